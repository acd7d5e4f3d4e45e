"""Online training (`train.source = "online"`): the target runs on data.path for each micro-batch and
nothing but checkpoints is written; it must train exactly as extract-then-train on the same data."""
import signal
import subprocess
import time

import pytest
import torch

from conftest import make_config
from eagle3 import train_state
from eagle3 import extraction, training
from eagle3.models import tiny
from eagle3.models.weights import Checkpoint
from test_training import cli_args, final_weights, run_train, train_losses

# what the `hidden` fixture's extraction used: the online forward must run the same
# data.max_seq_len within a micro-batch (train.batch_tokens 160): online train refuses longer, as extract does
AS_EXTRACTED = {"train.source": "online", "extract.dtype": "float32", "debug.chunk_tokens": 300,
                "data.max_seq_len": 160}


def assert_same_training(a, b):
    la, lb = train_losses(a), train_losses(b)
    assert la.keys() == lb.keys() and la
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=1e-5, abs=1e-5), step
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-5)


def test_online_trains_like_extract_then_train_and_writes_no_shards(tmp_path, llama_target, token_data, hidden,
                                                                    capsys):
    offline = make_config(tmp_path / "offline", llama_target, token_data, **{"extract.output_dir": hidden})
    training.run(offline)
    unused = tmp_path / "never-written"
    online = make_config(tmp_path / "online", llama_target, token_data, **{"train.source": "online",
                                                                          "extract.output_dir": unused})
    capsys.readouterr()
    training.run(online)
    # the default placement says what it costs, with the target's size
    size = sum(f.stat().st_size for f in llama_target.glob("*.safetensors"))
    assert Checkpoint(llama_target).text_bytes() == size > 0
    assert f'train.online_target = "stream" reads the target\'s {size / 1e9:.1f} GB' in capsys.readouterr().err
    assert_same_training(tmp_path / "offline" / "train", tmp_path / "online" / "train")
    assert not unused.exists()
    assert sorted(p.name for p in (tmp_path / "online").iterdir()) == ["train"]
    log = (tmp_path / "online" / "train" / "metrics.jsonl").read_text()
    assert '"target_tokens_per_s"' in log and '"draft_tokens_per_s"' in log


def test_a_resident_target_gives_the_same_states_as_a_streamed_one(tmp_path, llama_target, token_data):
    from eagle3.data.online import OnlineReader
    from eagle3.models.weights import Checkpoint
    readers = [OnlineReader(make_config(tmp_path, llama_target, token_data, **{"train.online_target": mode}),
                            Checkpoint(llama_target), [1, 2, 3], torch.device("cpu")) for mode in ("stream", "resident")]
    refs = readers[0].sequences[:5]
    for _ in range(2):                                   # the resident reader's second pass reuses its layers
        a, b = (r.read(refs) for r in readers)
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.target_argmax, b.target_argmax)
    assert readers[0].runner.resident is None and len(readers[1].runner.resident) == 5


def test_online_on_the_kimi_layout_with_int4_experts_trains_like_offline(tmp_path, token_data):
    """MLA, MoE and packed int4 experts in the online forward: the same states as extraction's."""
    kimi = tiny.make_kimi(tmp_path / "kimi", vocab=256)
    overrides = {"extract.output_dir": tmp_path / "hidden", "draft.num_attention_heads": 4,
                 "draft.num_key_value_heads": 4, "train.max_steps": 4}
    offline = make_config(tmp_path / "offline", kimi, token_data, **overrides)
    extraction.run(offline)
    training.run(offline)
    training.run(make_config(tmp_path / "online", kimi, token_data, **overrides, **{"train.source": "online"}))
    assert_same_training(tmp_path / "offline" / "train", tmp_path / "online" / "train")


def test_a_resumed_online_run_checks_the_input_file_not_the_unused_shard_directory(tmp_path, llama_target,
                                                                                   token_data):
    first = {"train.source": "online", "train.max_steps": 3, "extract.output_dir": tmp_path / "a"}
    training.run(make_config(tmp_path, llama_target, token_data, **first))
    more = {**first, "train.max_steps": 6}
    training.Trainer(make_config(tmp_path, llama_target, token_data, **{**more, "extract.output_dir": tmp_path / "b"}))
    other = tmp_path / "other.jsonl"
    other.write_text(token_data.read_text())
    with pytest.raises(training.TrainError, match="data_dir differs"):
        training.Trainer(make_config(tmp_path, llama_target, other, **more))


@pytest.mark.slow
def test_online_on_two_ranks_trains_like_offline_on_two_ranks(tmp_path, llama_target, token_data, hidden):
    run_train(cli_args(tmp_path / "offline", llama_target, token_data, hidden), nproc=2)
    run_train(cli_args(tmp_path / "online", llama_target, token_data, tmp_path / "none", **AS_EXTRACTED), nproc=2)
    assert_same_training(tmp_path / "offline" / "train", tmp_path / "online" / "train")


@pytest.mark.slow
def test_online_on_two_ranks_on_the_kimi_layout_trains_like_offline(tmp_path, token_data):
    """Two gloo ranks, MLA, MoE and int4 experts in fp32: online equals extract-then-train."""
    kimi = tiny.make_kimi(tmp_path / "kimi", vocab=256)
    extraction.run(make_config(tmp_path, kimi, token_data))   # fp32, 300-token chunks: AS_EXTRACTED's
    heads = {"draft.num_attention_heads": 4, "draft.num_key_value_heads": 4}
    run_train(cli_args(tmp_path / "offline", kimi, token_data, tmp_path / "hidden", **heads), nproc=2)
    run_train(cli_args(tmp_path / "online", kimi, token_data, tmp_path / "none", **AS_EXTRACTED, **heads), nproc=2)
    assert_same_training(tmp_path / "offline" / "train", tmp_path / "online" / "train")


def test_staged_on_two_ranks_trains_like_offline_on_two_ranks(tmp_path, llama_target, token_data, hidden):
    """The target's layers split between the two ranks, every micro-batch passed along (and the
    held-out evaluation, whose batches do not split evenly, read by both ranks in lockstep)."""
    run_train(cli_args(tmp_path / "offline", llama_target, token_data, hidden, **{"train.grad_accum": 2}), nproc=2)
    # a step's two micro-batches per rank pass the pipeline together
    staged = {**AS_EXTRACTED, "train.online_target": "staged", "train.eval_every": 2, "train.grad_accum": 2}
    run_train(cli_args(tmp_path / "staged", llama_target, token_data, tmp_path / "none", **staged), nproc=2)
    assert_same_training(tmp_path / "offline" / "train", tmp_path / "staged" / "train")


def test_a_staged_target_gives_each_rank_the_states_of_its_own_batch(tmp_path, llama_target, token_data):
    """One process: a single stage is the whole target, and an empty batch gives None."""
    from eagle3.data.online import OnlineReader
    from eagle3.resolve import resolve
    from eagle3.models.weights import Checkpoint
    cfgs = [make_config(tmp_path, llama_target, token_data, **{"train.online_target": m}) for m in ("stream", "staged")]
    ckpt = Checkpoint(llama_target)
    aux = resolve(cfgs[0], ckpt).aux_layer_ids
    stream, staged = (OnlineReader(c, ckpt, aux, torch.device("cpu")) for c in cfgs)
    refs = stream.sequences[:3]
    a, b = stream.read(refs), staged.read(refs)
    for name in ("aux_hidden", "final_hidden", "target_argmax"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert staged.read([]) is None and staged.lockstep and not stream.lockstep


@pytest.mark.slow
def test_a_killed_online_run_resumes_to_the_same_weights(tmp_path, llama_target, token_data):
    args = lambda d: cli_args(d, llama_target, token_data, tmp_path / "none",   # noqa: E731
                              **AS_EXTRACTED, **{"train.max_steps": 12})
    run_train(args(tmp_path / "straight"))
    proc = run_train(args(tmp_path / "killed"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = tmp_path / "killed" / "train" / "checkpoints" / "step-00000004"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert train_state.latest(tmp_path / "killed" / "train").name < "step-00000012", "the run was not interrupted"
    assert "resumed from" in run_train(args(tmp_path / "killed")).stderr
    a, b = final_weights(tmp_path / "straight" / "train"), final_weights(tmp_path / "killed" / "train")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_bad_input_line_online_is_named_without_a_traceback(tmp_path, llama_target, token_data):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(token_data.read_text().splitlines()[0] + "\n[1, 2]\n")
    online = {"train.source": "online", "data.max_seq_len": 160}
    out = run_train(cli_args(tmp_path, llama_target, bad, tmp_path / "none", **online),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = out.communicate(timeout=300)
    assert out.returncode != 0 and f"error: {bad}:2:" in err and "Traceback" not in err
    assert not (tmp_path / "train" / "checkpoints").exists()


def test_a_staged_target_is_refused_across_nodes(tmp_path, llama_target, token_data, monkeypatch):
    from eagle3.config import ConfigError
    from eagle3.data.online import OnlineReader
    from eagle3.models.weights import Checkpoint
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")   # this process's world (1) is not one node's ranks
    cfg = make_config(tmp_path, llama_target, token_data, **{"train.online_target": "staged"})
    with pytest.raises(ConfigError, match='online_target = "staged" splits the target across the GPUs of one node'):
        OnlineReader(cfg, Checkpoint(llama_target), [0, 1, 2], torch.device("cpu"))
