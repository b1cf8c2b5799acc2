"""Chunked log-prob / top-k / logsumexp head: O(k) memory per token, never O(V) per token.

From final hidden states h (N, H) and the output embedding W (V, H), logits z = h W^T / tau
are formed C tokens at a time. Per token it returns log pi(y_n), logsumexp, the top-k
indices (int32) and log-probs, log-probs at given indices, and the entropy. The only
per-token state kept is O(k); the only (., V) tensor alive is one chunk of C x V logits.

The gradient path (:class:`ChunkedLogProb`) is a custom autograd function whose forward
saves h, W, the indices and the logsumexp (O(N k)), and whose backward recomputes each
chunk's logits: with g_t the incoming gradient of log pi(y_n) and g_i those of log pi at the
index set,

    d z_n = (e_{y_n} g_t + sum_i e_{q_i} g_i - (g_t + sum_i g_i) softmax(z_n)) / tau
    dh    = dz W,   dW = dz^T h                                  (chunk by chunk)

and with g_H the incoming gradient of the entropy H_n (the entropy bonus, when asked for)

    d z_n += -g_H softmax(z_n) (log softmax(z_n) + H_n) / tau

so neither the forward nor the backward ever holds an (N, V) tensor.

Final-logit soft-capping (Gemma 2 and 3, ``softcap`` = c > 0) makes the logits z = c tanh(h W^T / c) / tau;
the backward multiplies d z by its derivative, 1 - tanh(h W^T / c)^2, recomputed with the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def acc_dtype(h: Tensor) -> torch.dtype:
    """Logits are formed in float32 for half-precision inputs, else in the input's dtype."""
    return torch.float32 if h.dtype in (torch.float16, torch.bfloat16) else h.dtype


#: a chunk's memory budget in MiB by device type, when ``model.head_chunk_mb`` is null. On a GPU 256 MiB gives
#: 147-token chunks at V = 151,936, too few rows to fill it: the no-grad passes took 1.65x the materialized head on
#: an H200, 1.14x with 2048-token chunks (benchmarks/results/kl_head_h200.json); 4096 MiB gives 2355 tokens there,
#: and the anchor pass 1.14x, the policy pass 1.42x (kl_head_h200_fixed.json).
CHUNK_MB = {"cpu": 256.0, "cuda": 4096.0}


def chunk_budget_mb(configured: float | None, device_type: str) -> float:
    """``model.head_chunk_mb`` as set, or the device's default (:data:`CHUNK_MB`; a CPU's for other devices)."""
    return configured if configured is not None else CHUNK_MB.get(device_type, CHUNK_MB["cpu"])


def auto_chunk(n_tokens: int, vocab: int, budget_mb: float = CHUNK_MB["cpu"], bytes_per: int = 4, copies: int = 3) -> int:
    """Tokens per chunk so that ``copies`` (C, V) float buffers fit in ``budget_mb``."""
    c = int(budget_mb * 2**20 // (vocab * bytes_per * copies))
    return max(1, min(n_tokens, c))


@dataclass
class HeadChunk:
    """Tokens per chunk of the log-prob head as the trainer sizes it: ``model.head_chunk_tokens`` if set (``fixed``),
    else by the memory budget (:func:`chunk_budget_mb`); picklable, for the rollout worker."""

    fixed: int
    vocab: int
    budget_mb: float

    def __call__(self, n_tokens: int) -> int:
        return self.fixed or auto_chunk(n_tokens, self.vocab, self.budget_mb)


@dataclass
class ChunkedOut:
    logp: Tensor  # (N,) log pi(y_n)
    lse: Tensor  # (N,) logsumexp of z_n
    topk_idx: Tensor | None = None  # (N, k) int32
    topk_logp: Tensor | None = None  # (N, k)
    index_logp: Tensor | None = None  # (N, k')
    entropy: Tensor | None = None  # (N,)


@torch.no_grad()
def logits_chunk(h: Tensor, W: Tensor, f32: torch.dtype, temperature: float, softcap: float) -> Tensor:
    """(C, V) logits of a chunk: h W^T, soft-capped (c tanh(. / c)) when ``softcap`` > 0, over the temperature."""
    z = (h @ W.T).to(f32)
    if softcap:
        z = z.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def chunked_head_nograd(h: Tensor, W: Tensor, targets: Tensor, *, k: int = 0, index: Tensor | None = None,
                        entropy: bool = False, temperature: float = 1.0, chunk: int = 0, softcap: float = 0.0) -> ChunkedOut:
    """No-grad pass (pi_old, the anchor): O(N k) outputs, one (C, V) chunk at a time."""
    N, V = h.shape[0], W.shape[0]
    C = chunk or auto_chunk(N, V)
    f32 = acc_dtype(h)
    logp = torch.empty(N, dtype=f32, device=h.device)
    lse = torch.empty(N, dtype=f32, device=h.device)
    tk_i = torch.empty(N, k, dtype=torch.int32, device=h.device) if k else None
    tk_l = torch.empty(N, k, dtype=f32, device=h.device) if k else None
    ix_l = torch.empty(N, index.shape[-1], dtype=f32, device=h.device) if index is not None else None
    ent = torch.empty(N, dtype=f32, device=h.device) if entropy else None
    for s in range(0, N, C):
        e = min(N, s + C)
        z = logits_chunk(h[s:e], W, f32, temperature, softcap)  # (C, V)
        lz = torch.logsumexp(z, -1)  # (C,)
        lse[s:e] = lz
        logp[s:e] = z.gather(-1, targets[s:e, None].long())[:, 0] - lz
        if k:
            v, i = z.topk(k, -1)  # (C, k)
            tk_i[s:e], tk_l[s:e] = i.to(torch.int32), v - lz[:, None]
        if index is not None:
            ix_l[s:e] = z.gather(-1, index[s:e].long()) - lz[:, None]
        if entropy:
            z.sub_(lz[:, None])  # log p in place
            ent[s:e] = -(z.exp() * z).sum(-1)
    return ChunkedOut(logp=logp, lse=lse, topk_idx=tk_i, topk_logp=tk_l, index_logp=ix_l, entropy=ent)


class ChunkedLogProb(torch.autograd.Function):
    """(log pi(y_n), log pi at index, entropy) with a chunk-recomputing backward. Inputs: h (N, H), W (V, H).

    The index and entropy outputs are empty tensors when not asked for."""

    @staticmethod
    def forward(ctx, h: Tensor, W: Tensor, targets: Tensor, index: Tensor | None, temperature: float, chunk: int,
                entropy: bool = False, softcap: float = 0.0):
        out = chunked_head_nograd(h, W, targets, index=index, entropy=entropy, temperature=temperature, chunk=chunk,
                                  softcap=softcap)
        ent = out.entropy if entropy else torch.empty(0, device=h.device)
        ctx.save_for_backward(h, W, targets, out.lse, ent, *([index] if index is not None else []))
        ctx.has_index, ctx.temperature, ctx.chunk, ctx.softcap = index is not None, temperature, chunk, softcap
        ix = out.index_logp if index is not None else torch.empty(0, device=h.device)
        return out.logp, ix, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor, g_index: Tensor, g_ent: Tensor):
        if ctx.has_index:
            h, W, targets, lse, ent, index = ctx.saved_tensors
        else:
            (h, W, targets, lse, ent), index = ctx.saved_tensors, None
        use_ent = g_ent is not None and ent.numel() > 0
        N, V = h.shape[0], W.shape[0]
        C = ctx.chunk or auto_chunk(N, V)
        tau = ctx.temperature
        need_h, need_W = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.zeros_like(h) if need_h else None
        acc = acc_dtype(h)
        gW = torch.zeros(W.shape, dtype=acc, device=W.device) if need_W else None
        g_logp = g_logp.to(acc) if g_logp is not None else torch.zeros(N, dtype=acc, device=h.device)
        for s in range(0, N, C):
            e = min(N, s + C)
            z = logits_chunk(h[s:e], W, acc, tau, ctx.softcap)  # (C, V), recomputed
            dcap = 1 - (z * (tau / ctx.softcap)).square() if ctx.softcap else None  # 1 - tanh^2: the cap's slope
            lp = z.sub_(lse[s:e, None])  # log softmax, in place
            ent_term = None
            if use_ent:  # -g_H p (log p + H), formed before lp becomes p
                ge = g_ent[s:e].to(acc)
                ent_term = (lp + ent[s:e, None].to(acc)).mul_(lp.exp()).mul_(-ge[:, None])  # (C, V)
            p = lp.exp_()  # softmax, in place: one (C, V) buffer
            gt = g_logp[s:e]  # (C,)
            total = gt.clone()
            if index is not None and g_index is not None and g_index.numel():
                gi = g_index[s:e].to(acc)  # (C, k)
                total += gi.sum(-1)
            dz = p.mul_(-total[:, None])  # -(g_t + sum g_i) softmax
            if ent_term is not None:
                dz.add_(ent_term)
            dz.scatter_add_(-1, targets[s:e, None].long(), gt[:, None])
            if index is not None and g_index is not None and g_index.numel():
                dz.scatter_add_(-1, index[s:e].long(), gi)
            if tau != 1.0:
                dz.div_(tau)
            if dcap is not None:
                dz.mul_(dcap)
            dz = dz.to(h.dtype)
            if need_h:
                torch.mm(dz, W, out=gh[s:e])  # (C, H), written in place
            if need_W:
                if dz.dtype == acc:
                    gW.addmm_(dz.T, h[s:e])  # (V, H) accumulated in place: no per-chunk temporary
                else:  # half precision: the product on the half-precision units (float32 sums inside the GEMM), then
                    # added to the float32 total. A float32 GEMM here was 70% of the policy pass on an H200 (3.7x
                    # the materialized head at V = 151,936, benchmarks/results/kl_head_h200.json)
                    gW.add_(torch.mm(dz.T, h[s:e]))
        return gh, (gW.to(W.dtype) if need_W else None), None, None, None, None, None, None


def chunked_logprobs(h: Tensor, W: Tensor, targets: Tensor, index: Tensor | None = None, temperature: float = 1.0,
                     chunk: int = 0, entropy: bool = False, softcap: float = 0.0):
    """Differentiable (log pi(y_n) (N,), log pi at index (N, k) or None) with O(N k) saved state;
    with ``entropy=True`` a third output, the differentiable entropy (N,)."""
    logp, ix, ent = ChunkedLogProb.apply(h, W, targets, index, temperature, chunk, entropy, softcap)
    if entropy:
        return logp, (ix if index is not None else None), ent
    return logp, (ix if index is not None else None)
