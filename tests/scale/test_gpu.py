"""CUDA paths; each test skips itself when no GPU is present."""

import pytest
import torch

from ema_pg.chunked import chunked_head_nograd, chunked_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_chunked_head_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(64, 32, generator=g), torch.randn(500, 32, generator=g)
    t, idx = torch.randint(0, 500, (64,), generator=g), torch.randint(0, 500, (64, 8), generator=g)
    cpu = chunked_head_nograd(h, W, t, k=8, index=idx, chunk=16)
    gpu = chunked_head_nograd(h.cuda(), W.cuda(), t.cuda(), k=8, index=idx.cuda(), chunk=16)
    assert torch.allclose(cpu.logp, gpu.logp.cpu(), atol=1e-4)
    hc, Wc = h.cuda().requires_grad_(True), W.cuda().requires_grad_(True)
    lp, ix = chunked_logprobs(hc, Wc, t.cuda(), idx.cuda(), 1.0, 16)
    (lp.sum() + ix.sum()).backward()
    assert torch.isfinite(hc.grad).all() and torch.isfinite(Wc.grad).all()
