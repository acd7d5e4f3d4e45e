"""The training loop: DDP over the draft's trainable parameters, token-budget micro-batches,
gradient accumulation, AdamW with warmup + wsd or cosine, evaluation, logging, checkpoints, export.

Works as one plain process and under `torchrun --nproc_per_node N` (NCCL on GPUs, gloo on CPU).
The global batch of optimizer step s is the same whatever the number of ranks: micro-batch
`s * world * accum + a * world + rank` of the epoch's packing goes to `rank` as its a-th.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

from eagle3 import checkpoint as ckpt_io
from eagle3 import distributed, float8
from eagle3.config import Config, ConfigError
from eagle3.data.batch import Batch, RowRule
from eagle3.data.batching import Prefetcher, one_ahead, pack, split_holdout
from eagle3.data.errors import InputError
from eagle3.data.online import OnlineReader, stream_note
from eagle3.data.shards import DataError, ShardReader, check_manifest, loss_token_counts
from eagle3.draft import Eagle3Draft
from eagle3.export import export_all
from eagle3.resolve import resolve
from eagle3.files import relock, run_lock, strict_json, writable_dir
from eagle3.models.checkpoint import Checkpoint, TargetError
from eagle3.ttt import METRICS, Objective, plan_rows, summarize, ttt_forward
from eagle3.vocab import VocabError, build_vocab


class TrainError(ValueError):
    pass


# Settings a resumed run must share with its checkpoint: data order and learning-rate schedule.
# (train.grad_accum may change with the world size: their product, the global batch, must not.)
# (train.max_steps may be raised to extend a run: the LR schedule keeps the total it was built with.)
RESUME_FIXED = ("seed", "batch_tokens", "eval_fraction", "epochs", "ttt_steps",
                "loss_decay", "lr", "min_lr_ratio", "warmup_steps", "schedule", "decay_fraction", "betas",
                "weight_decay", "prompt_rows")
# how the head starts and whether it trains: a change alters the optimizer's parameters
HEAD_FIXED = ("lm_head_init", "freeze_lm_head")


class TTTModel(nn.Module):
    """The unit DDP wraps: the draft plus the TTT unroll as its forward."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, batch, embed, head_rows, steps, attention, loss_steps, decay, scale, skip, objective):
        return ttt_forward(self.draft, batch, embed, head_rows, steps, attention, loss_steps, decay, scale,
                           skip, objective)


TRITON_HEAD_DIMS = (64, 128)


def select_kernels(choice: str, device: torch.device, head_dim: int, where: str = "config"):
    """(attention, loss over all steps) with the signatures of kernels/reference.py: Triton, or torch (on CUDA the
    established recipe of `kernels.flex`, on the CPU the reference). "auto" takes Triton on CUDA;
    the Triton attention serves head dims 64 and 128 only, so another head dim keeps flex
    attention under "auto" and is an error under "triton"."""
    use_triton = choice == "triton" or (choice == "auto" and device.type == "cuda")
    if not use_triton and device.type == "cuda":   # the established recipe: flex + compiled loss
        from kernels.flex import ttt_attention, ttt_loss_steps
        return ttt_attention, ttt_loss_steps
    if not use_triton:
        from kernels.reference import ttt_attention, ttt_loss_steps
        return ttt_attention, ttt_loss_steps
    from kernels import ttt_attention, ttt_loss_steps
    if head_dim not in TRITON_HEAD_DIMS:
        if choice == "triton":
            raise TrainError(f"{where}: debug.kernels = \"triton\" needs draft.head_dim in {TRITON_HEAD_DIMS}, "
                             f"got {head_dim}; set debug.kernels = \"auto\" or \"torch\", or draft.head_dim")
        print(f"note: draft.head_dim = {head_dim} is not served by the Triton attention "
              f"{TRITON_HEAD_DIMS}; using flex_attention", file=sys.stderr)
        from kernels.flex import ttt_attention
    return ttt_attention, ttt_loss_steps


class Schedule:
    """Linear warmup to lr, then to lr * min_lr_ratio at the last step (LambdaLR factor): by a
    cosine over all the steps after warmup, or (`wsd`) at lr until the last `decay_fraction` of the
    steps and linearly down over those."""

    def __init__(self, warmup: int, total: int, min_ratio: float, kind: str = "cosine", decay_fraction: float = 0.2):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        self.kind, self.decay_fraction = kind, decay_fraction

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "wsd":   # the decay starts after warmup, however large decay_fraction is
            start = max(self.warmup, self.total - max(1, round(self.decay_fraction * self.total)))
            progress = min(1.0, max(0, step - start) / max(1, self.total - start))
            return 1 - (1 - self.min_ratio) * progress
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def masked_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step() unless `skip` (a bool tensor). A fused AdamW (ours on CUDA) reads the flag on
    the device, as GradScaler's found_inf: no host sync per step. Other optimizers (ours on the CPU)
    read it on the host, where that costs nothing."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = skip.float()
        optimizer.step()
    elif not bool(skip):
        optimizer.step()


CAUSES = {1: "loss", 2: "gradient norm", 3: "loss and gradient norm"}


class Plan:
    """Which micro-batches each rank reads at each optimizer step (a pure function of the step)."""

    def __init__(self, refs, budget: int, seed: int, world: int, accum: int, max_steps: int, epochs: int,
                 data: str = "the data"):
        self.refs, self.budget, self.seed, self.per_step = refs, budget, seed, world * accum
        self.world, self.accum = world, accum
        self._epochs: dict[int, list] = {}
        self._steps: dict[int, int] = {}
        if len(self.epoch(0)) < self.per_step:
            tokens = sum(r.length for r in refs)
            raise TrainError(f"{data}: its training split ({len(refs)} sequences, {tokens} tokens) packs into "
                             f"{len(self.epoch(0))} micro-batches of train.batch_tokens = {budget}, fewer than "
                             f"one optimizer step needs (world size {world} x train.grad_accum {accum}); use more "
                             "data, or a smaller train.batch_tokens, train.grad_accum or train.eval_fraction")
        self.total = max_steps or sum(self.steps_in(e) for e in range(epochs))

    def epoch(self, e: int) -> list:
        if e not in self._epochs:
            self._epochs = {e: pack(self.refs, self.budget, self.seed, e)}
        return self._epochs[e]

    def steps_in(self, e: int) -> int:
        if e not in self._steps:
            self._steps[e] = len(self.epoch(e)) // self.per_step
        return self._steps[e]

    def locate(self, step: int) -> tuple[int, int]:
        e = 0
        while step >= self.steps_in(e):
            step -= self.steps_in(e)
            e += 1
        return e, step

    def rank_batches(self, start: int, rank: int):
        """This rank's micro-batches for steps start..total-1, in order."""
        for step in range(start, self.total):
            e, j = self.locate(step)
            batches = self.epoch(e)
            for a in range(self.accum):
                yield batches[j * self.per_step + a * self.world + rank]


def _logged_step(line: str) -> float:
    """Step of a metrics.jsonl line; a line torn by a kill counts as after any checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def _num(value) -> str:
    return "nan" if value is None else f"{value:.4f}"


class MetricsLog:
    """metrics.jsonl on rank 0 (and TensorBoard when installed)."""

    def __init__(self, output_dir: Path, start_step: int, enabled: bool):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        if self.path.exists():  # a resumed run drops what the killed run logged after its checkpoint
            kept = [ln for ln in self.path.read_text().splitlines() if _logged_step(ln) <= start_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(output_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(strict_json(record) + "\n")
        if self.tb is not None:
            prefix = record.get("split", "train")
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"{prefix}/{key}", value, record["step"])
                elif isinstance(value, list):
                    for k, v in enumerate(value):
                        self.tb.add_scalar(f"{prefix}/{key}_{k}", v, record["step"])


def existing_run(output_dir: Path) -> list[str]:
    """What in `output_dir` belongs to an earlier run: step directories, metrics.jsonl, export/."""
    steps = sorted(p.name for p in ckpt_io.checkpoints_dir(output_dir).glob("step-*"))
    more = f" and {len(steps) - 1} older" if len(steps) > 1 else ""
    held = [f"checkpoints/{steps[-1]}{more}"] if steps else []
    return held + [name for name in ("metrics.jsonl", "export") if (output_dir / name).exists()]


OLD_RUN = ".old-%Y%m%d-%H%M%S"   # strftime suffix of an output_dir moved aside by train.resume = "overwrite"


def refuse_existing_run(output_dir: Path, source: str) -> None:
    """train.resume = "never" starts a new run: writing it into an old run's directory would truncate
    its metrics and leave its checkpoints beside the new ones, where resume = "auto" picks them."""
    held = existing_run(output_dir)
    if held:
        raise TrainError(f"{source}: train.resume = \"never\", but train.output_dir {output_dir} already holds a "
                         f"run ({', '.join(held)}); choose another train.output_dir, or set train.resume = \"overwrite\", "
                         f"which moves the old run, whole, to {output_dir}.old-YYYYmmdd-HHMMSS "
                         "and starts the new one in an empty directory (nothing was deleted)")


def move_old_run(output_dir: Path) -> Path | None:
    """train.resume = "overwrite": rename an output_dir that holds a run to `<output_dir>.old-<time>`, whole,
    so that the new run starts in an empty directory and the two never mix. Rank 0 only."""
    if not existing_run(output_dir):
        return None
    stamp = time.strftime(OLD_RUN)
    moved, n = output_dir.with_name(output_dir.name + stamp), 1
    while moved.exists():   # two overwrites within one second
        moved, n = output_dir.with_name(f"{output_dir.name}{stamp}-{n}"), n + 1
    try:
        output_dir.rename(moved)
    except OSError as e:
        raise TrainError(f"{output_dir}: train.resume = \"overwrite\", but moving the old run to {moved} failed "
                         f"({e.strerror or e}); nothing was deleted: move or remove it yourself, or choose "
                         "another train.output_dir") from None
    print(f"train.resume = overwrite: moved the old run in {output_dir} to {moved}", file=sys.stderr)
    return moved


def fp8_changes(state: dict, float8: bool, float8_head: bool) -> str:
    """What a resumed run does differently in fp8 from the checkpoint's steps so far ("" if nothing;
    auto on another GPU kind, say)."""
    said = ""
    for key, now, what in (("float8_used", float8, "fp8 GEMMs (train.float8)"),
                           ("float8_head_used", float8_head, "fp8 head GEMMs (train.float8_head)")):
        if state[key] != now:
            said += (f"; its steps so far ran {'with' if state[key] else 'without'} {what}, "
                     f"from here {'with' if now else 'without'}")
    return said


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg, t = cfg, cfg.train
        self.dist = distributed.setup(cfg.debug.train_device, cfg.debug.collective_timeout_s)
        self.device = self.dist.device
        self.cuda = self.device.type == "cuda"
        self.float_dtype = torch.bfloat16 if self.cuda else torch.float32
        torch.manual_seed(t.seed)
        self.output_dir = Path(t.output_dir)
        if t.resume in ("never", "overwrite"):
            if t.resume == "overwrite":   # rank 0 moves the old run before any other rank looks at the directory
                if self.dist.main:
                    move_old_run(self.output_dir)
                    relock(self.output_dir, "train.output_dir", "train", TrainError)
                self.dist.barrier()
            refuse_existing_run(self.output_dir, cfg.source)
        writable_dir(self.output_dir, TrainError, "train.output_dir")

        self.target = Checkpoint(cfg.target.path)
        text = self.target.config
        self.resolved = resolve(cfg, self.target)
        self.data_dir = Path(self.resolved.data_dir)
        self.reader = self._reader(cfg)

        spec = self.resolved.draft_spec
        d2t, t2d = build_vocab(loss_token_counts(self.reader.manifest), text.vocab_size, spec.draft_vocab_size)
        draft = Eagle3Draft(spec)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        self.t2d_cpu = t2d
        if self.cuda and cfg.debug.compile_ops:
            draft.compile_elementwise()
        self.float8 = float8.choose(t.float8, self.device, spec, cfg.source, say=self.dist.main)
        if self.float8:
            draft.use_float8()
        # the target's head rows of the draft vocab in their stored precision (tied: the embedding's)
        target_rows = self.target.get("lm_head.weight")[t2d]
        self.init_head(draft, target_rows)
        self.model = TTTModel(draft).to(self.device)
        self.embed = self.target.get("embed_tokens.weight").to(self.device, self.float_dtype)
        self.head_rows = target_rows.to(self.device, self.float_dtype)

        train_refs, self.eval_refs = split_holdout(self.reader.sequences, t.eval_fraction)
        longest = max(r.length for r in self.reader.sequences)
        if longest > t.batch_tokens:
            raise TrainError(f"{cfg.source}: train.batch_tokens = {t.batch_tokens} is smaller than the "
                             f"longest sequence ({longest} tokens); raise it or lower data.max_seq_len")
        source = self.reader.manifest.get("source", {}).get("path", "?")
        self.plan = Plan(train_refs, t.batch_tokens, t.seed, self.dist.world, t.grad_accum, t.max_steps, t.epochs,
                         data=f"data.path {source} (online)" if self.online else
                         f"train.data_dir {self.data_dir} (extracted from data.path {source})")

        # a frozen lm_head is in neither the optimizer, gradient clipping nor DDP's buckets
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                           fused=self.cuda)
        self.schedule = Schedule(t.warmup_steps, self.plan.total, t.min_lr_ratio, t.schedule, t.decay_fraction)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        # the model is initialised alike on every rank; any draw from here on differs by rank
        torch.manual_seed(t.seed + 1_000_003 * self.dist.rank)
        self.attention, self.loss_steps = select_kernels(cfg.debug.kernels, self.device, spec.head_dim, cfg.source)
        plain = self.loss_steps
        self.loss_steps = float8.head_loss(t.float8_head, self.float8, plain, self.device, spec, cfg.source,
                                           say=self.dist.main)
        self.float8_head = self.loss_steps is not plain
        self.start_step = self._maybe_resume()
        self.ddp = self.model
        if self.dist.world > 1:
            # device_ids=None: batches are already on the device, and DDP moving the inputs would
            # turn the host-side copies the step keeps (sequence boundaries) into device tensors
            self.ddp = nn.parallel.DistributedDataParallel(
                self.model, device_ids=None, broadcast_buffers=False, gradient_as_bucket_view=True)
        self.log = MetricsLog(self.output_dir, self.start_step, self.dist.main)
        # first non-finite step and its cause (CAUSES), steps skipped since the last log; on the device
        self.first_nonfinite = torch.full((2,), -1, dtype=torch.long, device=self.device)
        self.skipped = torch.zeros((), dtype=torch.long, device=self.device)

    def init_head(self, draft: Eagle3Draft, target_rows: torch.Tensor) -> None:
        """experimental.lm_head_init and experimental.freeze_lm_head: "target" copies the target's rows [V_d, H]
        into the fp32 master exactly (from the stored tensor, before any cast to the compute dtype);
        a frozen head gets no gradient, no optimizer state and no weight-gradient work in the loss."""
        head = draft.lm_head.weight
        if self.cfg.experimental.lm_head_init == "target":
            if target_rows.shape != head.shape:
                raise TrainError(f"{self.cfg.source}: experimental.lm_head_init = \"target\": the target's head rows are "
                                 f"{list(target_rows.shape)}, the draft's lm_head is {list(head.shape)}")
            with torch.no_grad():
                head.copy_(target_rows)
        if self.cfg.experimental.freeze_lm_head:
            head.requires_grad_(False)
            if self.cfg.experimental.lm_head_init == "random" and self.dist.main:
                print("warning: experimental.freeze_lm_head = true with experimental.lm_head_init = \"random\": the draft's "
                      "lm_head stays random and is never trained; use lm_head_init = \"target\" or "
                      "freeze_lm_head = false", file=sys.stderr)

    def _reader(self, cfg: Config) -> ShardReader | OnlineReader:
        """Where the micro-batches come from: the shards, or (online) the target run on data.path."""
        self.online = cfg.train.source == "online"
        if self.online:   # each rank streams the target on its own micro-batches, on the training device
            if cfg.train.online_target == "stream" and self.dist.main:
                print(stream_note(self.target, self.device), file=sys.stderr)
            return OnlineReader(cfg, self.target, self.resolved.aux_layer_ids, self.device)
        reader = ShardReader(self.data_dir)
        check_manifest(reader.manifest, self.target.config, self.resolved.aux_layer_ids, self.data_dir)
        return reader

    def _side_rates(self, tokens_all: int, elapsed: float) -> dict:
        """Online, which side bounds the run (all ranks, since the last log): the target's tokens/s
        over its forward's busy time, the draft's over the loop's time not spent waiting for batches."""
        if not self.online:
            return {}
        totals = (self.reader.totals.tokens, self.reader.totals.seconds)
        since = [now - before for now, before in zip(totals, self.target_totals)]
        self.target_totals = totals
        made = self.dist.all_reduce(torch.tensor([float(since[0]), since[1]], device=self.device))
        busy = float(made[1]) / self.dist.world
        return {"target_tokens_per_s": float(made[0]) / busy if busy else float("nan"),
                "draft_tokens_per_s": tokens_all / max(elapsed - self.waited, 1e-9)}

    def _state(self) -> dict:
        return {"config": self.cfg.to_dict(), "resolved": self.resolved.to_dict(),
                "target": self.target.config.identity(), "target_architectures": self.target.config.architectures,
                "world_size": self.dist.world, "schedule_total": self.schedule.total,
                # what train.float8 and train.float8_head (auto: the GPU) resolved to
                "float8_used": self.float8, "float8_head_used": self.float8_head}

    def _maybe_resume(self) -> int:
        choice = self.cfg.train.resume
        path = None if choice in ("never", "overwrite") else Path(choice)
        if choice == "auto":
            path, skipped = ckpt_io.latest_readable(self.output_dir)
            if skipped and path is None:   # starting over would write into a run that is there
                raise ckpt_io.CheckpointError("no checkpoint of the run reads any more: " + "; ".join(
                    f"{bad}: {why}" for bad, why in skipped) + f"; {ckpt_io.ELSEWHERE}")
            for bad, why in skipped if self.dist.main else ():
                print(f"warning: resume skips {bad}, which no longer reads ({why}); resuming from {path}",
                      file=sys.stderr)
        if path is None:
            return 0
        state = ckpt_io.read_state(path)
        now = self._state()
        was = {**state["resolved"], "target": state["target"]}
        for key, value in {**now["resolved"], "target": now["target"]}.items():
            if key != "verifier_name" and was[key] != value:   # the verifier is only a name in the export
                raise TrainError(f"{path}/state.json: {key} differs from this run's ({was[key]} vs "
                                 f"{value}); choose another train.output_dir to start a new run")
        self._check_global_batch(path, state)
        fixed = [("experimental", key) for key in HEAD_FIXED] + [("train", key) for key in RESUME_FIXED]
        for section, key in fixed:   # the trainable parameters, the data order and the LR schedule followed
            was = state["config"][section][key]
            if key == "decay_fraction" and now["config"]["train"]["schedule"] == "cosine":
                continue   # the cosine does not read it (and a changed schedule is refused above)
            if was != now["config"][section][key]:
                raise TrainError(f"{path}/state.json: {section}.{key} was {json.dumps(was)}, this run "
                                 f"has {json.dumps(now['config'][section][key])}; a resumed run must keep it (set "
                                 f"--{section}.{key} {json.dumps(was)} to resume it, or choose another "
                                 "train.output_dir to start a new run)")
        self._check_end(path, state)
        ckpt_io.restore(path, self.model.draft, self.optimizer, self.scheduler, self.dist.rank)
        # a run extended past its old end (a larger train.max_steps) keeps the schedule it was built
        # with: steps past that end run at its final learning rate, lr x min_lr_ratio
        self.schedule.total = state["schedule_total"]
        if self.dist.main:
            was = (state["world_size"], state["config"]["train"]["grad_accum"])
            other = (f"; written by world size {was[0]} x train.grad_accum {was[1]}, now {self.dist.world} x "
                     f"{self.cfg.train.grad_accum}: the same global batch" if was[0] != self.dist.world else "")
            other += fp8_changes(state, self.float8, self.float8_head)
            print(f"resumed from {path} (step {state['step']}{other})", file=sys.stderr)
        return state["step"]

    def _check_end(self, path: Path, state: dict) -> None:
        """train.max_steps may extend a run, never end it before its checkpoint."""
        if self.plan.total >= state["step"]:
            return
        raise TrainError(f"{path}/state.json: the checkpoint is at step {state['step']}, but this run ends at step "
                         f"{self.plan.total} (train.max_steps = {self.cfg.train.max_steps}); a resumed run may raise "
                         f"train.max_steps to extend the run, not end before its checkpoint: set train.max_steps >= "
                         f"{state['step']}, resume from an earlier checkpoint (train.resume = DIR), or choose another "
                         "train.output_dir to start a new run")

    def _check_global_batch(self, path: Path, state: dict) -> None:
        """Another world size resumes when world size x train.grad_accum is the checkpoint's: the plan
        then gives optimizer step s the same micro-batches (s*world*accum .. +world*accum-1 of the
        epoch's packing) and the loss is normalised over the whole step across ranks."""
        was_world, was_accum = state["world_size"], state["config"]["train"]["grad_accum"]
        world, accum = self.dist.world, self.cfg.train.grad_accum
        if was_world * was_accum == world * accum:
            return
        product = was_world * was_accum
        keep = (f"train.grad_accum = {product // world} keeps it" if product % world == 0 else
                f"no train.grad_accum keeps it on {world} ranks (use a number of ranks that divides {product})")
        raise TrainError(f"{path}/state.json: the checkpoint's global batch is world size {was_world} x "
                         f"train.grad_accum {was_accum} = {product} micro-batches per step, this run's is world size "
                         f"{world} x train.grad_accum {accum} = {world * accum}; a resumed run must keep it: "
                         f"{keep} (or choose another train.output_dir to start a new run)")

    def _autocast(self):
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, model, batch, scale=1.0, training=False):
        t = self.cfg.train
        objective = Objective(self.row_rule(training), loss=t.loss, temperature=t.loss_temperature,
                              eta=self.cfg.experimental.lk_eta)
        with self._autocast():
            return model(batch, self.embed, self.head_rows, t.ttt_steps, self.attention, self.loss_steps,
                         t.loss_decay, scale, self.cfg.debug.skip_dead_rows, objective)

    def row_rule(self, training: bool) -> RowRule:
        """The rows the loss trains; evaluation measures on assistant rows only (no prompt rows)."""
        return RowRule(self.cfg.train.prompt_rows and training)

    def prepare_batch(self, batch: Batch, training: bool = True) -> Batch:
        """Host-side work on a batch read from the shards, done by the prefetch thread off the step's
        critical path: what the step would otherwise sync (or spend CPU time) to learn: the row
        plan (moved to the device with the batch) and the sequence boundaries (kept on the host)."""
        t = self.cfg.train
        plan = plan_rows(batch, t.ttt_steps, self.t2d_cpu, self.cfg.debug.skip_dead_rows, self.row_rule(training))
        return dataclasses.replace(batch, plan=plan, cu_seqlens_host=batch.cu_seqlens.to(torch.int32))

    def prefetcher(self, start: int) -> Prefetcher:
        """This rank's micro-batches from optimizer step `start` on, read ahead. On CUDA the prefetch
        thread also prepares them; on the CPU the step prepares its own, since a second thread
        doing tensor work there competes with the training for the same cores."""
        return Prefetcher(self.reader, self.plan.rank_batches(start, self.dist.rank), self.cfg.debug.prefetch,
                          pin=self.cuda, prepare=self.prepare_batch if self.cuda else None,
                          together=self.cfg.train.grad_accum)

    def device_batches(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """The micro-batches on the training device, each copied (from pinned host memory, on a CUDA
        stream of its own) while the work before it computes: the next micro-batch's copy is started
        before the current one is handed over, and the compute stream waits for a copy only when the
        step takes that micro-batch (`_on_device`). On the compute stream the copies ran in stream
        order with every SM idle: about 17 ms of a 0.9 s Kimi-size step. Device memory: the step's
        micro-batches and one more. Elsewhere, and for online readers, the batches as they come
        (pulling one ahead would move a staged target's collective read out of step with the other
        ranks; for the stream and resident placements the overlap is unmeasured, so left out)."""
        if not self.cuda or self.online:
            yield from batches
            return
        stream = torch.cuda.Stream(self.device)

        def start(batch: Batch) -> Batch:
            with torch.cuda.stream(stream):
                moved = self._on_device(self._prepared(batch))
                return dataclasses.replace(moved, ready=stream.record_event())

        yield from one_ahead(batches, start)

    def _prepared(self, batch: Batch) -> Batch:
        """The batch as `prepare_batch` leaves it (the prefetcher's work, done here if it was not)."""
        return batch if batch.plan is not None else self.prepare_batch(batch)

    def settle_buckets(self, batch: Batch) -> None:
        """DDP lays its gradient buckets out again after a process's first backward (in the order
        the gradients became ready), and 3 or more ranks' gradients are summed in another order in
        each layout: a run resumed from a checkpoint would round its first step unlike the run it
        continues (6e-8 apart on 4 CPU ranks). One backward at the start of every process, its
        gradients dropped and its random draws undone, puts every step of every process in the
        rebuilt layout."""
        with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
            self._forward(self.ddp, self._on_device(self._prepared(batch)), training=True)[0].backward()
        self.optimizer.zero_grad(set_to_none=True)

    def _on_device(self, batch: Batch) -> Batch:
        """The batch on the training device: copied here, or (`device_batches`) its copy on the
        copy stream waited for by this stream, which from now on also owns its memory."""
        if batch.ready is None:
            return batch.to(self.device, self.float_dtype)
        here = torch.cuda.current_stream(self.device)
        here.wait_event(batch.ready)
        for t in batch.device_tensors():   # allocated on the copy stream, used and freed on this one
            t.record_stream(here)
        return dataclasses.replace(batch, ready=None)

    def train_step(self, batches: list[Batch], step: int = 0) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the metric sums [K, 7] (zeros
        for a step with a non-finite loss or gradient norm, which changes no weight)."""
        batches = [self._prepared(b) for b in batches]
        loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        # torch.full passes the value as a kernel argument: no pageable copy, no sync
        denom = torch.full((), float(sum(b.plan.denominator for b in batches)), device=self.device)
        denom = self.dist.all_reduce(denom).clamp(min=1)
        metrics = torch.zeros(self.cfg.train.ttt_steps, len(METRICS), device=self.device)
        for a, batch in enumerate(batches):
            batch = self._on_device(batch)
            sync = self.dist.world == 1 or a == len(batches) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                loss, m, _ = self._forward(self.ddp, batch, self.dist.world / denom, training=True)
                loss.backward()
            loss_bad |= ~torch.isfinite(loss.detach())
            metrics += m
        self.grad_norm = nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip)
        bad = self._track_nonfinite(loss_bad, step)
        masked_step(self.optimizer, bad)
        self.scheduler.step()   # the schedule follows the step number, skipped or not
        self.optimizer.zero_grad(set_to_none=True)
        return torch.where(bad, 0.0, metrics)

    def _track_nonfinite(self, loss_bad: torch.Tensor, step: int) -> torch.Tensor:
        """Whether this step's loss (on any rank) or gradient norm is non-finite, as a device flag:
        reading it here would cost a host sync every step on CUDA, so the first such step is kept on
        the device and `check_finite` reads it at log, eval and checkpoint steps."""
        flags = self.dist.all_reduce(torch.stack((loss_bad, ~torch.isfinite(self.grad_norm))).float())
        bad = flags.sum() > 0
        cause = (flags[0] > 0).long() + 2 * (flags[1] > 0).long()
        here = torch.stack((torch.full((), step, dtype=torch.long, device=self.device), cause))
        self.first_nonfinite = torch.where(bad & (self.first_nonfinite[0] < 0), here, self.first_nonfinite)
        self.skipped += bad
        return bad

    def check_finite(self) -> None:
        """Stop at the first non-finite step unless debug.skip_nonfinite; called before anything
        is logged or saved, so the newest checkpoint stays the last good one."""
        step, cause = self.first_nonfinite.tolist()
        if step < 0 or self.cfg.debug.skip_nonfinite:
            return
        last = ckpt_io.latest(self.output_dir)
        kept = f"the newest checkpoint, {last}, is the last good one" if last else "no checkpoint was written"
        raise TrainError(f"{self.output_dir}: step {step}: non-finite {CAUSES[cause]}; training stopped, {kept} "
                         "(rerun resumes from it: lower train.lr or train.grad_clip, check the data, or set "
                         "debug.skip_nonfinite = true to skip such steps)")

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        if not self.eval_refs:
            return None
        batches = pack(self.eval_refs, self.cfg.train.batch_tokens)
        metrics = torch.zeros(self.cfg.train.ttt_steps, len(METRICS), device=self.device)
        reader, world, rank = self.reader, self.dist.world, self.dist.rank
        for first in range(0, len(batches), world):   # rank r reads batches r, r + world, ...
            refs = batches[first + rank] if first + rank < len(batches) else []
            if not refs and not reader.lockstep:
                continue
            batch = reader.read(refs)   # staged online: a collective, so every rank reads, even nothing
            if batch is not None:
                metrics += self._forward(self.model, self._on_device(self.prepare_batch(batch, training=False)))[1]
        return summarize(self.dist.all_reduce(metrics))

    def run(self) -> Path:
        t, total = self.cfg.train, self.plan.total
        batches = self.device_batches(self.prefetcher(self.start_step))
        window = torch.zeros(t.ttt_steps, len(METRICS), device=self.device)
        tokens, clock, self.waited, self.target_totals = 0, time.perf_counter(), 0.0, (0, 0.0)
        bar = tqdm(total=total, initial=self.start_step, unit="step", desc="train", disable=not self.dist.main)
        saved = None
        # staged online reads run here, after the queued draft work: finish it first, or it is timed as theirs
        settle = torch.cuda.synchronize if self.cuda and self.reader.lockstep else lambda: None
        for step in range(self.start_step, total):
            settle()
            wait = time.perf_counter()
            micro = [next(batches) for _ in range(t.grad_accum)]
            self.waited += time.perf_counter() - wait
            if step == self.start_step and self.dist.world > 1:
                self.settle_buckets(micro[0])
            tokens += sum(b.rows for b in micro)
            done = step + 1
            window += self.train_step(micro, done)
            del micro   # before the next step's micro-batches come: one step's on the device at a time
            if any(done % every == 0 for every in (self.cfg.debug.log_every, t.eval_every, t.checkpoint_every)) or done == total:
                self.check_finite()
            if done % self.cfg.debug.log_every == 0 or done == total:
                tokens_all = int(self.dist.all_reduce(torch.tensor(float(tokens), device=self.device)))
                elapsed = time.perf_counter() - clock
                rate = tokens_all / elapsed
                record = {"step": done, "split": "train", "lr": self.scheduler.get_last_lr()[0],
                          "grad_norm": float(self.grad_norm), "tokens_per_s": rate, **self._side_rates(tokens_all, elapsed),
                          "skipped_steps": int(self.skipped), **summarize(self.dist.all_reduce(window))}
                self.log.write(record)
                bar.set_postfix(loss=f"{record['loss'][0]:.3f}", acc0=f"{record['acc'][0]:.3f}",
                                tok_s=f"{rate:,.0f}", **({"target_tok_s": f"{record['target_tokens_per_s']:,.0f}",
                                                          "draft_tok_s": f"{record['draft_tokens_per_s']:,.0f}"}
                                                         if self.online else {}))
                window.zero_()
                self.skipped.zero_()
                tokens, clock, self.waited = 0, time.perf_counter(), 0.0
            if done % t.eval_every == 0 or done == total:
                result = self.evaluate()
                if result is not None:
                    self.log.write({"step": done, "split": "eval", **result})
            if done % t.checkpoint_every == 0 or done == total:
                saved = ckpt_io.save(self.output_dir, done, self.model.draft, self.optimizer, self.scheduler,
                                     self._state(), self.dist, t.keep_checkpoints)
            bar.update(1)
        bar.close()
        saved = saved or ckpt_io.latest(self.output_dir)
        if self.dist.main and saved is not None:
            exported = export_all(saved, self.output_dir / "export", self.cfg)
            for fmt, path in exported.items():
                print(f"exported {fmt} draft: {path}")
        if self.dist.main:
            print(self.summary(saved))
        self.dist.barrier()
        return self.output_dir

    def summary(self, saved: Path | None) -> str:
        """Where the run ended and where its files are; read back from metrics.jsonl, so that a rerun
        of a finished run says the same."""
        records = [json.loads(ln) for ln in self.log.path.read_text().splitlines()] if self.log.path.exists() else []
        last = {r["split"]: r for r in records}
        lines = [f"train: done, step {self.plan.total} in {self.output_dir}"]
        for split, name in (("train", "train"), ("eval", "held-out")):
            if split in last:
                r = last[split]
                estimate = f", accept_len {_num(r['accept_len'])}" if split == "eval" else ""
                lines.append(f"  {name} (step {r['step']}{estimate}), per TTT step: loss "
                             f"{' '.join(_num(x) for x in r['loss'])}; accuracy {' '.join(_num(x) for x in r['acc'])}")
        skipped = sum(r.get("skipped_steps", 0) for r in records if r["split"] == "train")
        if skipped:
            lines.append(f"  skipped steps (non-finite loss or gradient norm, debug.skip_nonfinite): {skipped}")
        lines.append(f"  metrics: {self.log.path}")
        lines.append(f"  last checkpoint: {saved}")
        lines += [f"  {fmt} export: {self.output_dir / 'export' / fmt}" for fmt in self.cfg.export.formats
                  if (self.output_dir / "export" / fmt).is_dir()]
        if self.log.tb is not None:
            lines.append(f"  tensorboard: {self.output_dir / 'tensorboard'}")
        if saved is not None:   # training draws no plot: evaluate does, with real decoding when given prompts
            lines.append(f"  plot and real decoding: python -m eagle3 evaluate {saved} --prompts PROMPTS.jsonl "
                         "(writes eval.json and eval.png there; the checkpoint's own settings)")
        return "\n".join(lines)


def kept(cfg: Config) -> str:
    """What a run stopped midway leaves to resume from, as its last line says it."""
    newest = ckpt_io.latest(cfg.train.output_dir)
    return f"newest complete checkpoint {newest}" if newest else "no checkpoint written yet"


def run(cfg: Config) -> Path:
    """Train; rank 0 owns train.output_dir meanwhile (a second run on it stops at once). A collective
    that fails because another rank is gone (or stuck past debug.collective_timeout_s) stops the run
    here, with the checkpoint to resume from instead of torch's traceback."""
    main_rank = int(os.environ.get("RANK", "0")) == 0
    try:
        with run_lock(Path(cfg.train.output_dir), "train.output_dir", "train", TrainError, held=main_rank):
            return Trainer(cfg).run()
    except RuntimeError as e:
        lost = distributed.lost_peer(e, f"debug.collective_timeout_s = {cfg.debug.collective_timeout_s:g} s")
        if lost is None:
            raise
        raise TrainError(f"{lost}; training stopped, {kept(cfg)}; the same command resumes") from None
    finally:
        distributed.teardown()


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    from eagle3.config import cli, interrupted
    cfg = cli(argv, "Train an EAGLE-3 draft with training-time test.", prog)
    distributed.stop_on_sigterm(lambda: kept(cfg))
    try:
        run(cfg)
    except (TargetError, DataError, InputError, VocabError, TrainError, ConfigError, ckpt_io.CheckpointError) as e:
        raise SystemExit(distributed.first_word(f"error: {e}")) from None
    except KeyboardInterrupt:
        interrupted(kept(cfg))
