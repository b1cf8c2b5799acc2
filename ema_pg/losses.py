"""The GRPO loss of Appendix A, as small functions composed in :func:`policy_loss`.

    A        = advantages(R, group_size, norm)                      per sequence, (B,)
    J_n      = A * [M_n * ratio_n + (1 - M_n) * sg(clip(ratio_n))]   clip-higher surrogate (algo.loss=ppo)
    loss     = aggregate(-J + beta * KL - c_H * H, mask, mode)

The surrogate J is one of :data:`SURROGATES` (``algo.loss``): ``ppo`` (the paper's clip-higher
PPO/GRPO, with optional dual clip), ``gspo`` (a sequence-level ratio), ``cispo`` (a clipped,
stop-gradient IS weight on the log-prob gradient) or ``dppo_tv`` / ``dppo_kl`` (a trust region on the
token probability's difference or binary KL instead of its ratio); the paper calls its two changes
orthogonal to this choice (Appendix A).

Departures from the paper's text, all documented at their function:
- the surrogate uses ratio = pi/pi_old in the masked form so that its *value* equals PPO's
  min(ratio A, clip(ratio) A) as well as its gradient (the paper's s_n M_n log pi has the
  same gradient, a different value);
- ``norm="none"`` keeps the group-mean baseline (Dr. GRPO) rather than raw rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

ADV_NORMS = ("group", "global", "none")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


ADV_EPS = 1e-6  #: the advantages' std guard; also the authors' kld / (adv_batch_std + 1e-6)


def _centered(rewards: Tensor, group_size: int) -> Tensor:
    """R - V(x), (B, G) in float64, V the mean of the prompt's group."""
    r = rewards.view(-1, group_size).to(torch.float64)
    return r - r.mean(-1, keepdim=True)


def advantages(rewards: Tensor, group_size: int, norm: str, eps: float = ADV_EPS) -> Tensor:
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
    centered = _centered(rewards, group_size)  # (B, G)
    if norm == "group":
        r = rewards.view(-1, group_size).to(torch.float64)
        out = centered / (r.std(-1, unbiased=True, keepdim=True) + eps)
    elif norm == "global":
        flat = centered.flatten()
        out = (flat - flat.mean()) / (global_std(rewards, group_size) + eps) if flat.numel() > 1 else flat
    else:
        out = centered
    return out.flatten().to(rewards.dtype)


def global_std(rewards: Tensor, group_size: int) -> float:
    """The batch standard deviation of R - V(x) that ``global`` normalization divides by (unbiased; 0 for one entry).

    With ``algo.global_kl_scale`` the token KL is divided by it too (+ ``ADV_EPS``), as the authors' code does.
    """
    flat = _centered(rewards, group_size).flatten()
    return float(flat.std(unbiased=True)) if flat.numel() > 1 else 0.0


def clip_masks(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """The clip-higher masks of Appendix A: (clipped_low, clipped_high), each (B, T) bool.

    clipped_high: A > 0 and ratio > 1 + eps_high; clipped_low: A < 0 and ratio < 1 - eps_low.
    M_n = 1 - clipped_low - clipped_high.
    """
    a = adv.unsqueeze(-1) if adv.dim() == ratio.dim() - 1 else adv
    high = (a > 0) & (ratio > 1.0 + eps_high)
    low = (a < 0) & (ratio < 1.0 - eps_low)
    return low, high


def _per_token(adv: Tensor, like: Tensor) -> Tensor:
    return adv.unsqueeze(-1) if adv.dim() == like.dim() - 1 else adv  # (B, 1) or (B, T)


def ppo_surrogate(
    logp: Tensor, logp_old: Tensor, adv: Tensor, eps_low: float, eps_high: float, clip_ratio_c: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clip-higher PPO/GRPO objective J_n (to maximize), (B, T).

    Binary-mask form (Appendix A): J_n = A * ratio_n where M_n = 1, and A * sg(clip(ratio_n))
    where a token is clipped (M_n = 0). Its gradient is s_n M_n A grad log pi (the paper's),
    and its value and gradient equal min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A).
    ``adv`` is (B,) per sequence or (B, T) per token.

    ``clip_ratio_c`` > 1: dual-clip PPO (Ye et al. 2020): where A < 0 the objective is also
    bounded below by c A, i.e. J = max(min(ratio A, clip(ratio) A), c A); a token with
    ratio > c and A < 0 then carries no gradient. 0 = off (``algo.clip_ratio_c``).
    """
    ratio = torch.exp(logp - logp_old.detach())  # (B, T), grad = ratio * grad log pi
    a = _per_token(adv, logp)
    low, high = clip_masks(ratio.detach(), a, eps_low, eps_high)
    clipped = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)
    keep = ~(low | high)  # M_n
    J = a * torch.where(keep, ratio, clipped)  # (B, T)
    info = {"ratio": ratio.detach(), "clipped_low": low, "clipped_high": high}
    if clip_ratio_c > 0:
        dual = (a < 0) & (ratio.detach() > clip_ratio_c)  # (B, T); here min(.) = ratio A < c A
        J = torch.where(dual, (clip_ratio_c * a).expand_as(J), J)
        info["clipped_dual"] = dual
    return J, info


def gspo_surrogate(
    logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, s_i = exp(mean_t log(pi/pi_old)).

    J_i = min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i). Written per token as
    J_t = A * sg(s_i) * pi_t/sg(pi_t) where unclipped (value s_i A, gradient s_i A grad log pi_t)
    and A * sg(clip(s_i)) where clipped, so that with ``seq-mean-token-mean`` aggregation the
    loss's value and gradient are GSPO's exactly (grad s_i = s_i * mean_t grad log pi_t).
    The paper of GSPO uses a much tighter clip than PPO (eps ~ 3e-4 / 4e-4): set algo.eps_low/high.
    """
    mb = mask.bool()  # masked positions to 0 first: a nan or -inf there would survive the product with 0
    logp, logp_old = _masked(logp, mb), _masked(logp_old, mb)
    m = mb.to(logp.dtype)
    log_s = ((logp - logp_old.detach()) * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # (B,)
    s = log_s.detach().exp()  # (B,)
    a = adv if adv.dim() == 1 else adv[:, 0]  # (B,) sequence-level
    s_tok = torch.exp(log_s.detach().unsqueeze(-1) + logp - logp.detach())  # (B, T): value s_i, grad s_i grad log pi_t
    low, high = clip_masks(s, a, eps_low, eps_high)  # (B,)
    keep = ~(low | high)
    J = a.unsqueeze(-1) * torch.where(keep.unsqueeze(-1), s_tok, s.clamp(1.0 - eps_low, 1.0 + eps_high).unsqueeze(-1))
    expand = lambda x: x.unsqueeze(-1).expand_as(logp)
    return J, {"ratio": expand(s), "clipped_low": expand(low), "clipped_high": expand(high)}


def cispo_surrogate(
    logp: Tensor, logp_old: Tensor, adv: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (Chen et al. 2025, MiniMax-M1): the IS weight is clipped and stopped, never the token.

    J_t = sg(clip(ratio_t, 1-eps_low, 1+eps_high)) * A * log pi_t in gradient: every token keeps a
    gradient, scaled by its clipped weight. Written as A * sg(w) * pi/sg(pi), its value is w A.
    (MiniMax clip only from above: a large ``algo.eps_low`` such as 1.0 switches the lower clip off.)
    """
    ratio = torch.exp(logp - logp_old.detach())  # (B, T)
    a = _per_token(adv, logp)
    w = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)
    J = a * w * torch.exp(logp - logp.detach())  # value w A, gradient w A grad log pi
    r = ratio.detach()
    return J, {"ratio": r, "clipped_low": r < 1.0 - eps_low, "clipped_high": r > 1.0 + eps_high}  # weight clipped


def dppo_surrogate(
    logp: Tensor, logp_old: Tensor, adv: Tensor, eps_low: float, eps_high: float, trunc: float, divergence: str
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO (Qi et al. 2026, "Rethinking the trust region in LLM reinforcement learning", arXiv 2602.04879; verl's
    ``dppo_tv`` / ``dppo_kl`` policy losses): the trust region is a bound on a divergence of
    the sampled token's probability, not on its ratio. With p = pi(y_t), p_old = pi_old(y_t):

    - ``tv`` (Binary-TV): a token with A > 0 keeps its gradient while p - p_old <= eps_high, one with A <= 0 while
      p - p_old >= -eps_low;
    - ``kl`` (Binary-KL): D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)), the KL of the two
      Bernoulli laws "this token or another"; A > 0 keeps it while D <= eps_high or p <= p_old, A <= 0 while
      D <= eps_low or p >= p_old.

    A kept token's gradient is A sg(min(ratio, c)) grad log pi (c = ``trunc``, none at 0), a masked one's is 0:
    written A sg(w) pi/sg(pi), as CISPO's, its value is w A (verl prints -A w log pi; the gradients are equal).
    """
    ratio = torch.exp(logp - logp_old.detach()).detach()
    a = _per_token(adv, logp)
    w = ratio.clamp(max=trunc) if trunc > 0 else ratio
    p, p_old = logp.detach().exp(), logp_old.detach().exp()
    if divergence == "tv":
        up_ok, down_ok = p - p_old <= eps_high, p - p_old >= -eps_low
    else:
        d = p_old * (logp_old.detach() - logp.detach()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        up_ok, down_ok = (d <= eps_high) | (p <= p_old), (d <= eps_low) | (p >= p_old)
    keep = torch.where(a > 0, up_ok, down_ok)
    J = a * w * torch.exp(logp - logp.detach()) * keep.to(logp.dtype)
    return J, {"ratio": ratio, "clipped_low": ~keep & (a <= 0), "clipped_high": ~keep & (a > 0)}


@dataclass(frozen=True)
class PPOClip:
    """``algo.loss=ppo``: the paper's clip-higher PPO/GRPO (Appendix A; :func:`ppo_surrogate`), the ratio clipped to
    [1 - eps_low, 1 + eps_high]; ``clip_ratio_c`` > 1 adds dual-clip PPO's bound c A under negative advantages (0 = off)."""

    eps_low: float
    eps_high: float
    clip_ratio_c: float

    def __call__(self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return ppo_surrogate(logp, logp_old, adv, self.eps_low, self.eps_high, self.clip_ratio_c)


@dataclass(frozen=True)
class GSPOClip:
    """``algo.loss=gspo``: one ratio per sequence (:func:`gspo_surrogate`), clipped to [1 - eps_low, 1 + eps_high]."""

    eps_low: float
    eps_high: float

    def __call__(self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return gspo_surrogate(logp, logp_old, adv, mask, self.eps_low, self.eps_high)


@dataclass(frozen=True)
class CISPOClip:
    """``algo.loss=cispo``: every token keeps its gradient, weighted by the stopped IS weight clipped to
    [1 - eps_low, 1 + eps_high] (:func:`cispo_surrogate`)."""

    eps_low: float
    eps_high: float

    def __call__(self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return cispo_surrogate(logp, logp_old, adv, self.eps_low, self.eps_high)


@dataclass(frozen=True)
class DPPOTrust:
    """``algo.loss=dppo_tv`` / ``dppo_kl``: a trust region on the sampled token's probability (:func:`dppo_surrogate`):
    ``eps_low`` / ``eps_high`` bound its divergence (``divergence``: tv or kl, fixed by the option) below and above,
    and ``clip_ratio_c`` > 1 truncates the kept token's IS weight (0 = off)."""

    eps_low: float
    eps_high: float
    clip_ratio_c: float
    divergence: str  # tv | kl: fixed by the option (SURROGATES), not a knob

    def __call__(self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return dppo_surrogate(logp, logp_old, adv, self.eps_low, self.eps_high, self.clip_ratio_c, self.divergence)


#: a surrogate J's record: called as J(logp, logp_old, adv, mask) -> (J (B, T), its clip masks and ratio)
Surrogate = PPOClip | GSPOClip | CISPOClip | DPPOTrust

#: the surrogate registry (``algo.loss``): each option's record type, and the option's own fixed fields; the record's
#: other fields are the ``algo`` knobs of the same names it reads (:func:`surrogate_knobs`)
SURROGATES: dict[str, tuple[type, dict[str, str]]] = {
    "ppo": (PPOClip, {}),
    "gspo": (GSPOClip, {}),
    "cispo": (CISPOClip, {}),
    "dppo_tv": (DPPOTrust, {"divergence": "tv"}),
    "dppo_kl": (DPPOTrust, {"divergence": "kl"}),
}


def surrogate_knobs(name: str) -> tuple[str, ...]:
    """The ``algo`` knobs surrogate ``name`` reads: its record's fields that its option does not fix."""
    cls, fixed = SURROGATES[name]
    return tuple(f.name for f in fields(cls) if f.name not in fixed)


def build_surrogate(name: str, **knobs) -> Surrogate:
    """Surrogate ``name``'s record from the ``algo`` knobs it reads (``knobs`` may hold others: they are not its)."""
    if name not in SURROGATES:
        raise ValueError(f"unknown surrogate {name!r}; choose one of: {', '.join(SURROGATES)}")
    cls, fixed = SURROGATES[name]
    return cls(**{k: knobs[k] for k in surrogate_knobs(name)}, **fixed)


@dataclass(frozen=True)
class Share:
    """A micro-batch's place in its minibatch: the minibatch's loss-mask tokens and rows. A micro-batch's loss and its
    mean metrics are then its share of the minibatch's (sums over its tokens or rows over the minibatch's counts), and
    the micro-batches' shares add up to the whole minibatch's value, for every aggregation."""

    tokens: float
    rows: int


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "seq-mean-token-mean", norm_len: int | None = None,
              share: Share | None = None) -> Tensor:
    """Reduce a (B, T) per-token loss over the loss mask to a scalar.

    ``seq-mean-token-mean``     mean over sequences of the mean over each one's tokens
                                (the paper's 1/N 1/L, Appendix A);
    ``token-mean``              sum over all tokens / number of tokens (DAPO);
    ``seq-mean-token-sum``      mean over sequences of each one's token sum (verl's mode of that name);
    ``seq-mean-token-sum-norm`` mean over sequences of the token sum / ``norm_len``
                                (Dr. GRPO; default norm_len = T, the padded length). This equals TRL's
                                ``dr_grpo``; verl's mode of the same name is B times it (a sum over
                                sequences, not a mean).
    Positions outside the mask contribute nothing, even if they hold inf or nan. A sequence with no
    token in the mask counts as 0 in the ``seq-mean-*`` means (it is one of the B); verl leaves such
    rows out of the mean, so with fully masked rows (DAPO's overlong filtering) the two differ.
    ``share``: these rows are a micro-batch of a minibatch (:class:`Share`): the sums are divided by the
    minibatch's tokens or rows, so the micro-batches' values add up to the minibatch's.
    """
    if mode not in LOSS_AGGS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of: {', '.join(LOSS_AGGS)}")
    m = mask.bool()
    x = torch.where(m, per_token, torch.zeros_like(per_token))  # (B, T)
    mf = m.to(per_token.dtype)
    if mode == "token-mean":
        return x.sum() / (mf.sum().clamp(min=1.0) if share is None else max(share.tokens, 1.0))
    if mode == "seq-mean-token-mean":
        per_seq = x.sum(-1) / mf.sum(-1).clamp(min=1.0)  # (B,)
    elif mode == "seq-mean-token-sum":
        per_seq = x.sum(-1)  # (B,)
    else:
        per_seq = x.sum(-1) / float(norm_len or per_token.shape[-1])  # (B,)
    return per_seq.mean() if share is None else per_seq.sum() / share.rows


def _masked(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros_like(x))


def masked_mean(x: Tensor, mask: Tensor, share: Share | None = None) -> Tensor:
    """The mean of ``x`` over the mask; with ``share``, the sum over the mask over the minibatch's tokens."""
    m = mask.bool()
    return torch.where(m, x, torch.zeros_like(x)).sum() / (m.sum().clamp(min=1) if share is None else max(share.tokens, 1.0))


@dataclass(frozen=True)
class LossSpec:
    """The loss, compiled once from a run's ``algo`` record (:meth:`of`): ``surrogate`` the J of ``algo.loss``, its
    option's record with the knobs it reads (:data:`SURROGATES`), ``entropy_coef`` c_H the entropy bonus's weight,
    ``loss_agg`` the aggregation (:data:`LOSS_AGGS`) and ``norm_len`` its fixed length (``seq-mean-token-sum-norm``).
    No defaults here: their one home is ``AlgoConfig`` (paper values there)."""

    surrogate: Surrogate
    loss_agg: str  # one of LOSS_AGGS
    entropy_coef: float
    norm_len: int | None = None

    @classmethod
    def of(cls, algo, norm_len: int | None = None) -> LossSpec:
        """A run's: the ``algo`` record's surrogate and coefficients; ``norm_len`` its ``rollout.max_new_tokens``."""
        knobs = {k: getattr(algo, k) for k in surrogate_knobs(algo.loss)}
        return cls(build_surrogate(algo.loss, **knobs), algo.loss_agg, algo.entropy_coef, norm_len)


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    kl: Tensor | None,
    *,
    beta: float,
    spec: LossSpec,
    entropy: Tensor | None = None,
    pg_weight: Tensor | None = None,
    share: Share | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = aggregate(-w * J + beta * KL - c_H * H, mask): Algorithm 3 line 22 (w = 1, c_H = 0), with metrics.

    ``spec`` (:class:`LossSpec`): the surrogate J and the coefficients; its ``entropy_coef`` c_H weighs an entropy
    bonus on ``entropy`` (B, T), the policy's entropy at each position with its gradient (needed when c_H != 0).

    ``pg_weight`` (B, T), no grad: a per-token weight w on the policy-gradient term only, the
    truncated importance-sampling correction of an inference engine's sampling mismatch.

    ``kl`` is the (B, T) output of any registry estimator (or None). Observation and padding
    tokens have mask 0: they carry neither policy loss nor KL.

    ``share`` (:class:`Share`): these rows are a micro-batch; the loss and the mean metrics are its share of the
    minibatch's, so that the micro-batches' add up (``ratio_max`` / ``ratio_min`` combine by max / min).
    """
    loss_agg, norm_len, entropy_coef = spec.loss_agg, spec.norm_len, spec.entropy_coef
    m = mask.bool()  # masked positions first set to 0: a nan or -inf there reaches neither the loss nor its gradient
    logp, logp_old = _masked(logp, m), _masked(logp_old, m)
    kl = None if kl is None else _masked(kl, m)
    entropy = None if entropy is None else _masked(entropy, m)
    J, info = spec.surrogate(logp, logp_old, adv, mask)
    per_token = -J if pg_weight is None else -J * pg_weight.detach()
    if kl is not None and beta != 0.0:
        per_token = per_token + beta * kl
    if entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the policy's per-token entropy (with its gradient)")
        per_token = per_token - entropy_coef * entropy
    loss = aggregate(per_token, mask, loss_agg, norm_len, share)
    with torch.no_grad():
        ratio = info["ratio"]
        mean = lambda x: masked_mean(x, mask, share)
        metrics = {
            "pg_loss": aggregate(-J.detach() if pg_weight is None else -J.detach() * pg_weight, mask, loss_agg, norm_len,
                                 share),
            "kl": mean(kl.detach()) if kl is not None else torch.zeros(()),
            "clip_frac_low": mean(info["clipped_low"].to(ratio.dtype)),
            "clip_frac_high": mean(info["clipped_high"].to(ratio.dtype)),
            "ratio_mean": mean(ratio),
            "ratio_max": ratio[m].max() if m.any() else torch.ones(()),
            "ratio_min": ratio[m].min() if m.any() else torch.ones(()),
            "approx_kl_old": mean(-torch.log(ratio)),  # k1 of (pi_old || pi), cleanrl-style
        }
        if "clipped_dual" in info:
            metrics["clip_frac_dual"] = mean(info["clipped_dual"].to(ratio.dtype))
        if entropy is not None and entropy.requires_grad:
            metrics["entropy_cur"] = mean(entropy.detach())
    return loss, metrics


grpo_loss = policy_loss  #: its name before it was named for what it runs (PPO, GSPO, CISPO, DPPO too), for one release
