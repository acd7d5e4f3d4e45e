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
from eagle3.data.media import content_parts, place
from eagle3.errors import InputError
from eagle3.models.vision import MediaItem


@dataclass
class Record:
    line: int                  # 1-based line number in the input file
    input_ids: np.ndarray      # int32 [n]
    loss_mask: np.ndarray      # uint8 [n]
    part: int = 0              # the sequence's index among its line's (a chat line may give several)
    media: list[MediaItem] = field(default_factory=list)   # its images / video chunks, in order of their placeholders


LOST_SHARE = 0.05   # a larger share of the trained tokens cut off by data.max_seq_len is warned about loudly


def reply_spans(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of loss tokens in a mask: a sequence's replies."""
    edges = np.flatnonzero(np.diff(np.r_[0, np.asarray(mask) != 0, 0].astype(np.int8))).tolist()
    return list(zip(edges[0::2], edges[1::2]))


@dataclass
class ChatStats:
    """What the chat lines trained, and what they cost (docs/data.md); `unrendered`, `ignored` and `missing` count
    lines. Every chat line read counts, those dropped by data.max_seq_len too: replies = trained + lost."""
    lines: int = 0
    replies: int = 0
    replies_trained: int = 0   # replies with tokens left to train within data.max_seq_len
    replies_cut: int = 0       # of those, the ones cut short by it
    sequences: int = 0         # sequences extracted
    split_lines: int = 0       # lines given as more than one sequence: the template rewrites their history
    split_sequences: int = 0   # the sequences of those lines, before data.max_seq_len
    repeated_tokens: int = 0   # context tokens rendered again in a later sequence of the same line
    empty_thoughts: int = 0    # replies without reasoning where the template opens one
    dropped_parts: int = 0     # sequences of lines otherwise kept, left with nothing to train by data.max_seq_len
    trained: Counter = field(default_factory=Counter)      # loss tokens: reasoning / content / tool_calls
    lost: Counter = field(default_factory=Counter)         # loss tokens cut off by data.max_seq_len, by category
    unrendered: Counter = field(default_factory=Counter)   # field -> lines whose field the template leaves out
    ignored: Counter = field(default_factory=Counter)      # key -> lines carrying a key no engine reads
    missing: Counter = field(default_factory=Counter)      # field -> lines lacking a field the template renders
    first_line: dict = field(default_factory=dict)         # field or key -> the first line carrying it

    def add(self, line: int, encoded, kept: list[np.ndarray], cut: int) -> None:
        """A chat line's `encoded` sequences; `kept`: the kinds of those extracted (cut at data.max_seq_len, the ones
        left with nothing to train left out); `cut`: the replies cut short."""
        self.lines += 1
        self.replies += encoded.replies
        self.replies_trained += sum(len(reply_spans(k)) for k in kept)
        self.replies_cut += cut
        self.empty_thoughts += encoded.empty_thoughts
        self.sequences += len(kept)
        self.dropped_parts += (len(encoded.sequences) - len(kept)) * bool(kept)
        self.split_lines += len(encoded.sequences) > 1
        self.split_sequences += len(encoded.sequences) * (len(encoded.sequences) > 1)
        self.repeated_tokens += encoded.repeated
        trained = count_kinds(kept)
        self.trained.update(trained)
        self.lost.update({k: n - trained[k] for k, n in encoded.trained.items()})
        for counter, fields in ((self.unrendered, encoded.unrendered), (self.ignored, encoded.ignored),
                                (self.missing, encoded.missing)):
            counter.update(fields)
            for name in fields:
                self.first_line.setdefault(name, line)

    def summary(self) -> dict:
        return {"lines": self.lines, "replies": self.replies, "replies_trained": self.replies_trained,
                "replies_cut": self.replies_cut, "replies_lost": self.replies - self.replies_trained,
                "sequences": self.sequences, "split_lines": self.split_lines, "split_sequences": self.split_sequences,
                "repeated_tokens": self.repeated_tokens, "trained_tokens": {k: self.trained[k] for k in CATEGORIES},
                "lost_tokens": {k: self.lost[k] for k in CATEGORIES}, "empty_thoughts": self.empty_thoughts,
                "dropped_parts": self.dropped_parts, "fields_not_rendered": dict(self.unrendered),
                "keys_ignored": dict(self.ignored), "fields_missing": dict(self.missing)}

    def describe(self) -> str:
        """One line: the replies and the trained tokens by category, and the cost of the lines split into several
        sequences."""
        trained = ", ".join(f"{k.replace('_', ' ')} {self.trained[k]:,}" for k in CATEGORIES)
        return (f"{self.lines:,} chat lines, {self.replies:,} replies: {self.replies_trained:,} trained "
                f"({self.replies_cut:,} cut short by data.max_seq_len), {self.replies - self.replies_trained:,} lost "
                f"to it; trained tokens: {trained}; {self.split_lines:,} lines in {self.split_sequences:,} "
                f"sequences (their template rewrites earlier turns), {self.repeated_tokens:,} context tokens "
                "rendered again")

    def warnings(self, path: Path) -> list[str]:
        """One line per field of the data that is not trained, not read or missing, with the lines it affects."""
        def lines(name: str, n: int) -> str:
            verb = "carries" if n == 1 else "carry"
            return f"{path}: {n} chat line{'s' * (n != 1)} {verb} {name}"
        first = {name: f"(first: {path}:{line})" for name, line in self.first_line.items()}
        return ([f"{lines(name, n)} that the chat template does not render {first[name]}: not in the training text"
                 for name, n in sorted(self.unrendered.items())] +
                [f"{lines(repr(name), n)}, which neither vLLM nor SGLang passes to the template {first[name]}: ignored"
                 for name, n in sorted(self.ignored.items())] +
                [f"{path}: {n} chat line{'s' * (n != 1)} lack {name}, which the chat template renders {first[name]}: "
                 "trained with it empty, where the model writes one" for name, n in sorted(self.missing.items())] +
                [f"{path}: {self.empty_thoughts} replies have no reasoning where the chat template opens one: trained "
                 "as an empty thought (`</think>` at once), not as the model thinks when served"] * bool(self.empty_thoughts) +
                [f"{path}: {self.dropped_parts} sequences of chat lines split by their template kept nothing to train "
                 "within data.max_seq_len: not extracted"] * bool(self.dropped_parts))


MEDIA_COUNTS = ("images", "video_chunks", "media_tokens")
DROPPED = {"prompt": "the prompt before their first reply is longer than data.max_seq_len",
           "no_loss": "their loss_mask is all 0"}


@dataclass
class InputStats:
    """What the lines of data.path gave: lines = used + skipped + dropped; the loss tokens trained and those lost to
    data.max_seq_len by category (pre-tokenized lines: `pre_tokenized`)."""
    max_seq_len: int = 0
    lines: int = 0
    sequences: int = 0
    skipped: int = 0           # lines that cannot be used (data.on_error = "skip")
    truncated: int = 0         # sequences extracted cut at data.max_seq_len
    windowed: int = 0          # sequences trained as windows (data.windows)
    skipped_lines: list[int] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)      # reason (DROPPED) -> lines with nothing to train
    dropped_lines: list[int] = field(default_factory=list)
    first_dropped: dict = field(default_factory=dict)      # reason -> the first line dropped for it
    prompts: list[int] = field(default_factory=list)       # [shortest, longest] prompt of the lines dropped for it
    masked: Counter = field(default_factory=Counter)       # pre-tokenized loss tokens: trained / lost
    media: Counter = field(default_factory=Counter)        # images / video_chunks / media_tokens extracted
    chat: ChatStats = field(default_factory=ChatStats)

    @property
    def used(self) -> int:
        return self.lines - self.skipped - sum(self.dropped.values())

    def tokens(self, which: str) -> dict[str, int]:
        """Loss tokens by category, `which` "trained" or "lost" (to data.max_seq_len)."""
        chat = getattr(self.chat, which)
        return {**{k: chat[k] for k in CATEGORIES}, "pre_tokenized": self.masked[which]}

    def drop(self, line: int, reason: str, prompt: int | None) -> None:
        self.dropped[reason] += 1
        self.dropped_lines.append(line)
        self.first_dropped.setdefault(reason, line)
        if prompt is not None:
            self.prompts = [min(self.prompts[0], prompt), max(self.prompts[1], prompt)] if self.prompts else [prompt] * 2

    def summary(self) -> dict:
        """The manifest's counts of the data."""
        return {"lines": self.lines, "sequences": self.sequences, "skipped_lines": self.skipped,
                "skipped_line_numbers": self.skipped_lines[:1000], "dropped_lines": dict(self.dropped),
                "dropped_line_numbers": self.dropped_lines[:1000], "truncated": self.truncated,
                **({"windowed": self.windowed} if self.windowed else {}),
                "trained_tokens": self.tokens("trained"), "lost_tokens": self.tokens("lost"),
                **({"media": {k: self.media[k] for k in MEDIA_COUNTS}} if self.media else {}),
                **({"chat": self.chat.summary()} if self.chat.lines else {})}

    def describe(self) -> str:
        """One line: where each line went."""
        windows = f"; {self.windowed:,} of them trained as windows (data.windows)" if self.windowed else ""
        text = (f"{self.lines:,} lines: {self.used:,} used as {self.sequences:,} sequences ({self.truncated:,} cut at "
                f"data.max_seq_len {self.max_seq_len:,}{windows}), {self.skipped:,} skipped, "
                f"{sum(self.dropped.values()):,} dropped with nothing to train")
        text += "".join(f"; {n:,} because {self._reason(why)}" for why, n in sorted(self.dropped.items()))
        return text + (f"; media: {self.media['images']:,} images, {self.media['video_chunks']:,} video chunks, "
                       f"{self.media['media_tokens']:,} media tokens" if self.media else "")

    def _reason(self, why: str) -> str:
        """Why lines were dropped; the prompts' sizes against data.max_seq_len."""
        return DROPPED[why] + (f" ({self.prompts[0]:,}-{self.prompts[1]:,} tokens)" if why == "prompt" else "")

    def describe_lost(self) -> str | None:
        """One line: the trained tokens data.max_seq_len cuts off, by category; None when it cuts none."""
        lost, trained = self.tokens("lost"), self.tokens("trained")
        if not (total := sum(lost.values())):
            return None
        share = total / (total + sum(trained.values()))
        parts = ", ".join(f"{k.replace('_', ' ').replace('pre ', 'pre-')} {n:,}" for k, n in lost.items() if n)
        return f"data.max_seq_len {self.max_seq_len:,} cuts off {total:,} trained tokens ({share:.1%}: {parts})"

    def warnings(self, path: Path) -> list[str]:
        """The dropped lines by reason, and a large share of the trained tokens lost to data.max_seq_len."""
        out = []
        for why, n in sorted(self.dropped.items()):
            out.append(f"{path}: {n} line{'s' * (n != 1)} dropped because {self._reason(why)} "
                       f"(first: {path}:{self.first_dropped[why]}): nothing to train, not used")
        lost, trained = sum(self.tokens("lost").values()), sum(self.tokens("trained").values())
        if lost > LOST_SHARE * (lost + trained):
            out.append(f"{path}: {self.describe_lost()}, more than {LOST_SHARE:.0%} of them: the draft does not "
                       "learn the end of long replies; raise data.max_seq_len")
        return out + self.chat.warnings(path)


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


def token_media(obj: dict, ids: np.ndarray, chat: Callable, base: Path) -> list[tuple]:
    """(pad start, MediaItem) of a pre-tokenized line's `media` (the content parts its pads in the context, loss_mask
    0, stand for, in order: a pad in a reply is a token the model wrote)."""
    parts = obj.get("media")
    if parts is None:
        return []
    if not isinstance(parts, list):
        raise ValueError("'media' must be a list of image_url / video_url content parts")
    _, refs = content_parts(parts, "media")
    reader = chat().media_reader
    mask = obj.get("loss_mask")
    context = np.asarray(mask) == 0 if isinstance(mask, list) and len(mask) == len(ids) else None
    return place(ids, reader.read([(0, *ref) for ref in refs], base).items, reader.pad_id, context)


def _line(number: int, raw: bytes, vocab_size: int, chat: Callable, regenerating: bool, base: Path) -> tuple:
    """One line: ("ok", [(ids, mask, kinds or None, [(pad start, MediaItem)])], the chat line's Encoded or None),
    ("bad", why) for a line that cannot be used, or ("fatal", why) for a tokenizer or template that cannot be (every
    chat line would fail). `base`: the data file's directory, where media paths are read from."""
    try:
        obj = json.loads(utf8(raw))
        if not is_chat(obj):
            ids, mask = _parse_tokens(obj, vocab_size)
            return "ok", [(ids, mask, None, token_media(obj, ids, chat, base))], None
        encoded = chat().encode(obj, regenerating, base)
        for ids, _ in encoded.sequences:
            if len(ids) < 2:
                raise ValueError(f"conversation of {len(ids)} tokens; at least 2 are needed")
            check_chat_ids(ids, vocab_size)
        return "ok", [(ids, mask, kinds, media) for (ids, mask), kinds, media in
                      zip(encoded.sequences, encoded.kinds, encoded.media)], encoded
    except InputError as e:
        return "fatal", str(e)
    except Exception as e:   # noqa: BLE001 - any failure of one line (JSON, bytes, template) is that line's
        return "bad", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


_POOL_JOB: tuple = ()   # (vocab_size, chat, regenerating, base) of the pool being forked: its workers read it


def _pool_line(job: tuple[int, bytes]) -> tuple:
    return _line(*job, *_POOL_JOB)


def _parsed(path: Path, vocab_size: int, chat: Callable, regenerating: bool, workers: int):
    """(number, _line's answer) of each line, in order; chat lines rendered by `workers` forked processes when the
    file is long enough to pay for them (rendering is Python: one core per process)."""
    global _POOL_JOB
    jobs = json_lines(path, "data.path")
    if workers <= 1 or sys.platform != "linux" or path.stat().st_size < POOL_BYTES:
        yield from ((number, _line(number, raw, vocab_size, chat, regenerating, path.parent)) for number, raw in jobs)
        return
    _POOL_JOB = (vocab_size, chat, regenerating, path.parent)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        numbered = list(jobs)
        yield from zip((n for n, _ in numbered), pool.imap(_pool_line, numbered, chunksize=16))


POOL_BYTES = 4 << 20   # smaller data files are read in the calling process


def read_records(path: str | Path, vocab_size: int, max_seq_len: int, on_error: str = "fatal",
                 target_dir: str | Path | None = None, template_kwargs: dict | None = None,
                 regenerating: bool = False, workers: int = 1, report: bool = True,
                 windows: tuple[float, int] = (0.0, 0)) -> tuple[list[Record], InputStats]:
    """`target_dir` holds the tokenizer and chat template, `template_kwargs` the default `chat_template_kwargs`;
    only chat lines need them. `regenerating`: the replies are to be regenerated (ChatEncoder.encode). `workers`:
    processes rendering chat lines. `report`: print the warnings about the data's fields (one rank of several).
    `windows`: (share, tokens) of data.windows, the sequences to train as windows (`windowed`)."""
    path = Path(path)
    records, stats, chat = [], InputStats(max_seq_len), chat_encoder(target_dir, template_kwargs)
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
        _add(stats, number, sequences, encoded, records)
    records, stats.windowed = windowed(records, *windows)
    stats.sequences = len(records)
    if not records:
        fix = f"; raise data.max_seq_len above {stats.prompts[0]:,}" if stats.dropped["prompt"] else ""
        raise InputError(f"{path}: no usable sequences: {stats.describe()}{fix}")
    for warning in stats.warnings(path) if report else []:
        print(f"warning: {warning}", file=sys.stderr)
    return records, stats


def _add(stats: InputStats, number: int, sequences: list[tuple], encoded, records: list[Record]) -> None:
    """A line's sequences cut at data.max_seq_len into `records`, those left with nothing to train left out (the
    whole line when none is left), and counted in `stats`."""
    # (ids, mask, kinds, media) cut, beside the length before the cut
    kept = [(_cut(ids, mask, kinds, media, stats.max_seq_len), len(ids)) for ids, mask, kinds, media in sequences]
    kept = [(cut, length) for cut, length in kept if cut[1].any()]
    n = stats.max_seq_len
    if encoded is not None:
        # a reply cut short: its run of loss tokens goes on past the cut
        stats.chat.add(number, encoded, [c[2] for c, _ in kept],
                       sum(len(mask) > n and bool(mask[n - 1] and mask[n]) for _, mask, _, _ in sequences))
    else:
        trained = sum(int(c[1].sum()) for c, _ in kept)
        stats.masked.update(trained=trained, lost=sum(int(m.sum()) for _, m, _, _ in sequences) - trained)
    if not kept:
        starts = [int(np.argmax(mask)) for _, mask, _, _ in sequences if mask.any()]
        stats.drop(number, "prompt" if starts else "no_loss", min(starts) if starts else None)
        return
    stats.truncated += sum(len(c[0]) < length for c, length in kept)
    for item in (item for (_, _, _, media), _ in kept for item in media):
        stats.media.update({"images" if item.kind == "image" else "video_chunks": 1, "media_tokens": item.tokens})
    records += [Record(number, ids, mask, part, media) for part, ((ids, mask, _, media), _) in enumerate(kept)]


def windowed(records: list[Record], share: float, length: int) -> tuple[list[Record], int]:
    """`share` of the sequences longer than `length` (evenly spread, in order) cut into windows that each label the
    next `length` tokens, as sequences of their own: the target reads a window without the context before it, save
    the two tokens before its first, which lead it unlabelled (a row labels the token two ahead, `ttt.label_rows`), so
    every token is labelled once at TTT step 0 either way; a sequence with images or video stays whole (its vision rows
    follow its pads). -> (records, the sequences cut)."""
    if share <= 0:
        return records, 0
    out, long, cut = [], 0, 0
    for rec in records:
        if len(rec.input_ids) <= length or rec.media:
            out.append(rec)
            continue
        long += 1
        if int(long * share) == int((long - 1) * share):
            out.append(rec)
            continue
        cut += 1
        for start in range(0, len(rec.input_ids), length):
            lead = min(start, 2)
            mask = rec.loss_mask[start - lead:start + length].copy()
            mask[:lead] = 0
            if mask.any():
                out.append(Record(rec.line, rec.input_ids[start - lead:start + length], mask, rec.part))
    return out, cut


def _cut(ids: np.ndarray, mask: np.ndarray, kinds, media: list[tuple], n: int) -> tuple:
    """A sequence cut at `n` tokens, or before the pads of a media item the cut would split (the vision tower
    sees whole images): (ids, mask, kinds, the MediaItems left whole)."""
    split = [start for start, item in media if start < n < start + item.tokens]
    n = split[0] if split else n
    return ids[:n], mask[:n], None if kinds is None else kinds[:n], [item for start, item in media if start < n]


def json_lines(path: Path, key: str) -> Iterator[tuple[int, bytes]]:
    """(number, bytes) of each non-blank line of the JSON-lines file config key `key` names; a clear error, at the
    call and not at the first line read, for one that is missing or no regular file (a directory, a FIFO)."""
    if not path.exists():
        raise InputError(f"{path}: file not found ({key})")
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise InputError(f"{path}: {kind}; {key} must name a JSON-lines file")
    return _numbered_lines(path)


def _numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
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
