"""The paper's stability lemma (§4, Lemma 4.2) with a stale anchor: what ``anchor.align=behaviour`` changes.

Per eigen-direction of the Fisher (eigenvalue lambda, a = alpha beta lambda), the lemma's linearized step is

    theta_{t+1} = theta_t + alpha g - a (theta_t - m_t),      m_{t+1} = eta m_t + (1 - eta) theta_t

(m the EMA anchor, updated every step). Its lag delta = theta - m decays by chi = eta - a per step: stable iff
a < 1 + eta (eq. 9). With rollouts k versions behind and the anchor aligned to the behaviour version, the KL
pulls theta_t toward m_{t-k}, the anchor k steps ago: the pull's lag is delta_t + (m_t - m_{t-k}), the
anchor's own recent movement added. The recursion is then a delayed one; its characteristic polynomial is

    (z - 1 + a)(z - eta) z^k - a (1 - eta)

whose root z = 1 is the common drift of theta and m (no lag), and whose other roots govern the lag. With the
anchor aligned current, the pull is toward m_t as in the lemma (k = 0 here); the staleness is then in the
policy-gradient term, which the lemma holds constant (its assumption (7)).
"""

from __future__ import annotations

import numpy as np


def lag_roots(a: float, eta: float, k: int) -> np.ndarray:
    """The roots of (z - 1 + a)(z - eta) z^k - a (1 - eta) but the drift root z = 1: the lag's modes for
    a = alpha beta lambda, EMA rate eta and an anchor k steps behind (k = 0: the lemma, one root eta - a)."""
    p = np.polymul(np.polymul([1.0, a - 1.0], [1.0, -eta]), [1.0] + [0.0] * k)
    p[-1] -= a * (1.0 - eta)
    q, _ = np.polydiv(p, [1.0, -1.0])  # p(1) = 0 for every a, eta, k: divide the drift root out
    return np.roots(q)


def stability_bound(eta: float, k: int, hi: float = 8.0, tol: float = 1e-10) -> float:
    """The largest a = alpha beta lambda below which every lag mode decays (all roots of :func:`lag_roots` inside
    the unit circle), by bisection on [0, hi]: 1 + eta at k = 0 (eq. 9)."""
    def stable(a: float) -> bool:
        return bool(np.max(np.abs(lag_roots(a, eta, k))) < 1.0)

    lo = 0.0
    if stable(hi):
        return float("inf")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stable(mid) else (lo, mid)
    return lo
