"""experimental.lm_head_init and experimental.freeze_lm_head: the draft's head starts as the target's
rows of the draft vocab (the embedding's when tied), stays frozen by default, and a resumed run
must keep both settings."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import make_config, make_llama
from eagle3 import train_state
from eagle3 import extraction, training
from eagle3.config import ConfigError
from eagle3.models.weights import Checkpoint

FAST = {"train.eval_every": 100, "debug.log_every": 100, "train.checkpoint_every": 3}


@pytest.fixture(scope="module")
def tied(tmp_path_factory, token_data):
    """A tied target (no lm_head tensor) and its extracted data."""
    tmp = tmp_path_factory.mktemp("tied")
    target = make_llama(tmp / "target", hidden=32, layers=5, heads=4, kv_heads=2, intermediate=64,
                        vocab=256, tie=True)
    extraction.run(make_config(tmp, target, token_data))
    return target, tmp / "hidden"


def config(tmp_path, llama_target, token_data, hidden, **extra):
    return make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, **FAST, **extra})


def target_rows(target, d2t) -> torch.Tensor:
    """The target's stored head rows of the draft vocab, found from d2t (draft id i -> i + d2t[i])."""
    return Checkpoint(target).get("lm_head.weight")[torch.arange(d2t.numel()) + d2t]


def trained(tmp_path, llama_target, token_data, hidden, **extra):
    """(trainer at step 0, its initial weights, final checkpoint weights) of a 6-step run."""
    cfg = config(tmp_path, llama_target, token_data, hidden, **extra)
    trainer = training.Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.draft.state_dict().items()}
    trainer.run()
    return trainer, before, load_file(train_state.latest(tmp_path / "train") / train_state.MODEL)


def test_target_init_copies_the_target_rows_exactly(tmp_path, llama_target, token_data, hidden):
    trainer = training.Trainer(config(tmp_path / "t", llama_target, token_data, hidden))
    draft = trainer.model.draft
    rows = target_rows(llama_target, draft.d2t)
    assert rows.dtype == torch.bfloat16 and draft.lm_head.weight.dtype == torch.float32
    assert torch.equal(draft.lm_head.weight.detach(), rows.float())
    assert not draft.lm_head.weight.requires_grad               # frozen by default
    # only the head differs from a random-init draft: the other weights draw the same numbers
    rand = training.Trainer(config(tmp_path / "r", llama_target, token_data, hidden,
                                   **{"experimental.lm_head_init": "random", "experimental.freeze_lm_head": "false"})).model.draft
    assert rand.lm_head.weight.requires_grad and not torch.equal(rand.lm_head.weight, draft.lm_head.weight)
    for (name, a), b in zip(draft.state_dict().items(), rand.state_dict().values()):
        assert name == "lm_head.weight" or torch.equal(a, b), name


def test_target_init_of_a_tied_target_takes_the_embedding_rows(tmp_path, token_data, tied):
    target, tied_hidden = tied
    assert not Checkpoint(target).head_name       # no lm_head tensor at all
    draft = training.Trainer(config(tmp_path, target, token_data, tied_hidden)).model.draft
    embed = Checkpoint(target).get("embed_tokens.weight")
    assert torch.equal(draft.lm_head.weight.detach(), embed[torch.arange(draft.d2t.numel()) + draft.d2t].float())


def test_frozen_head_stays_the_target_rows_and_exports_them(tmp_path, llama_target, token_data, hidden):
    trainer, before, after = trained(tmp_path, llama_target, token_data, hidden)
    head = trainer.model.draft.lm_head.weight
    assert all(p is not head for g in trainer.optimizer.param_groups for p in g["params"])
    assert all(p is not head for p in trainer.params) and head.grad is None
    n_params = len(list(trainer.model.parameters()))
    saved = torch.load(train_state.latest(tmp_path / "train") / "optimizer.pt", weights_only=False)["optimizer"]
    assert len(saved["param_groups"][0]["params"]) == n_params - 1
    rows = target_rows(llama_target, after["d2t"])
    assert torch.equal(after["lm_head.weight"], rows.float())
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight", "norm.weight"):
        assert not torch.equal(after[name], before[name]), name

    layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight"}
    common = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    export = tmp_path / "train" / "export"
    for fmt, prefix in (("vllm", "layers.0."), ("sglang", "midlayer.")):
        with safe_open(export / fmt / "model.safetensors", "pt") as f:
            assert set(f.keys()) == common | {prefix + n for n in layer}
            got = f.get_tensor("lm_head.weight")
            assert got.dtype == torch.bfloat16 and torch.equal(got, rows.to(torch.bfloat16)), fmt


def test_trained_head_from_the_target_rows_changes(tmp_path, llama_target, token_data, hidden):
    trainer, before, after = trained(tmp_path, llama_target, token_data, hidden, **{"experimental.freeze_lm_head": "false"})
    head = trainer.model.draft.lm_head.weight
    assert any(p is head for g in trainer.optimizer.param_groups for p in g["params"])
    rows = target_rows(llama_target, after["d2t"]).float()
    assert torch.equal(before["lm_head.weight"], rows) and not torch.equal(after["lm_head.weight"], rows)


def test_frozen_random_head_warns(tmp_path, llama_target, token_data, hidden, capsys):
    trainer = training.Trainer(config(tmp_path, llama_target, token_data, hidden,
                                      **{"experimental.lm_head_init": "random"}))
    assert not trainer.model.draft.lm_head.weight.requires_grad
    assert "lm_head stays random and is never trained" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"experimental.lm_head_init = 'target_rows'; expected one of \('target', 'random'\)"):
        make_config(tmp_path, llama_target, token_data, **{"experimental.lm_head_init": "target_rows"})


def test_resume_refuses_a_changed_head_setting_and_keeps_an_unchanged_one(tmp_path, llama_target, token_data,
                                                                           hidden):
    _, _, final = trained(tmp_path, llama_target, token_data, hidden)
    out = tmp_path / "train"
    step3 = out / "checkpoints" / "step-00000003"
    with pytest.raises(training.TrainError, match=r"experimental.freeze_lm_head was true, this run has false"):
        training.Trainer(config(tmp_path, llama_target, token_data, hidden,
                                **{"experimental.freeze_lm_head": "false", "train.resume": step3}))
    with pytest.raises(training.TrainError, match=r'experimental.lm_head_init was "target", this run has "random"'):
        training.Trainer(config(tmp_path, llama_target, token_data, hidden,
                                **{"experimental.lm_head_init": "random", "train.resume": step3}))
    # unchanged: resumes from step 3 and ends on the weights of the uninterrupted run
    again = training.Trainer(config(tmp_path, llama_target, token_data, hidden, **{"train.resume": step3}))
    assert again.start_step == 3
    again.run()
    resumed = load_file(train_state.latest(out) / train_state.MODEL)
    for key in final:
        assert torch.equal(resumed[key], final[key]), key

