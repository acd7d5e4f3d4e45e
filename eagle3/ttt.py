"""Training-time test: the K-step unrolled draft, its targets, masks, loss and metrics.

Rows are packed tokens. At step k, row t reads the embedding of x[t+1+k], is trained towards
p[t+1+k] (the target's distribution for x[t+2+k]) and is valid when t+2+k is inside its sequence,
loss_mask[t+2+k] = 1 and the target's greedy token g[t+1+k] is in the draft vocab. The mask moves
with the targets at every step (SpecForge issue 885 is the bug of not moving it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3 import linear
from eagle3.data.batch import Batch, RowPlan, RowRule
from eagle3.draft import Rows
from eagle3.ops import gather_rows, positions_from_cu_seqlens, scatter_rows

# per-step metric sums; "accepted" (leading correct steps of each start row) only in step 0's row;
# "alpha" / "alpha_greedy": each counted row's expected acceptance of its draft token (probabilistic
# proposals: Σ_v min(p_v, q_v); greedy ones: p(argmax q)), 0 where the target's token is out of vocab
METRICS = ("loss_sum", "valid", "correct", "acc_rows", "cond_correct", "cond_rows", "accepted", "alpha",
           "alpha_greedy")


@dataclass(frozen=True)
class Objective:
    """Recipe levers of the training objective, beside the unroll itself (K, decay)."""
    rows: RowRule = RowRule()   # rows trained besides in-vocab assistant rows (prompt: loss_mask-0 labels)
    loss: str = "kl"            # the per-row loss (kernels.reference.LOSSES): kl, tv, nla, lk_hybrid, pq
    temperature: float = 1.0    # p and q both at this temperature in the loss (the serving temperature)
    eta: float = 3.0            # lk_hybrid's blend: lambda = exp(-eta * alpha)


@dataclass
class StepTargets:
    index: torch.Tensor      # [T] row of x[t+1+k] / p[t+1+k] / g[t+1+k] (clamped into range)
    valid: torch.Tensor      # [T] bool: trained at this step
    acc_rows: torch.Tensor   # [T] bool: counted for accuracy (loss_mask[t+2+k] = 1, in range)
    in_vocab: torch.Tensor   # [T] bool: the target's greedy token g[t+1+k] is in the draft vocab


def row_layout(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each packed row in its sequence, that sequence's length), both [T]."""
    lengths = cu_seqlens.diff()
    return positions_from_cu_seqlens(cu_seqlens, T), torch.repeat_interleave(lengths, lengths, output_size=T)


def label_rows(k: int, positions: torch.Tensor, seq_len: torch.Tensor, loss_mask: torch.Tensor,
               prompt: bool = False) -> torch.Tensor:
    """[T] bool: at step k, row t's label x[t+2+k] is inside its sequence and an assistant token
    (any token with `prompt`)."""
    T = positions.shape[0]
    inside = positions + 2 + k < seq_len
    if prompt:
        return inside
    label_row = (torch.arange(T, device=positions.device) + 2 + k).clamp(max=T - 1)
    return inside & loss_mask[label_row].bool()


def step_targets(k: int, positions: torch.Tensor, seq_len: torch.Tensor, loss_mask: torch.Tensor,
                 greedy: torch.Tensor, t2d: torch.Tensor, rule: RowRule = RowRule()) -> StepTargets:
    """Step k's label rows: assistant rows count for accuracy; those whose target greedy token is
    outside the draft vocab (the draft cannot be right there) are not trained and always count as
    misses; prompt rows are trained only with `rule.prompt`."""
    T = positions.shape[0]
    index = (torch.arange(T, device=positions.device) + 1 + k).clamp(max=T - 1)
    acc_rows = label_rows(k, positions, seq_len, loss_mask)
    trained = label_rows(k, positions, seq_len, loss_mask, prompt=True) if rule.prompt else acc_rows
    in_vocab = t2d[greedy[index].long()]
    valid = trained & in_vocab
    return StepTargets(index, valid, acc_rows, in_vocab)


def target_probs(final_hidden: torch.Tensor, head_rows: torch.Tensor, steps: int,
                 temperature: float = 1.0) -> torch.Tensor:
    """p over the draft vocab, once per batch for all steps: softmax(final @ W_t[t2d].T / temperature),
    shifted up by one row and padded so that step k's targets are the view `probs[k : k + T]` (no
    copy).
    Returns [T + steps, V_d] in the compute dtype (rows past the end are zero and never valid)."""
    T = final_hidden.shape[0]
    probs = final_hidden.new_zeros(T + steps, head_rows.shape[0])
    logits = (final_hidden[1:] @ head_rows.T).float()
    p = torch.softmax(logits if temperature == 1 else logits / temperature, dim=-1)    # [T - 1, V_d]
    probs[:T - 1] = p
    return probs


def loss_denominator(batch: Batch, rule: RowRule = RowRule()) -> torch.Tensor:
    """The loss's normaliser: rows whose step-0 label x[t+2] is an assistant token (any token with
    `rule.prompt`)."""
    positions, seq_len = row_layout(batch.cu_seqlens, batch.rows)
    return label_rows(0, positions, seq_len, batch.loss_mask, rule.prompt).sum()


def all_step_targets(batch: Batch, steps: int, t2d: torch.Tensor, rule: RowRule = RowRule()) -> list[StepTargets]:
    positions, seq_len = row_layout(batch.cu_seqlens, batch.rows)
    return [step_targets(k, positions, seq_len, batch.loss_mask, batch.target_argmax.long(), t2d, rule)
            for k in range(steps)]


def live_rows(targets: list[StepTargets]) -> list[torch.Tensor]:
    """Per step, the rows whose work can still reach the loss: row t is live at step k when it is
    valid at some step >= k (its chain feeds nobody else's loss after step 0). [N_k] indices,
    nested: live rows of step k+1 are live at step k. Computing them costs one host sync per
    step; the trainer finds them on the CPU with the batch instead (`plan_rows`)."""
    alive = torch.stack([tg.valid for tg in targets]).flip(0).cummax(0).values.flip(0)
    return [a.nonzero().flatten() for a in alive]


def loss_rows(targets: list[StepTargets], live: list) -> list[torch.Tensor]:
    """Per step, the valid rows as indices into the rows the step keeps (all T rows, or live[k]):
    what the loss computes. Found on the host with the batch, they spare the loss a sync per step."""
    return [(tg.valid if r is None else tg.valid[r]).nonzero().flatten() for tg, r in zip(targets, live)]


def plan_rows(batch: Batch, steps: int, t2d: torch.Tensor, skip_dead_rows: bool = True,
              rule: RowRule = RowRule(), targets: list[StepTargets] | None = None) -> RowPlan:
    """The batch's row plan (see `RowPlan`), wherever the batch and t2d are (the host, in training);
    `targets`: the batch's `all_step_targets`, when the caller has them already."""
    targets = targets or all_step_targets(batch, steps, t2d, rule)
    live = live_rows(targets) if skip_dead_rows else None
    return RowPlan(steps, rule, live, loss_rows(targets, live or [None] * steps), int(loss_denominator(batch, rule)))


def ttt_forward(draft, batch: Batch, embed: torch.Tensor, head_rows: torch.Tensor, steps: int,
                attention, loss_steps, decay: float = 0.8, scale: float | torch.Tensor = 1.0,
                skip_dead_rows: bool = True, objective: Objective = Objective()):
    """Unrolled TTT over one packed micro-batch.

    batch: on the draft's device; its row plan is used when it was made for this unroll (steps,
    skip_dead_rows, rows trained) and found here otherwise.
    embed: frozen target embedding [V_t, H]; head_rows: target lm_head rows of the draft vocab
    [V_d, H]. `attention` and `loss_steps` have the signatures of `kernels.ttt_attention`
    and `kernels.ttt_loss_steps` (`loss_steps` is passed `p_rows` by keyword). With skip_dead_rows,
    work that cannot reach the loss is skipped (exactly: same loss and gradients): at step 0 every
    row makes its keys and values but only live rows run the rest; from step 1 on only live rows are
    computed at all. `objective` holds
    the recipe levers (rows trained, the loss); prepared live/loss rows must follow its row rule.
    Returns (Σ_k decay^k · scale · Σ_valid loss_k, metric sums [steps, METRICS], per-row detail): the
    accepted-length sum in step 0's row only; the detail holds, per
    row, `correct` [steps, T] and `accepted` [T] (leading correct steps), for evaluation.
    """
    ids, greedy = batch.input_ids.long(), batch.target_argmax.long()
    T = batch.rows
    targets = all_step_targets(batch, steps, draft.t2d, objective.rows)
    positions = row_layout(batch.cu_seqlens, T)[0]
    plan = batch.plan
    if plan is None or not plan.fits(steps, skip_dead_rows, objective.rows):
        plan = plan_rows(batch, steps, draft.t2d, skip_dead_rows, objective.rows, targets)
    live = plan.live or [None] * steps
    probs = target_probs(batch.final_hidden, head_rows, steps, objective.temperature)
    kept = []
    # the kernels read the boundaries on the host: a host copy, when the trainer gives one, saves a sync
    cu_attention = batch.cu_seqlens_host if batch.cu_seqlens_host is not None else batch.cu_seqlens.to(torch.int32)

    def next_inputs(k: int, h: torch.Tensor):
        """Step k reads x[t+1+k] at position t+k; its rows carry the chains still alive."""
        if k == steps or (k > 0 and live[k] is not None and live[k].numel() == 0):
            return None   # nothing reaches the loss any more (step 0 always runs: DDP wants every parameter used)
        rows = _step_rows(k, live, T)
        computed = rows.computed if rows.computed is not None else slice(None)
        if k > 0 and rows.computed is not None:
            h = gather_rows(h, torch.searchsorted(kept[-1], rows.computed) if kept[-1] is not None else rows.computed)
        kept.append(rows.kept_global())
        return h, embed[ids[targets[k].index[computed]]], positions[computed] + k, rows

    with linear.casts_reused():   # each weight cast once for the K steps, its gradients summed by the GEMMs
        head_inputs = [draft.head_input(h).to(embed.dtype)      # the loss runs in the compute dtype
                       for h in draft.unroll(batch.aux_hidden, attention, cu_attention, next_inputs)]
    done = len(head_inputs)
    # step k's targets: rows k .. k+T-1 of probs (a view), or its kept rows shifted by k, read in place
    ps, p_rows = zip(*[(probs[k:k + T], None) if r is None else (probs, r + k) for k, r in enumerate(kept)])
    total, losses, argmaxes, alphas = loss_steps(
        head_inputs, draft.lm_head.weight.to(embed.dtype), list(ps), plan.loss[:done],
        [decay ** k * scale for k in range(done)], p_rows=list(p_rows), loss=objective.loss,
        temperature=objective.temperature, eta=objective.eta)
    missing = steps - done
    losses = [scatter_rows(x, r, T, 0) for x, r in zip(losses, kept)] + [total.new_zeros(T)] * missing
    alphas = [scatter_rows(x, r, T, 0) for x, r in zip(alphas, kept)] + [total.new_zeros(T)] * missing
    argmaxes = [scatter_rows(x, r, T, -1) for x, r in zip(argmaxes, kept)] + [greedy.new_full((T,), -1)] * missing
    return (total, *step_metrics(targets, losses, argmaxes, alphas, probs, greedy, draft.d2t))


def _step_rows(k: int, live: list, T: int) -> Rows:
    if live[k] is None:
        return Rows(T)
    return Rows(T, kept=live[0]) if k == 0 else Rows(T, computed=live[k])


def step_metrics(targets: list[StepTargets], losses, argmaxes, alphas, probs, greedy, d2t) -> tuple[torch.Tensor, dict]:
    """Per-step sums on the device (no host sync), the METRICS columns; and the per-row detail
    (correct per step, leading correct steps). probs [T + steps, V_d]: the loss's targets, for the
    greedy-proposal acceptance p(argmax q)."""
    metrics = torch.zeros(len(targets), len(METRICS), device=greedy.device)
    run = torch.ones_like(greedy, dtype=torch.bool)
    accepted = torch.zeros_like(greedy)
    corrects = []
    for k, (tg, loss, argmax, alpha) in enumerate(zip(targets, losses, argmaxes, alphas)):
        counted = tg.valid & tg.acc_rows & tg.in_vocab
        correct = counted & (argmax + d2t[argmax.clamp(min=0)] == greedy[tg.index])
        p_top = probs[k:k + len(argmax)].gather(1, argmax.clamp(min=0).unsqueeze(1)).squeeze(1)
        metrics[k, :6] = torch.stack([loss.detach().sum(), tg.valid.sum(), correct.sum(), tg.acc_rows.sum(),
                                      (correct & run).sum(), (tg.acc_rows & run).sum()]).float()
        metrics[k, 7:] = torch.stack([torch.where(counted, alpha, 0).sum(), torch.where(counted, p_top.float(), 0).sum()])
        run = run & correct
        accepted += run
        corrects.append(correct)
    metrics[0, 6] = accepted.sum()
    return metrics, {"correct": torch.stack(corrects), "accepted": accepted, "start": targets[0].acc_rows}


def summarize(metrics: torch.Tensor) -> dict:
    """Metric sums [steps, METRICS] (over batches/ranks) -> per-step loss, accuracy, conditional
    accuracy, expected acceptance of both proposal kinds, and the acceptance-length estimate
    tau = 1 + mean leading correct steps over start rows."""
    m = metrics.double().cpu()
    steps = m.shape[0]
    ratio = lambda a, b: (a / b).item() if b > 0 else float("nan")  # noqa: E731
    out = {"loss": [ratio(m[k, 0], m[k, 1]) for k in range(steps)],
           "acc": [ratio(m[k, 2], m[k, 3]) for k in range(steps)],
           "cond_acc": [ratio(m[k, 4], m[k, 5]) for k in range(steps)],
           "alpha": [ratio(m[k, 7], m[k, 3]) for k in range(steps)],
           "alpha_greedy": [ratio(m[k, 8], m[k, 3]) for k in range(steps)],
           "rows": [int(m[k, 3]) for k in range(steps)]}
    out["accept_len"] = 1 + ratio(m[0, 6], m[0, 3]) if m[0, 3] > 0 else float("nan")
    return out
