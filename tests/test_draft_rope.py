"""The draft's rotary rule (docs/training.md, "Long context: the rotary rule"): for Kimi-K2.5 and for Llama targets
with llama3, yarn or no rope scaling, the draft is exported, and the cos/sin each engine derives from the exported
config.json, by its own arithmetic transcribed below from its sources, equal training's at every position up to the
target's max_position_embeddings. A sliding window is exported as vLLM reads it; SGLang takes it at launch."""
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from conftest import KIMI_FIXTURE
from eagle3.config import Config, ConfigError, validate
from eagle3.draft import Eagle3Draft
from eagle3.draft_io import load_vllm_draft
from eagle3.export import export_all
from eagle3.models.weights import read_config
from eagle3.ops import draft_rope, rope_cos_sin
from eagle3.resolve import resolve

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
         "rms_norm_eps": 1e-5}
TARGETS = {
    "kimi-k2.5": None,   # the real config.json: YaRN factor 64 over 4096, theta 50,000, 262,144 positions
    # Llama-3.1-8B's rotary
    "llama3": {**LLAMA, "rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}},
    # Qwen3's long-context recipe: YaRN factor 4 over 32,768, given as transformers 5's rope_parameters
    "yarn": {**LLAMA, "head_dim": 128, "max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1000000.0}},
    "none": {**LLAMA, "rope_theta": 10000.0, "max_position_embeddings": 8192, "head_dim": 64},
    # DeepSeek-V3.2's (DeepSeek-V3's YaRN, factor 40 over 4,096), with the DSA indexer's fields
    "deepseek-v3.2": {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 7168,
                      "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
                      "vocab_size": 129280, "rms_norm_eps": 1e-6, "kv_lora_rank": 512, "q_lora_rank": 1536,
                      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "index_topk": 2048,
                      "index_n_heads": 64, "index_head_dim": 128, "rope_theta": 10000.0,
                      "max_position_embeddings": 163840, "rope_scaling": {
                          "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
}


# --- each engine's rotary, transcribed from its source ----------------------------------------------------------

def _default_inv_freq(base, rotary_dim):
    # vllm rotary_embedding/base.py RotaryEmbedding._compute_inv_freq; sglang rotary_embedding.py, the same
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def _yarn_get_mscale(scale, mscale=1.0):
    # vllm rotary_embedding/common.py @002d181 (sglang: _yarn_get_mscale without `mscale`)
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base, rotary_dim, original, factor, beta_fast, beta_slow):
    """vllm yarn_scaling_rope.py @0cd5784 YaRNScalingRotaryEmbedding._compute_inv_freq with common.py's
    yarn_find_correction_range / yarn_linear_ramp_mask (sglang @00a66eb: the same, times extrapolation_factor 1)."""
    def dim(rotations):
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = max(math.floor(dim(beta_fast)), 0), min(math.ceil(dim(beta_slow)), rotary_dim - 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    inv_freq_mask = 1 - ramp
    return inv_freq_interpolation * (1 - inv_freq_mask) + inv_freq_extrapolation * inv_freq_mask


def _llama3_inv_freq(base, rotary_dim, factor, low_freq_factor, high_freq_factor, orig_max_position):
    # vllm rotary_embedding/llama3_rope.py @045d757 (sglang Llama3RotaryEmbedding @00a66eb: the same)
    inv_freqs = _default_inv_freq(base, rotary_dim)
    low_freq_wavelen = orig_max_position / low_freq_factor
    high_freq_wavelen = orig_max_position / high_freq_factor
    wave_len = 2 * math.pi / inv_freqs
    smooth = ((orig_max_position / wave_len - low_freq_factor) / (high_freq_factor - low_freq_factor)
              if low_freq_factor != high_freq_factor else 0)
    return torch.where(wave_len < high_freq_wavelen, inv_freqs, torch.where(
        wave_len > low_freq_wavelen, inv_freqs / factor,
        (1 - smooth) * inv_freqs / factor + smooth * inv_freqs))


def _cache(inv_freq, positions, mscale=1.0):
    # every engine's _compute_cos_sin_cache: einsum over fp32 positions, cos/sin times mscale (YaRN's), fp32
    freqs = torch.einsum("i,j -> ij", torch.arange(positions, dtype=torch.float32), inv_freq)
    return freqs.cos() * mscale, freqs.sin() * mscale


def _rope(head_dim, base, scaling, positions, yarn_mscale):
    """(cos, sin) [positions, head_dim/2] of get_rope's rotate-half embedding; yarn_mscale: the engine's factor rule."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return _cache(_default_inv_freq(base, head_dim), positions)
    if kind == "llama3":
        return _cache(_llama3_inv_freq(base, head_dim, scaling["factor"], scaling["low_freq_factor"],
                                       scaling["high_freq_factor"], scaling["original_max_position_embeddings"]),
                      positions)
    assert kind == "yarn", kind
    inv = _yarn_inv_freq(base, head_dim, scaling["original_max_position_embeddings"], scaling["factor"],
                         scaling.get("beta_fast", 32), scaling.get("beta_slow", 1))
    return _cache(inv, positions, yarn_mscale(scaling))


def vllm_new(layer, positions):
    """vllm-project/vllm, llama.py's LlamaAttention._init_rotary_emb: get_rope(head_dim,
    rope_parameters=config.rope_parameters) (rotary_embedding/__init__.py: base = rope_parameters["rope_theta"]);
    YaRNScalingRotaryEmbedding @0cd5784:
    mscale = attention_factor, else yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim) when both are
    set, else yarn_get_mscale(f)."""
    params = layer["rope_parameters"]

    def mscale(s):
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        if s.get("mscale") and s.get("mscale_all_dim"):
            f = s["factor"]
            return float(_yarn_get_mscale(f, s["mscale"]) / _yarn_get_mscale(f, s["mscale_all_dim"]))
        return float(_yarn_get_mscale(s["factor"]))
    return _rope(layer["head_dim"], params["rope_theta"], params, positions, mscale)


def vllm_legacy(layer, positions):
    """vllm-project/vllm before rope_parameters: LlamaDecoderLayer reads config.rope_theta and config.rope_scaling;
    get_rope's "yarn" branch (rotary_embedding/__init__.py @07b12f1) passes only extrapolation_factor, attn_factor,
    beta_fast, beta_slow, apply_yarn_scaling, truncate, so mscale = yarn_get_mscale(factor) * attn_factor."""
    return _rope(layer["head_dim"], layer["rope_theta"], layer["rope_scaling"], positions,
                 lambda s: float(_yarn_get_mscale(s["factor"]) * s.get("attn_factor", 1)))


def sglang(config, positions):
    """sgl-project/sglang, models/llama.py @0023954 LlamaDecoderLayer: rope_theta, rope_scaling of the flat config;
    layers/rotary_embedding.py @00a66eb get_rope: "yarn" takes extrapolation_factor, attn_factor, beta_fast,
    beta_slow; YaRNScalingRotaryEmbedding: mscale = _yarn_get_mscale(factor) * attn_factor."""
    return _rope(config["head_dim"], config["rope_theta"], config["rope_scaling"], positions,
                 lambda s: float(_yarn_get_mscale(s["factor"]) * s.get("attn_factor", 1)))


# --- the exports --------------------------------------------------------------------------------------------------

def target_config(name, tmp_path):
    if TARGETS[name] is None:
        return read_config(KIMI_FIXTURE)
    (tmp_path / f"{name}.json").write_text(json.dumps(TARGETS[name]))
    return read_config(tmp_path / f"{name}.json")


def exported(tmp_path, text, **changes):
    """Resolve the draft for target config `text`, shrink everything but its rotary, write a checkpoint of a random
    draft and export it -> (its DraftSpec, {format: config.json}, the export directory)."""
    cfg = Config()
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    resolved = resolve(cfg, SimpleNamespace(config=text))
    spec = dataclasses.replace(resolved.draft_spec, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                               intermediate_size=32, draft_vocab_size=16, target_vocab_size=64, target_hidden_size=32)
    draft = Eagle3Draft(spec)
    draft.t2d[:16] = True
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, ckpt / "model.safetensors")
    state = {"resolved": {**resolved.to_dict(), "draft_spec": dataclasses.asdict(spec)},
             "target": text.identity(), "target_architectures": text.architectures}
    (ckpt / "state.json").write_text(json.dumps(state))
    written = export_all(ckpt, tmp_path / "export", cfg)
    return spec, {fmt: json.loads((path / "config.json").read_text()) for fmt, path in written.items()}, written


@pytest.mark.parametrize("name", TARGETS)
def test_each_engine_computes_the_cos_sin_training_used(tmp_path, name):
    text = target_config(name, tmp_path)
    spec, configs, written = exported(tmp_path, text)
    positions = text.max_position_embeddings
    inv_freq, mscale = draft_rope(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    cos, sin = rope_cos_sin(torch.arange(positions), inv_freq, mscale)        # training's [P, D]
    half = spec.head_dim // 2
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])   # rotate-half
    layer = configs["vllm"]["transformer_layer_config"]
    for engine, (c, s) in {"vLLM": vllm_new(layer, positions), "vLLM (legacy keys)": vllm_legacy(layer, positions),
                           "SGLang": sglang(configs["sglang"], positions)}.items():
        assert c.shape == (positions, half)
        assert torch.equal(c, cos[:, :half]) and torch.equal(s, sin[:, :half]), f"{name}: {engine} differs"
    draft, _ = load_vllm_draft(written["vllm"])                                # the reader decodes with them too
    assert torch.equal(draft.inv_freq, inv_freq) and draft.rope_mscale == mscale
    expected = {"kimi-k2.5": ("yarn", 64.0), "llama3": ("llama3", 8.0), "yarn": ("yarn", 4.0), "none": None,
                "deepseek-v3.2": ("yarn", 40.0)}[name]
    scaling = layer["rope_scaling"]
    assert (scaling and (scaling["rope_type"], scaling["factor"])) == expected
    assert configs["sglang"]["rope_scaling"] == scaling


def test_kimis_yarn_dict_copied_verbatim_would_split_the_engines(tmp_path):
    """Why the rule drops mscale / mscale_all_dim: with Kimi's own dict vLLM's current rule gives cos/sin x 1.0,
    older vLLM and SGLang x 1.416; the exported dict gives 1.416 everywhere, which training uses."""
    text = target_config("kimi-k2.5", tmp_path)
    spec, configs, _ = exported(tmp_path, text)
    verbatim = {**text.rope_scaling, "rope_theta": text.rope_theta}
    layer = {"head_dim": spec.head_dim, "rope_theta": text.rope_theta, "rope_scaling": verbatim,
             "rope_parameters": verbatim}
    new, old = vllm_new(layer, 2)[0][1, 0].item(), vllm_legacy(layer, 2)[0][1, 0].item()
    assert new == pytest.approx(math.cos(1.0)) and old == pytest.approx(1.4158883 * math.cos(1.0))
    assert draft_rope(spec.head_dim, spec.rope_theta, spec.rope_scaling)[1] == pytest.approx(1.4158883)
    assert set(configs["vllm"]["transformer_layer_config"]["rope_scaling"]) == {
        "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}


def test_plain_rope_is_the_comparison(tmp_path):
    spec, configs, _ = exported(tmp_path, target_config("kimi-k2.5", tmp_path), **{"experimental.draft_rope": "plain"})
    assert spec.rope_scaling is None and configs["vllm"]["transformer_layer_config"]["rope_scaling"] is None
    assert configs["vllm"]["transformer_layer_config"]["rope_parameters"] == {"rope_type": "default",
                                                                            "rope_theta": 50000.0}


def vllm_draft_window(layer, target_layers, draft_layer):
    """vllm-project/vllm llama.py LlamaAttention (read through llama_eagle3.py @00bd149, which sets
    config.target_layer_count and numbers draft layers from it): layer_types[layer_idx - target_layer_count] ==
    "sliding_attention" gives per_layer_sliding_window = config.sliding_window; flash_attn.py's window is then
    (sliding_window - 1, 0): a key sliding_window - 1 positions back is the oldest a query sees."""
    layer_types = layer.get("layer_types")
    if not layer_types:
        return None
    effective = (target_layers + draft_layer) - target_layers
    return layer["sliding_window"] if layer_types[effective] == "sliding_attention" else None


def test_a_sliding_window_is_exported_as_vllm_reads_it_and_served_by_sglang_with_its_flag(tmp_path):
    """SGLang 0.5.23 takes the window at launch (--speculative-draft-window-size, tests/test_serving.py): its export
    carries none."""
    text = target_config("none", tmp_path)
    spec, configs, written = exported(tmp_path, text, **{"draft.sliding_window": 2048})
    assert vllm_draft_window(configs["vllm"]["transformer_layer_config"], text.num_hidden_layers, 0) == 2048
    assert load_vllm_draft(written["vllm"])[0].spec.sliding_window == 2048
    assert "sliding_window" not in configs["sglang"] and "layer_types" not in configs["sglang"]
    cfg = Config()
    cfg.draft.sliding_window = 2048
    validate(cfg)
    cfg.export.formats, cfg.draft.sliding_window = ["vllm"], 4
    with pytest.raises(ConfigError, match="draft.sliding_window = 4; expected 0 .* at least train.ttt_steps"):
        validate(cfg)
