"""The update of one RL iteration (Alg 3, lines 13-23): :func:`update` runs ``algo.ppo_epochs`` passes of minibatch
updates over the batch :func:`ema_pg.step.rl_step` collected and scored; :func:`minibatch_update` is one optimizer
step, over the minibatch's micro-batches (:func:`micro_batches`); an :class:`Updater` applies it, with the numerical
guard of every trainer (:class:`FiniteGuard`).

    for epoch in range(ppo_epochs):                  # a seeded order of minibatches
        for rows in minibatches:
            for r in micro_batches(rows):            # algo.max_tokens_per_microbatch
                cur  = head(policy, r, index=q_n)    # with grad
                kl   = estimator(KLInputs(...))      # (mb, T)
                loss = policy_loss(cur, old, adv, mask, kl)   # its share of the minibatch's aggregation
            updater.step(losses)                     # backward per micro-batch, then one optimizer step
            critic.update(rows)                      # PPO only
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .corrections import decoupled_weight, loglinear_prox, off_policy_sequence_mask
from .heads import head
from .kl import KLInputs
from .losses import LossSpec, Share, policy_loss
from .microbatches import micro_batches
from .rollout.base import Rollouts
from .scoring import OldAndAnchor, OldAndAnchorScorer


def update(it_seed: int, parts, batch: UpdateBatch, grad_ratio: bool = False) -> dict[str, float]:
    """``algo.ppo_epochs`` passes of minibatch updates (Alg 3, lines 13-23); the mean of each update's metrics.

    ``parts``: the run's :class:`ema_pg.step.StepParts`. ``grad_ratio``: also measure, on the first minibatch, the
    gradient norms of the loss's policy-gradient part and of its KL part (:class:`PgKlGrads`; two extra backward
    passes)."""
    algo, world = parts.algo, parts.world
    n_rows = len(batch.rollouts)
    minibatch = algo.minibatch_size // world.size or n_rows  # per rank
    order_gen = torch.Generator().manual_seed(it_seed)
    sums: dict[str, float] = {}
    diagnostics: dict[str, torch.Tensor] = {}
    n_updates = 0
    for _epoch in range(algo.ppo_epochs):
        order = torch.randperm(n_rows, generator=order_gen) if minibatch < n_rows else torch.arange(n_rows)
        for start in range(0, n_rows, minibatch):
            rows = order[start : start + minibatch].to(batch.mask.device)
            pg_kl = PgKlGrads(parts.policy) if grad_ratio and n_updates == 0 else None  # measured once, not averaged
            loss_metrics = minibatch_update(rows, parts, batch, pg_kl)
            if pg_kl is not None:
                diagnostics.update(pg_kl.norms())
            n_updates += 1
            for key, value in loss_metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
    metrics = {f"train/{key}": total / max(n_updates, 1) for key, total in sums.items()}
    metrics.update({f"train/{key}": float(v) for key, v in diagnostics.items()})
    metrics["train/skipped_steps"] = sums.get("skipped_steps", 0.0)  # a count, not a mean
    return metrics


def minibatch_update(rows: Tensor, parts, batch: UpdateBatch, pg_kl: PgKlGrads | None = None) -> dict[str, float]:
    """One optimizer step on the minibatch ``rows``, over its micro-batches (``algo.max_tokens_per_microbatch``):
    each one's forward, KL and loss (its share of the minibatch's aggregation, so the gradients add up to the whole
    minibatch's), then its backward, before the next one's forward; then the critic's step on the same rows."""
    algo, world, rollouts, mask = parts.algo, parts.world, batch.rollouts, batch.mask
    pieces = [rows[g] for g in micro_batches(rollouts.select(rows), algo.max_tokens_per_microbatch, world)]
    share = None if len(pieces) == 1 else Share(tokens=float(mask[rows].sum()), rows=len(rows))
    weight = 1.0
    if world.size > 1 and algo.loss_agg == "token-mean":  # the strategy averages over ranks: weigh
        n_tok = mask[rows].sum().float()                 # each rank's token mean by its share of tokens
        weight = world.size * n_tok / world.sum(n_tok).clamp(min=1)
    seen: list[dict] = []
    packings: list = []

    def losses():
        for r in pieces:
            loss, m, packing = _micro_batch_loss(r, parts, batch, share, pg_kl)
            packings.append(packing)
            loss = loss * weight
            m["loss"] = loss.detach()
            seen.append(m)
            yield loss

    out = parts.updater.step(losses(), count=len(pieces))
    metrics = {k: float(COMBINE.get(k, sum)(float(m[k]) for m in seen)) for k in (seen[0] if seen else {})}
    metrics.update(out)
    if parts.critic is not None and len(seen) == len(pieces):  # the value model's own update on the same rows
        metrics.update(parts.critic.update([(rollouts.select(r), batch.values[r], batch.returns[r], mask[r], p)
                                            for r, p in zip(pieces, packings)], share))
    return metrics


def _micro_batch_loss(r: Tensor, parts, batch: UpdateBatch, share: Share | None, pg_kl: PgKlGrads | None):
    """The loss of the micro-batch ``r`` (its share of the minibatch's), its metrics and its packing (None: padded)."""
    algo, scores, scorer, mask, adv = parts.algo, batch.scores, batch.scorer, batch.mask, batch.adv
    old, anchor = scores.old, scores.anchor
    sub = batch.rollouts.select(r)
    packing = scorer.pack(sub)  # None: the padded pass
    index = None if scores.index is None else scores.index[r]  # (mb, T, k)
    cur = head(parts.policy, sub, index=index, full_logits=scorer.full, temperature=parts.rollout.temperature,
               chunk=parts.chunk(sub.response_mask.numel()), entropy=algo.entropy_coef != 0, packing=packing)
    kl = None
    if batch.beta != 0.0 and algo.reward_kl == "none" and parts.estimator.name != "none":  # a token KL term
        kl = parts.estimator(KLInputs(
            logp=cur.logp, logp_old=old.logp[r], logp_ref=anchor.logp[r],
            tokens=sub.input_ids[:, sub.prompt_len:], topk_idx=index, topk_logp=cur.index_logp,
            topk_logp_ref=None if scores.anchor_index_logp is None else scores.anchor_index_logp[r],
            logits=cur.logits, ref_logits=None if anchor.logits is None else anchor.logits[r],
        ))  # (mb, T)
    pg_weight = None if batch.tis is None else batch.tis[r]
    if algo.opsm_delta is not None:  # DeepSeek-V3.2's mask: against the sampler's log-probs and the policy now
        behaviour = old.logp[r] if batch.rollouts.engine_logp is None else batch.rollouts.engine_logp[r]
        opsm = off_policy_sequence_mask(adv[r], cur.logp, behaviour, mask[r], algo.opsm_delta)
        pg_weight = opsm if pg_weight is None else pg_weight * opsm
    spec = batch.spec
    ref, pg_weight = _reference(batch, r, cur.logp, old.logp[r], mask[r], pg_weight)
    loss, m = policy_loss(cur.logp, ref, adv[r], mask[r], kl, beta=batch.beta, spec=spec, entropy=cur.entropy,
                        pg_weight=pg_weight, share=share)
    if algo.opsm_delta is not None:
        m["opsm_masked_seqs"] = (opsm[:, 0] == 0).sum().to(loss.dtype)  # a count: added over micro-batches
    if pg_kl is not None:
        without_kl, _ = policy_loss(cur.logp, ref, adv[r], mask[r], None, beta=0.0, spec=spec,
                                  entropy=cur.entropy, pg_weight=pg_weight, share=share)
        pg_kl.add(loss, without_kl)
    return loss, m, packing


def _reference(batch: UpdateBatch, r: Tensor, logp: Tensor, logp_old: Tensor, mask: Tensor, pg_weight: Tensor | None
               ) -> tuple[Tensor, Tensor | None]:
    """The ratio's reference for micro-batch ``r`` and its PG term's weights: pi_old; or decoupled PPO's proximal
    policy, recomputed as the step started (its behaviour weight is in ``batch.tis`` already) or log-linear
    (:func:`ema_pg.corrections.loglinear_prox`, from this pass's log-probs: its behaviour weight is taken here)."""
    p = batch.prox
    if p is None:
        return logp_old, pg_weight
    if p.alpha is None:
        return p.logp[r], pg_weight
    ref = loglinear_prox(logp_old, logp, p.alpha)
    w = decoupled_weight(ref, logp_old, mask, p.cap)
    return ref, w if pg_weight is None else pg_weight * w


@dataclass
class Proximal:
    """Decoupled PPO's proximal policy (``algo.decoupled``): its log-probs, (N, T), from a pass as the step started
    (``algo.prox_logp=recompute``), or the log-linear approximation's alpha and the behaviour weight's cap
    (``loglinear``)."""

    logp: Tensor | None = None
    alpha: float | None = None
    cap: float | None = None


@dataclass
class UpdateBatch:
    """One iteration's batch as the update reads it: the rollouts, their no-grad scores (pi_old, the anchor, the
    index set: :class:`ema_pg.scoring.OldAndAnchor`) and the scorer that made them (its packing and logits rule), the
    advantages and the loss mask, the engine-mismatch weights, PPO's values and returns, and the KL weight in
    force."""

    rollouts: Rollouts
    scores: OldAndAnchor  # pi_old's, the anchor's, the index set
    scorer: OldAndAnchorScorer  # its .pack(batch) and .full: how the update's passes score
    adv: Tensor  # (N,) or (N, T)
    mask: Tensor  # (N, T) the loss's: policy tokens, less DAPO's filtered truncations
    tis: Tensor | None  # (N, T) the rollout correction's weights on the PG term (None: none)
    values: Tensor | None  # (N, T) PPO's old values (algo.advantage=gae)
    returns: Tensor | None  # (N, T) their GAE returns
    beta: float  # the token KL's weight in force: the KL controller's, over the batch std under global_kl_scale
    spec: LossSpec  # the surrogate and its coefficients, built once per iteration from the algo record
    prox: Proximal | None = None  # decoupled PPO: the proximal policy, the ratio's reference


#: how a minibatch's metric combines its micro-batches' (the rest are shares that add up: losses, token means)
COMBINE = {"ratio_max": max, "ratio_min": min}


class PgKlGrads:
    """How much the KL term steers the update: the gradients of the loss without its KL term (the policy gradient,
    with the entropy bonus if any) and of the KL term alone (``loss`` minus that: the aggregation is linear), summed
    over a minibatch's micro-batches; :meth:`norms` gives their norms and ``kl_pg_grad_ratio`` = ||grad beta KL|| /
    ||grad J||. Each graph is kept for the update's own backward. On several processes, this rank's local
    gradients."""

    def __init__(self, policy):
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.pg: list[Tensor | None] = [None] * len(self.params)
        self.kl: list[Tensor | None] = [None] * len(self.params)

    def add(self, loss: Tensor, loss_without_kl: Tensor) -> None:
        for acc, x in ((self.pg, loss_without_kl), (self.kl, loss - loss_without_kl)):
            if not x.requires_grad:
                continue
            for i, g in enumerate(torch.autograd.grad(x, self.params, retain_graph=True, allow_unused=True)):
                if g is not None:
                    acc[i] = g if acc[i] is None else acc[i] + g

    def norms(self) -> dict[str, Tensor]:
        def norm(acc):
            gs = [g for g in acc if g is not None]
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in gs])) if gs else torch.zeros(())

        g_pg, g_kl = norm(self.pg), norm(self.kl)
        return {"grad_norm_pg": g_pg, "grad_norm_kl": g_kl, "kl_pg_grad_ratio": g_kl / g_pg.clamp(min=1e-30)}


# ---------------------------------------------------------------------- the optimizer side
class NonFiniteUpdates(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient; none of them was applied."""


class FiniteGuard:
    """The numerical guard of every :class:`Updater`: an update whose loss or gradient norm is not
    finite is skipped (no optimizer or scheduler step, gradients dropped), so the policy, the
    optimizer state and, through them, the anchor never see it. ``limit`` consecutive skips raise
    :class:`NonFiniteUpdates`; the run then stops at its last good checkpoint."""

    def __init__(self, limit: int):
        self.limit, self.consecutive = int(limit), 0

    def bad(self, loss: float, grad_norm: float = 0.0) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return False
        self.consecutive += 1
        if self.consecutive >= self.limit:
            raise NonFiniteUpdates(f"{self.consecutive} consecutive updates had a non-finite loss or gradient "
                                   f"(last: loss={loss}, grad_norm={grad_norm}); none was applied")
        return True

    def check_params(self, params) -> None:
        """After an update: a finite gradient can still make a parameter non-finite (float16 weights, where
        Adam's eps underflows to 0). The run stops at once, before anything is saved."""
        if not all(bool(torch.isfinite(p).all()) for p in params):
            raise NonFiniteUpdates("an update made parameters non-finite (float16 weights are the usual cause: "
                                   "Adam's eps underflows); nothing after the last checkpoint was saved")


class Updater:
    """Applies one gradient update for a loss, or for the losses of a minibatch's micro-batches, whose gradients
    accumulate (each loss carries its share of the minibatch's aggregation): zero grads; per loss the finite check
    and backward; the gradient norm, its check and clipping; the optimizer and LR steps; ``after_step``. The
    :class:`FiniteGuard` skips an update whose loss or gradient norm is not finite (nothing moves).

    One sequence for every trainer; how a step reaches the model is the subclass's: :class:`TorchUpdater` (a plain
    torch optimizer: tests, benchmarks, scripts) and the Lightning module's (``ema_pg.engine.module``: backward and
    clipping through the strategy; under DeepSpeed the engine clips and reports the norm after its step)."""

    norm_after_step = False  #: the gradient norm is known only after the optimizer step (DeepSpeed's engine)

    def __init__(self, max_bad_steps: int, after_step: Callable[[], None] | None = None):
        self.guard = FiniteGuard(max_bad_steps)
        self.after_step = after_step  # run after every applied optimizer step (an anchor's soft sync counts them)

    def step(self, losses, count: int | None = None) -> dict[str, float]:
        """``losses``: a loss tensor, or an iterable of ``count`` of them (a generator computes each micro-batch's
        forward only when the one before it has gone backward: memory holds one micro-batch's graph)."""
        if isinstance(losses, Tensor):
            losses, count = [losses], 1
        if count is None:
            raise ValueError("Updater.step: give the number of losses an iterable yields (count)")
        self._zero()
        total = 0.0
        for i, loss in enumerate(losses):
            value = self._loss_value(loss)
            if not math.isfinite(value):
                self.guard.bad(value)  # raises at the limit
                self._zero()
                return {"skipped_steps": 1.0}
            total += value
            self._backward(loss, last=i == count - 1)
        if self.norm_after_step:
            self.guard.bad(total)
            self._opt_step()
            norm = self._norm()
        else:
            norm = self._norm()
            if self.guard.bad(total, norm):
                self._zero()
                return {"skipped_steps": 1.0, "grad_norm": norm}
            self._clip(norm)
            self._opt_step()
            self._check_params()
        self._sched_step()
        if self.after_step is not None:
            self.after_step()
        return {"grad_norm": norm, "skipped_steps": 0.0}

    # how a step reaches the model (``last``: the backward that ends the accumulation, where a reduction happens)
    def _zero(self) -> None: ...
    def _loss_value(self, loss: Tensor) -> float: return float(loss.detach())
    def _backward(self, loss: Tensor, last: bool) -> None: ...
    def _norm(self) -> float: ...
    def _clip(self, norm: float) -> None: ...
    def _opt_step(self) -> None: ...
    def _check_params(self) -> None: ...
    def _sched_step(self) -> None: ...

    @property
    def lr(self) -> float: ...


class TorchUpdater(Updater):
    """:class:`Updater` over a plain torch optimizer (tests, benchmarks, scripts)."""

    def __init__(self, params, optimizer: torch.optim.Optimizer, scheduler=None, grad_clip: float = 0.0,
                 max_bad_steps: int = 3, after_step: Callable[[], None] | None = None):
        super().__init__(max_bad_steps, after_step)
        self.params, self.opt, self.sched, self.grad_clip = list(params), optimizer, scheduler, grad_clip

    def _zero(self):
        self.opt.zero_grad(set_to_none=True)

    def _backward(self, loss, last):
        loss.backward()

    def _norm(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        self._total_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        return float(self._total_norm)

    def _clip(self, norm):
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, self._total_norm)

    def _opt_step(self):
        self.opt.step()

    def _check_params(self):
        self.guard.check_params(self.params)

    def _sched_step(self):
        if self.sched is not None:
            self.sched.step()

    @property
    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])
