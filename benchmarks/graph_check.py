"""`python -m benchmarks.graph_check`: the same training steps eagerly, as CUDA graphs (debug.cuda_graphs) and at
the graphs' static shapes run eagerly, on the step bench's small draft with padded batches: per-step loss and
gradient norm side by side, and each replay's gradients against the same micro-batch run eagerly at the same
weights (GPU). The columns agree to bf16 noise, and each replay's gradients equal the eager run's, when the graphs are right."""
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
replayed, zeroed = graph.GraphedStep.__call__, graph.load


def varied(T: int, g: torch.Generator) -> torch.Tensor:
    """cu_seqlens of sequences of 1 to 1,024 tokens filling T: batches of several sequence counts, several graphs."""
    ends = torch.randint(1, 1025, (T,), generator=g).cumsum(0)
    return torch.cat([torch.zeros(1, dtype=torch.int64), ends[ends < T], torch.tensor([T])])


def leftover(batch, static=None):
    """`graph.load` with the filler rows left as the previous micro-batch wrote them (not zeroed)."""
    kept = {} if static is None else {n: getattr(static, n)[batch.rows:].clone() for n in batch.row_tensors()}
    static = zeroed(batch, static)
    for name, rows in kept.items():
        getattr(static, name)[batch.rows:].copy_(rows)
    return static


def verified(self, batch, scale):
    """A replay, then the same micro-batch run eagerly at the same weights: the largest relative difference
    of any parameter's gradient, kept in `self.checked` (the graph's gradients stay)."""
    params = [p for p in self._params if p.grad is not None]
    before = [p.grad.clone() for p in params]
    loss, metrics = replayed(self, batch, scale)
    if batch.cu_attention.numel() in self.graphs and self.eager >= self.WARMUP:
        ours = [p.grad.clone() for p in params]
        for p, b in zip(params, before):
            p.grad.copy_(b)
        self._step(self.inputs[batch.cu_attention.numel()])   # eagerly, on this stream
        self.checked.append(max(float(((p.grad - o).norm() / o.norm().clamp_min(1e-30))) for p, o in zip(params, ours)))
        for p, o in zip(params, ours):
            p.grad.copy_(o)
    return loss, metrics


def curve(root: Path, data: str, variant: str, steps: int) -> list[tuple]:
    """(loss0, grad norm, rows, graphs held) per step of one variant."""
    kernels, graph.GraphedStep.WARMUP = VARIANTS[variant]
    s = SIZES["small"]
    args = ["--target.path", str(root / "target"), "--train.data_dir", str(root / data),
            "--train.output_dir", str(root / f"out-{variant}"), *kernel_args(kernels),
            "--train.batch_tokens", "5000", "--train.eval_fraction", "0", "--train.max_steps", str(steps),
            "--train.resume", "never", "--vocab.draft_vocab_size", str(s["draft_vocab"]),
            "--draft.num_attention_heads", str(s["heads"]), "--draft.num_key_value_heads", str(s["kv_heads"]),
            "--draft.head_dim", str(s["head_dim"]), "--draft.intermediate_size", str(s["inter"]),
            "--train.lr", "1e-3", "--train.warmup_steps", "2"]
    trainer = Trainer(config_mod.load(None, args))
    if trainer.graphed is not None:
        trainer.graphed._params, trainer.graphed.checked = trainer.params, []
    batches, rows = trainer.feed.batches(0), []
    for step in range(steps):
        batch = next(batches)
        result = trainer.train_step([batch], step + 1)
        held = len(trainer.graphed.graphs) if trainer.graphed else 0
        checked = trainer.graphed.checked[-1] if trainer.graphed and trainer.graphed.checked else float("nan")
        rows.append((summarize(result.metrics)["loss"][0], float(result.grad_norm), batch.rows, held, checked))
    torch.cuda.synchronize()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.graph_check", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/graph-check"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of " + ",".join(VARIANTS))
    parser.add_argument("--varied", action="store_true",
                        help="sequences of 1 to 1,024 tokens (several sequence counts: several graphs) instead of 512 each")
    parser.add_argument("--filler", choices=("zeros", "leftover"), default="zeros",
                        help="the static buffers' filler rows: zeros (as training) or the previous batch's rows")
    args = parser.parse_args(argv)
    if unknown := set(args.variants.split(",")) - set(VARIANTS):
        parser.error(f"--variants: {', '.join(sorted(unknown))} unknown (of {', '.join(VARIANTS)})")
    require_cuda("benchmarks.graph_check")
    write_target(args.dir / "target", SIZES["small"])
    data = "data-varied" if args.varied else "data"
    write_shards(args.dir / data, args.dir / "target", "b", SIZES["small"], 12, varied if args.varied else None)
    graph.GraphedStep.__call__ = verified   # each replay's gradients against an eager run at the same weights
    graph.load = leftover if args.filler == "leftover" else zeroed
    curves = {variant: curve(args.dir, data, variant, args.steps) for variant in args.variants.split(",")}
    for step, cols in enumerate(zip(*curves.values())):
        held = max(c[3] for c in cols)
        checked = min((c[4] for c in cols if c[4] == c[4]), default=float("nan"))
        print(f"{step:3d} rows {cols[0][2]} graphs {held} replay vs eager grads {checked:.1e} | "
              + " | ".join(f"{v} loss0 {c[0]:.5f} grad norm {c[1]:.4f}" for v, c in zip(curves, cols)))


if __name__ == "__main__":
    main()
