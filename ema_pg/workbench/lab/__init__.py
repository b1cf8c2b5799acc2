"""The KL-estimator conformance lab: exact bias and variance of any estimator, by enumeration.

An estimator with the registry's signature (``fn(inputs: KLInputs) -> (B, T)``) is evaluated at
every token of a small vocabulary, one row per token (:mod:`ema_pg.kl.enumeration`): row j holds
its value f_j and its autograd gradient g_j with respect to the policy's logits when token j is
the sampled one. Under y ~ pi_sampling (pi_theta on-policy, pi_old != pi_theta off-policy), with
p_j = pi_sampling(j), everything follows exactly, with no Monte Carlo:

    E[f] = sum_j p_j f_j            Var[f] = sum_j p_j f_j^2 - E[f]^2
    E[g] = sum_j p_j g_j            tr Cov[g] = sum_j p_j ||g_j||^2 - ||E[g]||^2

and is set against the true KL and its gradient (reverse KL(pi || anchor) or forward
KL(anchor || pi)). An index set (Top-k) is the top-k of its source (pi_old or the anchor), or,
for the "any index set" check, every k-subset of the vocabulary.

>>> from ema_pg.workbench.lab import ENTRIES, PANEL, verdicts
>>> v = verdicts(ENTRIES["k3"])
>>> v["gradient_on"], v["follows_on"]
('biased', 'forward')

``python -m ema_pg.lab --all`` writes the report (``reproductions/estimator_lab/``); the
pytest plugin (:mod:`ema_pg.workbench.lab_plugin`) checks another project's estimator against its claims.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...kl.base import KLInputs
from ...kl.enumeration import enumeration_inputs
from ...kl.enumeration import index_set as top_indices
from ...kl.enumeration import true_kl_and_grad

TOL = 1e-9  #: |bias| at or below this (float64, quantities of order 1) counts as exactly unbiased
#: a variance E[x^2] - E[x]^2 at or below this share of E[x^2] is float64 cancellation, not spread: it is 0.
#: (Its noise is a few eps * E[x^2] and differs between CPU kinds: 8.7e-19 on one, 0 on another.)
VAR_RTOL = 1e-12
DIRECTIONS = ("reverse", "forward")
DTYPE = torch.float64

EstimatorFn = Callable[[KLInputs], Tensor]


# ---------------------------------------------------------------------------------------------- the panel
@dataclass(frozen=True)
class Case:
    """One position: the policy's, the anchor's and (off-policy) the sampling policy's logits, (V,)."""

    name: str
    logits: Tensor
    ref_logits: Tensor
    samp_logits: Tensor | None = None  # None: on-policy (pi_sampling = pi_theta)
    note: str = ""

    @property
    def V(self) -> int:
        return int(self.logits.shape[-1])

    @property
    def setting(self) -> str:
        return "on" if self.samp_logits is None else "off"

    def kl(self, direction: str = "reverse") -> float:
        return float(true_kl_and_grad(self.logits, self.ref_logits, direction)[0])

    def off_policy(self, samp_logits: Tensor) -> Case:
        return Case(self.name, self.logits, self.ref_logits, samp_logits, self.note)


def _probs(*p: float) -> Tensor:
    return torch.log(torch.tensor(p, dtype=DTYPE))


def _normal(seed: int, V: int, scale: float = 1.0) -> Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=DTYPE) * scale


def _panel() -> tuple[Case, ...]:
    """Small distributions: the public counterexample, near-equal and far-apart pairs, peaked and flat policies."""
    peaked = _normal(4, 8, 0.5)
    peaked[0] += 4.0  # top-1 mass about 0.9
    on = (
        Case("counterexample", _probs(0.6, 0.4), _probs(0.9, 0.1),
             note="V=2, pi=(0.6, 0.4), anchor=(0.9, 0.1): the public review note's case"),
        Case("near", _normal(1, 8), _normal(1, 8) + _normal(2, 8, 0.15), note="V=8, anchor = policy + small noise"),
        Case("far", _normal(3, 8, 1.5), _normal(13, 8, 1.5), note="V=8, independent policy and anchor"),
        Case("peaked", peaked, _normal(5, 8), note="V=8, policy with top-1 mass ~0.9"),
        Case("flat", _normal(6, 8, 0.1), _normal(7, 8), note="V=8, near-uniform policy"),
        Case("mid5", _normal(8, 5), _normal(9, 5, 1.2), note="V=5"),
    )
    off = tuple(c.off_policy(c.logits + _normal(100 + i, c.V, 0.6)) for i, c in enumerate(on))
    return on + off


PANEL: tuple[Case, ...] = _panel()  #: on-policy cases, then the same with pi_old = pi_theta + noise


# ---------------------------------------------------------------------------------------------- moments
@dataclass(frozen=True)
class Moments:
    """Exact moments of one estimator at one case and index set, beside the true KL of ``direction``."""

    value_mean: float
    value_var: float
    grad_mean: Tensor  # (V,)
    grad_var: float  # trace of the covariance of the per-token gradient
    kl: float
    kl_grad: Tensor  # (V,)
    other_grad: Tensor  # the gradient of the other direction's KL, to say which one E[g] follows

    @property
    def value_bias(self) -> float:
        return self.value_mean - self.kl

    @property
    def grad_bias(self) -> float:
        return float((self.grad_mean - self.kl_grad).norm())

    @property
    def rel_value_bias(self) -> float:
        """|bias| / KL; NaN where the KL is 0 (within TOL): a share of nothing is not defined."""
        return _share(abs(self.value_bias), abs(self.kl))

    @property
    def rel_grad_bias(self) -> float:
        """|bias| / |grad KL|; NaN where the gradient is 0 (within TOL)."""
        return _share(self.grad_bias, float(self.kl_grad.norm()))

    def follows(self) -> str:
        """Which gradient E[g] equals: the target's, the other KL's, zero, or none of them."""
        if self.grad_bias <= TOL:
            return "target"
        if float((self.grad_mean - self.other_grad).norm()) <= TOL:
            return "other"
        if float(self.grad_mean.norm()) <= TOL:
            return "zero"
        return "neither"


def rows(fn: EstimatorFn, case: Case, topk_idx: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(values (V,), gradients (V, V), weights (V,)): row j = the estimator when token j is sampled."""
    theta = case.logits.detach().clone().requires_grad_(True)

    def per_token(t: Tensor) -> Tensor:
        inp, _ = enumeration_inputs(None, t, case.ref_logits, case.samp_logits, topk_idx)
        out = fn(inp)
        if not isinstance(out, Tensor) or out.shape != inp.logp.shape:
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"the estimator returned {shape}; it must return one value per token, a tensor of the "
                             f"tokens' shape (B, T) = {tuple(inp.logp.shape)}")
        return out.reshape(-1)

    values = per_token(theta).detach()
    grads = torch.autograd.functional.jacobian(per_token, theta)  # (V, V): d f_j / d logits
    _, weights = enumeration_inputs(None, case.logits.detach(), case.ref_logits, case.samp_logits, None)
    return values, grads, weights.view(-1)


def moments(fn: EstimatorFn, case: Case, direction: str, topk_idx: Tensor | None = None) -> Moments:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}; got {direction!r}")
    f, g, p = rows(fn, case, topk_idx)
    mean = (p * f).sum()
    gmean = (p[:, None] * g).sum(0)
    kl, kl_grad = true_kl_and_grad(case.logits, case.ref_logits, direction)
    _, other = true_kl_and_grad(case.logits, case.ref_logits, "forward" if direction == "reverse" else "reverse")
    return Moments(
        value_mean=float(mean), value_var=_variance(float((p * f**2).sum()), float(mean**2)),
        grad_mean=gmean, grad_var=_variance(float((p * (g**2).sum(1)).sum()), float((gmean**2).sum())),
        kl=float(kl), kl_grad=kl_grad, other_grad=other,
    )


def _share(part: float, whole: float) -> float:
    return part / whole if whole > TOL else float("nan")


def _variance(second: float, mean_sq: float) -> float:
    """E[x^2] - |E x|^2, with a difference within float64 rounding of E[x^2] read as exactly 0."""
    var = second - mean_sq
    return var if var > VAR_RTOL * second else 0.0


def index_set(case: Case, source: str | None, k: int) -> Tensor | None:
    """The top-k of the source's distribution at this case (pi_old = the sampling policy); None without a source.

    k = 0 gives the empty index set (every token is tail), not None: an estimator with an index set
    reads the (V, 1, 0) tensors.
    """
    return None if source is None else top_indices(source, k, case.logits, case.ref_logits, case.samp_logits)


# ---------------------------------------------------------------------------------------------- entries
@dataclass(frozen=True)
class Entry:
    """An estimator of the panel: how to build it for a k, what it targets, where it comes from.

    ``make(k)`` returns the estimator for an index set of size k (k is ignored when
    ``index_source`` is None). ``target`` is the KL the estimator is used to estimate or
    regularize. ``documented`` is what its source says of it, checked against the lab's finding.
    """

    name: str
    make: Callable[[int], EstimatorFn]
    target: str
    source: str
    family: str = "ours"  # "ours" | "field"
    index_source: str | None = None  # "policy_old" | "anchor" | None
    ks: tuple[int, ...] = (0,)
    documented: str = ""
    equals: str = ""  # another entry it coincides with, where the lab shows it


@dataclass
class Row:
    entry: str
    case: str
    setting: str
    V: int
    k: int
    kl_reverse: float
    value_bias: float
    rel_value_bias: float
    grad_bias: float
    rel_grad_bias: float
    value_var: float
    grad_var: float
    follows: str
    any_set_grad_bias: float = float("nan")  # worst over every k-subset as the index set


def _ks(entry: Entry, V: int) -> list[int]:
    if entry.index_source is None:
        return [0]
    return sorted({min(k, V) for k in entry.ks})


def measure(entry: Entry, panel: Iterable[Case] = PANEL, any_set: bool = True) -> list[Row]:
    """Every (case, k) of the panel for one entry; ``any_set`` adds the worst bias over all k-subsets."""
    out = []
    for case in panel:
        for k in _ks(entry, case.V):
            fn = entry.make(k)
            m = moments(fn, case, entry.target, index_set(case, entry.index_source, k))
            worst = float("nan")
            if any_set and entry.index_source is not None and 0 < k < case.V:  # C(V, k) sets
                worst = max(moments(fn, case, entry.target, torch.tensor(q)).grad_bias
                            for q in itertools.combinations(range(case.V), k))
            out.append(Row(entry.name, case.name, case.setting, case.V, k, case.kl("reverse"), m.value_bias,
                           m.rel_value_bias, m.grad_bias, m.rel_grad_bias, m.value_var, m.grad_var, m.follows(),
                           worst))
    return out


def _word(rs: list[Row], attr: str) -> str:
    if not rs:
        return "n/a"
    worst = max(abs(getattr(r, attr)) for r in rs)
    if worst <= TOL:
        return "unbiased"
    return "biased"


def _size(rs: list[Row], rel: str) -> float:
    return max((x for r in rs if not math.isnan(x := getattr(r, rel))), default=float("nan"))


def _follows(rs: list[Row], target: str) -> str:
    other = "forward" if target == "reverse" else "reverse"
    seen = {r.follows for r in rs}
    if seen == {"target"}:
        return target
    if seen == {"other"}:
        return other
    if seen == {"zero"}:
        return "zero"
    return "neither"


def verdicts(entry: Entry, panel: Iterable[Case] = PANEL, rows_: list[Row] | None = None) -> dict:
    """Value / gradient x on / off-policy: "unbiased", or "biased" with the worst relative size."""
    rs = rows_ if rows_ is not None else measure(entry, panel)
    v: dict = {"entry": entry.name, "family": entry.family, "target": entry.target,
               "index_set": entry.index_source or "", "source": entry.source}
    for setting in ("on", "off"):
        sub = [r for r in rs if r.setting == setting]
        v[f"value_{setting}"] = _word(sub, "value_bias")
        v[f"value_{setting}_rel"] = _size(sub, "rel_value_bias")
        v[f"gradient_{setting}"] = _word(sub, "grad_bias")
        v[f"gradient_{setting}_rel"] = _size(sub, "rel_grad_bias")
        v[f"follows_{setting}"] = _follows(sub, entry.target)
    anyset = [r.any_set_grad_bias for r in rs if not math.isnan(r.any_set_grad_bias)]
    v["any_index_set"] = "" if not anyset else ("unbiased" if max(anyset) <= TOL else "biased")
    return v


# ---------------------------------------------------------------------------------------------- claims
@dataclass(frozen=True)
class Claims:
    """What an estimator claims; each None is not checked.

    ``value`` / ``gradient``: "unbiased" or "biased" for the KL of ``direction``; ``off_policy``: the
    claims hold also when the tokens come from pi_old != pi_theta (with the estimator's own
    correction); ``index_source``: whose top-k the estimator's index set is ("policy_old",
    "anchor"), None if it has none; ``ks``: the index-set sizes to check.
    """

    direction: str = "reverse"
    value: str | None = "unbiased"
    gradient: str | None = "unbiased"
    off_policy: bool = False
    index_source: str | None = None
    ks: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}; got {self.direction!r}")
        for what in (self.value, self.gradient):
            if what not in (None, "unbiased", "biased"):
                raise ValueError(f"a claim is 'unbiased', 'biased' or None; got {what!r}")
        if self.index_source not in (None, "policy_old", "anchor"):
            raise ValueError(f"index_source must be 'policy_old', 'anchor' or None; got {self.index_source!r}")

    @classmethod
    def parse(cls, text: str) -> Claims:
        """``direction=reverse,value=unbiased,gradient=unbiased,off_policy=true,index=policy_old,ks=0;1;2``."""
        kw: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, val = part.partition("=")
            key, val = key.strip(), val.strip()
            if key in ("direction", "value", "gradient"):
                kw[key] = None if val in ("", "none", "None") else val
            elif key == "off_policy":
                flag = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                        "off": False}.get(val.lower())
                if flag is None:
                    raise ValueError(f"off_policy={val!r}: give true or false")
                kw[key] = flag
            elif key in ("index", "index_source"):
                kw["index_source"] = None if val in ("", "none", "None") else val
            elif key == "ks":
                kw["ks"] = tuple(int(x) for x in val.replace(";", " ").split())
            else:
                raise ValueError(f"unknown claim {key!r}; claims are direction, value, gradient, off_policy, index, ks")
        return cls(**kw)


@dataclass
class Finding:
    ok: bool
    message: str
    what: str = ""  # "value" | "gradient"
    setting: str = ""  # "on" | "off"


def _kl_name(direction: str) -> str:
    return "KL(pi || ref)" if direction == "reverse" else "KL(ref || pi)"


def check(fn: EstimatorFn, claims: Claims, panel: Iterable[Case] = PANEL) -> list[Finding]:
    """Each claim against the panel: one finding per claim and setting, the worst case named."""
    settings = ("on", "off") if claims.off_policy else ("on",)
    entry = Entry("estimator", lambda k: fn, claims.direction, "", index_source=claims.index_source, ks=claims.ks)
    rs = measure(entry, [c for c in panel if c.setting in settings], any_set=False)
    findings = []
    for setting in settings:
        sub = [r for r in rs if r.setting == setting]
        where = "on-policy" if setting == "on" else "off-policy (tokens from pi_old)"
        for what, attr, rel, label in (("value", "value_bias", "rel_value_bias", "E[value]"),
                                       ("gradient", "grad_bias", "rel_grad_bias", "E[grad]")):
            claim = getattr(claims, what)
            if claim is None:
                continue
            worst = max(sub, key=lambda r: abs(getattr(r, attr)))
            size = abs(getattr(worst, attr))
            truth = f"the true {'value' if what == 'value' else 'gradient'} of {_kl_name(claims.direction)}"
            at = (f"at k={worst.k}, " if claims.index_source else "") + \
                f"{where} (case '{worst.case}', V={worst.V})"
            if claim == "unbiased":
                ok = size <= TOL
                msg = (f"{label} equals {truth} on all {len(sub)} cases, {where}" if ok else
                       f"{label} differs from {truth} by {size:.3g} (relative {getattr(worst, rel):.1%}) {at}")
            else:
                best = min(sub, key=lambda r: abs(getattr(r, attr)))
                ok = size > TOL
                msg = (f"{label} is biased for {truth}: up to {size:.3g} {at}" if ok else
                       f"claimed biased, but {label} equals {truth} to {abs(getattr(best, attr)):.1e} on every case, {where}")
            findings.append(Finding(ok, f"{what} {claim}, {setting}-policy: {msg}", what, setting))
    return findings


class ConformanceError(AssertionError):
    """An estimator's claim that the lab refutes; the message lists each refuted claim on one line."""


def assert_conforms(fn: EstimatorFn, claims: Claims | None = None, **claim_kw) -> list[Finding]:
    """Raise :class:`ConformanceError` naming every refuted claim; return the findings otherwise."""
    claims = claims if claims is not None else Claims(**claim_kw)
    findings = check(fn, claims)
    bad = [f.message for f in findings if not f.ok]
    if bad:
        raise ConformanceError("\n".join(bad))
    return findings


from .entries import ENTRIES  # noqa: E402  (the entries use the classes above)

__all__ = ["Case", "Claims", "ConformanceError", "ENTRIES", "Entry", "Finding", "Moments", "PANEL", "Row", "TOL",
           "assert_conforms", "check", "index_set", "measure", "moments", "rows", "verdicts"]
