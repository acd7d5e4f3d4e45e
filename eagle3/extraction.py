"""Run the target over the training data and write hidden-state shards (format: eagle3/data/shards.py).

Resumable: the shard plan is a pure function of the data and the settings, the manifest lists
only shards that were completely written, and a rerun skips them.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from eagle3 import distributed
from eagle3.errors import Eagle3Error
from eagle3.config import Config
from eagle3.resolve import resolve, resolve_device
from eagle3.data.chat import TOKENIZER_FILES
from eagle3.data.inputs import InputStats, Record, file_sha256, read_records
from eagle3.data.shards import (DTYPES, FORMAT_VERSION, MANIFEST, DataError, sha256_file, shard_name,
                                shard_tensors, write_shard)
from eagle3.files import atomic_write_text, read_json, run_lock, writable_dir
from eagle3.ops import TORCH_DTYPES
from eagle3.models.weights import Checkpoint
from eagle3.models.streaming import TargetRunner, build_model, check_tensors



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
    tokenizer = {name: file_sha256(ckpt.dir / name) for name in TOKENIZER_FILES if (ckpt.dir / name).exists()}
    blob = json.dumps([ckpt.config.config_sha256, aux_ids, data_sha, tokenizer, cfg.data.max_seq_len,
                       cfg.data.on_error, cfg.debug.shard_tokens, cfg.extract.dtype, cfg.extract.aux_dtype,
                       FORMAT_VERSION])
    return hashlib.sha256(blob.encode()).hexdigest()


def _check_or_write_header(out: Path, header: dict, main: bool) -> None:
    """The first run writes the manifest header; a rerun must be of the same plan."""
    path = out / MANIFEST
    if path.exists():
        try:
            existing = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e}); delete the output directory to start over") from None
        if existing.get("plan_key") != header["plan_key"]:
            raise DataError(f"{path}: this directory holds an extraction of other data, target or settings; "
                            "choose another extract.output_dir or delete the whole directory")
    elif main:
        atomic_write_text(path, json.dumps({**header, "shards": [], "complete": False}, indent=1))


def _journal(out: Path) -> Path:
    """One entry per finished shard, written after the shard's rename: what a resumed run trusts."""
    return out / ".entries"


def _finished(out: Path, plan_key: str) -> dict[str, dict]:
    """Journal entries of this plan whose shard is on disk; entries of another plan (a directory
    reused after its manifest was deleted) are not trusted: those shards are redone."""
    entries = {}
    for path in sorted(_journal(out).glob("shard-*.json")):
        try:
            entry = read_json(path, DataError, "journal entry")
        except DataError as e:   # a damaged entry only costs redoing its shard
            print(f"extract: {e}; redoing that shard", file=sys.stderr)
            continue
        if entry.get("plan_key") == plan_key and (out / entry["file"]).exists():
            entries[entry["file"]] = entry
    return entries


def _damage(out: Path, entry: dict) -> str | None:
    """What is wrong with a finished shard against its journal entry (None: intact). A shard
    truncated or altered after extraction would otherwise be kept by a rerun and fail in training."""
    path = out / entry["file"]
    size = path.stat().st_size
    if "bytes" in entry and size != entry["bytes"]:
        return f"{size} bytes, its journal entry says {entry['bytes']}"
    if sha256_file(path) != entry["sha256"]:   # cheap next to running the target over the shard
        return "sha256 differs from its journal entry"
    return None


def _verified(out: Path, done: dict[str, dict], mine: list[int]) -> dict[str, dict]:
    """`done` less this rank's shards that fail verification; their journal entries are removed, so
    that they are redone (and a run killed before that redoes them too)."""
    for i in mine:
        entry = done.get(shard_name(i))
        damage = entry and _damage(out, entry)
        if damage:
            print(f"extract: {out / entry['file']}: {damage}; redoing it", file=sys.stderr)
            (_journal(out) / (entry["file"] + ".json")).unlink()
            del done[entry["file"]]
    return done


def _header(cfg: Config, ckpt: Checkpoint, aux_ids: list[int], stats: InputStats) -> dict:
    data_sha = file_sha256(cfg.data.path)
    dtypes = dict(DTYPES)
    if cfg.extract.aux_dtype == "float8_e4m3fn":
        dtypes.update(aux_hidden="float8_e4m3fn", aux_scale="float32")
    return {
        "format_version": FORMAT_VERSION, "target": ckpt.config.identity(), "aux_layer_ids": aux_ids,
        "dtypes": dtypes, "plan_key": _plan_key(cfg, ckpt, aux_ids, data_sha),
        "source": {"path": str(cfg.data.path), "sha256": data_sha, "max_seq_len": cfg.data.max_seq_len,
                   "lines": stats.lines, "sequences": stats.sequences, "skipped_lines": stats.skipped,
                   "skipped_line_numbers": stats.skipped_lines[:1000], "truncated": stats.truncated},
    }


def kept(cfg: Config) -> str:
    """What an extraction stopped midway leaves, as its last line says it."""
    return f"the finished shards in {cfg.extract.output_dir} are kept"


def run(cfg: Config) -> Path:
    """Extract on this rank's share of the shards (shard i goes to rank i % world under torchrun);
    rank 0 writes the manifest once every rank is done. A barrier that fails because another rank is
    gone stops the extraction here, in one line."""
    dist = distributed.setup(cfg.debug.extract_device)
    try:   # rank 0 owns extract.output_dir meanwhile (a second extraction into it stops at once)
        with run_lock(Path(cfg.extract.output_dir), "extract.output_dir", "extract", DataError, held=dist.main):
            return _run(cfg, dist)
    except RuntimeError as e:
        lost = distributed.lost_peer(e, "torch's collective timeout")
        if lost is None:
            raise
        raise DataError(f"{lost}; extraction stopped, {kept(cfg)}; the same command resumes") from None
    finally:
        distributed.teardown()


def _run(cfg: Config, dist: distributed.Dist) -> Path:
    ckpt = Checkpoint(cfg.target.path)
    aux_ids = resolve(cfg, ckpt).aux_layer_ids   # the whole record: a draft that cannot be built fails now
    check_tensors(ckpt, build_model(ckpt, torch.device("cpu"), torch.float32))   # headers only, before any work
    records, stats = read_records(cfg.data.path, ckpt.config.vocab_size, cfg.data.max_seq_len,
                                  cfg.data.on_error, target_dir=ckpt.dir)
    out = writable_dir(cfg.extract.output_dir, DataError, "extract.output_dir")
    _journal(out).mkdir(parents=True, exist_ok=True)
    header = _header(cfg, ckpt, aux_ids, stats)
    _check_or_write_header(out, header, dist.main)
    dist.barrier()
    plan = plan_shards(records, cfg.debug.shard_tokens)
    mine = [i for i in range(dist.rank, len(plan), dist.world)]
    done = _verified(out, _finished(out, header["plan_key"]), mine)
    todo = [i for i in mine if shard_name(i) not in done]
    tokens = [sum(len(r.input_ids) for r in records[a:b]) for a, b in plan]
    device = resolve_device(cfg.debug.extract_device) if dist.world == 1 else dist.device
    runner = TargetRunner(ckpt, aux_ids, device, TORCH_DTYPES[cfg.extract.dtype], cfg.debug.chunk_tokens) if todo else None
    with tqdm(total=sum(tokens[i] for i in mine), initial=sum(tokens[i] for i in mine if i not in todo),
              unit="tok", unit_scale=True, desc=f"extract (rank {dist.rank})", disable=not dist.main) as bar:
        for i in todo:
            shard_records = records[plan[i][0]:plan[i][1]]
            ids = torch.from_numpy(np.concatenate([r.input_ids for r in shard_records]))
            cu = np.concatenate([[0], np.cumsum([len(r.input_ids) for r in shard_records])]).tolist()
            tensors = shard_tensors(shard_records, runner.run(ids, cu), cfg.extract.aux_dtype)
            entry = write_shard(out, i, tensors)
            entry["plan_key"] = header["plan_key"]
            atomic_write_text(_journal(out) / (shard_name(i) + ".json"), json.dumps(entry))
            bar.update(entry["tokens"])
    dist.barrier()
    if dist.main:
        _write_manifest(out, header, plan, stats, sum(tokens))
    dist.barrier()
    return out


def _write_manifest(out: Path, header: dict, plan: list, stats: InputStats, total: int) -> None:
    done = _finished(out, header["plan_key"])
    shards = [{k: v for k, v in done[shard_name(i)].items() if k != "plan_key"}
              for i in range(len(plan)) if shard_name(i) in done]
    manifest = {**header, "shards": shards, "complete": len(shards) == len(plan),
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    print(f"extract: {len(plan)} shards, {total} tokens, {stats.sequences} sequences "
          f"({stats.skipped} lines skipped, {stats.truncated} truncated) in {out}")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    from eagle3.config import cli, interrupted
    cfg = cli(argv, "Extract target hidden states into shards.", prog)
    distributed.stop_on_sigterm(lambda: kept(cfg))
    try:
        run(cfg)
    except Eagle3Error as e:
        raise SystemExit(distributed.first_word(f"error: {e}")) from None
    except KeyboardInterrupt:
        interrupted(kept(cfg))
