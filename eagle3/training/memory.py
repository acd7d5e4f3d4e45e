"""The training step's peak memory, estimated at start-up from the shapes, against what the device has: a run that
would not fit stops before its first step, naming the settings that lower it (docs/training.md)."""
from __future__ import annotations

import dataclasses
import os

import torch

from eagle3.config import Config
from eagle3.draft import DraftSpec, Eagle3Draft
from eagle3.errors import TrainError

# copies of a [rows, draft vocab] fp32 tensor that a TTT step keeps with the torch loss (logits, their softmax and
# log-softmax, the target's p and its gradient); the Triton loss streams the vocab in tiles and keeps none
VOCAB_COPIES = 3
# activations a draft layer keeps per row for its backward, in units of H (norms, residuals, concat, MLP out) and of
# the intermediate size (gate, up, their product); measured on the CPU (benchmarks/memory.py, a test holds it)
LAYER_H, LAYER_I = 14, 3
# shares of the available memory: a warning, and a refusal (on a GPU only well past it: the estimate is measured on
# the CPU, and CUDA's out-of-memory is a clean error where the CPU's is the kernel's OOM killer)
WARN, REFUSE = 0.8, {"cpu": 1.0, "cuda": 1.5}


@dataclasses.dataclass(frozen=True)
class Estimate:
    weights: int       # the draft's parameters (fp32) and the frozen embedding and head rows
    optimizer: int     # gradients and AdamW's two moments of the trainable parameters (fp32)
    activations: int   # what the K unrolled steps of one micro-batch keep for the backward

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.activations


def step_peak_bytes(spec: DraftSpec, cfg: Config, longest: int, cuda: bool) -> Estimate:
    """The peak of one training step on one rank: a micro-batch of train.batch_tokens rows (a context-parallel group
    holds one in all), K = train.ttt_steps steps; torch's kernels on the CPU (dense attention per sequence),
    Triton's on a GPU (bf16 activations, flash attention, the loss in vocab tiles); `longest`: the longest sequence
    trained, in rows."""
    t, rows = cfg.train, cfg.train.batch_tokens
    with torch.device("meta"):
        draft = Eagle3Draft(spec)
    total = sum(p.numel() for p in draft.parameters())
    trainable = total - (spec.draft_vocab_size * spec.hidden_size if cfg.experimental.freeze_lm_head else 0)
    frozen = (spec.target_vocab_size + spec.draft_vocab_size) * spec.hidden_size * (2 if cuda else 4)
    act = 2 if cuda else 4
    heads_width = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.kernel_head_dim()
    layer = (LAYER_H * spec.hidden_size + 2 * heads_width + LAYER_I * spec.intermediate_size) * act * spec.num_layers
    vocab = 0 if cuda else VOCAB_COPIES * spec.draft_vocab_size * 4
    # the CPU's dense attention keeps its probabilities [heads, L, L x (k + 1)] for a sequence of up to L rows
    attention = 0 if cuda else spec.num_attention_heads * longest * 4 * (t.ttt_steps + 1) / 2
    batch = (4 * spec.target_hidden_size + spec.draft_vocab_size) * 4   # aux and final states, the target's p
    per_row = t.ttt_steps * (layer + vocab + attention) + batch
    return Estimate(4 * total + frozen, 12 * trainable, int(rows * per_row))


def available_bytes(device: torch.device) -> tuple[int, str]:
    """(memory this process may use, what it is): the GPU's total, or the machine's available RAM."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"the GPU's {_gib(total)}"
    free = 0
    if os.path.exists("/proc/meminfo"):   # Linux: what new allocations can take without swapping
        with open("/proc/meminfo") as f:
            free = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), 0)
    return free, f"the {_gib(free)} of RAM available now"


def check(estimate: Estimate, available: tuple[int, str], cfg: Config, device: str = "cpu",
          ranks_here: int = 1) -> str | None:
    """Refuse a step that would not fit (TrainError), warn (the returned line) near the limit; None when it fits.
    `ranks_here`: processes of this node sharing the machine's RAM (the CPU)."""
    limit, what = available
    need = estimate.total * ranks_here
    if not limit or need < WARN * limit:
        return None
    t = cfg.train
    levers = (f"train.batch_tokens = {t.batch_tokens} (rows of a micro-batch), train.ttt_steps = {t.ttt_steps}, "
              f"vocab.draft_vocab_size, draft.intermediate_size")
    said = (f"{cfg.source}: one training step needs about {_gib(need)} (weights {_gib(estimate.weights)}, optimizer "
            f"{_gib(estimate.optimizer)}, activations {_gib(estimate.activations)}"
            f"{f' per rank, {ranks_here} ranks here' if ranks_here > 1 else ''}), against {what}")
    if need >= REFUSE[device] * limit:
        raise TrainError(f"{said}; lower {levers}, or train on a GPU (the Triton kernels keep no vocab-wide "
                         "logits and no attention scores)")
    return f"warning: {said}; if it runs out, lower {levers}"


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"
