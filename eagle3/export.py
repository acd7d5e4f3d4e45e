"""Export a trained draft for serving: vLLM (speculators layout) and SGLang (native).

Both read `d2t`/`t2d` and the same weights; they differ in the config and in the layer's name
(`layers.0.*` for vLLM, `midlayer.*` for SGLang, which silently skips names it does not know).
`load_vllm_draft` reads the vLLM layout back (ours or the peer trainer's) for real decoding.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eagle3 import checkpoint as ckpt_io
from eagle3.config import Config, from_dict
from eagle3.draft import DraftSpec, Eagle3Draft
from eagle3.resolve import NORM_FLAGS
from eagle3.files import make_readable, read_json, short_of_space, tensor_bytes
from eagle3.ops import TORCH_DTYPES, llama_inv_freq
from eagle3.models.checkpoint import Checkpoint, rope_settings
from eagle3.vocab import VocabError, check_vocab

LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")


def top_keys(spec: dict) -> list[str]:
    """The tensors outside the layers: the EAGLE-3.1 norms before fc only when the draft has them."""
    return (["fc.weight", "norm.weight", "lm_head.weight"] + ["input_norm.weight"] * bool(spec.get("norm_before_fc"))
            + [f"fc_norm.{i}.weight" for i in range(3 if spec.get("fc_norm") else 0)])


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
    resolved = state["resolved"]
    spec = resolved["draft_spec"]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.export.speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.export.verifier_name or resolved["verifier_name"],
                         "architectures": state["target_architectures"]},
        },
        "transformer_layer_config": _llama_layer_config(spec, cfg.export.dtype),
        "draft_vocab_size": spec["draft_vocab_size"],
        "target_hidden_size": spec["target_hidden_size"],
        **{key: spec.get(key, False) for key in NORM_FLAGS},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in resolved["aux_layer_ids"]],
        "torch_dtype": cfg.export.dtype,
    }


def sglang_config(state: dict, cfg: Config) -> dict:
    spec = state["resolved"]["draft_spec"]
    config = _llama_layer_config(spec, cfg.export.dtype)
    config.update({
        "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
        "draft_vocab_size": spec["draft_vocab_size"], "target_hidden_size": spec["target_hidden_size"],
        # SGLang reads only eagle_config's ids, as outputs of layers (ours; its target models capture
        # the input of layer id + 1): ModelRunner.__init__ in sglang/srt/model_executor/model_runner.py
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(state["resolved"]["aux_layer_ids"]),
                         "use_aux_hidden_state": True},
        "torch_dtype": cfg.export.dtype,
    })
    return config


def export_weights(weights: dict[str, torch.Tensor], spec: dict, layer_prefix, num_layers: int,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Map trained names onto the serving names; float weights cast to `dtype`, vocab maps kept."""
    top = top_keys(spec)
    if missing := [k for k in top if k not in weights]:   # an engine would keep its initial tensor
        raise ExportError(f"checkpoint weights lack {missing[0]} (the draft's settings ask for {missing})")
    out = {k: weights[k] for k in top}
    for i in range(num_layers):
        for key in LAYER_KEYS if i == 0 else [k for k in LAYER_KEYS if k != "hidden_norm.weight"]:
            src = f"layers.{i}.{key}"
            if src not in weights:   # an engine would silently keep a random tensor for it
                raise ExportError(f"checkpoint weights lack {src}")
            out[f"{layer_prefix(i)}.{key}"] = weights[src]
    left = set(weights) - {"d2t", "t2d", *top} - {
        f"layers.{i}.{k}" for i in range(num_layers) for k in LAYER_KEYS}
    if left:
        raise ExportError(f"checkpoint weights not exported: {sorted(left)[:5]}")
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    out["d2t"] = weights["d2t"].to(torch.int64)
    out["t2d"] = weights["t2d"].to(torch.bool)
    return out


def _write(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write into `<out_dir>.tmp`, then put it in place of `out_dir`: a failure (no room, no write
    permission) removes the partial folder and names the directory, and an export already there stays."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if short := short_of_space(out_dir.parent, tensor_bytes(tensors) + (1 << 20), f"the {out_dir.name} export"):
        raise ExportError(short + "; nothing was written")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        make_readable(tmp / "model.safetensors")
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    except (OSError, SafetensorError) as e:   # safetensors reports a full disk as its own error
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"{out_dir}: writing the export failed ({getattr(e, 'strerror', None) or e}); the partial folder was "
                          "removed") from None
    return out_dir


def export_all(checkpoint_dir: str | Path, out_dir: str | Path, cfg: Config | None = None) -> dict[str, Path]:
    """Write `out_dir/vllm` and/or `out_dir/sglang` from a training checkpoint directory."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    state = ckpt_io.read_state(checkpoint_dir)
    cfg = cfg or from_dict(state["config"], str(checkpoint_dir / ckpt_io.STATE))
    weights = ckpt_io.load_weights(checkpoint_dir)
    check_vocab(weights["d2t"], weights["t2d"], str(checkpoint_dir / ckpt_io.MODEL))
    spec = state["resolved"]["draft_spec"]
    if len(state["resolved"]["aux_layer_ids"]) != 3:
        raise ExportError(f"{checkpoint_dir}: EAGLE-3 export needs exactly 3 aux layers")
    dtype = TORCH_DTYPES[cfg.export.dtype]
    written = {}
    for fmt in cfg.export.formats:
        if fmt == "vllm":
            tensors = export_weights(weights, spec, lambda i: f"layers.{i}", spec["num_layers"], dtype)
            written[fmt] = _write(out_dir / "vllm", vllm_config(state, cfg), tensors)
        elif fmt != "sglang":
            raise ExportError(f"export format {fmt!r}; expected 'vllm' or 'sglang'")
        else:
            if spec["num_layers"] != 1:
                raise ExportError(f"{checkpoint_dir}: SGLang's EAGLE-3 draft has one layer (midlayer); "
                                  f"this draft has {spec['num_layers']}; export vllm only")
            for key in NORM_FLAGS:
                if spec.get(key):
                    raise ExportError(f"{checkpoint_dir}: the draft's {key} is on (experimental), which SGLang's LlamaForCausalLMEagle3 "
                                      "does not read (it would decode with another draft); export vllm only")
            tensors = export_weights(weights, spec, lambda i: "midlayer", 1, dtype)
            written[fmt] = _write(out_dir / "sglang", sglang_config(state, cfg), tensors)
    return written


# ---------------------------------------------------------------- loading a vLLM-layout draft back

class DraftLoadError(ValueError):
    """A draft directory that cannot be used; the message names the file and the field or tensor."""


# Names of the draft's own computation: one we do not know would change the result if dropped
# (a bias, a qk-norm, an input norm), so it is an error; anything else (the frozen embedding copy,
# the verifier head) is ignored with a note.
DRAFT_PARTS = ("fc", "layers.", "norm.", "lm_head.", "input_norm.", "hidden_norm.", "midlayer.", "fc_norm.")


def read_draft_config(path: Path) -> dict:
    """config.json of a speculators/vLLM EAGLE-3 draft, refusing what our draft cannot compute."""
    file = path / "config.json"
    config = read_json(file, DraftLoadError, "a draft directory needs config.json")
    if not isinstance(config, dict) or config.get("speculators_model_type") != "eagle3":
        found = config.get("speculators_model_type") if isinstance(config, dict) else None
        raise DraftLoadError(f"{file}: speculators_model_type is {found!r}; expected 'eagle3' (a "
                             "speculators/vLLM EAGLE-3 draft; an SGLang-layout draft is not read)")
    if config.get("norm_before_fc") and config.get("fc_norm"):
        raise DraftLoadError(f"{file}: norm_before_fc and fc_norm are both true; a draft has one of them")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftLoadError(f"{file}: transformer_layer_config must be an object (the draft layer's config)")
    problems = {"model_type": layer.get("model_type", "llama") != "llama",
                "hidden_act": layer.get("hidden_act", "silu") != "silu",
                "attention_bias": bool(layer.get("attention_bias")), "mlp_bias": bool(layer.get("mlp_bias")),
                "layer_types": "sliding_attention" in (layer.get("layer_types") or [])}
    for key, bad in problems.items():
        if bad:
            raise DraftLoadError(f"{file}: transformer_layer_config.{key} = {layer[key]!r}; our draft is a "
                                 "Llama layer (silu, no biases, full attention)")
    return config


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from model.safetensors or a sharded index."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise DraftLoadError(f"{index}: expected a JSON object with 'weight_map' ({e})") from None
    single = path / "model.safetensors"
    if not single.exists():
        raise DraftLoadError(f"{single}: not found (nor model.safetensors.index.json)")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def _shape(files: dict[str, Path], name: str) -> list[int] | None:
    if name not in files:
        return None
    with safe_open(files[name], "pt") as f:
        return list(f.get_slice(name).get_shape())


def _get(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(files[name], "pt") as f:
        return f.get_tensor(name)


def _draft_spec(config: dict, files: dict[str, Path], where: str) -> DraftSpec:
    """Sizes from transformer_layer_config; where it leaves one out (transformers writes only the
    values that differ from its defaults) from the tensors' shapes, else Llama's defaults."""
    layer = config["transformer_layer_config"]
    fc = _shape(files, "fc.weight")
    if fc is None or len(fc) != 2 or fc[1] % 3:
        raise DraftLoadError(f"{where}: fc.weight is {'missing' if fc is None else f'of shape {fc}'}; "
                             "expected [hidden, 3 * target_hidden]")
    q = _shape(files, "layers.0.self_attn.q_proj.weight") or [0]
    k = _shape(files, "layers.0.self_attn.k_proj.weight") or [0]
    gate = _shape(files, "layers.0.mlp.gate_proj.weight") or [0]
    head = _shape(files, "lm_head.weight") or [0]
    t2d = _shape(files, "t2d")
    heads = layer.get("num_attention_heads") or 32
    head_dim = layer.get("head_dim") or q[0] // heads
    layers = {int(n.split(".")[1]) for n in files if n.startswith("layers.") and n.split(".")[1].isdigit()}
    theta, _ = rope_settings(layer)
    return DraftSpec(
        hidden_size=layer.get("hidden_size") or fc[0], num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or max(1, k[0] // max(1, head_dim)),
        head_dim=head_dim, intermediate_size=layer.get("intermediate_size") or gate[0],
        num_layers=layer.get("num_hidden_layers") or max(1, len(layers)),
        rms_norm_eps=float(layer.get("rms_norm_eps") or 1e-6), rope_theta=theta,
        max_position_embeddings=layer.get("max_position_embeddings") or 2048,
        draft_vocab_size=config.get("draft_vocab_size") or head[0],
        target_vocab_size=layer.get("vocab_size") or (t2d[0] if t2d else 32000),
        target_hidden_size=config.get("target_hidden_size") or fc[1] // 3,
        # absent norm_before_residual: what vLLM's speculators config reader then serves, true
        **{key: bool(config.get(key, key == "norm_before_residual")) for key in NORM_FLAGS})


def _draft_tensors(files: dict[str, Path], draft: Eagle3Draft, where: str) -> dict[str, torch.Tensor]:
    """Every tensor the draft needs, shape-checked; d2t/t2d are the identity when the draft keeps
    the target's whole vocabulary (speculators then writes neither)."""
    expected = {name: list(t.shape) for name, t in draft.state_dict().items()}
    spec = draft.spec
    out = {}
    for name, shape in expected.items():
        if name in ("d2t", "t2d") and name not in files and spec.draft_vocab_size == spec.target_vocab_size:
            out[name] = (torch.zeros(shape, dtype=torch.int64) if name == "d2t"
                         else torch.ones(shape, dtype=torch.bool))
            continue
        found = _shape(files, name)
        if found is None:
            raise DraftLoadError(f"{where}: tensor {name} is missing (the draft needs it)")
        if found != shape:
            raise DraftLoadError(f"{where}: tensor {name} has shape {found}; config.json implies {shape}")
        out[name] = _get(files, name)
    out["d2t"], out["t2d"] = out["d2t"].to(torch.int64), out["t2d"].to(torch.bool)
    try:
        check_vocab(out["d2t"], out["t2d"], where)
    except VocabError as e:
        raise DraftLoadError(str(e)) from None
    unknown = sorted(set(files) - set(expected))
    parts = [n for n in unknown if n.startswith(DRAFT_PARTS)]
    if parts:
        raise DraftLoadError(f"{where}: tensor {parts[0]} is part of the draft's computation but our draft "
                             f"has no such tensor ({len(parts)} such: {parts[:4]})")
    if unknown:
        print(f"note: {where}: ignoring {len(unknown)} tensor(s) that are not part of the draft: {unknown[:4]}",
              file=sys.stderr)
    return out


def vllm_aux_layer_ids(config: dict, target_layers: int | None, where: str) -> list[int]:
    """Our aux layer ids (vLLM's minus 1); absent or null: vLLM's default [2, L//2, L-3]."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if target_layers is None:
            raise DraftLoadError(f"{where}: no eagle_aux_hidden_state_layer_ids; the default needs the target")
        ids = [2, target_layers // 2, target_layers - 3]
    if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids):
        raise DraftLoadError(f"{where}: eagle_aux_hidden_state_layer_ids = {ids!r}; expected 3 layer ids")
    ours = [i - 1 for i in ids]
    if target_layers is not None and any(not 0 <= i < target_layers for i in ours):
        raise DraftLoadError(f"{where}: eagle_aux_hidden_state_layer_ids = {ids} (vLLM's: inputs of layers) "
                             f"do not fit a target of {target_layers} layers: expected 1..{target_layers}")
    return ours


def _check_target(draft: Eagle3Draft, files: dict[str, Path], target: Checkpoint, where: str) -> None:
    """The draft reads the target's embeddings and aux states: sizes must agree; a stored copy of the
    embedding that differs says the draft was trained against another target (a note: still measurable)."""
    s, c = draft.spec, target.config
    for name, mine, theirs in (("hidden_size", s.hidden_size, c.hidden_size),
                               ("target_hidden_size", s.target_hidden_size, c.hidden_size),
                               ("vocab_size", s.target_vocab_size, c.vocab_size)):
        if mine != theirs:
            raise DraftLoadError(f"{where}: the draft's {name} is {mine} but the target {target.dir} has "
                                 f"{theirs}: trained for another target")
    if "embed_tokens.weight" in files:
        copy = _get(files, "embed_tokens.weight")
        if not torch.equal(copy, target.get("embed_tokens.weight").to(copy.dtype)):
            print(f"note: {where}: its embed_tokens.weight differs from the target's {target.dir}: was the "
                  "draft trained against another target?", file=sys.stderr)


def load_vllm_draft(path: str | Path, target: Checkpoint | None = None) -> tuple[Eagle3Draft, list[int]]:
    """(Eagle3Draft in fp32 on the CPU, our aux layer ids) from a speculators/vLLM EAGLE-3 directory
    (config.json + model.safetensors: our export or the peer trainer's). With the target, the sizes
    are checked against it and absent aux ids take vLLM's default for its layer count."""
    path = Path(path)
    config = read_draft_config(path)
    files = _tensor_files(path)
    where = str(path / "model.safetensors")
    draft = Eagle3Draft(_draft_spec(config, files, where))
    draft.load_state_dict(_draft_tensors(files, draft, where))
    _, scaling = rope_settings(config["transformer_layer_config"])
    if scaling:  # our draft's buffer is plain RoPE; the layer config asks for scaled frequencies
        try:
            draft.inv_freq.copy_(llama_inv_freq(draft.spec.head_dim, draft.spec.rope_theta, scaling))
        except ValueError as e:
            raise DraftLoadError(f"{path / 'config.json'}: transformer_layer_config: {e}") from None
    if target is not None:
        _check_target(draft, files, target, where)
    aux = vllm_aux_layer_ids(config, target.config.num_hidden_layers if target else None,
                             str(path / "config.json"))
    return draft.eval(), aux


def advertised_tokens(path: str | Path) -> int | None:
    """speculative_tokens of the draft config's first proposal method (what an engine drafts)."""
    methods = (read_draft_config(Path(path)).get("speculators_config") or {}).get("proposal_methods") or [{}]
    value = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    return value if isinstance(value, int) and value > 0 else None
