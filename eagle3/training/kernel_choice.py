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
    """debug.kernels: Triton ("auto" on CUDA; a head dim the Triton attention does not serve keeps flex attention) or
    torch (`kernels.flex` on CUDA, the reference on the CPU); then train.float8_head. `say`: rank 0."""
    choice = cfg.debug.kernels
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        from eagle3.kernels.ttt_loss import ttt_loss_steps as plain
        ttt_attention = _triton_attention(cfg, spec, choice == "triton", say)
    elif device.type == "cuda":
        from eagle3.kernels.flex import ttt_loss_steps as plain
        ttt_attention = _flex_attention(spec, say)
    else:
        from eagle3.kernels.reference import ttt_attention, ttt_loss_steps as plain
    loss_steps = float8.head_loss(cfg.train.float8_head, draft_float8, plain, device, spec, cfg.source, say,
                                  cfg.train.batch_tokens, agree)
    return Kernels(ttt_attention, loss_steps, loss_steps is not plain)


def _triton_attention(cfg: Config, spec, forced: bool, say: bool) -> Callable:
    """The Triton TTT attention for the draft's heads (MLA: the unpadded kernel at its nope, rope and v widths), else
    flex attention with a note (`forced`, debug.kernels = "triton": an error naming the setting)."""
    if spec.attention == "mla":
        from eagle3.kernels.mla_attention import DIMS
        widths = (spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim)
        if all(w in DIMS for w in widths):
            from eagle3.kernels.mla_attention import ttt_attention_mla
            return ttt_attention_mla
        need, setting = f"the MLA draft's nope, rope and v head dims in {DIMS}, got {widths}", "experimental.mla_dims"
    elif spec.head_dim in TRITON_HEAD_DIMS:
        from eagle3.kernels.ttt_attention import ttt_attention
        return ttt_attention
    else:
        need, setting = f"draft.head_dim in {TRITON_HEAD_DIMS}, got {spec.head_dim}", "draft.head_dim"
    if forced:
        raise TrainError(f"{cfg.source}: debug.kernels = \"triton\" needs {need}; set debug.kernels = \"auto\" or "
                         f"\"torch\", or {setting}")
    if say:
        print(f"note: the Triton attention needs {need}; using flex_attention", file=sys.stderr)
    return _flex_attention(spec, say)


FLEX_MIN_HEAD_DIM = 16   # torch's flex_attention lowering refuses narrower q/k/v heads


def _flex_attention(spec, say: bool) -> Callable:
    """Compiled flex attention, or the eager reference for heads narrower than flex compiles (tiny drafts)."""
    dims = ((spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim) if spec.attention == "mla"
            else (spec.head_dim,))
    if min(dims) >= FLEX_MIN_HEAD_DIM:
        from eagle3.kernels.flex import ttt_attention
        return ttt_attention
    if say:
        print(f"note: flex_attention needs head dims of at least {FLEX_MIN_HEAD_DIM}, got {min(dims)}; using the "
              "eager reference attention", file=sys.stderr)
    from eagle3.kernels.reference import ttt_attention
    return ttt_attention
