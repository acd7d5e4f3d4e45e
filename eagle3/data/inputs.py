"""Training conversations as token ids and loss masks from JSON lines (pre-tokenized or chat); a bad line is fatal
or skipped (`data.on_error`) and counted in the manifest, never dropped silently (docs/data.md)."""
from __future__ import annotations

import codecs
import functools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eagle3.errors import InputError


@dataclass
class Record:
    line: int                  # 1-based line number in the input file
    input_ids: np.ndarray      # int32 [n]
    loss_mask: np.ndarray      # uint8 [n]


@dataclass
class InputStats:
    lines: int = 0
    sequences: int = 0
    skipped: int = 0
    truncated: int = 0
    skipped_lines: list[int] = field(default_factory=list)


CHAT_KEYS = ("messages", "conversations")


def is_chat(obj: object) -> bool:
    # ids given with the conversation win: they need no tokenizer and are what the user chose
    return isinstance(obj, dict) and "input_ids" not in obj and any(key in obj for key in CHAT_KEYS)


def chat_encoder(target_dir: str | Path | None) -> Callable:
    """A function giving the target's ChatEncoder, loaded at its first call (its optional packages only for chat)."""
    @functools.cache
    def encoder():
        if target_dir is None:
            raise InputError("chat lines need the target's tokenizer and chat template; no target "
                             "directory was given")
        from eagle3.data.chat import ChatEncoder
        return ChatEncoder(target_dir)
    return encoder


def check_chat_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    if len(ids) and ids.max() >= vocab_size:
        raise ValueError(f"token id {int(ids.max())} >= the target's vocab_size {vocab_size}: "
                         "the tokenizer files do not match the target")
    return ids


def _parse_tokens(obj: object, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(obj, dict) or "input_ids" not in obj or "loss_mask" not in obj:
        raise ValueError("expected an object with 'input_ids' and 'loss_mask' (pre-tokenized), "
                         "'messages' or 'conversations' (chat)")
    ids, mask = obj["input_ids"], obj["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise ValueError("'input_ids' and 'loss_mask' must be lists of equal length")
    if len(ids) < 2:
        raise ValueError(f"sequence of {len(ids)} tokens; at least 2 are needed")
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"'input_ids' must be integers in [0, {vocab_size})")
    if not all(m in (0, 1) for m in mask):
        raise ValueError("'loss_mask' must hold only 0 and 1")
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def read_records(path: str | Path, vocab_size: int, max_seq_len: int, on_error: str = "fatal",
                 target_dir: str | Path | None = None) -> tuple[list[Record], InputStats]:
    """`target_dir` holds the tokenizer and chat template; only chat lines need it."""
    path = Path(path)
    records, stats, chat = [], InputStats(), chat_encoder(target_dir)
    for number, raw in json_lines(path, "data.path"):
        stats.lines += 1
        try:
            obj = json.loads(utf8(raw))
            ids, mask = chat().encode(obj) if is_chat(obj) else _parse_tokens(obj, vocab_size)
            if len(ids) < 2:   # a chat line's (_parse_tokens checks a pre-tokenized one's)
                raise ValueError(f"conversation of {len(ids)} tokens; at least 2 are needed")
            check_chat_ids(ids, vocab_size)
        except InputError as e:  # the tokenizer or template is unusable: every chat line would fail
            raise InputError(f"{path}:{number}: {e}") from None
        except Exception as e:   # noqa: BLE001 - any failure of one line (JSON, bytes, template) is that line's
            message = f"{path}:{number}: {e if isinstance(e, ValueError) else f'{type(e).__name__}: {e}'}"
            if on_error == "fatal":
                raise InputError(message + " (set data.on_error = \"skip\" to skip such lines)") from None
            print(f"warning: skipped {message}", file=sys.stderr)
            stats.skipped += 1
            stats.skipped_lines.append(number)
            continue
        if len(ids) > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            stats.truncated += 1
        records.append(Record(number, ids, mask))
    stats.sequences = len(records)
    if not records:
        raise InputError(f"{path}: no usable sequences")
    return records, stats


def json_lines(path: Path, key: str) -> Iterator[tuple[int, bytes]]:
    """(number, bytes) of each non-blank line of the JSON-lines file config key `key` names; a clear error
    for one that is missing or no regular file (a directory, a FIFO)."""
    if not path.exists():
        raise InputError(f"{path}: file not found ({key})")
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise InputError(f"{path}: {kind}; {key} must name a JSON-lines file")
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1:   # a UTF-8 byte order mark, as some editors write one, is no part of the first line
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if raw.strip():
                yield number, raw


def utf8(raw: bytes) -> str:
    """One line's bytes as text; a ValueError naming the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
