"""The chunked head against the materialized path, float32: values, top-k sets, gradients."""

import pytest
import torch

from ema_pg.chunked import auto_chunk, chunked_head_nograd, chunked_logprobs
from ema_pg.kl import ESTIMATORS, KLInputs, get_estimator

N, H, V, K = 96, 24, 211, 8


@pytest.fixture()
def data():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g) * 0.5
    W = torch.randn(V, H, generator=g) * 0.5
    W_ref = W + 0.1 * torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    return h, W, W_ref, t


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("chunk", [1, 7, 32, N])
@pytest.mark.parametrize("tau", [1.0, 0.8])
def test_nograd_outputs_match_materialized(data, chunk, tau):
    h, W, _, t = data
    z = (h @ W.T) / tau
    lp = torch.log_softmax(z, -1)
    idx = torch.randint(0, V, (N, 5))
    out = chunked_head_nograd(h, W, t, k=K, index=idx, entropy=True, temperature=tau, chunk=chunk)
    assert rel(out.logp, lp.gather(-1, t[:, None])[:, 0]) < 1e-5
    assert rel(out.lse, torch.logsumexp(z, -1)) < 1e-5
    v, i = lp.topk(K, -1)
    assert out.topk_idx.dtype == torch.int32
    assert torch.equal(out.topk_idx.long().sort(-1).values, i.sort(-1).values)  # same sets (no ties here)
    assert rel(out.topk_logp, v) < 1e-5
    assert rel(out.index_logp, lp.gather(-1, idx)) < 1e-5
    assert rel(out.entropy, -(lp.exp() * lp).sum(-1)) < 1e-5


@pytest.mark.parametrize("name", [n for n in ESTIMATORS if not ESTIMATORS[n].needs_full_logits and n != "none"])
def test_every_estimator_gets_the_same_gradients(data, name):
    """KL computed from the chunked head vs from materialized logits: grads w.r.t. h and W."""
    h0, W0, W_ref, t = data
    params = {"k": K} if "k" in ESTIMATORS[name].defaults else {}
    est = get_estimator(name, **params)
    with torch.no_grad():
        z_old = h0 @ W0.T
        src = z_old if est.topk_source != "anchor" else h0 @ W_ref.T
        q = src.topk(K, -1).indices if params else None
        lr = torch.log_softmax(h0 @ W_ref.T, -1)
        lo = torch.log_softmax(z_old, -1).gather(-1, t[:, None])[:, 0]

    def kl_sum(chunked: bool):
        h, W = h0.clone().requires_grad_(True), W0.clone().requires_grad_(True)
        if chunked:
            logp, ixl = chunked_logprobs(h, W, t, q, 1.0, chunk=13)
        else:
            lp = torch.log_softmax(h @ W.T, -1)
            logp, ixl = lp.gather(-1, t[:, None])[:, 0], None if q is None else lp.gather(-1, q)
        inp = KLInputs(logp=logp[None], logp_old=lo[None], logp_ref=lr.gather(-1, t[:, None])[:, 0][None], tokens=t[None],
                       topk_idx=None if q is None else q[None], topk_logp=None if ixl is None else ixl[None],
                       topk_logp_ref=None if q is None else lr.gather(-1, q)[None])
        val = est(inp).sum()
        gh, gW = torch.autograd.grad(val, (h, W))
        return val.detach(), gh, gW

    v1, gh1, gW1 = kl_sum(True)
    v2, gh2, gW2 = kl_sum(False)
    assert abs(float(v1 - v2)) <= 1e-5 * max(1.0, abs(float(v2)))
    assert rel(gh1, gh2) < 1e-5 and rel(gW1, gW2) < 1e-5


def test_bf16_inputs_accumulate_in_float32(data):
    h, W, _, t = data
    out = chunked_head_nograd(h.bfloat16(), W.bfloat16(), t, k=4, chunk=10)
    ref = torch.log_softmax((h.bfloat16() @ W.bfloat16().T).float(), -1).gather(-1, t[:, None])[:, 0]
    assert out.logp.dtype == torch.float32 and rel(out.logp, ref) < 1e-3


def test_bf16_gradients_match_the_float32_head_of_the_same_inputs(data):
    """bf16 h and W over several chunks: the gradients of log pi(y) and of the log-probs at an index equal those of
    the head formed in float32 from the same bf16 values, to bf16 rounding (each chunk's W-gradient is a bf16 GEMM
    added to a float32 total)."""
    h, W, _, t = data
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, W.shape[0], (h.shape[0], 4), generator=g)
    gl, gi = torch.randn(h.shape[0], generator=g), torch.randn(h.shape[0], 4, generator=g)
    hb, Wb = h.bfloat16().requires_grad_(True), W.bfloat16().requires_grad_(True)
    logp, ixl = chunked_logprobs(hb, Wb, t, q, 1.0, chunk=7)
    ghb, gWb = torch.autograd.grad((logp * gl).sum() + (ixl * gi).sum(), (hb, Wb))
    hf, Wf = hb.detach().float().requires_grad_(True), Wb.detach().float().requires_grad_(True)
    lp = torch.log_softmax(hf @ Wf.T, -1)
    ghf, gWf = torch.autograd.grad((lp.gather(-1, t[:, None])[:, 0] * gl).sum() + (lp.gather(-1, q) * gi).sum(), (hf, Wf))
    assert ghb.dtype == gWb.dtype == torch.bfloat16
    assert rel(ghb.float(), ghf) < 1e-2 and rel(gWb.float(), gWf) < 1e-2


def test_the_chunk_budget_is_the_devices_unless_set():
    from ema_pg.chunked import chunk_budget_mb

    assert chunk_budget_mb(None, "cpu") == 256.0 and chunk_budget_mb(None, "cuda") == 4096.0
    assert chunk_budget_mb(64.0, "cuda") == 64.0 and chunk_budget_mb(None, "mps") == 256.0  # a CPU's elsewhere
    assert auto_chunk(10**6, 151_936, chunk_budget_mb(None, "cuda")) == 4096 * 2**20 // (151_936 * 4 * 3) == 2355


def test_auto_chunk_respects_the_budget():
    c = auto_chunk(10_000, 151_936, budget_mb=64)
    assert c * 151_936 * 4 * 3 <= 64 * 2**20 and c >= 1
    assert auto_chunk(10, 100) == 10


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("entropy", [False, True])
def test_soft_capped_logits_value_and_gradient_match_the_materialized_path(tau, entropy):
    """Gemma 2/3: logits = c tanh(h W^T / c) / tau. float64, a cap small enough to bend the logits."""
    g = torch.Generator().manual_seed(3)
    h0, W0 = torch.randn(N, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    t, q = torch.randint(0, V, (N,), generator=g), torch.randint(0, V, (N, 5), generator=g)
    cap = 3.0
    gl, gi, ge = (torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, 5, generator=g, dtype=torch.float64),
                  torch.randn(N, generator=g, dtype=torch.float64))

    def run(chunked: bool):
        h, W = h0.clone().requires_grad_(True), W0.clone().requires_grad_(True)
        if chunked:
            outs = chunked_logprobs(h, W, t, q, tau, 11, entropy, cap)
        else:
            lp = torch.log_softmax(cap * torch.tanh(h @ W.T / cap) / tau, -1)
            outs = (lp.gather(-1, t[:, None])[:, 0], lp.gather(-1, q)) + ((-(lp.exp() * lp).sum(-1),) if entropy else ())
        loss = (outs[0] * gl).sum() + (outs[1] * gi).sum() + ((outs[2] * ge).sum() if entropy else 0)
        return [o.detach() for o in outs], torch.autograd.grad(loss, (h, W))

    (o1, g1), (o2, g2) = run(True), run(False)
    for a, b in zip(o1 + list(g1), o2 + list(g2)):
        assert rel(a, b) < 1e-10
    uncapped = chunked_head_nograd(h0, W0, t, temperature=tau)
    assert rel(uncapped.logp, o2[0]) > 1e-2  # the cap does bend these logits: the test can tell
    nog = chunked_head_nograd(h0, W0, t, k=K, index=q, entropy=True, temperature=tau, chunk=7, softcap=cap)
    assert rel(nog.logp, o2[0]) < 1e-10 and rel(nog.index_logp, o2[1]) < 1e-10
