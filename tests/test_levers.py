"""Recipe levers: rows outside the draft vocab, input noise, hard labels, fp32 residual, norm before residual."""
import pytest
import torch

from conftest import make_config
from eagle3 import extraction, training
from eagle3.data.batch import RowRule
from eagle3.ttt import Objective, noisy, plan_rows, step_targets, target_probs, ttt_forward
from kernels.reference import ttt_attention, ttt_loss_steps
from test_ttt import random_batch, tiny_draft


def test_oov_rows_are_trained_only_when_asked_and_always_count_as_misses():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])
    greedy = torch.arange(8)
    t2d = torch.ones(8, dtype=torch.bool)
    t2d[4] = False                                   # the target's greedy token 4 is outside the draft vocab
    positions, seq_len = torch.arange(8), torch.full((8,), 8)
    drop = step_targets(1, positions, seq_len, mask, greedy, t2d)
    keep = step_targets(1, positions, seq_len, mask, greedy, t2d, RowRule(oov=True))
    assert torch.equal(keep.acc_rows, drop.acc_rows) and torch.equal(keep.valid, keep.acc_rows)
    assert (keep.valid & ~drop.valid).nonzero().flatten().tolist() == [2]   # row 2 reads x[4] at step 1

    assert_more_rows_trained_same_counts(RowRule(oov=True))


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


def test_aux_noise_scales_with_each_layer_and_is_off_at_zero():
    torch.manual_seed(0)
    aux = torch.cat([torch.randn(4000, 8), 10 * torch.randn(4000, 8), 100 * torch.randn(4000, 8)], 1)
    out = noisy(aux, 0.1)
    rms = aux.view(4000, 3, 8).pow(2).mean(-1).sqrt()
    ratio = (out - aux).view(4000, 3, 8).pow(2).mean(-1).sqrt() / rms      # per token and layer ~ 0.1
    assert torch.allclose(ratio.mean(0), torch.full((3,), 0.1), rtol=0.05)
    assert torch.equal(noisy(aux, 0.0), aux)

    draft, batch = tiny_draft(), random_batch([20])
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    clean = ttt_forward(draft, batch, embed, head, 2, ttt_attention, ttt_loss_steps)[0]
    torch.manual_seed(1)
    noised = ttt_forward(draft, batch, embed, head, 2, ttt_attention, ttt_loss_steps,
                         objective=Objective(aux_noise=0.5))[0]
    assert not torch.allclose(clean, noised)


def test_hard_label_moves_the_target_towards_the_top_token_and_keeps_a_distribution():
    torch.manual_seed(0)
    final, head = torch.randn(9, 16), torch.randn(24, 16)
    soft, half, hard = (target_probs(final, head, 3, w) for w in (0.0, 0.5, 1.0))
    assert soft.shape == hard.shape == (12, 24) and not hard[8:].any()       # shifted, padded rows stay zero
    top = soft[:8].argmax(-1)
    assert torch.equal(hard[:8], torch.nn.functional.one_hot(top, 24).float())
    assert torch.allclose(half[:8], (soft[:8] + hard[:8]) / 2) and torch.allclose(half[:8].sum(-1), torch.ones(8))

    draft, batch = tiny_draft(), random_batch([13, 9])
    embed = torch.randn(40, 16)
    runs = [ttt_forward(draft, batch, embed, head, 2, ttt_attention, ttt_loss_steps, objective=Objective(hard_label=w))
            for w in (0.0, 1.0)]
    assert not torch.allclose(runs[0][0], runs[1][0])                        # another loss...
    assert torch.equal(runs[0][1][:, 1:7], runs[1][1][:, 1:7])                # ...on the same rows and argmaxes
    # (the expected acceptance, columns 7 and 8, is measured against the loss's own target)


def test_fp32_residual_keeps_the_chain_in_fp32_with_bf16_inputs():
    draft = tiny_draft()
    aux = torch.randn(6, 48).bfloat16()
    assert draft.project(aux).dtype == torch.bfloat16
    draft.fp32_residual = True
    h = draft.project(aux)
    assert h.dtype == torch.float32
    out = draft.step(h, torch.randn(6, 16).bfloat16(), torch.arange(6), [[]], ttt_attention,
                     torch.tensor([0, 6], dtype=torch.int32))
    assert out.dtype == torch.float32


def test_the_trainer_passes_the_levers_and_evaluates_without_noise(tmp_path, llama_target, token_data):
    cfg = make_config(tmp_path, llama_target, token_data, **{"train.oov_rows": "true", "train.aux_noise": 0.3,
                                                             "train.hard_label": 0.5,
                                                             "vocab.draft_vocab_size": 64})
    extraction.run(cfg)
    trainer = training.Trainer(cfg)
    batch = trainer._on_device(trainer._prepared(trainer.reader.read(trainer.plan.epoch(0)[0])))
    with torch.no_grad():
        eval_a, eval_b = (trainer._forward(trainer.model, batch)[0] for _ in range(2))
        train_a, train_b = (trainer._forward(trainer.model, batch, training=True)[0] for _ in range(2))
    assert torch.equal(eval_a, eval_b) and not torch.equal(train_a, train_b)
    trained = sum(b.numel() for b in batch.plan.loss)
    cfg.train.oov_rows = False
    assert trained > sum(r.numel() for r in trainer.prepare_batch(trainer.reader.read(trainer.plan.epoch(0)[0])).plan.loss)


def test_norm_before_residual_starts_the_residual_from_the_normed_state(tmp_path, llama_target, token_data, hidden):
    import dataclasses
    import json
    from eagle3.config import ConfigError
    from eagle3.export import load_vllm_draft
    plain = tiny_draft()
    normed = type(plain)(dataclasses.replace(plain.spec, norm_before_residual=True))
    normed.load_state_dict(plain.state_dict())
    h, emb = torch.randn(6, 16), torch.randn(6, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    step = lambda d, x: d.step(x, emb, torch.arange(6), [[]], ttt_attention, cu)   # noqa: E731
    # hidden_norm starts at weight 1, where normalising twice is normalising once
    torch.testing.assert_close(step(normed, h), step(plain, plain.layers[0].hidden_norm(h)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(step(normed, h), step(plain, h))

    with pytest.raises(ConfigError, match="norm_before_residual = true cannot be exported for SGLang"):
        make_config(tmp_path, llama_target, token_data, **{"draft.norm_before_residual": "true"})
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.max_steps": 2,
                                                             "draft.norm_before_residual": "true",
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
    ({"draft.norm_before_fc": "true", "draft.norm_output": "true", "draft.norm_before_residual": "true"},
     ["input_norm.weight"]),
    ({"draft.fc_norm": "true"}, ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]),
])
def test_eagle31_norms_train_export_and_decode_back(tmp_path, llama_target, token_data, hidden, flags, tensors):
    import json
    from safetensors import safe_open
    from eagle3 import checkpoint as ckpt_io
    from eagle3.export import load_vllm_draft
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.max_steps": 3,
                                                             "export.formats": '["vllm"]', **flags})
    training.run(cfg)
    vllm = tmp_path / "train" / "export" / "vllm"
    config = json.loads((vllm / "config.json").read_text())
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert config[key] is (flags.get(f"draft.{key}") == "true")
    with safe_open(vllm / "model.safetensors", "pt") as f:
        assert set(tensors) <= set(f.keys())
        assert not any(torch.equal(f.get_tensor(n).float(), torch.ones(16)) for n in tensors)   # trained
    loaded, _ = load_vllm_draft(vllm)
    trained = ckpt_io.load_draft(ckpt_io.latest(tmp_path / "train"))[0]
    aux = torch.randn(5, 3 * loaded.spec.target_hidden_size)
    emb, cu = torch.randn(5, loaded.spec.hidden_size), torch.tensor([0, 5], dtype=torch.int32)
    outputs = [list(d.unroll(aux, ttt_attention, cu, lambda k, h: None if k == 2 else (
        h, emb, torch.arange(5) + k, None))) for d in (loaded, trained)]
    for a, b in zip(*outputs):   # the export (bf16) decodes what was trained
        torch.testing.assert_close(a, b.float(), rtol=2e-2, atol=2e-2)


def test_eagle31_norm_settings_are_checked_at_start(tmp_path, llama_target, token_data):
    from eagle3.config import ConfigError
    with pytest.raises(ConfigError, match="norm_before_fc and draft.fc_norm are both true"):
        make_config(tmp_path, llama_target, token_data, **{"draft.norm_before_fc": "true", "draft.fc_norm": "true",
                                                           "export.formats": '["vllm"]'})
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        with pytest.raises(ConfigError, match=f"draft.{key} = true cannot be exported for SGLang"):
            make_config(tmp_path, llama_target, token_data, **{f"draft.{key}": "true"})


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
