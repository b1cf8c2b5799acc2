"""Partial rollouts (``rollout.partial=true``, with ``rollout.max_staleness >= 1``): a response still running at a
weight update is continued by the next version instead of being waited for or sampled again.

A rollout worker keeps a stream of prompt groups in flight (its block of every batch's prompts, in batch order, each
with its own seed: the prompts and seeds a whole-rollout run starts at that batch). For batch t, with the weights of
version v = max(0, t - k) (the schedule of :mod:`ema_pg.engine.ahead`, unchanged):

1. the groups in flight are topped up from the stream to ``block + spare`` (``rollout.partial_spare``);
2. a *pass* advances every response not yet ended by up to ``rollout.partial_tokens`` tokens, with version v
   (:meth:`ema_pg.rollout.hf.HFSampler.sample` continues each response from its prefix), and scores the new tokens
   with version v's policy and, under ``anchor.align=behaviour``, its anchor; a group is ready when its G responses
   have ended (EOS or ``max_new_tokens``);
3. passes repeat until ``block`` groups are ready; the batch is the first ``block`` of them, in the order they
   entered the stream. The rest stay in flight and go on with the next version.

Every token records the version that sampled it (``Sampled.token_version``). pi_old of a token, the loss's behaviour
log-prob, is its sampling version's, token by token, and so is its top-k index set; under ``anchor.align=behaviour``
its anchor score is the anchor of that version (docs/async.md derives what that does to the stability lemma). The
stream's state after each batch travels with the batch (``Sampled.carry``), so a checkpoint, which keeps the batches
in flight, keeps it too: a resumed run repeats the uninterrupted one. Nothing here races: which tokens a version
samples is a function of token counts, never of time.

With ``spare = 0`` every group in flight must end before its batch is handed over, one version samples it all, and
the batch is the whole-rollout batch (a test checks it token for token).
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
from .step import OldAndAnchor, OldAndAnchorScorer, Sampled, StepParts, step_seed
from .tasks.base import checked_reward


@dataclass
class Group:
    """One prompt's G responses in flight: their tokens so far, and per token its scores and sampling version."""

    prompt: object  #: the task's prompt
    seed: int  #: its sampling seed (prompt_seeds of its batch)
    source: tuple[int, int]  #: (the batch of the stream it came from, its place in this worker's block)
    tokens: list[list[int]]  #: per response, its tokens so far
    pieces: list[list[OldAndAnchor]] = field(default_factory=list)  #: per response, each pass's scores (1 row)
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
    batch; ``spare``: the groups it keeps in flight beyond them; ``tokens``: the most tokens a pass adds to a
    response. ``state``: a saved :meth:`state` to continue from (a resumed run)."""

    def __init__(self, block: int, spare: int, tokens: int, state: dict | None = None):
        self.block, self.spare, self.tokens = block, spare, tokens
        self.cursor: tuple[int, int] = (0, 0)  #: the stream's next prompt: (batch, place in this worker's block)
        self.groups: list[Group] = []  #: in flight, in stream order
        if state is not None:
            if (state["block"], state["spare"], state["tokens"]) != (block, spare, tokens):
                raise ValueError(f"the saved partial-rollout stream has block {state['block']}, spare "
                                 f"{state['spare']} and {state['tokens']} tokens a pass; this run asks for {block}, "
                                 f"{spare} and {tokens}: resume with the run's own rollout settings")
            self.cursor, self.groups = tuple(state["cursor"]), state["groups"]

    def state(self) -> dict:
        """What a resume continues from: the cursor and the groups in flight."""
        return {"block": self.block, "spare": self.spare, "tokens": self.tokens, "cursor": self.cursor,
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
                cache[s] = (list(parts.task.sample(B, seed=it_seed))[mine], prompt_seeds(it_seed, B)[mine])
            prompts, seeds = cache[s]
            self.groups.append(Group(prompts[j], seeds[j], (s, j), [[] for _ in range(G)], [[] for _ in range(G)],
                                     [[] for _ in range(G)], [False] * G))
            self.cursor = (s, j + 1) if j + 1 < len(prompts) else (s + 1, 0)

    def _heads(self, parts: StepParts, groups: list[Group]) -> list[list[int]]:
        """The prompt ids of each group (as the sampler encodes them)."""
        return prompt_ids(parts.sampler.tok, sampler_prompts([g.prompt for g in groups], parts.encode))

    @torch.no_grad()
    def _pass(self, parts: StepParts, version: int, scorer: OldAndAnchorScorer) -> None:
        """Every response not yet ended, advanced by up to ``tokens`` tokens with ``parts.policy`` (version
        ``version``), its new tokens scored by that policy and anchor."""
        ro_cfg, G, eos = parts.rollout, parts.algo.group_size, parts.sampler.tok.eos_token_id
        going = [g for g in self.groups if not g.ready]
        heads = self._heads(parts, going)
        before = [list(y) for g in going for y in g.tokens]
        budget = [0 if e else self.tokens for g in going for e in g.ended]
        ro = parts.sampler.generate(parts.policy, heads, G, temperature=ro_cfg.temperature, top_p=ro_cfg.top_p,
                                    max_new_tokens=ro_cfg.max_new_tokens, seed=[g.seed for g in going],
                                    prefix=before, budget=budget)
        resp, mask = ro.input_ids[:, ro.prompt_len:], ro.loss_mask[:, ro.prompt_len:].bool()
        after = [b + resp[r][mask[r]].tolist() for r, b in enumerate(before)]
        moved = [r for r in range(len(after)) if len(after[r]) > len(before[r])]
        full = row_rollouts([heads[r // G] for r in moved], [after[r] for r in moved], [r // G for r in moved],
                            parts.sampler.tok, ro_cfg.max_new_tokens)
        scores = scorer(parts.policy, parts.anchor_model, full)  # the whole responses so far, by this version
        for i, r in enumerate(moved):
            g, y = going[r // G], r % G
            a, b = len(before[r]), len(after[r])
            g.pieces[y].append(map_scores(scores, lambda x, i=i, a=a, b=b: x[i:i + 1, a:b].clone()))
            g.versions[y].extend([version] * (b - a))
            g.tokens[y] = after[r]
            g.ended[y] = after[r][-1] == eos or b >= ro_cfg.max_new_tokens

    # ------------------------------------------------------------------ one batch
    def batch(self, t: int, version: int, parts: StepParts) -> Sampled:
        """Batch ``t``, its passes sampled by ``parts.policy``, the weights of version ``version`` (module docstring)."""
        t0 = time.perf_counter()
        algo, world = parts.algo, parts.world
        scorer = OldAndAnchorScorer(parts.estimator, parts.rollout.temperature, parts.chunk, packer(algo, parts.policy),
                                    algo.max_tokens_per_microbatch)
        self._top_up(parts, world)
        passes = 0
        while sum(g.ready for g in self.groups) < self.block:
            self._pass(parts, version, scorer)
            passes += 1
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
                   "rollout/partial_passes": float(passes), "rollout/partial_in_flight": float(len(self.groups)),
                   "rollout/frac_mixed_versions": sum(mixed) / len(mixed)}
        return Sampled(rollouts, rewards, metrics, version, scores if parts.anchor_model is not None else None,
                       time.perf_counter() - t0, token_version=token_version)
