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

from ..scores import ScoreRequest, TokenScores, pad_columns

#: The environment's turn: called once for every row that ended its turn at a stop string, all together
#: (one batched call per turn, as Search-R1's generation loop makes one batched search request), with
#: (rows, each row's turn text: its policy text since its last observation or the prompt). Returns per
#: row the observation to append (generation then continues) or None (the row ends).
OnStop = Callable[[list[int], list[str]], "list[str | None]"]


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

        olds = [p.old for p in parts]
        old = TokenScores.cat(olds, T) if all(o is not None for o in olds) else None
        cat_opt = lambda xs: None if any(x is None for x in xs) else torch.cat(xs)
        return Rollouts(
            input_ids=torch.cat([grow(p.input_ids, p, pad_id) for p in parts]),
            attention_mask=torch.cat([grow(p.attention_mask, p, 0) for p in parts]),
            loss_mask=torch.cat([grow(p.loss_mask, p, 0) for p in parts]),
            prompt_len=P, prompt_index=[i for p in parts for i in p.prompt_index],
            responses=[r for p in parts for r in p.responses], old=old,
            engine_logp=cat_opt([pad_columns(p.engine_logp, T) for p in parts]),
            truncated=cat_opt([p.truncated for p in parts]),
        )


def pad_id(tok) -> int:
    """The id a batch pads with: the tokenizer's pad token, else its EOS."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


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

    ``prompts``: token ids (:class:`ema_pg.prompts.PromptEncoder` makes them), or plain strings
    (:func:`ema_pg.prompts.prompt_ids` encodes them). Row ``r`` answers prompt ``r // n``.
    Rows pause at a stop string until every row of the batch has ended its turn, then the
    environment answers them in one call (``on_stop``); a row's samples do not depend on that
    pausing (:class:`RowUniforms`).
    ``seed``: an int, or one seed per prompt (:func:`prompt_seeds`).
    ``score``: what to return of pi_old (the sampling policy) in ``Rollouts.old``. A sampler that
    cannot score with the trainer's numerics (an inference engine with its own kernels) returns
    ``old=None`` and the trainer scores pi_old itself.
    ``full_weights``: see the attribute.
    ``lockstep``: None, or the :class:`ema_pg.dist.World` whose processes must run every forward together
    (ZeRO-3 gathers parameters collectively): a sampler that steps token by token then runs until every
    rank is done. A sampler whose engine holds its own weights (vLLM) has nothing to keep in step.
    """

    lockstep: object | None
    #: None, or a function of the model sampled giving a context in which it samples (DeepSpeed ZeRO-3: its weights
    #: gathered once, :class:`ema_pg.dist.Zero3FullWeights`); a sampler whose engine holds its own weights ignores it
    full_weights: object | None

    def generate(self, model, prompts: list[str] | list[list[int]], n: int, *, temperature: float, top_p: float,
                 max_new_tokens: int, stop: list[str] | None = None, on_stop: OnStop | None = None,
                 seed: int | list[int] = 0, score: ScoreRequest | None = None) -> Rollouts: ...

    def close(self) -> None:
        """Free what the sampler holds beyond its run (an inference engine and its KV cache); a later
        :meth:`generate` starts again. Called when a run ends: a sweep runs its runs in one process."""


class RowUniforms:
    """The uniforms of a batch's sampled tokens: row r's j-th policy token is drawn at u[r, j], the r % n-th of
    the j-th draw of n uniforms from its prompt's generator (``gens[r // n]``). Draws are made in order as the
    rows need them, so a row's uniforms depend on its prompt's seed and its own position only: not on when
    it samples (rows paused for the environment, other processes' rows). Without pauses this is exactly one
    draw of n uniforms per prompt per step."""

    def __init__(self, gens: list[torch.Generator], n: int, device):
        self.gens, self.n, self.device = gens, n, device
        self.buf = torch.empty((len(gens), 64, n), dtype=torch.float64, device=device)  # (prompts, positions, n)
        self.drawn = 0  # positions drawn so far (the buffer doubles when full: one copy per doubling)

    def __call__(self, pos: Tensor) -> Tensor:
        """(N, 1) uniforms of the rows at policy-token positions ``pos`` (N,)."""
        need = int(pos.max()) + 1 if pos.numel() else 0
        while self.drawn < need:
            if self.drawn == self.buf.shape[1]:
                self.buf = torch.cat([self.buf, torch.empty_like(self.buf)], 1)
            self.buf[:, self.drawn] = torch.stack([torch.rand(self.n, 1, generator=g, device=self.device,
                                                              dtype=torch.float64)[:, 0] for g in self.gens])
            self.drawn += 1
        r = torch.arange(pos.shape[0], device=self.device)
        return self.buf[r // self.n, pos, r % self.n][:, None]
