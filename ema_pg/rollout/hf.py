"""Rollouts over a Hugging Face causal LM with a reused KV cache.

One sampling loop serves single- and multi-turn tasks: when a row's text ends with a stop
string, ``on_stop`` may return an observation; its tokens are fed through the model into the
same cache (loss mask 0) and sampling continues, so earlier turns are never recomputed.
Position ids always come from the attention mask, here and in :mod:`ema_pg.heads`, so the
sampler's log-probs and the scorer's agree to float rounding.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import nullcontext
import weakref
from typing import NamedTuple

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from ..scores import ScoreRequest, TokenScores
from ..prompts import prompt_ids
from .base import OnStop, RowUniforms, Rollouts, pad_id, prompt_seeds


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """(N,) indices drawn from the rows of (N, V) ``probs`` (non-negative, any positive total) by the inverse
    CDF at (N, 1) uniforms ``u`` in [0, 1): the first index whose cumulative mass C_i exceeds u * C_V. Token i
    is drawn for u in [C_{i-1}, C_i) / C_V, an interval of length p_i / C_V, so a token of zero mass is never
    drawn (its C_i equals C_{i-1}; a rounded sum of non-negative terms never decreases), and u * C_V stays
    below C_V in round-to-nearest for every u < 1. One uniform per row instead of one exponential per row and
    token (the exponential race this replaced took a tenth of the sampler's time at a 300-token vocabulary)."""
    c = probs.double().cumsum(-1)  # float64: at a 150k vocabulary float32 would round small steps away
    return torch.searchsorted(c, u.double() * c[:, -1:], right=True).squeeze(-1)


def sample_token(logits: Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | list[torch.Generator] | None = None, u: Tensor | None = None) -> Tensor:
    """(N,) tokens from (N, V) logits: greedy at temperature 0, else temperature + nucleus.

    ``u``: the rows' (N, 1) uniforms (:class:`~ema_pg.rollout.base.RowUniforms`); else drawn from ``generator``:
    one for the whole batch, or a list of G generators, each drawing the uniforms of its N / G consecutive rows."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp > top_p  # keep the smallest prefix with mass >= top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    N, dev = probs.shape[0], probs.device
    if u is not None:
        return draw(probs, u)
    if isinstance(generator, list):
        n = N // len(generator)
        u = torch.cat([torch.rand(n, 1, generator=g, device=dev, dtype=torch.float64) for g in generator])
    else:
        u = torch.rand(N, 1, generator=generator, device=dev, dtype=torch.float64)
    return draw(probs, u)


class GrowingLayer(DynamicLayer):
    """A :class:`DynamicLayer` that writes new keys/values into a buffer with spare room instead of
    concatenating: one copy per doubling of the length, not one copy of the whole cache per token.
    Returns views of the filled part, so attention sees exactly what the concatenation gave."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.n, self.kbuf, self.vbuf = 0, None, None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, add = self.n, key_states.shape[-2]
        if self.kbuf is None or n + add > self.kbuf.shape[-2]:
            cap = max(2 * (n + add), 64)
            kbuf = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
            vbuf = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
            if n:
                kbuf[..., :n, :], vbuf[..., :n, :] = self.kbuf[..., :n, :], self.vbuf[..., :n, :]
            self.kbuf, self.vbuf = kbuf, vbuf
        self.kbuf[..., n : n + add, :] = key_states
        self.vbuf[..., n : n + add, :] = value_states
        self.n = n + add
        self.keys, self.values = self.kbuf[..., : self.n, :], self.vbuf[..., : self.n, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n if self.is_initialized else 0


class RowsLayer(DynamicLayer):
    """A :class:`GrowingLayer` seen through some of its rows: an update writes those rows' new columns into the whole
    layer (the other rows' new columns are zeros, which their masks never attend) and returns those rows' keys and
    values so far. A forward over a subset of a batch's rows extends every row's cache alike."""

    def __init__(self, parent: GrowingLayer, rows: Tensor):
        super().__init__()
        self.parent, self.rows, self.is_initialized = parent, rows, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        p = self.parent
        grow = lambda x: x.new_zeros(p.kbuf.shape[0], *x.shape[1:]).index_copy_(0, self.rows, x)
        p.update(grow(key_states), grow(value_states))
        return p.kbuf[self.rows, :, : p.n], p.vbuf[self.rows, :, : p.n]

    def get_seq_length(self) -> int:
        return self.parent.n


class FrontLayer(DynamicLayer):
    """A :class:`GrowingLayer` seen through its first ``n`` rows (a view, no copy): an update writes those rows' new
    column and zeros for the others' (never attended), and returns the first rows' keys and values. The sampler keeps
    the rows that go on at the front of its cache (:class:`Slots`), so a decode step computes them only."""

    def __init__(self, parent: GrowingLayer, n: int):
        super().__init__()
        self.parent, self.front, self.is_initialized = parent, n, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        p = self.parent
        grow = lambda x: torch.cat([x, x.new_zeros(p.kbuf.shape[0] - self.front, *x.shape[1:])])
        p.update(grow(key_states), grow(value_states))
        return p.kbuf[: self.front, :, : p.n], p.vbuf[: self.front, :, : p.n]

    def get_seq_length(self) -> int:
        return self.parent.n


class Slots:
    """Where each row's keys and values sit in a batch's :class:`GrowingLayer` cache: row r at slot ``slot[r]``. Rows
    are moved (their cache rows swapped) so that a set of rows occupies the first slots, moving as few as it takes:
    a decode step then runs on a prefix of the cache, a view."""

    def __init__(self, n: int, layers: list):
        self.slot, self.row, self.layers = list(range(n)), list(range(n)), layers

    def to_front(self, rows: list[int]) -> None:
        """Put ``rows`` in the first len(rows) slots (in some order)."""
        k, want = len(rows), set(rows)
        out_of_place = [r for r in rows if self.slot[r] >= k]
        free = [s for s in range(k) if self.row[s] not in want]
        for r, s in zip(out_of_place, free):
            a, b = self.slot[r], s
            for layer in self.layers:
                for buf in (layer.kbuf, layer.vbuf):
                    buf[[a, b]] = buf[[b, a]]
            other = self.row[b]
            self.row[a], self.row[b] = other, r
            self.slot[other], self.slot[r] = a, b

    def rows(self, k: int) -> list[int]:
        """The rows in the first ``k`` slots, slot order."""
        return self.row[:k]


class FixedLayer(StaticLayer):
    """transformers' :class:`StaticLayer` (preallocated keys and values, written in place at fixed addresses)
    whose values keep their own dtype: under autocast the rotary embedding leaves the keys in float32 while
    the value projection gives bfloat16, as the growing cache stores them; StaticLayer would give both the
    keys' dtype and refuse the values."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self.values.dtype != value_states.dtype:
            self.values = torch.zeros_like(self.values, dtype=value_states.dtype)
            torch._dynamo.mark_static_address(self.values)


def full_attention_layers(model) -> int | None:
    """The number of decoder layers if all of them use full attention, else None (sliding windows etc.)."""
    text = model.config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    return text.num_hidden_layers if kinds == {"full_attention"} else None


@functools.lru_cache(maxsize=64)
def _cache_kwarg_of(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwarg(model) -> str:
    """The name under which ``model.forward`` takes its KV cache: ``cache`` since transformers 5.24 (which
    deprecates ``past_key_values`` with a FutureWarning at every call), ``past_key_values`` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper's own takes **kw
    return _cache_kwarg_of(type(base).forward)


def new_cache(model) -> Cache:
    """A :class:`GrowingLayer` cache for models whose layers all use full attention, else transformers' own."""
    n = full_attention_layers(model)
    if n is None:  # sliding-window or other layer kinds: their own cache layers
        return DynamicCache(config=model.config)
    return Cache(layers=[GrowingLayer() for _ in range(n)])


def static_columns(needed: int) -> int:
    """The static cache's columns for ``needed`` = prompt + max_new_tokens: the next power of two (at least 64),
    so that batches whose padded prompts differ in length share one cache and one compiled decode step instead
    of compiling one per length (torch recompiles a function at most ``recompile_limit`` = 8 times, then runs it
    eagerly). The columns past ``needed`` stay masked."""
    return max(64, 1 << (needed - 1).bit_length())


class HFSampler:
    """Sampling loop with a KV cache. ``tokenizer`` must pad on the left.

    ``static_cache``: single-turn calls (no ``stop``) of full-attention models run over a preallocated
    cache of prompt + ``max_new_tokens`` columns rounded up to a power of two (:func:`static_columns`), so
    every decode step has the same shapes; on CUDA the decode step is compiled with
    ``mode="reduce-overhead"`` (captured once as a CUDA graph per batch shape and replayed), which removes
    the per-step launch cost of a small model's hundreds of kernels. The prefill, multi-turn calls and
    ZeRO-3 lockstep stay eager on the growing cache. The numbers are those of the eager loop to float
    rounding (the attention runs over the padded cache length). None (the default): on for a plain model
    on CUDA; off for LoRA policies (never run under graphs) and on CPU, where it was 8% slower (before the
    power-of-two columns): no launch cost to save, and attention over every preallocated column."""

    def __init__(self, tokenizer, max_obs_tokens: int = 256, static_cache: bool | None = None):
        self.tok = tokenizer
        self.max_obs_tokens = max_obs_tokens
        self.static_cache = static_cache
        #: per model: (its compiled decode step or the model itself, {(rows, columns, autocast): cache}), reused
        #: across calls so that a CUDA graph's buffers keep their addresses
        self._static: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        #: a :class:`ema_pg.dist.World` whose ranks must run the same forwards (DeepSpeed ZeRO-3, where every
        #: forward gathers parameters collectively): the loop then runs until every rank's rows are done
        self.lockstep = None
        #: None, or a function of the model sampled giving a context in which it samples (DeepSpeed ZeRO-3: its whole
        #: weights gathered once and its per-module hooks set aside, :class:`ema_pg.dist.Zero3FullWeights`)
        self.full_weights = None

    def _static_for(self, model, shape: tuple[int, int, bool], dev: torch.device):
        """(a reset cache of ``shape`` = (rows, columns, under autocast) for ``model``, its decode step)."""
        decode, caches = self._static.get(model, (None, {}))
        if decode is None:
            decode = torch.compile(model, mode="reduce-overhead", dynamic=False) if dev.type == "cuda" else model
            self._static[model] = (decode, caches)
        cache = caches.get(shape)
        if cache is None:
            cache = caches[shape] = Cache(layers=[FixedLayer(max_cache_len=shape[1])
                                                  for _ in range(full_attention_layers(model))])
        cache.reset()
        return cache, decode

    def _any(self, flag: bool) -> bool:
        return flag if self.lockstep is None else bool(self.lockstep.max(int(flag)))

    def _max(self, n: int) -> int:
        return n if self.lockstep is None else self.lockstep.max(n)

    def close(self) -> None:
        """(Sampler.close) Nothing to free: the sampler samples from the trainer's own model."""

    def generate(self, model, prompts: list[str] | list[list[int]], n: int = 1, **kw) -> Rollouts:
        """:meth:`sample`, inside ``full_weights(model)`` when it is set."""
        if self.full_weights is None:
            return self.sample(model, prompts, n, **kw)
        with self.full_weights(model):
            return self.sample(model, prompts, n, **kw)

    @torch.no_grad()
    def sample(self, model, prompts: list[str] | list[list[int]], n: int = 1, *, temperature: float = 1.0,
               top_p: float = 1.0, max_new_tokens: int = 32, stop: list[str] | None = None,
               on_stop: OnStop | None = None, seed: int | list[int] = 0, score: ScoreRequest | None = None) -> Rollouts:
        """Sample ``n`` responses per prompt. The sampler sees pi_old's whole next-token distribution
        at every step, so with ``score`` it also returns pi_old's scores in ``Rollouts.old``: log
        pi_old(y_n), and as asked its top-k (index set and log-probs) and entropy. The training step
        then needs no second pass of the policy.

        Multi-turn (``stop``): a row whose text ends with a stop string waits; once no row of the batch is
        mid-turn, ``on_stop`` answers every waiting row in one call, their observations go through the
        cache with loss mask 0 and the rows go on (a row answered None ends).

        The phases are :class:`_Decoding`'s: the prompts' prefill, the environment's turn, a token step, the
        cache's new column, and the result packed to the left.

        A body compiled in place (``model.compile``, :func:`ema_pg.engine.models.compile_body`) runs eagerly here:
        the cache's Python bookkeeping (its fill, each layer's index into it) specialized a graph per layer and
        per prefill / decode / observation block, 28 graphs for a two-layer model, past dynamo's recompile limit,
        after which the layers fell back to eager for the update's passes too. The static cache's decode step
        (CUDA) keeps its own compiled graph."""
        return self._sample(model, prompts, n, _Call(temperature, top_p, max_new_tokens, list(stop or []), on_stop, seed,
                                                     score))

    def continue_responses(self, model, prompts: list[str] | list[list[int]], n: int, resume: Continuation, *,
                           temperature: float, top_p: float, max_new_tokens: int, seed: int | list[int],
                           score: ScoreRequest | None = None) -> Rollouts:
        """Continue responses (partial rollouts, :mod:`ema_pg.partial`; single-turn, so no stop strings): the keywords
        are :meth:`sample`'s, and ``resume.prefix`` gives each row the response tokens it has already (row r: the r-th of the n rows of prompt
        r // n), sampled earlier, perhaps by other weights. They are prefilled with the prompt and the row samples on
        from there, its policy-token count and its uniforms (:class:`RowUniforms`, by position) where the prefix ends:
        a response continued with the same weights is the response sampled whole. A row whose prefix has ended (EOS or
        ``max_new_tokens``) only waits. ``resume.until``: called after each token step with the (N,) rows still going;
        True stops the call there, and the rows still going stop without ending (neither EOS nor truncated), to be
        continued by a later call. The result's prompt columns hold prompt and prefix; its response columns the new
        tokens alone (their scores, as asked, in ``old``)."""
        call = _Call(temperature, top_p, max_new_tokens, [], None, seed, score, resume.prefix)
        with (nullcontext() if self.full_weights is None else self.full_weights(model)):
            return self._sample(model, prompts, n, call, resume.until)

    @torch.no_grad()
    def _sample(self, model, prompts, n: int, call: _Call, until: Callable[[Tensor], bool] | None = None) -> Rollouts:
        was_training = model.training
        model.eval()
        with torch.compiler.set_stance("force_eager"):  # a compiled body (model.compile) runs eagerly here: see sample
            d = _Decoding(self, model, prompts, n, call)
            while self._any(bool(d.active.any())):
                d.environment_turn()
                nxt, a, sampling = d.token_step()
                if self._any(bool(d.active.any())):  # a row goes on (or waits for the environment): the cache takes
                    # the column, as the columns do. (Skipping it when every row that sampled had ended, while others
                    # waited, left the cache a column short of the mask from then on: each later step read its rows'
                    # keys one column off, so pi_old's scores and the samples of every multi-turn batch after such a
                    # step were not the policy's. Found by scoring the sampler's batches with the log-prob head: up to
                    # 1.8 nats apart.)
                    if until is not None and until(d.active.clone()):  # the caller's stop: the rest goes on later
                        break
                    d.extend_cache(nxt, a, sampling)
        model.train(was_training)
        return d.result()

class Continuation(NamedTuple):
    """What :meth:`HFSampler.continue_responses` continues: each row's response so far, and when to stop."""

    prefix: list[list[int]]
    until: Callable[[Tensor], bool] | None = None


class _Call(NamedTuple):
    """The settings of one :meth:`HFSampler.sample` call (its keyword arguments)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    stop: list[str]
    on_stop: OnStop | None
    seed: int | list[int]
    score: ScoreRequest | None
    prefix: list[list[int]] | None = None  #: per row, the response so far (partial rollouts)


class _Decoding:
    """One :meth:`HFSampler.sample` call: the prompts' prefill (at construction), then per step the environment's
    turn (:meth:`environment_turn`), a token for every sampling row (:meth:`token_step`) and the cache's new column
    (:meth:`extend_cache`); :meth:`result` packs the rows. The columns grow as lists of (N, W) blocks: ids,
    attention, loss mask, pi_old's log-probs and, as asked, its top-k and entropy."""

    def __init__(self, sampler: HFSampler, model, prompts, n: int, call: _Call):
        self.s, self.model = sampler, model
        self.temperature, self.top_p, self.max_new_tokens = call.temperature, call.top_p, call.max_new_tokens
        self.stop, self.on_stop, self.score = call.stop, call.on_stop, call.score
        score, seed = call.score, call.seed
        self.topk, self.entropy = (score.topk, score.entropy) if score is not None else (0, False)
        tok = self.tok = sampler.tok
        dev = self.dev = next(model.parameters()).device
        self.eos = tok.eos_token_id
        pad = self.pad = pad_id(tok)
        self.rows = rows = [i for i in range(len(prompts)) for _ in range(n)]
        p_ids = prompt_ids(tok, prompts)
        before = call.prefix or [[] for _ in rows]  # each row's response so far (partial rollouts)
        if len(before) != len(rows):
            raise ValueError(f"{len(before)} prefixes for {len(rows)} rows: give one per row (prompt r // n)")
        heads = [p_ids[i] + [int(t) for t in before[r]] for r, i in enumerate(rows)]
        #: a row whose prefix has ended (EOS, or max_new_tokens) only waits: it is not prefilled, and its prompt columns
        #: are cut to the width of the rows that go on
        going = [not (b and (int(b[-1]) == self.eos or len(b) >= self.max_new_tokens)) for b in before]
        N, P = self.N, self.P = len(rows), max((len(h) for h, g in zip(heads, going) if g),
                                               default=max(len(h) for h in heads))
        heads = [h[len(h) - P:] if len(h) > P else h for h in heads]
        ids = torch.full((N, P), pad, dtype=torch.long)
        am = torch.zeros((N, P), dtype=torch.long)
        for r, h in enumerate(heads):  # left-padded
            if h:
                ids[r, P - len(h):], am[r, P - len(h):] = torch.tensor(h), 1
        self.ids, self.am = ids, am = ids.to(dev), am.to(dev)
        self.uniforms = RowUniforms([torch.Generator(device=dev).manual_seed(s) for s in prompt_seeds(seed, len(prompts))],
                                    n, dev)
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        kv = self.kv = cache_kwarg(model)
        auto = dev.type == "cuda"  # (a LoRA policy's sampler is built with static_cache=False: build_sampler)
        self.static = (auto if sampler.static_cache is None else sampler.static_cache) and not self.stop \
            and sampler.lockstep is None and full_attention_layers(model) is not None
        if self.static:  # the mask of every column the cache holds, filled as columns are written
            cols = static_columns(P + self.max_new_tokens)
            self.cache, self.decode = sampler._static_for(model, (N, cols, torch.is_autocast_enabled(dev.type)), dev)
            self.mask_buf = torch.zeros((N, cols), dtype=am.dtype, device=dev)
            self.mask_buf[:, :P] = am
            out = model(input_ids=ids, attention_mask=self.mask_buf, position_ids=pos, use_cache=True, **{kv: self.cache})
        else:
            self.cache = new_cache(model)
            if call.prefix is not None and any(going) and sampler.lockstep is None and \
                    all(isinstance(layer, GrowingLayer) for layer in self.cache.layers):
                out = self._prefill_going(torch.tensor([r for r in range(N) if going[r]], device=dev), pos)
            else:
                out = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True, **{kv: self.cache})
        #: observations go through the model for the rows that have one, once per distinct history (a GrowingLayer
        #: cache; ZeRO-3's lockstep runs every rank's forwards alike, so there the whole block goes)
        self.by_rows = not self.static and sampler.lockstep is None and \
            all(isinstance(layer, GrowingLayer) for layer in self.cache.layers)
        self.slots = Slots(N, self.cache.layers if self.by_rows else [])  # each row's place in the cache
        self.next_logits = out.logits[:, -1].float()  # (N, V)
        self.cols_ids, self.cols_am, self.cols_lm, self.cols_lp = [], [], [], []
        self.cols_ti, self.cols_tl, self.cols_en = [], [], []
        self.active = torch.tensor(going, dtype=torch.bool, device=dev)
        self.waiting = torch.zeros(N, dtype=torch.bool, device=dev)  # at a stop string, for the environment's turn
        self.truncated = torch.zeros(N, dtype=torch.bool, device=dev)  # (N,) ran out of policy tokens
        self.n_before = torch.tensor([len(b) for b in before], dtype=torch.long, device=dev)
        self.n_policy = self.n_before.clone()  # policy tokens so far: the prefix's count on
        self.resp_ids: list[list[int]] = [[int(t) for t in b] for b in before]
        self.turn_start = [0] * N  # where each row's current turn begins in resp_ids
        self.last_pos = pos[:, -1].clone()

    # ------------------------------------------------------------------ the cache's forwards
    def _prefill_going(self, act: Tensor, pos: Tensor):
        """Continuing responses: the prefill of rows ``act`` alone (the others' prefixes have ended: they only wait), into
        the whole batch's cache; returns an output whose last logits are those rows' (zeros for the others, never sampled from).

        The rows go in buckets of similar length (their heads' lengths rounded up to a power of two), each over its own
        last columns: a continued response's long prefix does not pad a new prompt's short one. The columns a bucket
        leaves out, and the rows that wait, are zeros in the cache, where the masks never attend."""
        P, am = self.P, self.am
        lengths = am.sum(-1)
        width = {r: min(P, 1 << max(int(lengths[r]) - 1, 0).bit_length()) for r in act.tolist()}
        keys = values = logits = None
        for w in sorted(set(width.values())):
            rows = torch.tensor([r for r, x in width.items() if x == w], device=act.device)
            sub = new_cache(self.model)
            o = self.model(input_ids=self.ids[rows, P - w:], attention_mask=am[rows, P - w:],
                           position_ids=pos[rows, P - w:], use_cache=True, **{self.kv: sub})
            if keys is None:
                k0, v0 = sub.layers[0].keys, sub.layers[0].values
                keys = [k0.new_zeros(self.N, k0.shape[1], P, k0.shape[-1]) for _ in sub.layers]
                values = [v0.new_zeros(self.N, v0.shape[1], P, v0.shape[-1]) for _ in sub.layers]
                logits = o.logits.new_zeros(self.N, 1, o.logits.shape[-1])
            for i, part in enumerate(sub.layers):
                keys[i][rows, :, P - w:] = part.keys
                values[i][rows, :, P - w:] = part.values
            logits[rows] = o.logits[:, -1:]
        for layer, k, v in zip(self.cache.layers, keys, values):
            layer.update(k, v)
        return type(o)(logits=logits)

    def _positions(self, block_am: Tensor) -> Tensor:
        """A block's position ids: they continue past real tokens only."""
        bpos = self.last_pos[:, None] + block_am.cumsum(-1)
        return torch.where(block_am.bool(), bpos, self.last_pos[:, None].clamp(min=0))

    def _attention(self) -> Tensor:
        return torch.cat([self.am] + self.cols_am, 1)  # (N, L) including the newest block

    def feed(self, block: Tensor, block_am: Tensor) -> None:
        """Run a (N, W) block through the model; refresh next_logits of rows whose last column is real."""
        bpos = self._positions(block_am)
        if self.static:  # one column: written into the mask buffer; same shapes at every step
            self.mask_buf[:, self.P + len(self.cols_am) - 1] = block_am[:, 0]
            with torch.compiler.set_stance("default"):  # the decode step's own graph (CUDA), compiled on purpose
                o = self.decode(input_ids=block, attention_mask=self.mask_buf, position_ids=bpos, use_cache=True,
                                **{self.kv: self.cache})
        else:
            o = self.model(input_ids=block, attention_mask=self._attention(), position_ids=bpos, use_cache=True,
                           **{self.kv: self.cache})
        real_last = block_am[:, -1].bool()
        self.next_logits = torch.where(real_last[:, None], o.logits[:, -1].float(), self.next_logits)
        self.last_pos = self.last_pos + block_am.sum(-1)

    def feed_rows(self, block: Tensor, block_am: Tensor, rows: list[int]) -> None:
        """Run an (N, W) observation block through the model for ``rows`` only (the rows with an observation; of
        rows whose history and observation are the same token for token, one), every row's cache extended alike:
        no compute on the rows that wait or have ended, nor twice on one history."""
        dev, cache, slots = self.dev, self.cache, self.slots
        n0 = cache.layers[0].n
        full_am = self._attention()
        hist = torch.cat([torch.cat([self.ids] + self.cols_ids, 1) * full_am, full_am], 1)
        R = torch.tensor(rows, device=dev)
        _, inv = torch.unique(hist[R], dim=0, return_inverse=True)  # (|R|,) which distinct history each row has
        first = torch.full((int(inv.max()) + 1,), len(rows), device=dev).scatter_reduce(
            0, inv, torch.arange(len(rows), device=dev), "amin")  # the first row of each distinct history
        sub, rep = R[first], R[first[inv]]  # the rows computed; each row's representative
        bpos = self._positions(block_am)
        at = torch.tensor([slots.slot[r] for r in sub.tolist()], device=dev)  # their rows of the cache
        view = Cache(layers=[RowsLayer(layer, at) for layer in cache.layers])
        o = self.model(input_ids=block[sub], attention_mask=full_am[sub], position_ids=bpos[sub], use_cache=True,
                       **{self.kv: view})
        logits = self.next_logits.clone()
        logits[sub] = torch.where(block_am[sub, -1].bool()[:, None], o.logits[:, -1].float(), self.next_logits[sub])
        copies = R[rep != R]
        if len(copies):  # the same history and observation: the same new columns and next-token logits
            dst = torch.tensor([slots.slot[r] for r in copies.tolist()], device=dev)
            src = torch.tensor([slots.slot[r] for r in rep[rep != R].tolist()], device=dev)
            W = block.shape[1]
            for layer in cache.layers:
                layer.kbuf[dst, :, n0 : n0 + W] = layer.kbuf[src, :, n0 : n0 + W]
                layer.vbuf[dst, :, n0 : n0 + W] = layer.vbuf[src, :, n0 : n0 + W]
            logits[copies] = logits[rep[rep != R]]
        self.next_logits = logits
        self.last_pos = self.last_pos + block_am.sum(-1)

    def feed_front(self, tokens: Tensor, a: Tensor, rows: list[int]) -> None:
        """A decode step for ``rows`` only (the rows that sampled and go on), moved to the front of the cache; the
        other rows' new column is empty (masked), as feeding every row with a mask of 0 made it."""
        self.slots.to_front(rows)
        order = torch.tensor(self.slots.rows(len(rows)), device=self.dev)
        bpos = (self.last_pos + a)[order][:, None]
        view = Cache(layers=[FrontLayer(layer, len(rows)) for layer in self.cache.layers])
        o = self.model(input_ids=tokens[order][:, None], attention_mask=self._attention()[order], position_ids=bpos,
                       use_cache=True, **{self.kv: view})
        logits = self.next_logits.clone()
        logits[order] = o.logits[:, -1].float()
        self.next_logits = logits
        self.last_pos = self.last_pos + a

    def add_columns(self, block: Tensor, block_am: Tensor) -> None:
        """Observation columns: attended, loss mask 0, no scores."""
        N, W, dev = self.N, block.shape[1], self.dev
        self.cols_ids.append(block)
        self.cols_am.append(block_am)
        self.cols_lm.append(torch.zeros_like(block_am))
        self.cols_lp.append(torch.zeros((N, W), device=dev))
        if self.cols_ti:
            self.cols_ti.append(torch.zeros((N, W, self.topk), dtype=torch.long, device=dev))
            self.cols_tl.append(torch.zeros((N, W, self.topk), device=dev))
        if self.cols_en:
            self.cols_en.append(torch.zeros((N, W), device=dev))

    # ------------------------------------------------------------------ the phases of a step
    def environment_turn(self) -> None:
        """Once no row is mid-turn, every waiting row is answered in one call; the observations go through the
        cache (loss mask 0) and each answered row starts a new turn."""
        tok, waiting, active = self.tok, self.waiting, self.active
        observations: dict[int, str] = {}
        if bool(waiting.any()) and not bool((active & ~waiting).any()):
            wrows = waiting.nonzero().flatten().tolist()
            turns = [tok.decode(self.resp_ids[r][self.turn_start[r]:], skip_special_tokens=False) for r in wrows]
            answers = self.on_stop(wrows, turns) if self.on_stop else [None] * len(wrows)
            if len(answers) != len(wrows):
                raise ValueError(f"on_stop answered {len(answers)} observations for {len(wrows)} rows")
            counts = self.n_policy.tolist()
            for r, obs in zip(wrows, answers):
                waiting[r] = False
                if obs is None:
                    active[r] = False
                elif counts[r] >= self.max_new_tokens:  # no policy tokens left to read it with
                    active[r], self.truncated[r] = False, True
                else:
                    observations[r] = obs
        enc_obs = {r: tok(o, add_special_tokens=False)["input_ids"][: self.s.max_obs_tokens]
                   for r, o in observations.items()}
        W = self.s._max(max((len(v) for v in enc_obs.values()), default=0))
        if W > 0:  # an empty observation just lets the row continue
            block = torch.full((self.N, W), self.pad, dtype=torch.long, device=self.dev)
            block_am = torch.zeros((self.N, W), dtype=torch.long, device=self.dev)
            for r, v in enc_obs.items():  # left-pad inside the block: each row's last column is real
                if v:
                    block[r, W - len(v):] = torch.tensor(v, device=self.dev)
                    block_am[r, W - len(v):] = 1
            self.add_columns(block, block_am)
            if self.by_rows:
                self.feed_rows(block, block_am, sorted(r for r, v in enc_obs.items() if v))
            else:
                self.feed(block, block_am)
        for r, v in enc_obs.items():
            self.resp_ids[r].extend(v)
            self.turn_start[r] = len(self.resp_ids[r])

    def token_step(self) -> tuple[Tensor, Tensor, Tensor]:
        """A token for every row that samples (active, not waiting), its pi_old scores as asked, and each row's
        end: EOS, a stop string (then it waits) or the token budget. (next tokens, 1 where sampled, the rows
        that sampled)."""
        temperature, topk = self.temperature, self.topk
        sampling = self.active & ~self.waiting
        logp_all = torch.log_softmax(self.next_logits / temperature, -1) if temperature > 0 and self.score else None
        u = self.uniforms(torch.where(sampling, self.n_policy, 0)) if temperature > 0 else None
        nxt = sample_token(self.next_logits, temperature, self.top_p, u=u)
        nxt = torch.where(sampling, nxt, torch.full_like(nxt, self.pad))
        a = sampling.long()
        self.cols_ids.append(nxt[:, None])
        self.cols_am.append(a[:, None])
        self.cols_lm.append(a[:, None])
        self.cols_lp.append(logp_all.gather(-1, nxt[:, None]) * a[:, None] if logp_all is not None
                            else torch.zeros_like(nxt[:, None], dtype=torch.float))
        if topk and logp_all is not None:
            v, i = logp_all.topk(topk, -1)  # (N, k)
            self.cols_ti.append(i[:, None])
            self.cols_tl.append(v[:, None])
        if self.entropy and logp_all is not None:
            self.cols_en.append(-(logp_all.exp() * logp_all).sum(-1, keepdim=True))
        self.n_policy += a
        toks, counts = nxt.tolist(), self.n_policy.tolist()
        for r in sampling.nonzero().flatten().tolist():
            t = toks[r]
            self.resp_ids[r].append(t)
            if t == self.eos:
                self.active[r] = False
                continue
            if self.stop:
                tail = self.tok.decode(self.resp_ids[r][max(self.turn_start[r], len(self.resp_ids[r]) - 16):],
                                       skip_special_tokens=False)
                if any(tail.endswith(s) for s in self.stop):
                    self.waiting[r] = True  # the environment answers it with the others, at the end of the turn
                    continue
            if counts[r] >= self.max_new_tokens:
                self.active[r] = False
                self.truncated[r] = True  # it wanted to go on: no EOS, not ended by the environment
        return nxt, a, sampling

    def extend_cache(self, nxt: Tensor, a: Tensor, sampling: Tensor) -> None:
        """The step's column into the cache: the rows that go on, moved to the front (by rows), or the whole column."""
        if not self.by_rows:
            self.feed(nxt[:, None], a[:, None])
            return
        go_on = (sampling & self.active).nonzero().flatten().tolist()
        if go_on:  # the rows that go on, at the front of the cache (which is in slot order from now on)
            self.feed_front(nxt, a, go_on)
        else:  # nobody goes on from this step's token (the others wait): an empty column keeps the count
            for layer in self.cache.layers:
                z = layer.kbuf.new_zeros(self.N, layer.kbuf.shape[1], 1, layer.kbuf.shape[-1])
                layer.update(z, torch.zeros_like(z, dtype=layer.vbuf.dtype))

    def result(self) -> Rollouts:
        """Each row's real response tokens packed to the left. Holes (columns where a row had nothing: other rows'
        observations, finished rows) are masked and do not advance positions, so scoring the packed batch is
        exactly scoring what was sampled, without the holes' cost."""
        keep = torch.cat(self.cols_am, 1).bool()  # (N, T_full)
        T = int(keep.sum(1).max())
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :T]  # real columns first
        real = torch.arange(T, device=self.dev)[None, :] < keep.sum(1, keepdim=True)  # (N, T)

        def pack(cols, fill=0):
            x = torch.cat(cols, 1)
            idx = order if x.dim() == 2 else order[..., None].expand(-1, -1, x.shape[-1])
            y = x.gather(1, idx)
            return torch.where(real if y.dim() == 2 else real[..., None], y, torch.full_like(y, fill))

        score = self.score is not None and self.temperature > 0
        return Rollouts(
            input_ids=torch.cat([self.ids, pack(self.cols_ids, self.pad)], 1),
            attention_mask=torch.cat([self.am, real.long()], 1),
            loss_mask=torch.cat([torch.zeros_like(self.am), pack(self.cols_lm)], 1),
            prompt_len=self.P,
            prompt_index=self.rows,
            responses=[self.tok.decode([t for t in r if t != self.eos], skip_special_tokens=True) for r in self.resp_ids],
            old=None if not score else TokenScores(
                logp=pack(self.cols_lp), index=pack(self.cols_ti) if self.cols_ti else None,
                index_logp=pack(self.cols_tl) if self.cols_tl else None,
                entropy=pack(self.cols_en) if self.cols_en else None),
            truncated=self.truncated,
        )

