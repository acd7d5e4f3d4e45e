"""Images and video in chat lines: the engines' placeholder counts, the processor's pixel layout, bad media."""
import ast
import base64
import importlib.util
import json
import math
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.data import media
from eagle3.data.chat import ChatEncoder
from eagle3.data.inputs import read_records
from eagle3.errors import InputError
from eagle3.models import tiny

Image = pytest.importorskip("PIL.Image")
av = pytest.importorskip("av")

VOCAB = 512
PAD = VOCAB - 256 + 21   # <|media_pad|> at its real offset among the special tokens


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tiny.write_kimi_chat(tmp_path_factory.mktemp("kimi"), VOCAB)
    config = tiny.kimi_k25_config(64, 2, 4, 32, 16, 16, 8, 16, 128, 32, 8, 2, 1, 1, 1, VOCAB, 128, 32.0)
    (root / "config.json").write_text(json.dumps(config))
    return root


def png(path, width, height, seed=0):
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(path)
    return path


def video(path, frames=20, rate=4, size=(64, 48)):
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for i in range(frames):
            frame = np.full((size[1], size[0], 3), 10 * i, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def line(*parts, reply="ok"):
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": reply}]}


def image(url):
    return {"type": "image_url", "image_url": {"url": url}}


# (height, width) -> tokens, as Kimi-K2.5's processor and both engines count them
FIGURES = {(448, 448): 256, (1024, 1024): 1369, (1080, 1920): 2691, (3000, 3000): 4225}


def test_placeholder_counts_match_the_processor():
    for (h, w), n in FIGURES.items():
        assert media.image_tokens(h, w) == n
    assert media.grid(4, 720, 1280, "video") == (4, 50, 86)   # a 720p chunk: 4,096 patches a frame, 1,075 pads
    sizes = [(1, 1), (13, 13), (14, 14), (27, 29), (28, 10000), (10000, 28), (512 * 14, 20), (512 * 14 + 1, 20),
             (7200, 7200), (20000, 9), (1, 30000), (30000, 30000)]
    rng = random.Random(0)
    sizes += [(rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(300)]
    for h, w in sizes:
        (rh, rw), (ph, pw) = media.navit_size(h, w, media.IMAGE_PATCHES)
        assert rh <= h and rw <= w and ph % 28 == 0 and pw % 28 == 0   # never upscaled; padded to 28
        assert (ph // 14) * (pw // 14) <= media.IMAGE_PATCHES + 2 * 28 * 512 and max(ph, pw) <= 512 * 14
    navit_resize = transformers_navit_resize()
    for h, w in sizes:
        _, (ph, pw) = navit_resize(h, w, patch_size=14, merge_kernel_size=2, max_patches=16384, max_size_per_side=512)
        assert media.image_tokens(h, w) == (ph // 14) * (pw // 14) // 4, (h, w)


def transformers_navit_resize():
    return transformers_function("image_processing_kimi_k25.py", "navit_resize")


def transformers_function(module: str, name: str, owner: str | None = None):
    """A function (or `owner` class's method) of transformers 5.24's models/kimi_k25/`module`, read from its source:
    the modules themselves import torchvision, which the tests do without."""
    spec = importlib.util.find_spec("transformers")
    if spec is None:
        pytest.skip("transformers is not installed")
    source = Path(spec.origin).parent / "models" / "kimi_k25" / module
    body = ast.parse(source.read_text()).body
    if owner is not None:
        body = next(n for n in body if getattr(n, "name", "") == owner).body
    function, = [n for n in body if getattr(n, "name", "") == name]
    scope = {"math": math, "torch": torch}
    exec(compile(ast.Module([function], []), str(source), "exec"), scope)
    return scope[name]


def test_patch_layout_equals_transformers_patchify():
    frames = torch.randint(0, 256, (4, 3, 56, 84), dtype=torch.uint8)
    normal = ((frames.double() / 255).float() - 0.5) / 0.5
    image = transformers_function("image_processing_kimi_k25.py", "patchify", "Kimi_K25ImageProcessor")
    theirs, h, w = image(None, normal[:1], 14)
    ours = media.patches(frames[:1], "image")
    assert torch.equal(ours[0], theirs[0]) and ours[1] == (1, h, w)
    video = transformers_function("video_processing_kimi_k25.py", "patchify", "Kimi_K25VideoProcessor")
    theirs, t, h, w = video(None, normal[None], 14)
    ours = media.patches(frames, "video")
    assert torch.equal(ours[0], theirs[0]) and ours[1] == (t, h, w)


def test_patches_are_laid_out_as_the_processor_lays_them_out():
    frames = torch.randint(0, 256, (1, 3, 56, 84), dtype=torch.uint8)   # no resize: 4 x 6 patches
    pixels, grid = media.patches(frames, "image")
    assert grid == (1, 4, 6) and pixels.shape == (24, 3, 14, 14) and pixels.dtype == torch.float32
    for p in (0, 5, 6, 23):   # row-major over the grid
        i, j = divmod(p, 6)
        crop = frames[0, :, 14 * i:14 * i + 14, 14 * j:14 * j + 14].float()
        torch.testing.assert_close(pixels[p], (crop - 127.5) / 127.5, rtol=0, atol=1e-7)
    padded, grid = media.patches(frames[..., :50, :70], "image")   # padded bottom-right with zeros (-1 once normal)
    assert grid == (1, 4, 6) and torch.equal(padded[-1, :, -6:], torch.full((3, 6, 14), -1.0))


def kimi_processor_pixels(path: Path) -> tuple[np.ndarray, tuple[int, int, int]]:
    """An image's pixel_values and grid by the steps of Kimi-K2.5's own processor, the checkpoint's
    kimi_k25_vision_processing.py + media_utils.py that vLLM runs: Pillow's bicubic resize to the navit size, zeros
    padded bottom/right, (x / 255 as float32 - 0.5) * (1 / 0.5), 14 x 14 patches row-major."""
    rgb = Image.open(path).convert("RGB")
    (h, w), (ph, pw) = media.navit_size(rgb.height, rgb.width, 16384)
    x = np.pad(np.asarray(rgb.resize((w, h), Image.Resampling.BICUBIC)), ((0, ph - h), (0, pw - w), (0, 0)))
    x = (x[None] / 255.0).astype(np.float32)
    x -= np.array([0.5, 0.5, 0.5])
    x *= 1.0 / np.array([0.5, 0.5, 0.5])
    x = x.reshape(1, ph // 14, 14, pw // 14, 14, 3).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 3, 14, 14)
    return x, (1, ph // 14, pw // 14)


def test_pixel_values_equal_kimis_own_processor(tmp_path):
    # 7300 x 300 -> 7168 x 294: Pillow resamples the tall axis first, where torchvision's resize (transformers' port)
    # differs from it by up to 25 levels on this noise
    for w, h in ((100, 60), (1000, 30), (300, 7300), (3000, 2000)):
        path = png(tmp_path / f"{w}x{h}.png", w, h)
        ours, grid = media.patches(media.decode_image(str(path), tmp_path), "image")
        theirs, their_grid = kimi_processor_pixels(path)
        assert grid == their_grid and grid[1:] == transformers_grid(h, w)
        assert torch.equal(ours, torch.from_numpy(theirs)), (w, h)


def transformers_grid(height: int, width: int) -> tuple[int, int]:
    _, (ph, pw) = transformers_navit_resize()(height, width, patch_size=14, merge_kernel_size=2, max_patches=16384,
                                               max_size_per_side=512)
    return ph // 14, pw // 14


def test_transparency_is_handled_as_vllm_hands_images_to_the_processor(tmp_path):
    rgba = np.zeros((28, 28, 4), np.uint8)
    rgba[..., 0], rgba[:14, :, 3] = 200, 255   # the top half opaque red, the bottom half transparent
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    frames = media.decode_image("a.png", tmp_path)
    assert frames[0, :, 0, 0].tolist() == [200, 0, 0] and frames[0, :, -1, 0].tolist() == [255, 255, 255]
    # vLLM's ImageMediaIO composites only RGBA; other modes go through Pillow's convert("RGB"), transparency dropped
    la = np.zeros((28, 28, 2), np.uint8)
    la[..., 0], la[:14, :, 1] = 90, 255
    Image.fromarray(la, "LA").save(tmp_path / "la.png")
    palette = Image.new("P", (28, 28), 1)
    palette.putpalette([0, 0, 0, 30, 60, 90] + [0] * 762)
    palette.save(tmp_path / "p.png", transparency=1)   # its only colour transparent
    assert media.decode_image("la.png", tmp_path)[0, :, -1, 0].tolist() == [90, 90, 90]
    assert media.decode_image("p.png", tmp_path)[0, :, 0, 0].tolist() == [30, 60, 90]


def test_video_frames_are_sampled_as_kimis_own_processor_samples_them():
    # split_video_chunks: round(n * min(2, fps) / fps) frames, linspace(0, n - 1, k).round()
    assert media.sample(20, 4).tolist() == [0, 2, 4, 6, 8, 11, 13, 15, 17, 19]
    assert media.sample(300, 30)[:5].tolist() == [0, 16, 31, 47, 63]   # transformers' port: 0, 15, 30, 45, 60
    assert media.sample(3, 1.0).tolist() == [0, 1, 2]   # under 2 fps: every frame once
    assert media.sample(1, 30).tolist() == [0]
    assert media.timestamp(17 / 4) == "00:00:04.250" and media.timestamp(3661.5) == "01:01:01.500"


def test_image_line_expands_each_image_to_the_engines_count(kimi, tmp_path):
    png(tmp_path / "a.png", 100, 60)
    png(tmp_path / "b.png", 30, 200, seed=1)
    data = "data:image/png;base64," + base64.b64encode((tmp_path / "b.png").read_bytes()).decode()
    encoded = ChatEncoder(kimi).encode(line(image("a.png"), "and", image(data), "?"), base=tmp_path)
    (ids, mask), placed = encoded.sequences[0], encoded.media[0]
    assert [item.grid_thw for _, item in placed] == [(1, 6, 8), (1, 16, 4)]   # 60x100 -> 84x112; 200x30 -> 224x56
    runs = np.split(np.flatnonzero(ids == PAD), np.flatnonzero(np.diff(np.flatnonzero(ids == PAD)) > 1) + 1)
    assert [(int(r[0]), len(r)) for r in runs] == [(start, item.tokens) for start, item in placed] == \
        [(placed[0][0], 12), (placed[1][0], 16)]
    assert not mask[ids == PAD].any()
    text = ChatEncoder(kimi).tokenizer.encode.decode(ids[:placed[0][0]].tolist())
    assert text.endswith("<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|>")
    assert torch.equal(placed[1][1].pixel_values, media.patches(media.decode_image(data, tmp_path), "image")[0])


def test_video_is_sampled_at_2_fps_in_chunks_of_4_with_timestamps(kimi, tmp_path):
    video(tmp_path / "v.mp4")   # 20 frames at 4 fps: 10 sampled (0, 2, .., 8, 11, .., 19), chunks of 4, 4, 2
    encoder = ChatEncoder(kimi)
    encoded = encoder.encode(line("watch", {"type": "video_url", "video_url": {"url": "v.mp4"}}), base=tmp_path)
    (ids, _), placed = encoded.sequences[0], encoded.media[0]
    assert [(item.kind, item.grid_thw, item.tokens) for _, item in placed] == [("video", (t, 4, 6), 6) for t in (4, 4, 2)]
    text = encoder.tokenizer.encode.decode(ids.tolist())
    pads = "<|media_pad|>" * 6
    assert "watch" + "".join(f"{t}<|media_begin|>video<|media_content|>{pads}<|media_end|>"
                             for t in ("00:00:00.000", "00:00:02.000", "00:00:04.250")) in text
    assert placed[2][1].pixel_values.shape == (2 * 24, 3, 14, 14)


def test_records_carry_whole_media_and_the_report_counts_them(kimi, tmp_path):
    png(tmp_path / "a.png", 100, 60)
    video(tmp_path / "v.mp4")
    lines = [line(image("a.png"), "x"), line({"type": "video_url", "video_url": {"url": "v.mp4"}})]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    records, stats = read_records(path, VOCAB, 4096, target_dir=kimi)
    assert [len(r.media) for r in records] == [1, 3]
    assert stats.summary()["media"] == {"images": 1, "video_chunks": 3, "media_tokens": 12 + 18}
    assert "1 images, 3 video chunks, 30 media tokens" in stats.describe()
    later = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                          *line(image("a.png"), "x")["messages"]]}
    path.write_text(json.dumps(later) + "\n")
    (record,), _ = read_records(path, VOCAB, 4096, target_dir=kimi)
    start = int(np.flatnonzero(record.input_ids == PAD)[0])
    (record,), stats = read_records(path, VOCAB, start + 5, target_dir=kimi)   # a cut inside the image's pads
    assert len(record.input_ids) == start and not record.media and "media" not in stats.summary()


BAD = {  # line -> what its one error line says
    "missing": "image not found", "text.png": "not a readable image", "cut.png": "not a readable image",
    "data:text/plain;base64,aGk=": "not an image", "data:image/png;base64,aGVsbG8=": "not a readable image",
    "big.png": "over Pillow's limit", "e.avi": "a video with no frames", "pad": "placeholders and media disagree",
}


def test_bad_media_lines_are_skipped_one_line_each(kimi, tmp_path, monkeypatch, capsys):
    png(tmp_path / "ok.png", 40, 40)
    (tmp_path / "text.png").write_text("not an image")
    (tmp_path / "cut.png").write_bytes(png(tmp_path / "whole.png", 60, 60).read_bytes()[:2000])
    png(tmp_path / "big.png", 120, 100)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5000)   # Pillow refuses twice this
    with av.open(str(tmp_path / "e.avi"), "w") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()
    lines = [line(image("ok.png"), "fine")]
    for name in BAD:
        if name == "e.avi":
            lines.append(line({"type": "video_url", "video_url": {"url": name}}))
        else:
            lines.append(line(image("ok.png" if name == "pad" else name), "<|media_pad|>" if name == "pad" else "?"))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    records, stats = read_records(path, VOCAB, 4096, "skip", target_dir=kimi)
    assert len(records) == 1 and stats.skipped == len(BAD) and stats.skipped_lines == list(range(2, len(BAD) + 2))
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("warning: skipped")]
    for number, (error, why) in enumerate(zip(errors, BAD.values()), start=2):
        assert error.startswith(f"warning: skipped {path}:{number}: ") and why in error, error
    with pytest.raises(InputError, match=f"{path}:2: .*image not found"):
        read_records(path, VOCAB, 4096, "fatal", target_dir=kimi)


def test_media_for_a_target_without_a_vision_tower(kimi, tmp_path, capsys):
    (tmp_path / "t").mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "t" / name).write_bytes((kimi / name).read_bytes())
    config = {k: v for k, v in json.loads((kimi / "config.json").read_text()).items() if k != "vision_config"}
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    png(tmp_path / "a.png", 40, 40)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(line(image("a.png"))) + "\n" + json.dumps(line("text only")) + "\n")
    records, stats = read_records(path, VOCAB, 4096, "skip", target_dir=tmp_path / "t")
    assert len(records) == 1 and stats.skipped == 1
    error, = [e for e in capsys.readouterr().err.splitlines() if e.startswith("warning: skipped")]
    assert error.startswith(f"warning: skipped {path}:1: ") and "the target has no vision tower" in error


PUBLISHED_CFG = {  # Kimi-K2.5's preprocessor_config.json media settings as published (K2.6's are the same)
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
    "config_type": "image"}


@pytest.mark.parametrize("given, refused", [
    ({"media_proc_cfg": PUBLISHED_CFG}, None),
    ({**PUBLISHED_CFG, "merge_kernel_size": [2, 2]}, None),            # older files: the settings at the top level
    ({"media_proc_cfg": {**PUBLISHED_CFG, "in_patch_limit": 4096}}, "media_proc_cfg.in_patch_limit is 4096"),
    ({"media_proc_cfg": {**PUBLISHED_CFG, "sample_fps": 8.0}}, "media_proc_cfg.sample_fps is 8.0"),
    ({"media_proc_cfg": [1]}, "media_proc_cfg: expected a JSON object")])
def test_media_settings_other_than_the_published_ones_are_refused(kimi, tmp_path, given, refused):
    target = tmp_path / "t"
    shutil.copytree(kimi, target)
    (target / "preprocessor_config.json").write_text(json.dumps(given))
    png(tmp_path / "a.png", 40, 40)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(line(image("a.png"), "x")) + "\n")
    if refused is None:
        (record,), _ = read_records(path, VOCAB, 4096, target_dir=target)
        assert len(record.media) == 1
        return
    with pytest.raises(InputError) as e:
        read_records(path, VOCAB, 4096, "skip", target_dir=target)   # the target's, not a line's: never skipped
    assert str(e.value).startswith(f"{path}:1: {target / 'preprocessor_config.json'}: {refused}")


def test_missing_pillow_names_the_extra(kimi, tmp_path, monkeypatch):
    png(tmp_path / "a.png", 40, 40)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(InputError, match=r"eagle3-trainer\[vision\]"):
        ChatEncoder(kimi).encode(line(image("a.png")), base=tmp_path)


@pytest.fixture(scope="module")
def vision_target(tmp_path_factory):
    root = tiny.make_kimi(tmp_path_factory.mktemp("kimi-vision"), layers=4, weights="bf16")
    return tiny.write_kimi_chat(root, VOCAB)


def test_decoding_with_images_is_lossless_and_sees_them(vision_target, tmp_path):
    """Evaluate's target (IncrementalTarget) places the tower's rows at the prompt's pads as extraction's does, in
    one pass or in pieces; speculative decoding with images keeps the target's greedy output."""
    from eagle3.draft import Eagle3Draft
    from eagle3.models.incremental import IncrementalTarget
    from eagle3.models.streaming import TargetRunner
    from eagle3.models.weights import Checkpoint
    from eagle3.resolve import DraftSpec
    from eagle3.speculative import Drafter, greedy_decode_many, speculative_decode_many
    png(tmp_path / "a.png", 70, 50)
    ids, placed = ChatEncoder(vision_target).encode_prompt_media(line(image("a.png"), "what?"), tmp_path)
    items, ckpt, cpu = [item for _, item in placed], Checkpoint(vision_target), torch.device("cpu")
    extracted = TargetRunner(ckpt, [0, 0, 1], cpu, torch.float32).run(torch.from_numpy(ids), [0, len(ids)], items)
    whole, pieces = (IncrementalTarget(ckpt, [0, 0, 1], cpu, torch.float32, chunk) for chunk in (None, 7))
    for target in (whole, pieces):
        (_, final), = target.forward_many([torch.from_numpy(ids)], [target.new_cache(items)])
        torch.testing.assert_close(final, extracted["final_hidden"].float(), rtol=1e-4, atol=1e-4)
    (_, blind), = whole.forward_many([torch.from_numpy(ids)], [whole.new_cache()])
    assert not torch.allclose(blind[-1], final[-1], atol=1e-3)   # the image changes what follows
    torch.manual_seed(0)
    H, V = ckpt.config.hidden_size, ckpt.config.vocab_size
    draft = Eagle3Draft(DraftSpec(H, 4, 4, 16, 128, 1, 1e-6, 10000.0, 1024, V, V, H))
    prompts, media = [ids.tolist(), ids.tolist()], [items, []]
    greedy = greedy_decode_many(whole, prompts, 12, media=media)
    decoded = speculative_decode_many(whole, Drafter(draft, whole.embed), prompts, 12, 3, media=media)
    assert [d.tokens for d in decoded] == [g.tokens for g in greedy]


def test_regenerated_lines_keep_their_media(vision_target, tmp_path):
    """Our own loop regenerates a conversation about an image seeing it, and writes the image beside the ids."""
    from eagle3.generate import regenerate
    from eagle3.models.incremental import IncrementalTarget
    from eagle3.models.weights import Checkpoint
    from eagle3.sampling import Sampling
    png(tmp_path / "a.png", 70, 50)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(line(image("a.png"), "what?")) + "\n")
    records, _ = read_records(data, VOCAB, 4096, target_dir=vision_target, report=False)
    target = IncrementalTarget(Checkpoint(vision_target), [0, 0, 1], torch.device("cpu"), torch.float32)
    out, = regenerate(target, records, Sampling(0.0, 1.0), 6, set(), 1, 0)
    assert out["media"] == [{"type": "image_url", "image_url": {"url": str((tmp_path / "a.png").resolve())}}]
    again = tmp_path / "regenerated.jsonl"
    again.write_text(json.dumps(out) + "\n")
    (record,), stats = read_records(again, VOCAB, 4096, target_dir=vision_target, report=False)
    assert [m.grid_thw for m in record.media] == [m.grid_thw for m in records[0].media]
    assert stats.summary()["media"]["images"] == 1


def test_an_image_and_a_video_run_through_the_target_as_extraction_runs_them(vision_target, tmp_path):
    """The tower's rows (t-pooled for a video chunk) fill exactly the pads the data side wrote for each item."""
    from eagle3.models.streaming import TargetRunner
    from eagle3.models.weights import Checkpoint
    png(tmp_path / "a.png", 70, 50)
    video(tmp_path / "v.mp4", frames=12)   # 6 frames sampled: chunks of 4 and 2
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(line(image("a.png"), {"type": "video_url", "video_url": {"url": "v.mp4"}})) + "\n")
    (record,), _ = read_records(data, VOCAB, 4096, target_dir=vision_target, report=False)
    assert [(m.kind, m.grid_thw) for m in record.media] == [("image", (1, 4, 6)), ("video", (4, 4, 6)),
                                                             ("video", (2, 4, 6))]
    ids = torch.from_numpy(record.input_ids)
    out = TargetRunner(Checkpoint(vision_target), [0, 0, 1], torch.device("cpu"), torch.float32).run(
        ids, [0, len(ids)], record.media)
    assert out["media_embeds"].shape[0] == int((ids == PAD).sum()) == 3 * 6


def chat_answer(content, reasoning=None, finish="stop"):
    """vLLM's /v1/chat/completions answer (a reasoning parser's split: `reasoning`, as later vLLM names it)."""
    return {"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "target",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "reasoning": reasoning},
                         "finish_reason": finish}], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}


def test_generate_sends_conversations_with_images_through_the_chat_api(vision_target, tmp_path, capsys):
    """Through servers, a line with an image goes to /v1/chat/completions, the image as a data: URL, each reply after
    the earlier regenerated ones; the line written back is the conversation, which extraction renders and expands.
    A text line keeps the token-id endpoint."""
    from conftest import make_config
    from test_engines import Fake, vllm_answer
    from eagle3 import generate
    png(tmp_path / "a.png", 70, 50)
    data = tmp_path / "d.jsonl"
    chat = line(image("a.png"), "what?", reply="old")
    chat["messages"] += [{"role": "user", "content": "more?"}, {"role": "assistant", "content": "old again"}]
    chat["chat_template_kwargs"] = {"thinking": True}
    text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text(json.dumps(text) + "\n" + json.dumps(chat) + "\n")
    replies = iter([chat_answer("a cat", "look at it"), chat_answer("two cats", "look again", "length")])
    fake = Fake(lambda path, body: (200, next(replies) if path == "/v1/chat/completions" else
                                    vllm_answer([40, 41, PAD - 21 + 2])))
    try:
        cfg = make_config(tmp_path, vision_target, data, **{
            "generate.output_path": tmp_path / "out" / "regen.jsonl", "generate.servers": json.dumps([fake.url]),
            "debug.generate_retries": 0})
        out = generate.run(cfg)
    finally:
        fake.close()
    chats = [body for path, body in fake.requests if path == "/v1/chat/completions"]
    assert len(chats) == 2 and len(fake.requests) == 3
    first, second = chats
    encoded = base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    assert first["messages"][0]["content"][0] == image(f"data:image/png;base64,{encoded}")
    assert first["chat_template_kwargs"] == {"thinking": True} and first["skip_special_tokens"] is False
    assert [m["role"] for m in first["messages"]] == ["user"]
    answered = second["messages"][1]   # the first reply as the engine gave it, its reasoning under both names
    assert (answered["content"], answered["reasoning_content"], answered["reasoning"]) == ("a cat", *["look at it"] * 2)
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(w["source_line"], w["source_part"]) for w in written] == [(1, 0), (2, 0)]
    assert "input_ids" in written[0] and written[1]["cut_replies"] == [1]
    turns = written[1]["messages"]
    assert turns[0]["content"][0] == image(str((tmp_path / "a.png").resolve()))   # readable from the output's folder
    assert turns[1] == {"role": "assistant", "content": "a cat", "reasoning_content": "look at it"}
    assert turns[3]["reasoning_content"] == "look again"
    records, stats = read_records(out, VOCAB, 4096, target_dir=vision_target, report=False)
    assert stats.media["images"] == len([r for r in records if r.media]) >= 1 and stats.chat.lines == 1
    assert not stats.chat.ignored   # generate's own keys are no unread field
    generate.run(cfg)   # a rerun finds it complete: one line for the line regenerated whole
    assert "already complete" in capsys.readouterr().out


def test_an_image_changed_under_the_same_data_file_is_another_extraction(vision_target, tmp_path):
    """The plan key holds each media file's path, size and time: a resumed extraction does not mix two images."""
    import os
    from conftest import make_config
    from eagle3 import extraction
    from eagle3.data.shards import DataError
    png(tmp_path / "a.png", 70, 50)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(line(image("a.png"), "what?")) + "\n")
    cfg = make_config(tmp_path, vision_target, data)
    extraction.run(cfg)
    extraction.run(cfg)   # unchanged: the same plan, nothing redone
    stat = (tmp_path / "a.png").stat()
    png(tmp_path / "a.png", 70, 50, seed=1)   # other pixels, the same size
    os.utime(tmp_path / "a.png", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match="holds an extraction of other data, target or settings"):
        extraction.run(cfg)


def test_a_pad_the_model_wrote_in_a_reply_is_a_token_not_a_placeholder(vision_target, tmp_path):
    """Only the prompt's pads are media: a reply holding the pad id (as a random target samples it) reads, extracts
    and trains with the tower's rows at the context pads alone, and the pad's own embedding in the reply."""
    from conftest import make_config
    from eagle3 import extraction
    from eagle3.data.shards import ShardReader
    from eagle3.models.streaming import MediaInputs
    from eagle3.models.weights import Checkpoint
    from eagle3.ttt import token_inputs
    png(tmp_path / "a.png", 70, 50)
    chat = line(image("a.png"), "what?", reply="a <|media_pad|> cat")
    (record,), _ = read_records(write(tmp_path / "chat.jsonl", chat), VOCAB, 4096, target_dir=vision_target,
                                report=False)
    ids, mask = torch.from_numpy(record.input_ids).long(), torch.from_numpy(record.loss_mask)
    context_pads = (ids == PAD) & (mask == 0)
    assert int(((ids == PAD) & (mask == 1)).sum()) == 1 and int(context_pads.sum()) == record.media[0].tokens
    # generate's own output: the same sequence pre-tokenized with its image
    tokens = {"input_ids": record.input_ids.tolist(), "loss_mask": record.loss_mask.tolist(),
              "media": media.parts_of(record.media)}
    data = write(tmp_path / "tokens.jsonl", tokens)
    (again,), _ = read_records(data, VOCAB, 4096, target_dir=vision_target, report=False)
    assert [m.grid_thw for m in again.media] == [m.grid_thw for m in record.media]
    cfg = make_config(tmp_path, vision_target, data)
    extraction.run(cfg)
    batch = ShardReader(cfg.extract.output_dir).read(ShardReader(cfg.extract.output_dir).sequences)
    assert batch.media_embeds.shape[0] == int(context_pads.sum())
    # the first layer's input: the tower's rows at the context pads, the token's embedding at the reply's pad
    inputs = MediaInputs(Checkpoint(vision_target), torch.device("cpu"), torch.float32)
    table = torch.randn(VOCAB, batch.media_embeds.shape[1])
    rows = batch.media_embeds.float()
    h = inputs.embed(table, ids, rows, mask == 0)
    assert torch.equal(h[context_pads], rows) and torch.equal(h[~context_pads], table[ids[~context_pads]])
    draft_input = token_inputs(table, ids, rows, PAD, mask)(torch.arange(len(ids)))   # SGLang's rule, in training
    assert torch.equal(draft_input, h)


def write(path, obj):
    path.write_text(json.dumps(obj) + "\n")
    return path


def test_the_incremental_target_skips_a_reply_pad_between_two_images(vision_target, tmp_path):
    """Generate's own loop feeds replies token by token: a pad it sampled before a later image takes no row, so the
    target's states equal extraction's over the same sequence."""
    from eagle3.models.incremental import IncrementalTarget
    from eagle3.models.streaming import TargetRunner
    from eagle3.models.weights import Checkpoint
    png(tmp_path / "a.png", 70, 50)
    png(tmp_path / "b.png", 40, 60, seed=2)
    (record,), _ = read_records(write(tmp_path / "d.jsonl", line(image("a.png"), "and", image("b.png"))), VOCAB, 4096,
                                target_dir=vision_target, report=False)
    at = int(np.flatnonzero(record.input_ids == PAD)[record.media[0].tokens - 1]) + 1   # after the first image
    ids = torch.from_numpy(np.insert(record.input_ids, at, PAD)).long()
    context = torch.from_numpy(np.insert(record.loss_mask, at, 1) == 0)   # the pad between them: written by the model
    ckpt, cpu = Checkpoint(vision_target), torch.device("cpu")
    whole = TargetRunner(ckpt, [0, 0, 1], cpu, torch.float32).run(ids, [0, len(ids)], record.media, context)
    target = IncrementalTarget(ckpt, [0, 0, 1], cpu, torch.float32)
    cache = target.new_cache(record.media)
    pieces = [target.forward_many([ids[a:b]], [cache], [context[a:b]])[0][1] for a, b in ((0, at), (at, at + 1),
                                                                                           (at + 1, len(ids)))]
    torch.testing.assert_close(torch.cat(pieces), whole["final_hidden"].float(), rtol=1e-4, atol=1e-4)
