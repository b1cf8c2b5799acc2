"""The rollout-correction family against hand-worked weights, and what each does to the PG expectation by enumeration."""

import math

import pytest
import torch

from ema_pg.corrections import CORRECTIONS, correct

# two sequences, three tokens; rho = pi_old / mu per token; the last token of sequence 2 is outside the mask
RHO = torch.tensor([[1.5, 3.0, 0.25], [0.8, 1.2, 7.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
C = 2.0
HAND = {  # each weight worked by hand from the table in ema_pg/corrections.py
    "token_tis": [[1.5, 2.0, 0.25], [0.8, 1.2, 0.0]],  # min(rho_t, 2)
    "seq_tis": [[1.125] * 3, [0.96, 0.96, 0.0]],  # rho_1 = 1.5 * 3 * 0.25 = 1.125; rho_2 = 0.8 * 1.2 = 0.96
    "token_mask": [[1.5, 0.0, 0.0], [0.8, 1.2, 0.0]],  # 3 > 2 and 0.25 < 1/2 leave the band
    "seq_mask": [[1.125] * 3, [0.96, 0.96, 0.0]],  # both sequence ratios inside [1/2, 2]
    "seq_reject": [[0.0] * 3, [1.0, 1.0, 0.0]],  # sequence 1 holds a token with |log rho| = log 4 > log 2
}


def weights(name, rho=RHO, mask=MASK, cap=C):
    logp_b = torch.zeros_like(rho)
    return correct(name, torch.log(rho), logp_b, mask, cap)


@pytest.mark.parametrize("name", list(HAND))
def test_weights_by_hand(name):
    w, _ = weights(name)
    assert torch.allclose(w.double(), torch.tensor(HAND[name], dtype=torch.float64), atol=1e-6), w


def test_every_correction_has_a_hand_worked_case():
    assert set(HAND) | {"none"} == set(CORRECTIONS)


def test_metrics_by_hand():
    _, m = weights("token_mask")
    rho = torch.tensor([1.5, 3.0, 0.25, 0.8, 1.2], dtype=torch.float64)
    assert m["rollout/mismatch_kl_k1"] == pytest.approx(float(-rho.log().mean()), rel=1e-6)
    assert m["rollout/mismatch_kl_k3"] == pytest.approx(float((rho - 1 - rho.log()).mean()), rel=1e-6)
    assert m["rollout/frac_masked"] == pytest.approx(2 / 5)
    assert m["rollout/is_weight_mean"] == pytest.approx((1.5 + 0.8 + 1.2) / 5, rel=1e-6)
    assert m["rollout/frac_rejected"] == 0.0
    assert m["rollout/logp_gap_max"] == pytest.approx(math.log(4), rel=1e-6)
    _, r = weights("seq_reject")
    assert r["rollout/frac_rejected"] == pytest.approx(1 / 2) and r["rollout/frac_masked"] == pytest.approx(3 / 5)
    w, n = weights("none")
    assert w is None and "rollout/is_weight_mean" not in n and n["rollout/mismatch_kl_k1"] == m["rollout/mismatch_kl_k1"]


def test_weights_carry_no_gradient_and_refuse_unknown_names():
    lo = torch.log(RHO).requires_grad_(True)
    w, _ = correct("token_tis", lo, torch.zeros_like(RHO), MASK, C)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="unknown rollout correction 'icepop'"):
        correct("icepop", lo, torch.zeros_like(RHO), MASK, C)


def test_token_tis_with_a_cap_that_never_binds_is_unbiased_and_the_band_is_not():
    """One token position, V = 5, tokens drawn from mu: E_mu[w f] = sum_j mu_j w_j f_j. With w = pi_old/mu
    (token_tis, C large) it is E_pi_old[f] exactly; token_mask with a tight band drops the tokens it masks."""
    g = torch.Generator().manual_seed(0)
    pi_old = torch.softmax(torch.randn(5, generator=g, dtype=torch.float64), -1)
    mu = torch.softmax(torch.log(pi_old) + 0.8 * torch.randn(5, generator=g, dtype=torch.float64), -1)
    f = torch.randn(5, generator=g, dtype=torch.float64)
    lo, lb, mask = torch.log(pi_old).view(5, 1), torch.log(mu).view(5, 1), torch.ones(5, 1, dtype=torch.float64)
    target = float((pi_old * f).sum())
    w, _ = correct("token_tis", lo, lb, mask, 1e9)
    assert float((mu * w.view(-1).double() * f).sum()) == pytest.approx(target, rel=1e-6)
    wm, m = correct("token_mask", lo, lb, mask, 1.3)
    assert m["rollout/frac_masked"] > 0
    assert abs(float((mu * wm.view(-1).double() * f).sum()) - target) > 1e-3
