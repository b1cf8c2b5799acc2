"""Group-sequential decisions on paired seeds: looks after batches of seeds, boundaries by alpha spending.

A claim "A > B" is decided on the paired differences d_s = score(A, s) - score(B, s) over training seeds s, as
every fixed-seed verdict of the workbench is (:mod:`ema_pg.workbench.results`). Instead of one look at a fixed
number of seeds, the design looks after batches of seeds (n_1 < n_2 < ... < n_K = N, the cap) and stops a claim at
the first look whose statistic crosses a boundary:

- at look k, T_k = mean(d) / (sd(d) / sqrt(n_k)), the paired t statistic of the n_k seeds so far;
- **holds** if T_k >= b_k, **fails** if T_k <= -b_k, otherwise the next look; at the cap with neither,
  **stopped at the cap** (undecided), reported with its interval like any other verdict.

The boundaries keep the overall error at ``alpha`` (two-sided, symmetric: under no effect, the chance of a "holds"
at any look is alpha / 2, and of either verdict alpha), by Lan and DeMets' alpha spending (Biometrika 1983): the
z statistics of the looks are those of a Brownian motion at information times t_k = n_k / N, and the boundary c_k
of look k is set so that the chance of first crossing at look k, under no effect, is alpha(t_k) - alpha(t_{k-1}),
computed by the recursive numerical integration of Armitage, McPherson and Rowe (1969) on a grid. Spending
functions (two-sided alpha):

- ``obrien_fleming`` (the default): each side spends alpha / 2 by 2 - 2 Phi(z_{1 - alpha/4} / sqrt t), as
  ``ldbounds`` and ``gsDesign`` do for a two-sided design (equal to gsDesign's ``gsBound`` with ``sfLDOF`` to
  5e-9 at unequal fractions: ``tests/fixtures/gsdesign_boundaries.json``). Early looks need overwhelming
  evidence (|z| > 4.87 at a fifth of the seeds), the last one little more than the fixed design's 1.96 (2.03 at five equal looks), so
  stopping early costs little at the cap;
- ``pocock``: alpha(t) = alpha ln(1 + (e - 1) t), about equal boundaries at every look: stops early more often,
  at the price of a higher last boundary.

The differences' sd is estimated, so each look's boundary is carried from the z scale to the t distribution with
n_k - 1 degrees of freedom at the same nominal one-sided p-value (the usual small-sample correction); the
simulation measures what it gives: the false "holds" rate sits a little above alpha / 2 (`analysis/sequential_calibration.py`,
`reproductions/sequential_calibration/calibration.json`).
At each look the **repeated confidence interval** mean +- b_k sd / sqrt(n_k) covers the true mean difference at
every look at once with probability >= 1 - alpha (Jennison and Turnbull, 1989): the interval reported with a
verdict, whenever the design stops. A look taken at another number of seeds than planned (a run that failed)
spends alpha at its actual information time; the cap N stays as registered.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import numpy as np

SPENDING = ("obrien_fleming", "pocock")  #: the spending functions a design may name
VERDICTS = ("holds", "fails", "continue", "stopped at the cap")  #: a look's outcome for one claim
#: paired differences whose sd is at most this times their size do not vary: identical up to float rounding
#: (0.35 - 0.30 and 0.40 - 0.35 differ in the last bits), their t statistic undefined
FLAT = 1e-12


def _phi(x):
    return np.exp(-0.5 * np.square(x)) / math.sqrt(2 * math.pi)


def _Phi(x):
    from scipy.special import ndtr

    return ndtr(x)


def _Phi_inv(p):
    from scipy.special import ndtri

    return ndtri(p)


def spent(t: float, alpha: float, spending: str) -> float:
    """Two-sided alpha spent by information time ``t`` in [0, 1]."""
    if spending not in SPENDING:
        raise ValueError(f"spending={spending!r}; choose one of {', '.join(SPENDING)}")
    if t <= 0:
        return 0.0
    t = min(t, 1.0)
    if spending == "obrien_fleming":  # each side spends alpha / 2 by the one-sided function
        return float(2.0 * (2.0 - 2.0 * _Phi(_Phi_inv(1.0 - alpha / 4) / math.sqrt(t))))
    return float(alpha * math.log(1.0 + (math.e - 1.0) * t))


def z_boundaries(fractions, alpha: float = 0.05, spending: str = "obrien_fleming", grid: int = 4001) -> list[float]:
    """The two-sided z boundaries c_1..c_K at increasing information times ``fractions`` (the last <= 1), so that
    under no effect the chance of |Z_k| >= c_k first at look k is alpha(t_k) - alpha(t_{k-1}).

    Recursive integration over the continuation region of B(t) = Z sqrt(t), a Brownian motion: the density of
    B(t_k) on paths that have not stopped is carried on a grid of ``grid`` points (Simpson weights) from one look
    to the next by the Gaussian transition kernel. Each design is computed once per process (a claims page asks
    the same few designs at every look of every plan)."""
    return list(_z_boundaries(tuple(float(t) for t in fractions), float(alpha), spending, int(grid)))


@functools.lru_cache(maxsize=256)
def _z_boundaries(ts: tuple[float, ...], alpha: float, spending: str, grid: int) -> tuple[float, ...]:
    if not ts or any(b <= a for a, b in zip(ts, ts[1:])) or ts[0] <= 0 or ts[-1] > 1 + 1e-12:
        raise ValueError(f"information fractions must increase within (0, 1]; got {list(ts)}")
    grid += 1 - grid % 2  # an odd number of points for Simpson's rule
    bounds: list[float] = []
    x = w = dens = None  # the grid over the last continuation region, its weights, the density on it
    prev_t, prev_spend = 0.0, 0.0
    for t in ts:
        target = spent(t, alpha, spending) - prev_spend
        dt = t - prev_t
        if x is None:  # the first look: B(t_1) ~ N(0, t_1)
            c = float(_Phi_inv(1.0 - target / 2))

            def exit_prob(c_, t=t):
                return 2.0 * (1.0 - _Phi(c_))
        else:
            sd = math.sqrt(dt)

            def exit_prob(c_, t=t, sd=sd):  # P(not stopped before, |B(t)| >= c sqrt t)
                h = c_ * math.sqrt(t)
                tail = (1.0 - _Phi((h - x) / sd)) + _Phi((-h - x) / sd)
                return float(np.sum(w * dens * tail))
            lo, hi = 0.0, 40.0
            for _ in range(200):  # exit_prob falls as c grows
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if exit_prob(mid) > target else (lo, mid)
            c = 0.5 * (lo + hi)
        bounds.append(c)
        # the density of B(t) on the paths still going, over the new continuation region (-h, h)
        h = c * math.sqrt(t)
        x_new = np.linspace(-h, h, grid)
        step = x_new[1] - x_new[0]
        w_new = np.full(grid, 2.0)
        w_new[1:-1:2] = 4.0
        w_new[0] = w_new[-1] = 1.0
        w_new *= step / 3.0
        if x is None:
            dens = _phi(x_new / math.sqrt(t)) / math.sqrt(t)
        else:
            sd = math.sqrt(dt)
            kernel = _phi((x_new[:, None] - x[None, :]) / sd) / sd  # (new, old)
            dens = kernel @ (w * dens)
        x, w = x_new, w_new
        prev_t, prev_spend = t, spent(t, alpha, spending)
    return tuple(bounds)


def t_boundary(c: float, n: int) -> float:
    """The z boundary ``c`` carried to the t distribution with n - 1 degrees of freedom at the same one-sided
    nominal p-value."""
    from scipy.stats import t as student_t

    return float(student_t.isf(1.0 - _Phi(c), df=n - 1))


@dataclass(frozen=True)
class Design:
    """A pre-registered group-sequential design: the looks (numbers of paired seeds, the last is the cap), the
    two-sided overall error and the spending function."""

    looks: tuple[int, ...] = (10, 20, 30, 45, 60)
    alpha: float = 0.05
    spending: str = "obrien_fleming"

    def __post_init__(self):
        if bad := [n for n in self.looks if isinstance(n, bool) or not isinstance(n, (int, float))
                   or isinstance(n, float) and not n.is_integer()]:
            raise ValueError(f"looks={list(self.looks)}: {bad[0]!r} is not a whole number of seeds; give whole "
                             "numbers (a look is taken after that many paired seeds)")
        looks = tuple(int(n) for n in self.looks)
        object.__setattr__(self, "looks", looks)
        if len(looks) < 1 or looks[0] < 3 or any(b <= a for a, b in zip(looks, looks[1:])):
            raise ValueError(f"looks={list(looks)}: give increasing numbers of seeds, the first at least 3")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha={self.alpha} must be in (0, 1)")
        if self.spending not in SPENDING:
            raise ValueError(f"spending={self.spending!r}; choose one of {', '.join(SPENDING)}")

    @property
    def cap(self) -> int:
        return self.looks[-1]

    def boundaries(self, taken: list[int] | None = None) -> list[float]:
        """Z boundaries of the looks taken so far at ``taken`` seeds (default: the planned looks)."""
        ns = list(taken) if taken is not None else list(self.looks)
        return z_boundaries([n / self.cap for n in ns], self.alpha, self.spending)


@dataclass
class Look:
    """One claim at one look."""

    look: int  # 1-based
    n: int  # paired seeds
    mean: float  # mean paired difference
    sd: float  # its sd over seeds
    t: float  # paired t statistic
    z_bound: float  # the boundary on the z scale (alpha spent at n / cap)
    bound: float  # the boundary on the t scale with n - 1 degrees of freedom
    lo: float  # the repeated confidence interval of the mean difference
    hi: float
    verdict: str  # holds | fails | continue | stopped at the cap

    def row(self) -> dict:
        return asdict(self)


def look(design: Design, diffs_by_look: list, final: bool | None = None) -> list[Look]:
    """The looks of one claim: ``diffs_by_look[k]`` holds the paired differences of every seed at look k (the
    seeds of look k include those of the looks before). Stops at the first look that decides; the last look
    given is the cap's when its size is the cap (or ``final``)."""
    taken = [len(d) for d in diffs_by_look]
    out: list[Look] = []
    for k, d in enumerate(diffs_by_look, 1):
        last = None if final is None or k < len(diffs_by_look) else final
        out.append(look_at(design, taken[: k - 1], d, last))
        if out[-1].verdict != "continue":
            break
    return out


def look_at(design: Design, taken_before: list[int], diffs, final: bool | None = None) -> Look:
    """Look number ``len(taken_before) + 1`` of one claim, on the paired differences ``diffs`` of every seed so far:
    its boundary spends alpha at the seeds each earlier look had when it was taken (``taken_before``, as looks.csv
    records them) and at this look's. ``final``: whether this is the cap's look (default: when its seeds reach the
    cap).

    No verdict comes from a degenerate statistic: differences that do not vary (sd 0 to float rounding, :data:`FLAT`:
    the t statistic is undefined, not infinite) or that are not all finite decide nothing at this look; the claim continues (at the cap it is
    stopped at the cap), with t and the interval NaN."""
    d = np.asarray(diffs, dtype=float)
    n = len(d)
    if n < 3:
        raise ValueError(f"a look needs at least 3 paired seeds; got {n}")
    k = len(taken_before) + 1
    c = design.boundaries(list(taken_before) + [n])[-1]
    b = t_boundary(c, n)
    last = (n >= design.cap) if final is None else final
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if not (math.isfinite(mean) and math.isfinite(sd)) or sd <= FLAT * max(1.0, float(np.abs(d).max())):
        nan = float("nan")
        return Look(k, n, mean, sd, nan, c, b, nan, nan, "stopped at the cap" if last else "continue")
    se = sd / math.sqrt(n)
    t = mean / se
    verdict = "holds" if t >= b else "fails" if t <= -b else ("stopped at the cap" if last else "continue")
    return Look(k, n, mean, sd, t, c, b, mean - b * se, mean + b * se, verdict)


def simulate(design: Design, effect: float, sd: float, sims: int = 20_000, seed: int = 0) -> dict:
    """Operating characteristics by simulation: paired differences ~ Normal(``effect``, ``sd``) per seed, the
    design's looks and t boundaries as :func:`look` applies them. Returns the shares of holds, fails and
    stopped-at-the-cap verdicts, each with its Monte-Carlo standard error, and the mean number of seeds used."""
    rng = np.random.default_rng(seed)
    d = rng.normal(effect, sd, size=(sims, design.cap))

    def t_at(n):
        x = d[:, :n]
        return x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
    return {"sims": sims, "effect": effect, "sd": sd, **_verdict_shares(design.looks, design.boundaries(), t_at, sims)}


def _verdict_shares(ns, zb, t_at, sims: int) -> dict:
    """``sims`` simulated claims taken through looks at ``ns`` seeds with z boundaries ``zb``, as :func:`look`
    decides: ``t_at(n)`` gives every simulated claim's t statistic at n seeds. The shares of each verdict (with
    their Monte-Carlo standard errors) and the mean number of seeds used."""
    state = np.zeros(sims, dtype=np.int8)  # 0 going, 1 holds, 2 fails
    used = np.full(sims, ns[-1])
    for n, c in zip(ns, zb):
        t = t_at(n)
        b = t_boundary(c, n)
        going = state == 0
        up, down = going & (t >= b), going & (t <= -b)
        state[up], state[down] = 1, 2
        used[up | down] = n
    out = {"mean_seeds": float(used.mean())}
    for name, code in (("holds", 1), ("fails", 2), ("stopped at the cap", 0)):
        p = float((state == code).mean())
        out[name] = p
        out[f"{name} (MC se)"] = math.sqrt(p * (1 - p) / sims)
    return out


OUTLOOKS = {"trend": "if the effect is what the seeds so far estimate",
            "predictive": "averaged over the uncertainty of the effect",
            "none": "if there is no effect from here on"}  #: the futures :func:`outlook` may assume


def outlook(design: Design, taken: list[int], mean: float, sd: float, effect: float | str = "trend",
            sims: int = 20_000, seed: int = 0) -> dict:
    """Where an open claim may end: the chance of each verdict by the cap, given the looks ``taken`` so far (their
    numbers of seeds; the last one's paired differences have ``mean`` and ``sd``) and the planned looks still to
    come, if each seed still to come differs by Normal(mu, ``sd``), where mu is ``effect`` when it is a number, or:

    - ``"trend"``: mu = ``mean``, the effect the seeds so far estimate (the conditional power of Lan and Wittes,
      1988), which takes the estimate for the truth and so is sure of itself;
    - ``"predictive"``: mu drawn per simulated future from Normal(``mean``, ``sd`` / sqrt(n)), the effect's
      uncertainty after n seeds under a flat prior (the predictive power of Spiegelhalter, Freedman and
      Blackburn, 1986): the one to plan by;
    - ``"none"``: mu = 0, no effect from here on (how often the seeds so far would be carried over a boundary by
      noise alone).

    The remaining looks apply the boundaries
    :func:`look` will apply (spent at the seeds actually taken, then at the planned looks) to the t statistic of
    all seeds so far, from the observed sum and sum of squares plus the simulated ones. Returns the shares of
    holds, fails and stopped at the cap (each with its Monte-Carlo standard error), the mean number of seeds the
    claim will have used and the next look's seeds."""
    n = int(taken[-1])
    rest = list(design.looks[len(taken):])  # the planned looks after the len(taken) already taken
    if not rest:
        raise ValueError(f"{len(taken)} looks taken of {len(design.looks)}: the claim is at its cap")
    zb = design.boundaries(list(taken) + rest)[len(taken):]
    rng = np.random.default_rng(seed)
    if isinstance(effect, str):
        if effect not in OUTLOOKS:
            raise ValueError(f"effect={effect!r}; give a number or one of {', '.join(OUTLOOKS)}")
        mu = rng.normal(mean, sd / math.sqrt(n), size=(sims, 1)) if effect == "predictive" else \
            np.full((sims, 1), mean if effect == "trend" else 0.0)
    else:
        mu = np.full((sims, 1), float(effect))
    d = rng.normal(mu, sd, size=(sims, rest[-1] - n))
    s = n * mean + np.cumsum(d, 1)  # the running sum and sum of squares of every seed so far
    q = (n - 1) * sd**2 + n * mean**2 + np.cumsum(d * d, 1)

    def t_at(m):
        mean_m = s[:, m - n - 1] / m
        var_m = np.maximum(q[:, m - n - 1] - m * mean_m**2, 0.0) / (m - 1)
        return mean_m / np.sqrt(var_m / m)
    return {"sims": sims, "effect": effect, "sd": sd, "seeds": n, "next_look": rest[0], "cap": rest[-1],
            **_verdict_shares(rest, zb, t_at, sims)}


POWER = 0.8  #: the power a plan's detectable effect is stated at
POWER_SIMS = 20_000  #: simulated claims behind a plan's power


def power_at(design: Design, effect_sd: float, sims: int = POWER_SIMS, seed: int = 0) -> float:
    """The chance that a claim whose true paired difference is ``effect_sd`` times its sd is decided "holds" by the
    design's cap, its looks and t boundaries as :func:`look` applies them (the t statistic does not depend on the
    scale, so the effect in units of the sd is all it takes). The same simulated seeds for every effect, so the
    power rises with the effect and :func:`detectable` can bisect it."""
    mean, se = _standard_looks(design.looks, sims, seed)
    return _verdict_shares(design.looks, design.boundaries(), lambda n: (mean[n] + effect_sd) / se[n], sims)["holds"]


@functools.lru_cache(maxsize=8)
def _standard_looks(looks: tuple[int, ...], sims: int, seed: int) -> tuple[dict, dict]:
    """``sims`` claims of standard normal paired differences: each look's mean and standard error (a shift of
    every difference by the effect moves the mean and leaves the standard error)."""
    z = np.random.default_rng(seed).standard_normal((sims, looks[-1]))
    return ({n: z[:, :n].mean(1) for n in looks}, {n: z[:, :n].std(1, ddof=1) / math.sqrt(n) for n in looks})


@functools.lru_cache(maxsize=64)
def detectable(design: Design, power: float = POWER, sims: int = POWER_SIMS, seed: int = 0) -> float:
    """The smallest effect, in units of the paired differences' sd, that the design decides "holds" by its cap
    with probability ``power`` (bisection on :func:`power_at`, to 1e-4 sd)."""
    lo, hi = 0.0, 20.0
    while hi - lo > 1e-4:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if power_at(design, mid, sims, seed) >= power else (mid, hi)
    return hi


def fixed_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """The chance that one look at ``n`` seeds, a two-sided t test at ``alpha``, finds ``effect`` > 0 (a 'holds'),
    from the noncentral t distribution: the fixed design beside the sequential one."""
    from scipy.stats import nct
    from scipy.stats import t as student_t

    crit = student_t.isf(alpha / 2, df=n - 1)
    return float(nct.sf(crit, df=n - 1, nc=effect / sd * math.sqrt(n)))
