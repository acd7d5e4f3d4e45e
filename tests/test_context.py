"""Context parallelism: one packed micro-batch split by rows over gloo ranks trains exactly as in one process."""
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle3.data.batch import Batch, RowRule, split
from eagle3.draft import DraftSpec, Eagle3Draft
from eagle3.training.context import SplitAttention
from eagle3.ttt import Objective, plan_rows, ttt_forward
from eagle3.kernels.reference import ttt_attention, ttt_loss_steps

STEPS = 3
LENGTHS = [37, 5, 20]   # 62 rows: padded to 64 for 4 ranks; the first sequence spans several slices


def draft_and_inputs():
    """A 2-layer GQA draft (8 q heads, 4 kv heads), the frozen embedding and head rows, and a batch whose last
    sequence trains nothing (a rank whose rows are all dead at every step still takes part in each exchange)."""
    torch.manual_seed(0)
    spec = DraftSpec(hidden_size=16, num_attention_heads=8, num_key_value_heads=4, head_dim=8, intermediate_size=32,
                     num_layers=2, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                     draft_vocab_size=24, target_vocab_size=40, target_hidden_size=16)
    draft = Eagle3Draft(spec)
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[torch.randperm(40)[:24]] = True
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(t2d.nonzero().flatten() - torch.arange(24))
    g = torch.Generator().manual_seed(1)
    T = sum(LENGTHS)
    mask = (torch.rand(T, generator=g) > 0.3).to(torch.uint8)
    mask[T - LENGTHS[-1]:] = 0
    in_vocab = t2d.nonzero().flatten()[torch.randint(0, 24, (T,), generator=g)]
    greedy = torch.where(torch.rand(T, generator=g) < 0.5, in_vocab, torch.randint(0, 40, (T,), generator=g))
    batch = Batch(input_ids=torch.randint(0, 40, (T,), generator=g, dtype=torch.int32), loss_mask=mask,
                  target_argmax=greedy.to(torch.int32), aux_hidden=torch.randn(T, 48, generator=g),
                  final_hidden=torch.randn(T, 16, generator=g),
                  cu_seqlens=torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist()))
    return draft, torch.randn(40, 16, generator=g), torch.randn(24, 16, generator=g), batch


# (skip_dead_rows, the objective): the defaults' dead rows skipped, or every row computed and prompt rows trained
VARIANTS = {"skip": (True, Objective()), "every-row": (False, Objective(RowRule(prompt=True), loss="kl"))}


def run(variant, split_over=None):
    """Loss, metric sums and the parameters' gradients of the micro-batch (or of this rank's part of it, split over
    the default group of `split_over` ranks), with the row plan as training makes it."""
    draft, embed, head, batch = draft_and_inputs()
    attention = ttt_attention
    if split_over:
        batch = split(batch, split_over, dist.get_rank(), halo=STEPS + 1)
        attention = SplitAttention(ttt_attention, split_over, dist.group.WORLD)
    skip, objective = VARIANTS[variant]
    batch = dataclasses.replace(batch, plan=plan_rows(batch, STEPS, draft.t2d, skip, objective.rows))
    loss, metrics, _ = ttt_forward(draft, batch, embed, head, STEPS, attention, ttt_loss_steps,
                                   skip_dead_rows=skip, objective=objective)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def rank_main(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)   # a forked process must not use its parent's OpenMP pool (as DataLoader's workers)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for variant in VARIANTS:
            torch.save(run(variant, world), f"{out}/{variant}-{rank}.pt")
        heads = SplitAttention(None, world, dist.group.WORLD).to_heads(*(torch.randn(4, 4, 8) for _ in range(3)))
        torch.save([p.untyped_storage().data_ptr() for p in heads], f"{out}/storages-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory):
    """Each world size's ranks, forked (torch is imported already) and given two minutes."""
    out = tmp_path_factory.mktemp("ranks")
    for world in (2, 4):
        (out / str(world)).mkdir()
        ranks = mp.start_processes(rank_main, args=(world, f"file://{out}/{world}/init", f"{out}/{world}"),
                                   nprocs=world, join=False, start_method="fork")
        deadline = time.monotonic() + 120
        while not ranks.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ranks.processes:
                    p.kill()
                raise AssertionError(f"{world} ranks did not finish in 120 s")
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("world", [2, 4])
def test_gradients_of_a_sequence_split_over_ranks_equal_one_process(ranks_out, world, variant):
    """Each rank trains its slice of the packed row (the TTT shift's halo read from the data, attention by all-to-all
    over heads): the ranks' losses, metric sums and gradients add up to the single-process ones on the whole row."""
    loss, metrics, grads = run(variant)
    parts = [torch.load(ranks_out / str(world) / f"{variant}-{r}.pt") for r in range(world)]
    torch.testing.assert_close(sum(p[0] for p in parts), loss)
    torch.testing.assert_close(sum(p[1] for p in parts), metrics)
    assert metrics[:, 1].min() > 0   # every step trains rows
    assert grads.keys() == parts[0][2].keys() and len(grads) == 22
    for name, grad in grads.items():
        torch.testing.assert_close(sum(p[2][name] for p in parts), grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world", [2, 4])
def test_the_exchange_hands_q_k_v_as_tensors_of_their_own(ranks_out, world):
    """The attention keeps each step's keys and values for its backward: as views of the all-to-all buffer they would
    keep that step's queries alive with them."""
    for r in range(world):
        assert len(set(torch.load(ranks_out / str(world) / f"storages-{r}.pt"))) == 3


def test_a_split_keeps_the_rows_each_rank_reads():
    """Slices of equal length (filler one-token sequences pad the row), the per-token fields `halo` rows further
    (zeros past the end), aux states only the slice's own rows, the boundaries the whole row's."""
    *_, batch = draft_and_inputs()
    parts = [split(batch, 4, r, halo=4) for r in range(4)]
    assert [(p.part.start, p.part.total, p.rows, p.input_ids.shape[0]) for p in parts] == \
        [(0, 64, 16, 20), (16, 64, 16, 20), (32, 64, 16, 20), (48, 64, 16, 16)]
    assert parts[0].cu_seqlens.tolist() == [0, 37, 42, 62, 63, 64]
    assert torch.equal(parts[1].input_ids, batch.input_ids[16:36]) and torch.equal(parts[1].aux_hidden,
                                                                                   batch.aux_hidden[16:32])
    assert torch.equal(parts[3].final_hidden[:14], batch.final_hidden[48:]) and not parts[3].final_hidden[14:].any()


@pytest.mark.slow
def test_four_ranks_in_two_context_parallel_groups_train_as_one_process(tmp_path, llama_target, token_data, hidden):
    """world 4 = 2 data-parallel groups x 2 context-parallel ranks, train.batch_tokens 24 below the longest sequence
    (40 tokens): the same training as one process reading micro-batches of 48 tokens, two per step."""
    from test_training import cli_args, run_train, trained_alike
    run = {"train.max_steps": 4, "train.checkpoint_every": 4, "train.eval_every": 2}
    one, four = tmp_path / "one", tmp_path / "four"
    run_train(cli_args(one, llama_target, token_data, hidden, **run, **{"train.batch_tokens": 48,
                                                                        "train.grad_accum": 2}))
    run_train(cli_args(four, llama_target, token_data, hidden, **run, **{"train.batch_tokens": 24,
                                                                         "train.context_parallel": 2}), nproc=4)
    assert trained_alike(one, four) == {1, 2, 3, 4}


def test_what_cannot_be_split_is_refused_naming_the_keys(tmp_path, llama_target, token_data):
    """A group that does not divide the ranks or the draft's heads; sequences longer than a group's micro-batch."""
    from types import SimpleNamespace

    from conftest import make_config
    from eagle3 import training
    from eagle3.training.context import Layout
    from eagle3.training.loop import data_plan
    cfg = make_config(tmp_path, llama_target, token_data, **{"train.context_parallel": 3})
    with pytest.raises(training.TrainError, match=r"^command line --train.context_parallel: "
                                                  r"train.context_parallel = 3 needs a divisor of the world size "
                                                  r"\(1\); a divisor of draft.num_key_value_heads \(2\)"):
        training.Trainer(cfg)
    cfg = make_config(tmp_path, llama_target, token_data, **{"train.batch_tokens": 16, "train.context_parallel": 2})
    reader = SimpleNamespace(sequences=[SimpleNamespace(index=i, length=n) for i, n in enumerate([30, 40, 8])],
                             manifest={})
    with pytest.raises(training.TrainError, match=r"^command line --train.batch_tokens: train.batch_tokens = 16 x "
                                                  r"train.context_parallel = 2 \(32 tokens\) is smaller than the "
                                                  r"longest sequence of data \(40 tokens\)"):
        data_plan(cfg, reader, Layout(2, 0, 0, 1), "data")
    assert data_plan(cfg, reader, Layout(4, 0, 0, 1), "data")[0].budget == 64   # a group of 4 holds it


def test_a_rank_reads_only_the_rows_of_its_share(tmp_path):
    """Shards read for one part (`window`) then split equal the whole micro-batch read then split, across shards."""
    import functools

    from eagle3.bench import step
    from eagle3.data.batch import window
    from eagle3.data.shards import ShardReader
    s = step.SIZES["tiny"]
    step.write_target(tmp_path / "target", s)
    step.write_shards(tmp_path / "data", tmp_path / "target", "b", s, 2)
    reader = ShardReader(tmp_path / "data")
    refs = reader.sequences[3:6]   # 3 x 128 rows, the first from another shard than the others
    whole = reader.read(refs)
    for index in range(4):
        read = reader.read(refs, rows=functools.partial(window, parts=4, index=index, halo=4))
        assert read.rows == min(100, 384 - 96 * index) and torch.equal(read.cu_seqlens, whole.cu_seqlens)
        a, b = split(whole, 4, index, 4), split(read, 4, index, 4)
        assert a.part == b.part and torch.equal(a.cu_seqlens, b.cu_seqlens)
        for name, t in a.row_tensors().items():
            assert torch.equal(t, b.row_tensors()[name]), name


def test_extract_refuses_sequences_longer_than_a_micro_batch_trains():
    """Issue 51: data.max_seq_len above train.batch_tokens x train.context_parallel stops extract before any work;
    the shipped config.toml is a pair that trains."""
    from conftest import ROOT
    from eagle3.config import cli, load, require_trainable
    args = ["--config", str(ROOT / "config.toml"), "--target.path", "t", "--data.path", "d.jsonl",
            "--data.max_seq_len", "4096", "--train.batch_tokens", "2048"]
    with pytest.raises(SystemExit, match=r"^error: command line --data.max_seq_len: data.max_seq_len = 4096 is longer "
                                         r"than one micro-batch trains \(train.batch_tokens = 2048 x "
                                         r"train.context_parallel = 1: 2048 tokens\)"):
        cli(args, command="extract")
    assert cli([*args, "--train.context_parallel", "2"], command="extract").train.context_parallel == 2
    assert cli(args, command="train").data.max_seq_len == 4096   # train checks the sequences it reads
    require_trainable(load(ROOT / "config.toml"))
