"""`python -m benchmarks.graph_check`: the same training steps eagerly, as CUDA graphs (debug.cuda_graphs) and at
the graphs' static shapes run eagerly, on the step bench's small draft with padded batches: per-step loss and
gradient norm side by side (GPU). The three columns agree to bf16 noise when the graphs are right."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eagle3 import config as config_mod
from eagle3.bench.step import SIZES, kernel_args, write_shards, write_target
from eagle3.bench.timing import require_cuda
from eagle3.training import Trainer, graph
from eagle3.ttt import summarize

VARIANTS = {"eager": ("triton", 2), "graph": ("triton-graph", 2), "static": ("triton-graph", 10 ** 9)}


def curve(root: Path, variant: str, steps: int) -> list[tuple]:
    """(loss0, grad norm, rows, graphs held) per step of one variant."""
    kernels, graph.GraphedStep.WARMUP = VARIANTS[variant]
    s = SIZES["small"]
    args = ["--target.path", str(root / "target"), "--train.data_dir", str(root / "data"),
            "--train.output_dir", str(root / f"out-{variant}"), *kernel_args(kernels),
            "--train.batch_tokens", "5000", "--train.eval_fraction", "0", "--train.max_steps", str(steps),
            "--train.resume", "never", "--vocab.draft_vocab_size", str(s["draft_vocab"]),
            "--draft.num_attention_heads", str(s["heads"]), "--draft.num_key_value_heads", str(s["kv_heads"]),
            "--draft.head_dim", str(s["head_dim"]), "--draft.intermediate_size", str(s["inter"]),
            "--train.lr", "1e-3", "--train.warmup_steps", "2"]
    trainer = Trainer(config_mod.load(None, args))
    batches, rows = trainer.feed.batches(0), []
    for step in range(steps):
        batch = next(batches)
        result = trainer.train_step([batch], step + 1)
        held = len(trainer.graphed.graphs) if trainer.graphed else 0
        rows.append((summarize(result.metrics)["loss"][0], float(result.grad_norm), batch.rows, held))
    torch.cuda.synchronize()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.graph_check", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/graph-check"))
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    require_cuda("benchmarks.graph_check")
    write_target(args.dir / "target", SIZES["small"])
    write_shards(args.dir / "data", args.dir / "target", "b", SIZES["small"], 12)
    curves = {variant: curve(args.dir, variant, args.steps) for variant in VARIANTS}
    for step, cols in enumerate(zip(*curves.values())):
        print(f"{step:3d} rows {cols[0][2]} graphs {cols[1][3]} | "
              + " | ".join(f"{v} loss0 {c[0]:.5f} grad norm {c[1]:.4f}" for v, c in zip(curves, cols)))


if __name__ == "__main__":
    main()
