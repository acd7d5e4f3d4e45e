"""The MLA draft layer (draft.attention = "mla"): its forward against transformers' DeepseekV3Attention inside
vLLM's Eagle3DeepseekV2ForCausalLM layer math, its TTT gradients through the Triton kernel (interpreted) against the
eager reference, a trained run's vLLM / SGLang exports read back to the same logits and decoded losslessly at T = 0 on
a tiny MLA target, and Kimi-K2.5's real MLA dims built and exported on the meta device.

Run as a script (TRITON_INTERPRET=1, by `run_interpreted`) it prints the interpreted kernel cases as JSON lines."""
import functools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from eagle3.draft import DraftSpec, Eagle3Draft

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_draft(seed=0, vocab=24, dims=(12, 8, 16, 8, 16)):
    """A tiny MLA draft: [q_lora, kv_lora, nope, rope, v] = dims (kernel head dim 64), YaRN x4, vocab maps set."""
    torch.manual_seed(seed)
    q_lora, kv_lora, nope, rope, v = dims
    spec = DraftSpec(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=nope + rope,
                     intermediate_size=32, num_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=128, draft_vocab_size=vocab, target_vocab_size=40, target_hidden_size=16,
                     attention="mla", q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                     qk_rope_head_dim=rope, v_head_dim=v, rope_scaling=YARN)
    draft = Eagle3Draft(spec)
    for p in draft.parameters():   # unit-scale linears (peaked attention) and norms away from 1
        p.data = torch.randn(p.shape) * p.shape[1] ** -0.5 if p.dim() == 2 else p.data + 0.2 * torch.randn(p.shape)
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[torch.randperm(40)[:vocab]] = True
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(t2d.nonzero().flatten() - torch.arange(vocab))
    return draft


# ---------------------------------------------------------------------------------------------
# forward: vLLM's layer math around transformers' MLA attention

def vllm_layer_reference(draft: Eagle3Draft, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """One sequence through DeepseekV2Eagle3DecoderLayer's math (vllm/model_executor/models/deepseek_eagle3.py):
    cat[input_layernorm(emb), hidden_norm(h)] -> MLA attention (transformers' DeepseekV3Attention, its own YaRN
    rotary and softmax scale) -> + h -> post_attention_layernorm -> SwiGLU MLP -> + residual -> norm -> lm_head."""
    tf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    s, layer = draft.spec, draft.layers[0]
    config = tf.DeepseekV3Config(
        hidden_size=2 * s.hidden_size, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_attention_heads, q_lora_rank=s.q_lora_rank, kv_lora_rank=s.kv_lora_rank,
        qk_nope_head_dim=s.qk_nope_head_dim, qk_rope_head_dim=s.qk_rope_head_dim, v_head_dim=s.v_head_dim,
        rope_parameters={**s.rope_scaling, "rope_theta": s.rope_theta}, max_position_embeddings=128,
        rms_norm_eps=s.rms_norm_eps, attention_bias=False)
    config._attn_implementation = "eager"
    attn = tf.DeepseekV3Attention(config, 0)
    attn.o_proj = torch.nn.Linear(s.num_attention_heads * s.v_head_dim, s.hidden_size, bias=False)   # 2H in, H out
    attn.load_state_dict(layer.self_attn.state_dict())
    T = h.shape[0]
    x = torch.cat([rms(emb, layer.input_layernorm), rms(h, layer.hidden_norm)], -1)[None]   # [1, T, 2H]
    cos, sin = tf.DeepseekV3RotaryEmbedding(config)(x, torch.arange(T)[None])
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    h = h + attn(x, (cos, sin), mask)[0][0]
    m = layer.mlp
    x = rms(h, layer.post_attention_layernorm)
    h = h + torch.nn.functional.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T) @ m.down_proj.weight.T
    return rms(h, draft.norm) @ draft.lm_head.weight.T


def rms(x, norm):
    return norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)


def test_forward_equals_vllm_layer_math_with_transformers_attention():
    from eagle3.kernels.reference import ttt_attention
    draft = mla_draft(3)
    g = torch.Generator().manual_seed(1)
    T, H = 21, draft.spec.hidden_size
    h, emb = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    with torch.no_grad():
        out = draft.step(h, emb, torch.arange(T), [[]], ttt_attention, torch.tensor([0, T]))
        ours = draft.lm_head(draft.head_input(out))
        expected = vllm_layer_reference(draft, h, emb)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # YaRN shows: without its softmax mscale² the logits differ
    scale = draft.layers[0].self_attn.scale
    assert scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(4) + 1) ** 2)
    draft.layers[0].self_attn.scale = 24 ** -0.5
    with torch.no_grad():
        plain = draft.lm_head(draft.head_input(draft.step(h, emb, torch.arange(T), [[]], ttt_attention,
                                                           torch.tensor([0, T]))))
    assert (plain - expected).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# TTT gradients through the Triton kernel (interpreted) against the eager reference

def _grads(draft, attention):
    from eagle3.ttt import ttt_forward
    from eagle3.kernels.reference import ttt_loss_steps
    from test_ttt import random_batch
    g = torch.Generator().manual_seed(5)
    draft.zero_grad()
    total, _, _ = ttt_forward(draft, random_batch([11, 19, 6]), torch.randn(40, 16, generator=g),
                              torch.randn(24, 16, generator=g), 3, attention, ttt_loss_steps)
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def interpreted_cases() -> None:
    from eagle3.kernels import reference
    from eagle3.kernels.ttt_attention import ttt_attention
    from eagle3.kernels.mla_attention import ttt_attention_mla
    from eagle3.kernels.interpreter import INTERPRET
    print(json.dumps({"case": "interpreted", "ok": INTERPRET}))
    draft = mla_draft(7, dims=(16, 16, 16, 16, 32))   # widths the unpadded kernel serves
    loss_ref, ref = _grads(draft, reference.ttt_attention)
    padded = functools.partial(reference.padded_mla, ttt_attention)   # the GQA kernel over heads padded to 64
    for case, attention in (("ttt_gradients", ttt_attention_mla), ("padded_gradients", padded)):
        loss_tri, tri = _grads(draft, attention)
        worst = max(((tri[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)).item() for n in ref)
        ok = set(ref) == set(tri) and abs(loss_tri - loss_ref) < 1e-5 * abs(loss_ref) and worst < 1e-4
        print(json.dumps({"case": case, "ok": bool(ok), "detail": f"loss {loss_tri} vs {loss_ref}, "
                          f"worst relative gradient error {worst:.2e} over {len(ref)} tensors"}))
    # the GQA kernel at D = 256 (what the padded path gives Kimi's 192-wide q/k and 128-wide v heads)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(*shape, generator=g, requires_grad=True) for shape in ((9, 1, 256), (2, 9, 1, 256),
                                                                                    (2, 9, 1, 256)))
    outs = [fn(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32), scale=0.07)
            for fn in (ttt_attention, reference.ttt_attention)]
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    err = max((a - b).abs().max().item() for a, b in zip((outs[0], *grads[0]), (outs[1], *grads[1])))
    print(json.dumps({"case": "d256", "ok": err < 1e-4, "detail": f"max error {err:.2e}"}))


INTERPRETED_CHILD = True   # conftest starts the child at collection, in the background


@pytest.fixture(scope="module")
def interpreted():
    from conftest import run_interpreted
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", ["ttt_gradients", "padded_gradients", "d256"])
def test_triton_ttt_attention_gives_the_eager_gradients(interpreted, case):
    """The MLA draft's TTT gradients through the unpadded MLA kernel, and through the padded path, equal the eager
    reference's."""
    from conftest import assert_interpreted_case
    assert_interpreted_case(interpreted, case, case)


def test_fp8_gemms_give_the_mla_draft_the_dense_gradients_to_fp8_precision():
    """train.float8 swaps every linear of the MLA layer too (its widths here multiples of 16, as fp8 GEMMs want)."""
    from eagle3 import float8
    from eagle3.kernels.reference import ttt_attention
    dense = mla_draft(2, dims=(16, 16, 16, 16, 16))
    fp8 = mla_draft(2, dims=(16, 16, 16, 16, 16))
    fp8.use_float8()
    assert fp8.layers[0].self_attn.linears is float8.linears
    (loss_d, grads_d), (loss_f, grads_f) = _grads(dense, ttt_attention), _grads(fp8, ttt_attention)
    assert abs(loss_f - loss_d) < 0.05 * abs(loss_d)
    for name in ("layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_b_proj.weight", "fc.weight"):
        cos = torch.nn.functional.cosine_similarity(grads_f[name].flatten(), grads_d[name].flatten(), dim=0)
        assert cos > 0.95, (name, cos)


def test_the_gemms_are_the_mla_layers():
    from eagle3.float8 import gemm_widths, layer_shapes
    spec = mla_draft().spec
    shapes = layer_shapes(spec)
    assert shapes["self_attn.q_a_proj"] == (12, 32) and shapes["self_attn.kv_b_proj"] == (2 * 32, 8)
    assert {f"layers.0.{n}.weight" for n in shapes if n != "fc"} <= set(dict(mla_draft().named_parameters()))
    kimi = kimi_spec()
    assert layer_shapes(kimi)["self_attn.kv_a_proj_with_mqa"] == (576, 2 * 7168)
    assert kimi.attention_width() == 64 * (192 + 128 + 128) + 64   # q, k_nope and v per head, one k_pe: unpadded
    assert not [name for name, width in gemm_widths(kimi).items() if width % 16]   # fp8 GEMMs take every one
    assert gemm_widths(spec)["kv_lora_rank + qk_rope_head_dim"] == 16


def test_the_triton_choice_is_the_unpadded_kernel_at_the_widths_it_serves():
    """debug.kernels = "triton" (and "auto" on CUDA) trains an MLA draft with the unpadded kernel at Kimi's widths; at
    widths it does not serve, "triton" names the setting to change."""
    from types import SimpleNamespace
    from eagle3.training import kernel_choice
    from eagle3.kernels.mla_attention import ttt_attention_mla
    cfg = SimpleNamespace(debug=SimpleNamespace(kernels="triton"), source="c.toml",
                          train=SimpleNamespace(float8_head=None, batch_tokens=64))
    chosen = kernel_choice.choose(cfg, torch.device("cpu"), kimi_spec(), draft_float8=False, say=False)
    assert chosen.attention is ttt_attention_mla
    with pytest.raises(kernel_choice.TrainError, match=r"c.toml: debug.kernels = \"triton\" needs the MLA draft's "
                                                       r"nope, rope and v head dims in .*got \(16, 8, 16\).*mla_dims"):
        kernel_choice.choose(cfg, torch.device("cpu"), mla_draft().spec, draft_float8=False, say=False)


# ---------------------------------------------------------------------------------------------
# Kimi-K2.5's real dims build and export

def kimi_spec(config_file: Path | None = None, **overrides) -> DraftSpec:
    """The draft `resolve` makes for a target config (Kimi-K2.5's real one by default) with draft.attention mla."""
    from eagle3.models.weights import read_config
    from eagle3.resolve import resolve
    from conftest import KIMI_FIXTURE, make_config
    file = config_file or KIMI_FIXTURE
    cfg = make_config(Path("/nonexistent"), file.parent, Path("/nonexistent/data.jsonl"),
                      **{"draft.attention": "mla", **overrides})

    class Ckpt:   # resolve reads the config only
        config = read_config(file)
    return resolve(cfg, Ckpt()).draft_spec


def test_the_mla_dims_come_from_the_target_or_are_set(tmp_path):
    from eagle3.config import ConfigError
    llama = tmp_path / "config.json"
    llama.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                 "vocab_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "intermediate_size": 128, "rms_norm_eps": 1e-5}))
    with pytest.raises(ConfigError, match="needs q_lora_rank, .* the target's config .* gives \\[None"):
        kimi_spec(llama)   # a GQA target has no MLA dims
    spec = kimi_spec(llama, **{"experimental.mla_dims": "[64, 32, 64, 32, 64]"})
    assert (spec.q_lora_rank, spec.qk_rope_head_dim, spec.rope_scaling, spec.v_head_dim) == (64, 32, None, 64)
    with pytest.raises(ConfigError, match="an even rope dim"):
        kimi_spec(llama, **{"experimental.mla_dims": "[64, 32, 64, 31, 64]"})
    with pytest.raises(ConfigError, match="mla_dims is set but draft.attention is \"gqa\""):
        kimi_spec(**{"draft.attention": "gqa", "experimental.mla_dims": "[64, 32, 64, 32, 64]"})


def test_kimi_dims_build_and_export_on_meta(tmp_path):
    from eagle3.draft_io import read_draft_config
    from eagle3.export import export_weights, mla_config, vllm_name
    from eagle3.config import load
    spec = kimi_spec()
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
            spec.num_attention_heads) == (1536, 512, 128, 64, 128, 64)
    assert spec.rope_scaling["factor"] == 64 and spec.rope_scaling["rope_type"] == "yarn"
    with torch.device("meta"):
        draft = Eagle3Draft(spec)
    assert draft.layers[0].self_attn.scale == pytest.approx(0.1446796, abs=5e-8)   # 192^-0.5 · mscale(64)²
    from dataclasses import asdict
    state = {"resolved": {"draft_spec": asdict(spec), "aux_layer_ids": [1, 29, 57], "verifier_name": "kimi"},
             "target": {"model_type": "kimi_k25", "text_model_type": "kimi_k2", "num_hidden_layers": 61}}
    tensors = export_weights(dict(draft.state_dict()), asdict(spec), vllm_name, 1, torch.bfloat16)
    assert tensors["layers.0.self_attn.q_a_proj.weight"].shape == (1536, 2 * 7168)
    assert tensors["layers.0.self_attn.kv_b_proj.weight"].shape == (64 * 256, 512)
    config = mla_config(state, load(None, []))
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = read_draft_config(tmp_path)
    assert read["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and read["model_type"] == "deepseek_v3"
    assert read["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert read["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert read["rope_scaling"]["type"] == "yarn" and read["rope_scaling"]["factor"] == 64
    assert read["rope_scaling"]["rope_theta"] == read["rope_theta"] == 50000   # what vLLM's get_rope reads


def test_a_published_layout_loads(tmp_path):
    """A peer's MLA draft: midlayer.* names, the full vocabulary without d2t / t2d, an embedding copy, aux ids in
    eagle_config's "layer_ids" (vLLM 0.34.0 reads them as its own, inputs of layers; never eagle_config's
    eagle_aux_hidden_state_layer_ids, SGLang's key, which leaves vLLM its default layers)."""
    from safetensors.torch import save_file
    from eagle3.draft_io import load_vllm_draft
    from eagle3.kernels.reference import ttt_attention
    draft = mla_draft(4, vocab=40)
    s = draft.spec
    config = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 16,
              "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32, "num_hidden_layers": 1,
              "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128, "vocab_size": 40,
              "draft_vocab_size": 40, "rope_scaling": {**{k: v for k, v in YARN.items() if k != "rope_type"},
                                                       "type": "yarn"},
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [9, 9, 9], "layer_ids": [2, 5, 7]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in draft.state_dict().items() if k not in ("d2t", "t2d")}
    save_file({**tensors, "embed_tokens.weight": torch.randn(40, 16)}, tmp_path / "model.safetensors")
    theirs, aux = load_vllm_draft(tmp_path)
    assert aux == [1, 4, 6] and theirs.spec == s
    assert torch.equal(theirs.d2t, torch.zeros(40, dtype=torch.int64)) and bool(theirs.t2d.all())
    h, emb = torch.randn(9, 16), torch.randn(9, 16)
    with torch.no_grad():
        a, b = (d.step(h, emb, torch.arange(9), [[]], ttt_attention, torch.tensor([0, 9])) for d in (draft, theirs))
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# a trained run on a tiny MLA target: exports read back, lossless decoding

@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    from conftest import make_config
    from eagle3 import extraction, training
    from eagle3.models import tiny
    tmp = tmp_path_factory.mktemp("mla")
    target = tiny.make_kimi(tmp / "kimi", vocab=256, layers=5, shards=1)
    data = tiny.make_token_data(tmp / "data.jsonl", vocab=256, sequences=10, max_len=40)
    cfg = make_config(tmp, target, data, **{
        "draft.attention": "mla", "target.aux_layer_ids": "[1, 2, 3]", "train.max_steps": 4,
        "train.eval_every": 4, "train.checkpoint_every": 4, "export.formats": '["vllm", "sglang"]',
        "debug.export_dtype": "float32", "debug.evaluate_device": "cpu", "evaluate.max_new_tokens": 8,
        "evaluate.prompts": str(data)})
    extraction.run(cfg)
    training.run(cfg)
    return cfg


def test_exports_read_back_to_the_checkpoints_logits(mla_run):
    from eagle3 import train_state
    from eagle3.draft_io import load_vllm_draft
    from eagle3.models.weights import Checkpoint
    ours, state = train_state.load_draft(train_state.latest(mla_run.train.output_dir))
    assert state["resolved"]["draft_spec"]["attention"] == "mla"
    export = Path(mla_run.train.output_dir) / "export"
    g = torch.Generator().manual_seed(0)
    T, H = 13, ours.spec.hidden_size
    aux, emb = torch.randn(T, 3 * H, generator=g), torch.randn(T, H, generator=g)
    from eagle3.kernels.reference import ttt_attention

    def logits(draft):
        with torch.no_grad():
            h = draft.step(draft.project(aux), emb, torch.arange(T), [[]], ttt_attention, torch.tensor([0, T]))
            return draft.lm_head(draft.head_input(h))
    for fmt in ("vllm", "sglang"):
        config = json.loads((export / fmt / "config.json").read_text())
        assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["kv_lora_rank"] == 16
        theirs, aux_ids = load_vllm_draft(export / fmt, Checkpoint(mla_run.target.path))
        assert aux_ids == [1, 2, 3] and theirs.spec == ours.spec
        assert torch.equal(logits(theirs), logits(ours)), fmt


def test_real_decoding_with_the_mla_draft_is_lossless(mla_run):
    from eagle3 import train_state
    from eagle3.evaluate import real_decoding
    report = real_decoding(mla_run, train_state.latest(mla_run.train.output_dir))
    assert report["mismatches"] == 0 and report["prompts"] > 0 and report["rounds"] > 0


@pytest.mark.slow
def test_ddp_two_processes_train_the_mla_draft_as_one(tmp_path, llama_target, token_data, hidden):
    """An MLA draft (dims set: a Llama target has none) under DDP on 2 gloo ranks = 1 process accumulating 2."""
    from test_training import cli_args, final_weights, run_train
    mla = {"draft.attention": "mla", "experimental.mla_dims": "[32,16,16,16,16]"}
    run_train(cli_args(tmp_path / "one", llama_target, token_data, hidden, **mla, **{"train.grad_accum": 2}))
    run_train(cli_args(tmp_path / "two", llama_target, token_data, hidden, **mla), nproc=2)
    a, b = final_weights(tmp_path / "one" / "train"), final_weights(tmp_path / "two" / "train")
    assert "layers.0.self_attn.kv_b_proj.weight" in a
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_exports_the_engines_would_misread_are_refused():
    from eagle3.export import ExportError, check_servable
    spec = {"attention": "mla", "num_layers": 1, "norm_before_fc": True}
    with pytest.raises(ExportError, match="norm_before_fc is on .*vLLM's Eagle3DeepseekV2ForCausalLM"):
        check_servable(spec, "vllm", "ckpt")
    with pytest.raises(ExportError, match="SGLang's Eagle3DeepseekV2ForCausalLM 0.5.23 has one draft layer"):
        check_servable({"attention": "mla", "num_layers": 2}, "sglang", "ckpt")
    check_servable({"attention": "mla", "num_layers": 1, "fc_norm": True, "norm_output": True}, "sglang", "ckpt")


def test_the_step_bench_puts_the_mla_draft_beside_each_size():
    from eagle3.bench import step
    assert step.parse(["--tiny", "--mla"]).sizes == ["tiny", "tiny-mla"]
    kimi, mla = kimi_spec(), step.SIZES["kimi-mla"]
    assert mla["base"] == "kimi" and mla["attention"] == "mla"
    # per row and step: the MLA layer's GEMMs and attention at heads of 192 (q, k) and 128 (v), no padding
    linears = 2 * (1536 * 2 * 7168 + 64 * 192 * 1536 + 576 * 2 * 7168 + 64 * 256 * 512 + 7168 * 64 * 128
                   + 3 * 7168 * 18432)
    attention = 2 * (192 + 128) * 64 * (mla["seq_len"] / 2 + 1)
    head, fc = 2 * 7168 * 32000 * 2, 2 * 7168 * 3 * 7168
    assert step.step_flops(mla, kimi, 1, 1, False) == pytest.approx(3 * (fc + linears + attention) + head + head / 2)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    interpreted_cases()
