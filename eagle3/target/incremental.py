"""The whole target resident with a KV cache, for decoding one sequence token by token
(speculative-decoding checks and response regeneration; extraction streams layers instead)."""
from __future__ import annotations

import torch

from eagle3.ops import positions_from_cu_seqlens, rms_norm
from eagle3.target.checkpoint import Checkpoint
from eagle3.target.streaming import build_model


class IncrementalTarget:
    def __init__(self, ckpt: Checkpoint, aux_layer_ids: list[int], device: torch.device,
                 dtype: torch.dtype = torch.float32):
        self.aux_layer_ids, self.device = aux_layer_ids, device
        self.model = build_model(ckpt, device, dtype)
        self.layers = [self.model.load_layer(i) for i in range(ckpt.config.num_hidden_layers)]
        self.embed = ckpt.get("embed_tokens.weight").to(device, dtype)
        self.norm = ckpt.get("norm.weight").to(device, dtype)
        self.head = ckpt.get("lm_head.weight").to(device, dtype)
        self.eps = ckpt.config.rms_norm_eps

    def new_cache(self) -> list[dict]:
        return [{} for _ in self.layers]

    @staticmethod
    def cached_tokens(cache: list[dict]) -> int:
        return next(iter(cache[0].values())).shape[0] if cache[0] else 0

    @staticmethod
    def crop(cache: list[dict], n: int) -> None:
        """Forget every cached position from n on (rejected draft tokens)."""
        for layer in cache:
            for name in layer:
                layer[name] = layer[name][:n]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Process the next ids [n] of the sequence -> (aux [n, 3H], post-norm final [n, H])."""
        start = self.cached_tokens(cache)
        cu = torch.tensor([0, ids.numel()], device=self.device)
        positions = positions_from_cu_seqlens(cu, ids.numel()) + start
        h = self.embed[ids.to(self.device)]
        captured = {}
        for i, (weights, layer_cache) in enumerate(zip(self.layers, cache)):
            h = self.model.layer_forward(weights, h, positions, cu, cache=layer_cache)
            if i in self.aux_layer_ids:
                captured[i] = h
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        return aux, rms_norm(h, self.norm, self.eps)

    def greedy(self, final: torch.Tensor) -> torch.Tensor:
        return (final @ self.head.T).float().argmax(-1)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        return (final @ self.head.T).float()
