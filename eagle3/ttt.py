"""Training-time test: the K-step unrolled draft, its targets, masks, loss and metrics. At step k packed row t reads
x[t+1+k], is trained towards p[t+1+k] and is valid where its label is an in-vocab assistant token (docs/ttt.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3 import linear
from eagle3.data.batch import Batch, RowPlan, RowRule
from eagle3.draft import Rows
from eagle3.models.vision import media_positions
from eagle3.ops import gather_rows, positions_from_cu_seqlens, scatter_rows

# per-step metric sums; "accepted" (leading correct steps) in step 0's row only; "alpha" / "alpha_greedy":
# a row's expected acceptance of its draft token, Σ_v min(p_v, q_v) / p(argmax q)
METRICS = ("loss_sum", "valid", "correct", "acc_rows", "cond_correct", "cond_rows", "accepted", "alpha", "alpha_greedy")


@dataclass(frozen=True)
class Objective:
    """Recipe levers of the training objective besides K and the decay."""
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


def batch_layout(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_layout` of the rows the batch computes (of a `split` batch: its slice of the whole one's)."""
    if batch.part is None:
        return row_layout(batch.cu_seqlens, batch.rows)
    start = batch.part.start
    return tuple(x[start:start + batch.rows] for x in row_layout(batch.cu_seqlens, batch.part.total))


def label_rows(k: int, positions: torch.Tensor, seq_len: torch.Tensor, loss_mask: torch.Tensor,
               prompt: bool = False) -> torch.Tensor:
    """[T] bool: at step k, row t's label x[t+2+k] is inside its sequence and (unless `prompt`) an assistant token;
    loss_mask may run past the T rows (a `split` batch's)."""
    T = positions.shape[0]
    inside = positions + 2 + k < seq_len
    if prompt:
        return inside
    label_row = (torch.arange(T, device=positions.device) + 2 + k).clamp(max=loss_mask.shape[0] - 1)
    return inside & loss_mask[label_row].bool()


def step_targets(k: int, positions: torch.Tensor, seq_len: torch.Tensor, loss_mask: torch.Tensor,
                 greedy: torch.Tensor, t2d: torch.Tensor, rule: RowRule = RowRule()) -> StepTargets:
    """Step k's label rows; rows whose greedy token is outside the draft vocab are not trained and count as misses.
    greedy and loss_mask may run past the T rows (a `split` batch's)."""
    T = positions.shape[0]
    index = (torch.arange(T, device=positions.device) + 1 + k).clamp(max=greedy.shape[0] - 1)
    acc_rows = label_rows(k, positions, seq_len, loss_mask)
    trained = label_rows(k, positions, seq_len, loss_mask, prompt=True) if rule.prompt else acc_rows
    in_vocab = t2d[greedy[index].long()]
    return StepTargets(index, trained & in_vocab, acc_rows, in_vocab)


def target_probs(final_hidden: torch.Tensor, head_rows: torch.Tensor, steps: int,
                 temperature: float = 1.0) -> torch.Tensor:
    """softmax(final @ W_t[t2d].T / temperature) [T + steps, V_d], shifted up a row so that step k's targets are the
    view `probs[k : k + T]`, padded with uniform rows (never valid, finite under every loss)."""
    T = final_hidden.shape[0]
    probs = final_hidden.new_full((T + steps, head_rows.shape[0]), 1 / head_rows.shape[0])
    logits = (final_hidden[1:] @ head_rows.T).float()
    probs[:T - 1] = torch.softmax(logits if temperature == 1 else logits / temperature, dim=-1)
    return probs


def loss_denominator(batch: Batch, rule: RowRule = RowRule(), layout: tuple | None = None) -> torch.Tensor:
    """The loss's normaliser: rows whose step-0 label x[t+2] is an assistant token (any with `rule.prompt`);
    `layout`: the batch's `batch_layout`, when the caller has it."""
    positions, seq_len = layout or batch_layout(batch)
    return label_rows(0, positions, seq_len, batch.loss_mask, rule.prompt).sum()


def all_step_targets(batch: Batch, steps: int, t2d: torch.Tensor, rule: RowRule = RowRule(),
                     layout: tuple | None = None) -> list[StepTargets]:
    positions, seq_len = layout or batch_layout(batch)
    return [step_targets(k, positions, seq_len, batch.loss_mask, batch.target_argmax.long(), t2d, rule)
            for k in range(steps)]


def plan_rows(batch: Batch, steps: int, t2d: torch.Tensor, skip_dead_rows: bool = True,
              rule: RowRule = RowRule(), targets: list[StepTargets] | None = None,
              layout: tuple | None = None) -> RowPlan:
    """The batch's `RowPlan`, wherever the batch and t2d are (the host, in training: no sync per step)."""
    layout = layout or batch_layout(batch)
    targets = targets or all_step_targets(batch, steps, t2d, rule, layout)
    live = None
    if skip_dead_rows:   # row t is live at step k when valid at some step >= k: nested, [N_k] each
        alive = torch.stack([tg.valid for tg in targets]).flip(0).cummax(0).values.flip(0)
        if batch.part is not None:   # a `split` batch's rank runs every step (its group's exchange), no kernel empty
            alive[:, 0] = True
        live = [a.nonzero().flatten() for a in alive]
    # per step, the valid rows as indices into the rows the step keeps (all T, or live[k])
    loss = [(tg.valid if r is None else tg.valid[r]).nonzero().flatten()
            for tg, r in zip(targets, live or [None] * steps)]
    return RowPlan(steps, rule, live, loss, int(loss_denominator(batch, rule, layout)))


def token_inputs(embed: torch.Tensor, ids: torch.Tensor, media_embeds: torch.Tensor | None,
                 media_pad: int | None, loss_mask: torch.Tensor | None = None):
    """index [N] -> the draft's token embeddings of ids[index] [N, H]: the embedding table's rows, but at the media
    placeholders (`media_positions`: the pad id in the prompts, loss_mask 0) the target's vision rows when
    `media_pad` (SGLang's rule) is set and the batch carries them."""
    if media_pad is None or media_embeds is None or media_embeds.shape[0] == 0:
        return lambda index: embed[ids[index]]
    pads = media_positions(ids, media_pad, None if loss_mask is None else loss_mask == 0)
    slot = (pads.long().cumsum(0) - 1).clamp(min=0)   # [T]: each placeholder's row of media_embeds
    rows = media_embeds.to(embed.dtype)
    # a select, not a boolean index: no host sync, static shapes for CUDA graphs
    return lambda index: torch.where(pads[index][:, None], rows[slot[index]], embed[ids[index]])


def ttt_forward(draft, batch: Batch, embed: torch.Tensor, head_rows: torch.Tensor, steps: int,
                attention, loss_steps, decay: float = 0.8, scale: float | torch.Tensor = 1.0,
                skip_dead_rows: bool = True, objective: Objective = Objective(), static: bool = False,
                media_pad: int | None = None):
    """Unrolled TTT over one packed micro-batch -> (Σ_k decay^k · scale · Σ_valid loss_k, metric sums, per-row detail);
    skip_dead_rows skips work that cannot reach the loss; `static`: every row computed, nothing read on the host;
    `media_pad`: the placeholder id whose rows read the batch's `media_embeds` (`token_inputs`)."""
    ids, greedy = batch.input_ids.long(), batch.target_argmax.long()
    T = batch.rows
    layout = batch_layout(batch)   # (positions, sequence lengths) of the batch's rows
    targets = all_step_targets(batch, steps, draft.t2d, objective.rows, layout)
    positions = layout[0]
    plan = batch.plan
    if not static and (plan is None or not plan.fits(steps, skip_dead_rows, objective.rows)):
        plan = plan_rows(batch, steps, draft.t2d, skip_dead_rows, objective.rows, targets, layout)
    live = [None] * steps if static else plan.live or [None] * steps
    probs = target_probs(batch.final_hidden, head_rows, steps, objective.temperature)
    tokens = token_inputs(embed, ids, batch.media_embeds, media_pad, batch.loss_mask)
    kept = []
    # the kernels read the boundaries on the host: a host copy, when the trainer gives one, saves a sync
    cu_attention = (batch.cu_attention if batch.cu_attention is not None else batch.cu_seqlens_host
                    if batch.cu_seqlens_host is not None else batch.cu_seqlens.to(torch.int32))

    def next_inputs(k: int, h: torch.Tensor):
        if k == steps or (k > 0 and live[k] is not None and live[k].numel() == 0):
            return None   # nothing reaches the loss any more (step 0 always runs: DDP wants every parameter used)
        rows = Rows(T) if live[k] is None else Rows(T, kept=live[0]) if k == 0 else Rows(T, computed=live[k])
        computed = rows.computed if rows.computed is not None else slice(None)
        if k > 0 and rows.computed is not None:
            h = gather_rows(h, torch.searchsorted(kept[-1], rows.computed) if kept[-1] is not None else rows.computed)
        kept.append(rows.kept_global())
        return h, tokens(targets[k].index[computed]), positions[computed] + k, rows

    with linear.casts_reused():   # each weight cast once for the K steps, its gradients summed by the GEMMs
        head_inputs = [draft.head_input(h).to(embed.dtype)      # the loss runs in the compute dtype
                       for h in draft.unroll(batch.aux_hidden, attention, cu_attention, next_inputs)]
    done = len(head_inputs)
    # step k's targets: rows k .. k+T-1 of probs (a view), or its kept rows shifted by k, read in place
    ps, p_rows = zip(*[(probs[k:k + T], None) if r is None else (probs, r + k) for k, r in enumerate(kept)])
    weights = [decay ** k * scale for k in range(done)]
    if static:   # per-row weights, 0 where not valid, instead of the rows' indices
        valid, weights = [None] * done, [tg.valid * w for tg, w in zip(targets, weights)]
    else:
        valid = plan.loss[:done]
    total, losses, argmaxes, alphas = loss_steps(
        head_inputs, draft.lm_head.weight.to(embed.dtype), list(ps), valid, weights, p_rows=list(p_rows),
        loss=objective.loss, temperature=objective.temperature, eta=objective.eta)
    missing = steps - done
    losses = [scatter_rows(x, r, T, 0) for x, r in zip(losses, kept)] + [total.new_zeros(T)] * missing
    alphas = [scatter_rows(x, r, T, 0) for x, r in zip(alphas, kept)] + [total.new_zeros(T)] * missing
    argmaxes = [scatter_rows(x, r, T, -1) for x, r in zip(argmaxes, kept)] + [greedy.new_full((T,), -1)] * missing
    return (total, *step_metrics(targets, losses, argmaxes, alphas, probs, greedy, draft.d2t))


def step_metrics(targets: list[StepTargets], losses, argmaxes, alphas, probs, greedy, d2t) -> tuple[torch.Tensor, dict]:
    """Per-step sums of the METRICS columns on the device (no host sync), and the per-row detail."""
    metrics = torch.zeros(len(targets), len(METRICS), device=greedy.device)
    run = torch.ones_like(targets[0].valid)   # [T] (greedy may run past the rows: a `split` batch's)
    accepted = torch.zeros_like(run, dtype=greedy.dtype)
    corrects = []
    for k, (tg, loss, argmax, alpha) in enumerate(zip(targets, losses, argmaxes, alphas)):
        counted = tg.valid & tg.acc_rows & tg.in_vocab
        correct = counted & (argmax + d2t[argmax.clamp(min=0)] == greedy[tg.index])
        p_top = probs[k:k + len(argmax)].gather(1, argmax.clamp(min=0).unsqueeze(1)).squeeze(1)
        metrics[k, :6] = torch.stack([torch.where(tg.valid, loss.detach(), 0).sum(), tg.valid.sum(), correct.sum(),
                                      tg.acc_rows.sum(), (correct & run).sum(), (tg.acc_rows & run).sum()]).float()
        metrics[k, 7:] = torch.stack([torch.where(counted, alpha, 0).sum(),
                                      torch.where(counted, p_top.float(), 0).sum()])
        run = run & correct
        accepted += run
        corrects.append(correct)
    metrics[0, 6] = accepted.sum()
    return metrics, {"correct": torch.stack(corrects), "accepted": accepted, "start": targets[0].acc_rows}


def summarize(metrics: torch.Tensor) -> dict:
    """Metric sums [steps, METRICS] -> per-step loss, accuracy, conditional accuracy, expected acceptance
    of both proposal kinds, and tau = 1 + mean leading correct steps over start rows."""
    m = metrics.double().cpu()
    ratio = lambda a, b: (a / b).item() if b > 0 else float("nan")  # noqa: E731
    columns = {"loss": (0, 1), "acc": (2, 3), "cond_acc": (4, 5), "alpha": (7, 3), "alpha_greedy": (8, 3)}
    out = {name: [ratio(m[k, a], m[k, b]) for k in range(m.shape[0])] for name, (a, b) in columns.items()}
    out["rows"] = [int(m[k, 3]) for k in range(m.shape[0])]
    out["accept_len"] = 1 + ratio(m[0, 6], m[0, 3]) if m[0, 3] > 0 else float("nan")
    return out
