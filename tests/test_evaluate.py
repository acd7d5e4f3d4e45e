"""Speculative decoding is lossless; the TTT acceptance estimate equals real decoding on data the
target regenerated greedily; evaluate and generate commands."""
import json

import pytest
import torch

from conftest import make_config
from eagle3 import checkpoint as ckpt_io
from eagle3 import extraction, generate, training
from eagle3.data.batching import to_device
from eagle3.data.shards import ShardReader
from eagle3.draft import DraftSpec, Eagle3Draft
from eagle3.evaluate import evaluate, reply_positions
from eagle3.speculative import Drafter, greedy_decode, speculative_decode
from eagle3.target import tiny
from eagle3.target.checkpoint import Checkpoint
from eagle3.target.incremental import IncrementalTarget
from eagle3.target.streaming import TargetRunner
from eagle3.ttt import ttt_forward
from kernels.reference import ttt_attention, ttt_loss_steps


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
    parts = [target.forward(ids[a:b], cache) for a, b in ((0, 11), (11, 12), (12, 30))]
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


def test_reply_positions():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 0])
    pos = reply_positions(mask, torch.tensor([0, 7, 10]))
    assert pos[[1, 2, 3, 5, 6, 7, 8]].tolist() == [0, 1, 2, 0, 1, 0, 1]   # a new sequence starts at 7


@pytest.fixture(scope="module", params=["llama", "kimi"])
def regenerated_run(request, tmp_path_factory, llama_target, token_data):
    tmp = tmp_path_factory.mktemp("regen")
    path = llama_target if request.param == "llama" else tiny.make_kimi(tmp / "kimi", vocab=256)
    cfg = make_config(tmp, path, token_data, **{
        "generate.output_path": tmp / "regen.jsonl", "generate.max_new_tokens": 24, "generate.dtype": "float32",
        "generate.device": "cpu", "train.max_steps": 60 if request.param == "llama" else 200, "train.batch_tokens": 400, "train.ttt_steps": 3,
        "train.eval_fraction": 0.25, "train.eval_every": 60, "train.checkpoint_every": 60, "train.log_every": 20,
        "train.lr": 1e-2})
    generate.run(cfg)
    cfg.data.path = str(tmp / "regen.jsonl")
    extraction.run(cfg)
    training.run(cfg)
    return cfg


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
    path = cfg.generate.output_path
    lines = open(path).read().splitlines()
    partial = path + ".partial"
    open(partial, "w").write("\n".join(lines[:-2]) + "\n" + lines[-2][:10])
    generate.run(cfg)
    assert open(path).read().splitlines() == lines


def test_estimate_equals_real_acceptance_per_row(regenerated_run):
    """On greedily regenerated data, the TTT chain of a start row and a decoding round from the
    same context accept the same number of tokens."""
    cfg = regenerated_run
    checkpoint = ckpt_io.latest(cfg.train.output_dir)
    draft, state = ckpt_io.load_draft(checkpoint)
    target = IncrementalTarget(Checkpoint(cfg.target.path), state["aux_layer_ids"], torch.device("cpu"))
    reader = ShardReader(cfg.extract.output_dir)
    head_rows = target.head[draft.t2d]
    drafter, K = Drafter(draft, target.embed), cfg.train.ttt_steps
    agree = total = 0
    estimated, real = [], []
    # any row of greedily regenerated data will do; training rows are where the small draft is
    # right often enough for long chains to be compared
    for ref in reader.sequences[:8]:
        batch = to_device(reader.read([ref]), torch.device("cpu"), torch.float32)
        _, _, detail = ttt_forward(draft, batch, target.embed, head_rows, K, ttt_attention, ttt_loss_steps)
        ids, mask = batch["input_ids"].long(), batch["loss_mask"]
        for t in range(0, ids.numel() - K - 2, 3):
            if not mask[t + 2:t + 2 + K].all():   # whole chain inside the reply: nothing cuts it short
                continue
            cache = target.new_cache()
            aux, _ = target.forward(ids[:t + 1], cache)
            proposed = drafter.propose(aux.bfloat16().float(), ids[:t + 2], K)
            _, final = target.forward(torch.cat([ids[t + 1:t + 2], torch.tensor(proposed)]), cache)
            verified = target.greedy(final).tolist()
            a = 0
            while a < K and proposed[a] == verified[a]:
                a += 1
            estimated.append(int(detail["accepted"][t]))
            real.append(a)
            agree += a == int(detail["accepted"][t])
            total += 1
    assert total > 20 and sum(real) > 5, (total, real)   # the draft learned something to compare
    print(f"rows {total} agree {agree} estimated {sum(estimated)} real {sum(real)}")
    assert agree / total > 0.9
    assert abs(sum(estimated) - sum(real)) / total < 0.15


def test_evaluate_command_writes_report(regenerated_run):
    report = evaluate(regenerated_run, ckpt_io.latest(regenerated_run.train.output_dir))
    saved = json.loads((ckpt_io.latest(regenerated_run.train.output_dir) / "eval.json").read_text())
    assert saved["accept_len"] == report["accept_len"] and 1 <= report["accept_len"] <= 4
    assert len(report["acc"]) == 3 and report["by_reply_position"]
    assert sum(b["start_rows"] for b in report["by_reply_position"]) == report["rows"][0]
    pytest.importorskip("matplotlib")
    assert (ckpt_io.latest(regenerated_run.train.output_dir) / "eval.png").stat().st_size > 10_000


def test_replayed_rounds_equal_real_decoding(regenerated_run):
    """Whole replies: tokens per target forward of the speculative-decoding loop equal the rounds
    replayed by evaluate from the TTT per-row chains."""
    from eagle3.evaluate import decoding_rounds
    cfg = regenerated_run
    draft, state = ckpt_io.load_draft(ckpt_io.latest(cfg.train.output_dir))
    target = IncrementalTarget(Checkpoint(cfg.target.path), state["aux_layer_ids"], torch.device("cpu"))
    reader, K = ShardReader(cfg.extract.output_dir), cfg.train.ttt_steps
    replayed, real = [0, 0], [0, 0]
    for ref in reader.sequences[:8]:
        batch = to_device(reader.read([ref]), torch.device("cpu"), torch.float32)
        _, _, detail = ttt_forward(draft, batch, target.embed, target.head[draft.t2d], K, ttt_attention,
                                   ttt_loss_steps)
        mask = batch["loss_mask"].tolist()
        start, end = mask.index(1), len(mask) - mask[::-1].index(1)
        assert all(mask[start:end]) and end == len(mask)          # one reply, at the end
        tokens, rounds = decoding_rounds(detail["accepted"], batch["loss_mask"], batch["cu_seqlens"])
        replayed = [replayed[0] + tokens, replayed[1] + rounds]
        decoded = speculative_decode(target, Drafter(draft, target.embed), batch["input_ids"][:start].tolist(),
                                     end - start, K)
        assert decoded.tokens == batch["input_ids"][start:end].tolist()   # the data is the target's own
        real = [real[0] + sum(decoded.accepted), real[1] + len(decoded.accepted)]
    print("replayed", replayed, "real", real)
    assert real[1] > 0 and replayed[0] / replayed[1] == pytest.approx(real[0] / real[1], rel=0.02)
    assert real[0] / real[1] > 1.3
