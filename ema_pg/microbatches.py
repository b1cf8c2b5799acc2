"""Micro-batches under a token budget (``algo.max_tokens_per_microbatch``): which rows of a batch go together, and
a function run over them with its outputs put back in row order. The step's scoring (:mod:`ema_pg.scoring`) and the
update's passes (:mod:`ema_pg.update`) both go by them, so they live below both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

import torch
from torch import Tensor

from .dist import World
from .rollout.base import Rollouts


def micro_batches(batch: Rollouts, budget: int, world: World = World()) -> list[Tensor]:
    """The rows (indices into ``batch``) of each micro-batch of a minibatch: rows in prompt order (a prompt's samples
    together, so that they share their prefix), a new micro-batch whenever the next row's real tokens would take it
    over ``budget`` (a row longer than the budget goes alone). On several processes every rank makes as many
    micro-batches as the rank that needs the most (its heaviest ones split in two): some strategies' forwards are
    collective. ``budget`` 0: one micro-batch, the whole minibatch."""
    n = len(batch)
    if budget <= 0:
        return [torch.arange(n)]
    order = sorted(range(n), key=lambda i: batch.prompt_index[i])
    tokens = batch.attention_mask.sum(1).tolist()
    groups, cur, total = [], [], 0
    for i in order:
        if cur and total + tokens[i] > budget:
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += tokens[i]
    groups.append(cur)
    count = world.max(len(groups)) if world.size > 1 else len(groups)
    while len(groups) < count:  # as many as the other ranks: split the heaviest divisible one at its middle token
        j = max((g for g in range(len(groups)) if len(groups[g]) > 1), key=lambda g: sum(tokens[i] for i in groups[g]))
        g = groups.pop(j)
        half, acc, cut = sum(tokens[i] for i in g) / 2, 0, 1
        for k, i in enumerate(g[:-1], 1):
            acc += tokens[i]
            cut = k
            if acc >= half:
                break
        groups[j:j] = [g[:cut], g[cut:]]
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def over_micro_batches(batch: Rollouts, budget: int, world: World, fn: Callable):
    """``fn(rows)`` on each micro-batch of ``batch`` (:func:`micro_batches`), the outputs put back in row order; with
    one micro-batch, ``fn(None)``: the whole batch at once. ``fn`` returns a tensor (rows first), a dataclass of
    them (None fields allowed) or None."""
    parts = micro_batches(batch, budget, world)
    if len(parts) == 1:
        return fn(None)
    return _rows_back([fn(p) for p in parts], torch.argsort(torch.cat(parts)))


def _rows_back(outs: list, back: Tensor):
    first = outs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        return torch.cat(outs)[back]
    return type(first)(**{f.name: _rows_back([getattr(o, f.name) for o in outs], back) for f in fields(first)})
