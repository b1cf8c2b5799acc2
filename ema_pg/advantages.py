"""Advantage estimators as a registry, like :mod:`ema_pg.kl`: ``algo.advantage`` picks one.

    spec = ADVANTAGES[name]            # an AdvantageSpec: the estimator and what it needs
    adv = spec(AdvantageInputs(rewards, group_size, tokens, mask, world, ...))

``group``         GRPO's Monte-Carlo group baseline, scaled by ``algo.adv_norm`` (Appendix A, Fig 9):
                  :func:`ema_pg.losses.advantages`; ``global`` z-scores over the whole batch, all ranks,
                  and with ``algo.global_kl_scale`` returns ``kl_scale`` = 1 / (that std + 1e-6), by which
                  the step divides the token KL too (the authors' code: PG and KL keep their balance);
``rloo``          REINFORCE leave-one-out: A_i = R_i - mean_{j != i} R_j over the prompt's group, unscaled;
``reinforce_pp``  REINFORCE++-baseline: A_i = R_i - mean(group), broadcast to the response's tokens and
                  whitened over every policy token of the batch (one process);
``gae``           PPO's token-level GAE from a critic's values (``algo.gamma``, ``algo.lam``), whitened
                  over the batch when ``algo.adv_norm=global``; returns the value targets too.

An estimator returns (N,) per-sequence or (N, T) per-token advantages; the surrogates take either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .critic import gae as gae_recursion
from .critic import last_token_rewards
from .critic import whiten
from .dist import World
from .losses import advantages as group_advantages
from .losses import ADV_EPS, global_std


@dataclass
class AdvantageInputs:
    rewards: Tensor  # (N,) this rank's rewards, prompt-major, each group whole (shaped: overlong, WARP's KL)
    group_size: int
    tokens: Tensor  # (N, T) the policy's tokens (no prompt, observation or padding)
    mask: Tensor  # (N, T) the loss mask (tokens, minus DAPO's truncated responses)
    world: World = World()
    values: Tensor | None = None  # (N, T) the critic's values (gae)
    #: algo.adv_norm, algo.gamma, algo.lam, algo.global_kl_scale (group estimator, norm=global): given by the caller,
    #: since their defaults' home is AlgoConfig
    norm: str = field(kw_only=True)
    gamma: float = field(kw_only=True)
    lam: float = field(kw_only=True)
    global_kl_scale: bool = field(kw_only=True)


@dataclass
class Advantages:
    adv: Tensor  # (N,) or (N, T)
    returns: Tensor | None = None  # (N, T) value targets (gae)
    kl_scale: float = 1.0  # the factor on the token KL term (global_kl_scale)
    kl_scaled: bool = False  # whether kl_scale applies (global_kl_scale under adv_norm=global): the weight is not beta


def group(inp: AdvantageInputs) -> Advantages:
    r, w = inp.rewards, inp.world
    if inp.norm != "global":
        return Advantages(group_advantages(r, inp.group_size, inp.norm))
    everyone = w.all_gather_cat(r) if w.size > 1 else r  # mean and std over the whole batch, all ranks
    adv = group_advantages(everyone, inp.group_size, inp.norm)
    if w.size > 1:
        adv = adv[w.block(w.size * len(r))]
    scale = 1.0 / (global_std(everyone, inp.group_size) + ADV_EPS) if inp.global_kl_scale else 1.0
    return Advantages(adv, kl_scale=scale, kl_scaled=inp.global_kl_scale)


def rloo(inp: AdvantageInputs) -> Advantages:
    G = inp.group_size
    r = inp.rewards.view(-1, G).to(torch.float64)  # (B, G)
    others = (r.sum(-1, keepdim=True) - r) / (G - 1)  # the mean of the group's other samples
    return Advantages((r - others).flatten().to(inp.rewards.dtype))


def reinforce_pp(inp: AdvantageInputs) -> Advantages:
    centered = group_advantages(inp.rewards, inp.group_size, "none")  # R - mean(group), (N,)
    per_token = centered.unsqueeze(-1).expand_as(inp.mask).to(torch.float32)
    return Advantages(whiten(per_token, inp.mask))


def gae(inp: AdvantageInputs) -> Advantages:
    if inp.values is None:
        raise ValueError("algo.advantage=gae needs the critic's values")
    adv, returns = gae_recursion(last_token_rewards(inp.rewards, inp.tokens), inp.values, inp.tokens, inp.gamma, inp.lam)
    if inp.norm == "global":
        adv = whiten(adv, inp.mask)
    return Advantages(adv, returns)


@dataclass(frozen=True)
class AdvantageSpec:
    """One entry of the registry: the estimator and the properties the step and the checks ask of it, in one place
    (as :mod:`ema_pg.kl` and :mod:`ema_pg.anchors` keep theirs)."""

    fn: Callable[[AdvantageInputs], Advantages]
    needs_critic: bool = False  #: it reads a value model's values (the run builds the critic)
    per_token: bool = False  #: its advantages are (N, T), not one per sequence (GSPO cannot take them)
    one_process: bool = False  #: its statistics are one process's batch's (refused on several)

    def __call__(self, inp: AdvantageInputs) -> Advantages:
        return self.fn(inp)


ADVANTAGES: dict[str, AdvantageSpec] = {
    "group": AdvantageSpec(group),
    "rloo": AdvantageSpec(rloo),
    "reinforce_pp": AdvantageSpec(reinforce_pp, per_token=True, one_process=True),
    "gae": AdvantageSpec(gae, needs_critic=True, per_token=True, one_process=True),
}
