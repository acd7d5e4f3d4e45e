"""`python -m eagle3 evaluate`: our checkpoints by the held-out TTT estimate, any draft (ours or vLLM layout) by
real speculative decoding of prompts, into eval.json and eval.png (docs/evaluate.md)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from eagle3 import train_state
from eagle3.config import Config
from eagle3.data.batch import Batch, RowRule
from eagle3.data.loader import pack, split_holdout
from eagle3.data.inputs import (InputError, chat_encoder, check_chat_ids, is_chat, json_lines, reply_spans, token_media,
                                 utf8)
from eagle3.data.shards import MANIFEST, ShardReader, check_manifest
from eagle3.draft_io import advertised_tokens, check_checkpoint_target, load_any_draft, media_rule
from eagle3.resolve import resolve_device
from eagle3.files import strict_json
from eagle3.generate import stop_tokens
from eagle3.ops import TORCH_DTYPES
from eagle3.sampling import Sampling
from eagle3.speculative import Decoded, Drafter, greedy_decode_many, sampled_decode_many, speculative_decode_many
from eagle3.models.vision import media_rule_pad
from eagle3.models.weights import Checkpoint
from eagle3.models.incremental import IncrementalTarget
from eagle3.ttt import METRICS, Objective, summarize, ttt_forward
from eagle3.kernels.reference import ttt_attention, ttt_loss_steps

BUCKETS = [(0, 16), (16, 64), (64, 256), (256, 1024), (1024, None)]


def reply_positions(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Index of each token inside its assistant reply (a run of loss_mask = 1 within a sequence)."""
    T = loss_mask.numel()
    idx = torch.arange(T, device=loss_mask.device)
    m = loss_mask.bool()
    seq_start = torch.zeros(T, dtype=torch.bool, device=m.device)
    seq_start[cu_seqlens[:-1].long()] = True
    prev = torch.cat([m.new_zeros(1), m[:-1]])
    starts = m & (seq_start | ~prev)
    last_start = torch.cummax(torch.where(starts, idx, torch.full_like(idx, -1)), 0).values
    return idx - last_start


def decoding_rounds(accepted: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[int, int]:
    """(tokens, rounds) of chain speculative decoding of each reply replayed from the per-row accepted counts: a round
    whose newest token is x_m drafts from row m-1 and gains its accepted drafts + 1 (the prefill: the first token)."""
    acc, mask, bounds = accepted.tolist(), loss_mask.tolist(), cu_seqlens.tolist()
    tokens = rounds = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        for start, end in reply_spans(mask[a:b]):
            m, last = a + max(start, 1), a + end - 1          # a reply needs a prompt before it
            while m < last:
                gained = min(acc[m - 1] + 1, last - m)
                tokens, rounds, m = tokens + gained, rounds + 1, m + gained
    return tokens, rounds


class Evaluation:
    """Accumulates, over batches, metric sums overall and per reply-position bucket."""

    def __init__(self, steps: int):
        self.total = torch.zeros(steps, len(METRICS))
        self.buckets = {b: torch.zeros(steps, len(METRICS)) for b in BUCKETS}
        self.decoded = [0, 0]                  # tokens, rounds of the replayed decoding

    def add(self, metrics: torch.Tensor, detail: dict, batch: Batch) -> None:
        self.total += metrics.cpu()
        T = batch.rows
        label_row = (torch.arange(T, device=batch.loss_mask.device) + 2).clamp(max=T - 1)
        position = reply_positions(batch.loss_mask, batch.cu_seqlens)[label_row].cpu()
        correct, accepted, start = (detail[k].cpu() for k in ("correct", "accepted", "start"))
        tokens, rounds = decoding_rounds(accepted, batch.loss_mask.cpu(), batch.cu_seqlens.cpu())
        self.decoded = [self.decoded[0] + tokens, self.decoded[1] + rounds]
        for (lo, hi), sums in self.buckets.items():
            rows = start & (position >= lo) & (position < (hi if hi is not None else T + 1))
            sums[:, 2] += (correct & rows).sum(1)
            sums[:, 3] += rows.sum()
            sums[0, 6] += accepted[rows].sum()

    def report(self) -> dict:
        out = summarize(self.total)
        out["accept_len_decoding"] = self.decoded[0] / self.decoded[1] if self.decoded[1] else float("nan")
        out["by_reply_position"] = [
            {"positions": [lo, hi], "start_rows": int(s[0, 3]),
             "accept_len": summarize(s)["accept_len"], "acc_given_start": summarize(s)["acc"]}
            for (lo, hi), s in self.buckets.items() if s[0, 3] > 0]
        return out


@torch.no_grad()
def estimate(cfg: Config, checkpoint_dir: str | Path, steps: int | None = None) -> dict:
    """The TTT estimate on the held-out shards; `steps` overrides the K the draft was trained with."""
    checkpoint_dir = Path(checkpoint_dir)
    device = resolve_device(cfg.debug.train_device)
    draft, state = train_state.load_draft(checkpoint_dir, device)
    target = Checkpoint(cfg.target.path)
    check_checkpoint_target(state, target, checkpoint_dir)
    data_dir = Path(cfg.resolved_train_data_dir())
    reader = ShardReader(data_dir)
    check_manifest(reader.manifest, target.config, state["resolved"]["aux_layer_ids"], data_dir)
    trained = state["config"]["train"]   # the held-out split and K the draft was trained with
    embed = target.get("embed_tokens.weight").to(device, torch.float32)
    head_rows = target.get("lm_head.weight")[draft.t2d.cpu()].to(device, torch.float32)
    steps = steps or trained["ttt_steps"]
    objective = Objective(RowRule(), loss=trained.get("loss", "kl"), temperature=trained.get("loss_temperature", 1.0),
                          eta=state["config"].get("experimental", {}).get("lk_eta", 3.0))
    _, held_out = split_holdout(reader.sequences, trained["eval_fraction"])
    media_pad = media_rule_pad(media_rule(checkpoint_dir), target)   # the draft's input at media pads, as trained
    result = Evaluation(steps)
    for refs in pack(held_out, cfg.train.batch_tokens):
        batch = reader.read(refs).to(device, torch.float32)
        _, metrics, detail = ttt_forward(draft, batch, embed, head_rows, steps, ttt_attention, ttt_loss_steps,
                                         trained["loss_decay"], objective=objective, media_pad=media_pad)
        result.add(metrics, detail, batch)
    return {"checkpoint": str(checkpoint_dir), "step": state["step"], "held_out_sequences": len(held_out),
            **result.report()}


def write_report(report: dict, out: Path, checkpoint_dir: str | Path | None = None) -> list[Path]:
    """`out` as JSON and its plot beside it (an estimate's with the checkpoint's training curves) -> files written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(strict_json(report, indent=1))
    metrics = None
    if "acc" in report:
        metrics = Path(train_state.read_state(Path(checkpoint_dir))["config"]["train"]["output_dir"]) / "metrics.jsonl"
    return [out, out.with_suffix(".png")] if plot(report, metrics, out.with_suffix(".png")) else [out]


@dataclass
class Prompt:
    line: int                  # 1-based line in the prompts file
    ids: list[int]
    media: list = field(default_factory=list)   # MediaItems of its media pads, in order


def prompt_ids(obj: object, vocab_size: int, chat, base: Path) -> tuple[list[int], list]:
    """One line's prompt and its MediaItems: `input_ids` (cut before the first assistant token when `loss_mask` is
    there, so a held-out training line works) or a chat line up to the generation prompt (`chat()`: its ChatEncoder;
    `base`: where its media paths are read from)."""
    media = []
    if is_chat(obj):
        ids, placed = chat().encode_prompt_media(obj, base)
        ids, media = check_chat_ids(ids, vocab_size).tolist(), [item for _, item in placed]
    elif not isinstance(obj, dict) or "input_ids" not in obj:
        raise ValueError("expected an object with 'input_ids' (optionally 'loss_mask'), or chat 'messages' "
                         "/ 'conversations'")
    else:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab_size for i in ids):
            raise ValueError(f"'input_ids' must be a list of integers in [0, {vocab_size})")
        mask = obj.get("loss_mask")
        if mask is not None:
            if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
                raise ValueError("'loss_mask' must be a list of 0/1 as long as 'input_ids'")
            ids = ids[:mask.index(1)] if 1 in mask else ids
        media = [item for start, item in token_media(obj, np.asarray(obj["input_ids"]), chat, base) if start < len(ids)]
    if not ids:
        raise ValueError("empty prompt (nothing before the first assistant token)")
    return ids, media


def read_prompts(path: str | Path, vocab_size: int, target_dir: str | Path,
                 room: tuple[int, int, str] | None = None, template_kwargs: dict | None = None) -> list[Prompt]:
    """The prompts of a JSON-lines file (chat lines rendered with `template_kwargs`, as training data); errors name the
    file and line. `room`: (the target's positions, tokens to decode after each prompt, where the positions are set):
    a prompt with no room to decode is refused."""
    path, chat, prompts = Path(path), chat_encoder(target_dir, template_kwargs), []
    for number, line in json_lines(path, "evaluate.prompts"):
        try:
            prompts.append(Prompt(number, *prompt_ids(json.loads(utf8(line)), vocab_size, chat, path.parent)))
        except ValueError as e:   # JSONDecodeError, ChatError and InputError are ValueErrors
            raise InputError(f"{path}:{number}: {e}") from None
        if room and len(prompts[-1].ids) + room[1] > room[0]:   # decoded past them, RoPE positions mean nothing
            raise InputError(f"{path}:{number}: a prompt of {len(prompts[-1].ids)} tokens + evaluate.max_new_tokens "
                             f"{room[1]} exceeds the target's max_position_embeddings {room[0]} ({room[2]}); shorten "
                             "the prompt or lower evaluate.max_new_tokens")
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts


def pooled(accepted: list[int], drafts: list[int], k: int) -> dict:
    """Figures pooled over rounds: tokens gained per round (`accepted`) and, for j = 1..k, the share of rounds
    whose j-th draft the target accepted (`drafts`: leading accepted drafts per round)."""
    rounds = len(accepted)
    if not rounds:
        return {"real_accept_len": None, "rounds": 0, "per_position_acceptance": None}
    return {"real_accept_len": sum(accepted) / rounds, "rounds": rounds,
            "per_position_acceptance": [sum(a >= j for a in drafts) / rounds for j in range(1, k + 1)]}


def depth_buckets(edges: list[int], max_positions: int) -> list[tuple[int, int | None]]:
    """[0, e1), [e1, e2), ..., [en, end): those starting below the target's max_positions (a round can start there)."""
    return [(lo, hi) for lo, hi in zip([0, *edges], [*edges, None]) if lo < max_positions]


def depth_label(lo: int, hi: int | None) -> str:
    size = lambda n: f"{n // 1024}k" if n % 1024 == 0 else str(n)  # noqa: E731
    if hi is None:
        return f">={size(lo)}" if lo else "all"
    return f"<{size(hi)}" if lo == 0 else f"{size(lo)}-{size(hi)}"


def by_depth(decoded: list[Decoded], buckets: list[tuple[int, int | None]], k: int) -> list[dict]:
    """The pooled figures of the rounds that started in each bucket of context depth (prompt + tokens generated
    when the round's draft proposes), and the tokens those rounds gained."""
    rounds = [r for d in decoded for r in zip(d.depths, d.accepted, d.drafts_accepted)]
    out = []
    for lo, hi in buckets:
        inside = [(a, n) for depth, a, n in rounds if lo <= depth and (hi is None or depth < hi)]
        gained, drafts = [a for a, _ in inside], [n for _, n in inside]
        out.append({"depth": [lo, hi], "label": depth_label(lo, hi), **pooled(gained, drafts, k),
                    "tokens": sum(gained)})
    return out


def decoding_report(decoded: list[Decoded], references: list[Decoded] | None, prompts: list[Prompt], k: int,
                    buckets: list[tuple[int, int | None]]) -> dict:
    """Totals over all rounds of all prompts (the prefill in new_tokens, not in rounds), and by depth; `mismatches`
    against the greedy references (T = 0). The figures: docs/evaluate.md."""
    accepted = [a for d in decoded for a in d.accepted]
    per_request = [d.mean_accepted for d in decoded if d.accepted]
    report = {**pooled(accepted, [a for d in decoded for a in d.drafts_accepted], k),
              "accept_len_per_request": sum(per_request) / len(per_request) if per_request else float("nan"),
              "prompts": len(prompts), "new_tokens": sum(len(d.tokens) for d in decoded), "k": k,
              "by_depth": by_depth(decoded, buckets, k)}
    if references is not None:
        mismatched = [p.line for p, d, r in zip(prompts, decoded, references) if d.tokens != r.tokens]
        report |= {"mismatches": len(mismatched), "mismatch_lines": mismatched[:20]}
    return report


def media(batch: list[Prompt]) -> list[list] | None:
    """The prompts' MediaItems, None when none has any."""
    return [p.media for p in batch] if any(p.media for p in batch) else None


def batches(prompts: list[Prompt], size: int, tokens: int, max_new: int) -> list[list[int]]:
    """Indices of the prompts decoded together: by length, at most `size` a batch and, past one prompt, at most
    `tokens` positions (prompt + max_new each), so that deep prompts decode in batches that fit."""
    order, out = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids)), []
    for i in order:
        need = len(prompts[i].ids) + max_new
        if out and len(out[-1]) < size and used + need <= tokens:
            out[-1].append(i)
            used += need
        else:
            out.append([i])
            used = need
    return out


SEEDED = ("real_accept_len", "accept_len_per_request", "per_position_acceptance", "rounds", "new_tokens")
SEEDED_BY_DEPTH = ("real_accept_len", "per_position_acceptance", "rounds", "tokens")


def mean_sd(reports: list[dict], keys: tuple[str, ...]) -> dict:
    """Each key's mean over the reports that have it (not None: no rounds) and its sample deviation (`<key>_sd`, 0 for
    one report)."""
    out = {}
    for key in keys:
        known = [r[key] for r in reports if r[key] is not None]
        if not known:
            out[key] = out[f"{key}_sd"] = None
            continue
        t = torch.tensor(known, dtype=torch.float64)                      # [seeds] or [seeds, k]
        sd = t.std(0) if len(known) > 1 else torch.zeros_like(t[0])
        out[key], out[f"{key}_sd"] = t.mean(0).tolist(), sd.tolist()
    return out


def over_seeds(reports: list[dict], seeds: list[int]) -> dict:
    """One report per seed -> each figure's mean, sample deviation (`<key>_sd`), per-seed figures; by depth too."""
    out = {k: v for k, v in reports[0].items() if k not in SEEDED} | mean_sd(reports, SEEDED)
    out["by_depth"] = [{"depth": b[0]["depth"], "label": b[0]["label"], **mean_sd(list(b), SEEDED_BY_DEPTH)}
                       for b in zip(*(r["by_depth"] for r in reports))]          # b: one bucket, each seed's
    per_seed = [{"seed": s, **{k: r[k] for k in (*SEEDED, "by_depth")}} for s, r in zip(seeds, reports)]
    return out | {"seeds": seeds, "per_seed": per_seed}


@torch.no_grad()
def real_decoding(cfg: Config, draft_dir: str | Path, prompts_path: str | Path | None = None, *,
                  out: str | Path | None = None) -> dict:
    """Speculative decoding of `draft_dir` (ours or vLLM layout) on the prompts at the `[evaluate]` settings:
    at T = 0 checked against the target's greedy output, above 0 once per seed. `out` also writes the report there."""
    e, start = cfg.evaluate, time.perf_counter()
    sampling = Sampling(e.temperature, e.top_p, e.draft_sampling)
    prompts_path = prompts_path or e.prompts
    if not prompts_path:
        raise InputError(f"{cfg.source}: no prompts for real decoding: set evaluate.prompts (--prompts FILE)")
    ckpt = Checkpoint(cfg.target.path)
    draft, aux_ids, trained = load_any_draft(draft_dir, ckpt)
    media_pad = media_rule_pad(media_rule(draft_dir), ckpt)   # the draft's input at media pads, as trained
    k = e.k or trained or advertised_tokens(draft_dir) or 7
    n = e.max_new_tokens
    text = ckpt.config
    prompts = read_prompts(prompts_path, text.vocab_size, ckpt.dir, (text.max_position_embeddings, n, text.source),
                           cfg.data.chat_template_kwargs)
    dbg = cfg.debug
    device, dtype = resolve_device(dbg.evaluate_device), TORCH_DTYPES[dbg.evaluate_dtype]
    target = IncrementalTarget(ckpt, aux_ids, device, dtype, dbg.chunk_tokens)
    stop, buckets = stop_tokens(cfg, ckpt), depth_buckets(dbg.evaluate_depth_edges, text.max_position_embeddings)
    inv_freq = draft.inv_freq.float().clone()          # RoPE frequencies lose their precision in bf16
    draft = draft.to(device, dtype)
    draft.inv_freq = inv_freq.to(device)
    loaded, groups = time.perf_counter(), batches(prompts, dbg.evaluate_batch_size, dbg.chunk_tokens, n)

    def each_batch(decode) -> list[Decoded]:
        """decode(drafter, ids, batch's prompts) over the batches (each with fresh KV pools) -> in prompts' order."""
        out = {}
        for group in groups:
            target.fresh_pool()
            batch = [prompts[i] for i in group]
            out |= dict(zip(group, decode(Drafter(draft, target.embed, media_pad), [p.ids for p in batch], batch)))
        return [out[i] for i in range(len(prompts))]

    if sampling.greedy:
        references = each_batch(lambda drafter, ids, batch: greedy_decode_many(target, ids, n, stop, media(batch)))
        timing = {"greedy_seconds": time.perf_counter() - loaded}
        decoded = each_batch(lambda drafter, ids, batch: speculative_decode_many(target, drafter, ids, n, k, stop,
                                                                                 media(batch)))
        report = decoding_report(decoded, references, prompts, k, buckets)
    else:
        seeds = list(range(e.seeds))
        runs = [decoding_report(each_batch(lambda drafter, ids, batch: sampled_decode_many(
            target, drafter, ids, n, k, stop, sampling, [s * 1_000_003 + p.line for p in batch], media(batch))),
            None, prompts, k,
            buckets) for s in seeds]
        report, timing = over_seeds(runs, seeds), {}
    end = time.perf_counter()
    report = {"draft": str(draft_dir), "draft_format": "ours" if trained else "vllm", "target": str(cfg.target.path),
              "prompts_file": str(prompts_path), "aux_layer_ids": aux_ids, "temperature": e.temperature,
              "top_p": e.top_p, "draft_sampling": "greedy" if sampling.greedy else e.draft_sampling, **report,
              "max_new_tokens": e.max_new_tokens, "device": str(device), "dtype": dbg.evaluate_dtype,
              "batch_size": dbg.evaluate_batch_size, "wall_seconds": end - start, **timing,
              "speculative_seconds": end - loaded - timing.get("greedy_seconds", 0.0)}
    if report.get("mismatches"):
        print(f"warning: {report['mismatches']} of {len(prompts)} prompts decoded differently from the target's greedy "
              f"output (lines {report['mismatch_lines']}): near-ties in {dbg.evaluate_dtype}, or a bug",
              file=sys.stderr)
    if out is not None:
        write_report(report, Path(out))
    return report


def run(cfg: Config, draft_dir: str | Path, out: str | Path | None = None) -> tuple[dict, list[Path]]:
    """The TTT estimate (our checkpoints) and real decoding (`evaluate.prompts`) in one eval.json and its plot ->
    (report, the files written)."""
    draft_dir = Path(draft_dir)
    ours = (draft_dir / train_state.STATE).exists()
    out = Path(out) if out else draft_dir / "eval.json"
    shards = (Path(cfg.resolved_train_data_dir()) / MANIFEST).exists()
    report = {}
    if ours and (shards or not cfg.evaluate.prompts):   # without prompts the estimate is all there is
        report.update(estimate(cfg, draft_dir))
    elif ours:
        print(f"note: no shards in {cfg.resolved_train_data_dir()}: real decoding only, no TTT estimate",
              file=sys.stderr)
    if cfg.evaluate.prompts:
        report.update(real_decoding(cfg, draft_dir))
    elif not ours:
        raise InputError(f"{draft_dir}: a vLLM-layout draft is judged by real decoding: give --prompts FILE")
    return report, write_report(report, out, draft_dir)


def plot(report: dict, metrics_path: Path | None, out: Path) -> bool:
    """The estimate by TTT step and the training curves, real acceptance by depth: those the report has, under one
    headline (real decoding's figure where there is one); skipped (False) without matplotlib or without any."""
    panels = [p for p, there in ((plot_estimate, "acc" in report), (plot_training, "acc" in report),
                                 (plot_depth, bool(report.get("by_depth")))) if there]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), squeeze=False)
    for panel, ax in zip(panels, axes[0]):
        panel(ax, report, metrics_path)
    fig.suptitle(headline(report), fontsize=14)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def headline(report: dict) -> str:
    """What a reader wants first: real decoding's tokens per target forward, else the held-out estimate."""
    if report.get("real_accept_len") is not None:
        return (f"real decoding: {report['real_accept_len']:.2f} tokens per target forward "
                f"({report['prompts']} prompts, k = {report['k']}, T = {report['temperature']})")
    return f"held-out estimate: accept_len ≈ {report['accept_len']:.2f} (no real decoding: evaluate --prompts)"


def plot_estimate(ax, report: dict, _) -> None:
    steps = range(len(report["acc"]))
    ax.plot(steps, report["acc"], "o-", label="accuracy")
    ax.plot(steps, report["cond_acc"], "s--", label="given earlier steps right")
    ax.set_xticks(list(steps))   # TTT steps are whole
    ax.set_ylim(0, 1.05)
    ax.set(xlabel="TTT step", ylabel="held-out accuracy", title=f"held-out estimate: accept_len ≈ "
           f"{report['accept_len']:.2f}")
    ax.title.set_fontsize(10)
    ax.legend(loc="lower left", fontsize=8)


def plot_training(ax, _, metrics_path: Path) -> None:
    if not metrics_path.exists():
        return
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    train, evals = ([r for r in records if r["split"] == split] for split in ("train", "eval"))
    ax.plot([r["step"] for r in train], [r["loss"][0] for r in train], label="train loss (step 0)")
    twin = ax.twinx()
    twin.plot([r["step"] for r in evals], [r["accept_len"] for r in evals], "r.-", label="held-out accept_len")
    ax.set(xlabel="optimizer step", ylabel="loss", title="training")
    ax.title.set_fontsize(10)
    twin.set_ylabel("accept_len")
    lines = ax.get_legend_handles_labels(), twin.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="center right", fontsize=8)


def plot_depth(ax, report: dict, _) -> None:
    """Real tokens per round pooled by where the rounds started (± the deviation over seeds at T > 0), on the whole
    range a round can gain (1 to k + 1 tokens); a bucket without rounds stays, marked empty."""
    buckets, top = report["by_depth"], report["k"] + 1
    at = range(len(buckets))
    tau = [0.0 if b["real_accept_len"] is None else b["real_accept_len"] for b in buckets]
    ax.bar(at, tau, yerr=[b.get("real_accept_len_sd") or 0.0 for b in buckets], capsize=4, color="tab:blue")
    for x, y, b in zip(at, tau, buckets):
        ax.annotate(f"{y:.2f}" if b["rounds"] else "no rounds", (x, y), textcoords="offset points", xytext=(0, 3),
                    ha="center", va="bottom", fontsize=8)
    # the rounds under each bucket's name, not over the bars where they meet the axes
    ax.set_xticks(list(at), [f"{b['label']}\n{b['rounds']:.0f} rounds" for b in buckets], fontsize=8)
    ax.set_ylim(0, top + 0.4)
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="context depth at the round's start (tokens)", ylabel="tokens per target forward",
           title=f"real decoding by depth (1 = no draft token accepted, {top} = all)")
    ax.title.set_fontsize(10)
