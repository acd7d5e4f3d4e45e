"""`python -m benchmarks.quality` at toy size on the CPU: every stage but the peer, end to end."""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import quality
from eagle3.models.weights import Checkpoint


# TINY's draft recipe (4 steps at lr 3e-4, inside the 20 warm-up steps) leaves every draft as it started (real
# tau 1.0 at T = 0); 8 steps at 1e-2 learn the tiny target's greedy token: the checks below can tell the two apart
RECIPE = ["--recipe", "lr=1e-2", "--recipe", "epochs=2"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("quality")
    quality.main(["--tiny", "--work", str(work), "--device", "cpu", "--stages", "target,data,ours,measure", *RECIPE,
                "--variant", "base", "--variant", "trained-head:experimental.freeze_lm_head=false",
                "--variant", "aux:target.aux_layer_ids=[1,3,6]",
                "--variant", "sampled:data.path={work}/regen-sampled.jsonl,train.loss=nla",
                "--variant", "thinking:data.path={work}/thinking.jsonl"])
    return work


@pytest.mark.slow
def test_the_target_is_a_hugging_face_llama_our_reader_loads(work):
    target = Checkpoint(work / "target")
    r = quality.TINY
    assert target.config.hidden_size == r.hidden and target.config.num_hidden_layers == r.layers
    assert target.config.default_aux_layer_ids() == [1, 3, 4]
    names = set(load_file(work / "target" / "model.safetensors"))
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight"} <= names
    assert (work / "target" / "tokenizer.json").exists()
    # it learned: well below a uniform guess over its vocabulary (ln 384 = 5.95, where it starts), on the
    # judging files too (a target of one step, or lr 0, stays at 5.95)
    target = json.loads((work / "quality.json").read_text())["target"]
    uniform = math.log(quality.TINY.vocab)
    assert target["train_loss"] < uniform - 0.5 and target["judging_files_loss"] < uniform - 0.5, target


@pytest.mark.slow
def test_judging_prompts_never_come_from_the_draft_data(work):
    prompts = [json.loads(line)["input_ids"] for line in (work / "prompts.jsonl").read_text().splitlines()]
    data = [json.loads(line) for line in (work / "regen.jsonl").read_text().splitlines()]
    assert len(prompts) == quality.TINY.eval_prompts and len(data) == quality.TINY.train_prompts
    text = {tuple(d["input_ids"][i:i + len(p)]) for d in data for p in prompts for i in range(len(d["input_ids"]))}
    assert not any(tuple(p) in text for p in prompts)
    assert all(sum(d["loss_mask"]) == quality.TINY.reply_len for d in data)
    # the same prompts, their replies sampled at the serving temperature instead of greedily
    sampled = [json.loads(line) for line in (work / "regen-sampled.jsonl").read_text().splitlines()]
    prompt_of = lambda d: d["input_ids"][:d["loss_mask"].index(1)]   # noqa: E731
    assert [prompt_of(d) for d in sampled] == [prompt_of(d) for d in data]
    assert sum(d["input_ids"] != g["input_ids"] for d, g in zip(sampled, data)) > len(data) // 2


@pytest.mark.slow
def test_measure_reports_real_decoding_of_every_variant_losslessly(work):
    results = json.loads((work / "quality.json").read_text())["results"]
    assert set(results) == {"base", "trained-head", "aux", "sampled", "thinking"}
    K = quality.TINY.ttt_steps
    for m in results.values():
        assert m["t0"]["mismatches"] == 0 and m["t0"]["prompts"] == quality.TINY.eval_prompts
        for setting in ("t0", "greedy", "probabilistic"):
            assert 1.0 <= m[setting]["real_accept_len"] <= 1 + K and len(m[setting]["per_position_acceptance"]) == K
        for setting in ("greedy", "probabilistic"):   # sampled: every seed decoded, the spread beside the mean
            assert m[setting]["seeds"] == list(range(quality.TINY.eval_seeds)) and "real_accept_len_sd" in m[setting]
            saved = json.loads((work / f"eval-base-{setting}.json").read_text())
            assert (saved["temperature"], saved["top_p"]) == (quality.TINY.serve_temperature, quality.TINY.serve_top_p)
    frozen = load_file(work / "ours-base" / "export" / "vllm" / "model.safetensors")["lm_head.weight"]
    trained = load_file(work / "ours-trained-head" / "export" / "vllm" / "model.safetensors")["lm_head.weight"]
    assert not torch.equal(frozen, trained)   # the variant's override reached the trainer
    assert "| base |" in quality.table(results)
    # a variant that changes the hidden states reads shards of its own, and its export says which layers
    assert json.loads((work / "hidden-aux" / "manifest.json").read_text())["aux_layer_ids"] == [1, 3, 6]
    config = json.loads((work / "ours-aux" / "export" / "vllm" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 7]
    assert not (work / "hidden-base").exists() and not (work / "hidden-trained-head").exists()
    # {work} names a file of the work directory: the sampled replies, extracted apart
    manifest = json.loads((work / "hidden-sampled" / "manifest.json").read_text())
    assert manifest["source"]["path"].endswith("regen-sampled.jsonl"), manifest["source"]
    state = json.loads(next((work / "ours-sampled" / "checkpoints").glob("step-*/state.json")).read_text())
    assert state["config"]["train"]["loss"] == "nla"


@pytest.mark.slow
def test_the_thinking_variant_trains_every_reply_token_through_the_chat_path(work):
    """thinking.jsonl holds the greedy replies as chat lines, half reasoning, the long ones (long_reply_len) last:
    extracted through the chat path, every reply token is trained (reasoning about half of them), the same text as
    the pre-tokenized lines."""
    from tokenizers import Tokenizer
    chat = json.loads((work / "hidden-thinking" / "manifest.json").read_text())["source"]["chat"]
    r = quality.TINY
    assert chat["lines"] == chat["sequences"] == r.train_prompts + r.long_prompts and not chat["fields_not_rendered"]
    trained = chat["trained_tokens"]
    assert trained["tool_calls"] == 0 and 0.3 < trained["reasoning"] / sum(trained.values()) < 0.7, trained
    tok = Tokenizer.from_file(str(work / "target" / "tokenizer.json"))
    greedy = [json.loads(line) for name in ("regen.jsonl", quality.LONG_REPLIES)
              for line in (work / name).read_text().splitlines()]
    assert [sum(row["loss_mask"]) for row in greedy[-r.long_prompts:]] == [r.long_reply_len] * r.long_prompts
    lines = [json.loads(line) for line in (work / "thinking.jsonl").read_text().splitlines()]
    assert len(lines) == len(greedy)
    for row, line in zip(greedy, lines):
        user, reply = line["messages"]
        assert user["content"] + reply["reasoning_content"] + reply["content"] == tok.decode(row["input_ids"])


@pytest.mark.slow
def test_every_draft_learned_what_the_target_does(work):
    """Each draft's held-out acceptance and loss, and its real decoding, against what a draft that learned nothing
    gets (this run at lr 1e-9: held-out alpha 0.46-0.65, held-out loss as high as its training's, real tau 1.0)."""
    results = json.loads((work / "quality.json").read_text())["results"]
    # not the thinking variant: the toy target's replies are one space token repeated, which the chat path's text
    # re-tokenizes into longer runs of spaces, tokens the target never predicts (at full size it matches base)
    for name, m in ((n, m) for n, m in results.items() if n != "thinking"):
        lines = (work / f"ours-{name}" / "metrics.jsonl").read_text().splitlines()
        log = {r["split"]: r for r in map(json.loads, lines)}
        train, held_out = log["train"], log["eval"]   # train: the mean over the whole run (one window, from step 1)
        assert train["step"] == held_out["step"] < 50, name   # 50: our_config's log_every
        # nla's loss is -log alpha: the final draft's proposals are accepted over 90% of the time at position 1
        assert held_out["alpha"][0] > 0.9, (name, held_out["alpha"])
        assert held_out["loss"][0] < train["loss"][0] / 3, (name, held_out["loss"][0], train["loss"][0])
        # the target's greedy replies are one token repeated: a draft that found it gets whole chains accepted.
        # Not the trained head: matched to the target's flat distribution, its top two tokens swap from step to step
        if name != "trained-head":
            assert m["t0"]["real_accept_len"] >= 3, (name, m["t0"])


def test_variant_syntax():
    assert quality.parse_variant("base") == ("base", {})
    assert quality.parse_variant("lr:train.lr=1e-3,train.warmup_steps=5") == (
        "lr", {"train.lr": "1e-3", "train.warmup_steps": "5"})
    assert quality.parse_variant("aux:target.aux_layer_ids=[1,3,6],train.lr=1e-3") == (
        "aux", {"target.aux_layer_ids": "[1,3,6]", "train.lr": "1e-3"})
    with pytest.raises(SystemExit, match="name"):
        quality.parse_variant("a b:train.lr=1")
    with pytest.raises(SystemExit, match="expected"):
        quality.parse_variant("x:train.lr")
    with pytest.raises(SystemExit, match="not starting with 'peer'"):   # the peer's drafts are named so
        quality.parse_variant("peer2:train.lr=1")
    with pytest.raises(SystemExit, match="flags need a name"):
        quality.run_peer(quality.TINY, Path("/nonexistent"), Path("script.py"), ":--eagle31")
    with pytest.raises(SystemExit, match="--data takes one of greedy, sampled"):
        quality.run_peer(quality.TINY, Path("/nonexistent"), Path("script.py"), "x:--loss-fn nla --data hot")
    changed = quality.with_changes(quality.Recipe(), ["train_prompts=3072", "lr=3e-4"])
    assert (changed.train_prompts, changed.lr, changed.epochs) == (3072, 3e-4, quality.Recipe().epochs)
    with pytest.raises(SystemExit, match="key=value"):
        quality.with_changes(quality.Recipe(), ["no_such_field=1"])


@pytest.mark.slow
def test_a_work_directory_built_with_another_recipe_is_refused(work):
    with pytest.raises(SystemExit, match=r"another recipe \(lr: 0.01 there, 0.001 asked\)"):
        quality.main(["--tiny", "--work", str(work), "--stages", "measure", *RECIPE, "--recipe", "lr=1e-3"])


@pytest.fixture(scope="module")
def long_work(tmp_path_factory):
    work = tmp_path_factory.mktemp("quality-long")
    quality.main(["--tiny", "--long", "--work", str(work), "--device", "cpu", "--stages", "target,data,ours,measure",
                  "--judge", "t0,greedy", "--recipe", "lr=1e-2"])
    return work


@pytest.mark.slow
def test_the_long_variant_trains_whole_and_windowed_drafts_on_the_same_tokens(long_work):
    r = quality.TINY_LONG
    assert quality.hf_config(quality.LONG, 0)["max_position_embeddings"] == quality.LONG.seq_len == 8192
    lines = {kind: [json.loads(line) for line in (long_work / name).read_text().splitlines()]
             for kind, name in quality.LONG_DATA.items()}
    assert len(lines["whole"]) == r.train_prompts and {len(x["input_ids"]) for x in lines["whole"]} == {r.long_len}
    assert max(len(x["input_ids"]) for x in lines["short"]) == r.window + 2     # the window and the 2 tokens before it
    trained = {kind: [t for x in rows for t, m in zip(x["input_ids"], x["loss_mask"]) if m]
               for kind, rows in lines.items()}
    assert trained["whole"] == trained["short"] == trained["mix"]               # the same tokens, in the same order
    labelled = {kind: [t for x in rows for t in x["input_ids"][2:]] for kind, rows in lines.items()}
    assert labelled["whole"] == labelled["short"] == labelled["mix"]            # a row labels the token two ahead
    half = r.train_prompts // 2
    assert [x["input_ids"] for x in lines["mix"][:half]] == [x["input_ids"] for x in lines["whole"][:half]]
    assert max(len(x["input_ids"]) for x in lines["mix"][half:]) == r.window + 2
    # a later device call carries the target, not the corpus ids: encoded again with its tokenizer, the same
    saved = torch.load(long_work / "corpus_ids.pt")
    (long_work / "corpus_ids.pt").rename(long_work / "ids.bak")
    try:
        assert [t.tolist() for t in quality.corpus_ids(r, long_work)] == [t.tolist() for t in saved]
    finally:
        (long_work / "ids.bak").rename(long_work / "corpus_ids.pt")
    for name, hidden in (("whole", "hidden"), ("short", "hidden-short"), ("mix", "hidden-mix")):
        manifest = json.loads((long_work / hidden / "manifest.json").read_text())
        assert manifest["source"]["path"].endswith(quality.LONG_DATA[name]), manifest["source"]
    prompts = [len(json.loads(line)["input_ids"])
               for line in (long_work / quality.LONG_PROMPTS).read_text().splitlines()]
    assert prompts == [r.prompt_len] * 3 + [2 * r.window, (2 * r.window + r.seq_len - r.eval_new_tokens) // 2,
                                            r.seq_len - r.eval_new_tokens]


@pytest.mark.slow
def test_the_long_variant_judges_by_depth_on_short_and_deep_prompts(long_work):
    results = json.loads((long_work / "quality.json").read_text())["results"]
    assert set(results) == {"whole", "short", "mix", "window", "plain"}
    # the target scales its rotary (llama3); the drafts carry that scaling to the engines, but the plain-RoPE arm
    target = json.loads((long_work / "target" / "config.json").read_text())["rope_scaling"]
    exported = {name: json.loads((long_work / f"ours-{name}" / "export" / "vllm" / "config.json").read_text())
                ["transformer_layer_config"] for name in results}
    assert target == quality.long_rope(quality.TINY_LONG) and target["rope_type"] == "llama3"
    assert exported["whole"]["rope_scaling"] == exported["window"]["rope_scaling"] == target
    assert exported["plain"].get("rope_scaling") is None
    for m in results.values():
        assert m["t0"]["mismatches"] == 0 and m["t0"]["prompts"] == quality.TINY_LONG.eval_prompts
        for setting in ("t0", "greedy"):
            buckets = {b["label"]: b for b in m[setting]["by_depth"]}
            assert list(buckets) == ["<16", "16-32", "32-64", ">=64"]             # depth_edges: 16, 32, 64
            assert sum(b["rounds"] for b in buckets.values()) == pytest.approx(m[setting]["rounds"])
            # short prompts (6 + 8 tokens) start their rounds below 16, deep ones (32, 76, 120) from 32 on
            assert buckets["<16"]["rounds"] > 0 and buckets["16-32"]["rounds"] == 0
            assert buckets["32-64"]["rounds"] > 0 and buckets[">=64"]["rounds"] > 0
        assert "real_accept_len_sd" in m["greedy"]["by_depth"][0]
    table = quality.depth_table(results).splitlines()
    assert table[0] == "| draft | setting | <16 | 16-32 | 32-64 | >=64 |" and len(table) == 2 + 2 * len(results)


def test_drafts_by_seed_and_in_the_published_shapes():
    """`draft_seeds` repeats each of the recipe's drafts with train.seed 1.. beside it; the DeepSeek bench adds the
    published Kimi drafts' shapes (the target's MLP width and full vocabulary; GQA with a KV head per head)."""
    r = quality.Recipe(target_kind="deepseek", draft_seeds=2)
    names = [quality.parse_variant(v)[0] for v in quality.equal_size_variants(r)]
    assert names == ["mla", "gqa", "mla-published", "gqa-published", "mla-s1", "gqa-s1", "mla-published-s1",
                     "gqa-published-s1"]
    published = dict(quality.parse_variant(v) for v in quality.published_variants(r))
    assert published["gqa-published"] == {"draft.attention": "gqa", "draft.num_key_value_heads": "4",
                                          "draft.head_dim": "64", "draft.intermediate_size": "768",
                                          "vocab.draft_vocab_size": "2048"}
    assert quality.parse_variant(quality.seeded(r, ["whole"])[1]) == ("whole-s1", {"train.seed": "1"})
    long = [quality.parse_variant(v)[0] for v in quality.long_variants(quality.LONG)]
    assert long == ["whole", "short", "mix", "window", "plain"]


def test_a_converged_target_stops_when_its_judging_loss_flattens_and_reports_it_by_position():
    assert not quality.converged([3.0, 2.0, 1.9], 2)                  # 1.9 is 5% below the best before the window
    assert quality.converged([3.0, 2.0, 1.99, 1.985], 2)              # under 1% in 2 checks
    assert not quality.converged([3.0, 2.98], 2)                      # too few checks
    losses = torch.arange(8192, dtype=torch.float32)
    buckets = quality.position_buckets(losses)
    assert list(buckets) == ["0-128", "128-512", "512-2048", "2048-4096", "4096-8192"]
    assert buckets["0-128"] == 63.5 and list(quality.position_buckets(losses[:100])) == ["0-100"]


def _saved_and_read_back(model, r, tmp_path):
    """The bench's target `model` saved as the bench saves it -> (its own logits on 30 tokens as saved, ours from the
    files by our target forward, the checkpoint)."""
    from eagle3.models.families import build_model
    with torch.no_grad():
        model.load_state_dict({k: v.bfloat16().float() for k, v in model.state_dict().items()})   # as saved
        ids = torch.randint(0, r.vocab, (1, 30), generator=torch.Generator().manual_seed(1))
        expected = model(ids)[0]
    quality.write_target(model, r, 0, tmp_path)
    ckpt = Checkpoint(tmp_path)
    target = build_model(ckpt, torch.device("cpu"), torch.float32)
    h = ckpt.get("embed_tokens.weight").float()[ids[0]]
    for i in range(r.layers):
        h = target.layer_forward(target.load_layer(i), h, torch.arange(30), torch.tensor([0, 30]))
    logits = torch.nn.functional.rms_norm(h, (r.hidden,), ckpt.get("norm.weight").float(), 1e-5) @ \
        ckpt.get("lm_head.weight").float().T
    return expected, logits, ckpt, target


def test_the_deepseek_target_is_one_our_mla_forward_reads_as_trained(tmp_path):
    """The MLA-target variant's model, saved, gives the logits our DeepSeek-V3 target forward computes from the
    files (MLA with YaRN, sigmoid-routed experts behind a dense first layer); its two drafts weigh the same."""
    import dataclasses
    r = dataclasses.replace(quality.TINY, target_kind="deepseek", layers=4)
    torch.manual_seed(0)
    model = quality.Deepseek(r)
    for m in model.modules():   # an uneven balancing bias, as training leaves it
        if isinstance(m, quality.MoE):
            m.gate.e_score_correction_bias.normal_(0, 0.05)
    expected, logits, ckpt, _ = _saved_and_read_back(model, r, tmp_path)
    assert ckpt.config.is_deepseek and ckpt.config.rope_scaling["factor"] == 4.0
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    variants = [quality.parse_variant(v)[1] for v in quality.equal_size_variants(quality.Recipe(target_kind="deepseek"))]
    assert variants[0] == {"draft.attention": "mla"} and variants[1]["draft.intermediate_size"] == "547"


def test_the_qwen3_moe_target_is_one_our_forward_reads_as_trained(tmp_path):
    """The Qwen3-MoE-shaped variant's model, saved, gives the logits our Qwen3-MoE target forward computes from the
    files (per-head q/k norms, softmax-routed experts behind a dense first layer)."""
    import dataclasses
    r = dataclasses.replace(quality.TINY, target_kind="qwen3_moe", layers=4, heads=2)
    torch.manual_seed(0)
    expected, logits, ckpt, target = _saved_and_read_back(quality.Llama(r), r, tmp_path)
    assert ckpt.config.family.name == "Qwen3-MoE"
    assert [e is None for e in target.layout.experts] == [True, False, False, False]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_second_measure_judges_only_drafts_not_yet_judged(long_work, monkeypatch):
    """`measure` after a `wait` (the peer trained beside ours) must not judge ours again: its files are kept."""
    import eagle3.evaluate
    before = json.loads((long_work / "quality.json").read_text())["results"]
    monkeypatch.setattr(eagle3.evaluate, "real_decoding", lambda *a, **k: pytest.fail("judged again"))
    again = quality.measure(quality.TINY_LONG, long_work, "cpu", ["t0", "greedy"])
    assert {n: m["t0"]["real_accept_len"] for n, m in again.items()} == \
           {n: m["t0"]["real_accept_len"] for n, m in before.items()}


@pytest.mark.slow
def test_measure_stages_side_by_side_each_judge_their_drafts_into_one_summary(long_work, tmp_path, monkeypatch):
    """`--drafts` judges the named drafts alone (measure@NAME stages run side by side on one GPU) and adds them to
    quality.json's results beside the others; an unknown name is refused with what is there."""
    import shutil
    import eagle3.evaluate
    work = tmp_path / "w"
    shutil.copytree(long_work, work, ignore=shutil.ignore_patterns("hidden*"))
    for name in ("whole", "short"):
        (work / f"eval-{name}-t0.json").unlink()
    judged, real = [], eagle3.evaluate.real_decoding

    def spy(cfg, path, prompts, out):
        judged.append(path.parent.parent.name)
        return real(cfg, path, prompts, out=out)
    monkeypatch.setattr(eagle3.evaluate, "real_decoding", spy)
    args = ["--tiny", "--long", "--work", str(work), "--device", "cpu", "--stages", "measure", "--judge", "t0,greedy",
            "--recipe", "lr=1e-2"]
    quality.main([*args, "--drafts", "whole"])
    assert judged == ["ours-whole"]
    results = json.loads((work / "quality.json").read_text())["results"]
    assert set(results) == {"whole", "short", "mix", "window", "plain"} and "t0" in results["whole"]
    with pytest.raises(SystemExit, match="no trained draft named wide"):
        quality.main([*args, "--drafts", "short,wide"])
    assert judged == ["ours-whole"]
