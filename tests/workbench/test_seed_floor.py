"""The floor ``benchmarks/seed_cost.py`` puts beside a seed's cost, worked by hand on a small shape."""

from __future__ import annotations

import pytest
from transformers import Qwen2Config

from benchmarks.seed_cost import flop_floor


def test_the_seed_floor_is_five_forwards_over_the_shared_layout(tmp_path):
    Qwen2Config(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                vocab_size=10).save_pretrained(tmp_path)
    tokens = {"real": 100, "shared": 60, "policy": 20, "padded": 150, "rows": 10}
    f = flop_floor(tmp_path, tokens, iterations=1, rate=1e3, per_row_len=10)
    # per token: q, o 8x8; k, v 8x4; gate, up, down 8x16 -> 576 multiply-adds; causal attention 4 * 10 * 8 / 2 = 160
    # FLOPs; the output layer 2 * 8 * 10 on the 20 policy tokens only
    shared_forward = 2 * 576 * 60 + 160 * 60 + 2 * 8 * 10 * 20
    assert f["shared_forward_flops"] == pytest.approx(shared_forward)
    assert f["seed_floor_flops"] == pytest.approx(5 * shared_forward)  # sample 1, anchor 1, update 3
    assert f["seed_floor_s"] == pytest.approx(5 * shared_forward / 1e3)
    assert f["shared_update_floor_s"] == pytest.approx(3 * shared_forward / 1e3)
    real_forward = 2 * 576 * 100 + 160 * 100 + 2 * 8 * 10 * 20
    assert f["update_flops"] == pytest.approx(3 * real_forward) and f["anchor_flops"] == pytest.approx(real_forward)
    assert f["padded_update_flops"] == pytest.approx(3 * (2 * 576 * 150 + 160 * 150 + 2 * 8 * 10 * 150))
