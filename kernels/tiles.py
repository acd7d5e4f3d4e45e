"""Which tilings a Triton autotuner tries, by GPU family of shared memory per block: "large" 227 KB (sm_90, sm_100/103),
"a100" 163 KB (sm_80, sm_87), "small" 99 KB or less (others, ROCm); `python -m benchmarks.tiles` checks them."""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton

FAMILIES = ("large", "a100", "small")


def family(capability: tuple[int, int], hip: bool = False) -> str:
    """The tile family of a CUDA compute capability (major, minor); every ROCm GPU is "small"."""
    if hip:
        return "small"
    if capability[0] in (9, 10):
        return "large"
    if capability in ((8, 0), (8, 7)):
        return "a100"
    return "small"


def union(lists: dict[str, list[tuple]]) -> list[tuple]:
    """Every family's candidates once, in the order first listed (the autotuner's config list)."""
    return list(dict.fromkeys(c for name in FAMILIES for c in lists[name]))


def as_tuple(config, keys: tuple[str, ...]) -> tuple:
    """A triton.Config as the lists' tuples: its `keys` kwargs, then warps and stages."""
    return (*(config.kwargs[k] for k in keys), config.num_warps, config.num_stages)


def pruner(lists: dict[str, list[tuple]], keys: tuple[str, ...]) -> Callable:
    """An `early_config_prune` keeping, in order, the configs `lists` holds for the GPU of the kernel's tensors."""
    def prune(configs, named_args, **kwargs):
        device = next(a.device for a in named_args.values() if isinstance(a, torch.Tensor))
        by_tuple = {as_tuple(c, keys): c for c in configs}
        wanted = lists[family(torch.cuda.get_device_capability(device), torch.version.hip is not None)]
        return [by_tuple[t] for t in wanted if t in by_tuple]
    return prune


def autotuned(kernel, lists: dict[str, list[tuple]], key: list[str], pre_hook: Callable | None = None):
    """`kernel` autotuned over every family's (BLOCK_M, BLOCK_N, warps, stages) of `lists`, pruned to the running GPU's
    at tuning time, one tuning per value of the `key` arguments."""
    return triton.autotune(configs=[triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s,
                                                  pre_hook=pre_hook) for m, n, w, s in union(lists)], key=key,
                           prune_configs_by={"early_config_prune": pruner(lists, ("BLOCK_M", "BLOCK_N"))})(kernel)
