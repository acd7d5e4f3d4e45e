"""Which kernels a run trains with (debug.kernels) and whether its head GEMMs run in fp8 (train.float8_head)."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from eagle3 import float8
from eagle3.config import Config
from eagle3.errors import TrainError

TRITON_HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class Kernels:
    attention: Callable     # the signature of kernels.reference.ttt_attention
    loss_steps: Callable    # of kernels.reference.ttt_loss_steps
    float8_head: bool       # whether loss_steps runs the lm_head GEMMs in fp8 (train.float8_head resolved)


def choose(cfg: Config, device: torch.device, spec, draft_float8: bool, say: bool = True, agree=bool) -> Kernels:
    """debug.kernels: Triton ("auto" on CUDA; a head dim outside TRITON_HEAD_DIMS keeps flex attention) or
    torch (`kernels.flex` on CUDA, the reference on the CPU); then train.float8_head. `say`: rank 0."""
    choice, head_dim = cfg.debug.kernels, spec.kernel_head_dim()
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        from eagle3.kernels.ttt_loss import ttt_loss_steps as plain
        if head_dim in TRITON_HEAD_DIMS:
            from eagle3.kernels.ttt_attention import ttt_attention
        elif choice == "triton":
            raise TrainError(f"{cfg.source}: debug.kernels = \"triton\" needs draft.head_dim in {TRITON_HEAD_DIMS}, "
                             f"got {head_dim}; set debug.kernels = \"auto\" or \"torch\", or draft.head_dim")
        else:
            print(f"note: draft.head_dim = {head_dim} is not served by the Triton attention "
                  f"{TRITON_HEAD_DIMS}; using flex_attention", file=sys.stderr)
            from eagle3.kernels.flex import ttt_attention
    elif device.type == "cuda":
        from eagle3.kernels.flex import ttt_attention, ttt_loss_steps as plain
    else:
        from eagle3.kernels.reference import ttt_attention, ttt_loss_steps as plain
    loss_steps = float8.head_loss(cfg.train.float8_head, draft_float8, plain, device, spec, cfg.source, say,
                                  cfg.train.batch_tokens, agree)
    return Kernels(ttt_attention, loss_steps, loss_steps is not plain)
