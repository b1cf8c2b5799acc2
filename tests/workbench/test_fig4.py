"""The Fig 4 error decomposition against brute force (one autograd pass per sampled token)."""

import pytest
import torch

from analysis.fig4_bias_variance import critical_sizes, gradient_moments, run, tune_scale

from ema_pg.kl import KLInputs, get_estimator


def brute_force(est, z, z_ref, q):
    V = z.shape[0]
    pi = torch.softmax(z, 0)
    gs = []
    for j in range(V):
        t = z.clone().requires_grad_(True)
        lp, lr = torch.log_softmax(t, 0), torch.log_softmax(z_ref, 0)
        tok = torch.tensor([[j]])
        qq = None if q is None else q.view(1, 1, -1)
        inp = KLInputs(logp=lp[tok], logp_old=lp.detach()[tok], logp_ref=lr[tok], tokens=tok, topk_idx=qq,
                       topk_logp=None if q is None else lp[qq], topk_logp_ref=None if q is None else lr[qq])
        (g,) = torch.autograd.grad(est(inp).sum(), t)
        gs.append(g)
    G = torch.stack(gs)  # (V, V)
    return (pi[:, None] * G).sum(0), float((pi * (G**2).sum(-1)).sum())


@pytest.mark.parametrize("name,params,k", [("k4", {}, 0), ("topk_reverse", {"tail": "paper"}, 5),
                                           ("topk_reverse", {"tail": "corrected"}, 5), ("topk_reverse", {"tail": "none"}, 5)])
def test_gradient_moments_equal_brute_force(name, params, k):
    g = torch.Generator().manual_seed(0)
    z, z_ref = torch.randn(40, generator=g, dtype=torch.float64) * 2, torch.randn(40, generator=g, dtype=torch.float64)
    est = get_estimator(name, **({"k": k} if k else {}), **params)
    q = torch.topk(z, k).indices if k else None
    m1, s1 = gradient_moments(est, torch.log_softmax(z, 0), torch.log_softmax(z_ref, 0), q)
    m2, s2 = brute_force(est, z, z_ref, q)
    assert torch.allclose(m1, m2, atol=1e-12) and abs(s1 - s2) < 1e-10 * max(1.0, s2)


def test_monte_carlo_rmse_matches_the_formula():
    """Averages of B sampled per-token gradients: simulated RMSE vs sqrt(bias^2 + var/B)."""
    g = torch.Generator().manual_seed(1)
    z, z_ref = torch.randn(30, generator=g, dtype=torch.float64) * 2, torch.randn(30, generator=g, dtype=torch.float64)
    est = get_estimator("topk_reverse", k=3, tail="paper")
    q = torch.topk(z, 3).indices
    _, _ = gradient_moments(est, torch.log_softmax(z, 0), torch.log_softmax(z_ref, 0), q)
    # per-row gradients by brute force, then sample
    pi = torch.softmax(z, 0)
    G = []
    for j in range(30):
        t = z.clone().requires_grad_(True)
        lp, lr = torch.log_softmax(t, 0), torch.log_softmax(z_ref, 0)
        tok = torch.tensor([[j]])
        inp = KLInputs(logp=lp[tok], logp_old=lp.detach()[tok], logp_ref=lr[tok], tokens=tok, topk_idx=q.view(1, 1, -1),
                       topk_logp=lp[q.view(1, 1, -1)], topk_logp_ref=lr[q.view(1, 1, -1)])
        G.append(torch.autograd.grad(est(inp).sum(), t)[0])
    G = torch.stack(G)
    t = z.clone().requires_grad_(True)
    lp, lr = torch.log_softmax(t, 0), torch.log_softmax(z_ref, 0)
    (g_true,) = torch.autograd.grad((lp.exp() * (lp - lr)).sum(), t)
    mean = (pi[:, None] * G).sum(0)
    var = float((pi * ((G - mean) ** 2).sum(-1)).sum())
    B = 16
    idx = torch.multinomial(pi.expand(4000, -1), B, replacement=True, generator=g)  # (4000, B)
    est_g = G[idx].mean(1)  # (4000, V)
    mc = float(((est_g - g_true) ** 2).sum(-1).mean().sqrt())
    formula = ((mean - g_true).norm() ** 2 + var / B).sqrt().item()
    assert abs(mc - formula) / formula < 0.05


def test_scale_tuning_hits_the_mass():
    z = torch.randn(5000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for m in (0.2, 0.9):
        s = tune_scale(z, m)
        assert abs(float(torch.softmax(s * z, 0).topk(32).values.sum()) - m) < 1e-6


def test_small_grid_orderings():
    res = run(tasks=2, vocab=2000, masses=(0.5,), ks=(8, 64), bs=(1, 64, 4096), progress=False)
    get = lambda e, k, B: float(res[(res.estimator == e) & (res.K == k) & (res.B == B)].rel_rmse.iloc[0])
    for k in (8, 64):
        for B in (1, 64, 4096):
            assert get("top-k (corrected tail)", k, B) < get("sampled (K4)", k, B)
        assert get("truncated", k, 1) == pytest.approx(get("truncated", k, 4096), rel=1e-9)  # a floor: no variance
    assert get("top-k (corrected tail)", 8, 4096) < get("truncated", 8, 4096) < get("top-k (corrected tail)", 8, 1)
    crit = critical_sizes(res)
    assert set(crit.columns) >= {"M32", "K", "B_crit_corrected", "B_crit_paper"}
