"""The one timer of the benches, and what they share: `median_ms` times GPU work (do_bench's median, L2 flushed;
the host clock on a CPU), `wall_s` work with host steps in it, `peak_bytes` the memory GPU work adds."""
from __future__ import annotations

import datetime
import gc
import json
import statistics
import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def median_ms(fn: Callable[[], object], warmup: float = 25, rep: float = 100) -> float:
    """Median ms of one fn() after `warmup` ms of warm-up calls, over `rep` ms of calls (at least one each)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    fn()
    estimate = max(elapsed_ms(lambda: [fn() for _ in range(5)]) / 5, 1e-6)
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    return statistics.median(elapsed_ms(fn) for _ in range(max(1, int(rep / estimate))))


def median_ms_of_calls(fn: Callable[[], object], calls: int, warmup_calls: int = 1) -> float:
    """`median_ms` over `calls` calls after `warmup_calls`, the budgets taken from one timed call."""
    fn()                               # compile / autotune / allocate outside the estimate
    once = elapsed_ms(fn)
    # half a call of slack: the budgets are divided by an estimate that includes the L2 flush, rounded down
    return median_ms(fn, warmup=warmup_calls * once, rep=(calls + 0.5) * once)


def elapsed_ms(fn: Callable[[], object]) -> float:
    """Ms of one fn(): CUDA events on the GPU (the host returns before the GPU is done), else the host clock."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def wall_s(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, fn()) on the host clock, queued GPU work finished before and after (no CUDA context made)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def peak_bytes(fn: Callable[[], T]) -> tuple[int, T]:
    """(peak bytes allocated during fn() above what was allocated before it, fn())."""
    free_memory()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def free_memory() -> None:
    """Drop what earlier work left: tensors in reference cycles, the allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def matmul_tflops() -> float:
    """The bf16 matmul rate of this GPU (8192^3), measured now: the floor and MFU of the benches."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192 ** 3 / median_ms(lambda: a @ b, warmup=100, rep=500) / 1e9


def describe_device() -> str:
    """Today's date, the GPU (or the CPU) and the versions: the first line of a bench's output."""
    import triton
    device = "cpu"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.multi_processor_count} SMs)"
    return f"{datetime.date.today()} {device}, torch {torch.__version__}, triton {triton.__version__}"


def append_json(path: str | None, rows: list[dict]) -> None:
    """Each row as one JSON line at the end of `path` (no path: nothing)."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def require_cuda(command: str, otherwise: str = "") -> None:
    """A GPU-only bench stops with a message on a machine without CUDA, not a traceback."""
    if not torch.cuda.is_available():
        raise SystemExit(f"error: python -m {command} needs a CUDA GPU{otherwise}")


def attempt(what: str, fn: Callable[..., T], *args) -> T | None:
    """fn(*args), or None after a line saying why: one failing contender (OOM, compile error) ends no run."""
    try:
        return fn(*args)
    except Exception as exc:
        print(f"{what} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return None


def shape_labels(text: str, every: list[str]) -> list[str]:
    """'a, c' -> ['a', 'c']; 'all' -> every."""
    return list(every) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]


def rel_error(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """|got - want| / |want| (L2), both in `dtype`."""
    want = want.to(dtype)
    return ((got.to(dtype) - want).norm() / want.norm()).item()
