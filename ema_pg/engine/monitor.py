"""Live EMA-stability monitor (§4, Appendix C, eq. 28).

tr(F) >= lambda_max(F), and tr(F) = E ||grad log pi(y|x)||^2 over sampled responses (eq. 28),
so alpha * beta * tr(F) is an upper bound on alpha * beta * lambda_max. Against Lemma 4.2:

    bound <= eta           stable, non-oscillatory for sure
    eta < bound < 1 + eta  oscillation possible
    bound >= 1 + eta       instability possible

alpha is read as the optimizer's current learning rate: the lemma is stated for SGD, and
under Adam this is a heuristic scale, not a guarantee. Every call costs one backward pass
per monitored sequence (``monitor/seconds`` is logged); it is off by default
(``monitor.every=0``).
"""

from __future__ import annotations

import logging
import time

import torch

from ..heads import head
from ..rollout.base import Rollouts

log = logging.getLogger(__name__)
REGIMES = ("non-oscillatory", "oscillation possible", "instability possible")


def fisher_trace(policy: torch.nn.Module, batch: Rollouts, rows: list[int], temperature: float = 1.0) -> float:
    """Eq. 28: mean over ``rows`` of ||grad_theta log pi(y|x)||^2 (sequence-level score)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    total = 0.0
    for r in rows:
        sub = batch.select([r])
        h = head(policy, sub, temperature=temperature)
        seq_logp = torch.where(sub.response_mask.bool(), h.logp, torch.zeros_like(h.logp)).sum()
        grads = torch.autograd.grad(seq_logp, params, allow_unused=True)
        total += float(sum((g.float() ** 2).sum() for g in grads if g is not None))
    return total / max(len(rows), 1)


class StabilityMonitor:
    """Every ``every`` iterations, alpha * beta * tr(F) against Lemma 4.2's regimes. beta is given per call: the token
    KL's weight the loss applied at that iteration (the step's ``kl_weight``: beta, or over the batch's reward std
    under ``algo.global_kl_scale``), so the bound is the one the update ran under."""

    def __init__(self, every: int, num_sequences: int, eta: float):
        self.every, self.n, self.eta = every, num_sequences, eta
        self.warned: set[int] = set()

    def due(self, iteration: int, beta: float) -> bool:
        return self.every > 0 and beta > 0 and iteration % self.every == 0

    def __call__(self, policy, batch: Rollouts, lr: float, beta: float, temperature: float = 1.0) -> dict:
        t0 = time.perf_counter()
        rows = list(range(min(self.n, len(batch))))
        trF = fisher_trace(policy, batch, rows, temperature)
        bound = lr * beta * trF
        regime = 0 if bound <= self.eta else (1 if bound < 1 + self.eta else 2)
        if regime > 0 and regime not in self.warned:
            self.warned.add(regime)
            log.warning("EMA stability monitor: alpha*beta*tr(F) = %.3g with eta = %.3g -> %s (Lemma 4.2); "
                        "lower optim.lr or algo.beta, or raise anchor.eta", bound, self.eta, REGIMES[regime])
        return {"anchor/trF": trF, "anchor/alpha_beta_trF": bound, "anchor/regime": regime,
                "monitor/seconds": time.perf_counter() - t0}
