"""Issue-6 experiment: does training-time test pay off at later draft positions?

Tiny target -> regenerate the replies greedily -> extract -> train one draft with ttt_steps = 7
and one with ttt_steps = 1 on the same tokens -> real accepted length from the speculative
decoding loop on held-out prompts, drafting k tokens per round.

    python bench/ttt_experiment.py [--steps 400] [--out runs/ttt_experiment]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3 import checkpoint as ckpt_io  # noqa: E402
from eagle3 import config as config_mod  # noqa: E402
from eagle3 import extraction, generate, training  # noqa: E402
from eagle3.data.batching import split_holdout  # noqa: E402
from eagle3.data.inputs import read_records  # noqa: E402
from eagle3.data.shards import ShardReader  # noqa: E402
from eagle3.evaluate import evaluate  # noqa: E402
from eagle3.speculative import Drafter, speculative_decode  # noqa: E402
from eagle3.models import tiny  # noqa: E402
from eagle3.models.checkpoint import Checkpoint  # noqa: E402
from eagle3.models.incremental import IncrementalTarget  # noqa: E402


def config(out: Path, **overrides) -> config_mod.Config:
    base = {"target.path": out / "target", "data.path": out / "data.jsonl", "extract.output_dir": out / "hidden",
            "generate.output_path": out / "regen.jsonl", "generate.max_new_tokens": 48,
            "generate.dtype": "float32", "extract.dtype": "float32", "train.batch_tokens": 2048,
            "train.lr": 3e-3, "train.eval_fraction": 0.1, "train.log_every": 50, "train.eval_every": 1000,
            "train.checkpoint_every": 1000, "train.device": "cpu", "extract.device": "cpu",
            "generate.device": "cpu", **overrides}
    return config_mod.load(None, [x for k, v in base.items() for x in (f"--{k}", str(v))])


def real_acceptance(cfg, checkpoint: Path, prompts: list[list[int]], k: int) -> dict:
    draft, state = ckpt_io.load_draft(checkpoint)
    target = IncrementalTarget(Checkpoint(cfg.target.path), state["aux_layer_ids"], torch.device("cpu"))
    drafter = Drafter(draft, target.embed)
    accepted, reached = [], [0] * (k + 1)
    for prompt in prompts:
        result = speculative_decode(target, drafter, prompt, cfg.generate.max_new_tokens, k)
        accepted += result.accepted
        for a in result.accepted:
            for j in range(a):
                reached[j] += 1
    rounds = len(accepted)
    return {"k": k, "rounds": rounds, "mean_accepted": sum(accepted) / rounds,
            "accept_rate_by_draft_position": [reached[j + 1] / rounds for j in range(k)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", default="runs/ttt_experiment")
    args = parser.parse_args()
    out = Path(args.out)
    tiny.make_llama(out / "target", hidden=128, layers=8, heads=4, kv_heads=2, intermediate=256, vocab=512)
    tiny.make_token_data(out / "data.jsonl", vocab=512, sequences=384, min_len=16, max_len=64, seed=1)
    cfg = config(out)
    generate.run(cfg)
    cfg = config(out, **{"data.path": out / "regen.jsonl"})
    extraction.run(cfg)
    held_out_cfg = config(out, **{"data.path": out / "regen.jsonl", "train.ttt_steps": 7})
    records, _ = read_records(out / "regen.jsonl", 512, 4096)
    _, held_out = split_holdout(ShardReader(cfg.extract.output_dir).sequences, cfg.train.eval_fraction)
    prompts = [records[ref.index].input_ids[:list(records[ref.index].loss_mask).index(1)].tolist()
               for ref in held_out]
    results = {}
    for steps in (7, 1):
        run_cfg = config(out, **{"data.path": out / "regen.jsonl", "train.ttt_steps": steps,
                                 "train.max_steps": args.steps, "train.output_dir": out / f"train-k{steps}"})
        training.run(run_cfg)
        checkpoint = ckpt_io.latest(run_cfg.train.output_dir)
        estimate = evaluate(held_out_cfg, checkpoint, steps=7)
        results[f"ttt_steps={steps}"] = {
            "estimate_accept_len_k7": estimate["accept_len"],
            "estimate_accept_len_decoding_k7": estimate["accept_len_decoding"], "estimate_acc_by_step": estimate["acc"],
            "real_k3": real_acceptance(cfg, checkpoint, prompts, 3),
            "real_k7": real_acceptance(cfg, checkpoint, prompts, 7)}
    print(json.dumps(results, indent=1))
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
