"""Sampled token-level KL estimators of Table 1 (§5.2, Appendices E and F).

Each takes the log-probs of the sampled token only (O(1) memory per token) and multiplies the
result by the clipped off-policy weight s = sg(pi_theta/pi_sampling) (§5.2): with
``iw_clip`` wide enough that no weight is clipped, every estimator below keeps under
y ~ pi_sampling the expectation it has on-policy under y ~ pi_theta.

What each one estimates, under E_p with p ~ pi_theta (Table 1):

======  =======================================  ==============  =========================
name    expression                               value           E[autodiff gradient]
======  =======================================  ==============  =========================
k1      -log w                                   KL(pi||ref) ok  0 (biased)
k2      (log w)^2 / 2                            biased          grad KL(pi||ref) ok
k3      -log w + w - 1                           KL(pi||ref) ok  grad KL(ref||pi) (biased)
k3pp    r (-log w + w - 1)          (eq. 22)     KL(pi||ref) ok  grad KL(pi||ref) ok
k4      r sg(-log w)                (eq. 23)     KL(pi||ref) ok  grad KL(pi||ref) ok
k5      sg(w) log w + log r         (eq. 24)     KL(ref||pi) ok  grad KL(ref||pi) ok
======  =======================================  ==============  =========================
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import KLInputs, offpolicy_weight, ratio_r


def _log_w(inp: KLInputs) -> Tensor:
    return inp.logp_ref - inp.logp  # (B, T) log w, differentiable through logp


def k1(inp: KLInputs, *, iw_clip: tuple[float, float]) -> Tensor:
    """K1 = -log w: unbiased value, zero expected gradient."""
    return offpolicy_weight(inp, iw_clip) * (-_log_w(inp))


def k2(inp: KLInputs, *, iw_clip: tuple[float, float]) -> Tensor:
    """K2 = (log w)^2 / 2: biased value, unbiased reverse-KL gradient."""
    return offpolicy_weight(inp, iw_clip) * 0.5 * _log_w(inp) ** 2


def k3_core(log_w: Tensor) -> Tensor:
    """-log w + w - 1 (non-negative for every w > 0)."""
    return torch.expm1(log_w) - log_w


def k3(inp: KLInputs, *, iw_clip: tuple[float, float]) -> Tensor:
    """K3 = -log w + w - 1 (GRPO's default): unbiased value, forward-KL gradient."""
    return offpolicy_weight(inp, iw_clip) * k3_core(_log_w(inp))


def k3pp(inp: KLInputs, *, iw_clip: tuple[float, float]) -> Tensor:
    """K3++ = r K3 (eq. 22): unbiased reverse-KL value and gradient."""
    return offpolicy_weight(inp, iw_clip) * ratio_r(inp.logp) * k3_core(_log_w(inp))


def k4_core(inp: KLInputs) -> Tensor:
    """r sg(-log w) (eq. 23), without the off-policy weight."""
    return ratio_r(inp.logp) * (-_log_w(inp)).detach()


def k4(inp: KLInputs, *, iw_clip: tuple[float, float]) -> Tensor:
    """K4 = r sg(-log w) (eq. 23): unbiased reverse-KL value and gradient."""
    return offpolicy_weight(inp, iw_clip) * k4_core(inp)


def k5_core(inp: KLInputs) -> Tensor:
    """sg(w) log w + log r (eq. 24), without the off-policy weight."""
    log_w = _log_w(inp)
    log_r = inp.logp - inp.logp.detach()  # value 0, gradient = score
    return torch.exp(log_w.detach()) * log_w + log_r


def k5(inp: KLInputs, *, iw_clip: tuple[float, float]) -> Tensor:
    """K5 = sg(w) log w + log r (eq. 24): unbiased forward-KL value and gradient."""
    return offpolicy_weight(inp, iw_clip) * k5_core(inp)
