"""Exact expectations of an estimator by enumeration over a small vocabulary (docs/algorithm.md, "The KL-estimator registry").

With B = V rows, row j holding sampled token j, E_p[f] = sum_j sg(pi_sampling(j)) f_j, and
E_p[grad f] is the autograd gradient of that sum with respect to the policy logits. No
sampling is involved, so "unbiased" can be checked to float64 precision.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Estimator, KLInputs


def index_set(source: str, k: int, logits: Tensor, ref_logits: Tensor, samp_logits: Tensor | None = None) -> Tensor:
    """The top-k indices (k,) of ``source``'s distribution: "policy_old" (the sampling policy; the policy's own
    on-policy) or "anchor"; k = 0 gives the empty set."""
    src = {"policy_old": logits if samp_logits is None else samp_logits, "anchor": ref_logits}[source]
    return torch.topk(src.detach(), min(k, src.shape[-1])).indices


def enumeration_inputs(est: Estimator | None, logits: Tensor, ref_logits: Tensor, samp_logits: Tensor | None = None,
                       topk_idx: Tensor | None = None) -> tuple[KLInputs, Tensor]:
    """KLInputs for one position enumerated over every token, and the weights pi_sampling (V, 1).

    ``logits`` (V,) are the policy's (grad flows to them), ``ref_logits`` the anchor's,
    ``samp_logits`` the sampling policy's (default: the policy's own, detached). The index set
    is the top-k of the estimator's ``topk_source`` unless ``topk_idx`` (k,) is given (``est`` may
    then be None: the inputs do not depend on it).
    """
    V = logits.shape[-1]
    samp_logits = logits.detach() if samp_logits is None else samp_logits
    lp = torch.log_softmax(logits, -1)  # (V,)
    lr = torch.log_softmax(ref_logits, -1).detach()  # (V,)
    lo = torch.log_softmax(samp_logits, -1).detach()  # (V,)
    tokens = torch.arange(V).view(V, 1)  # (B=V, T=1)
    if topk_idx is None and est is not None and est.k > 0:
        topk_idx = index_set(est.topk_source, est.k, logits, ref_logits, samp_logits)  # (k,)
    q = None if topk_idx is None else topk_idx.view(1, 1, -1).expand(V, 1, -1)  # (V, 1, k)
    inp = KLInputs(
        logp=lp[tokens],  # (V, 1)
        logp_old=lo[tokens],
        logp_ref=lr[tokens],
        tokens=tokens,
        topk_idx=q,
        topk_logp=None if q is None else lp[q],  # (V, 1, k)
        topk_logp_ref=None if q is None else lr[q],
        logits=logits.view(1, 1, V).expand(V, 1, V),
        ref_logits=ref_logits.view(1, 1, V).expand(V, 1, V).detach(),
    )
    return inp, lo.exp().view(V, 1)


def expected_value_and_grad(est: Estimator, logits: Tensor, ref_logits: Tensor, samp_logits: Tensor | None = None,
                            topk_idx: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(E[value], E[autograd gradient w.r.t. the policy logits]) under y ~ pi_sampling."""
    theta = logits.detach().clone().requires_grad_(True)
    inp, weights = enumeration_inputs(est, theta, ref_logits, samp_logits, topk_idx)
    value = (weights * est(inp)).sum()
    (grad,) = torch.autograd.grad(value, theta)
    return value.detach(), grad


def true_kl_and_grad(logits: Tensor, ref_logits: Tensor, direction: str) -> tuple[Tensor, Tensor]:
    """(KL, grad KL w.r.t. the policy logits) for ``reverse`` KL(pi||ref) or ``forward`` KL(ref||pi)."""
    theta = logits.detach().clone().requires_grad_(True)
    lp, lr = torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1).detach()
    kl = (lp.exp() * (lp - lr)).sum() if direction == "reverse" else (lr.exp() * (lr - lp)).sum()
    (grad,) = torch.autograd.grad(kl, theta)
    return kl.detach(), grad
