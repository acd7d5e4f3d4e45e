"""Hidden-state shards on disk: writer with atomic commit, manifest, reader. A shard is listed only
once written under a temp name and renamed, so a killed extraction resumes without trusting partial work."""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from eagle3.data.batch import Batch, Part
from eagle3.data.aux_fp8 import encode_aux_fp8
from eagle3.data.inputs import Record
from eagle3.files import make_readable, open_safetensors, read_json, sha256_file, short_of_space, tensor_bytes
from eagle3.models.vision import media_positions
from eagle3.models.weights import TextConfig
from eagle3.errors import Eagle3Error

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"input_ids": "int32", "loss_mask": "uint8", "cu_seqlens": "int64", "aux_hidden": "bfloat16",
          "final_hidden": "bfloat16", "target_argmax": "int32"}
# extraction verifies its finished shards against the journal and redoes the bad ones
REDO = "rerun extract with the same config to redo it"


class DataError(Eagle3Error):
    """Hidden-state data that is missing, corrupt or does not match; the message names the file."""


SHARD_HEADER = 1 << 16   # the safetensors header of a shard, generously


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def shard_tensors(records: list[Record], out: dict[str, torch.Tensor], aux_dtype: str) -> dict[str, torch.Tensor]:
    """A shard's (or online micro-batch's) tensors: the records' tokens and masks, the target's outputs."""
    lengths = [len(r.input_ids) for r in records]
    tensors = {"input_ids": torch.from_numpy(np.concatenate([r.input_ids for r in records])),
               "loss_mask": torch.from_numpy(np.concatenate([r.loss_mask for r in records])),
               "cu_seqlens": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
               "aux_hidden": out["aux_hidden"].to(torch.bfloat16),
               "final_hidden": out["final_hidden"].to(torch.bfloat16),
               "target_argmax": out["target_argmax"].to(torch.int32)}
    if aux_dtype == "float8_e4m3fn":
        tensors.update(encode_aux_fp8(out["aux_hidden"]))
    if "media_embeds" in out:   # the target's vision rows, in placeholder order: the draft's input under SGLang's rule
        tensors["media_embeds"] = out["media_embeds"].to(torch.bfloat16)
    return tensors


def write_shard(directory: Path, index: int, tensors: dict[str, torch.Tensor]) -> dict:
    """Write one shard atomically (refused before any byte when the disk lacks room); its manifest entry."""
    path = directory / shard_name(index)
    tmp = path.with_name(path.name + ".tmp")
    if short := short_of_space(directory, tensor_bytes(tensors) + SHARD_HEADER, path.name):
        raise DataError(f"{short}; nothing of it was written and the shards finished so far are kept: free space "
                        "and rerun extract, which resumes with this shard")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
    make_readable(tmp)
    os.replace(tmp, path)
    mask = tensors["loss_mask"].bool()
    counts = Counter(tensors["input_ids"][mask].tolist())
    return {"file": path.name, "tokens": int(tensors["input_ids"].numel()),
            "sequences": int(tensors["cu_seqlens"].numel() - 1), "loss_tokens": int(mask.sum()),
            "bytes": path.stat().st_size, "sha256": sha256_file(path),
            "loss_token_counts": {str(k): v for k, v in sorted(counts.items())}}


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if Path(directory).exists() and not Path(directory).is_dir():
        raise DataError(f"{directory}: a file, not a directory of shards (run extract.py first, or set train.data_dir "
                        "to its extract.output_dir)")
    manifest = read_json(path, DataError, "run extract.py first, or set train.data_dir")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {manifest.get('format_version')!r}; "
                        f"this version reads {FORMAT_VERSION}")
    for key in ("target", "aux_layer_ids", "shards"):
        if key not in manifest:
            raise DataError(f"{path}: missing field '{key}'")
    return manifest


def loss_token_counts(manifest: dict) -> Counter:
    total: Counter = Counter()
    for shard in manifest["shards"]:
        total.update({int(k): v for k, v in shard["loss_token_counts"].items()})
    return total


@dataclass(frozen=True)
class SeqRef:
    """One sequence: shard index, token range inside the shard, global sequence index."""
    shard: int
    start: int
    end: int
    index: int

    @property
    def length(self) -> int:
        return self.end - self.start


class ShardReader:
    """Random access to the sequences of an extraction directory."""
    lockstep = False   # reads are independent per rank (online's staged reads are not)

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.manifest = read_manifest(self.dir)
        self.files = [self.dir / s["file"] for s in self.manifest["shards"]]
        for path, entry in zip(self.files, self.manifest["shards"]):
            if not path.exists():
                raise DataError(f"{self.dir / MANIFEST}: lists {path.name}, which is missing")
            if "bytes" in entry and path.stat().st_size != entry["bytes"]:   # cheap: catches truncation
                raise DataError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry['bytes']} "
                                f"(truncated or replaced); {REDO}")
        self._handles: dict[int, object] = {}
        self.media_pad = self.manifest.get("media_pad_id")   # set when the target has a vision tower
        self._media_before: dict[int, dict[int, int]] = {}   # shard -> {a sequence's first row: pads before it}
        self.sequences: list[SeqRef] = []
        for s in range(len(self.files)):
            cu = self._handle(s).get_tensor("cu_seqlens").tolist()
            self.sequences += [SeqRef(s, a, b, len(self.sequences) + i) for i, (a, b) in enumerate(zip(cu, cu[1:]))]

    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = open_safetensors(self.files[shard], DataError, REDO)
        return self._handles[shard]

    def read_many(self, batches: list[list[SeqRef]], pin: bool = False, rows=None) -> list[Batch]:
        return [self.read(refs, pin, rows) for refs in batches]

    def read(self, refs: list[SeqRef], pin: bool = False, rows=None) -> Batch:
        """`refs` packed into one batch with its own cu_seqlens (fp8 shards add `aux_scale`: `Batch.to` decodes);
        `pin`: gathered straight from the mapped files into pinned memory, one copy instead of two; `rows(T)`: only
        the packed rows [start, end) it gives are read (a context-parallel rank's, `eagle3.data.batch.window`)."""
        keys = [k for k in self._handle(0).keys() if k not in ("cu_seqlens", "media_embeds")]
        cu = torch.tensor([0] + [r.length for r in refs], dtype=torch.int64).cumsum(0)
        T = int(cu[-1])
        start, end = (0, T) if rows is None else rows(T)
        pieces = [(r, max(start - o, 0), min(end - o, r.length)) for r, o in zip(refs, cu.tolist())]
        pieces = [(r, a, b) for r, a, b in pieces if a < b]
        batch = {}
        for k in keys:   # views of the mapped files
            parts = [self._handle(r.shard).get_slice(k)[r.start + a:r.start + b] for r, a, b in pieces]
            out = torch.empty(sum(len(p) for p in parts), *parts[0].shape[1:], dtype=parts[0].dtype, pin_memory=pin)
            batch[k] = torch.cat(parts, out=out)
        return Batch(**batch, cu_seqlens=cu, part=None if rows is None else Part(start, T),
                     media_embeds=self._media(pieces))

    def _media(self, pieces: list) -> torch.Tensor | None:
        """The vision rows of the pieces' placeholders, in order; None when their shards hold none."""
        if self.media_pad is None:
            return None
        parts = []
        for r, a, b in pieces:
            shard = self._handle(r.shard)
            if "media_embeds" not in shard.keys():
                continue
            if r.shard not in self._media_before:   # one count per sequence, kept; the shard's ids read once
                ids, cu = shard.get_tensor("input_ids"), shard.get_tensor("cu_seqlens")
                pads = media_positions(ids, self.media_pad, shard.get_tensor("loss_mask") == 0)
                before = torch.cat([cu.new_zeros(1), pads.long().cumsum(0)])[cu[:-1]]
                self._media_before[r.shard] = dict(zip(cu[:-1].tolist(), before.tolist()))
            window = slice(r.start, r.start + b)   # the sequence's, up to b
            pads = media_positions(shard.get_slice("input_ids")[window], self.media_pad,
                                   shard.get_slice("loss_mask")[window] == 0)
            first = self._media_before[r.shard][r.start] + int(pads[:a].sum())
            parts.append(shard.get_slice("media_embeds")[first:first + int(pads[a:].sum())])
        return torch.cat(parts) if parts else None


def check_manifest(manifest: dict, target: TextConfig, aux_ids: list[int], where: Path) -> None:
    """Refuse data extracted from another target or with other aux layers."""
    have = manifest["target"]
    for key, value in target.identity().items():
        if have.get(key) != value:
            raise DataError(f"{where}/manifest.json: target.{key} = {have.get(key)!r}, but the target "
                            f"at {target.source} has {value!r}; re-extract or point target.path at the "
                            "model the data came from")
    if manifest["aux_layer_ids"] != aux_ids:
        raise DataError(f"{where}/manifest.json: aux_layer_ids = {manifest['aux_layer_ids']}, but the "
                        f"config asks for {aux_ids} (target.aux_layer_ids)")
    if not manifest.get("complete"):
        raise DataError(f"{where}/manifest.json: the extraction is not complete; rerun extract.py")
    if not sum(s["loss_tokens"] for s in manifest["shards"]):   # the loss would be 0/0: nan, nothing learnt
        source = manifest.get("source", {}).get("path", "data.path")
        raise DataError(f"{where}/manifest.json: no assistant tokens: every loss_mask in the "
                        f"{len(manifest['shards'])} shards (extracted from {source}) is all zero, so there is "
                        "nothing to train on; the loss mask must be 1 on the assistant replies")
