"""Padding-free passes: a batch's real tokens as one sequence, each distinct prefix once.

A :class:`Rollouts` batch is a padded (N, L) grid: left-padded prompts, right-padded responses, rows of very
different lengths (a multi-turn search row holds one observation or three). A padded pass computes every
cell. :func:`pack` lays out only the real tokens, as nodes of one sequence of S tokens:

- **padding-free**: each row's real tokens once, in order, with its own positions (0, 1, 2, ... restarting
  per row), and attention that never crosses rows;
- **shared prefixes** (``share_prefixes=True``): rows whose token sequences begin alike (the G samples of one
  prompt share the prompt, and often their first search and its observation) share those nodes. A causal
  decoder's state at a token is a function of the tokens up to it and their positions only, so a shared node
  is the same computation as each row's copy; its gradient is the sum of what the rows that read it send
  back, as the copies' gradients sum to it in the padded pass. The nodes are the prefix tree of the rows'
  sequences (rows sorted, each adding the tokens past its longest common prefix with the row before it).

Attention on packed nodes (:func:`packed_attention`, the attention implementation :data:`PACKED` of
transformers' ``AttentionInterface``) gathers each row's queries, keys and values back into a right-padded
(N, heads, L, dim) layout, runs causal attention row by row (one batched kernel: a row's padding comes after
its last token, so causality alone keeps it unseen) and takes each node's output from the row that created it.
The projections, the MLPs and the norms run on the S nodes only; attention, the cheap part at these lengths,
is computed per row (a shared node's attention once per row that holds it). Sliding-window layers and
attention-logit soft-capping are applied in the row layout, exactly.

Only the positions the loss reads are scored (:attr:`Packing.rows`, :attr:`Packing.cols`): the policy tokens
(loss mask 1). A head over the packed pass returns (N, T) scores that are 0 at every other response column,
where the padded pass's values were multiplied by a loss mask of 0 anyway.

Equal to the padded pass to float rounding (the same products, summed in another layout): per-token
log-probs, top-k values, loss and gradient, tested across the model matrix (``tests/algorithm/test_packing.py``).
Models whose attention is not transformers' attention interface, or that keep state across positions other
than attention, cannot pack: :func:`pack_problem` names them.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from transformers import AttentionInterface

PACKED = "ema_pg_packed"  #: the attention implementation a packed pass runs under (not a mask function's name:
# transformers then builds no (S, S) mask for it)
PACK_KWARG = "ema_pg_pack"  #: the keyword that carries the :class:`Packing` through the model to its attention


@dataclass
class Packing:
    """One batch's real tokens as S packed nodes, and where the loss reads them."""

    input_ids: Tensor  # (1, S) the nodes' tokens
    position_ids: Tensor  # (1, S) each node's position in its rows (its depth in the prefix tree)
    gather: Tensor  # (N, L) the node at each row position (0 past the row's length)
    #: rows of similar length, attended together: each bucket's (n_b, L_b) nodes at its rows' positions, L_b its
    #: longest row (a row's attention costs its bucket's L_b^2, not the batch's L^2)
    buckets: list[Tensor]
    rep: Tensor  # (S,) where each node's attention output is read: its creating row position in the buckets' outputs
    rows: Tensor  # (M,) the scored positions: row ...
    cols: Tensor  # (M,) ... and response column (a policy token)
    predictors: Tensor  # (M,) the node whose state predicts each scored token (the row's previous token)
    targets: Tensor  # (M,) the scored tokens
    shape: tuple[int, int]  # (N, T): the response grid the scores are scattered back to
    padded_tokens: int  # N x L of the padded pass (prompt and response columns)

    @property
    def tokens(self) -> int:
        """S, the tokens a packed pass computes."""
        return int(self.input_ids.shape[1])

    def take(self, x: Tensor) -> Tensor:
        """(M, ...) from an (N, T, ...) response tensor at the scored positions."""
        return x[self.rows, self.cols]

    def put(self, x: Tensor) -> Tensor:
        """(N, T, ...) from (M, ...) scores: zero at every position not scored."""
        out = x.new_zeros(*self.shape, *x.shape[1:])
        return out.index_put((self.rows, self.cols), x)


def pack(batch, share_prefixes: bool = True) -> Packing:
    """The :class:`Packing` of a :class:`~ema_pg.rollout.base.Rollouts` batch. A row's tokens are its columns with
    attention mask 1, in order (its positions are their count, as the padded pass's position ids are)."""
    am = batch.attention_mask.bool()  # (N, C)
    dev = am.device
    N, C = am.shape
    lens = am.sum(1)  # (N,)
    L = int(lens.max())
    col_of = torch.sort((~am).to(torch.int8), dim=1, stable=True).indices[:, :L]  # (N, L) a row's real columns in order
    t_idx = torch.arange(L, device=dev)
    valid = t_idx[None, :] < lens[:, None]  # (N, L)
    toks = torch.where(valid, batch.input_ids.gather(1, col_of), torch.full_like(col_of, -1))  # (N, L)
    if share_prefixes and N > 1:
        order = torch.as_tensor(np.lexsort(toks.cpu().numpy().T[::-1]), device=dev)  # rows in lexicographic order
        s = toks[order]
        same = (s[1:] == s[:-1]) & valid[order][1:]  # (N-1, L)
        lcp = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), same.long().cumprod(1).sum(1)])  # (N,)
    else:
        order = torch.arange(N, device=dev)
        lcp = torch.zeros(N, dtype=torch.long, device=dev)
    slen = lens[order]
    new = slen - lcp  # nodes each sorted row adds
    offset = torch.cumsum(new, 0) - new  # (N,) its first node's id
    # the row (in sorted order) that created the node at (row i, position t): the last row up to i whose common
    # prefix with its predecessor ends at or before t
    cand = torch.where(lcp[:, None] <= t_idx[None, :], torch.arange(N, device=dev)[:, None], -1)  # (N, L)
    owner = torch.cummax(cand, 0).values
    node_sorted = offset[owner] + t_idx[None, :] - lcp[owner]  # (N, L)
    gather = torch.empty_like(node_sorted)
    gather[order] = node_sorted
    gather = torch.where(valid, gather, torch.zeros_like(gather))
    S = int(new.sum())
    created = valid & (t_idx[None, :] >= lcp[torch.argsort(order)][:, None])  # the positions where a row adds a node
    r_c, t_c = created.nonzero(as_tuple=True)
    buckets, where = [], torch.empty(N, dtype=torch.long, device=dev)  # where: a row's first position in the outputs
    start = 0
    for rows_b in length_buckets(lens):
        Lb = int(lens[rows_b].max())
        buckets.append(gather[rows_b, :Lb])
        where[rows_b] = start + torch.arange(len(rows_b), device=dev) * Lb
        start += len(rows_b) * Lb
    rep = torch.empty(S, dtype=torch.long, device=dev)
    rep[gather[r_c, t_c]] = where[r_c] + t_c
    ids = torch.empty(S, dtype=batch.input_ids.dtype, device=dev)
    ids[gather[r_c, t_c]] = toks[r_c, t_c]
    pos = torch.empty(S, dtype=torch.long, device=dev)
    pos[gather[r_c, t_c]] = t_c
    # the scored tokens: response columns with loss mask 1, each predicted by its row's previous token
    P = batch.prompt_len
    scored = valid & (batch.loss_mask.gather(1, col_of) > 0) & (col_of >= P)  # (N, L)
    rows, ts = scored.nonzero(as_tuple=True)
    if bool((ts == 0).any()):
        raise ValueError("a scored token is its row's first: nothing before it predicts it (an empty prompt)")
    return Packing(input_ids=ids[None], position_ids=pos[None], gather=gather, buckets=buckets, rep=rep, rows=rows,
                   cols=col_of[rows, ts] - P, predictors=gather[rows, ts - 1], targets=toks[rows, ts],
                   shape=(N, C - P), padded_tokens=N * C)


def has_dropout(model) -> bool:
    """Whether ``model`` drops activations at random in training (then rows sharing a prefix would share its mask)."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) or \
        bool(getattr(model.config, "attention_dropout", 0) or 0)


#: what one more attention call costs, in the units of a bucket's cost (rows x length^2): a 64-token row's attention
BUCKET_COST = 64 * 64


def length_buckets(lens: Tensor, most: int = 4) -> list[Tensor]:
    """Rows grouped by length (at most ``most`` groups, each a tensor of row indices): the grouping of the rows sorted
    by length that minimizes sum over groups of (rows x longest length^2), plus :data:`BUCKET_COST` per group (an
    exact dynamic program over the cut points)."""
    order = torch.argsort(lens, stable=True)
    x = lens[order].tolist()
    n = len(x)
    INF = float("inf")
    # best[k][j]: the cost of the first j sorted rows in k groups; cut[k][j]: where its last group starts
    best = [[0.0] + [INF] * n] + [[INF] * (n + 1) for _ in range(most)]
    cut = [[0] * (n + 1) for _ in range(most + 1)]
    for k in range(1, most + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                c = best[k - 1][i] + (j - i) * x[j - 1] ** 2 + BUCKET_COST
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    k = min(range(1, most + 1), key=lambda kk: best[kk][n])
    groups, j = [], n
    while k:
        i = cut[k][j]
        groups.append(order[i:j])
        j, k = i, k - 1
    return groups[::-1]


def pack_problem(model) -> str | None:
    """Why ``model`` cannot run a packed pass (one line), or None."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    name = type(model).__name__
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("sdpa", "eager", "ema_pg_sdpa", PACKED):
        return (f"{name} runs attention={impl!r}; the packed pass replaces sdpa or eager attention only: set "
                "algo.padding_free=false")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention", "sliding_attention"}:
        return (f"{name} has layers of kind {sorted(kinds - {'full_attention', 'sliding_attention'})} (state carried "
                "across positions besides attention); set algo.padding_free=false")
    return None


@contextmanager
def packed(model):
    """Run ``model`` under :data:`PACKED` attention inside the block (the implementation it had is restored)."""
    cfg = model.config
    before = cfg._attn_implementation
    if before == PACKED:
        yield
        return
    cfg._attn_implementation = PACKED
    try:
        yield
    finally:
        cfg._attn_implementation = before


def packed_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs) -> tuple[Tensor, None]:
    """transformers' attention signature on packed nodes: (1, Hq, S, D) query, (1, Hkv, S, D) key and value ->
    ((1, S, Hq, D), None); the :class:`Packing` comes as ``kwargs[PACK_KWARG]``."""
    p: Packing = kwargs[PACK_KWARG]
    outs = [_rows_attention(module, query, key, value, g, dropout, scaling, sliding_window, softcap) for g in p.buckets]
    out = torch.cat([o.transpose(1, 2).flatten(0, 1) for o in outs])  # (sum n_b L_b, Hq, D)
    return out[p.rep][None], None  # (1, S, Hq, D): each node from its creating row


@torch.library.custom_op("ema_pg::node_sums", mutates_args=())
def node_sums(grad: Tensor, index: Tensor, n: int) -> Tensor:
    """(n, ...): each node's sum of ``grad`` over the positions of ``index`` that read it, in reading order (the
    positions' flat order), accumulated in float32 at least. The gradient of ``x[index]``, summed in an order that
    does not depend on threads or processes: on the CPU ``index_add_`` adds the reads one after another; elsewhere
    (atomic adds) the reads are sorted by node, stably, and each node's run summed by a segmented reduction. An op
    of its own, so a compiled graph calls it as it is instead of turning it into a scatter of atomic adds. The CPU
    order is how torch implements ``index_add_``, not a documented promise: tests/algorithm/test_packing.py holds it to a loop
    over the reads, bit for bit, and to two processes on two threads giving the same gradient."""
    flat = index.reshape(-1)
    g = grad.reshape(flat.shape[0], -1)
    acc = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
    if g.device.type == "cpu":
        out = acc.new_zeros((n, acc.shape[1])).index_add_(0, flat, acc)
    else:
        node, read = torch.sort(flat, stable=True)
        runs = torch.searchsorted(node, torch.arange(n + 1, device=flat.device)).diff()  # reads per node
        out = torch.segment_reduce(acc[read], "sum", lengths=runs, axis=0)
    return out.to(g.dtype).reshape(n, *grad.shape[index.dim():])


@node_sums.register_fake
def _(grad: Tensor, index: Tensor, n: int) -> Tensor:
    return grad.new_empty((n, *grad.shape[index.dim():]))


class _Rows(torch.autograd.Function):
    """``x[index]`` whose backward sums the gradients of a node that several rows read (a shared prefix) in a fixed
    order (:func:`node_sums`). The default backward (``index_put_`` with accumulation) sums them on several CPU
    threads in an order that varies from one process to the next (a run on 2 threads did not repeat itself), and
    so does the atomic add a compiled scatter becomes."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.n = x.shape[0]
        return x[index]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return node_sums(grad, index, ctx.n), None


def _rows_attention(module, query, key, value, gather, dropout, scaling, sliding_window, softcap) -> Tensor:
    """Causal attention of the rows whose nodes ``gather`` (n, L) holds, right-padded: (n, Hq, L, D)."""
    L = gather.shape[1]
    Hq, Hkv = query.shape[1], key.shape[1]
    rows = lambda x: _Rows.apply(x[0].transpose(0, 1), gather).transpose(1, 2)  # (1, H, S, D) -> (n, H, L, D)
    q, k, v = rows(query), rows(key), rows(value)
    drop = dropout if module.training else 0.0
    window = sliding_window if sliding_window and sliding_window < L else None
    if softcap or window:  # the row layout's causal mask, banded for a sliding window; soft-capped logits by hand
        i = torch.arange(L, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if window:
            allowed &= i[None, :] > i[:, None] - window
        if Hq != Hkv:
            k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        scores = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed, float("-inf"))
        w = torch.softmax(scores, -1, dtype=torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)
        w = w.to(q.dtype)
        w = torch.nn.functional.dropout(w, p=drop, training=drop > 0)
        out = w @ v  # (N, Hq, L, D)
    else:
        gqa = {"enable_gqa": True} if Hq != Hkv else {}
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=drop, scale=scaling, is_causal=True,
                                                               **gqa)
    return out


AttentionInterface.register(PACKED, packed_attention)


def packed_states(body, p: Packing, owner=None) -> Tensor:
    """(M, H) final hidden states of a decoder ``body`` at the nodes that predict the scored tokens; ``owner``: the
    model whose config the body reads (default: the body's own)."""
    with packed(owner if owner is not None else body):
        out = body(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, **{PACK_KWARG: p})
    return _Rows.apply(out.last_hidden_state[0], p.predictors)  # a node predicts every row's next token after it


def packed_hidden(model, p: Packing) -> Tensor:
    """:func:`packed_states` of a causal LM's decoder body."""
    return packed_states(model.get_decoder(), p, owner=model)


def packer(algo, model):
    """The batch -> :class:`Packing` (or None: padded passes) function of ``algo.padding_free`` and
    ``algo.share_prefixes`` for ``model``: prefixes are shared only where that is exact, not for a model with dropout
    (whose update draws a mask per row), which packs its rows apart."""
    if not algo.padding_free:
        return lambda batch: None
    share = algo.share_prefixes and not has_dropout(model)
    return lambda batch: pack(batch, share)
