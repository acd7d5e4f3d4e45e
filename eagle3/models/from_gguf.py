"""A llama.cpp GGUF file of a Llama-architecture model turned into a target directory in the Hugging Face layout
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json), read with the `gguf` package (the `real` extra) and `tokenizers` (the `chat` extra): the
demo's real small model (SmolLM2-135M-Instruct). The weights are dequantised to float32; the tokenizer is the
file's byte-level BPE with llama.cpp's pre-tokenizer for it (docs/targets.md, "A GGUF file")."""
from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from eagle3.errors import TargetError

# GGUF tensor names (llama.cpp's gguf-py TENSOR_NAMES for LLM_ARCH_LLAMA) -> Hugging Face Llama names
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's pre-tokenizers of byte-level BPE vocabularies we reproduce (tokenizer.ggml.pre): "smollm" splits
# every digit off (\p{N}) before GPT-2's pattern (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM)
PRE_TOKENIZERS = {"smollm": True, "gpt-2": False}
CONTROL = 3   # tokenizer.ggml.token_type of a special (control) token


def hf_name(name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    raise TargetError(f"GGUF tensor {name}: not a Llama tensor this converter knows")


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf permute of q/k rows (each head's rotary halves interleaved) [out, in]."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def field(reader, key: str, path: Path, default=None):
    if key not in reader.fields:
        if default is not None:
            return default
        raise TargetError(f"{path}: GGUF key {key} is missing")
    return reader.fields[key].contents()


def hf_config(reader, path: Path, tied: bool) -> dict:
    arch = field(reader, "general.architecture", path)
    if arch != "llama":
        raise TargetError(f"{path}: general.architecture is {arch!r}; only 'llama' GGUF files convert")
    get = lambda key, default=None: field(reader, f"llama.{key}", path, default)   # noqa: E731
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    ids = {k: int(field(reader, f"tokenizer.ggml.{k}", path)) for k in ("bos_token_id", "eos_token_id")}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": hidden // heads, "vocab_size": len(field(reader, "tokenizer.ggml.tokens", path)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(get("rope.freq_base", 10000.0)), "max_position_embeddings": int(get("context_length")),
            "tie_word_embeddings": tied, "hidden_act": "silu", "torch_dtype": "float32", **ids}


def weights(reader, config: dict) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to float32 under its Hugging Face name, q/k rows back in Hugging Face order."""
    from gguf.quants import dequantize
    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))   # a writable copy
        w = w.reshape([int(n) for n in reversed(t.shape)])      # GGUF lists dims innermost first
        if ".q_proj." in name:
            w = unpermute(w, config["num_attention_heads"])
        elif ".k_proj." in name:
            w = unpermute(w, config["num_key_value_heads"])
        out[name] = w.contiguous()
    return out


def write_tokenizer(reader, path: Path, out: Path) -> tuple[str, str]:
    """tokenizer.json from the file's vocabulary and merges -> (bos, eos) token strings."""
    tk = importlib.import_module("tokenizers")
    model = field(reader, "tokenizer.ggml.model", path)
    pre = field(reader, "tokenizer.ggml.pre", path, "gpt-2")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise TargetError(f"{path}: tokenizer {model!r} with pre-tokenizer {pre!r}; only byte-level BPE ('gpt2') "
                          f"with {' or '.join(map(repr, PRE_TOKENIZERS))} converts")
    tokens = field(reader, "tokenizer.ggml.tokens", path)
    kinds = field(reader, "tokenizer.ggml.token_type", path)
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", path)]
    tok = tk.Tokenizer(tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if PRE_TOKENIZERS[pre] else byte_level)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, kinds) if kind == CONTROL])
    tok.save(str(out / "tokenizer.json"))
    return tuple(tokens[int(field(reader, f"tokenizer.ggml.{k}_token_id", path))] for k in ("bos", "eos"))


def convert(path: str | Path, out: str | Path) -> Path:
    """Write the target directory `out` (through `out`.tmp, renamed when whole) from the GGUF file `path`."""
    try:
        gguf = importlib.import_module("gguf")
    except ImportError:
        raise TargetError(f"{path}: reading a GGUF file needs the optional package 'gguf': "
                          "pip install eagle3-trainer[real]") from None
    path, out = Path(path), Path(out)
    reader = gguf.GGUFReader(path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = hf_config(reader, path, tied)
    save_file(weights(reader, config), tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    bos, eos = write_tokenizer(reader, path, tmp)
    template = field(reader, "tokenizer.chat_template", path)
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos,
                                                           "chat_template": template}, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": config["bos_token_id"],
                                                            "eos_token_id": config["eos_token_id"]}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
