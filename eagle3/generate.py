"""`python -m eagle3 generate --config config.toml`: regenerate the assistant replies of the
training conversations with the target itself (the biggest lever on acceptance).

Each assistant reply (a run of loss_mask = 1) is replaced by the target's own continuation of
everything before it (earlier replies already regenerated); user turns are kept. The output is
pre-tokenized JSON lines, the format extraction reads. Resumable: lines are appended to
`<output>.partial` as they finish and a rerun skips the conversations already there.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3.config import Config
from eagle3.data.inputs import Record, read_records
from eagle3.extraction import resolve_device
from eagle3.ops import TORCH_DTYPES
from eagle3.target.checkpoint import Checkpoint
from eagle3.target.incremental import IncrementalTarget


def reply_spans(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def stop_tokens(cfg: Config, ckpt: Checkpoint) -> set[int]:
    if cfg.generate.stop_token_ids is not None:
        return set(cfg.generate.stop_token_ids)
    eos = ckpt.config.raw.get("eos_token_id")
    stop = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    tok_cfg = ckpt.dir / "tokenizer_config.json"
    if tok_cfg.exists():
        added = json.loads(tok_cfg.read_text()).get("added_tokens_decoder", {})
        stop |= {int(i) for i, t in added.items() if t.get("content") == "<|im_end|>"}
    return stop


class Sampler:
    def __init__(self, temperature: float, top_p: float, seed: int):
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.temperature, -1)
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < self.top_p  # smallest set with mass >= top_p
        choice = torch.multinomial(sorted_probs * keep, 1, generator=self.generator)
        return int(order[choice])


def regenerate(target: IncrementalTarget, record: Record, sample: Sampler, max_new: int,
               stop: set[int]) -> tuple[list[int], list[int]]:
    """The conversation with every assistant reply replaced by the target's own."""
    ids, mask, cursor = [], [], 0
    original = record.input_ids.tolist()
    for start, end in reply_spans(record.loss_mask.tolist()):
        ids += original[cursor:start]
        mask += [0] * (start - cursor)
        reply = _continue(target, ids, sample, max_new, stop)
        ids += reply
        mask += [1] * len(reply)
        cursor = end
    ids += original[cursor:]
    mask += [0] * (len(original) - cursor)
    return ids, mask


def _continue(target: IncrementalTarget, prompt: list[int], sample: Sampler, max_new: int,
              stop: set[int]) -> list[int]:
    cache = target.new_cache()
    _, final = target.forward(torch.tensor(prompt), cache)
    out = [sample(target.logits(final[-1]))]
    while len(out) < max_new and out[-1] not in stop:
        _, final = target.forward(torch.tensor(out[-1:]), cache)
        out.append(sample(target.logits(final[-1])))
    return out


def _done_lines(partial: Path) -> set[int]:
    """Source lines already regenerated; a torn last line (killed mid-write) is dropped."""
    if not partial.exists():
        return set()
    lines = partial.read_text().split("\n")
    complete = [line for line in lines[:-1] if line]
    partial.write_text("".join(line + "\n" for line in complete))
    return {json.loads(line)["source_line"] for line in complete}


def run(cfg: Config) -> Path:
    g = cfg.generate
    ckpt = Checkpoint(cfg.target.path)
    records, stats = read_records(cfg.data.path, ckpt.config.vocab_size, cfg.data.max_seq_len,
                                  cfg.data.on_error, target_dir=ckpt.dir)
    out = Path(g.output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    done = _done_lines(partial)
    todo = [r for r in records if r.line not in done]
    target = IncrementalTarget(ckpt, [0, 0, 0], resolve_device(g.device), TORCH_DTYPES[g.dtype])
    sample, stop = Sampler(g.temperature, g.top_p, g.seed), stop_tokens(cfg, ckpt)
    with partial.open("a") as f:
        for record in tqdm(todo, desc="generate", unit="conv", initial=len(records) - len(todo),
                           total=len(records)):
            sample.generator.manual_seed(g.seed * 1_000_003 + record.line)  # same draw on resume
            ids, mask = regenerate(target, record, sample, g.max_new_tokens, stop)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask, "source_line": record.line}) + "\n")
            f.flush()
    os.replace(partial, out)
    print(f"generate: {len(records)} conversations ({stats.skipped} input lines skipped) -> {out}")
    return out
