"""The stability lemma with a stale anchor (``ema_pg.anchors.stability``), against the lemma and a simulation."""

import pytest

from ema_pg.anchors.stability import lag_roots, stability_bound


def simulate(a: float, eta: float, k: int, steps: int = 4000) -> float:
    """|lag| after ``steps`` steps of the delayed recursion from a unit lag (g = 0): the KL pulls theta to m_{t-k}."""
    theta, m = [1.0], [0.0]
    for t in range(steps):
        ref = m[max(0, t - k)]
        theta.append(theta[-1] - a * (theta[-1] - ref))
        m.append(eta * m[-1] + (1 - eta) * theta[-2])
    return abs(theta[-1] - m[-1])


@pytest.mark.parametrize("a, eta", [(0.3, 0.9), (1.2, 0.9), (0.05, 0.99)])
def test_without_staleness_the_lag_decays_by_the_lemmas_chi(a, eta):
    roots = lag_roots(a, eta, 0)
    assert roots == pytest.approx([eta - a])  # Lemma 4.2: chi = eta - alpha beta lambda


@pytest.mark.parametrize("eta", [0.9, 0.99])
def test_the_bound_is_the_lemmas_at_k0_and_where_z_minus_1_crosses_at_k1_and_k2(eta):
    assert stability_bound(eta, 0) == pytest.approx(1 + eta, abs=1e-8)  # eq. 9
    # by hand: p(-1) = 0 at a = (1 + eta) / eta for k = 1 and at a = 1 + eta for k = 2
    assert stability_bound(eta, 1) == pytest.approx((1 + eta) / eta, abs=1e-8)
    assert stability_bound(eta, 2) == pytest.approx(1 + eta, abs=1e-8)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_the_bound_separates_decaying_from_growing_simulated_lags(k):
    eta = 0.9
    b = stability_bound(eta, k)
    assert simulate(0.97 * b, eta, k) < 1e-3
    assert simulate(1.03 * b, eta, k) > 1e3
