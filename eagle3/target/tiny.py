"""Miniature random-weight targets with the real config layouts and tensor names.

Used by the tests and the demo: every code path that reads a real checkpoint is exercised on
these. `make_llama` writes Llama / Qwen2 / Qwen3 layouts (flat config, `model.` prefix).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """One model.safetensors, or `shards` files plus model.safetensors.index.json."""
    if shards <= 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, out / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_llama(out: str | Path, family: str = "llama", hidden: int = 64, layers: int = 6,
               heads: int = 4, kv_heads: int = 2, intermediate: int = 128, vocab: int = 512,
               tie: bool = False, shards: int = 1, seed: int = 0,
               dtype: torch.dtype = torch.bfloat16) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "architectures": [_ARCH[family]], "model_type": family, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": tie, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def ones(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    t = {"model.embed_tokens.weight": rand(vocab, hidden, std=1.0), "model.norm.weight": ones(hidden)}
    if not tie:
        t["lm_head.weight"] = rand(vocab, hidden, std=3 * hidden ** -0.5)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ones(hidden)
        t[p + "post_attention_layernorm.weight"] = ones(hidden)
        t[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        # small output projections keep the residual stream close to the token embedding, so the
        # target's greedy token is mostly a function of recent tokens: learnable by a tiny draft
        t[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim, std=0.3 * hidden ** -0.5)
        t[p + "mlp.gate_proj.weight"] = rand(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = rand(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = rand(hidden, intermediate, std=0.3 * intermediate ** -0.5)
        if family == "qwen2":
            for n, width in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
                t[p + f"self_attn.{n}.bias"] = rand(width * head_dim, std=0.02)
        if family == "qwen3":
            t[p + "self_attn.q_norm.weight"] = ones(head_dim)
            t[p + "self_attn.k_norm.weight"] = ones(head_dim)
    _save_sharded(t, out, shards)
    return out


def make_token_data(out: str | Path, vocab: int, sequences: int = 64, min_len: int = 16,
                    max_len: int = 96, seed: int = 0) -> Path:
    """Pre-tokenized JSON lines: a 'user' prefix (loss_mask 0) then an 'assistant' reply (1).

    Tokens follow a random bigram chain so the text has structure a draft can learn."""
    g = torch.Generator().manual_seed(seed)
    follow = torch.randint(3, vocab, (vocab, 4), generator=g)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for _ in range(sequences):
            n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            ids = [int(torch.randint(3, vocab, (1,), generator=g))]
            for _ in range(n - 1):
                ids.append(int(follow[ids[-1], int(torch.randint(0, 4, (1,), generator=g))]))
            user = int(torch.randint(2, max(3, n // 3), (1,), generator=g))
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * user + [1] * (n - user)}) + "\n")
    return out


def make_demo_target(out: str | Path) -> Path:
    """The target the README demo and the default config.toml use."""
    return make_llama(out, family="llama", hidden=64, layers=8, heads=4, kv_heads=2, intermediate=128,
                      vocab=512, seed=0)
