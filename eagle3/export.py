"""Export a trained draft for serving (SPEC §9): vLLM (speculators layout) and SGLang (native).

Both read `d2t`/`t2d` and the same weights; they differ in the config and in the layer's name
(`layers.0.*` for vLLM, `midlayer.*` for SGLang, which silently skips names it does not know).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3 import checkpoint as ckpt_io
from eagle3.config import Config, from_dict
from eagle3.ops import TORCH_DTYPES
from eagle3.vocab import check_vocab

LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")


class ExportError(ValueError):
    pass


def _llama_layer_config(spec: dict, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec["hidden_size"],
            "num_attention_heads": spec["num_attention_heads"],
            "num_key_value_heads": spec["num_key_value_heads"], "head_dim": spec["head_dim"],
            "intermediate_size": spec["intermediate_size"], "rms_norm_eps": spec["rms_norm_eps"],
            "rope_theta": spec["rope_theta"], "max_position_embeddings": spec["max_position_embeddings"],
            "vocab_size": spec["target_vocab_size"], "num_hidden_layers": spec["num_layers"],
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": dtype}


def vllm_config(state: dict, cfg: Config) -> dict:
    spec = state["draft_spec"]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.export.speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.export.verifier_name or cfg.target.path,
                         "architectures": state["target_architectures"]},
        },
        "transformer_layer_config": _llama_layer_config(spec, cfg.export.dtype),
        "draft_vocab_size": spec["draft_vocab_size"],
        "target_hidden_size": spec["target_hidden_size"],
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in state["aux_layer_ids"]],
        "torch_dtype": cfg.export.dtype,
    }


def sglang_config(state: dict, cfg: Config) -> dict:
    spec = state["draft_spec"]
    config = _llama_layer_config(spec, cfg.export.dtype)
    config.update({
        "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
        "draft_vocab_size": spec["draft_vocab_size"], "target_hidden_size": spec["target_hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(state["aux_layer_ids"]),
                         "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in state["aux_layer_ids"]],
        "torch_dtype": cfg.export.dtype,
    })
    return config


def export_weights(weights: dict[str, torch.Tensor], layer_prefix: str, num_layers: int,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Map trained names onto the serving names; float weights cast to `dtype`, vocab maps kept."""
    out = {"fc.weight": weights["fc.weight"], "norm.weight": weights["norm.weight"],
           "lm_head.weight": weights["lm_head.weight"]}
    for i in range(num_layers):
        for key in LAYER_KEYS if i == 0 else [k for k in LAYER_KEYS if k != "hidden_norm.weight"]:
            src = f"layers.{i}.{key}"
            if src not in weights:   # an engine would silently keep a random tensor for it
                raise ExportError(f"checkpoint weights lack {src}")
            out[f"{layer_prefix(i)}.{key}"] = weights[src]
    left = set(weights) - {"d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight"} - {
        f"layers.{i}.{k}" for i in range(num_layers) for k in LAYER_KEYS}
    if left:
        raise ExportError(f"checkpoint weights not exported: {sorted(left)[:5]}")
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    out["d2t"] = weights["d2t"].to(torch.int64)
    out["t2d"] = weights["t2d"].to(torch.bool)
    return out


def _write(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def export_all(checkpoint_dir: str | Path, out_dir: str | Path, cfg: Config | None = None) -> dict[str, Path]:
    """Write `out_dir/vllm` and/or `out_dir/sglang` from a training checkpoint directory."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    state = ckpt_io.read_state(checkpoint_dir)
    cfg = cfg or from_dict(state["config"], str(checkpoint_dir / ckpt_io.STATE))
    weights = ckpt_io.load_weights(checkpoint_dir)
    check_vocab(weights["d2t"], weights["t2d"], str(checkpoint_dir / ckpt_io.MODEL))
    spec = state["draft_spec"]
    if len(state["aux_layer_ids"]) != 3:
        raise ExportError(f"{checkpoint_dir}: EAGLE-3 export needs exactly 3 aux layers")
    dtype = TORCH_DTYPES[cfg.export.dtype]
    written = {}
    for fmt in cfg.export.formats:
        if fmt == "vllm":
            tensors = export_weights(weights, lambda i: f"layers.{i}", spec["num_layers"], dtype)
            written[fmt] = _write(out_dir / "vllm", vllm_config(state, cfg), tensors)
        elif fmt != "sglang":
            raise ExportError(f"export format {fmt!r}; expected 'vllm' or 'sglang'")
        else:
            if spec["num_layers"] != 1:
                raise ExportError(f"{checkpoint_dir}: SGLang's EAGLE-3 draft has one layer (midlayer); "
                                  f"this draft has {spec['num_layers']}; export vllm only")
            tensors = export_weights(weights, lambda i: "midlayer", 1, dtype)
            written[fmt] = _write(out_dir / "sglang", sglang_config(state, cfg), tensors)
    return written
