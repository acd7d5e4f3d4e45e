"""Checkpoints as their makers publish them: DeepSeek-V3 (with its MTP layer), flat Kimi-K2 and nested Kimi-K2.5
stored in fp8 blocks (float32 and bf16 scales, dimensions that end in a partial block) or int4 give the hidden states
that transformers' DeepseekV3ForCausalLM computes on the weights dequantized here by the published rule; every path
(whole, chunked, offline shards, online, staged); and each thing the reader refuses, refused by name."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import edited_copy, make_config
from eagle3 import extraction
from eagle3.data.online import OnlineReader
from eagle3.data.shards import ShardReader
from eagle3.models import quant, tiny
from eagle3.models.inspect import inspect
from eagle3.models.staged import StagedTarget
from eagle3.models.streaming import TargetRunner
from eagle3.models.weights import Checkpoint, TargetError

tf = pytest.importorskip("transformers")

SMALL = dict(layers=4, vocab=256, shards=2, hidden=64, kv_lora_rank=16)
TARGETS = {
    # block 128 over dims that straddle it: kv_a_proj_with_mqa 136 + 8 = 144 rows, hidden 160 columns, dense 144
    "deepseek_v3-fp8-f32": dict(SMALL, layout="deepseek_v3", weights="fp8", mtp=1, hidden=160, kv_lora_rank=136,
                                intermediate=144),
    # non-square blocks from weight_block_size: kv_a 20 + 8 = 28 rows = 16 + 12, every dim ends in a partial block
    "kimi_k2-fp8-bf16": dict(SMALL, layout="kimi_k2", weights="fp8", scale_dtype=torch.bfloat16, block=(16, 48),
                             kv_lora_rank=20),
    "kimi_k25-fp8-f32": dict(SMALL, layout="kimi_k25", weights="fp8", block=(128, 128)),
    "kimi_k2-int4": dict(SMALL, layout="kimi_k2", weights="int4"),
}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory) -> Path:
    return tiny.make_kimi(tmp_path_factory.mktemp("formats") / request.param, **TARGETS[request.param])


# ---------------------------------------------------------------------------------------------
# the reference: transformers on weights dequantized independently

def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """W[i, j] = float(w[i, j]) * scale_inv[i // b0, j // b1] (DeepSeek-V3 inference/kernel.py weight_dequant)."""
    rows = torch.arange(w.shape[0]) // block[0]
    cols = torch.arange(w.shape[1]) // block[1]
    return w.float() * scale_inv.float()[rows[:, None], cols[None, :]]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    words = packed.numpy().view(np.uint32)
    nibbles = np.stack([(words >> np.uint32(4 * j)) & np.uint32(15) for j in range(8)], -1)
    values = torch.from_numpy(nibbles.reshape(words.shape[0], -1).astype(np.int64) - 8).float()
    return values * scale.float().repeat_interleave(values.shape[1] // scale.shape[1], dim=1)


def dequantized_dir(target: Path, out: Path) -> Path:
    """`target` as a flat bf16-free fp32 deepseek_v3 checkpoint: dequantized, renamed, vision and MTP tensors left
    out; the config's quantization_config dropped."""
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    block = (text.get("quantization_config") or {}).get("weight_block_size")
    tensors = {}
    for f in target.glob("*.safetensors"):
        tensors.update(load_file(f))
    dense = {}
    for name, t in tensors.items():
        short = name.removeprefix("language_model.")
        if short.startswith(("vision_tower.", "mm_projector.")) or short.startswith(
                f"model.layers.{text['num_hidden_layers']}."):
            continue
        if name.endswith(".weight_scale_inv"):
            dense[short.removesuffix("_scale_inv")] = dequantize_fp8(tensors[name.removesuffix("_scale_inv")], t, block)
        elif name.endswith(".weight_packed"):
            base = name.removesuffix(".weight_packed")
            dense[short.removesuffix("_packed")] = dequantize_int4(t, tensors[base + ".weight_scale"])
        elif not name.endswith((".weight_scale", ".weight_shape")) and short not in dense:
            dense[short] = t.float()
    save_file({k: v.contiguous() for k, v in dense.items()}, out / "model.safetensors")
    text = {k: v for k, v in text.items() if k not in ("quantization_config", "auto_map")}
    (out / "config.json").write_text(json.dumps({**text, "model_type": "deepseek_v3",
                                                 "architectures": ["DeepseekV3ForCausalLM"]}))
    return out


@pytest.fixture(scope="module")
def reference(target, tmp_path_factory):
    """ids of two sequences -> transformers' states: {layer i: output [T, H]} and the post-norm final [T, H]."""
    model = tf.DeepseekV3ForCausalLM.from_pretrained(dequantized_dir(target, tmp_path_factory.mktemp("dense")),
                                                     dtype=torch.float32, attn_implementation="eager").eval()
    outs = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda _m, _a, out, i=i: outs.__setitem__(i, out[0] if isinstance(out, tuple)
                                                                                 else out))

    @torch.no_grad()
    def run(ids: torch.Tensor, cu: list[int]) -> tuple[dict, torch.Tensor]:
        layers, finals = {}, []
        for a, b in zip(cu[:-1], cu[1:]):
            finals.append(model.model(ids[None, a:b]).last_hidden_state[0])
            for i, h in outs.items():
                layers.setdefault(i, []).append(h[0])
        return {i: torch.cat(h) for i, h in layers.items()}, torch.cat(finals)
    return run


AUX = [0, 1, 2]
IDS = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0))
CU = [0, 20, 50]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_every_stored_format_gives_transformers_states_whole_and_chunked(target, reference):
    layers, final = reference(IDS, CU)
    want_aux = torch.cat([layers[i] for i in AUX], -1)
    ckpt = Checkpoint(target)
    for chunk in (1000, 8):   # whole; every sequence in chunks of 8 tokens (the latents of earlier chunks attended)
        got = TargetRunner(ckpt, AUX, torch.device("cpu"), torch.float32, chunk_tokens=chunk).run(IDS, CU)
        torch.testing.assert_close(got["aux_hidden"], want_aux, rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(got["final_hidden"], final, rtol=2e-4, atol=2e-4)
    staged = StagedTarget(ckpt, AUX, torch.device("cpu"), torch.float32, rank=0, world=1).run([(IDS, CU)], None)[0]
    torch.testing.assert_close(staged["aux_hidden"], want_aux, rtol=2e-4, atol=2e-4)
    # computed in bf16: within its rounding, but for tokens whose expert choice a rounding flips (a near-tie)
    got = TargetRunner(ckpt, AUX, torch.device("cpu"), torch.bfloat16).run(IDS, CU)
    for a, b in ((got["aux_hidden"], want_aux), (got["final_hidden"], final)):
        per_token = (a.float() - b).norm(dim=-1) / b.norm(dim=-1)
        assert per_token.median() < 1.5e-2 and (per_token < 3e-2).float().mean() > 0.85


def test_offline_shards_and_online_batches_hold_transformers_states(target, reference, tmp_path):
    data = tiny.make_token_data(tmp_path / "data.jsonl", vocab=256, sequences=6, min_len=12, max_len=30)
    cfg = make_config(tmp_path, target, data, **{"extract.dtype": "float32", "debug.chunk_tokens": 16,
                                                 "draft.num_attention_heads": 4, "draft.num_key_value_heads": 4})
    out = extraction.run(cfg)
    shards = ShardReader(out)
    aux_ids = json.loads((out / "manifest.json").read_text())["aux_layer_ids"]
    online = OnlineReader(make_config(tmp_path, target, data, **{"train.source": "online", "extract.dtype": "float32"}),
                          Checkpoint(target), aux_ids, torch.device("cpu"))
    for batch in (shards.read(shards.sequences), online.read(online.sequences)):
        layers, final = reference(batch.input_ids.long(), batch.cu_seqlens.tolist())
        want = torch.cat([layers[i] for i in aux_ids], -1)
        assert rel(batch.aux_hidden, want) < 5e-3 and rel(batch.final_hidden, final) < 5e-3   # stored in bf16


def test_inspect_names_the_format_and_what_is_skipped(target):
    report = inspect(str(target))
    w, kind = report["weights"], TARGETS[target.name]
    skipped = {"deepseek_v3": "multi-token-prediction layer", "kimi_k25": "vision tower"}.get(kind["layout"])
    assert [why.split(" past")[0].split(" and")[0] for why in w["skipped"]] == ([skipped] if skipped else [])
    assert w["forward_tensors"] + w["skipped_tensors"] == w["tensors"]
    if kind["weights"] == "fp8":
        assert report["quantization"]["weight_block_size"] == list(kind["block"] if "block" in kind else (128, 128))
        # every decoder linear (attention 5, dense 3, shared 3, 8 experts x 3) but the router
        assert w["quantized_linears"] == {"int4": 0, "fp8": 4 * 5 + 3 + 3 * (3 + 24), "mxfp4": 0}
    else:
        assert w["quantized_linears"] == {"int4": 3 * 24, "fp8": 0, "mxfp4": 0}


def test_the_dequantizer_reads_partial_blocks_and_both_scale_dtypes():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(576, 200, generator=g)      # kv_a_proj_with_mqa's 576 rows: 4.5 blocks of 128
    for scale_dtype in (torch.float32, torch.bfloat16):
        stored = tiny.fp8_blocks(w, (128, 128), scale_dtype)
        assert list(stored["weight_scale_inv"].shape) == quant.block_scale_shape((576, 200), (128, 128)) == [5, 2]
        want = dequantize_fp8(stored["weight"], stored["weight_scale_inv"], [128, 128])
        rows = quant.row_scales(stored["weight_scale_inv"], 576, 128)
        got = quant.dequantize({"weight": stored["weight"], "row_scale": rows}, torch.float32, 128)
        assert torch.equal(got, want) and rel(got, w) < 0.05
        assert torch.equal(quant.dequantize({"weight": stored["weight"], "row_scale": rows}, torch.bfloat16, 128),
                           want.bfloat16())


def test_triton_fp8_kernel_interpreted():
    from test_deepseek import interpreted
    interpreted("""
import sys, torch
sys.path.insert(0, sys.argv[1])
from eagle3.models import quant
g = torch.Generator().manual_seed(2)
for shape, b1 in [((2, 20, 200), 128), ((30, 96), 32)]:
    w = (torch.randn(*shape, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(*shape[:-1], -(-shape[-1] // b1), generator=g)
    want = quant.dequantize({"weight": w, "row_scale": scale}, torch.float32, b1)
    got = quant._launch(w, scale, torch.float32, b1, 1)
    assert torch.equal(got, want), shape
print("ok")
""")


# ---------------------------------------------------------------------------------------------
# refusals: one line each, before any work

@pytest.fixture(scope="module")
def fp8_target(tmp_path_factory) -> Path:
    return tiny.make_kimi(tmp_path_factory.mktemp("fp8"), layout="kimi_k2", weights="fp8", layers=4, vocab=256,
                          experts=4, shards=1)


def variant(target: Path, tmp: Path, config=None, tensors=None) -> Path:
    return edited_copy(target, tmp / "variant", config, tensors)


def refused(path: Path, match: str) -> str:
    for read in (lambda: inspect(str(path)),
                 lambda: TargetRunner(Checkpoint(path), AUX, torch.device("cpu"), torch.float32)):
        with pytest.raises(TargetError, match=match) as e:
            read()
        assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("edit, match", [
    (lambda q: q.update(quant_method="awq"), r"quant_method 'awq' is not read"),
    (lambda q: q.update(fmt="e5m2"), r"fp8 with fmt 'e5m2'"),
    (lambda q: q.update(activation_scheme="static"), r"activation_scheme 'static'"),
    (lambda q: q.pop("weight_block_size"), r"weight_block_size None .*per-tensor fp8 is not read"),
    (lambda q: q.update(new_knob=1), r"unknown keys \['new_knob'\]"),
])
def test_a_quantization_config_not_implemented_is_refused_naming_it(fp8_target, tmp_path, edit, match):
    refused(variant(fp8_target, tmp_path, config=lambda c: edit(c["quantization_config"])), match)


def test_compressed_tensors_other_than_int4_packs_is_refused(tmp_path):
    target = tiny.make_kimi(tmp_path / "k", layers=4, vocab=256, experts=4, shards=1)

    def eight_bits(cfg):
        cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    refused(variant(target, tmp_path, config=eight_bits), r"compressed-tensors with weights num_bits 8 \(read: 4\)")


def test_a_stray_scale_where_the_config_says_unquantized_is_refused(fp8_target, tmp_path):
    path = variant(fp8_target, tmp_path, config=lambda c: c.pop("quantization_config"))
    refused(path, r"model.layers.0.self_attn.kv_a_proj_with_mqa is stored fp8 \(.*weight_scale_inv\), "
                  r"but .* says unquantized")


def test_a_quantized_weight_missing_its_scale_is_refused(fp8_target, tmp_path):
    name = "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"
    path = variant(fp8_target, tmp_path, tensors=lambda t: t.pop(name))
    refused(path, r"model.layers.2.mlp.experts.3.down_proj.weight is F8_E4M3 without its weight_scale_inv")


def test_a_scale_with_no_weight_is_refused(fp8_target, tmp_path):
    path = variant(fp8_target, tmp_path, tensors=lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"))
    refused(path, r"model.layers.1.self_attn.o_proj.weight_scale_inv, a scale with no weight")


def test_an_unknown_tensor_is_refused_by_name(fp8_target, tmp_path):
    path = variant(fp8_target, tmp_path, tensors=lambda t: t.update({"model.layers.1.mlp.bonus.weight": torch.ones(2)}))
    refused(path, r"1 tensors that no part of a DeepSeek-V3 forward reads nor a known reason skips, first: "
                  r"model.layers.1.mlp.bonus.weight")


def test_an_mtp_layer_is_skipped_only_when_the_config_declares_it(tmp_path):
    target = tiny.make_kimi(tmp_path / "ds", layout="deepseek_v3", weights="fp8", mtp=1, layers=4, vocab=256,
                            experts=4, shards=1)
    assert "multi-token-prediction" in next(iter(inspect(str(target))["weights"]["skipped"]))
    refused(variant(target, tmp_path, config=lambda c: c.update(num_nextn_predict_layers=0)),
            r"first: model.layers.4.")


def test_rotary_buffers_and_a_tied_duplicate_head_are_skipped(tmp_path):
    from conftest import make_llama
    path = make_llama(tmp_path / "l", hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, vocab=64, tie=True)
    t = load_file(path / "model.safetensors")
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    save_file(t, path / "model.safetensors")
    skipped = inspect(str(path))["weights"]["skipped"]
    assert sorted(why.split(":")[0] for why in skipped) == ["lm_head beside tie_word_embeddings true",
                                                              "rotary buffer"]
    assert math.isfinite(TargetRunner(Checkpoint(path), [0, 1, 2], torch.device("cpu"), torch.float32).run(
        torch.arange(5), [0, 5])["final_hidden"].sum().item())


def test_an_fp8_weight_of_another_dtype_is_refused(fp8_target, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    path = variant(fp8_target, tmp_path, tensors=lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    refused(path, name.replace(".", r"\.") + r" is BF16 with a F32 weight_scale_inv; expected F8_E4M3")


def test_a_quantization_config_at_both_levels_must_be_one(tmp_path):
    target = tiny.make_kimi(tmp_path / "k25", weights="fp8", layers=4, vocab=256, experts=4, shards=1)

    def both(cfg, **change):
        cfg["quantization_config"] = {**cfg["text_config"]["quantization_config"], **change}
    assert inspect(str(variant(target, tmp_path / "same", config=both)))["quantization"]["method"] == "fp8"
    refused(variant(target, tmp_path / "other", config=lambda c: both(c, weight_block_size=[64, 64])),
            r"config.json: quantization_config at the top level and in text_config differ")


def test_a_qwen3_fp8_release_reads_as_its_dequantized_weights(tmp_path):
    """The Llama family reads its linears through the same call: Qwen3 FP8's layout (bf16 scales, 128 x 128 blocks
    over dims of 96 and 160) gives the states of the same weights dequantized and stored plain."""
    from conftest import make_llama
    path = make_llama(tmp_path / "q", family="qwen3", hidden=96, layers=4, heads=4, kv_heads=2, intermediate=160,
                      vocab=128, dtype=torch.float32)
    weights, dense = load_file(path / "model.safetensors"), {}
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        stored = tiny.fp8_blocks(weights[name], (128, 128), torch.bfloat16)
        weights[name], weights[name + "_scale_inv"] = stored["weight"], stored["weight_scale_inv"]
        dense[name] = dequantize_fp8(stored["weight"], stored["weight_scale_inv"], [128, 128])
    fp8 = edited_copy(path, tmp_path / "fp8", config=lambda c: c.update(quantization_config={
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"]}), tensors=lambda t: t.update(weights))
    plain = edited_copy(path, tmp_path / "plain", tensors=lambda t: t.update(dense))
    assert inspect(str(fp8))["weights"]["quantized_linears"]["fp8"] == 4 * 7
    ids = torch.arange(40) % 128
    a, b = (TargetRunner(Checkpoint(p), AUX, torch.device("cpu"), torch.float32).run(ids, [0, 40])
            for p in (fp8, plain))
    torch.testing.assert_close(a["aux_hidden"], b["aux_hidden"])
    torch.testing.assert_close(a["final_hidden"], b["final_hidden"])
