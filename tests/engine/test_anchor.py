import torch

from ema_pg.anchors import get_scheme
from ema_pg.engine.anchor import AnchorCallback


def net(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2)).to(dtype)


def test_ema_update_is_eq_2():
    pol = net()
    an = AnchorCallback(get_scheme("ema", eta=0.9, update_every=1))
    an.attach(pol)
    theta0 = [p.detach().clone() for p in pol.parameters()]
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(1.0)
    an.anchor.apply(pol, 1)
    for p0, p, pa in zip(theta0, pol.parameters(), an.model.parameters()):
        assert torch.allclose(pa, 0.9 * p0 + 0.1 * p)
    lag = sum(((p - pa) ** 2).sum() for p, pa in zip(pol.parameters(), an.model.parameters())) ** 0.5
    assert abs(an.lag_norm(pol) - float(lag.detach())) < 1e-5 and an.updates == 1


def test_fixed_anchor_never_moves():
    pol = net()
    an = AnchorCallback(get_scheme("fixed"))
    an.attach(pol)
    before = [p.clone() for p in an.model.parameters()]
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(5.0)
    an.anchor.apply(pol, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, an.model.parameters()))


def test_fp32_master_keeps_small_updates_a_bf16_copy_would_lose():
    pol = net(torch.bfloat16)
    an = AnchorCallback(get_scheme("ema", eta=0.999, update_every=1))
    an.attach(pol)
    start = {n: t.clone() for n, t in an.master.items()}
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.01)  # each EMA step moves the anchor by 1e-5: below bf16 resolution near 0.3
    for _ in range(100):
        an.anchor.apply(pol, 1)
    moved = torch.cat([(an.master[n] - start[n]).flatten() for n in start])
    assert moved.min() > 5e-4  # 100 steps of ~1e-5 accumulated in fp32
    naive = [start[n].to(torch.bfloat16) for n in start]
    for _ in range(100):  # the same steps done in bf16 arithmetic are lost in rounding
        naive = [(0.999 * a + 0.001 * p.detach()).to(torch.bfloat16) for a, p in zip(naive, pol.parameters())]
    assert all(torch.equal(a, start[n].to(torch.bfloat16)) for a, n in zip(naive, start))  # never moved
    assert an.master["0.weight"].dtype == torch.float32


def test_state_round_trip():
    pol = net()
    a = AnchorCallback(get_scheme("ema", eta=0.5))
    a.attach(pol)
    with torch.no_grad():
        for p in pol.parameters():
            p.mul_(3.0)
    a.anchor.apply(pol, 1)
    b = AnchorCallback(get_scheme("ema", eta=0.5))
    b.load_state_dict(a.state_dict())  # before attach: applied on attach
    b.attach(net())
    assert b.updates == 1
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_fisher_trace_is_the_mean_squared_score_norm():
    """Eq. 28 on a tiny LM: equals the mean of per-sequence ||grad log pi(y|x)||^2 computed by hand."""
    from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
    from ema_pg.engine.monitor import StabilityMonitor, fisher_trace
    from ema_pg.rollout import HFSampler
    from ema_pg.tasks import build_task

    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    m = build_tiny_model(len(tok), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                         tokenizer=tok)
    ro = HFSampler(tok).generate(m, ["1+2=", "33+4="], 2, temperature=1.0, max_new_tokens=4, seed=0)
    got = fisher_trace(m, ro, [0, 3])
    want = 0.0
    for r in (0, 3):
        m.zero_grad()
        out = m(input_ids=ro.input_ids[r:r + 1], attention_mask=ro.attention_mask[r:r + 1],
                position_ids=ro.position_ids[r:r + 1]).logits[0, ro.prompt_len - 1:-1]
        lp = torch.log_softmax(out, -1).gather(-1, ro.input_ids[r, ro.prompt_len:, None])[:, 0]
        (lp * ro.loss_mask[r, ro.prompt_len:]).sum().backward()
        want += sum(float((p.grad ** 2).sum()) for p in m.parameters() if p.grad is not None) / 2
    assert abs(got - want) < 1e-4 * want
    mon = StabilityMonitor(every=1, num_sequences=2, eta=0.9)
    out = mon(m, ro, lr=1.5 / fisher_trace(m, ro, [0, 1]), beta=1.0)  # bound = 1.5: between eta and 1 + eta
    assert out["anchor/regime"] == 1 and abs(out["anchor/alpha_beta_trF"] - 1.5) < 1e-2
    assert mon(m, ro, lr=1e-9, beta=1.0)["anchor/regime"] == 0


def test_reset_anchor_is_the_policy_after_each_update():
    pol = net()
    an = AnchorCallback(get_scheme("reset", update_every=1))  # anchor=reset
    an.attach(pol)
    with torch.no_grad():
        for p in pol.parameters():
            p.mul_(3.0).add_(0.5)
    assert an.lag_norm(pol) > 0
    an.anchor.apply(pol, 1)
    assert all(torch.equal(a, p) for a, p in zip(an.model.parameters(), pol.parameters()))
    assert an.lag_norm(pol) == 0.0


def test_sync_mixes_every_sync_steps_optimizer_steps_in_the_anchors_dtype():
    pol = net(torch.bfloat16)
    an = AnchorCallback(get_scheme("sync", sync_alpha=0.6, sync_steps=3))
    an.attach(pol)
    assert an.master == {}  # no fp32 master: the anchor's own weights are mixed
    ref0 = [p.detach().clone() for p in an.model.parameters()]
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(1.0)
    an.anchor.after_iteration(pol, 1)  # the iteration clock does nothing under sync
    an.after_optimizer_step(pol)
    an.after_optimizer_step(pol)
    assert all(torch.equal(a, b) for a, b in zip(ref0, an.model.parameters())) and an.updates == 0
    an.after_optimizer_step(pol)  # the 3rd optimizer step: mix
    for r0, p, a in zip(ref0, pol.parameters(), an.model.parameters()):
        want = r0.clone().mul_(0.4).add_(p.detach(), alpha=0.6)  # in bf16, as the peers mix
        assert a.dtype == torch.bfloat16 and torch.equal(a, want)
    assert an.updates == 1 and an.optimizer_steps == 3
    state = an.state_dict()
    b = AnchorCallback(get_scheme("sync", sync_alpha=0.6, sync_steps=3))
    b.attach(net(torch.bfloat16))
    b.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(an.model.parameters(), b.model.parameters()))
    assert b.optimizer_steps == 3 and b.updates == 1


def test_anchor_scheme_arguments_are_checked():
    import pytest

    with pytest.raises(ValueError, match="sync_alpha"):
        get_scheme("sync", sync_alpha=0.0, sync_steps=1)
    with pytest.raises(ValueError, match="teacher_path"):
        AnchorCallback(get_scheme("teacher"))
