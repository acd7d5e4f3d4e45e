import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, make_config
from eagle3 import extraction
from eagle3.data.inputs import InputError
from eagle3.data.shards import DataError, ShardReader, loss_token_counts, read_manifest
from eagle3.files import sha256_file


def test_shards_and_honest_manifest(tmp_path, llama_target, token_data):
    cfg = make_config(tmp_path, llama_target, token_data)
    out = extraction.run(cfg)
    manifest = read_manifest(out)
    lines = [json.loads(x) for x in token_data.read_text().splitlines()]
    assert manifest["complete"] and len(manifest["shards"]) > 2
    assert sum(s["tokens"] for s in manifest["shards"]) == sum(len(x["input_ids"]) for x in lines)
    assert sum(s["sequences"] for s in manifest["shards"]) == len(lines) == manifest["source"]["sequences"]
    assert manifest["aux_layer_ids"] == [1, 1, 1] and manifest["target"]["hidden_size"] == 32
    expected = {}
    for x in lines:
        for i, m in zip(x["input_ids"], x["loss_mask"]):
            if m:
                expected[i] = expected.get(i, 0) + 1
    assert dict(loss_token_counts(manifest)) == expected
    first = load_file(out / manifest["shards"][0]["file"])
    assert first["input_ids"].dtype == torch.int32 and first["loss_mask"].dtype == torch.uint8
    assert first["aux_hidden"].shape == (first["input_ids"].numel(), 96)
    assert first["aux_hidden"].dtype == first["final_hidden"].dtype == torch.bfloat16
    assert first["target_argmax"].dtype == torch.int32 and first["cu_seqlens"].dtype == torch.int64
    for shard in manifest["shards"]:
        assert sha256_file(out / shard["file"]) == shard["sha256"]
    reader = ShardReader(out)
    batch = reader.read(reader.sequences[3:6])
    assert batch.cu_seqlens.tolist()[-1] == batch.input_ids.numel()
    assert batch.input_ids[: len(lines[3]["input_ids"])].tolist() == lines[3]["input_ids"]


def test_chunk_size_does_not_change_shards(tmp_path, llama_target, token_data):
    a = extraction.run(make_config(tmp_path / "a", llama_target, token_data, **{"debug.chunk_tokens": 30}))
    b = extraction.run(make_config(tmp_path / "b", llama_target, token_data, **{"debug.chunk_tokens": 5000}))
    for shard in read_manifest(a)["shards"]:
        x, y = load_file(a / shard["file"]), load_file(b / shard["file"])
        for key in x:
            torch.testing.assert_close(x[key], y[key])


def test_killed_extraction_resumes_without_redoing(tmp_path, llama_target, token_data):
    cfg = make_config(tmp_path, llama_target, token_data)
    out = extraction.run(cfg)
    manifest = read_manifest(out)
    reference = {s["file"]: s["sha256"] for s in manifest["shards"]}
    # simulate a kill while writing the last shard: no journal entry, no manifest, a partial temp file
    last = manifest["shards"][-1]["file"]
    (out / ".entries" / (last + ".json")).unlink()
    (out / last).rename(out / (last + ".tmp"))
    (out / "manifest.json").write_text(json.dumps({**manifest, "shards": [], "complete": False}))
    stamps = {f: os.stat(out / f).st_mtime_ns for f in reference if f != last}
    extraction.run(cfg)
    resumed = read_manifest(out)
    assert resumed["complete"] and {s["file"]: s["sha256"] for s in resumed["shards"]} == reference
    assert all(os.stat(out / f).st_mtime_ns == t for f, t in stamps.items())  # finished shards untouched


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])   # 3: shards split unevenly
def test_n_ranks_write_the_same_shards(tmp_path, llama_target, token_data, ranks):
    single = extraction.run(make_config(tmp_path / "one", llama_target, token_data))
    args = [f"--target.path={llama_target}", f"--data.path={token_data}", "--debug.extract_device=cpu",
            f"--extract.output_dir={tmp_path / 'two'}", "--debug.shard_tokens=400", "--debug.chunk_tokens=300",
            "--extract.dtype=float32"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           "extract.py", "--config", "config.toml", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = read_manifest(single), read_manifest(tmp_path / "two")
    assert b["complete"] and [(s["file"], s["tokens"]) for s in a["shards"]] == \
        [(s["file"], s["tokens"]) for s in b["shards"]]
    for shard in a["shards"]:  # same values (thread counts differ, so not bit for bit)
        x, y = load_file(single / shard["file"]), load_file(tmp_path / "two" / shard["file"])
        for key in x:
            torch.testing.assert_close(x[key], y[key])


def test_fp8_aux_storage_is_read_back_transparently(tmp_path, llama_target, token_data):
    bf16 = extraction.run(make_config(tmp_path / "bf16", llama_target, token_data))
    fp8 = extraction.run(make_config(tmp_path / "fp8", llama_target, token_data,
                                     **{"extract.aux_dtype": "float8_e4m3fn"}))
    manifest = read_manifest(fp8)
    assert manifest["dtypes"]["aux_hidden"] == "float8_e4m3fn"
    size = lambda d: sum(p.stat().st_size for p in d.glob("shard-*.safetensors"))  # noqa: E731
    assert size(fp8) < 0.8 * size(bf16)
    refs = ShardReader(fp8).sequences[:4]
    batch, exact = ShardReader(fp8).read(refs), ShardReader(bf16).read(refs)
    assert batch.aux_hidden.dtype == torch.float8_e4m3fn and batch.aux_scale.shape == (
        batch.input_ids.numel(), 3)
    decoded = batch.to(torch.device("cpu"), torch.float32).aux_hidden
    err = (decoded - exact.aux_hidden.float()).norm() / exact.aux_hidden.float().norm()
    assert err < 0.05


def test_other_settings_refuse_existing_output(tmp_path, llama_target, token_data):
    extraction.run(make_config(tmp_path, llama_target, token_data))
    with pytest.raises(DataError, match="holds an extraction of other data, target or settings"):
        extraction.run(make_config(tmp_path, llama_target, token_data, **{"data.max_seq_len": 10}))
    manifest = tmp_path / "hidden" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])   # a damaged manifest: the rerun names it and the way out
    with pytest.raises(DataError, match=f"^{manifest}: not valid JSON .*; delete the directory to start over$"):
        extraction.run(make_config(tmp_path, llama_target, token_data))


def test_bad_lines_reported_with_line_numbers(tmp_path, llama_target):
    data = tmp_path / "bad.jsonl"
    good = json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]})
    data.write_text("\n".join([good, "{oops", json.dumps({"input_ids": [1, 2], "loss_mask": [1]}),
                               json.dumps({"input_ids": [1, 9999], "loss_mask": [1, 1]}), good]) + "\n")
    cfg = make_config(tmp_path, llama_target, data)
    with pytest.raises(InputError, match=r"bad.jsonl:2: .*data.on_error"):
        extraction.run(cfg)
    cfg = make_config(tmp_path, llama_target, data, **{"data.on_error": "skip"})
    out = extraction.run(cfg)
    source = read_manifest(out)["source"]
    assert source["skipped_lines"] == 3 and source["skipped_line_numbers"] == [2, 3, 4]
    assert source["sequences"] == 2


def test_inputs_of_the_wrong_kind_or_encoding_are_named(tmp_path, llama_target, monkeypatch):
    """A line that is not UTF-8 is that line's error (skippable); a directory or a FIFO as data.path
    and a config file that is not UTF-8 are named in one line; `skip` skips any per-line failure."""
    from eagle3.config import ConfigError, load
    from eagle3.data import inputs
    data = tmp_path / "bytes.jsonl"
    good = json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}).encode()
    data.write_bytes(b"\n".join([good, b'{"input_ids": [5, 6], "loss_mask": [0, 1], "note": "caf\xe9"}', good]) + b"\n")
    with pytest.raises(InputError, match=r"bytes.jsonl:2: not UTF-8 text \(byte 55: b'\\xe9'\).*data.on_error"):
        extraction.run(make_config(tmp_path, llama_target, data))
    out = extraction.run(make_config(tmp_path, llama_target, data, **{"data.on_error": "skip",
                                                                       "extract.output_dir": tmp_path / "h2"}))
    assert read_manifest(out)["source"]["skipped_line_numbers"] == [2]
    # a failure of another kind inside one line's parsing is skipped like any other
    real = inputs._parse_tokens
    monkeypatch.setattr(inputs, "_parse_tokens", lambda obj, v: real(obj, v) if len(obj["input_ids"]) != 2
                        else {}["boom"])
    records, stats = inputs.read_records(data, 256, 64, "skip")
    assert stats.skipped_lines == [2] and len(records) == 2
    for bad, kind in ((tmp_path, "a directory"), (tmp_path / "fifo", "not a regular file")):
        if kind != "a directory":
            os.mkfifo(bad)
        with pytest.raises(InputError, match=f"^{bad}: {kind}; data.path must name a JSON-lines file$"):
            extraction.run(make_config(tmp_path, llama_target, bad))
    toml = tmp_path / "c.toml"
    toml.write_bytes(b'[train]\nlr = 1e-4\n# r\xe9sum\xe9\n')
    with pytest.raises(ConfigError, match=r"c.toml:3: not UTF-8 text"):
        load(toml)
    with pytest.raises(ConfigError, match="a directory, not a TOML config file"):
        load(tmp_path)


def test_bad_target_path(tmp_path, token_data):
    from eagle3.models.weights import TargetError
    with pytest.raises(TargetError, match=r"nowhere: target directory not found"):
        extraction.run(make_config(tmp_path, tmp_path / "nowhere", token_data))


def test_reused_directory_after_deleting_the_manifest_redoes_every_shard(tmp_path, llama_target, token_data):
    out = extraction.run(make_config(tmp_path, llama_target, token_data))
    (out / "manifest.json").unlink()
    other = tmp_path / "other.jsonl"
    other.write_text("".join(line + "\n" for line in token_data.read_text().splitlines()[::-1]))
    extraction.run(make_config(tmp_path, llama_target, other))
    assert all(sha256_file(out / s["file"]) == s["sha256"] for s in read_manifest(out)["shards"])
    reader = ShardReader(out)
    first = json.loads(other.read_text().splitlines()[0])["input_ids"]
    assert reader.read(reader.sequences[:1]).input_ids.tolist() == first


def test_windows_train_long_sequences_as_windows(tmp_path, llama_target, token_data):
    """data.windows = [0.5, 16]: every other sequence longer than 16 tokens becomes windows that the target
    reads alone (two unlabelled tokens of context before each), every loss token labelled once either way."""
    lines = [json.loads(x) for x in token_data.read_text().splitlines()]
    whole = extraction.run(make_config(tmp_path / "whole", llama_target, token_data))
    cut = extraction.run(make_config(tmp_path / "cut", llama_target, token_data,
                                     **{"data.windows": "[0.5, 16]"}))
    a, b = read_manifest(whole), read_manifest(cut)
    long = [i for i, x in enumerate(lines) if len(x["input_ids"]) > 16]
    assert b["source"]["windowed"] == len(long) // 2 > 0 and "windowed" not in a["source"]
    assert loss_token_counts(b) == loss_token_counts(a)
    x, y = ShardReader(whole), ShardReader(cut)
    first = long[1]                      # the second long sequence is the first cut, those before it whole
    ids = lines[first]["input_ids"]
    win0, win1 = y.read([y.sequences[first]]), y.read([y.sequences[first + 1]])
    full = x.read([x.sequences[first]])
    assert win0.input_ids.tolist() == ids[:16] and win1.input_ids.tolist() == ids[14:32]
    assert win1.loss_mask[:2].tolist() == [0, 0] and win1.loss_mask[2:].tolist() == lines[first]["loss_mask"][16:32]
    # the first window is the sequence's prefix: the same states; the second reads no context before its lead tokens
    torch.testing.assert_close(win0.aux_hidden, full.aux_hidden[:16])
    assert not torch.allclose(win1.aux_hidden[2:].float(), full.aux_hidden[16:32].float(), atol=1e-2)
    # a row labels the token two ahead: the windows label each token the whole sequence labels, once
    labelled = [t for w in (win0, win1) for t in w.input_ids[2:].tolist()]
    assert labelled == ids[2:32]
    with pytest.raises(DataError, match="holds an extraction of other data, target or settings"):
        extraction.run(make_config(tmp_path / "cut", llama_target, token_data, **{"data.windows": "[0.25, 16]"}))


def test_windows_leave_media_sequences_whole():
    import numpy as np
    from eagle3.data.inputs import Record, windowed
    ids, mask = np.arange(40, dtype=np.int32), np.ones(40, dtype=np.uint8)
    records = [Record(1, ids, mask, media=["an image"]), Record(2, ids, mask), Record(3, ids[:10], mask[:10])]
    out, cut = windowed(records, 1.0, 16)
    assert cut == 1 and [(r.line, len(r.input_ids)) for r in out] == [(1, 40), (2, 16), (2, 18), (2, 10), (3, 10)]
    assert [int(r.loss_mask.sum()) for r in out] == [40, 16, 16, 8, 10]
    assert windowed(records, 0.0, 16) == (records, 0)
