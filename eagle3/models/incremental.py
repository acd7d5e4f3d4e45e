"""The whole target resident with one KV pool (a slot per sequence), decoding many sequences a few tokens at a
time: per layer one indexed copy of the new keys and one padded attention call for all short chunks."""
from __future__ import annotations

import heapq
import weakref

import torch

from eagle3.ops import rms_norm
from eagle3.models.weights import Checkpoint
from eagle3.models.attention import cached_attention, padded_cached_attention
from eagle3.models.streaming import MediaInputs, build_model, check_tensors
from eagle3.models.vision import media_positions

# chunks up to this long attend batched, padded to a power of two; longer ones (prompts, few) one at a time
SHORT_MAX = 64


class KVPool:
    """Per layer a k and a v buffer [slots, capacity, heads, D], allocated at its first write, grown by
    doubling. Slots go lowest first: the live ones stay at the front, usually read as one slice."""

    def __init__(self, layers: int):
        self.k, self.v = [None] * layers, [None] * layers   # per layer [slots, capacity, heads, D] or None
        self.kept = [None] * layers      # per layer [slots, capacity, ...] of other rows (the DSA indexer's keys)
        self.slots = self.capacity = 0          # allocated sizes, the same for every layer
        self.used, self.free = 0, []            # slots ever handed out; heap of released ones

    def acquire(self) -> int:
        if self.free:
            return heapq.heappop(self.free)
        self.used += 1
        return self.used - 1

    def release(self, slot: int) -> None:
        heapq.heappush(self.free, slot)

    def reserve(self, slots: int, capacity: int) -> None:
        """Make room for slots 0..slots-1 holding `capacity` positions each."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = self.slots if slots <= self.slots else max(slots, 2 * self.slots)
        new_cap = self.capacity if capacity <= self.capacity else max(capacity, 2 * self.capacity, 64)
        for bufs in (self.k, self.v, self.kept):
            for i, old in enumerate(bufs):
                if old is not None:
                    # zeros, not empty: masked keys still enter q.k, and NaN garbage would leak
                    bufs[i] = old.new_zeros(new_slots, new_cap, *old.shape[2:])
                    bufs[i][:self.slots, :self.capacity] = old
        self.slots, self.capacity = new_slots, new_cap

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store new k/v [T, heads, D] at flat index [T] (slot * capacity + position) -> the buffers."""
        return tuple(self._store(bufs, layer, index, new) for bufs, new in ((self.k, k), (self.v, v)))

    def keep(self, layer: int, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Store other per-token rows [T, ...] as `write` does -> their buffer [slots, capacity, ...]."""
        return self._store(self.kept, layer, index, rows)

    def _store(self, bufs: list, layer: int, index: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        if bufs[layer] is None:
            bufs[layer] = new.new_zeros(self.slots, self.capacity, *new.shape[1:])
        bufs[layer].view(-1, *new.shape[1:]).index_copy_(0, index, new)
        return bufs[layer]


class SequenceCache:
    """One sequence's slot in the pool and how many positions it holds; dropped, the slot is freed. `rows`: the
    vision tower's rows [M, H] for the media pads it has yet to see, in order."""
    __slots__ = ("slot", "length", "rows", "__weakref__")

    def __init__(self, pool: KVPool, rows: torch.Tensor | None = None):
        self.slot, self.length, self.rows = pool.acquire(), 0, rows
        weakref.finalize(self, pool.release, self.slot).atexit = False   # nothing to free at exit


class _Group:
    """Sequences whose chunks pad to length n, attended in one call: R pool `rows`, each token's padded row
    (`pad_index`), which packed `tokens` they are (None: all), where each row's new tokens start (`start_row`)."""

    def __init__(self, n: int, members: torch.Tensor, slots, starts, ends, seq, offset):
        self.n, ms = n, slots[members]
        lo, hi = int(ms.min()), int(ms.max()) + 1
        if hi - lo <= 2 * len(members):    # slots close together: a view of the pool, no gather
            self.rows, row, R = slice(lo, hi), ms - lo, hi - lo
        else:
            self.rows, row, R = ms, torch.arange(len(members)), len(members)
        row_of_seq = torch.full_like(slots, -1)
        row_of_seq[members] = row
        tokens = (row_of_seq[seq] >= 0).nonzero().flatten()                     # [t]
        self.pad_index = row_of_seq[seq[tokens]] * n + offset[tokens]           # [t]
        self.tokens = None if len(tokens) == len(seq) else tokens
        self.start_row = torch.zeros(R, dtype=torch.long)   # rows of no member: see key 0 only
        self.start_row[row] = starts[members]
        self.keys = int(ends[members].max())                                    # L
        self._masks = {}

    def mask(self, group: int, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
        """Additive mask [R, 1, n * group, L] for padded_cached_attention's folded queries, kept for the
        pass (a boolean one is converted by every layer); rows padded to 16 keys, as fused kernels want.
        With `window` > 0 a query sees the keys less than `window` positions back."""
        if (group, dtype, window) not in self._masks:
            device, width = self.start_row.device, -(-self.keys // 16) * 16
            last = (self.start_row[:, None] + torch.arange(self.n, device=device)).repeat_interleave(group, 1)
            back = last[:, None, :, None] - torch.arange(width, device=device)   # [R, 1, n * group, width]
            hidden = back < 0
            if window:
                hidden |= back >= window
                hidden[..., 0] &= ~hidden[..., :self.keys].all(-1)   # a padding row past its window sees key 0: finite
            bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
            self._masks[(group, dtype, window)] = bias[..., :self.keys]
        return self._masks[(group, dtype, window)]


class PassLayout:
    """Where the packed tokens of a pass go and what each query sees: built on the host, sent in one copy."""

    def __init__(self, pool: KVPool, caches: list[SequenceCache], lengths: list[int], device: torch.device):
        if len({c.slot for c in caches}) < len(caches):
            raise ValueError("forward_many: the same cache twice in one pass")
        slots = torch.tensor([c.slot for c in caches])
        starts = torch.tensor([c.length for c in caches])
        n = torch.tensor(lengths)
        ends, T = starts + n, sum(lengths)
        pool.reserve(int(slots.max()) + 1, int(ends.max()))
        cu = torch.cat([n.new_zeros(1), n.cumsum(0)])                              # [B+1]
        seq = torch.arange(len(caches)).repeat_interleave(n, output_size=T)        # [T] sequence of each token
        offset = torch.arange(T) - cu[seq]                                         # [T] index in its chunk
        positions = starts[seq] + offset                                           # [T]
        sizes = {1 << (x - 1).bit_length() for x in lengths if 0 < x <= SHORT_MAX}   # next power of two
        self.groups = [_Group(size, ((n > size // 2) & (n <= size)).nonzero().flatten(),
                              slots, starts, ends, seq, offset) for size in sorted(sizes)]
        bounds = cu.tolist()
        self.long = [(bounds[b], bounds[b + 1], c.slot, c.length)
                     for b, (c, x) in enumerate(zip(caches, lengths)) if x > SHORT_MAX]
        self.cu, self.positions, self.write_index = cu, positions, slots[seq] * pool.capacity + positions
        fields = [(self, a) for a in ("cu", "positions", "write_index")] + [(g, a) for g in self.groups for a in (
            "rows", "pad_index", "tokens", "start_row") if isinstance(getattr(g, a), torch.Tensor)]
        host = [getattr(obj, a) for obj, a in fields]
        flat = torch.cat([t.flatten() for t in host]).to(device)   # small int64 tensors: one copy
        for (obj, a), t, part in zip(fields, host, flat.split([t.numel() for t in host])):
            setattr(obj, a, part.view(t.shape))


class LayerPass:
    """A layer's `cache` in a batched pass, which the layer's attention calls `attend` on."""

    def __init__(self, pool: KVPool, layer: int, layout: PassLayout):
        self.pool, self.layer, self.layout = pool, layer, layout

    def attend(self, q, k, v, scale=None, window: int = 0, sinks=None) -> torch.Tensor:
        """q [T, Hq, D], this pass's k/v [T, Hkv, D|Dv] -> [T, Hq, Dv]; `window` > 0: each query sees the keys
        less than `window` positions back (a sliding-window draft or target layer); `sinks` [Hq]: gpt-oss's."""
        lay = self.layout
        k_cache, v_cache = self.pool.write(self.layer, lay.write_index, k, v)
        group = q.shape[1] // k.shape[1]                            # query heads per kv head

        def batched(g, q):
            return padded_cached_attention(q, k_cache, v_cache, g.rows, g.pad_index, g.mask(group, q.dtype, window),
                                           scale, sinks)

        if len(lay.groups) == 1 and lay.groups[0].tokens is None:   # decode / verify: all in one call
            return batched(lay.groups[0], q)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for g in lay.groups:
            out.index_copy_(0, g.tokens, batched(g, q.index_select(0, g.tokens)))
        for a, b, slot, start in lay.long:   # causal over what the slot holds (no [T, n] mask without a window)
            ks, vs = k_cache[slot, :start + b - a], v_cache[slot, :start + b - a]
            out[a:b] = cached_attention(q[a:b], ks, vs, scale, window, sinks)
        return out

    def keep(self, rows: torch.Tensor) -> torch.Tensor:
        """This pass's other per-token rows [T, ...] of the layer (the DSA indexer's keys) -> [slots, capacity, ...]."""
        return self.pool.keep(self.layer, self.layout.write_index, rows)

    def sequences(self):
        """(a, b, slot, start) of each sequence in the pass: its tokens a..b, pool slot, positions already held."""
        cu = self.layout.cu.tolist()
        runs = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]
        first = self.layout.write_index[[a for a, _ in runs]].tolist()
        return [(a, b, f // self.pool.capacity, f % self.pool.capacity) for (a, b), f in zip(runs, first)]

    def cached(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's k/v [length, heads, D] of a slot, this pass's included (after `attend`)."""
        return self.pool.k[self.layer][slot, :length], self.pool.v[self.layer][slot, :length]


class IncrementalTarget:
    """`chunk_tokens`: a pass over more tokens (a long prompt's prefill) runs as several, bounding its activations."""

    def __init__(self, ckpt: Checkpoint, aux_layer_ids: list[int], device: torch.device,
                 dtype: torch.dtype = torch.float32, chunk_tokens: int | None = None):
        self.aux_layer_ids, self.device, self.chunk_tokens = aux_layer_ids, device, chunk_tokens
        self.model = build_model(ckpt, device, dtype)
        check_tensors(ckpt, self.model)
        self.layers = [self.model.load_layer(i) for i in range(ckpt.config.num_hidden_layers)]
        self.embed = ckpt.get("embed_tokens.weight").to(device, dtype)
        self.norm = ckpt.get("norm.weight").to(device, dtype)
        self.head = ckpt.get("lm_head.weight").to(device, dtype)
        self.eps = ckpt.config.rms_norm_eps
        self.pool = KVPool(len(self.layers))
        self.media = MediaInputs(ckpt, device, dtype)

    def new_cache(self, media: list = ()) -> SequenceCache:
        """A sequence's cache; `media`: the MediaItems of its prompt's pads, run through the vision tower now."""
        return SequenceCache(self.pool, self.media.features(media) if media else None)

    def fresh_pool(self) -> None:
        """A new, empty KV pool: the next batch sizes it (slots x capacity) on its own, not on earlier batches'
        (many short prompts, then a few long ones, would otherwise allocate the product)."""
        self.pool = KVPool(len(self.layers))

    @torch.no_grad()
    def forward_many(self, chunks: list[torch.Tensor], caches: list[SequenceCache],
                     contexts: list[torch.Tensor] | None = None) -> list[tuple]:
        """The next tokens of several sequences in one batched pass -> [(aux, final)] per sequence; over
        `chunk_tokens` tokens, one sequence at a time in pieces of `chunk_tokens`. `contexts`: per chunk bool, where
        its media pads may be (not a reply the model wrote; None: anywhere)."""
        contexts = contexts or [None] * len(chunks)
        if self.chunk_tokens is None or sum(c.numel() for c in chunks) <= self.chunk_tokens:
            return self._pass(chunks, caches, contexts)
        pieces = ([self._pass([piece], [cache], [None if context is None else context[a:a + len(piece)]])[0]
                   for a, piece in zip(range(0, len(chunk), self.chunk_tokens), chunk.split(self.chunk_tokens))]
                  for chunk, cache, context in zip(chunks, caches, contexts))
        return [tuple(torch.cat(part) for part in zip(*parts)) for parts in pieces]

    def _pass(self, chunks: list[torch.Tensor], caches: list[SequenceCache], contexts: list) -> list[tuple]:
        lengths = [c.numel() for c in chunks]
        layout = PassLayout(self.pool, caches, lengths, self.device)
        h = self._embed(chunks, caches, contexts)
        captured = {}
        for i, weights in enumerate(self.layers):
            h = self.model.layer_forward(weights, h, layout.positions, layout.cu, cache=LayerPass(self.pool, i, layout))
            if i in self.aux_layer_ids:
                captured[i] = h
        for cache, n in zip(caches, lengths):
            cache.length += n
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        final = rms_norm(h, self.norm, self.eps)
        return list(zip(aux.split(lengths), final.split(lengths)))

    def _embed(self, chunks: list[torch.Tensor], caches: list[SequenceCache], contexts: list) -> torch.Tensor:
        """The chunks' token embeddings, the caches' next vision rows at their prompts' media pads: only those, as
        the engines place them (a reply that samples the pad id embeds it as a token)."""
        ids = torch.cat(chunks).to(self.device)
        h, offset = self.embed[ids], 0
        for chunk, cache, context in zip(chunks, caches, contexts):
            if cache.rows is not None and len(cache.rows):
                where = media_positions(chunk, self.media.config.pad_id, context).nonzero().squeeze(1)
                where = where[:len(cache.rows)]
                h[offset + where.to(self.device)] = cache.rows[:len(where)].to(h.dtype)
                cache.rows = cache.rows[len(where):]
            offset += len(chunk)
        return h

    def greedy(self, final: torch.Tensor) -> torch.Tensor:
        return self.logits(final).argmax(-1)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        return (final @ self.head.T).float()
