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
abs     |log w|                                  biased          biased (sign(log pi/ref) score)
======  =======================================  ==============  =========================

Two options of the authors' code and the peers, off by default:

- ``straight_through`` (the "+" variants, e.g. K3+): the value of K_n with the gradient of K2,
  sg(K_n) + K2 - sg(K2); on-policy it keeps K_n's value and gets K2's unbiased reverse-KL gradient.
- ``clamp`` (K3, K3++ and K5): the authors' numerical guard, log w clamped to [-20, 20] (and K3 to
  [-10, 10]); exact wherever |log w| and K3 are inside those ranges, gradient 0 where clamped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import KLInputs, offpolicy_weight, ratio_r


def _log_w(inp: KLInputs) -> Tensor:
    return inp.logp_ref - inp.logp  # (B, T) log w, differentiable through logp


CLAMP_LOG_W, CLAMP_VALUE = 20.0, 10.0  #: the authors' clamp of K3 / K3++ / K5 (``clamp=True``; K5: log w only)


def _finish(inp: KLInputs, core: Tensor, iw_clip: tuple[float, float], straight_through: bool) -> Tensor:
    """s * core, or with ``straight_through`` s * (sg(core) + K2 - sg(K2)): K_n's value, K2's gradient."""
    if straight_through:
        k2_core = 0.5 * _log_w(inp) ** 2
        core = core.detach() + k2_core - k2_core.detach()
    return offpolicy_weight(inp, iw_clip) * core


def k1(inp: KLInputs, *, iw_clip: tuple[float, float], straight_through: bool) -> Tensor:
    """K1 = -log w: unbiased value, zero expected gradient."""
    return _finish(inp, -_log_w(inp), iw_clip, straight_through)


def k2(inp: KLInputs, *, iw_clip: tuple[float, float], straight_through: bool) -> Tensor:
    """K2 = (log w)^2 / 2: biased value, unbiased reverse-KL gradient (straight_through changes nothing)."""
    return _finish(inp, 0.5 * _log_w(inp) ** 2, iw_clip, straight_through)


def k3_core(log_w: Tensor) -> Tensor:
    """-log w + w - 1 (non-negative for every w > 0)."""
    return torch.expm1(log_w) - log_w


def _k3_clamped(inp: KLInputs, clamp: bool) -> Tensor:
    if not clamp:
        return k3_core(_log_w(inp))
    return k3_core(_log_w(inp).clamp(-CLAMP_LOG_W, CLAMP_LOG_W)).clamp(-CLAMP_VALUE, CLAMP_VALUE)


def k3(inp: KLInputs, *, iw_clip: tuple[float, float], clamp: bool, straight_through: bool) -> Tensor:
    """K3 = -log w + w - 1 (GRPO's default): unbiased value, forward-KL gradient."""
    return _finish(inp, _k3_clamped(inp, clamp), iw_clip, straight_through)


def k3pp(inp: KLInputs, *, iw_clip: tuple[float, float], clamp: bool, straight_through: bool) -> Tensor:
    """K3++ = r K3 (eq. 22): unbiased reverse-KL value and gradient."""
    return _finish(inp, ratio_r(inp.logp) * _k3_clamped(inp, clamp), iw_clip, straight_through)


def k4_core(inp: KLInputs) -> Tensor:
    """r sg(-log w) (eq. 23), without the off-policy weight."""
    return ratio_r(inp.logp) * (-_log_w(inp)).detach()


def k4(inp: KLInputs, *, iw_clip: tuple[float, float], straight_through: bool) -> Tensor:
    """K4 = r sg(-log w) (eq. 23): unbiased reverse-KL value and gradient."""
    return _finish(inp, k4_core(inp), iw_clip, straight_through)


def k5_core(inp: KLInputs, clamp: bool = False) -> Tensor:
    """sg(w) log w + log r (eq. 24), without the off-policy weight; ``clamp``: log w to [-20, 20] first."""
    log_w = _log_w(inp) if not clamp else _log_w(inp).clamp(-CLAMP_LOG_W, CLAMP_LOG_W)
    log_r = inp.logp - inp.logp.detach()  # value 0, gradient = score
    return torch.exp(log_w.detach()) * log_w + log_r


def k5(inp: KLInputs, *, iw_clip: tuple[float, float], clamp: bool, straight_through: bool) -> Tensor:
    """K5 = sg(w) log w + log r (eq. 24): unbiased forward-KL value and gradient."""
    return _finish(inp, k5_core(inp, clamp), iw_clip, straight_through)


def abs_kl(inp: KLInputs, *, iw_clip: tuple[float, float], straight_through: bool) -> Tensor:
    """|log w| (the peers' ``abs``): a distance, biased for the KL in value and gradient."""
    return _finish(inp, _log_w(inp).abs(), iw_clip, straight_through)
