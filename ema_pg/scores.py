"""Per-token scores of one model on a batch of rollouts, and what a sampler is asked to score.

Both the sampler (which sees pi_old's whole next-token distribution while it samples) and
:func:`ema_pg.heads.head` produce :class:`TokenScores`; the RL step reads them the same way
whichever produced them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass(frozen=True)
class ScoreRequest:
    """What a sampler should return of the sampling policy pi_old while it samples."""

    topk: int = 0  #: pi_old's own top-k at every response position (0 = none)
    entropy: bool = False  #: pi_old's entropy at every response position


@dataclass
class TokenScores:
    """One model's scores of the response tokens of a batch (T = response columns)."""

    logp: Tensor  # (N, T) log pi(y_n)
    index: Tensor | None = None  # (N, T, k) long: the index set q_n the next field is at
    index_logp: Tensor | None = None  # (N, T, k) log pi at ``index``
    logits: Tensor | None = None  # (N, T, V) temperature-scaled logits (exact estimators only)
    entropy: Tensor | None = None  # (N, T) entropy of pi at each position

    def select(self, rows: Tensor) -> TokenScores:
        """The same scores for a subset of rows (a minibatch)."""
        return TokenScores(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                              for f in fields(self)})

    @staticmethod
    def cat(parts: list[TokenScores], width: int) -> TokenScores:
        """The rows of several batches' scores as one, each field's response columns padded with zeros on the right
        to ``width`` (padding the loss never reads: its mask is 0 there)."""
        return TokenScores(**{f.name: None if getattr(parts[0], f.name) is None else
                              torch.cat([pad_columns(getattr(p, f.name), width) for p in parts]) for f in fields(parts[0])})


def pad_columns(x: Tensor | None, width: int) -> Tensor | None:
    """``x`` (N, T, ...) with zeros appended along its dim 1 up to ``width`` columns (None stays None)."""
    if x is None:
        return None
    return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, width - x.shape[1]])
