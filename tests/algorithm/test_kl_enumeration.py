"""Every estimator against the paper's equations by exact enumeration (float64, V = 7).

E_p[f] = sum_j pi_sampling(j) f_j and E_p[grad f] its autograd gradient: no sampling, so each
"unbiased" claim of Table 1 is checked to 1e-10, and each "biased" claim by a gap far above it.
"""

import pytest
import torch

from ema_pg.kl import DIVERGENCES, get_estimator
from ema_pg.kl.enumeration import expected_value_and_grad, true_kl_and_grad

V = 7
WIDE = (0.0, 1e9)  # an iw_clip that never clips


def logits_triplet(seed: int):
    g = torch.Generator().manual_seed(seed)
    z = lambda s: torch.randn(V, generator=g, dtype=torch.float64) * s
    return z(1.5), z(1.0), z(1.2)  # policy, anchor, sampling policy


def close(a, b, tol=1e-10):
    return torch.allclose(a, b, atol=tol, rtol=tol)


SETTINGS = [("on", None), ("off", "samp")]


def run(name, setting, seed=0, **params):
    theta, ref, samp = logits_triplet(seed)
    est = get_estimator(name, **params)
    return est, theta, ref, expected_value_and_grad(est, theta, ref, samp if setting == "off" else None)


# ---------------------------------------------------------------- unbiased where Table 1 says so
UNBIASED = [
    ("k3pp", "reverse", {}), ("k4", "reverse", {}), ("k5", "forward", {}),
    ("exact_reverse", "reverse", {}), ("exact_forward", "forward", {}),
] + [
    (name, d, {"k": k, "tail": "corrected"})
    for name, d in (("topk_reverse", "reverse"), ("topk_forward", "forward"))
    for k in (0, 1, 3, V)
]


@pytest.mark.parametrize("setting", ["on", "off"])
@pytest.mark.parametrize("name,direction,params", UNBIASED)
@pytest.mark.parametrize("seed", [0, 1])
def test_unbiased_value_and_gradient(name, direction, params, setting, seed):
    if name.startswith(("k", "topk")):
        params = {**params, "iw_clip": WIDE}
    est, theta, ref, (val, grad) = run(name, setting, seed, **params)
    kl, kl_grad = true_kl_and_grad(theta, ref, direction)
    assert close(val, kl), (val, kl)
    assert close(grad, kl_grad), (grad, kl_grad)


def test_k_zero_is_the_sampled_estimator():
    theta, ref, samp = logits_triplet(3)
    for topk, sampled in (("topk_reverse", "k4"), ("topk_forward", "k5")):
        a = expected_value_and_grad(get_estimator(topk, k=0, iw_clip=WIDE), theta, ref, samp)
        b = expected_value_and_grad(get_estimator(sampled, iw_clip=WIDE), theta, ref, samp)
        assert close(a[0], b[0]) and close(a[1], b[1])
        assert get_estimator(topk, k=0).topk_source is None


def test_k_equals_vocab_is_exact_for_every_tail():
    theta, ref, samp = logits_triplet(4)
    for name, d in (("topk_reverse", "reverse"), ("topk_forward", "forward")):
        kl, g = true_kl_and_grad(theta, ref, d)
        for tail in ("none", "paper", "corrected"):
            v, gr = expected_value_and_grad(get_estimator(name, k=V, tail=tail), theta, ref, samp)
            assert close(v, kl) and close(gr, g, 1e-9)


def test_unbiased_on_any_index_set_not_only_topk():
    """§5.3: unbiased regardless of whether the indices are the top-k."""
    theta, ref, samp = logits_triplet(5)
    q = torch.tensor([6, 0, 2])  # an arbitrary set
    for name, d in (("topk_reverse", "reverse"), ("topk_forward", "forward")):
        v, g = expected_value_and_grad(get_estimator(name, k=3, iw_clip=WIDE), theta, ref, samp, topk_idx=q)
        kl, kg = true_kl_and_grad(theta, ref, d)
        assert close(v, kl) and close(g, kg)


# ---------------------------------------------------------------- biased where Table 1 says so
@pytest.mark.parametrize("setting", ["on", "off"])
def test_k1_value_unbiased_gradient_zero(setting):
    _, theta, ref, (val, grad) = run("k1", setting, iw_clip=WIDE)
    kl, kl_grad = true_kl_and_grad(theta, ref, "reverse")
    assert close(val, kl)
    assert close(grad, torch.zeros_like(grad))
    assert kl_grad.norm() > 0.1  # so a zero expected gradient is a real bias


@pytest.mark.parametrize("setting", ["on", "off"])
def test_k2_value_biased_gradient_reverse(setting):
    _, theta, ref, (val, grad) = run("k2", setting, iw_clip=WIDE)
    kl, kl_grad = true_kl_and_grad(theta, ref, "reverse")
    assert (val - kl).abs() > 1e-2
    assert close(grad, kl_grad)


@pytest.mark.parametrize("setting", ["on", "off"])
def test_k3_value_unbiased_gradient_is_forward_kl(setting):
    _, theta, ref, (val, grad) = run("k3", setting, iw_clip=WIDE)
    kl, rev_grad = true_kl_and_grad(theta, ref, "reverse")
    _, fwd_grad = true_kl_and_grad(theta, ref, "forward")
    assert close(val, kl)
    assert close(grad, fwd_grad)
    assert (grad - rev_grad).norm() > 1e-2


def test_no_offpolicy_correction_is_biased_off_policy():
    """iw_clip = (1, 1) drops s: under pi_sampling != pi_theta the value is no longer the KL."""
    for name, d, p in (("k4", "reverse", {}), ("k5", "forward", {}), ("topk_reverse", "reverse", {"k": 3})):
        _, theta, ref, (val, grad) = run(name, "off", iw_clip=(1.0, 1.0), **p)
        kl, kg = true_kl_and_grad(theta, ref, d)
        assert (val - kl).abs() > 1e-3 and (grad - kg).norm() > 1e-3, name


def test_tight_iw_clip_is_biased_wide_is_not():
    theta, ref, samp = logits_triplet(6)
    kl, _ = true_kl_and_grad(theta, ref, "reverse")
    tight = expected_value_and_grad(get_estimator("k4", iw_clip=(0.9, 1.1)), theta, ref, samp)[0]
    wide = expected_value_and_grad(get_estimator("k4", iw_clip=WIDE), theta, ref, samp)[0]
    assert (tight - kl).abs() > 1e-3 and close(wide, kl)


# ---------------------------------------------------------------- the printed Alg 1/2 tail
@pytest.mark.parametrize("setting", ["on", "off"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name,direction,sign", [("topk_reverse", "reverse", +1.0), ("topk_forward", "forward", -1.0)])
def test_paper_tail_unbiased_value_gradient_off_by_head_mass(name, direction, sign, k, setting):
    est, theta, ref, (val, grad) = run(name, setting, k=k, tail="paper", iw_clip=WIDE)
    kl, kl_grad = true_kl_and_grad(theta, ref, direction)
    assert close(val, kl)
    # the head-mass gradient grad pi_theta(q) with q the same index set the estimator used
    _, samp = logits_triplet(0)[1:]
    src = {"reverse": samp if setting == "off" else theta, "forward": ref}[direction]
    q = torch.topk(src, k).indices
    t = theta.clone().requires_grad_(True)
    (mass_grad,) = torch.autograd.grad(torch.softmax(t, -1)[q].sum(), t)
    assert close(grad, kl_grad + sign * mass_grad)
    assert mass_grad.norm() > 1e-3  # the bias is real, not a rounding artefact


# ---------------------------------------------------------------- truncated KL
@pytest.mark.parametrize("name,direction", [("topk_reverse", "reverse"), ("topk_forward", "forward")])
def test_truncated_kl_is_biased(name, direction):
    est, theta, ref, (val, grad) = run(name, "on", k=3, tail="none")
    kl, kl_grad = true_kl_and_grad(theta, ref, direction)
    assert (val - kl).abs() > 1e-3
    assert (grad - kl_grad).norm() > 1e-3
    # its value is exactly the head of the KL sum
    lp, lr = torch.log_softmax(theta, -1), torch.log_softmax(ref, -1)
    q = torch.topk(theta if direction == "reverse" else ref, 3).indices
    head = (lp.exp() * (lp - lr))[q].sum() if direction == "reverse" else (lr.exp() * (lr - lp))[q].sum()
    assert close(val, head)


# ---------------------------------------------------------------- Top-k f-divergences (App. H)
def closed_form_fdiv(theta, ref, divergence, alpha=0.5):
    """Table 5's D_f = sum_j Q(j) f(P(j)/Q(j)), written directly from the table."""
    P, Q = torch.softmax(theta, -1), torch.softmax(ref, -1)
    t = P / Q
    f = {
        "forward_kl": lambda t: -torch.log(t),
        "reverse_kl": lambda t: t * torch.log(t),
        "pearson": lambda t: (t - 1) ** 2,
        "neyman": lambda t: (t - 1) ** 2 / t,
        "hellinger": lambda t: 0.5 * (torch.sqrt(t) - 1) ** 2,
        "js": lambda t: 0.5 * (t * torch.log(t) - (t + 1) * torch.log((t + 1) / 2)),
        "tv": lambda t: 0.5 * (t - 1).abs(),
        "alpha": lambda t: (t**alpha - 1 - alpha * (t - 1)) / (alpha * (alpha - 1)),
    }[divergence]
    return (Q * f(t)).sum()


@pytest.mark.parametrize("divergence", list(DIVERGENCES))
@pytest.mark.parametrize("k", [0, 3, V])
@pytest.mark.parametrize("setting", ["on", "off"])
def test_topk_fdiv_matches_table5_closed_forms(divergence, k, setting):
    est, theta, ref, (val, grad) = run("topk_fdiv", setting, k=k, divergence=divergence, iw_clip=WIDE)
    t = theta.clone().requires_grad_(True)
    d = closed_form_fdiv(t, ref, divergence)
    (dg,) = torch.autograd.grad(d, t)
    assert close(val, d.detach(), 1e-9)
    assert close(grad, dg, 1e-9)


def test_fdiv_known_identities():
    theta, ref, _ = logits_triplet(7)
    kl_r, _ = true_kl_and_grad(theta, ref, "reverse")
    kl_f, _ = true_kl_and_grad(theta, ref, "forward")
    assert close(closed_form_fdiv(theta, ref, "reverse_kl"), kl_r)
    assert close(closed_form_fdiv(theta, ref, "forward_kl"), kl_f)
    P, Q = torch.softmax(theta, -1), torch.softmax(ref, -1)
    assert close(closed_form_fdiv(theta, ref, "tv"), 0.5 * (P - Q).abs().sum())
    assert close(closed_form_fdiv(theta, ref, "hellinger"), 0.5 * ((P.sqrt() - Q.sqrt()) ** 2).sum())
    M = (P + Q) / 2
    js = 0.5 * (P * (P / M).log()).sum() + 0.5 * (Q * (Q / M).log()).sum()
    assert close(closed_form_fdiv(theta, ref, "js"), js)


def test_fdiv_reverse_kl_agrees_with_corrected_topk_reverse_in_expectation_not_per_sample():
    theta, ref, samp = logits_triplet(8)
    a = get_estimator("topk_fdiv", k=3, divergence="reverse_kl", iw_clip=WIDE)
    b = get_estimator("topk_reverse", k=3, tail="corrected", iw_clip=WIDE)
    va, ga = expected_value_and_grad(a, theta, ref, samp)
    vb, gb = expected_value_and_grad(b, theta, ref, samp)
    assert close(va, vb) and close(ga, gb)
    # per-sample gradients differ: K4 keeps a baseline that Kf++ does not
    from ema_pg.kl.enumeration import enumeration_inputs

    t = theta.clone().requires_grad_(True)
    inp, _ = enumeration_inputs(a, t, ref, samp)
    tail_row = int((~(inp.topk_idx[:, 0] == inp.tokens).any(-1)).nonzero()[0])
    (g1,) = torch.autograd.grad(a(inp)[tail_row].sum(), t, retain_graph=True)
    (g2,) = torch.autograd.grad(b(inp)[tail_row].sum(), t)
    assert (g1 - g2).norm() > 1e-3
