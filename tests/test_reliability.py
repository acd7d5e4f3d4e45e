"""Issue 13, "nothing lost, nothing silent": what a user meets with a used output directory, damaged
files, data that cannot train, NaN metrics, file modes, untrusted checkpoints and a full disk."""
import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, make_config
from eagle3 import train_state
from eagle3 import evaluate, extraction, training
from eagle3.config import Config, ConfigError
from eagle3.data.inputs import InputError
from eagle3.data.shards import DataError, ShardReader, read_manifest
from eagle3.files import sha256_file
from eagle3.files import FILE_MODE, strict_json
from eagle3.models.weights import Checkpoint, TargetError


def config(tmp_path, llama_target, token_data, hidden, **overrides):
    return make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden,
                                                              "debug.kernels": "torch", **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, llama_target, token_data, hidden):
    """A finished 6-step run (checkpoints at 3 and 6, exports) and what it printed; not modified."""
    tmp = tmp_path_factory.mktemp("trained")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        training.run(config(tmp, llama_target, token_data, hidden))
    return tmp, printed.getvalue()


def snapshot(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def strict_loads(text):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


# --- a used output directory ---------------------------------------------------------------------

def test_resume_never_refuses_a_directory_holding_a_run(tmp_path, llama_target, token_data, hidden, trained):
    run_tmp, _ = trained
    out = run_tmp / "train"
    before = snapshot(out)
    with pytest.raises(training.TrainError) as e:
        training.Trainer(config(run_tmp, llama_target, token_data, hidden, **{"train.resume": "never"}))
    message = str(e.value)
    for part in (f"train.output_dir {out} already holds a run", "checkpoints/step-00000006 and 1 older",
                 "metrics.jsonl", "export", "choose another train.output_dir, or set train.resume = \"overwrite\", "
                 f"which moves the old run, whole, to {out}.old-YYYYmmdd-HHMMSS"):
        assert part in message, (part, message)
    assert snapshot(out) == before   # nothing truncated, nothing deleted

    # a run killed before its first checkpoint left only metrics.jsonl: still a run
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text('{"step": 2, "split": "train"}\n')
    with pytest.raises(training.TrainError, match=r"holds a run \(metrics.jsonl\)"):
        training.Trainer(config(tmp_path, llama_target, token_data, hidden, **{"train.resume": "never"}))
    # an empty directory holds no run
    (tmp_path / "train" / "metrics.jsonl").unlink()
    assert training.Trainer(config(tmp_path, llama_target, token_data, hidden,
                                   **{"train.resume": "never"})).start_step == 0


def test_overwrite_moves_the_old_run_aside_whole(tmp_path, llama_target, token_data, hidden, trained, capsys):
    run_tmp, _ = trained
    out = tmp_path / "train"
    shutil.copytree(run_tmp / "train", out)
    before = {p.relative_to(out): data for p, data in snapshot(out).items()}
    old_steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    training.run(config(tmp_path, llama_target, token_data, hidden,
                        **{"train.resume": "overwrite", "train.max_steps": 2,
                           "debug.log_every": 1}))
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("train.old-")]
    assert len(moved) == 1 and re.fullmatch(r"train\.old-\d{8}-\d{6}", moved[0].name), moved
    assert f"moved the old run in {out} to {moved[0]}" in capsys.readouterr().err
    assert {p.relative_to(moved[0]): data for p, data in snapshot(moved[0]).items()} == before   # intact
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2] and max(old_steps) == 6
    assert [p.name for p in train_state.complete_checkpoints(out)] == ["step-00000002"]   # none of the old run's
    # the key it replaced names its successor
    with pytest.raises(ConfigError, match='train.overwrite is gone: now train.resume = "overwrite"'):
        config(tmp_path, llama_target, token_data, hidden, **{"train.overwrite": "true"})


def test_resume_mismatch_points_at_another_output_dir(llama_target, token_data, hidden, trained):
    run_tmp, _ = trained
    with pytest.raises(training.TrainError, match="train.seed was 0, this run has 1") as e:
        training.Trainer(config(run_tmp, llama_target, token_data, hidden, **{"train.seed": 1}))
    assert "choose another train.output_dir" in str(e.value) and "never" not in str(e.value)


def test_a_resume_on_shards_extracted_again_at_the_same_path_stops(tmp_path, llama_target, token_data):
    """Issue 46, row 2: the shards at train.data_dir replaced by another extraction (other data at the same
    paths) are not resumed on: the checkpoint recorded the manifest's plan_key."""
    data = tmp_path / "data.jsonl"
    lines = token_data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines))
    settings = {"train.max_steps": 3, "debug.kernels": "torch"}
    extraction.run(make_config(tmp_path, llama_target, data))
    training.run(make_config(tmp_path, llama_target, data, **settings))
    shutil.rmtree(tmp_path / "hidden")                       # extract's own advice: delete the whole directory
    data.write_text("".join(lines[:40]))
    extraction.run(make_config(tmp_path, llama_target, data))
    with pytest.raises(training.TrainError) as e:
        training.run(make_config(tmp_path, llama_target, data, **{**settings, "train.max_steps": 6}))
    checkpoint = tmp_path / "train" / "checkpoints" / "step-00000003"
    assert str(e.value).startswith(f"{checkpoint}/state.json: the checkpoint trained on other shards than "
                                   f"{tmp_path / 'hidden'} holds now (manifest plan_key "), str(e.value)
    assert train_state.latest(tmp_path / "train") == checkpoint


def test_a_larger_max_steps_extends_a_finished_run_at_the_final_lr(tmp_path, llama_target, token_data, hidden,
                                                                    trained):
    run_tmp, _ = trained
    out = tmp_path / "train"
    shutil.copytree(run_tmp / "train", out)
    with pytest.raises(training.TrainError) as e:   # never ending before the checkpoint
        training.Trainer(config(tmp_path, llama_target, token_data, hidden, **{"train.max_steps": 5}))
    for part in (f"{out / 'checkpoints' / 'step-00000006'}/state.json: the checkpoint is at step 6, but this run "
                 "ends at step 5 (train.max_steps = 5)", "set train.max_steps >= 6"):
        assert part in str(e.value), (part, str(e.value))
    cfg = config(tmp_path, llama_target, token_data, hidden, **{"train.max_steps": 9, "debug.log_every": 1})
    trainer = training.Trainer(cfg)
    assert trainer.start_step == 6 and trainer.schedule.total == 6 and trainer.plan.total == 9
    trainer.run()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["split"] == "train"}
    assert [s for s in train if s > 6] == [7, 8, 9]
    final = cfg.train.lr * cfg.train.min_lr_ratio
    for step in (7, 8, 9):   # the lr the next step uses: past the old end, the schedule's final one
        assert train[step]["lr"] == pytest.approx(final, rel=1e-12)
    assert train[6]["lr"] == pytest.approx(final, rel=1e-12)   # the old run ended there
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(final, rel=1e-12)
    state = train_state.read_state(train_state.latest(out))
    assert state["step"] == 9 and state["schedule_total"] == 6 and state["config"]["train"]["max_steps"] == 9


@pytest.mark.slow
def test_resume_on_another_world_size_keeps_the_global_batch(tmp_path, llama_target, token_data, hidden):
    from test_training import cli_args, final_weights, run_train
    two = tmp_path / "two"   # uninterrupted: 2 ranks x grad_accum 1, checkpoints at 2, 4, 6
    run_train(cli_args(two, llama_target, token_data, hidden), nproc=2)
    middle = two / "train" / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in middle.glob("rng-rank*.pt")) == ["rng-rank0.pt", "rng-rank1.pt"]
    one = tmp_path / "one"   # from its step 2 on: 1 rank x grad_accum 2
    out = run_train(cli_args(one, llama_target, token_data, hidden,
                             **{"train.resume": middle, "train.grad_accum": 2}))
    assert f"resumed from {middle} (step 2; written by world size 2 x train.grad_accum 1, now 1 x 2" in out.stderr
    assert "warning" not in out.stderr   # rank 1's RNG file is not this run's: not read, no warning
    a, b = final_weights(two / "train"), final_weights(one / "train")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)
    # another global batch is refused, naming both products and the grad_accum that keeps it
    for accum, hint in ((1, "train.grad_accum = 2 keeps it"), (3, "train.grad_accum = 2 keeps it")):
        bad = subprocess.run([sys.executable, "train.py", "--config", "config.toml",
                              *cli_args(tmp_path / f"bad{accum}", llama_target, token_data, hidden,
                                        **{"train.resume": middle, "train.grad_accum": accum})],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr
        for part in ("world size 2 x train.grad_accum 1 = 2 micro-batches per step",
                     f"world size 1 x train.grad_accum {accum} = {accum}", hint):
            assert part in bad.stderr, (part, bad.stderr)


# --- damaged files -------------------------------------------------------------------------------

def truncate(path, keep=None):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2 if keep is None else keep])


def test_truncated_target_safetensors_names_the_file(tmp_path, llama_target, token_data):
    target = tmp_path / "target"
    shutil.copytree(llama_target, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    damaged = target / index["model.embed_tokens.weight"]
    truncate(damaged)
    out = subprocess.run([sys.executable, "-m", "eagle3", "inspect", str(target)], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"error: {damaged}: not a readable safetensors file") and \
        len(out.stderr.strip().splitlines()) == 1, out.stderr
    with pytest.raises(TargetError, match=f"{damaged}: not a readable safetensors file"):
        extraction.run(make_config(tmp_path, target, token_data))
    # a single-file target is opened at once
    single = tmp_path / "single"
    shutil.copytree(llama_target, single)
    for name in set(index.values()):
        (single / name).unlink()
    (single / "model.safetensors.index.json").unlink()
    (single / "model.safetensors").write_bytes(b"\x10\x00\x00")   # cut inside the header's length
    with pytest.raises(TargetError, match=f"{single / 'model.safetensors'}: not a readable safetensors file"):
        Checkpoint(single)


@pytest.mark.parametrize("constant", ["NaN", "Infinity"])
def test_a_non_finite_number_in_the_target_config_is_refused_naming_the_field(tmp_path, llama_target, capsys,
                                                                             constant):
    """Issue 46, row 3: Python's JSON reads NaN and Infinity; a target config holding one is refused at read
    time (inspect, extract, train), naming the field."""
    from eagle3.__main__ import main
    target = tmp_path / "target"
    shutil.copytree(llama_target, target)
    text = (target / "config.json").read_text()
    (target / "config.json").write_text(re.sub(r'"rms_norm_eps": [^,]+', f'"rms_norm_eps": {constant}', text))
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(target)])
    assert e.value.code == f"error: {target / 'config.json'}: field 'rms_norm_eps' = {constant}; expected a finite " \
                           "number (NaN and Infinity are not numbers a model config can use)"
    assert capsys.readouterr().out == ""


def test_extraction_stops_at_a_shard_with_non_finite_states_naming_it_and_the_layer(tmp_path, llama_target,
                                                                                  token_data, monkeypatch):
    """Issue 46, row 3: states that are NaN or inf are never written as a shard; the finished shards stay."""
    from eagle3.models.streaming import TargetRunner

    class Broken(TargetRunner):   # the second shard's layer-2 states come out NaN
        calls = 0

        def run(self, *args):
            states, Broken.calls = super().run(*args), Broken.calls + 1
            if Broken.calls == 2:
                states["aux_hidden"][3, 32 + 5] = float("nan")
            return states
    monkeypatch.setattr(extraction, "TargetRunner", Broken)
    cfg = make_config(tmp_path, llama_target, token_data, **{"target.aux_layer_ids": "[1, 2, 3]"})
    out = tmp_path / "hidden"
    with pytest.raises(DataError) as e:
        extraction.run(cfg)
    assert str(e.value).startswith(f"{out / 'shard-00001.safetensors'}: the target's output of layer 2 (aux_hidden) "
                                   "holds 1 of "), str(e.value)
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.safetensors"]
    monkeypatch.undo()
    extraction.run(cfg)                                  # resumes with the shard that stopped it
    assert read_manifest(out)["complete"]


def test_truncated_shard_is_named_in_training_and_redone_by_extract(tmp_path, llama_target, token_data, hidden,
                                                                    capsys):
    copy = tmp_path / "hidden"
    shutil.copytree(hidden, copy)
    shards = {s["file"]: s["sha256"] for s in read_manifest(copy)["shards"]}
    truncated, altered = copy / "shard-00001.safetensors", copy / "shard-00002.safetensors"
    truncate(truncated)
    data = bytearray(altered.read_bytes())   # same size, other bytes: only sha256 sees it
    data[-5] ^= 0xFF
    altered.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{truncated}: .* bytes, the manifest says .*rerun extract"):
        training.run(config(tmp_path, llama_target, token_data, copy))
    # a manifest without sizes (older extractions): opening the shard names it
    manifest = json.loads((copy / "manifest.json").read_text())
    for shard in manifest["shards"]:
        del shard["bytes"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=f"{truncated}: not a readable safetensors file"):
        ShardReader(copy)

    capsys.readouterr()
    extraction.run(make_config(tmp_path, llama_target, token_data))   # extract.output_dir = copy
    err = capsys.readouterr().err
    assert f"{truncated}: " in err and f"{altered}: sha256 differs from its journal entry; redoing it" in err
    assert {s["file"]: s["sha256"] for s in read_manifest(copy)["shards"]} == shards
    assert all(sha256_file(copy / f) == h for f, h in shards.items())
    ShardReader(copy)
    # a damaged journal entry costs only its shard
    (copy / ".entries" / "shard-00000.safetensors.json").write_text("{torn")
    extraction.run(make_config(tmp_path, llama_target, token_data))
    assert "shard-00000.safetensors.json: not valid JSON" in capsys.readouterr().err
    assert {s["file"]: s["sha256"] for s in read_manifest(copy)["shards"]} == shards


# --- data that cannot train ----------------------------------------------------------------------

def test_a_utf8_byte_order_mark_opens_a_data_file_without_losing_its_first_line(tmp_path, token_data):
    """Issue 46: a data or prompts file saved with a UTF-8 BOM keeps its first line (the error's "skip"
    advice would have dropped a valid line)."""
    from eagle3.data.inputs import read_records
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + token_data.read_bytes())
    records, stats = read_records(bom, 256, 4096)
    plain, _ = read_records(token_data, 256, 4096)
    assert [r.input_ids.tolist() for r in records] == [r.input_ids.tolist() for r in plain] and stats.skipped == 0


def test_all_zero_loss_masks_are_refused_before_training(tmp_path, llama_target, token_data):
    lines = [json.loads(x) for x in token_data.read_text().splitlines()]
    data = tmp_path / "no_assistant.jsonl"
    data.write_text("".join(json.dumps({**x, "loss_mask": [0] * len(x["loss_mask"])}) + "\n" for x in lines))
    cfg = make_config(tmp_path, llama_target, data)
    with pytest.raises(InputError, match=rf"{data}: no usable sequences: .*{len(lines)} because their loss_mask is all 0"):
        extraction.run(cfg)
    # shards written otherwise (another tool, a manifest edited): training refuses them too
    extraction.run(make_config(tmp_path, llama_target, token_data))
    manifest = read_manifest(tmp_path / "hidden")
    for shard in manifest["shards"]:
        shard["loss_tokens"] = 0
    (tmp_path / "hidden" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"{tmp_path / 'hidden' / 'manifest.json'}: no assistant tokens.*"
                                        rf"{token_data.name}"):
        training.Trainer(cfg)
    assert not (tmp_path / "train" / "metrics.jsonl").exists()



def test_data_that_cannot_fill_one_step_is_refused_naming_the_data(tmp_path, llama_target, token_data):
    data = tmp_path / "few.jsonl"
    data.write_text("".join(token_data.read_text().splitlines(keepends=True)[:4]))
    cfg = make_config(tmp_path, llama_target, data, **{"train.grad_accum": 8})
    extraction.run(cfg)
    with pytest.raises(training.TrainError) as e:
        training.Trainer(cfg)
    message = str(e.value)
    for part in (f"train.data_dir {tmp_path / 'hidden'} (extracted from data.path {data}): its training split (",
                 "fewer than one optimizer step needs (world size 1 x train.grad_accum 8)", "use more data"):
        assert part in message, (part, message)
    assert not (tmp_path / "train" / "metrics.jsonl").exists()


# --- non-finite loss or gradient -----------------------------------------------------------------

def poison(monkeypatch, step, what):
    """Make optimizer step `step` (1-based, grad_accum 1) produce a NaN loss, or NaN gradients with a
    finite loss."""
    calls = {"forward": 0, "clip": 0}
    forward, clip = training.Trainer._forward, torch.nn.utils.clip_grad_norm_

    def nan_loss(self, model, batch, scale=1.0, **kwargs):
        loss, metrics, extra = forward(self, model, batch, scale, **kwargs)
        if kwargs.get("training"):
            calls["forward"] += 1
            if calls["forward"] == step:
                loss = loss * float("nan")
        return loss, metrics, extra

    def nan_grads(params, *args, **kwargs):
        params = list(params)
        calls["clip"] += 1
        if calls["clip"] == step:
            params[0].grad.fill_(float("nan"))
        return clip(params, *args, **kwargs)

    if what == "loss":
        monkeypatch.setattr(training.Trainer, "_forward", nan_loss)
    else:
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_grads)


def test_nonfinite_step_stops_keeping_the_last_good_checkpoint(tmp_path, llama_target, token_data, hidden,
                                                               monkeypatch):
    cfg = config(tmp_path, llama_target, token_data, hidden)   # log every 2, eval and checkpoint every 3
    out = tmp_path / "train"
    with monkeypatch.context() as m:
        poison(m, 5, "loss")
        with pytest.raises(training.TrainError) as e:
            training.run(cfg)
    last = train_state.latest(out)
    assert str(e.value).startswith(f"{out}: step 5: non-finite loss and gradient norm; training stopped, the newest "
                                   f"checkpoint, {last}, is the last good one"), str(e.value)
    assert "debug.skip_nonfinite = true" in str(e.value)
    assert last.name == "step-00000003" and not (out / "export").exists()
    assert all(torch.isfinite(t).all() for t in load_file(last / train_state.MODEL).values())
    assert max(strict_loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()) == 4
    # finite loss, NaN gradients at a log step: stops there, before any checkpoint
    shutil.rmtree(out)
    with monkeypatch.context() as m:
        poison(m, 2, "grads")
        with pytest.raises(training.TrainError, match=f"{out}: step 2: non-finite gradient norm; training stopped, "
                                                      "no checkpoint was written"):
            training.run(cfg)
    assert train_state.latest(out) is None


def test_skip_nonfinite_skips_and_counts_the_step(tmp_path, llama_target, token_data, hidden, monkeypatch, capsys):
    cfg = config(tmp_path, llama_target, token_data, hidden, **{"debug.skip_nonfinite": "true"})
    poison(monkeypatch, 5, "loss")
    training.run(cfg)
    out = tmp_path / "train"
    records = [strict_loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["split"] == "train"}
    assert [train[s]["skipped_steps"] for s in (2, 4, 6)] == [0, 0, 1]
    assert all(math.isfinite(x) for x in train[6]["loss"])
    assert "skipped steps (non-finite loss or gradient norm, debug.skip_nonfinite): 1" in capsys.readouterr().out
    last = train_state.latest(out)
    assert last.name == "step-00000006"
    assert all(torch.isfinite(t).all() for t in load_file(last / train_state.MODEL).values())
    state = torch.load(last / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    steps = {float(s["step"]) for s in state.values()}
    assert steps == {5.0}   # six steps run, five taken


def test_a_skipped_first_step_advances_the_schedule_without_a_warning(tmp_path, llama_target, token_data, hidden,
                                                                      monkeypatch):
    """Issue 46: a non-finite first step (skipped) still steps the schedule; torch's lr_scheduler order
    warning is not shown for it."""
    import warnings
    cfg = config(tmp_path, llama_target, token_data, hidden, **{"debug.skip_nonfinite": "true", "train.max_steps": 2})
    poison(monkeypatch, 1, "loss")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        training.run(cfg)
    assert not [w for w in shown if "lr_scheduler" in str(w.message)], [str(w.message) for w in shown]


# --- strict JSON ---------------------------------------------------------------------------------

def test_nan_metrics_are_written_as_null(tmp_path, monkeypatch):
    log = training.MetricsLog(tmp_path, 0, True)
    log.write({"step": 1, "split": "train", "loss": [float("nan"), 1.5], "grad_norm": float("inf")})
    assert strict_loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 1, "split": "train", "loss": [None, 1.5], "grad_norm": None}
    nan = float("nan")
    report = {"step": 3, "accept_len": nan, "acc": [nan, 0.5], "cond_acc": [nan, 0.5], "loss": [nan, 1.0]}
    monkeypatch.setattr(evaluate, "estimate", lambda cfg, path, steps=None: dict(report))
    # a checkpoint whose run logged the NaN above: the plot reads it back as null
    (tmp_path / train_state.STATE).write_text(json.dumps({"config": {"train": {"output_dir": str(tmp_path)}}}))
    evaluate.run(Config(), tmp_path)
    assert strict_loads((tmp_path / "eval.json").read_text())["acc"] == [None, 0.5]
    assert strict_json({"a": (math.inf, -math.inf, 2)}) == '{"a": [null, null, 2]}'


# --- file modes ----------------------------------------------------------------------------------

def test_exports_checkpoints_and_shards_follow_the_umask(hidden, trained):
    umask = os.umask(0)
    os.umask(umask)
    assert FILE_MODE == 0o666 & ~umask
    out = trained[0] / "train"
    files = [out / "export" / "vllm" / "model.safetensors", out / "export" / "sglang" / "model.safetensors",
             out / "export" / "vllm" / "config.json", train_state.latest(out) / train_state.MODEL,
             train_state.latest(out) / "optimizer.pt", *hidden.glob("shard-*.safetensors")]
    for path in files:
        assert os.stat(path).st_mode & 0o777 == FILE_MODE, (path, oct(os.stat(path).st_mode))


# --- untrusted checkpoints -----------------------------------------------------------------------

class Payload:
    """What a crafted checkpoint holds: unpickling it with weights_only=False runs code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_loads_optimizer_and_rng_with_weights_only(tmp_path, llama_target, token_data, hidden, trained):
    shared = tmp_path / "shared"
    shutil.copytree(train_state.latest(trained[0] / "train"), shared)
    cfg = config(tmp_path, llama_target, token_data, hidden, **{"train.resume": shared})
    marker = tmp_path / "ran"
    for name in ("optimizer.pt", "rng-rank0.pt"):
        good = (shared / name).read_bytes()
        torch.save({"optimizer": Payload(marker)}, shared / name)
        with pytest.raises(train_state.CheckpointError, match=rf"{shared / name}: refused: .*\(io.open, "):
            training.Trainer(cfg)
        assert not marker.exists(), "the checkpoint ran code"
        (shared / name).write_bytes(good)
    # a truncated optimizer state names the file
    truncate(shared / "optimizer.pt")
    with pytest.raises(train_state.CheckpointError, match=f"{shared / 'optimizer.pt'}: unreadable"):
        training.Trainer(cfg)


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.pt", "state.json"])
def test_resume_auto_skips_a_newest_checkpoint_that_no_longer_reads(tmp_path, llama_target, token_data, hidden,
                                                                     trained, capsys, damaged):
    run_tmp, _ = trained
    shutil.copytree(run_tmp / "train", tmp_path / "train")
    newest = tmp_path / "train" / "checkpoints" / "step-00000006"
    truncate(newest / damaged)
    assert training.Trainer(config(tmp_path, llama_target, token_data, hidden)).start_step == 3
    err = capsys.readouterr().err
    assert f"warning: resume skips {newest}, which no longer reads" in err and damaged in err, err
    assert f"resuming from {newest.parent / 'step-00000003'}" in err


def test_rng_state_round_trips_through_weights_only(tmp_path):
    import random

    import numpy as np
    torch.save(train_state.rng_state(), tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    train_state.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


# --- end of training -----------------------------------------------------------------------------

def test_the_checkpoint_space_estimate_is_close_to_what_a_checkpoint_takes(tmp_path):
    """Issue 46: the free-space check asked about twice a small checkpoint's size (a fixed 1 MiB for the
    side files), refusing checkpoints that fit."""
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    dist = types.SimpleNamespace(main=True, rank=0, world=1, barrier=lambda: None)
    saved = train_state.save(tmp_path, 1, model, optimizer, scheduler, {"config": {}}, dist, keep=3)
    real = sum(p.stat().st_size for p in saved.iterdir())
    need = train_state.checkpoint_bytes(model, optimizer)
    assert real <= need <= 1.25 * real, (need, real)


def test_training_ends_with_a_summary(trained):
    run_tmp, printed = trained
    out = run_tmp / "train"
    for part in ("train (step 6), per TTT step: loss ", "held-out (step 6, accept_len ", "; accuracy ",
                 "plot and real decoding: python -m eagle3 evaluate",
                 f"metrics: {out / 'metrics.jsonl'}", f"last checkpoint: {out / 'checkpoints' / 'step-00000006'}",
                 f"vllm export: {out / 'export' / 'vllm'}", f"sglang export: {out / 'export' / 'sglang'}"):
        assert part in printed, (part, printed)


def test_the_printed_evaluate_command_works_as_printed(trained, token_data, tmp_path, monkeypatch, capsys):
    """The summary's evaluate command takes the checkpoint's own settings (its target, its shards),
    not a config.toml that points elsewhere, so it runs as printed from any directory."""
    from eagle3.__main__ import main
    run_tmp, printed = trained
    line = next(x for x in printed.splitlines() if "plot and real decoding:" in x)
    command = line.split("python -m eagle3 ")[1].split(" (")[0].split()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(x + "\n" for x in token_data.read_text().splitlines()[:3]))
    monkeypatch.chdir(tmp_path)                           # no config.toml here
    main([a.replace("PROMPTS.jsonl", str(prompts)) for a in command] + ["--max-new-tokens", "4"])
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["prompts"] == 3 and summary["mismatches"] == 0 and "accept_len" in summary


# --- full disk, read-only directory --------------------------------------------------------------

def test_full_disk_while_checkpointing_keeps_the_last_good_one(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    dist = types.SimpleNamespace(main=True, rank=0, barrier=lambda: None)
    good = train_state.save(tmp_path, 1, model, optimizer, scheduler, {}, dist, keep=3)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def torn(*args, **kwargs):   # what torch.save says when the disk fills under it
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    for target, failing in ((train_state, "save_file"), (train_state.torch, "save")):
        with monkeypatch.context() as m:
            m.setattr(target, failing, full if failing == "save_file" else torn)
            with pytest.raises(train_state.CheckpointError) as e:
                train_state.save(tmp_path, 2, model, optimizer, scheduler, {}, dist, keep=3)
        tmp = train_state.step_dir(tmp_path, 2).with_name("step-00000002.tmp")
        assert str(e.value).startswith(f"{tmp}: writing the checkpoint failed (")
        assert "GiB (" in str(e.value) and "bytes) free in" in str(e.value)
        assert not tmp.exists() and train_state.latest(tmp_path) == good
    assert set(load_file(good / train_state.MODEL)) == {"weight", "bias"}


def test_a_full_disk_while_logging_stops_in_one_line_and_the_same_command_resumes(tmp_path, llama_target,
                                                                                   token_data, hidden, monkeypatch):
    """Issue 46, row 6: metrics.jsonl cannot be written: one line naming the file, the free space and the
    newest checkpoint; the same command resumes."""
    from pathlib import Path
    from test_training import cli_args
    out, real_open = tmp_path / "train", Path.open
    args = ["--config", str(ROOT / "config.toml"), *cli_args(tmp_path, llama_target, token_data, hidden)]

    def full(self, mode="r", *rest, **kwargs):   # the disk fills after the first checkpoint
        if self.name == "metrics.jsonl" and "a" in mode and train_state.latest(out) is not None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(self, mode, *rest, **kwargs)
    monkeypatch.setattr(Path, "open", full)
    with pytest.raises(SystemExit) as e:
        training.main(args)
    message = e.value.code
    assert message.startswith(f"error: {out / 'metrics.jsonl'}: writing the training log failed (No space left on "
                              "device); ") and " bytes (" in message and " GiB) free there" in message, message
    assert message.endswith(f"training stopped, newest complete checkpoint {out / 'checkpoints' / 'step-00000002'}: "
                            "free space, then the same command resumes"), message
    monkeypatch.undo()
    training.main(args)
    assert train_state.latest(out).name == "step-00000006"


def test_free_space_is_checked_before_a_checkpoint_or_a_shard_is_written(tmp_path, llama_target, token_data,
                                                                        monkeypatch):
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()   # optimizer state: exp_avg and exp_avg_sq, as large as the weights
    dist = types.SimpleNamespace(main=True, rank=0, world=1, barrier=lambda: None)
    good = train_state.save(tmp_path, 1, model, optimizer, scheduler, {}, dist, keep=3)
    weights = (64 * 64 + 64) * 4
    need = train_state.checkpoint_bytes(model, optimizer)
    assert need >= 3 * weights   # weights plus the two AdamW moments
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=need - 1))
    written = []
    for target, name in ((train_state, "save_file"), (train_state.torch, "save")):
        original = getattr(target, name)
        monkeypatch.setattr(target, name, lambda *a, _o=original, **k: written.append(a) or _o(*a, **k))
    with pytest.raises(train_state.CheckpointError) as e:
        train_state.save(tmp_path, 2, model, optimizer, scheduler, {}, dist, keep=3)
    message = str(e.value)
    for part in (f"{tmp_path / 'checkpoints'}: not enough free space for the checkpoint of step 2", f"{need} bytes",
                 f"{need - 1} bytes", f"the newest checkpoint, {good}, stays the last good one"):
        assert part in message, (part, message)
    assert not written and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001"]
    monkeypatch.undo()

    # a shard: refused before its file (or .tmp) appears; the finished ones are kept
    cfg = make_config(tmp_path, llama_target, token_data)
    extraction.run(cfg)
    out = tmp_path / "hidden"
    (out / "shard-00001.safetensors").unlink()
    (out / ".entries" / "shard-00001.safetensors.json").unlink()
    files = sorted(p.name for p in out.iterdir())
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with pytest.raises(DataError) as e:
        extraction.run(cfg)
    assert str(e.value).startswith(f"{out}: not enough free space to write shard-00001.safetensors: it needs about ")
    assert "1000 bytes (0.00 GiB) are free" in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == files
    monkeypatch.undo()
    extraction.run(cfg)
    assert all(sha256_file(out / s["file"]) == s["sha256"] for s in read_manifest(out)["shards"])
    ShardReader(out)


def test_unwritable_output_directories_are_named(tmp_path, llama_target, token_data, hidden):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(training.TrainError, match=f"{blocker / 'train'}: cannot write there .*train.output_dir"):
        training.Trainer(config(tmp_path, llama_target, token_data, hidden,
                                **{"train.output_dir": blocker / "train"}))
    with pytest.raises(DataError, match=f"{blocker / 'hidden'}: cannot write there .*extract.output_dir"):
        extraction.run(make_config(tmp_path, llama_target, token_data,
                                   **{"extract.output_dir": blocker / "hidden"}))
    if os.geteuid() == 0:
        return   # root writes through any mode bits
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o555)
    with pytest.raises(training.TrainError, match=f"{readonly}: cannot write there"):
        training.Trainer(config(tmp_path, llama_target, token_data, hidden, **{"train.output_dir": readonly}))


# --- generate: killed and rerun ------------------------------------------------------------------

def test_generate_refuses_changed_settings_and_skips_a_finished_run(tmp_path, llama_target, token_data,
                                                                     monkeypatch, capsys):
    from eagle3 import generate
    out = tmp_path / "regen.jsonl"
    base = {"generate.output_path": out, "generate.max_new_tokens": 6, "generate.temperature": 0.0, "debug.generate_batch_size": 8,
            "debug.generate_dtype": "float32", "debug.generate_device": "cpu"}
    cfg = make_config(tmp_path, llama_target, token_data, **base)
    generate.run(cfg)
    finished, settings = out.read_bytes(), (tmp_path / "regen.jsonl.settings.json").read_bytes()
    assert strict_loads(settings.decode())["generate.max_new_tokens"] == 6
    assert sorted(p.name for p in tmp_path.glob("regen*")) == ["regen.jsonl", "regen.jsonl.settings.json"]

    # a finished run: nothing redone, said so
    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded again")
    with monkeypatch.context() as m:
        m.setattr(generate, "IncrementalTarget", no_target)
        generate.run(cfg)
    assert f"{out} is already complete with these settings; nothing to do" in capsys.readouterr().out
    assert out.read_bytes() == finished

    # killed after 10 conversations: the partial file and its settings
    partial = tmp_path / "regen.jsonl.partial"
    partial.write_text("".join(finished.decode().splitlines(keepends=True)[:10]))
    (tmp_path / "regen.jsonl.partial.settings.json").write_bytes(settings)
    out.unlink()
    other_data = tmp_path / "other.jsonl"
    other_data.write_text(token_data.read_text().replace("\n", "\n\n", 1))   # same lines, other bytes
    before = partial.read_bytes()
    for changed, named in (({"generate.max_new_tokens": 8}, "generate.max_new_tokens 6 -> 8"),
                           ({"generate.temperature": 0.7, "debug.generate_seed": 3},
                            "generate.temperature 0.0 -> 0.7, debug.generate_seed 0 -> 3"),
                           ({"debug.stop_token_ids": "[5]"}, "stop tokens "),
                           ({"data.path": other_data}, "data.path sha256 ")):
        with pytest.raises(generate.GenerateError) as e:
            generate.run(make_config(tmp_path, llama_target, token_data, **{**base, **changed}))
        message = str(e.value)
        for part in (f"{partial} was generated with other settings (", named, "set another generate.output_path",
                     f"or remove {partial} and regen.jsonl.partial.settings.json to start over"):
            assert part in message, (part, message)
        assert partial.read_bytes() == before and not out.exists()
    # the same settings resume and give the uninterrupted file
    generate.run(cfg)
    assert out.read_bytes() == finished and not partial.exists()
    assert not (tmp_path / "regen.jsonl.partial.settings.json").exists()

    # a finished output is not overwritten by other settings either; on the command line: one line
    cmd = [sys.executable, "-m", "eagle3", "generate", "--config", str(ROOT / "config.toml")]
    for key, value in {**base, "target.path": llama_target, "data.path": token_data, "generate.max_new_tokens": 7,
                       "data.max_seq_len": 4096}.items():   # make_config's default (config.toml's: 2048)
        cmd += [f"--{key}", str(value)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith(f"error: {out} was generated with other settings (generate.max_new_tokens 6 -> 7)")
    assert out.read_bytes() == finished


def test_generate_owns_its_output_and_checks_a_finished_one(tmp_path, llama_target, token_data, monkeypatch,
                                                            capsys):
    """Issue 46, row 1: a second generate on the same output stops naming the holder (the first one
    finishes whole), and a finished output is called complete only with one line per input sequence."""
    from eagle3 import generate
    out = tmp_path / "regen.jsonl"
    cfg = make_config(tmp_path, llama_target, token_data, **{
        "generate.output_path": out, "generate.max_new_tokens": 3, "debug.generate_batch_size": 8,
        "debug.generate_dtype": "float32", "debug.generate_device": "cpu"})
    first, seconds = generate.regenerate, []

    def racing(*args, **kwargs):   # a second run starts while the first writes its first line
        lines = first(*args, **kwargs)
        yield next(lines)
        with pytest.raises(generate.GenerateError) as e:
            generate.run(cfg)
        seconds.append(str(e.value))
        yield from lines
    monkeypatch.setattr(generate, "regenerate", racing)
    generate.run(cfg)
    monkeypatch.undo()
    assert seconds and re.match(rf"{out}: in use by another run \(generate on host .*, pid {os.getpid()}, since .*\); "
                                "wait for it to end, or choose another generate.output_path", seconds[0]), seconds
    sources = [json.loads(x)["source_line"] for x in out.read_text().splitlines()]
    assert sources == list(range(1, 49)), sources   # one line per conversation, in order
    lines = out.read_text().splitlines(keepends=True)
    for damaged, named in ((lines[:30] + lines[29:], "line 31 has (source_line, source_part) (30, 0), expected (31, 0)"),
                           (lines[:-1], "line 48 has (source_line, source_part) none (missing), expected (48, 0)")):
        out.write_text("".join(damaged))
        with pytest.raises(generate.GenerateError) as e:
            generate.run(cfg)
        assert str(e.value).startswith(f"{out}: {len(damaged)} lines for the 48 sequences of data.path; {named}")
        assert "already complete" not in capsys.readouterr().out


# --- command lines -------------------------------------------------------------------------------

def test_unknown_flags_are_usage_errors_before_anything_runs(capsys, llama_target, monkeypatch):
    from eagle3.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(llama_target), "--verbose"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and "inspect: error: unrecognized arguments: --verbose" in err
    monkeypatch.setattr(training, "run", lambda cfg: pytest.fail("ran"))
    for argv in (["demo", "--verbose"], ["generate", "--train.max_steps"], ["evaluate", "ckpt", "stray"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert "error: command line: " in capsys.readouterr().err


# --- the SGLang export ---------------------------------------------------------------------------

def test_a_config_that_sets_no_target_or_data_is_refused_naming_the_file(tmp_path, monkeypatch):
    """Issue 46, row 7: an empty config.toml (or one without [target]) does not train, extract or generate on
    the built-in demo defaults: one line names the file and what it did not set."""
    from eagle3 import __main__ as cli
    for module in (training.loop, extraction):
        monkeypatch.setattr(module, "run", lambda cfg: pytest.fail("ran on the defaults"))
    path = tmp_path / "my.toml"
    demo = 'target.path = "demo/target"'
    cases = (("", training.main, "sets nothing, so train would run on the built-in demo defaults "
              f'({demo}, data.path = "demo/data.jsonl"); set target.path and data.path there'),
             ("[train]\nlr = 1e-4\n", training.main, "sets no target.path and no data.path or train.data_dir or "
              f'extract.output_dir, so train would run on the built-in demo defaults ({demo}, data.path = '),
             ('[target]\npath = "t"\n', extraction.main, "sets no data.path, so extract would run on the built-in "
              'demo defaults (data.path = "demo/data.jsonl"); set data.path there or on the command line'),
             ("", lambda argv: cli.main(["generate", *argv]), "sets nothing, so generate would run on the built-in"))
    for text, main, said in cases:
        path.write_text(text)
        with pytest.raises(SystemExit) as e:
            main(["--config", str(path)])
        assert str(e.value.code).startswith(f"error: {path}: {said}"), (text, e.value.code)
        assert str(e.value.code).endswith("or run the demo: python -m eagle3 demo")
    # what the command line sets counts: the data there, the target from the file
    path.write_text('[target]\npath = "t"\n')
    with pytest.raises(pytest.fail.Exception, match="ran on the defaults"):
        training.main(["--config", str(path), "--train.data_dir", str(tmp_path)])


# --- README --------------------------------------------------------------------------------------

def test_readme_installs_what_ci_installs():
    """A plain `pip install torch` on a CPU-only machine fetches the CUDA build; CI pins the CPU one."""
    import re
    ci, readme = (ROOT / ".ci" / "run").read_text(), (ROOT / "README.md").read_text()
    pins = dict(re.findall(r'pip install -q "(torch|triton)==([^"]+)"', ci))
    assert set(pins) == {"torch", "triton"}, ci
    assert f'pip install "torch=={pins["torch"]}" --index-url https://download.pytorch.org/whl/cpu' in readme
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', ci).group(1)
    assert f'pip install "triton=={pins["triton"]}" -e ".[{extras}]"' in readme
    assert "pip install torch &&" not in readme


def test_a_resume_keeps_the_schedule_and_the_rows_it_trained(llama_target, token_data, hidden, trained):
    """The rules on their own: tests/test_training_parts.py; here the Trainer applies them, naming a change."""
    run_tmp, _ = trained
    with pytest.raises(training.TrainError, match='train.schedule was "wsd", this run has "cosine"'):
        training.Trainer(config(run_tmp, llama_target, token_data, hidden, **{"train.schedule": "cosine"}))
    with pytest.raises(training.TrainError, match="train.prompt_rows was true, this run has false"):
        training.Trainer(config(run_tmp, llama_target, token_data, hidden, **{"train.prompt_rows": "false"}))


@pytest.mark.parametrize("entry", ["train", "extract", "generate"])
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, llama_target, token_data, hidden, trained, monkeypatch,
                                              capsys, entry):
    """Ctrl-C (KeyboardInterrupt) anywhere in a run: no traceback, one line saying what is kept and
    that the same command resumes, exit status 130 as for SIGINT."""
    from eagle3 import __main__ as cli, generate

    def stop(*_):
        raise KeyboardInterrupt

    run_tmp, _ = trained
    args = ["--target.path", str(llama_target), "--data.path", str(token_data), "--extract.output_dir", str(hidden),
            "--train.output_dir", str(run_tmp / "train"), "--debug.train_device", "cpu", "--debug.extract_device", "cpu"]
    if entry == "train":
        monkeypatch.setattr(training.loop, "run", stop)   # what training.main calls
        call, expected = lambda: training.main(["--config", str(ROOT / "config.toml"), *args]), \
            f"newest complete checkpoint {run_tmp / 'train' / 'checkpoints' / 'step-00000006'}"
    elif entry == "extract":
        monkeypatch.setattr(extraction, "run", stop)
        call, expected = lambda: extraction.main(["--config", str(ROOT / "config.toml"), *args]), \
            f"the finished shards in {hidden} are kept"
    else:
        monkeypatch.setattr(generate, "run", stop)
        call, expected = lambda: cli.main(["generate", "--config", str(ROOT / "config.toml"), *args]), \
            "python -m eagle3 generate"
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == f"interrupted: {expected}; the same command resumes" and "Traceback" not in err, err


def test_overrides_may_stand_before_the_positionals(tmp_path, trained):
    """`export --debug.export_dtype float32 CKPT OUT`: the override's value is not taken for a positional."""
    from eagle3.__main__ import main
    run_tmp, _ = trained
    checkpoint = run_tmp / "train" / "checkpoints" / "step-00000006"
    main(["export", "--debug.export_dtype", "float32", "--export.formats=[\"vllm\"]", str(checkpoint), str(tmp_path / "x")])
    assert {t.dtype for n, t in load_file(tmp_path / "x" / "vllm" / "model.safetensors").items()
            if n not in ("d2t", "t2d")} == {torch.float32}
    assert not (tmp_path / "x" / "sglang").exists()


SHORT_REPLIES = ["--generate.max_new_tokens", "8", "--evaluate.max_new_tokens", "8"]   # the demo regenerates, briefly


def test_the_demo_rerun_with_other_settings_trains_anew(tmp_path, capsys):
    """README: `python -m eagle3 demo --train.max_steps 40` after a first demo starts a fresh demo run
    (the finished one is moved aside whole), instead of refusing to resume it below its step."""
    from eagle3.__main__ import main
    paths = ["--target.path", str(tmp_path / "target"), "--data.path", str(tmp_path / "data.jsonl"),
             "--extract.output_dir", str(tmp_path / "hidden"), "--train.output_dir", str(tmp_path / "train"),
             "--generate.output_path", str(tmp_path / "regenerated.jsonl"), *SHORT_REPLIES,
             "--train.eval_every", "2", "--train.checkpoint_every", "2", "--debug.train_device", "cpu",
             "--debug.extract_device", "cpu"]
    main(["demo", *paths, "--train.max_steps", "4"])
    main(["demo", *paths, "--train.max_steps", "2"])
    steps = [p.name for p in (tmp_path / "train" / "checkpoints").iterdir()]
    assert steps == ["step-00000002"], steps
    aside = list(tmp_path.glob("train.old-*"))
    assert len(aside) == 1 and (aside[0] / "checkpoints" / "step-00000004").is_dir()


def test_the_demo_prints_a_next_step_that_runs_as_printed(tmp_path, monkeypatch, capsys):
    """Issue 46: after `python -m eagle3 demo` in a fresh clone, the evaluate command it prints runs as
    printed, on held-out prompts of its own data that the demo wrote."""
    from eagle3.__main__ import main
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "config.toml", tmp_path / "config.toml")
    main(["demo", "--train.max_steps", "2", *SHORT_REPLIES])
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if "plot and real decoding:" in x)
    command = line.split("python -m eagle3 ")[1].split(" (")[0].split()
    assert command == ["evaluate", "runs/demo/train/checkpoints/step-00000002", "--prompts", "demo/prompts.jsonl"]
    main(command)
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    held_out = len((tmp_path / "demo" / "prompts.jsonl").read_text().splitlines())
    assert summary["prompts"] == held_out > 8 and summary["mismatches"] == 0 and summary["new_tokens"] > 8


def test_export_onto_a_full_disk_names_it_and_leaves_nothing(tmp_path, trained, monkeypatch, capsys):
    from eagle3 import export, files
    from eagle3.__main__ import main
    run_tmp, _ = trained
    checkpoint = run_tmp / "train" / "checkpoints" / "step-00000006"
    monkeypatch.setattr(files, "free_bytes", lambda path: 1000)           # checked before anything is written
    with pytest.raises(SystemExit, match=r"x: not enough free space to write the vllm export: .*nothing was written"):
        main(["export", str(checkpoint), str(tmp_path / "x")])
    monkeypatch.undo()

    def disk_full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "save_file", disk_full)                   # the disk fills while writing
    with pytest.raises(SystemExit, match=r"vllm: writing the export failed \(No space left on device\); the partial"):
        main(["export", str(checkpoint), str(tmp_path / "x")])
    assert list((tmp_path / "x").iterdir()) == []                         # no stray vllm.tmp/


def test_export_never_deletes_what_it_did_not_write(tmp_path, trained):
    """Issue 46, row 4: an export replaces `OUT/<format>` whole, so a folder holding other files is refused
    (nothing written, nothing deleted); an earlier export of ours is replaced."""
    from eagle3.__main__ import main
    run_tmp, _ = trained
    checkpoint = run_tmp / "train" / "checkpoints" / "step-00000006"
    main(["export", str(checkpoint), str(tmp_path / "out")])
    main(["export", str(checkpoint), str(tmp_path / "out")])               # an earlier export: replaced
    notes = tmp_path / "out" / "vllm" / "notes.txt"
    notes.write_text("mine")
    before = snapshot(tmp_path / "out")
    with pytest.raises(SystemExit) as e:
        main(["export", str(checkpoint), str(tmp_path / "out")])
    assert e.value.code == (f"error: {notes.parent}: holds notes.txt, which no export writes, and an export replaces "
                            "the folder whole; move them away or choose another out_dir (nothing was written)")
    assert snapshot(tmp_path / "out") == before


def test_export_refuses_a_folder_that_checkpoint_rotation_deletes(tmp_path, trained):
    """Issue 46, row 5: `export CK CK` (or anywhere under checkpoints/) would be deleted with the checkpoint."""
    from eagle3.__main__ import main
    run_tmp, _ = trained
    checkpoints = run_tmp / "train" / "checkpoints"
    before = snapshot(checkpoints)
    for out in (checkpoints / "step-00000006", checkpoints / "exports"):
        with pytest.raises(SystemExit) as e:
            main(["export", str(checkpoints / "step-00000006"), str(out)])
        assert e.value.code == (f"error: {out}: inside {checkpoints.resolve()}, whose checkpoints are deleted by "
                                "checkpoint rotation (train.keep_checkpoints), the export with them; choose an "
                                "out_dir outside it")
    assert snapshot(checkpoints) == before


def test_a_run_owns_its_output_folder(tmp_path, llama_target, token_data, hidden, capsys):
    """A second run on the same train.output_dir or extract.output_dir stops naming the run that holds
    it; a lock left by a process that died is taken over with a note."""
    out = tmp_path / "train"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from eagle3.files import run_lock; "
                               f"lock = run_lock(__import__('pathlib').Path({str(out)!r}), 'k', 'train', ValueError); "
                               "lock.__enter__(); print('held', flush=True); time.sleep(60)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(training.TrainError, match=rf"{out}: in use by another run \(train on host .*, pid "
                                                      rf"{holder.pid}, since .*\); wait for it to end, or choose "
                                                      "another train.output_dir"):
            training.run(config(tmp_path, llama_target, token_data, hidden))
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed: its name stays in the file, and the next run takes the lock over
    training.run(config(tmp_path, llama_target, token_data, hidden, **{"train.max_steps": 2}))
    assert (out / ".lock").read_text() == ""                       # released at the end of the run
    assert f"taking over the lock of a run that ended without releasing it (train on host" in capsys.readouterr().out
    data = tmp_path / "h"
    data.mkdir()
    with open(data / ".lock", "w") as f:
        import fcntl
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("extract on host elsewhere, pid 1, since then")
        f.flush()
        with pytest.raises(DataError, match=r"h: in use by another run \(extract on host elsewhere, pid 1"):
            extraction.run(make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": data}))


def test_sigterm_of_a_one_process_run_says_what_is_kept_and_the_same_command_resumes(tmp_path, llama_target,
                                                                                   token_data, hidden):
    """Issue 46: plain SIGTERM (a job scheduler's stop) of a one-process run ends it with one line naming the
    newest checkpoint, status 143, as Ctrl-C prints its own; the same command resumes."""
    import signal
    import time
    from test_training import cli_args, run_train
    args = cli_args(tmp_path, llama_target, token_data, hidden, **{"train.max_steps": 40, "train.batch_tokens": 48,
                                                                    "train.eval_every": 40, "debug.log_every": 40})
    out = tmp_path / "train"
    launch = run_train(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while train_state.latest(out) is None and launch.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    launch.send_signal(signal.SIGTERM)
    _, err = launch.communicate(timeout=60)
    newest = train_state.latest(out)
    assert launch.returncode == 143 and "Traceback" not in err, err
    assert err.rstrip().endswith(f"stopped by SIGTERM; newest complete checkpoint {newest}; the same command "
                                 "resumes"), err
    assert f"resumed from {newest}" in run_train(args).stderr and train_state.latest(out).name == "step-00000040"


# --- a dead rank ---------------------------------------------------------------------------------

def worker_pid(launch, rank):
    """The pid of torchrun's worker of `rank`, known by its environment (/proc: Linux)."""
    from benchmarks.processes import descendants
    for pid in descendants(launch.pid):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:   # gone meanwhile
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under torchrun (pid {launch.pid})")


def stop_a_rank(launch, out, signum, after):
    """Once the run has a checkpoint newer than `after`, send rank 1 `signum`; the launch's output
    (all ranks and torchrun) and the seconds from the signal to its end, which must come by itself."""
    import signal
    import time
    from benchmarks.processes import alive, kill_tree
    deadline = time.time() + 120
    while train_state.latest(out) == after and launch.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert launch.poll() is None and train_state.latest(out) != after, "no new checkpoint came"
    victim, survivor = worker_pid(launch, 1), worker_pid(launch, 0)
    os.kill(victim, signum)
    start = time.time()
    if signum == signal.SIGSTOP:   # a stuck rank, which torchrun does not notice: rank 0 must time out
        while alive(survivor) and time.time() < start + 60:
            time.sleep(0.05)
        os.kill(victim, signal.SIGCONT)   # then torchrun's SIGTERM, held while it was stopped, arrives
    try:
        printed, _ = launch.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(launch)
        pytest.fail(f"the surviving rank still ran {time.time() - start:.0f} s after rank 1 got {signum!r}")
    return printed, time.time() - start


@pytest.mark.slow
def test_a_dead_or_stuck_rank_ends_the_run_in_one_line_and_the_same_command_resumes(tmp_path, llama_target,
                                                                                   token_data, hidden):
    """Issue 35, row 15: a rank killed under torchrun (which then stops the others with SIGTERM) or
    stuck (which no launcher notices: the collective timeout) ends the run within a bound, each
    surviving rank saying in one line what happened and the newest checkpoint, with no traceback; the
    same command resumes from it."""
    import signal
    from test_training import cli_args, run_train
    args = cli_args(tmp_path, llama_target, token_data, hidden,
                    **{"train.max_steps": 40, "train.batch_tokens": 48, "train.eval_every": 40, "debug.log_every": 40,
                       "debug.collective_timeout_s": 10})
    out = tmp_path / "train"
    for signum, ends in ((signal.SIGKILL, {0: "error: rank 0: rank 1 is gone (a collective failed: "}),
                         (signal.SIGSTOP, {0: "error: rank 0: rank 1 did not answer within debug.collective_timeout_s "
                                              "= 10 s, stuck or gone (a collective failed: Timed out waiting 10000ms",
                                           1: "error: rank 1: rank 0 "})):
        before = train_state.latest(out)
        launch = run_train(args, nproc=2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        printed, seconds = stop_a_rank(launch, out, signum, before)
        newest = train_state.latest(out)
        assert launch.returncode != 0 and seconds < 30 and newest.name < "step-00000040", (seconds, printed)
        # torchrun's own traceback only (a virtualenv at ROOT + "-venv" is not ours: issue 46)
        assert f'File "{ROOT}/' not in printed and "]: Traceback" not in printed, printed
        said = [line for line in printed.splitlines() if "the same command resumes" in line]
        assert len(said) == len(ends), printed   # one line per surviving rank
        for rank, start in ends.items():   # the collective's error, or torchrun's SIGTERM where it came first
            sigterm = f"rank {rank}: stopped by SIGTERM (torchrun sends it when another rank fails"
            line = next((x for x in said if x.startswith((start, sigterm))), "")
            assert line.endswith(f"newest complete checkpoint {newest}; the same command resumes"), printed
    finished = run_train(args, nproc=2)
    assert f"resumed from {newest} (step {int(newest.name[5:])}" in finished.stderr
    assert train_state.latest(out).name == "step-00000040"


def test_the_estimate_scores_an_lk_hybrid_draft_with_the_eta_it_trained_with(tmp_path, llama_target, token_data,
                                                                             hidden, trained):
    run_tmp, _ = trained
    losses = []
    for eta in (0.0, 50.0):
        checkpoint = tmp_path / f"eta{eta:g}"
        shutil.copytree(train_state.latest(run_tmp / "train"), checkpoint)
        state = json.loads((checkpoint / "state.json").read_text())
        state["config"]["train"]["loss"] = "lk_hybrid"
        state["config"].setdefault("experimental", {})["lk_eta"] = eta
        (checkpoint / "state.json").write_text(json.dumps(state))
        losses.append(evaluate.estimate(config(run_tmp, llama_target, token_data, hidden), checkpoint)["loss"][0])
    # eta 0: lambda = 1, the KL term alone; eta 50: lambda ~ 0, mostly 1 - alpha
    assert losses[0] != pytest.approx(losses[1], rel=1e-3)
