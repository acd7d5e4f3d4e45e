"""TTT kernels (SPEC §8): fused attention and fused loss in Triton, with pure-torch references.

`ttt_attention`, `ttt_loss` and `ttt_loss_steps` are the Triton versions; the `*_reference`
names are the ground truth they are tested against (also what `train.kernels = "torch"` uses).
"""
from kernels.reference import ttt_attention as ttt_attention_reference
from kernels.reference import ttt_loss as ttt_loss_reference
from kernels.reference import ttt_loss_steps as ttt_loss_steps_reference
from kernels.ttt_attention import ttt_attention
from kernels.ttt_loss import ttt_loss, ttt_loss_steps

__all__ = ["ttt_attention", "ttt_loss", "ttt_loss_steps", "ttt_attention_reference",
           "ttt_loss_reference", "ttt_loss_steps_reference"]
