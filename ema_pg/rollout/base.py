"""The rollout interface: prompts in, token ids and a loss mask out.

Layout of a :class:`Rollouts` batch of N = B*n rows: columns [0, P) hold the left-padded
prompts, columns [P, L) the response. A response may interleave policy tokens (loss mask 1)
with environment observation tokens (loss mask 0, attention 1) and padding (both 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ..scores import ScoreRequest, TokenScores

#: Called when a row's text matches a stop string: (row, response_text_so_far) -> observation
#: text to append (generation then continues), or None to end the row.
OnStop = Callable[[int, str], "str | None"]


@dataclass
class Rollouts:
    input_ids: Tensor  # (N, L) long
    attention_mask: Tensor  # (N, L) long; 0 on padding (left of prompts, holes in responses)
    loss_mask: Tensor  # (N, L) long; 1 on policy-generated response tokens only
    prompt_len: int  # P
    prompt_index: list[int]  # (N,) which prompt each row answers
    responses: list[str] = field(default_factory=list)  # decoded responses (observations included)
    old: TokenScores | None = None  # pi_old's scores, when the sampler was asked for them and computed them
    engine_logp: Tensor | None = None  # (N, T) an inference engine's own log-probs of the sampled tokens (0 elsewhere)
    truncated: Tensor | None = None  # (N,) bool: the row ran out of policy tokens (no EOS, no end by the environment)

    @property
    def position_ids(self) -> Tensor:
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)  # (N, L)

    @property
    def response_mask(self) -> Tensor:
        """(N, T) loss mask of the response columns, T = L - P."""
        return self.loss_mask[:, self.prompt_len:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor | list[int]) -> Rollouts:
        rows_t = torch.as_tensor(rows, dtype=torch.long)
        r = rows_t.tolist()
        return Rollouts(
            self.input_ids[rows_t], self.attention_mask[rows_t], self.loss_mask[rows_t], self.prompt_len,
            [self.prompt_index[i] for i in r], [self.responses[i] for i in r] if self.responses else [],
            None if self.old is None else self.old.select(rows_t),
            None if self.engine_logp is None else self.engine_logp[rows_t.to(self.engine_logp.device)],
            None if self.truncated is None else self.truncated[rows_t.to(self.truncated.device)],
        )

    @staticmethod
    def cat(parts: list[Rollouts], pad_id: int = 0) -> Rollouts:
        """Rows of several batches as one: prompts left-padded to the longest, responses right-padded
        (positions follow the attention mask, so scores are unchanged). ``prompt_index`` is kept as
        each part has it: the caller numbers prompts across parts."""
        P = max(p.prompt_len for p in parts)
        T = max(p.input_ids.shape[1] - p.prompt_len for p in parts)

        def grow(x: Tensor, p: Rollouts, fill) -> Tensor:  # (N, L) -> (N, P + T)
            left, right = P - p.prompt_len, T - (x.shape[1] - p.prompt_len)
            return torch.nn.functional.pad(x, (left, right), value=fill)

        def grow_t(x: Tensor | None) -> Tensor | None:  # (N, T_p, ...) -> (N, T, ...)
            if x is None:
                return None
            pad = [0, 0] * (x.dim() - 2) + [0, T - x.shape[1]]
            return torch.nn.functional.pad(x, pad)

        olds = [p.old for p in parts]
        old = None
        if all(o is not None for o in olds):
            old = TokenScores(**{f: None if getattr(olds[0], f) is None else torch.cat([grow_t(getattr(o, f)) for o in olds])
                                 for f in ("logp", "index", "index_logp", "logits", "entropy")})
        cat_opt = lambda xs: None if any(x is None for x in xs) else torch.cat(xs)
        return Rollouts(
            input_ids=torch.cat([grow(p.input_ids, p, pad_id) for p in parts]),
            attention_mask=torch.cat([grow(p.attention_mask, p, 0) for p in parts]),
            loss_mask=torch.cat([grow(p.loss_mask, p, 0) for p in parts]),
            prompt_len=P, prompt_index=[i for p in parts for i in p.prompt_index],
            responses=[r for p in parts for r in p.responses], old=old,
            engine_logp=cat_opt([grow_t(p.engine_logp) for p in parts]),
            truncated=cat_opt([p.truncated for p in parts]),
        )


def prompt_seeds(seed: int | list[int], n_prompts: int) -> list[int]:
    """One sampling seed per prompt. A list is one seed per prompt already; an int gives
    ``seed`` * 1_000_003 + j to prompt j. Each prompt's samples come from its own random stream,
    so a prompt's responses do not depend on the other prompts of the batch (several processes
    sample what one process does)."""
    if isinstance(seed, int):
        return [(seed * 1_000_003 + j) % 2**62 for j in range(n_prompts)]
    seeds = [int(s) for s in seed]
    if len(seeds) != n_prompts:
        raise ValueError(f"{len(seeds)} seeds for {n_prompts} prompts: give one per prompt, or one int")
    return seeds


class Sampler(Protocol):
    """Draws ``n`` responses per prompt from ``model``.

    ``seed``: an int, or one seed per prompt (:func:`prompt_seeds`).
    ``score``: what to return of pi_old (the sampling policy) in ``Rollouts.old``. A sampler that
    cannot score with the trainer's numerics (an inference engine with its own kernels) returns
    ``old=None`` and the trainer scores pi_old itself.
    """

    def generate(self, model, prompts: list[str], n: int, *, temperature: float, top_p: float,
                 max_new_tokens: int, stop: list[str] | None = None, on_stop: OnStop | None = None,
                 seed: int | list[int] = 0, score: ScoreRequest | None = None) -> Rollouts: ...
