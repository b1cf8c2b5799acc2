"""One RL iteration of Algorithm 3 as a plain function: :func:`rl_step`, first, then its phases in the order they
run. No Lightning here.

    prompts  = task.sample(B)                                   # B prompts, seeded by (seed, iteration)
    rollouts = sampler.generate(policy, prompts, n=G)           # B*G responses; pi_old's scores if it can
    rewards  = task.reward(...)                                 # (B*G,); DAPO: refill flat groups
    scores   = OldAndAnchorScorer(...)(policy, anchor, rollouts)  # pi_old, anchor, the index set q_n
    rewards  = shape_rewards(...)                               # DAPO's overlong penalty, WARP's sequence KL
    adv      = ADVANTAGES[algo.advantage](...)                  # group | rloo | reinforce_pp | gae (ema_pg.advantages)
    update(...)                                                 # Lambda passes of minibatch updates (ema_pg.update)
    anchor.after_iteration(policy, t + 1)                       # the anchor follows: eq. 2 (Alg 3, line 25)

What an iteration is made of (the policy, its anchor and the rule it follows, the task, the sampler, the estimator,
the updater, the algo and rollout records) is one record, :class:`StepParts`. The anchor's rule
(:class:`ema_pg.anchors.follow.Anchor`: EMA, reset, sync, BEMA, ...) runs at two clocks: after each applied optimizer
step (the updater's ``after_step``: ``sync`` counts optimizer steps) and after the iteration, the step's last line.
A rollout worker's parts have no rule: it samples, nothing follows. Departures from the paper's Algorithm 3, all
deliberate:

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

import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .advantages import ADVANTAGES, AdvantageInputs
from .critic import Critic
from .anchors.follow import Anchor
from .corrections import correct, decoupled_weight, prox_alpha
from .dist import World, join_metrics
from .heads import head
from .kl import Estimator, sequence_kl_penalty
from .kl.sampled import k3_core
from .kl_control import response_mean_k1
from .losses import LossSpec, masked_mean
from .packing import Packing, packer
from .prompts import PromptEncoder, sampler_prompts
from .rollout.base import Rollouts, Sampler, prompt_seeds
from .scores import ScoreRequest, TokenScores, pad_columns
from .tasks.base import Task, checked_reward, env_turns, sampled, sampler_stops
from .microbatches import over_micro_batches
from .scoring import OldAndAnchor, OldAndAnchorScorer
from .update import Proximal, UpdateBatch, Updater, update

if TYPE_CHECKING:  # the records' types only: the algorithm floor imports nothing of the config at run time
    from .config.schema import AlgoConfig, RolloutConfig


def rl_step(iteration: int, parts: StepParts, *, beta: float, grad_ratio: bool = False,
            sampled: Sampled | None = None) -> StepResult:
    """Run RL iteration ``iteration`` (0-based) of ``parts`` and return its metrics (namespaced, reduced over
    ranks) and rollouts.

    ``grad_ratio``: also measure, on the first minibatch, the gradient norms of the loss's policy-gradient part
    and of its KL part (:class:`ema_pg.update.PgKlGrads`; two extra backward passes). ``sampled``: the batch as a
    rollout worker sampled it ahead (:func:`sample_ahead`; asynchronous training): pi_old is then the behaviour
    policy's scores, and the anchor is scored here only when the worker did not; None (synchronous): the batch is
    sampled here by the current policy. ``beta``: the KL coefficient in force this iteration, bound by the caller
    (the run's KL controller, :mod:`ema_pg.kl_control`, whose ``fixed`` value is ``algo.beta``); the step reads no
    other. The result carries it, the weight the loss gave the token KL and the KL the controller measures.
    """
    algo, rollout, world = parts.algo, parts.rollout, parts.world
    it_seed = step_seed(parts.seed, iteration)
    scorer = OldAndAnchorScorer(parts.estimator, rollout.temperature, parts.chunk, packer(algo, parts.policy),
                                algo.max_tokens_per_microbatch, world)
    t0 = time.perf_counter()

    # 1. prompts, rollouts from pi_old (= the current policy), rewards; DAPO's dynamic sampling refills
    if sampled is None:
        rollouts, rewards, sampling = _collect(it_seed, parts, scorer.request())
    else:  # sampled ahead by an older policy (rollout.max_staleness): pi_old is the behaviour policy
        rollouts, rewards = sampled.rollouts, sampled.rewards.to(parts.device)
        sampling = {**sampled.metrics, "rollout/staleness": float(iteration - sampled.version),
                    "time/rollout_worker_s": sampled.rollout_s}
        if sampled.token_version is not None:  # partial rollouts: each token's own sampling version
            sampling.update(token_staleness(iteration, sampled.token_version, rollouts.response_mask))
    mask = rollouts.response_mask  # (N, T): policy tokens only (no prompt, observation or padding)
    if algo.mask_truncated and rollouts.truncated is not None:  # DAPO's overlong filtering: no loss on them
        mask = mask * (~rollouts.truncated).to(mask.dtype)[:, None]
    t1 = time.perf_counter()

    # 2. pi_old, the anchor and the index set (Alg 3, lines 6-11); shaped rewards; advantages
    packing = scorer.pack(rollouts)  # the whole batch's (None: padded passes)
    if sampled is not None and sampled.scores is not None:  # scored by the worker: the anchor of the behaviour version
        scores = sampled.scores
    else:
        scores = scorer(parts.policy, parts.anchor_model, rollouts, packing)
    t2 = time.perf_counter()
    rewards, shaped = shape_rewards(rewards, rollouts, scores.old, scores.anchor, algo, rollout, beta=beta)
    values = _values(parts, scorer, rollouts, packing)  # (N, T) PPO's value model's; None without one
    est = ADVANTAGES[algo.advantage](AdvantageInputs(shaped, algo.group_size, rollouts.response_mask, mask, world,
                                                     values, norm=algo.adv_norm, gamma=algo.gamma, lam=algo.lam,
                                                     global_kl_scale=algo.global_kl_scale))
    tis, mismatch = engine_mismatch(scores.old, rollouts, mask, rollout)  # vLLM's numerics vs the trainer's
    prox, tis, decoupled = (_decoupled(parts, scorer, rollouts, packing, scores.old, mask, tis, iteration - sampled.version)
                            if sampled is not None and algo.decoupled else (None, tis, {}))

    # 3. Lambda passes of minibatch updates (Alg 3, lines 13-23; ema_pg.update)
    kl_weight = beta * est.kl_scale  # the token KL's weight in the loss: beta, or beta over the batch std (global_kl_scale)
    batch = UpdateBatch(rollouts=rollouts, scores=scores, scorer=scorer, adv=est.adv, mask=mask, tis=tis,
                        values=values, returns=est.returns, beta=kl_weight,
                        spec=parts.loss, prox=prox)
    updates = update(it_seed, parts, batch, grad_ratio)  # each applied optimizer step also ticks the anchor's step clock
    t3 = time.perf_counter()

    # 4. metrics (namespaced; docs/training.md has the table)
    metrics = {**updates, **_batch_metrics(rollouts, rewards, scores, mask, world), **mismatch, **sampling, **decoupled,
               "train/lr": parts.updater.lr, "time/rollout_s": t1 - t0, "time/score_s": t2 - t1, "time/update_s": t3 - t2,
               "time/step_s": t3 - t0, "time/tokens_per_s": float(mask.sum()) / max(t3 - t0, 1e-9)}
    if packing is not None:  # what the padding-free passes leave out of the padded grid (algo.padding_free)
        metrics["perf/padding_saved"] = 1.0 - packing.tokens / packing.padded_tokens
    metrics = world.reduce_metrics({**metrics, **_kl_metrics(beta, kl_weight, est.kl_scaled, scores, rollouts)})

    # 5. the anchor follows the policy: eq. 2 (Alg 3, line 25), by its scheme's rule and clock
    metrics.update(follow_anchor(parts, iteration))
    return StepResult(metrics, rollouts, beta, float(kl_weight), metrics.get("train/kl_ctrl_kl"))


# ---------------------------------------------------------------------- 1. prompts, rollouts, rewards
def _collect(it_seed: int, parts: StepParts, score: ScoreRequest | None):
    """(rollouts, rewards, metrics) of one iteration.

    With ``algo.dynamic_sampling`` (DAPO): groups whose rewards are all equal (zero advantage, no
    gradient) are dropped and new prompts are sampled, up to ``algo.max_sampling_rounds`` rounds
    in all, until ``prompts_per_step`` groups have a reward spread; if the rounds run out, the
    batch is filled up with dropped groups (they carry no policy gradient, only the KL)."""
    algo, world = parts.algo, parts.world
    ro, prompts, rewards = _sample_round(it_seed, parts, score, offset=0)
    G = algo.group_size
    zero_std = rewards.view(-1, G).std(-1) == 0  # (groups,)
    metrics = {"train/frac_groups_zero_std": float(world.all_gather_cat(zero_std.float()).mean())}
    if not algo.dynamic_sampling:
        return ro, rewards, metrics
    got, kept = [(ro, rewards, zero_std)], int((~zero_std).sum())
    n_groups = len(prompts)
    rounds = 1
    while kept < n_groups and rounds < algo.max_sampling_rounds:
        r_seed = step_seed(it_seed, 1_000 + rounds)  # a new prompt stream per round
        ro2, p2, rw2 = _sample_round(r_seed, parts, score, offset=len(prompts))
        prompts += p2
        z2 = rw2.view(-1, G).std(-1) == 0
        got.append((ro2, rw2, z2))
        kept += int((~z2).sum())
        rounds += 1
    good = [(j, g) for j, (_, _, z) in enumerate(got) for g in range(len(z)) if not z[g]][:n_groups]
    dropped = [(j, g) for j, (_, _, z) in enumerate(got) for g in range(len(z)) if z[g]]
    chosen = good + dropped[: n_groups - len(good)]
    batch = Rollouts.cat([got[j][0].select(list(range(g * G, (g + 1) * G))) for j, g in chosen])
    rewards = torch.cat([got[j][1][g * G:(g + 1) * G] for j, g in chosen])
    metrics.update({"train/sampling_rounds": float(rounds),
                    "train/frac_groups_kept_zero_std": float(len(chosen) - len(good)) / n_groups})
    return batch, rewards, metrics


def _sample_round(round_seed: int, parts: StepParts, score: ScoreRequest | None, offset: int):
    """One round of prompts, their groups' rollouts and rewards: this rank's block, prompt indices from ``offset``."""
    task, algo, rollout = parts.task, parts.algo, parts.rollout
    all_prompts = sampled(task, algo.prompts_per_step, round_seed)
    mine = parts.world.block(len(all_prompts))  # this rank's prompts, each with its whole group
    prompts = all_prompts[mine]
    ro = parts.sampler.generate(
        parts.policy, sampler_prompts(prompts, parts.encode), algo.group_size, temperature=rollout.temperature,
        top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens, stop=sampler_stops(task, rollout.stop),
        on_stop=env_turns(task, prompts, algo.group_size),
        seed=prompt_seeds(round_seed, len(all_prompts))[mine], score=score)
    rewards = torch.tensor([checked_reward(task, prompts[i], text) for i, text in zip(ro.prompt_index, ro.responses)],
                           dtype=torch.float32, device=parts.device)  # (N,)
    ro.prompt_index = [i + offset for i in ro.prompt_index]
    return ro, list(prompts), rewards


# ---------------------------------------------------------------------- 2. pi_old, the anchor, the index set
# ---------------------------------------------------------------------- 2. shaped rewards, values, corrections
def overlong_penalty(length: Tensor, max_len: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer policy tokens, then falling linearly to
    -factor at max_len: factor * min(0, ((max_len - buffer) - length) / buffer). ``length`` (N,)."""
    return factor * (((max_len - buffer) - length.float()) / buffer).clamp(max=0.0)


def shape_rewards(rewards: Tensor, rollouts: Rollouts, old: TokenScores, anchor: TokenScores | None, algo,
                  rollout, *, beta: float) -> tuple[Tensor, Tensor]:
    """Reward shaping, one composed step: (the run's reward, the reward the advantages read), each (N,).

    The run's reward is the task's plus DAPO's soft overlong punishment (eq. 13 of DAPO, ``algo.overlong_buffer``);
    the advantages' subtracts WARP's sequence-level KL to the anchor from it (eq. 10-12, ``algo.reward_kl``)."""
    mask = rollouts.response_mask
    if algo.overlong_buffer > 0:
        rewards = rewards + overlong_penalty(mask.sum(-1), rollout.max_new_tokens, algo.overlong_buffer,
                                             algo.overlong_penalty).to(rewards.dtype)
    if algo.reward_kl == "sequence":  # beta: the one in force (the KL controller's)
        return rewards, rewards - beta * sequence_kl_penalty(old.logp, anchor.logp, mask)
    return rewards, rewards


def _values(parts: StepParts, scorer: OldAndAnchorScorer, rollouts: Rollouts, packing: Packing | None) -> Tensor | None:
    """PPO's value model's values of the batch, (N, T), by micro-batches under a token budget; None without one."""
    if not ADVANTAGES[parts.algo.advantage].needs_critic:
        return None
    return over_micro_batches(rollouts, parts.algo.max_tokens_per_microbatch, parts.world, lambda rows: (
        parts.critic.values(rollouts, packing) if rows is None
        else parts.critic.values(rollouts.select(rows), scorer.pack(rollouts.select(rows)))))


def engine_mismatch(old: TokenScores, rollouts: Rollouts, mask: Tensor, rollout) -> tuple[Tensor | None, dict]:
    """When an inference engine sampled with its own numerics: the rollout correction's weights on the PG term
    (``rollout.correction``, :mod:`ema_pg.corrections`; None for ``none``) and the mismatch metrics; else (None, {})."""
    if rollouts.engine_logp is None:
        return None, {}
    return correct(rollout.correction, old.logp, rollouts.engine_logp, mask, rollout.correction_cap,
                   rollout.correction_threshold)


@torch.no_grad()
def _decoupled(parts: StepParts, scorer: OldAndAnchorScorer, rollouts: Rollouts, packing: Packing | None, old: TokenScores,
               mask: Tensor, tis: Tensor | None, lag: int) -> tuple[Proximal, Tensor, dict[str, float]]:
    """Decoupled PPO on a batch sampled ``lag`` iterations ahead (``algo.decoupled``): the proximal policy's log-probs,
    (N, T), from one no-grad pass of the policy as the step starts (by micro-batches under a token budget): the ratio's
    reference in the loss; and the PG term's weights, the behaviour weight pi_prox / pi_behave
    (:func:`ema_pg.corrections.decoupled_weight`) times the engine's correction where there is one. Under
    ``algo.prox_logp=loglinear`` no pass: each micro-batch interpolates (:func:`ema_pg.update._reference`)."""
    if parts.algo.prox_logp == "loglinear":
        alpha = prox_alpha(lag)
        return Proximal(alpha=alpha, cap=parts.algo.behave_weight_cap), tis, {"train/prox_alpha": alpha}
    def logp(rows):
        sub = rollouts if rows is None else rollouts.select(rows)
        return head(parts.policy, sub, temperature=parts.rollout.temperature, chunk=parts.chunk(sub.response_mask.numel()),
                    packing=packing if rows is None else scorer.pack(sub)).logp
    prox = over_micro_batches(rollouts, parts.algo.max_tokens_per_microbatch, parts.world, logp)
    w = decoupled_weight(prox, old.logp, mask, parts.algo.behave_weight_cap)
    raw = w if parts.algo.behave_weight_cap is None else decoupled_weight(prox, old.logp, mask)  # before the cap
    m = mask.bool()
    n = max(int(m.sum()), 1)
    metrics = {"train/behave_weight_mean": float(raw[m].sum()) / n,
               "train/behave_masked_frac": float(((w == 0) & m).sum()) / n}
    return Proximal(logp=prox), w if tis is None else tis * w, metrics


# ---------------------------------------------------------------------- 4. metrics
def token_staleness(iteration: int, token_version: Tensor, mask: Tensor) -> dict[str, float]:
    """The staleness of a partial-rollout batch's tokens at its update (:mod:`ema_pg.partial`): the mean and the
    largest of ``iteration`` minus each token's sampling version, over the tokens of ``mask``."""
    m = mask.bool()
    lag = (iteration - token_version.to(m.device))[m].float()
    if not lag.numel():
        return {}
    return {"rollout/staleness_token_mean": float(lag.mean()), "rollout/staleness_token_max": float(lag.max())}


def _batch_metrics(rollouts, rewards, scores: OldAndAnchor, mask, world) -> dict[str, float]:
    """What the batch was: rewards, entropy, length, KL(pi_old || anchor) from the samples, the engine's gap."""
    old, anchor = scores.old, scores.anchor
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


def follow_anchor(parts: StepParts, iteration: int) -> dict[str, float]:
    """Step 5: the anchor's rule after iteration ``iteration`` (its clock reads ``iteration + 1``, the iterations done),
    with the lag ||theta - theta_ref|| and the rule's applications so far logged as they stood before it
    (``anchor/lag_norm``, ``anchor/updates``). Nothing without a rule (no anchor, a rollout worker's parts)."""
    if parts.anchor is None:
        return {}
    m = {"anchor/lag_norm": parts.anchor.lag_norm(parts.policy), "anchor/updates": parts.anchor.updates}
    parts.anchor.after_iteration(parts.policy, iteration + 1)
    return m


def _kl_metrics(beta: float, weight: float, scaled: bool, scores, rollouts: Rollouts) -> dict[str, float]:
    """beta in force (``train/kl_coef``: the KL controller's, ``algo.beta`` under ``kl_ctrl=fixed``), the loss's token
    KL weight where it is a quantity of its own (``train/kl_weight``: over the batch's reward std, global_kl_scale),
    and the KL the adaptive controller measures at sampling (``train/kl_ctrl_kl``; none without an anchor)."""
    m = {"train/kl_coef": beta}
    if scaled:
        m["train/kl_weight"] = weight
    if scores.anchor is not None:
        m["train/kl_ctrl_kl"] = float(response_mean_k1(scores.old.logp, scores.anchor.logp, rollouts.response_mask))
    return m


# ---------------------------------------------------------------------- the records
@dataclass
class StepParts:
    """What a run's RL iterations are made of, the same at every iteration. ``algo`` and ``rollout`` are the run's
    groups of the same names as plain records, ``loss`` the loss compiled from them; ``chunk(n_tokens)`` gives the head's chunk size. ``anchor_model`` is None only when
    there is no KL (``anchor=none``). ``world``: on several processes, this rank's share of the batch (see
    :mod:`ema_pg.dist`). ``critic`` (:class:`ema_pg.critic.Critic`, with ``algo.advantage=gae``): token-level GAE
    advantages, and a value update after each policy update. ``encode``: the run's
    :class:`ema_pg.prompts.PromptEncoder` (None: prompts as plain text). ``updater``: None where the parts only
    sample (:func:`sample_ahead`)."""

    policy: torch.nn.Module
    anchor_model: torch.nn.Module | None
    task: Task
    sampler: Sampler
    estimator: Estimator
    algo: AlgoConfig  #: the run's algo group as a plain record (ema_pg.config.step_records: bound once)
    rollout: RolloutConfig  #: its rollout group, likewise
    seed: int
    chunk: Callable[[int], int]
    updater: Updater | None = None
    world: World = field(default_factory=World)
    critic: Critic | None = None
    encode: PromptEncoder | None = None
    anchor: Anchor | None = None  #: the rule the anchor follows (ema_pg.anchors.follow), applied at the step's end
    #: the loss compiled once from ``algo`` (the run's Binding.loss); None: compiled here from ``algo`` and ``rollout``
    loss: LossSpec | None = None

    def __post_init__(self):
        if self.loss is None:
            self.loss = LossSpec.of(self.algo, self.rollout.max_new_tokens)

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device


@dataclass
class StepResult:
    """One iteration's outcome: its metrics (namespaced, reduced over ranks) and rollouts, and the values in force
    that the run acts on next, typed rather than read back from the metrics: ``beta`` (the KL coefficient the step
    was given), ``kl_weight`` (the token KL's weight the loss applied: ``beta``, or ``beta`` over the batch's reward
    std under ``algo.global_kl_scale``; the stability monitor's beta) and ``ctrl_kl`` (the KL the adaptive
    controller measures, the mean over responses of each one's token-mean k1 to the anchor; None without one)."""

    metrics: dict[str, float]
    rollouts: Rollouts
    beta: float
    kl_weight: float
    ctrl_kl: float | None


def step_seed(seed: int, iteration: int) -> int:
    """The seed of iteration ``iteration``'s prompts, samples and minibatch order."""
    return seed * 1_000_003 + iteration


# ---------------------------------------------------------------------- sampled ahead (asynchronous training)
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
    #: partial rollouts (ema_pg.partial): (N, T) the version that sampled each response token (where the mask is 1);
    #: None: every token is ``version``'s
    token_version: Tensor | None = None
    #: partial rollouts: each worker's stream state after this batch (bytes; what a resumed worker continues from)
    carry: list[bytes] | None = None

    def share(self, world: World, group_size: int) -> Sampled:
        """This rank's block of whole groups of a batch the worker sampled whole (several trainer processes, one
        worker): the rows of the prompts :meth:`ema_pg.dist.World.block` gives this rank, as a synchronous run
        splits its prompts. The sampling metrics stay the whole batch's."""
        if world.size == 1:
            return self
        groups = world.block(len(self.rewards) // group_size)
        rows = torch.arange(groups.start * group_size, groups.stop * group_size)
        return Sampled(self.rollouts.select(rows), self.rewards[rows.to(self.rewards.device)], self.metrics,
                       self.version, None if self.scores is None else self.scores.select(rows), self.rollout_s,
                       None if self.token_version is None else self.token_version[rows], self.carry)

    @staticmethod
    def join(blocks: list[Sampled], pad_id: int = 0) -> Sampled:
        """The batch a pool of rollout workers sampled in blocks (``rollout.workers``; block w: the prompts
        :class:`ema_pg.dist.Share` w gives, each with its whole group), as one worker samples it whole: the rows in
        block order, prompts numbered across the blocks, response columns padded to the longest, the metrics joined
        as ranks' are (:func:`ema_pg.dist.join_metrics`); its sampling time is the slowest block's."""
        if len(blocks) == 1:
            return blocks[0]
        if len({b.version for b in blocks}) > 1:
            raise ValueError(f"the blocks of one batch come from versions {sorted({b.version for b in blocks})}")
        parts, n = [], 0
        for b in blocks:
            parts.append(replace(b.rollouts, prompt_index=[i + n for i in b.rollouts.prompt_index]))
            n += len(set(b.rollouts.prompt_index))
        rollouts = Rollouts.cat(parts, pad_id)
        width = rollouts.response_mask.shape[1]
        scores = None if blocks[0].scores is None else OldAndAnchor.cat([b.scores for b in blocks], width)
        token_version = None if blocks[0].token_version is None else \
            torch.cat([pad_columns(b.token_version, width) for b in blocks])
        carry = None if blocks[0].carry is None else [c for b in blocks for c in b.carry]
        return Sampled(rollouts, torch.cat([b.rewards for b in blocks]), join_metrics([b.metrics for b in blocks]),
                       blocks[0].version, scores, max(b.rollout_s for b in blocks), token_version, carry)


@torch.no_grad()
def sample_ahead(iteration: int, version: int, parts: StepParts) -> Sampled:
    """Iteration ``iteration``'s batch as :func:`rl_step` would collect it, sampled by ``parts.policy`` (the weights
    of version ``version``): the prompts, sampling seeds and DAPO refills of ``iteration``; pi_old's scores are
    always filled in (the trainer's policy has moved on); ``parts.anchor_model`` (the anchor of the same version, or
    None) is scored too. One process (a worker serves one trainer)."""
    t0 = time.perf_counter()
    algo = parts.algo
    scorer = OldAndAnchorScorer(parts.estimator, parts.rollout.temperature, parts.chunk, packer(algo, parts.policy),
                                algo.max_tokens_per_microbatch)
    rollouts, rewards, metrics = _collect(step_seed(parts.seed, iteration), parts, scorer.request())
    scores = scorer(parts.policy, parts.anchor_model, rollouts)
    rollouts.old = scores.old
    return Sampled(rollouts, rewards, metrics, version, scores if parts.anchor_model is not None else None,
                   time.perf_counter() - t0)
