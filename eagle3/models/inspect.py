"""`python -m eagle3 inspect`: what the pipeline will read from a target, checked (config fields, every
tensor the forward needs present and of the shape the config implies), as one JSON-able report."""
from __future__ import annotations

import torch

from eagle3.models import quant
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
                         "dense_layers": sum(not s.is_moe(i) for i in range(c.num_hidden_layers)),
                         "moe_intermediate_size": s.moe_intermediate_size}
        if s.index is not None:
            report["indexer"] = {"heads": s.index.heads, "head_dim": s.index.head_dim, "topk": s.index.topk,
                                 "rotary": "interleaved" if s.index.interleaved else "rotate-half",
                                 "layer_types": ["full" if s.has_indexer(i) else "shared"
                                                 for i in range(c.num_hidden_layers)]}
    elif blocks := [e for e in model.layout.experts if e is not None]:
        e, a = blocks[0], model.layout.attention
        report["moe"] = {"routed_experts": e.router.experts, "shared_experts": int(e.shared > 0),
                         "experts_per_token": e.router.top_k, "router": e.router.scoring,
                         "dense_layers": c.num_hidden_layers - len(blocks), "moe_intermediate_size": e.inter}
        report["attention"] = {"head_dim": a.head_dim, "rotary_dim": a.rotary_dim, "qk_norm": a.qk_norm,
                               "sinks": a.sinks, "sliding_window": max(a.windows, default=0)}
    if not ckpt.weight_map:
        report["weights"] = "missing: no model.safetensors or model.safetensors.index.json"
        return report | dict.fromkeys(("embed_tokens", "lm_head", "norm"))
    names = check_tensors(ckpt, model)   # refuses what is neither read nor skipped for a reason
    needed = {ckpt.full_name(n) for n in names}   # a tied head is the embedding
    skipped = ckpt.account(names)
    report["weights"] = {"files": len(set(ckpt.weight_map.values())), "tensors": len(ckpt.weight_map),
                         "prefix": ckpt.prefix, "forward_tensors": len(needed),
                         "quantized_linears": {"int4": sum(n.endswith(".weight_packed") for n in needed),
                                               "fp8": sum(n.endswith("." + quant.FP8_SCALE) for n in needed),
                                               "mxfp4": sum(n.endswith("_blocks") for n in needed)},
                         "skipped_tensors": sum(skipped.values()), "skipped": skipped}
    if vision := target_vision(ckpt):   # read by the vision tower when the data has images or video
        report["vision"] = {"tensors": len(vision_tensor_names(ckpt.weight_map)), "media_pad_id": vision.pad_id,
                            "cost": describe_cost(vision)}
    report.update(ckpt.outer_tensors())
    return report

