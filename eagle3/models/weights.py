"""A target checkpoint: its text config (nested `text_config` resolved) and lazy, by-name access to its
safetensors (through the index or a single file)."""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.errors import TargetError
from eagle3.files import open_safetensors
from eagle3.models import quant


def require(cfg: dict, key: str, where: str, needs: str, kind: type = int):
    """cfg[key], an integer (`kind` float: a number); else an error naming the field and who `needs` it."""
    expected = "an integer" if kind is int else "a number"
    if key not in cfg:
        raise TargetError(f"{where}: missing field '{key}': {needs} needs it ({expected})")
    value = cfg[key]
    if not isinstance(value, int if kind is int else (int, float)) or isinstance(value, bool):
        raise TargetError(f"{where}: field '{key}' = {value!r}; {needs} needs {expected}")
    return value


@dataclass(frozen=True)
class Family:
    """A kind of text model: the names that mean it, and the fields its forward needs besides the common ones."""
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    fields: dict


COMMON_FIELDS = {"hidden_size": int, "vocab_size": int, "num_hidden_layers": int, "num_attention_heads": int,
                 "intermediate_size": int, "rms_norm_eps": float}
# kimi_k25 / KimiK25ForConditionalGeneration: Kimi-K2.5's wrapper, for a text_config that names neither
DEEPSEEK = Family("DeepSeek-V3", ("deepseek_v3", "kimi_k2", "kimi_k25"),
                  ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"),
                  {"kv_lora_rank": int, "qk_nope_head_dim": int, "qk_rope_head_dim": int, "v_head_dim": int,
                   "n_routed_experts": int, "num_experts_per_tok": int, "moe_intermediate_size": int})
LLAMA = Family("Llama", ("llama", "mistral", "qwen2", "qwen3"),
               ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"), {})
# the GQA MoE families (eagle3.models.families): the fields their rooms read besides the common ones
QWEN3_MOE = Family("Qwen3-MoE", ("qwen3_moe",), ("Qwen3MoeForCausalLM",),
                   {"num_experts": int, "num_experts_per_tok": int, "moe_intermediate_size": int})
MINIMAX_M2 = Family("MiniMax-M2", ("minimax_m2",), ("MiniMaxM2ForCausalLM",),
                    {"num_local_experts": int, "num_experts_per_tok": int})
GLM4_MOE = Family("GLM-4.5", ("glm4_moe",), ("Glm4MoeForCausalLM",),
                  {"n_routed_experts": int, "num_experts_per_tok": int, "moe_intermediate_size": int})
GPT_OSS = Family("gpt-oss", ("gpt_oss",), ("GptOssForCausalLM",), {"num_local_experts": int, "num_experts_per_tok": int})
# DeepSeek-V3's forward with other choices (eagle3/models/deepseek.py): GLM's MoE on DeepSeek's MLA; the DSA indexer
_INDEXER = {"index_topk": int, "index_n_heads": int, "index_head_dim": int, "q_lora_rank": int}
GLM4_MOE_LITE = Family("GLM-4.7-Flash", ("glm4_moe_lite",), ("Glm4MoeLiteForCausalLM",), DEEPSEEK.fields)
DEEPSEEK_V32 = Family("DeepSeek-V3.2", ("deepseek_v32",), ("DeepseekV32ForCausalLM",),
                      {**DEEPSEEK.fields, **_INDEXER})
GLM_MOE_DSA = Family("GLM-5", ("glm_moe_dsa",), ("GlmMoeDsaForCausalLM",), {**DEEPSEEK.fields, **_INDEXER})
FAMILIES = (DEEPSEEK, GLM4_MOE_LITE, DEEPSEEK_V32, GLM_MOE_DSA, LLAMA, QWEN3_MOE, MINIMAX_M2, GLM4_MOE,
            GPT_OSS)
MLA_FAMILIES = (DEEPSEEK, GLM4_MOE_LITE, DEEPSEEK_V32, GLM_MOE_DSA)
# families the engines serve that this forward does not build: model_type (outer or text) -> what is missing
_DELTANET = "its Gated DeltaNet linear-attention layers (3 of every 4) are not built"
NOT_BUILT = {"qwen3_5_moe": f"Qwen3.5-MoE: {_DELTANET}", "qwen3_5_moe_text": f"Qwen3.5-MoE: {_DELTANET}",
             "qwen3_5": f"Qwen3.5: {_DELTANET}", "qwen3_5_text": f"Qwen3.5: {_DELTANET}",
             "qwen3_next": f"Qwen3-Next: {_DELTANET}",
             "deepseek_v4": "DeepSeek-V4: its compressed-KV attention (shared KV, sinks, windows) and 4-stream "
                            "hyper-connections are not built",
             "kimi_linear": "Kimi-Linear: its Kimi Delta Attention linear-attention layers are not built"}


@dataclass
class TextConfig:
    """The text model's fields, whichever wrapper they came in; `raw` is the text-level dict."""
    raw: dict
    source: str                 # file and path inside it, e.g. "config.json:text_config"
    model_type: str             # outer model_type
    text_model_type: str
    architectures: list[str]
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    quantization: dict | None   # `quant_format` described, for inspect
    quant_format: quant.Format
    max_position_embeddings: int
    config_sha256: str
    family: Family
    needs: str                  # what named the family, for errors: "model_type 'kimi_k2' (DeepSeek-V3 family)"

    @property
    def is_deepseek(self) -> bool:
        """DeepSeek-V3's MLA forward (with the family's choices)."""
        return self.family in MLA_FAMILIES

    @property
    def head_dim(self) -> int:
        return self.raw.get("head_dim") or self.hidden_size // self.num_attention_heads

    def default_aux_layer_ids(self) -> list[int]:
        n = self.num_hidden_layers
        return [1, n // 2 - 1, n - 4]

    def identity(self) -> dict:
        """What shards record about the target they came from."""
        return {"config_sha256": self.config_sha256, "model_type": self.model_type,
                "text_model_type": self.text_model_type, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "num_hidden_layers": self.num_hidden_layers}


def rope_settings(text: dict) -> tuple[float, dict | None]:
    """rope_theta and the scaling dict, from `rope_scaling` or `rope_parameters`, `type` or `rope_type`."""
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or (params if params.get("rope_type", params.get("type")) else None)
    theta = text.get("rope_theta") or params.get("rope_theta") or 10000.0   # absent or null: the default
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    return float(theta), scaling


def _non_finite(value, where: str = "") -> tuple[str, float] | None:
    """(the path of the first NaN or infinite number in parsed JSON, e.g. "text_config.rope_theta", it), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (where, value)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := _non_finite(item, f"{where}[{key}]" if isinstance(key, int) else
                                 f"{where}.{key}" if where else key)) is not None:
            return found
    return None


def _quant_format(outer: dict, text: dict, where: str, path: Path) -> quant.Format:
    """The quantization_config of the text config or the outer one (the same if both have one), checked."""
    inner, top = text.get("quantization_config"), outer.get("quantization_config") if text is not outer else None
    if inner and top and inner != top:
        raise TargetError(f"{path}: quantization_config at the top level and in text_config differ; expected one")
    try:
        return quant.read_format(inner or top, where if inner else str(path))
    except ValueError as e:
        raise TargetError(str(e)) from None


def read_config(path: Path) -> TextConfig:
    """Resolve a (possibly nested) config.json into the text model's fields."""
    try:
        blob = path.read_bytes()
        outer = json.loads(blob)
    except FileNotFoundError:
        raise TargetError(f"{path}: not found (a target directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise TargetError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(outer, dict):
        raise TargetError(f"{path}: expected a JSON object")
    if (field := _non_finite(outer)) is not None:   # Python's JSON reads NaN and Infinity: a forward of NaNs
        raise TargetError(f"{path}: field '{field[0]}' = {json.dumps(field[1])}; expected a finite number (NaN and "
                          "Infinity are not numbers a model config can use)")
    text, where = outer, str(path)
    if "text_config" in outer:
        text, where = outer["text_config"], f"{path}:text_config"
        if not isinstance(text, dict):
            raise TargetError(f"{where}: expected an object")
    model_type = str(outer.get("model_type", ""))
    text_model_type = str(text.get("model_type", model_type))
    architectures = list(text.get("architectures") or outer.get("architectures") or [])
    # the family by model_type (as transformers dispatches), else by architectures; never guessed from the fields
    if text_model_type:
        named, found = f"model_type '{text_model_type}'", [f for f in FAMILIES if text_model_type in f.model_types]
    else:
        named = f"architectures {architectures}" if architectures else "no model_type or architectures"
        found = [f for f in FAMILIES if set(architectures) & set(f.architectures)]
    missing = next((NOT_BUILT[t] for t in (text_model_type, model_type) if t in NOT_BUILT), None)
    if not found and missing:
        raise TargetError(f"{where}: {named} is not supported: {missing}")
    if not found:
        supported = "; ".join(f"{', '.join(f.model_types)} ({f.name} family)" for f in FAMILIES)
        raise TargetError(f"{where}: unsupported target ({named}); supported model_types: {supported}")
    family, needs = found[0], f"{named} ({found[0].name} family)"
    for key, kind in {**COMMON_FIELDS, **family.fields}.items():
        require(text, key, where, needs, kind)
    theta, scaling = rope_settings(text)
    heads = text["num_attention_heads"]
    quant_format = _quant_format(outer, text, where, path)
    tie = text.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))
    cfg = TextConfig(
        raw=text, source=where, model_type=model_type, text_model_type=text_model_type, architectures=architectures,
        **{k: text[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size")},
        num_attention_heads=heads, num_key_value_heads=text.get("num_key_value_heads") or heads,
        rms_norm_eps=float(text["rms_norm_eps"]), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(tie), quantization=quant_format.describe(), quant_format=quant_format,
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        config_sha256=hashlib.sha256(blob).hexdigest(), family=family, needs=needs)
    if cfg.num_hidden_layers < 4:
        raise TargetError(f"{where}: num_hidden_layers = {cfg.num_hidden_layers}; EAGLE-3 needs at least 4")
    # a GQA head without head_dim is hidden_size / heads; GLM-4.5 (5120, 96 heads of 128) and MLA heads are not
    if not cfg.is_deepseek and not text.get("head_dim") and cfg.hidden_size % heads:
        raise TargetError(f"{where}: hidden_size {cfg.hidden_size} is not a multiple of num_attention_heads {heads} "
                          "and no head_dim is given")
    return cfg


# where a text model's tensors live, in order of preference: (model prefix, lm_head name)
_PREFIXES = [("language_model.model.", "language_model.lm_head.weight"), ("model.language_model.", "lm_head.weight"),
             ("model.", "lm_head.weight"), ("", "lm_head.weight")]
# a multimodal wrapper's vision tower and projector: never part of the text forward (`Checkpoint.skip_reason`)
VISION = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "visual.", "model.visual.")


def _open(path: Path):
    return open_safetensors(path, TargetError, "truncated or corrupt: copy or download that file again")


class Checkpoint:
    """A target directory: `config` and its text tensors by names relative to the text model
    (`layers.3.self_attn.q_proj.weight`); `lm_head.weight` is the embedding when they are tied."""

    def __init__(self, path: str | Path, require_weights: bool = True):
        self.path = Path(path)
        if not self.path.exists():
            raise TargetError(f"{self.path}: target directory not found (target.path)")
        if not self.path.is_dir() and self.path.suffix != ".json":   # a weights file, an archive: not its config
            raise TargetError(f"{self.path}: a file, not a directory; target.path names the target's directory "
                              "(config.json, tokenizer and safetensors) or its config.json")
        cfg_path = self.path / "config.json" if self.path.is_dir() else self.path
        self.config = read_config(cfg_path)
        self.dir = cfg_path.parent
        index = self.dir / "model.safetensors.index.json"
        self.weights_file = index if index.exists() else self.dir / "model.safetensors"   # what lists the tensors
        self.weight_map = self._weight_map()
        self._handles: dict[str, object] = {}
        self.prefix, self.head_name = self._detect_prefix() if self.weight_map else ("", None)
        if require_weights and not self.weight_map:
            raise TargetError(f"{self.dir}: no model.safetensors or model.safetensors.index.json found")

    def _weight_map(self) -> dict[str, str]:
        file = self.weights_file
        if file.suffix == ".json":
            try:
                wm = json.loads(file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise TargetError(f"{file}: expected a JSON object with 'weight_map' ({e})") from None
            missing = sorted({f for f in wm.values() if not (self.dir / f).exists()})
            if missing:
                raise TargetError(f"{file}: shard files listed but missing: {', '.join(missing[:5])}")
            return wm
        if not file.exists():
            return {}
        with _open(file) as f:
            return {name: file.name for name in f.keys()}

    def _detect_prefix(self) -> tuple[str, str | None]:
        for prefix, head in _PREFIXES:
            if prefix + "embed_tokens.weight" in self.weight_map:
                tie = self.config.tie_word_embeddings
                if not tie and head not in self.weight_map:
                    raise TargetError(f"{self.dir}: no '{head}' tensor and tie_word_embeddings is false "
                                      f"in {self.config.source}")
                return prefix, None if tie else head
        raise TargetError(f"{self.dir}: no embedding tensor found (looked for "
                          f"{', '.join(p + 'embed_tokens.weight' for p, _ in _PREFIXES[:3])})")

    def full_name(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.head_name or self.prefix + "embed_tokens.weight"
        return self.prefix + name

    def has(self, name: str) -> bool:
        return self.full_name(name) in self.weight_map

    def text_tensor_names(self) -> list[str]:
        return [n for n in self.weight_map if not n.startswith(VISION)]

    def text_bytes(self) -> int:
        """The summed size of the files that hold its text tensors."""
        return sum((self.dir / f).stat().st_size for f in {self.weight_map[n] for n in self.text_tensor_names()})

    def _handle(self, name: str):
        full = self.full_name(name)
        if full not in self.weight_map:
            raise TargetError(f"{self.dir}: tensor '{full}' not found in the checkpoint")
        file = self.weight_map[full]
        if file not in self._handles:
            self._handles[file] = _open(self.dir / file)
        return self._handles[file], full

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        handle, full = self._handle(name)
        return handle.get_tensor(full).to(device)

    def info(self, name: str) -> dict:
        handle, full = self._handle(name)
        sl = handle.get_slice(full)
        return {"name": full, "shape": list(sl.get_shape()), "dtype": sl.get_dtype()}

    def skip_reason(self, full: str) -> str | None:
        """Why the text forward reads no tensor `full` (a name as stored), or None: the one list of what is skipped."""
        c = self.config
        # DeepSeek's and GLM's count, MiniMax-M2's (vLLM 0.34 and SGLang 0.5.23 drop those layers alike)
        field = next((k for k in ("num_nextn_predict_layers", "num_mtp_modules") if c.raw.get(k)),
                     "num_nextn_predict_layers")
        extra = int(c.raw.get(field) or 0)
        layers = self.prefix + "layers."
        layer = full[len(layers):].split(".")[0] if full.startswith(layers) else ""
        if full.startswith(VISION):
            return "vision tower and projector: the text forward reads no image"
        if layer.isdigit() and c.num_hidden_layers <= int(layer) < c.num_hidden_layers + extra:
            return (f"multi-token-prediction layer past num_hidden_layers {c.num_hidden_layers} "
                    f"({field} {extra}): a decoding aid, not part of the forward")
        if full.endswith(".rotary_emb.inv_freq"):
            return "rotary buffer: the forward computes its own from the config"
        if self.head_name is None and full.endswith("lm_head.weight"):
            return "lm_head beside tie_word_embeddings true: the embedding is the head"
        return None

    def account(self, used: list[str]) -> dict[str, int]:
        """Every tensor of the checkpoint read (`used`, names as `get` takes them) or skipped -> {reason: count};
        any other is refused by name."""
        read = {self.full_name(n) for n in used}
        reasons = {name: self.skip_reason(name) for name in self.weight_map if name not in read}
        if unknown := [name for name, why in reasons.items() if why is None]:
            raise TargetError(f"{self.weights_file}: {len(unknown)} tensors that no part of a "
                              f"{self.config.family.name} forward reads nor a known reason skips, first: "
                              f"{', '.join(unknown[:3])}")
        return dict(Counter(reasons.values()))

    def linear_shapes(self, base: str, shape: tuple[int, int]) -> dict[str, list[int] | quant.GroupedShape]:
        """The tensors linear `base` ([out, in]) is stored as -> their shapes, its format checked against the config."""
        kind, fmt, weight = quant.linear_kind(self.has, base), self.config.quant_format, f"{base}.weight"
        if kind not in ("plain", fmt.kind):
            said = f"{fmt.kind} linears" if fmt.describe() else "unquantized weights (no quantization_config)"
            raise TargetError(f"{self.weights_file}: {self.full_name(base)} is stored {kind} ("
                              f"{', '.join(n for n in self.weight_map if n.startswith(self.full_name(base) + '.'))}), "
                              f"but {self.config.source} says {said}")
        if kind == "int4":
            return {f"{base}.{suffix}": s for suffix, s in quant.packed_shapes(*shape).items()}
        dtype = self.info(weight)["dtype"] if self.has(weight) else None
        if kind == "fp8":
            scale = f"{base}.{quant.FP8_SCALE}"
            if dtype is None:
                raise TargetError(f"{self.weights_file}: {self.full_name(scale)}, a scale with no weight "
                                  f"({self.full_name(weight)} is missing)")
            scale_dtype = self.info(scale)["dtype"]
            if dtype != "F8_E4M3" or scale_dtype not in ("F32", "BF16", "F16"):
                raise TargetError(f"{self.weights_file}: {self.full_name(weight)} is {dtype} with a {scale_dtype} "
                                  f"{quant.FP8_SCALE}; expected F8_E4M3 with F32, BF16 or F16 scales")
            return {weight: list(shape), scale: quant.block_scale_shape(shape, fmt.block)}
        if dtype and dtype.startswith("F8"):
            raise TargetError(f"{self.weights_file}: {self.full_name(weight)} is {dtype} without its "
                              f"{quant.FP8_SCALE} (a quantized weight missing its scale)")
        return {weight: list(shape)}

    def linear_parts(self, base: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        """Linear `base` as stored, on the CPU, row-aligned: int4 `weight_packed` + `weight_scale`, fp8 `weight` +
        `row_scale` (`quant.row_scales`) or a plain `weight` [out, in]; `quant.dequantize` makes it dense."""
        kind = quant.linear_kind(self.has, base)
        if kind == "int4":
            packed, scale = self.get(base + ".weight_packed"), self.get(base + ".weight_scale")
            try:
                quant.check_packed(packed, scale, self.get(base + ".weight_shape"), shape)
            except ValueError as e:
                raise TargetError(f"{self.dir / self.weight_map[self.full_name(base + '.weight_packed')]}: "
                                  f"{self.full_name(base)}.{e}") from None
            return {"weight_packed": packed, "weight_scale": scale}
        w, full = self.get(base + ".weight"), self.full_name(base + ".weight")
        if list(w.shape) != list(shape):
            raise TargetError(f"{self.dir / self.weight_map[full]}: {full}: shape {list(w.shape)}; "
                              f"expected {list(shape)}")
        if kind == "plain":
            return {"weight": w}
        scale = self.get(f"{base}.{quant.FP8_SCALE}")
        return {"weight": w, "row_scale": quant.row_scales(scale, shape[0], self.config.quant_format.block[0])}

    @property
    def block_cols(self) -> int | None:
        """fp8 blocks' width (weight_block_size[1]), for `quant.dequantize`."""
        return self.config.quant_format.block[1] if self.config.quant_format.block else None

    def linear(self, base: str, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Linear `base`'s weight [out, in] on `device` in `dtype`, dequantized there from however it is stored: the
        one call through which every family reads its linears."""
        parts = {k: v.to(device, non_blocking=True) for k, v in self.linear_parts(base, shape).items()}
        return quant.dequantize(parts, dtype, self.block_cols)

    def check_shapes(self, expected: dict[str, list[int] | quant.GroupedShape], shown: int = 5) -> None:
        """Raise naming the tensors (the first `shown`) not of the `expected` shape, from the headers only."""
        wrong = [f"{self.full_name(n)} is {found}, expected {want}" for n, want in expected.items()
                 if not quant.shape_fits(want, found := self.info(n)["shape"])]
        if wrong:
            more = f"; and {len(wrong) - shown} more" if len(wrong) > shown else ""
            raise TargetError(f"{self.weights_file}: {len(wrong)} of the {len(expected)} tensors checked do not have "
                              f"the shape {self.config.source} implies: {'; '.join(wrong[:shown])}{more}")

    def outer_tensors(self) -> dict[str, dict]:
        """`info` of the embedding, head and final norm, checked against the config (not met in the forward)."""
        c = self.config
        info = {name: self.info(f"{name}.weight") for name in ("embed_tokens", "lm_head", "norm")}
        for name in ("embed_tokens", "lm_head"):
            if info[name]["shape"] != [c.vocab_size, c.hidden_size]:
                raise TargetError(f"{self.dir}: {info[name]['name']} has shape {info[name]['shape']}, but "
                                  f"{c.source} says vocab_size {c.vocab_size} x hidden_size {c.hidden_size}")
        if info["norm"]["shape"] != [c.hidden_size]:
            raise TargetError(f"{self.dir}: {info['norm']['name']} has shape {info['norm']['shape']}; expected "
                              f"[{c.hidden_size}]")
        return info
