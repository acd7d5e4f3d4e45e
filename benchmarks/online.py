"""`python -m benchmarks.online`: online training's target placements against offline extraction
then training, for the same tokens, on a real-width 4-layer Kimi-layout target with the Kimi-size draft.

The target (layer 0 dense, layers 1-3 MoE: MLA, 384 int4 experts of 2048, top-8 + 1 shared expert,
hidden 7168, vocab 163840: `moe.KIMI_MODEL`) is written to `--dir` once as a real checkpoint
(Kimi-K2.5's wrapper config, `language_model.` prefix, a packed/scale/shape triple per int4 expert
linear, one safetensors file per layer plus an index): random weights made on the GPU by
`moe.GeneratedKimi`, unstacked into the checkpoint's names, reused by the next run of the same shape
(about 35 GB; the seconds and GB/s of writing it are printed). The data are pre-tokenized JSON lines
of 4096-token sequences (a 512-token prompt, then the reply: layout (a) of the step bench) drawn from
32000 ids; the target's head rows of all other ids are zero, so its greedy token is always in the
draft vocabulary and every row is trained, as on real data (random head rows would leave ~80% of the
rows without a target: a far cheaper draft step than a real run's).

Each placement trains the step bench's Kimi-size draft (64/8 heads of 128, intermediate 18432, draft
vocab 32000) for `--steps` optimizer steps of one 16384-token micro-batch per rank, on the same
sequences, under `torchrun --standalone --nproc_per_node RANKS` launched by this bench (one launch per
phase; each rank runs `--worker`, which also records its time and peak memory): `offline` extracts
the shards (extraction's code, shard i on rank i mod N) and then trains on them; `stream`, `resident`
and `staged` train with `train.source = "online"` and that `train.online_target`.

Figures, all ranks together: steady rates are medians over the training log's per-step windows after
the first (compilation and first loads excluded): online the log's `target_tokens_per_s`,
`draft_tokens_per_s` and `tokens_per_s` (end to end); offline the extraction's steady rate from its
shards' write times (each rank's shards after its first: `extraction_steady`), the training's `tokens_per_s`, and end to end
1 / (1/extraction + 1/training), the two run one after the other on the same GPUs. Wall: the
placement's launches, process start-up, compilation and the final checkpoint included. Peak: the
highest `torch.cuda.max_memory_allocated` of any rank in any phase. Disk: the bytes the placement left
(shards, the final checkpoint; no export). Cost: GPU-seconds per 1k tokens at the steady end-to-end rate.

    python -m benchmarks.online [--placements offline,stream,resident,staged] [--ranks 2] [--steps 8]
                                  [--dir DIR] [--json FILE]
    python -m benchmarks.online --table FILE    # the markdown table of the rows a --json FILE holds
    python -m benchmarks.online --tiny          # the same at toy sizes on the CPU (gloo)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks import moe
from eagle3 import config as config_mod
from eagle3 import extraction, training
from eagle3.bench import step
from eagle3.bench.timing import describe_device, free_memory, require_cuda
from eagle3.data.shards import read_manifest
from eagle3.files import atomic_write_text
from eagle3.models import tiny
from eagle3.models.weights import read_config

from benchmarks.processes import kill_tree

ROOT = Path(__file__).resolve().parents[1]   # where extract.py, train.py and config.toml are
PLACEMENTS = ("offline", "stream", "resident", "staged")
KIMI = dict(model=moe.KIMI_MODEL, layers=4, draft=step.SIZES["kimi"], shard_tokens=65536, steps=8)
# step.SIZES["tiny"]'s draft (hidden 64) and vocabulary on moe.TINY's target; shards of one micro-batch, so
# that every rank extracts some
TINY = dict(model=dict(moe.TINY["model"], vocab=step.SIZES["tiny"]["vocab"]), layers=4, draft=step.SIZES["tiny"], shard_tokens=512,
            steps=3)
PREFIX = "language_model.model."   # Kimi-K2.5's text tensors
STAMP = "bench-target.json"        # written last: the target is complete, and of which shape


def data_ids(s: dict) -> torch.Tensor:
    """The token ids the data use (draft_vocab of them): the draft vocabulary, and the target's head rows kept."""
    return torch.randperm(s["model"]["vocab"], generator=torch.Generator().manual_seed(1))[:s["draft"]["draft_vocab"]]


def layer_tensors(model: moe.GeneratedKimi, i: int) -> dict[str, torch.Tensor]:
    """Layer i made on the device in the layout `DeepseekTarget.load_layer` returns, back in the
    checkpoint's names on the host: the stacked experts split into one int4 triple per linear."""
    w = {k: v.cpu() for k, v in model.load_layer(i).items()}
    p = f"{PREFIX}layers.{i}."
    out = {p + ("mlp.gate.e_score_correction_bias" if k == "mlp.gate.bias" else k + ".weight"): v
           for k, v in w.items() if not k.startswith("experts.")}
    if "experts.gate_up.weight_packed" not in w:
        return out
    for key, projs in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
        packed, scale = w[f"experts.{key}.weight_packed"], w[f"experts.{key}.weight_scale"]
        rows = packed.shape[1] // len(projs)   # load_layer stacks gate rows before up rows
        for e in range(packed.shape[0]):
            for j, proj in enumerate(projs):
                base, part = f"{p}mlp.experts.{e}.{proj}.", slice(j * rows, (j + 1) * rows)
                out[base + "weight_packed"], out[base + "weight_scale"] = packed[e, part], scale[e, part]
                out[base + "weight_shape"] = torch.tensor([rows, packed.shape[2] * 8], dtype=torch.int32)
    return out


def outer_tensors(ckpt: moe.GeneratedCheckpoint, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Embedding, final norm and head; the head's rows outside `ids` zero (its greedy token stays in them)."""
    head = ckpt.get("lm_head.weight")
    outside = torch.ones(head.shape[0], dtype=torch.bool, device=head.device)
    outside[ids.to(head.device)] = False
    head[outside] = 0
    return {PREFIX + "embed_tokens.weight": ckpt.get("embed_tokens.weight").cpu(),
            PREFIX + "norm.weight": ckpt.get("norm.weight").cpu(), "language_model.lm_head.weight": head.cpu()}


def write_target(out: Path, s: dict, device: torch.device) -> dict:
    """The Kimi-layout checkpoint of shape `s` in `out`, unless one of that shape is there:
    {"reused"} or {"bytes", "seconds"} of writing it."""
    config = tiny.kimi_k25_config(layers=s["layers"], **s["model"])
    stamp = {"config": config, "draft_vocab": s["draft"]["draft_vocab"]}   # what the weights depend on
    if (out / STAMP).exists() and json.loads((out / STAMP).read_text()) == stamp:
        return {"reused": True}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    ckpt = moe.GeneratedCheckpoint(read_config(out / "config.json"), device)
    model = moe.GeneratedKimi(ckpt, device, torch.bfloat16)
    files = [lambda i=i: layer_tensors(model, i) for i in range(s["layers"])]
    files.append(lambda: outer_tensors(ckpt, data_ids(s)))
    weight_map, written, start = {}, 0, time.perf_counter()
    for n, make in enumerate(files):
        name = f"model-{n + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = make()
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        written += (out / name).stat().st_size
        del tensors   # before the next layer is made: host memory for one layer at a time
    free_memory()   # the workers need the GPU this process generated on
    index = {"metadata": {"total_size": written}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / STAMP).write_text(json.dumps(stamp))
    return {"reused": False, "bytes": written, "seconds": time.perf_counter() - start}


def write_data(path: Path, s: dict, sequences: int) -> None:
    """`sequences` pre-tokenized lines of the draft shape's seq_len (layout a's mask), ids from
    `data_ids` (kept when the file is there: its name holds the count and length)."""
    if path.exists():
        return
    d, g, ids = s["draft"], torch.Generator().manual_seed(2), data_ids(s)
    lines = []
    for _ in range(sequences):
        x = ids[torch.randint(0, len(ids), (d["seq_len"],), generator=g)]
        lines.append(json.dumps({"input_ids": x.tolist(), "loss_mask": step.loss_mask("a", d, g).tolist()}) + "\n")
    atomic_write_text(path, "".join(lines))


def data_path(root: Path, s: dict, sequences: int) -> Path:
    return root / f"data-{sequences}x{s['draft']['seq_len']}.jsonl"


def prepare(root: Path, s: dict, sequences: int, device: torch.device) -> tuple[Path, Path, dict]:
    """(target dir, data file, what writing the target took) under `root`, made or reused."""
    data = data_path(root, s, sequences)
    root.mkdir(parents=True, exist_ok=True)
    write_data(data, s, sequences)
    return root / "target", data, write_target(root / "target", s, device)


def describe_written(target: Path, written: dict) -> str:
    if written["reused"]:
        return f"target {target}: reused"
    gb, seconds = written["bytes"] / 1e9, written["seconds"]
    return f"target {target}: {gb:.1f} GB written in {seconds:.0f} s ({gb / seconds:.2f} GB/s)"


def torchrun(ranks: int, args: list[str]) -> list[str]:
    """The command running `args` (a script, or -m module, and its arguments) on `ranks` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *args]


# one phase's limit: a hung rank (a lost NCCL peer) must not hold the GPUs for the parts after it
PHASE_TIMEOUT = 900


def launch(ranks: int, args: list[str], capture: bool = False) -> tuple[float, subprocess.CompletedProcess]:
    """(seconds, result) of `torchrun(ranks, args)` from the repository root (`capture`: its output as
    text); fails naming the command, and past PHASE_TIMEOUT kills it with its workers."""
    cmd = torchrun(ranks, args)
    start = time.perf_counter()
    pipe = subprocess.PIPE if capture else None
    with subprocess.Popen(cmd, cwd=ROOT, stdout=pipe, stderr=pipe, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=PHASE_TIMEOUT)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise RuntimeError(f"timed out after {PHASE_TIMEOUT} s (killed with its workers): {' '.join(cmd)}")
    if proc.returncode:
        raise RuntimeError(f"rc {proc.returncode}: {' '.join(cmd)}" + (f"\n{err[-3000:]}" if err else ""))
    return time.perf_counter() - start, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_dir(root: Path, placement: str) -> Path:
    return root / "runs" / placement


def config_args(root: Path, s: dict, data: Path, placement: str, steps: int, cpu: bool, **extra) -> list[str]:
    """The config of `placement`'s phases as command-line overrides: the draft shape of the step bench,
    one checkpoint at the end, a log line per step (the rates' windows), no held-out split, no export;
    `extra` ({"train.resume": "auto"}) changes or adds keys."""
    d, out = s["draft"], run_dir(root, placement)
    cfg = {"target.path": root / "target", "data.path": data, "target.aux_layer_ids": "[1, 2, 3]",
           "extract.output_dir": out / "hidden", "debug.shard_tokens": s["shard_tokens"],
           "train.output_dir": out / "train", "train.batch_tokens": d["seqs"] * d["seq_len"],
           "data.max_seq_len": d["seqs"] * d["seq_len"],   # what one micro-batch trains (checked at start-up)
           "train.max_steps": steps, "train.checkpoint_every": steps, "debug.log_every": 1,
           "train.eval_fraction": 0, "train.resume": "never", "export.formats": "[]",
           "vocab.draft_vocab_size": d["draft_vocab"], "draft.num_attention_heads": d["heads"],
           "draft.num_key_value_heads": d["kv_heads"], "draft.head_dim": d["head_dim"],
           "draft.intermediate_size": d["inter"]}
    if placement != "offline":
        cfg.update({"train.source": "online", "train.online_target": placement})
    if cpu:
        cfg.update({"debug.train_device": "cpu", "debug.extract_device": "cpu"})
    cfg.update(extra)
    return [x for k, v in cfg.items() for x in (f"--{k}", str(v))]


def work(root: Path, s: dict, data: Path, placement: str, phase: str, steps: int, cpu: bool) -> None:
    """One rank of a placement's phase (under torchrun): run it, then record its seconds and peak memory."""
    cfg = config_mod.load(None, config_args(root, s, data, placement, steps, cpu))
    start = time.perf_counter()
    (extraction if phase == "extract" else training).run(cfg)
    seconds = time.perf_counter() - start
    rank, cuda = int(os.environ.get("RANK", "0")), torch.cuda.is_initialized()
    report = {"rank": rank, "seconds": seconds,
              "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
              "reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else None}
    (run_dir(root, placement) / f"{phase}-rank{rank}.json").write_text(json.dumps(report))


def steady(values: list) -> float | None:
    """Median of the per-step windows after the first (compilation, first loads); the one if alone."""
    values = [v for v in values if v is not None]
    return statistics.median(values[1:] if len(values) > 1 else values) if values else None


def extraction_steady(hidden: Path, ranks: int) -> float | None:
    """The extraction's steady tokens/s, all ranks together, from its shards' write times: per rank
    (shard i is rank i % ranks's) the tokens of its shards after its first over the time from its
    first to its last, so start-up, loading the embedding and first compiles are left out as the
    online rates leave out their first window. None when no rank wrote two shards."""
    shards = read_manifest(hidden)["shards"]
    total, measured = 0.0, False
    for r in range(ranks):
        mine = shards[r::ranks]
        if len(mine) > 1:
            times = [(hidden / e["file"]).stat().st_mtime for e in mine]
            total += sum(e["tokens"] for e in mine[1:]) / max(times[-1] - times[0], 1e-9)
            measured = True
    return total if measured else None


def rates(log: list[dict], reports: dict, tokens: int, hidden: Path, ranks: int) -> tuple[float, float, float]:
    """Steady (target, draft, end-to-end) tokens/s of all ranks: online from the training log; offline
    the extraction's steady rate (its tokens over its slowest rank's seconds where no rank wrote two
    shards), then training on its shards, on the same GPUs."""
    e2e = steady([r["tokens_per_s"] for r in log])
    if "extract" not in reports:
        return steady([r["target_tokens_per_s"] for r in log]), steady([r["draft_tokens_per_s"] for r in log]), e2e
    target = extraction_steady(hidden, ranks) or tokens / max(r["seconds"] for r in reports["extract"])
    return target, e2e, 1 / (1 / target + 1 / e2e)


def run_placement(root: Path, s: dict, data: Path, placement: str, args: argparse.Namespace) -> dict:
    out = run_dir(root, placement)
    shutil.rmtree(out, ignore_errors=True)   # a fresh run: extraction would resume from old shards
    out.mkdir(parents=True)
    phases = ("extract", "train") if placement == "offline" else ("train",)
    walls = {}
    for phase in phases:
        worker = ["-m", "benchmarks.online", "--worker", f"{placement}:{phase}", "--dir", str(root),
                  "--ranks", str(args.ranks), "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
        walls[phase] = launch(args.ranks, worker)[0]
    reports = {phase: [json.loads(p.read_text()) for p in sorted(out.glob(f"{phase}-rank*.json"))] for phase in phases}
    log = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    log = [r for r in log if r["split"] == "train"]
    tokens = args.steps * args.ranks * s["draft"]["seqs"] * s["draft"]["seq_len"]   # every sequence of the data once
    target, draft, e2e = rates(log, reports, tokens, out / "hidden", args.ranks)
    peaks = [r["peak_gib"] for rs in reports.values() for r in rs if r["peak_gib"] is not None]
    disk = sum(f.stat().st_size for sub in ("hidden", "train") for f in (out / sub).rglob("*") if f.is_file())
    row = {"placement": placement, "ranks": args.ranks, "tokens": tokens, "steps": args.steps,
           "wall_s": sum(walls.values()), "phase_wall_s": walls, "target_tokens_per_s": target,
           "draft_tokens_per_s": draft, "tokens_per_s": e2e, "wall_tokens_per_s": tokens / sum(walls.values()),
           "peak_gib": max(peaks) if peaks else None, "reports": reports, "disk_bytes": disk,
           "last_loss0": log[-1]["loss"][0],   # the same tokens and seed: about equal for every placement
           "gpu_s_per_1k_tokens": args.ranks * 1000 / e2e, "shape": "tiny" if args.tiny else "kimi",
           "device": describe_device()}
    if not args.keep:
        shutil.rmtree(out / "hidden", ignore_errors=True)
        shutil.rmtree(out / "train", ignore_errors=True)
    return row


def _num(x, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(columns: list[str], cells: list[list[str]]) -> str:
    """A markdown table; a column whose name starts with "#" is right-aligned (the "#" dropped)."""
    head = [c.lstrip("#") for c in columns]
    rule = ["---:" if c.startswith("#") else "---" for c in columns]
    return "\n".join("| " + " | ".join(row) + " |" for row in [head, rule, *cells])


def table(rows: list[dict]) -> str:
    return markdown(["placement", "#ranks", "#tokens", "#wall s", "#target tok/s", "#draft tok/s", "#end-to-end tok/s",
                     "#tok/s over wall", "#peak GiB/GPU", "#disk GB written", "#GPU-s / 1k tokens", "#last step loss0"],
                    [[r["placement"], str(r["ranks"]), f"{r['tokens']:,}", f"{r['wall_s']:.0f}",
                      _num(r["target_tokens_per_s"]), _num(r["draft_tokens_per_s"]), _num(r["tokens_per_s"]),
                      _num(r["wall_tokens_per_s"]), _num(r["peak_gib"], ".1f"), f"{r['disk_bytes'] / 1e9:.3g}",
                      _num(r["gpu_s_per_1k_tokens"], ".3f"), f"{r['last_loss0']:.4f}"] for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.online", description=__doc__.split("\n")[0])
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help="comma list of " + ", ".join(PLACEMENTS))
    parser.add_argument("--ranks", type=int, default=2, help="ranks (GPUs) of every placement: torchrun --nproc_per_node")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps, one micro-batch per rank each: the tokens (default 8, --tiny 3)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (gloo)")
    parser.add_argument("--dir", default=None, help="where the target, data and runs go (the target and data are "
                        "kept and reused by the next run with the same --dir; default: a temporary directory)")
    parser.add_argument("--json", default=None, help="append each placement's row here as a JSON line")
    parser.add_argument("--table", default=None, metavar="FILE", help="print the table of the rows in FILE and exit")
    parser.add_argument("--keep", action="store_true", help="keep each placement's shards and checkpoint")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # PLACEMENT:PHASE, one rank
    args = parser.parse_args(argv)
    if args.table:
        print(table([json.loads(line) for line in Path(args.table).read_text().splitlines()]))
        return
    if not args.tiny and not args.worker:
        require_cuda("benchmarks.online", " (a real-width Kimi-layout target); --tiny runs it at toy size on the CPU")
    s = TINY if args.tiny else KIMI
    args.steps = args.steps or s["steps"]
    root = Path(args.dir or tempfile.mkdtemp(prefix="eagle3-online-"))
    sequences = args.steps * args.ranks * s["draft"]["seqs"]   # every micro-batch read once
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.worker:
        placement, phase = args.worker.split(":")
        work(root, s, data_path(root, s, sequences), placement, phase, args.steps, device.type == "cpu")
        return
    print(describe_device(), flush=True)
    target, data, written = prepare(root, s, sequences, device)
    print(describe_written(target, written), flush=True)
    rows = []
    for placement in args.placements.split(","):
        rows.append(run_placement(root, s, data, placement, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "reports"}), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print(f"\n{args.ranks} rank(s), {rows[0]['tokens']:,} tokens each, micro-batch "
          f"{s['draft']['seqs']} x {s['draft']['seq_len']} tokens per rank\n" + table(rows))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
