"""Attention for grouped-query models on CPU without copying the keys and values.

transformers' ``sdpa`` attention repeats each key/value head for its query heads
(``repeat_kv``, a copy of the whole KV cache per layer and decode step) whenever a padding
mask is present on a device other than XPU/MPS. PyTorch's CPU kernel takes grouped-query
attention directly (``enable_gqa=True``) with a mask, so on CPU this function hands it the
unrepeated tensors. The result is the same computation (the kernel indexes head
``h // group`` instead of reading a copy); on a 4-query / 2-key-value-head model it cut the
sampler's time by 13% (``benchmarks/rl_step.py``). Other devices keep transformers' path.

:func:`use_fast_attention` switches a loaded model to it; models built or loaded by
:mod:`ema_pg.engine.models` get it there. The choice is not saved with a model (it is set after
loading), so saved folders load anywhere.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

NAME = "ema_pg_sdpa"


def gqa_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     is_causal=None, **kwargs):
    """transformers' attention signature: (B, Hq, L, D) query, (B, Hkv, S, D) key/value -> ((B, L, Hq, D), None)."""
    if query.device.type != "cpu" or key.shape[1] == query.shape[1] or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0, scale=scaling,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and causal), enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_fast_attention(model):
    """Switch a model that uses ``sdpa`` attention to :func:`gqa_sdpa_forward`; others are left as they are."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
    return model
