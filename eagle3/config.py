"""The one typed configuration schema (each key's type, default and doc make `python -m eagle3 config` and
docs/config.md; `None`, "auto" in TOML, means derive it): TOML loading, `--section.key value` overrides, checks."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eagle3.errors import Eagle3Error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(Eagle3Error):
    """A configuration that cannot be used; the message names the file and the key."""


def setting(default: object, doc: str):
    """A config key: its default and its one-line doc."""
    if isinstance(default, (list, dict)):       # a mutable default: each Config gets its own copy
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


Dtype = Literal["bfloat16", "float16", "float32"]


@dataclass
class TargetConfig:
    path: str = setting("demo/target", "target directory: `config.json` + safetensors (a nested `text_config` is fine)")
    aux_layer_ids: list[int] | None = setting(
        None, "the 3 decoder layers whose output is captured (0-based; vLLM's ids are +1); auto: `[1, L//2-1, L-4]`")


# template kwargs the engines set themselves: neither data.chat_template_kwargs nor a chat line may set them
RESERVED_KWARGS = {"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
                   "bos_token", "eos_token"}


@dataclass
class DataConfig:
    path: str = setting("demo/data.jsonl", 'JSON lines, one conversation each: pre-tokenized `{"input_ids", '
                        '"loss_mask"}`, chat `{"messages": [...]}` or ShareGPT `{"conversations": [...]}`')
    max_seq_len: int = setting(4096, "tokens; longer sequences are truncated (counted in the manifest)")
    on_error: Literal["fatal", "skip"] = setting(
        "fatal", "a line that cannot be used: `fatal` stops naming it, `skip` skips it (counted in the manifest)")
    windows: list[float] = setting(
        [], "`[share, tokens]`: that share of the sequences longer than `tokens` trained as consecutive windows of "
        "that many tokens instead of whole (long traces: `[0.5, 512]`, the long bench's best from 512 tokens deep and "
        "overall: docs/training.md); `[]`: every sequence whole")
    chat_template_kwargs: dict = setting(
        {}, "chat lines: passed to the target's chat template as an engine passes a request's `chat_template_kwargs` "
        "(Kimi-K2.5: `{thinking = false}` for instant mode); a line's own `chat_template_kwargs` win")


@dataclass
class ExtractConfig:
    output_dir: str = setting("runs/demo/hidden", "shards (`shard-NNNNN.safetensors`) + `manifest.json`")
    dtype: Dtype = setting("bfloat16", "compute dtype of the target forward")
    aux_dtype: Literal["bfloat16", "float8_e4m3fn"] = setting(
        "bfloat16", "storage of `aux_hidden`; `float8_e4m3fn` (a scale per token and layer) takes half the bytes")


@dataclass
class VocabConfig:
    draft_vocab_size: int | None = setting(None, "the most frequent assistant tokens kept; auto: min(32000, target's)")


@dataclass
class DraftConfig:
    """The draft's shape; its hidden size, RoPE theta and norm epsilon are always the target's."""
    num_layers: int = setting(1, "decoder layers of the draft (SGLang's MLA draft takes 1)")
    num_attention_heads: int | None = setting(None, "auto: the target's")
    num_key_value_heads: int | None = setting(None, "auto: the target's (fewer for a GQA draft)")
    head_dim: int | None = setting(None, "auto: the target's head_dim, else `hidden_size // num_attention_heads`")
    intermediate_size: int | None = setting(None, "auto: the target's dense intermediate size")
    attention: Literal["auto", "gqa", "mla"] = setting(
        "auto", "the draft layer's attention: `gqa` (Llama layer) or `mla` (DeepSeek-V3 latent attention, its dims "
        "the target's; vLLM's Eagle3DeepseekV2ForCausalLM); auto: gqa, for MLA targets too (measured: docs/ttt.md)")
    sliding_window: int = setting(
        0, "the draft attends to the last N positions (vLLM's `sliding_window`, SGLang's "
        "`--speculative-draft-window-size` N - 1; gqa drafts); 0 = all (docs/training.md)")
    media_embedding: Literal["vllm", "sglang"] = setting(
        "vllm", "the draft's token embedding at image / video placeholders, as the serving engine gives it: `vllm` "
        "the placeholder token's embedding, `sglang` the target's fused vision rows (docs/export.md)")


@dataclass
class TrainConfig:
    source: Literal["shards", "online"] = setting(
        "shards", "`shards`: extracted hidden states (`train.data_dir`); `online`: run the target on `data.path`")
    online_target: Literal["stream", "resident", "staged"] = setting(
        "stream", "online: `stream` the target's layers per micro-batch (memory: two layers), keep the target "
        "`resident` on each rank (memory: all of it), or `staged` across the ranks (1/world each)")
    data_dir: str | None = setting(None, "shards to train on; auto: `extract.output_dir`")
    output_dir: str = setting("runs/demo/train", "`checkpoints/`, `metrics.jsonl`, `export/`")
    max_steps: int = setting(200, "optimizer steps; 0 = run `train.epochs` epochs")
    epochs: int = setting(1, "passes over the data when `train.max_steps` = 0")
    seed: int = setting(0, "init and data order")
    batch_tokens: int = setting(16384, "tokens in one micro-batch of packed sequences, per rank")
    grad_accum: int = setting(1, "micro-batches per rank per optimizer step")
    context_parallel: int = setting(
        1, "ranks that train one micro-batch of this many x `train.batch_tokens` tokens together, its rows split among "
        "them (sequences longer than a rank holds); divides the world size and the draft's heads (docs/training.md)")
    ttt_steps: int = setting(7, "training-time-test unroll K")
    loss_decay: float = setting(0.8, "the loss of TTT step k is weighted `loss_decay**k`")
    lr: float = setting(1e-4, "AdamW peak learning rate: linear warmup, then `train.schedule`")
    schedule: Literal["cosine", "wsd"] = setting(
        "wsd", "after warmup: `wsd` holds lr, then decays linearly over `train.decay_fraction`; `cosine` throughout")
    decay_fraction: float = setting(0.2, "`wsd`: the share of the steps over which lr decays, in (0, 1]")
    min_lr_ratio: float = setting(0.1, "the schedule ends at `lr × min_lr_ratio`; later steps run at it")
    warmup_steps: int = setting(20, "linear warmup steps")
    betas: list[float] = setting([0.9, 0.95], "AdamW betas")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    grad_clip: float = setting(0.5, "gradient norm clip")
    eval_fraction: float = setting(0.05, "share of sequences held out for evaluation and the acceptance estimate")
    eval_every: int = setting(50, "steps between evaluations")
    checkpoint_every: int = setting(100, "steps between checkpoints (the free space is checked first)")
    keep_checkpoints: int = setting(3, "newest checkpoints kept")
    resume: str = setting(
        "auto", "`auto`: the newest complete checkpoint that reads; `never`: a new run, refusing a folder that holds "
        "one; `overwrite`: the old run moved aside to `<output_dir>.old-<time>`; or a checkpoint directory")
    float8: bool | None = setting(
        None, "the draft's linear layers as fp8 GEMMs (e4m3 forward, e5m2 gradients, fp32 masters); auto: on a GPU "
        "with fp8 tensor cores where a layer's fp8 GEMMs time faster at this shape (once; ~/.cache/eagle3)")
    float8_head: bool | None = setting(
        None, "the loss's lm_head GEMMs as fp8 too; auto: with train.float8 and the Triton loss, where faster (timed)")
    prompt_rows: bool = setting(
        True, "also train rows labelled with a prompt token, towards the target there; metrics count assistant rows")
    loss: Literal["kl", "tv", "nla", "lk_hybrid", "pq"] = setting(
        "nla", "per TTT step, between the target's p and the draft's q (docs/losses.md): `nla` -log Σ min(p, q), "
        "`tv`, `lk_hybrid`, `kl` forward KL, `pq` -log Σ p·q")
    loss_temperature: float = setting(1.0, "p and q at this temperature in the loss: the draft's serving temperature")


@dataclass
class ExportConfig:
    formats: list[Literal["vllm", "sglang"]] = setting(
        ["vllm", "sglang"], "written to `train.output_dir/export/<format>/` at the end of training")
    speculative_tokens: int = setting(3, "draft tokens per round advertised to the engine")
    verifier_name: str | None = setting(
        None, "the verifier the vLLM export names (`vllm serve` of the draft folder takes a Hugging Face repo id only); "
        "auto: the target's repo id when it lies in the Hugging Face cache, else its absolute path")


@dataclass
class GenerateConfig:
    output_path: str = setting("runs/demo/regenerated.jsonl", "pre-tokenized JSON lines (point `data.path` at it)")
    max_new_tokens: int = setting(512, "per assistant reply")
    temperature: float = setting(
        1.0, "the temperature the target is served at (Kimi-K2.5: 1.0), where its replies are sampled; 0 = greedy, "
        "for a target served greedily")
    top_p: float = setting(0.95, "nucleus sampling threshold, in (0, 1]: the serving top_p (Kimi-K2.5's 0.95)")
    servers: list[str] = setting(
        [], "base URLs of running vLLM / SGLang / OpenAI-compatible servers of the target (`http://host:8000`), which "
        "write the replies; empty: the target runs here, on one device (debug.generate_device)")
    served_model: str | None = setting(None, "the model name the servers serve; auto: the only one they list")


@dataclass
class EvaluateConfig:
    prompts: str | None = setting(None, "JSON lines of prompts to decode (`--prompts`); auto: only the TTT estimate")
    max_new_tokens: int = setting(128, "tokens generated per prompt (`--max-new-tokens`)")
    k: int | None = setting(None, "draft tokens per round (`--k`); auto: our draft's `train.ttt_steps`, a "
                                  "vLLM-layout draft's `speculative_tokens` (7 if it has none)")
    temperature: float = setting(
        0.0, "serving temperature (`--temperature`): 0 = greedy, checked token for token; > 0 = speculative sampling")
    top_p: float = setting(1.0, "serving top_p (`--top-p`), in (0, 1], applied to the target's distribution")
    draft_sampling: Literal["greedy", "probabilistic"] = setting(
        "greedy", "at temperature > 0 the draft proposes its argmax (vLLM's default) or a sample (`--draft-sampling`)")
    seeds: int = setting(1, "at temperature > 0, decode with seeds 0..N-1, report mean and deviation (`--seeds`)")


@dataclass
class ExperimentalConfig:
    """Levers without a gain so far (benchmarks/RESULTS.md), kept for comparison."""
    norm_before_residual: bool = setting(
        False, "layer 0's residual starts from `hidden_norm(fc(aux))` (speculators' and vLLM's key; SGLang has none)")
    aux_norm: Literal["none", "concat", "per_layer"] = setting(
        "none", "an RMSNorm before `fc` over the concatenated aux states (`concat`, speculators' `norm_before_fc`) "
        "or on each (`per_layer`, EAGLE-3.1's `fc_norm`); SGLang's MLA draft reads `per_layer` only")
    norm_output: bool = setting(
        False, "the normed output is the head's input and the next step's state (EAGLE-3.1's)")
    lm_head_init: Literal["target", "random"] = setting(
        "target", "the draft's `lm_head` starts as the target's rows of the draft vocab, or `random`")
    freeze_lm_head: bool = setting(True, "the draft's `lm_head` keeps its initial weights (not trained)")
    lk_eta: float = setting(3.0, "`train.loss = lk_hybrid`: η of λ = exp(-η·α)")
    draft_rope: Literal["target", "plain"] = setting(
        "target", "the draft's rotary: the target's rope scaling (YaRN, llama3, linear; docs/training.md), or `plain` "
        "RoPE at the target's theta (the comparison)")
    mla_dims: list[int] = setting(
        [], "draft.attention = mla: [q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim]; "
        "empty: the target's")


@dataclass
class DebugConfig:
    """Plumbing: devices, kernel choice, sizes of internal work units; the defaults are the tuned ones."""
    train_device: str = setting("auto", "where training runs: `cpu`, `cuda`, `cuda:N`; auto: cuda if available")
    extract_device: str = setting("auto", "where extraction runs the target (same choices)")
    generate_device: str = setting("auto", "where `generate` runs the target (same choices)")
    evaluate_device: str = setting("auto", "where `evaluate` runs target and draft (same choices)")
    export_dtype: Dtype = setting("bfloat16", "dtype of the exported draft's weights")
    generate_dtype: Dtype = setting("bfloat16", "compute dtype of the target in `generate`")
    generate_seed: int = setting(0, "`generate`'s sampling seed (each sequence's and reply's seed derives from it)")
    stop_token_ids: list[int] | None = setting(
        None, "where `generate` and `evaluate` stop a reply; auto: as vLLM: eos_token_id of generation_config.json "
        "(else config.json) and the tokenizer's eos_token")
    evaluate_dtype: Dtype = setting("float32", "compute dtype in `evaluate` (bf16 near-ties would be mismatches)")
    generate_batch_size: int = setting(16, "conversations decoded together by `generate`")
    generate_requests: int = setting(64, "`generate` with servers: requests in flight on each server")
    generate_timeout_s: float = setting(3600.0, "`generate` with servers: seconds one reply may take")
    generate_retries: int = setting(
        5, "`generate` with servers: retries of a request that meets no server, a timeout or a 5xx answer; a server "
        "still failing then is dropped and the others go on")
    generate_retry_wait_s: float = setting(1.0, "`generate` with servers: the first wait before a retry; it doubles")
    evaluate_batch_size: int = setting(32, "prompts decoded together by `evaluate` (same tokens at any size)")
    evaluate_depth_edges: list[int] = setting(
        [2048, 8192, 32768], "context depths splitting `evaluate`'s acceptance by depth into buckets (< 2k, 2k-8k, "
        "8k-32k, >= 32k); those starting at or past the target's max_position_embeddings are left out")
    data_workers: int | None = setting(
        None, "processes rendering the chat lines of a data file over 4 MB; auto: the CPUs / the ranks on this node, "
        "at most 32")
    shard_tokens: int = setting(65536, "tokens per shard file (a shard ends on a sequence boundary)")
    chunk_tokens: int = setting(65536, "tokens run through one target layer at a time; a longer sequence runs in "
                                "chunks of this many against its earlier chunks' keys (docs/deepseek.md); `evaluate` "
                                "batches deep prompts within it")
    kernels: Literal["auto", "triton", "torch"] = setting(
        "auto", "`auto`: Triton on CUDA (flex_attention where the head dim is not 64/128), the torch reference on "
        "CPU; `torch`: compiled flex_attention + compiled loss on CUDA")
    skip_dead_rows: bool = setting(True, "skip TTT rows whose work cannot reach the loss (exact)")
    cuda_graphs: bool | None = setting(
        None, "replay each micro-batch's forward and backward as a CUDA graph (one GPU, shards, the Triton kernels; "
        "batches padded to train.batch_tokens); auto: on for a draft of hidden size <= 1024 (launch-bound)")
    compile_ops: bool = setting(True, "on CUDA, fused RMSNorm, RoPE and SiLU·up kernels for the draft")
    prefetch: int = setting(2, "micro-batches read ahead in a background thread")
    log_every: int = setting(10, "steps between metrics.jsonl lines")
    skip_nonfinite: bool = setting(
        False, "a step whose loss or gradient is NaN/inf: `true` skips and counts it, `false` stops the run naming it")
    collective_timeout_s: float = setting(600.0, "seconds a rank waits in a collective before the run stops")


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
    experimental: ExperimentalConfig = field(default_factory=ExperimentalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    source: str = "<defaults>"                # where the config came from, for error messages
    origins: dict = field(default_factory=dict, repr=False, compare=False)   # "section.key" -> where it was set

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("source", "origins")}

    def absolute_dict(self) -> dict:
        """`to_dict` with the file and folder keys absolute: a checkpoint's config then reads from any directory."""
        out = self.to_dict()
        for name in PATH_KEYS:
            section, key = name.split(".")
            if out[section][key] is not None:
                out[section][key] = os.path.abspath(out[section][key])
        return out

    def value(self, name: str) -> object:
        section, key = name.split(".")
        return getattr(getattr(self, section), key)

    def origin(self, name: str) -> str:
        """Where "section.key" was set: the command line, a file, or the defaults."""
        return self.origins.get(name, self.source)

    def resolved_train_data_dir(self) -> str:
        return self.train.data_dir or self.extract.output_dir


# the keys naming files and folders, which a checkpoint records absolute
PATH_KEYS = ("target.path", "data.path", "extract.output_dir", "train.data_dir", "train.output_dir",
             "generate.output_path", "evaluate.prompts")

POSITIVE = ("data.max_seq_len draft.num_layers train.batch_tokens train.grad_accum train.ttt_steps train.eval_every "
            "train.checkpoint_every train.keep_checkpoints export.speculative_tokens generate.max_new_tokens "
            "evaluate.max_new_tokens evaluate.k evaluate.seeds debug.shard_tokens debug.chunk_tokens debug.log_every "
            "debug.generate_batch_size debug.evaluate_batch_size debug.prefetch train.epochs train.context_parallel "
            "vocab.draft_vocab_size debug.data_workers debug.generate_requests").split()

# keys that moved or went: an old config names the new key (or why it went) instead of "unknown key"
MOVED = {"debug": "train.kernels train.skip_dead_rows train.compile_ops train.prefetch train.collective_timeout_s "
                  "train.log_every train.skip_nonfinite extract.shard_tokens extract.chunk_tokens",
         "experimental": "draft.norm_before_residual draft.norm_output draft.lm_head_init train.freeze_lm_head "
                         "train.lk_eta"}
RENAMED = {old: f"now {new}.{old.split('.')[1]}" for new, olds in MOVED.items() for old in olds.split()}
RENAMED |= {f"{s}.device": f"now debug.{s}_device" for s in ("train", "extract", "generate", "evaluate")}
RENAMED |= {f"{s}.{k}": f"now debug.{s}_{k}" for s in ("generate", "evaluate") for k in ("batch_size", "dtype")}
RENAMED |= {"export.dtype": "now debug.export_dtype", "generate.seed": "now debug.generate_seed",
            "generate.stop_token_ids": "now debug.stop_token_ids"}
RENAMED |= {f"draft.{k}": "the draft's is always the target's" for k in (
    "hidden_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")}
RENAMED |= {f"train.{k}": "measured without gain (benchmarks/RESULTS.md)" for k in (
    "hard_label", "aux_noise", "oov_rows", "fp32_residual")}
RENAMED |= {"draft.norm_before_fc": 'now experimental.aux_norm = "concat"',
            "draft.fc_norm": 'now experimental.aux_norm = "per_layer"',
            "train.overwrite": 'now train.resume = "overwrite"', "evaluate.max_prompts": "give a shorter prompts file"}


def _sections() -> dict[str, type]:
    return {name: cls for name, cls in typing.get_type_hints(Config).items() if name not in ("source", "origins")}


def type_name(tp: object) -> str:
    """A key's type as messages and docs show it: `int`, `list[float]`, `"fatal" | "skip"`, `int | auto`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if tp is dict:
        return "table"
    if origin in (typing.Union, types.UnionType):     # X | None: "auto" in TOML
        return " | ".join("auto" if a is type(None) else type_name(a) for a in args)
    return tp.__name__


def _coerce(value: object, tp: object, where: str) -> object:
    """`value` (from TOML or JSON) checked against the annotation `tp` and converted."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{where} = {value!r}; expected one of {args}")
    if origin in (typing.Union, types.UnionType):
        if (value is None or value == "auto") and type(None) in args:
            return None
        inner = next(a for a in args if a is not type(None))
        try:
            return _coerce(value, inner, where)
        except ConfigError:
            if typing.get_origin(inner) is list:   # its own message names the bad item
                raise
            raise ConfigError(f"{where}: expected {type_name(tp)}, got {value!r}") from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of {type_name(args[0])}, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and type(value) is tp:
        return value
    if tp is dict and isinstance(value, dict):
        return dict(value)
    raise ConfigError(f"{where}: expected {type_name(tp)}, got {value!r}")


def _apply(cfg: Config, section: str, key: str, value: object, origin: str, command_line: bool = False) -> None:
    """Set section.key from `origin`; command-line text is JSON unless the key is a string (TOML's "200": a str)."""
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"{origin}: unknown section [{section}]; allowed: {', '.join(sections)}")
    name, types_ = f"{section}.{key}", typing.get_type_hints(sections[section])
    if name in RENAMED:
        raise ConfigError(f"{origin}: {name} is gone: {RENAMED[name]}")
    if key not in types_:
        raise ConfigError(f"{origin}: unknown key '{name}'; allowed keys of [{section}]: {', '.join(types_)}")
    if command_line and isinstance(value, str) and types_[key] not in (str, str | None) and value != "auto":
        try:
            value = json.loads(value.strip())
        except json.JSONDecodeError:
            pass
    setattr(getattr(cfg, section), key, _coerce(value, types_[key], f"{origin}: {name}"))
    cfg.origins[name] = origin


# The engine versions whose sources the export follows (docs/export.md); what each one's draft class reads:
ENGINES = {"vllm": "vLLM 0.34.0", "sglang": "SGLang 0.5.23"}
# the draft settings it does not read, by (format, draft.attention): an export with one on would decode with another
# draft than the one trained. vLLM: llama_eagle3.py reads all four norm flags and layer_types/sliding_window,
# deepseek_eagle3.py has no input_norm. SGLang: llama_eagle3.py reads norm_before_fc, fc_norm, norm_output and
# --speculative-draft-window-size but starts layer 0's residual from the un-normed h; kimi_k25_eagle3.py reads
# fc_norm and norm_output. (A window on an MLA draft is refused when it resolves: neither MLA class has one.)
UNREAD = {("vllm", "gqa"): (), ("vllm", "mla"): ("norm_before_fc",),
          ("sglang", "gqa"): ("norm_before_residual",), ("sglang", "mla"): ("norm_before_residual", "norm_before_fc")}
# the target families (model_type, outer or text) an engine version serves no EAGLE-3 draft for, and why: vLLM 0.34.0
# captures hidden states only from a target class implementing SupportsEagle3 (models/interfaces.py; else "Model does
# not support EAGLE3 interface", v1/worker/gpu/spec_decode/eagle/eagle3_utils.py). SGLang 0.5.23 serves every family
# read here (set_eagle3_layers_to_capture in each model file). docs/families.md has the table with its sources.
UNSERVED = {"vllm": {"glm4_moe": "its Glm4MoeForCausalLM (models/glm4_moe.py) does not implement SupportsEagle3",
                     "glm4_moe_lite": "its Glm4MoeLiteForCausalLM (models/glm4_moe_lite.py) does not implement "
                                      "SupportsEagle3"},
            "sglang": {}}
# the draft classes with one layer only (kimi_k25_eagle3.py raises on num_hidden_layers != 1); the others take several
ONE_LAYER = {("sglang", "mla")}
# the config setting behind each draft-spec flag
SETTING_KEYS = {"norm_before_residual": "experimental.norm_before_residual",
                "norm_before_fc": 'experimental.aux_norm = "concat"', "fc_norm": 'experimental.aux_norm = "per_layer"',
                "norm_output": "experimental.norm_output", "sliding_window": "draft.sliding_window"}


def check_servable_settings(cfg: Config) -> None:
    """Refuse, at start-up of a run that exports (extract, train), draft settings that an engine in export.formats
    would not read (the run checks the aux ids too, once it knows the target)."""
    x = cfg.experimental
    on = {"norm_before_residual": x.norm_before_residual, "norm_before_fc": x.aux_norm == "concat",
          "fc_norm": x.aux_norm == "per_layer", "norm_output": x.norm_output, "sliding_window": cfg.draft.sliding_window}
    kind = "mla" if cfg.draft.attention == "mla" else "gqa"
    for fmt in cfg.export.formats:
        engine = ENGINES[fmt]
        fix = 'set export.formats = ["vllm"]' if fmt == "sglang" else None
        if (fmt, kind) in ONE_LAYER and cfg.draft.num_layers != 1:
            raise ConfigError(f"{cfg.origin('draft.num_layers')}: draft.num_layers = {cfg.draft.num_layers} cannot be "
                              f"exported for {engine} (its {kind} draft has one layer); {fix or 'set it to 1'}")
        if keys := [SETTING_KEYS[flag].split(" ")[0] for flag in UNREAD[fmt, kind] if on[flag]]:
            raise ConfigError(f"{cfg.origin(keys[0])}: {keys[0]} cannot be exported for {engine} (its {kind} draft "
                              f"does not read it); {fix or f'turn {keys[0]} off'}")


def windows_ok(w: list[float]) -> bool:
    return not w or (len(w) == 2 and 0 < w[0] <= 1 and w[1] >= 1 and w[1] == int(w[1]))


def validate(cfg: Config) -> None:
    """The checks a type cannot express: ranges, paths, combinations."""
    for name in POSITIVE:
        if (value := cfg.value(name)) is not None and value <= 0:
            raise ConfigError(f"{cfg.origin(name)}: {name} = {value}; expected a positive integer")
    t, e, g, x = cfg.train, cfg.evaluate, cfg.generate, cfg.experimental
    edges = cfg.debug.evaluate_depth_edges
    ranges = {"train.max_steps": (t.max_steps >= 0, "an integer >= 0 (0: train.epochs epochs)"),
              "train.lr": (t.lr > 0, "> 0"), "train.grad_clip": (t.grad_clip > 0, "> 0"),
              "train.loss_decay": (t.loss_decay > 0, "> 0"), "train.loss_temperature": (t.loss_temperature > 0, "> 0"),
              "train.min_lr_ratio": (0 <= t.min_lr_ratio <= 1, "a number in [0, 1]"),
              "train.warmup_steps": (t.warmup_steps >= 0, "an integer >= 0"),
              "train.decay_fraction": (0 < t.decay_fraction <= 1, "a number in (0, 1]"),
              "train.weight_decay": (t.weight_decay >= 0, "a number >= 0"),
              "train.betas": (len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "two numbers in [0, 1)"),
              "train.eval_fraction": (0 <= t.eval_fraction < 1, "[0, 1)"),
              "data.windows": (windows_ok(cfg.data.windows), "[] or [share, tokens]: a share in (0, 1] and a "
                               "whole number of tokens >= 1, as [0.5, 512]"),
              "evaluate.temperature": (e.temperature >= 0, "a number >= 0 (0 = greedy)"),
              "evaluate.top_p": (0 < e.top_p <= 1, "a number in (0, 1]"),
              "generate.temperature": (g.temperature >= 0, "a number >= 0 (0 = greedy)"),
              "generate.top_p": (0 < g.top_p <= 1, "a number in (0, 1]"),
              "experimental.lk_eta": (x.lk_eta >= 0, "a number >= 0"),
              "draft.media_embedding": (cfg.draft.media_embedding == "vllm" or t.context_parallel == 1,
                                        "\"vllm\" with train.context_parallel > 1 (its split batches carry no vision "
                                        "rows)"),
              "draft.sliding_window": (cfg.draft.sliding_window == 0 or cfg.draft.sliding_window >= t.ttt_steps,
                                              f"0 (all positions) or at least train.ttt_steps = {t.ttt_steps}"),
              "debug.generate_timeout_s": (cfg.debug.generate_timeout_s > 0, "> 0"),
              "debug.generate_retries": (cfg.debug.generate_retries >= 0, "an integer >= 0"),
              "debug.generate_retry_wait_s": (cfg.debug.generate_retry_wait_s >= 0, "a number >= 0"),
              "debug.collective_timeout_s": (cfg.debug.collective_timeout_s > 0, "> 0"),
              "debug.evaluate_depth_edges": (all(a < b for a, b in zip([0, *edges], edges)),
                                             "increasing positive integers")}
    for name, (ok, expected) in ranges.items():
        if not ok:
            raise ConfigError(f"{cfg.origin(name)}: {name} = {cfg.value(name)}; expected {expected}")
    if t.resume not in ("auto", "never", "overwrite") and not Path(t.resume).is_dir():
        raise ConfigError(f"{cfg.origin('train.resume')}: train.resume = {t.resume!r}; expected 'auto', 'never', "
                          "'overwrite' or an existing checkpoint directory")
    for i, url in enumerate(g.servers):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{cfg.origin('generate.servers')}: generate.servers[{i}] = {url!r}; expected a base "
                              "URL such as \"http://127.0.0.1:8000\"")
    if reserved := sorted(RESERVED_KWARGS & set(cfg.data.chat_template_kwargs)):
        raise ConfigError(f"{cfg.origin('data.chat_template_kwargs')}: data.chat_template_kwargs may not set "
                          f"{', '.join(reserved)}: the engines set them")
    if (ids := cfg.target.aux_layer_ids) is not None and len(ids) != 3:
        raise ConfigError(f"{cfg.origin('target.aux_layer_ids')}: target.aux_layer_ids = {ids}; EAGLE-3 needs "
                          "exactly 3 layers")
    if ids is not None and ids != sorted(ids):   # vLLM and SGLang hand them to the draft in layer order
        raise ConfigError(f"{cfg.origin('target.aux_layer_ids')}: target.aux_layer_ids = {ids}; expected them in "
                          f"increasing order ({sorted(ids)}): the engines hand the layers to the draft in layer order")


# what a command reads: groups of keys of which a file or flag must set one (the defaults are the demo's)
INPUTS = {"extract": (("target.path",), ("data.path",)),
          "train": (("target.path",), ("data.path", "train.data_dir", "extract.output_dir")),
          "generate": (("target.path",), ("data.path",))}


def require_inputs(cfg: Config, command: str) -> None:
    """Refuse to run `command` on the built-in demo target or data when nothing set them (an empty config file)."""
    unset = [group for group in INPUTS[command] if not any(key in cfg.origins for key in group)]
    if not unset:
        return
    said = "sets no " + " and no ".join(" or ".join(group) for group in unset)
    if cfg.source not in cfg.origins.values():
        said = "sets nothing" if cfg.source != "<defaults>" else "no config file was read"
    defaults = ", ".join(f"{group[0]} = {json.dumps(cfg.value(group[0]))}" for group in unset)
    raise ConfigError(f"{cfg.source}: {said}, so {command} would run on the built-in demo defaults ({defaults}); "
                      f"set {' and '.join(group[0] for group in unset)} there or on the command line "
                      f"(--{unset[0][0]} ...), or run the demo: python -m eagle3 demo")


def require_trainable(cfg: Config) -> None:
    """Refuse, before extracting, sequences (up to data.max_seq_len) longer than a micro-batch trains."""
    n, tokens, ranks = cfg.data.max_seq_len, cfg.train.batch_tokens, cfg.train.context_parallel
    if n > tokens * ranks:
        raise ConfigError(f"{cfg.origin('data.max_seq_len')}: data.max_seq_len = {n} is longer than one micro-batch "
                          f"trains (train.batch_tokens = {tokens} x train.context_parallel = {ranks}: {tokens * ranks} "
                          "tokens); lower data.max_seq_len, raise train.batch_tokens, or split each micro-batch over "
                          "more ranks (train.context_parallel)")


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


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv -> (the overrides, everything else), so that overrides may stand anywhere on a command line."""
    overrides, rest, i = [], [], 0
    while i < len(argv):
        if argv[i].startswith("--") and "." in argv[i][2:].partition("=")[0]:
            takes = 1 if "=" in argv[i] or i + 1 >= len(argv) else 2
            overrides += argv[i:i + takes]
        else:
            takes = 1
            rest.append(argv[i])
        i += takes
    return overrides, rest


def load(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load `path` (TOML; None: the defaults), apply command-line overrides, validate. Raises ConfigError."""
    if path is None:
        return override(Config(), overrides or [])
    path = Path(path)
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, not a TOML config file (--config)") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return override(from_dict(data, str(path)), overrides or [])


def override(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with the command-line overrides applied, validated. Raises ConfigError."""
    for section, key, value in parse_overrides(overrides):
        _apply(cfg, section, key, value, f"command line --{section}.{key}", command_line=True)
    validate(cfg)
    return cfg


OVERRIDES_HELP = ("Any config key can be overridden: --section.key value or --section.key=value, e.g. "
                  "--train.max_steps 40 (lists as JSON: --train.betas \"[0.9, 0.95]\"). Every key with its "
                  "type, default and meaning: python -m eagle3 config.")


def check_overrides(parser, argv: list[str]) -> list[str]:
    """`argv` if it is all overrides, else the parser's usage error (exit 2) before anything runs."""
    try:
        parse_overrides(argv)
    except ConfigError as e:
        parser.error(str(e))
    return argv


def interrupted(what: str, resumes: bool = True) -> None:
    """Ctrl-C: one line instead of a traceback, and the shell's exit status for SIGINT (130)."""
    print(f"interrupted: {what}; {'the same command resumes' if resumes else 'run it again'}", file=sys.stderr)
    raise SystemExit(130)


def cli(argv: list[str] | None = None, description: str = "", prog: str | None = None,
        command: str | None = None) -> Config:
    """Entry-point helper: `--config FILE` plus overrides (for `command`, its INPUTS set); exits with the error
    message on failure."""
    import argparse
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=OVERRIDES_HELP)
    parser.add_argument("--config", default="config.toml", help="TOML config file (default: config.toml)")
    overrides, argv = split_overrides(sys.argv[1:] if argv is None else argv)
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = load(args.config, check_overrides(parser, rest + overrides))
        if command:
            require_inputs(cfg, command)
        # what extract writes, online training reads (data.max_seq_len); from shards, train checks the sequences
        # they hold (`eagle3.training.loop.data_plan`)
        if command == "extract" or command == "train" and cfg.train.source == "online":
            require_trainable(cfg)
        if command in ("extract", "train"):
            check_servable_settings(cfg)
        return cfg
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


# --- the schema as documentation ------------------------------------------------------------------

class Key(typing.NamedTuple):
    name: str                                 # section.key
    type: object
    default: object
    doc: str


APART = ("experimental", "debug")   # sections apart from the keys a user tunes: `config --all` lists them


def schema(everything: bool = True) -> list[Key]:
    """Every config key, in the schema's order (without the APART sections unless `everything`)."""
    return [Key(f"{section}.{f.name}", typing.get_type_hints(cls)[f.name],
                f.default_factory() if f.default is dataclasses.MISSING else f.default, f.metadata["doc"])
            for section, cls in _sections().items() if everything or section not in APART
            for f in dataclasses.fields(cls)]


def toml_value(value: object) -> str:
    return '"auto"' if value is None else json.dumps(value)


def _note(cfg: Config | None, key: Key, label: str, fmt: str = "{}") -> str:
    """' (label: value)' where `cfg` sets another value than the default, else ''."""
    if cfg is None or (value := cfg.value(key.name)) == key.default:
        return ""
    return f" ({label}: {fmt.format(toml_value(value))})"


def reference(cfg: Config | None = None, label: str = "set", everything: bool = False) -> str:
    """Every key with its type, default, doc and the value `cfg` sets where it is not the default."""
    lines = []
    for key in schema(everything):
        lines.append(f"{key.name}: {type_name(key.type)} = {toml_value(key.default)}{_note(cfg, key, label)}")
        lines.append(textwrap.fill(key.doc, 100, initial_indent="    ", subsequent_indent="    "))
    if not everything:
        lines.append(f"(and {len(schema()) - len(lines) // 2} more in [experimental], levers measured without a "
                     "gain, and [debug], plumbing: python -m eagle3 config --all)")
    return "\n".join(lines) + "\n"


def markdown_table(cfg: Config | None = None, label: str = "set") -> str:
    """docs/config.md's table: one row per key of every section."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key in schema():
        default = f"`{toml_value(key.default)}`" + _note(cfg, key, label, "`{}`")
        cells = (f"`{key.name}`", f"`{type_name(key.type)}`", default, key.doc)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")   # a bare | splits a cell
    return "\n".join(rows) + "\n"
