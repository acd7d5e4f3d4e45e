"""Which tile configurations a Triton kernel's autotuner tries, by GPU family.

What decides a family is the shared memory one block may use (the tiles of every pipeline stage
live there): 227 KB on Hopper (sm_90) and datacenter Blackwell (sm_100, sm_103), 163 KB on A100
(sm_80), about 99 KB on consumer Ampere, Ada and Blackwell (sm_86, sm_89, sm_120) and older GPUs.
A kernel lists its candidates per family ("large", "a100", "small"), each list ending with a
fallback that fits every GPU; its autotuner gets all of them and `pruner` keeps the family's at
tuning time, from the device of the kernel's tensor arguments. Triton's autotuner still skips a
config a device turns out unable to run (out of resources), so a list that guesses a little
high costs compile time, not a failure. Only the "large" lists were measured (on an H200).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

FAMILIES = ("large", "a100", "small")


def family(capability: tuple[int, int]) -> str:
    """The tile family of a CUDA compute capability (major, minor)."""
    major, minor = capability
    if major in (9, 10):
        return "large"
    if (major, minor) == (8, 0):
        return "a100"
    return "small"


def union(lists: dict[str, list[tuple]]) -> list[tuple]:
    """Every family's candidates once, in the order first listed (the autotuner's config list)."""
    if set(lists) != set(FAMILIES):
        raise ValueError(f"tile lists for {sorted(lists)}, expected one per family {FAMILIES}")
    return list(dict.fromkeys(c for name in FAMILIES for c in lists[name]))


def pruner(lists: dict[str, list[tuple]], as_tuple: Callable) -> Callable:
    """An `early_config_prune` for triton.autotune: of its configs, the ones in `lists` for the GPU
    the kernel runs on (`as_tuple` turns a triton.Config into the lists' tuples)."""
    def prune(configs, named_args, **kwargs):
        device = next(a.device for a in named_args.values() if isinstance(a, torch.Tensor))
        wanted = set(lists[family(torch.cuda.get_device_capability(device))])
        return [c for c in configs if as_tuple(c) in wanted]
    return prune
