"""Shared pieces of the KL-estimator registry: inputs, the estimator object, helpers.

Notation (paper, Table 1 and §5.2): p = y_n is the sampled token, ``logp`` = log pi_theta(p),
``logp_ref`` = log pi_ref(p), ``logp_old`` = log pi_sampling(p);
w = pi_ref(p) / pi_theta(p), r = pi_theta(p) / sg(pi_theta(p)) (value 1, gradient = score),
s = sg(pi_theta(p) / pi_sampling(p)) clipped to ``iw_clip`` (the off-policy weight of Alg 1-2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class KLInputs:
    """Everything a token-level KL estimator may read. All log-probs are natural logs.

    Shapes: B sequences, T tokens, k top-k indices, V vocabulary.
    """

    logp: Tensor  # (B, T) log pi_theta(y_n | h_n), with grad
    logp_old: Tensor  # (B, T) log pi_sampling(y_n | h_n), no grad
    logp_ref: Tensor  # (B, T) log pi_anchor(y_n | h_n), no grad
    tokens: Tensor | None = None  # (B, T) long, sampled tokens y_n
    topk_idx: Tensor | None = None  # (B, T, k) long, index set q_n
    topk_logp: Tensor | None = None  # (B, T, k) log pi_theta at q_n, with grad
    topk_logp_ref: Tensor | None = None  # (B, T, k) log pi_anchor at q_n, no grad
    logits: Tensor | None = None  # (B, T, V) policy logits, with grad (exact estimators only)
    ref_logits: Tensor | None = None  # (B, T, V) anchor logits, no grad (exact estimators only)


def ratio_r(logp: Tensor) -> Tensor:
    """r = pi/sg(pi): value exactly 1, gradient grad log pi (eq. 21)."""
    return torch.exp(logp - logp.detach())


def offpolicy_weight(inp: KLInputs, iw_clip: tuple[float, float]) -> Tensor:
    """s = clip(sg(pi_theta(p) / pi_sampling(p)), s_min, s_max); (1, 1) means no correction."""
    lo, hi = iw_clip
    if lo == 1.0 and hi == 1.0:
        return torch.ones_like(inp.logp_old)
    s = torch.exp(inp.logp.detach() - inp.logp_old.detach())
    return s.clamp(min=lo, max=hi)


def in_index_set(tokens: Tensor, topk_idx: Tensor) -> Tensor:
    """(B, T) bool: whether the sampled token y_n lies in q_n."""
    if topk_idx.shape[-1] == 0:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return (topk_idx == tokens.unsqueeze(-1)).any(-1)  # (B, T, k) -> (B, T)


def require(inp: KLInputs, name: str, *fields: str) -> None:
    missing = [f for f in fields if getattr(inp, f) is None]
    if missing:
        raise ValueError(f"KL estimator '{name}' needs KLInputs fields {missing}; they are None")


@dataclass(frozen=True)
class Estimator:
    """A registered token-level KL estimator bound to its parameters.

    Calling it on :class:`KLInputs` returns a (B, T) per-token estimate that is differentiable
    with respect to the policy. ``topk_source`` says whose top-k indices it needs
    (``"policy_old"``, ``"anchor"`` or ``None``); ``needs_full_logits`` is True only for the
    exact estimators.
    """

    name: str
    fn: Callable[..., Tensor]
    params: dict = field(default_factory=dict)
    topk_source: str | None = None
    needs_full_logits: bool = False
    direction: str | None = None  # the KL whose gradient it follows: "reverse" | "forward" | None (see EstimatorSpec)

    @property
    def k(self) -> int:
        return int(self.params.get("k", 0))

    def __call__(self, inputs: KLInputs) -> Tensor:
        return self.fn(inputs, **self.params)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Estimator({self.name}{', ' if args else ''}{args})"
