"""Top-k f-divergence estimators (Appendix H, Table 5).

D_f(P || Q) = sum_j Q(j) f(t_j), t_j = P(j)/Q(j), with P = pi_theta and Q = pi_ref. The
estimator is the exact head on the index set S plus the masked sampled tail Kf++:

    TopK-D_f = sum_{j in S} Q(j) f(t_j) + s * 1(p notin S) * sg(w) f(1/w)      (eq. 120-122)

Kf++ = r g_f(w) = sg(w) f(1/w) (eq. 115-116) has no baseline inside, so unlike the printed
Alg 1/2 it is unbiased in value *and* gradient on any index set (eq. 124-126), at the price
of more gradient variance. S is the top-k of pi_old, except for ``forward_kl`` whose
expectation is under the anchor, where S is the anchor's top-k (as in Alg 2).

Each f is written in terms of u = log t, which keeps the tail finite for tiny probabilities.
Table 5 prints Neyman chi^2 with f(t) = (t-1)^2; its sampled column r (1-w)^2 corresponds to
f(t) = (t-1)^2 / t, which is the Neyman divergence and what is implemented.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .base import KLInputs, in_index_set, offpolicy_weight, require


def _f_forward_kl(u: Tensor, alpha: float) -> Tensor:
    return -u  # -log t


def _f_reverse_kl(u: Tensor, alpha: float) -> Tensor:
    return u.exp() * u  # t log t


def _f_pearson(u: Tensor, alpha: float) -> Tensor:
    return torch.expm1(u) ** 2  # (t-1)^2


def _f_neyman(u: Tensor, alpha: float) -> Tensor:
    return torch.expm1(u) ** 2 * torch.exp(-u)  # (t-1)^2 / t


def _f_hellinger(u: Tensor, alpha: float) -> Tensor:
    return 0.5 * torch.expm1(0.5 * u) ** 2  # (sqrt t - 1)^2 / 2


def _f_js(u: Tensor, alpha: float) -> Tensor:
    t = u.exp()  # (t log t - (t+1) log((t+1)/2)) / 2
    return 0.5 * (t * u - (t + 1) * (torch.logaddexp(u, torch.zeros_like(u)) - torch.log(torch.tensor(2.0, dtype=u.dtype))))


def _f_tv(u: Tensor, alpha: float) -> Tensor:
    return 0.5 * torch.expm1(u).abs()  # |t - 1| / 2


def _f_alpha(u: Tensor, alpha: float) -> Tensor:
    return (torch.exp(alpha * u) - 1 - alpha * torch.expm1(u)) / (alpha * (alpha - 1))


DIVERGENCES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "reverse_kl": _f_reverse_kl,
    "forward_kl": _f_forward_kl,
    "js": _f_js,
    "hellinger": _f_hellinger,
    "pearson": _f_pearson,
    "neyman": _f_neyman,
    "tv": _f_tv,
    "alpha": _f_alpha,
}


def topk_fdiv(
    inp: KLInputs, *, k: int, divergence: str, alpha: float, iw_clip: tuple[float, float]
) -> Tensor:
    """Top-k f-divergence D_f(pi_theta || pi_ref) per token (eq. 122); (B, T)."""
    f = DIVERGENCES[divergence]
    out = torch.zeros_like(inp.logp)
    tail_mask = torch.ones_like(inp.logp)
    if not (k == 0 and inp.topk_idx is None):
        require(inp, "topk_fdiv", "tokens", "topk_idx", "topk_logp", "topk_logp_ref")
        if inp.topk_idx.shape[-1] != k:
            raise ValueError(f"topk_fdiv: estimator has k={k} but topk_idx holds {inp.topk_idx.shape[-1]}")
        lr = inp.topk_logp_ref.detach()  # (B, T, k)
        out = out + (lr.exp() * f(inp.topk_logp - lr, alpha)).sum(-1)  # exact head, (B, T)
        tail_mask = (~in_index_set(inp.tokens, inp.topk_idx)).to(inp.logp.dtype)
    u = inp.logp - inp.logp_ref.detach()  # log t(p) = -log w, (B, T)
    kf = torch.exp(-u.detach()) * f(u, alpha)  # sg(w) f(1/w), eq. 116
    return out + offpolicy_weight(inp, iw_clip) * tail_mask * kf
