"""Log-prob heads: what one model's pass over a batch of rollouts gives the loss and the KL.

``head(model, rollouts, ...)`` runs the transformer body once, then the output layer through
the chunked head of :mod:`ema_pg.chunked`: O(k) memory per token in the no-grad passes
(pi_old, the anchor) and in the policy's gradient pass, whose backward recomputes each
chunk's logits. Only ``full_logits=True`` (the exact estimators) materializes the (N, T, V)
logits.

Every pass returns one :class:`TokenScores`. Its index set is either the model's own top-k
(``topk=k``) or one given by the caller (``index=...``); either way ``index`` holds the
indices and ``index_logp`` the model's log-probs there, so a reader never has to know which.

All log-probs are of the temperature-scaled distribution softmax(logits / temperature), the
distribution the sampler draws from (nucleus truncation aside). The output layer must be a
linear map without bias (Qwen2, Llama, Mistral, Gemma, Phi-3, GPT-2, ...); final-logit soft-capping
(Gemma 2 and 3) is applied inside the chunked head, exactly; :func:`check_head` refuses the rest at start. Under
DeepSpeed ZeRO-3 the output embedding alone is gathered for the head (for the gradient pass,
by running the head as the output layer's forward, so its backward is gathered too).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunked import chunked_head_nograd, chunked_logprobs
from .packing import Packing, packed_hidden
from .rollout.base import Rollouts
from .scores import TokenScores
from .dist import call_through, gathered, zero3_partitioned


def softcap(model) -> float:
    """The model's final-logit soft-cap c (logits = c tanh(logits / c)); 0 = none."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return float(getattr(cfg, "final_logit_softcapping", None) or 0.0)


def check_head(model) -> None:
    """Raise NotImplementedError, naming the model, if the chunked head cannot score it: its logits must be
    hidden @ W^T (soft-capped or not) from a decoder body (``get_decoder``) and an output embedding."""
    name = type(model).__name__
    lm = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if lm is None or getattr(lm, "weight", None) is None or not hasattr(model, "get_decoder"):
        raise NotImplementedError(f"{name}: the log-prob head needs a decoder body and an output embedding "
                                  "(a causal LM from transformers' AutoModelForCausalLM)")
    if getattr(lm, "bias", None) is not None:
        raise NotImplementedError(f"{name}: its output layer has a bias; the chunked head computes logits = hidden @ "
                                  "W^T (+ soft-capping) only")


def output_layer(model) -> Tensor:
    check_head(model)
    return model.get_output_embeddings().weight  # (V, H)


def response_hidden(model, batch: Rollouts) -> Tensor:
    """(N, T, H) final hidden states at the positions that predict the response tokens."""
    body = model.get_decoder()
    out = body(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
               use_cache=False)  # a scoring pass: no cache to fill (the config's default builds and fills one)
    return out.last_hidden_state[:, batch.prompt_len - 1 : -1]


def response_logits(model, batch: Rollouts, temperature: float = 1.0, packing: Packing | None = None) -> Tensor:
    """(N, T, V) materialized logits (exact estimators and tests only); with ``packing``, (M, V) at its scored
    positions."""
    hid = response_hidden(model, batch) if packing is None else packed_hidden(model, packing)
    W = output_layer(model)
    if zero3_partitioned(W):
        logits = call_through(model.get_output_embeddings(), lambda x: (x @ output_layer(model).T).float(), hid)
    else:
        logits = (hid @ W.T).float()
    c = softcap(model)
    if c:
        logits = c * torch.tanh(logits / c)
    return logits / temperature if temperature != 1.0 else logits


def head(model, batch: Rollouts, *, topk: int = 0, index: Tensor | None = None, full_logits: bool = False,
         entropy: bool = False, temperature: float = 1.0, chunk: int = 0, packing: Packing | None = None) -> TokenScores:
    """Score ``batch``'s response tokens under ``model``.

    ``topk`` > 0: the index set is the model's own top-k (no-grad passes only);
    ``index`` (N, T, k): the index set is given. With grad enabled ``logp``, ``index_logp``
    and (``entropy=True``, the entropy bonus) ``entropy`` carry gradients (the policy's update pass).
    ``packing`` (:func:`ema_pg.packing.pack` of ``batch``): a padding-free pass that scores the policy tokens only;
    every other response position of the (N, T) scores is 0.
    """
    if topk and index is not None:
        raise ValueError("head: give topk (the model's own top-k) or index (a given index set), not both")
    if packing is None:
        targets = batch.input_ids[:, batch.prompt_len:]  # (N, T)
        N, T = targets.shape
        flat = lambda x: x.reshape(N * T, *x.shape[2:])
        shape = lambda x: x.view(N, T, *x.shape[1:])
    else:
        targets = packing.targets  # (M,)
        flat, shape = packing.take, packing.put
    if full_logits:
        logits = response_logits(model, batch, temperature, packing)  # (N, T, V) or (M, V)
        lp = torch.log_softmax(logits, -1)
        t = targets.unsqueeze(-1)
        out = TokenScores(logp=lp.gather(-1, t).squeeze(-1), logits=logits)
        if topk > 0:
            out.index_logp, out.index = lp.topk(topk, dim=-1)
        elif index is not None:
            out.index, out.index_logp = index, lp.gather(-1, index if packing is None else flat(index))
        if entropy:
            out.entropy = -(lp.exp() * lp).sum(-1)
        if packing is not None:
            out = TokenScores(**{f: v if v is None or (f == "index" and index is not None) else shape(v)
                                 for f, v in vars(out).items()})
        return out
    if packing is None:
        h = flat(response_hidden(model, batch))  # (N*T, H)
        t = flat(targets)
    else:
        h, t = packed_hidden(model, packing), targets  # (M, H), (M,)
    W, cap = output_layer(model), softcap(model)
    ix = None if index is None else flat(index)  # (N*T or M, k)
    if torch.is_grad_enabled() and (h.requires_grad or W.requires_grad):
        if topk:
            raise ValueError("head: the gradient pass scores a given index set only (its own top-k is a no-grad stat)")
        if zero3_partitioned(W):  # the output layer's module gathers W for the head and for its backward
            outs = call_through(model.get_output_embeddings(),
                                lambda x: chunked_logprobs(x, output_layer(model), t, ix, temperature, chunk, entropy, cap), h)
        else:
            outs = chunked_logprobs(h, W, t, ix, temperature, chunk, entropy, cap)
        logp, ixl = outs[0], outs[1]
        return TokenScores(logp=shape(logp), index=index, index_logp=None if ixl is None else shape(ixl),
                           entropy=shape(outs[2]) if entropy else None)
    with gathered([W]):  # ZeRO-3: the output embedding only, not the whole model
        r = chunked_head_nograd(h, W, t, k=topk, index=ix, entropy=entropy, temperature=temperature, chunk=chunk,
                                softcap=cap)
    out = TokenScores(logp=shape(r.logp), entropy=None if r.entropy is None else shape(r.entropy))
    if topk > 0:
        out.index, out.index_logp = shape(r.topk_idx.long()), shape(r.topk_logp)
    elif ix is not None:
        out.index, out.index_logp = index, shape(r.index_logp)
    return out
