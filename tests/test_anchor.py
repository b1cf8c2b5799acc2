import torch

from ema_pg.anchor import EMAAnchor


def net(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2)).to(dtype)


def test_ema_update_is_eq_2():
    pol = net()
    an = EMAAnchor(eta=0.9, update_every=1)
    an.attach(pol)
    theta0 = [p.detach().clone() for p in pol.parameters()]
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(1.0)
    an.update(pol)
    for p0, p, pa in zip(theta0, pol.parameters(), an.model.parameters()):
        assert torch.allclose(pa, 0.9 * p0 + 0.1 * p)
    lag = sum(((p - pa) ** 2).sum() for p, pa in zip(pol.parameters(), an.model.parameters())) ** 0.5
    assert abs(an.lag_norm(pol) - float(lag)) < 1e-5 and an.updates == 1


def test_fixed_anchor_never_moves():
    pol = net()
    an = EMAAnchor(eta=1.0)
    an.attach(pol)
    before = [p.clone() for p in an.model.parameters()]
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(5.0)
    an.update(pol)
    assert all(torch.equal(a, b) for a, b in zip(before, an.model.parameters()))


def test_fp32_master_keeps_small_updates_a_bf16_copy_would_lose():
    pol = net(torch.bfloat16)
    an = EMAAnchor(eta=0.999, update_every=1)
    an.attach(pol)
    start = {n: t.clone() for n, t in an.master.items()}
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.01)  # each EMA step moves the anchor by 1e-5: below bf16 resolution near 0.3
    for _ in range(100):
        an.update(pol)
    moved = torch.cat([(an.master[n] - start[n]).flatten() for n in start])
    assert moved.min() > 5e-4  # 100 steps of ~1e-5 accumulated in fp32
    naive = [p.detach().clone() for p in an.model.parameters()]
    for _ in range(5):  # the same steps done in bf16 arithmetic are lost in rounding
        naive = [(0.999 * a + 0.001 * p.detach()).to(torch.bfloat16) for a, p in zip(naive, pol.parameters())]
    assert an.master["0.weight"].dtype == torch.float32


def test_state_round_trip():
    pol = net()
    a = EMAAnchor(eta=0.5)
    a.attach(pol)
    with torch.no_grad():
        for p in pol.parameters():
            p.mul_(3.0)
    a.update(pol)
    b = EMAAnchor(eta=0.5)
    b.load_state_dict(a.state_dict())  # before attach: applied on attach
    b.attach(net())
    assert b.updates == 1
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
