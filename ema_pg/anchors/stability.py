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

Partial rollouts (``rollout.partial=true``) mix versions within a batch: a token sampled by version t - d is scored,
aligned, by the anchor m_{t-d}. If a share w_d of the batch's KL weight sits at delay d (sum of w_d = 1), the pull is
toward sum_d w_d m_{t-d}, and with K the largest delay the polynomial becomes

    (z - 1 + a)(z - eta) z^K - a (1 - eta) sum_d w_d z^(K - d)

(from (z - 1 + a) Theta = a sum_d w_d z^-d M and (z - eta) M = (1 - eta) Theta in z-transforms; z = 1 is again a
root, since the w_d sum to 1). One delay k is the case w_k = 1.
"""

from __future__ import annotations

import numpy as np


def delay_weights(k: int | dict[int, float]) -> dict[int, float]:
    """{delay: share of the KL weight}: one delay ``k`` (w_k = 1), or a mixture (partial rollouts), normalized."""
    w = {int(k): 1.0} if isinstance(k, int) else {int(d): float(x) for d, x in k.items() if x}
    if not w or min(w) < 0 or min(w.values()) < 0:
        raise ValueError(f"delays must be >= 0 with non-negative weights, not all zero; got {k}")
    total = sum(w.values())
    return {d: x / total for d, x in w.items()}


def lag_roots(a: float, eta: float, k: int | dict[int, float]) -> np.ndarray:
    """The roots of (z - 1 + a)(z - eta) z^K - a (1 - eta) sum_d w_d z^(K - d) but the drift root z = 1: the lag's modes
    for a = alpha beta lambda, EMA rate eta and an anchor k steps behind (k = 0: the lemma, one root eta - a), or a mix
    of delays ``{d: w_d}`` (module docstring)."""
    w = delay_weights(k)
    K = max(w)
    p = np.polymul(np.polymul([1.0, a - 1.0], [1.0, -eta]), [1.0] + [0.0] * K)
    for d, x in w.items():  # z^(K - d) sits at index len(p) - 1 - (K - d)
        p[len(p) - 1 - (K - d)] -= a * (1.0 - eta) * x
    q, _ = np.polydiv(p, [1.0, -1.0])  # p(1) = 0 for every a, eta, k: divide the drift root out
    return np.roots(q)


def stability_bound(eta: float, k: int | dict[int, float], hi: float = 8.0, tol: float = 1e-10) -> float:
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
