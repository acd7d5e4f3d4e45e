"""Files read and written safely: JSON and safetensors whose errors name the file, writes that appear whole
or not at all, strict JSON out, output modes that follow the umask, one run per output directory."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

os.umask(_umask := os.umask(0))   # reading the umask means setting it: once, at import
FILE_MODE = 0o666 & ~_umask       # what open() gives a new file (safetensors' save_file writes 0600)


def read_json(path: Path, error: type[Exception], missing: str, corrupt: str = "") -> object:
    """The JSON in `path`; `error` naming the file when it is absent or corrupt (with the matching hint)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{path}: not found ({missing})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}){'; ' + corrupt if corrupt else ''}") from None


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temporary name and rename: a killed writer leaves the old file or none."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def make_readable(path: Path) -> None:
    """The mode of any file this user creates, so that a server running as another user can read it."""
    os.chmod(path, FILE_MODE)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def strict_json(value, **kwargs) -> str:
    """json.dumps with NaN and inf as null: Python would write NaN, which strict parsers reject."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def open_safetensors(path: Path, error: type[Exception], hint: str):
    """safe_open(path); `error` naming the file when it is missing, truncated or not safetensors."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError) as e:
        raise error(f"{path}: not a readable safetensors file ({e}); {hint}") from None


def writable_dir(path: Path, error: type[Exception], key: str) -> Path:
    """Create `path` and check that files can be written there: an error at start-up, not at the first write."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise error(f"{path}: cannot write there ({e.strerror or e}); fix its permissions or choose "
                    f"another {key}") from None
    return path


def tensor_bytes(value) -> int:
    """Bytes of every tensor in `value` (nested dicts, lists and tuples)."""
    import torch
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of `path` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def short_of_space(directory: Path, need: int, what: str) -> str | None:
    """None when `directory` has room for `need` bytes; else the sentence that says it has not."""
    free = free_bytes(directory)
    if free >= need:
        return None
    return (f"{directory}: not enough free space to write {what}: it needs about {need} bytes "
            f"({need / 2**30:.2f} GiB), {free} bytes ({free / 2**30:.2f} GiB) are free")


_HELD: dict[str, object] = {}   # lock files of the runs this process holds


def _release(f) -> None:
    """Leave the lock file empty (only a killed run leaves its name) and let it go."""
    f.seek(0)
    f.truncate()
    f.close()


@contextlib.contextmanager
def run_lock(directory: Path, key: str, what: str, error: type[Exception], held: bool = True,
             of: Path | None = None):
    """Own `directory` while the block runs (unless not `held`) by an advisory lock on `directory/.lock`, which the
    kernel releases however the process ends: a second run meets `error` naming the holder. `of`: own only that
    file of `directory` (the lock `.<name>.lock` beside it)."""
    if not held:
        yield
        return
    path = Path(directory).absolute() / (f".{of.name}.lock" if of else ".lock")
    made = not path.parent.exists()
    _take(path, of or directory, key, what, error)
    try:
        yield
    finally:
        if (f := _HELD.pop(str(path), None)) is not None:
            _release(f)
        if made and [p.name for p in path.parent.iterdir()] == [path.name]:   # a run that wrote nothing
            path.unlink()
            path.parent.rmdir()


def relock(directory: Path, key: str, what: str, error: type[Exception]) -> None:
    """After this process moved `directory` aside (its lock file with it) and made it anew: lock the new one."""
    path = Path(directory).absolute() / ".lock"
    if (f := _HELD.pop(str(path), None)) is not None:
        _release(f)
        _take(path, directory, key, what, error)


def _take(path: Path, owned: Path, key: str, what: str, error: type[Exception]) -> None:
    """Lock `path` for the run that owns `owned` (what the messages name)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError as e:
        raise error(f"{owned}: cannot write there ({e.strerror}); choose another {key}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not written its name yet"
        f.close()
        raise error(f"{owned}: in use by another run ({holder}); wait for it to end, or choose another "
                    f"{key}") from None
    f.seek(0)
    if before := f.read().strip():
        print(f"note: {owned}: taking over the lock of a run that ended without releasing it ({before})")
    f.seek(0)
    f.truncate()
    f.write(f"{what} on host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    f.flush()
    _HELD[str(path)] = f


def sha256_file(path: str | Path) -> str:
    """The file's SHA-256, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
