"""Export a trained draft for vLLM (speculators layout, `layers.0.*`) and SGLang (native, `midlayer.*`): the same
weights and `d2t`/`t2d`, another config, each written as the engine versions in ENGINES read it (docs/export.md).
`eagle3.draft_io` reads the vLLM layout back."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from eagle3 import train_state
from eagle3.config import ENGINES, ONE_LAYER, SETTING_KEYS, UNREAD, UNSERVED, Config, ExportConfig, from_dict
from eagle3.draft_io import layer_keys, top_keys
from eagle3.models.weights import MLA_FAMILIES
from eagle3.resolve import MLA_DIMS, NORM_FLAGS
from eagle3.files import make_readable, short_of_space, tensor_bytes
from eagle3.ops import TORCH_DTYPES
from eagle3.vocab import check_vocab
from eagle3.errors import Eagle3Error


class ExportError(Eagle3Error):
    """A checkpoint that cannot be exported, or an export that could not be written."""


def _llama_layer_config(spec: dict, dtype: str) -> dict:
    same = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rms_norm_eps", "rope_theta", "max_position_embeddings")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **{k: spec[k] for k in same},
            "vocab_size": spec["target_vocab_size"], "num_hidden_layers": spec["num_layers"],
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": dtype, **_rope_fields(spec)}


def _rope_fields(spec: dict) -> dict:
    """The rotary training used, in the legacy keys (rope_scaling + rope_theta: SGLang, vLLM with transformers 4)
    and in transformers 5's rope_parameters (newer vLLM), the same values (docs/export.md)."""
    scaling = spec.get("rope_scaling")
    return {"rope_scaling": scaling,
            "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": spec["rope_theta"]}}


def _window_fields(spec: dict) -> dict:
    """A sliding window as vLLM's llama.py reads a draft's: every layer "sliding_attention", `sliding_window`."""
    if not spec.get("sliding_window"):
        return {}
    return {"layer_types": ["sliding_attention"] * spec["num_layers"], "sliding_window": spec["sliding_window"]}


def media_field(state: dict, cfg: Config) -> dict:
    """The draft's input at image / video placeholders as trained, else as `cfg` says (engines ignore the key; it
    tells a reader of the export which engine's rule the draft expects: docs/export.md)."""
    trained = state.get("config", {}).get("draft", {})
    return {"eagle3_media_embedding": trained.get("media_embedding", cfg.draft.media_embedding)}


def vllm_config(state: dict, cfg: Config) -> dict:
    resolved = state["resolved"]
    spec = resolved["draft_spec"]
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.export.speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.export.verifier_name or resolved["verifier_name"],
                         "architectures": state["target_architectures"]}},
        "transformer_layer_config": {**_llama_layer_config(spec, cfg.debug.export_dtype), **_window_fields(spec)},
        "draft_vocab_size": spec["draft_vocab_size"], "target_hidden_size": spec["target_hidden_size"],
        **{key: spec.get(key, False) for key in NORM_FLAGS},
        "eagle_aux_hidden_state_layer_ids": vllm_aux_ids(resolved["aux_layer_ids"]),
        **media_field(state, cfg), "torch_dtype": cfg.debug.export_dtype}


def vllm_aux_ids(ours: list[int]) -> list[int]:
    """vLLM 0.34 captures `hidden_states + residual` entering layer v for each id v (EagleModelMixin.
    _maybe_add_hidden_state, vllm/model_executor/models/interfaces.py; deepseek_v2.py DeepseekV2Model.forward; v = L:
    the last layer's output): the output of layer v - 1, so ours + 1, for every target family."""
    return [i + 1 for i in ours]


def sglang_aux_ids(state: dict, where: str) -> list[int]:
    """The eagle_config ids SGLang 0.5.23 turns into our layers. Its target captures the input of layer c (the output
    of c - 1) for each c in `layers_to_capture`, c < L; `set_eagle3_layers_to_capture` makes c = id + 1 on the GQA
    families' targets (srt/models/llama.py, qwen2.py, qwen3.py, qwen3_moe.py, minimax_m2.py, glm4_moe.py; gpt_oss.py
    unless the largest id is L, which our ids never are) but on the MLA families' (DeepSeek-V3 / Kimi and DeepSeek-V3.2
    in deepseek_v2.py, GLM-5 in glm4_moe.py's GlmMoeDsaForCausalLM(DeepseekV2ForCausalLM), GLM-4.7-Flash in
    glm4_moe_lite.py) only when the first id is 1, else c = id. Ids it cannot express raise ExportError."""
    ours, target = list(state["resolved"]["aux_layer_ids"]), state["target"]
    layers = target["num_hidden_layers"]
    if max(ours) >= layers - 1:
        raise ExportError(f"{where}: {ENGINES['sglang']} captures a layer's input, never the last layer's "
                          f"output: target.aux_layer_ids = {ours} on a target of {layers} layers; choose ids below "
                          f"{layers - 1} or export vllm only")
    if not is_mla_family(target):
        return ours
    if ours[0] == 0:
        raise ExportError(f"{where}: {ENGINES['sglang']} adds 1 to an MLA-family target's ids only when "
                          f"the first is 1 (deepseek_v2.py set_eagle3_layers_to_capture), so no id list makes it "
                          f"capture layer 0's output: target.aux_layer_ids = {ours}; choose a first id other than 0 "
                          "or export vllm only")
    return ours if ours[0] == 1 else [i + 1 for i in ours]


def is_mla_family(target: dict) -> bool:
    """The target is of an MLA family (DeepSeek-V3 / Kimi, GLM-4.7-Flash, DeepSeek-V3.2, GLM-5), from the identity a
    checkpoint records."""
    types = {t for f in MLA_FAMILIES for t in f.model_types}
    return bool({target.get("model_type"), target.get("text_model_type")} & types)


def sglang_config(state: dict, cfg: Config) -> dict:
    spec = state["resolved"]["draft_spec"]
    config = _llama_layer_config(spec, cfg.debug.export_dtype)
    config.update({
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": spec["draft_vocab_size"],
        "target_hidden_size": spec["target_hidden_size"],
        # llama_eagle3.py LlamaModel reads these three (norm_before_residual it has not: refused before)
        **{key: spec.get(key, False) for key in ("norm_before_fc", "fc_norm", "norm_output")},
        "eagle_config": _sglang_eagle_config(state), **media_field(state, cfg), "torch_dtype": cfg.debug.export_dtype})
    return config


def _sglang_eagle_config(state: dict) -> dict:
    """SGLang 0.5.23 reads the aux ids from eagle_config alone (srt/model_executor/model_runner_components/
    spec_aux_hidden_state.py, _resolve_eagle_aux_hidden_state)."""
    return {"eagle_aux_hidden_state_layer_ids": sglang_aux_ids(state, "the SGLang export"),
            "use_aux_hidden_state": True}


def mla_config(state: dict, cfg: Config) -> dict:
    """An MLA draft's config for vLLM's and SGLang's Eagle3DeepseekV2ForCausalLM: a flat DeepSeek-V3 config of the
    draft layer (vllm/model_executor/models/deepseek_eagle3.py; sglang/srt/models/kimi_k25_eagle3.py)."""
    resolved = state["resolved"]
    spec = resolved["draft_spec"]
    same = ("hidden_size", "num_attention_heads", "intermediate_size", "rms_norm_eps", "rope_theta",
            "max_position_embeddings", "draft_vocab_size", "target_hidden_size", *MLA_DIMS)
    # rope_theta inside the legacy dict too (older vLLM handed get_rope a copy of rope_scaling alone); vLLM 0.34's
    # DeepseekV2MLAAttention and SGLang 0.5.23's kimi_k25_eagle3.py read rope_parameters (theta inside) first
    scaling = spec["rope_scaling"] and {**spec["rope_scaling"], "type": spec["rope_scaling"]["rope_type"],
                                        "rope_theta": spec["rope_theta"]}
    parameters = scaling or {"rope_type": "default", "rope_theta": spec["rope_theta"]}
    try:   # vLLM reads the top-level ids; SGLang eagle_config's, in its own rule (a vLLM-only export may lack them)
        sglang = {"eagle_config": _sglang_eagle_config(state)}
    except ExportError:
        sglang = {}
    return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3",
            **{k: spec[k] for k in same}, "num_key_value_heads": spec["num_attention_heads"],
            "num_hidden_layers": spec["num_layers"], "vocab_size": spec["target_vocab_size"], "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False, "rope_scaling": scaling,
            "rope_parameters": parameters, "norm_before_residual": spec["norm_before_residual"],
            "fc_norm": spec["fc_norm"], "norm_output": spec["norm_output"],
            "eagle_aux_hidden_state_layer_ids": vllm_aux_ids(resolved["aux_layer_ids"]), **sglang,
            **media_field(state, cfg), "torch_dtype": cfg.debug.export_dtype}


def vllm_name(i: int, key: str) -> str:
    return f"layers.{i}.{key}"


def sglang_name(i: int, key: str) -> str:
    """SGLang 0.5.23's names (srt/models/llama_eagle3.py, kimi_k25_eagle3.py): layer 0 as `midlayer.*`, which older
    versions know alone; a later Llama layer normalises its input with its `hidden_norm` (our `input_layernorm`)."""
    if i == 0:
        return f"midlayer.{key}"
    return f"layers.{i}.{'hidden_norm.weight' if key == 'input_layernorm.weight' else key}"


def export_weights(weights: dict[str, torch.Tensor], spec: dict, name, num_layers: int,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Map trained names onto the serving names (`name(layer, key)`); float weights cast to `dtype`, vocab maps
    kept."""
    top = top_keys(spec)
    if missing := [k for k in top if k not in weights]:   # an engine would keep its initial tensor
        raise ExportError(f"checkpoint weights lack {missing[0]} (the draft's settings ask for {missing})")
    out = {k: weights[k] for k in top}
    for i in range(num_layers):
        for key in layer_keys(spec, i == 0):
            src = f"layers.{i}.{key}"
            if src not in weights:   # an engine would silently keep a random tensor for it
                raise ExportError(f"checkpoint weights lack {src}")
            out[name(i, key)] = weights[src]
    layers = {f"layers.{i}.{k}" for i in range(num_layers) for k in layer_keys(spec)}
    if left := set(weights) - {"d2t", "t2d", *top} - layers:
        raise ExportError(f"checkpoint weights not exported: {sorted(left)[:5]}")
    return {**{k: v.to(dtype).contiguous() for k, v in out.items()},
            "d2t": weights["d2t"].to(torch.int64), "t2d": weights["t2d"].to(torch.bool)}


def _write(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `<out_dir>.tmp`, then rename it to `out_dir`: a failure removes it and keeps an export already there."""
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
        raise ExportError(f"{out_dir}: writing the export failed ({getattr(e, 'strerror', None) or e}); the partial "
                          "folder was removed") from None
    return out_dir


EXPORT_FILES = {"config.json", "model.safetensors"}   # what `_write` puts in `<out_dir>/<format>`


def check_out_dir(checkpoint_dir: Path, out_dir: Path, formats) -> None:
    """Refuse an out_dir that checkpoint rotation would delete, or a `<format>` folder holding what no export wrote
    (the export replaces the folder whole)."""
    rotated = checkpoint_dir.resolve().parent
    if rotated.name == "checkpoints" and out_dir.resolve().is_relative_to(rotated):
        raise ExportError(f"{out_dir}: inside {rotated}, whose checkpoints are deleted by checkpoint rotation "
                          "(train.keep_checkpoints), the export with them; choose an out_dir outside it")
    for folder in (out_dir / fmt for fmt in formats):
        others = sorted({p.name for p in folder.iterdir()} - EXPORT_FILES) if folder.is_dir() else [folder.name]
        if folder.exists() and others:
            raise ExportError(f"{folder}: holds {', '.join(others[:5])}, which no export writes, and an export "
                              "replaces the folder whole; move them away or choose another out_dir (nothing was "
                              "written)")


def export_all(checkpoint_dir: str | Path, out_dir: str | Path, cfg: Config | None = None,
               formats: list[str] | None = None) -> dict[str, Path]:
    """Write `out_dir/vllm` and/or `out_dir/sglang` (`formats`, default export.formats) from a training checkpoint."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    state = train_state.read_state(checkpoint_dir)
    cfg = cfg or from_dict(state["config"], str(checkpoint_dir / train_state.STATE))
    if formats is None:
        formats, skipped = served_formats(state["target"], cfg)
        for line in skipped:
            print(line)
    weights = train_state.load_weights(checkpoint_dir)
    check_vocab(weights["d2t"], weights["t2d"], str(checkpoint_dir / train_state.MODEL))
    spec, dtype, written = state["resolved"]["draft_spec"], TORCH_DTYPES[cfg.debug.export_dtype], {}
    check_out_dir(checkpoint_dir, out_dir, formats)
    mla = spec.get("attention") == "mla"
    check_exportable(state, formats, str(checkpoint_dir))   # every format checked before any is written
    for fmt in formats:   # "vllm" or "sglang", as the config's type says
        if fmt == "vllm":
            tensors = export_weights(weights, spec, vllm_name, spec["num_layers"], dtype)
            written[fmt] = _write(out_dir / "vllm", (mla_config if mla else vllm_config)(state, cfg), tensors)
        else:
            tensors = export_weights(weights, spec, sglang_name, spec["num_layers"], dtype)
            written[fmt] = _write(out_dir / "sglang", (mla_config if mla else sglang_config)(state, cfg), tensors)
    return written


def check_exportable(state: dict, formats, where: str) -> None:
    """Refuse (nothing written) a format whose engine would serve another draft than the one trained: a setting it
    does not read, or aux ids it cannot express. `state` needs only "resolved" and "target" (a run checks at start)."""
    for fmt in formats:
        if why := unserved(state["target"], fmt):
            others = [f for f in ENGINES if f != fmt]
            raise ExportError(f"{where}: {why}; export {' or '.join(others)} only "
                              f"(export.formats = {json.dumps(others)})")
        check_servable(state["resolved"]["draft_spec"], fmt, where)
        if fmt == "sglang":
            sglang_aux_ids(state, where)


def unserved(target: dict, fmt: str) -> str | None:
    """Why the engine version of `fmt` serves no EAGLE-3 draft for the target's family (config.UNSERVED), or None."""
    names = [name for name in (target.get("model_type"), target.get("text_model_type")) if name in UNSERVED[fmt]]
    return names and f"{ENGINES[fmt]} serves no EAGLE-3 draft for a {names[0]} target: {UNSERVED[fmt][names[0]]}"


def served_formats(target: dict, cfg: Config) -> tuple[list[str], list[str]]:
    """export.formats to write, and a line for each skipped: from the default (every engine), a format whose engine
    serves no draft for the target is skipped; a list naming it otherwise is refused (`check_exportable`)."""
    formats = list(cfg.export.formats)
    if sorted(formats) != sorted(ExportConfig().formats):
        return formats, []
    skipped = {fmt: why for fmt in formats if (why := unserved(target, fmt))}
    return [fmt for fmt in formats if fmt not in skipped], [f"not exporting {fmt}: {why}" for fmt, why in
                                                            skipped.items()]


def serving_commands(state: dict, cfg: Config, written: dict[str, Path]) -> list[str]:
    """How to serve each written export (the engines' own flags, docs/export.md), for the log."""
    target, spec, k = state["resolved"]["verifier_name"], state["resolved"]["draft_spec"], cfg.export.speculative_tokens
    lines = []
    if "vllm" in written:
        options = json.dumps({"method": "eagle3", "model": str(written["vllm"]), "num_speculative_tokens": k})
        lines.append(f"serve with {ENGINES['vllm']}: vllm serve {target} --speculative-config '{options}'")
    if "sglang" in written:
        # --speculative-draft-window-size counts the keys before the query (srt/layers/attention: window_left)
        window = f" --speculative-draft-window-size {spec['sliding_window'] - 1}" if spec.get("sliding_window") else ""
        lines.append(f"serve with {ENGINES['sglang']}: python3 -m sglang.launch_server --model-path {target} "
                     f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {written['sglang']} "
                     f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
                     f"{window}")
    return lines


def check_servable(spec: dict, fmt: str, where: str) -> None:
    """Refuse an export the engine would serve differently from what was trained (nothing is written)."""
    kind = spec.get("attention", "gqa")
    engine = {("vllm", "gqa"): "vLLM", ("sglang", "gqa"): "SGLang's LlamaForCausalLMEagle3"}.get(
        (fmt, kind), f"{'vLLM' if fmt == 'vllm' else 'SGLang'}'s Eagle3DeepseekV2ForCausalLM")
    engine += f" {ENGINES[fmt].split()[1]}"
    if (fmt, kind) in ONE_LAYER and spec["num_layers"] != 1:
        raise ExportError(f"{where}: {engine} has one draft layer (midlayer); this draft has {spec['num_layers']}; "
                          "export vllm only")
    if on := [key for key in UNREAD[fmt, kind] if spec.get(key)]:
        raise ExportError(f"{where}: the draft's {on[0]} is on ({SETTING_KEYS[on[0]]}), which {engine} does not "
                          f"read (it would decode with another draft); "
                          f"{'export vllm only' if fmt == 'sglang' else 'retrain'}")
