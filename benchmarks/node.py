"""`python -m benchmarks.node`: one 8-GPU node against fewer ranks doing the same work (issue 16).

    python -m benchmarks.node scaling ONE.jsonl MANY.jsonl
        the step bench's rows (`python -m eagle3.bench --json`) from 1 GPU and from torchrun on N: per
        layout and kernels, N-GPU tokens/s over 1-GPU tokens/s (the bar: 0.95 N, 7.6x on 8), beside the
        N-rank run's same-weights and host-sync columns
    python -m benchmarks.node extract [--ranks 1,8] [--shards 8] [--dir DIR] [--tiny]
        `extract.py` under torchrun for each rank count on the online bench's real-width Kimi-layout
        target (`online.prepare`), `--shards` shards of 65536 tokens: wall seconds (start-up included)
        and tokens/s, and each count's shards against the first count's: the same plan, how many
        files are bit-equal, the largest difference of every tensor, the greedy tokens that agree
    python -m benchmarks.node resume [--ranks 8] [--steps 40] [--every 5] [--kill-at 10] [--dir DIR] [--tiny]
        `train.py` on N ranks on the same shards (the online bench's toy Kimi-layout target and
        draft: a check of resume, not of speed): uninterrupted twice (the second gives the run-to-run
        floor, 0 where training is deterministic), and once killed with SIGKILL (torchrun and every
        worker: `processes.kill_tree`) as soon as checkpoint `--kill-at` is complete, then rerun with
        the same command; its final weights against the uninterrupted run's

`--tiny`: toy sizes on the CPU (gloo).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3 import train_state
from eagle3 import config as config_mod
from eagle3 import extraction
from benchmarks import online
from benchmarks.processes import kill_tree
from eagle3.bench.timing import free_memory, require_cuda
from eagle3.data.shards import read_manifest


def scaling(one: list[dict], many: list[dict]) -> list[dict]:
    """Per (layout, kernels) in both: the N-rank run's tokens/s over the 1-GPU run's, and its checks."""
    base = {(r["layout"], r["kernels"]): r for r in one if r["world"] == 1}
    rows = []
    for r in many:
        b = base.get((r["layout"], r["kernels"]))
        if b is None or r["world"] == 1:
            continue
        n, rate = r["world"], r["tokens_per_s_per_gpu"]
        ratio = n * rate / b["tokens_per_s_per_gpu"]
        rows.append({"layout": r["layout"], "kernels": r["kernels"], "world": n, "one_gpu": b["tokens_per_s_per_gpu"],
                     "per_gpu": rate, "node": n * rate, "scaling": ratio, "meets": ratio >= 0.95 * n,
                     "same_weights": r["same_weights_on_all_ranks"], "host_syncs": r["host_syncs"],
                     "host_syncs_one_gpu": b["host_syncs"]})
    return rows


def scaling_table(rows: list[dict]) -> str:
    return online.markdown(["layout", "kernels", "#GPUs", "#1-GPU tok/s", "#tok/s/GPU", "#node tok/s", "#scaling", ">= 0.95 N",
                     "same weights on all ranks", "#host syncs/step (N, 1)"],
                    [[r["layout"], r["kernels"], str(r["world"]), f"{r['one_gpu']:,.0f}", f"{r['per_gpu']:,.0f}",
                      f"{r['node']:,.0f}", f"{r['scaling']:.2f}x", str(r["meets"]), str(r["same_weights"]),
                      f"{r['host_syncs']}, {r['host_syncs_one_gpu']}"] for r in rows])


def compare_shards(a: Path, b: Path, device: torch.device) -> dict:
    """Two extractions of the same data: the same shard plan, how many files are bit-equal (their
    sha256), and over the others the largest absolute difference of each tensor and the share of
    greedy tokens that agree."""
    ma, mb = read_manifest(a), read_manifest(b)

    def plan(m):
        return [(s["file"], s["tokens"], s["sequences"], s["loss_tokens"]) for s in m["shards"]]

    differ = [s["file"] for s, t in zip(ma["shards"], mb["shards"]) if s["sha256"] != t["sha256"]]
    worst, agree, tokens = {}, 0, 0
    for name in differ:
        x, y = load_file(a / name, device=str(device)), load_file(b / name, device=str(device))
        for key in x:
            diff = float((x[key].float() - y[key].float()).abs().max()) if x[key].numel() else 0.0
            worst[key] = max(worst.get(key, 0.0), diff)
        agree += int((x["target_argmax"] == y["target_argmax"]).sum())
        tokens += x["target_argmax"].numel()
    return {"shards": len(ma["shards"]), "same_plan": ma["complete"] and mb["complete"] and plan(ma) == plan(mb),
            "bit_equal": len(ma["shards"]) - len(differ), "max_abs_diff": worst,
            "argmax_agreement": agree / tokens if tokens else 1.0}


def extract_ranks(root: Path, s: dict, ranks: list[int], shards: int, device: torch.device) -> list[dict]:
    """extract.py on each rank count over the same data; rows of wall time, tokens/s and the shards
    compared with the first count's."""
    sequences = shards * s["shard_tokens"] // s["draft"]["seq_len"]
    target, data, written = online.prepare(root, s, sequences, device)
    print(online.describe_written(target, written), flush=True)
    tokens, rows = sequences * s["draft"]["seq_len"], []
    for n in ranks:
        out = root / f"hidden-{n}"
        shutil.rmtree(out, ignore_errors=True)   # a fresh run: a rerun would keep the finished shards
        args = online.config_args(root, s, data, "offline", 1, device.type == "cpu", **{"extract.output_dir": out})
        wall = online.launch(n, ["extract.py", "--config", "config.toml", *args])[0]
        row = {"ranks": n, "shards": shards, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
               "steady_tokens_per_s": online.extraction_steady(out, n)}   # start-up left out
        if rows:
            row["speedup"] = rows[0]["wall_s"] / wall
            first = rows[0]["ranks"]
            row["against"] = {"ranks": first, **compare_shards(root / f"hidden-{first}", out, device)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def extract_table(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        c = r.get("against")
        same = ([str(c["same_plan"]), f"{c['bit_equal']} of {c['shards']}", f"{c['argmax_agreement']:.4%}",
                 f"{c['max_abs_diff'].get('aux_hidden', 0):.3g}, {c['max_abs_diff'].get('final_hidden', 0):.3g}"]
                if c else ["(reference)", "", "", ""])
        steady = f"{r['steady_tokens_per_s']:,.0f}" if r.get("steady_tokens_per_s") else "-"
        cells.append([str(r["ranks"]), str(r["shards"]), f"{r['tokens']:,}", f"{r['wall_s']:.0f}",
                      f"{r['tokens_per_s']:,.0f}", steady, f"{r.get('speedup', 1.0):.2f}x", *same])
    return online.markdown(["#ranks", "#shards", "#tokens", "#wall s", "#tokens/s (wall)", "#steady tokens/s",
                     "#speed-up (wall)", "same plan", "#bit-equal shards", "#greedy tokens agreeing",
                     "largest difference (aux, final)"], cells)


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return train_state.load_weights(train_state.latest(output_dir))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def kill_when(cmd: list[str], marker: Path, log: Path) -> None:
    """Run `cmd` (its output to `log`) and SIGKILL it with all its workers once `marker` exists."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=online.ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + online.PHASE_TIMEOUT
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        kill_tree(proc)


def kill_resume(root: Path, s: dict, ranks: int, steps: int, every: int, kill_at: int, device: torch.device) -> dict:
    """The same training on `ranks` ranks uninterrupted twice, and killed at checkpoint `kill_at`
    then resumed: the final weights compared."""
    sequences = steps * ranks * s["draft"]["seqs"]
    _, data, _ = online.prepare(root, s, sequences, device)
    cpu = device.type == "cpu"

    def overrides(name: str) -> list[str]:
        return online.config_args(root, s, data, "offline", steps, cpu, **{
            "train.output_dir": root / name, "train.resume": "auto", "train.checkpoint_every": every})

    def args(name: str) -> list[str]:
        return ["train.py", "--config", "config.toml", *overrides(name)]

    shutil.rmtree(online.run_dir(root, "offline") / "hidden", ignore_errors=True)
    extraction.run(config_mod.load(None, overrides("straight")))   # the shards, once, in this process
    free_memory()
    for name in ("straight", "again", "killed"):
        shutil.rmtree(root / name, ignore_errors=True)
    walls = {name: online.launch(ranks, args(name))[0] for name in ("straight", "again")}
    kill_when(online.torchrun(ranks, args("killed")), train_state.step_dir(root / "killed", kill_at),
              root / "killed.log")
    stopped = train_state.latest(root / "killed")
    if stopped is None or stopped == train_state.step_dir(root / "killed", steps):
        raise RuntimeError(f"the run to kill was not interrupted (newest checkpoint: {stopped})")
    walls["resumed"], resumed = online.launch(ranks, args("killed"), capture=True)
    straight, again, killed = (final_weights(root / name) for name in ("straight", "again", "killed"))
    return {"ranks": ranks, "steps": steps, "killed_after": stopped.name, "resumed": "resumed from" in resumed.stderr,
            "bit_equal": all(torch.equal(straight[k], killed[k]) for k in straight),
            "max_abs_diff": max_abs_diff(straight, killed), "floor_max_abs_diff": max_abs_diff(straight, again),
            "wall_s": walls}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.node", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("scaling", help="N-GPU over 1-GPU tokens/s from the step bench's --json files")
    p.add_argument("one")
    p.add_argument("many")
    for name, help in (("extract", "extract.py on each rank count: tokens/s and the same shards"),
                       ("resume", "a run killed on N ranks, resumed, against uninterrupted ones")):
        p = sub.add_parser(name, help=help)
        p.add_argument("--dir", default=None, help="work directory (the target is kept and reused; default: temporary)")
        p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (gloo)")
        p.add_argument("--json", default=None, help="append the results here as JSON lines")
    sub.choices["extract"].add_argument("--ranks", default="1,8", help="comma list of rank counts; the first: the reference")
    sub.choices["extract"].add_argument("--shards", type=int, default=8)
    for flag, default in (("--ranks", 8), ("--steps", 40), ("--every", 5), ("--kill-at", 10)):
        sub.choices["resume"].add_argument(flag, type=int, default=default)
    args = parser.parse_args(argv)
    if args.command == "scaling":
        one, many = ([json.loads(line) for line in Path(f).read_text().splitlines()] for f in (args.one, args.many))
        print(scaling_table(scaling(one, many)))
        return
    if not (args.tiny or args.command == "resume"):
        require_cuda("benchmarks.node", "; --tiny runs it at toy size on the CPU")
    s = online.TINY if args.tiny or args.command == "resume" else online.KIMI
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    root = Path(args.dir or tempfile.mkdtemp(prefix="eagle3-node-"))
    if args.command == "extract":
        results = extract_ranks(root, s, [int(n) for n in args.ranks.split(",")], args.shards, device)
        print(extract_table(results))
    else:
        results = [kill_resume(root, s, args.ranks, args.steps, args.every, args.kill_at, device)]
        print(json.dumps(results[0]), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
