"""Recipe levers: which rows are trained, the EAGLE-3.1 norms."""
import pytest
import torch

from conftest import make_config
from eagle3 import extraction, training
from eagle3.data.batch import RowRule
from eagle3.ttt import Objective, plan_rows, step_targets, ttt_forward
from eagle3.kernels.reference import ttt_attention, ttt_loss_steps
from test_ttt import random_batch, tiny_draft


def test_rows_whose_target_token_is_outside_the_draft_vocab_are_not_trained_and_count_as_misses():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])
    greedy = torch.arange(8)
    t2d = torch.ones(8, dtype=torch.bool)
    t2d[4] = False                                   # the target's greedy token 4 is outside the draft vocab
    positions, seq_len = torch.arange(8), torch.full((8,), 8)
    targets = step_targets(1, positions, seq_len, mask, greedy, t2d)
    assert (targets.acc_rows & ~targets.valid).nonzero().flatten().tolist() == [2]   # row 2 reads x[4] at step 1


def assert_more_rows_trained_same_counts(rule):
    """A row rule that trains more rows: more valid rows at every step, the same accuracy, counted
    rows and acceptance as the default rule."""
    draft, batch = tiny_draft(), random_batch([11, 17])
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    _, plain, _ = ttt_forward(draft, batch, embed, head, 3, ttt_attention, ttt_loss_steps)
    _, more, _ = ttt_forward(draft, batch, embed, head, 3, ttt_attention, ttt_loss_steps, objective=Objective(rule))
    assert (more[:, 1] > plain[:, 1]).all()
    assert torch.equal(more[:, 2:], plain[:, 2:])
    return draft, batch


def test_the_trainer_trains_prompt_rows_only_when_asked_and_evaluates_on_assistant_rows(tmp_path, llama_target,
                                                                                        token_data):
    cfg = make_config(tmp_path, llama_target, token_data, **{"vocab.draft_vocab_size": 64})
    extraction.run(cfg)
    trainer = training.Trainer(cfg)
    refs = trainer.plan.epoch(0)[0]

    def rows(trainer, training_):
        return sum(r.numel() for r in trainer.feed.prepare(trainer.reader.read(refs), training_).plan.loss)

    with_prompts, evaluated = rows(trainer, True), rows(trainer, False)
    cfg.train.prompt_rows = False
    plain = training.Trainer(cfg)
    assert plain.plan.epoch(0)[0] == refs
    assert with_prompts > rows(plain, True) == evaluated == rows(plain, False)


def test_norm_before_residual_starts_the_residual_from_the_normed_state(tmp_path, llama_target, token_data, hidden):
    import dataclasses
    import json
    from eagle3.config import ConfigError, check_servable_settings
    from eagle3.draft_io import load_vllm_draft
    plain = tiny_draft()
    normed = type(plain)(dataclasses.replace(plain.spec, norm_before_residual=True))
    normed.load_state_dict(plain.state_dict())
    h, emb = torch.randn(6, 16), torch.randn(6, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    step = lambda d, x: d.step(x, emb, torch.arange(6), [[]], ttt_attention, cu)   # noqa: E731
    # hidden_norm starts at weight 1, where normalising twice is normalising once
    torch.testing.assert_close(step(normed, h), step(plain, plain.layers[0].hidden_norm(h)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(step(normed, h), step(plain, h))

    with pytest.raises(ConfigError, match="experimental.norm_before_residual cannot be exported for SGLang"):
        check_servable_settings(make_config(tmp_path, llama_target, token_data,
                                            **{"experimental.norm_before_residual": "true"}))
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.max_steps": 2,
                                                             "experimental.norm_before_residual": "true",
                                                             "export.formats": '["vllm"]'})
    training.run(cfg)
    vllm = tmp_path / "train" / "export" / "vllm"
    assert json.loads((vllm / "config.json").read_text())["norm_before_residual"] is True
    assert load_vllm_draft(vllm)[0].spec.norm_before_residual        # and evaluate decodes with it


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_eagle31_norms_compute_what_speculators_and_vllm_compute():
    """norm_before_fc: one norm over the concatenated aux states; fc_norm: one per aux state;
    norm_output: norm(h) is the next step's state and the head's input (speculators' Eagle3DraftModel)."""
    import dataclasses
    plain = tiny_draft()
    aux, emb = torch.randn(6, 48), torch.randn(6, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    w3 = 1 + 0.1 * torch.randn(48)

    def variant(**flags):
        d = type(plain)(dataclasses.replace(plain.spec, **flags))
        d.load_state_dict(plain.state_dict(), strict=False)          # the shared weights; new norms start at 1
        for name, p in d.named_parameters():
            if name == "input_norm.weight":
                p.data.copy_(w3)
            elif name.startswith("fc_norm."):
                p.data.copy_(w3.view(3, 16)[int(name.split(".")[1])])
        return d

    fc = plain.fc.weight
    torch.testing.assert_close(variant(norm_before_fc=True).project(aux), rms(aux, w3) @ fc.T)
    per_layer = torch.cat([rms(a, w) for a, w in zip(aux.chunk(3, -1), w3.view(3, 16))], -1)
    torch.testing.assert_close(variant(fc_norm=True).project(aux), per_layer @ fc.T)
    assert not torch.allclose(per_layer, rms(aux, w3))              # the two forms differ

    normed = variant(norm_output=True)
    chain = lambda d: list(d.unroll(aux, ttt_attention, cu, lambda k, h: None if k == 2 else (   # noqa: E731
        h, emb, torch.arange(6) + k, None)))
    out_plain, out_normed = chain(plain), chain(normed)
    torch.testing.assert_close(out_normed[0], plain.norm(out_plain[0]))          # step 0: same input state
    h1 = plain.step(plain.norm(out_plain[0]), emb, torch.arange(6) + 1, [[]], ttt_attention, cu)
    assert not torch.allclose(out_normed[1], plain.norm(out_plain[1]))          # step 1 reads the normed state
    torch.testing.assert_close(normed.head_input(out_normed[0]), plain.head_input(out_plain[0]))
    assert h1.shape == out_normed[1].shape


@pytest.mark.parametrize("flags, tensors", [
    ({"experimental.aux_norm": "concat", "experimental.norm_output": "true",
      "experimental.norm_before_residual": "true"}, ["input_norm.weight"]),
    ({"experimental.aux_norm": "per_layer"}, ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]),
])
def test_eagle31_norms_train_export_and_decode_back(tmp_path, llama_target, token_data, hidden, flags, tensors):
    import json
    from safetensors import safe_open
    from eagle3 import train_state
    from eagle3.draft_io import load_vllm_draft
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.max_steps": 3,
                                                             "export.formats": '["vllm"]', **flags})
    training.run(cfg)
    vllm = tmp_path / "train" / "export" / "vllm"
    config = json.loads((vllm / "config.json").read_text())
    aux_norm = flags.get("experimental.aux_norm")
    for key, on in (("norm_before_residual", flags.get("experimental.norm_before_residual") == "true"),
                    ("norm_before_fc", aux_norm == "concat"), ("fc_norm", aux_norm == "per_layer"),
                    ("norm_output", flags.get("experimental.norm_output") == "true")):
        assert config[key] is on
    with safe_open(vllm / "model.safetensors", "pt") as f:
        assert set(tensors) <= set(f.keys())
        assert not any(torch.equal(f.get_tensor(n).float(), torch.ones(16)) for n in tensors)   # trained
    loaded, _ = load_vllm_draft(vllm)
    trained = train_state.load_draft(train_state.latest(tmp_path / "train"))[0]
    aux = torch.randn(5, 3 * loaded.spec.target_hidden_size)
    emb, cu = torch.randn(5, loaded.spec.hidden_size), torch.tensor([0, 5], dtype=torch.int32)
    outputs = [list(d.unroll(aux, ttt_attention, cu, lambda k, h: None if k == 2 else (
        h, emb, torch.arange(5) + k, None))) for d in (loaded, trained)]
    for a, b in zip(*outputs):   # the export (bf16) decodes what was trained
        torch.testing.assert_close(a, b.float(), rtol=2e-2, atol=2e-2)


def test_eagle31_norm_settings_are_checked_at_start(tmp_path, llama_target, token_data):
    """SGLang 0.5.23's Llama draft reads EAGLE-3.1's norms; not norm_before_residual (tests/test_serving.py)."""
    from eagle3.config import ConfigError, check_servable_settings
    for key, value in (("aux_norm", "concat"), ("aux_norm", "per_layer"), ("norm_output", "true")):
        check_servable_settings(make_config(tmp_path, llama_target, token_data, **{f"experimental.{key}": value}))
    with pytest.raises(ConfigError, match="experimental.norm_before_residual cannot be exported for SGLang"):
        check_servable_settings(make_config(tmp_path, llama_target, token_data,
                                            **{"experimental.norm_before_residual": "true"}))


def test_prompt_rows_train_prompt_labels_but_count_only_assistant_rows():
    mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])                 # a 4-token prompt, a 4-token reply
    greedy, t2d = torch.arange(8), torch.ones(8, dtype=torch.bool)
    positions, seq_len = torch.arange(8), torch.full((8,), 8)
    plain = step_targets(0, positions, seq_len, mask, greedy, t2d)
    prompt = step_targets(0, positions, seq_len, mask, greedy, t2d, RowRule(prompt=True))
    assert plain.valid.nonzero().flatten().tolist() == [2, 3, 4, 5]           # labels x[4..7]
    assert prompt.valid.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]    # labels x[2..7]
    assert torch.equal(prompt.acc_rows, plain.acc_rows)

    draft, batch = assert_more_rows_trained_same_counts(RowRule(prompt=True))
    assert plan_rows(batch, 3, draft.t2d, rule=RowRule(prompt=True)).denominator > plan_rows(batch, 3, draft.t2d).denominator
