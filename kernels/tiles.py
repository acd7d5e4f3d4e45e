"""Which tile configurations a Triton kernel's autotuner tries, by GPU family.

What decides a family is the shared memory one block may use (the tiles of every pipeline stage
live there): 227 KB on Hopper (sm_90) and datacenter Blackwell (sm_100, sm_103), 163 KB on A100
(sm_80) and Jetson Orin (sm_87), about 99 KB on consumer Ampere, Ada and Blackwell (sm_86, sm_89,
sm_120/121), less on older GPUs (64 KB on Turing) and on AMD GPUs (64 KB of LDS), which get the
"small" lists too. A kernel lists its candidates per family ("large", "a100", "small"), each list
ending with a fallback that fits every GPU; its autotuner gets all of them and `pruner` keeps the
family's, in its order, at tuning time, from the device of the kernel's tensor arguments. Triton's
autotuner still skips a config a device turns out unable to run (out of resources), so a list that
guesses a little high costs compile time, not a failure. Only the "large" lists were timed (on an
H200); `python -m eagle3.bench tiles` builds every list for every GPU of its family (no GPU needed)
and checks each block's shared memory against that GPU's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

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
    if set(lists) != set(FAMILIES):
        raise ValueError(f"tile lists for {sorted(lists)}, expected one per family {FAMILIES}")
    return list(dict.fromkeys(c for name in FAMILIES for c in lists[name]))


def as_tuple(config, keys: tuple[str, ...]) -> tuple:
    """A triton.Config as the lists' tuples: its `keys` kwargs, then warps and stages."""
    return (*(config.kwargs[k] for k in keys), config.num_warps, config.num_stages)


def pruner(lists: dict[str, list[tuple]], keys: tuple[str, ...]) -> Callable:
    """An `early_config_prune` for triton.autotune: of its configs, the ones in `lists` for the GPU
    the kernel runs on, in that list's order (its tensors are passed positionally)."""
    def prune(configs, named_args, **kwargs):
        device = next(a.device for a in named_args.values() if isinstance(a, torch.Tensor))
        by_tuple = {as_tuple(c, keys): c for c in configs}
        wanted = lists[family(torch.cuda.get_device_capability(device), torch.version.hip is not None)]
        return [by_tuple[t] for t in wanted if t in by_tuple]
    return prune
