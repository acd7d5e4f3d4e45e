"""The batched KV pool of IncrementalTarget: decoding several sequences with mixed chunk lengths,
crops, slot reuse and buffer growth gives the full causal forward's states; a pass costs the same
number of operations whatever the number of sequences; generate does not depend on its batch."""
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import make_config, make_llama
from eagle3 import generate
from eagle3.models import tiny
from eagle3.models.weights import Checkpoint
from eagle3.models.incremental import SHORT_MAX, IncrementalTarget
from eagle3.models.streaming import TargetRunner


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "kimi"])
def family_target(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "kimi":
        return tiny.make_kimi(tmp, vocab=256)
    return make_llama(tmp, family=request.param, hidden=32, layers=4, heads=4, kv_heads=2,
                      intermediate=64, vocab=256)


class Sequence:
    """A decoded sequence: its cache, tokens and the (aux, final) row of every cached position."""

    def __init__(self, target, prompt_len, g):
        self.cache, self.g = target.new_cache(), g
        self.tokens, self.aux, self.final = self.draw(prompt_len), [], []
        self.fed = 0

    def draw(self, n):
        return torch.randint(0, 256, (n,), generator=self.g).tolist()

    def feed(self, n=None):
        """The next chunk: the unfed tokens, or n new ones."""
        if n is not None:
            self.tokens += self.draw(n)
        chunk = torch.tensor(self.tokens[self.fed:])
        self.fed = len(self.tokens)
        return chunk

    def took(self, out):
        self.aux.append(out[0])
        self.final.append(out[1])

    def crop(self, n):
        self.cache.length = n
        self.tokens, self.fed = self.tokens[:n], n
        self.aux, self.final = [torch.cat(self.aux)[:n]], [torch.cat(self.final)[:n]]


def step(target, seqs, sizes):
    outs = target.forward_many([s.feed(n) for s, n in zip(seqs, sizes)], [s.cache for s in seqs])
    for s, out in zip(seqs, outs):
        s.took(out)


def test_batched_pool_equals_full_forward(family_target):
    ckpt = Checkpoint(family_target)
    target = IncrementalTarget(ckpt, [1, 2, 3], torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(target, n, g) for n in (5, SHORT_MAX + 6, 1, 12, 33)]
    step(target, seqs, [None] * 5)                           # prefill: 4 padded groups + 1 long prompt
    for _ in range(3):
        step(target, seqs, [1] * 5)                          # decode; the long one outgrows the capacity
    step(target, seqs, [4] * 5)                              # verify k + 1 = 4 tokens each
    for s, keep in zip(seqs, (0, 1, 4, 2, 3)):               # reject some drafts
        s.crop(len(s.tokens) - 4 + keep)
    assert [s.cache.length for s in seqs] == [len(s.tokens) for s in seqs]
    seqs[2] = None                                           # a finished sequence frees its slot ...
    seqs[2] = Sequence(target, SHORT_MAX + 20, g)            # ... which a new long prompt takes
    extra = Sequence(target, 3, g)                           # one more slot: the pool grows
    seqs.append(extra)
    step(target, seqs, [2, 1, None, 3, 1, None])             # mixed lengths, prompts and decodes
    step(target, [seqs[0], extra], [1, 1])                   # slots 0 and 5 only: gathered, not a slice
    step(target, seqs, [1] * 6)
    assert seqs[2].cache.slot == 2 and extra.cache.slot == 5
    assert target.pool.k[0].shape[0] >= 6 and target.pool.k[0].shape[1] >= SHORT_MAX + 24
    ref = TargetRunner(ckpt, [1, 2, 3], torch.device("cpu"), torch.float32)
    for s in seqs:
        full = ref.run(torch.tensor(s.tokens), [0, len(s.tokens)])
        torch.testing.assert_close(torch.cat(s.final), full["final_hidden"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat(s.aux), full["aux_hidden"], rtol=1e-5, atol=1e-5)


def test_slots_are_reused_lowest_first(llama_target):
    target = IncrementalTarget(Checkpoint(llama_target), [1, 2, 3], torch.device("cpu"))
    caches = [target.new_cache() for _ in range(4)]
    assert [c.slot for c in caches] == [0, 1, 2, 3]
    del caches[2], caches[0]
    assert [target.new_cache().slot for _ in range(2)] == [0, 0]   # each dropped again at once
    kept = [target.new_cache(), target.new_cache(), target.new_cache()]
    assert sorted(c.slot for c in kept) == [0, 2, 4]
    target.forward_many([torch.tensor([3, 4, 5])], [kept[0]])
    assert kept[0].length == 3
    with pytest.raises(ValueError, match="same cache twice"):
        target.forward_many([torch.tensor([1]), torch.tensor([2])], [kept[0], kept[0]])


class OpCounter(TorchDispatchMode):
    """Counts the operators that run a kernel (views launch none)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk", [1, 4])
def test_pass_cost_does_not_grow_with_the_batch(llama_target, chunk):
    """Decode (1 token) and verify (k + 1) passes run the same operations for 2 or 8 sequences."""
    target = IncrementalTarget(Checkpoint(llama_target), [1, 2, 3], torch.device("cpu"))
    counts = []
    for batch in (8, 2):                  # the larger first: the second pass needs no buffer growth
        caches = [target.new_cache() for _ in range(batch)]
        target.forward_many([torch.arange(10 + i) for i in range(batch)], caches)
        with OpCounter() as counter:
            target.forward_many([torch.ones(chunk, dtype=torch.long)] * batch, caches)
        counts.append(counter.ops)
        del caches
    assert counts[0] == counts[1], counts


@pytest.fixture(scope="module")
def two_turn_data(tmp_path_factory):
    """Conversations of two replies, some with a user turn longer than SHORT_MAX (attended alone
    while the others decode)."""
    path = tmp_path_factory.mktemp("turns") / "data.jsonl"
    g = torch.Generator().manual_seed(3)
    with path.open("w") as f:
        for i in range(7):
            lens = [4 + 3 * i, 10, SHORT_MAX + 5 if i % 3 == 0 else 6, 10]
            ids = torch.randint(3, 256, (sum(lens),), generator=g).tolist()
            mask = [0] * lens[0] + [1] * lens[1] + [0] * lens[2] + [1] * lens[3]
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return path


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_does_not_depend_on_the_batch(tmp_path, llama_target, two_turn_data, temperature):
    outputs = []
    for batch in (1, 4):
        out = tmp_path / f"regen-{batch}.jsonl"
        cfg = make_config(tmp_path, llama_target, two_turn_data, **{
            "generate.output_path": out, "generate.max_new_tokens": 12, "debug.generate_batch_size": batch,
            "generate.temperature": temperature, "debug.generate_dtype": "float32", "debug.generate_device": "cpu",
            "debug.stop_token_ids": "[]"})
        generate.run(cfg)
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]
    lines = [json.loads(x) for x in outputs[0].splitlines()]
    assert len(lines) == 7 and all(sum(x["loss_mask"]) == 24 for x in lines)
