"""Settings left "auto" in the config turned into values, in one place for every stage (the
device; the target layers whose outputs the draft reads)."""
from __future__ import annotations

import torch

from eagle3.config import Config
from eagle3.models.checkpoint import Checkpoint, TargetError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_aux_layer_ids(cfg: Config, ckpt: Checkpoint) -> list[int]:
    ids = cfg.target.aux_layer_ids or ckpt.config.default_aux_layer_ids()
    n = ckpt.config.num_hidden_layers
    if any(not 0 <= i < n for i in ids):
        raise TargetError(f"{cfg.source}: target.aux_layer_ids = {ids}; the target has layers 0..{n - 1}")
    return list(ids)
