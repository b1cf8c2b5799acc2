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
================  =================================================  ==========================================

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


CORRECTIONS: dict[str, Callable[[Tensor, Tensor, float], Tensor] | None] = {  # none: no weight at all
    "none": None, "token_tis": token_tis, "seq_tis": seq_tis, "token_mask": token_mask, "seq_mask": seq_mask,
    "seq_reject": seq_reject,
}


def correct(name: str, logp_old: Tensor, logp_behaviour: Tensor, mask: Tensor, cap: float
            ) -> tuple[Tensor | None, dict[str, float]]:
    """(the stopped weights (N, T), or None for ``none``; the mismatch metrics) over the loss mask."""
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
    w = weigh(log_rho, mask.to(log_rho.dtype), cap) * mask
    has = m.any(-1)
    metrics.update({
        "rollout/is_weight_mean": float(w[m].sum()) / n_tok,
        "rollout/frac_masked": float(((w == 0) & m).sum()) / n_tok,
        "rollout/frac_rejected": float(((w.sum(-1) == 0) & has).sum()) / max(int(has.sum()), 1),
    })
    return w.detach(), metrics
