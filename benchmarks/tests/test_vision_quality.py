"""`python -m benchmarks.vision_quality` at toy size on the CPU: every stage, end to end."""
import json
import math

import pytest
from safetensors import safe_open

from benchmarks import vision_quality as vq
from eagle3.models.vision import target_vision
from eagle3.models.weights import Checkpoint


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    pytest.importorskip("PIL")
    work = tmp_path_factory.mktemp("vision_quality")
    vq.main(["--tiny", "--work", str(work), "--device", "cpu"])
    return work


@pytest.mark.slow
def test_the_target_is_a_kimi_k25_checkpoint_that_learned(work):
    target = Checkpoint(work / "target")
    assert target.prefix == "language_model.model." and target_vision(target).width == vq.TINY.vision_width
    names = set(target.weight_map)
    assert {"language_model.lm_head.weight", "language_model.model.layers.1.mlp.gate.e_score_correction_bias",
            "vision_tower.patch_embed.proj.weight", "mm_projector.proj.2.weight"} <= names
    with safe_open(work / "target" / target.weight_map["language_model.model.embed_tokens.weight"], "pt") as f:
        assert list(f.get_slice("language_model.model.embed_tokens.weight").get_shape()) == [vq.TINY.vocab,
                                                                                               vq.TINY.hidden]
    assert (work / "target" / "tiktoken.model").exists() and not (work / "target" / "pictures").exists()
    stats = json.loads((work / "vision_quality.json").read_text())["target"]
    uniform = math.log(vq.TINY.vocab)   # where its replies' loss starts
    assert stats["held_reply_loss/image"] < uniform - 1 and stats["held_reply_loss/text"] < uniform - 1, stats


@pytest.mark.slow
def test_the_drafts_data_and_the_held_out_prompts(work):
    rows = [json.loads(x) for x in (work / "regen.jsonl").read_text().splitlines()]
    assert sum("media" in x for x in rows) == vq.TINY.train_images and len(rows) == vq.TINY.train_images + vq.TINY.train_texts
    assert all("media" not in json.loads(x) for x in (work / "text.jsonl").read_text().splitlines())
    trained = {p["image_url"]["url"] for x in rows for p in x.get("media", [])}
    for kind in vq.KINDS:
        prompts = [json.loads(x)["messages"] for x in (work / f"prompts-{kind}.jsonl").read_text().splitlines()]
        assert len(prompts) == vq.TINY.eval_prompts and all(len(m) == 1 for m in prompts)
        urls = [p["image_url"]["url"] for m in prompts if isinstance(m[0]["content"], list) for p in m[0]["content"]
                if p["type"] == "image_url"]
        assert len(urls) == (vq.TINY.eval_prompts if kind == "image" else 0)
        assert not {str(work / u) for u in urls} & trained   # pictures never trained on
    accuracy = json.loads((work / "vision_quality.json").read_text())["data"]["caption_accuracy"]
    assert accuracy["pictures"] == vq.TINY.eval_prompts and 0 <= accuracy["all"] <= 1


@pytest.mark.slow
def test_three_drafts_judged_losslessly_on_image_and_text_prompts(work):
    results = json.loads((work / "vision_quality.json").read_text())["results"]
    assert list(results) == ["text", "vllm", "sglang"]
    K = vq.TINY.ttt_steps
    for name, m in results.items():
        for kind in vq.KINDS:
            assert m[kind]["t0"]["mismatches"] == 0 and m[kind]["t0"]["prompts"] == vq.TINY.eval_prompts
            for setting in ("t0", "probabilistic"):
                assert 1.0 <= m[kind][setting]["real_accept_len"] <= 1 + K
            assert m[kind]["probabilistic"]["seeds"] == list(range(vq.TINY.eval_seeds))
        exported = json.loads((work / f"ours-{name}" / "export" / "vllm" / "config.json").read_text())
        assert exported["eagle3_media_embedding"] == ("sglang" if name == "sglang" else "vllm")
    # the text-only draft's hidden states hold no pictures; the others' do
    manifests = {p.parent.name: json.loads(p.read_text()) for p in work.glob("hidden*/manifest.json")}
    assert set(manifests) == {"hidden", "hidden-text"}
    assert "| text |" in vq.table(results, ["t0", "probabilistic"])


@pytest.mark.slow
def test_the_package_reads_the_target_as_it_was_trained(work, tmp_path):
    """A trained line with a picture: the bench's training forward on the saved weights (its rows merged at the
    placeholders) gives the logits our Kimi-K2.5 target forward computes from the files."""
    import torch
    from eagle3.models.families import build_model
    from eagle3.models.vision import merge_media
    from benchmarks import quality
    ckpt = Checkpoint(work / "target")
    model = quality.Deepseek(vq.TINY)
    prefix = "language_model."
    model.load_state_dict({n[len(prefix):]: ckpt.get(n[len(prefix + "model."):] if n != prefix + "lm_head.weight"
                                                      else "lm_head.weight").float()
                           for n in ckpt.weight_map if n.startswith(prefix)})
    line = next(x for x in (work / "regen.jsonl").read_text().splitlines() if '"media"' in x)
    (tmp_path / "line.jsonl").write_text(line + "\n")
    (x,), pad_id, _ = vq.encoded(tmp_path / "line.jsonl", work / "target", torch.device("cpu"))
    assert x.rows is not None and int((x.ids == pad_id).sum()) == x.rows.shape[0]
    with torch.no_grad():
        expected = model(x.ids[None], embeds=merge_media(model.model.embed_tokens(x.ids), x.ids, x.rows,
                                                          pad_id)[None])[0]
        target = build_model(ckpt, torch.device("cpu"), torch.float32)
        h = merge_media(ckpt.get("embed_tokens.weight").float()[x.ids], x.ids, x.rows, pad_id)
        n = len(x.ids)
        for i in range(vq.TINY.layers):
            h = target.layer_forward(target.load_layer(i), h, torch.arange(n), torch.tensor([0, n]))
        logits = torch.nn.functional.rms_norm(h, (vq.TINY.hidden,), ckpt.get("norm.weight").float(), 1e-5) @ \
            ckpt.get("lm_head.weight").float().T
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
