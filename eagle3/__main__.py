"""`python -m eagle3 COMMAND` (the `eagle3` console script): every stage from one command line. `train` and
`extract` run what train.py and extract.py (kept for torchrun) run, `bench` what `python -m eagle3.bench` runs."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3 import config as config_mod
from eagle3.errors import Eagle3Error
from eagle3.models.inspect import inspect

# the commands with a parser of their own, given the rest of the command line as it is
FORWARDED = {"extract": "extract the target's hidden states into shards (what extract.py runs)",
             "train": "train an EAGLE-3 draft with training-time test (what train.py runs)",
             "bench": "the training-step and kernel benchmarks (python -m eagle3.bench)"}


def forward(command: str, argv: list[str]) -> None:
    if command == "bench":
        from eagle3.bench.__main__ import main as bench
        return bench(argv)
    from eagle3 import extraction, training
    (training.main if command == "train" else extraction.main)(argv, prog=f"python -m eagle3 {command}")


def demo(args, overrides: list[str]) -> None:
    from eagle3.demo import run
    run(args, overrides)


SUMMARY_KEYS = ("step", "accept_len", "accept_len_decoding", "acc", "cond_acc", "alpha", "alpha_greedy",
                "temperature", "top_p", "draft_sampling", "seeds", "real_accept_len", "real_accept_len_sd",
                "accept_len_per_request", "accept_len_per_request_sd", "per_position_acceptance", "rounds",
                "prompts", "new_tokens", "mismatches", "k", "wall_seconds")
SHORTHANDS = ("prompts", "max_new_tokens", "k", "temperature", "top_p", "draft_sampling", "seeds")


def evaluate_command(args, overrides: list[str]) -> None:
    """--prompts, --k and the other SHORTHANDS set the [evaluate] keys (and win over overrides)."""
    from eagle3.evaluate import run
    from eagle3.files import strict_json
    from eagle3.train_state import STATE
    overrides = overrides + [x for key in SHORTHANDS if (value := getattr(args, key)) is not None
                             for x in (f"--evaluate.{key}", value)]
    ours = (Path(args.checkpoint) / STATE).exists()
    cfg = checkpoint_config(args, overrides) if ours else config_mod.load(args.config or "config.toml", overrides)
    report, written = run(cfg, args.checkpoint, args.out)
    summary = {k: report[k] for k in SUMMARY_KEYS if k in report}
    for key, figure in (("accept_len_by_depth", "real_accept_len"), ("rounds_by_depth", "rounds")):
        if "by_depth" in report:
            summary[key] = {b["label"]: b[figure] for b in report["by_depth"]}
    print(strict_json(summary))
    inside = " (inside the checkpoint: deleted with it by checkpoint rotation, train.keep_checkpoints; --out FILE " \
             f"keeps {'them' if len(written) > 1 else 'it'} elsewhere)" if ours and args.out is None else ""
    print(f"wrote {' and '.join(map(str, written))}{inside}")


def export_command(args, overrides: list[str]) -> None:
    from eagle3.export import export_all, serving_commands
    from eagle3.train_state import read_state
    cfg = checkpoint_config(args, overrides)
    written = export_all(args.checkpoint, args.out_dir, cfg)
    for fmt, path in written.items():
        print(f"exported {fmt} draft: {path}")
    for line in serving_commands(read_state(args.checkpoint), cfg, written) if written else ():
        print(line)


def checkpoint_config(args, overrides: list[str]) -> config_mod.Config:
    """--config FILE if given, else the config our checkpoint was trained with (its state.json); overrides on top."""
    from eagle3.train_state import read_state
    if args.config:
        return config_mod.load(args.config, overrides)
    return config_mod.override(config_mod.from_dict(read_state(args.checkpoint)["config"], args.checkpoint), overrides)


def config_command(args, overrides: list[str]) -> None:
    cfg, name = config_mod.load(args.config, overrides), Path(args.config).name if args.config else "set"
    print(config_mod.markdown_table(cfg, name) if args.markdown else config_mod.reference(cfg, name, args.all), end="")


def generate_command(args, overrides: list[str]) -> None:
    from eagle3.generate import run
    cfg = config_mod.load(args.config, overrides)
    config_mod.require_inputs(cfg, "generate")
    run(cfg)


COMMANDS = {"inspect": lambda args, _: print(json.dumps(inspect(args.target), indent=2)), "export": export_command,
            "evaluate": evaluate_command, "generate": generate_command, "demo": demo, "config": config_command}


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="python -m eagle3", epilog="Each command: python -m eagle3 COMMAND "
                                     "--help. Under torchrun: train.py and extract.py, with the same arguments.")
    sub = parser.add_subparsers(dest="command", required=True)
    subs = {}

    def add(name: str, text: str, config: str | None = "TOML config file (default: config.toml)",
            default: str | None = "config.toml") -> argparse.ArgumentParser:
        """`config`: the help of --config; None for a command that reads no config."""
        subs[name] = sub.add_parser(name, help=text, description=text,
                                    epilog=config_mod.OVERRIDES_HELP if config else None)
        if config:
            subs[name].add_argument("--config", default=default, help=config)
        return subs[name]

    add("inspect", "resolve a target checkpoint and print what the pipeline will use (one JSON object)",
        None).add_argument("target", help="target directory (or its config.json)")
    for name, text in FORWARDED.items():
        sub.add_parser(name, help=text, add_help=False)
    p = add("export", "export a training checkpoint for the engines in export.formats (vllm, sglang; e.g. "
                      "--export.formats '[\"vllm\"]')",
            "TOML config file (default: the checkpoint's own config, kept in its state.json)", None)
    p.add_argument("checkpoint", help="checkpoint directory, e.g. runs/demo/train/checkpoints/step-00000200")
    p.add_argument("out_dir", help="where to write <format>/config.json and model.safetensors")
    p = add("evaluate", "real speculative decoding on prompts (--prompts) and, for our checkpoints, the "
                        "held-out acceptance-length estimate",
            "TOML config file (default: for our checkpoints their own config, kept in their state.json: the "
            "target and data they were trained on; for a vLLM-layout draft config.toml)", None)
    p.add_argument("checkpoint", help="one of our checkpoints or a speculators/vLLM EAGLE-3 draft directory")
    for flag, text in (("--prompts", "JSON lines of prompts"), ("--max-new-tokens", "tokens per prompt"),
                       ("--k", "draft tokens per round"), ("--temperature", "serving temperature, 0 = greedy"),
                       ("--top-p", "serving top_p"), ("--draft-sampling", "greedy | probabilistic"),
                       ("--seeds", "seeds at temperature > 0")):
        p.add_argument(flag, help=f"{text} (evaluate.{flag[2:].replace('-', '_')})")
    p.add_argument("--out", help="where to write the report (default: eval.json in the draft directory)")
    add("generate", "regenerate the training replies with the target itself ([generate] keys)")
    p = add("demo", "tiny target -> generate -> extract -> train -> export -> evaluate, on the CPU")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--thinking", action="store_true", help="chat lines with reasoning (some long) and tool calls "
                      "(Kimi-K2.5's template) trained as written; data and runs beside the plain demo's, with -thinking")
    kind.add_argument("--vision", action="store_true", help="the tiny Kimi-K2.5 with a tiny vision tower, "
                      "conversations about images drawn on the fly; acceptance on image prompts beside text prompts "
                      "(the vision extra)")
    kind.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct (the `real` extra's GGUF), served by "
                      "llama.cpp's server, end to end with each stage timed; in demo/smollm2* and runs/demo-real")
    p = add("config", "the config keys with their type, default and meaning",
            "a TOML config file: its values are shown where they are not the defaults", None)
    p.add_argument("--all", action="store_true", help="also the [experimental] and [debug] keys")
    p.add_argument("--markdown", action="store_true", help="every key as docs/config.md's table")
    return parser, subs


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in FORWARDED:
        return forward(argv[0], argv[1:])
    parser, subs = _parser()
    overrides, argv = config_mod.split_overrides(argv)
    args, rest = parser.parse_known_args(argv)
    rest += overrides
    if args.command == "inspect" and rest:   # it takes no config: nothing to override
        subs[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    config_mod.check_overrides(subs[args.command], rest)
    try:
        COMMANDS[args.command](args, rest)
    except Eagle3Error as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        config_mod.interrupted(f"python -m eagle3 {args.command}", resumes=args.command in ("demo", "generate"))


if __name__ == "__main__":
    main()
