"""The step bench's lab side (`benchmarks.step_lab`, `benchmarks.graph_check --varied`) at toy size on the CPU."""
import json

import torch

from benchmarks import graph_check, step_lab
from eagle3.bench import step
from eagle3.data.shards import ShardReader


def test_the_step_lab_trains_a_random_head_and_prompt_rows_when_asked(tmp_path):
    """--train-head and --prompt-rows reach the trainer's config: another first loss than the default's."""
    base = ["--tiny", "--layouts", "b", "--kernels", "torch", "--steps", "1", "--warmup", "1", "--dir", str(tmp_path)]
    for name, lab in (("default", []), ("head", ["--train-head"]), ("rows", ["--prompt-rows"])):
        step_lab.main(base + lab + ["--json", str(tmp_path / f"{name}.jsonl")])
    loss = {n: json.loads((tmp_path / f"{n}.jsonl").read_text())["first_step_loss"] for n in ("default", "head", "rows")}
    assert loss["head"] != loss["default"] != loss["rows"]
    assert step_lab.overrides(True, False)[-1] == "false" and step_lab.overrides(False, True)[-1] == "true"


def test_the_profile_tables_list_kernels_and_the_longest_gaps(tmp_path):
    from torch.profiler import profile

    with profile() as prof:
        torch.ones(4).sum()
    merged = [[0, 1000, "a", "b"], [4000, 5000, "c", "d"], [5500, 6000, "e", "f"]]
    step_lab.profile_tables(tmp_path / "p")(prof, merged, 0.01, "tiny-a-torch")
    text = (tmp_path / "p" / "profile-tiny-a-torch.txt").read_text()
    assert "GPU busy 2.5 ms" in text and text.index("3.00 ms  after b  before c") < text.index("0.50 ms  after d")
    assert (tmp_path / "p" / "profile-tiny-a-torch.kernels.tsv").read_text().startswith("ms\tcalls\tkernel\n")


def test_varied_shards_hold_sequences_of_several_lengths_filling_each_shard(tmp_path):
    """graph_check --varied: batches whose sequence counts differ, so that several graphs are made."""
    s = dict(step.SIZES["tiny"], seqs=64)
    step.write_target(tmp_path / "target", s)
    step.write_shards(tmp_path / "data", tmp_path / "target", "b", s, 3, graph_check.varied)
    lengths = [r.length for r in ShardReader(tmp_path / "data").sequences]
    assert sum(lengths) == 3 * s["seqs"] * s["seq_len"] and min(lengths) >= 1 and max(lengths) <= 1024
    assert len(set(lengths)) > len(lengths) // 2   # not the fixed s["seq_len"] of the other benches
