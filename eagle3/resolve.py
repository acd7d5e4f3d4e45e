"""Settings left "auto" turned into values: the device, and `resolve`'s record for a config and a target,
which checkpoints carry so that resume, evaluate and export read what training used."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from eagle3.config import Config, ConfigError
from eagle3.models.deepseek import yarn_settings
from eagle3.models.weights import Checkpoint, TargetError
from eagle3.ops import draft_rope_scaling


@dataclass
class DraftSpec:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool = False   # layer 0's residual is hidden_norm(h), not h (vLLM reads the flag)
    norm_before_fc: bool = False         # one RMSNorm over the concatenated aux states before fc
    fc_norm: bool = False                # an RMSNorm per aux state before fc
    norm_output: bool = False            # norm(h) is the head's input and the next step's state
    rope_scaling: dict | None = None     # as exported: gqa `ops.draft_rope_scaling`, mla the target's DeepSeek YaRN
    sliding_window: int = 0              # step-0 keys seen: the last N positions (0: all)
    attention: str = "gqa"               # "gqa": a Llama layer; "mla": DeepSeek-V3's latent attention (the dims below)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def attention_width(self) -> int:
        """Values per row of one layer-step's q, k and v as the TTT attention keeps them: GQA's heads of head_dim;
        MLA's q and k_nope + v per head, unpadded, and its one rotary key."""
        if self.attention != "mla":
            return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
        return self.num_attention_heads * (2 * nope + rope + self.v_head_dim) + rope


# the norm settings under the keys speculators and vLLM use (what each engine reads: config.UNREAD)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class Resolved:
    aux_layer_ids: list[int]        # target layers (0-based) whose outputs the draft reads
    draft_spec: DraftSpec
    data_dir: str                   # what training reads: the shards, or online the input file (data.path)
    verifier_name: str              # what the exported config names as the verifier

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Resolved":
        return cls(**{**d, "draft_spec": DraftSpec(**d["draft_spec"])})


def resolve(cfg: Config, ckpt: Checkpoint) -> Resolved:
    """Every "auto" of `cfg` that depends on the target, checked: a draft that cannot be built fails here."""
    text, d, x = ckpt.config, cfg.draft, cfg.experimental
    ids, n = cfg.target.aux_layer_ids or text.default_aux_layer_ids(), text.num_hidden_layers
    if any(not 0 <= i < n for i in ids):
        raise TargetError(f"{cfg.source}: target.aux_layer_ids = {ids}; the target has layers 0..{n - 1}")
    heads = d.num_attention_heads or text.num_attention_heads
    kv = d.num_key_value_heads or text.num_key_value_heads
    if heads % kv and d.attention != "mla":
        raise ConfigError(f"{cfg.source}: draft.num_attention_heads {heads} is not a multiple of "
                          f"draft.num_key_value_heads {kv}")
    hidden = text.hidden_size   # the draft's is the target's: the frozen target embedding feeds it
    try:
        scaling = draft_rope_scaling(text.rope_scaling) if x.draft_rope == "target" and d.attention != "mla" else None
    except ValueError as e:
        raise TargetError(f"{text.source}: rope_scaling: {e}; set experimental.draft_rope = \"plain\"") from None
    spec = DraftSpec(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, num_layers=d.num_layers,
        head_dim=d.head_dim or text.raw.get("head_dim") or hidden // heads, rope_theta=text.rope_theta,
        intermediate_size=d.intermediate_size or text.intermediate_size, rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings,
        draft_vocab_size=cfg.vocab.draft_vocab_size or min(32000, text.vocab_size), target_vocab_size=text.vocab_size,
        target_hidden_size=hidden, norm_before_residual=x.norm_before_residual, norm_before_fc=x.aux_norm == "concat",
        fc_norm=x.aux_norm == "per_layer", norm_output=x.norm_output, rope_scaling=scaling,
        sliding_window=d.sliding_window)
    if d.attention == "mla":
        if d.sliding_window:
            raise ConfigError(f"{cfg.source}: draft.sliding_window = {d.sliding_window} with draft.attention = "
                              "\"mla\": vLLM's and SGLang's MLA drafts attend over every key (use a gqa draft)")
        spec = replace(spec, **mla_fields(cfg, text, heads))
    elif x.mla_dims:
        raise ConfigError(f"{cfg.source}: experimental.mla_dims is set but draft.attention is "
                          f"\"{d.attention}\"; the dims shape an MLA draft only (draft.attention = \"mla\")")
    data = cfg.data.path if cfg.train.source == "online" else cfg.resolved_train_data_dir()
    verifier = cfg.export.verifier_name or hub_repo_id(cfg.target.path) or os.path.abspath(cfg.target.path)
    return Resolved(list(ids), spec, os.path.abspath(data), verifier)   # absolute: a checkpoint works from anywhere


def hub_repo_id(path: str) -> str | None:
    """The Hugging Face repo id of a target inside the hub cache (`.../models--ORG--NAME/snapshots/REV`), else None:
    `vllm serve` of a speculators draft folder takes its verifier only as such an id (vLLM 0.34
    transformers_utils/config.py, maybe_override_with_speculators, refuses a local path)."""
    parts = Path(os.path.abspath(path)).parts
    for folder, below in zip(parts, parts[1:]):
        if folder.startswith("models--") and below == "snapshots":
            return folder.removeprefix("models--").replace("--", "/", 1)
    return None


MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_fields(cfg: Config, text, heads: int) -> dict:
    """The MLA draft's DraftSpec fields: experimental.mla_dims, else the target's; checked."""
    dims = cfg.experimental.mla_dims or [text.raw.get(k) for k in MLA_DIMS]
    where = "experimental.mla_dims" if cfg.experimental.mla_dims else f"the target's config {text.source}"
    if len(dims) != len(MLA_DIMS) or not all(isinstance(n, int) and n > 0 for n in dims) or dims[3] % 2:
        raise ConfigError(f"{cfg.source}: draft.attention = \"mla\" needs {', '.join(MLA_DIMS)} as positive "
                          f"integers (an even rope dim); {where} gives {dims} (set experimental.mla_dims)")
    named = dict(zip(MLA_DIMS, dims))
    scaling = text.rope_scaling
    if scaling is not None and scaling["rope_type"] != "yarn":
        raise ConfigError(f"{cfg.source}: draft.attention = \"mla\" rotates as DeepSeek (YaRN or none); the "
                          f"target's rope_scaling is '{scaling['rope_type']}'")
    scaling = yarn_settings(scaling) if cfg.experimental.draft_rope == "target" else None   # "plain": the comparison
    return {"attention": "mla", "num_key_value_heads": heads, "rope_scaling": scaling,
            "head_dim": named["qk_nope_head_dim"] + named["qk_rope_head_dim"], **named}


def resolve_device(name: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def data_windows(cfg: Config) -> tuple[float, int]:
    """The sequences trained as windows: (share, tokens) of data.windows; (0, 0) for none."""
    share, tokens = cfg.data.windows or (0.0, 0)
    return share, int(tokens)


def data_workers(cfg: Config) -> int:
    """`debug.data_workers`, or this node's CPUs shared among its ranks (at most 32)."""
    if cfg.debug.data_workers is not None:
        return cfg.debug.data_workers
    return max(1, min(32, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
