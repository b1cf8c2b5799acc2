"""Asynchronous rollouts (``rollout.max_staleness``): the step reads what the behaviour policy sampled and scored,
the worker keeps the schedule max(0, t - k), and what a checkpoint saves repeats the uninterrupted run.

A test fails if: a batch taken from elsewhere changes the step's numerics; pi_old (or the aligned anchor) in the
loss is the current model's instead of the behaviour version's; the worker samples with another version than
max(0, t - k); a restored worker does not continue with the same batches; a bad combination starts a run.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import compose_cfg, frozen, moved

from ema_pg.config import ConfigError, step_records, validate
from ema_pg.chunked import HeadChunk
from ema_pg.engine.rollout_workers import RolloutsAhead, RolloutWorkerError
from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
from ema_pg.heads import head
from ema_pg.kl import KLInputs, get_estimator
from ema_pg.prompts import PromptEncoder
from ema_pg.rollout import HFSampler
from ema_pg.step import StepParts, rl_step, sample_ahead
from ema_pg.update import TorchUpdater
from ema_pg.tasks import build_task

K = 4
WAIT_S = 120  # a schedule of five small batches takes seconds; this long means the two processes are stuck


@pytest.fixture(scope="module")
def world():
    task = build_task({"name": "toy_add", "eval_size": 8})
    tok = train_bpe_tokenizer(task.corpus(), vocab_size=300)
    policy = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=0,
                              tokenizer=tok)
    cfg = compose_cfg(["algo.prompts_per_step=3", "algo.group_size=2", "rollout.max_new_tokens=5", "algo.beta=1.0",
                       f"kl.k={K}"])
    return policy, tok, task, cfg


def step(world, policy, anchor, *, sampled=None, estimator=None, updater=None, iteration=0):
    _, tok, task, cfg = world
    est = estimator or get_estimator("topk_reverse", k=K)
    params = [p for p in policy.parameters() if p.requires_grad]
    upd = updater or TorchUpdater(params, torch.optim.AdamW(params, lr=1e-2))
    return rl_step(iteration, StepParts(policy, anchor, task, HFSampler(tok), est, cfg.algo, cfg.rollout, 0,
                                        lambda n: 7, upd), beta=cfg.algo.beta, sampled=sampled)


def ahead(world, policy, anchor, iteration, version, estimator=None):
    _, tok, task, cfg = world
    est = estimator or get_estimator("topk_reverse", k=K)
    return sample_ahead(iteration, version, StepParts(policy, anchor, task, HFSampler(tok), est, cfg.algo, cfg.rollout,
                                                      0, lambda n: 7))


def test_a_batch_sampled_ahead_by_the_same_weights_gives_the_synchronous_step_bit_for_bit(world):
    """Staleness 0 through the asynchronous path (sample, hand over, update) = today's step: same weights after the
    update, same metrics. The synchronous step itself is unchanged by rollout.max_staleness=0 (no worker)."""
    policy = world[0]
    anchor = frozen(moved(policy, 0.3, 1))
    a, b = copy.deepcopy(policy), copy.deepcopy(policy)
    sync = step(world, a, anchor, iteration=3)
    handed = step(world, b, anchor, iteration=3, sampled=ahead(world, b, None, 3, 3))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert handed.metrics["rollout/staleness"] == 0.0
    for key, value in sync.metrics.items():
        if not key.startswith("time/"):
            assert handed.metrics[key] == value or (value != value and handed.metrics[key] != handed.metrics[key]), key


def recording(name="topk_reverse"):
    real, seen = get_estimator(name, k=K), {}

    def fn(inputs: KLInputs, **p):
        seen["inputs"] = inputs
        return real.fn(inputs, **p)

    return dataclasses.replace(real, fn=fn), seen


@pytest.mark.parametrize("align", ["current", "behaviour"])
def test_with_staleness_1_the_loss_reads_the_behaviour_versions_logprobs_and_the_aligned_anchor(world, align):
    """Batch 1 sampled by version 0, updated on by version 1: pi_old (the ratio's denominator and the KL's
    logp_old) is version 0's, and the anchor is version 0's under align=behaviour, version 1's under current."""
    v0 = world[0]
    v1 = moved(v0, 0.2, 7)  # the policy after iteration 0's update
    anchor_v0, anchor_v1 = frozen(moved(v0, 0.3, 1)), frozen(moved(v0, 0.3, 2))
    batch = ahead(world, v0, anchor_v0 if align == "behaviour" else None, 1, 0)
    est, seen = recording()
    params = list(v1.parameters())  # lr 0: every update of the iteration sees the same ratio
    res = step(world, v1, anchor_v1, sampled=batch, estimator=est, iteration=1,
               updater=TorchUpdater(params, torch.optim.SGD(params, lr=0.0)))
    assert res.metrics["rollout/staleness"] == 1.0
    ro, inputs = batch.rollouts, seen["inputs"]
    mask = ro.response_mask.bool()
    score = torch.no_grad()(lambda m, **kw: head(m, ro, temperature=1.0, chunk=7, **kw))
    b0, b1 = score(v0, topk=K), score(v1, topk=K)
    assert torch.allclose(inputs.logp_old[mask], b0.logp[mask], atol=1e-5)
    assert (inputs.logp_old[mask] - b1.logp[mask]).abs().max() > 1e-2
    assert torch.equal(inputs.topk_idx, b0.index)  # Alg 1's index set: the behaviour policy's top-k
    ratio = torch.exp(b1.logp - b0.logp)[mask]
    assert res.metrics["train/ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-4)
    assert res.metrics["train/ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-4)
    want, other = (anchor_v0, anchor_v1) if align == "behaviour" else (anchor_v1, anchor_v0)
    ref = score(want, index=b0.index)
    assert torch.allclose(inputs.logp_ref[mask], ref.logp[mask], atol=1e-5)
    assert torch.allclose(inputs.topk_logp_ref, ref.index_logp, atol=1e-5)
    assert (inputs.logp_ref[mask] - score(other, index=b0.index).logp[mask]).abs().max() > 1e-2



def watch_loss(monkeypatch) -> list:
    """The (ratio reference, PG weights) each call of the update's loss receives, as a list filled as it runs."""
    import ema_pg.update as update

    seen, real = [], update.policy_loss

    def watched(logp, logp_old, adv, mask, kl, **kw):
        seen.append((logp_old.detach(), kw["pg_weight"]))
        return real(logp, logp_old, adv, mask, kl, **kw)

    monkeypatch.setattr(update, "policy_loss", watched)
    return seen


@pytest.mark.parametrize("cap", [None, 1.05])
def test_decoupled_ppo_clips_around_the_proximal_policy_and_weighs_by_prox_over_behaviour(world, cap, monkeypatch):
    """algo.decoupled on a batch sampled by version 0 and updated on by version 1: the loss's ratio is taken against
    the proximal policy (version 1 as the step starts: pi_theta / pi_prox = 1 at lr 0), and its PG term is weighted
    by pi_prox / pi_behave = pi_v1 / pi_v0, token by token; a cap masks the tokens above it. The KL estimator still
    reads the behaviour policy (it sampled the tokens)."""
    v0 = world[0]
    v1 = moved(v0, 0.2, 7)
    batch = ahead(world, v0, None, 1, 0)
    seen = watch_loss(monkeypatch)
    est, kl_seen = recording()
    cfg = copy.deepcopy(world[3])
    cfg.algo.decoupled, cfg.algo.behave_weight_cap = True, cap
    params = list(v1.parameters())
    res = step((*world[:3], cfg), v1, frozen(v0), sampled=batch, estimator=est, iteration=1,
               updater=TorchUpdater(params, torch.optim.SGD(params, lr=0.0)))
    ro = batch.rollouts
    mask = ro.response_mask.bool()
    score = torch.no_grad()(lambda m: head(m, ro, temperature=1.0, chunk=7).logp)
    b0, b1 = score(v0), score(v1)
    prox, weight = seen[0]
    assert torch.allclose(prox[mask], b1[mask], atol=1e-5)  # the ratio's reference: the policy as the step starts
    assert torch.allclose(kl_seen["inputs"].logp_old[mask], b0[mask], atol=1e-5)  # the estimator's: the sampler's
    w = torch.exp(b1 - b0)
    want = w if cap is None else torch.where(w <= cap, w, torch.zeros_like(w))
    assert torch.allclose(weight[mask], want[mask], atol=1e-4) and (weight[~mask] == 0).all()
    assert res.metrics["train/ratio_max"] == pytest.approx(1.0, abs=1e-5)  # pi_theta = pi_prox at lr 0
    assert res.metrics["train/behave_weight_mean"] == pytest.approx(float(w[mask].mean()), rel=1e-4)
    masked = 0.0 if cap is None else float((w[mask] > cap).float().mean())
    assert res.metrics["train/behave_masked_frac"] == pytest.approx(masked)
    if cap is not None:
        assert 0 < masked < 1  # the cap bites on some tokens, not all: the case tests both sides


def test_the_loglinear_proximal_policy_interpolates_by_the_versions_and_needs_no_pass():
    """AReaL's approximation by hand: log pi_prox = log pi_b + alpha (log pi_theta - log pi_b), alpha = lag / (lag+1)
    (v_behave t - lag, v_prox t, v_theta t + 1), no gradient through it; 0 on policy, 1/2 a step behind."""
    from ema_pg.corrections import loglinear_prox, prox_alpha

    assert [prox_alpha(lag) for lag in (0, 1, 2, 3)] == [0.0, 0.5, 2 / 3, 0.75]
    behave = torch.tensor([[-1.0, -2.0, -0.5]])
    now = torch.tensor([[-0.5, -3.0, -0.5]], requires_grad=True)
    got = loglinear_prox(behave, now, 2 / 3)
    assert torch.allclose(got, torch.tensor([[-1.0 + 2 / 3 * 0.5, -2.0 - 2 / 3, -0.5]]))
    assert not got.requires_grad and torch.equal(loglinear_prox(behave, now, 0.0), behave)


@pytest.mark.parametrize("iteration", [1, 2])
def test_decoupled_ppo_with_the_loglinear_proximal_policy_takes_its_ratio_and_weight_from_the_interpolation(
        world, iteration, monkeypatch):
    """algo.prox_logp=loglinear on a batch sampled by version 0 and updated on at iteration 1 or 2 (alpha 1/2, 2/3):
    the ratio's reference is log pi_b + alpha (log pi_theta - log pi_b), the PG weight pi_prox / pi_b of that, capped
    as the recomputed one is; the step makes no pass of the policy for it (its logged alpha says which it took)."""
    v0 = world[0]
    v1 = moved(v0, 0.2, 7)
    batch = ahead(world, v0, None, iteration, 0)
    seen = watch_loss(monkeypatch)
    cfg = copy.deepcopy(world[3])
    cfg.algo.decoupled, cfg.algo.prox_logp, cfg.algo.behave_weight_cap = True, "loglinear", 1.02
    params = list(v1.parameters())
    res = step((*world[:3], cfg), v1, frozen(v0), sampled=batch, iteration=iteration,
               updater=TorchUpdater(params, torch.optim.SGD(params, lr=0.0)))
    ro = batch.rollouts
    mask = ro.response_mask.bool()
    score = torch.no_grad()(lambda m: head(m, ro, temperature=1.0, chunk=7).logp)
    b0, b1 = score(v0), score(v1)
    alpha = iteration / (iteration + 1)
    prox, weight = seen[0]
    want_prox = b0 + alpha * (b1 - b0)
    assert torch.allclose(prox[mask], want_prox[mask], atol=1e-5)
    w = torch.exp(want_prox - b0)
    want = torch.where(w <= 1.02, w, torch.zeros_like(w))
    assert torch.allclose(weight[mask], want[mask], atol=1e-4) and (weight[~mask] == 0).all()
    assert 0 < float((want[mask] == 0).float().mean()) < 1  # the cap bites on some tokens, not all
    assert res.metrics["train/prox_alpha"] == pytest.approx(alpha)
    assert res.metrics["train/ratio_max"] == pytest.approx(float(torch.exp(b1 - want_prox)[mask].max()), rel=1e-4)
    assert "train/behave_weight_mean" not in res.metrics  # that needs the recomputed pass


def test_decoupled_ppo_needs_a_batch_sampled_ahead_and_its_cap_needs_it():
    for overrides, line in ((["algo.decoupled=true"], "set rollout.max_staleness >= 1"),
                            (["algo.behave_weight_cap=2"], "set algo.decoupled=true with it"),
                            (["algo.decoupled=true", "rollout.max_staleness=1", "algo.behave_weight_cap=1"],
                             "a cap > 1"),
                            (["algo.prox_logp=loglinear", "rollout.max_staleness=1"], "set algo.decoupled=true with it"),
                            (["algo.decoupled=true", "rollout.max_staleness=1", "algo.prox_logp=linear"],
                             "choose one of: recompute, loglinear")):
        with pytest.raises(ConfigError, match=line):
            validate(compose_cfg(overrides))


def _ahead(world, k, policy, anchor, align, cfg=None):
    _, tok, task, base = world
    cfg = copy.deepcopy(cfg if cfg is not None else base)
    cfg.rollout.max_staleness, cfg.anchor.align = k, align
    return RolloutsAhead(cfg, policy, anchor, tok, task, PromptEncoder(tok, "off"), HeadChunk(7, 300, 256.0),
                         k=cfg.rollout.max_staleness, records=step_records(cfg))


def test_the_worker_samples_batch_t_with_version_t_minus_k_and_a_restored_one_continues_alike(world):
    """A real worker process, k = 2: versions 0, 0, 0, 1, 2; batch 3's pi_old and aligned anchor are version 1's; a
    worker restored from the batches in flight after iteration 2 hands out what the first one would have."""
    v = [world[0]] + [moved(world[0], 0.2, 10 + i) for i in range(5)]
    anchors = [frozen(moved(world[0], 0.3, 20 + i)) for i in range(6)]
    first = _ahead(world, 2, v[0], anchors[0], "behaviour")
    try:
        got = [first.next(t, v[t], anchors[t]) for t in range(3)]
        saved = first.state()  # the checkpoint after iteration 2: batches 3 and 4 (3 asked at t=1, 4 at t=2)
        assert sorted(saved) == [3, 4]
        got += [first.next(t, v[t], anchors[t]) for t in range(3, 5)]
    finally:
        first.close()
    assert [b.version for b in got] == [0, 0, 0, 1, 2]
    ro = got[3].rollouts
    mask = ro.response_mask.bool()
    with torch.no_grad():
        b1 = head(v[1], ro, temperature=1.0, chunk=7, topk=K)
        a1 = head(anchors[1], ro, temperature=1.0, chunk=7, index=b1.index)
    assert torch.allclose(ro.old.logp[mask], b1.logp[mask], atol=1e-5)
    assert torch.equal(ro.old.index, b1.index)
    assert torch.allclose(got[3].scores.anchor.logp[mask], a1.logp[mask], atol=1e-5)
    resumed = _ahead(world, 2, v[0], anchors[0], "behaviour")
    resumed.restore(saved)
    try:
        again = [resumed.next(t, v[t], anchors[t]) for t in range(3, 5)]
    finally:
        resumed.close()
    for a, b in zip(got[3:], again):
        assert a.version == b.version and torch.equal(a.rollouts.input_ids, b.rollouts.input_ids)
        assert torch.equal(a.rollouts.old.logp, b.rollouts.old.logp)
        assert torch.equal(a.scores.anchor.logp, b.scores.anchor.logp)


def test_each_trainer_process_takes_its_block_of_whole_groups_of_the_workers_batch(world):
    """Several trainer processes, one worker: the worker's whole batch (rollouts, pi_old, the aligned anchor's
    scores and index set, rewards) is split into the blocks of whole groups that World.block gives each rank, in
    rank order, and nothing is lost or repeated."""
    from ema_pg.dist import World

    policy, _, _, cfg = world
    whole = ahead(world, policy, frozen(moved(policy, 0.1, 1)), 2, 1)
    G, ranks = cfg.algo.group_size, 3
    shares = [whole.share(World(r, ranks), G) for r in range(ranks)]
    for r, s in enumerate(shares):
        assert s.rollouts.prompt_index == [r] * G and s.version == 1 and s.metrics == whole.metrics
    cat = lambda get: torch.cat([get(s) for s in shares])
    assert torch.equal(cat(lambda s: s.rewards), whole.rewards)
    assert torch.equal(cat(lambda s: s.rollouts.input_ids), whole.rollouts.input_ids)
    assert torch.equal(cat(lambda s: s.rollouts.old.logp), whole.rollouts.old.logp)
    assert torch.equal(cat(lambda s: s.scores.old.index_logp), whole.scores.old.index_logp)
    assert torch.equal(cat(lambda s: s.scores.anchor.logp), whole.scores.anchor.logp)
    assert torch.equal(cat(lambda s: s.scores.index), whole.scores.index)
    assert torch.equal(cat(lambda s: s.scores.anchor_index_logp), whole.scores.anchor_index_logp)
    assert whole.share(World(), G) is whole


@pytest.mark.parametrize("n", [2, 4])
def test_the_blocks_a_pool_samples_join_into_the_batch_one_worker_samples(world, n):
    """``rollout.workers = n``: worker w samples the block of whole prompt groups that rank w of n would, and the
    joined blocks are one worker's batch: the same prompts in the same order, the same sampled tokens (each prompt
    has its own seed), the same rewards and version; pi_old's and the aligned anchor's scores, and the index set,
    are each block's own forward pass (the same within rounding)."""
    from ema_pg.dist import Share
    from ema_pg.step import Sampled

    policy, tok, task, base = world
    cfg = copy.deepcopy(base)
    cfg.algo.prompts_per_step = 4
    anchor = frozen(moved(policy, 0.1, 1))

    def sampled(world_):
        return sample_ahead(5, 2, StepParts(policy, anchor, task, HFSampler(tok), get_estimator("topk_reverse", k=K),
                                            cfg.algo, cfg.rollout, 0, lambda m: 7, world=world_))

    whole = sampled(Share(0, 1))
    joined = Sampled.join([sampled(Share(w, n)) for w in range(n)], tok.pad_token_id)
    assert joined.version == whole.version == 2
    assert torch.equal(joined.rewards, whole.rewards) and joined.rollouts.responses == whole.rollouts.responses
    assert joined.rollouts.prompt_index == whole.rollouts.prompt_index
    for f in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(getattr(joined.rollouts, f), getattr(whole.rollouts, f)), f
    mask = whole.rollouts.response_mask.bool()
    assert torch.allclose(joined.rollouts.old.logp[mask], whole.rollouts.old.logp[mask], atol=1e-5)
    assert torch.equal(joined.scores.index[mask], whole.scores.index[mask])
    assert torch.allclose(joined.scores.anchor.logp[mask], whole.scores.anchor.logp[mask], atol=1e-5)
    assert joined.metrics == pytest.approx(whole.metrics)


@pytest.mark.slow  # three pools of real worker processes: ~24 s; the fast suite joins the blocks in-process
def test_a_pool_of_two_worker_processes_hands_out_one_workers_batches_and_its_checkpoint(world):
    """Two real worker processes against one, k = 1, four iterations of moving versions: the same batches
    (tokens, rewards, versions) in the same order, and the batches in flight a checkpoint saves are whole batches
    that a pool of another size takes back."""
    policy, *_ = world
    cfg = copy.deepcopy(world[3])
    cfg.algo.prompts_per_step = 4
    v = [policy] + [moved(policy, 0.2, 40 + i) for i in range(4)]

    def run(n, saved=None, its=range(4)):
        c = copy.deepcopy(cfg)
        c.rollout.workers = n
        w = _ahead(world, 1, policy, None, "current", cfg=c)
        if saved is not None:
            w.restore(saved)
        try:
            got = [w.next(t, v[t], None) for t in its]
            return got, w.state()
        finally:
            w.close()

    one, one_saved = run(1)
    two, two_saved = run(2)
    assert [b.version for b in two] == [b.version for b in one] == [0, 0, 1, 2]
    for a, b in zip(one, two):
        assert torch.equal(a.rewards, b.rewards) and torch.equal(a.rollouts.input_ids, b.rollouts.input_ids)
    assert sorted(two_saved) == sorted(one_saved) == [4]
    again, _ = run(1, saved=two_saved, its=[4])  # the pool's checkpoint, resumed by one worker
    from ema_pg.engine.rollout_workers import _loads

    assert torch.equal(again[0].rollouts.input_ids, _loads(one_saved[4]).rollouts.input_ids)
    assert torch.equal(again[0].rewards, _loads(one_saved[4]).rewards)


@pytest.mark.slow  # a pool of real worker processes, one killed: ~10 s
def test_a_killed_worker_of_a_pool_stops_the_trainer_with_one_line_naming_it(world):
    """kill -9 of the second of two workers: the trainer's next wait ends in one error that names that worker."""
    import os
    import signal

    cfg = copy.deepcopy(world[3])
    cfg.algo.prompts_per_step, cfg.rollout.workers = 4, 2
    worker = _ahead(world, 1, world[0], None, "current", cfg=cfg)
    try:
        worker.next(0, world[0], None)
        os.kill(worker.procs[1].pid, signal.SIGKILL)
        worker.procs[1].join(10)
        with pytest.raises(RolloutWorkerError, match=r"rollout worker 2 of 2 (died|is gone) \(exit code -9\)"):
            for t in range(1, 4):
                worker.next(t, world[0], None)
    finally:
        worker.close()


def test_a_dead_workers_exit_code_is_named_even_when_another_thread_reaps_it_first():
    """CI saw "exit code None" for a worker killed by SIGKILL: the caller's ``join`` reaped the process while the
    pool's thread read its code, and that read came back empty. The pool reads until the code is there."""
    import multiprocessing
    import os
    import signal
    import time

    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    proc.start()
    os.kill(proc.pid, signal.SIGKILL)
    poll, empty = proc._popen.poll, iter(range(3))

    def raced(*a):  # the other thread's waitpid took the child: these reads see nothing yet
        return None if next(empty, None) is not None else poll(*a)

    proc._popen.poll = raced
    pool = RolloutsAhead.__new__(RolloutsAhead)
    pool.procs = [proc]
    assert pool._exit_code(0) == -signal.SIGKILL


def test_a_stop_signal_that_lands_while_the_worker_is_spawned_is_the_trainers_and_not_lost(world, monkeypatch):
    """SIGTERM to the trainer and to its new worker in the moment the worker is spawned: the trainer's handler runs
    once the spawn is done (it used to ignore the run's signals for that moment, so a scheduler's stop landing
    there was lost and the run went on to its end), and the worker, which leaves them to the trainer, lives on
    and samples."""
    import multiprocessing.context
    import os
    import signal

    spawn = multiprocessing.context.SpawnProcess.start

    def start_then_signal(proc):
        spawn(proc)
        os.kill(proc.pid, signal.SIGTERM)  # the worker is still starting: its interpreter has not run our code yet
        os.kill(os.getpid(), signal.SIGTERM)

    got: list[int] = []
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start_then_signal)
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: got.append(sig))
    worker = _ahead(world, 1, world[0], None, "current")
    try:
        batch = worker.next(0, world[0], None)
        assert worker.proc.is_alive()
    finally:
        worker.close()
        signal.signal(signal.SIGTERM, previous)
    assert got == [signal.SIGTERM] and batch.version == 0


def test_a_worker_without_the_batches_it_should_have_sampled_refuses_to_guess(world):
    """Resumed at iteration 3 with nothing in flight: batch 3 was version 1's, which is gone: a clear error."""
    worker = _ahead(world, 2, world[0], None, "current")
    try:
        with pytest.raises(RolloutWorkerError, match="batch 3 should have been sampled by version 1"):
            worker.next(3, world[0], None)
    finally:
        worker.close()


@pytest.mark.parametrize("overrides, match", [
    (["rollout.max_staleness=-1"], "rollout.max_staleness"),
    (["anchor.align=old"], "anchor.align='old'; choose one of: current, behaviour"),
    (["rollout.workers=0", "rollout.max_staleness=1"], "rollout.workers"),
    (["rollout.workers=2"], "set rollout.max_staleness >= 1, or rollout.workers=1"),
    (["rollout.workers=3", "rollout.max_staleness=1", "algo.prompts_per_step=4"], "divisible by rollout.workers=3"),
    (["rollout.workers=2", "rollout.max_staleness=1", "algo.prompts_per_step=4", "algo.dynamic_sampling=true"],
     "use rollout.workers=1 with it"),
])
def test_bad_async_settings_stop_at_start_naming_the_knob(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(overrides))


def test_weights_larger_than_the_pipes_buffer_flow_both_ways_without_a_deadlock(world):
    """The demo's sizes: a 1M-parameter policy (4 MB of weights a push) and batches of 128 responses with their
    top-32 index sets (~200 kB each) coming back: the trainer pushes while the worker returns a batch. Before the
    pipe had a thread per direction, both sides blocked on their sends (found by the study's first sweep)."""
    import threading

    _, tok, _, _ = world
    big = build_tiny_model(len(tok), hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, seed=0,
                           tokenizer=tok)
    versions = [big] + [moved(big, 0.05, 30 + i) for i in range(4)]
    demo = compose_cfg(["algo.prompts_per_step=16", "algo.group_size=8", "rollout.max_new_tokens=6", "kl.k=32"])
    worker = _ahead(world, 2, big, None, "current", cfg=demo)
    got: list[int] = []

    def drive():
        got.extend(worker.next(t, versions[t], None).version for t in range(5))

    th = threading.Thread(target=drive, daemon=True)
    th.start()
    th.join(WAIT_S)
    if th.is_alive():
        worker.proc.kill()  # frees the hung send, so the test ends
        pytest.fail(f"the trainer and the worker blocked each other (nothing moved for {WAIT_S} s)")
    worker.close()
    assert got == [0, 0, 0, 1, 2]


def async_run(tmp_path, eval_every: int, **popen):
    """(the trainer process, its run folder, its rollout worker): a real async run (staleness 1, 400 iterations of
    the tiny task) started on the command line, returned once its worker process exists."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil
    from helpers import spawned_children
    from test_faults import cli_tiny

    root = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ema_pg.train", *cli_tiny(tmp_path), "algo.iterations=400",
           f"algo.eval_every={eval_every}", "rollout.max_staleness=1", f"run_dir={run}", f"hydra.run.dir={run}"]
    # started as a terminal starts a foreground job, with Ctrl-C at its default: a child inherits an ignored SIGINT,
    # and bash ignores it in a script's background jobs (`make test-full &`, a CI script run with &), where Python
    # then never raises KeyboardInterrupt and the run went on to its end. A handled signal is reset by the exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    finally:
        signal.signal(signal.SIGINT, previous)
    trainer = psutil.Process(p.pid)

    deadline = time.time() + 300
    while time.time() < deadline and not spawned_children(trainer):
        time.sleep(0.2)
    found = spawned_children(trainer)
    assert found, "no rollout worker started"
    return p, run, found[0]


@pytest.mark.slow
def test_a_killed_worker_stops_the_run_with_one_line_and_leaves_no_process(tmp_path):
    """kill -9 of the rollout worker mid-run: the run exits non-zero naming the worker, records the failure in its
    folder, keeps its last checkpoint, and leaves no process behind."""
    import time

    import psutil

    p, run, worker = async_run(tmp_path, eval_every=100)
    time.sleep(2)  # a few iterations in
    worker.kill()
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0
    assert "rollout worker" in out and "died" in out, out[-2000:]
    assert (run / "failed.json").is_file()
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_saves_the_iteration_and_exits_75(tmp_path, sig):
    """`kill -TERM -- -PGID`, as Slurm and systemd stop a job (and Ctrl-C, SIGINT to the group): the worker used to
    die first, the save waited on it, and the run ended with exit 1 (kind=service), no checkpoint since the last
    period, and a worker traceback. Now the worker leaves the signal to the trainer: SIGTERM saves the iteration and
    exits 75, SIGINT stops as a synchronous run does, with no worker traceback."""
    import os
    import signal
    import time

    import psutil

    from ema_pg.engine.policy import checkpoint_iteration

    p, run, worker = async_run(tmp_path, eval_every=200, start_new_session=True)
    time.sleep(4)  # a few iterations in, inside the first evaluation period
    os.killpg(p.pid, getattr(signal, sig))
    out, _ = p.communicate(timeout=300)
    assert "Traceback" not in out, out[-3000:]  # no worker traceback (its KeyboardInterrupt, or the dead pipe's)
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
    if sig == "SIGINT":  # Ctrl-C stops a run as a synchronous one stops: Lightning's one line, exit 1, resumable
        assert p.returncode == 1 and "Detected KeyboardInterrupt" in out, out[-3000:]
        return
    assert p.returncode == 75, out[-3000:]
    it = checkpoint_iteration(run)
    assert 0 < it < 200 and not (run / "failed.json").exists()


@pytest.mark.slow
def test_a_stopped_worker_stops_the_run_in_bounded_time_even_under_sigterm(tmp_path):
    """The worker SIGSTOPped, then SIGTERM to the trainer: the trainer waited forever (its wait had no time-out) and
    exited only once the worker was continued. Now the wait gives up on a worker stopped for STOPPED_GRACE_S."""
    import signal
    import time

    import psutil

    from ema_pg.engine.rollout_workers import STOPPED_GRACE_S

    p, run, worker = async_run(tmp_path, eval_every=200)
    time.sleep(3)
    worker.suspend()
    try:
        time.sleep(1)
        p.send_signal(signal.SIGTERM)
        start = time.time()
        out, _ = p.communicate(timeout=STOPPED_GRACE_S + 60)
        took = time.time() - start
    finally:
        if psutil.pid_exists(worker.pid):
            worker.resume()
    assert p.returncode not in (0, None) and took < STOPPED_GRACE_S + 30, (p.returncode, took)
    assert f"the rollout worker (pid {worker.pid}) is stopped" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.slow  # a whole run with its worker: ~30 s; the fast suite stays under 5 minutes
def test_a_staleness_that_leaves_every_batch_to_the_initial_policy_is_said(tmp_path, caplog):
    """rollout.max_staleness=500 with 4 iterations: every batch sampled by version 0, and no word said."""
    from helpers import compose_cfg

    from ema_pg.train import train

    cfg = compose_cfg(["rollout.max_staleness=500", "algo.iterations=2", "algo.eval_every=2"], tmp_path)
    with caplog.at_level("WARNING", logger="ema_pg"):
        train(cfg)
    assert "rollout.max_staleness=500 with algo.iterations=2: every batch of this run is sampled by the initial " \
           "policy" in caplog.text


def test_a_run_of_whole_rollouts_resumes_on_another_number_of_workers_and_partial_rollouts_do_not(tmp_path):
    """``resume=RUN rollout.workers=1`` on a 2-worker run was refused ("the settings differ ... rollout.workers")
    where docs/async.md promises a resume on any number of workers: whole rollouts now take it (a pool's checkpoint
    holds whole batches, which one worker takes back: the slow pool test above); partial rollouts, whose streams
    are each worker's own, are refused in one line before anything starts."""
    from omegaconf import OmegaConf, open_dict

    from ema_pg.engine.runs import resolve_resume

    for partial in (False, True):
        extra = ["rollout.partial=true"] if partial else []
        saved = compose_cfg(["rollout.max_staleness=1", "rollout.workers=2", *extra], tmp_path)
        run = tmp_path / f"run{int(partial)}"
        run.mkdir()
        (run / "config.yaml").write_text(OmegaConf.to_yaml(saved, resolve=True))
        now = copy.deepcopy(saved)
        with open_dict(now):
            now.resume, now.rollout.workers, now.algo.iterations = str(run), 1, saved.algo.iterations + 2
        if partial:
            with pytest.raises(ConfigError) as e:
                resolve_resume(now)
            assert str(e.value) == ("resume: rollout.workers=1, but this run of partial rollouts ran on 2 workers, "
                                    "each continuing its own stream of groups in flight: resume with "
                                    "rollout.workers=2 (a run of whole rollouts may change it)")
        else:
            assert resolve_resume(now).rollout.workers == 1
        now.rollout.workers, now.algo.beta = 2, 0.5  # another setting is still refused
        with pytest.raises(ConfigError, match=r"settings differ from the run's \(algo.beta\)"):
            resolve_resume(now)


@pytest.mark.slow  # three runs with rollout workers: about 30 s
def test_a_two_worker_run_resumed_by_one_worker_samples_what_the_pool_would_have(tmp_path):
    """End to end: a 2-worker run to iteration 2, continued to 4 by one worker, against the uninterrupted 2-worker
    run: the same rewards every iteration (the same prompts and tokens), and weights within pi_old's rounding."""
    import pandas as pd

    from ema_pg.engine.fit import train
    from ema_pg.engine.policy import load_run_model

    common = ["rollout.max_staleness=1", "algo.iterations=4", "algo.eval_every=4", "task.digits=1", "task.eval_size=4",
              "sft.steps=150"]  # a base with some reward: the updates move the weights
    ref = compose_cfg([*common, "rollout.workers=2"], tmp_path / "ref")
    train(ref)
    cut = compose_cfg([*common, "rollout.workers=2", "algo.iterations=2"], tmp_path / "cut")
    train(cut)
    from omegaconf import open_dict

    again = compose_cfg([*common, "rollout.workers=1"], tmp_path / "cut")
    with open_dict(again):
        again.resume = cut.run_dir
    train(again)
    rewards = lambda c: pd.read_csv(f"{c.run_dir}/metrics.csv")["train/reward_mean"].dropna().tolist()
    assert len(rewards(ref)) == 4 and rewards(again) == rewards(ref) and any(rewards(ref))
    init = load_run_model(ref.run_dir, which="initial")[0].state_dict()
    a, b = (load_run_model(c.run_dir)[0].state_dict() for c in (ref, again))
    step = sum(((a[k] - init[k]) ** 2).sum() for k in a) ** 0.5
    assert step > 0 and sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5 / step < 1e-2
