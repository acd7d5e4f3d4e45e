"""`python -m eagle3 {inspect,export,evaluate,generate,demo}`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3.models.checkpoint import Checkpoint, TargetError, inspect


def demo(args) -> None:
    """Make the tiny demo target and data if absent, then extract, train and export."""
    from eagle3 import config as config_mod
    from eagle3 import extraction, training
    from eagle3.models import tiny
    cfg = config_mod.load(args.config, args.overrides)
    if not (Path(cfg.target.path) / "config.json").exists():
        tiny.make_demo_target(cfg.target.path)
        print(f"demo: wrote a tiny random target to {cfg.target.path}")
    if not Path(cfg.data.path).exists():
        vocab = Checkpoint(cfg.target.path).config.vocab_size
        tiny.make_token_data(cfg.data.path, vocab=vocab, sequences=256)
        print(f"demo: wrote synthetic training data to {cfg.data.path}")
    extraction.run(cfg)
    training.run(cfg)


SUMMARY_KEYS = ("step", "accept_len", "accept_len_decoding", "acc", "cond_acc", "real_accept_len",
                "per_position_acceptance", "rounds", "prompts", "new_tokens", "mismatches", "k", "wall_seconds")


def evaluate_command(args, overrides: list[str]) -> None:
    """--prompts / --max-new-tokens / --k are shorthands for the [evaluate] keys (they win)."""
    from eagle3 import config as config_mod
    from eagle3.evaluate import run
    shorthands = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "k": args.k}
    overrides = overrides + [x for key, value in shorthands.items() if value is not None
                             for x in (f"--evaluate.{key}", value)]
    from eagle3.files import strict_json
    report, out = run(config_mod.load(args.config, overrides), args.checkpoint, args.out)
    print(strict_json({k: report[k] for k in SUMMARY_KEYS if k in report}))
    print(f"wrote {out}")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from eagle3.config import OVERRIDES_HELP
    parser = argparse.ArgumentParser(prog="python -m eagle3", epilog="Extraction and training: python extract.py "
                                     "--help, python train.py --help. Each command: python -m eagle3 COMMAND --help.")
    sub = parser.add_subparsers(dest="command", required=True)
    subs = {}

    def add(name: str, text: str, overrides: bool) -> argparse.ArgumentParser:
        subs[name] = sub.add_parser(name, help=text, description=text, epilog=OVERRIDES_HELP if overrides else None)
        if overrides:
            subs[name].add_argument("--config", default="config.toml", help="TOML config file (default: config.toml)")
        return subs[name]

    p = add("inspect", "resolve a target checkpoint and print what the pipeline will use (one JSON object)", False)
    p.add_argument("target", help="target directory (or its config.json)")
    p = add("export", "export a training checkpoint for vLLM and SGLang (the config comes from the checkpoint's "
                      "state.json)", False)
    p.add_argument("checkpoint", help="checkpoint directory, e.g. runs/demo/train/checkpoints/step-00000200")
    p.add_argument("out_dir", help="where to write <format>/config.json and model.safetensors")
    p.add_argument("--formats", default="vllm,sglang", help="comma-separated: vllm, sglang (default: both)")
    add("demo", "tiny target -> extract -> train -> export, on the CPU", True)
    p = add("evaluate", "real speculative decoding on prompts (--prompts) and, for our checkpoints, the "
                        "held-out acceptance-length estimate", True)
    p.add_argument("checkpoint", help="one of our checkpoints or a speculators/vLLM EAGLE-3 draft directory")
    p.add_argument("--prompts", help="JSON lines of prompts (evaluate.prompts)")
    p.add_argument("--max-new-tokens", help="tokens per prompt (evaluate.max_new_tokens)")
    p.add_argument("--k", help="draft tokens per round (evaluate.k)")
    p.add_argument("--out", help="where to write the report (default: eval.json in the draft directory)")
    add("generate", "regenerate the training replies with the target itself ([generate] keys)", True)
    return parser, subs


def main(argv: list[str] | None = None) -> None:
    from eagle3.config import check_overrides
    parser, subs = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("inspect", "export") and rest:   # they take no config: nothing to override
        subs[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    rest = check_overrides(subs[args.command], rest) if rest else rest
    try:
        if args.command == "inspect":
            print(json.dumps(inspect(args.target), indent=2))
        elif args.command == "export":
            from eagle3 import config as config_mod
            from eagle3.checkpoint import read_state
            from eagle3.config import from_dict
            from eagle3.export import export_all
            cfg = from_dict(read_state(args.checkpoint)["config"], args.checkpoint)
            cfg.export.formats = args.formats.split(",")
            config_mod.validate(cfg)
            for fmt, path in export_all(args.checkpoint, args.out_dir, cfg).items():
                print(f"exported {fmt} draft: {path}")
        elif args.command == "evaluate":
            evaluate_command(args, rest)
        elif args.command == "generate":
            from eagle3 import config as config_mod
            from eagle3.generate import run as generate
            generate(config_mod.load(args.config, rest))
        else:
            args.overrides = rest
            demo(args)
    except (TargetError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
