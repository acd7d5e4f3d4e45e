"""`python -m eagle3 generate --config config.toml`: regenerate the assistant replies of the training
conversations with the target itself (the biggest lever on acceptance; docs/data.md). Each reply (a run of
loss_mask = 1) becomes the target's continuation of everything before it, in batches sharing one KV pool.
Resumable: `<output>.partial` grows in input order, its settings recorded beside it; other settings are refused."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3.config import Config
from eagle3.data.chat import TOKENIZER_FILES, stop_token_ids
from eagle3.data.inputs import Record, read_records
from eagle3.resolve import resolve_device
from eagle3.files import atomic_write_text, read_json, sha256_file, strict_json
from eagle3.ops import TORCH_DTYPES
from eagle3.sampling import Sampling, sample
from eagle3.models.weights import Checkpoint
from eagle3.models.incremental import IncrementalTarget
from eagle3.errors import Eagle3Error


def reply_spans(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    mask = list(mask)
    edges = [i for i, (a, b) in enumerate(zip([0, *mask], [*mask, 0])) if bool(a) != bool(b)]
    return list(zip(edges[0::2], edges[1::2]))


def stop_tokens(cfg: Config, ckpt: Checkpoint) -> set[int]:
    ids = cfg.generate.stop_token_ids
    return set(ids) if ids is not None else stop_token_ids(ckpt.dir, ckpt.config.raw.get("eos_token_id"))


class Conversation:
    """One conversation being regenerated: its tokens so far, the target's cache, the reply it replaces.
    Every target pass ends where a reply's next token follows, so each pass is followed by one sample."""

    def __init__(self, record: Record, target: IncrementalTarget, seed: int):
        self.record, self.original = record, record.input_ids.tolist()
        self.spans = reply_spans(record.loss_mask.tolist())
        self.ids, self.mask, self.cursor, self.reply = [], [], 0, 0
        self.cache = target.new_cache()
        self.generator = torch.Generator().manual_seed(seed)  # per conversation: same draws on resume
        self._copy_until_next_reply()

    @property
    def done(self) -> bool:
        return not self.spans

    def feed(self) -> torch.Tensor:
        """Tokens the target has not seen yet."""
        return torch.tensor(self.ids[self.cache.length:])

    def take(self, token: int, max_new: int, stop: set[int]) -> None:
        self.ids.append(token)
        self.mask.append(1)
        self.reply += 1
        if token in stop or self.reply >= max_new:
            self.cursor = self.spans.pop(0)[1]
            self._copy_until_next_reply()

    def _copy_until_next_reply(self) -> None:
        """Copy the original tokens up to the next reply (or to the end when none is left)."""
        end = self.spans[0][0] if self.spans else len(self.original)
        self.ids += self.original[self.cursor:end]
        self.mask += [0] * (end - self.cursor)
        self.cursor, self.reply = end, 0

    def output(self) -> dict:
        return {"input_ids": self.ids, "loss_mask": self.mask, "source_line": self.record.line}


def regenerate(target: IncrementalTarget, records: list[Record], sampling: Sampling, max_new: int,
               stop: set[int], batch: int, seed: int):
    """Regenerated conversations in input order (sampled at `sampling`'s temperature and top_p), up to `batch`
    of them through the target together (a pass takes each one's unseen tokens: a prompt or its last sample)."""
    waiting = list(records)
    active: list[Conversation] = []
    finished: dict[int, dict] = {}
    order = [r.line for r in records]
    while waiting or active:
        while waiting and len(active) < batch:
            record = waiting.pop(0)
            active.append(Conversation(record, target, seed * 1_000_003 + record.line))
        for conv in [c for c in active if c.done]:
            finished[conv.record.line] = conv.output()
            active.remove(conv)
        if active:
            results = target.forward_many([c.feed() for c in active], [c.cache for c in active])
            last = target.logits(torch.stack([final[-1] for _, final in results]))      # [B, V]
            for conv, token in zip(active, sample(last, sampling.temperature, sampling.top_p,
                                                  [c.generator for c in active])):
                conv.take(token, max_new, stop)
        while order and order[0] in finished:
            yield finished.pop(order.pop(0))


def _done_lines(partial: Path) -> set[int]:
    """Source lines already regenerated; a torn last line (killed mid-write) is dropped."""
    if not partial.exists():
        return set()
    lines = partial.read_text().split("\n")
    complete = [line for line in lines[:-1] if line]
    partial.write_text("".join(line + "\n" for line in complete))
    return {json.loads(line)["source_line"] for line in complete}


class GenerateError(Eagle3Error):
    """A generate output that this run must not touch; the message names the file and the way out."""


def settings(cfg: Config, ckpt: Checkpoint) -> dict:
    """Everything that changes the replies (not batch size or device), keyed by the config key to change."""
    g = cfg.generate
    tokenizer = {name: sha256_file(ckpt.dir / name) for name in TOKENIZER_FILES if (ckpt.dir / name).exists()}
    return {"target.path": str(ckpt.dir.resolve()), "target config.json sha256": ckpt.config.config_sha256,
            "target tokenizer sha256": tokenizer, "data.path sha256": sha256_file(Path(cfg.data.path)),
            "data.max_seq_len": cfg.data.max_seq_len, "data.on_error": cfg.data.on_error,
            "generate.max_new_tokens": g.max_new_tokens, "generate.temperature": g.temperature,
            "generate.top_p": g.top_p, "generate.seed": g.seed, "debug.generate_dtype": cfg.debug.generate_dtype,
            "stop tokens": sorted(stop_tokens(cfg, ckpt))}


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".settings.json")


def _check_same(path: Path, current: dict) -> None:
    """Refuse to add to or stand in for `path` when its recorded settings are not `current`."""
    sidecar = _sidecar(path)
    if not sidecar.exists():
        changed, remove = f"it has no {sidecar.name} recording them", f"{path}"
    else:
        recorded = read_json(sidecar, GenerateError, "written with the output")
        if not isinstance(recorded, dict):
            raise GenerateError(f"{sidecar}: expected a JSON object of generate settings; remove it and {path}")
        changed = ", ".join(f"{k} {strict_json(recorded.get(k))} -> {strict_json(current.get(k))}"
                            for k in {**recorded, **current} if recorded.get(k) != current.get(k))
        remove = f"{path} and {sidecar.name}"
    if changed:
        raise GenerateError(f"{path} was generated with other settings ({changed}); set another "
                            f"generate.output_path, or remove {remove} to start over")


def _finish(partial: Path, out: Path) -> None:
    """Rename the partial file and its settings so that a kill between the steps never mixes two runs' settings."""
    atomic_write_text(_sidecar(out), _sidecar(partial).read_text())
    os.replace(partial, out)
    _sidecar(partial).unlink()


def run(cfg: Config) -> Path:
    g = cfg.generate
    ckpt = Checkpoint(cfg.target.path)
    out = Path(g.output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    current = settings(cfg, ckpt)
    if partial.exists() and partial.stat().st_size:
        _check_same(partial, current)
    elif out.exists():
        _check_same(out, current)
        _sidecar(partial).unlink(missing_ok=True)   # left by a kill inside _finish
        print(f"generate: {out} is already complete with these settings; nothing to do")
        return out
    else:
        atomic_write_text(_sidecar(partial), strict_json(current, indent=1) + "\n")
    records, stats = read_records(cfg.data.path, ckpt.config.vocab_size, cfg.data.max_seq_len,
                                  cfg.data.on_error, target_dir=ckpt.dir)
    done = _done_lines(partial)
    todo = [r for r in records if r.line not in done]
    target = IncrementalTarget(ckpt, [0, 0, 0], resolve_device(cfg.debug.generate_device), TORCH_DTYPES[cfg.debug.generate_dtype])
    sampling, stop = Sampling(g.temperature, g.top_p), stop_tokens(cfg, ckpt)
    with partial.open("a") as f, tqdm(desc="generate", unit="conv", initial=len(records) - len(todo),
                                      total=len(records)) as bar:
        for line in regenerate(target, todo, sampling, g.max_new_tokens, stop, cfg.debug.generate_batch_size, g.seed):
            f.write(json.dumps(line) + "\n")
            f.flush()
            bar.update(1)
    _finish(partial, out)
    print(f"generate: {len(records)} conversations ({stats.skipped} input lines skipped) -> {out}")
    return out
