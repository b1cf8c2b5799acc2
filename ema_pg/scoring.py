"""The no-grad scores of one batch that the step makes and the update reads: pi_old's and the anchor's, and the index
set q_n of a Top-k estimator (:class:`OldAndAnchor`), made by :class:`OldAndAnchorScorer`, the one place that decides
whose top-k q_n is. They live below both :mod:`ema_pg.step` and :mod:`ema_pg.update`, so neither types them as
``object``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .dist import World
from .heads import head
from .kl import Estimator
from .microbatches import over_micro_batches
from .packing import Packing
from .rollout.base import Rollouts
from .scores import ScoreRequest, TokenScores, pad_columns


@dataclass
class OldAndAnchor:
    """No-grad scores of one batch: what the loss and the KL estimator read besides the policy."""

    old: TokenScores  # pi_old: logp (N, T), entropy (N, T), logits for the exact estimators
    anchor: TokenScores | None  # the anchor: logp (N, T), logits for the exact estimators
    index: Tensor | None  # (N, T, k) the index set q_n handed to the estimator (None: no top-k)
    anchor_index_logp: Tensor | None  # (N, T, k) log pi_anchor at q_n

    def select(self, rows: Tensor) -> OldAndAnchor:
        """The same scores for a subset of rows."""
        pick = lambda x: None if x is None else x[rows.to(x.device)]
        return OldAndAnchor(self.old.select(rows.to(self.old.logp.device)),
                            None if self.anchor is None else self.anchor.select(rows.to(self.anchor.logp.device)),
                            pick(self.index), pick(self.anchor_index_logp))

    @staticmethod
    def cat(parts: list[OldAndAnchor], width: int) -> OldAndAnchor:
        """The rows of several batches' scores as one, response columns padded to ``width``
        (:meth:`ema_pg.scores.TokenScores.cat`)."""
        opt = lambda xs: None if xs[0] is None else torch.cat([pad_columns(x, width) for x in xs])  # noqa: E731
        return OldAndAnchor(TokenScores.cat([p.old for p in parts], width),
                            None if parts[0].anchor is None else TokenScores.cat([p.anchor for p in parts], width),
                            opt([p.index for p in parts]), opt([p.anchor_index_logp for p in parts]))


class OldAndAnchorScorer:
    """The one place that decides whose top-k is the estimator's index set q_n.

    ``topk_source == "policy_old"`` (reverse KL, Alg 1): q_n = top-k of pi_old, and the anchor is
    scored at q_n. ``"anchor"`` (forward KL, Alg 2): q_n = the anchor's own top-k. ``None``: no
    index set. :meth:`request` tells the sampler what to compute of pi_old while it samples;
    :meth:`__call__` takes the sampler's scores when present and computes what is missing.
    """

    def __init__(self, estimator: Estimator, temperature: float, chunk: Callable[[int], int],
                 pack: Callable[[Rollouts], Packing | None] = lambda batch: None, budget: int = 0,
                 world: World = World()):
        self.source, self.k, self.full = estimator.topk_source, estimator.k, estimator.needs_full_logits
        self.temperature, self.chunk, self.pack = temperature, chunk, pack
        self.budget, self.world = budget, world  # algo.max_tokens_per_microbatch: the passes go by micro-batches

    def request(self) -> ScoreRequest | None:
        """What the sampler should return of pi_old (None: the exact estimators need full logits)."""
        if self.full:
            return None
        return ScoreRequest(topk=self.k if self.source == "policy_old" else 0, entropy=True)

    @torch.no_grad()
    def __call__(self, policy, anchor_model, rollouts: Rollouts, packing: Packing | None = None) -> OldAndAnchor:
        """``rollouts.old`` (the sampler's scores) is pi_old when present; else ``policy`` is scored here.
        ``packing``: the batch's (else made here by ``pack``). With a token budget the batch goes by micro-batches
        (:func:`ema_pg.microbatches.micro_batches`), each scored apart, the rows put back in their order."""
        return over_micro_batches(rollouts, self.budget, self.world, lambda rows: (
            self._score(policy, anchor_model, rollouts, packing) if rows is None
            else self._score(policy, anchor_model, rollouts.select(rows), None)))

    def _score(self, policy, anchor_model, rollouts: Rollouts, packing: Packing | None) -> OldAndAnchor:
        packing = packing if packing is not None else self.pack(rollouts)
        ch, kw = self.chunk(rollouts.response_mask.numel()), {"temperature": self.temperature, "packing": packing}
        old = rollouts.old
        if old is None:
            old = head(policy, rollouts, topk=self.k if self.source == "policy_old" else 0, full_logits=self.full,
                       entropy=True, chunk=ch, **kw)
        if anchor_model is None:
            return OldAndAnchor(old, None, None, None)
        if self.source == "policy_old":
            anchor = head(anchor_model, rollouts, index=old.index, full_logits=self.full, chunk=ch, **kw)
        else:
            anchor = head(anchor_model, rollouts, topk=self.k if self.source == "anchor" else 0,
                          full_logits=self.full, chunk=ch, **kw)
        index = anchor.index if self.source is not None else None
        return OldAndAnchor(old, anchor, index, anchor.index_logp)
