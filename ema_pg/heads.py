"""Log-prob heads: per-token log pi(y_n), top-k indices and log-probs, log-probs at given indices.

This is the simple, materialized head: it forms the (N, T, V) response logits once. The
interface (``head(model, rollouts, ...) -> HeadOut``) is what the training step uses; a
memory-efficient head can replace the body without touching the callers.

All log-probs are of the temperature-scaled distribution softmax(logits / temperature), the
distribution the sampler draws from (nucleus truncation aside).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .rollout.base import Rollouts


@dataclass
class HeadOut:
    logp: Tensor  # (N, T) log pi(y_n)
    topk_idx: Tensor | None = None  # (N, T, k) this model's own top-k indices
    topk_logp: Tensor | None = None  # (N, T, k) log pi at topk_idx
    index_logp: Tensor | None = None  # (N, T, k') log pi at the given index set
    logits: Tensor | None = None  # (N, T, V) temperature-scaled logits (exact estimators only)
    entropy: Tensor | None = None  # (N, T)


def response_logits(model, batch: Rollouts, temperature: float = 1.0) -> Tensor:
    """(N, T, V) logits predicting the response tokens, T = L - P."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    logits = out.logits[:, batch.prompt_len - 1 : -1]  # (N, T, V)
    return logits.float() / temperature if temperature != 1.0 else logits.float()


def head(model, batch: Rollouts, *, k: int = 0, index: Tensor | None = None, full_logits: bool = False,
         entropy: bool = False, temperature: float = 1.0) -> HeadOut:
    """Everything the KL estimators and the loss read from one model on one batch."""
    logits = response_logits(model, batch, temperature)  # (N, T, V)
    lp = torch.log_softmax(logits, -1)  # (N, T, V)
    targets = batch.input_ids[:, batch.prompt_len:]  # (N, T)
    out = HeadOut(logp=lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    if k > 0:
        out.topk_logp, out.topk_idx = lp.topk(k, dim=-1)  # (N, T, k)
    if index is not None:
        out.index_logp = lp.gather(-1, index)  # (N, T, k')
    if full_logits:
        out.logits = logits
    if entropy:
        out.entropy = -(lp.exp() * lp).sum(-1)  # (N, T)
    return out
