import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_config
from eagle3 import extraction
from eagle3.data.inputs import InputError
from eagle3.data.shards import DataError, ShardReader, loss_token_counts, read_manifest, sha256_file


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
    reader = ShardReader(out, verify=True)
    batch = reader.read(reader.sequences[3:6])
    assert batch["cu_seqlens"].tolist()[-1] == batch["input_ids"].numel()
    assert batch["input_ids"][: len(lines[3]["input_ids"])].tolist() == lines[3]["input_ids"]


def test_chunk_size_does_not_change_shards(tmp_path, llama_target, token_data):
    a = extraction.run(make_config(tmp_path / "a", llama_target, token_data, **{"extract.chunk_tokens": 30}))
    b = extraction.run(make_config(tmp_path / "b", llama_target, token_data, **{"extract.chunk_tokens": 5000}))
    for shard in read_manifest(a)["shards"]:
        x, y = load_file(a / shard["file"]), load_file(b / shard["file"])
        for key in x:
            torch.testing.assert_close(x[key], y[key])


def test_killed_extraction_resumes_without_redoing(tmp_path, llama_target, token_data):
    cfg = make_config(tmp_path, llama_target, token_data)
    out = extraction.run(cfg)
    manifest = read_manifest(out)
    reference = {s["file"]: s["sha256"] for s in manifest["shards"]}
    # simulate a kill while writing the last shard: it is not in the manifest, a partial file is left
    last = manifest["shards"].pop()
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / last["file"]).unlink()
    (out / (last["file"] + ".tmp")).write_bytes(b"partial")
    stamps = {s["file"]: os.stat(out / s["file"]).st_mtime_ns for s in manifest["shards"]}
    extraction.run(cfg)
    resumed = read_manifest(out)
    assert resumed["complete"] and {s["file"]: s["sha256"] for s in resumed["shards"]} == reference
    assert all(os.stat(out / f).st_mtime_ns == t for f, t in stamps.items())  # finished shards untouched


def test_other_settings_refuse_existing_output(tmp_path, llama_target, token_data):
    extraction.run(make_config(tmp_path, llama_target, token_data))
    with pytest.raises(DataError, match="holds an extraction of other data, target or settings"):
        extraction.run(make_config(tmp_path, llama_target, token_data, **{"data.max_seq_len": 10}))


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


def test_bad_target_path(tmp_path, token_data):
    from eagle3.target.checkpoint import TargetError
    with pytest.raises(TargetError, match=r"nowhere: target directory not found"):
        extraction.run(make_config(tmp_path, tmp_path / "nowhere", token_data))
