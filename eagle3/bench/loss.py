"""`python -m eagle3.bench loss [--shapes a,b,c,c*] [--json FILE]`: the fused TTT loss of K = 7 steps against eager,
torch.compile, the GEMMs alone and the floor (the useful FLOPs at the bf16 rate measured in the run), on the GPU."""
from __future__ import annotations

import argparse

import torch

from eagle3.bench.timing import (append_json, attempt, describe_device, free_memory, matmul_tflops,
                                 median_ms_of_calls, peak_bytes, rel_error, require_cuda, shape_labels)
from eagle3.kernels.reference import ttt_loss as reference_loss
from eagle3.kernels.ttt_loss import chosen_configs, ttt_loss, ttt_loss_steps

K, V = 7, 32000
SHAPES = {  # label: (N, H, share of rows not valid); "c*" is (c) with every row valid
    "a": (4096, 7168, 0.0),
    "b": (16384, 7168, 0.0),
    "c": (16384, 4096, 0.3),
}
GiB = 2 ** 30
DEVICE = "cuda"
NAN = float("nan")


def shape(label: str) -> tuple[int, int, float]:
    N, H, invalid = SHAPES[label.rstrip("*")]
    return N, H, 0.0 if label.endswith("*") else invalid


class Problem:
    """Inputs of one K-step iteration in bf16 on the GPU: the head w [V, H], rows h_k [N, H] and targets p[k : k + N]
    (views of one [N + K, V] tensor, as in training)."""

    def __init__(self, N: int, H: int, invalid: float, seed: int = 0):
        dev, g = DEVICE, torch.Generator(device=DEVICE).manual_seed(seed)
        self.w = (torch.randn(V, H, device=dev, generator=g) * (2 / H ** 0.5)).bfloat16().requires_grad_()
        self.hs = [torch.randn(N, H, device=dev, generator=g).bfloat16().requires_grad_() for _ in range(K)]
        p = torch.empty(N + K, V, device=dev, dtype=torch.bfloat16)
        for a in range(0, N + K, 4096):   # softmax in slices: no [N, V] fp32 temporary
            p[a:a + 4096] = torch.softmax(torch.randn(min(4096, N + K - a), V, device=dev, generator=g) * 3, -1)
        self.ps = [p[k:k + N] for k in range(K)]
        valid = torch.rand(N + K, device=dev, generator=g) >= invalid
        self.valids = [valid[k:k + N] for k in range(K)]
        self.n_valid = [int(v.sum()) for v in self.valids]
        self.weights = [0.8 ** k / max(1, self.n_valid[0]) for k in range(K)]
        self.leaves = [self.w, *self.hs]

    def zero_grads(self):
        for t in self.leaves:
            t.grad = None


def per_step(prob: Problem, fn):
    """fwd+bwd of K calls of a per-step loss function; returns (losses, argmaxes, alphas)."""
    def run():
        prob.zero_grads()
        outs = [fn(prob.hs[k], prob.w, prob.ps[k], prob.valids[k]) for k in range(K)]
        sum(loss.sum() * weight for (loss, _, _), weight in zip(outs, prob.weights)).backward()
        losses, argmaxes, alphas = zip(*outs)
        return [loss.detach() for loss in losses], argmaxes, alphas
    return run


def all_steps(prob: Problem, loss: str = "kl"):
    """fwd+bwd of one ttt_loss_steps call (the `triton-K` iteration) with the given loss kind."""
    def run():
        prob.zero_grads()
        total, *out = ttt_loss_steps(prob.hs, prob.w, prob.ps, prob.valids, prob.weights, loss=loss)
        total.backward()
        return out
    return run


def cublas_only(prob: Problem):
    """The GEMMs the loss needs, unchunked, on the valid rows: logits, dh, dw per step."""
    hv = [h.detach()[v.nonzero().squeeze(1)] for h, v in zip(prob.hs, prob.valids)]
    w = prob.w.detach()
    z = torch.empty(max(prob.n_valid), V, device=DEVICE, dtype=torch.bfloat16)
    dw = torch.empty_like(w)

    def run():
        for k, h in enumerate(hv):
            zk = torch.matmul(h, w.t(), out=z[: h.shape[0]])
            torch.matmul(zk, w)
            if k == 0:
                torch.matmul(zk.t(), h, out=dw)
            else:
                dw.addmm_(zk.t(), h)
    return run


def memory(prob: Problem, fn) -> tuple[float, float]:
    """(extra, raw) GiB of one iteration: raw the peak above the inputs, extra raw less the gradients left."""
    prob.zero_grads()
    raw = peak_bytes(fn)[0]
    grads = sum(t.grad.nbytes for t in prob.leaves if t.grad is not None)
    prob.zero_grads()
    return (raw - grads) / GiB, raw / GiB


def fp32_reference(prob: Problem, loss: str = "kl"):
    """Per-step losses, argmaxes, alphas, dh and dw of the same iteration, in fp32 without TF32."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    wf, steps = prob.w.detach().float().requires_grad_(), []
    for k in range(K):
        hf = prob.hs[k].detach().float().requires_grad_()
        row, argmax, alpha = reference_loss(hf, wf, prob.ps[k].float(), prob.valids[k], loss=loss)
        (row.sum() * prob.weights[k]).backward()
        steps.append((row.detach(), argmax, alpha, hf.grad))
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return (*map(list, zip(*steps)), wf.grad)


def errors(prob: Problem, fn, ref) -> dict:
    losses, argmaxes, alphas = fn()
    r_losses, r_argmaxes, r_alphas, r_dhs, r_dw = ref
    valid = torch.cat(prob.valids)
    argmax, r_argmax = torch.cat(argmaxes), torch.cat(r_argmaxes)
    out = dict(loss=rel_error(torch.cat(losses), torch.cat(r_losses)),
               alpha=rel_error(torch.cat(alphas), torch.cat(r_alphas)),
               argmax=(argmax[valid] == r_argmax[valid]).float().mean().item(),
               argmax_invalid_ok=bool((argmax[~valid] == -1).all()) if (~valid).any() else True,
               dh=rel_error(torch.cat([h.grad for h in prob.hs]), torch.cat(r_dhs)), dw=rel_error(prob.w.grad, r_dw))
    prob.zero_grads()
    return out


def check(prob: Problem, label: str, loss: str, contenders: list, checks: list) -> None:
    """Each contender's errors against the fp32 reference of `loss`, appended to `checks`."""
    ref = fp32_reference(prob, loss)
    for name, fn in contenders:
        if (e := attempt(f"[{label}] {name} check", errors, prob, fn, ref)) is not None:
            checks.append((label, name, e))
    del ref
    free_memory()


def measure(prob: Problem, name: str, fn) -> tuple[float, float, float]:
    """(median ms, extra GiB, raw GiB) of one method."""
    ms = median_ms_of_calls(fn, calls=7)
    return ms, *(memory(prob, fn) if name != "cublas" else (NAN, NAN))


def bench_shape(label: str, rate: float, results: dict, checks: list) -> None:
    """Check and time every method at one shape: results[(label, name)] = (ms, TFLOP/s, extra, raw GiB)."""
    N, H, invalid = shape(label)
    prob = Problem(N, H, invalid)
    flops = sum(3 * 2 * n * V * H for n in prob.n_valid)
    # triton: exact for any upstream gradient (4 GEMMs a step); triton-K: the loss weights known (3 GEMMs)
    methods = {"triton": per_step(prob, ttt_loss), "triton-K": all_steps(prob)}
    if not label.endswith("*"):
        check(prob, label, "kl", [("eager", per_step(prob, reference_loss)), *methods.items()], checks)
        print(f"[{label}] checked", flush=True)
        torch._dynamo.reset()
        methods = {"eager": per_step(prob, reference_loss),
                   "compile": per_step(prob, torch.compile(reference_loss, dynamic=False)),
                   **methods, "cublas": cublas_only(prob)}
    for name, fn in methods.items():
        if measured := attempt(f"[{label}] {name}", measure, prob, name, fn):
            ms, extra, raw = measured
            results[(label, name)] = (ms, flops / ms / 1e9, extra, raw)
            print(f"[{label}] {name:9s} {ms:9.2f} ms {flops / ms / 1e9:6.0f} TFLOP/s "
                  f"extra {extra:6.2f} GiB raw {raw:6.2f} GiB", flush=True)
    results[(label, "floor")] = (flops / rate / 1e9, rate, NAN, NAN)
    del prob, methods
    free_memory()


def ratios(results: dict, label: str) -> list[str]:
    """Each fused method's time against the others' at one shape."""
    ms = {name: v[0] for (lab, name), v in results.items() if lab == label}
    return [f"({label}) " + ", ".join(f"{other}/{name} {ms[other] / ms[name]:.3f}" for other in ms if other != name)
            for name in ("triton", "triton-K") if name in ms]


def print_checks(checks: list) -> None:
    print("\nCorrectness vs fp32 reference (relative L2 error; argmax = agreement on valid rows)")
    print("| shape | method | loss | alpha | argmax | dh | dw |\n|---|---|---|---|---|---|---|")
    for label, name, e in checks:
        flag = "" if e["argmax_invalid_ok"] else " (argmax not -1 on invalid rows!)"
        print(f"| {label} | {name} | {e['loss']:.2e} | {e['alpha']:.2e} | {e['argmax'] * 100:.2f}%{flag} "
              f"| {e['dh']:.2e} | {e['dw']:.2e} |")


def run(shapes: str = "all", json_path: str | None = None) -> None:
    labels, device = shape_labels(shapes, [*SHAPES, "c*"]), describe_device()
    print(f"{device}, K={K}, V={V}, bf16", flush=True)
    rate = matmul_tflops()
    print(f"bf16 torch.matmul 8192^3: {rate:.0f} TFLOP/s", flush=True)
    results, checks = {}, []
    for label in labels:
        bench_shape(label, rate, results, checks)
    print_checks(checks)
    print("\n| shape | N, H, not valid | method | fwd+bwd ms | TFLOP/s (useful) | extra GiB | raw GiB |")
    print("|---|---|---|---|---|---|---|")
    gib, rows = (lambda x: "" if x != x else f"{x:.2f}"), []
    for (label, name), (ms, tf, extra, raw) in results.items():
        N, H, invalid = shape(label)
        print(f"| {label} | {N}, {H}, {invalid:.0%} | {name} | {ms:.2f} | {tf:.0f} | {gib(extra)} | {gib(raw)} |")
        rows.append({"bench": "loss", "device": device, "shape": label, "N": N, "H": H, "V": V, "not_valid": invalid,
                     "method": name, "fwd_bwd_ms": ms, "tflops": tf, "extra_gib": extra, "raw_gib": raw})
    append_json(json_path, rows)
    print("", *(line for label in labels for line in ratios(results, label)), sep="\n")
    if configs := chosen_configs():
        print("loss kernel configs chosen by autotune (V, LOSS, WRITE_GRAD, ...):", configs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.bench loss", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="all", help="comma-separated shape labels (a,b,c,c*) or 'all'")
    parser.add_argument("--json", default=None, help="append each row (shape, method) here as a JSON line")
    args = parser.parse_args(argv)
    require_cuda("eagle3.bench loss")
    run(args.shapes, args.json)
