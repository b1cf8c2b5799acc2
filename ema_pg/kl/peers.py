"""The field's KL estimators that are not configurations of ours, written from their published formulas.

Each function has the registry's signature (``fn(inputs: KLInputs, **params) -> (B, T)``) so that the
estimator lab (:mod:`ema_pg.workbench.lab`) measures it beside ours. Those of the field that *are* one of
ours with options (verl's ``low_var_kl`` = ``k3`` with ``clamp``; ``k3+`` = ``k3`` with ``clamp`` and
``straight_through``; ``abs``; ``mse`` = ``k2``) are entries of the lab's panel, not functions here.

Notation as in :mod:`ema_pg.kl.base`: ``logp`` = log pi_theta(y), ``logp_ref`` = log pi_ref(y),
``logp_old`` = log pi_old(y) at the sampled token y; ``topk_*`` at the index set.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import KLInputs, in_index_set, require
from .sampled import k3_core


def iw_k3(inp: KLInputs, *, log_ratio_clamp: float | None) -> Tensor:
    """Importance-weighted K3: (pi_theta / pi_old) * (pi_ref/pi_theta - log(pi_ref/pi_theta) - 1).

    DeepSeek-V3.2 technical report, §3.1 "Unbiased KL Estimate" (arXiv 2512.02556); as TRL's
    ``GRPOConfig.use_bias_correction_kl`` (trl/trainer/grpo_trainer.py: the per-token K3 times the
    differentiable ratio ``coef_1``, PR #4638, default on since PR #6503) and slime's
    ``--use-unbiased-kl`` (THUDM/slime PR #1004). The ratio keeps its gradient, so on-policy
    (ratio value 1) the gradient is still changed: it becomes the reverse-KL gradient.
    ``log_ratio_clamp`` bounds log(pi_theta/pi_old) as some ports do (Trinity-RFT: 20); None = none.
    """
    log_ratio = inp.logp - inp.logp_old.detach()
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    return torch.exp(log_ratio) * k3_core(inp.logp_ref.detach() - inp.logp)


def openrlhf_unbiased_gradient(inp: KLInputs, *, value: str, iw_clip: tuple[float, float]) -> Tensor:
    """The value of K1/K2/K3, the gradient of sg(w_is) * sg(k1) * grad log pi_theta.

    OpenRLHF ``--algo.kl.unbiased_gradient`` (PR #1309, openrlhf/models/utils.py
    ``compute_approx_kl``): "keeps the chosen estimator's forward value but backpropagates through
    ``w * k1 * grad log pi_theta``, where ``w = pi_theta / pi_theta_old`` is the importance weight
    (clamped and detached)", k1 = log pi_theta - log pi_ref.
    """
    k1 = (inp.logp - inp.logp_ref).detach()
    shown = {"k1": k1, "k2": 0.5 * k1**2, "k3": k3_core(-k1)}[value]
    w = torch.exp(inp.logp.detach() - inp.logp_old.detach()).clamp(*iw_clip)
    score = inp.logp - inp.logp.detach()  # value 0, gradient grad log pi_theta
    return shown + w * k1 * score


def _topk_masses(inp: KLInputs, name: str) -> tuple[Tensor, Tensor]:
    require(inp, name, "topk_logp", "topk_logp_ref")
    return inp.topk_logp, inp.topk_logp_ref.detach()  # (B, T, k) student / teacher at the teacher's top-k


def topk_forward_truncated_clamped(inp: KLInputs) -> Tensor:
    """max(0, sum_{i in T} p_i (log p_i - log q_i)): teacher top-k forward KL, clamped at 0.

    verl's on-policy distillation loss ``forward_kl_topk`` (verl/trainer/distillation/.../losses.py),
    as its RFC states it (verl issue #7856): p = teacher (here the anchor), q = student (the policy),
    T = the teacher's top-k. The clamp is ``clamp_min(0)``; clamped tokens carry no gradient.
    """
    lq, lp = _topk_masses(inp, "topk_forward_truncated_clamped")
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


def topk_forward_tail_bucket(inp: KLInputs) -> Tensor:
    """sum_{i in T} p_i log(p_i/q_i) + (1 - P) log((1 - P)/(1 - Q)): the (k+1)-category KL.

    The tail-bucket proposal for verl's top-k distillation (``forward_kl_topk_tail``, RFC verl issue
    #7856, PR #7855): every token outside the teacher's top-k T is one category, P = p(T), Q = q(T);
    p = teacher (the anchor), q = student (the policy). A lower bound of the forward KL.
    """
    lq, lp = _topk_masses(inp, "topk_forward_tail_bucket")
    head = (lp.exp() * (lp - lq)).sum(-1)
    log_tail_p = torch.log1p(-lp.exp().sum(-1).clamp(max=1.0 - 1e-15))  # log(1 - P)
    log_tail_q = torch.log1p(-lq.exp().sum(-1).clamp(max=1.0 - 1e-15))  # log(1 - Q), with grad
    return head + log_tail_p.exp() * (log_tail_p - log_tail_q)


def topk_reverse_score_tail(inp: KLInputs) -> Tensor:
    """Exact reverse KL on the support S plus, outside S, sg(log pi_theta - log pi_ref) * r.

    The per-token top-k-support reverse-KL estimator of NeMo-RL's on-policy distillation (PR #3608,
    nemo_rl/algorithms/opd.py): "the exact reverse-KL contribution is used for a selected top-k
    support; when the sampled target is outside that support, its score-function contribution
    estimates the remaining vocabulary tail"; the tail advantage is the detached log-ratio at the
    current policy; support and teacher values are constants; no importance weight. r = pi/sg(pi)
    (value 1) carries the score, so the value is the sampled tail's log-ratio.
    """
    require(inp, "topk_reverse_score_tail", "tokens", "topk_idx", "topk_logp", "topk_logp_ref")
    lp, lr = inp.topk_logp, inp.topk_logp_ref.detach()
    head = (lp.exp() * (lp - lr)).sum(-1)
    outside = (~in_index_set(inp.tokens, inp.topk_idx)).to(inp.logp.dtype)
    tail_adv = (inp.logp - inp.logp_ref).detach()
    return head + outside * tail_adv * torch.exp(inp.logp - inp.logp.detach())


def topk_reverse_renormalized(inp: KLInputs) -> Tensor:
    """KL(pi_T || ref_T): the reverse KL between the policy and the anchor, each renormalized on T.

    Teacher top-K local support matching of "Revisiting On-Policy Distillation" (arXiv 2603.25562): T = the
    teacher's (here the anchor's) top-K tokens, pi_T(i) = pi(i) / pi(T) and ref_T(i) = ref(i) / ref(T) for i in T,
    and the loss sum_{i in T} pi_T(i) (log pi_T(i) - log ref_T(i)), with no sampled tail. Biased for the KL
    (the mass outside T and the two normalizers are dropped); exact when T is the whole vocabulary. Needs k >= 1.
    """
    require(inp, "topk_reverse_renormalized", "topk_logp", "topk_logp_ref")
    if inp.topk_logp.shape[-1] == 0:
        raise ValueError("topk_reverse_renormalized needs k >= 1: an empty support has no distribution to renormalize")
    lp = inp.topk_logp - torch.logsumexp(inp.topk_logp, -1, keepdim=True)
    lr = inp.topk_logp_ref.detach() - torch.logsumexp(inp.topk_logp_ref.detach(), -1, keepdim=True)
    return (lp.exp() * (lp - lr)).sum(-1)
