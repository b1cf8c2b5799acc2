"""Partial rollouts (``rollout.partial=true``, with ``rollout.max_staleness >= 1``): a response still running at a
weight update is continued by the next version instead of being waited for or sampled again.

A rollout worker keeps a stream of prompt groups in flight (its block of every batch's prompts, in batch order, each
with its own seed: the prompts and seeds a whole-rollout run starts at that batch). For batch t, with the weights of
version v = max(0, t - k) (the schedule of :mod:`ema_pg.engine.rollout_workers`, unchanged):

1. the groups in flight are topped up from the stream to ``block + spare`` (``rollout.partial_spare``);
2. version v continues every response not yet ended, all of them a token at a time together
   (:meth:`ema_pg.rollout.hf.HFSampler.continue_responses` from each response's prefix, with pi_old's scores of the new tokens),
   and stops at the first token step after which ``block`` groups are ready: a group is ready when its G responses
   have ended (EOS or ``max_new_tokens``). Under ``anchor.align=behaviour`` version v's anchor scores the new tokens;
3. the batch is the first ``block`` ready groups, in the order they entered the stream. The rest stay in flight and
   go on with the next version.

Every token records the version that sampled it (``Sampled.token_version``). pi_old of a token, the loss's behaviour
log-prob, is its sampling version's, token by token, and so is its top-k index set; under ``anchor.align=behaviour``
its anchor score is the anchor of that version (docs/async.md derives what that does to the stability lemma). The
stream's state after each batch travels with the batch (``Sampled.carry``), so a checkpoint, which keeps the batches
in flight, keeps it too: a resumed run repeats the uninterrupted one. Nothing here races: which tokens a version
samples is a function of token counts, never of time.

With ``spare = 0`` every group in flight must end before its batch is handed over, one version samples it all in one
call, and the batch is the whole-rollout batch (a test checks it bit for bit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, is_dataclass

import torch
from torch import Tensor

from .dist import World
from .packing import packer
from .prompts import prompt_ids, sampler_prompts
from .rollout.base import Rollouts, pad_id, prompt_seeds
from .rollout.hf import Continuation
from .tasks.base import sampled
from .scores import TokenScores
from .scoring import OldAndAnchor, OldAndAnchorScorer
from .step import Sampled, StepParts, step_seed
from .tasks.base import checked_reward


@dataclass
class Group:
    """One prompt's G responses in flight: their tokens so far, and per token its scores and sampling version."""

    prompt: object  #: the task's prompt
    seed: int  #: its sampling seed (prompt_seeds of its batch)
    source: tuple[int, int]  #: (the batch of the stream it came from, its place in this worker's block)
    tokens: list[list[int]]  #: per response, its tokens so far
    pieces: list[list[OldAndAnchor]] = field(default_factory=list)  #: per response, each version's scores (1 row)
    versions: list[list[int]] = field(default_factory=list)  #: per response, each token's sampling version
    ended: list[bool] = field(default_factory=list)  #: per response: EOS or max_new_tokens reached

    @property
    def ready(self) -> bool:
        return all(self.ended)


def map_scores(x, fn):
    """``fn`` applied to every tensor of a (nested) score record (:class:`OldAndAnchor`, :class:`TokenScores`)."""
    if x is None:
        return None
    if isinstance(x, Tensor):
        return fn(x)
    assert is_dataclass(x)
    return type(x)(**{f.name: map_scores(getattr(x, f.name), fn) for f in fields(x)})


def cat_columns(pieces: list):
    """Score records of one row, side by side: their tensors concatenated along the columns (dim 1)."""
    first = pieces[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        return torch.cat(pieces, 1)
    return type(first)(**{f.name: cat_columns([getattr(p, f.name) for p in pieces]) for f in fields(first)})


def _shift(x: Tensor, a: int) -> Tensor:
    """``x`` (1, T, ...) moved ``a`` columns to the right (zeros in front): a row's new-token scores placed after its
    prefix."""
    return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [a, 0])


def row_rollouts(heads: list[list[int]], responses: list[list[int]], prompt_index: list[int], tok,
                 max_new_tokens: int) -> Rollouts:
    """A single-turn batch from token lists: prompts (``heads``) left-padded, responses right-padded, the loss on
    every response token, a response truncated when it has ``max_new_tokens`` tokens and no EOS."""
    pad, eos = pad_id(tok), tok.eos_token_id
    N, P, T = len(heads), max(len(h) for h in heads), max(len(r) for r in responses)
    ids = torch.full((N, P + T), pad, dtype=torch.long)
    am = torch.zeros((N, P + T), dtype=torch.long)
    lm = torch.zeros((N, P + T), dtype=torch.long)
    for r, (h, y) in enumerate(zip(heads, responses)):
        if h:
            ids[r, P - len(h):P], am[r, P - len(h):P] = torch.tensor(h), 1
        if y:
            ids[r, P:P + len(y)], am[r, P:P + len(y)], lm[r, P:P + len(y)] = torch.tensor(y), 1, 1
    truncated = torch.tensor([len(y) >= max_new_tokens and (not y or y[-1] != eos) for y in responses])
    text = [tok.decode([t for t in y if t != eos], skip_special_tokens=True) for y in responses]
    return Rollouts(ids, am, lm, P, list(prompt_index), text, truncated=truncated)


class PartialStream:
    """One worker's stream of prompt groups in flight (module docstring). ``block``: the groups it hands over per
    batch; ``spare``: the groups it keeps in flight beyond them. ``state``: a saved :meth:`state` to continue from (a
    resumed run)."""

    def __init__(self, block: int, spare: int, state: dict | None = None):
        self.block, self.spare = block, spare
        self.cursor: tuple[int, int] = (0, 0)  #: the stream's next prompt: (batch, place in this worker's block)
        self.groups: list[Group] = []  #: in flight, in stream order
        if state is not None:
            if (state["block"], state["spare"]) != (block, spare):
                raise ValueError(f"the saved partial-rollout stream has block {state['block']} and spare "
                                 f"{state['spare']}; this run asks for {block} and {spare}: resume with the run's own "
                                 "rollout settings")
            self.cursor, self.groups = tuple(state["cursor"]), state["groups"]

    def state(self) -> dict:
        """What a resume continues from: the cursor and the groups in flight."""
        return {"block": self.block, "spare": self.spare, "cursor": self.cursor,
                "groups": self.groups}

    # ------------------------------------------------------------------ the stream
    def _top_up(self, parts: StepParts, world: World) -> None:
        """Groups from the stream until ``block + spare`` are in flight: batch s's block of prompts, each with the seed
        a whole-rollout run gives it at batch s."""
        B, G = parts.algo.prompts_per_step, parts.algo.group_size
        cache: dict[int, tuple[list, list[int]]] = {}
        while len(self.groups) < self.block + self.spare:
            s, j = self.cursor
            if s not in cache:
                it_seed = step_seed(parts.seed, s)
                mine = world.block(B)
                cache[s] = (list(sampled(parts.task, B, it_seed))[mine], prompt_seeds(it_seed, B)[mine])
            prompts, seeds = cache[s]
            self.groups.append(Group(prompts[j], seeds[j], (s, j), [[] for _ in range(G)], [[] for _ in range(G)],
                                     [[] for _ in range(G)], [False] * G))
            self.cursor = (s, j + 1) if j + 1 < len(prompts) else (s + 1, 0)

    def _heads(self, parts: StepParts, groups: list[Group]) -> list[list[int]]:
        """The prompt ids of each group (as the sampler encodes them)."""
        return prompt_ids(parts.sampler.tok, sampler_prompts([g.prompt for g in groups], parts.encode))

    @torch.no_grad()
    def _continue(self, parts: StepParts, version: int, scorer: OldAndAnchorScorer) -> int:
        """Every response not yet ended, continued by ``parts.policy`` (version ``version``) until ``block`` groups
        are ready; its new tokens' pi_old scores are the sampler's, their anchor scores (aligned) that version's anchor's.
        Returns the token steps taken."""
        ro_cfg, G, eos = parts.rollout, parts.algo.group_size, parts.sampler.tok.eos_token_id
        going = [g for g in self.groups if not g.ready]
        heads = self._heads(parts, going)
        before = [list(y) for g in going for y in g.tokens]
        need = self.block - (len(self.groups) - len(going))  # groups still to become ready
        steps = [0]

        def enough(active: Tensor) -> bool:
            steps[0] += 1
            return int((~active.view(-1, G)).all(-1).sum()) >= need

        ro = parts.sampler.continue_responses(parts.policy, heads, G, Continuation(before, enough),
                                              temperature=ro_cfg.temperature, top_p=ro_cfg.top_p,
                                              max_new_tokens=ro_cfg.max_new_tokens, seed=[g.seed for g in going],
                                              score=scorer.request())
        mask = ro.response_mask.bool()
        new = [ro.input_ids[r, ro.prompt_len:][mask[r]].tolist() for r in range(len(before))]
        moved = [r for r in range(len(new)) if new[r]]
        old = ro.old  # pi_old of the new tokens, by the sampler: their columns are each row's first len(new[r])
        anchor = None
        if parts.anchor_model is not None:  # aligned: this version's anchor scores the new tokens (in their context)
            full = row_rollouts([heads[r // G] for r in moved], [before[r] + new[r] for r in moved],
                                [r // G for r in moved], parts.sampler.tok, ro_cfg.max_new_tokens)
            full.old = TokenScores.cat([map_scores(old.select(torch.tensor([r])),
                                                   lambda x, r=r: _shift(x, len(before[r]))) for r in moved],
                                       full.response_mask.shape[1])
            anchor = scorer(parts.policy, parts.anchor_model, full)
        for i, r in enumerate(moved):
            g, y = going[r // G], r % G
            a, n = len(before[r]), len(new[r])
            piece = OldAndAnchor(map_scores(old.select(torch.tensor([r])), lambda x, n=n: x[:, :n].clone()),
                                 None, None, None)
            if anchor is not None:
                cut = map_scores(anchor.select(torch.tensor([i])), lambda x, a=a, n=n: x[:, a:a + n].clone())
                piece = OldAndAnchor(piece.old, cut.anchor, cut.index, cut.anchor_index_logp)
            g.pieces[y].append(piece)
            g.versions[y].extend([version] * n)
            g.tokens[y] = before[r] + new[r]
            g.ended[y] = g.tokens[y][-1] == eos or len(g.tokens[y]) >= ro_cfg.max_new_tokens
        return steps[0]

    # ------------------------------------------------------------------ one batch
    def batch(self, t: int, version: int, parts: StepParts) -> Sampled:
        """Batch ``t``, its new tokens sampled by ``parts.policy``, the weights of version ``version`` (module docstring)."""
        t0 = time.perf_counter()
        algo, world = parts.algo, parts.world
        scorer = OldAndAnchorScorer(parts.estimator, parts.rollout.temperature, parts.chunk, packer(algo, parts.policy),
                                    algo.max_tokens_per_microbatch)
        self._top_up(parts, world)
        steps = self._continue(parts, version, scorer) if sum(g.ready for g in self.groups) < self.block else 0
        out = [g for g in self.groups if g.ready][: self.block]
        self.groups = [g for g in self.groups if not any(g is o for o in out)]
        G, tok = algo.group_size, parts.sampler.tok
        heads = self._heads(parts, out)
        rows = [(k, y) for k in range(len(out)) for y in range(G)]
        rollouts = row_rollouts([heads[k] for k, _ in rows], [out[k].tokens[y] for k, y in rows],
                                [k for k, _ in rows], tok, parts.rollout.max_new_tokens)
        T = rollouts.response_mask.shape[1]
        scores = OldAndAnchor.cat([cat_columns(out[k].pieces[y]) for k, y in rows], T)
        rollouts.old = scores.old
        token_version = torch.zeros((len(rows), T), dtype=torch.long)
        for r, (k, y) in enumerate(rows):
            v = out[k].versions[y]
            token_version[r, :len(v)] = torch.tensor(v)
        rewards = torch.tensor([checked_reward(parts.task, out[k].prompt, text) for (k, _), text
                                in zip(rows, rollouts.responses)], dtype=torch.float32)
        mixed = [len(set(out[k].versions[y])) > 1 for k, y in rows]
        metrics = {"train/frac_groups_zero_std": float((rewards.view(-1, G).std(-1) == 0).float().mean()),
                   "rollout/partial_steps": float(steps), "rollout/partial_in_flight": float(len(self.groups)),
                   "rollout/frac_mixed_versions": sum(mixed) / len(mixed)}
        return Sampled(rollouts, rewards, metrics, version, scores if parts.anchor_model is not None else None,
                       time.perf_counter() - t0, token_version=token_version)
