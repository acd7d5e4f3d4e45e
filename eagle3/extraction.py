"""Run the target over the training data and write hidden-state shards (SPEC §5).

Resumable: the shard plan is a pure function of the data and the settings, the manifest lists
only shards that were completely written, and a rerun skips them.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from eagle3.config import Config
from eagle3.data.inputs import InputError, Record, file_sha256, read_records
from eagle3.data.shards import (DTYPES, FORMAT_VERSION, MANIFEST, DataError, atomic_write_text,
                                shard_name, write_shard)
from eagle3.target.checkpoint import Checkpoint, TargetError
from eagle3.target.streaming import TargetRunner

DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_aux_layer_ids(cfg: Config, ckpt: Checkpoint) -> list[int]:
    ids = cfg.target.aux_layer_ids or ckpt.config.default_aux_layer_ids()
    n = ckpt.config.num_hidden_layers
    if any(not 0 <= i < n for i in ids):
        raise TargetError(f"{cfg.source}: target.aux_layer_ids = {ids}; the target has layers 0..{n - 1}")
    return list(ids)


def plan_shards(records: list[Record], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive record ranges [a, b) of about shard_tokens tokens each."""
    plan, start, tokens = [], 0, 0
    for i, r in enumerate(records):
        if tokens and tokens + len(r.input_ids) > shard_tokens:
            plan.append((start, i))
            start, tokens = i, 0
        tokens += len(r.input_ids)
    plan.append((start, len(records)))
    return plan


def _plan_key(cfg: Config, ckpt: Checkpoint, aux_ids: list[int], data_sha: str) -> str:
    blob = json.dumps([ckpt.config.config_sha256, aux_ids, data_sha, cfg.data.max_seq_len,
                       cfg.data.on_error, cfg.extract.shard_tokens, cfg.extract.dtype, FORMAT_VERSION])
    return hashlib.sha256(blob.encode()).hexdigest()


def _load_or_start_manifest(out: Path, header: dict) -> dict:
    path = out / MANIFEST
    if not path.exists():
        return {**header, "shards": [], "complete": False}
    manifest = json.loads(path.read_text())
    if manifest.get("plan_key") != header["plan_key"]:
        raise DataError(f"{path}: this directory holds an extraction of other data, target or settings; "
                        "choose another extract.output_dir or delete it")
    return manifest


def _shard_tensors(records: list[Record], out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    lengths = [len(r.input_ids) for r in records]
    return {
        "input_ids": torch.from_numpy(np.concatenate([r.input_ids for r in records])),
        "loss_mask": torch.from_numpy(np.concatenate([r.loss_mask for r in records])),
        "cu_seqlens": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
        "aux_hidden": out["aux_hidden"].to(torch.bfloat16),
        "final_hidden": out["final_hidden"].to(torch.bfloat16),
        "target_argmax": out["target_argmax"].to(torch.int32),
    }


def run(cfg: Config) -> Path:
    ckpt = Checkpoint(cfg.target.path)
    aux_ids = resolve_aux_layer_ids(cfg, ckpt)
    records, stats = read_records(cfg.data.path, ckpt.config.vocab_size, cfg.data.max_seq_len,
                                  cfg.data.on_error)
    out = Path(cfg.extract.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data_sha = file_sha256(cfg.data.path)
    header = {
        "format_version": FORMAT_VERSION, "target": ckpt.config.identity(), "aux_layer_ids": aux_ids,
        "dtypes": DTYPES, "plan_key": _plan_key(cfg, ckpt, aux_ids, data_sha),
        "source": {"path": str(cfg.data.path), "sha256": data_sha, "max_seq_len": cfg.data.max_seq_len,
                   "lines": stats.lines, "sequences": stats.sequences, "skipped_lines": stats.skipped,
                   "skipped_line_numbers": stats.skipped_lines[:1000], "truncated": stats.truncated},
    }
    manifest = _load_or_start_manifest(out, header)
    plan = plan_shards(records, cfg.extract.shard_tokens)
    done = {s["file"] for s in manifest["shards"]}
    todo = [i for i in range(len(plan)) if shard_name(i) not in done]
    total = sum(len(r.input_ids) for a, b in plan for r in records[a:b])
    runner = TargetRunner(ckpt, aux_ids, resolve_device(cfg.extract.device), DTYPE[cfg.extract.dtype],
                          cfg.extract.chunk_tokens) if todo else None
    with tqdm(total=total, unit="tok", unit_scale=True, desc="extract",
              initial=total - sum(len(r.input_ids) for i in todo for r in records[slice(*plan[i])])) as bar:
        for i in todo:
            shard_records = records[plan[i][0]:plan[i][1]]
            ids = torch.from_numpy(np.concatenate([r.input_ids for r in shard_records]))
            cu = np.concatenate([[0], np.cumsum([len(r.input_ids) for r in shard_records])]).tolist()
            entry = write_shard(out, i, _shard_tensors(shard_records, runner.run(ids, cu)))
            manifest["shards"] = sorted(manifest["shards"] + [entry], key=lambda s: s["file"])
            atomic_write_text(out / MANIFEST, json.dumps(manifest))
            bar.update(entry["tokens"])
    manifest["complete"] = len(manifest["shards"]) == len(plan)
    manifest["finished_at"] = manifest.get("finished_at") or time.strftime("%Y-%m-%dT%H:%M:%S")
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    print(f"extract: {len(plan)} shards, {total} tokens, {stats.sequences} sequences "
          f"({stats.skipped} lines skipped, {stats.truncated} truncated) in {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    from eagle3.config import cli
    cfg = cli(argv, "Extract target hidden states into shards (SPEC §5).")
    try:
        run(cfg)
    except (TargetError, InputError, DataError) as e:
        raise SystemExit(f"error: {e}") from None
