"""Speculative decoding is lossless; the TTT acceptance estimate equals real decoding on data the
target regenerated greedily; real decoding of our checkpoints and of vLLM-layout drafts on prompts;
evaluate and generate commands."""
import copy
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import edited_copy as vllm_variant, make_config
from eagle3 import train_state
from eagle3 import extraction, generate, training
from eagle3.data.loader import split_holdout
from eagle3.data.shards import ShardReader
from eagle3.draft import DraftSpec, Eagle3Draft
from eagle3.__main__ import main
from eagle3.data.inputs import InputError
from eagle3.evaluate import (Prompt, batches, decoding_report, depth_buckets, depth_label, over_seeds, read_prompts,
                             real_decoding, reply_positions, run)
from eagle3.draft_io import DraftLoadError, load_vllm_draft
from eagle3.speculative import Decoded, Drafter, greedy_decode_many, speculative_decode_many
from eagle3.models import tiny
from eagle3.models.weights import Checkpoint
from eagle3.models.incremental import IncrementalTarget
from eagle3.models.streaming import TargetRunner
from eagle3.ttt import ttt_forward
from eagle3.kernels.reference import ttt_attention, ttt_loss_steps
from test_chat import qwen_tokenizer


def greedy_decode(target, prompt, max_new, stop=frozenset()):
    return greedy_decode_many(target, [prompt], max_new, stop)[0]


def speculative_decode(target, drafter, prompt, max_new, k, stop=frozenset()):
    return speculative_decode_many(target, drafter, [prompt], max_new, k, stop)[0]


@pytest.fixture(scope="module")
def target(llama_target):
    return IncrementalTarget(Checkpoint(llama_target), [1, 2, 3], torch.device("cpu"))


@pytest.fixture(scope="module")
def kimi_target(tmp_path_factory):
    path = tiny.make_kimi(tmp_path_factory.mktemp("kimi"), vocab=256)
    return IncrementalTarget(Checkpoint(path), [1, 2, 3], torch.device("cpu"))


def test_cached_forward_equals_streaming_forward(target, llama_target):
    ids = torch.randint(0, 256, (30,))
    cache = target.new_cache()
    parts = [target.forward_many([ids[a:b]], [cache])[0] for a, b in ((0, 11), (11, 12), (12, 30))]
    ref = TargetRunner(Checkpoint(llama_target), [1, 2, 3], torch.device("cpu"), torch.float32).run(ids, [0, 30])
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), ref["final_hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), ref["aux_hidden"], rtol=1e-5, atol=1e-5)


class OracleDrafter:
    """Proposes the target's own greedy continuation with every third token wrong."""

    def __init__(self, target):
        self.target, self.calls = target, 0

    def propose(self, aux, tokens, k):
        out = greedy_decode(self.target, tokens.tolist(), k).tokens
        self.calls += 1
        if self.calls % 3 == 0:
            out[self.calls % k] = (out[self.calls % k] + 1) % 256
        return out

    def new_cache(self, rows=None):
        return None

    def propose_many(self, auxes, tokens, k, caches):
        return [self.propose(aux, torch.tensor(t), k) for aux, t in zip(auxes, tokens)]


def random_drafter(target, seed):
    torch.manual_seed(seed)
    H = target.embed.shape[1]
    draft = Eagle3Draft(DraftSpec(H, 4, 2, 8, 64, 1, 1e-6, 10000.0, 256, 128, 256, H))
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[torch.randperm(256)[:128]] = True
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(t2d.nonzero().flatten() - torch.arange(128))
    return Drafter(draft, target.embed)


@pytest.mark.parametrize("family", ["llama", "kimi"])
@pytest.mark.parametrize("make", ["oracle", "random"])
def test_speculative_decoding_is_lossless(request, family, make):
    target = request.getfixturevalue("target" if family == "llama" else "kimi_target")
    drafter = OracleDrafter(target) if make == "oracle" else random_drafter(target, 0)
    for seed in range(3):
        prompt = torch.randint(0, 256, (7 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = greedy_decode(target, prompt, 25)
        spec = speculative_decode(target, drafter, prompt, 25, k=4)
        assert spec.tokens == plain.tokens
        if make == "oracle":
            assert spec.mean_accepted > 2
    stop = {plain.tokens[5]}
    assert speculative_decode(target, drafter, prompt, 25, k=4, stop=stop).tokens == \
        greedy_decode(target, prompt, 25, stop=stop).tokens


@pytest.mark.parametrize("family", ["llama", "kimi"])
def test_batched_decoding_equals_one_prompt_at_a_time(request, family):
    target = request.getfixturevalue("target" if family == "llama" else "kimi_target")
    drafter = random_drafter(target, 1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 12, 1, 9)]
    stop = {greedy_decode(target, prompts[1], 20).tokens[6]}      # one prompt stops early
    greedy = [greedy_decode(target, p, 20, stop) for p in prompts]
    assert greedy_decode_many(target, prompts, 20, stop) == greedy
    batched = speculative_decode_many(target, drafter, prompts, 20, 3, stop)
    assert batched == [speculative_decode(target, drafter, p, 20, 3, stop) for p in prompts]
    assert [b.tokens for b in batched] == [g.tokens for g in greedy] and len(batched[1].tokens) == 7
    # the prefill's token alone reaches the limit: no round at all
    assert speculative_decode(target, drafter, prompts[0], 1, 3).accepted == []


class DepthDrafter(OracleDrafter):
    """Proposes the target's greedy continuation of the prompts (`prompts`, decoded once), its first token wrong from
    context depth `wrong_from` on."""

    def __init__(self, target, prompts: list[list[int]], wrong_from: int, max_new: int):
        super().__init__(target)
        self.wrong_from = wrong_from
        self.greedy = [p + d.tokens for p, d in zip(prompts, greedy_decode_many(target, prompts, max_new))]

    def propose(self, aux, tokens, k):
        tokens = tokens.tolist()
        full = next(g for g in self.greedy if g[:len(tokens)] == tokens)
        out = full[len(tokens):len(tokens) + k]
        if len(tokens) >= self.wrong_from:
            out[0] = (out[0] + 1) % 256
        return out


def test_acceptance_by_depth_equals_a_hand_count(target):
    """Rounds start at depth prompt + generated; k = 3 drafts all accepted below depth 40, none from 40 on, 20 new
    tokens. Prompt of 30: the prefill's token, rounds at 31 (<32), 35 and 39 (32-40) gain 4 each (13 tokens), then 7
    rounds at 43..49 gain 1. Prompt of 36: a round at 37 (32-40) gains 4 (5 tokens), then 15 at 41..55 gain 1."""
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 36)]
    decoded = speculative_decode_many(target, DepthDrafter(target, prompts, 40, 20 + 3), prompts, 20, 3)
    assert [d.depths[:4] for d in decoded] == [[31, 35, 39, 43], [37, 41, 42, 43]]
    buckets = depth_buckets([32, 40, 4096], 4096)                       # the last one starts at the target's end
    assert buckets == [(0, 32), (32, 40), (40, 4096)]
    report = decoding_report(decoded, None, [Prompt(i + 1, p) for i, p in enumerate(prompts)], 3, buckets)
    assert [(b["label"], b["rounds"], b["tokens"], b["real_accept_len"], b["per_position_acceptance"])
            for b in report["by_depth"]] == [("<32", 1, 4, 4.0, [1.0, 1.0, 1.0]), ("32-40", 3, 12, 4.0, [1.0] * 3),
                                             ("40-4k", 22, 22, 1.0, [0.0, 0.0, 0.0])]
    # pooled, as the whole-set figure: 38 tokens in 26 rounds (per request it would be (19/10 + 19/16) / 2)
    assert (report["rounds"], report["real_accept_len"]) == (26, 38 / 26)
    assert report["accept_len_per_request"] == pytest.approx((19 / 10 + 19 / 16) / 2)
    assert depth_buckets([2048, 8192, 32768], 4096) == [(0, 2048), (2048, 8192)]
    assert [depth_label(*b) for b in depth_buckets([2048, 8192, 32768], 131072)] == ["<2k", "2k-8k", "8k-32k",
                                                                                     ">=32k"]


def test_acceptance_by_depth_over_seeds():
    """At T > 0 each bucket's figure is the mean over the seeds whose rounds reach it, its deviation beside it."""
    def seed(rounds):   # (depth, tokens gained, drafts accepted) per round of one prompt
        return Decoded([0] * (1 + sum(a for _, a, _ in rounds)), [a for _, a, _ in rounds], [n for _, _, n in rounds],
                       [d for d, _, _ in rounds])
    seeds = [[(5, 3, 2), (8, 1, 0), (20, 2, 1)], [(5, 1, 0), (6, 2, 1)]]
    reports = [decoding_report([seed(r)], None, [Prompt(1, [1] * 5)], 2, [(0, 10), (10, None)]) for r in seeds]
    report = over_seeds(reports, [0, 1])
    near, deep = report["by_depth"]
    assert (near["label"], deep["label"]) == ("<10", ">=10")
    assert near["real_accept_len"] == pytest.approx(1.75) and near["rounds"] == 2.0
    assert near["real_accept_len_sd"] == pytest.approx(torch.tensor([2.0, 1.5]).std().item())
    assert near["per_position_acceptance"] == pytest.approx([0.5, 0.25])
    assert (deep["real_accept_len"], deep["real_accept_len_sd"], deep["tokens"]) == (2.0, 0.0, 1.0)
    assert report["per_seed"][1]["by_depth"][1]["real_accept_len"] is None    # seed 1 never got that deep


def test_reply_positions():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 0])
    pos = reply_positions(mask, torch.tensor([0, 7, 10]))
    assert pos[[1, 2, 3, 5, 6, 7, 8]].tolist() == [0, 1, 2, 0, 1, 0, 1]   # a new sequence starts at 7


@pytest.fixture(scope="module", params=["llama", "kimi"])
def regenerated_run(request, tmp_path_factory, llama_target, token_data):
    tmp = tmp_path_factory.mktemp("regen")
    path = llama_target if request.param == "llama" else tiny.make_kimi(tmp / "kimi", vocab=256)
    cfg = make_config(tmp, path, token_data, **{
        "generate.output_path": tmp / "regen.jsonl", "generate.max_new_tokens": 24, "generate.temperature": 0.0,
        "debug.generate_dtype": "float32",
        "debug.generate_device": "cpu", "train.max_steps": 60 if request.param == "llama" else 200, "train.batch_tokens": 400, "train.ttt_steps": 3,
        "train.eval_fraction": 0.25, "train.eval_every": 60, "train.checkpoint_every": 60, "debug.log_every": 20,
        "train.lr": 1e-2})
    generate.run(cfg)
    cfg.data.path = str(tmp / "regen.jsonl")
    extraction.run(cfg)
    training.run(cfg)
    return cfg


@pytest.mark.slow
def test_generate_output_and_resume(regenerated_run, token_data):
    cfg = regenerated_run
    out = [json.loads(x) for x in open(cfg.data.path)]
    src = [json.loads(x) for x in open(token_data)]
    assert len(out) == len(src) and [o["source_line"] for o in out] == list(range(1, len(src) + 1))
    first = out[0]
    user = src[0]["loss_mask"].index(1)
    assert first["input_ids"][:user] == src[0]["input_ids"][:user] and first["loss_mask"][user:] == [1] * 24
    # the reply is the target's own greedy continuation
    t = IncrementalTarget(Checkpoint(cfg.target.path), [0, 0, 0], torch.device("cpu"))
    assert first["input_ids"][user:] == greedy_decode(t, first["input_ids"][:user], 24).tokens
    # resume: drop the last two lines and a torn one; regeneration gives back the same file
    cfg = copy.deepcopy(cfg)
    cfg.data.path = str(token_data)   # the fixture pointed it at the output, for extraction
    path = cfg.generate.output_path
    lines = open(path).read().splitlines()
    partial = path + ".partial"
    open(partial, "w").write("\n".join(lines[:-2]) + "\n" + lines[-2][:10])
    shutil.copy(path + ".settings.json", partial + ".settings.json")
    generate.run(cfg)
    assert open(path).read().splitlines() == lines


def held_out_batches(cfg, draft, state, target):
    """(batch, per-row TTT detail) of each held-out sequence (the split the checkpoint was trained
    with), one sequence at a time."""
    reader = ShardReader(cfg.extract.output_dir)
    _, held_out = split_holdout(reader.sequences, state["config"]["train"]["eval_fraction"])
    for ref in held_out:
        batch = reader.read([ref]).to(torch.device("cpu"), torch.float32)
        yield batch, ttt_forward(draft, batch, target.embed, target.head[draft.t2d], cfg.train.ttt_steps,
                                 ttt_attention, ttt_loss_steps)[2]


@pytest.mark.slow
def test_estimate_equals_real_acceptance_on_each_held_out_row(regenerated_run):
    """On greedily regenerated data, the TTT chain of each held-out start row and a decoding round
    from the same context (the target's states rounded to bf16, as the shards hold them) accept the
    same number of tokens."""
    cfg = regenerated_run
    draft, state = train_state.load_draft(train_state.latest(cfg.train.output_dir))
    target = IncrementalTarget(Checkpoint(cfg.target.path), state["resolved"]["aux_layer_ids"], torch.device("cpu"))
    drafter, K = Drafter(draft, target.embed), cfg.train.ttt_steps
    estimated, real = [], []
    for batch, detail in held_out_batches(cfg, draft, state, target):
        ids, mask = batch.input_ids.long(), batch.loss_mask
        for t in range(ids.numel() - K - 1):
            if not mask[t + 2:t + 2 + K].all():   # whole chain inside the reply: nothing cuts it short
                continue
            cache = target.new_cache()
            [(aux, _)] = target.forward_many([ids[:t + 1]], [cache])
            (proposed,) = drafter.propose_many([aux.bfloat16().float()], [ids[:t + 2].tolist()], K)
            [(_, final)] = target.forward_many([torch.cat([ids[t + 1:t + 2], torch.tensor(proposed)])], [cache])
            verified = target.greedy(final).tolist()
            a = 0
            while a < K and proposed[a] == verified[a]:
                a += 1
            estimated.append(int(detail["accepted"][t]))
            real.append(a)
    assert len(real) > 100 and sum(real) > 20, (len(real), real)   # the draft learned something to compare
    assert estimated == real


@pytest.mark.slow
def test_evaluate_command_writes_report(regenerated_run):
    report, _ = run(regenerated_run, train_state.latest(regenerated_run.train.output_dir))
    saved = json.loads((train_state.latest(regenerated_run.train.output_dir) / "eval.json").read_text())
    assert saved["accept_len"] == report["accept_len"] and 1 <= report["accept_len"] <= 4
    assert len(report["acc"]) == 3 and report["by_reply_position"]
    assert sum(b["start_rows"] for b in report["by_reply_position"]) == report["rows"][0]
    pytest.importorskip("matplotlib")
    assert (train_state.latest(regenerated_run.train.output_dir) / "eval.png").stat().st_size > 10_000


@pytest.mark.slow
def test_replayed_rounds_match_real_decoding_of_held_out_replies(regenerated_run):
    """Whole held-out replies: tokens per target forward of the speculative-decoding loop match the
    rounds replayed by evaluate from the TTT per-row chains (to ~2%: the loop drafts from the
    target's float32 states, the shards hold bf16, so a near-tie can end a round one token apart)."""
    from eagle3.evaluate import decoding_rounds
    cfg = regenerated_run
    draft, state = train_state.load_draft(train_state.latest(cfg.train.output_dir))
    target = IncrementalTarget(Checkpoint(cfg.target.path), state["resolved"]["aux_layer_ids"], torch.device("cpu"))
    replayed, real = [0, 0], [0, 0]
    for batch, detail in held_out_batches(cfg, draft, state, target):
        mask = batch.loss_mask.tolist()
        start, end = mask.index(1), len(mask) - mask[::-1].index(1)
        assert all(mask[start:end]) and end == len(mask)          # one reply, at the end
        tokens, rounds = decoding_rounds(detail["accepted"], batch.loss_mask, batch.cu_seqlens)
        replayed = [replayed[0] + tokens, replayed[1] + rounds]
        decoded = speculative_decode(target, Drafter(draft, target.embed), batch.input_ids[:start].tolist(),
                                     end - start, cfg.train.ttt_steps)
        assert decoded.tokens == batch.input_ids[start:end].tolist()   # the data is the target's own
        real = [real[0] + sum(decoded.accepted), real[1] + len(decoded.accepted)]
    print("replayed", replayed, "real", real)
    assert real[0] > real[1] + 20                                  # drafts were accepted
    assert replayed[0] == real[0] and replayed[1] == pytest.approx(real[1], rel=0.02)


# ---------------------------------------------------------------- real decoding on prompts

@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, llama_target, token_data):
    """A draft trained briefly on replies the tiny Llama target regenerated, exported in the vLLM
    layout in float32 (so the export holds exactly the checkpoint's weights); prompts = those lines."""
    tmp = tmp_path_factory.mktemp("real")
    cfg = make_config(tmp, llama_target, token_data, **{
        "generate.output_path": tmp / "regen.jsonl", "generate.max_new_tokens": 24, "generate.temperature": 0.0,
        "debug.generate_dtype": "float32",
        "debug.generate_device": "cpu", "train.max_steps": 60, "train.batch_tokens": 400, "train.ttt_steps": 3,
        "train.eval_fraction": 0.25, "train.eval_every": 60, "train.checkpoint_every": 60, "debug.log_every": 20,
        "train.lr": 1e-2, "export.formats": '["vllm"]', "debug.export_dtype": "float32",
        "debug.evaluate_device": "cpu", "evaluate.max_new_tokens": 20})
    generate.run(cfg)
    cfg.data.path = str(tmp / "regen.jsonl")
    extraction.run(cfg)
    training.run(cfg)
    cfg.evaluate.prompts = str(first_lines(tmp / "regen.jsonl", 12, tmp / "prompts.jsonl"))
    return cfg


def first_lines(src: Path, n: int, dst: Path) -> Path:
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[:n]))
    return dst


def checkpoint_and_export(cfg):
    return train_state.latest(cfg.train.output_dir), Path(cfg.train.output_dir) / "export" / "vllm"


def decode_directly(cfg, checkpoint, k: int) -> list[int]:
    """Accepted counts of every round, from speculative_decode itself on the prompts' user parts."""
    draft, state = train_state.load_draft(checkpoint)
    ckpt = Checkpoint(cfg.target.path)
    target = IncrementalTarget(ckpt, state["resolved"]["aux_layer_ids"], torch.device("cpu"))
    drafter, stop = Drafter(draft, target.embed), generate.stop_tokens(cfg, ckpt)
    accepted = []
    for line in open(cfg.evaluate.prompts).read().splitlines():
        obj = json.loads(line)
        prompt = obj["input_ids"][:obj["loss_mask"].index(1)]
        accepted += speculative_decode(target, drafter, prompt, cfg.evaluate.max_new_tokens, k, stop).accepted
    return accepted


def test_real_decoding_of_checkpoint_and_its_vllm_export(llama_run, tmp_path):
    cfg = llama_run
    checkpoint, export = checkpoint_and_export(cfg)
    ours = real_decoding(cfg, checkpoint)
    theirs = real_decoding(cfg, export, out=tmp_path / "eval.json")
    assert json.loads((tmp_path / "eval.json").read_text()) == theirs
    accepted = decode_directly(cfg, checkpoint, 3)
    assert ours["real_accept_len"] == sum(accepted) / len(accepted) and ours["rounds"] == len(accepted)
    assert ours["mismatches"] == 0 and ours["prompts"] == 12
    assert ours["k"] == 3 and theirs["k"] == 3     # trained ttt_steps; the export's speculative_tokens
    assert (ours["draft_format"], theirs["draft_format"]) == ("ours", "vllm")
    for key in ("real_accept_len", "per_position_acceptance", "rounds", "new_tokens", "mismatches"):
        assert ours[key] == theirs[key], key
    assert ours["real_accept_len"] > 1.3                        # the draft learned something to compare
    share = ours["per_position_acceptance"]
    assert len(share) == 3 and all(a >= b for a, b in zip(share, share[1:]))
    # the prefill's token is no round; a round cut at max_new_tokens counts its kept tokens only
    assert ours["new_tokens"] == sum(accepted) + ours["prompts"]
    assert 1 + sum(share) >= ours["real_accept_len"] - 1e-9


def test_k_override_and_unbatched(llama_run, tmp_path):
    cfg = copy.deepcopy(llama_run)
    cfg.evaluate.k, cfg.debug.evaluate_batch_size = 2, 1   # the one-prompt loops
    cfg.evaluate.prompts = str(first_lines(Path(cfg.evaluate.prompts), 5, tmp_path / "five.jsonl"))
    checkpoint, _ = checkpoint_and_export(cfg)
    report = real_decoding(cfg, checkpoint)
    accepted = decode_directly(cfg, checkpoint, 2)
    assert report["k"] == 2 and report["prompts"] == 5 and report["mismatches"] == 0
    assert report["real_accept_len"] == sum(accepted) / len(accepted)


@pytest.mark.parametrize("config, tensors, error", [
    (None, lambda t: t.pop("layers.0.mlp.up_proj.weight"),
     r"model\.safetensors: tensor layers\.0\.mlp\.up_proj\.weight is missing"),
    (None, lambda t: t.update({"norm.weight": torch.ones(7)}),
     r"model\.safetensors: tensor norm\.weight has shape \[7\]"),
    (None, lambda t: t.update({"layers.0.self_attn.q_proj.bias": torch.zeros(32)}),
     r"model\.safetensors: tensor layers\.0\.self_attn\.q_proj\.bias is part of the draft's computation"),
    (lambda c: c.update(norm_before_fc=True), None, r"model\.safetensors: tensor input_norm\.weight is missing"),
    (lambda c: c.update(norm_before_fc=True, fc_norm=True), None,
     r"config\.json: norm_before_fc and fc_norm are both true"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), None,
     r"config\.json: transformer_layer_config\.model_type = 'qwen3'"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 3]), None,
     r"config\.json: eagle_aux_hidden_state_layer_ids = \[0, 2, 3\]"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=512),
     lambda t: t.update({"t2d": torch.cat([t["t2d"], torch.zeros(256, dtype=torch.bool)])}),
     r"model\.safetensors: the draft's vocab_size is 512 but the target .* has 256"),
    (None, lambda t: t.update({"d2t": t["d2t"] + 1}), r"model\.safetensors: arange\(draft_vocab\) \+ d2t"),
])
def test_unusable_vllm_draft_is_refused_naming_the_file(llama_run, tmp_path, config, tensors, error):
    _, export = checkpoint_and_export(llama_run)
    bad = vllm_variant(export, tmp_path / "bad", config, tensors)
    with pytest.raises(DraftLoadError, match=error) as e:
        load_vllm_draft(bad, Checkpoint(llama_run.target.path))
    assert str(bad) in str(e.value)


def test_cli_reports_a_bad_draft(llama_run, tmp_path):
    _, export = checkpoint_and_export(llama_run)
    bad = vllm_variant(export, tmp_path / "bad", None, lambda t: t.pop("fc.weight"))
    with pytest.raises(SystemExit, match=rf"error: {bad}/model\.safetensors: .*fc\.weight"):
        main(["evaluate", str(bad), "--config", str(write_toml(llama_run, tmp_path)),
              "--prompts", llama_run.evaluate.prompts])


def test_speculators_style_draft_loads(llama_run, tmp_path, capsys):
    """What the peer trainer writes: the layer config without values equal to transformers'
    defaults, aux ids left to the default, a frozen copy of the target's embedding, no verifier."""
    cfg = llama_run
    checkpoint, export = checkpoint_and_export(cfg)
    target = Checkpoint(cfg.target.path)

    def peer_config(c):
        for key in ("head_dim", "num_key_value_heads", "intermediate_size"):
            c["transformer_layer_config"].pop(key)
        c["eagle_aux_hidden_state_layer_ids"] = None
        c.pop("target_hidden_size")
    peer = vllm_variant(export, tmp_path / "peer", peer_config, lambda t: t.update(
        {"embed_tokens.weight": target.get("embed_tokens.weight").bfloat16(),
         "verifier_lm_head.weight": torch.zeros(128, 32)}))
    draft, aux = load_vllm_draft(peer, target)
    assert "ignoring 2 tensor(s)" in capsys.readouterr().err
    L = target.config.num_hidden_layers
    assert aux == [1, L // 2 - 1, L - 4]
    ours, state = train_state.load_draft(checkpoint)
    assert draft.spec == ours.spec
    for name, value in ours.state_dict().items():
        assert torch.equal(draft.state_dict()[name], value), name


def test_full_vocabulary_draft_without_vocab_maps(llama_target, tmp_path):
    """speculators writes no d2t/t2d when the draft keeps the target's whole vocabulary."""
    target = Checkpoint(llama_target)
    spec = DraftSpec(32, 4, 2, 8, 64, 1, 1e-6, 10000.0, 256, 256, 256, 32)
    weights = {k: v for k, v in Eagle3Draft(spec).state_dict().items() if k not in ("d2t", "t2d")}
    (tmp_path / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "draft_vocab_size": 256, "eagle_aux_hidden_state_layer_ids": [2, 3, 4],
        "transformer_layer_config": {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
                                     "vocab_size": 256, "num_hidden_layers": 1}}))
    save_file(weights, tmp_path / "model.safetensors")
    draft, aux = load_vllm_draft(tmp_path, target)
    assert aux == [1, 2, 3] and draft.t2d.all() and not draft.d2t.any()


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_read_prompts(tmp_path, llama_target):
    target = tmp_path / "target"
    shutil.copytree(llama_target, target)
    _, tok = qwen_tokenizer(target)
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    path = write_lines(tmp_path / "prompts.jsonl", [
        {"input_ids": [5, 6, 7]}, "",
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},          # a training line: its prompt
        {"messages": [user("hi"), {"role": "assistant", "content": "hello"}]},   # the reference reply dropped
        {"conversations": [{"from": "human", "value": "ok?"}]}])
    prompts = read_prompts(path, 256, target)
    assert [p.line for p in prompts] == [1, 3, 4, 5]
    assert [p.ids for p in prompts[:2]] == [[5, 6, 7], [5, 6]]
    render = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert prompts[2].ids == render("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert prompts[3].ids == render("<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n")
    for line, error in [({"input_ids": [5, 300]}, r"integers in \[0, 256\)"),
                        ({"input_ids": [5, 6], "loss_mask": [1, 1]}, "empty prompt"),
                        ({"input_ids": [5, 6], "loss_mask": [0]}, "'loss_mask'"),
                        ({"text": "hi"}, "expected an object with 'input_ids'"), ("{bad", "Expecting"),
                        ({"messages": [{"role": "assistant", "content": "hello"}]}, "no prompt")]:
        bad = write_lines(tmp_path / "bad.jsonl", [{"input_ids": [5]}, line])
        with pytest.raises(InputError, match=rf"bad\.jsonl:2: .*{error}"):
            read_prompts(bad, 256, target)


def test_a_prompt_without_room_to_decode_and_a_zero_draft_vocab_are_refused(llama_run, tmp_path):
    """Issue 46, row 8: a prompt that, with evaluate.max_new_tokens, runs past the target's
    max_position_embeddings is refused naming its line; vocab.draft_vocab_size = 0 is refused like -5."""
    from eagle3 import config as config_mod
    cfg = llama_run
    checkpoint, _ = checkpoint_and_export(cfg)
    long = write_lines(tmp_path / "long.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [5] * 4090}])
    with pytest.raises(InputError) as e:
        real_decoding(cfg, checkpoint, long)
    assert str(e.value) == (f"{long}:2: a prompt of 4090 tokens + evaluate.max_new_tokens 20 exceeds the target's "
                            f"max_position_embeddings 4096 ({Path(cfg.target.path) / 'config.json'}); shorten the "
                            "prompt or lower evaluate.max_new_tokens")
    for size in ("0", "-5"):
        with pytest.raises(config_mod.ConfigError) as e:
            config_mod.load(None, ["--vocab.draft_vocab_size", size])
        assert str(e.value) == (f"command line --vocab.draft_vocab_size: vocab.draft_vocab_size = {size}; expected a "
                                "positive integer")


def test_deep_prompts_decode_whole_in_batches_that_fit(llama_run, tmp_path):
    """Deep prompts: batches by length within debug.chunk_tokens positions, a prompt longer than that prefilled in
    pieces, the same decoding as in one pass, its rounds in the deep bucket."""
    lengths = [10, 3000, 20, 2900, 15]
    prompts = [Prompt(i + 1, [5] * n) for i, n in enumerate(lengths)]
    assert batches(prompts, 3, 4000, 20) == [[0, 4, 2], [3], [1]]      # 30 + 35 + 40; 2920; 3020 (2920 + 3020 > 4000)
    cfg = copy.deepcopy(llama_run)
    g = torch.Generator().manual_seed(0)
    cfg.evaluate.prompts = str(write_lines(tmp_path / "deep.jsonl", [
        {"input_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (12, 2100, 9)]))
    checkpoint = checkpoint_and_export(cfg)[0]
    whole = real_decoding(cfg, checkpoint)
    cfg.debug.chunk_tokens, cfg.debug.evaluate_depth_edges = 800, [64, 2048, 8192]   # the deep one in 3 pieces
    pieces = real_decoding(cfg, checkpoint)
    assert pieces["mismatches"] == 0 and pieces["new_tokens"] == 3 * 20
    for key in ("real_accept_len", "rounds", "per_position_acceptance"):
        assert pieces[key] == whole[key], key
    near, _, deep = pieces["by_depth"]                                   # 8k-: past the target's 4096 positions
    assert [b["label"] for b in pieces["by_depth"]] == ["<64", "64-2k", "2k-8k"]
    assert deep["rounds"] > 0 and near["rounds"] + deep["rounds"] == pieces["rounds"]
    assert [b["rounds"] for b in whole["by_depth"]] == [near["rounds"], deep["rounds"]]   # <2k, 2k-8k by default


def test_real_decoding_on_chat_prompts(llama_run, tmp_path):
    """Chat prompts through the target's own template (a copy of the target with a tokenizer)."""
    cfg = copy.deepcopy(llama_run)
    target = tmp_path / "target"
    shutil.copytree(cfg.target.path, target)
    qwen_tokenizer(target)
    cfg.target.path = str(target)
    cfg.evaluate.prompts = str(write_lines(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": text}]} for text in ("hi", "ok?", "hello there")]))
    report = real_decoding(cfg, checkpoint_and_export(cfg)[1])
    assert report["prompts"] == 3 and report["mismatches"] == 0 and report["rounds"] > 0


def write_toml(cfg, tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[target]\npath = "{cfg.target.path}"\n[extract]\noutput_dir = "{cfg.extract.output_dir}"\n'
                    '[debug]\ntrain_device = "cpu"\nevaluate_device = "cpu"\n[evaluate]\nmax_new_tokens = 20\n')
    return path


def test_cli_evaluate_end_to_end(llama_run, tmp_path, capsys):
    cfg = llama_run
    checkpoint, export = checkpoint_and_export(cfg)
    toml = write_toml(cfg, tmp_path)
    main(["evaluate", str(checkpoint), "--config", str(toml), "--prompts", cfg.evaluate.prompts, "--k", "3"])
    out = capsys.readouterr().out.splitlines()
    summary, saved = json.loads(out[0]), json.loads((checkpoint / "eval.json").read_text())
    png = importlib.util.find_spec("matplotlib") is not None             # the plot too, named (issue 51)
    written = f"{checkpoint / 'eval.json'}" + (f" and {checkpoint / 'eval.png'}" if png else "")
    assert out[1] == f"wrote {written} (inside the checkpoint: deleted with it by checkpoint rotation, " \
                     f"train.keep_checkpoints; --out FILE keeps {'them' if png else 'it'} elsewhere)"   # issue 46 row 5
    assert summary["accept_len_by_depth"] == {b["label"]: b["real_accept_len"] for b in saved["by_depth"]}
    assert list(summary["rounds_by_depth"]) == ["<2k", "2k-8k"] and summary["rounds_by_depth"]["<2k"] == saved["rounds"]
    accepted = decode_directly(cfg, checkpoint, 3)
    assert summary["real_accept_len"] == saved["real_accept_len"] == sum(accepted) / len(accepted)
    assert summary["mismatches"] == 0 and summary["k"] == 3
    # the TTT estimate on the held-out shards sits beside real decoding
    assert saved["accept_len_decoding"] > 1 and saved["held_out_sequences"] > 0 and "accept_len" in summary
    # a vLLM-layout draft: --out, the shorthand and an override (the override loses to the shorthand)
    four = first_lines(Path(cfg.evaluate.prompts), 4, tmp_path / "four.jsonl")
    main(["evaluate", str(export), "--config", str(toml), "--prompts", str(four), "--max-new-tokens", "8",
          "--evaluate.max_new_tokens", "30", "--out", str(tmp_path / "v.json")])
    saved = json.loads((tmp_path / "v.json").read_text())
    assert saved["prompts"] == 4 and saved["max_new_tokens"] == 8 and "accept_len" not in saved
    assert (tmp_path / "v.png").exists() == png             # real decoding alone plots its acceptance by depth
    with pytest.raises(SystemExit, match="give --prompts"):
        main(["evaluate", str(export), "--config", str(toml)])


@pytest.mark.parametrize("mode", ["greedy", "probabilistic"])
def test_real_decoding_at_a_serving_temperature(llama_run, mode):
    """Speculative sampling of our checkpoint and of its vLLM export (the same float32 weights: the
    same draws, so the same figures), seeded, with the mean and spread over seeds."""
    cfg = copy.deepcopy(llama_run)
    checkpoint, export = checkpoint_and_export(cfg)
    cfg.evaluate.temperature, cfg.evaluate.top_p, cfg.evaluate.seeds, cfg.evaluate.draft_sampling = 1.0, 0.95, 3, mode
    ours, theirs = real_decoding(cfg, checkpoint), real_decoding(cfg, export)
    assert (ours["temperature"], ours["top_p"], ours["draft_sampling"], ours["seeds"]) == (1.0, 0.95, mode, [0, 1, 2])
    assert "mismatches" not in ours                        # no token-for-token reference when sampling
    for key in ("real_accept_len", "accept_len_per_request", "per_position_acceptance", "rounds", "per_seed",
                "by_depth"):
        assert ours[key] == theirs[key], key
    per_seed = ours["per_seed"]
    for s in per_seed:   # by depth at T > 0: each seed's rounds all in the buckets, the mean beside its spread
        assert sum(b["rounds"] for b in s["by_depth"]) == s["rounds"]
    near = ours["by_depth"][0]
    assert near["real_accept_len"] == pytest.approx(sum(s["by_depth"][0]["real_accept_len"] for s in per_seed) / 3)
    assert near["real_accept_len_sd"] > 0 and len(near["per_position_acceptance_sd"]) == 3
    assert len({s["real_accept_len"] for s in per_seed}) == 3 and ours["real_accept_len_sd"] > 0
    values = torch.tensor([s["real_accept_len"] for s in per_seed], dtype=torch.float64)
    assert ours["real_accept_len"] == pytest.approx(values.mean().item())
    assert ours["real_accept_len_sd"] == pytest.approx(values.std().item())
    assert 1 <= ours["real_accept_len"] <= 4 and 1 <= ours["accept_len_per_request"] <= 4
    for s in per_seed:   # pooled acceptance: 1 + the per-position shares (each round's kept drafts)
        assert s["real_accept_len"] <= 1 + sum(s["per_position_acceptance"]) + 1e-9
    assert real_decoding(cfg, checkpoint)["per_seed"] == per_seed     # reproducible


def test_cli_evaluate_at_a_serving_temperature(llama_run, tmp_path, capsys):
    cfg = llama_run
    _, export = checkpoint_and_export(cfg)
    toml = write_toml(cfg, tmp_path)
    base = ["evaluate", str(export), "--config", str(toml), "--prompts", cfg.evaluate.prompts, "--max-new-tokens", "8"]
    main(base + ["--temperature", "1", "--top-p", "0.95", "--draft-sampling", "probabilistic", "--seeds", "2",
                 "--out", str(tmp_path / "t1.json")])
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["seeds"] == [0, 1] and summary["draft_sampling"] == "probabilistic" and "real_accept_len_sd" in summary
    for flags, named in ((["--temperature", "-1"], "evaluate.temperature"), (["--top-p", "0"], "evaluate.top_p"),
                         (["--top-p", "1.5"], "evaluate.top_p"), (["--draft-sampling", "beam"], "evaluate.draft_sampling")):
        with pytest.raises(SystemExit) as e:
            main(base + flags)
        assert named in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)
