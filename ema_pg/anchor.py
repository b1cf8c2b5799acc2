"""The anchor (reference) policy as a Lightning Callback: fixed or an EMA of the policy.

    theta_ema <- eta * theta_ema + (1 - eta) * theta      every ``update_every`` iterations (Alg 3, l. 25)

The EMA is accumulated in an fp32 master copy, so it stays exact when the model runs in
bf16/fp16 (an EMA step of (1 - eta) * 1e-6 vanishes in bf16); the anchor model used for
scoring holds the master cast to the model's dtype. ``eta = 1`` is the fixed anchor of
standard GRPO (``anchor=fixed`` is that preset). The master copy and the update count are saved in checkpoints.
"""

from __future__ import annotations

import copy
import logging

import lightning as L
import torch

log = logging.getLogger(__name__)


class EMAAnchor(L.Callback):
    def __init__(self, eta: float = 0.9, update_every: int = 10, eval_every: int = 0):
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"anchor.eta must be in [0, 1]; got {eta}")
        if update_every < 1:
            raise ValueError(f"anchor.update_every must be >= 1; got {update_every}")
        self.eta, self.update_every, self.eval_every = float(eta), int(update_every), int(eval_every)
        self.model: torch.nn.Module | None = None
        self.master: dict[str, torch.Tensor] = {}
        self.updates = 0
        self._pending: dict | None = None

    # ------------------------------------------------------------------ construction
    def attach(self, policy: torch.nn.Module) -> None:
        """theta_ema <- theta (Alg 3, line 1): a frozen copy of the policy plus an fp32 master."""
        self.model = copy.deepcopy(policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.master = {n: p.detach().float().clone() for n, p in policy.named_parameters()}
        if self._pending is not None:
            self._apply_state(self._pending)
            self._pending = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.model is None:
            self.attach(pl_module.policy)
        self.model.to(pl_module.device)
        self.master = {n: t.to(pl_module.device) for n, t in self.master.items()}

    # ------------------------------------------------------------------ the EMA step
    @torch.no_grad()
    def update(self, policy: torch.nn.Module) -> None:
        if self.eta >= 1.0:
            return
        params = dict(self.model.named_parameters())
        for n, p in policy.named_parameters():
            m = self.master[n]
            m.mul_(self.eta).add_(p.detach().float(), alpha=1.0 - self.eta)
            params[n].copy_(m)
        self.updates += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.iteration % self.update_every == 0:
            self.update(pl_module.policy)

    @torch.no_grad()
    def lag_norm(self, policy: torch.nn.Module) -> float:
        """||theta - theta_ema|| over all parameters (fp32)."""
        sq = sum(float(((p.detach().float() - self.master[n]) ** 2).sum()) for n, p in policy.named_parameters())
        return sq**0.5

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        # eta and update_every are settings, recorded in the run's config.yaml (which a resume may not change)
        return {"master": {n: t.detach().cpu() for n, t in self.master.items()}, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        if self.model is None:
            self._pending = state
        else:
            self._apply_state(state)

    @torch.no_grad()
    def _apply_state(self, state: dict) -> None:
        self.updates = int(state["updates"])
        params = dict(self.model.named_parameters())
        for n, t in state["master"].items():
            self.master[n] = t.to(self.master[n].device).float().clone()
            params[n].copy_(self.master[n])
