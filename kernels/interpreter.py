"""Triton's CPU interpreter (TRITON_INTERPRET=1): what our kernels need of it that it lacks."""
from __future__ import annotations


def fix_loop_bounds() -> None:
    """Let interpreted kernels loop to run-time bounds (`for n0 in range(0, m0, BLOCK_N)`).

    Triton 3.6's interpreter holds scalars as 1-element arrays and gives them `__index__ = int(array)`,
    which NumPy >= 2.4 refuses for arrays that are not 0-d. Convert through the single element
    instead. Only installed under TRITON_INTERPRET=1; harmless for other interpreted kernels.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_index_fixed", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._index_fixed = True
    interpreter._patch_lang_tensor = patch
