"""`python -m eagle3 inspect`: what the pipeline will read from a target, checked (config fields, every
tensor the forward needs present and of the shape the config implies), as one JSON-able report."""
from __future__ import annotations

import torch

from eagle3.models.weights import Checkpoint
from eagle3.models.streaming import build_model, check_tensors
from eagle3.models.vision import describe_cost, target_vision, vision_tensor_names


def inspect(target: str) -> dict:
    """What the pipeline will read from a target; weights reported missing if absent."""
    ckpt = Checkpoint(target, require_weights=False)
    c = ckpt.config
    model = build_model(ckpt, torch.device("cpu"), torch.float32)   # checks RoPE kind and routing, weights or not
    report = {"path": str(ckpt.dir), "model_type": c.model_type, "text_model_type": c.text_model_type,
              "architectures": c.architectures, "family": c.family.name, "config_source": c.source,
              "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "num_hidden_layers": c.num_hidden_layers,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "aux_layer_ids": c.default_aux_layer_ids(), "tie_word_embeddings": c.tie_word_embeddings,
              "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "quantization": c.quantization}
    if c.is_deepseek:
        s = model.spec
        report["moe"] = {"routed_experts": s.n_routed_experts, "shared_experts": s.n_shared_experts,
                         "experts_per_token": s.num_experts_per_tok, "n_group": s.n_group, "topk_group": s.topk_group,
                         "dense_layers": s.first_k_dense_replace, "moe_intermediate_size": s.moe_intermediate_size}
    if not ckpt.weight_map:
        report["weights"] = "missing: no model.safetensors or model.safetensors.index.json"
        return report | dict.fromkeys(("embed_tokens", "lm_head", "norm"))
    needed = {ckpt.full_name(n) for n in check_tensors(ckpt, model)}   # a tied head is the embedding
    report["weights"] = {"files": len(set(ckpt.weight_map.values())), "text_tensors": len(ckpt.text_tensor_names()),
                         "skipped_tensors": len(ckpt.weight_map) - len(ckpt.text_tensor_names()),
                         "prefix": ckpt.prefix, "forward_tensors": len(needed),
                         "int4_linears": sum(n.endswith(".weight_packed") for n in needed),
                         "unused_text_tensors": len(ckpt.text_tensor_names()) - len(needed)}
    if vision := target_vision(ckpt):   # read by the vision tower when the data has images or video
        report["vision"] = {"tensors": len(vision_tensor_names(ckpt.weight_map)), "media_pad_id": vision.pad_id,
                            "cost": describe_cost(vision)}
    report.update(ckpt.outer_tensors())
    return report

