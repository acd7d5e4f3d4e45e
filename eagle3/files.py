"""Files read and written safely: JSON whose errors name the file, writes that appear whole or not at all."""
from __future__ import annotations

import json
import os
from pathlib import Path


def read_json(path: Path, error: type[Exception], missing: str) -> object:
    """The JSON in `path`; `error` naming the file when it is absent (with the `missing` hint) or corrupt."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{path}: not found ({missing})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temporary name and rename: a killed writer leaves the old file or none."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
