"""The step's fast paths compute what transformers' reference paths compute.

- ``ema_pg_sdpa`` (grouped-query attention without repeated key/value copies) against
  transformers' ``sdpa`` and ``eager`` attention: logits and gradients, with padding;
- the sampler's growing KV cache against transformers' ``DynamicCache``: the same tokens and
  log-probs, across a buffer reallocation and a multi-turn observation block.
"""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ema_pg.engine.attention import NAME, use_fast_attention
from ema_pg.engine.models import build_tiny_model, load_model_dir, save_model_dir, train_bpe_tokenizer
from ema_pg.rollout import HFSampler
from ema_pg.rollout import hf as hf_rollout
from ema_pg.rollout.hf import GrowingLayer
from ema_pg.scores import ScoreRequest
from ema_pg.tasks import build_task
from helpers import per_row


@pytest.fixture(scope="module")
def gqa_policy():
    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    m = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         tokenizer=tok, seed=3)
    return m, tok


def _padded_batch(tok):
    enc = tok(["1+2=", "12+345=3", "7"], return_tensors="pt", padding=True, add_special_tokens=False)
    am = enc["attention_mask"]
    return enc["input_ids"], am, (am.cumsum(-1) - 1).clamp(min=0)


def _logits_and_grads(m, tok):
    """Logits of the padded batch and the parameters' gradients of a loss over its real positions."""
    ids, am, pos = _padded_batch(tok)
    m.zero_grad()
    logits = m(input_ids=ids, attention_mask=am, position_ids=pos).logits
    (logits * am[..., None]).pow(2).mean().backward()  # padded rows' garbage is excluded
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    return logits.detach(), grads, am.bool()


def _assert_same_values_and_grads(a, b):
    (la, ga, real), (lb, gb, _) = a, b
    assert (la - lb)[real].abs().max() < 1e-5
    for x, y in zip(ga, gb):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-4)


def _multi_turn(m, tok, max_new_tokens: int):
    """Six sampled rows of two prompts; the first three stops get an observation block fed through the cache."""
    calls = {"n": 0}

    def observation(row, text):  # a multi-turn block on the first stop of every row
        calls["n"] += 1
        return " 1 2 3" if calls["n"] < 4 else None

    return HFSampler(tok).generate(m, ["1+2=", "12+345="], 3, on_stop=per_row(observation), temperature=1.0,
                                   max_new_tokens=max_new_tokens, seed=5, stop=["+"],
                                   score=ScoreRequest(topk=3, entropy=True))


def test_models_built_or_loaded_here_use_the_fast_attention(gqa_policy, tmp_path):
    m, tok = gqa_policy
    assert m.config._attn_implementation == NAME
    loaded, _ = load_model_dir(save_model_dir(m, tok, tmp_path / "m"))
    assert loaded.config._attn_implementation == NAME
    assert "_attn_implementation" not in (tmp_path / "m" / "config.json").read_text()  # not saved: loads anywhere


@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_gqa_attention_equals_transformers_attention_in_value_and_gradient(gqa_policy, reference):
    m, tok = gqa_policy
    out = {}
    for impl in (NAME, reference):
        m.set_attn_implementation(impl)
        out[impl] = _logits_and_grads(m, tok)
    m.set_attn_implementation("sdpa")
    use_fast_attention(m)
    _assert_same_values_and_grads(out[NAME], out[reference])


def test_growing_layer_returns_what_concatenation_returns():
    grow, ref = GrowingLayer(), DynamicLayer()
    torch.manual_seed(0)
    for width in [5, 1, 1, 30, 1, 40, 3]:  # passes the first capacity (64) and doubles
        k, v = torch.randn(2, 2, width, 4), torch.randn(2, 2, width, 4)
        gk, gv = grow.update(k, v)
        rk, rv = ref.update(k, v)
        assert torch.equal(gk, rk) and torch.equal(gv, rv)
        assert grow.get_seq_length() == ref.get_seq_length()
    assert grow.kbuf.shape[-2] >= 81


def test_sampler_with_growing_cache_equals_dynamic_cache(gqa_policy, monkeypatch):
    m, tok = gqa_policy
    fast = _multi_turn(m, tok, 70)
    monkeypatch.setattr(hf_rollout, "new_cache", lambda model: DynamicCache(config=model.config))
    ref = _multi_turn(m, tok, 70)
    assert torch.equal(fast.input_ids, ref.input_ids) and torch.equal(fast.loss_mask, ref.loss_mask)
    assert fast.input_ids.shape[1] - fast.prompt_len > 64  # the cache grew past its first buffer
    assert torch.allclose(fast.old.logp, ref.old.logp, atol=1e-6)
    assert torch.equal(fast.old.index, ref.old.index)


@pytest.mark.slow  # compiling forward and backward: ~45 s on a cold cache; the fast suite stays under 5 minutes
def test_a_compiled_body_computes_what_the_eager_one_does(gqa_policy):
    """``model.compile``: the decoder body compiled in place (dynamic shapes) gives eager's logits and
    gradients to float rounding and keeps every parameter name. The sampler runs it eagerly (no frame traced: its
    cache's bookkeeping had specialized a graph per layer and block kind, past dynamo's recompile limit) and samples
    the same multi-turn rollouts."""
    import copy

    from torch._dynamo.utils import counters

    from ema_pg.engine.models import compile_body

    eager, tok = gqa_policy
    m = compile_body(copy.deepcopy(eager))
    compiled_call = m.model._compiled_call_impl
    assert compiled_call is not None and compile_body(m).model._compiled_call_impl is compiled_call  # once
    assert list(m.state_dict()) == list(eager.state_dict())  # checkpoints unchanged
    _assert_same_values_and_grads(_logits_and_grads(m, tok), _logits_and_grads(eager, tok))
    traced = counters["frames"]["total"]
    got, ref = _multi_turn(m, tok, 24), _multi_turn(eager, tok, 24)
    assert counters["frames"]["total"] == traced
    assert torch.equal(got.input_ids, ref.input_ids) and torch.equal(got.loss_mask, ref.loss_mask)
    assert torch.equal(got.old.logp, ref.old.logp)


def test_static_cache_sampling_equals_the_growing_cache(gqa_policy):
    """``static_cache``: every decode step over the preallocated prompt + max_new_tokens columns (the
    masked columns ahead carry no weight) gives the growing cache's tokens and log-probs, rows of different
    prompt lengths and rows ended by EOS included; a second call reuses the cache (reset, not stale)."""
    m, tok = gqa_policy
    prompts = ["1+2=", "12+345=", "7"]
    kw = dict(temperature=1.0, max_new_tokens=12, score=ScoreRequest(topk=3, entropy=True))
    sampler = HFSampler(tok, static_cache=True)
    for seed in (0, 1):
        a = HFSampler(tok).generate(m, prompts, 4, seed=seed, **kw)
        b = sampler.generate(m, prompts, 4, seed=seed, **kw)
        assert a.responses == b.responses and torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.loss_mask, b.loss_mask) and torch.equal(a.truncated, b.truncated)
        assert (a.old.logp - b.old.logp).abs().max() < 1e-5
        assert torch.equal(a.old.index, b.old.index) and (a.old.entropy - b.old.entropy).abs().max() < 1e-5
    assert a.truncated.any() and not a.truncated.all()  # rows that ran to the limit and rows that ended by EOS
    assert len(sampler._static[m][1]) == 1  # one cache for the one batch shape, reused by the second call
    c = sampler.generate(m, ["1+2=", "1", "7"], 4, seed=0, **kw)  # shorter padded prompts: the same columns
    assert c.prompt_len < a.prompt_len and len(sampler._static[m][1]) == 1
    assert [hf_rollout.static_columns(n) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 keys (rotary), bfloat16 values: both kept
        a = HFSampler(tok).generate(m, prompts, 4, seed=0, **kw)
        b = sampler.generate(m, prompts, 4, seed=0, **kw)
    assert a.responses == b.responses and (a.old.logp - b.old.logp).abs().max() < 1e-2
    assert len(sampler._static[m][1]) == 2  # its own cache: the layers' dtypes differ under autocast


def test_static_cache_falls_back_to_the_growing_cache_for_multi_turn(gqa_policy):
    """A call with stop strings (observations of unknown length) keeps the growing cache, with equal results."""
    m, tok = gqa_policy
    kw = dict(temperature=1.0, max_new_tokens=10, seed=5, stop=["+"])
    a = HFSampler(tok).generate(m, ["1+2=", "12+345="], 3, **kw)
    s = HFSampler(tok, static_cache=True)
    b = s.generate(m, ["1+2=", "12+345="], 3, **kw)
    assert a.responses == b.responses and m not in s._static
    default = HFSampler(tok)  # static_cache None: on for a CUDA policy only
    default.generate(m, ["1+2="], 2, temperature=1.0, max_new_tokens=4, seed=0)
    assert default.static_cache is None and m not in default._static


def test_static_cache_is_not_used_in_lockstep(gqa_policy):
    """Under DeepSpeed ZeRO-3 the sampler runs in lockstep with the other ranks (``lockstep``, set by the
    module): every rank must run the same forwards, so the growing-cache loop runs even when the static
    cache is asked for. Here a one-process :class:`World` (its collectives the identity) stands for it."""
    from ema_pg.dist import World

    m, tok = gqa_policy
    kw = dict(temperature=1.0, max_new_tokens=8, seed=2, score=ScoreRequest())
    a = HFSampler(tok).generate(m, ["1+2=", "7"], 3, **kw)
    s = HFSampler(tok, static_cache=True)
    s.lockstep = World()
    b = s.generate(m, ["1+2=", "7"], 3, **kw)
    assert m not in s._static and a.responses == b.responses and torch.equal(a.old.logp, b.old.logp)
    s.lockstep = None
    s.generate(m, ["1+2=", "7"], 3, **kw)
    assert len(s._static[m][1]) == 1  # the same sampler out of lockstep takes the static path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graph decode step needs a GPU")
def test_static_cache_cuda_graph_decode_equals_the_eager_loop_on_gpu(gqa_policy):
    """On CUDA the static cache's decode step is compiled and replayed as a CUDA graph: the same tokens and,
    to the compiled kernels' rounding, the same log-probs as the eager loop; the graph is replayed across calls."""
    m, tok = gqa_policy
    m = m.to("cuda")
    kw = dict(temperature=1.0, max_new_tokens=12, score=ScoreRequest(topk=3, entropy=True))
    sampler = HFSampler(tok)  # the default: static for a CUDA policy
    try:
        for seed in (0, 1, 2):
            a = HFSampler(tok, static_cache=False).generate(m, ["1+2=", "12+345=", "7"], 4, seed=seed, **kw)
            b = sampler.generate(m, ["1+2=", "12+345=", "7"], 4, seed=seed, **kw)
            assert a.responses == b.responses
            assert (a.old.logp - b.old.logp).abs().max() < 1e-4
        assert len(sampler._static[m][1]) == 1  # the static path ran, one cache for the one shape
    finally:
        m.to("cpu")
