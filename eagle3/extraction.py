"""Run the target over the training data into hidden-state shards (eagle3/data/shards.py). Resumable:
the plan is a function of the data and settings, and a rerun skips the shards journaled as written."""
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
from eagle3.config import Config
from eagle3.resolve import data_windows, data_workers, resolve, resolve_device
from eagle3.data.chat import RENDERING
from eagle3.data.tokenizer import TOKENIZER_FILES
from eagle3.data.inputs import InputStats, read_records
from eagle3.data.media import files_fingerprint
from eagle3.data.shards import DTYPES, FORMAT_VERSION, MANIFEST, DataError, shard_name, shard_tensors, write_shard
from eagle3.files import atomic_write_text, read_json, run_lock, sha256_file, writable_dir
from eagle3.ops import TORCH_DTYPES
from eagle3.models.vision import target_vision
from eagle3.models.weights import Checkpoint
from eagle3.models.streaming import TargetRunner, build_model, check_tensors, past_positions, split_chunks

JOURNAL = ".entries"   # one entry per finished shard, written after the shard: what a resumed run trusts


def _check_or_write_header(out: Path, header: dict, main: bool) -> None:
    """The first run writes the manifest header; a rerun must be of the same plan."""
    path = out / MANIFEST
    if path.exists():
        if read_json(path, DataError, "", "delete the directory to start over").get("plan_key") != header["plan_key"]:
            raise DataError(f"{path}: this directory holds an extraction of other data, target or settings; "
                            "choose another extract.output_dir or delete the whole directory")
    elif main:
        atomic_write_text(path, json.dumps({**header, "shards": [], "complete": False}, indent=1))


def _finished(out: Path, plan_key: str) -> dict[str, dict]:
    """Journal entries of this plan whose shard is on disk (another plan's shards are redone)."""
    entries = {}
    for path in sorted((out / JOURNAL).glob("shard-*.json")):
        try:
            entry = read_json(path, DataError, "journal entry")
        except DataError as e:   # a damaged entry only costs redoing its shard
            print(f"extract: {e}; redoing that shard", file=sys.stderr)
            continue
        if entry.get("plan_key") == plan_key and (out / entry["file"]).exists():
            entries[entry["file"]] = entry
    return entries


def _verified(out: Path, done: dict[str, dict], mine: list[int]) -> dict[str, dict]:
    """`done` less this rank's shards altered since their journal entry (kept, they would fail training): redone."""
    for i in mine:
        if (entry := done.get(shard_name(i))) is None:
            continue
        path = out / entry["file"]
        if (size := path.stat().st_size) != entry.get("bytes", size):
            damage = f"{size} bytes, its journal entry says {entry['bytes']}"
        elif sha256_file(path) != entry["sha256"]:   # cheap next to running the target over the shard
            damage = "sha256 differs from its journal entry"
        else:
            continue
        print(f"extract: {path}: {damage}; redoing it", file=sys.stderr)
        (out / JOURNAL / (entry["file"] + ".json")).unlink()
        del done[entry["file"]]
    return done


def _header(cfg: Config, ckpt: Checkpoint, aux_ids: list[int], stats: InputStats, records: list) -> dict:
    data_sha = sha256_file(cfg.data.path)
    media = [item for r in records for item in r.media]
    dtypes = dict(DTYPES)
    if cfg.extract.aux_dtype == "float8_e4m3fn":
        dtypes.update(aux_hidden="float8_e4m3fn", aux_scale="float32")
    tokenizer = {name: sha256_file(ckpt.dir / name) for name in TOKENIZER_FILES if (ckpt.dir / name).exists()}
    chat = [json.dumps(cfg.data.chat_template_kwargs, sort_keys=True), RENDERING] if stats.chat.lines else []
    plan = json.dumps([ckpt.config.config_sha256, aux_ids, data_sha, tokenizer, cfg.data.max_seq_len, cfg.data.on_error,
                       *([data_windows(cfg)] if cfg.data.windows else []),
                       cfg.debug.shard_tokens, cfg.extract.dtype, cfg.extract.aux_dtype, FORMAT_VERSION, *chat,
                       *([files_fingerprint(media)] if media else [])])   # the images the data points to
    vision = target_vision(ckpt)
    return {"format_version": FORMAT_VERSION, "target": ckpt.config.identity(), "aux_layer_ids": aux_ids,
            "dtypes": dtypes, **({"media_pad_id": vision.pad_id} if vision else {}),
            "plan_key": hashlib.sha256(plan.encode()).hexdigest(),
            "source": {"path": str(cfg.data.path), "sha256": data_sha, "max_seq_len": cfg.data.max_seq_len,
                       **({"windows": cfg.data.windows} if cfg.data.windows else {}),
                       **stats.summary()}}


def check_finite(states: dict[str, torch.Tensor], aux_ids: list[int], shard: Path, dtype: str) -> None:
    """Stop before writing a shard whose states hold NaN or inf: a draft cannot learn from them, and training would
    blame its own settings at step 1."""
    aux = states["aux_hidden"].chunk(len(aux_ids), dim=-1)
    parts = [(f"layer {i} (aux_hidden)", x) for i, x in zip(aux_ids, aux)] + [
        ("the last layer after the final norm (final_hidden)", states["final_hidden"])]
    for name, x in parts:
        if bad := int((~torch.isfinite(x)).sum()):
            raise DataError(f"{shard}: the target's output of {name} holds {bad} of {x.numel()} values NaN or "
                            f"infinite; nothing of this shard was written (the finished ones are kept): check the "
                            f"target's weights and config.json, or extract.dtype = \"float32\" if {dtype} overflows")


def kept(cfg: Config) -> str:
    """What an extraction stopped midway leaves, as its last line says it."""
    return f"the finished shards in {cfg.extract.output_dir} are kept"


def run(cfg: Config) -> Path:
    """Extract this rank's shards (i % world == rank), rank 0 the manifest; a lost rank stops it in one line."""
    dist = distributed.setup(cfg.debug.extract_device)
    try:   # rank 0 owns extract.output_dir meanwhile (a second extraction into it stops at once)
        with run_lock(Path(cfg.extract.output_dir), "extract.output_dir", "extract", DataError, held=dist.main):
            return _run(cfg, dist)
    except RuntimeError as e:
        lost = distributed.lost_peer(e, "torch's collective timeout")
        if lost is None:
            raise
        raise distributed.lost_peer_error(
            DataError, f"{lost}; extraction stopped, {kept(cfg)}; the same command resumes") from None
    finally:
        distributed.teardown()


def _run(cfg: Config, dist: distributed.Dist) -> Path:
    ckpt = Checkpoint(cfg.target.path)
    aux_ids = resolve(cfg, ckpt).aux_layer_ids   # the whole record: a draft that cannot be built fails now
    check_tensors(ckpt, build_model(ckpt, torch.device("cpu"), torch.float32))   # headers only, before any work
    records, stats = read_records(cfg.data.path, ckpt.config.vocab_size, cfg.data.max_seq_len, cfg.data.on_error,
                                  target_dir=ckpt.dir, template_kwargs=cfg.data.chat_template_kwargs,
                                  workers=data_workers(cfg), report=dist.main, windows=data_windows(cfg))
    if dist.main:
        for line in (stats.describe(), stats.chat.lines and stats.chat.describe(), stats.describe_lost()):
            if line:
                print(f"extract: {line}")
        if note := past_positions([len(r.input_ids) for r in records], ckpt):
            print(f"extract: {note}", file=sys.stderr)
    out = writable_dir(cfg.extract.output_dir, DataError, "extract.output_dir")
    (out / JOURNAL).mkdir(parents=True, exist_ok=True)
    header = _header(cfg, ckpt, aux_ids, stats, records)
    _check_or_write_header(out, header, dist.main)
    dist.barrier()
    cu = np.cumsum([0] + [len(r.input_ids) for r in records]).tolist()
    plan = split_chunks(cu, cfg.debug.shard_tokens)   # record ranges [a, b) of about shard_tokens tokens
    mine = list(range(dist.rank, len(plan), dist.world))
    done = _verified(out, _finished(out, header["plan_key"]), mine)
    todo = [i for i in mine if shard_name(i) not in done]
    tokens = [cu[b] - cu[a] for a, b in plan]
    device = resolve_device(cfg.debug.extract_device) if dist.world == 1 else dist.device
    runner = (TargetRunner(ckpt, aux_ids, device, TORCH_DTYPES[cfg.extract.dtype], cfg.debug.chunk_tokens)
              if todo else None)
    with tqdm(total=sum(tokens[i] for i in mine), initial=sum(tokens[i] for i in mine if i not in todo),
              unit="tok", unit_scale=True, desc=f"extract (rank {dist.rank})", disable=not dist.main) as bar:
        for i in todo:
            a, b = plan[i]
            ids = torch.from_numpy(np.concatenate([r.input_ids for r in records[a:b]]))
            context = torch.from_numpy(np.concatenate([r.loss_mask for r in records[a:b]]) == 0)   # the prompts
            states = runner.run(ids, [c - cu[a] for c in cu[a:b + 1]], [m for r in records[a:b] for m in r.media],
                                context)
            check_finite(states, aux_ids, out / shard_name(i), cfg.extract.dtype)
            tensors = shard_tensors(records[a:b], states, cfg.extract.aux_dtype)
            entry = write_shard(out, i, tensors) | {"plan_key": header["plan_key"]}
            atomic_write_text(out / JOURNAL / (shard_name(i) + ".json"), json.dumps(entry))
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
    print(f"extract: {len(plan)} shards, {total} tokens, {stats.sequences} sequences of {stats.used} lines "
          f"({stats.skipped} skipped, {sum(stats.dropped.values())} dropped; {stats.truncated} sequences cut at "
          f"data.max_seq_len) in {out}")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    distributed.main(run, kept, "Extract target hidden states into shards.", argv, prog, "extract")
