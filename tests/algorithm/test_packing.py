"""Padding-free passes (ema_pg.packing): the layout, and every score equal to the padded pass's across the model
matrix, in float64 so that "equal to rounding" is tight: log-probs, the index set's log-probs, a model's own top-k,
entropy, full logits, and the gradient of a loss through all of them; prefixes shared and not; LoRA."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from ema_pg.heads import head
from ema_pg.packing import PACKED, has_dropout, pack, pack_problem
from ema_pg.rollout.base import Rollouts
from test_model_matrix import ARCHS

V = 40


def batch(seed: int = 0, N: int = 8, P: int = 5, T: int = 12) -> Rollouts:
    """Rows as a multi-turn sampler leaves them: left-padded prompts of 2-5 tokens, responses of policy tokens
    (loss mask 1) with an observation span (loss mask 0) inside some, right padding; rows 1-3 begin as row 0 does
    (a shared prompt, then a shared first turn of 0, 3 and 6 response tokens), row 5 repeats row 4 whole."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (N, P + T), generator=g)
    am = torch.zeros(N, P + T, dtype=torch.long)
    lm = torch.zeros(N, P + T, dtype=torch.long)
    for r in range(N):
        plen, rlen = 2 + r % 4, 4 + (3 * r) % (T - 3)
        am[r, P - plen : P + rlen] = 1
        lm[r, P : P + rlen] = 1
        if r % 3 == 1:  # an observation inside the response
            lm[r, P + 2 : P + 4] = 0
    for r, shared in ((1, 0), (2, 3), (3, 6)):  # row 0's prompt and length, and its first `shared` response tokens
        am[r], ids[r, : P + shared] = am[0], ids[0, : P + shared]
        lm[r] = torch.cat([torch.zeros(P, dtype=torch.long), am[r, P:]])
    ids[5], am[5], lm[5] = ids[4], am[4], lm[4]
    ids = torch.where(am.bool(), ids, torch.zeros_like(ids))  # padding holds the pad id
    return Rollouts(input_ids=ids, attention_mask=am, loss_mask=lm, prompt_len=P, prompt_index=list(range(N)))


def real_rows(b: Rollouts) -> list[tuple[int, ...]]:
    return [tuple(b.input_ids[r][b.attention_mask[r].bool()].tolist()) for r in range(len(b))]


def test_pack_lays_out_each_distinct_prefix_once():
    b = batch()
    seqs = real_rows(b)
    prefixes = {s[:i] for s in seqs for i in range(1, len(s) + 1)}
    for share, nodes in ((True, len(prefixes)), (False, sum(len(s) for s in seqs))):
        p = pack(b, share)
        assert p.tokens == nodes
        for r, s in enumerate(seqs):  # each row reads its own tokens, at their positions
            n = p.gather[r, : len(s)]
            assert p.input_ids[0, n].tolist() == list(s)
            assert p.position_ids[0, n].tolist() == list(range(len(s)))
        L = p.gather.shape[1]
        laid = torch.cat([g.flatten() for g in p.buckets])  # the rows' nodes as attention lays them out
        assert torch.equal(laid[p.rep], torch.arange(p.tokens))  # a node's output is read where its creator holds it
        assert sum(len(g) for g in p.buckets) == len(b)  # every row in one bucket
        m = b.response_mask.bool()  # the scored positions are the policy tokens, predicted by the token before
        assert sorted(zip(p.rows.tolist(), p.cols.tolist())) == sorted(map(tuple, m.nonzero().tolist()))
        assert torch.equal(p.targets, b.input_ids[:, b.prompt_len:][p.rows, p.cols])
        assert p.padded_tokens == b.input_ids.numel() and L == max(map(len, seqs))
    assert pack(b, True).tokens < pack(b, False).tokens  # the guard: this batch has prefixes to share


def model_of(name: str, dtype=torch.float64):
    make, _ = ARCHS[name]
    cfg = make(V)
    if name == "gemma2":
        cfg.attn_logit_softcapping = 5.0  # bends these tiny logits: the packed attention's soft-cap is exercised
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).to(dtype)


def scores_and_grad(model, b: Rollouts, index, packing):
    """(log-probs, index log-probs, entropy, gradient of a loss of all three) at the policy tokens."""
    model.zero_grad(set_to_none=True)
    out = head(model, b, index=index, entropy=True, chunk=7, packing=packing)
    m = b.response_mask.bool()
    loss = (out.logp[m] ** 2).sum() + out.index_logp[m].sin().sum() + out.entropy[m].sum()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.logp[m], out.index_logp[m], out.entropy[m], grads


@pytest.mark.parametrize("name", list(ARCHS))
def test_packed_passes_equal_the_padded_ones_across_the_model_matrix(name):
    model = model_of(name)
    assert pack_problem(model) is None
    model.eval()  # no dropout draws: the same computation in both layouts (GPT-2's dropout is tested below)
    b = batch()
    index = torch.randint(0, V, (len(b), b.input_ids.shape[1] - b.prompt_len, 4), generator=torch.Generator().manual_seed(1))
    ref = scores_and_grad(model, b, index, None)
    for share in (False, True):  # float64 weights, but the norms compute in float32 inside (RMSNorm casts), so the
        # layouts agree to float32 rounding (~1e-7 relative; a shared node's gradient sums the rows before the norm)
        got = scores_and_grad(model, b, index, pack(b, share))
        for a, g in zip(ref, got):
            torch.testing.assert_close(g, a, rtol=1e-5, atol=5e-5)
    m = b.response_mask.bool()
    with torch.no_grad():  # the no-grad pass: a model's own top-k, and full logits for the exact estimators
        a = head(model, b, topk=5, entropy=True, chunk=7)
        g = head(model, b, topk=5, entropy=True, chunk=7, packing=pack(b))
        torch.testing.assert_close(g.index_logp[m], a.index_logp[m], rtol=1e-6, atol=1e-6)
        assert torch.equal(g.index[m], a.index[m])
        torch.testing.assert_close(g.logp[m], a.logp[m], rtol=1e-6, atol=1e-6)
        assert torch.equal(g.logp[~m], torch.zeros_like(g.logp[~m]))  # nothing is scored outside the loss mask
        fa = head(model, b, full_logits=True, index=index)
        fg = head(model, b, full_logits=True, index=index, packing=pack(b))
        torch.testing.assert_close(fg.logits[m], fa.logits[m], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fg.index_logp[m], fa.index_logp[m], rtol=1e-6, atol=1e-6)
    assert model.config._attn_implementation != PACKED  # restored after each pass


def test_rows_are_bucketed_by_length_at_the_least_attention_cost():
    """The exact dynamic program against every grouping of a small batch's sorted lengths into at most 4 runs."""
    from itertools import combinations

    from ema_pg.packing import BUCKET_COST, length_buckets

    lens = torch.tensor([300, 12, 290, 150, 20, 160, 155, 310, 18])
    got = length_buckets(lens)
    cost = lambda groups: sum(len(g) * int(lens[g].max()) ** 2 + BUCKET_COST for g in groups)
    x = torch.argsort(lens, stable=True)
    best = min(cost([x[i:j] for i, j in zip((0, *cuts), (*cuts, len(x)))])
               for k in range(4) for cuts in combinations(range(1, len(x)), k))
    assert cost(got) == best and sorted(torch.cat(got).tolist()) == list(range(len(lens)))
    assert len(got) > 1  # the guard: these lengths are worth splitting


def test_a_model_with_dropout_packs_its_rows_apart():
    """GPT-2 drops activations in training: sharing a prefix would share one mask among rows, so the run's packer
    does not share for it, while a model without dropout shares."""
    from ema_pg.config import AlgoConfig
    from ema_pg.packing import packer

    gpt2, qwen = model_of("gpt2"), model_of("qwen2")
    assert has_dropout(gpt2) and not has_dropout(qwen)
    b = batch()
    assert packer(AlgoConfig(), gpt2)(b).tokens == pack(b, False).tokens
    assert packer(AlgoConfig(), qwen)(b).tokens == pack(b, True).tokens
    assert packer(AlgoConfig(padding_free=False), qwen)(b) is None


def test_a_model_that_cannot_pack_is_named_in_one_line():
    model = model_of("qwen2")
    model.config._attn_implementation = "flash_attention_2"
    problem = pack_problem(model)
    assert "Qwen2ForCausalLM" in problem and "algo.padding_free=false" in problem and "\n" not in problem


def test_a_lora_policy_packs_as_its_padded_pass():
    from ema_pg.engine.lora import add_anchor_adapter, wrap_lora

    policy = wrap_lora(model_of("qwen2"), rank=4, alpha=8.0, targets="all-linear")
    with torch.no_grad():  # adapters away from zero, so that they change the scores
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    anchor = add_anchor_adapter(policy)
    policy.eval()
    b = batch(1)
    index = torch.randint(0, V, (len(b), b.input_ids.shape[1] - b.prompt_len, 3))
    ref, got = scores_and_grad(policy, b, index, None), scores_and_grad(policy, b, index, pack(b))
    for a, g in zip(ref, got):
        torch.testing.assert_close(g, a, rtol=1e-5, atol=1e-5)
    m = b.response_mask.bool()
    with torch.no_grad():  # the anchor adapter, through its view of the policy
        torch.testing.assert_close(head(anchor, b, packing=pack(b)).logp[m], head(anchor, b).logp[m], rtol=1e-6, atol=1e-6)


DETERMINISM = r"""
import sys, torch
torch.set_num_threads(2)
from ema_pg.engine.models import build_tiny_model
from ema_pg.heads import head
from ema_pg.packing import pack
from ema_pg.rollout.base import Rollouts
m = build_tiny_model(1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, seed=0)
g = torch.Generator().manual_seed(1)
N, P, T = 32, 100, 300
ids = torch.randint(3, 1024, (N, P + T), generator=g)
for r in range(N):  # 8 samples share each prompt: shared prefix nodes, read by 8 rows
    ids[r, :P] = ids[r - r % 8, :P]
am = torch.ones(N, P + T, dtype=torch.long)
for r in range(N):
    am[r, P + 20 + 8 * r:] = 0
lm = am.clone()
lm[:, :P] = 0
ro = Rollouts(input_ids=ids * am, attention_mask=am, loss_mask=lm, prompt_len=P, prompt_index=[r // 8 for r in range(N)])
out = head(m, ro, packing=pack(ro, True))
(out.logp * ro.response_mask).sum().backward()
torch.save([p.grad for p in m.parameters()], sys.argv[1])
"""


@pytest.mark.slow  # two processes of a 4-layer update, 25 s
def test_a_packed_update_on_two_threads_repeats_itself_in_another_process(tmp_path):
    """The gradient of a shared prefix node sums what the rows that read it send back; on several CPU threads the
    default accumulation summed them in an order that varied between processes, so a run on 2 threads did not
    repeat itself (the demo gave 0.832-0.867). Two processes now give the same bits."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for i in (1, 2):
        r = subprocess.run([sys.executable, "-c", DETERMINISM, str(tmp_path / f"{i}.pt")], capture_output=True,
                           text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_shared_nodes_gradient_is_its_readers_sum_in_reading_order_and_compiles_whole():
    """The backward of a row gather (``_Rows``, :func:`node_sums`) sums each node's gradients in reading order, bit for
    bit the sum a loop over the reads gives (half precision accumulated in float32), with nodes read by every row;
    it touches no process-wide switch (torch's deterministic mode is global to every thread), and is traced whole:
    compiled without a graph break, the same bits."""
    from unittest import mock

    from ema_pg.packing import _Rows, node_sums

    g = torch.Generator().manual_seed(0)
    S, n, L, H, D = 30, 6, 25, 2, 3
    index = torch.randint(0, S, (n, L), generator=g)
    index.view(-1)[:S] = torch.arange(S)  # every node read at least once
    index[:, :4] = torch.arange(4)  # four nodes read by every row
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(S, H, D, generator=g).to(dtype).requires_grad_()
        w = torch.randn(n, L, H, D, generator=g).to(dtype)
        want = torch.zeros(S, H, D)
        for pos, node in enumerate(index.reshape(-1).tolist()):
            want[node] = want[node] + w.reshape(-1, H, D)[pos].float()
        want = want.to(dtype)
        with mock.patch("torch.use_deterministic_algorithms", side_effect=AssertionError("a process-wide switch")):
            (got,) = torch.autograd.grad(_Rows.apply(x, index), x, w)
        assert torch.equal(got, want), dtype
    torch.library.opcheck(node_sums, (w, index, S))  # its fake (shape) function, schema and autograd registration
    compiled = torch.compile(lambda x: (_Rows.apply(x, index) * w).sum(), fullgraph=True, backend="aot_eager")
    (got,) = torch.autograd.grad(compiled(x), x)
    assert torch.equal(got, want)
