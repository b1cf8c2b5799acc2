"""Partial rollouts (``rollout.partial=true``, :mod:`ema_pg.partial`): a response still running at a weight update is
continued by the next version; each token records its version, and pi_old (and, aligned, the anchor) of a token is
its version's. A continued response equals the response sampled whole when the weights do not change; a pool and a
resumed worker continue the stream exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import compose_cfg, frozen, moved

from ema_pg.chunked import HeadChunk
from ema_pg.config import ConfigError, step_records, validate
from ema_pg.engine.rollout_workers import RolloutsAhead, RolloutWorkerError
from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
from ema_pg.heads import head
from ema_pg.kl import get_estimator
from ema_pg.partial import PartialStream
from ema_pg.prompts import PromptEncoder
from ema_pg.rollout import HFSampler
from ema_pg.rollout.hf import Continuation
from ema_pg.step import StepParts, rl_step, sample_ahead
from ema_pg.tasks import build_task
from ema_pg.update import TorchUpdater

K = 4


def eos_prone(model, tok, task, logit: float = 6.0):
    """``model`` with its EOS logit raised to about ``logit`` where its hidden states point on average (the head has no
    bias to give it): responses end after a few tokens, at different lengths."""
    out = copy.deepcopy(model)
    enc = tok([p.text for p in task.sample(8, seed=5)], return_tensors="pt", padding=True)
    with torch.no_grad():
        h = out.model(**enc).last_hidden_state[enc.attention_mask.bool()].mean(0)
        out.lm_head.weight[tok.eos_token_id] = h / h.norm() ** 2 * logit
    return out


@pytest.fixture(scope="module")
def world():
    task = build_task({"name": "toy_add", "eval_size": 8})
    tok = train_bpe_tokenizer(task.corpus(), vocab_size=300)
    policy = eos_prone(build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=0,
                                        tokenizer=tok), tok, task)
    cfg = compose_cfg(["algo.prompts_per_step=4", "algo.group_size=2", "rollout.max_new_tokens=9", "algo.beta=1.0",
                       f"kl.k={K}", "rollout.max_staleness=1", "rollout.partial=true"])
    return policy, tok, task, cfg


def parts(world, policy, anchor=None, cfg=None):
    _, tok, task, base = world
    c = cfg if cfg is not None else base
    return StepParts(policy, anchor, task, HFSampler(tok), get_estimator("topk_reverse", k=K), c.algo, c.rollout, 0,
                     lambda n: 7)


def test_a_response_continued_with_the_same_weights_is_the_response_sampled_whole(world):
    """The sampler's continuation: responses sampled in calls stopped after 3 token steps (``until``), each call
    prefilling the tokens so far, are the responses one call samples whole (each token's uniform is fixed by its prompt's
    seed and its position), and a response that ended only waits."""
    policy, tok, task, _ = world
    s, prompts = HFSampler(tok), [p.text for p in task.sample(3, seed=5)]
    kw = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 9, "seed": [11, 12, 13]}
    whole = s.generate(policy, prompts, 2, **kw)
    want = [whole.input_ids[r, whole.prompt_len:][whole.loss_mask[r, whole.prompt_len:].bool()].tolist()
            for r in range(len(whole))]
    got, calls = [[] for _ in want], 0
    while True:
        ended = [bool(y) and (y[-1] == tok.eos_token_id or len(y) >= 9) for y in got]
        if all(ended):
            break
        steps = [0]

        def three(active):
            steps[0] += 1
            return steps[0] == 3

        ro = s.continue_responses(policy, prompts, 2, Continuation(got, three), **kw)
        calls += 1
        for r in range(len(got)):
            got[r] = got[r] + ro.input_ids[r, ro.prompt_len:][ro.loss_mask[r, ro.prompt_len:].bool()].tolist()
    assert calls > 1 and got == want
    assert len({len(y) for y in want}) > 1  # the responses end at different lengths (EOS)


def test_with_no_spare_groups_the_stream_hands_over_the_whole_rollout_batches(world):
    """``rollout.partial_spare=0``: every group in flight ends before its batch is handed over, so batch t is the batch
    a whole-rollout worker samples at t with the same weights, bit for bit: its prompts, tokens, rewards and pi_old."""
    policy = world[0]
    p = parts(world, policy)
    stream = PartialStream(4, 0)
    for t in range(3):
        got, whole = stream.batch(t, 0, p), sample_ahead(t, 0, p)
        assert torch.equal(got.rollouts.input_ids, whole.rollouts.input_ids)
        assert torch.equal(got.rollouts.loss_mask, whole.rollouts.loss_mask)
        assert torch.equal(got.rewards, whole.rewards) and got.rollouts.responses == whole.rollouts.responses
        mask = whole.rollouts.response_mask.bool()
        for f in ("logp", "index", "index_logp", "entropy"):
            assert torch.equal(getattr(got.rollouts.old, f)[mask], getattr(whole.rollouts.old, f)[mask]), f
        assert stream.groups == [] and got.metrics["rollout/frac_mixed_versions"] == 0


def test_each_token_carries_its_versions_logprobs_index_set_and_aligned_anchor(world):
    """Versions 0..4 of moving weights (and anchors, aligned), a block of spare groups: responses cross versions. Each
    token records the version that sampled it, and its pi_old log-prob, top-k index set and anchor score are that
    version's policy and anchor scoring the whole response, at that token."""
    policy, tok, _, cfg = world
    v = [policy] + [moved(policy, 0.3, 10 + i) for i in range(4)]
    anchors = [frozen(moved(policy, 0.3, 30 + i)) for i in range(5)]
    stream, mixed = PartialStream(4, 4), 0
    for t in range(5):
        b = stream.batch(t, t, parts(world, v[t], anchors[t]))
        ro, tv = b.rollouts, b.token_version
        mask = ro.response_mask.bool()
        assert b.version == t and int(tv[mask].max()) <= t
        for j in tv[mask].unique().tolist():
            at = mask & (tv == j)
            with torch.no_grad():
                old = head(v[j], ro, temperature=1.0, chunk=7, topk=K)
                anc = head(anchors[j], ro, temperature=1.0, chunk=7, index=ro.old.index)
            assert torch.allclose(ro.old.logp[at], old.logp[at], atol=1e-5)
            # the top-k of the same distribution: the same values (an index may swap places with a near-tie's)
            assert torch.allclose(ro.old.index_logp[at], old.index_logp[at], atol=1e-5)
            at_index = head(v[j], ro, temperature=1.0, chunk=7, index=ro.old.index).index_logp
            assert torch.allclose(ro.old.index_logp[at], at_index[at], atol=1e-5)  # the version's log-probs there
            assert torch.allclose(b.scores.anchor.logp[at], anc.logp[at], atol=1e-5)
            assert torch.allclose(b.scores.anchor_index_logp[at], anc.index_logp[at], atol=1e-5)
        rows = [set(tv[r][mask[r]].tolist()) for r in range(len(ro))]
        mixed += sum(len(s) > 1 for s in rows)
        assert b.metrics["rollout/frac_mixed_versions"] == pytest.approx(sum(len(s) > 1 for s in rows) / len(rows))
        # versions never go back within a response: its tokens are sampled in order
        assert all(torch.all(tv[r][mask[r]].diff() >= 0) for r in range(len(ro)))
    assert mixed > 0


def test_the_update_reads_each_tokens_own_staleness(world):
    """The trainer's step on a partial batch logs the staleness of its tokens (iteration minus each token's version)."""
    policy, tok, _, cfg = world
    stream = PartialStream(4, 4)
    batches = [stream.batch(t, t, parts(world, moved(policy, 0.3, t))) for t in range(3)]
    b = batches[2]
    mask = b.rollouts.response_mask.bool()
    lag = (4 - b.token_version)[mask].float()
    learner = copy.deepcopy(policy)
    params = [q for q in learner.parameters() if q.requires_grad]
    p = parts(world, learner, frozen(policy))
    p.updater = TorchUpdater(params, torch.optim.AdamW(params, lr=1e-3))
    metrics = rl_step(4, p, beta=cfg.algo.beta, sampled=b).metrics
    assert metrics["rollout/staleness_token_mean"] == pytest.approx(float(lag.mean()))
    assert metrics["rollout/staleness_token_max"] == float(lag.max())
    assert metrics["rollout/staleness"] == 2.0


def _ahead(world, n, policy):
    _, tok, task, base = world
    cfg = copy.deepcopy(base)
    cfg.rollout.workers = n
    return RolloutsAhead(cfg, policy, None, tok, task, PromptEncoder(tok, "off"), HeadChunk(7, 300, 256.0),
                         k=cfg.rollout.max_staleness, records=step_records(cfg))


def _continued(world, n, its=5, cut=3):
    """(the uninterrupted worker's batches 0 .. its - 1, those a worker restored at the checkpoint after iteration
    cut - 1 hands out, that checkpoint): real worker processes, k = 1, moving versions."""
    policy = world[0]
    v = [policy] + [moved(policy, 0.3, 50 + i) for i in range(its)]

    def run(ts, saved=None):
        w = _ahead(world, n, policy)
        w.restore(saved or {})
        try:
            got = [w.next(t, v[t], None) for t in ts]
            return got, w.state()
        finally:
            w.close()

    whole, _ = run(range(its))
    _, saved = run(range(cut))
    return whole, run(range(cut, its), saved)[0], saved


def check_continued(whole, again):
    assert [b.version for b in whole] == [0] + list(range(len(whole) - 1))
    assert any(b.metrics["rollout/frac_mixed_versions"] > 0 for b in whole)  # responses crossed a weight update
    for t, b in enumerate(whole):
        assert int(b.token_version[b.rollouts.response_mask.bool()].max()) <= max(0, t - 1)
    for a, b in zip(whole[len(whole) - len(again):], again):
        assert torch.equal(a.rollouts.input_ids, b.rollouts.input_ids) and torch.equal(a.rewards, b.rewards)
        assert torch.equal(a.token_version, b.token_version) and torch.equal(a.rollouts.old.logp, b.rollouts.old.logp)


@pytest.mark.slow  # two runs of a real worker process: ~21 s; the fast suite continues the stream in-process
def test_a_worker_process_continues_its_stream_and_a_resumed_worker_repeats_it(world):
    """A real worker process, k = 1, moving versions: batch t's tokens are of versions <= t - 1; the batches after a
    checkpoint, taken by a worker restored from it, are the uninterrupted worker's bit for bit; a pool of two refuses
    that checkpoint's one stream with one line, before it starts a process."""
    whole, again, saved = _continued(world, 1)
    check_continued(whole, again)
    pool = _ahead(world, 2, world[0])
    pool.restore(saved)
    with pytest.raises(RolloutWorkerError, match="1 partial-rollout workers.*rollout.workers"):
        pool.next(3, world[0], None)
    assert pool.procs == []


@pytest.mark.slow  # six pairs of worker processes, one after another: about 20 s
def test_a_pool_of_two_workers_continues_its_streams_and_resumes_them_exactly(world):
    """``rollout.workers=2`` with partial rollouts: each worker continues its own stream of its block's groups, and a
    pool restored from a checkpoint repeats the uninterrupted pool's batches bit for bit."""
    whole, again, _ = _continued(world, 2)
    check_continued(whole, again)
    assert all(len(b.rollouts) == 8 for b in whole)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.max_staleness=0"], "rollout.partial=true continues a rollout worker"),
    (["rollout=vllm"], "built for the HF sampler"),
    (["rollout.stop=['</search>']"], "single-turn"),
    (["algo.dynamic_sampling=true"], "dynamic_sampling"),
    (["algo.decoupled=true", "algo.prox_logp=loglinear"], "prox_logp=recompute"),
    (["kl=exact_reverse"], "full logits"),
    (["rollout.partial_spare=-1"], "partial_spare"),
    (["rollout.partial_spare=1000000"], r"rollout.partial_spare=1000000 keeps .* beyond a worker's block of 4 .* "
                                        r"give at most 16 \(4 blocks\), or leave it unset"),
    (["rollout.partial_spare=33", "rollout.workers=2", "algo.prompts_per_step=16"], "block of 8 .* give at most 32 "),
])
def test_settings_partial_rollouts_are_not_built_for_stop_at_start_naming_the_knob(overrides, match):
    cfg = compose_cfg(["rollout.max_staleness=1", "rollout.partial=true", *overrides])
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


def test_each_trainer_process_takes_its_groups_token_versions_with_them(world):
    """Several trainer processes, one worker: each rank's block of whole groups keeps its rows' token versions."""
    from ema_pg.dist import World

    policy, _, _, cfg = world
    stream = PartialStream(4, 4)
    b = [stream.batch(t, t, parts(world, moved(policy, 0.3, t))) for t in range(3)][2]
    shares = [b.share(World(r, 2), cfg.algo.group_size) for r in range(2)]
    assert torch.equal(torch.cat([s.token_version for s in shares]), b.token_version)
    assert torch.equal(torch.cat([s.rollouts.input_ids for s in shares]), b.rollouts.input_ids)
