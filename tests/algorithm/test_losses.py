"""The GRPO loss of Appendix A: hand-computed advantages, aggregations and surrogate values."""

import pytest
import torch

from ema_pg.kl import KLInputs, get_estimator
from ema_pg.losses import LossSpec, PPOClip, advantages, aggregate, policy_loss, ppo_surrogate

R = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])


PAPER = {"spec": LossSpec(PPOClip(eps_low=0.2, eps_high=0.28, clip_ratio_c=0.0),  # Appendix A
                          loss_agg="seq-mean-token-mean", entropy_coef=0.0)}


def test_group_advantages_by_hand():
    # group 1: mean .25, unbiased std sqrt(.75/3) = .5 -> (1.5, -.5, -.5, -.5)
    # group 2: mean .5, std sqrt(1/3) -> +-0.5*sqrt(3) = +-0.8660254
    a = advantages(R, 4, "group", eps=0.0)
    assert a.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.8660254, 0.8660254, -0.8660254, -0.8660254], abs=1e-6)


def test_global_advantages_by_hand():
    # centered (.75,-.25,-.25,-.25,.5,.5,-.5,-.5): mean 0, unbiased std sqrt(1.75/7) = .5
    a = advantages(R, 4, "global", eps=0.0)
    assert a.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 1.0, 1.0, -1.0, -1.0], abs=1e-6)


def test_no_normalization_keeps_the_group_baseline():
    assert advantages(R, 4, "none").tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])


def test_constant_group_gives_zero_advantage_not_nan():
    a = advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, "group")
    assert a[:2].tolist() == [0.0, 0.0] and torch.isfinite(a).all()


@pytest.mark.parametrize("kw,match", [({"group_size": 1, "norm": "group"}, "group_size must be >= 2"), ({"group_size": 3, "norm": "group"}, "multiple of group_size"),
                                      ({"group_size": 4, "norm": "batch"}, "group, global, none")])
def test_advantage_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        advantages(R, **kw)


PT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode,norm_len,expected",
    [("seq-mean-token-mean", None, (1.5 + 4.0) / 2), ("token-mean", None, 7.0 / 3),
     ("seq-mean-token-sum-norm", None, (3.0 / 3 + 4.0 / 3) / 2), ("seq-mean-token-sum-norm", 4, (3.0 / 4 + 4.0 / 4) / 2)],
)
def test_aggregation_by_hand(mode, norm_len, expected):
    assert aggregate(PT, MASK, mode, norm_len).item() == pytest.approx(expected)


def test_aggregation_ignores_masked_inf_and_nan():
    x = PT.clone()
    x[0, 2], x[1, 1] = float("inf"), float("nan")
    assert aggregate(x, MASK, "token-mean").item() == pytest.approx(7.0 / 3)


def test_surrogate_by_hand():
    logp_old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0]])  # per token
    J, info = ppo_surrogate(logp, logp_old, adv, 0.2, 0.28, 0.0)
    # 1.5 with A>0 -> clipped at 1.28; 0.5 with A<0 -> clipped at 0.8 * -1; 0.5 with A>0 -> 0.5
    assert J.tolist()[0] == pytest.approx([1.28, -0.8, 0.5])
    assert info["clipped_high"].tolist() == [[True, False, False]]
    assert info["clipped_low"].tolist() == [[False, True, False]]
    J.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, 0.5])  # s * M * A


def test_mask_form_equals_min_form_in_value_and_gradient():
    g = torch.Generator().manual_seed(1)
    logp_old = -torch.rand(16, 9, generator=g, dtype=torch.float64) * 3
    logp0 = logp_old + torch.randn(16, 9, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(16, generator=g, dtype=torch.float64)
    a = logp0.clone().requires_grad_(True)
    J, _ = ppo_surrogate(a, logp_old, adv, 0.2, 0.28, 0.0)
    J.sum().backward()
    b = logp0.clone().requires_grad_(True)
    ratio = torch.exp(b - logp_old)
    A = adv[:, None]
    ref = torch.minimum(ratio * A, ratio.clamp(0.8, 1.28) * A)
    ref.sum().backward()
    assert torch.allclose(J, ref) and torch.allclose(a.grad, b.grad)
    # and the gradient is the paper's s * M * A * grad log pi
    M = ~(((A > 0) & (ratio > 1.28)) | ((A < 0) & (ratio < 0.8)))
    assert torch.allclose(a.grad, (ratio * M * A).detach())
    assert (~M).any() and M.any()  # both branches exercised


def test_grpo_loss_puts_no_loss_and_no_kl_on_masked_tokens():
    B, T = 2, 4
    logp = (-torch.rand(B, T)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]])
    kl = torch.rand(B, T)
    kl_poisoned = torch.where(mask.bool(), kl, torch.full_like(kl, 1e30))
    adv = torch.tensor([1.0, -1.0])
    l1, m1 = policy_loss(logp, logp.detach(), adv, mask, kl, beta=0.5, **PAPER)
    l2, m2 = policy_loss(logp, logp.detach(), adv, mask, kl_poisoned, beta=0.5, **PAPER)
    assert l1.item() == pytest.approx(l2.item()) and m1["kl"].item() == pytest.approx(m2["kl"].item())
    l1.backward()
    assert (logp.grad[~mask.bool()] == 0).all() and (logp.grad[mask.bool()] != 0).all()


def test_grpo_loss_by_hand_with_kl():
    # on-policy (ratio 1): J = A; loss = agg(-A + beta*KL); seq-mean-token-mean
    logp = torch.zeros(2, 2)
    kl = torch.tensor([[2.0, 4.0], [6.0, 8.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, m = policy_loss(logp, logp, torch.tensor([1.0, -2.0]), mask, kl, beta=0.1, **PAPER)
    # seq 0: mean(-1 + .2, -1 + .4) = -0.7 ; seq 1: (2 + .6) = 2.6 ; mean = 0.95
    assert loss.item() == pytest.approx(0.95)
    assert m["kl"].item() == pytest.approx(4.0) and m["clip_frac_low"].item() == 0.0
    assert m["ratio_mean"].item() == pytest.approx(1.0)


def test_tis_weight_scales_the_policy_gradient_term_only():
    # pg_weight w: loss = agg(-w * J + beta * KL); by hand on-policy (J = A), seq-mean-token-mean
    logp = torch.zeros(2, 2, requires_grad=True)
    kl = torch.tensor([[2.0, 4.0], [6.0, 8.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    w = torch.tensor([[0.5, 2.0], [3.0, 7.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, m = policy_loss(logp, logp.detach(), adv, mask, kl, beta=0.1, pg_weight=w, **PAPER)
    # seq 0: mean(-0.5 + .2, -2 + .4) = -0.95 ; seq 1: (6 + .6) = 6.6 ; mean = 2.825
    assert loss.item() == pytest.approx(2.825)
    assert m["pg_loss"].item() == pytest.approx((-1.25 + 6.0) / 2)
    loss.backward()  # d/dlogp of -w * A * ratio at ratio 1 = -w * A, over the seq-mean-token-mean weights
    assert torch.allclose(logp.grad, torch.tensor([[-0.5 / 4, -2.0 / 4], [6.0 / 2, 0.0]]))
    ones, _ = policy_loss(logp, logp.detach(), adv, mask, kl, beta=0.1, pg_weight=torch.ones(2, 2), **PAPER)
    none, _ = policy_loss(logp, logp.detach(), adv, mask, kl, beta=0.1, **PAPER)
    assert ones.item() == none.item()


def test_loss_with_a_registry_estimator_end_to_end():
    B, T, V = 4, 3, 6
    logits = torch.randn(B, T, V, requires_grad=True)
    lp = torch.log_softmax(logits, -1)
    tok = torch.randint(0, V, (B, T))
    logp = lp.gather(-1, tok[..., None])[..., 0]
    idx = lp.detach().topk(2, -1).indices
    lr = torch.log_softmax(torch.randn(B, T, V), -1)
    inp = KLInputs(logp=logp, logp_old=logp.detach(), logp_ref=lr.gather(-1, tok[..., None])[..., 0], tokens=tok,
                   topk_idx=idx, topk_logp=lp.gather(-1, idx), topk_logp_ref=lr.gather(-1, idx))
    kl = get_estimator("topk_reverse", k=2)(inp)
    loss, m = policy_loss(logp, logp.detach(), torch.randn(B), torch.ones(B, T), kl, beta=0.1, **PAPER)
    loss.backward()
    assert logits.grad.abs().sum() > 0 and torch.isfinite(loss)
