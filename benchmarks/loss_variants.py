"""`python -m benchmarks.loss_variants`: the fused TTT loss (`ttt_loss_steps`, the trainer's) for each loss
kind of `train.loss` against `kl`'s, on the GPU, at the loss bench's shapes (`python -m eagle3.bench loss`).

Each kind is checked against its fp32 reference beside eager bf16 of it, then timed fwd+bwd with its extra
memory; the table gives each kind's time and memory against kl's.

    python -m benchmarks.loss_variants [--shapes a,c] [--losses tv,nla,lk_hybrid,pq]
"""
from __future__ import annotations

import argparse
import functools

from eagle3.bench.loss import SHAPES, Problem, all_steps, check, measure, per_step, print_checks, shape
from eagle3.bench.timing import attempt, describe_device, free_memory, require_cuda, shape_labels
from eagle3.kernels.reference import LOSSES
from eagle3.kernels.reference import ttt_loss as reference_loss


def bench_shape(label: str, losses: list[str], results: dict, checks: list) -> None:
    """Check (not at a `*` shape) and time triton-K of each loss kind: results[(label, loss)] = (ms, extra GiB)."""
    prob = Problem(*shape(label))
    if not label.endswith("*"):
        # each loss kind beside eager bf16 of it; tv's and nla's gradients follow [q <= p], which bf16
        # logits flip here and there: a few % from fp32 in both
        for loss in losses:
            pairs = [(f"triton-K[{loss}]", all_steps(prob, loss))]
            if loss != "kl":
                pairs.insert(0, (f"eager[{loss}]", per_step(prob, functools.partial(reference_loss, loss=loss))))
            check(prob, label, loss, pairs, checks)
    for loss in losses:
        if measured := attempt(f"[{label}] triton-K[{loss}]", measure, prob, "triton-K", all_steps(prob, loss)):
            results[(label, loss)] = measured[:2]
            print(f"[{label}] triton-K[{loss}] {measured[0]:9.2f} ms extra {measured[1]:6.2f} GiB", flush=True)
    del prob
    free_memory()


def loss_table(results: dict, labels: list[str], losses: list[str]) -> list[str]:
    """Per shape and loss kind: triton-K's time, its ratio to kl's and its extra memory beside kl's."""
    out = ["| shape | loss | triton-K fwd+bwd ms | / kl | extra GiB | extra - kl's GiB |", "|---|---|---|---|---|---|"]
    worst = None
    for label in labels:
        kl = results.get((label, "kl"))
        for loss in losses:
            t = results.get((label, loss))
            if t is None or kl is None:
                continue
            ratio = t[0] / kl[0]
            if loss != "kl" and (worst is None or ratio > worst[0]):
                worst = (ratio, label, loss)
            out.append(f"| {label} | {loss} | {t[0]:.2f} | {ratio:.3f} | {t[1]:.2f} | {t[1] - kl[1]:+.3f} |")
    if worst is not None:
        ratio, label, loss = worst
        out.append(f"slowest loss against kl: {loss} at ({label}) {ratio:.3f}x "
                   f"({'within' if ratio <= 1.10 else 'OVER'} the 1.10x bar)")
    return out


def parse_losses(text: str) -> list[str]:
    """'tv,nla' -> ['kl', 'tv', 'nla'] (kl first: the yardstick)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if unknown := [n for n in names if n not in LOSSES]:
        raise ValueError(f"unknown loss {', '.join(unknown)}; the losses are {','.join(LOSSES)}")
    return ["kl"] + [n for n in dict.fromkeys(names) if n != "kl"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loss_variants", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="a,c", help="comma-separated shape labels (a,b,c,c*) or 'all'")
    parser.add_argument("--losses", default=",".join(LOSSES), help="comma list of loss kinds, timed against kl's")
    args = parser.parse_args(argv)
    try:
        losses = parse_losses(args.losses)
    except ValueError as exc:
        parser.error(str(exc))
    require_cuda("benchmarks.loss_variants")
    labels = shape_labels(args.shapes, [*SHAPES, "c*"])
    print(describe_device(), flush=True)
    results, checks = {}, []
    for label in labels:
        bench_shape(label, losses, results, checks)
    print_checks(checks)
    print("\n" + "\n".join(loss_table(results, labels, losses)))


if __name__ == "__main__":
    main()
