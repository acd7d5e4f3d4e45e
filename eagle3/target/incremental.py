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
        """One sequence's cache: a dict per layer."""
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

    def forward(self, ids: torch.Tensor, cache: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Process the next ids [n] of one sequence -> (aux [n, 3H], post-norm final [n, H])."""
        return self.forward_many([ids], [cache])[0]

    @torch.no_grad()
    def forward_many(self, chunks: list[torch.Tensor], caches: list[list[dict]]) -> list[tuple]:
        """The next tokens of several sequences in one batched pass (matmuls over all of them,
        attention per sequence against its own cache) -> [(aux, final)] per sequence."""
        lengths = [c.numel() for c in chunks]
        cu = torch.tensor([0] + lengths, device=self.device).cumsum(0)
        starts = torch.tensor([self.cached_tokens(c) for c in caches], device=self.device)
        positions = positions_from_cu_seqlens(cu, int(cu[-1])) + starts.repeat_interleave(
            torch.tensor(lengths, device=self.device))
        h = self.embed[torch.cat(chunks).to(self.device)]
        captured = {}
        for i, weights in enumerate(self.layers):
            h = self.model.layer_forward(weights, h, positions, cu, cache=[c[i] for c in caches])
            if i in self.aux_layer_ids:
                captured[i] = h
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        final = rms_norm(h, self.norm, self.eps)
        return list(zip(aux.split(lengths), final.split(lengths)))

    def greedy(self, final: torch.Tensor) -> torch.Tensor:
        return self.logits(final).argmax(-1)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        return (final @ self.head.T).float()
