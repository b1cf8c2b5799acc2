"""One RL iteration of Algorithm 3 as a plain function: :func:`rl_step`. No Lightning here.

    prompts  = task.sample(B)                                   # B prompts, seeded by (seed, iteration)
    rollouts = sampler.generate(policy, prompts, n=G)           # B*G responses; pi_old's scores if it can
    rewards  = task.reward(...)                                 # (B*G,); DAPO: refill flat groups
    scores   = OldAndAnchorScorer(...)(policy, anchor, rollouts)  # pi_old, anchor, the index set q_n
    rewards  = shape_rewards(...)                               # DAPO's overlong penalty, WARP's sequence KL
    adv      = ADVANTAGES[algo.advantage](...)                  # group | rloo | reinforce_pp | gae (ema_pg.advantages)
    for epoch in range(ppo_epochs):                             # Lambda passes, minibatch updates (_update)
        cur  = head(policy, minibatch, index=q_n)               # with grad
        kl   = estimator(KLInputs(...))                         # (mb, T)
        loss = grpo_loss(cur, old, adv, mask, kl)  ->  updater.step(loss)   (J: algo.loss = ppo | gspo | cispo | dppo_*)
        critic.update(minibatch, values, returns)               # PPO only

The anchor's scheme is not part of the step: the caller applies it after the step and after each
optimizer step (:class:`ema_pg.anchors.follow.Anchor`; in a run, :class:`ema_pg.engine.anchor.AnchorCallback`). Departures from the paper's Algorithm 3, all deliberate:

- prompts, sampling and minibatch order are seeded by (seed, iteration), so a resumed run
  repeats an uninterrupted one exactly; each prompt samples from its own stream, so several
  processes (each with its block of prompts, :mod:`ema_pg.dist`) sample what one process does;
- log-probs are those of softmax(logits / temperature), the distribution sampled from;
- pi_old's scores come from the sampler when it can give them (it evaluated pi_old's whole
  next-token distribution while sampling); otherwise from one no-grad pass of the policy;
- asynchronous (``rollout.max_staleness`` = k > 0): the batch arrives sampled ahead (:func:`sample_ahead`,
  in a rollout worker) by the policy of version max(0, t - k), and pi_old is that behaviour policy's
  (the anchor too under ``anchor.align=behaviour``); the step then starts at its line 2.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .heads import head
from .kl import Estimator, KLInputs, sequence_kl_penalty
from .kl.sampled import k3_core
from .kl_control import response_mean_k1
from .dist import World
from .advantages import ADVANTAGES, AdvantageInputs
from .corrections import correct, off_policy_sequence_mask
from .losses import Share, grpo_loss, masked_mean
from .packing import Packing, packer
from .prompts import sampler_prompts
from .rollout.base import Rollouts, Sampler, prompt_seeds
from .scores import ScoreRequest, TokenScores
from .tasks.base import checked_reward


def step_seed(seed: int, iteration: int) -> int:
    """The seed of iteration ``iteration``'s prompts, samples and minibatch order."""
    return seed * 1_000_003 + iteration


# ---------------------------------------------------------------------- pi_old, the anchor, the index set
@dataclass
class OldAndAnchor:
    """No-grad scores of one batch: what the loss and the KL estimator read besides the policy."""

    old: TokenScores  # pi_old: logp (N, T), entropy (N, T), logits for the exact estimators
    anchor: TokenScores | None  # the anchor: logp (N, T), logits for the exact estimators
    index: Tensor | None  # (N, T, k) the index set q_n handed to the estimator (None: no top-k)
    anchor_index_logp: Tensor | None  # (N, T, k) log pi_anchor at q_n

    def select(self, rows: Tensor) -> OldAndAnchor:
        """The same scores for a subset of rows."""
        pick = lambda x: None if x is None else x[rows.to(x.device)]
        return OldAndAnchor(self.old.select(rows.to(self.old.logp.device)),
                            None if self.anchor is None else self.anchor.select(rows.to(self.anchor.logp.device)),
                            pick(self.index), pick(self.anchor_index_logp))


class OldAndAnchorScorer:
    """The one place that decides whose top-k is the estimator's index set q_n.

    ``topk_source == "policy_old"`` (reverse KL, Alg 1): q_n = top-k of pi_old, and the anchor is
    scored at q_n. ``"anchor"`` (forward KL, Alg 2): q_n = the anchor's own top-k. ``None``: no
    index set. :meth:`request` tells the sampler what to compute of pi_old while it samples;
    :meth:`__call__` takes the sampler's scores when present and computes what is missing.
    """

    def __init__(self, estimator: Estimator, temperature: float, chunk: Callable[[int], int],
                 pack: Callable[[Rollouts], Packing | None] = lambda batch: None, budget: int = 0,
                 world: World = World()):
        self.source, self.k, self.full = estimator.topk_source, estimator.k, estimator.needs_full_logits
        self.temperature, self.chunk, self.pack = temperature, chunk, pack
        self.budget, self.world = budget, world  # algo.max_tokens_per_microbatch: the passes go by micro-batches

    def request(self) -> ScoreRequest | None:
        """What the sampler should return of pi_old (None: the exact estimators need full logits)."""
        if self.full:
            return None
        return ScoreRequest(topk=self.k if self.source == "policy_old" else 0, entropy=True)

    @torch.no_grad()
    def __call__(self, policy, anchor_model, rollouts: Rollouts, packing: Packing | None = None) -> OldAndAnchor:
        """``rollouts.old`` (the sampler's scores) is pi_old when present; else ``policy`` is scored here.
        ``packing``: the batch's (else made here by ``pack``). With a token budget the batch goes by micro-batches
        (:func:`micro_batches`), each scored apart, the rows put back in their order."""
        if self.budget > 0:
            parts = micro_batches(rollouts, self.budget, self.world)
            if len(parts) > 1:
                outs = [self._score(policy, anchor_model, rollouts.select(p), None) for p in parts]
                back = torch.argsort(torch.cat(parts))
                cat = lambda xs: None if xs[0] is None else torch.cat(xs)[back]
                scores = lambda ts: None if ts[0] is None else TokenScores(
                    **{f: cat([getattr(t, f) for t in ts]) for f in ("logp", "index", "index_logp", "logits", "entropy")})
                return OldAndAnchor(scores([o.old for o in outs]), scores([o.anchor for o in outs]),
                                    cat([o.index for o in outs]), cat([o.anchor_index_logp for o in outs]))
        return self._score(policy, anchor_model, rollouts, packing)

    def _score(self, policy, anchor_model, rollouts: Rollouts, packing: Packing | None) -> OldAndAnchor:
        packing = packing if packing is not None else self.pack(rollouts)
        ch, kw = self.chunk(rollouts.response_mask.numel()), {"temperature": self.temperature, "packing": packing}
        old = rollouts.old
        if old is None:
            old = head(policy, rollouts, topk=self.k if self.source == "policy_old" else 0, full_logits=self.full,
                       entropy=True, chunk=ch, **kw)
        if anchor_model is None:
            return OldAndAnchor(old, None, None, None)
        if self.source == "policy_old":
            anchor = head(anchor_model, rollouts, index=old.index, full_logits=self.full, chunk=ch, **kw)
        else:
            anchor = head(anchor_model, rollouts, topk=self.k if self.source == "anchor" else 0,
                          full_logits=self.full, chunk=ch, **kw)
        index = anchor.index if self.source is not None else None
        return OldAndAnchor(old, anchor, index, anchor.index_logp)


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


# ---------------------------------------------------------------------- rollouts and reward shaping
def overlong_penalty(length: Tensor, max_len: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer policy tokens, then falling linearly to
    -factor at max_len: factor * min(0, ((max_len - buffer) - length) / buffer). ``length`` (N,)."""
    return factor * (((max_len - buffer) - length.float()) / buffer).clamp(max=0.0)


def shape_rewards(rewards: Tensor, rollouts: Rollouts, old: TokenScores, anchor: TokenScores | None, algo,
                  rollout, beta: float | None = None) -> tuple[Tensor, Tensor]:
    """Reward shaping, one composed step: (the run's reward, the reward the advantages read), each (N,).

    The run's reward is the task's plus DAPO's soft overlong punishment (eq. 13 of DAPO, ``algo.overlong_buffer``);
    the advantages' subtracts WARP's sequence-level KL to the anchor from it (eq. 10-12, ``algo.reward_kl``)."""
    mask = rollouts.response_mask
    if algo.overlong_buffer > 0:
        rewards = rewards + overlong_penalty(mask.sum(-1), rollout.max_new_tokens, algo.overlong_buffer,
                                             algo.overlong_penalty).to(rewards.dtype)
    if algo.reward_kl == "sequence":
        beta = algo.beta if beta is None else beta  # the KL controller's, when the run has one
        return rewards, rewards - beta * sequence_kl_penalty(old.logp, anchor.logp, mask)
    return rewards, rewards


def _sample_round(round_seed: int, *, policy, task, sampler, algo, rollout, score, world, device, offset: int,
                  encode=None):
    all_prompts = task.sample(algo.prompts_per_step, seed=round_seed)
    mine = world.block(len(all_prompts))  # this rank's prompts, each with its whole group
    prompts = all_prompts[mine]
    ro = sampler.generate(
        policy, sampler_prompts(prompts, encode), algo.group_size, temperature=rollout.temperature, top_p=rollout.top_p,
        max_new_tokens=rollout.max_new_tokens, stop=list(rollout.stop), on_stop=task.on_stop_fn(prompts, algo.group_size),
        seed=prompt_seeds(round_seed, len(all_prompts))[mine], score=score)
    rewards = torch.tensor([checked_reward(task, prompts[i], text) for i, text in zip(ro.prompt_index, ro.responses)],
                           dtype=torch.float32, device=device)  # (N,)
    ro.prompt_index = [i + offset for i in ro.prompt_index]
    return ro, list(prompts), rewards


def _collect(it_seed: int, *, policy, task, sampler, algo, rollout, score, world, device, encode=None):
    """(rollouts, rewards, metrics) of one iteration.

    With ``algo.dynamic_sampling`` (DAPO): groups whose rewards are all equal (zero advantage, no
    gradient) are dropped and new prompts are sampled, up to ``algo.max_sampling_rounds`` rounds
    in all, until ``prompts_per_step`` groups have a reward spread; if the rounds run out, the
    batch is filled up with dropped groups (they carry no policy gradient, only the KL)."""
    kw = dict(policy=policy, task=task, sampler=sampler, algo=algo, rollout=rollout, score=score, world=world,
              device=device, encode=encode)
    ro, prompts, rewards = _sample_round(it_seed, offset=0, **kw)
    G = algo.group_size
    zero_std = rewards.view(-1, G).std(-1) == 0  # (groups,)
    metrics = {"train/frac_groups_zero_std": float(world.all_gather_cat(zero_std.float()).mean())}
    if not algo.dynamic_sampling:
        return ro, rewards, metrics
    parts, kept = [(ro, rewards, zero_std)], int((~zero_std).sum())
    n_groups = len(prompts)
    rounds = 1
    while kept < n_groups and rounds < algo.max_sampling_rounds:
        r_seed = step_seed(it_seed, 1_000 + rounds)  # a new prompt stream per round
        ro2, p2, rw2 = _sample_round(r_seed, offset=len(prompts), **kw)
        prompts += p2
        z2 = rw2.view(-1, G).std(-1) == 0
        parts.append((ro2, rw2, z2))
        kept += int((~z2).sum())
        rounds += 1
    good = [(j, g) for j, (_, _, z) in enumerate(parts) for g in range(len(z)) if not z[g]][:n_groups]
    dropped = [(j, g) for j, (_, _, z) in enumerate(parts) for g in range(len(z)) if z[g]]
    chosen = good + dropped[: n_groups - len(good)]
    batch = Rollouts.cat([parts[j][0].select(list(range(g * G, (g + 1) * G))) for j, g in chosen])
    rewards = torch.cat([parts[j][1][g * G:(g + 1) * G] for j, g in chosen])
    metrics.update({"train/sampling_rounds": float(rounds),
                    "train/frac_groups_kept_zero_std": float(len(chosen) - len(good)) / n_groups})
    return batch, rewards, metrics


@dataclass
class Sampled:
    """One iteration's batch sampled ahead of its update, by a rollout worker (``rollout.max_staleness`` > 0):
    the rollouts with pi_old's scores (``rollouts.old``: the behaviour policy's, the policy of version
    ``version`` that sampled them), the rewards, the sampling metrics and, under ``anchor.align=behaviour``,
    the anchor's scores as the anchor was at that version (``scores``; None: the trainer scores its current
    anchor)."""

    rollouts: Rollouts
    rewards: Tensor  # (N,)
    metrics: dict[str, float]
    version: int  # RL iterations applied to the weights that sampled it
    scores: OldAndAnchor | None = None
    rollout_s: float = 0.0  # the worker's time to sample and score it

    def share(self, world: World, group_size: int) -> Sampled:
        """This rank's block of whole groups of a batch the worker sampled whole (several trainer processes, one
        worker): the rows of the prompts :meth:`ema_pg.dist.World.block` gives this rank, as a synchronous run
        splits its prompts. The sampling metrics stay the whole batch's."""
        if world.size == 1:
            return self
        groups = world.block(len(self.rewards) // group_size)
        rows = torch.arange(groups.start * group_size, groups.stop * group_size)
        return Sampled(self.rollouts.select(rows), self.rewards[rows.to(self.rewards.device)], self.metrics,
                       self.version, None if self.scores is None else self.scores.select(rows), self.rollout_s)


@torch.no_grad()
def sample_ahead(iteration: int, version: int, *, policy, anchor_model, task, sampler: Sampler, estimator: Estimator,
                 algo, rollout, seed: int, chunk: Callable[[int], int], encode=None) -> Sampled:
    """Iteration ``iteration``'s batch as :func:`rl_step` would collect it, sampled by ``policy`` (the weights of
    version ``version``): the prompts, sampling seeds and DAPO refills of ``iteration``; pi_old's scores are
    always filled in (the trainer's policy has moved on); ``anchor_model`` (the anchor of the same version, or
    None) is scored too. One process (a worker serves one trainer)."""
    t0 = time.perf_counter()
    scorer = OldAndAnchorScorer(estimator, rollout.temperature, chunk, packer(algo, policy),
                                algo.max_tokens_per_microbatch)
    device = next(policy.parameters()).device
    rollouts, rewards, metrics = _collect(step_seed(seed, iteration), policy=policy, task=task, sampler=sampler,
                                          algo=algo, rollout=rollout, score=scorer.request(), world=World(),
                                          device=device, encode=encode)
    scores = scorer(policy, anchor_model, rollouts)
    rollouts.old = scores.old
    return Sampled(rollouts, rewards, metrics, version, scores if anchor_model is not None else None,
                   time.perf_counter() - t0)


# ---------------------------------------------------------------------- the step
@dataclass
class StepResult:
    metrics: dict[str, float]
    rollouts: Rollouts


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


def grad_norms_pg_kl(policy, loss: torch.Tensor, loss_without_kl: torch.Tensor) -> dict[str, torch.Tensor]:
    """:class:`PgKlGrads` of one loss."""
    g = PgKlGrads(policy)
    g.add(loss, loss_without_kl)
    return g.norms()


def micro_batches(batch: Rollouts, budget: int, world: World = World()) -> list[Tensor]:
    """The rows (indices into ``batch``) of each micro-batch of a minibatch: rows in prompt order (a prompt's samples
    together, so that they share their prefix), a new micro-batch whenever the next row's real tokens would take it
    over ``budget`` (a row longer than the budget goes alone). On several processes every rank makes as many
    micro-batches as the rank that needs the most (its heaviest ones split in two): some strategies' forwards are
    collective. ``budget`` 0: one micro-batch, the whole minibatch."""
    n = len(batch)
    if budget <= 0:
        return [torch.arange(n)]
    order = sorted(range(n), key=lambda i: batch.prompt_index[i])
    tokens = batch.attention_mask.sum(1).tolist()
    groups, cur, total = [], [], 0
    for i in order:
        if cur and total + tokens[i] > budget:
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += tokens[i]
    groups.append(cur)
    count = world.max(len(groups)) if world.size > 1 else len(groups)
    while len(groups) < count:  # as many as the other ranks: split the heaviest divisible one at its middle token
        j = max((g for g in range(len(groups)) if len(groups[g]) > 1), key=lambda g: sum(tokens[i] for i in groups[g]))
        g = groups.pop(j)
        half, acc, cut = sum(tokens[i] for i in g) / 2, 0, 1
        for k, i in enumerate(g[:-1], 1):
            acc += tokens[i]
            cut = k
            if acc >= half:
                break
        groups[j:j] = [g[:cut], g[cut:]]
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def engine_mismatch(old: TokenScores, rollouts: Rollouts, mask: Tensor, rollout) -> tuple[Tensor | None, dict]:
    """When an inference engine sampled with its own numerics: the rollout correction's weights on the PG term
    (``rollout.correction``, :mod:`ema_pg.corrections`; None for ``none``) and the mismatch metrics; else (None, {})."""
    if rollouts.engine_logp is None:
        return None, {}
    return correct(rollout.correction, old.logp, rollouts.engine_logp, mask, rollout.correction_cap,
                   rollout.correction_threshold)


def _update(it_seed: int, *, policy, rollouts, scores, scorer, adv, mask, tis, estimator, updater, algo, rollout, world,
            chunk, critic, values, returns, grad_ratio, beta) -> dict[str, float]:
    """``algo.ppo_epochs`` passes of minibatch updates (Alg 3, lines 13-23); the mean of each update's metrics.

    ``beta`` is the token KL's weight in force: the KL controller's (``algo.beta`` under ``algo.kl_ctrl=fixed``),
    over the batch std under ``algo.global_kl_scale``."""
    n_rows = len(rollouts)
    minibatch = algo.minibatch_size // world.size or n_rows  # per rank
    order_gen = torch.Generator().manual_seed(it_seed)
    sums: dict[str, float] = {}
    diagnostics: dict[str, torch.Tensor] = {}
    n_updates = 0
    for _epoch in range(algo.ppo_epochs):
        order = torch.randperm(n_rows, generator=order_gen) if minibatch < n_rows else torch.arange(n_rows)
        for start in range(0, n_rows, minibatch):
            rows = order[start : start + minibatch].to(mask.device)
            pg_kl = PgKlGrads(policy) if grad_ratio and n_updates == 0 else None  # measured once, not averaged
            loss_metrics = _minibatch_update(rows, policy=policy, rollouts=rollouts, scores=scores, scorer=scorer,
                                             adv=adv, mask=mask, tis=tis, estimator=estimator, updater=updater,
                                             algo=algo, rollout=rollout, world=world, chunk=chunk, critic=critic,
                                             values=values, returns=returns, beta=beta, pg_kl=pg_kl)
            if pg_kl is not None:
                diagnostics.update(pg_kl.norms())
            n_updates += 1
            for key, value in loss_metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
    metrics = {f"train/{key}": total / max(n_updates, 1) for key, total in sums.items()}
    metrics.update({f"train/{key}": float(v) for key, v in diagnostics.items()})
    metrics["train/skipped_steps"] = sums.get("skipped_steps", 0.0)  # a count, not a mean
    metrics["train/kl_beta"] = beta  # the KL weight in force (algo.beta, or over the batch std: global_kl_scale)
    return metrics


#: how a minibatch's metric combines its micro-batches' (the rest are shares that add up: losses, token means)
COMBINE = {"ratio_max": max, "ratio_min": min}


def _minibatch_update(rows: Tensor, *, policy, rollouts, scores, scorer, adv, mask, tis, estimator, updater, algo,
                      rollout, world, chunk, critic, values, returns, beta, pg_kl) -> dict[str, float]:
    """One optimizer step on the minibatch ``rows``, over its micro-batches (``algo.max_tokens_per_microbatch``):
    each one's forward, KL and loss (its share of the minibatch's aggregation, so the gradients add up to the whole
    minibatch's), then its backward, before the next one's forward; then the critic's step on the same rows."""
    old, anchor = scores.old, scores.anchor
    token_kl = beta != 0.0 and algo.reward_kl == "none" and estimator.name != "none"  # the beta in force
    parts = [rows[g] for g in micro_batches(rollouts.select(rows), algo.max_tokens_per_microbatch, world)]
    share = None if len(parts) == 1 else Share(tokens=float(mask[rows].sum()), rows=len(rows))
    weight = 1.0
    if world.size > 1 and algo.loss_agg == "token-mean":  # the strategy averages over ranks: weigh
        n_tok = mask[rows].sum().float()                 # each rank's token mean by its share of tokens
        weight = world.size * n_tok / world.sum(n_tok).clamp(min=1)
    seen: list[dict] = []
    packings: list = []

    def losses():
        for r in parts:
            batch = rollouts.select(r)
            packing = scorer.pack(batch)  # None: the padded pass
            packings.append(packing)
            index = None if scores.index is None else scores.index[r]  # (mb, T, k)
            cur = head(policy, batch, index=index, full_logits=scorer.full, temperature=rollout.temperature,
                       chunk=chunk(batch.response_mask.numel()), entropy=algo.entropy_coef != 0, packing=packing)
            kl = None
            if token_kl:
                kl = estimator(KLInputs(
                    logp=cur.logp, logp_old=old.logp[r], logp_ref=anchor.logp[r],
                    tokens=batch.input_ids[:, batch.prompt_len:], topk_idx=index, topk_logp=cur.index_logp,
                    topk_logp_ref=None if scores.anchor_index_logp is None else scores.anchor_index_logp[r],
                    logits=cur.logits, ref_logits=None if anchor.logits is None else anchor.logits[r],
                ))  # (mb, T)
            pg_weight = None if tis is None else tis[r]
            if algo.opsm_delta is not None:  # DeepSeek-V3.2's mask: against the sampler's log-probs and the policy now
                behaviour = old.logp[r] if rollouts.engine_logp is None else rollouts.engine_logp[r]
                opsm = off_policy_sequence_mask(adv[r], cur.logp, behaviour, mask[r], algo.opsm_delta)
                pg_weight = opsm if pg_weight is None else pg_weight * opsm
            loss_args = dict(eps_low=algo.eps_low, eps_high=algo.eps_high, loss_agg=algo.loss_agg, surrogate=algo.loss,
                             clip_ratio_c=algo.clip_ratio_c, entropy_coef=algo.entropy_coef, entropy=cur.entropy,
                             norm_len=rollout.max_new_tokens, pg_weight=pg_weight, share=share)
            loss, m = grpo_loss(cur.logp, old.logp[r], adv[r], mask[r], kl, beta=beta, **loss_args)
            if algo.opsm_delta is not None:
                m["opsm_masked_seqs"] = (opsm[:, 0] == 0).sum().to(loss.dtype)  # a count: added over micro-batches
            if pg_kl is not None:
                without_kl, _ = grpo_loss(cur.logp, old.logp[r], adv[r], mask[r], None, beta=0.0, **loss_args)
                pg_kl.add(loss, without_kl)
            loss = loss * weight
            m["loss"] = loss.detach()
            seen.append(m)
            yield loss

    out = updater.step(losses(), count=len(parts))
    metrics = {k: float(COMBINE.get(k, sum)(float(m[k]) for m in seen)) for k in (seen[0] if seen else {})}
    metrics.update(out)
    if critic is not None and len(seen) == len(parts):  # the value model's own update on the same rows
        metrics.update(critic.update([(rollouts.select(r), values[r], returns[r], mask[r], p)
                                      for r, p in zip(parts, packings)], share))
    return metrics


def _batch_metrics(rollouts, rewards, old, anchor, mask, world) -> dict[str, float]:
    """What the batch was: rewards, entropy, length, KL(pi_old || anchor) from the samples, the engine's gap."""
    all_rewards = world.all_gather_cat(rewards)
    metrics = {
        "train/reward_mean": float(all_rewards.mean()),
        "train/reward_std": float(all_rewards.std()) if len(all_rewards) > 1 else 0.0,
        "train/entropy": float(masked_mean(old.entropy, mask)) if old.entropy is not None else float("nan"),
        "train/response_len": float(mask.sum(-1).float().mean()),
    }
    if anchor is not None:  # cleanrl-style diagnostics of KL(pi_old || anchor) from the samples
        log_w = anchor.logp - old.logp
        metrics["train/kl_k1"] = float(masked_mean(-log_w, mask))
        metrics["train/kl_k3"] = float(masked_mean(k3_core(log_w), mask))
    if rollouts.truncated is not None:
        metrics["train/frac_truncated"] = float(rollouts.truncated.float().mean())
    return metrics


def rl_step(iteration: int, *, policy, anchor_model, task, sampler: Sampler, estimator: Estimator,
            updater: Updater, algo, rollout, seed: int, chunk: Callable[[int], int],
            world: World = World(), critic=None, grad_ratio: bool = False, encode=None,
            sampled: Sampled | None = None, beta: float | None = None) -> StepResult:
    """Run RL iteration ``iteration`` (0-based) and return its metrics (namespaced) and rollouts.

    ``algo`` and ``rollout`` are the config nodes of the same names; ``chunk(n_tokens)`` gives the
    head's chunk size. ``anchor_model`` is None only when there is no KL (``anchor=none``).
    ``world``: on several processes, this rank's share of the batch (see :mod:`ema_pg.dist`);
    the metrics returned are reduced over ranks. ``critic`` (:class:`ema_pg.critic.Critic`, with
    ``algo.advantage=gae``): token-level GAE advantages, and a value update after each policy update.
    ``grad_ratio``: also measure, on the first minibatch, the gradient norms of the loss's policy-gradient
    part and of its KL part (:func:`grad_norms_pg_kl`; two extra backward passes).
    ``encode``: the run's :class:`ema_pg.prompts.PromptEncoder` (None: prompts as plain text).
    ``sampled``: the batch as a rollout worker sampled it ahead (:func:`sample_ahead`; asynchronous training):
    pi_old is then the behaviour policy's scores, and the anchor is scored here only when the worker did not.
    None (synchronous): the batch is sampled here by the current policy.
    ``beta``: the KL coefficient in force this iteration, the run's KL controller's (:mod:`ema_pg.kl_control`);
    None: ``algo.beta``.
    """
    kl_coef = algo.beta if beta is None else beta
    device = next(policy.parameters()).device
    it_seed = step_seed(seed, iteration)
    scorer = OldAndAnchorScorer(estimator, rollout.temperature, chunk, packer(algo, policy),
                                algo.max_tokens_per_microbatch, world)
    t0 = time.perf_counter()

    # 1. prompts, rollouts from pi_old (= the current policy), rewards; DAPO's dynamic sampling refills
    if sampled is None:
        rollouts, rewards, sampling = _collect(it_seed, policy=policy, task=task, sampler=sampler, algo=algo,
                                              rollout=rollout, score=scorer.request(), world=world, device=device,
                                              encode=encode)
    else:  # sampled ahead by an older policy (rollout.max_staleness): pi_old is the behaviour policy
        rollouts, rewards = sampled.rollouts, sampled.rewards.to(device)
        sampling = {**sampled.metrics, "rollout/staleness": float(iteration - sampled.version),
                    "time/rollout_worker_s": sampled.rollout_s}
    mask = rollouts.response_mask  # (N, T): policy tokens only (no prompt, observation or padding)
    if algo.mask_truncated and rollouts.truncated is not None:  # DAPO's overlong filtering: no loss on them
        mask = mask * (~rollouts.truncated).to(mask.dtype)[:, None]
    t1 = time.perf_counter()

    # 2. pi_old, the anchor and the index set (Alg 3, lines 6-11); shaped rewards; advantages
    packing = scorer.pack(rollouts)  # the whole batch's (None: padded passes)
    if sampled is not None and sampled.scores is not None:  # scored by the worker: the anchor of the behaviour version
        scores = sampled.scores
    else:
        scores = scorer(policy, anchor_model, rollouts, packing)
    old, anchor = scores.old, scores.anchor
    t2 = time.perf_counter()
    rewards, shaped = shape_rewards(rewards, rollouts, old, anchor, algo, rollout, beta=kl_coef)
    values = None
    if ADVANTAGES[algo.advantage].needs_critic:  # (N, T), by micro-batches under a token budget
        parts = micro_batches(rollouts, algo.max_tokens_per_microbatch, world)
        values = critic.values(rollouts, packing) if len(parts) == 1 else torch.cat(
            [critic.values(rollouts.select(p), scorer.pack(rollouts.select(p))) for p in parts])[torch.argsort(torch.cat(parts))]
    est = ADVANTAGES[algo.advantage](AdvantageInputs(shaped, algo.group_size, rollouts.response_mask, mask, world,
                                                     values, norm=algo.adv_norm, gamma=algo.gamma, lam=algo.lam,
                                                     global_kl_scale=algo.global_kl_scale))
    adv, returns = est.adv, est.returns  # (N,) or (N, T)
    tis, mismatch = engine_mismatch(old, rollouts, mask, rollout)  # vLLM's numerics vs the trainer's

    # 3. Lambda passes of minibatch updates (Alg 3, lines 13-23)
    updates = _update(it_seed, policy=policy, rollouts=rollouts, scores=scores, scorer=scorer, adv=adv, mask=mask,
                      tis=tis, estimator=estimator, updater=updater, algo=algo, rollout=rollout, world=world,
                      chunk=chunk, critic=critic, values=values, returns=returns, grad_ratio=grad_ratio,
                      beta=kl_coef * est.kl_scale)
    t3 = time.perf_counter()

    # 4. metrics (namespaced; docs/training.md has the table)
    metrics = {**updates, **_batch_metrics(rollouts, rewards, old, anchor, mask, world), **mismatch, **sampling,
               "train/lr": updater.lr, "time/rollout_s": t1 - t0, "time/score_s": t2 - t1, "time/update_s": t3 - t2,
               "time/step_s": t3 - t0, "time/tokens_per_s": float(mask.sum()) / max(t3 - t0, 1e-9)}
    if packing is not None:  # what the padding-free passes leave out of the padded grid (algo.padding_free)
        metrics["perf/padding_saved"] = 1.0 - packing.tokens / packing.padded_tokens
    metrics["train/kl_coef"] = kl_coef  # beta in force (the KL controller's; algo.beta under kl_ctrl=fixed)
    if anchor is not None:  # the KL the adaptive controller measures (ema_pg.kl_control), at sampling
        metrics["train/kl_ctrl_kl"] = float(response_mean_k1(old.logp, anchor.logp, rollouts.response_mask))
    return StepResult(world.reduce_metrics(metrics), rollouts)
