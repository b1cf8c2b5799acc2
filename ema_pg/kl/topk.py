"""Top-k KL estimators (§5.3, Algorithms 1 and 2, Appendix A).

Both split the vocabulary at position n into the index set q_n (k indices) and its tail:

    TopkKL_n = [exact KL restricted to q_n]  +  s * 1(y_n not in q_n) * [sampled KL]_n

* ``topk_reverse`` estimates KL(pi_theta || pi_ref); q_n = top-k of pi_old (the sampling
  policy); the tail is K4 (Alg 1).
* ``topk_forward`` estimates KL(pi_ref || pi_theta); q_n = top-k of the anchor; the tail is
  K5 (Alg 2).

``tail`` chooses the tail term:

``none``      Truncated KL: the head alone. Biased in value and in gradient.
``paper``     Alg 1/2 as printed. Unbiased in value. Its expected gradient is *not* the true
              one: K4 and K5 carry a baseline (sg on -log w; the ``log r`` term) that
              cancels only over the whole vocabulary. Restricted to the tail it leaves
              E[grad] = grad KL + grad pi_theta(q_n) (reverse) and
              E[grad] = grad KL - grad pi_theta(q_n) (forward),
              where pi_theta(q_n) = sum_{j in q_n} pi_theta(j) is the policy's head mass.
``corrected`` (default) ``paper`` plus the O(k) term -/+ (pi_theta(q_n) - sg(pi_theta(q_n))):
              value 0, gradient that removes the head-mass term exactly. Unbiased in value
              and gradient for any index set q_n, and keeps the low-variance K4/K5 tail.

Derivation of the head-mass term (reverse; forward is the same with the sign flipped):
E_p[1(p notin q) grad K4] = sum_{j notin q} pi(j) l(j) grad log pi(j), while the true tail
gradient grad sum_{j notin q} pi(j) l(j) adds sum_{j notin q} grad pi(j) = -grad pi(q).

``k = 0`` (empty q_n) reduces both to their sampled estimator (K4, K5); ``k = |V|`` to the
exact KL. With ``iw_clip`` wide enough that nothing is clipped, sampling from pi_old keeps
everything above; ``iw_clip = (1, 1)`` switches the off-policy correction off.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import KLInputs, in_index_set, offpolicy_weight, require
from .sampled import k4_core, k5_core

TAILS = ("none", "paper", "corrected")


def _head_mass_term(topk_logp: Tensor) -> Tensor:
    """pi_theta(q_n) - sg(pi_theta(q_n)): value 0, gradient grad pi_theta(q_n)."""
    mass = topk_logp.exp().sum(-1)  # (B, T)
    return mass - mass.detach()


def _tail_mask(inp: KLInputs, name: str) -> Tensor:
    """(B, T) float: 1 where the sampled token lies outside q_n."""
    if inp.topk_idx is None:  # k = 0: the whole vocabulary is tail
        return torch.ones_like(inp.logp)
    require(inp, name, "tokens")
    return (~in_index_set(inp.tokens, inp.topk_idx)).to(inp.logp.dtype)


def _check_k(inp: KLInputs, name: str, k: int) -> bool:
    """Return whether there is a head; check the inputs' k against the estimator's."""
    if k == 0 and inp.topk_idx is None:
        return False
    require(inp, name, "tokens", "topk_idx", "topk_logp", "topk_logp_ref")
    got = inp.topk_idx.shape[-1]
    if got != k:
        raise ValueError(f"{name}: estimator has k={k} but topk_idx holds {got} indices per token")
    return got > 0


def topk_reverse(inp: KLInputs, *, k: int, tail: str, iw_clip: tuple[float, float]) -> Tensor:
    """Top-k reverse KL (Alg 1, eq. 25-26). q_n must come from pi_old (``topk_source``)."""
    has_head = _check_k(inp, "topk_reverse", k)
    out = torch.zeros_like(inp.logp)
    if has_head:
        lp, lr = inp.topk_logp, inp.topk_logp_ref.detach()  # (B, T, k)
        out = out + (lp.exp() * (lp - lr)).sum(-1)  # truncated KL, (B, T)
    if tail == "none":
        return out
    s = offpolicy_weight(inp, iw_clip)
    out = out + s * _tail_mask(inp, "topk_reverse") * k4_core(inp)
    if tail == "corrected" and has_head:
        out = out - _head_mass_term(inp.topk_logp)
    return out


def topk_forward(inp: KLInputs, *, k: int, tail: str, iw_clip: tuple[float, float]) -> Tensor:
    """Top-k forward KL (Alg 2, eq. 27). q_n must come from the anchor (``topk_source``)."""
    has_head = _check_k(inp, "topk_forward", k)
    out = torch.zeros_like(inp.logp)
    if has_head:
        lp, lr = inp.topk_logp, inp.topk_logp_ref.detach()  # (B, T, k)
        out = out + (lr.exp() * (lr - lp)).sum(-1)  # truncated forward KL, (B, T)
    if tail == "none":
        return out
    s = offpolicy_weight(inp, iw_clip)
    out = out + s * _tail_mask(inp, "topk_forward") * k5_core(inp)
    if tail == "corrected" and has_head:
        out = out + _head_mass_term(inp.topk_logp)
    return out
