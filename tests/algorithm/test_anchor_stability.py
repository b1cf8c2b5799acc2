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


def simulate_mixed(a: float, eta: float, w: dict[int, float], steps: int = 4000) -> float:
    """|lag| of the recursion whose KL pulls theta to sum_d w_d m_{t-d} (a partial-rollout batch: a share w_d of its
    tokens sampled d versions back, each scored by the anchor of its version)."""
    theta, m = [1.0], [0.0]
    for t in range(steps):
        ref = sum(x * m[max(0, t - d)] for d, x in w.items())
        theta.append(theta[-1] - a * (theta[-1] - ref))
        m.append(eta * m[-1] + (1 - eta) * theta[-2])
    return abs(theta[-1] - m[-1])


def test_one_delay_given_as_a_mixture_is_that_delay():
    for k in (0, 1, 3):
        assert sorted(lag_roots(0.4, 0.9, {k: 1.0}), key=abs) == pytest.approx(sorted(lag_roots(0.4, 0.9, k), key=abs))


@pytest.mark.parametrize("eta", [0.5, 0.9, 0.99])
def test_half_the_tokens_one_and_half_two_versions_back_is_stable_up_to_a_2(eta):
    # by hand: p(z) = (z - 1 + a)(z - eta) z^2 - a (1 - eta)(z + 1) / 2, so p(-1) = (2 - a)(1 + eta): 0 at a = 2
    assert stability_bound(eta, {1: 0.5, 2: 0.5}) == pytest.approx(2.0, abs=1e-8)


@pytest.mark.parametrize("w", [{1: 0.5, 2: 0.5}, {1: 0.75, 2: 0.25}, {1: 0.5, 2: 0.25, 3: 0.25}])
def test_the_mixed_bound_separates_decaying_from_growing_simulated_lags(w):
    eta = 0.9
    b = stability_bound(eta, w)
    assert simulate_mixed(0.97 * b, eta, w) < 1e-3
    assert simulate_mixed(1.03 * b, eta, w) > 1e3


def test_no_random_mixture_of_delays_is_stable_over_a_narrower_range_than_the_lemmas():
    """docs/async.md's claim about partial rollouts' behaviour-aligned anchor: in random mixtures of delays 0..6 the
    stable range of alpha beta lambda never falls below the lemma's 1 + eta."""
    import numpy as np

    rng = np.random.default_rng(0)
    for eta in (0.5, 0.9, 0.99):
        for _ in range(20):
            w = rng.dirichlet(np.ones(int(rng.integers(2, 8))))
            assert stability_bound(eta, {d: float(x) for d, x in enumerate(w)}, tol=1e-7) >= 1 + eta - 1e-6


def test_the_partial_rollout_table_of_docs_async_is_what_the_code_computes():
    """docs/async.md's table of mixed delays (eta = 0.9): each row's bound and lag decay at a = 0.1, recomputed."""
    import re
    from fractions import Fraction
    from pathlib import Path

    import numpy as np

    text = (Path(__file__).resolve().parents[2] / "docs" / "async.md").read_text()
    table = text[text.index("| delays d: shares w_d |"):].split("\n\n")[0].splitlines()[2:]
    assert len(table) == 4
    for line in table:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        w = {int(d): float(Fraction(x)) for d, x in re.findall(r"(\d+): (\d+(?:/\d+)?)", cells[0].split(" (")[0])}
        assert f"{stability_bound(0.9, w):.3f}" == cells[1].split()[0], line
        assert f"{float(np.max(np.abs(lag_roots(0.1, 0.9, w)))):.3f}" == cells[2], line
