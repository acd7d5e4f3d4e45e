"""`python -m benchmarks.step_lab`: the step bench (`python -m eagle3.bench`) with the lab's options.

    python -m benchmarks.step_lab [--train-head] [--prompt-rows] [--profile-dir DIR] --sizes kimi --layouts a ...

--train-head: a random lm_head, trained (default: the target's rows, frozen, ours and the peer's);
--prompt-rows: prompt rows trained too (train.prompt_rows, our default; the bench trains assistant rows only,
the peer's workload); --profile-dir: each run's GPU kernel table and its longest idle gaps. Every other option
is the step bench's; so is torchrun."""
from __future__ import annotations

import argparse
from pathlib import Path

from eagle3.bench import step
from eagle3.files import atomic_write_text


def overrides(train_head: bool, prompt_rows: bool) -> list[str]:
    """The config arguments of the lab's options, after the bench's own."""
    head = ["--experimental.lm_head_init", "random", "--experimental.freeze_lm_head", "false"]
    return head * train_head + ["--train.prompt_rows", "true"] * prompt_rows


def profile_tables(directory: Path):
    """A `report` for the bench: per run, the kernels by GPU time (profile-LABEL.kernels.tsv) and the profiler's
    tables with the 25 longest idle gaps between busy stretches (profile-LABEL.txt)."""
    def report(prof, merged: list, wall: float, label: str) -> None:
        table = directory / f"profile-{label}.txt"
        table.parent.mkdir(parents=True, exist_ok=True)
        averages = prof.key_averages()
        kernels = sorted((e for e in averages if e.device_type.name == "CUDA"   # kernels, not the optimizer's
                          and not getattr(e, "is_user_annotation", False)),        # annotation of their span
                         key=lambda e: -e.self_device_time_total)
        atomic_write_text(table.with_suffix(".kernels.tsv"), "ms\tcalls\tkernel\n" + "".join(
            f"{e.self_device_time_total / 1e3:.3f}\t{e.count}\t{e.key}\n" for e in kernels))
        gaps = sorted(((n[0] - m[1], m[3], n[2]) for m, n in zip(merged, merged[1:])), reverse=True)[:25]
        busy = sum(b - a for a, b, _, _ in merged)
        table.write_text(averages.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=90)
                         + averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90)
                         + f"\nwall {wall * 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms; longest gaps:\n"
                         + "".join(f"{gap / 1e3:8.2f} ms  after {before[:70]}  before {after[:70]}\n"
                                   for gap, before, after in gaps))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_lab", description=__doc__.split("\n")[0])
    parser.add_argument("--train-head", action="store_true", help="a random lm_head, trained")
    parser.add_argument("--prompt-rows", action="store_true", help="train prompt rows too")
    parser.add_argument("--profile-dir", type=Path, default=None, help="write each run's GPU kernel table here")
    own, rest = parser.parse_known_args(argv)
    step.main(rest, overrides(own.train_head, own.prompt_rows), own.profile_dir and profile_tables(own.profile_dir))


if __name__ == "__main__":
    main()
