"""The base-algorithm variants and the authors' remaining KL knobs, each against its equation.

KL options by exact enumeration (float64, V = 7, as in test_kl_enumeration); surrogates and
aggregations against hand-worked values and a direct, per-sequence formula.
"""

import math

import pytest
import torch

from ema_pg.chunked import chunked_logprobs
from ema_pg.kl import get_estimator
from ema_pg.kl.enumeration import enumeration_inputs, expected_value_and_grad, true_kl_and_grad
from ema_pg.losses import LossSpec, PPOClip, aggregate, cispo_surrogate, policy_loss, gspo_surrogate, ppo_surrogate

V = 7
WIDE = (0.0, 1e9)


def triplet(seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(V, generator=g, dtype=torch.float64) * s for s in (1.5, 1.0, 1.2))


def close(a, b, tol=1e-10):
    return torch.allclose(a, b, atol=tol, rtol=tol)


# ---------------------------------------------------------------- "+" variants: K_n's value, K2's gradient
@pytest.mark.parametrize("name,value_dir", [("k1", "reverse"), ("k3", "reverse"), ("k3pp", "reverse"),
                                            ("k4", "reverse"), ("k5", "forward")])
@pytest.mark.parametrize("off_policy", [False, True])
def test_straight_through_keeps_the_value_and_takes_k2s_unbiased_reverse_gradient(name, value_dir, off_policy):
    theta, ref, samp = triplet(2)
    clip = WIDE if off_policy else None
    est = get_estimator(name, straight_through=True, **({"iw_clip": clip} if clip else {}))
    plain = get_estimator(name, **({"iw_clip": clip} if clip else {}))
    s = samp if off_policy else None
    val, grad = expected_value_and_grad(est, theta, ref, s)
    val_plain, _ = expected_value_and_grad(plain, theta, ref, s)
    kl_value, _ = true_kl_and_grad(theta, ref, value_dir)
    _, rev_grad = true_kl_and_grad(theta, ref, "reverse")
    assert close(val, val_plain) and close(val, kl_value)
    assert close(grad, rev_grad)
    assert est.direction == "reverse"


def test_k3_plus_differs_from_k3_in_gradient_only():
    theta, ref, _ = triplet(4)
    v1, g1 = expected_value_and_grad(get_estimator("k3"), theta, ref)
    v2, g2 = expected_value_and_grad(get_estimator("k3", straight_through=True), theta, ref)
    assert close(v1, v2)
    assert (g1 - g2).abs().max() > 1e-3  # K3's gradient is the forward KL's, K3+'s the reverse KL's


# ---------------------------------------------------------------- the authors' clamp of K3 / K3++
@pytest.mark.parametrize("name", ["k3", "k3pp", "k5"])
def test_clamp_is_exact_inside_its_range(name):
    theta, ref, _ = triplet(5)
    theta, ref = theta * 0.5, ref * 0.5  # every |log w| < 20 and every K3 < 10
    lw = torch.log_softmax(ref, -1) - torch.log_softmax(theta, -1)
    assert float(lw.abs().max()) < 20 and float((lw.exp() - 1 - lw).max()) < 10
    a = expected_value_and_grad(get_estimator(name, clamp=True), theta, ref)
    b = expected_value_and_grad(get_estimator(name), theta, ref)
    assert close(a[0], b[0]) and close(a[1], b[1])


@pytest.mark.parametrize("name", ["k3", "k3pp"])
def test_clamp_bounds_the_value_and_stops_the_gradient_where_it_bites(name):
    theta, ref, _ = triplet(6)
    theta, ref = theta * 0.5, ref * 0.5
    ref[0] = -60.0  # the anchor gives token 0 ~e^-60: log w ~ -60 there, K3 ~ 59
    est, plain = get_estimator(name, clamp=True), get_estimator(name)
    th = theta.clone().requires_grad_(True)
    inp, _ = enumeration_inputs(est, th, ref)
    per_row = est(inp)[:, 0]  # (V,) one value per sampled token
    assert float(plain(inp)[0, 0].detach()) > 50
    assert float(per_row[0].detach()) == pytest.approx(10.0)
    assert bool((per_row <= 10.0).all())
    (g0,) = torch.autograd.grad(per_row[0], th, retain_graph=True)
    if name == "k3":
        assert float(g0.abs().max()) == 0.0  # clamped: no gradient from that token
    else:  # K3++ = r * clamp(K3): the score-function part stays, weighted by the clamped value 10
        (score,) = torch.autograd.grad(torch.log_softmax(th, -1)[0], th)
        assert close(g0, 10.0 * score)
    assert float(per_row[1].detach()) < 10
    (g1,) = torch.autograd.grad(per_row[1], th)
    assert float(g1.abs().max()) > 0.0  # the other tokens keep theirs


def test_k5_clamp_bounds_log_w_as_the_authors_do():
    """K5 with clamp: sg(w) log w + log r with log w clamped to [-20, 20]; the tail token's log w = +40 reads 20."""
    theta, ref, _ = triplet(8)
    theta, ref = theta * 0.5, ref * 0.5
    theta[0] = -45.0  # pi(0) ~ e^-45 where the anchor gives it ~e^-1: log w ~ +44 at token 0
    est, plain = get_estimator("k5", clamp=True), get_estimator("k5")
    th = theta.clone().requires_grad_(True)
    inp, _ = enumeration_inputs(est, th, ref)
    lw = float((inp.logp_ref - inp.logp)[0, 0].detach())
    assert lw > 40
    assert float(est(inp)[0, 0].detach()) == pytest.approx(math.exp(20.0) * 20.0, rel=1e-12)
    assert float(plain(inp)[0, 0].detach()) == pytest.approx(math.exp(lw) * lw, rel=1e-9)
    (g0,) = torch.autograd.grad(est(inp)[0, 0], th)
    (score,) = torch.autograd.grad(torch.log_softmax(th, -1)[0], th)
    assert close(g0, score)  # the clamped log w is constant: only log r's score is left
    rows = slice(1, None)  # elsewhere the clamp changes nothing
    assert torch.allclose(est(inp)[rows], plain(inp)[rows])


# ---------------------------------------------------------------- abs
def test_abs_is_the_expected_absolute_log_ratio_and_biased_for_the_kl():
    theta, ref, _ = triplet(7)
    val, grad = expected_value_and_grad(get_estimator("abs"), theta, ref)
    th = theta.clone().requires_grad_(True)
    lp, lr = torch.log_softmax(th, -1), torch.log_softmax(ref, -1)
    p = lp.detach().exp()
    want = (p * (lp - lr).abs()).sum()  # sg(pi) |log pi - log ref|: its gradient is E[sign * score]
    (want_grad,) = torch.autograd.grad(want, th)
    assert close(val, want.detach()) and close(grad, want_grad)
    kl, kl_grad = true_kl_and_grad(theta, ref, "reverse")
    assert abs(float(val - kl)) > 1e-3 and (grad - kl_grad).abs().max() > 1e-3


def test_kl_flags_must_be_booleans():
    with pytest.raises(ValueError, match="clamp must be true or false"):
        get_estimator("k3", clamp=1)
    with pytest.raises(ValueError, match="takes no parameter"):
        get_estimator("k4", clamp=True)


# ---------------------------------------------------------------- surrogates
def test_dual_clip_bounds_negative_advantage_tokens_at_c_times_a():
    logp_old = torch.zeros(1, 4, dtype=torch.float64)
    ratio = torch.tensor([[0.5, 1.0, 2.5, 4.0]], dtype=torch.float64)
    logp = ratio.log().requires_grad_(True)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    J, info = ppo_surrogate(logp, logp_old, adv, 0.2, 0.28, 3.0)
    # A < 0: min(rA, clip(r)A) = [-0.8 (clipped low), -1, -2.5, -4]; the dual clip bounds -4 at 3A = -3
    assert J.detach()[0].tolist() == pytest.approx([-0.8, -1.0, -2.5, -3.0])
    (g,) = torch.autograd.grad(J.sum(), logp)
    assert g[0].tolist() == pytest.approx([0.0, -1.0, -2.5, 0.0])  # d(rA)/dlog r = rA where unclipped
    assert info["clipped_dual"].tolist() == [[False, False, False, True]]
    J0, _ = ppo_surrogate(logp, logp_old, adv, 0.2, 0.28, 0.0)
    assert float(J0[0, 3].detach()) == pytest.approx(-4.0)  # off: plain PPO
    Jp, _ = ppo_surrogate(logp, logp_old, -adv, 0.2, 0.28, 3.0)  # positive advantages are untouched
    assert float(Jp[0, 3].detach()) == pytest.approx(1.28)


def test_gspo_equals_the_sequence_level_objective_in_value_and_gradient():
    torch.manual_seed(0)
    B, T = 3, 5
    logp = (-torch.rand(B, T, dtype=torch.float64)).requires_grad_(True)
    logp_old = logp.detach() + 0.05 * torch.randn(B, T, dtype=torch.float64)
    logp_old[2] -= 0.5  # sequence 2: ratio ~ e^0.5, clipped for A > 0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    J, info = gspo_surrogate(logp, logp_old, adv, mask, 0.2, 0.28)
    loss = aggregate(-J, mask, "seq-mean-token-mean")
    (g,) = torch.autograd.grad(loss, logp)
    # the direct formula: s_i = exp(mean_t (log pi - log pi_old)), J_i = min(s A, clip(s) A)
    th = logp.detach().clone().requires_grad_(True)
    m = mask.double()
    s = torch.exp(((th - logp_old) * m).sum(-1) / m.sum(-1))
    want = -torch.minimum(s * adv, s.clamp(0.8, 1.28) * adv).mean()
    (wg,) = torch.autograd.grad(want, th)
    assert close(loss.detach(), want.detach()) and close(g, wg)
    assert bool(info["clipped_high"][2].all()) and not bool(info["clipped_high"][0].any())


def test_cispo_keeps_every_token_and_weighs_it_by_the_clipped_ratio():
    logp_old = torch.zeros(1, 3, dtype=torch.float64)
    ratio = torch.tensor([[0.5, 1.1, 2.0]], dtype=torch.float64)
    logp = ratio.log().requires_grad_(True)
    adv = torch.tensor([2.0], dtype=torch.float64)
    J, info = cispo_surrogate(logp, logp_old, adv, 0.2, 0.28)
    w = [0.8, 1.1, 1.28]
    assert J.detach()[0].tolist() == pytest.approx([2 * x for x in w])
    (g,) = torch.autograd.grad(J.sum(), logp)  # d/dlog pi = sg(w) A: no token loses its gradient
    assert g[0].tolist() == pytest.approx([2 * x for x in w])
    assert info["clipped_high"].tolist() == [[False, False, True]]
    Jp, _ = ppo_surrogate(logp, logp_old, adv, 0.2, 0.28, 0.0)  # PPO drops the clipped token's gradient
    (gp,) = torch.autograd.grad(Jp.sum(), logp)
    assert float(gp[0, 2]) == 0.0


def test_dppo_masks_the_token_probabilitys_move_not_its_ratio_by_hand():
    """DPPO (verl's dppo_tv / dppo_kl): p_old = 0.5 everywhere; sequence 1 (A = +1) moves its tokens to 0.8 and 0.6,
    sequence 2 (A = -1) to 0.2 and 0.9. The kept tokens' gradient is A min(ratio, c) with c = 1.5."""
    from ema_pg.losses import dppo_surrogate

    logp_old = torch.full((2, 2), math.log(0.5), dtype=torch.float64)
    logp = torch.tensor([[0.8, 0.6], [0.2, 0.9]], dtype=torch.float64).log().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    J, info = dppo_surrogate(logp, logp_old, adv, 0.2, 0.2, 1.5, "tv")
    (g,) = torch.autograd.grad(J.sum(), logp)
    # TV: +0.3 > 0.2 masked, +0.1 kept (ratio 1.2); -0.3 < -0.2 masked, +0.4 kept (ratio 1.8, truncated to 1.5)
    assert g.flatten().tolist() == pytest.approx([0.0, 1.2, 0.0, -1.5])
    assert info["clipped_high"].tolist() == [[True, False], [False, False]]
    assert info["clipped_low"].tolist() == [[False, False], [True, False]]
    # binary KL of 0.5 -> 0.8 (and of 0.5 -> 0.2): 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.22314; at eps 0.25 it is
    # kept, where TV's difference 0.3 still leaves eps 0.25
    (gk,) = torch.autograd.grad(dppo_surrogate(logp, logp_old, adv, 0.25, 0.25, 1.5, "kl")[0].sum(), logp)
    (gt,) = torch.autograd.grad(dppo_surrogate(logp, logp_old, adv, 0.25, 0.25, 1.5, "tv")[0].sum(), logp)
    assert gk.flatten().tolist() == pytest.approx([1.5, 1.2, -0.4, -1.5]) and gt[0, 0] == 0.0 and gt[1, 0] == 0.0
    (g0,) = torch.autograd.grad(dppo_surrogate(logp, logp_old, adv, 0.2, 0.2, 1.5, "kl")[0].sum(), logp)
    assert g0.flatten().tolist() == pytest.approx([0.0, 1.2, 0.0, -1.5])  # 0.22314 > 0.2 on both moved tokens


def test_seq_mean_token_sum_aggregation():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert float(aggregate(x, mask, "seq-mean-token-sum")) == pytest.approx(((1 + 2) + (4 + 6)) / 2)


def test_the_entropy_bonus_adds_the_exact_entropy_gradient():
    torch.manual_seed(1)
    N, H = 6, 5
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, H, dtype=torch.float64)
    t = torch.randint(0, V, (N,))
    logp, _, ent = chunked_logprobs(h, W, t, None, 1.0, 4, entropy=True)
    mask = torch.ones(2, 3)
    spec = LossSpec(PPOClip(eps_low=0.2, eps_high=0.28, clip_ratio_c=0.0), loss_agg="seq-mean-token-mean",
                    entropy_coef=0.1)
    adv = torch.zeros(2, dtype=torch.float64)  # no policy gradient: only the bonus moves
    loss, m = policy_loss(logp.view(2, 3), logp.detach().view(2, 3), adv, mask, None, beta=0.0, spec=spec,
                        entropy=ent.view(2, 3))
    (g,) = torch.autograd.grad(loss, h)
    lp = torch.log_softmax(h @ W.T, -1)
    want = -0.1 * (-(lp.exp() * lp).sum(-1)).mean()
    (wg,) = torch.autograd.grad(want, h)
    assert close(loss.detach(), want.detach()) and close(g, wg)
    assert float(m["entropy_cur"]) == pytest.approx(float(-want.detach() / 0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp.view(2, 3), logp.detach().view(2, 3), adv, mask, None, beta=0.0, spec=spec)


def test_unknown_surrogate_and_bad_dual_clip_are_refused_at_config_time():
    from ema_pg.config import ConfigError, compose, validate

    for over, msg in ((["algo.loss=trpo"], "algo.loss"), (["algo.clip_ratio_c=0.5"], "clip_ratio_c"),
                      (["algo.loss=gspo", "algo.clip_ratio_c=3"], "clip_ratio_c")):
        with pytest.raises(ConfigError, match=msg):
            validate(compose(["experiment=demo", *over]))
