"""The KL coefficient's controller (``algo.kl_ctrl``): fixed, or Ziegler et al. 2019's adaptive proportional one.

Fine-Tuning Language Models from Human Preferences (arXiv 1909.08593), section 2.2: the coefficient β aims the
measured KL at a target,

    e_t = clip(KL_t / KL_target - 1, -0.2, 0.2),        β_{t+1} = β_t (1 + K_β e_t),    K_β = n_t / horizon,

where ``n_t`` is the number of responses the iteration trained on, as verl (``AdaptiveKLController``, updated in
``apply_kl_penalty`` with ``n_steps`` = the batch size) and OpenRLHF (``n_steps`` = rollout batch x samples per
prompt) count it. The KL they measure, and so this one: the k1 estimate log π_old - log π_ref of the sampled
tokens, averaged over each response's tokens, then over the responses (verl's ``masked_mean(kld, mask, axis=-1)``
and batch mean; OpenRLHF's per-sample mean), at the iteration's sampling, before its update. β_t is applied to
iteration t (to the loss's token KL, or to the reward under ``algo.reward_kl=sequence``), then updated from KL_t.

``fixed`` leaves β = ``algo.beta`` for the whole run (bit for bit today's training). ``adaptive`` starts from
``algo.beta`` and aims at ``algo.kl_target`` over ``algo.kl_horizon`` responses (verl's defaults: 0.1, 10000).
The value is saved in the run's checkpoint and resumed exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .losses import aggregate

KL_CTRLS = ("fixed", "adaptive")  #: algo.kl_ctrl's choices
ERROR_CLIP = 0.2  #: the proportional error's clip (Ziegler et al. 2019; verl, OpenRLHF, TRL)


@dataclass
class KLController:
    """β in force and its update. ``target`` None: fixed."""

    value: float
    target: float | None = None
    horizon: float = 1.0

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, current_kl: float, n_steps: int) -> None:
        """After an iteration that trained on ``n_steps`` responses at measured KL ``current_kl``."""
        if not self.adaptive:
            return
        error = min(max(current_kl / self.target - 1.0, -ERROR_CLIP), ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def build_kl_controller(algo) -> KLController:
    """The controller of the ``algo`` config node (``kl_ctrl``, ``beta``, ``kl_target``, ``kl_horizon``)."""
    if algo.kl_ctrl == "adaptive":
        return KLController(float(algo.beta), float(algo.kl_target), float(algo.kl_horizon))
    return KLController(float(algo.beta))


def response_mean_k1(old_logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """The controller's KL: the mean over responses of each response's mean k1 (log π_old - log π_ref) over its
    tokens, as a 0-dim tensor (a response with no token counts 0): the loss's own ``seq-mean-token-mean``
    aggregation of k1. ``mask``: (N, T) policy tokens."""
    return aggregate(old_logp - ref_logp, mask, "seq-mean-token-mean")
