"""The KL-estimator registry (docs/algorithm.md, "The KL-estimator registry").

>>> from ema_pg.kl import KLInputs, get_estimator, ESTIMATORS
>>> est = get_estimator("topk_reverse", k=32, tail="corrected", iw_clip=(0.0, 10.0))
>>> est.topk_source, est.needs_full_logits
('policy_old', False)

Every estimator is a pure function of the tensors in :class:`KLInputs` that returns a (B, T)
per-token estimate. Names follow Table 1, Alg 1-2 and Appendix H of the paper:

- ``k1 k2 k3 k3pp k4 k5 abs`` (sampled, :mod:`ema_pg.kl.sampled`), parameters ``iw_clip``,
  ``straight_through`` (the "+" variants) and, for k3/k3pp/k5, ``clamp``;
- ``exact_reverse exact_forward`` (full logits, :mod:`ema_pg.kl.exact`);
- ``topk_reverse topk_forward`` (:mod:`ema_pg.kl.topk`), parameters ``k``, ``tail``, ``iw_clip``;
- ``topk_fdiv`` (:mod:`ema_pg.kl.fdiv`), parameters ``k``, ``divergence``, ``alpha``, ``iw_clip``;
- ``none`` (no KL).

``sequence_kl_penalty`` (eq. 10-12) is the reward-side penalty of the WARP baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .base import Estimator, KLInputs
from .exact import exact_forward, exact_reverse
from .fdiv import DIVERGENCES, topk_fdiv
from .sampled import abs_kl, k1, k2, k3, k3pp, k4, k5
from .sequence import sequence_kl_penalty
from .topk import TAILS, topk_forward, topk_reverse


def no_kl(inp: KLInputs) -> Tensor:
    """No KL regularization: zeros, (B, T)."""
    return torch.zeros_like(inp.logp)


@dataclass(frozen=True)
class EstimatorSpec:
    """What the registry knows of one estimator: its function, defaults, needs and KL direction.

    ``defaults`` is the one home of the estimator's parameter defaults (the functions take them
    as required keywords). ``direction`` is the KL whose gradient the estimator follows in
    expectation (Table 1): "reverse" = KL(pi || ref), "forward" = KL(ref || pi), None = no
    gradient (none, k1); ``topk_fdiv`` takes it from its divergence.
    """

    fn: Callable[..., Tensor]
    defaults: dict = field(default_factory=dict)
    topk_source: str | None = None  # for k > 0; "policy_old" | "anchor"
    needs_full_logits: bool = False
    direction: str | None = None


_SAMPLED_OFF = {"iw_clip": (1.0, 1.0), "straight_through": False}  # k1-k3: GRPO practice, no off-policy correction
_SAMPLED_ON = {"iw_clip": (0.0, 10.0), "straight_through": False}  # our unbiased estimators: lenient clip (Fig 9)
_CLAMP = {"clamp": False}  # the authors' numerical clamp of K3 / K3++ / K5 (off: exact)

ESTIMATORS: dict[str, EstimatorSpec] = {
    "none": EstimatorSpec(no_kl),
    "k1": EstimatorSpec(k1, _SAMPLED_OFF),  # -log w; unbiased value, zero gradient
    "k2": EstimatorSpec(k2, _SAMPLED_OFF, direction="reverse"),  # (log w)^2/2
    "k3": EstimatorSpec(k3, {**_SAMPLED_OFF, **_CLAMP}, direction="forward"),  # unbiased reverse value, forward grad
    "k3pp": EstimatorSpec(k3pp, {**_SAMPLED_ON, **_CLAMP}, direction="reverse"),  # r K3 (eq. 22)
    "k4": EstimatorSpec(k4, _SAMPLED_ON, direction="reverse"),  # r sg(-log w) (eq. 23)
    "k5": EstimatorSpec(k5, {**_SAMPLED_ON, **_CLAMP}, direction="forward"),  # sg(w) log w + log r (eq. 24)
    "abs": EstimatorSpec(abs_kl, _SAMPLED_OFF),  # |log w|: the peers' "abs", biased
    "exact_reverse": EstimatorSpec(exact_reverse, needs_full_logits=True, direction="reverse"),
    "exact_forward": EstimatorSpec(exact_forward, needs_full_logits=True, direction="forward"),
    "topk_reverse": EstimatorSpec(
        topk_reverse, {"k": 32, "tail": "corrected", "iw_clip": (0.0, 10.0)}, "policy_old", direction="reverse",  # Alg 1
    ),
    "topk_forward": EstimatorSpec(
        topk_forward, {"k": 32, "tail": "corrected", "iw_clip": (0.0, 2.5)}, "anchor", direction="forward",  # Alg 2
    ),
    "topk_fdiv": EstimatorSpec(
        topk_fdiv, {"k": 32, "divergence": "reverse_kl", "alpha": 0.5, "iw_clip": (0.0, 10.0)}, "policy_old",  # App. H
    ),
}


def _check_iw_clip(name: str, iw_clip) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in iw_clip)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: iw_clip must be a pair (s_min, s_max), e.g. (0.0, 10.0); got {iw_clip!r}") from None
    if not (0.0 <= lo <= hi):
        raise ValueError(
            f"{name}: iw_clip=({lo}, {hi}) needs 0 <= s_min <= s_max; use (1.0, 1.0) for no "
            "off-policy correction, (0.0, 10.0) for a lenient clip"
        )
    return (lo, hi)


def get_estimator(name: str, **params) -> Estimator:
    """Build a registered estimator bound to ``params`` (unknown names/params raise ValueError)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; choose one of: {', '.join(ESTIMATORS)}")
    spec = ESTIMATORS[name]
    unknown = set(params) - set(spec.defaults)
    if unknown:
        valid = ", ".join(spec.defaults) or "none"
        raise ValueError(f"KL estimator {name!r} takes no parameter(s) {sorted(unknown)}; valid: {valid}")
    p = {**spec.defaults, **params}
    if "iw_clip" in p:
        p["iw_clip"] = _check_iw_clip(name, p["iw_clip"])
    if "k" in p:
        if isinstance(p["k"], bool) or int(p["k"]) != p["k"] or p["k"] < 0:
            raise ValueError(f"{name}: k must be an integer >= 0 (k=0 is the sampled estimator); got {p['k']!r}")
        p["k"] = int(p["k"])
    if "tail" in p and p["tail"] not in TAILS:
        raise ValueError(f"{name}: unknown tail {p['tail']!r}; choose one of: {', '.join(TAILS)}")
    if "divergence" in p:
        if p["divergence"] not in DIVERGENCES:
            raise ValueError(f"{name}: unknown divergence {p['divergence']!r}; choose one of: {', '.join(DIVERGENCES)}")
        if p["divergence"] == "alpha" and float(p["alpha"]) in (0.0, 1.0):
            raise ValueError(f"{name}: alpha-divergence needs alpha not in {{0, 1}} (those limits are the KLs); got {p['alpha']}")
    for flag in ("clamp", "straight_through"):
        if flag in p and not isinstance(p[flag], bool):
            raise ValueError(f"{name}: {flag} must be true or false; got {p[flag]!r}")
    source, direction = spec.topk_source, spec.direction
    if p.get("straight_through"):  # the "+" variants follow K2's gradient: the reverse KL
        direction = "reverse"
    if name == "topk_fdiv":
        direction = {"reverse_kl": "reverse", "forward_kl": "forward"}.get(p["divergence"], p["divergence"])
        if p["divergence"] == "forward_kl":
            source = "anchor"
    if p.get("k", 0) == 0:
        source = None
    return Estimator(name=name, fn=spec.fn, params=p, topk_source=source, needs_full_logits=spec.needs_full_logits,
                     direction=direction)


__all__ = ["DIVERGENCES", "ESTIMATORS", "TAILS", "Estimator", "EstimatorSpec", "KLInputs", "get_estimator", "sequence_kl_penalty"]
