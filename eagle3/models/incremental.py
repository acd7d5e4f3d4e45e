"""The whole target resident with a KV cache, for decoding many sequences a few tokens at a time
(speculative-decoding checks and response regeneration; extraction streams layers instead).

All sequences share one KV pool: per layer a key and a value buffer [slots, capacity, heads, D],
a slot per sequence. A pass writes every new key/value with one indexed copy per layer and runs
the short chunks (decode: 1 token, verify: k+1) of all sequences through one padded attention
call per layer, so a pass costs O(layers) kernel launches whatever the number of sequences."""
from __future__ import annotations

import heapq
import weakref

import torch

from eagle3.ops import rms_norm
from eagle3.models.weights import Checkpoint
from eagle3.models.attention import cached_attention, causal_cached_attention, padded_cached_attention
from eagle3.models.streaming import build_model

# Chunks up to this many tokens attend batched, padded to the next power of two (<= 2x wasted
# queries); longer ones (prompts, user turns) attend one sequence at a time: few, and padding a
# whole batch to a prompt's length would cost far more than their launches.
SHORT_MAX = 64


class KVPool:
    """Keys and values of every sequence a target decodes: per layer one buffer pair
    [slots, capacity, heads, D] (allocated at the layer's first write, when the model's k/v shapes
    and dtype are known), grown by doubling. Slots are handed out lowest first, so the live ones
    stay packed at the front and a pass usually reads them as one slice of the buffers."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
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
        for bufs in (self.k, self.v):
            for i, old in enumerate(bufs):
                if old is not None:
                    # zeros, not empty: masked keys still enter q.k, and NaN garbage would leak
                    bufs[i] = old.new_zeros(new_slots, new_cap, *old.shape[2:])
                    bufs[i][:self.slots, :self.capacity] = old
        self.slots, self.capacity = new_slots, new_cap

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store a pass's new k/v [T, heads, D] at flat positions index [T] (slot * capacity +
        position) -> the layer's buffers [slots, capacity, heads, D]."""
        if self.k[layer] is None:
            self.k[layer] = k.new_zeros(self.slots, self.capacity, *k.shape[1:])
            self.v[layer] = v.new_zeros(self.slots, self.capacity, *v.shape[1:])
        for buf, new in ((self.k[layer], k), (self.v[layer], v)):
            buf.view(-1, *new.shape[1:]).index_copy_(0, index, new)
        return self.k[layer], self.v[layer]


class SequenceCache:
    """One sequence's KV cache: its slot in the target's pool and how many positions it holds.
    Dropping the handle gives the slot back to the pool."""
    __slots__ = ("slot", "length", "__weakref__")

    def __init__(self, pool: KVPool):
        self.slot, self.length = pool.acquire(), 0
        weakref.finalize(self, pool.release, self.slot).atexit = False   # nothing to free at exit


class _Group:
    """Sequences whose chunks pad to the same length n, attended in one call: R rows of the pool
    (`rows`: a slice, or an index of slots), each token's padded row r * n + i (`pad_index`),
    which packed tokens they are (`tokens`; None: all, in order), and where each row's new
    tokens start (`start_row` [R]: query i of row r sees keys 0 .. start + i)."""

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

    def host_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.rows, self.pad_index, self.tokens, self.start_row) if isinstance(t, torch.Tensor)]

    def adopt(self, device_tensors: list[torch.Tensor]) -> None:
        """Take the device copies of host_tensors()."""
        it = iter(device_tensors)
        if isinstance(self.rows, torch.Tensor):
            self.rows = next(it)
        self.pad_index = next(it)
        self.tokens = next(it) if self.tokens is not None else None
        self.start_row = next(it)

    def mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [R, 1, n * group, L] for queries folded as padded_cached_attention does
        (row i * group + g: query i, head g of a kv head's group): 0 visible, -inf not. Built at
        the first layer and kept for the pass (a boolean one would be converted by every layer);
        its rows padded to 16 keys in memory, the alignment the fused kernels want."""
        if (group, dtype) not in self._masks:
            device, width = self.start_row.device, -(-self.keys // 16) * 16
            last = (self.start_row[:, None] + torch.arange(self.n, device=device)).repeat_interleave(group, 1)
            hidden = torch.arange(width, device=device) > last[:, None, :, None]   # [R, 1, n * group, width]
            bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
            self._masks[(group, dtype)] = bias[..., :self.keys]
        return self._masks[(group, dtype)]


class PassLayout:
    """Where the packed tokens of one pass over several sequences go and what each query sees:
    built once per pass on the host, copied to the device in one transfer, used by every layer."""

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
        sizes = {_padded(x) for x in lengths if 0 < x <= SHORT_MAX}
        self.groups = [_Group(size, ((n > size // 2) & (n <= size)).nonzero().flatten(),
                              slots, starts, ends, seq, offset) for size in sorted(sizes)]
        bounds = cu.tolist()
        self.long = [(bounds[b], bounds[b + 1], c.slot, c.length)
                     for b, (c, x) in enumerate(zip(caches, lengths)) if x > SHORT_MAX]
        host = [cu, positions, slots[seq] * pool.capacity + positions]
        for g in self.groups:
            host += g.host_tensors()
        on_device = _to_device(host, device)
        self.cu, self.positions, self.write_index = on_device[:3]
        at = 3
        for g in self.groups:
            k = len(g.host_tensors())
            g.adopt(on_device[at:at + k])
            at += k


def _padded(x: int) -> int:
    """Chunk length -> the power of two it is padded to."""
    return 1 << (x - 1).bit_length()


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Small host int64 tensors -> device, in one copy."""
    flat = torch.cat([t.flatten() for t in tensors]).to(device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


class LayerPass:
    """What a layer's forward gets as `cache` in a batched pass (attention.cached_attention_packed calls
    attend): the pool, the layer and the pass's layout."""

    def __init__(self, pool: KVPool, layer: int, layout: PassLayout):
        self.pool, self.layer, self.layout = pool, layer, layout

    def attend(self, q, k, v, scale=None) -> torch.Tensor:
        """q [T, Hq, D], this pass's k/v [T, Hkv, D|Dv] -> attention output [T, Hq, Dv]."""
        lay = self.layout
        k_cache, v_cache = self.pool.write(self.layer, lay.write_index, k, v)
        group = q.shape[1] // k.shape[1]                            # query heads per kv head

        def batched(g, q):
            return padded_cached_attention(q, k_cache, v_cache, g.rows, g.pad_index, g.mask(group, q.dtype), scale)

        if len(lay.groups) == 1 and lay.groups[0].tokens is None:   # decode / verify: all in one call
            return batched(lay.groups[0], q)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for g in lay.groups:
            out.index_copy_(0, g.tokens, batched(g, q.index_select(0, g.tokens)))
        for a, b, slot, start in lay.long:
            attend = causal_cached_attention if start == 0 else cached_attention
            out[a:b] = attend(q[a:b], k_cache[slot, :start + b - a], v_cache[slot, :start + b - a], scale)
        return out


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
        self.pool = KVPool(len(self.layers))

    def new_cache(self) -> SequenceCache:
        """One sequence's cache (a slot of the shared pool, freed when the handle is dropped)."""
        return SequenceCache(self.pool)

    @staticmethod
    def cached_tokens(cache: SequenceCache) -> int:
        return cache.length

    @staticmethod
    def crop(cache: SequenceCache, n: int) -> None:
        """Forget every cached position from n on (rejected draft tokens): later writes overwrite them."""
        cache.length = min(cache.length, n)

    def forward(self, ids: torch.Tensor, cache: SequenceCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Process the next ids [n] of one sequence -> (aux [n, 3H], post-norm final [n, H])."""
        return self.forward_many([ids], [cache])[0]

    @torch.no_grad()
    def forward_many(self, chunks: list[torch.Tensor], caches: list[SequenceCache]) -> list[tuple]:
        """The next tokens of several sequences in one batched pass (matmuls over all of them, the
        short chunks' attention in one call per layer) -> [(aux, final)] per sequence."""
        lengths = [c.numel() for c in chunks]
        layout = PassLayout(self.pool, caches, lengths, self.device)
        h = self.embed[torch.cat(chunks).to(self.device)]
        captured = {}
        for i, weights in enumerate(self.layers):
            h = self.model.layer_forward(weights, h, layout.positions, layout.cu,
                                         cache=LayerPass(self.pool, i, layout))
            if i in self.aux_layer_ids:
                captured[i] = h
        for cache, n in zip(caches, lengths):
            cache.length += n
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        final = rms_norm(h, self.norm, self.eps)
        return list(zip(aux.split(lengths), final.split(lengths)))

    def greedy(self, final: torch.Tensor) -> torch.Tensor:
        return self.logits(final).argmax(-1)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        return (final @ self.head.T).float()
