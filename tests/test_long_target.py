"""A sequence longer than `debug.chunk_tokens` through the target a chunk at a time per layer (each chunk's queries
against the keys the earlier chunks left: MLA's latent, GQA's k/v): the same states as the whole-sequence forward,
offline and online, and no intermediate as large as the whole sequence's attention or MoE activations."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

from conftest import make_config
from eagle3 import extraction
from eagle3.data.online import OnlineReader
from eagle3.data.shards import read_manifest
from eagle3.models import tiny
from eagle3.models.streaming import TargetRunner, build_model, past_positions, run_layers
from eagle3.models.weights import Checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    return tiny.make_kimi(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def long_data(tmp_path_factory) -> Path:
    """Sequences of 60-150 tokens: each several 16-token chunks long."""
    return tiny.make_token_data(tmp_path_factory.mktemp("long") / "data.jsonl", vocab=256, sequences=4,
                                min_len=60, max_len=150)


@pytest.mark.parametrize("target", ["kimi", "llama_target"])
def test_a_long_sequence_in_chunks_equals_the_whole_forward(target, request):
    """MLA (latent expanded a head at a time) and GQA (k/v repeated to a slice of query heads); the long sequence
    between two short ones, which still run packed together."""
    ckpt = Checkpoint(request.getfixturevalue(target))
    ids = torch.randint(0, 256, (130,), generator=torch.Generator().manual_seed(5))
    cu = [0, 9, 121, 130]
    chunked = TargetRunner(ckpt, [1, 2, 3], CPU, torch.float32, chunk_tokens=16).run(ids, cu)
    whole = TargetRunner(ckpt, [1, 2, 3], CPU, torch.float32, chunk_tokens=1000).run(ids, cu)
    for key in ("aux_hidden", "final_hidden"):
        torch.testing.assert_close(chunked[key], whole[key], rtol=1e-5, atol=1e-5)
    assert torch.equal(chunked["target_argmax"], whole["target_argmax"])


class LargestOutput(TorchFunctionMode):
    """The largest storage (bytes) any torch function returns while active."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if type(t) is torch.Tensor:
                self.bytes = max(self.bytes, t.untyped_storage().nbytes())
        return out


def peaks_chunked_and_whole(model, T: int = 768, chunk: int = 128) -> tuple[dict, dict, torch.Tensor]:
    """A random h [T, H] through every layer of `model` in chunks of `chunk` and whole -> ({chunk or T: the largest
    output of a torch call}, {chunk or T: the final h}, h)."""
    layers = [(i, model.load_layer(i)) for i in range(model.cfg.num_hidden_layers)]
    h = torch.randn(T, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    peaks, outs = {}, {}
    for c in (chunk, T):
        with LargestOutput() as seen:
            outs[c] = run_layers(model, layers, h, [0, T], [1], c)[0]
        peaks[c] = seen.bytes
    return peaks, outs, h


def test_a_chunked_sequence_allocates_nothing_larger_than_its_hidden_states(kimi):
    """768 tokens in 128-token chunks: no torch call of the layers returns more than h [T, H] itself (the latent
    cache is [T, 16 + 8], a chunk's causal mask on the CPU [128, <= T], the weights of a block of experts 2/3 of h);
    the whole-sequence forward does ([T, 128] dense MLP, [T * 2, H] MoE pairs, [T, heads, 24] keys), and one head's
    [T, T] scores alone would be 12x h."""
    T = 768
    peaks, _, h = peaks_chunked_and_whole(build_model(Checkpoint(kimi), CPU, torch.float32), T)
    assert peaks[128] <= h.nbytes < peaks[T], (peaks, h.nbytes)
    assert T * T * 4 >= 12 * h.nbytes


@pytest.mark.parametrize("setting", ["offline", "stream", "staged"])
def test_long_sequences_extract_and_feed_online_as_whole_ones(setting, tmp_path, kimi, long_data):
    """`extract`'s shards, and the online feed's micro-batches (streamed or staged target), of 16-token chunks
    equal those of whole sequences (to the stored bf16); nothing is cut."""
    mode = {} if setting == "offline" else {"train.online_target": setting}
    cfgs = [make_config(tmp_path / str(chunk), kimi, long_data, **{"debug.chunk_tokens": chunk}, **mode)
            for chunk in (16, 1000)]
    if setting == "offline":
        outs = [extraction.run(cfg) for cfg in cfgs]
        manifest = read_manifest(outs[0])
        assert sum(s["tokens"] for s in manifest["shards"]) == sum(
            len(json.loads(line)["input_ids"]) for line in long_data.read_text().splitlines())
        pairs = [[load_file(out / s["file"]) for out in outs] for s in manifest["shards"]]
    else:
        ckpt = Checkpoint(kimi)
        readers = [OnlineReader(cfg, ckpt, [1, 2, 3], CPU) for cfg in cfgs]
        pairs = [[vars(r.read(r.sequences[1:3])) for r in readers]]
    for chunked, whole in pairs:
        for key, value in whole.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(chunked[key], value, msg=key)


def test_sequences_past_the_targets_positions_are_extracted_whole_and_named(tmp_path, llama_target, long_data,
                                                                            capsys):
    target = Path(shutil.copytree(llama_target, tmp_path / "target"))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 100}))
    lengths = [len(json.loads(line)["input_ids"]) for line in long_data.read_text().splitlines()]
    out = extraction.run(make_config(tmp_path, target, long_data, **{"debug.chunk_tokens": 32}))
    over = [n for n in lengths if n > 100]
    assert over and f"{len(over)} sequences are longer than max_position_embeddings 100" in capsys.readouterr().err
    assert f"the longest {max(over)} tokens" in past_positions(lengths, Checkpoint(target))
    assert sum(s["tokens"] for s in read_manifest(out)["shards"]) == sum(lengths)
