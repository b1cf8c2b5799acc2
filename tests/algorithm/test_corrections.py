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
    # Geo-RS at C = 1.03: geometric means 1.125^(1/3) = 1.0400 > 1.03 (rejected) and 0.96^(1/2) = 0.9798 >= 1/1.03
    "seq_geo_reject": [[0.0] * 3, [1.0, 1.0, 0.0]],
    # K3-RS at tau = 0.1: mean K3 (0.094535 + 0.901388 + 0.636294) / 3 = 0.5441 > 0.1 (rejected); (0.023144 +
    # 0.017678) / 2 = 0.0204 kept
    "seq_k3_reject": [[0.0] * 3, [1.0, 1.0, 0.0]],
}
BOUNDS = {"seq_geo_reject": {"cap": 1.03}, "seq_k3_reject": {"threshold": 0.1}}  # the rest at C = 2


def weights(name, rho=RHO, mask=MASK, cap=C):
    logp_b = torch.zeros_like(rho)
    b = {"cap": cap, "threshold": 0.0, **BOUNDS.get(name, {})}
    return correct(name, torch.log(rho), logp_b, mask, b["cap"], b["threshold"])


def test_the_sequence_mean_rejections_turn_at_their_bounds():
    w, _ = correct("seq_geo_reject", torch.log(RHO), torch.zeros_like(RHO), MASK, 1.05)  # 1.0400 < 1.05: kept now
    assert w[0].tolist() == [1.0, 1.0, 1.0]
    w, _ = correct("seq_k3_reject", torch.log(RHO), torch.zeros_like(RHO), MASK, C, 0.55)  # 0.5441 <= 0.55
    assert w[0].tolist() == [1.0, 1.0, 1.0]
    w, _ = correct("seq_k3_reject", torch.log(RHO), torch.zeros_like(RHO), MASK, C, 0.02)  # 0.0204 > 0.02
    assert w[1].tolist() == [0.0, 0.0, 0.0]


def test_deepseeks_off_policy_sequence_mask_by_hand():
    from ema_pg.corrections import off_policy_sequence_mask

    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    behaviour = torch.zeros(3, 2)
    logp = torch.tensor([[-0.4, -0.8], [-0.3, -0.5], [-2.0, -9.0]], requires_grad=True)  # drifts 0.6, 0.4, 2.0
    adv = torch.tensor([-1.0, -1.0, 0.5])
    m = off_policy_sequence_mask(adv, logp, behaviour, mask, 0.5)
    assert m[:, 0].tolist() == [0.0, 1.0, 1.0] and not m.requires_grad  # A >= 0 always stays; 0.4 <= 0.5 stays
    assert off_policy_sequence_mask(adv, logp, behaviour, mask, 0.7)[:, 0].tolist() == [1.0, 1.0, 1.0]
    per_token_adv = adv[:, None].expand(3, 2)  # the sequence's advantage is its first column
    assert torch.equal(off_policy_sequence_mask(per_token_adv, logp, behaviour, mask, 0.5), m)


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


def test_a_run_trains_with_dppo_and_the_off_policy_sequence_mask(tmp_path, monkeypatch):
    """Both reach the update: dppo_tv as the surrogate, and DeepSeek's mask on every micro-batch, read against the
    sampler's log-probs (here pi_old's: the HF sampler is the trainer) and the policy as it is at that minibatch; the
    logged count is the masks' (the real function runs, watched)."""
    import pandas as pd
    from helpers import compose_cfg

    import ema_pg.update as update
    from ema_pg.corrections import off_policy_sequence_mask
    from ema_pg.train import train

    seen = []

    def watched(adv, logp, behaviour, mask, delta):
        out = off_policy_sequence_mask(adv, logp, behaviour, mask, delta)
        seen.append((float((out[:, 0] == 0).sum()), float((behaviour - logp.detach()).abs().max()), delta))
        return out

    monkeypatch.setattr(update, "off_policy_sequence_mask", watched)
    _, objs = train(compose_cfg(["algo.loss=dppo_tv", "algo.opsm_delta=0.25", "algo.ppo_epochs=2",
                                 "algo.minibatch_size=8", "algo.clip_ratio_c=3"], tmp_path))
    df = pd.read_csv(objs["run_dir"] / "metrics.csv")
    assert len(seen) == 4 * 2 * 2 and {d for *_, d in seen} == {0.25}  # iterations x epochs x minibatches
    assert seen[0][1] < 1e-5  # the first minibatch is on-policy: the sampler's log-probs are the policy's
    per_iteration = [sum(c for c, *_ in seen[i * 4:(i + 1) * 4]) / 4 for i in range(4)]  # mean over the 4 updates
    assert df["train/opsm_masked_seqs"].dropna().tolist() == pytest.approx(per_iteration)
    assert df["train/loss"].dropna().map(math.isfinite).all()


@pytest.mark.parametrize("change, match", [
    (["rollout.correction=seq_k3_reject"], "rejects a sequence whose mean K3 exceeds rollout.correction_threshold"),
    (["algo.opsm_delta=-0.1"], "algo.opsm_delta=-0.1: the mean log-ratio"),
    (["algo.loss=cispo", "algo.clip_ratio_c=3"], "is the dual clip of algo.loss=ppo \\(or the ratio's truncation of"),
])
def test_the_new_knobs_refuse_bad_values_in_one_line(change, match, tmp_path):
    from helpers import compose_cfg

    from ema_pg.config import ConfigError
    from ema_pg.train import train

    with pytest.raises(ConfigError, match=match):
        train(compose_cfg(change, tmp_path))
