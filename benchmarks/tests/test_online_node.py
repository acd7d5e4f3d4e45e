"""The online-placement bench (issue 15) and the 8-GPU node checks (issue 16) at toy size on the CPU:
the code a later GPU call runs, with what it measures checked."""
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks import moe, node, online, quality
from eagle3.data.shards import read_manifest
from eagle3.files import sha256_file
from eagle3.models.weights import Checkpoint
from eagle3.models.deepseek import DeepseekTarget
from eagle3.models.streaming import check_tensors

CPU = torch.device("cpu")


def test_the_written_target_is_a_kimi_checkpoint_of_the_generated_layers(tmp_path):
    started = time.perf_counter()
    written = online.write_target(tmp_path, online.TINY, CPU)
    # what it reports is what it wrote: the files' sizes (each at least its tensors), in a share of this call's time
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert not written["reused"] and len(files) == online.TINY["layers"] + 1
    assert written["bytes"] == sum(f.stat().st_size for f in files)
    assert written["bytes"] >= sum(t.nbytes for f in files for t in load_file(f).values())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == written["bytes"]
    assert 0 < written["seconds"] < time.perf_counter() - started
    assert online.write_target(tmp_path, online.TINY, CPU) == {"reused": True}
    ckpt = Checkpoint(tmp_path)
    assert ckpt.config.model_type == "kimi_k25" and ckpt.prefix == "language_model.model."
    assert ckpt.has("layers.1.mlp.experts.7.down_proj.weight_packed")   # int4 experts, layer 0 dense
    assert not ckpt.has("layers.0.mlp.experts.0.up_proj.weight_packed") and ckpt.has("layers.0.mlp.up_proj.weight")
    loaded = DeepseekTarget(ckpt, CPU, torch.bfloat16)
    check_tensors(ckpt, loaded)                    # every tensor the forward reads is there
    torch.manual_seed(0)                           # the writer's draws, in its order: layers 0..3
    made = moe.GeneratedKimi(moe.GeneratedCheckpoint(ckpt.config, CPU), CPU, torch.bfloat16)
    for i in range(4):
        want, got = made.load_layer(i), loaded.load_layer(i)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), (i, key)
    # the head keeps only the data's ids: the target's greedy token is always in the draft vocabulary
    head, ids = ckpt.get("lm_head.weight"), online.data_ids(online.TINY)
    kept = head.abs().sum(-1) > 0
    assert kept.sum() == len(ids) and kept[ids].all()


@pytest.mark.slow
def test_every_placement_trains_the_same_tokens_and_is_measured(tmp_path, capsys):
    rows_file = tmp_path / "rows.jsonl"
    started = time.perf_counter()
    online.main(["--tiny", "--dir", str(tmp_path), "--json", str(rows_file)])
    elapsed = time.perf_counter() - started
    rows = {r["placement"]: r for r in map(json.loads, rows_file.read_text().splitlines())}
    assert tuple(rows) == online.PLACEMENTS
    d = online.TINY["draft"]
    tokens = online.TINY["steps"] * 2 * d["seqs"] * d["seq_len"]
    trained = tokens // d["seq_len"] * (d["seq_len"] - d["user"])   # layout (a): a row per token after the user turn
    # the placements' launches take most of this test's time, and no more than it
    assert elapsed / 2 < sum(r["wall_s"] for r in rows.values()) < elapsed
    for r in rows.values():
        assert r["ranks"] == 2 and r["tokens"] == tokens and r["peak_gib"] is None   # no GPU here
        assert r["wall_s"] == pytest.approx(sum(r["phase_wall_s"].values()))
        assert r["wall_tokens_per_s"] == pytest.approx(tokens / r["wall_s"])
        assert r["gpu_s_per_1k_tokens"] == pytest.approx(2000 / r["tokens_per_s"])
        for phase, reports in r["reports"].items():   # each rank's timed run inside its phase's launch
            assert [x["rank"] for x in reports] == [0, 1]
            assert all(0 < x["seconds"] < r["phase_wall_s"][phase] for x in reports), (phase, r)
        # the steady rates against the ranks' own clocks: the time they give all the work fits in the timed runs
        # (a median of the windows after the first), and is no tiny share of them (start-up and compiling included)
        train_s = max(x["seconds"] for x in r["reports"]["train"])
        draft = r["draft_tokens_per_s"] if r["placement"] == "offline" else r["tokens_per_s"]
        assert train_s / 50 < trained / draft < 2 * train_s, r
        target_s = max(x["seconds"] for x in r["reports"]["extract"]) if r["placement"] == "offline" else train_s
        assert target_s / 50 < tokens / r["target_tokens_per_s"] < 3 * target_s, r
        if r["placement"] != "offline":   # the draft's time leaves out the waits for the target's batches
            assert r["draft_tokens_per_s"] >= r["tokens_per_s"]
        # the same data, seed and forward: every placement trained the same draft
        assert r["last_loss0"] == pytest.approx(rows["offline"]["last_loss0"], rel=1e-3)
    offline = rows["offline"]
    assert [x["rank"] for x in offline["reports"]["extract"]] == [0, 1]
    extract_then_train = 1 / (1 / offline["target_tokens_per_s"] + 1 / offline["draft_tokens_per_s"])
    assert offline["tokens_per_s"] == pytest.approx(extract_then_train)
    # offline alone wrote hidden states: at least aux (3 H) and final (H) in bf16 for every token
    hidden_bytes = tokens * 4 * online.TINY["model"]["hidden"] * 2
    for name in ("stream", "resident", "staged"):
        assert offline["disk_bytes"] - rows[name]["disk_bytes"] >= hidden_bytes
        assert rows[name]["disk_bytes"] == pytest.approx(rows["stream"]["disk_bytes"], rel=0.01)   # the checkpoint
    assert not (tmp_path / "runs" / "offline" / "hidden").exists()   # measured, then removed
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in table[2:]] == [f"| {p}" for p in online.PLACEMENTS]
    online.main(["--table", str(rows_file)])
    assert capsys.readouterr().out.splitlines() == table


def test_scaling_is_the_node_rate_over_the_one_gpu_rate():
    def row(world, layout, rate, same=True, syncs=0):
        return {"world": world, "layout": layout, "kernels": "triton-fp8", "tokens_per_s_per_gpu": rate,
                "same_weights_on_all_ranks": same, "host_syncs": syncs}
    one = [row(1, "a", 20000.0), row(1, "b", 30000.0)]
    many = [row(8, "a", 19500.0), row(8, "b", 27000.0, same=False, syncs=2), row(8, "c", 1.0)]
    a, b = node.scaling(one, many)
    assert a["scaling"] == pytest.approx(7.8) and a["meets"] and a["node"] == 156000
    assert b["scaling"] == pytest.approx(7.2) and not b["meets"] and not b["same_weights"] and b["host_syncs"] == 2
    assert "| a | triton-fp8 | 8 | 20,000 | 19,500 | 156,000 | 7.80x | True | True | 0, 0 |" in node.scaling_table([a, b])


def test_extraction_on_two_ranks_is_compared_shard_by_shard_with_one(tmp_path):
    started = time.perf_counter()
    node.main(["extract", "--tiny", "--ranks", "1,2", "--shards", "4", "--dir", str(tmp_path),
               "--json", str(tmp_path / "rows.jsonl")])
    elapsed = time.perf_counter() - started
    one, two = map(json.loads, (tmp_path / "rows.jsonl").read_text().splitlines())
    assert (one["ranks"], two["ranks"]) == (1, 2) and one["tokens"] == two["tokens"] == 4 * 512
    assert two["against"]["same_plan"] and two["against"]["shards"] == 4
    assert one["wall_s"] + two["wall_s"] < elapsed and two["speedup"] == pytest.approx(one["wall_s"] / two["wall_s"])
    for r in (one, two):
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        # from the shards' write times: each rank's shards after its first were written inside the launch
        assert r["steady_tokens_per_s"] * r["wall_s"] >= (4 - r["ranks"]) * 512, r
    # a shard that came out otherwise is found, and by how much
    altered = tmp_path / "altered"
    shutil.copytree(tmp_path / "hidden-1", altered)
    shard = read_manifest(altered)["shards"][2]
    tensors = load_file(altered / shard["file"])
    tensors["final_hidden"][5] += 1.0
    tensors["target_argmax"][:64] += 1
    save_file(tensors, altered / shard["file"])
    manifest = json.loads((altered / "manifest.json").read_text())
    manifest["shards"][2]["sha256"] = sha256_file(altered / shard["file"])
    (altered / "manifest.json").write_text(json.dumps(manifest))
    found = node.compare_shards(tmp_path / "hidden-1", altered, CPU)
    assert found["same_plan"] and found["bit_equal"] == 3
    assert found["max_abs_diff"]["final_hidden"] >= 0.5 and found["max_abs_diff"]["input_ids"] == 0
    assert found["argmax_agreement"] == pytest.approx(1 - 64 / shard["tokens"])


@pytest.mark.slow
def test_a_run_killed_on_two_ranks_resumes_to_the_uninterrupted_weights(tmp_path):
    node.main(["resume", "--tiny", "--ranks", "2", "--steps", "6", "--every", "2", "--kill-at", "2",
               "--dir", str(tmp_path), "--json", str(tmp_path / "r.jsonl")])
    (r,) = map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())
    assert r["killed_after"] < "step-00000006" and r["resumed"]
    assert r["bit_equal"] and r["max_abs_diff"] == 0 and r["floor_max_abs_diff"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU sees")
@pytest.mark.parametrize("harness,argv", [(online, []), (node, ["extract"]), (quality, [])])
def test_a_harness_on_a_cpu_machine_says_so_at_once(harness, argv):
    """No default that cannot run on a CPU: a one-line refusal naming --tiny, before any work."""
    with pytest.raises(SystemExit, match="needs a CUDA GPU.*--tiny"):
        harness.main(argv)
