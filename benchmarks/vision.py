"""`python -m benchmarks.vision`: Kimi-K2.5's vision tower and projector (eagle3/models/vision.py) at their published
sizes on one GPU: milliseconds and peak memory per item for a 448 x 448 image, a 1080 x 1920 one and one 720p video
chunk of 4 frames, in bf16 as extraction runs them (`--tiny`: the test tower's sizes, on the CPU).

Weights are random in the published names and shapes (written once to a temporary safetensors file and read by
`VisionTower` as a checkpoint's would be); pixels are random. Times: `median_ms_of_calls` (3 calls after 1 warm-up).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from eagle3.bench.timing import append_json, describe_device, median_ms_of_calls, peak_bytes, require_cuda
from eagle3.models import tiny
from eagle3.models.vision import MediaItem, VisionTower, describe_cost, expected_shapes, vision_config

# the published tower (Kimi-K2.5's vision_config) and its projector into the language model's 7168
KIMI = dict(width=1152, heads=16, layers=27, intermediate=4304, pos_grid=64)
# (name, (t, h, w) patches): 448 x 448; 1080 x 1920 padded to 1092 x 1932; 720p frames padded to 728 x 1288
ITEMS = [("image 448x448", (1, 32, 32)), ("image 1080x1920", (1, 78, 138)), ("video chunk 720p x 4", (4, 52, 92))]


def tower(sizes: dict, text_hidden: int, directory: Path, device: torch.device) -> VisionTower:
    """A VisionTower over random tensors of `sizes`, read from a safetensors file in `directory`."""
    raw = {"vision_config": tiny.kimi_vision_config(text_hidden, **sizes)}
    _, _, rand, ones, _, _ = tiny.start_target(directory, raw, 0, torch.bfloat16)
    save_file(tiny.vision_tensors(raw["vision_config"], rand, ones), directory / "model.safetensors")
    c = vision_config(raw, str(directory / "config.json"))
    ckpt = SimpleNamespace(dir=directory, weight_map=dict.fromkeys(expected_shapes(c), "model.safetensors"))
    return VisionTower(ckpt, c, device, torch.bfloat16)


def run(tiny_sizes: bool, json_path: str | None) -> list[dict]:
    device = torch.device("cpu" if tiny_sizes else "cuda")
    with tempfile.TemporaryDirectory() as d:
        vt = tower(tiny.TINY_VISION if tiny_sizes else KIMI, 64 if tiny_sizes else 7168, Path(d), device)
    print(describe_device())
    print(describe_cost(vt.c))
    rows = []
    for name, (t, h, w) in ITEMS[:1] if tiny_sizes else ITEMS:
        item = MediaItem("video" if t > 1 else "image", torch.randn(t * h * w, 3, 14, 14, device=device), (t, h, w))
        ms = median_ms_of_calls(lambda: vt.features([item]), calls=3)
        peak = peak_bytes(lambda: vt.features([item]))[0] if device.type == "cuda" else None
        rows.append({"item": name, "patches": t * h * w, "tokens": vt.c.pads((t, h, w)), "ms": round(ms, 2),
                     "peak_gib": None if peak is None else round(peak / 2**30, 2)})
        print(rows[-1], flush=True)
    append_json(json_path, rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vision", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the test tower's sizes on the CPU")
    p.add_argument("--json", help="append the rows as JSON lines here")
    args = p.parse_args(argv)
    if not args.tiny:
        require_cuda("benchmarks.vision", "; --tiny runs it at toy size on the CPU")
    with torch.no_grad():
        run(args.tiny, args.json)


if __name__ == "__main__":
    main()
