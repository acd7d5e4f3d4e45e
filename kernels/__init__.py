"""TTT kernels: fused attention and fused loss (SPEC §8), with pure-torch references."""
from kernels.reference import ttt_attention as ttt_attention_reference
from kernels.reference import ttt_loss as ttt_loss_reference

__all__ = ["ttt_attention_reference", "ttt_loss_reference"]
