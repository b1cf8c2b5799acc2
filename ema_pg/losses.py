"""The GRPO loss of Appendix A, as small functions composed in :func:`grpo_loss`.

    A        = advantages(R, group_size, norm)                      per sequence, (B,)
    J_n      = A * [M_n * ratio_n + (1 - M_n) * sg(clip(ratio_n))]   clip-higher surrogate
    loss     = aggregate(-J + beta * KL, mask, mode)

Departures from the paper's text, all documented at their function:
- the surrogate uses ratio = pi/pi_old in the masked form so that its *value* equals PPO's
  min(ratio A, clip(ratio) A) as well as its gradient (the paper's s_n M_n log pi has the
  same gradient, a different value);
- ``norm="none"`` keeps the group-mean baseline (Dr. GRPO) rather than raw rewards.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

ADV_NORMS = ("group", "global", "none")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


def advantages(rewards: Tensor, group_size: int, norm: str = "group", eps: float = 1e-6) -> Tensor:
    """Monte-Carlo advantages, (B*G,) from rewards (B*G,) laid out prompt-major.

    ``group``  (R - V(x)) / (std(x) + eps), V the mean and std the unbiased (N-1) standard
               deviation over the N = ``group_size`` samples of a prompt (Appendix A).
    ``global`` R - V(x), then one z-score over the flattened batch (Appendix B, Fig 9): the
               per-problem std(x) is discarded.
    ``none``   R - V(x): the group baseline only, no scaling (Dr. GRPO).
    """
    if norm not in ADV_NORMS:
        raise ValueError(f"unknown advantage normalization {norm!r}; choose one of: {', '.join(ADV_NORMS)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-baselined advantages; got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries; got shape {tuple(rewards.shape)}")
    r = rewards.view(-1, group_size).to(torch.float64)  # (B, G)
    centered = r - r.mean(-1, keepdim=True)  # (B, G)
    if norm == "group":
        out = centered / (r.std(-1, unbiased=True, keepdim=True) + eps)
    elif norm == "global":
        flat = centered.flatten()
        out = (flat - flat.mean()) / (flat.std(unbiased=True) + eps) if flat.numel() > 1 else flat
    else:
        out = centered
    return out.flatten().to(rewards.dtype)


def clip_masks(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """The clip-higher masks of Appendix A: (clipped_low, clipped_high), each (B, T) bool.

    clipped_high: A > 0 and ratio > 1 + eps_high; clipped_low: A < 0 and ratio < 1 - eps_low.
    M_n = 1 - clipped_low - clipped_high.
    """
    a = adv.unsqueeze(-1) if adv.dim() == ratio.dim() - 1 else adv
    high = (a > 0) & (ratio > 1.0 + eps_high)
    low = (a < 0) & (ratio < 1.0 - eps_low)
    return low, high


def ppo_surrogate(
    logp: Tensor, logp_old: Tensor, adv: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clip-higher PPO/GRPO objective J_n (to maximize), (B, T).

    Binary-mask form (Appendix A): J_n = A * ratio_n where M_n = 1, and A * sg(clip(ratio_n))
    where a token is clipped (M_n = 0). Its gradient is s_n M_n A grad log pi (the paper's),
    and its value and gradient equal min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A).
    ``adv`` is (B,) per sequence or (B, T) per token.
    """
    ratio = torch.exp(logp - logp_old.detach())  # (B, T), grad = ratio * grad log pi
    a = adv.unsqueeze(-1) if adv.dim() == logp.dim() - 1 else adv  # (B, 1) or (B, T)
    low, high = clip_masks(ratio.detach(), a, eps_low, eps_high)
    clipped = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)
    keep = ~(low | high)  # M_n
    J = a * torch.where(keep, ratio, clipped)  # (B, T)
    return J, {"ratio": ratio.detach(), "clipped_low": low, "clipped_high": high}


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "seq-mean-token-mean", norm_len: int | None = None) -> Tensor:
    """Reduce a (B, T) per-token loss over the loss mask to a scalar.

    ``seq-mean-token-mean``     mean over sequences of the mean over each one's tokens
                                (the paper's 1/N 1/L, Appendix A);
    ``token-mean``              sum over all tokens / number of tokens (DAPO);
    ``seq-mean-token-sum-norm`` mean over sequences of the token sum / ``norm_len``
                                (Dr. GRPO; default norm_len = T, the padded length).
    Positions outside the mask contribute nothing, even if they hold inf or nan.
    """
    if mode not in LOSS_AGGS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of: {', '.join(LOSS_AGGS)}")
    m = mask.bool()
    x = torch.where(m, per_token, torch.zeros_like(per_token))  # (B, T)
    mf = m.to(per_token.dtype)
    if mode == "token-mean":
        return x.sum() / mf.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        per_seq = x.sum(-1) / mf.sum(-1).clamp(min=1.0)  # (B,)
    else:
        per_seq = x.sum(-1) / float(norm_len or per_token.shape[-1])  # (B,)
    return per_seq.mean()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.bool()
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def grpo_loss(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    kl: Tensor | None,
    *,
    beta: float,
    eps_low: float,
    eps_high: float,
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"],
    norm_len: int | None = None,
    pg_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = aggregate(-w * J + beta * KL, mask): Algorithm 3 line 22 (w = 1), with metrics.

    ``pg_weight`` (B, T), no grad: a per-token weight w on the policy-gradient term only, the
    truncated importance-sampling correction of an inference engine's sampling mismatch.

    The coefficients have no defaults here: their one home is ``AlgoConfig`` (paper values there).

    ``kl`` is the (B, T) output of any registry estimator (or None). Observation and padding
    tokens have mask 0: they carry neither policy loss nor KL.
    """
    J, info = ppo_surrogate(logp, logp_old, adv, eps_low, eps_high)
    per_token = -J if pg_weight is None else -J * pg_weight.detach()
    if kl is not None and beta != 0.0:
        per_token = per_token + beta * kl
    loss = aggregate(per_token, mask, loss_agg, norm_len)
    with torch.no_grad():
        ratio = info["ratio"]
        m = mask.bool()
        metrics = {
            "pg_loss": aggregate(-J.detach() if pg_weight is None else -J.detach() * pg_weight, mask, loss_agg, norm_len),
            "kl": masked_mean(kl.detach(), mask) if kl is not None else torch.zeros(()),
            "clip_frac_low": masked_mean(info["clipped_low"].to(ratio.dtype), mask),
            "clip_frac_high": masked_mean(info["clipped_high"].to(ratio.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": ratio[m].max() if m.any() else torch.ones(()),
            "ratio_min": ratio[m].min() if m.any() else torch.ones(()),
            "approx_kl_old": masked_mean(-torch.log(ratio), mask),  # k1 of (pi_old || pi), cleanrl-style
        }
    return loss, metrics
