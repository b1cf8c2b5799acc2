"""Rollout corrections: weights on the policy-gradient term when the tokens were sampled by a behaviour
policy mu that is not the trainer's pi_old (an inference engine's numerics; an older policy version).

Per token, rho_t = pi_old(y_t) / mu(y_t) (log rho_t = log pi_old - log mu, over the loss mask); per
sequence, rho = prod_t rho_t. With a cap C > 1 (``rollout.correction_cap``), the weight w on token t
of sequence i is:

================  =================================================  ==========================================
``correction``    w_{i,t}                                            from
================  =================================================  ==========================================
``none``          1                                                  (the trainer's pi_old is taken as behaviour)
``token_tis``     min(rho_t, C)                                      truncated IS (Yao et al. 2025, "Your
                                                                     efficient RL framework secretly brings you
                                                                     off-policy RL training"; Ionides 2008)
``seq_tis``       min(rho_i, C)                                      sequence-level truncated IS (same)
``token_mask``    rho_t * 1[1/C <= rho_t <= C]                       IcePop (Ling Team, Ring-1T, arXiv 2510.18855):
                                                                     tokens outside the band get no gradient
``seq_mask``      rho_i * 1[1/C <= rho_i <= C]                       masked IS (MIS), sequence level (Liu et al.
                                                                     2025, "When speed kills stability")
``seq_reject``    1[max_t |log rho_t| <= log C]                      rejection: a sequence with one token outside
                                                                     the band is dropped whole, the rest keep 1
``seq_geo_reject``  1[|mean_t log rho_t| <= log C]                   Geo-RS: the sequence's geometric-mean ratio
                                                                     in the band (verl's ``rollout_rs=
                                                                     seq_mean_k1``; Liu, Li et al. 2025, "When
                                                                     speed kills stability", part 3). Peers run
                                                                     it tight: C = 1.001
``seq_k3_reject`` 1[mean_t (rho_t - 1 - log rho_t) <= tau]           K3-RS: the sequence's mean K3 divergence at
                                                                     most tau = ``rollout.correction_threshold``
                                                                     (verl's ``rollout_rs=seq_mean_k3`` with its
                                                                     ``rollout_rs_threshold``)
================  =================================================  ==========================================

The two rejections by a sequence mean (Geo-RS, K3-RS) do not grow with the response's length, where the product
of ``seq_tis``/``seq_mask`` and the worst token of ``seq_reject`` do. Like verl's rejection sampling they set the
weight to 1 or 0 (the loss mask), with no importance weight. Means are over the sequence's loss-mask tokens.

Beside them, one mask that reads the advantage and the *current* policy, so it is applied in each minibatch's loss
(:func:`off_policy_sequence_mask`, ``algo.opsm_delta``): DeepSeek-V3.2's off-policy sequence masking.

Every weight is stopped (no gradient). The metrics the peers log come with it: the mismatch
KL(mu || pi_old) per token by K1 (mean of -log rho) and K3 (mean of rho - 1 - log rho, >= 0), both
unbiased under tokens from mu; the mean weight; the share of tokens with weight 0 (masked) and of
sequences with weight 0 (rejected).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

LOG_CLAMP = 30.0  #: |log rho| beyond this is clamped before exp (the weight is then capped or masked anyway)


def _token(log_rho: Tensor) -> Tensor:
    return torch.exp(log_rho.clamp(-LOG_CLAMP, LOG_CLAMP))


def _seq(log_rho: Tensor, mask: Tensor) -> Tensor:
    return (log_rho * mask).sum(-1, keepdim=True)  # (N, 1) log of the sequence ratio


def token_tis(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    return _token(log_rho).clamp(max=cap)


def seq_tis(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    s = _seq(log_rho, mask)
    return torch.exp(s.clamp(-LOG_CLAMP, math.log(cap))).expand_as(log_rho)


def token_mask(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    inside = log_rho.abs() <= math.log(cap)
    return torch.where(inside, _token(log_rho), torch.zeros_like(log_rho))


def seq_mask(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    s = _seq(log_rho, mask)
    inside = s.abs() <= math.log(cap)
    return torch.where(inside, torch.exp(s.clamp(-LOG_CLAMP, LOG_CLAMP)), torch.zeros_like(s)).expand_as(log_rho)


def seq_reject(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    worst = torch.where(mask.bool(), log_rho.abs(), torch.zeros_like(log_rho)).amax(-1, keepdim=True)
    return (worst <= math.log(cap)).to(log_rho.dtype).expand_as(log_rho)


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (N, 1)


def seq_geo_reject(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    return (_seq_mean(log_rho, mask).abs() <= math.log(cap)).to(log_rho.dtype).expand_as(log_rho)


def seq_k3_reject(log_rho: Tensor, mask: Tensor, threshold: float) -> Tensor:
    k3 = _token(log_rho) - 1.0 - log_rho.clamp(-LOG_CLAMP, LOG_CLAMP)
    return (_seq_mean(k3, mask) <= threshold).to(log_rho.dtype).expand_as(log_rho)


#: the registry (``rollout.correction``): each weight of (log rho, mask, its bound); none: no weight at all
CORRECTIONS: dict[str, Callable[[Tensor, Tensor, float], Tensor] | None] = {
    "none": None, "token_tis": token_tis, "seq_tis": seq_tis, "token_mask": token_mask, "seq_mask": seq_mask,
    "seq_reject": seq_reject, "seq_geo_reject": seq_geo_reject, "seq_k3_reject": seq_k3_reject,
}
#: the corrections whose bound is ``rollout.correction_threshold`` (a divergence), not the ratio cap C
THRESHOLD_BOUND = ("seq_k3_reject",)


def off_policy_sequence_mask(adv: Tensor, logp: Tensor, logp_behaviour: Tensor, mask: Tensor, delta: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (DeepSeek-AI 2025, section 3.1; TRL's ``off_policy_mask_threshold``):
    M_i = 0 when A_i < 0 and (1/|o_i|) sum_t log(mu(o_t) / pi_theta(o_t)) > delta, else 1, with mu the policy that
    sampled the tokens and pi_theta the policy being updated, stopped. A sequence the current policy has moved far
    from, and that the update would push down, is dropped; one with a non-negative advantage always stays.
    (N, T) weights of 1 or 0 (``adv`` (N,) or (N, T): its first column is the sequence's)."""
    a = adv if adv.dim() == 1 else adv[:, 0]
    m = mask.to(logp.dtype)
    drift = _seq_mean((logp_behaviour - logp.detach()).to(m.dtype), m)[:, 0]  # (N,)
    keep = (a >= 0) | (drift <= delta)
    return keep.to(logp.dtype).unsqueeze(-1).expand_as(logp)


#: algo.prox_logp's choices: how decoupled PPO gets its proximal policy's log-probs
PROX_LOGPS = ("recompute", "loglinear")


def prox_alpha(lag: int) -> float:
    """The interpolation weight of :func:`loglinear_prox` for a batch sampled ``lag`` iterations before the step
    that updates on it: alpha = (v_prox - v_behave) / (v_theta - v_behave) with v_behave = t - lag (the sampling
    version), v_prox = t (the weights as step t starts) and v_theta = t + 1 (the weights it produces); 0 on policy."""
    return lag / (lag + 1)


def loglinear_prox(logp_behave: Tensor, logp_now: Tensor, alpha: float) -> Tensor:
    """AReaL's log-linear approximation of the proximal policy (``prox_logp_method: loglinear``, docs/algorithms/
    prox_approx.md): log pi_prox ~ log pi_behave + alpha (log pi_theta - log pi_behave), pi_theta the policy being
    updated (stopped: the proximal policy is a constant of the loss), alpha = :func:`prox_alpha`. It saves decoupled
    PPO's no-grad pass of the policy; it is exact on policy (alpha 0) and where the policy has not moved since the
    batch was sampled. (N, T)."""
    return logp_behave + alpha * (logp_now.detach() - logp_behave)


def decoupled_weight(logp_prox: Tensor, logp_behave: Tensor, mask: Tensor, cap: float | None = None) -> Tensor:
    """Decoupled PPO's behaviour weight (Hilton et al. 2022; AReaL's ``use_decoupled_loss`` with
    ``behav_imp_weight_cap``): w_t = pi_prox(y_t) / pi_behave(y_t), the proximal policy (the trainer's weights when
    the step starts) over the policy that sampled the token; with a cap C, a token whose w_t exceeds C gets w_t = 0
    (masked, not truncated). Stopped; 0 off the loss mask. (N, T)."""
    m = mask.bool()
    log_w = torch.where(m, (logp_prox - logp_behave).detach(), torch.zeros_like(logp_prox))
    w = torch.where(m, log_w.exp(), torch.zeros_like(log_w))
    return w if cap is None else torch.where(w <= cap, w, torch.zeros_like(w))


def correct(name: str, logp_old: Tensor, logp_behaviour: Tensor, mask: Tensor, cap: float, threshold: float = 0.0
            ) -> tuple[Tensor | None, dict[str, float]]:
    """(the stopped weights (N, T), or None for ``none``; the mismatch metrics) over the loss mask. ``cap``: C of the
    ratio bands; ``threshold``: the divergence bound of :data:`THRESHOLD_BOUND`'s corrections."""
    if name not in CORRECTIONS:
        raise ValueError(f"unknown rollout correction {name!r}; choose one of: {', '.join(CORRECTIONS)}")
    m = mask.bool()
    log_rho = torch.where(m, (logp_old - logp_behaviour).detach().to(torch.float32), torch.zeros_like(logp_old))
    n_tok = max(int(m.sum()), 1)
    rho = _token(log_rho)
    metrics = {
        "rollout/mismatch_kl_k1": float((-log_rho)[m].sum()) / n_tok,
        "rollout/mismatch_kl_k3": float((rho - 1 - log_rho)[m].sum()) / n_tok,
        "rollout/logp_gap_mean": float(log_rho.abs()[m].sum()) / n_tok,
        "rollout/logp_gap_max": float(log_rho.abs()[m].max()) if m.any() else 0.0,
    }
    weigh = CORRECTIONS[name]
    if weigh is None:
        return None, metrics
    w = weigh(log_rho, mask.to(log_rho.dtype), threshold if name in THRESHOLD_BOUND else cap) * mask
    has = m.any(-1)
    metrics.update({
        "rollout/is_weight_mean": float(w[m].sum()) / n_tok,
        "rollout/frac_masked": float(((w == 0) & m).sum()) / n_tok,
        "rollout/frac_rejected": float(((w.sum(-1) == 0) & has).sum()) / max(int(has.sum()), 1),
    })
    return w.detach(), metrics
