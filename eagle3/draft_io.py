"""Loading drafts: one of our checkpoints, or any speculators/vLLM-layout EAGLE-3 directory (what `export`
writes and the engines load), refusing what our draft cannot compute; that layout's names and shapes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3 import train_state
from eagle3.draft import DraftSpec, Eagle3Draft
from eagle3.errors import Eagle3Error
from eagle3.files import read_json
from eagle3.models.deepseek import yarn_settings
from eagle3.models.weights import Checkpoint, rope_settings
from eagle3.ops import draft_rope, yarn_mscale
from eagle3.resolve import MLA_DIMS, NORM_FLAGS
from eagle3.vocab import VocabError, check_vocab

LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")
# the MLA layer's attention (DeepSeek-V3's names); the MLP and norms as the Llama layer's
MLA_ATTENTION_KEYS = tuple(f"self_attn.{n}.weight" for n in (
    "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))


def layer_keys(spec: dict, first: bool = True) -> list[str]:
    """A layer's tensor names (without `layers.i.`); only the first has hidden_norm."""
    keys = (MLA_ATTENTION_KEYS + LAYER_KEYS[4:]) if spec.get("attention") == "mla" else LAYER_KEYS
    return [k for k in keys if first or k != "hidden_norm.weight"]


def top_keys(spec: dict) -> list[str]:
    """The tensors outside the layers: the EAGLE-3.1 norms before fc only when the draft has them."""
    return (["fc.weight", "norm.weight", "lm_head.weight"] + ["input_norm.weight"] * bool(spec.get("norm_before_fc"))
            + [f"fc_norm.{i}.weight" for i in range(3 if spec.get("fc_norm") else 0)])


class DraftLoadError(Eagle3Error):
    """A draft directory that cannot be used; the message names the file and the field or tensor."""


# names of the draft's own computation: an unknown one (a bias) is an error, anything else gets a note
DRAFT_PARTS = ("fc", "layers.", "norm.", "lm_head.", "input_norm.", "hidden_norm.", "midlayer.", "fc_norm.")


# vLLM's and SGLang's MLA draft (a flat DeepSeek-V3 config; vllm/model_executor/models/deepseek_eagle3.py)
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


def is_mla(config: dict) -> bool:
    return isinstance(config, dict) and bool(set(config.get("architectures") or []) & set(MLA_ARCHITECTURES))


def _check_mla_config(config: dict, file: Path) -> dict:
    """An Eagle3DeepseekV2ForCausalLM config: DeepSeek MLA dims present, nothing our draft does not compute."""
    if missing := [k for k in ("num_attention_heads", *MLA_DIMS) if not isinstance(config.get(k), int)]:
        raise DraftLoadError(f"{file}: {missing[0]} = {config.get(missing[0])!r}; an MLA draft needs "
                             f"{', '.join(MLA_DIMS)} as integers (q_lora_rank: SGLang requires it, so do we)")
    _, scaling = rope_settings(config)
    problems = {"model_type": config.get("model_type") not in ("deepseek_v3", "deepseek_v2"),
                "hidden_act": config.get("hidden_act", "silu") != "silu",
                "attention_bias": bool(config.get("attention_bias")), "norm_before_fc": bool(config.get("norm_before_fc")),
                "rope_scaling": scaling is not None and scaling["rope_type"] != "yarn"}
    for key, bad in problems.items():
        if bad:
            raise DraftLoadError(f"{file}: {key} = {config.get(key)!r}; an MLA draft is a DeepSeek-V3 layer (silu, no "
                                 "biases, no norm before fc, YaRN or no rope scaling) as vLLM's deepseek_eagle3 runs it")
    return config


def read_draft_config(path: Path) -> dict:
    """config.json of a speculators/vLLM EAGLE-3 draft (Llama layer) or of an Eagle3DeepseekV2ForCausalLM one (MLA
    layer), refusing what our draft cannot compute."""
    file = path / "config.json"
    config = read_json(file, DraftLoadError, "a draft directory needs config.json")
    if is_mla(config):
        return _check_mla_config(config, file)
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
                "layer_types": len(set(layer.get("layer_types") or [])) > 1}
    for key, bad in problems.items():
        if bad:
            raise DraftLoadError(f"{file}: transformer_layer_config.{key} = {layer[key]!r}; our draft is a "
                                 "Llama layer (silu, no biases, one attention kind for all layers)")
    return config


def _sliding_window(layer: dict, where: str) -> int:
    """The window of a layer config whose layer_types are "sliding_attention" (what vLLM reads), else 0."""
    if "sliding_attention" not in (layer.get("layer_types") or []):
        return 0
    window = layer.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise DraftLoadError(f"{where}: transformer_layer_config.sliding_window = {window!r} with sliding_attention "
                             "layers; expected a positive integer")
    return window


class Files(dict):
    """Tensor name (ours) -> (safetensors file, the name stored there)."""

    def shape(self, name: str) -> list[int] | None:
        if name not in self:
            return None
        file, stored = self[name]
        with safe_open(file, "pt") as f:
            return list(f.get_slice(stored).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        file, stored = self[name]
        with safe_open(file, "pt") as f:
            return f.get_tensor(stored)


def _tensor_files(path: Path, mla: bool = False) -> Files:
    """Tensor name -> file, from model.safetensors or a sharded index; an MLA draft's `midlayer.*` is `layers.0.*`,
    as vLLM's deepseek_eagle3 loader maps it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            stored = {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise DraftLoadError(f"{index}: expected a JSON object with 'weight_map' ({e})") from None
    else:
        single = path / "model.safetensors"
        if not single.exists():
            raise DraftLoadError(f"{single}: not found (nor model.safetensors.index.json)")
        with safe_open(single, "pt") as f:
            stored = {name: single for name in f.keys()}
    def ours(name: str) -> str:
        return "layers.0." + name.removeprefix("midlayer.") if mla and name.startswith("midlayer.") else name
    return Files({ours(name): (file, name) for name, file in stored.items()})


def _fc_shape(files: Files, where: str) -> list[int]:
    fc = files.shape("fc.weight")
    if fc is None or len(fc) != 2 or fc[1] % 3:
        raise DraftLoadError(f"{where}: fc.weight is {'missing' if fc is None else f'of shape {fc}'}; "
                             "expected [hidden, 3 * target_hidden]")
    return fc


def _mla_draft_spec(c: dict, files: Files, where: str) -> DraftSpec:
    """An Eagle3DeepseekV2ForCausalLM config's draft: sizes from the config, else from the tensors' shapes."""
    fc = _fc_shape(files, where)
    gate, head, t2d = (files.shape(n) or [0] for n in ("layers.0.mlp.gate_proj.weight", "lm_head.weight", "t2d"))
    theta, scaling = rope_settings(c)
    layers = {int(n.split(".")[1]) for n in files if n.startswith("layers.") and n.split(".")[1].isdigit()}
    return DraftSpec(
        hidden_size=c.get("hidden_size") or fc[0], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_attention_heads"], head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        intermediate_size=c.get("intermediate_size") or gate[0], num_layers=c.get("num_hidden_layers") or len(layers),
        rms_norm_eps=float(c.get("rms_norm_eps") or 1e-6), rope_theta=theta,
        max_position_embeddings=c.get("max_position_embeddings") or 2048,
        draft_vocab_size=c.get("draft_vocab_size") or head[0], target_vocab_size=c.get("vocab_size") or t2d[0],
        target_hidden_size=c.get("target_hidden_size") or fc[1] // 3,
        norm_before_residual=bool(c.get("norm_before_residual")), fc_norm=bool(c.get("fc_norm")),
        norm_output=bool(c.get("norm_output")), attention="mla", **{k: c[k] for k in MLA_DIMS},
        rope_scaling=yarn_settings(scaling))


def _draft_spec(config: dict, files: Files, where: str) -> DraftSpec:
    """Sizes from transformer_layer_config; where it leaves one out (transformers writes only the
    values that differ from its defaults) from the tensors' shapes, else Llama's defaults."""
    layer = config["transformer_layer_config"]
    fc = _fc_shape(files, where)
    q, k, gate, head = (files.shape(name) or [0] for name in ("layers.0.self_attn.q_proj.weight",
                        "layers.0.self_attn.k_proj.weight", "layers.0.mlp.gate_proj.weight", "lm_head.weight"))
    t2d = files.shape("t2d")
    heads = layer.get("num_attention_heads") or 32
    head_dim = layer.get("head_dim") or q[0] // heads
    layers = {int(n.split(".")[1]) for n in files if n.startswith("layers.") and n.split(".")[1].isdigit()}
    config_file = str(Path(where).with_name("config.json"))
    theta, scaling = rope_settings(layer)
    _check_rope(head_dim, theta, scaling, config_file)
    return DraftSpec(
        hidden_size=layer.get("hidden_size") or fc[0], num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or max(1, k[0] // max(1, head_dim)),
        head_dim=head_dim, intermediate_size=layer.get("intermediate_size") or gate[0],
        num_layers=layer.get("num_hidden_layers") or max(1, len(layers)),
        rms_norm_eps=float(layer.get("rms_norm_eps") or 1e-6), rope_theta=theta,
        max_position_embeddings=layer.get("max_position_embeddings") or 2048,
        draft_vocab_size=config.get("draft_vocab_size") or head[0],
        target_vocab_size=layer.get("vocab_size") or (t2d[0] if t2d else 32000),
        target_hidden_size=config.get("target_hidden_size") or fc[1] // 3, rope_scaling=scaling,
        sliding_window=_sliding_window(layer, config_file),
        # absent norm_before_residual: what vLLM's speculators config reader then serves, true
        **{key: bool(config.get(key, key == "norm_before_residual")) for key in NORM_FLAGS})


def _check_rope(head_dim: int, theta: float, scaling: dict | None, where: str) -> None:
    """Refuse a rope scaling our draft does not compute; note a YaRN magnitude that engine versions disagree on."""
    try:
        _, factor = draft_rope(head_dim, theta, scaling)
    except (ValueError, KeyError) as e:
        raise DraftLoadError(f"{where}: transformer_layer_config rope scaling: {e!s}") from None
    if scaling and scaling["rope_type"] == "yarn" and factor != (default := yarn_mscale(float(scaling["factor"]))):
        print(f"note: {where}: its YaRN cos/sin factor is {factor:.4f} by vLLM's current rule (mscale, "
              f"mscale_all_dim or attention_factor), but {default:.4f} in SGLang and older vLLM; decoding uses "
              f"{factor:.4f}", file=sys.stderr)


def _draft_tensors(files: Files, draft: Eagle3Draft, where: str) -> dict[str, torch.Tensor]:
    """Every tensor the draft needs, shape-checked; d2t/t2d the identity when the draft keeps the target's
    whole vocabulary (speculators then writes neither)."""
    expected = {name: list(t.shape) for name, t in draft.state_dict().items()}
    spec = draft.spec
    out = {}
    for name, shape in expected.items():
        if name in ("d2t", "t2d") and name not in files and spec.draft_vocab_size == spec.target_vocab_size:
            out[name] = (torch.zeros(shape, dtype=torch.int64) if name == "d2t"
                         else torch.ones(shape, dtype=torch.bool))
            continue
        found = files.shape(name)
        if found is None:
            raise DraftLoadError(f"{where}: tensor {name} is missing (the draft needs it)")
        if found != shape:
            raise DraftLoadError(f"{where}: tensor {name} has shape {found}; config.json implies {shape}")
        out[name] = files.tensor(name)
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
    """Our aux layer ids (vLLM's minus 1), as vLLM 0.34 finds them (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py,
    get_eagle3_aux_layers_from_config): the top-level ids, else eagle_config's "layer_ids" (never its
    eagle_aux_hidden_state_layer_ids, SGLang's key), else the target's default [2, L//2, L-3]; inputs of layers."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get("layer_ids")
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


def _check_target(draft: Eagle3Draft, files: Files, target: Checkpoint, where: str) -> None:
    """Sizes must agree with the target's; a stored embedding copy that differs gets a note (still measurable)."""
    s, c = draft.spec, target.config
    for name, mine, theirs in (("hidden_size", s.hidden_size, c.hidden_size),
                               ("target_hidden_size", s.target_hidden_size, c.hidden_size),
                               ("vocab_size", s.target_vocab_size, c.vocab_size)):
        if mine != theirs:
            raise DraftLoadError(f"{where}: the draft's {name} is {mine} but the target {target.dir} has "
                                 f"{theirs}: trained for another target")
    if "embed_tokens.weight" in files:
        copy = files.tensor("embed_tokens.weight")
        if not torch.equal(copy, target.get("embed_tokens.weight").to(copy.dtype)):
            print(f"note: {where}: its embed_tokens.weight differs from the target's {target.dir}: was the "
                  "draft trained against another target?", file=sys.stderr)


def load_vllm_draft(path: str | Path, target: Checkpoint | None = None) -> tuple[Eagle3Draft, list[int]]:
    """(Eagle3Draft in fp32 on the CPU, our aux layer ids) from a speculators/vLLM EAGLE-3 directory; with
    the target, sizes are checked against it and absent aux ids take vLLM's default for its layer count."""
    path = Path(path)
    config = read_draft_config(path)
    files = _tensor_files(path, is_mla(config))
    where = str(path / "model.safetensors")
    draft = Eagle3Draft((_mla_draft_spec if is_mla(config) else _draft_spec)(config, files, where))
    draft.load_state_dict(_draft_tensors(files, draft, where))
    if target is not None:
        _check_target(draft, files, target, where)
    aux = vllm_aux_layer_ids(config, target.config.num_hidden_layers if target else None, str(path / "config.json"))
    return draft.eval(), aux


def advertised_tokens(path: str | Path) -> int | None:
    """speculative_tokens of the draft config's first proposal method (what an engine drafts)."""
    methods = (read_draft_config(Path(path)).get("speculators_config") or {}).get("proposal_methods") or [{}]
    value = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    return value if isinstance(value, int) and value > 0 else None


def check_checkpoint_target(state: dict, target: Checkpoint, checkpoint_dir: Path) -> None:
    if state["target"] != target.config.identity():
        raise train_state.CheckpointError(f"{checkpoint_dir}/state.json: trained against another target than "
                                      f"{target.path} (target.path)")


def media_rule(path: str | Path) -> str:
    """The rule the draft at `path` was trained with at media placeholders ("vllm" or "sglang"; docs/export.md): our
    checkpoint's `draft.media_embedding`, an export's `eagle3_media_embedding`, else vLLM's (another trainer's)."""
    path = Path(path)
    if (path / train_state.STATE).exists():
        return train_state.read_state(path)["config"]["draft"].get("media_embedding", "vllm")
    config = read_json(path / "config.json", DraftLoadError, "not a draft directory")
    return config.get("eagle3_media_embedding", "vllm")


def load_any_draft(path: str | Path, target: Checkpoint) -> tuple[Eagle3Draft, list[int], int | None]:
    """(draft on the CPU, our aux layer ids, its trained ttt_steps or None) from our checkpoint or a vLLM-layout one."""
    path = Path(path)
    if (path / train_state.STATE).exists():
        draft, state = train_state.load_draft(path)
        check_checkpoint_target(state, target, path)
        return draft, state["resolved"]["aux_layer_ids"], state["config"]["train"]["ttt_steps"]
    if (path / "config.json").exists():
        return (*load_vllm_draft(path, target), None)
    raise train_state.CheckpointError(f"{path}: neither one of our checkpoints ({train_state.STATE}) nor a "
                                  "speculators/vLLM EAGLE-3 draft (config.json)")
