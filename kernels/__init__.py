"""TTT kernels: fused attention and loss in Triton (`ttt_attention`, `ttt_attention_mla`, `ttt_loss`, `ttt_loss_steps`,
imported on first use: the references run without Triton) and their pure-torch ground truth (`*_reference`)."""
import importlib

from kernels.reference import ttt_attention as ttt_attention_reference
from kernels.reference import ttt_loss as ttt_loss_reference
from kernels.reference import ttt_loss_steps as ttt_loss_steps_reference

_TRITON = {"ttt_attention": "kernels.ttt_attention", "ttt_attention_mla": "kernels.mla_attention",
           "ttt_loss": "kernels.ttt_loss", "ttt_loss_steps": "kernels.ttt_loss"}

__all__ = [*_TRITON, "ttt_attention_reference", "ttt_loss_reference", "ttt_loss_steps_reference"]


def __getattr__(name: str):
    if name in _TRITON:
        module = importlib.import_module(_TRITON[name])
        # importing the submodule bound its name here: the functions win, as with eager imports
        globals().update({n: getattr(module, n) for n, m in _TRITON.items() if m == _TRITON[name]})
        return globals()[name]
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
