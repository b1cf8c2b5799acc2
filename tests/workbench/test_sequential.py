"""The group-sequential design (ema_pg.workbench.studies.sequential): boundaries against published values, the error rate
under no effect by simulation, and the verdict rules of one claim's looks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ema_pg.workbench.studies.sequential import (Design, detectable, fixed_power, look, outlook, power_at, simulate, spent, t_boundary,
                                        z_boundaries)

FIVE = [0.2, 0.4, 0.6, 0.8, 1.0]


def test_boundaries_match_the_published_lan_demets_values():
    """Five equally spaced looks, two-sided alpha 0.05: the Lan-DeMets O'Brien-Fleming-type and Pocock-type
    boundaries as tabulated by ldbounds / gsDesign (Reboussin et al. 2000, Table 1)."""
    obf = z_boundaries(FIVE, 0.05, "obrien_fleming")
    assert obf == pytest.approx([4.8769, 3.3570, 2.6803, 2.2898, 2.0310], abs=2e-4)
    pocock = z_boundaries(FIVE, 0.05, "pocock")
    assert pocock == pytest.approx([2.4380, 2.4268, 2.4102, 2.3966, 2.3860], abs=2e-4)
    # one look spends all of alpha: the fixed design's boundary
    assert z_boundaries([1.0], 0.05)[0] == pytest.approx(1.959964, abs=1e-5)


def test_boundaries_match_gsdesign_at_unequal_information_fractions():
    """gsDesign's gsBound with sfLDOF / sfLDPocock (alpha / 2 per side), computed by analysis/gsdesign_reference.R
    into tests/fixtures/gsdesign_boundaries.json (its source line names gsDesign's version and commit): the claims
    plan's looks, a look moved by a failed cell, looks ending short of the cap, another alpha, Pocock. Both sides
    integrate on grids and agree to about 5e-9; a boundary spent at other fractions differs by more than 1e-3."""
    ref = json.loads((Path(__file__).parents[1] / "fixtures" / "gsdesign_boundaries.json").read_text())
    assert "gsDesign" in ref["source"] and len(ref["cases"]) == 8
    for case in ref["cases"]:
        ours = z_boundaries(case["fractions"], case["alpha"], case["spending"])
        assert ours == pytest.approx(case["bounds"], abs=1e-7), case["name"]
    moved = next(c for c in ref["cases"] if "failed cell" in c["name"])
    planned = z_boundaries([10 / 60, 20 / 60, 30 / 60, 45 / 60, 1.0])
    assert max(abs(a - b) for a, b in zip(planned, moved["bounds"])) > 1e-3  # the fixture can tell the two apart


def test_the_spending_functions_spend_alpha_by_the_cap_and_nothing_at_zero():
    for s in ("obrien_fleming", "pocock"):
        assert spent(0.0, 0.05, s) == 0.0
        assert spent(1.0, 0.05, s) == pytest.approx(0.05, abs=1e-12)
        assert spent(0.5, 0.05, s) < 0.05
    assert spent(0.2, 0.05, "obrien_fleming") < spent(0.2, 0.05, "pocock")  # O'Brien-Fleming spends late
    with pytest.raises(ValueError, match="spending"):
        spent(0.5, 0.05, "haybittle")


def test_under_no_effect_false_holds_stay_at_or_under_half_alpha():
    """The whole procedure as the command applies it (t statistics of estimated sd, t boundaries), simulated:
    a "holds" under no effect at most alpha / 2 = 2.5% (within 3 Monte-Carlo standard errors), either verdict at
    most alpha; the same for Pocock's spending and for unequal looks."""
    for design in (Design(), Design(spending="pocock"), Design(looks=(5, 12, 20))):
        r = simulate(design, effect=0.0, sd=0.03, sims=40_000, seed=1)
        assert r["holds"] <= 0.025 + 3 * r["holds (MC se)"], (design, r)
        assert r["holds"] + r["fails"] <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 40_000), (design, r)
        assert r["holds"] > 0.015  # the boundaries are not so wide that nothing is ever decided


def test_under_an_effect_the_design_decides_with_the_fixed_designs_power_and_fewer_seeds():
    design = Design()
    r = simulate(design, effect=0.013, sd=0.028, sims=20_000, seed=2)
    fixed = fixed_power(0.013, 0.028, design.cap)
    assert abs(r["holds"] - fixed) < 0.02  # O'Brien-Fleming loses little power at the cap
    assert r["mean_seeds"] < 0.8 * design.cap  # and stops early on average
    assert r["fails"] == 0.0


def test_naive_repeated_looks_would_inflate_the_error():
    """The guard that the boundaries matter: testing at 1.96 at every look gives far more than 2.5% false holds."""
    rng = np.random.default_rng(3)
    d = rng.normal(0.0, 1.0, size=(20_000, 60))
    hit = np.zeros(20_000, dtype=bool)
    for n in Design().looks:
        x = d[:, :n]
        hit |= x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n)) >= t_boundary(1.959964, n)
    assert hit.mean() > 0.05


def test_a_look_stops_at_the_first_crossing_and_reports_the_repeated_interval():
    design = Design(looks=(5, 10, 20))
    strong = [0.05, 0.06, 0.055, 0.052, 0.058, 0.051, 0.057, 0.054, 0.056, 0.053]
    looks = look(design, [strong[:5], strong])
    assert [x.verdict for x in looks][-1] == "holds"
    first = looks[0]
    assert first.n == 5 and first.mean == pytest.approx(np.mean(strong[:5]))
    se = np.std(strong[:5], ddof=1) / math.sqrt(5)
    assert first.lo == pytest.approx(first.mean - first.bound * se)
    assert first.hi == pytest.approx(first.mean + first.bound * se)
    # a hopeless claim at the cap: stopped there, with its interval containing 0
    noise = np.random.default_rng(4).normal(0, 1, 20)
    noise -= noise.mean()
    out = look(design, [noise[:5], noise[:10], noise])
    assert [x.verdict for x in out] == ["continue", "continue", "stopped at the cap"]
    assert out[-1].lo < 0 < out[-1].hi
    # a clear negative: fails
    assert look(design, [[-x for x in strong[:5]], [-x for x in strong]])[-1].verdict == "fails"


def test_designs_refuse_what_cannot_be_a_design():
    with pytest.raises(ValueError, match="increasing"):
        Design(looks=(10, 10, 20))
    with pytest.raises(ValueError, match="at least 3"):
        Design(looks=(2, 10))
    with pytest.raises(ValueError, match="alpha"):
        Design(alpha=1.5)
    with pytest.raises(ValueError, match="at least 3"):
        look(Design(), [[0.1, 0.2]])


def test_an_open_claims_outlook_matches_the_closed_forms_of_one_last_look():
    """One look left, many seeds (so the t statistic is all but a z): the chance of "holds" at the cap is, with
    t = n_1 / N the information time, c the last z boundary and Z_1 the statistic so far,
    trend:      1 - Phi((c - Z_1 / sqrt t) / sqrt(1 - t))        (drift taken as Z_1 / sqrt t; Lan and Wittes),
    predictive: 1 - Phi((c - Z_1 / sqrt t) / sqrt((1 - t) / t))  (drift ~ N(Z_1 / sqrt t, 1 / t), flat prior),
    no effect:  1 - Phi((c - Z_1 sqrt t) / sqrt(1 - t))."""
    from scipy.stats import norm

    design = Design(looks=(200, 400))
    c = design.boundaries()[-1]
    sd, z1, t = 0.02, 1.0, 0.5
    mean = z1 * sd / math.sqrt(200)
    want = {"trend": norm.sf((c - z1 / math.sqrt(t)) / math.sqrt(1 - t)),
            "predictive": norm.sf((c - z1 / math.sqrt(t)) / math.sqrt((1 - t) / t)),
            "none": norm.sf((c - z1 * math.sqrt(t)) / math.sqrt(1 - t))}
    assert want["none"] + 0.1 < want["trend"] < want["predictive"] - 0.05  # three futures the test tells apart
    for effect, p in want.items():
        r = outlook(design, [200], mean, sd, effect, sims=40_000, seed=5)
        assert r["holds"] == pytest.approx(p, abs=0.008), (effect, r["holds"], p)
        assert r["holds"] + r["fails"] + r["stopped at the cap"] == pytest.approx(1.0)
        assert r["next_look"] == 400 and r["cap"] == 400
    # a number is an effect for every future seed: zero is "none"
    assert outlook(design, [200], mean, sd, 0.0, sims=40_000, seed=5)["holds"] == pytest.approx(want["none"], abs=0.008)


def test_the_outlook_goes_on_from_the_looks_actually_taken_and_refuses_a_claim_at_its_cap():
    """After a first look taken at 9 seeds instead of 10, the next look is the planned second one (20 seeds), not
    the planned first; a claim sitting just under its boundary with a strong trend is carried over it there nearly
    always."""
    design = Design(looks=(10, 20, 30))
    zb = design.boundaries([9, 20, 30])
    sd = 1.0
    mean = 0.9 * t_boundary(zb[0], 9) * sd / 3  # t at 9 seeds: 90% of its boundary
    r = outlook(design, [9], mean, sd, "trend", sims=20_000, seed=6)
    assert r["seeds"] == 9 and r["next_look"] == 20
    assert r["holds"] > 0.95 and r["fails"] == 0.0
    assert r["mean_seeds"] < 21
    with pytest.raises(ValueError, match="at its cap"):
        outlook(design, [10, 20, 30], 0.1, 1.0)
    with pytest.raises(ValueError, match="predictive"):
        outlook(design, [10], 0.1, 1.0, "hopeful")


def test_a_designs_power_is_its_simulation_and_its_detectable_effect_meets_the_fixed_design_at_one_look():
    """power_at is simulate's share of holds at effect / sd (the same simulated seeds); at a single look the design
    is the two-sided t test, whose power the noncentral t gives in closed form: the detectable effect found by
    bisection has that power, to Monte-Carlo error; O'Brien-Fleming's five looks cost a little over one look."""
    d = Design(looks=(10, 20, 30, 45, 60))
    assert power_at(d, 0.3) == simulate(d, 0.03, 0.1)["holds"]
    one = Design(looks=(60,))
    k1 = detectable(one)
    assert abs(fixed_power(k1, 1.0, 60) - 0.8) < 0.01
    assert detectable(d) > k1 and detectable(d) < 1.05 * k1
    assert power_at(d, 0.0) < 0.03  # no effect: a holds only by the design's error (alpha / 2)
