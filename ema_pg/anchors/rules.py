"""The reference-update rules, one pure function each, on one parameter tensor.

    rule(anchor, policy, state, t, **params) -> (anchor', state')

``anchor`` is the anchor's current value of the parameter (its fp32 master for the schemes that
keep one), ``policy`` the policy's (fp32 for those schemes), ``state`` the scheme's own fp32
buffers of that parameter (BEMA's EMA and theta_0; empty for the others), ``t`` the number of
iterations since the scheme's start (BEMA's clock). Nothing is changed in place: the engine copies
the results into the anchor model, its master and its buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor

State = dict[str, Tensor]


def ema(anchor: Tensor, policy: Tensor, state: State, t: int, *, eta: float, update_every: int) -> tuple[Tensor, State]:
    """theta_ema <- eta * theta_ema + (1 - eta) * theta (eq. 2; Alg 3, line 25), every ``update_every`` iterations."""
    return torch.add(anchor * eta, policy, alpha=1.0 - eta), state


def reset(anchor: Tensor, policy: Tensor, state: State, t: int, *, eta: float, update_every: int) -> tuple[Tensor, State]:
    """theta_ref <- theta every ``update_every`` iterations: the EMA with eta = 0 (a hard reset)."""
    return policy.clone(), state


def sync(anchor: Tensor, policy: Tensor, state: State, t: int, *, sync_alpha: float,
         sync_steps: int) -> tuple[Tensor, State]:
    """theta_ref <- (1 - alpha) theta_ref + alpha theta every ``sync_steps`` optimizer steps, in the anchor's own
    dtype (TRL's ``sync_ref_model``: ``ref_model_mixup_alpha``, ``ref_model_sync_steps``)."""
    return torch.add(anchor * (1.0 - sync_alpha), policy.to(anchor.dtype), alpha=sync_alpha), state


def bema_coefficients(t: int, *, ema_power: float, bias_power: float, lag: float, multiplier: float,
                      min_ema_multiplier: float) -> tuple[float, float]:
    """(beta_t, alpha_t) of BEMA (Block and Zhang 2025, arXiv 2508.00180):
    beta_t = max((rho + gamma t)^-kappa, beta_min), alpha_t = (rho + gamma t)^-eta_b."""
    age = lag + multiplier * t
    return max(age ** -ema_power, min_ema_multiplier), age ** -bias_power


def bema(anchor: Tensor, policy: Tensor, state: State, t: int, *, ema_power: float, bias_power: float, lag: float,
         multiplier: float, min_ema_multiplier: float, **clock) -> tuple[Tensor, State]:
    """Bias-corrected EMA: EMA_t = (1 - beta_t) EMA_{t-1} + beta_t theta_t, and the anchor
    theta'_t = EMA_t + alpha_t (theta_t - theta_0), theta_0 and EMA_0 the policy at iteration ``update_after``.
    The correction alpha_t (theta_t - theta_0) removes the EMA's lag behind a drifting policy. ``clock``: the
    scheme's ``update_every`` and ``update_after``, which the scheme reads (:class:`ema_pg.anchors.SchemeSpec`)."""
    beta, alpha = bema_coefficients(t, ema_power=ema_power, bias_power=bias_power, lag=lag, multiplier=multiplier,
                                    min_ema_multiplier=min_ema_multiplier)
    avg = torch.add(state["ema"] * (1.0 - beta), policy, alpha=beta)
    return avg + alpha * (policy - state["theta0"]), {"ema": avg, "theta0": state["theta0"]}


def bema_start(policy: Tensor) -> State:
    """BEMA's buffers at its start: EMA_0 = theta_0 = the policy."""
    return {"ema": policy.clone(), "theta0": policy.clone()}


# ---------------------------------------------------------------------- parameter checks (messages say what to change)
def check_ema(p: dict) -> None:
    if not 0.0 <= p["eta"] <= 1.0:
        raise ValueError(f"anchor.eta must be in [0, 1] (1.0 = fixed anchor; the paper recommends 0.9-0.95); got {p['eta']}")
    _check_every(p)


def _check_every(p: dict) -> None:
    if int(p["update_every"]) != p["update_every"] or p["update_every"] < 1:
        raise ValueError(f"anchor.update_every must be an integer >= 1 (paper: 10); got {p['update_every']}")


def check_pinned_eta(value: float, scheme: str, other: str):
    def check(p: dict) -> None:
        if p["eta"] != value:
            raise ValueError(f"anchor={scheme} is the EMA with eta={value}; anchor.eta={p['eta']} asks for another "
                             f"scheme: use anchor={other} anchor.eta={p['eta']}")
        if "update_every" in p:
            _check_every(p)
    return check


def check_sync(p: dict) -> None:
    if not (0.0 < p["sync_alpha"] <= 1.0 and p["sync_steps"] >= 1):
        raise ValueError(f"anchor=sync needs anchor.sync_alpha in (0, 1] and anchor.sync_steps >= 1 (TRL: 0.6, 512); "
                         f"got {p['sync_alpha']}, {p['sync_steps']}")


def check_bema(p: dict) -> None:
    _check_every(p)
    if p["lag"] <= 0 or p["multiplier"] < 0 or p["ema_power"] < 0 or p["bias_power"] < 0:
        raise ValueError(f"anchor=bema needs anchor.lag > 0, anchor.multiplier >= 0 and anchor.ema_power, "
                         f"anchor.bias_power >= 0; got {p['lag']}, {p['multiplier']}, {p['ema_power']}, {p['bias_power']}")
    if not 0.0 <= p["min_ema_multiplier"] <= 1.0 or p["update_after"] < 0:
        raise ValueError(f"anchor.min_ema_multiplier must be in [0, 1] and anchor.update_after >= 0; got "
                         f"{p['min_ema_multiplier']}, {p['update_after']}")
