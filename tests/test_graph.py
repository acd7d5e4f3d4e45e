"""CUDA graphs' static shapes, on the CPU: a padded batch at static shapes trains and measures exactly
what the batch does; when auto turns graphs on."""
import pytest
import torch

from eagle3.data.batch import RowRule, pad
from eagle3.config import ConfigError
from eagle3.training import graph
from eagle3.ttt import Objective, ttt_forward
from eagle3.kernels.reference import ttt_attention, ttt_loss_steps
from test_ttt import random_batch, tiny_draft


def test_pad_lays_out_filler_rows_that_no_label_reaches():
    batch = random_batch([11, 17])
    padded = pad(batch, 50, 17)
    assert padded.rows == 28 and padded.padding == 22 and padded.cu_seqlens.numel() == 51
    assert padded.cu_seqlens.tolist()[:3] == [0, 11, 28] and padded.cu_seqlens.diff()[2:].le(1).all()
    # the kernels see the filler as sequences no longer than the longest, then empty ones: 8 in all
    assert padded.cu_attention.tolist() == [0, 11, 28, 45, 50, 50, 50, 50, 50]
    assert pad(random_batch([5] * 9), 45, 5).cu_attention.numel() == 17   # 9 sequences: the next power of two
    static = graph.load(padded)
    assert static.rows == 50 and torch.equal(static.input_ids[:28], batch.input_ids) and not static.aux_hidden[28:].any()
    again = graph.load(pad(random_batch([20], seed=1), 50, 17), static)
    assert again is static and torch.equal(static.input_ids[:20], random_batch([20], seed=1).input_ids)
    assert not static.input_ids[20:].any() and not static.final_hidden[20:].any()


@pytest.mark.parametrize("loss,prompt", [("kl", False), ("nla", True)])
def test_a_padded_batch_at_static_shapes_gives_the_same_loss_gradients_and_metrics(loss, prompt):
    draft, batch = tiny_draft(), random_batch([11, 17])
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    objective = Objective(RowRule(prompt), loss=loss)
    results = []
    buffers = graph.load(pad(random_batch([40, 20], seed=3), 64, 40))   # a longer batch's buffers
    for b, static in ((batch, False), (graph.load(pad(batch, 64, 17), buffers), True)):
        draft.zero_grad()
        total, metrics, _ = ttt_forward(draft, b, embed, head, 3, ttt_attention, ttt_loss_steps, scale=0.5,
                                        objective=objective, static=static)
        total.backward()
        results.append((total.detach(), metrics, [p.grad.clone() for p in draft.parameters() if p.grad is not None]))
    (t0, m0, g0), (t1, m1, g1) = results
    torch.testing.assert_close(t1, t0)
    torch.testing.assert_close(m1, m0)
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a)


def test_auto_graphs_small_drafts_on_one_gpu_only(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    assert graph.wanted(None, cuda, 1, False, True, 256, "c.toml")
    assert not graph.wanted(None, cuda, 1, False, True, 4096, "c.toml")
    assert not graph.wanted(None, torch.device("cpu"), 1, False, True, 256, "c.toml")
    assert not graph.wanted(None, cuda, 8, False, True, 256, "c.toml")
    assert not graph.wanted(False, cuda, 1, False, True, 256, "c.toml")
    assert graph.wanted(True, cuda, 1, False, True, 4096, "c.toml")
    with pytest.raises(ConfigError, match=r"c.toml: debug.cuda_graphs = true .*several ranks"):
        graph.wanted(True, cuda, 2, False, True, 256, "c.toml")
    monkeypatch.setattr(torch.version, "hip", "6.4")   # ROCm: auto stays off, true is the user's call
    assert not graph.wanted(None, cuda, 1, False, True, 256, "c.toml")
    assert graph.wanted(True, cuda, 1, False, True, 256, "c.toml")
