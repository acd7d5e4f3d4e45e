"""Kimi-K2.5's vision path beside its language model: the MoonViT tower and the `mm_projector`, read from the
checkpoint's `vision_tower.*` / `mm_projector.*` tensors as published, turning images and video chunks into the
embeddings that replace the `<|media_pad|>` tokens before the first layer.

The interface with the data side (eagle3/data): a record with media carries `media: list[MediaItem]` in order of
appearance; each item's `pixel_values` are laid out as the Kimi-K2.5 image / video processor gives them for that
item ([t*h*w, 3, 14, 14] float32, frames then patch rows then patch columns, normalized), `grid_thw` = (t, h, w) in
patches (t = 1 for an image, the frames of one chunk for video), and the record's token ids hold exactly
`VisionConfig.pads(grid_thw)` = (h/2)*(w/2) placeholder ids per item (frames pooled), in the same order; nothing else
is needed. `VisionTower.features` gives the fused rows [sum of pads, H] in that order and `merge_media` writes them at
the placeholders of the embedded ids: the target runners do both (`streaming.MediaInputs`: extraction, online,
staged, incremental decoding), and return the rows as `media_embeds` for the draft's input under SGLang's rule
(`media_rule_pad`, `draft.media_embedding`).

The math (transformers 5.24 `Kimi_K25VisionModel` / `Kimi_K25MultimodalProjection`; vLLM 0.34 `kimi_k25_vit.py`):
patches -> 14x14 conv -> + the learned 64x64 position grid resized bicubically to (h, w) (+ a sinusoidal time row
per frame of a video chunk) -> N pre-LayerNorm layers (fused `wqkv` with 2-D rotary on interleaved pairs: x then y
per frequency; every patch of one item, all frames of a chunk together, attends to the others; gelu-tanh MLP) ->
final LayerNorm -> mean over the chunk's frames -> 2x2 neighbours side by side -> projector LayerNorm (per patch),
Linear, GELU, Linear to the language model's width.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from eagle3.errors import TargetError
from eagle3.files import open_safetensors

VISION_PREFIXES = ("vision_tower.", "mm_projector.")   # the checkpoint's tensors this module reads
ROPE_THETA = 10000.0   # MoonViT's 2-D rotary base (not in config.json; vLLM and transformers fix it)
PAD_ID_DEFAULT = 163605   # <|media_pad|>: the engines' id for images and video alike (transformers' video id differs)


@dataclass
class MediaItem:
    kind: Literal["image", "video"]
    pixel_values: torch.Tensor        # [t*h*w, 3, patch, patch] float32, as the processor lays it out
    grid_thw: tuple[int, int, int]    # (t, h, w) in patches


@dataclass(frozen=True)
class VisionConfig:
    """vision_config of Kimi-K2.5's config.json, under its published names."""
    patch: int
    width: int
    heads: int
    layers: int
    intermediate: int
    pos_grid: tuple[int, int]
    pos_time: int
    merge: tuple[int, int]
    projector_eps: float
    text_hidden: int
    pad_id: int

    def pads(self, grid_thw) -> int:
        """Placeholder tokens of one item: frames pooled, then merge[0] x merge[1] patches per token."""
        _, h, w = grid_thw
        return (h // self.merge[0]) * (w // self.merge[1])


# published value -> the only one this forward implements
_FIXED = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
          "video_attn_type": "spatial_temporal"}


def vision_config(raw: dict, source: str) -> VisionConfig | None:
    """The tower's settings from config.json's `raw` dict, or None for a target without one."""
    v = raw.get("vision_config")
    if not isinstance(v, dict) or "vt_hidden_size" not in v:
        return None
    for key, want in _FIXED.items():
        if v.get(key, want) != want:
            raise TargetError(f"{source}: vision_config.{key} = {v[key]!r}; only {want!r} (Kimi-K2.5's) is supported")
    try:
        return VisionConfig(
            patch=int(v["patch_size"]), width=int(v["vt_hidden_size"]), heads=int(v["vt_num_attention_heads"]),
            layers=int(v["vt_num_hidden_layers"]), intermediate=int(v["vt_intermediate_size"]),
            pos_grid=(int(v["init_pos_emb_height"]), int(v["init_pos_emb_width"])),
            pos_time=int(v["init_pos_emb_time"]),
            merge=tuple(int(k) for k in v["merge_kernel_size"]), projector_eps=float(v.get("projector_ln_eps", 1e-5)),
            text_hidden=int(v["text_hidden_size"]), pad_id=int(raw.get("media_placeholder_token_id", PAD_ID_DEFAULT)))
    except (KeyError, TypeError, ValueError) as e:
        raise TargetError(f"{source}: vision_config is missing or has a malformed field ({e!r}); "
                          "expected Kimi-K2.5's published vision_config") from None


def target_vision(ckpt) -> VisionConfig | None:
    """The vision tower's settings of a `Checkpoint`, from its config.json, or None when it has no tower."""
    path = ckpt.path if ckpt.path.suffix == ".json" else ckpt.dir / "config.json"
    return vision_config(json.loads(path.read_text()), str(path))


def media_rule_pad(rule: str, ckpt) -> int | None:
    """The placeholder id whose draft input is the target's vision row (SGLang's rule, `draft.media_embedding =
    "sglang"`), or None: the placeholder token's own embedding (vLLM's), or a target without a vision tower."""
    c = target_vision(ckpt) if rule == "sglang" else None
    return None if c is None else c.pad_id


def vision_tensor_names(weight_map: dict[str, str]) -> list[str]:
    """The checkpoint tensors the vision tower and projector use."""
    return [n for n in weight_map if n.startswith(VISION_PREFIXES)]


def _layer_names(i: int) -> list[str]:
    b = f"vision_tower.encoder.blocks.{i}."
    return [b + n + s for n in ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1") for s in (".weight", ".bias")]


def expected_shapes(c: VisionConfig) -> dict[str, list[int]]:
    """Every tensor the forward reads, with its shape."""
    d, m = c.width, c.width * c.merge[0] * c.merge[1]
    shapes = {"vision_tower.patch_embed.proj.weight": [d, 3, c.patch, c.patch],
              "vision_tower.patch_embed.proj.bias": [d], "vision_tower.patch_embed.pos_emb.weight": [*c.pos_grid, d],
              "vision_tower.encoder.final_layernorm.weight": [d], "vision_tower.encoder.final_layernorm.bias": [d],
              "mm_projector.pre_norm.weight": [d], "mm_projector.pre_norm.bias": [d],
              "mm_projector.proj.0.weight": [m, m], "mm_projector.proj.0.bias": [m],
              "mm_projector.proj.2.weight": [c.text_hidden, m], "mm_projector.proj.2.bias": [c.text_hidden]}
    for i in range(c.layers):
        names = _layer_names(i)
        for name, shape in zip(names, ([d], [d], [d], [d], [3 * d, d], [3 * d], [d, d], [d],
                                       [c.intermediate, d], [c.intermediate], [d, c.intermediate], [d])):
            shapes[name] = shape
    return shapes


def read_vision(directory, weight_map: dict[str, str], c: VisionConfig, device, dtype) -> dict[str, torch.Tensor]:
    """The tower's and projector's tensors by published name, checked against `c`, in `dtype` on `device`."""
    shapes, handles, out = expected_shapes(c), {}, {}
    missing = [n for n in shapes if n not in weight_map]
    if missing:
        raise TargetError(f"{directory}: {len(missing)} of the {len(shapes)} vision tensors are missing, first: "
                          f"{missing[0]} (a target served with images needs its vision_tower.* and mm_projector.*)")
    for name, shape in shapes.items():
        file = weight_map[name]
        if file not in handles:
            handles[file] = open_safetensors(directory / file, TargetError, "copy or download that file again")
        t = handles[file].get_tensor(name)
        if list(t.shape) != shape:
            raise TargetError(f"{directory / file}: {name} is {list(t.shape)}, the vision_config implies {shape}")
        out[name] = t.to(device, dtype)
    return out


class VisionTower:
    """The tower and projector of one checkpoint, resident: MediaItems -> fused placeholder embeddings."""

    def __init__(self, ckpt, c: VisionConfig, device, dtype=torch.bfloat16):
        self.c, self.device, self.dtype = c, device, dtype
        self.w = read_vision(ckpt.dir, ckpt.weight_map, c, device, dtype)
        head_dim = c.width // c.heads
        self.inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 4, device=device).float() / head_dim)
        self.time_rows = _sincos(c.pos_time, c.width).to(device)

    @torch.no_grad()
    def features(self, items: list[MediaItem]) -> torch.Tensor:
        """items -> [sum of pads, text hidden] in item order (each item's tokens row-major over its merged grid)."""
        if not items:
            return torch.zeros(0, self.c.text_hidden, device=self.device, dtype=self.dtype)
        merged = [self._merged(self._tower(it), it.grid_thw) for it in items]
        return self._project(torch.cat(merged))

    def _tower(self, item: MediaItem) -> torch.Tensor:
        """One item -> final-LayerNorm states [t*h*w, width]: its frames attend jointly (one sequence)."""
        c, w, (t, h, wd) = self.c, self.w, item.grid_thw
        x = item.pixel_values.to(self.device, self.dtype)
        if x.shape != (t * h * wd, 3, c.patch, c.patch):
            raise TargetError(f"media item of grid {item.grid_thw}: pixel_values {tuple(x.shape)}, expected "
                              f"{(t * h * wd, 3, c.patch, c.patch)}")
        # a 14x14 conv of stride 14 on one 14x14 patch is a linear map of its flattened pixels
        p = "vision_tower.patch_embed."
        x = F.linear(x.flatten(1), w[p + "proj.weight"].flatten(1), w[p + "proj.bias"])
        x = x + self._positions(t, h, wd).to(x.dtype)
        cos, sin = self._rotary(t, h, wd)
        for i in range(c.layers):
            x = self._layer(i, x, cos, sin)
        e = "vision_tower.encoder.final_layernorm."
        return F.layer_norm(x, (c.width,), w[e + "weight"], w[e + "bias"], 1e-5)

    def _positions(self, t: int, h: int, wd: int) -> torch.Tensor:
        """The learned grid resized to (h, w) (bicubic, as the reference), plus a time row per frame of a chunk."""
        grid = self.w["vision_tower.patch_embed.pos_emb.weight"].float()   # [H0, W0, D]
        if (h, wd) != tuple(grid.shape[:2]):
            grid = F.interpolate(grid.permute(2, 0, 1)[None], size=(h, wd), mode="bicubic")[0].permute(1, 2, 0)
        pos = grid.reshape(1, h * wd, -1)
        if t > 1:
            if t > self.c.pos_time:
                raise TargetError(f"a video chunk of {t} frames; the tower's time embedding holds "
                                  f"{self.c.pos_time} (vision_config.init_pos_emb_time)")
            pos = pos + self.time_rows[:t, None]
        return pos.expand(t, -1, -1).reshape(t * h * wd, -1)

    def _rotary(self, t: int, h: int, wd: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [t*h*w, head_dim/2]: pair 2k turns with the column, pair 2k+1 with the row, at frequency k."""
        rows, cols = torch.meshgrid(torch.arange(h, device=self.device), torch.arange(wd, device=self.device),
                                    indexing="ij")
        angles = torch.stack([cols.reshape(-1, 1) * self.inv_freq, rows.reshape(-1, 1) * self.inv_freq], -1)
        angles = angles.flatten(1).repeat(t, 1)
        return angles.cos(), angles.sin()

    def _layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, w = self.c, self.w
        b = f"vision_tower.encoder.blocks.{i}."
        y = F.layer_norm(x, (c.width,), w[b + "norm0.weight"], w[b + "norm0.bias"], 1e-5)
        q, k, v = F.linear(y, w[b + "wqkv.weight"], w[b + "wqkv.bias"]).unflatten(-1, (3, c.heads, -1)).unbind(1)
        q, k = _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)   # [n, heads, head_dim]
        # 4-D [1, heads, n, head_dim]: SDPA's flash and memory-efficient kernels take no 3-D inputs (the math
        # fallback materialises [heads, n, n] scores: 16 GiB for one 1080p image)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v)[0]
        x = x + F.linear(a.transpose(0, 1).flatten(1), w[b + "wo.weight"], w[b + "wo.bias"])
        y = F.layer_norm(x, (c.width,), w[b + "norm1.weight"], w[b + "norm1.bias"], 1e-5)
        y = F.gelu(F.linear(y, w[b + "mlp.fc0.weight"], w[b + "mlp.fc0.bias"]), approximate="tanh")
        return x + F.linear(y, w[b + "mlp.fc1.weight"], w[b + "mlp.fc1.bias"])

    def _merged(self, x: torch.Tensor, grid_thw) -> torch.Tensor:
        """[t*h*w, D] -> [pads, kh*kw, D]: the mean over frames, then each kh x kw block's patches in row order."""
        (t, h, wd), (kh, kw) = grid_thw, self.c.merge
        x = x.view(t, h // kh, kh, wd // kw, kw, -1).mean(0)
        return x.permute(0, 2, 1, 3, 4).reshape((h // kh) * (wd // kw), kh * kw, -1)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        w, p = self.w, "mm_projector."
        x = F.layer_norm(x, (self.c.width,), w[p + "pre_norm.weight"], w[p + "pre_norm.bias"], self.c.projector_eps)
        x = F.gelu(F.linear(x.flatten(1), w[p + "proj.0.weight"], w[p + "proj.0.bias"]))
        return F.linear(x, w[p + "proj.2.weight"], w[p + "proj.2.bias"])


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2j, 2j+1) of x [n, heads, head_dim] by angle j, in float32."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)


def _sincos(frames: int, dim: int) -> torch.Tensor:
    """[frames, dim] sin | cos of frame index times 1/10000^(2j/dim): the time row added to a chunk's frames."""
    freq = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    angle = torch.arange(frames, dtype=torch.float64)[:, None] * freq
    return torch.cat([angle.sin(), angle.cos()], 1).float()


def media_positions(ids, pad_id: int, context=None):
    """bool [T] (a tensor or numpy array, as `ids`): the placeholders the vision rows fill, the pad id where `context`
    (bool [T]: a prompt token, loss_mask 0; None: all) holds. A pad the model wrote in a reply is a token like any
    other: the engines embed what they decode as tokens."""
    where = ids == pad_id
    return where if context is None else where & context


def merge_media(embeds: torch.Tensor, ids: torch.Tensor, features: torch.Tensor, pad_id: int,
                context: torch.Tensor | None = None) -> torch.Tensor:
    """embeds [T, H] of ids [T] with the placeholder rows (`media_positions`) replaced, in order, by features [M, H]."""
    where = media_positions(ids, pad_id, context).nonzero().squeeze(1)
    if where.numel() != features.shape[0]:
        raise TargetError(f"{where.numel()} <|media_pad|> tokens (id {pad_id}) but {features.shape[0]} media "
                          "feature rows: the placeholders and the images of a sequence disagree")
    out = embeds.clone()
    out[where.to(out.device)] = features.to(out.device, out.dtype)
    return out


def describe_cost(c: VisionConfig) -> str:
    """Parameters of the tower and projector (for inspect): their memory at 2 bytes each."""
    params = sum(math.prod(s) for s in expected_shapes(c).values())
    return f"vision tower + projector: {params / 1e6:.3g}M parameters ({params * 2 / 2**30:.2f} GiB in bf16)"
