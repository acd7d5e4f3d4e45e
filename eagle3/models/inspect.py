"""`python -m eagle3 inspect`: what the pipeline will read from a target, checked (shapes, and for
DeepSeek-V3/Kimi every tensor the forward needs), as one JSON-able report."""
from __future__ import annotations

from eagle3.models.checkpoint import Checkpoint, TargetError
from eagle3.models.deepseek import DeepseekSpec, required_tensor_names


def inspect(target: str) -> dict:
    """What the pipeline will read from a target; weights reported missing if absent."""
    ckpt = Checkpoint(target, require_weights=False)
    c = ckpt.config
    report = {"path": str(ckpt.dir), "model_type": c.model_type, "text_model_type": c.text_model_type,
              "architectures": c.architectures, "config_source": c.source, "hidden_size": c.hidden_size,
              "vocab_size": c.vocab_size, "num_hidden_layers": c.num_hidden_layers,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "aux_layer_ids": c.default_aux_layer_ids(), "tie_word_embeddings": c.tie_word_embeddings,
              "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "quantization": c.quantization}
    if not ckpt.weight_map:
        report["weights"] = "missing: no model.safetensors or model.safetensors.index.json"
        for name in ("embed_tokens", "lm_head", "norm"):
            report[name] = None
        return report
    report["weights"] = {"files": len(set(ckpt.weight_map.values())),
                         "text_tensors": len(ckpt.text_tensor_names()),
                         "skipped_tensors": len(ckpt.weight_map) - len(ckpt.text_tensor_names()),
                         "prefix": ckpt.prefix}
    report.update(ckpt.outer_tensors())
    _check_layers(ckpt)
    if c.is_deepseek:
        _check_deepseek(ckpt, report)
    return report


def _check_deepseek(ckpt: Checkpoint, report: dict) -> None:
    """MoE layout, and every tensor the DeepSeek-V3 forward reads present in the weight map."""
    spec = DeepseekSpec.from_config(ckpt.config)
    report["moe"] = {"routed_experts": spec.n_routed_experts, "shared_experts": spec.n_shared_experts,
                     "experts_per_token": spec.num_experts_per_tok, "n_group": spec.n_group,
                     "topk_group": spec.topk_group, "dense_layers": spec.first_k_dense_replace,
                     "moe_intermediate_size": spec.moe_intermediate_size}
    needed = list(dict.fromkeys(ckpt.full_name(n) for n in required_tensor_names(ckpt)))
    missing = [n for n in needed if n not in ckpt.weight_map]
    if missing:
        index = ckpt.dir / ("model.safetensors.index.json" if (ckpt.dir / "model.safetensors.index.json").exists()
                            else "model.safetensors")
        raise TargetError(f"{index}: {len(missing)} of the {len(needed)} tensors the forward needs are missing, "
                          f"first: {missing[0]}")
    report["weights"]["forward_tensors"] = len(needed)
    report["weights"]["int4_linears"] = sum(n.endswith(".weight_packed") for n in needed)
    report["weights"]["unused_text_tensors"] = len(ckpt.text_tensor_names()) - len(needed)


def _check_layers(ckpt: Checkpoint) -> None:
    c = ckpt.config
    missing = [n for i in range(c.num_hidden_layers) for n in (f"layers.{i}.input_layernorm.weight",)
               if not ckpt.has(n)]
    if missing:
        raise TargetError(f"{ckpt.dir}: {len(missing)} layers have no tensors, e.g. {ckpt.full_name(missing[0])}")
