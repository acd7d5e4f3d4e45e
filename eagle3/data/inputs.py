"""Training conversations as token ids and loss masks from JSON lines (pre-tokenized or chat); a bad line is fatal
or skipped (`data.on_error`) and counted in the manifest, never dropped silently (docs/data.md)."""
from __future__ import annotations

import codecs
import functools
import json
import multiprocessing
import sys
from collections.abc import Callable, Iterator
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eagle3.data.chat import CATEGORIES, count_kinds
from eagle3.errors import InputError


@dataclass
class Record:
    line: int                  # 1-based line number in the input file
    input_ids: np.ndarray      # int32 [n]
    loss_mask: np.ndarray      # uint8 [n]
    part: int = 0              # the sequence's index among its line's (a chat line may give several)


@dataclass
class ChatStats:
    """What the chat lines trained, and what they cost (docs/data.md); `unrendered` and `ignored` count lines."""
    lines: int = 0
    replies: int = 0
    sequences: int = 0
    split_lines: int = 0       # lines given as more than one sequence: the template rewrites their history
    repeated_tokens: int = 0   # context tokens rendered again in a later sequence of the same line
    empty_thoughts: int = 0    # replies without reasoning where the template opens one
    dropped_parts: int = 0     # sequences left with nothing to train by data.max_seq_len
    trained: Counter = field(default_factory=Counter)      # loss tokens: reasoning / content / tool_calls
    unrendered: Counter = field(default_factory=Counter)   # field -> lines whose field the template leaves out
    ignored: Counter = field(default_factory=Counter)      # key -> lines carrying a key no engine reads
    first_line: dict = field(default_factory=dict)         # field or key -> the first line carrying it

    def add(self, line: int, encoded, kinds: list[np.ndarray]) -> None:
        """A chat line's `encoded` sequences, whose `kinds` are what is left of them to train (after truncation)."""
        self.lines += 1
        self.replies += encoded.replies
        self.empty_thoughts += encoded.empty_thoughts
        self.sequences += len(kinds)
        self.split_lines += len(kinds) > 1
        self.repeated_tokens += encoded.repeated
        self.trained.update(count_kinds(kinds))
        for counter, fields in ((self.unrendered, encoded.unrendered), (self.ignored, encoded.ignored)):
            counter.update(fields)
            for name in fields:
                self.first_line.setdefault(name, line)

    def summary(self) -> dict:
        return {"lines": self.lines, "replies": self.replies, "sequences": self.sequences, "split_lines": self.split_lines,
                "repeated_tokens": self.repeated_tokens, "trained_tokens": {k: self.trained[k] for k in CATEGORIES},
                "empty_thoughts": self.empty_thoughts, "dropped_parts": self.dropped_parts,
                "fields_not_rendered": dict(self.unrendered), "keys_ignored": dict(self.ignored)}

    def describe(self) -> str:
        """One line: the trained tokens by category, and the cost of the lines split into several sequences."""
        trained = ", ".join(f"{k.replace('_', ' ')} {self.trained[k]:,}" for k in CATEGORIES)
        return (f"{self.lines:,} chat lines, {self.replies:,} replies trained: {trained} tokens; "
                f"{self.split_lines:,} lines in {self.sequences - self.lines + self.split_lines:,} sequences "
                f"(their template rewrites earlier turns), {self.repeated_tokens:,} context tokens rendered again")

    def warnings(self, path: Path) -> list[str]:
        """One line per field of the data that is not trained or not read, with the lines it affects."""
        def lines(name: str, n: int) -> str:
            verb = "carries" if n == 1 else "carry"
            return f"{path}: {n} chat line{'s' * (n != 1)} {verb} {name}"
        first = {name: f"(first: {path}:{line})" for name, line in self.first_line.items()}
        return ([f"{lines(name, n)} that the chat template does not render {first[name]}: not in the training text"
                 for name, n in sorted(self.unrendered.items())] +
                [f"{lines(repr(name), n)}, which neither vLLM nor SGLang passes to the template {first[name]}: ignored"
                 for name, n in sorted(self.ignored.items())] +
                [f"{path}: {self.empty_thoughts} replies have no reasoning where the chat template opens one: trained "
                 "as an empty thought (`</think>` at once), not as the model thinks when served"] * bool(self.empty_thoughts) +
                [f"{path}: {self.dropped_parts} sequences of chat lines split by their template kept nothing to train "
                 "within data.max_seq_len: not extracted"] * bool(self.dropped_parts))


@dataclass
class InputStats:
    lines: int = 0
    sequences: int = 0
    skipped: int = 0
    truncated: int = 0
    skipped_lines: list[int] = field(default_factory=list)
    chat: ChatStats = field(default_factory=ChatStats)


CHAT_KEYS = ("messages", "conversations")


def is_chat(obj: object) -> bool:
    # ids given with the conversation win: they need no tokenizer and are what the user chose
    return isinstance(obj, dict) and "input_ids" not in obj and any(key in obj for key in CHAT_KEYS)


def chat_encoder(target_dir: str | Path | None, template_kwargs: dict | None = None) -> Callable:
    """A function giving the target's ChatEncoder, loaded at its first call (its optional packages only for chat);
    `template_kwargs`: `data.chat_template_kwargs`, what a line's own `chat_template_kwargs` add to."""
    @functools.cache
    def encoder():
        if target_dir is None:
            raise InputError("chat lines need the target's tokenizer and chat template; no target "
                             "directory was given")
        from eagle3.data.chat import ChatEncoder
        return ChatEncoder(target_dir, template_kwargs)
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


def _line(number: int, raw: bytes, vocab_size: int, chat: Callable, regenerating: bool) -> tuple:
    """One line: ("ok", [(ids, mask, kinds or None)], the chat line's Encoded or None), ("bad", why) for a line that
    cannot be used, or ("fatal", why) for a tokenizer or template that cannot be (every chat line would fail)."""
    try:
        obj = json.loads(utf8(raw))
        if not is_chat(obj):
            return "ok", [(*_parse_tokens(obj, vocab_size), None)], None
        encoded = chat().encode(obj, regenerating)
        for ids, _ in encoded.sequences:
            if len(ids) < 2:
                raise ValueError(f"conversation of {len(ids)} tokens; at least 2 are needed")
            check_chat_ids(ids, vocab_size)
        return "ok", [(ids, mask, kinds) for (ids, mask), kinds in zip(encoded.sequences, encoded.kinds)], encoded
    except InputError as e:
        return "fatal", str(e)
    except Exception as e:   # noqa: BLE001 - any failure of one line (JSON, bytes, template) is that line's
        return "bad", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


_POOL_JOB: tuple = ()   # (vocab_size, chat, regenerating) of the pool being forked: its workers read it


def _pool_line(job: tuple[int, bytes]) -> tuple:
    return _line(*job, *_POOL_JOB)


def _parsed(path: Path, vocab_size: int, chat: Callable, regenerating: bool, workers: int):
    """(number, _line's answer) of each line, in order; chat lines rendered by `workers` forked processes when the
    file is long enough to pay for them (rendering is Python: one core per process)."""
    global _POOL_JOB
    jobs = json_lines(path, "data.path")
    if workers <= 1 or sys.platform != "linux" or path.stat().st_size < POOL_BYTES:
        yield from ((number, _line(number, raw, vocab_size, chat, regenerating)) for number, raw in jobs)
        return
    _POOL_JOB = (vocab_size, chat, regenerating)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        numbered = list(jobs)
        yield from zip((n for n, _ in numbered), pool.imap(_pool_line, numbered, chunksize=16))


POOL_BYTES = 4 << 20   # smaller data files are read in the calling process


def read_records(path: str | Path, vocab_size: int, max_seq_len: int, on_error: str = "fatal",
                 target_dir: str | Path | None = None, template_kwargs: dict | None = None,
                 regenerating: bool = False, workers: int = 1, report: bool = True) -> tuple[list[Record], InputStats]:
    """`target_dir` holds the tokenizer and chat template, `template_kwargs` the default `chat_template_kwargs`;
    only chat lines need them. `regenerating`: the replies are to be regenerated (ChatEncoder.encode). `workers`:
    processes rendering chat lines. `report`: print the warnings about the data's fields (one rank of several)."""
    path = Path(path)
    records, stats, chat = [], InputStats(), chat_encoder(target_dir, template_kwargs)
    for number, (status, *answer) in _parsed(path, vocab_size, chat, regenerating, workers):
        stats.lines += 1
        if status == "fatal":
            raise InputError(f"{path}:{number}: {answer[0]}")
        if status == "bad":
            message = f"{path}:{number}: {answer[0]}"
            if on_error == "fatal":
                raise InputError(message + " (set data.on_error = \"skip\" to skip such lines)")
            print(f"warning: skipped {message}", file=sys.stderr)
            stats.skipped += 1
            stats.skipped_lines.append(number)
            continue
        sequences, encoded = answer
        kept = []
        for ids, mask, kinds in sequences:
            if len(ids) > max_seq_len:
                ids, mask, kinds = ids[:max_seq_len], mask[:max_seq_len], kinds if kinds is None else kinds[:max_seq_len]
                stats.truncated += 1
                if encoded is not None and not mask.any():   # a later part of a split line: its context alone
                    stats.chat.dropped_parts += 1
                    continue
            kept.append((ids, mask, kinds))
        if encoded is not None:
            stats.chat.add(number, encoded, [k for _, _, k in kept])
        records += [Record(number, ids, mask, part) for part, (ids, mask, _) in enumerate(kept)]
    stats.sequences = len(records)
    if not records:
        raise InputError(f"{path}: no usable sequences")
    for warning in stats.chat.warnings(path) if report else []:
        print(f"warning: {warning}", file=sys.stderr)
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
