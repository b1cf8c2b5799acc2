"""Exact token-level KL from full logits (Table 1, eq. 18 and §F.1): O(|V|) memory per token.

Always on-policy: the sum runs over the whole vocabulary, so no sampled token and no
off-policy weight enter. Unbiased in value and gradient by definition.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import KLInputs, require


def exact_reverse(inp: KLInputs) -> Tensor:
    """KL(pi_theta || pi_ref) = sum_j pi_theta(j) [log pi_theta(j) - log pi_ref(j)]."""
    require(inp, "exact_reverse", "logits", "ref_logits")
    lp = torch.log_softmax(inp.logits, dim=-1)  # (B, T, V)
    lr = torch.log_softmax(inp.ref_logits.detach(), dim=-1)  # (B, T, V)
    return (lp.exp() * (lp - lr)).sum(-1)  # (B, T)


def exact_forward(inp: KLInputs) -> Tensor:
    """KL(pi_ref || pi_theta) = sum_j pi_ref(j) [log pi_ref(j) - log pi_theta(j)]."""
    require(inp, "exact_forward", "logits", "ref_logits")
    lp = torch.log_softmax(inp.logits, dim=-1)  # (B, T, V)
    lr = torch.log_softmax(inp.ref_logits.detach(), dim=-1)  # (B, T, V)
    return (lr.exp() * (lr - lp)).sum(-1)  # (B, T)
