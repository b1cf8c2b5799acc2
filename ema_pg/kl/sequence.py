"""Sequence-level KL as a reward-side penalty (eq. 10-12), used by the WARP baseline.

KL_seq(y) = log pi(y|x) - log pi_ref(y|x) = sum_n rho_n over the response tokens. Subtracting
beta * sg(KL_seq) from the sequence reward makes the REINFORCE gradient the unbiased
sequence-level KL gradient of eq. 11-12. It is a reward shaping term, not a token estimator:
each token is charged for the divergence of all tokens after it (eq. 15).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sequence_kl_penalty(logp: Tensor, logp_ref: Tensor, mask: Tensor) -> Tensor:
    """(B,) sg(sum_n mask_n (log pi(y_n) - log pi_ref(y_n))): eq. 10 per sequence.

    ``logp`` is the sampling policy's log-prob of each response token (B, T); ``mask`` (B, T)
    selects the policy's own tokens (observation tokens excluded).
    """
    if logp.shape != logp_ref.shape or logp.shape != mask.shape:
        raise ValueError(f"shapes differ: logp {tuple(logp.shape)}, logp_ref {tuple(logp_ref.shape)}, mask {tuple(mask.shape)}")
    rho = torch.where(mask.bool(), logp.detach() - logp_ref.detach(), torch.zeros_like(logp))
    return rho.sum(-1)
