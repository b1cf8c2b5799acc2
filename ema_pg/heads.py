"""Log-prob heads: per-token log pi(y_n), top-k indices and log-probs, log-probs at given indices.

``head(model, rollouts, ...)`` runs the transformer body once, then the output layer through
the chunked head of :mod:`ema_pg.chunked`: O(k) memory per token in the no-grad passes
(pi_old, the anchor) and in the policy's gradient pass, whose backward recomputes each
chunk's logits. Only ``full_logits=True`` (the exact estimators) materializes the (N, T, V)
logits.

All log-probs are of the temperature-scaled distribution softmax(logits / temperature), the
distribution the sampler draws from (nucleus truncation aside). The output layer must be a
plain linear map without bias or logit soft-capping (Qwen2, Llama, Mistral, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .chunked import chunked_head_nograd, chunked_logprobs
from .rollout.base import Rollouts


@dataclass
class HeadOut:
    logp: Tensor  # (N, T) log pi(y_n)
    topk_idx: Tensor | None = None  # (N, T, k) this model's own top-k indices (int64)
    topk_logp: Tensor | None = None  # (N, T, k) log pi at topk_idx
    index_logp: Tensor | None = None  # (N, T, k') log pi at the given index set
    logits: Tensor | None = None  # (N, T, V) temperature-scaled logits (exact estimators only)
    entropy: Tensor | None = None  # (N, T)


def output_layer(model) -> Tensor:
    lm = model.get_output_embeddings()
    if getattr(lm, "bias", None) is not None or getattr(model.config, "final_logit_softcapping", None):
        raise NotImplementedError("the chunked head needs logits = hidden @ W^T (no bias, no soft-capping)")
    return lm.weight  # (V, H)


def response_hidden(model, batch: Rollouts) -> Tensor:
    """(N, T, H) final hidden states at the positions that predict the response tokens."""
    body = model.get_decoder()
    out = body(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    return out.last_hidden_state[:, batch.prompt_len - 1 : -1]


def response_logits(model, batch: Rollouts, temperature: float = 1.0) -> Tensor:
    """(N, T, V) materialized logits (exact estimators and tests only)."""
    logits = (response_hidden(model, batch) @ output_layer(model).T).float()
    return logits / temperature if temperature != 1.0 else logits


def head(model, batch: Rollouts, *, k: int = 0, index: Tensor | None = None, full_logits: bool = False,
         entropy: bool = False, temperature: float = 1.0, chunk: int = 0) -> HeadOut:
    """Everything the KL estimators and the loss read from one model on one batch."""
    targets = batch.input_ids[:, batch.prompt_len:]  # (N, T)
    if full_logits:
        logits = response_logits(model, batch, temperature)  # (N, T, V)
        lp = torch.log_softmax(logits, -1)
        out = HeadOut(logp=lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), logits=logits)
        if k > 0:
            out.topk_logp, out.topk_idx = lp.topk(k, dim=-1)
        if index is not None:
            out.index_logp = lp.gather(-1, index)
        if entropy:
            out.entropy = -(lp.exp() * lp).sum(-1)
        return out
    hid = response_hidden(model, batch)  # (N, T, H)
    B, T, H = hid.shape
    h, W, t = hid.reshape(B * T, H), output_layer(model), targets.reshape(B * T)
    ix = None if index is None else index.reshape(B * T, -1)
    shape = lambda x: x.view(B, T, *x.shape[1:])
    grad = torch.is_grad_enabled() and (h.requires_grad or W.requires_grad)
    out = HeadOut(logp=None)  # type: ignore[arg-type]
    if grad:
        logp, ixl = chunked_logprobs(h, W, t, ix, temperature, chunk)
        out.logp, out.index_logp = shape(logp), None if ixl is None else shape(ixl)
        if k > 0 or entropy:  # statistics of the current policy, without grad
            extra = chunked_head_nograd(h.detach(), W.detach(), t, k=k, entropy=entropy, temperature=temperature,
                                        chunk=chunk)
            out.topk_idx = None if extra.topk_idx is None else shape(extra.topk_idx.long())
            out.topk_logp = None if extra.topk_logp is None else shape(extra.topk_logp)
            out.entropy = None if extra.entropy is None else shape(extra.entropy)
        return out
    r = chunked_head_nograd(h, W, t, k=k, index=ix, entropy=entropy, temperature=temperature, chunk=chunk)
    out.logp = shape(r.logp)
    if k > 0:
        out.topk_idx, out.topk_logp = shape(r.topk_idx.long()), shape(r.topk_logp)
    if ix is not None:
        out.index_logp = shape(r.index_logp)
    if entropy:
        out.entropy = shape(r.entropy)
    return out
