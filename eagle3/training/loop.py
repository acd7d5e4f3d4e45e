"""The training loop: DDP over the draft's trainable parameters, gradient accumulation, AdamW,
evaluation, logging, checkpoints and export, in one process or under torchrun (NCCL, or gloo on CPU)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

from eagle3 import distributed, float8, train_state
from eagle3.config import Config
from eagle3.data.batch import Batch, RowRule
from eagle3.data.loader import pack, split_holdout
from eagle3.data.online import OnlineReader, stream_note
from eagle3.data.shards import ShardReader, check_manifest, loss_token_counts
from eagle3.draft import Eagle3Draft
from eagle3.errors import TrainError
from eagle3.export import ExportError, check_exportable, export_all, served_formats, serving_commands
from eagle3.models.vision import media_rule_pad
from eagle3.models.weights import Checkpoint
from eagle3.resolve import resolve
from eagle3.training import context, graph, kernel_choice, memory, resume, run_dir
from eagle3.training.feed import Feed
from eagle3.training.graph import GraphedStep
from eagle3.training.metrics import MetricsLog
from eagle3.training.schedule import Plan, Schedule
from eagle3.ttt import METRICS, Objective, summarize, ttt_forward
from eagle3.vocab import build_vocab, coverage


@dataclasses.dataclass(frozen=True, eq=False)
class Unroll:
    """The run's constants of the TTT unroll (see `eagle3.ttt.ttt_forward`)."""
    embed: torch.Tensor        # the target's frozen embedding [V_t, H], in the compute dtype
    head_rows: torch.Tensor    # the target's lm_head rows of the draft vocab [V_d, H]
    steps: int                 # train.ttt_steps, K
    attention: Callable        # kernel_choice.Kernels' (context parallel: in a context.SplitAttention)
    loss_steps: Callable
    decay: float               # train.loss_decay
    skip_dead_rows: bool       # debug.skip_dead_rows
    objective: Objective       # rows trained, the loss
    static: bool = False       # a CUDA graph's shapes (`eagle3.ttt.ttt_forward`)
    media_pad: int | None = None   # draft.media_embedding = "sglang": the placeholder id that reads vision rows

    def evaluating(self) -> Unroll:
        """The same unroll measuring on assistant rows only, as evaluation does."""
        return dataclasses.replace(self, objective=dataclasses.replace(self.objective, rows=RowRule()))

    def graphed(self, longest: int) -> Unroll:
        """The unroll at static shapes: every row, the attention bounded by the longest sequence."""
        return dataclasses.replace(self, attention=functools.partial(self.attention, max_seqlen=longest),
                                   skip_dead_rows=False, static=True)


class TTTModel(nn.Module):
    """The unit DDP wraps: the draft plus the TTT unroll as its forward."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, batch: Batch, unroll: Unroll, scale: float | torch.Tensor = 1.0):
        u = unroll
        return ttt_forward(self.draft, batch, u.embed, u.head_rows, u.steps, u.attention, u.loss_steps, u.decay,
                           scale, u.skip_dead_rows, u.objective, u.static, u.media_pad)


# the draft's buffers (vocab maps, RoPE frequencies) are alike on every rank: no broadcast before each forward
# (torch 2.13 names it forward_sync_buffers and warns on the older broadcast_buffers)
UNSYNCED_BUFFERS = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                    inspect.signature(nn.parallel.DistributedDataParallel).parameters else {"broadcast_buffers": False})


def masked_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step() unless `skip`; a fused AdamW reads the flag on the device (no host sync)."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = skip.float()
        optimizer.step()
    elif not bool(skip):
        optimizer.step()


CAUSES = {1: "loss", 2: "gradient norm", 3: "loss and gradient norm"}


class NonFinite:
    """Steps whose loss (any rank) or gradient norm is non-finite, tracked on the device (no sync per step)."""

    def __init__(self, dist: distributed.Dist, device: torch.device):
        self.dist = dist
        self.first = torch.full((2,), -1, dtype=torch.long, device=device)   # first such step, its cause (CAUSES)
        self.skipped = torch.zeros((), dtype=torch.long, device=device)      # such steps since the last log

    def track(self, loss_bad: torch.Tensor, grad_norm: torch.Tensor, step: int) -> torch.Tensor:
        """Whether step `step` is non-finite on any rank, as a device flag."""
        flags = self.dist.all_reduce(torch.stack((loss_bad, ~torch.isfinite(grad_norm))).float())
        bad = flags.sum() > 0
        cause = (flags[0] > 0).long() + 2 * (flags[1] > 0).long()
        here = torch.stack((torch.full((), step, dtype=torch.long, device=self.first.device), cause))
        self.first = torch.where(bad & (self.first[0] < 0), here, self.first)
        self.skipped += bad
        return bad

    def check(self, output_dir: Path, skip: bool) -> None:
        """Stop at the first non-finite step unless `skip`: before anything is logged or saved."""
        step, cause = self.first.tolist()
        if step < 0 or skip:
            return
        last = train_state.latest(output_dir)
        kept = f"the newest checkpoint, {last}, is the last good one" if last else "no checkpoint was written"
        raise TrainError(f"{output_dir}: step {step}: non-finite {CAUSES[cause]}; training stopped, {kept} "
                         "(rerun resumes from it: lower train.lr or train.grad_clip, check the data, or set "
                         "debug.skip_nonfinite = true to skip such steps)")


@dataclasses.dataclass
class StepResult:
    metrics: torch.Tensor     # metric sums [K, len(METRICS)] of this rank's micro-batches (zeros if skipped)
    grad_norm: torch.Tensor   # the gradient norm before clipping (all ranks)
    skipped: torch.Tensor     # bool: non-finite loss or gradient norm: no weight changed


@dataclasses.dataclass
class Window:
    """What the next train line of the log reports, gathered on this rank since the last one."""
    metrics: torch.Tensor                                            # metric sums [K, len(METRICS)]
    tokens: int = 0                                                  # rows trained
    clock: float = dataclasses.field(default_factory=time.perf_counter)
    waited: float = 0.0                                              # seconds spent waiting for batches
    target: tuple[int, float] = (0, 0.0)                             # online: the reader's totals at the last line

    def restart(self) -> None:
        self.metrics.zero_()
        self.tokens, self.clock, self.waited = 0, time.perf_counter(), 0.0

    def side_rates(self, reader, dist: distributed.Dist, tokens_all: int, elapsed: float) -> dict:
        """Online: the target's tokens/s over its busy time, the draft's over the time not waiting."""
        before, self.target = self.target, tuple(reader.totals)   # one snapshot: the prefetch thread adds to it
        since = [a - b for a, b in zip(self.target, before)]
        made = dist.all_reduce(torch.tensor([float(since[0]), since[1]], device=self.metrics.device))
        busy = float(made[1]) / dist.world
        return {"target_tokens_per_s": float(made[0]) / busy if busy else float("nan"),
                "draft_tokens_per_s": tokens_all / max(elapsed - self.waited, 1e-9)}


def open_reader(cfg: Config, target: Checkpoint, resolved, device: torch.device,
                say: bool) -> ShardReader | OnlineReader:
    if cfg.train.source == "online":   # each rank runs the target on data.path for its own micro-batches
        if cfg.train.online_target == "stream" and say:
            print(stream_note(target, device), file=sys.stderr)
        return OnlineReader(cfg, target, resolved.aux_layer_ids, device)
    data_dir = Path(resolved.data_dir)
    reader = ShardReader(data_dir)
    check_manifest(reader.manifest, target.config, resolved.aux_layer_ids, data_dir)
    return reader


def build_draft(cfg: Config, target: Checkpoint, spec, reader, device: torch.device,
                say: bool, agree=bool) -> tuple[Eagle3Draft, bool, torch.Tensor]:
    """(the draft as the config wants it, whether it runs fp8 GEMMs, the target's head rows of its vocab
    in their stored precision)."""
    counts = loss_token_counts(reader.manifest)
    d2t, t2d = build_vocab(counts, target.config.vocab_size, spec.draft_vocab_size)
    if say:
        print(f"draft vocab: {spec.draft_vocab_size} of {target.config.vocab_size} tokens, "
              f"{coverage(counts, t2d):.1%} of the loss tokens (vocab.draft_vocab_size)", file=sys.stderr)
    draft = Eagle3Draft(spec)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    if device.type == "cuda" and cfg.debug.compile_ops:
        draft.compile_elementwise()
    if fp8 := float8.choose(cfg.train.float8, device, spec, cfg.source, say, cfg.train.batch_tokens, agree):
        draft.use_float8()
    target_rows = target.get("lm_head.weight")[t2d]
    head, x = draft.lm_head.weight, cfg.experimental
    if x.lm_head_init == "target":   # [draft vocab, hidden] both, by construction
        with torch.no_grad():
            head.copy_(target_rows)
    if x.freeze_lm_head:
        head.requires_grad_(False)
        if x.lm_head_init == "random" and say:
            print('warning: experimental.freeze_lm_head = true with lm_head_init = "random": the lm_head stays '
                  'random and is never trained; set lm_head_init = "target" or freeze_lm_head = false', file=sys.stderr)
    return draft, fp8, target_rows


def data_plan(cfg: Config, reader, layout: context.Layout, data_dir: str) -> tuple[Plan, list]:
    """(the plan over the training split, the held-out sequences); micro-batches of train.batch_tokens tokens per
    rank of a context-parallel group, one per group."""
    t, ranks = cfg.train, layout.size
    train_refs, eval_refs = split_holdout(reader.sequences, t.eval_fraction)
    if (longest := max(r.length for r in reader.sequences)) > t.batch_tokens * ranks:
        split = (f" x train.context_parallel = {ranks} ({t.batch_tokens * ranks} tokens)" if ranks > 1 else "")
        # shards keep their sequences as extracted: data.max_seq_len acts only through extract
        again = "re-extract with a lower data.max_seq_len" if t.source == "shards" else "lower data.max_seq_len"
        raise TrainError(f"{cfg.origin('train.batch_tokens')}: train.batch_tokens = {t.batch_tokens}{split} is smaller "
                         f"than the longest sequence of {data_dir} ({longest} tokens); raise train.batch_tokens, "
                         f"split each micro-batch over more ranks (train.context_parallel), or {again}")
    source = reader.manifest.get("source", {}).get("path", "?")   # as an error names the data
    data = (f"data.path {source} (online)" if t.source == "online" else
            f"train.data_dir {Path(data_dir)} (extracted from data.path {source})")
    return Plan(train_refs, t.batch_tokens * ranks, t.seed, layout.data_world, t.grad_accum, t.max_steps, t.epochs,
                data), eval_refs


def start_notes(cfg: Config, longest: int, layout: context.Layout) -> list[str]:
    """What the log says of the data (its `longest` sequence) against the settings: context parallelism and the
    window it trains."""
    notes = []
    if layout.size > 1:
        notes.append(f"context parallel: {layout.size} ranks share each micro-batch of {layout.size} x "
                     f"{cfg.train.batch_tokens} tokens (train.context_parallel); the longest sequence trained has "
                     f"{longest} tokens")
    if (window := cfg.draft.sliding_window) and window >= longest:
        notes.append(f"note: draft.sliding_window = {window} is not shorter than the longest sequence trained "
                     f"({longest} tokens): no training row sees the window cut, the draft trains as without it")
    return notes


class Trainer:
    """One training run: set up from the config (output directory, data, draft, optimizer, kernels,
    resume), then `run`: the steps, evaluation, the log, checkpoints and the export."""

    def __init__(self, cfg: Config):
        self.cfg, t = cfg, cfg.train
        self.dist = distributed.setup(cfg.debug.train_device, cfg.debug.collective_timeout_s)
        self.device = self.dist.device
        self.cuda = self.device.type == "cuda"
        self.float_dtype = torch.bfloat16 if self.cuda else torch.float32
        torch.manual_seed(t.seed)
        self.output_dir = Path(t.output_dir)
        run_dir.prepare(self.output_dir, t.resume, cfg.source, self.dist)
        self.target = Checkpoint(cfg.target.path)
        self.resolved = resolve(cfg, self.target)
        # every export format is checked now, not after the last step
        self.formats, self.skipped = served_formats(self.target.config.identity(), cfg)
        check_exportable({"resolved": self.resolved.to_dict(), "target": self.target.config.identity()},
                         self.formats, cfg.source)
        self.online = t.source == "online"
        spec = self.resolved.draft_spec
        self.layout = context.layout(cfg.train.context_parallel, self.dist, spec.num_key_value_heads,
                                     spec.num_attention_heads, cfg.origin("train.context_parallel"), self.online)
        self.reader = open_reader(cfg, self.target, self.resolved, self.device, say=self.dist.main)
        self.plan, self.eval_refs = data_plan(cfg, self.reader, self.layout, self.resolved.data_dir)
        longest = max(r.length for r in self.reader.sequences)
        fits = memory.check(memory.step_peak_bytes(spec, cfg, longest, self.cuda), memory.available_bytes(self.device),
                            cfg, self.device.type, 1 if self.cuda else int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if self.dist.main:
            for line in [*start_notes(cfg, longest, self.layout), *([fits] if fits else []), *self.skipped]:
                print(line, file=sys.stderr)
        draft, self.float8, target_rows = build_draft(cfg, self.target, spec, self.reader, self.device,
                                                      self.dist.main, self.agree)
        self.model = TTTModel(draft).to(self.device)
        # a frozen lm_head is in neither the optimizer, gradient clipping nor DDP's buckets
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                           fused=self.cuda)
        self.schedule = Schedule(t.warmup_steps, self.plan.total, t.min_lr_ratio, t.schedule, t.decay_fraction)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        # the model is initialised alike on every rank; any draw from here on differs by rank
        torch.manual_seed(t.seed + 1_000_003 * self.dist.rank)
        kernels = kernel_choice.choose(cfg, self.device, spec, self.float8, self.dist.main, self.agree)
        self.float8_head = kernels.float8_head
        objective = Objective(RowRule(t.prompt_rows), loss=t.loss, temperature=t.loss_temperature,
                              eta=cfg.experimental.lk_eta)
        self.unroll = Unroll(self.target.get("embed_tokens.weight").to(self.device, self.float_dtype),
                             target_rows.to(self.device, self.float_dtype), t.ttt_steps,
                             self.layout.attention(kernels.attention),
                             kernels.loss_steps, t.loss_decay, cfg.debug.skip_dead_rows, objective,
                             media_pad=media_rule_pad(cfg.draft.media_embedding, self.target))
        self.eval_unroll = self.unroll.evaluating()
        self.graphed = pad_to = None
        if graph.wanted(cfg.debug.cuda_graphs, self.device, self.dist.world, self.online, "max_seqlen" in
                        inspect.signature(kernels.attention).parameters, spec.hidden_size, cfg.source, self.dist.main,
                        media=self.unroll.media_pad is not None):
            self.unroll, pad_to = self.unroll.graphed(longest), (t.batch_tokens, longest)
            self.graphed = GraphedStep(functools.partial(self._forward, self.model, training=True), self.device)
        self.feed = Feed(self.reader, self.plan, self.layout.data_rank, self.device, self.float_dtype,
                         self.model.draft.t2d.cpu(), self.unroll, self.eval_unroll, cfg.debug.prefetch,
                         overlap=self.cuda and not self.online, pad_to=pad_to, share=self.layout.share(t.ttt_steps))
        self.start_step = self._resume()
        # device_ids=None: DDP moving the inputs would move the host-side boundaries to the device
        self.ddp = self.model if self.dist.world == 1 else nn.parallel.DistributedDataParallel(
            self.model, device_ids=None, gradient_as_bucket_view=True, **UNSYNCED_BUFFERS)
        self.log = MetricsLog(self.output_dir, self.start_step, self.dist.main)
        self.nonfinite = NonFinite(self.dist, self.device)

    def agree(self, on: bool) -> bool:
        """A start-up choice every rank makes alike: on only where it is on for all (timings differ by GPU)."""
        return self.dist.all_reduce(torch.tensor(int(on), device=self.device)).item() == self.dist.world

    def _state(self) -> dict:
        """What a checkpoint of this run records besides the weights (state.json)."""
        return {"resolved": self.resolved.to_dict(),
                "target": self.target.config.identity(), "target_architectures": self.target.config.architectures,
                "config": self.cfg.absolute_dict(),   # its paths absolute: evaluate and export from anywhere
                "data_plan_key": self.reader.manifest.get("plan_key"),   # which extraction: none online
                "world_size": self.dist.world, "schedule_total": self.schedule.total, "float8_used": self.float8,
                "float8_head_used": self.float8_head, "cuda_graphs_used": self.graphed is not None}   # "auto"s resolved

    def _resume(self) -> int:
        """Continue from train.resume's checkpoint, if any: the step this run starts at."""
        path = resume.checkpoint(self.cfg.train.resume, self.output_dir, say=self.dist.main)
        if path is None:
            return 0
        was, now = train_state.read_state(path), self._state()
        resume.check(path, was, now, self.plan.total)
        train_state.restore(path, self.model.draft, self.optimizer, self.scheduler, self.dist.rank)
        # a run extended (a larger train.max_steps) keeps its schedule: past its end, lr x min_lr_ratio
        self.schedule.total = was["schedule_total"]
        if self.dist.main:
            print(resume.note(path, was, now), file=sys.stderr)
        return was["step"]

    def _forward(self, model, batch, scale=1.0, training=False):
        # a CUDA graph cannot replay autocast's cache of casts
        with (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not (training and self.unroll.static))
              if self.cuda else contextlib.nullcontext()):
            return model(batch, self.unroll if training else self.eval_unroll, scale)

    def settle_buckets(self, batch: Batch) -> None:
        """DDP lays its buckets out again after a process's first backward, and 3+ ranks sum gradients in
        another order in each layout: one backward at the start, undone, keeps a resumed run bit-exact."""
        with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
            self._forward(self.ddp, self.feed.on_device(self.feed.prepared(batch)), training=True)[0].backward()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, batches: list[Batch], step: int = 0) -> StepResult:
        """One optimizer step over this rank's micro-batches (a non-finite one changes no weight)."""
        batches = [self.feed.prepared(b) for b in batches]
        loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        # torch.full passes the value as a kernel argument: no pageable copy, no sync
        denom = torch.full((), float(sum(b.plan.denominator for b in batches)), device=self.device)
        denom = self.dist.all_reduce(denom).clamp(min=1)
        metrics = torch.zeros(self.cfg.train.ttt_steps, len(METRICS), device=self.device)
        for a, batch in enumerate(batches):
            batch = self.feed.on_device(batch)
            if self.graphed is not None:
                loss, m = self.graphed(batch, self.dist.world / denom)
            else:
                with contextlib.nullcontext() if self.dist.world == 1 or a == len(batches) - 1 else self.ddp.no_sync():
                    loss, m, _ = self._forward(self.ddp, batch, self.dist.world / denom, training=True)
                    loss.backward()
            loss_bad |= ~torch.isfinite(loss.detach())
            metrics += m
        grad_norm = nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip)
        bad = self.nonfinite.track(loss_bad, grad_norm, step)
        masked_step(self.optimizer, bad)
        with warnings.catch_warnings():   # the schedule follows the step number, skipped or not: no stray warning
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")   # (a regex)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=self.graphed is None)   # a graph adds to the .grad it captured
        return StepResult(torch.where(bad, 0.0, metrics), grad_norm, bad)

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """The metrics on the held-out sequences (None without any), data rank r reading batches r, r + world, ..."""
        if not self.eval_refs:
            return None
        batches = pack(self.eval_refs, self.cfg.train.batch_tokens * self.layout.size)
        metrics = torch.zeros(self.cfg.train.ttt_steps, len(METRICS), device=self.device)
        reader, world, rank = self.reader, self.layout.data_world, self.layout.data_rank
        for first in range(0, len(batches), world):
            refs = batches[first + rank] if first + rank < len(batches) else []
            if not refs and not reader.lockstep:
                continue
            batch = self.feed.read(refs)   # staged online: a collective, so every rank reads, even nothing
            if batch is not None:
                metrics += self._forward(self.model, self.feed.on_device(self.feed.prepare(batch, training=False)))[1]
        return summarize(self.dist.all_reduce(metrics))

    def run(self) -> Path:
        t, total = self.cfg.train, self.plan.total
        batches = self.feed.batches(self.start_step)
        window = Window(torch.zeros(t.ttt_steps, len(METRICS), device=self.device))
        bar = tqdm(total=total, initial=self.start_step, unit="step", desc="train", disable=not self.dist.main)
        saved = None
        # staged online reads run here, after the queued draft work: finish it first, or it is timed as theirs
        settle = torch.cuda.synchronize if self.cuda and self.reader.lockstep else lambda: None
        with bar:   # closed however the loop ends, so that a last line printed after it stays last
            for step in range(self.start_step, total):
                settle()
                wait = time.perf_counter()
                micro = [next(batches) for _ in range(t.grad_accum)]
                window.waited += time.perf_counter() - wait
                if step == self.start_step and self.dist.world > 1:
                    self.settle_buckets(micro[0])
                window.tokens += sum(b.rows for b in micro)
                result = self.train_step(micro, step + 1)
                window.metrics += result.metrics
                del micro   # before the next step's micro-batches come: one step's on the device at a time
                saved = self._after_step(step + 1, result, window, bar) or saved
                bar.update(1)
        return self._finish(saved)

    def _after_step(self, done: int, result: StepResult, window: Window, bar: tqdm) -> Path | None:
        """The finite check, the log, evaluation and a checkpoint, each when due; the checkpoint."""
        t, debug, last = self.cfg.train, self.cfg.debug, done == self.plan.total
        if any(done % every == 0 for every in (debug.log_every, t.eval_every, t.checkpoint_every)) or last:
            self.nonfinite.check(self.output_dir, debug.skip_nonfinite)
        if done % debug.log_every == 0 or last:
            self._log(done, result, window, bar)
        if done % t.eval_every == 0 or last:
            if (evaluated := self.evaluate()) is not None:
                self.log.write({"step": done, "split": "eval", **evaluated})
        if done % t.checkpoint_every == 0 or last:
            return train_state.save(self.output_dir, done, self.model.draft, self.optimizer, self.scheduler,
                                    self._state(), self.dist, t.keep_checkpoints)
        return None

    def _log(self, done: int, result: StepResult, window: Window, bar: tqdm) -> None:
        """The train line of step `done` (all ranks' window since the last one), then a new window."""
        tokens_all = int(self.dist.all_reduce(torch.tensor(float(window.tokens), device=self.device)))
        elapsed = time.perf_counter() - window.clock
        rate = tokens_all / elapsed
        record = {"step": done, "split": "train", "lr": self.scheduler.get_last_lr()[0],
                  "grad_norm": float(result.grad_norm), "tokens_per_s": rate,
                  **(window.side_rates(self.reader, self.dist, tokens_all, elapsed) if self.online else {}),
                  "skipped_steps": int(self.nonfinite.skipped), **summarize(self.dist.all_reduce(window.metrics))}
        self.log.write(record)
        bar.set_postfix(loss=f"{record['loss'][0]:.3f}", acc0=f"{record['acc'][0]:.3f}", tok_s=f"{rate:,.0f}",
                        **({"target_tok_s": f"{record['target_tokens_per_s']:,.0f}",
                            "draft_tok_s": f"{record['draft_tokens_per_s']:,.0f}"} if self.online else {}))
        window.restart()
        self.nonfinite.skipped.zero_()

    def _finish(self, saved: Path | None) -> Path:
        """The export of the last checkpoint and the summary, once every rank is done."""
        saved = saved or train_state.latest(self.output_dir)
        failed = []
        if self.dist.main:
            written = {}
            for fmt in self.formats if saved is not None else ():   # one failing keeps the others
                try:
                    written |= export_all(saved, self.output_dir / "export", self.cfg, [fmt])
                    print(f"exported {fmt} draft: {written[fmt]}")
                except ExportError as e:
                    failed.append(f"the {fmt} export failed: {e}")
            print(self.log.summary(self.plan.total, saved, self.formats, self.cfg.evaluate.prompts))
            for line in serving_commands(train_state.read_state(saved), self.cfg, written) if written else ():
                print(line)
        self.dist.barrier()
        if failed:
            raise TrainError("; ".join(failed))
        return self.output_dir


def run(cfg: Config) -> Path:
    """Train; rank 0 owns train.output_dir meanwhile. A collective that fails because another rank is gone
    (or stuck) stops the run with the checkpoint to resume from."""
    try:
        with run_dir.lock(Path(cfg.train.output_dir), held=int(os.environ.get("RANK", "0")) == 0):
            return Trainer(cfg).run()
    except RuntimeError as e:
        lost = distributed.lost_peer(e, f"debug.collective_timeout_s = {cfg.debug.collective_timeout_s:g} s")
        if lost is None:
            raise
        raise distributed.lost_peer_error(
            TrainError, f"{lost}; training stopped, {run_dir.kept(cfg)}; the same command resumes") from None
    finally:
        distributed.teardown()


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    distributed.main(run, run_dir.kept, "Train an EAGLE-3 draft with training-time test.", argv, prog, "train")
