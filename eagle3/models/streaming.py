"""Run packed tokens through the target one layer at a time: only the layer computed and the one
prefetched are resident, so a target far larger than device memory runs in two layers + activations."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from eagle3.ops import positions_from_cu_seqlens, rms_norm
from eagle3.models.attention import Prefix
from eagle3.models.weights import Checkpoint, TargetError
from eagle3.models.families import build_model
from eagle3.models.vision import MediaItem, VisionConfig, VisionTower, media_positions, merge_media, target_vision


def check_tensors(ckpt: Checkpoint, model) -> list[str]:
    """The tensors the forward reads; fail before any compute if one is absent or of the wrong shape or format, or if
    the checkpoint holds a tensor that is neither read nor skipped for a stated reason (`Checkpoint.account`)."""
    shapes = {n: s for i in range(ckpt.config.num_hidden_layers) for n, s in model.layer_shapes(i).items()}
    names = ["embed_tokens.weight", "norm.weight", "lm_head.weight", *shapes]
    missing = [n for n in names if not ckpt.has(n)]
    if missing:
        raise TargetError(f"{ckpt.weights_file}: {len(missing)} of the {len(names)} tensors the forward reads are "
                          f"missing from the checkpoint, first: {ckpt.full_name(missing[0])}")
    ckpt.outer_tensors()   # first: its errors name the config's fields
    ckpt.check_shapes(shapes)
    ckpt.account(names)
    return names


def split_chunks(cu_seqlens: list[int], chunk_tokens: int) -> list[tuple[int, int]]:
    """Group whole sequences into runs of at most chunk_tokens (a longer sequence goes alone)."""
    chunks, start = [], 0
    for i in range(1, len(cu_seqlens)):
        if cu_seqlens[i] - cu_seqlens[start] > chunk_tokens and i - 1 > start:
            chunks.append((start, i - 1))
            start = i - 1
    if len(cu_seqlens) > 1:
        chunks.append((start, len(cu_seqlens) - 1))
    return chunks


def past_positions(lengths: list[int], ckpt: Checkpoint) -> str | None:
    """A note on sequences longer than the target's max_position_embeddings: run whole, but past what it knows."""
    limit = ckpt.config.max_position_embeddings
    over = [n for n in lengths if n > limit]
    if not over:
        return None
    return (f"note: {len(over)} sequences are longer than max_position_embeddings {limit} ({ckpt.config.source}), "
            f"the longest {max(over)} tokens: the target's states past position {limit} are extrapolated; "
            "a lower data.max_seq_len cuts them")


class TargetRunner:
    """Packed token ids -> aux hidden states, post-norm final hidden state and greedy next token."""

    def __init__(self, ckpt: Checkpoint, aux_layer_ids: list[int], device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, chunk_tokens: int = 65536, resident: bool = False):
        self.ckpt, self.aux_layer_ids, self.device, self.dtype = ckpt, aux_layer_ids, device, dtype
        self.chunk_tokens = chunk_tokens
        self.resident: list | None = [] if resident else None   # every layer kept after the first pass
        self.model = build_model(ckpt, device, dtype)
        self.num_layers = ckpt.config.num_hidden_layers
        check_tensors(ckpt, self.model)
        self.embed = ckpt.get("embed_tokens.weight").to(device, dtype)
        self.norm = ckpt.get("norm.weight").to(device, dtype)
        self.head = ckpt.get("lm_head.weight").to(device, dtype)
        self._pool = ThreadPoolExecutor(max_workers=1)
        self.media = MediaInputs(ckpt, device, dtype)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, cu_seqlens: list[int], media: list[MediaItem] = (),
            context: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """input_ids [T], cu_seqlens (python ints), the sequences' media in order, `context` bool [T] (loss_mask 0:
        where placeholders are; None: everywhere) -> CPU aux [T, 3H], final [T, H], argmax [T] int32 (and with
        media, `media_embeds` [M, H]: the fused rows written at the placeholders)."""
        cu = cu_seqlens
        features = self.media.features(media)
        rows = self.media.rows(input_ids, cu, features, context)
        outs = [self._run_chunk(input_ids[cu[a]:cu[b]], [c - cu[a] for c in cu[a:b + 1]], features[rows[a]:rows[b]],
                                None if context is None else context[cu[a]:cu[b]])
                for a, b in split_chunks(cu, self.chunk_tokens)]
        out = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
        return out | ({"media_embeds": features.cpu()} if media else {})

    def _run_chunk(self, ids: torch.Tensor, cu: list[int], features: torch.Tensor,
                   context: torch.Tensor | None) -> dict[str, torch.Tensor]:
        h = self.media.embed(self.embed, ids.to(self.device, torch.long), features, context)
        h, captured = run_layers(self.model, enumerate(self._layers()), h,
                                 cu, self.aux_layer_ids, self.chunk_tokens, to_host=True)
        final = final_norm(h, self.norm, self.model.cfg.rms_norm_eps, self.chunk_tokens)
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        return {"aux_hidden": aux, "final_hidden": final.cpu(), "target_argmax": greedy_argmax(final, self.head).cpu()}

    def _layers(self):
        """Each layer's weights: streamed (the next one loads meanwhile), or the resident ones."""
        if self.resident is not None and len(self.resident) == self.num_layers:
            yield from self.resident
            return
        loaded = []
        pending = self._pool.submit(self.model.load_layer, 0)
        for i in range(self.num_layers):
            weights = pending.result()
            if i + 1 < self.num_layers:
                pending = self._pool.submit(self.model.load_layer, i + 1)
            if self.resident is not None:
                loaded.append(weights)
            yield weights
        if self.resident is not None:   # only a whole pass: one cut short by an error loads again
            self.resident = loaded


class MediaInputs:
    """The first layer's input with media: token embeddings, the vision tower's rows at the placeholders. The tower's
    settings and weights are read at the first media item (a text-only run never reads them)."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype):
        self.ckpt, self.device, self.dtype = ckpt, device, dtype
        self._config: VisionConfig | None = None
        self.tower: VisionTower | None = None

    @property
    def config(self) -> VisionConfig:
        if self._config is None:
            self._config = target_vision(self.ckpt)
            if self._config is None:
                raise TargetError(f"{self.ckpt.dir}: images or video given, but the target has no vision tower "
                                  f"({self.ckpt.config.needs})")
        return self._config

    def features(self, media: list[MediaItem]) -> torch.Tensor:
        """[sum of placeholders, H] in order ([0, H] without media)."""
        if not media:
            return torch.zeros(0, self.ckpt.config.hidden_size, device=self.device, dtype=self.dtype)
        if self.tower is None:
            self.tower = VisionTower(self.ckpt, self.config, self.device, self.dtype)
        return self.tower.features(list(media))

    def rows(self, ids: torch.Tensor, cu: list[int], features: torch.Tensor,
             context: torch.Tensor | None = None) -> list[int]:
        """The feature rows before each sequence boundary: sequence i's are rows[i]..rows[i+1]."""
        if features.shape[0] == 0:
            return [0] * len(cu)
        pads = media_positions(ids, self.config.pad_id, context)
        return torch.cat([torch.zeros(1, dtype=torch.long), pads.long().cumsum(0)])[torch.tensor(cu)].tolist()

    def embed(self, table: torch.Tensor, ids: torch.Tensor, features: torch.Tensor,
              context: torch.Tensor | None = None) -> torch.Tensor:
        h = table[ids]
        if features.shape[0] == 0:
            return h
        return merge_media(h, ids, features, self.config.pad_id, None if context is None else context.to(ids.device))


def run_layers(model, layers, h: torch.Tensor, cu: list[int], aux_layer_ids: list[int], chunk_tokens: int,
               to_host: bool = False):
    """h [T, H] of packed sequences `cu` through `layers` ((i, weights) pairs) -> (h, {aux layer i: h}), the aux
    states copied to the host as they come if `to_host`; one sequence longer than chunk_tokens (`split_chunks`
    puts it alone) runs chunk_tokens tokens at a time per layer."""
    cu_t = torch.tensor(cu).to(h.device, non_blocking=True)   # no wait for the queued work
    positions = positions_from_cu_seqlens(cu_t, h.shape[0])
    long = len(cu) == 2 and h.shape[0] > chunk_tokens
    captured = {}
    for i, weights in layers:
        h = (chunked_layer(model, weights, h, positions, chunk_tokens) if long
             else model.layer_forward(weights, h, positions, cu_t))
        if i in aux_layer_ids:
            captured[i] = h.cpu() if to_host else h
    return h, captured


def chunked_layer(model, weights, h: torch.Tensor, positions: torch.Tensor, chunk: int) -> torch.Tensor:
    """One sequence h [T, H] through one layer `chunk` tokens at a time: each chunk's queries attend to what the
    earlier chunks left in the layer's `Prefix` (MLA: the latent), so no activation grows with T but h itself."""
    prefix, out = Prefix(h.shape[0]), torch.empty_like(h)
    for a in range(0, h.shape[0], chunk):
        b = min(a + chunk, h.shape[0])
        out[a:b] = model.layer_forward(weights, h[a:b], positions[a:b], None, cache=prefix)
    return out


def final_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, rows: int) -> torch.Tensor:
    """rms_norm of h [T, H], `rows` tokens at a time: its fp32 temporaries stay chunk-sized."""
    out = torch.empty_like(h)
    for a in range(0, h.shape[0], rows):
        out[a:a + rows] = rms_norm(h[a:a + rows], weight, eps)
    return out


def greedy_argmax(final: torch.Tensor, head: torch.Tensor, rows: int = 4096, vocab_chunk: int = 32768) -> torch.Tensor:
    """argmax_v(final @ head.T) without holding [T, V] logits: [T] int32."""
    out = torch.empty(final.shape[0], dtype=torch.int32, device=final.device)
    for r in range(0, final.shape[0], rows):
        x = final[r:r + rows]
        best = torch.full((x.shape[0],), float("-inf"), device=x.device)
        best_idx = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        for v in range(0, head.shape[0], vocab_chunk):
            val, idx = (x @ head[v:v + vocab_chunk].T).float().max(-1)
            better = val > best  # strict: ties keep the lowest id, like torch.argmax
            best, best_idx = torch.where(better, val, best), torch.where(better, idx + v, best_idx)
        out[r:r + rows] = best_idx.to(torch.int32)
    return out
