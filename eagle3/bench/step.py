"""`python -m eagle3.bench`: the training step of an EAGLE-3 draft on synthetic shards at the sizes users train for:
tokens/s per GPU, MFU, peak memory, GPU idle, host syncs by size, data layout and kernel choice (docs/benchmarks.md)."""
from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3 import config as config_mod
from eagle3 import distributed
from eagle3.bench.timing import append_json, free_memory, matmul_tflops, require_cuda, wall_s
from eagle3.data.batch import Batch
from eagle3.data.shards import DTYPES, FORMAT_VERSION, MANIFEST, write_shard
from eagle3.files import atomic_write_text
from eagle3.float8 import layer_shapes
from eagle3.models.weights import read_config
from eagle3.training import Trainer
from eagle3.ttt import summarize

SIZES = {   # draft shapes (the target's hidden, heads, intermediate) and one micro-batch of tokens
    "kimi": dict(hidden=7168, vocab=163840, heads=64, kv_heads=8, head_dim=128, inter=18432, draft_vocab=32000,
                 seqs=4, seq_len=4096, user=512, layers=61),
    "llama8b": dict(hidden=4096, vocab=128256, heads=32, kv_heads=8, head_dim=128, inter=14336, draft_vocab=32000,
                    seqs=4, seq_len=4096, user=512, layers=32),
    "llama1b": dict(hidden=2048, vocab=128256, heads=32, kv_heads=8, head_dim=64, inter=8192, draft_vocab=32000,
                    seqs=4, seq_len=4096, user=512, layers=16),
    "small": dict(hidden=256, vocab=2048, heads=4, kv_heads=2, head_dim=64, inter=768, draft_vocab=256,
                  seqs=32, seq_len=512, user=128, layers=8),   # the quality bench's draft and batch
    "tiny": dict(hidden=64, vocab=2048, heads=2, kv_heads=2, head_dim=32, inter=128, draft_vocab=512,
                 seqs=4, seq_len=128, user=16, layers=61),   # 2 heads: a sequence splits over 2 ranks
}
# the MLA draft (draft.attention = "mla") beside each: Kimi's own attention dims (q_lora 1536, kv_lora 512, heads of
# 128 + 64 and 128), read from the stand-in target's config; the tiny one's set smaller (experimental.mla_dims)
SIZES |= {"kimi-mla": {**SIZES["kimi"], "attention": "mla", "base": "kimi"},   # base: whose target and shards
          "tiny-mla": {**SIZES["tiny"], "attention": "mla", "mla_dims": [32, 16, 32, 16, 32], "base": "tiny"}}


def shape(size: str, seq_len: int | None = None) -> dict:
    """SIZES[size], or with `seq_len` one sequence of that many tokens per micro-batch (a long thinking trace)."""
    return SIZES[size] if seq_len is None else {**SIZES[size], "seqs": 1, "seq_len": seq_len}


def folder(root: Path, size: str, name: str, seq_len: int | None = None) -> Path:
    """Where a size's shards (name "data-<layout>") or run ("out-...") go; long sequences have their own."""
    return root / size / (name if seq_len is None else f"{name}-{seq_len}")


def write_target(out: Path, s: dict) -> None:
    """A stand-in target: a text config (Kimi's with 61 layers, else Llama's) and the tensors the trainer reads;
    kept for the next run with the same --dir (config.json, written last, says the weights are complete)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": s["hidden"],
              "vocab_size": s["vocab"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
              "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "intermediate_size": s["inter"],
              "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 131072,
              "tie_word_embeddings": False}
    if s["layers"] == 61:   # Kimi's: its family needs the MLA and MoE sizes, though no layer is read
        config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=s["heads"],
                      q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      n_routed_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, rope_theta=50000.0,
                      max_position_embeddings=262144)
        del config["head_dim"]
    written = out / "config.json"
    if written.exists() and json.loads(written.read_text()) == config:
        return
    written.unlink(missing_ok=True)
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(s["vocab"], s["hidden"], generator=g).bfloat16(),
               "model.norm.weight": torch.ones(s["hidden"]).bfloat16(),
               "lm_head.weight": (torch.randn(s["vocab"], s["hidden"], generator=g) * s["hidden"] ** -0.5).bfloat16()},
              out / "model.safetensors")
    atomic_write_text(written, json.dumps(config))


def loss_mask(layout: str, s: dict, g: torch.Generator) -> torch.Tensor:
    """(a) a user turn of s["user"] tokens, then one reply; (b) alternating user/assistant turns of
    random lengths, about 40% of tokens outside replies."""
    n = s["seq_len"]
    mask = torch.zeros(n, dtype=torch.uint8)
    if layout == "a":
        mask[s["user"]:] = 1
        return mask
    i, assistant = 0, False
    while i < n:
        mean = n // 10 if assistant else n // 15
        turn = int(torch.randint(max(1, mean // 2), mean * 3 // 2 + 1, (1,), generator=g))
        mask[i:i + turn] = int(assistant)
        i, assistant = i + turn, not assistant
    return mask


def write_shards(out: Path, target: Path, layout: str, s: dict, batches: int, boundaries=None) -> None:
    """`batches` micro-batches of s["seqs"] sequences, a shard each, and their manifest (kept if --dir has as many);
    `boundaries(T, generator)`: other cu_seqlens than sequences of s["seq_len"] (the loss mask's turns ignore them)."""
    source = {"path": "synthetic", "layout": layout, "shape": s, "generator": 1,
              **({"boundaries": boundaries.__name__} if boundaries else {})}
    if (out / MANIFEST).exists():
        old = json.loads((out / MANIFEST).read_text())
        if old.get("source") == source and len(old["shards"]) >= batches:
            return
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    common = torch.randperm(s["vocab"], generator=g)[:s["draft_vocab"]]   # ids the replies use
    T = s["seqs"] * s["seq_len"]
    # the hidden states' values do not change the work: one random draw serves every shard
    aux = torch.randn(T, 3 * s["hidden"], generator=g, dtype=torch.bfloat16)
    final = torch.randn(T, s["hidden"], generator=g, dtype=torch.bfloat16)
    entries = []
    for b in range(batches):
        ids = common[torch.randint(0, s["draft_vocab"], (T,), generator=g)].to(torch.int32)
        greedy = torch.where(torch.rand(T, generator=g) < 0.9, ids.roll(-1),
                             torch.randint(0, s["vocab"], (T,), generator=g, dtype=torch.int32))
        tensors = {"input_ids": ids, "target_argmax": greedy,
                   "loss_mask": torch.cat([loss_mask(layout, s, g) for _ in range(s["seqs"])]),
                   "cu_seqlens": boundaries(T, g) if boundaries else torch.arange(0, T + 1, s["seq_len"]),
                   "aux_hidden": aux, "final_hidden": final}
        entries.append(write_shard(out, b, tensors))
    text = read_config(target / "config.json")
    manifest = {"format_version": FORMAT_VERSION, "target": text.identity(),
                "aux_layer_ids": text.default_aux_layer_ids(), "dtypes": DTYPES, "plan_key": "synthetic",
                "source": source, "shards": entries, "complete": True}
    atomic_write_text(out / MANIFEST, json.dumps(manifest))


def step_flops(s: dict, spec, steps: int, tokens: int, head_trained: bool) -> float:
    """Matmul FLOPs of one optimizer step computing every row at every TTT step, fwd + bwd (x3; a
    frozen lm_head needs no weight gradient: x2); the attention's at its useful head dims (no padding)."""
    H, V, shapes = s["hidden"], s["draft_vocab"], layer_shapes(spec)
    per_row_step = 2 * sum(n * k for name, (n, k) in shapes.items() if name != "fc")
    head = 2 * H * V * (3 if head_trained else 2)
    qk, v = ((spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim) if spec.attention == "mla"
             else (spec.head_dim, spec.head_dim))
    attention = 2 * (qk + v) * spec.num_attention_heads * (s["seq_len"] / 2 + steps)   # QK^T and PV, mean keys
    fc = 2 * shapes["fc"][0] * shapes["fc"][1]
    target_probs = 2 * H * V                               # no backward
    return tokens * (3 * (fc + steps * (per_row_step + attention)) + steps * head + target_probs)


def gpu_busy_fraction(trainer: Trainer, batches, label: str, report=None, steps: int = 3) -> float:
    """The busy share of `steps` steps back to back under the profiler: the union of the GPU kernels' time.
    `report(prof, stretches, wall, label)` gets the profile and the busy stretches [start, end, first, last kernel]."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = wall_s(lambda: [trainer.train_step([next(batches)]) for _ in range(steps)])[0]
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    merged = []
    for a, b, name in spans:
        if not merged or a > merged[-1][1]:
            merged.append([a, b, name, name])
        elif b > merged[-1][1]:
            merged[-1][1], merged[-1][3] = b, name
    if report is not None:
        report(prof, merged, wall, label)
    return sum(b - a for a, b, _, _ in merged) / 1e6 / wall


def host_syncs(trainer: Trainer, batch: Batch) -> list[str]:
    """Where one step waits for the GPU (torch's sync debug mode; the step should need none)."""
    import threading
    import traceback
    import warnings
    sites = []

    def record(message, *_):   # as warnings.showwarning; only the step's syncs, not the prefetch thread's
        frames = traceback.extract_stack()[:-1]
        if "synchroniz" in str(message) and threading.current_thread() is threading.main_thread() and any(
                Path(f.filename).parent.name == "training" for f in frames):
            ours = [f for f in frames if "/eagle3/" in f.filename or "/kernels/" in f.filename] or frames
            sites.append(f"{Path(frames[-1].filename).name}:{frames[-1].lineno} (from "
                         f"{Path(ours[-1].filename).name}:{ours[-1].lineno})")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step([batch])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def same_weights_on_all_ranks(trainer: Trainer) -> bool:
    """Every parameter bit-equal to rank 0's (what DDP promises after the optimizer steps)."""
    if trainer.dist.world == 1:
        return True
    equal = torch.ones((), device=trainer.device)
    for p in trainer.model.parameters():
        theirs = p.detach().clone()
        torch.distributed.broadcast(theirs, src=0)
        equal *= torch.equal(theirs, p.detach())
    return bool(trainer.dist.all_reduce(equal) == trainer.dist.world)


def kernel_args(kernels: str) -> list[str]:
    """A --kernels entry as config overrides: "torch", "triton[-fp8[-head]]", or "auto" (the defaults)."""
    if kernels == "auto":
        return []
    path, *options = kernels.split("-")
    # "torch": the established recipe, every row computed, eager layers; ours skips dead rows, fuses elementwise
    ours, has = str(path != "torch").lower(), lambda option: str(option in options).lower()   # noqa: E731
    return ["--debug.kernels", path, "--train.float8", has("fp8"), "--train.float8_head", has("head"),
            "--debug.skip_dead_rows", ours, "--debug.compile_ops", ours, "--debug.cuda_graphs", has("graph")]


def kernel_module(attention) -> str:
    """The module of the attention function a run's unroll calls, through a context-parallel split or a partial."""
    while not inspect.isfunction(attention):
        attention = getattr(attention, "attention", None) or attention.func
    return attention.__module__


def bench_one(root: Path, size: str, layout: str, kernels: str, steps: int, warmup: int, tflops: float,
              overrides: list[str] = (), report=None, seq_len: int | None = None, context: int = 1) -> dict:
    """One size, layout and kernel choice; `overrides`: more config arguments, `report`: see gpu_busy_fraction;
    `seq_len`: one sequence per micro-batch (`shape`), its rows split over `context` ranks (train.context_parallel)."""
    s = shape(size, seq_len)
    home = s.get("base", size)               # whose target and shards
    per_batch = s["seqs"] * s["seq_len"]     # tokens of a micro-batch (of all ranks sharing it)
    args = ["--target.path", str(root / home / "target"),
            "--train.data_dir", str(folder(root, home, f"data-{layout}", seq_len)),
            "--train.output_dir", str(folder(root, size, f"out-{layout}-{kernels}", seq_len)), *kernel_args(kernels),
            "--train.batch_tokens", str(per_batch // context), "--train.context_parallel", str(context),
            "--train.eval_fraction", "0",
            "--train.max_steps", str(steps + warmup + 4), "--train.resume", "never",
            "--vocab.draft_vocab_size", str(s["draft_vocab"]), "--draft.num_attention_heads", str(s["heads"]),
            "--draft.num_key_value_heads", str(s["kv_heads"]), "--draft.head_dim", str(s["head_dim"]),
            "--draft.intermediate_size", str(s["inter"]), "--draft.attention", s.get("attention", "gqa"),
            "--experimental.mla_dims", json.dumps(s.get("mla_dims", [])),
            "--train.prompt_rows", "false", *overrides]   # assistant rows only: the peer's workload
    started = time.perf_counter()
    trainer = Trainer(config_mod.load(None, args))
    cuda = trainer.device.type == "cuda"
    # as the training loop takes them: each micro-batch's copy to the GPU overlaps the step before
    batches = trainer.feed.batches(0)
    for i in range(warmup):
        metrics = trainer.train_step([next(batches)]).metrics
        if i == 0:
            first = metrics   # the same weights and data on every path: losses agree across kernels
    rows = []

    def loop():   # back to back, as in training: a sync between steps would hide the next copy
        for _ in range(steps):
            batch = next(batches)
            rows.append(batch.rows)
            trainer.train_step([batch])
            del batch

    step = wall_s(loop)[0] / steps
    tokens = statistics.mean(rows)
    label = f"{size}-{layout}-{kernels}-world{trainer.dist.world}-rank{trainer.dist.rank}"
    busy = gpu_busy_fraction(trainer, batches, label, report) if cuda else float("nan")
    syncs = host_syncs(trainer, next(batches)) if cuda else []
    flops = step_flops(s, trainer.resolved.draft_spec, trainer.cfg.train.ttt_steps, tokens,
                       not trainer.cfg.experimental.freeze_lm_head)
    attention_module = kernel_module(trainer.unroll.attention)
    return {"size": size, "layout": layout, "kernels": kernels, "seq_len": s["seq_len"], "tokens_per_batch": per_batch,
            "context_parallel": context, "float8": trainer.float8,
            "float8_head": trainer.float8_head, "world": trainer.dist.world, "step_s": step,
            "tokens_per_s_per_gpu": tokens / step, "mfu": flops / step / 1e12 / tflops if cuda else float("nan"),
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"),
            "gpu_idle": 1 - busy, "same_weights_on_all_ranks": same_weights_on_all_ranks(trainer),
            "host_syncs": len(syncs), "host_sync_sites": sorted(set(syncs)),
            "first_step_loss": [round(x, 4) for x in summarize(first)["loss"]],
            # the attention tuner's last picks, (BLOCK_M, BLOCK_N, warps, stages): what the step ran
            "attention_configs": {name: importlib.import_module(attention_module).best_config(name)
                                  for name in ("fwd", "dkdv", "dq")} if kernels != "torch" and cuda else None,
            "attention": attention_module,   # the kernel the step ran (the MLA draft: eagle3.kernels.mla_attention)
            "bench_s": round(time.perf_counter() - started)}


def out_of_memory_row(size: str, layout: str, kernels: str, seq_len: int | None, context: int,
                      dist: distributed.Dist, error: Exception) -> dict:
    s = shape(size, seq_len)
    gpu = torch.cuda.get_device_properties(dist.device).total_memory / 2 ** 30 if dist.device.type == "cuda" else None
    return {"size": size, "layout": layout, "kernels": kernels, "seq_len": s["seq_len"],
            "tokens_per_batch": s["seqs"] * s["seq_len"], "context_parallel": context, "world": dist.world,
            "out_of_memory": True, "gpu_gib": gpu, "error": str(error).split("\n")[0][:300]}


def run_ours(args: argparse.Namespace, dist: distributed.Dist, root: Path, overrides: list[str] = (),
             report=None) -> tuple[list[dict], float]:
    """Our step at each size, layout, kernel choice and sequence length asked for -> (rows, printed and --json'd; the
    bf16 rate). A sequence length splits each sequence over all ranks, or over length / --tokens-per-rank of them
    (context parallel); else each rank trains its own micro-batch of the size's sequences."""
    cases = [(size, layout, seq_len) for size in args.sizes for layout in args.layouts for seq_len in args.seq_lens]

    def groups(seq_len: int | None) -> int:   # ranks per micro-batch
        per_rank = args.tokens_per_rank or (seq_len or 0) // dist.world
        ranks = 1 if seq_len is None else max(1, seq_len // max(per_rank, 1))
        if dist.world % ranks or (seq_len or 0) % ranks:
            raise SystemExit(f"error: --seq-lens {seq_len}: {ranks} ranks per sequence must divide the world size "
                             f"({dist.world}) and the sequence")
        return ranks

    if dist.main:
        homes = dict.fromkeys((SIZES[size].get("base", size), layout, seq_len) for size, layout, seq_len in cases)
        for home, layout, seq_len in homes:   # an MLA size trains on its base size's target and shards
            write_target(root / home / "target", SIZES[home])
            write_shards(folder(root, home, f"data-{layout}", seq_len), root / home / "target", layout,
                         shape(home, seq_len), dist.world // groups(seq_len) * (args.steps + args.warmup + 4))
    dist.barrier()
    tflops = matmul_tflops() if dist.device.type == "cuda" else float("nan")
    results = []
    for (size, layout, seq_len), kernels in itertools.product(cases, args.kernels):
        try:
            results.append(bench_one(root, size, layout, kernels, args.steps, args.warmup, tflops, overrides, report,
                                     seq_len, groups(seq_len)))
        except torch.OutOfMemoryError as e:   # too large for this GPU: a row that says so, and the next case runs
            results.append(out_of_memory_row(size, layout, kernels, seq_len, groups(seq_len), dist, e))
        if dist.main:
            print(json.dumps(results[-1]), flush=True)
            append_json(args.json, [{**results[-1], "tflops": tflops}])
        free_memory()
        if dist.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
    return results, tflops


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eagle3.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="kimi", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--layouts", default="a,b")
    parser.add_argument("--kernels", default="torch,triton",
                        help="comma list of torch, triton, auto (the defaults); a -fp8 suffix adds train.float8 "
                             "(e.g. triton-fp8), -fp8-head also train.float8_head; -graph debug.cuda_graphs")
    parser.add_argument("--seq-lens", default="", help="comma list of tokens per sequence (e.g. 16384,32768,65536,"
                        "131072): each micro-batch one sequence, split over all ranks (train.context_parallel = the "
                        "world size), instead of the size's batch of sequences")
    parser.add_argument("--tokens-per-rank", type=int, default=None,
                        help="with --seq-lens: each sequence over length / this many ranks (e.g. 16384: 16k on "
                             "1 rank, 128k on 8), the others training other sequences; default: all ranks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="--sizes tiny (CPU smoke test; with --mla tiny-mla too)")
    parser.add_argument("--mla", action="store_true", help="each size's MLA draft beside it (kimi: kimi,kimi-mla)")
    parser.add_argument("--dir", default=None, help="where to write the synthetic targets and shards "
                        "(kept, and reused by the next bench with the same --dir)")
    parser.add_argument("--json", default=None, help="append the results here as JSON lines")
    args = parser.parse_args(argv)
    args.sizes = ["tiny"] if args.tiny else args.sizes.split(",")
    if args.mla:
        args.sizes = [x for size in args.sizes for x in (size, f"{size}-mla") if x in SIZES]
    args.layouts, args.kernels = args.layouts.split(","), args.kernels.split(",")
    args.seq_lens = [int(n) for n in args.seq_lens.split(",")] if args.seq_lens else [None]
    if unknown := [x for x in args.sizes if x not in SIZES]:
        parser.error(f"--sizes: unknown {', '.join(unknown)}; one of {', '.join(SIZES)}")
    kinds = r"auto|torch(-fp8(-head)?)?|triton(-fp8(-head)?)?(-graph)?"
    if bad := [k for k in args.kernels if not re.fullmatch(kinds, k)]:
        parser.error(f"--kernels: unknown {', '.join(bad)}; auto, torch or triton, with -fp8 or -fp8-head "
                     "(and -graph after triton's)")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first-step loss is the first warm-up step's)")
    if not args.tiny:   # a real-size draft on a CPU would run for hours
        require_cuda("eagle3.bench step", "; --tiny runs the same code at toy size on the CPU")
    return args


def main(argv: list[str] | None = None, overrides: list[str] = (), report=None) -> None:
    """The bench; `overrides` and `report` as in bench_one (benchmarks/step_lab.py passes them)."""
    args = parse(argv)
    dist = distributed.setup()
    root = Path(args.dir or tempfile.mkdtemp(prefix="eagle3-bench-"))
    results, tflops = run_ours(args, dist, root, overrides, report)
    if dist.main:
        print_table(results, tflops, dist)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    distributed.teardown()


def print_table(results: list[dict], tflops: float, dist: distributed.Dist) -> None:
    name = torch.cuda.get_device_name() if dist.device.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}, bf16 matmul {tflops:.0f} TFLOP/s (8192^3), {dist.world} rank(s)")
    print("| size | tokens/batch | layout | kernels | step ms | tokens/s/GPU | MFU (bf16 peak) | peak GiB | GPU idle "
          "| host syncs/step | same weights on all ranks | first step loss0 | tokens/sequence | ranks/sequence |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in results:
        if r.get("out_of_memory"):
            gpu = f"{r['gpu_gib']:.0f} GiB" if r["gpu_gib"] else "the device's"
            print(f"| {r['size']} | {r['tokens_per_batch']} | {r['layout']} | {r['kernels']} | out of memory "
                  f"({gpu}) | - | - | - | - | - | - | - | {r['seq_len']} | {r['context_parallel']} |")
            continue
        print(f"| {r['size']} | {r['tokens_per_batch']} | {r['layout']} | {r['kernels']} | {r['step_s'] * 1e3:.0f} "
              f"| {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['peak_gib']:.1f} | {r['gpu_idle']:.1%} "
              f"| {r['host_syncs']} | {r['same_weights_on_all_ranks']} | {r['first_step_loss'][0]:.4f} "
              f"| {r['seq_len']} | {r['context_parallel']} |")
    by = {(r["size"], r["layout"], r["seq_len"], r["kernels"]): r["tokens_per_s_per_gpu"] for r in results
          if not r.get("out_of_memory")}
    for (size, layout, seq_len, kernels), ours in by.items():
        if kernels == "triton" and (size, layout, seq_len, "torch") in by:
            print(f"{size} {layout} {seq_len}: triton / torch tokens/s = "
                  f"{ours / by[(size, layout, seq_len, 'torch')]:.2f}x")


if __name__ == "__main__":
    main()
