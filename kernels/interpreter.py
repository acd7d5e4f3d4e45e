"""Triton's CPU interpreter (TRITON_INTERPRET=1): whether it runs, and the fix our kernels need of it."""
import os

# Read once, at import: it also decides whether @triton.jit builds interpreted functions.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def fix_loop_bounds() -> None:
    """Let interpreted kernels loop to run-time bounds: Triton 3.6's interpreter gives its 1-element
    scalar arrays `__index__ = int(array)`, which NumPy >= 2.4 refuses; convert the single element."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_index_fixed", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._index_fixed = True
    interpreter._patch_lang_tensor = patch


if INTERPRET:
    fix_loop_bounds()
