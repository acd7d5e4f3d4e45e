"""Each text family's room: what its decoder composes from the shared parts (`gqa`, `moe`, or DeepSeek's MLA),
read from its config.json as transformers 5.24's classes read it (docs/families.md)."""
from __future__ import annotations

import torch

from eagle3.models import moe
from eagle3.models.gqa import Attention, Experts, GqaTarget, Layout
from eagle3.models.weights import Checkpoint, TargetError, TextConfig


def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype):
    """The target's forward: DeepSeek's MLA, or the GQA decoder its family's room lays out."""
    c = ckpt.config
    if c.is_deepseek:
        from eagle3.models.deepseek import DeepseekTarget
        return DeepseekTarget(ckpt, device, dtype)
    return GqaTarget(ckpt, device, dtype, ROOMS[c.family.name](ckpt, c, c.raw))


def _rotary_dim(c: TextConfig, raw: dict, default: float = 1.0) -> int:
    """The rotating dims of a head: `rotary_dim`, else head_dim x `partial_rotary_factor` (top level or in
    rope_parameters), even."""
    factor = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get("partial_rotary_factor", default))
    dim = raw.get("rotary_dim") or int(c.head_dim * factor)
    if dim % 2 or not 0 < dim <= c.head_dim:
        raise TargetError(f"{c.source}: the rotary dims {dim} (rotary_dim or partial_rotary_factor) must be even "
                          f"and at most head_dim {c.head_dim}")
    return dim


def _attention(c: TextConfig, raw: dict, **kw) -> Attention:
    return Attention(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                     kw.pop("rotary_dim", None) or _rotary_dim(c, raw), **kw)


def llama(ckpt: Checkpoint, c: TextConfig, raw: dict) -> Layout:
    """Llama / Mistral / Qwen2 (q/k/v biases) / Qwen3 (per-head q/k norms), by the tensors present."""
    attention = _attention(c, raw, qkv_bias=ckpt.has("layers.0.self_attn.q_proj.bias"),
                           qk_norm="head" if ckpt.has("layers.0.self_attn.q_norm.weight") else None)
    return Layout(attention, (None,) * c.num_hidden_layers, c.intermediate_size)


def qwen3_moe(ckpt: Checkpoint, c: TextConfig, raw: dict) -> Layout:
    """Qwen3 attention; softmax top-k experts (renormalised with norm_topk_prob) every decoder_sparse_step-th
    layer outside mlp_only_layers, no shared expert."""
    router = moe.Router("softmax", raw["num_experts"], raw["num_experts_per_tok"], bool(raw.get("norm_topk_prob")))
    block = Experts(router, "mlp.", "gate", raw["moe_intermediate_size"])
    step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or ())
    return Layout(_attention(c, raw, qk_norm="head"),
                  tuple(block if i not in dense and (i + 1) % step == 0 else None for i in range(c.num_hidden_layers)),
                  c.intermediate_size)


def minimax_m2(ckpt: Checkpoint, c: TextConfig, raw: dict) -> Layout:
    """RMSNorm over the whole q and k projections, rotary on `rotary_dim`; every layer sigmoid-routed with a
    correction bias, renormalised, `block_sparse_moe.experts.N.w1/w3/w2` (gate/up/down), no shared expert."""
    router = moe.Router("sigmoid", raw["num_local_experts"], raw["num_experts_per_tok"], True)
    block = Experts(router, "block_sparse_moe.", "gate", c.intermediate_size, ("w1", "w3", "w2"),
                    correction="e_score_correction_bias")
    return Layout(_attention(c, raw, qk_norm="whole"), (block,) * c.num_hidden_layers, c.intermediate_size)


def glm4_moe(ckpt: Checkpoint, c: TextConfig, raw: dict) -> Layout:
    """GQA with q/k/v biases (attention_bias), rotary on partial_rotary_factor of the head (0.5 by default),
    per-head q/k norms if use_qk_norm; DeepSeek's router and shared experts after first_k_dense_replace dense
    layers. The checkpoint's next-token-prediction layers (index num_hidden_layers on) are not read."""
    router = moe.Router("sigmoid", raw["n_routed_experts"], raw["num_experts_per_tok"],
                        bool(raw.get("norm_topk_prob", True)), float(raw.get("routed_scaling_factor", 1.0)),
                        int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1))
    moe.check_groups(router, c.source)
    inter = raw["moe_intermediate_size"]
    block = Experts(router, "mlp.", "gate", inter, correction="gate.e_score_correction_bias",
                    shared=inter * int(raw.get("n_shared_experts") or 0))
    dense = int(raw.get("first_k_dense_replace", 1))
    attention = _attention(c, raw, rotary_dim=_rotary_dim(c, raw, 0.5), qkv_bias=bool(raw.get("attention_bias")),
                           qk_norm="head" if raw.get("use_qk_norm") else None)
    return Layout(attention, tuple(None if i < dense else block for i in range(c.num_hidden_layers)),
                  c.intermediate_size)


def gpt_oss(ckpt: Checkpoint, c: TextConfig, raw: dict) -> Layout:
    """q/k/v/o biases, a learned sink per head, a sliding window on the `layer_types` that say so; every layer
    routes the top-k router logits (biased) through a softmax over those k to experts with biases and SwiGLU
    clamped at swiglu_limit of interleaved gate/up rows (fused tensors, MXFP4 or bf16)."""
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(c.num_hidden_layers)]
    window = int(raw.get("sliding_window", 128) or 0)   # left out: GptOssConfig's 128, as the engines read it
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    router = moe.Router("topk_softmax", raw["num_local_experts"], raw["num_experts_per_tok"], False)
    block = Experts(router, "mlp.", "router", c.intermediate_size, (), logit_bias=True,
                    clamp=float(raw.get("swiglu_limit", 7.0)))
    attention = _attention(c, raw, qkv_bias=True, o_bias=True, sinks=True, windows=windows)
    return Layout(attention, (block,) * c.num_hidden_layers, c.intermediate_size)


ROOMS = {"Llama": llama, "Qwen3-MoE": qwen3_moe, "MiniMax-M2": minimax_m2, "GLM-4.5": glm4_moe, "gpt-oss": gpt_oss}
