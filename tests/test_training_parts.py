"""The trainer's parts on their own (eagle3/training/): the LR schedule, the data plan, the rules of the
output directory and of a resume (on hand-made directories and state dicts), the kernel choice and the
masked optimizer step. The Trainer that wires them is tested in test_training.py and test_reliability.py."""
import copy
import json
import re
import time
from types import SimpleNamespace

import pytest
import torch

from eagle3 import train_state
from eagle3.config import Config, ConfigError
from eagle3.data.batch import RowRule
from eagle3.data.shards import SeqRef
from eagle3.errors import TrainError
from eagle3.training import kernel_choice, resume, run_dir
from eagle3.training.loop import Unroll, masked_step
from eagle3.training.schedule import Plan, Schedule
from eagle3.ttt import Objective

# --- schedule.py ---------------------------------------------------------------------------------


def test_wsd_schedule_holds_lr_then_decays_linearly():
    wsd = Schedule(warmup=2, total=10, min_ratio=0.1, kind="wsd", decay_fraction=0.3)
    assert [round(wsd(s), 6) for s in range(12)] == [0.5, 1, 1, 1, 1, 1, 1, 1, 0.7, 0.4, 0.1, 0.1]
    whole = Schedule(warmup=2, total=10, min_ratio=0.1, kind="wsd", decay_fraction=1.0)   # never into warmup
    assert whole(1) == 1 and whole(2) == 1 and whole(6) == pytest.approx(0.55) and whole(10) == pytest.approx(0.1)
    cosine = Schedule(warmup=2, total=10, min_ratio=0.1)
    assert cosine(2) == 1 and cosine(6) == pytest.approx(0.55) and cosine(10) == pytest.approx(0.1)


def test_past_its_total_a_schedule_stays_at_its_final_ratio():
    """A run extended by a larger train.max_steps keeps the schedule's total: steps past it run at lr x min_lr_ratio."""
    for kind in ("cosine", "wsd"):
        schedule = Schedule(warmup=1, total=6, min_ratio=0.25, kind=kind)
        assert [schedule(s) for s in (6, 7, 100)] == pytest.approx([0.25] * 3), kind


def refs(lengths):
    return [SeqRef(shard=0, start=0, end=n, index=i) for i, n in enumerate(lengths)]


def test_a_step_reads_the_same_micro_batches_whatever_the_world_size():
    """Micro-batch s*world*accum + a*world + rank of the epoch's packing: 2 ranks x 1 and 1 rank x 2
    read the same micro-batches at every step, epoch after epoch."""
    data = refs([5, 7, 3, 8, 2, 6, 4, 9, 1, 5, 7, 3])
    two = Plan(data, budget=10, seed=3, world=2, accum=1, max_steps=0, epochs=3)
    one = Plan(data, budget=10, seed=3, world=1, accum=2, max_steps=0, epochs=3)
    assert one.total == two.total == sum(two.steps_in(e) for e in range(3)) > 3
    by_rank = [list(two.rank_batches(0, r)) for r in range(2)]
    together = [b for pair in zip(*by_rank) for b in pair]
    assert list(one.rank_batches(0, 0)) == together
    assert all(sum(r.length for r in batch) <= 10 for batch in together)
    # a resume at step s reads from where step s starts
    assert list(two.rank_batches(2, 1)) == by_rank[1][2:]
    e, j = two.locate(two.steps_in(0) + 1)
    assert (e, j) == (1, 1) and two.epoch(1) != two.epoch(0)   # each epoch its own shuffle


def test_max_steps_sets_the_total_and_too_little_data_is_refused_naming_it():
    data = refs([6, 6, 6, 6])
    assert Plan(data, budget=6, seed=0, world=1, accum=1, max_steps=9, epochs=1).total == 9
    with pytest.raises(TrainError, match=r"^shards x: its training split \(4 sequences, 24 tokens\) packs into 4 "
                                         r"micro-batches .* \(world size 2 x train.grad_accum 3\)"):
        Plan(data, budget=6, seed=0, world=2, accum=3, max_steps=0, epochs=1, data="shards x")


# --- run_dir.py ----------------------------------------------------------------------------------


def a_run(output_dir, steps=(3, 6)):
    for step in steps:
        (train_state.step_dir(output_dir, step)).mkdir(parents=True)
    (output_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    return output_dir


def test_what_counts_as_an_earlier_run(tmp_path):
    out = tmp_path / "train"
    assert run_dir.existing_run(out) == []
    out.mkdir()
    (out / "tensorboard").mkdir()   # not a run on its own
    assert run_dir.existing_run(out) == []
    a_run(out)
    (out / "export").mkdir()
    assert run_dir.existing_run(out) == ["checkpoints/step-00000006 and 1 older", "metrics.jsonl", "export"]
    with pytest.raises(TrainError, match=re.escape(f"c.toml: train.resume = \"never\", but train.output_dir {out} "
                                                   "already holds a run (checkpoints/step-00000006 and 1 older")):
        run_dir.refuse_existing_run(out, "c.toml")


def test_overwrite_moves_a_run_aside_whole_and_twice_in_one_second_apart(tmp_path, monkeypatch, capsys):
    real = time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, *t: ".old-20260101-120000" if fmt == run_dir.OLD_RUN
                        else real(fmt, *t))
    out = tmp_path / "train"
    assert run_dir.move_old_run(out) is None   # nothing there: nothing moved
    first = run_dir.move_old_run(a_run(out))
    second = run_dir.move_old_run(a_run(out, steps=(2,)))
    assert first.name == "train.old-20260101-120000" and second.name == "train.old-20260101-120000-1"
    assert run_dir.existing_run(first)[0] == "checkpoints/step-00000006 and 1 older"
    assert run_dir.existing_run(second)[0] == "checkpoints/step-00000002" and not out.exists()
    assert f"moved the old run in {out} to {first}" in capsys.readouterr().err


def test_prepare_applies_train_resume_to_the_output_dir(tmp_path):
    dist = SimpleNamespace(main=True, barrier=lambda: None)
    out = a_run(tmp_path / "train")
    for choice in ("auto", "DIR"):   # resumes: the run stays
        run_dir.prepare(out, choice, "c.toml", dist)
        assert run_dir.existing_run(out)
    with pytest.raises(TrainError, match="already holds a run"):
        run_dir.prepare(out, "never", "c.toml", dist)
    run_dir.prepare(out, "overwrite", "c.toml", dist)
    assert run_dir.existing_run(out) == [] and out.is_dir()   # moved aside, made anew
    assert [p.name[:len("train.old-")] for p in tmp_path.iterdir() if p != out] == ["train.old-"]


def test_kept_names_the_checkpoint_to_resume_from(tmp_path):
    cfg = SimpleNamespace(train=SimpleNamespace(output_dir=str(tmp_path)))
    assert run_dir.kept(cfg) == "no checkpoint written yet"
    a_run(tmp_path)   # step directories without state.json are not complete
    assert run_dir.kept(cfg) == "no checkpoint written yet"
    (train_state.step_dir(tmp_path, 6) / train_state.STATE).write_text("{}")
    assert run_dir.kept(cfg) == f"newest complete checkpoint {train_state.step_dir(tmp_path, 6)}"


# --- resume.py -----------------------------------------------------------------------------------


def state(**changes) -> dict:
    """A checkpoint's state.json as Trainer._state writes it, with `changes` ("train.seed": 1, "world_size": 2)."""
    s = {"config": Config().to_dict(), "resolved": {"aux_layer_ids": [1, 2, 3], "verifier_name": "a/b",
                                                   "data_dir": "/data", "draft_spec": {"hidden_size": 32}},
         "target": {"config_sha256": "abc"}, "world_size": 1, "step": 4, "schedule_total": 10,
         "float8_used": False, "float8_head_used": False}
    for key, value in changes.items():
        where, _, name = key.rpartition(".")
        section = s["config"][where] if where in s["config"] else s[where] if where else s
        section[name] = value
    return s


CKPT = "runs/x/checkpoints/step-00000004"


def test_a_resume_of_the_same_run_passes_and_one_changed_setting_is_named():
    was = state()
    resume.check(CKPT, was, copy.deepcopy(was), total=10)
    resume.check(CKPT, was, state(**{"resolved.verifier_name": "c/d"}), total=10)   # only a name in the export
    resume.check(CKPT, was, state(**{"train.max_steps": 20, "train.keep_checkpoints": 9}), total=20)
    for key, value in [("train.seed", 1), ("train.lr", 1.0), ("train.prompt_rows", False),
                       ("experimental.freeze_lm_head", False)]:
        section, name = key.split(".")
        with pytest.raises(TrainError, match=re.escape(
                f"{CKPT}/state.json: {key} was {json.dumps(was['config'][section][name])}, this run has "
                f"{json.dumps(value)}; a resumed run must keep it (set --{key}")):
            resume.check(CKPT, was, state(**{key: value}), total=10)
    with pytest.raises(TrainError, match=r"aux_layer_ids differs from this run's \(\[1, 2, 3\] vs \[1, 1, 1\]\); "
                                         "choose another train.output_dir"):
        resume.check(CKPT, was, state(**{"resolved.aux_layer_ids": [1, 1, 1]}), total=10)
    with pytest.raises(TrainError, match="target differs"):
        resume.check(CKPT, was, state(target={"config_sha256": "def"}), total=10)


def test_a_checkpoint_from_before_a_spec_field_resumes_with_its_default():
    """Checkpoints older than the draft's rope_scaling / sliding_window trained plain RoPE over all keys."""
    was = state()
    resume.check(CKPT, was, state(**{"resolved.draft_spec": {"hidden_size": 32, "rope_scaling": None,
                                                               "sliding_window": 0}}), total=10)
    yarn = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}
    with pytest.raises(TrainError, match="draft_spec differs"):
        resume.check(CKPT, was, state(**{"resolved.draft_spec": {"hidden_size": 32, "rope_scaling": yarn}}), total=10)

def test_a_resume_keeps_the_context_parallel_group():
    """train.context_parallel sets the micro-batches; a checkpoint from before the key had 1."""
    older = state()
    del older["config"]["train"]["context_parallel"]
    resume.check(CKPT, older, state(), total=10)
    with pytest.raises(TrainError, match="train.context_parallel was 1, this run has 2; a resumed run must keep it "
                                         r"\(set --train.context_parallel 1"):
        resume.check(CKPT, older, state(**{"train.context_parallel": 2}), total=10)


def test_decay_fraction_is_fixed_only_where_the_schedule_reads_it():
    cosine = state(**{"train.schedule": "cosine"})
    resume.check(CKPT, cosine, state(**{"train.schedule": "cosine", "train.decay_fraction": 0.5}), total=10)
    wsd = state(**{"train.schedule": "wsd"})
    with pytest.raises(TrainError, match="train.decay_fraction was"):
        resume.check(CKPT, wsd, state(**{"train.schedule": "wsd", "train.decay_fraction": 0.5}), total=10)


@pytest.mark.parametrize("was, now, said", [
    ((2, 1), (1, 2), None), ((4, 2), (8, 1), None), ((1, 4), (2, 2), None),
    ((2, 1), (4, 1), "this run's is world size 4 x train.grad_accum 1 = 4; a resumed run must keep it: "
                     "no train.grad_accum keeps it on 4 ranks (use a number of ranks that divides 2)"),
    ((4, 1), (2, 1), "train.grad_accum = 2 keeps it"),
    ((2, 3), (3, 1), "global batch is world size 2 x train.grad_accum 3 = 6 micro-batches per step, this run's "
                     "is world size 3 x train.grad_accum 1 = 3; a resumed run must keep it: train.grad_accum = 2")])
def test_a_resume_keeps_the_global_batch_on_any_world_size(was, now, said):
    ckpt = state(world_size=was[0], **{"train.grad_accum": was[1]})
    if said is None:
        resume.check_global_batch(CKPT, ckpt, *now)
        return
    with pytest.raises(TrainError, match=re.escape(said)):
        resume.check_global_batch(CKPT, ckpt, *now)


def test_a_run_may_be_extended_never_ended_before_its_checkpoint():
    resume.check_end(CKPT, state(step=6), total=6, max_steps=6)
    resume.check_end(CKPT, state(step=6), total=9, max_steps=9)
    with pytest.raises(TrainError, match=re.escape(f"{CKPT}/state.json: the checkpoint is at step 6, but this run "
                                                   "ends at step 5 (train.max_steps = 5)")):
        resume.check_end(CKPT, state(step=6), total=5, max_steps=5)


def test_which_checkpoint_train_resume_picks(tmp_path, capsys):
    assert resume.checkpoint("never", tmp_path) is None and resume.checkpoint("overwrite", tmp_path) is None
    assert resume.checkpoint(str(tmp_path / "elsewhere"), tmp_path) == tmp_path / "elsewhere"
    assert resume.checkpoint("auto", tmp_path) is None   # nothing there: a new run
    newest = train_state.step_dir(tmp_path, 6)
    newest.mkdir(parents=True)
    (newest / train_state.STATE).write_text('{"step": ')   # torn: no longer reads
    with pytest.raises(train_state.CheckpointError, match=re.escape(f"no checkpoint of the run reads any more: {newest}: ")):
        resume.checkpoint("auto", tmp_path)
    # an older one that reads (headers only: state.json, the weights, the optimizer archive)
    older = train_state.step_dir(tmp_path, 3)
    older.mkdir()
    (older / train_state.STATE).write_text('{"step": 3}')
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(1)}, str(older / train_state.MODEL))
    torch.save({"optimizer": {}}, older / "optimizer.pt")
    assert resume.checkpoint("auto", tmp_path, say=False) == older and capsys.readouterr().err == ""
    assert resume.checkpoint("auto", tmp_path) == older
    assert f"warning: resume skips {newest}, which no longer reads" in capsys.readouterr().err


def test_a_resume_says_which_fp8_or_graph_choice_changed():
    was, now = state(float8_used=True), state(float8_used=True)
    assert resume.path_changes(was, now) == ""
    assert resume.path_changes(was, state(float8_used=True, float8_head_used=True)) == \
        "; its steps so far ran without fp8 head GEMMs (train.float8_head), from here with"
    assert resume.path_changes(was, state()) == "; its steps so far ran with fp8 GEMMs (train.float8), from here without"
    assert resume.path_changes(state(cuda_graphs_used=False), state(float8_used=True, cuda_graphs_used=True)) == (
        "; its steps so far ran without fp8 GEMMs (train.float8), from here with; "
        "its steps so far ran without CUDA graphs (debug.cuda_graphs), from here with")
    assert resume.path_changes(state(), state(cuda_graphs_used=True)) == ""   # written before graphs were recorded


def test_the_resume_line_names_the_step_and_what_differs():
    assert resume.note(CKPT, state(), state()) == f"resumed from {CKPT} (step 4)"
    was = state(world_size=2, float8_used=True)
    now = state(world_size=1, **{"train.grad_accum": 2})
    assert resume.note(CKPT, was, now) == (
        f"resumed from {CKPT} (step 4; written by world size 2 x train.grad_accum 1, now 1 x 2: the same global "
        "batch; its steps so far ran with fp8 GEMMs (train.float8), from here without)")


# --- kernel_choice.py, loop.py's pieces ----------------------------------------------------------


def test_on_the_cpu_the_kernels_are_the_reference_and_the_fp8_head_is_refused():
    from eagle3.kernels import reference
    cpu = torch.device("cpu")
    spec = SimpleNamespace(head_dim=8, hidden_size=32, draft_vocab_size=128)
    for choice in ("auto", "torch"):
        cfg = SimpleNamespace(debug=SimpleNamespace(kernels=choice),
                              train=SimpleNamespace(float8_head=None, batch_tokens=64), source="c.toml")
        chosen = kernel_choice.choose(cfg, cpu, spec, draft_float8=False, say=False)
        assert chosen == kernel_choice.Kernels(reference.ttt_attention, reference.ttt_loss_steps, False)
    cfg.train.float8_head = True
    with pytest.raises(ConfigError, match="c.toml: train.float8_head = true needs the Triton loss on a GPU"):
        kernel_choice.choose(cfg, cpu, spec, draft_float8=True)


def test_on_cuda_heads_narrower_than_flex_compiles_take_the_reference_attention(capsys):
    """torch's flex_attention lowering refuses heads under 16 wide: a tiny draft on a GPU trains with the reference."""
    from eagle3.kernels import flex, reference
    cfg = SimpleNamespace(debug=SimpleNamespace(kernels="torch"),
                          train=SimpleNamespace(float8_head=False, batch_tokens=64), source="c.toml")
    gpu = torch.device("cuda", 0)
    for head_dim, expected in ((8, reference.ttt_attention), (16, flex.ttt_attention)):
        spec = SimpleNamespace(attention="gqa", head_dim=head_dim, hidden_size=32, draft_vocab_size=128)
        assert kernel_choice.choose(cfg, gpu, spec, draft_float8=False).attention is expected
    assert "flex_attention needs head dims of at least 16, got 8" in capsys.readouterr().err
    cfg.debug.kernels = "auto"   # the Triton attention serves no head of 8 either
    spec = SimpleNamespace(attention="gqa", head_dim=8, hidden_size=32, draft_vocab_size=128)
    assert kernel_choice.choose(cfg, gpu, spec, draft_float8=False, say=False).attention is reference.ttt_attention


def test_evaluation_unrolls_alike_on_assistant_rows_only():
    train = Unroll(torch.zeros(4, 2), torch.zeros(3, 2), 3, None, None, 0.8, True,
                   Objective(RowRule(prompt=True), loss="tv", temperature=0.7))
    evaluating = train.evaluating()
    assert evaluating.objective == Objective(RowRule(), loss="tv", temperature=0.7)
    assert (evaluating.embed, evaluating.steps, evaluating.decay) == (train.embed, 3, 0.8)


@pytest.mark.parametrize("fused", [False, True])   # fused: our CUDA optimizer, flag read on the device
def test_masked_step_changes_nothing_when_skipped(fused):
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=fused)
    for skip in (True, False, True):
        before = weight.detach().clone()
        weight.grad = torch.ones(4)
        masked_step(optimizer, torch.tensor(skip))
        assert torch.equal(weight.detach(), before) == skip
    assert float(optimizer.state[weight]["step"]) == 1
