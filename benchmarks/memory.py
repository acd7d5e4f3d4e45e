"""The start-up estimate of a training step's peak memory (eagle3/training/memory.py) against the measured peak of
one step, per shape: on the GPU `torch.cuda.max_memory_allocated` over the step, on the CPU the peak resident size it
adds (Linux). One JSON line per shape:

    python -m benchmarks.memory --device cuda [--sizes small,wide] > memory.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_config, make_llama  # noqa: E402

from eagle3 import extraction, training  # noqa: E402
from eagle3.models import tiny  # noqa: E402
from eagle3.training import memory  # noqa: E402

# target hidden / intermediate / vocab, draft vocab, micro-batch tokens, TTT steps, sequence length
SIZES = {"tiny": (64, 128, 4096, 4096, 1024, 3, 200), "small": (512, 1536, 32768, 16384, 8192, 5, 2048),
         "wide": (1024, 4096, 65536, 32000, 16384, 7, 4096)}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def measure(name: str, device: str, work: Path) -> dict:
    hidden, inter, vocab, draft_vocab, tokens, steps, length = SIZES[name]
    target = make_llama(work / "t", hidden=hidden, layers=5, heads=8, kv_heads=4, intermediate=inter, vocab=vocab)
    data = tiny.make_token_data(work / "d.jsonl", vocab=vocab, sequences=2 * tokens // length + 2,
                                min_len=length - length // 4, max_len=length)
    cfg = make_config(work, target, data, **{"vocab.draft_vocab_size": draft_vocab, "train.batch_tokens": tokens,
                                             "data.max_seq_len": tokens, "train.ttt_steps": steps,
                                             "train.eval_fraction": 0.0, "debug.train_device": device,
                                             "debug.extract_device": device})
    extraction.run(cfg)
    trainer = training.Trainer(cfg)
    micro = [next(trainer.feed.batches(0))]
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _rss("VmRSS")
    trainer.train_step(micro, 1)
    if cuda:
        torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss("VmHWM")) - before
    estimate = memory.step_peak_bytes(trainer.resolved.draft_spec, cfg, length, cuda)
    step_part = estimate.optimizer + estimate.activations
    return {"size": name, "device": device, "measured_step_MiB": round(peak / 2 ** 20, 1),
            "estimated_step_MiB": round(step_part / 2 ** 20, 1), "ratio": round(step_part / peak, 3),
            "estimated_total_MiB": round(estimate.total / 2 ** 20, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="tiny,small,wide")
    args = parser.parse_args(argv)
    for name in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as work:
            print(json.dumps(measure(name, args.device, Path(work))), flush=True)


if __name__ == "__main__":
    main()
