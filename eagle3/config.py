"""The one typed configuration schema: TOML loading, `--section.key value` overrides, validation.

Every value a user may tune is a field below, with its type and default. `config.toml` holds the
same keys with comments. A value of `None` ("auto" in TOML) means "derive it": from the target for
draft sizes, from another key for paths.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file and the key."""


@dataclass
class TargetConfig:
    path: str = "demo/target"                 # directory with config.json and *.safetensors
    aux_layer_ids: list[int] | None = None    # decoder layers whose output is captured; auto: [1, L//2-1, L-4]


@dataclass
class DataConfig:
    path: str = "demo/data.jsonl"             # JSON lines: pre-tokenized, OpenAI "messages" or ShareGPT "conversations"
    max_seq_len: int = 4096                   # longer sequences are truncated (counted in the manifest)
    on_error: str = "fatal"                   # a line that cannot be parsed: "fatal" or "skip" (reported)


@dataclass
class ExtractConfig:
    output_dir: str = "runs/demo/hidden"      # shards + manifest.json
    shard_tokens: int = 65536                 # tokens per shard file (a shard ends on a sequence boundary)
    chunk_tokens: int = 65536                 # tokens run through one layer at a time
    device: str = "auto"                      # "auto" (cuda if available), "cpu", "cuda", "cuda:N"
    dtype: str = "bfloat16"                   # compute dtype of the target forward
    aux_dtype: str = "bfloat16"               # storage of aux_hidden: "bfloat16" or "float8_e4m3fn" (shards ~62% the size)


@dataclass
class VocabConfig:
    draft_vocab_size: int | None = None       # auto: min(32000, target vocab)


@dataclass
class DraftConfig:
    num_layers: int = 1
    hidden_size: int | None = None            # auto: the target's (the frozen embedding fixes it)
    num_attention_heads: int | None = None    # auto: the target's
    num_key_value_heads: int | None = None    # auto: the target's
    head_dim: int | None = None               # auto: hidden_size // num_attention_heads
    intermediate_size: int | None = None      # auto: the target's dense intermediate size
    rms_norm_eps: float | None = None         # auto: the target's
    rope_theta: float | None = None           # auto: the target's rope_theta (plain Llama RoPE in the draft)
    max_position_embeddings: int | None = None  # auto: the target's
    lm_head_init: str = "target"              # "target": the target's lm_head rows of the draft vocab; "random"


@dataclass
class TrainConfig:
    data_dir: str | None = None               # auto: extract.output_dir
    output_dir: str = "runs/demo/train"
    max_steps: int = 200                      # optimizer steps; 0 = run `epochs` epochs
    epochs: int = 1
    seed: int = 0
    batch_tokens: int = 16384                 # token budget of one micro-batch of packed sequences
    grad_accum: int = 1                       # micro-batches per rank per optimizer step
    ttt_steps: int = 7
    loss_decay: float = 0.8                   # step k is weighted decay**k
    lr: float = 1e-4
    min_lr_ratio: float = 0.1                 # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    eval_fraction: float = 0.05               # share of sequences held out for evaluation
    eval_every: int = 50
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    resume: str = "auto"                      # "auto" (newest complete checkpoint), "never", or a checkpoint dir
    overwrite: bool = False                   # with resume = "never": move a run already in output_dir aside first
    kernels: str = "auto"                     # "auto" (triton on CUDA), "triton", "torch"
    skip_dead_rows: bool = True               # skip the work of rows whose chain reaches no loss (exact)
    compile_ops: bool = True                  # torch.compile RMSNorm / RoPE / SiLU*up on CUDA
    device: str = "auto"
    prefetch: int = 2                         # micro-batches read ahead in a background thread
    freeze_lm_head: bool = True               # keep the draft's lm_head as initialised (not trained)
    fp32_residual: bool = False               # keep the draft's residual stream (and the state between TTT steps) in fp32
    oov_rows: bool = False                    # also train rows whose target token is outside the draft vocab
    aux_noise: float = 0.0                    # Gaussian noise on each aux layer's state, x its per-token RMS (training)
    hard_label: float = 0.0                   # loss target (1 - w) p + w onehot(argmax p) (training)
    skip_nonfinite: bool = False              # a step with a NaN/inf loss or gradient norm: skip it (counted), not stop


@dataclass
class ExportConfig:
    formats: list[str] = field(default_factory=lambda: ["vllm", "sglang"])
    speculative_tokens: int = 3               # draft tokens per round advertised to the engine
    dtype: str = "bfloat16"
    verifier_name: str | None = None          # auto: target.path


@dataclass
class GenerateConfig:
    output_path: str = "runs/demo/regenerated.jsonl"  # pre-tokenized JSON lines, read by extract.py
    max_new_tokens: int = 512                 # per assistant reply
    batch_size: int = 16                      # conversations decoded together
    temperature: float = 0.0                  # 0 = greedy (what the acceptance estimate assumes)
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: list[int] | None = None   # auto: the target's eos_token_id(s) and <|im_end|> if the tokenizer has it
    device: str = "auto"
    dtype: str = "bfloat16"


@dataclass
class EvaluateConfig:
    prompts: str | None = None                # JSON lines of prompts for real decoding; None: only the TTT estimate
    max_new_tokens: int = 128                 # tokens generated per prompt
    k: int | None = None                      # draft tokens per round; auto: ttt_steps (ours), speculative_tokens (vLLM)
    device: str = "auto"
    dtype: str = "float32"                    # target and draft; float32 so near-ties do not flip argmaxes
    max_prompts: int = 0                      # the first N prompts; 0 = all
    batch_size: int = 32                      # prompts decoded together (1: the plain one-prompt loops)


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    source: str = "<defaults>"                # where the config came from, for error messages

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source")
        return out

    def resolved_train_data_dir(self) -> str:
        return self.train.data_dir or self.extract.output_dir


CHOICES = {
    ("data", "on_error"): ("fatal", "skip"),
    ("extract", "dtype"): ("bfloat16", "float16", "float32"),
    ("extract", "aux_dtype"): ("bfloat16", "float8_e4m3fn"),
    ("train", "kernels"): ("auto", "triton", "torch"),
    ("draft", "lm_head_init"): ("target", "random"),
    ("export", "dtype"): ("bfloat16", "float16", "float32"),
    ("generate", "dtype"): ("bfloat16", "float16", "float32"),
    ("evaluate", "dtype"): ("bfloat16", "float16", "float32"),
}
POSITIVE = {("extract", "shard_tokens"), ("extract", "chunk_tokens"), ("train", "batch_tokens"),
            ("train", "grad_accum"), ("train", "ttt_steps"), ("train", "eval_every"),
            ("train", "log_every"), ("train", "checkpoint_every"), ("train", "keep_checkpoints"),
            ("draft", "num_layers"), ("data", "max_seq_len"), ("export", "speculative_tokens"),
            ("generate", "max_new_tokens"), ("generate", "batch_size"), ("evaluate", "max_new_tokens"),
            ("evaluate", "k"), ("evaluate", "batch_size")}


def _sections() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(Config) if f.name != "source"}


def _field_types(section_cls: type) -> dict[str, object]:
    return typing.get_type_hints(section_cls)


def _type_name(tp: object) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _coerce(value: object, tp: object, where: str) -> object:
    """Check `value` (from TOML or JSON) against the annotation `tp`; return it converted."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or value == "auto":
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of {_type_name(item)}, got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is tp):
        return value
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")


def _parse_cli_value(text: str) -> object:
    """A command-line value: JSON/TOML-like literals (numbers, true/false, lists), else a string."""
    lowered = text.strip()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(lowered)
    except json.JSONDecodeError:
        return text


def _apply(cfg: Config, section: str, key: str, value: object, origin: str) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"{origin}: unknown section [{section}]; allowed: {', '.join(sections)}")
    sub = getattr(cfg, section)
    types_ = _field_types(type(sub))
    if key not in types_:
        raise ConfigError(f"{origin}: unknown key '{section}.{key}'; allowed keys of [{section}]: "
                          f"{', '.join(types_)}")
    where = f"{origin}: {section}.{key}"
    tp = types_[key]
    if isinstance(value, str) and tp not in (str, str | None):
        value = _parse_cli_value(value) if value != "auto" else value
    setattr(sub, key, _coerce(value, tp, where))


def validate(cfg: Config) -> None:
    for (section, key), allowed in CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"{cfg.source}: {section}.{key} = {value!r}; expected one of {allowed}")
    for section, key in POSITIVE:
        value = getattr(getattr(cfg, section), key)
        if value is not None and value <= 0:
            raise ConfigError(f"{cfg.source}: {section}.{key} = {value}; expected a positive integer")
    t = cfg.train
    if t.max_steps < 0 or t.epochs <= 0:
        raise ConfigError(f"{cfg.source}: train.max_steps must be >= 0 and train.epochs > 0")
    ranges = {"lr": t.lr > 0, "grad_clip": t.grad_clip > 0, "loss_decay": t.loss_decay > 0,
              "min_lr_ratio": 0 <= t.min_lr_ratio <= 1, "warmup_steps": t.warmup_steps >= 0,
              "weight_decay": t.weight_decay >= 0, "prefetch": t.prefetch >= 1, "aux_noise": t.aux_noise >= 0,
              "hard_label": 0 <= t.hard_label <= 1}
    for key, ok in ranges.items():
        if not ok:
            raise ConfigError(f"{cfg.source}: train.{key} = {getattr(t, key)}; expected "
                              + {"min_lr_ratio": "a number in [0, 1]", "warmup_steps": "an integer >= 0",
                                 "weight_decay": "a number >= 0", "prefetch": "an integer >= 1",
                                 "aux_noise": "a number >= 0",
                                 "hard_label": "a number in [0, 1]"}.get(key, "> 0"))
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ConfigError(f"{cfg.source}: train.betas = {t.betas}; expected two numbers in [0, 1)")
    if not 0 <= t.eval_fraction < 1:
        raise ConfigError(f"{cfg.source}: train.eval_fraction = {t.eval_fraction}; expected [0, 1)")
    if t.resume not in ("auto", "never") and not Path(t.resume).is_dir():
        raise ConfigError(f"{cfg.source}: train.resume = {t.resume!r}; expected 'auto', 'never' or an "
                          "existing checkpoint directory")
    if t.overwrite and t.resume != "never":
        raise ConfigError(f"{cfg.source}: train.overwrite = true starts a new run in place of the one in "
                          f"train.output_dir, but train.resume = {t.resume!r} would resume; set "
                          "train.resume = \"never\" with it, or train.overwrite = false")
    for fmt in cfg.export.formats:
        if fmt not in ("vllm", "sglang"):
            raise ConfigError(f"{cfg.source}: export.formats has {fmt!r}; allowed: 'vllm', 'sglang'")
    g = cfg.generate
    if g.temperature < 0 or not 0 < g.top_p <= 1:
        raise ConfigError(f"{cfg.source}: generate.temperature must be >= 0 and generate.top_p in (0, 1]")
    if cfg.evaluate.max_prompts < 0:
        raise ConfigError(f"{cfg.source}: evaluate.max_prompts = {cfg.evaluate.max_prompts}; expected >= 0 (0 = all)")
    ids = cfg.target.aux_layer_ids
    if ids is not None and len(ids) != 3:
        raise ConfigError(f"{cfg.source}: target.aux_layer_ids = {ids}; EAGLE-3 needs exactly 3 layers")


def from_dict(data: dict, origin: str) -> Config:
    cfg = Config(source=origin)
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: '{section}' must be a [section] table; allowed sections: "
                              f"{', '.join(_sections())}")
        for key, value in values.items():
            _apply(cfg, section, key, value, origin)
    return cfg


def parse_overrides(argv: list[str]) -> list[tuple[str, str, str]]:
    """`--section.key value` or `--section.key=value` -> [(section, key, raw value)]."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"command line: unexpected argument {arg!r}; expected --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: {arg} needs a value")
            value, i = argv[i + 1], i + 1
        section, _, key = name.partition(".")
        out.append((section, key, value))
        i += 1
    return out


def load(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load `path` (TOML), apply command-line overrides, validate. Raises ConfigError."""
    if path is None:
        cfg = Config()
    else:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        cfg = from_dict(data, str(path))
    for section, key, value in parse_overrides(overrides or []):
        _apply(cfg, section, key, value, f"command line --{section}.{key}")
    validate(cfg)
    return cfg


OVERRIDES_HELP = ("Any config key can be overridden: --section.key value or --section.key=value, e.g. "
                  "--train.max_steps 40 (lists as JSON: --train.betas \"[0.9, 0.95]\"); sections: "
                  + ", ".join(f.name for f in dataclasses.fields(Config) if f.name != "source")
                  + ". The keys and their defaults: config.toml and README.md.")


def check_overrides(parser, argv: list[str]) -> list[str]:
    """`argv` if every item is a `--section.key value` override, else the parser's usage error
    (exit 2) before anything runs."""
    try:
        parse_overrides(argv)
    except ConfigError as e:
        parser.error(str(e))
    return argv


def cli(argv: list[str] | None = None, description: str = "") -> Config:
    """Entry-point helper: `--config FILE` plus overrides; exits with the error message on failure."""
    import argparse
    parser = argparse.ArgumentParser(description=description, epilog=OVERRIDES_HELP)
    parser.add_argument("--config", default="config.toml", help="TOML config file (default: config.toml)")
    args, rest = parser.parse_known_args(argv)
    try:
        return load(args.config, check_overrides(parser, rest))
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
