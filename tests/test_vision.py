"""Kimi-K2.5's vision path (eagle3/models/vision.py) against transformers 5.24's Kimi_K25 as an independent
reference, loaded by its own `from_pretrained` from the tiny target's published tensor names (its conversion
unfuses wqkv and permutes the rotary pairs): the tower and projector over images of several sizes and a two-chunk
video, and the target's hidden states with an image merged at its placeholders."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.errors import TargetError
from eagle3.models import tiny
from eagle3.models.streaming import TargetRunner
from eagle3.models.vision import (MediaItem, VisionTower, describe_cost, merge_media, target_vision, vision_config,
                                  vision_tensor_names)
from eagle3.models.weights import Checkpoint

CPU = torch.device("cpu")


def hf_config(cfg: dict):
    """transformers' Kimi_K25Config of our config.json (its vision field names differ from the published ones)."""
    tf = pytest.importorskip("transformers")
    dropped = ("quantization_config", "auto_map", "architectures")
    text = {k: v for k, v in cfg["text_config"].items() if k not in dropped}
    vc, pad = cfg["vision_config"], cfg["media_placeholder_token_id"]
    vision = dict(patch_size=vc["patch_size"], pos_emb_height=vc["init_pos_emb_height"],
                  pos_emb_width=vc["init_pos_emb_width"], pos_emb_time=vc["init_pos_emb_time"],
                  num_attention_heads=vc["vt_num_attention_heads"], num_hidden_layers=vc["vt_num_hidden_layers"],
                  hidden_size=vc["vt_hidden_size"], intermediate_size=vc["vt_intermediate_size"],
                  merge_kernel_size=vc["merge_kernel_size"])
    return tf.Kimi_K25Config(text_config={**text, "model_type": "deepseek_v3"}, vision_config=vision,
                             projection_hidden_size=vc["vt_hidden_size"],
                             projection_layer_norm_eps=vc["projector_ln_eps"], image_token_id=pad,
                             video_token_id=pad, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(our tiny Kimi-K2.5 with dense experts, transformers' model read from the same safetensors)."""
    tf = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("vision")
    path = tiny.make_kimi(root / "ours", layers=4, weights="bf16", shards=1)
    ref_dir = root / "hf"
    hf_config(json.loads((path / "config.json").read_text())).save_pretrained(ref_dir)
    (ref_dir / "model.safetensors").symlink_to(path / "model.safetensors")
    model, info = tf.Kimi_K25ForConditionalGeneration.from_pretrained(ref_dir, dtype=torch.float32,
                                                                      output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return path, model.eval()


def pixels(grid, seed):
    t, h, w = grid
    return torch.randn(t * h * w, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


# (t, h, w) in patches: the position grid's own size (8 x 8, no resize), smaller and larger, tall, wide, one token
IMAGES = [(1, 8, 8), (1, 4, 6), (1, 10, 4), (1, 2, 2), (1, 12, 16), (1, 6, 2)]


def test_tower_and_projector_equal_transformers(kimi):
    path, model = kimi
    ckpt = Checkpoint(path)
    tower = VisionTower(ckpt, target_vision(ckpt), CPU, torch.float32)
    for i, grid in enumerate(IMAGES):
        pv = pixels(grid, i)
        with torch.no_grad():
            ref = model.model.get_image_features(pv, torch.tensor([grid])).pooler_output[0]
        ours = tower.features([MediaItem("image", pv, grid)])
        assert ours.shape == (grid[1] * grid[2] // 4, 64)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    # a video of 6 frames: a chunk of 4 and one of 2, each with its time rows, after an image in the same call
    chunks = [(4, 4, 6), (2, 4, 6)]
    pvs = [pixels(g, 10 + i) for i, g in enumerate(chunks)]
    with torch.no_grad():
        ref = torch.cat(model.model.get_video_features(torch.cat(pvs), torch.tensor(chunks)).pooler_output)
    image = MediaItem("image", pixels(IMAGES[1], 1), IMAGES[1])
    ours = tower.features([image] + [MediaItem("video", pv, g) for pv, g in zip(pvs, chunks)])
    torch.testing.assert_close(ours[6:], ref, rtol=1e-4, atol=1e-5)
    # frames matter: the same chunk with its frames in another order pools other states (time rows differ)
    shuffled = pvs[1].view(2, 24, 3, 14, 14).flip(0).reshape(48, 3, 14, 14)
    assert not torch.allclose(tower.features([MediaItem("video", shuffled, chunks[1])]), ref[6:], atol=1e-3)


def image_sequence(pad: int, grid, before: list[int], after: list[int], vocab_base: int) -> list[int]:
    """Kimi's image span: <|media_begin|> (base+18) 'image' <|media_content|> (base+19) pads <|media_end|> (base+20)."""
    n = grid[1] * grid[2] // 4
    return before + [vocab_base + 18, 105, 109, 97, vocab_base + 19] + [pad] * n + [vocab_base + 20] + after


def test_extraction_with_an_image_equals_transformers_hidden_states(kimi):
    path, model = kimi
    ckpt = Checkpoint(path)
    c = target_vision(ckpt)
    base = ckpt.config.vocab_size - 256
    grids = [(1, 4, 6), (1, 6, 4)]
    seqs = [image_sequence(c.pad_id, grids[0], [3, 70, 80], [90, 91, 92, 93], base),
            image_sequence(c.pad_id, grids[1], [5], [40, 41, 42, 43, 44, 45], base)]
    media = [MediaItem("image", pixels(g, 20 + i), g) for i, g in enumerate(grids)]
    aux = [0, 1, 2]   # transformers' last hidden state is after the final norm: compared as final_hidden
    ids = torch.tensor(seqs[0] + seqs[1])
    cu = [0, len(seqs[0]), ids.numel()]
    runner = TargetRunner(ckpt, aux, CPU, torch.float32, chunk_tokens=20)   # one sequence a chunk
    got = runner.run(ids, cu, media)
    for s, (a, b) in enumerate(zip(cu, cu[1:])):
        with torch.no_grad():
            out = model(input_ids=ids[a:b][None], pixel_values=media[s].pixel_values,
                        image_grid_thw=torch.tensor([grids[s]]), output_hidden_states=True)
        ref = torch.cat([out.hidden_states[i + 1][0] for i in aux], -1)
        torch.testing.assert_close(got["aux_hidden"][a:b], ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got["final_hidden"][a:b], out.hidden_states[-1][0], rtol=1e-4, atol=1e-4)
    # the rows written at the placeholders, in order, are returned beside the states
    assert got["media_embeds"].shape == (12, 64)
    torch.testing.assert_close(got["media_embeds"], VisionTower(ckpt, c, CPU, torch.float32).features(media))
    # the staged target (one stage here) merges the same rows
    from eagle3.models.staged import StagedTarget
    staged = StagedTarget(ckpt, aux, CPU, torch.float32, 0, 1, chunk_tokens=20).run([(ids, cu, media)], None)[0]
    for key in got:
        torch.testing.assert_close(staged[key], got[key], rtol=1e-5, atol=1e-5)
    # without the image the states at and after the placeholders differ (the merge is not a no-op)
    plain = TargetRunner(ckpt, aux, CPU, torch.float32).run(ids[:cu[1]], cu[:2])
    assert not torch.allclose(plain["aux_hidden"][9:], got["aux_hidden"][9:cu[1]], atol=1e-3)


def test_placeholders_and_features_must_agree():
    embeds, ids = torch.zeros(5, 4), torch.tensor([1, 7, 7, 2, 7])
    out = merge_media(embeds, ids, torch.arange(12.).view(3, 4), pad_id=7)
    assert out[[1, 2, 4]].tolist() == torch.arange(12.).view(3, 4).tolist() and not out[[0, 3]].any()
    with pytest.raises(TargetError, match=r"3 <\|media_pad\|> tokens \(id 7\) but 2 media feature rows"):
        merge_media(embeds, ids, torch.zeros(2, 4), pad_id=7)


def test_vision_tensors_named_and_text_targets_refuse_media(kimi, tmp_path):
    path, _ = kimi
    ckpt = Checkpoint(path)
    names = vision_tensor_names(ckpt.weight_map)
    assert len(names) == 11 + 12 * 2 and all(n.startswith(("vision_tower.", "mm_projector.")) for n in names)
    from eagle3.models.inspect import inspect
    vision = inspect(str(path))["vision"]
    assert vision["tensors"] == 35 and vision["media_pad_id"] == target_vision(ckpt).pad_id == 512 - 256 + 21
    real = json.loads((Path(__file__).parent / "fixtures/kimi-k2.5/config.json").read_text())
    assert vision_config(real, "real").pads((1, 78, 138)) == 2691
    assert describe_cost(vision_config(real, "real")) == "vision tower + projector: 471M parameters (0.88 GiB in bf16)"
    config = json.loads((path / "config.json").read_text())
    del config["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    text_only = Checkpoint(tmp_path)
    assert target_vision(text_only) is None
    with pytest.raises(TargetError, match="images or video given, but the target has no vision tower"):
        TargetRunner(text_only, [0, 1, 3], CPU, torch.float32).run(
            torch.tensor([1, 2]), [0, 2], [MediaItem("image", pixels((1, 2, 2), 0), (1, 2, 2))])


# ---------------------------------------------------------------------------------------------
# the draft's input at the placeholders: vLLM's rule (the placeholder's embedding) or SGLang's (the vision rows)

def test_the_draft_reads_the_placeholder_embedding_under_vllm_and_the_vision_rows_under_sglang():
    from eagle3.kernels.reference import ttt_attention, ttt_loss_steps
    from eagle3.ttt import token_inputs, ttt_forward
    from test_ttt import random_batch, tiny_draft
    pad, draft = 39, tiny_draft()
    embed, head = torch.randn(40, 16), torch.randn(24, 16)
    batch = random_batch([12, 17])
    ids = batch.input_ids.clone()
    ids[ids == pad] = 1
    ids[[3, 4, 5, 20, 21]] = pad
    rows = torch.randn(5, 16)
    batch = dataclasses.replace(batch, input_ids=ids, media_embeds=rows)
    index = torch.tensor([0, 3, 4, 20, 21, 28])
    vllm = token_inputs(embed, ids.long(), rows, None)(index)
    sglang = token_inputs(embed, ids.long(), rows, pad)(index)
    assert torch.equal(vllm[1:5], embed[pad].expand(4, -1))            # vLLM: <|media_pad|>'s own row
    assert torch.equal(sglang[1:5], rows[[0, 1, 3, 4]])                 # SGLang: the target's vision rows, in order
    assert torch.equal(sglang[[0, 5]], vllm[[0, 5]])                    # text tokens alike

    def loss(media_pad, b=batch):
        return ttt_forward(draft, b, embed, head, 3, ttt_attention, ttt_loss_steps, media_pad=media_pad)[0]

    assert not torch.allclose(loss(pad), loss(None))
    # SGLang's rule with the vision rows equal to the placeholder's embedding is vLLM's
    same = dataclasses.replace(batch, media_embeds=embed[pad].expand(5, -1).clone())
    torch.testing.assert_close(loss(pad, same), loss(None), rtol=0, atol=0)


def test_real_decoding_drafter_reads_the_prompts_vision_rows_under_sglang_only(monkeypatch):
    from eagle3.speculative import Drafter
    from test_ttt import tiny_draft
    pad, draft, embed = 39, tiny_draft(), torch.randn(40, 16)
    rows = torch.randn(2, 16)
    tokens = [5, pad, pad, 7, 8, pad]   # the prompt's two pads, then one the model wrote (a token)
    seen = []
    step = draft.step
    monkeypatch.setattr(draft, "step", lambda h, emb, *a, **kw: seen.append(emb.clone()) or step(h, emb, *a, **kw))
    aux = torch.randn(5, 48)
    for media_pad in (None, pad):
        drafter = Drafter(draft, embed, media_pad)
        drafter.propose_many([aux], [tokens], 1, caches=[drafter.new_cache(rows)])
    vllm, sglang = seen   # step 0's inputs: row t reads x[t+1]
    assert torch.equal(vllm, embed[tokens[1:]])
    assert torch.equal(sglang[[0, 1]], rows) and torch.equal(sglang[2:], embed[tokens[3:]])


def test_shards_keep_the_vision_rows_and_reads_of_any_sequences_get_theirs(kimi, tmp_path):
    from eagle3.data.inputs import Record
    from eagle3.data.shards import FORMAT_VERSION, MANIFEST, ShardReader, shard_tensors, write_shard
    path, _ = kimi
    ckpt = Checkpoint(path)
    c = target_vision(ckpt)
    base = ckpt.config.vocab_size - 256
    grids = [(1, 4, 4), None, (1, 2, 6)]   # an image, a text-only sequence, another image
    records, media = [], []
    for i, g in enumerate(grids):
        items = [MediaItem("image", pixels(g, 30 + i), g)] if g else []
        ids = image_sequence(c.pad_id, g, [7 + i], [50, 51], base) if g else [9, 10, 11, 12]
        mask = np.r_[np.zeros(len(ids) - 2), np.ones(2)].astype(np.uint8)   # the last two tokens are the reply
        records.append(Record(i + 1, np.array(ids, np.int32), mask, media=items))
        media += items
    ids = torch.from_numpy(np.concatenate([r.input_ids for r in records]))
    cu = np.cumsum([0] + [len(r.input_ids) for r in records]).tolist()
    out = TargetRunner(ckpt, [0, 1, 2], CPU, torch.float32).run(ids, cu, media)
    write_shard(tmp_path, 0, shard_tensors(records, out, "bfloat16"))
    (tmp_path / MANIFEST).write_text(json.dumps({
        "format_version": FORMAT_VERSION, "target": {}, "aux_layer_ids": [0, 1, 2], "media_pad_id": c.pad_id,
        "shards": [{"file": "shard-00000.safetensors"}]}))
    reader = ShardReader(tmp_path)
    rows = out["media_embeds"].bfloat16()
    assert torch.equal(reader.read([reader.sequences[2]]).media_embeds, rows[4:])
    assert torch.equal(reader.read([reader.sequences[2], reader.sequences[0]]).media_embeds,
                       torch.cat([rows[4:], rows[:4]]))
    assert reader.read([reader.sequences[1]]).media_embeds.shape == (0, 64)
    # a window of the packed rows (a context-parallel rank's read) from inside the first image's placeholders
    window = reader.read([reader.sequences[0], reader.sequences[2]], rows=lambda T: (7, T))
    assert torch.equal(window.media_embeds, torch.cat([rows[1:4], rows[4:]]))


# ---------------------------------------------------------------------------------------------
# end to end at toy scale: drafts trained with images (under each engine's rule) and text-only, judged on both

def split_lines(chat, data, tmp_path):
    """(the text-only lines of the regenerated `data`, {"image"|"text": prompts}): the prompts are the user turns of
    the last lines of `chat`, the same questions as the training lines."""
    lines = [json.loads(x) for x in data.read_text().splitlines()]
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps(x) + "\n" for x in lines if "media" not in x))
    asked = [json.loads(x)["messages"][:1] for x in chat.read_text().splitlines()]
    prompts = {}
    for kind, want in (("image", True), ("text", False)):
        chosen = [m for m in asked if any(p.get("type") == "image_url" for p in m[0]["content"]) == want][-6:]
        prompts[kind] = chat.parent / f"prompts-{kind}.jsonl"   # beside the images its paths name
        prompts[kind].write_text("".join(json.dumps({"messages": m}) + "\n" for m in chosen))
    return text, prompts


@pytest.mark.slow
def test_drafts_trained_with_images_and_text_only_judged_on_image_and_text_prompts(tmp_path):
    pytest.importorskip("PIL")
    from conftest import make_config
    from eagle3 import extraction, generate, training
    from eagle3.evaluate import real_decoding
    from eagle3.train_state import latest
    target = tiny.make_kimi(tmp_path / "kimi", layers=4, shards=1)
    tiny.write_kimi_chat(target, 512)
    chat = tiny.make_image_chat(tmp_path / "data" / "chat.jsonl", conversations=64)
    common = {"train.max_steps": 60, "train.batch_tokens": 400, "evaluate.max_new_tokens": 16,
              "debug.evaluate_device": "cpu", "draft.num_attention_heads": 4, "draft.num_key_value_heads": 4,
              "generate.temperature": 0, "generate.max_new_tokens": 16, "debug.generate_dtype": "float32",
              "debug.generate_batch_size": 64, "data.on_error": "skip"}
    # the replies the target's own greedy ones (seeing the images), as real decoding then writes them
    data = generate.run(make_config(tmp_path, target, chat, **common, **{
        "generate.output_path": tmp_path / "data" / "regenerated.jsonl"}))
    text, prompts = split_lines(chat, data, tmp_path)
    runs = {"text only": (text, "vllm"), "images, vLLM rule": (data, "vllm"), "images, SGLang rule": (data, "sglang")}
    table = {}
    for name, (path, rule) in runs.items():
        work = tmp_path / name.replace(" ", "").replace(",", "")
        cfg = make_config(work, target, path, **common, **{"draft.media_embedding": rule,
                                                          "extract.output_dir": tmp_path / ("hidden-" + path.stem)})
        if not (Path(cfg.extract.output_dir) / "manifest.json").exists():
            extraction.run(cfg)
        training.run(cfg)
        checkpoint = latest(cfg.train.output_dir)
        table[name] = {kind: real_decoding(cfg, checkpoint, p) for kind, p in prompts.items()}
        exported = json.loads((Path(cfg.train.output_dir) / "export" / "vllm" / "config.json").read_text())
        assert exported["eagle3_media_embedding"] == rule
    accept = {name: {kind: r["real_accept_len"] for kind, r in row.items()} for name, row in table.items()}
    print(accept)
    for row in table.values():   # lossless at T = 0 with images in the prompts, under either rule
        assert all(r["mismatches"] == 0 and r["prompts"] == 6 for r in row.values())
    # what the target computes after an image is learnt from images only: on image prompts the drafts trained with
    # them accept clearly more than the text-only one, under either engine's rule
    for name in ("images, vLLM rule", "images, SGLang rule"):
        assert accept[name]["image"] > accept["text only"]["image"] + 0.2, accept
    manifest = json.loads((tmp_path / "hidden-regenerated" / "manifest.json").read_text())
    assert manifest["media_pad_id"] == 512 - 256 + 21
