"""Miniature random-weight targets with the real config layouts and tensor names, for the demo and the
tests: the DeepSeek-V3 family as published (`make_kimi`: Kimi-K2.5's nested config with int4 experts by default,
flat Kimi-K2 and DeepSeek-V3 with its MTP layer, fp8 blocks or bf16; `write_kimi_chat` Kimi's tokenizer files and
chat template), the GQA MoE families (`make_moe`: Qwen3-MoE, MiniMax-M2, GLM-4.5, gpt-oss with MXFP4 experts) and
synthetic token data."""
from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3.models.quant import dequantize_mxfp4
from eagle3.models.vision import expected_shapes, vision_config


def start_target(out: str | Path, config: dict, seed: int, dtype: torch.dtype, block: tuple[int, int] = (128, 128),
                 scale_dtype: torch.dtype = torch.float32):
    """Write config.json into `out` -> (out, tensors {}, rand, ones, mlp, linear): makers of seeded random tensors
    in `dtype` (rand: std 1/sqrt(fan-in) by default; ones: about 1), linear adding one linear stored plain, "int4"
    (packs) or "fp8" (`block` blocks with `scale_dtype` scales), mlp an MLP's three."""
    out, t, g = Path(out), {}, torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))

    def rand(*shape, std=None, dtype=dtype):
        return (torch.randn(*shape, generator=g) * (std if std is not None else shape[-1] ** -0.5)).to(dtype)

    def ones(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    def linear(base: str, shape: tuple[int, int], std: float | None = None, kind: str = "bf16"):
        if kind == "int4":
            t.update({f"{base}.{k}": v for k, v in _quantized(g, *shape, std).items()})
        elif kind == "fp8":
            t.update({f"{base}.{k}": v for k, v in fp8_blocks(rand(*shape, std=std, dtype=torch.float32), block,
                                                               scale_dtype).items()})
        else:
            t[f"{base}.weight"] = rand(*shape, std=std)

    def mlp(p: str, hidden: int, inter: int, kind: str = "bf16"):
        # small output projections: the greedy token mostly a function of recent tokens, learnable by a tiny draft
        for name, shape, std in (("gate_proj", (inter, hidden), hidden ** -0.5),
                                 ("up_proj", (inter, hidden), hidden ** -0.5),
                                 ("down_proj", (hidden, inter), 0.3 * inter ** -0.5)):
            linear(p + name, shape, std, kind)

    return out, t, rand, ones, mlp, linear


def fp8_blocks(w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """W [out, in] as DeepSeek-V3 stores it: `weight` float8 e4m3, `weight_scale_inv` [ceil(out/b0), ceil(in/b1)] the
    amax / 448 of each block (partial at the edges) in `scale_dtype`."""
    (out, inp), (b0, b1) = w.shape, block
    rows, cols = -(-out // b0), -(-inp // b1)
    padded = torch.zeros(rows * b0, cols * b1)
    padded[:out, :inp] = w.float().abs()
    scale = (padded.view(rows, b0, cols, b1).amax((1, 3)) / 448).clamp(min=1e-12).to(scale_dtype)
    full = scale.float().repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]
    return {"weight": (w.float() / full).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def save_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """One model.safetensors, or `shards` files and model.safetensors.index.json."""
    if shards <= 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return
    names, weight_map = list(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_token_data(out: str | Path, vocab: int, sequences: int = 64, min_len: int = 16,
                    max_len: int = 96, seed: int = 0) -> Path:
    """Pre-tokenized lines: a user prefix (loss_mask 0), then a reply (1) from a bigram chain a draft learns."""
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


WORDS = ("the a plan city rain sun wind cold warm day week map road train time price list step check "
         "answer result number sum add two four six ten more less first next last because so then").split()


def make_chat_data(out: str | Path, conversations: int = 256, seed: int = 0, long_every: int = 8,
                   long_words: int = 280) -> Path:
    """Chat lines as a thinking, tool-calling model is served: reasoning beside every reply, a tool-call loop
    (tools, a call, its result, the answer) in every fourth line, a second user turn in every fourth other, and in
    every `long_every`-th line a long trace of `long_words` words of reasoning (~1,350 tokens with the tiny
    byte-level vocabulary, where a short one has ~50). Words follow a fixed random chain, so that a draft can learn
    the text."""
    g = torch.Generator().manual_seed(seed)
    follow = torch.randint(0, len(WORDS), (len(WORDS), 3), generator=g)

    def text(n: int) -> str:
        word = [int(torch.randint(0, len(WORDS), (1,), generator=g))]
        for _ in range(n - 1):
            word.append(int(follow[word[-1], int(torch.randint(0, 3, (1,), generator=g))]))
        return " ".join(WORDS[w] for w in word)

    def reply(n: int, reasoning: int | None = None) -> dict:
        return {"role": "assistant", "reasoning_content": text(reasoning or 2 * n), "content": text(n)}

    tools = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                               "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i in range(conversations):
            long = i % long_every == long_every - 2   # a line without tools or a second turn
            line = {"messages": [{"role": "user", "content": text(4)}, reply(5, long_words if long else None)]}
            if i % 4 == 1:
                call = {"id": f"functions.lookup:{i}", "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps({"word": text(1)})}}
                line = {"tools": tools, "messages": [
                    line["messages"][0], {**reply(3), "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": text(3)}, reply(5)]}
            elif i % 4 == 3:
                line["messages"] += [{"role": "user", "content": text(3)}, reply(4)]
            f.write(json.dumps(line) + "\n")
    return out


COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")


def make_image_chat(out: str | Path, conversations: int = 96, seed: int = 0) -> Path:
    """Chat lines about pictures drawn here with Pillow (a colored shape on a plain ground, 56-140 px a side, saved
    under images/ beside `out`) and, every other line, the same questions in words only; the replies placeholders
    for `generate` to replace with the target's own."""
    from PIL import Image, ImageDraw
    out, rng = Path(out), torch.Generator().manual_seed(seed)
    (out.parent / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(conversations):
        color, shape = list(COLORS)[i % len(COLORS)], SHAPES[(i // len(COLORS)) % len(SHAPES)]
        if i % 2:
            lines.append([{"type": "text", "text": f"Describe a {color} {shape} in a few words."}])
            continue
        w, h = (int(x) for x in torch.randint(56, 141, (2,), generator=rng))
        image = Image.new("RGB", (w, h), (245, 245, 235))
        box = (w // 5, h // 5, 4 * w // 5, 4 * h // 5)
        draw = ImageDraw.Draw(image)
        {"circle": draw.ellipse, "square": draw.rectangle}.get(shape, lambda b, fill: draw.polygon(
            [(b[0], b[3]), (b[2], b[3]), ((b[0] + b[2]) // 2, b[1])], fill=fill))(box, fill=COLORS[color])
        image.save(out.parent / "images" / f"{i}.png")
        lines.append([{"type": "image_url", "image_url": {"url": f"images/{i}.png"}},
                      {"type": "text", "text": "What is in this picture?"}])
    out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": content}, {
        "role": "assistant", "content": "(the model's reply)"}]}) + "\n" for content in lines))
    return out


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values -8..7 [out, in] -> compressed-tensors int32 [out, in/8]."""
    nib = (q.to(torch.int64) + 8).unflatten(-1, (-1, 8))
    word = (nib << (4 * torch.arange(8))).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def _quantized(g: torch.Generator, out: int, inp: int, std: float, group: int = 32) -> dict[str, torch.Tensor]:
    """A random int4 linear with weights of about `std`: weight_packed/scale/shape."""
    q = torch.randint(-8, 8, (out, inp), generator=g)
    scale = std / 4.6 * (1 + 0.2 * torch.rand(out, inp // group, generator=g))  # int4 values have std ~4.6
    return {"weight_packed": pack_int4(q), "weight_scale": scale.to(torch.bfloat16),
            "weight_shape": torch.tensor([out, inp], dtype=torch.int32)}


# K2-Instruct's and DeepSeek-V3's (both at the top level of a flat config)
FP8_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
_KIMI_QUANT = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}


TINY_VISION = {"width": 32, "heads": 2, "layers": 2, "intermediate": 64, "pos_grid": 8}


def kimi_vision_config(text_hidden: int, width: int, heads: int, layers: int, intermediate: int, pos_grid: int) -> dict:
    """Kimi-K2.5's vision_config (the published keys and values) with small tower sizes."""
    return {"init_pos_emb_height": pos_grid, "init_pos_emb_time": 4, "init_pos_emb_width": pos_grid,
            "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": width,
            "mm_projector_type": "patchmerger", "patch_size": 14, "pos_emb_type": "divided_fixed",
            "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "text_hidden_size": text_hidden,
            "video_attn_type": "spatial_temporal", "vt_hidden_size": width, "vt_intermediate_size": intermediate,
            "vt_num_attention_heads": heads, "vt_num_hidden_layers": layers}


def kimi_k25_config(hidden, layers, heads, q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head, intermediate,
                    moe_intermediate, experts, top_k, n_group, topk_group, first_dense, vocab, yarn_original,
                    yarn_factor, vision: dict = TINY_VISION) -> dict:
    """Kimi-K2.5's config.json layout (the real file's keys; its text config's value types too), small sizes."""
    # special ids sit in the top 256 of the vocab, as Kimi's 163584.. do
    ids = {"bos_token_id": vocab - 256, "eos_token_id": vocab - 255, "pad_token_id": vocab - 1}
    text = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "model_type": "kimi_k2", "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, **ids,
        "ep_size": 1, "first_k_dense_replace": first_dense, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": 0.02, "intermediate_size": intermediate, "kv_lora_rank": kv_lora_rank,
        "max_position_embeddings": int(yarn_original * yarn_factor), "moe_intermediate_size": moe_intermediate,
        "moe_layer_freq": 1, "n_group": n_group, "n_routed_experts": experts, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": heads, "num_experts_per_tok": top_k,
        "num_hidden_layers": layers, "num_key_value_heads": heads, "num_nextn_predict_layers": 0,
        "pretraining_tp": 1, "q_lora_rank": q_lora_rank, "qk_nope_head_dim": qk_nope, "qk_rope_head_dim": qk_rope,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": float(yarn_factor), "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": yarn_original, "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": topk_group, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "use_cache": True, "v_head_dim": v_head, "vocab_size": vocab, "quantization_config": _KIMI_QUANT}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "auto_map": {}, **ids, "ignore_index": -100,
            "media_placeholder_token_id": vocab - 256 + 21, "model_type": "kimi_k25", "tie_word_embeddings": False,
            "use_unified_vision_chunk": True, "video_placeholder": "<|kimi_k25_video_placeholder|>",
            "text_config": text, "vision_config": kimi_vision_config(hidden, **vision)}


def make_kimi(out: str | Path, hidden: int = 64, layers: int = 5, heads: int = 4, q_lora_rank: int | None = 32,
              kv_lora_rank: int = 16, qk_nope: int = 16, qk_rope: int = 8, v_head: int = 16,
              intermediate: int = 128, moe_intermediate: int = 32, experts: int = 8, top_k: int = 2,
              n_group: int = 1, topk_group: int = 1, first_dense: int = 1, vocab: int = 512,
              yarn_original: int = 128, yarn_factor: float = 32.0, shards: int = 3, seed: int = 0,
              layout: str = "kimi_k25", weights: str = "int4", block: tuple[int, int] = (128, 128),
              scale_dtype: torch.dtype = torch.float32, mtp: int = 0, vision: dict = TINY_VISION) -> Path:
    """A miniature DeepSeek-V3-family target as published, sharded. `layout`: "kimi_k25" (K2.5 / K2.6: `kimi_k25`
    wrapper, `language_model.` prefix, a vision tower and projector of `vision`'s sizes), "kimi_k2" (K2-Instruct /
    K2-Thinking: flat) or "deepseek_v3" (V3 / R1 / V3.1: flat, `mtp` multi-token-prediction layers past the last).
    `weights`: "int4" (routed experts pack-quantized, as K2-Thinking and K2.5), "fp8" (every decoder linear but the
    router in `block` blocks, as K2-Instruct and V3) or "bf16"."""
    config = kimi_k25_config(hidden, layers, heads, q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head,
                             intermediate, moe_intermediate, experts, top_k, n_group, topk_group, first_dense,
                             vocab, yarn_original, yarn_factor, vision)
    text = config["text_config"]
    text["quantization_config"] = {"int4": _KIMI_QUANT, "fp8": {**FP8_QUANT, "weight_block_size": list(block)}
                                   }.get(weights)
    if weights == "bf16":
        del text["quantization_config"]
    if layout != "kimi_k25":
        config = {**text, "model_type": layout, "num_nextn_predict_layers": mtp}
    out, t, rand, ones, mlp, linear = start_target(out, config, seed, torch.bfloat16, block, scale_dtype)
    m, head = (("language_model.model.", "language_model.lm_head.weight") if layout == "kimi_k25"
               else ("model.", "lm_head.weight"))
    dense_kind = "fp8" if weights == "fp8" else "bf16"
    t.update({m + "embed_tokens.weight": rand(vocab, hidden, std=1.0), m + "norm.weight": ones(hidden),
              head: rand(vocab, hidden, std=3 * hidden ** -0.5)})
    for i in range(layers + (mtp if layout == "deepseek_v3" else 0)):
        p, a = f"{m}layers.{i}.", f"{m}layers.{i}.self_attn."
        t[p + "input_layernorm.weight"] = ones(hidden)
        t[p + "post_attention_layernorm.weight"] = ones(hidden)
        if q_lora_rank is None:
            linear(a + "q_proj", (heads * (qk_nope + qk_rope), hidden), kind=dense_kind)
        else:
            linear(a + "q_a_proj", (q_lora_rank, hidden), kind=dense_kind)
            t[a + "q_a_layernorm.weight"] = ones(q_lora_rank)
            linear(a + "q_b_proj", (heads * (qk_nope + qk_rope), q_lora_rank), kind=dense_kind)
        linear(a + "kv_a_proj_with_mqa", (kv_lora_rank + qk_rope, hidden), kind=dense_kind)
        t[a + "kv_a_layernorm.weight"] = ones(kv_lora_rank)
        linear(a + "kv_b_proj", (heads * (qk_nope + v_head), kv_lora_rank), kind=dense_kind)
        linear(a + "o_proj", (hidden, heads * v_head), 0.3 * (heads * v_head) ** -0.5, dense_kind)
        if i >= layers:   # DeepSeek-V3's MTP layer: a decoder layer with its own embedding, projection and head
            t.update({p + "enorm.weight": ones(hidden), p + "hnorm.weight": ones(hidden),
                      p + "embed_tokens.weight": rand(vocab, hidden, std=1.0),
                      p + "shared_head.norm.weight": ones(hidden), p + "shared_head.head.weight": rand(vocab, hidden)})
            linear(p + "eh_proj", (hidden, 2 * hidden), kind=dense_kind)
        if i < first_dense:
            mlp(p + "mlp.", hidden, intermediate, dense_kind)
            continue
        t[p + "mlp.gate.weight"] = rand(experts, hidden)
        t[p + "mlp.gate.e_score_correction_bias"] = rand(experts, std=0.1, dtype=torch.float32)
        mlp(p + "mlp.shared_experts.", hidden, moe_intermediate, dense_kind)
        for e in range(experts):
            mlp(f"{p}mlp.experts.{e}.", hidden, moe_intermediate, dense_kind if weights != "int4" else "int4")
    if layout == "kimi_k25":   # last: the text weights do not depend on the tower
        t.update(vision_tensors(config["vision_config"], rand, ones))
    save_sharded(t, out, shards)
    return out


def vision_tensors(vc: dict, rand, ones) -> dict[str, torch.Tensor]:
    """Random tensors of the vision tower and projector under their published names and shapes."""
    shapes = expected_shapes(vision_config({"vision_config": vc}, "tiny"))
    # norms about 1, biases small, the position grid and patch embedding about unit scale
    return {n: (ones(s[0]) if "norm" in n and n.endswith("weight") else rand(*s, std=0.02) if n.endswith("bias")
                else rand(*s, std=1.0) if "pos_emb" in n else rand(*s)) for n, s in shapes.items()}


# Kimi-K2.5's special tokens by offset from its first special id (163584 in the real vocabulary)
KIMI_SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
                14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 18: "<|media_begin|>",
                19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 22: "<think>", 23: "</think>",
                254: "[UNK]", 255: "[PAD]"}


def kimi_chat_template() -> str:
    """Kimi-K2.5's chat template (docs/data.md names its sources) with K2-Thinking's default system turn."""
    return resources.files("eagle3.models").joinpath("kimi_k25_chat_template.jinja").read_text()


def write_kimi_chat(root: str | Path, vocab: int, merges: tuple[bytes, ...] = ()) -> Path:
    """Kimi-K2.5's tokenizer files for a vocabulary of `vocab`: tiktoken.model with the 256 bytes (ids 0-255), then
    `merges` (each the join of two earlier tokens), its 256 special tokens at the top of the vocabulary with their
    real offsets, tokenizer_config.json, generation_config.json (stop at <|im_end|>) and chat_template.jinja."""
    root, base = Path(root), vocab - 256
    if 256 + len(merges) > base:
        raise ValueError(f"{len(merges)} merges do not fit below the special tokens of a {vocab}-token vocabulary")
    ranks = [bytes([i]) for i in range(256)] + list(merges)
    (root / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    special = {base + i: KIMI_SPECIAL.get(i, f"<|reserved_token_{i}|>") for i in range(256)}
    config = {"added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in special.items()},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": base + 2}))
    (root / "chat_template.jinja").write_text(kimi_chat_template())
    return root


MOE_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
                     "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def moe_config(family: str, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int,
               experts: int, top_k: int, vocab: int) -> dict:
    """The config.json keys of each GQA MoE family as its published checkpoints write them, small sizes."""
    c = {"architectures": [MOE_ARCHITECTURES[family]], "model_type": family, "hidden_size": hidden,
         "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
         "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "num_experts_per_tok": top_k,
         "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0}
    if family == "qwen3_moe":   # layer 0 dense: mlp_only_layers
        c |= {"intermediate_size": 2 * inter, "moe_intermediate_size": inter, "num_experts": experts,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0], "attention_bias": False}
    elif family == "minimax_m2":
        c |= {"intermediate_size": inter, "num_local_experts": experts, "rotary_dim": head_dim // 2,
              "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True}
    elif family == "glm4_moe":   # one next-token-prediction layer after the last, as GLM-4.5's
        c |= {"intermediate_size": 2 * inter, "moe_intermediate_size": inter, "n_routed_experts": experts,
              "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5,
              "attention_bias": True, "use_qk_norm": True, "num_nextn_predict_layers": 1}
    else:
        c |= {"intermediate_size": inter, "num_local_experts": experts, "experts_per_token": top_k,
              "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
              "rope_theta": 150000.0, "swiglu_limit": 7.0, "attention_bias": True, "initial_context_length": 4096,
              "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 4096}}
    return c


def make_moe(out: str | Path, family: str, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2,
             head_dim: int = 16, inter: int = 32, experts: int = 8, top_k: int = 2, vocab: int = 256,
             weights: str = "bf16", seed: int = 0) -> Path:
    """A miniature `family` target (qwen3_moe, minimax_m2, glm4_moe, gpt_oss) in its published tensor layout.
    `weights`: "bf16"; "fp8" (every decoder linear but the router in 16 x 32 blocks, as the FP8 releases of Qwen3-MoE,
    GLM-4.5 and MiniMax-M2 store them at 128 x 128); gpt-oss "mxfp4" (its experts as the release stores them; "bf16":
    their dequantization, as the BF16 re-releases)."""
    config = moe_config(family, hidden, layers, heads, kv_heads, head_dim, inter, experts, top_k, vocab)
    if weights == "fp8":
        config["quantization_config"] = {**FP8_QUANT, "weight_block_size": [16, 32]}
    if weights == "mxfp4":
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    out, t, rand, ones, mlp, linear = start_target(out, config, seed, torch.bfloat16, (16, 32))
    kind = "fp8" if weights == "fp8" else "bf16"
    t.update({"model.embed_tokens.weight": rand(vocab, hidden, std=1.0), "model.norm.weight": ones(hidden),
              "lm_head.weight": rand(vocab, hidden, std=3 * hidden ** -0.5)})
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers + (family == "glm4_moe")):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = ones(hidden), ones(hidden)
        for name, shape in (("q", (q, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden))):
            linear(f"{p}self_attn.{name}_proj", shape, kind=kind)
            if family in ("glm4_moe", "gpt_oss"):
                t[f"{p}self_attn.{name}_proj.bias"] = rand(shape[0], std=0.1)
        linear(p + "self_attn.o_proj", (hidden, q), 0.3 * q ** -0.5, kind)
        if family in ("qwen3_moe", "glm4_moe"):
            t.update({p + "self_attn.q_norm.weight": ones(head_dim), p + "self_attn.k_norm.weight": ones(head_dim)})
        if family == "minimax_m2":
            t.update({p + "self_attn.q_norm.weight": ones(q), p + "self_attn.k_norm.weight": ones(kv)})
        if family == "gpt_oss":
            t.update({p + "self_attn.o_proj.bias": rand(hidden, std=0.02), p + "self_attn.sinks": rand(heads, std=1.0)})
            _gpt_oss_experts(t, p + "mlp.", rand, hidden, inter, experts, weights == "mxfp4", seed + i)
        elif family == "minimax_m2":
            t[p + "block_sparse_moe.gate.weight"] = rand(experts, hidden)
            t[p + "block_sparse_moe.e_score_correction_bias"] = rand(experts, std=0.1, dtype=torch.float32)
            for e in range(experts):
                for name, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
                    linear(f"{p}block_sparse_moe.experts.{e}.{name}", shape, kind=kind)
        elif i < config.get("first_k_dense_replace", 0) or i in config.get("mlp_only_layers", ()):
            mlp(p + "mlp.", hidden, 2 * inter, kind)
        else:
            t[p + "mlp.gate.weight"] = rand(experts, hidden)
            if family == "glm4_moe":
                t[p + "mlp.gate.e_score_correction_bias"] = rand(experts, std=0.1, dtype=torch.float32)
                mlp(p + "mlp.shared_experts.", hidden, inter, kind)
            for e in range(experts):
                mlp(f"{p}mlp.experts.{e}.", hidden, inter, kind)
        if i == layers:   # GLM's next-token-prediction layer: its own projections beside a decoder layer
            t.update({p + "enorm.weight": ones(hidden), p + "hnorm.weight": ones(hidden),
                      p + "shared_head.norm.weight": ones(hidden)})
            linear(p + "eh_proj", (hidden, 2 * hidden), kind=kind)
    save_sharded(t, out, 2)
    return out


def _gpt_oss_experts(t: dict, p: str, rand, hidden: int, inter: int, experts: int, mxfp4: bool, seed: int) -> None:
    """gpt-oss's fused experts: MXFP4 `*_blocks` / `*_scales` [E, out, in/32, (16)], or bf16 [E, in, out]."""
    g = torch.Generator().manual_seed(seed)
    t[p + "router.weight"], t[p + "router.bias"] = rand(experts, hidden), rand(experts, std=0.1)
    for name, (o, n) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
        blocks = torch.randint(0, 256, (experts, o, n // 32, 16), generator=g, dtype=torch.uint8)
        # scales of 2^-4..2^-3 for weights of std ~ n^-0.5 at n = 32..64 (e2m1 values have std ~2.4)
        scales = torch.randint(123, 125, (experts, o, n // 32), generator=g, dtype=torch.uint8)
        if mxfp4:
            t[p + f"experts.{name}_blocks"], t[p + f"experts.{name}_scales"] = blocks, scales
        else:
            t[p + f"experts.{name}"] = dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(1, 2).contiguous()
        t[p + f"experts.{name}_bias"] = rand(experts, o, std=0.05)
