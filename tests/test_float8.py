"""fp8 training GEMMs (`train.float8`), on the CPU (torch._scaled_mm runs there too)."""
import json

import pytest
import torch

from conftest import make_config
from eagle3 import float8, linear, training
from eagle3.kernels import fp8_cast


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows", [37, 64])          # 37: padded to a multiple of 16 inside
def test_fp8_linear_forward_and_backward_follow_the_fp32_ones(rows):
    torch.manual_seed(0)
    x = (torch.randn(rows, 96) * 30).requires_grad_()  # dynamic scales: any magnitude
    w = (torch.randn(48, 96) * 0.01).requires_grad_()
    g = torch.randn(rows, 48)
    y = float8.linear(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    ref = x @ w.T
    rdx, rdw = torch.autograd.grad(ref, (x, w), g)
    assert y.shape == ref.shape and dw.dtype == torch.float32
    # e4m3 keeps 3 mantissa bits, e5m2 2: a few percent, not more
    assert rel(y, ref) < 0.05 and rel(dx, rdx) < 0.08 and rel(dw, rdw) < 0.08
    assert rel(y, ref) > 1e-4                          # and it did run in fp8
    three = torch.randn(2, 5, 96)                      # leading dimensions are kept
    assert float8.linear(three, w).shape == (2, 5, 48)


def test_the_fp8_step_keeps_fp32_masters_and_trains(tmp_path, llama_target, token_data, hidden):
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.float8": "true",
                                                             "train.max_steps": 6})
    trainer = training.Trainer(cfg)
    draft = trainer.model.draft
    assert draft.linears is float8.linears and draft.layers[0].mlp.linears is float8.linears
    assert all(p.dtype == torch.float32 for p in trainer.params)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"][0] for r in records if r["split"] == "train"]
    assert losses[-1] < losses[0]


def test_float8_refuses_a_gpu_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"c.toml: train.float8 = true needs .*A100 has 8.0"):
        float8.check_device(torch.device("cuda", 0), "c.toml")
    float8.check_device(torch.device("cpu"), "c.toml")   # the CPU runs torch._scaled_mm
    with pytest.raises(ValueError, match=r"c.toml: train.float8_head = true needs .*A100"):
        float8.check_device(torch.device("cuda", 0), "c.toml", "train.float8_head")   # the setting that asked
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2")                 # ROCm: refused up front, as auto is
    with pytest.raises(ValueError, match=r"c.toml: train.float8 = true is not supported on ROCm"):
        float8.check_device(torch.device("cuda", 0), "c.toml")


def test_float8_names_a_width_that_is_not_a_multiple_of_16():
    with pytest.raises(ValueError, match=r"c.toml: .*multiples of 16; intermediate_size = 100"):
        float8.check_dims({"hidden_size": 64, "intermediate_size": 100}, "c.toml")


def test_under_autocast_fp8_outputs_what_the_dense_path_outputs():
    x, w = torch.randn(20, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):     # an fp32 input under bf16 autocast
        fp8, dense = float8.linear(x, w), linear.dense_linear(x, w)
    assert fp8.dtype == dense.dtype == torch.bfloat16
    fp8.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32


def test_inside_casts_reused_a_weight_is_cast_once_until_it_changes(monkeypatch):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 64) * 0.05)
    xs = [torch.randn(20, 64, requires_grad=True) for _ in range(3)]
    g = torch.randn(20, 32)

    def grads(x):
        return torch.autograd.grad(float8.linear(x, w), (x, w), g)

    plain = [grads(x) for x in xs]
    calls = []
    monkeypatch.setattr(fp8_cast, "to_fp8_reference", lambda t, dtype: _count(calls, t, dtype))
    with linear.casts_reused():
        reused = [grads(x) for x in xs]
        assert calls.count((32, 64)) == 1            # the weight: once for the three inputs
        with torch.no_grad():
            w.mul_(2)                                # an in-place change: cast again
        grads(xs[0])
        assert calls.count((32, 64)) == 2
    for (dx, dw), (rdx, rdw) in zip(reused, plain):   # the same numbers as casting every time
        assert torch.equal(dx, rdx) and torch.equal(dw, rdw)


def test_inside_casts_reused_one_input_of_two_layers_is_cast_once(monkeypatch):
    w1, w2 = torch.nn.Parameter(torch.randn(16, 64)), torch.nn.Parameter(torch.randn(48, 64))
    x = torch.randn(20, 64)
    calls = []
    monkeypatch.setattr(fp8_cast, "to_fp8_reference", lambda t, dtype: _count(calls, t, dtype))
    with linear.casts_reused():
        float8.linear(x, w1), float8.linear(x, w2)
        float8.linear(x.clone(), w1)                # another tensor, equal values: cast anew
    assert calls.count((20, 64)) == 2 and len(calls) == 4


_to_fp8 = fp8_cast.to_fp8_reference


def _count(calls, t, dtype):
    calls.append(tuple(t.shape))
    return _to_fp8(t, dtype)


def fake_timings(monkeypatch, table):
    """float8.timings as measured: {part: (bf16 ms, fp8 ms)}."""
    monkeypatch.setattr(float8, "timings", lambda spec, tokens, device, part: dict(
        zip(("bf16_ms", "fp8_ms"), table[part])))


def test_auto_float8_is_on_only_where_the_gpu_the_widths_and_the_timing_allow_it(monkeypatch, capsys):
    from types import SimpleNamespace
    spec = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, target_hidden_size=64)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA X")
    fake_timings(monkeypatch, {"layer": (2.0, 1.0)})
    assert float8.choose(None, torch.device("cpu"), spec, "c.toml") is False
    assert "train.float8 = auto: off (cpu: fp8 GEMMs need a GPU)" in capsys.readouterr().err
    assert float8.choose(None, torch.device("cpu"), spec, "c.toml", say=False) is False   # not rank 0
    assert capsys.readouterr().err == ""
    timed = "one layer's GEMMs at 16384 tokens: fp8 1.00 ms, bf16 2.00 ms; timed once"
    for capability, widths, on, said in [((9, 0), {}, True, f"on ({timed}"),
                                         ((8, 0), {}, False, "off (no fp8 tensor cores on NVIDIA X)"),
                                         ((9, 0), {"intermediate_size": 100}, False, "off (widths not multiples "
                                                                                      "of 16: intermediate_size)")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert float8.choose(None, gpu, SimpleNamespace(**{**vars(spec), **widths}), "c.toml") is on
        assert f"train.float8 = auto: {said}" in capsys.readouterr().err
    # a small draft: the casts cost more than the GEMMs save, or not clearly less; or one rank disagrees
    for bf16, fp8 in [(1.0, 1.2), (1.0, 0.97)]:
        fake_timings(monkeypatch, {"layer": (bf16, fp8)})
        assert float8.choose(None, gpu, spec, "c.toml") is False
        said = capsys.readouterr().err
        assert f"train.float8 = auto: off (one layer's GEMMs at 16384 tokens: fp8 {fp8:.2f} ms" in said
    fake_timings(monkeypatch, {"layer": (2.0, 1.0)})
    assert float8.choose(None, gpu, spec, "c.toml", say=False, agree=lambda on: False) is False
    monkeypatch.setattr(torch.version, "hip", "6.2")                    # ROCm: other fp8 formats
    assert float8.choose(None, gpu, spec, "c.toml") is False
    assert "train.float8 = auto: off (ROCm: not supported)" in capsys.readouterr().err
    monkeypatch.setattr(torch.version, "hip", None)
    assert float8.choose(False, gpu, spec, "c.toml") is False           # an explicit choice is kept
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="needs a GPU with fp8 tensor cores"):
        float8.choose(True, gpu, spec, "c.toml")


def test_the_fp8_timing_is_measured_once_per_gpu_versions_shape_and_tokens(monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA X")
    measured = []
    monkeypatch.setattr(float8, "_workload", lambda part, spec, tokens, device, fp8: (part, tokens, fp8))
    monkeypatch.setattr(float8, "_median_ms", lambda step, device: measured.append(step) or (1.0 if step[2] else 3.0))
    spec = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, target_hidden_size=64, draft_vocab_size=256)
    gpu = torch.device("cuda", 0)
    assert float8.timings(spec, 4096, gpu, "layer") == {"bf16_ms": 3.0, "fp8_ms": 1.0}
    assert float8.faster(spec, 4096, gpu, "layer")[0] and len(measured) == 2        # the second read the cache
    float8.timings(spec, 8192, gpu, "layer")                                          # another token count
    float8.timings(SimpleNamespace(**{**vars(spec), "hidden_size": 128}), 4096, gpu, "layer")   # another shape
    float8.timings(spec, 4096, gpu, "head")
    assert measured == [("layer", 4096, False), ("layer", 4096, True), ("layer", 8192, False), ("layer", 8192, True),
                        ("layer", 4096, False), ("layer", 4096, True), ("head", 4096, False), ("head", 4096, True)]
    assert len(json.loads((tmp_path / "eagle3" / "float8.json").read_text())) == 4
    (tmp_path / "eagle3" / "float8.json").write_text("{not json")                    # a damaged cache: timed anew
    assert float8.timings(spec, 4096, gpu, "layer") == {"bf16_ms": 3.0, "fp8_ms": 1.0} and len(measured) == 10
    assert not list((tmp_path / "eagle3").glob("*.tmp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "eagle3" / "float8.json"))    # a file: no cache folder there
    assert float8.timings(spec, 4096, gpu, "layer") == {"bf16_ms": 3.0, "fp8_ms": 1.0}
    assert "the fp8 timing could not be cached" in capsys.readouterr().err


def test_the_timed_workload_runs_and_leaves_the_random_stream_alone():
    """The layer workload runs forward and backward (on the CPU: bf16) without drawing from the global
    generator the run's later draws use."""
    from types import SimpleNamespace
    spec = SimpleNamespace(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, target_hidden_size=32, draft_vocab_size=64)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    float8._workload("layer", spec, 16, torch.device("cpu"), False)()
    assert torch.equal(torch.rand(3), expected)


def test_without_autograd_the_fp8_linear_is_the_dense_one():
    x, w = torch.randn(20, 32), torch.randn(16, 32)
    with torch.no_grad():                                # held-out evaluation: the draft as served
        assert torch.equal(float8.linear(x, w), linear.dense_linear(x, w))
    assert not torch.equal(float8.linear(x, w), linear.dense_linear(x, w))


def test_float8_head_needs_the_triton_loss_on_a_gpu(tmp_path, llama_target, token_data, hidden):
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.float8_head": "true"})
    with pytest.raises(ValueError, match=r"train.float8_head = true needs the Triton loss on a GPU"):
        training.Trainer(cfg)


def test_float8_head_wraps_the_triton_loss_and_checks_its_widths(monkeypatch):
    from types import SimpleNamespace

    from eagle3.kernels import reference
    from eagle3.kernels.ttt_loss import ttt_loss_steps
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu, spec = torch.device("cuda", 0), SimpleNamespace(hidden_size=64, draft_vocab_size=256)
    loss = float8.head_loss(True, True, ttt_loss_steps, gpu, spec, "c.toml")
    assert loss.func is ttt_loss_steps and loss.keywords == {"float8": True}
    with pytest.raises(ValueError, match=r"train.float8_head = true needs .*multiples of 16; draft_vocab_size = 100"):
        float8.head_loss(True, True, ttt_loss_steps, gpu, SimpleNamespace(hidden_size=64, draft_vocab_size=100),
                         "c.toml")
    with pytest.raises(ValueError, match="needs the Triton loss"):
        float8.head_loss(True, True, reference.ttt_loss_steps, gpu, spec, "c.toml")
    assert float8.head_loss(False, True, ttt_loss_steps, gpu, spec, "c.toml") is ttt_loss_steps


def test_auto_float8_head_follows_train_float8_and_the_triton_loss(monkeypatch, capsys):
    from types import SimpleNamespace

    from eagle3.kernels import reference
    from eagle3.kernels.ttt_loss import ttt_loss_steps
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu, spec = torch.device("cuda", 0), SimpleNamespace(hidden_size=64, draft_vocab_size=256)
    fake_timings(monkeypatch, {"head": (2.0, 1.5)})
    loss = float8.head_loss(None, True, ttt_loss_steps, gpu, spec, "c.toml")
    assert loss.func is ttt_loss_steps and loss.keywords == {"float8": True}
    assert ("train.float8_head = auto: on (the lm_head loss at 16384 tokens: fp8 1.50 ms, bf16 2.00 ms"
            in capsys.readouterr().err)
    fake_timings(monkeypatch, {"head": (2.0, 2.5)})                      # slower in fp8 at this shape
    assert float8.head_loss(None, True, ttt_loss_steps, gpu, spec, "c.toml") is ttt_loss_steps
    assert "train.float8_head = auto: off (the lm_head loss at 16384 tokens: fp8 2.50 ms" in capsys.readouterr().err
    for draft_fp8, loss_steps, device, widths, said in [
            (False, ttt_loss_steps, gpu, {}, "train.float8 is off"),
            (True, reference.ttt_loss_steps, gpu, {}, "not the Triton loss on a GPU"),
            (True, ttt_loss_steps, torch.device("cpu"), {}, "not the Triton loss on a GPU"),
            (True, ttt_loss_steps, gpu, {"draft_vocab_size": 100}, "widths not multiples of 16: draft_vocab_size")]:
        chosen = float8.head_loss(None, draft_fp8, loss_steps, device, SimpleNamespace(**{**vars(spec), **widths}),
                                  "c.toml")
        assert chosen is loss_steps
        assert f"train.float8_head = auto: off ({said})" in capsys.readouterr().err
    float8.head_loss(None, True, ttt_loss_steps, gpu, spec, "c.toml", say=False)   # not rank 0
    assert capsys.readouterr().err == ""


def test_a_checkpoint_says_whether_fp8_ran_and_a_resume_without_it_says_so(tmp_path, llama_target, token_data,
                                                                          hidden, capsys):
    from eagle3 import train_state
    first = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.float8": "true",
                                                               "train.max_steps": 3})
    training.Trainer(first).run()
    assert train_state.read_state(train_state.latest(tmp_path / "train"))["float8_used"] is True
    capsys.readouterr()
    again = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.float8": "false",
                                                               "train.max_steps": 6})
    trainer = training.Trainer(again)
    assert "its steps so far ran with fp8 GEMMs (train.float8), from here without" in capsys.readouterr().err
    trainer.run()
    state = train_state.read_state(train_state.latest(tmp_path / "train"))
    assert state["float8_used"] is False and state["float8_head_used"] is False   # CPU: auto resolved off


def test_a_zero_row_input_passes_the_fp8_linear_both_ways():
    x, w = torch.randn(0, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    y = float8.linear(x, w)                               # a micro-batch with no trained row, at step 0
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 32) and (w.grad == 0).all()
