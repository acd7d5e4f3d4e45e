"""Which kernels a run trains with (debug.kernels: the TTT attention and the loss over all steps) and
whether the loss's lm_head GEMMs run in fp8 (train.float8_head): chosen once at start-up."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from eagle3 import float8
from eagle3.config import Config
from eagle3.errors import TrainError

TRITON_HEAD_DIMS = (64, 128)


def select_kernels(choice: str, device: torch.device, head_dim: int, where: str = "config"):
    """(attention, loss over all steps) with the signatures of kernels/reference.py: Triton, or torch (on CUDA the
    established recipe of `kernels.flex`, on the CPU the reference). "auto" takes Triton on CUDA;
    the Triton attention serves head dims 64 and 128 only, so another head dim keeps flex
    attention under "auto" and is an error under "triton"."""
    use_triton = choice == "triton" or (choice == "auto" and device.type == "cuda")
    if not use_triton and device.type == "cuda":   # the established recipe: flex + compiled loss
        from kernels.flex import ttt_attention, ttt_loss_steps
        return ttt_attention, ttt_loss_steps
    if not use_triton:
        from kernels.reference import ttt_attention, ttt_loss_steps
        return ttt_attention, ttt_loss_steps
    from kernels import ttt_attention, ttt_loss_steps
    if head_dim not in TRITON_HEAD_DIMS:
        if choice == "triton":
            raise TrainError(f"{where}: debug.kernels = \"triton\" needs draft.head_dim in {TRITON_HEAD_DIMS}, "
                             f"got {head_dim}; set debug.kernels = \"auto\" or \"torch\", or draft.head_dim")
        print(f"note: draft.head_dim = {head_dim} is not served by the Triton attention "
              f"{TRITON_HEAD_DIMS}; using flex_attention", file=sys.stderr)
        from kernels.flex import ttt_attention
    return ttt_attention, ttt_loss_steps


@dataclasses.dataclass(frozen=True)
class Kernels:
    attention: Callable     # the signature of kernels.reference.ttt_attention
    loss_steps: Callable    # of kernels.reference.ttt_loss_steps
    float8_head: bool       # whether loss_steps runs the lm_head GEMMs in fp8 (train.float8_head resolved)


def choose(cfg: Config, device: torch.device, spec, draft_float8: bool, say: bool = True) -> Kernels:
    """debug.kernels and train.float8_head for a run on `device` of the draft `spec` (`draft_float8`:
    train.float8 resolved); `say`: print the auto choices (rank 0)."""
    attention, plain = select_kernels(cfg.debug.kernels, device, spec.head_dim, cfg.source)
    loss_steps = float8.head_loss(cfg.train.float8_head, draft_float8, plain, device, spec, cfg.source, say=say)
    return Kernels(attention, loss_steps, loss_steps is not plain)
