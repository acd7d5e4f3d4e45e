"""Recipe levers: rows outside the draft vocab, input noise, hard labels, fp32 residual, norm before residual."""
import pytest
import torch

from conftest import make_config
from eagle3 import extraction, training
from eagle3.ttt import Objective, noisy, step_targets, target_probs, ttt_forward
from kernels.reference import ttt_attention, ttt_loss_steps
from test_ttt import random_batch, tiny_draft


def test_oov_rows_are_trained_only_when_asked_and_always_count_as_misses():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])
    greedy = torch.arange(8)
    t2d = torch.ones(8, dtype=torch.bool)
    t2d[4] = False                                   # the target's greedy token 4 is outside the draft vocab
    positions, seq_len = torch.arange(8), torch.full((8,), 8)
    drop = step_targets(1, positions, seq_len, mask, greedy, t2d)
    keep = step_targets(1, positions, seq_len, mask, greedy, t2d, oov_rows=True)
    assert torch.equal(keep.acc_rows, drop.acc_rows) and torch.equal(keep.valid, keep.acc_rows)
    assert (keep.valid & ~drop.valid).nonzero().flatten().tolist() == [2]   # row 2 reads x[4] at step 1

    draft, batch = tiny_draft(), random_batch([11, 17])
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    _, m_drop, _ = ttt_forward(draft, batch, embed, head, 3, ttt_attention, ttt_loss_steps)
    _, m_keep, d_keep = ttt_forward(draft, batch, embed, head, 3, ttt_attention, ttt_loss_steps,
                                    objective=Objective(oov_rows=True))
    assert (m_keep[:, 1] > m_drop[:, 1]).all()                     # more rows trained at every step
    assert torch.equal(m_keep[:, 2:], m_drop[:, 2:])               # same accuracy, rows and acceptance


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
    assert torch.equal(runs[0][1][:, 1:], runs[1][1][:, 1:])                  # ...on the same rows and argmaxes


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
