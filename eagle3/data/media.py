"""Images and video in chat lines as Kimi-K2.5's engines take them: OpenAI content parts decoded (Pillow, PyAV: the
`vision` extra), sampled, resized and patched as Kimi-K2.5's own processor (the checkpoint's code that vLLM runs;
transformers 5.24's Kimi_K25 processors count and lay out alike), and each vision chunk (an image, or 4 frames of a
video) given the engines' count of `<|media_pad|>` (docs/data.md)."""
from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import importlib
import io
import json
import math
import mimetypes
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3.data.tokenizer import ChatError
from eagle3.errors import InputError, TargetError
from eagle3.files import read_json
from eagle3.models.vision import MediaItem, media_positions, vision_config

# the checkpoint's preprocessor_config.json media_proc_cfg (transformers 5.24's Kimi_K25 processors' defaults alike)
PATCH, MERGE, MAX_SIDE = 14, 2, 512     # 14-px patches merged 2 x 2; at most 512 patches a side
IMAGE_PATCHES, FRAME_PATCHES = 16384, 4096
FPS, CHUNK = 2, 4                       # video frames sampled at 2 a second, 4 frames a vision chunk
# those settings as Kimi-K2.5 and K2.6 publish them (media_proc_cfg): the only ones this path computes, so a
# checkpoint whose preprocessor_config.json says otherwise (a lower cap, another fps) is refused, not miscounted
PUBLISHED = {"patch_size": PATCH, "merge_kernel_size": MERGE, "patch_limit_on_one_side": MAX_SIDE,
             "in_patch_limit": IMAGE_PATCHES, "in_patch_limit_each_frame": FRAME_PATCHES, "sample_fps": FPS,
             "temporal_merge_kernel_size": CHUNK, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
             "fixed_output_tokens": None, "in_patch_limit_video": None, "max_num_frames_each_video": None,
             "timestamp_mode": "hh:mm:ss.fff"}
PARTS = {"image_url": "image", "video_url": "video"}
# a video chunk's prompt after its timestamp; its one pad stands for the chunk's, as an image's does in the template
VIDEO_CHUNK = "<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"


@dataclass(frozen=True)
class Source:
    """Where a media item's pixels come from: decoded again when they are needed, so that records stay small."""
    url: str
    base: str                  # the data file's directory: a relative path is read from there
    chunk: int = 0             # a video's chunk


class MediaFile(MediaItem):
    """A MediaItem (eagle3.models.vision) whose pixels are decoded from its source when read, so that the records of
    a whole data file stay small: `pixel_values` float32 [t*h*w, 3, 14, 14] as the processor's rows for it,
    `grid_thw` (t, h, w) in patches as its `grid_thws` row; the ids hold `tokens` pads for it."""

    def __init__(self, kind: str, grid_thw: tuple[int, int, int], source: Source):
        self.kind, self.grid_thw, self.source = kind, grid_thw, source

    def __repr__(self) -> str:
        return f"MediaFile({self.kind!r}, {self.grid_thw}, {self.source})"

    @property
    def tokens(self) -> int:
        """Its placeholders: one per 2 x 2 patches of a frame (a video chunk's frames are pooled after the tower)."""
        return self.grid_thw[1] * self.grid_thw[2] // MERGE ** 2

    @property
    def pixel_values(self) -> torch.Tensor:
        frames = (decode_image if self.kind == "image" else decode_video)(self.source.url, Path(self.source.base))
        return patches(chunks(frames)[self.source.chunk] if self.kind == "video" else frames, self.kind)[0]


def navit_size(height: int, width: int, max_patches: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(resized, padded) (height, width): the processor's `navit_resize`: scaled to fit `max_patches` patches and
    MAX_SIDE a side, never upscaled, padded to multiples of 28."""
    count = max(1, height // PATCH) * max(1, width // PATCH)
    scale = min(1.0, math.sqrt(max_patches / count), MAX_SIDE * PATCH / height, MAX_SIDE * PATCH / width)
    h = min(max(1, int(height * scale)), MAX_SIDE * PATCH)
    w = min(max(1, int(width * scale)), MAX_SIDE * PATCH)
    factor = MERGE * PATCH
    return (h, w), (-(-h // factor) * factor, -(-w // factor) * factor)


def image_tokens(height: int, width: int) -> int:
    """The placeholders of a `height` x `width` image."""
    _, h, w = grid(1, height, width, "image")
    return h * w // MERGE ** 2


def grid(t: int, height: int, width: int, kind: str) -> tuple[int, int, int]:
    """(t, h, w) in patches of `t` frames of `height` x `width` pixels."""
    _, (h, w) = navit_size(height, width, IMAGE_PATCHES if kind == "image" else FRAME_PATCHES)
    return t, h // PATCH, w // PATCH


def patches(frames: torch.Tensor, kind: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 [t, 3, H, W] frames -> (float32 [t*h*w, 3, 14, 14], (t, h, w)): resized, padded bottom-right with
    zeros, (x / 255 - 0.5) / 0.5, patches row-major within each frame: the steps of Kimi-K2.5's own processor (the
    checkpoint's code that vLLM runs)."""
    (h, w), (ph, pw) = navit_size(*frames.shape[-2:], IMAGE_PATCHES if kind == "image" else FRAME_PATCHES)
    if (h, w) != tuple(frames.shape[-2:]):
        frames = _resize(frames, h, w)
    frames = torch.nn.functional.pad(frames, (0, pw - w, 0, ph - h))
    x = ((frames.double() / 255).float() - 0.5) * 2.0
    t, gh, gw = x.shape[0], ph // PATCH, pw // PATCH
    x = x.reshape(t, 3, gh, PATCH, gw, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(t * gh * gw, 3, PATCH, PATCH).contiguous(), (t, gh, gw)


def _resize(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [t, 3, H, W] -> [t, 3, height, width] by Pillow's bicubic resize, as the processor resizes each frame.
    torchvision's (transformers' port) differs by a level or more: Pillow picks which axis to resample first."""
    image = _require("PIL.Image")
    out = [np.asarray(image.fromarray(np.ascontiguousarray(f.permute(1, 2, 0).numpy())).resize(
        (width, height), image.Resampling.BICUBIC)) for f in frames]
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2)


def chunks(frames: torch.Tensor) -> list[torch.Tensor]:
    return list(frames.split(CHUNK))


def _require(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(f"images and video in chat lines need the optional package '{module}': "
                         "pip install eagle3-trainer[vision]") from None


def _bytes_or_path(url: str, base: Path, kind: str) -> bytes | Path:
    """A `data:` URL's bytes, or the file a path or `file://` URL names (a relative path: from `base`)."""
    if url.startswith("data:"):
        head, comma, body = url[5:].partition(",")
        if not comma or not head.startswith(kind + "/"):
            raise ChatError(f"{url[:40]}...: not an {kind}: a {kind} data: URL is data:{kind}/<type>;base64,...")
        try:
            return base64.b64decode(body, validate=True) if head.endswith(";base64") else \
                urllib.parse.unquote_to_bytes(body)
        except binascii.Error:
            raise ChatError(f"data:{head},...: not valid base64") from None
    if url.startswith(("http://", "https://")):
        raise ChatError(f"{url}: only files, file:// and data: URLs are read; download it first")
    path = file_path(url, base)
    if not path.is_file():
        raise ChatError(f"{path}: {kind} not found")
    return path


def file_path(url: str, base: Path) -> Path:
    """The file a path or `file://` URL names (a relative path: from `base`)."""
    return base / (Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)) if url.startswith("file://") else url)


def files_fingerprint(items: list) -> str:
    """SHA-256 of the path, size and modification time of each file the media items read (a `data:` URL is part of
    the data file itself): an image changed under an unchanged data file changes it, for a stat each."""
    files = sorted({file_path(i.source.url, Path(i.source.base)).resolve() for i in items
                    if isinstance(i, MediaFile) and not i.source.url.startswith("data:")})
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def decode_image(url: str, base: Path) -> torch.Tensor:
    """uint8 [1, 3, H, W] RGB of an image; a ChatError for one Pillow cannot read whole or that is over its limit."""
    image_module = _require("PIL.Image")
    source = _bytes_or_path(url, base, "image")
    name = source if isinstance(source, Path) else "data: URL"
    try:
        with image_module.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            image.load()
            rgb = np.asarray(_rgb(image, image_module))
    except image_module.DecompressionBombError as e:
        raise ChatError(f"{name}: over Pillow's limit of {2 * image_module.MAX_IMAGE_PIXELS:,} pixels, where vLLM "
                        f"and SGLang (which decode with Pillow) refuse it too ({e})") from None
    except (OSError, SyntaxError, ValueError) as e:   # unidentified, truncated or corrupt
        raise ChatError(f"{name}: not a readable image ({type(e).__name__}: {e})") from None
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1)[None]


def _rgb(image, image_module):
    """RGB as vLLM's `ImageMediaIO` hands it to Kimi-K2.5's processor: an RGBA image composited onto white, any other
    mode (LA, a palette or RGB with a transparent colour included) Pillow's `convert("RGB")`, which drops its
    transparency. (transformers' `convert_to_rgb` composites those too; the engines never reach it.)"""
    if image.mode != "RGBA":
        return image.convert("RGB")
    white = image_module.new("RGBA", image.size, (255, 255, 255, 255))
    return image_module.alpha_composite(white, image).convert("RGB")


def sample(total: int, fps: float) -> np.ndarray:
    """The frame indices Kimi-K2.5's own processor samples (`split_video_chunks`, the checkpoint's code that vLLM
    calls): round(total * min(FPS, fps) / fps) frames spread evenly from the first to the last, rounded (numpy's
    half-to-even). transformers' port (`default_sample_indices_fn`) picks other frames, hence other timestamps."""
    n = max(round(total * min(FPS, fps) / fps), 1)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def video_frames(url: str, base: Path) -> tuple[torch.Tensor, np.ndarray]:
    """uint8 [n, 3, H, W] frames sampled at FPS (only those are kept), and their times in seconds."""
    av = _require("av")
    source = _bytes_or_path(url, base, "video")
    name = source if isinstance(source, Path) else "data: URL"

    def frames(keep: np.ndarray | None) -> tuple[list, float]:
        """The frames at `keep` (all when None: counted) and the frame rate."""
        with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
            if not container.streams.video:
                raise ChatError(f"{name}: a file with no video stream")
            stream, out = container.streams.video[0], []
            if keep is None and stream.frames:   # the container's count, as transformers reads it
                return [None] * stream.frames, float(stream.average_rate or 0)
            with contextlib.suppress(av.EOFError):   # a stream that ends before its first frame
                for i, frame in enumerate(container.decode(video=0)):
                    if keep is None or i in keep:
                        out.append(None if keep is None else frame.to_ndarray(format="rgb24"))
                    if keep is not None and i >= keep[-1]:
                        break
            return out, float(stream.average_rate or 0)
    try:
        counted, rate = frames(None)
        if not counted or not rate:
            raise ChatError(f"{name}: a video with no frames" if not counted else f"{name}: a video with no frame rate")
        indices = sample(len(counted), rate)
        picked = frames(indices)[0]
    except (av.FFmpegError, OSError) as e:
        raise ChatError(f"{name}: not a readable video ({type(e).__name__}: {e})") from None
    if len(picked) < len(indices):
        raise ChatError(f"{name}: {len(picked)} frames decode of the {len(counted)} its container counts (truncated?)")
    return torch.from_numpy(np.stack(picked)).permute(0, 3, 1, 2), indices / rate


@functools.lru_cache(maxsize=1)   # a video's chunks are read one after another: decoded once for them all
def decode_video(url: str, base: Path) -> torch.Tensor:
    return video_frames(url, base)[0]


def timestamp(seconds: float) -> str:
    """HH:MM:SS.mmm as the processor writes a chunk's start."""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"


@dataclass
class Media:
    """A chat line's vision chunks in order, and per video the text that stands for it in the prompt."""
    items: list[MediaFile]
    owners: list[int]          # the message index of each item
    videos: list[str]


class MediaReader:
    """The target's media settings from its config.json; decodes a line's media parts."""

    def __init__(self, target_dir: str | Path):
        path = Path(target_dir) / "config.json"
        config = read_json(path, InputError, "the target's config")
        try:
            vision = vision_config(config, str(path)) if isinstance(config, dict) else None
        except TargetError as e:
            raise InputError(str(e)) from None
        self.vision, self.pad_id = vision is not None, vision and vision.pad_id
        self.video_placeholder = config.get("video_placeholder", "<|kimi_k25_video_placeholder|>")
        if self.vision:
            check_media_settings(Path(target_dir) / "preprocessor_config.json")

    def read(self, refs: list[tuple[int, str, str]], base: Path) -> Media:
        """`refs`: (message index, kind, url) of each media part in order of appearance."""
        if refs and not self.vision:
            raise ChatError(f"{len(refs)} image or video part(s), but the target has no vision tower (no "
                            "vision_config in its config.json)")
        media = Media([], [], [])
        for owner, kind, url in refs:
            if kind == "image":
                image = decode_image(url, base)
                media.items.append(MediaFile(kind, grid(1, *image.shape[-2:], kind), Source(url, str(base))))
                media.owners.append(owner)
                continue
            frames, seconds = video_frames(url, base)
            for k, chunk in enumerate(chunks(frames)):
                media.items.append(MediaFile(kind, grid(len(chunk), *frames.shape[-2:], kind),
                                             Source(url, str(base), k)))
                media.owners.append(owner)
            media.videos.append("".join(f"{timestamp(float(seconds[k]))}{VIDEO_CHUNK}"
                                        for k in range(0, len(frames), CHUNK)))
        return media


def check_media_settings(path: Path) -> None:
    """The checkpoint's media settings (`media_proc_cfg` of `path`, or its top level as older files keep them) where
    given must be the published ones; a missing file or field is the published default."""
    if not path.exists():
        return
    raw = read_json(path, InputError, "the target's preprocessor config")
    given = raw.get("media_proc_cfg", raw) if isinstance(raw, dict) else None
    if not isinstance(given, dict):
        raise InputError(f"{path}: media_proc_cfg: expected a JSON object of media settings")
    for key, want in PUBLISHED.items():
        value = given.get(key, want)
        if key == "merge_kernel_size" and isinstance(value, list) and len(set(value)) == 1:
            value = value[0]   # [2, 2] as the vision config writes it
        if value != want:
            raise InputError(f"{path}: media_proc_cfg.{key} is {value!r}; expected {want!r}, Kimi-K2.5's published "
                             "setting: images and video are counted and laid out for those settings only")


def with_videos(text: str, videos: list[str], placeholder: str) -> str:
    """`text` with its k-th video placeholder (the template's) replaced by the k-th video's chunks."""
    pieces = text.split(placeholder)
    if len(pieces) - 1 > len(videos):
        raise ChatError(f"the prompt holds {len(pieces) - 1} video placeholders for {len(videos)} video(s): "
                        "placeholders and media disagree")
    return "".join(p + v for p, v in zip(pieces, [*videos[:len(pieces) - 1], ""]))


def has_media(content: object) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in PARTS for p in content)


def content_parts(content: list, where: str) -> tuple[list[dict], list[tuple[str, str]]]:
    """A turn's parts as vLLM hands a template that loops over them ({"type": "image"}, {"type": "video"}, text
    parts), and (kind, url) of its media parts in order."""
    out, refs = [], []
    for i, part in enumerate(content):
        name = part.get("type") if isinstance(part, dict) else None
        if name == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
            continue
        if name not in PARTS:
            raise ChatError(f"{where}: content[{i}] must be a text, image_url or video_url part")
        value = part.get(name)
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise ChatError(f"{where}: content[{i}].{name} must be {{\"url\": \"<path, file:// or data: URL>\"}}")
        out.append({"type": PARTS[name]})
        refs.append((PARTS[name], url))
    return out, refs


def expand(ids: np.ndarray, items: list[MediaFile], pad_id: int,
           context: np.ndarray | None = None) -> tuple[np.ndarray, list[int]]:
    """Per token of `ids` (one pad per vision chunk, as the template writes them) how many it becomes: each pad of
    the `context` (bool [n], not a reply: a reply's pad is a token the model wrote) the tokens of the next of `items`;
    and where each of those items' pads start once expanded."""
    at = np.flatnonzero(media_positions(ids, pad_id, context))
    if len(at) > len(items):
        raise ChatError(f"the prompt holds {len(at)} <|media_pad|> placeholders for {len(items)} image(s) or video "
                        "chunk(s): placeholders and media disagree")
    counts = np.ones(len(ids), dtype=np.int64)
    counts[at] = [item.tokens for item in items[:len(at)]]
    return counts, (np.cumsum(counts)[at] - counts[at]).tolist()


def place(ids: np.ndarray, items: list[MediaFile], pad_id: int,
          context: np.ndarray | None = None) -> list[tuple[int, MediaFile]]:
    """(pad start, item) of a pre-tokenized line's items, whose pads its ids already hold at `context` tokens (bool
    [n]: loss_mask 0), in order."""
    at = np.flatnonzero(media_positions(ids, pad_id, context))
    if len(at) != sum(item.tokens for item in items):
        raise ChatError(f"input_ids hold {len(at)} <|media_pad|> tokens for media of {sum(i.tokens for i in items)}: "
                        "placeholders and media disagree")
    firsts = np.cumsum([0] + [item.tokens for item in items])[:-1]
    return [(int(at[f]), item) for f, item in zip(firsts, items)]


def absolute_url(url: str, base: Path) -> str:
    """A media URL that reads the same from any directory: a path made absolute (relative ones are `base`'s)."""
    return url if url.startswith(("data:", "file://")) else str((Path(base) / url).resolve())


def data_url(url: str, base: Path, kind: str) -> str:
    """A media URL as a `data:` URL of the file's bytes: what a server on another machine reads (a path or file://
    URL names a file on this one)."""
    source = _bytes_or_path(url, base, kind)
    if isinstance(source, bytes):
        return url
    mime = mimetypes.guess_type(source.name)[0] or ""
    mime = mime if mime.startswith(kind + "/") else f"{kind}/{source.suffix.lstrip('.') or 'unknown'}"
    return f"data:{mime};base64,{base64.b64encode(source.read_bytes()).decode()}"


def map_urls(content: list, convert) -> list:
    """A turn's content parts with each media part's URL replaced by convert(url, kind) (text parts as they are)."""
    out = []
    for part in content:
        name = part.get("type") if isinstance(part, dict) else None
        if name in PARTS:
            value = part.get(name)
            url = value.get("url") if isinstance(value, dict) else value
            part = {"type": name, name: {"url": convert(url, PARTS[name])}}
        out.append(part)
    return out


def parts_of(items: list[MediaFile]) -> list[dict]:
    """The content parts a line's media items came from (a video's chunks from one), each path absolute: what a
    pre-tokenized line written from them (generate's output) carries as `media`."""
    names = [f"{item.kind}_url" for item in items]
    return [{"type": name, name: {"url": absolute_url(item.source.url, Path(item.source.base))}}
            for name, item in zip(names, items) if not item.source.chunk]
