"""One real RL step (ema_pg.step.rl_step) on a tiny model: what reaches the KL estimator.

The estimator is the real registry estimator behind a recording shim; the updater records the
loss's gradient without applying it, so the policy the step saw is the policy the test scores
with materialized (N, T, V) logits afterwards.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import compose_cfg

from ema_pg.heads import response_logits
from ema_pg.kl import KLInputs, get_estimator
from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
from ema_pg.rollout import HFSampler
from ema_pg.step import OldAndAnchorScorer, StepParts, rl_step
from ema_pg.tasks import build_task

K = 4


@pytest.fixture(scope="module")
def setup():
    task = build_task({"name": "toy_add", "eval_size": 8})
    tok = train_bpe_tokenizer(task.corpus(), vocab_size=300)
    policy = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=0,
                              tokenizer=tok)
    anchor = copy.deepcopy(policy).eval()
    with torch.no_grad():  # an anchor that differs from the policy, so whose top-k is used matters
        g = torch.Generator().manual_seed(1)
        for p in anchor.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
            p.requires_grad_(False)
    cfg = compose_cfg(["algo.prompts_per_step=3", "algo.group_size=2", "rollout.max_new_tokens=5", "algo.beta=1.0"])
    return policy, anchor, tok, task, cfg


class RecordingUpdater:
    """Records the gradient of each loss; never changes the policy."""

    def __init__(self, params):
        self.params, self.grads = list(params), []

    def step(self, losses, count=None):
        for loss in [losses] if torch.is_tensor(losses) else losses:
            self.grads.append(torch.autograd.grad(loss, self.params, allow_unused=True))
        return {}

    @property
    def lr(self):
        return 0.0


def run_step(setup, name, **kl):
    policy, anchor, tok, task, cfg = setup
    real = get_estimator(name, k=K, **kl)
    params = [p for p in policy.parameters() if p.requires_grad]
    seen = {}

    def recording(inputs: KLInputs, **p):
        out = real.fn(inputs, **p)
        seen["inputs"] = inputs
        seen["kl"] = out.detach()
        seen["grad"] = torch.autograd.grad(out.sum(), params, retain_graph=True, allow_unused=True)
        return out

    est = dataclasses.replace(real, fn=recording)
    res = rl_step(0, StepParts(policy, anchor, task, HFSampler(tok), est, cfg.algo, cfg.rollout, 0, lambda n: 7,
                               RecordingUpdater(params)), beta=cfg.algo.beta)
    return res, seen, real, params


@pytest.mark.parametrize("name", ["topk_reverse", "topk_forward"])
def test_what_reaches_the_estimator_equals_a_materialized_computation(setup, name):
    policy, anchor, *_ = setup
    res, seen, real, params = run_step(setup, name, tail="corrected")
    ro, inp = res.rollouts, seen["inputs"]
    mask = ro.response_mask.bool()  # (N, T)
    tokens = ro.input_ids[:, ro.prompt_len:]
    with torch.no_grad():
        lp_anchor = torch.log_softmax(response_logits(anchor, ro), -1)  # (N, T, V)
        lp_old = torch.log_softmax(response_logits(policy, ro), -1)
    own = lp_old.topk(K, -1).indices if name == "topk_reverse" else lp_anchor.topk(K, -1).indices
    other = lp_anchor.topk(K, -1).indices if name == "topk_reverse" else lp_old.topk(K, -1).indices
    # the index set is pi_old's top-k for reverse KL (Alg 1) and the anchor's for forward KL (Alg 2)...
    assert torch.equal(inp.topk_idx[mask].sort(-1).values, own[mask].sort(-1).values)
    assert not torch.equal(own[mask].sort(-1).values, other[mask].sort(-1).values)  # ...and that choice matters here
    # the anchor's and pi_old's log-probs equal the materialized ones
    assert torch.allclose(inp.topk_logp_ref[mask], lp_anchor.gather(-1, inp.topk_idx)[mask], atol=1e-5)
    assert torch.allclose(inp.logp_ref[mask], lp_anchor.gather(-1, tokens[..., None])[..., 0][mask], atol=1e-5)
    assert torch.allclose(inp.logp_old[mask], lp_old.gather(-1, tokens[..., None])[..., 0][mask], atol=1e-5)
    # the KL and its gradient equal the materialized path's (full logits, same estimator)
    lp = torch.log_softmax(response_logits(policy, ro), -1)  # with grad
    mat = KLInputs(logp=lp.gather(-1, tokens[..., None])[..., 0], logp_old=inp.logp_old, logp_ref=inp.logp_ref,
                   tokens=tokens, topk_idx=inp.topk_idx, topk_logp=lp.gather(-1, inp.topk_idx),
                   topk_logp_ref=inp.topk_logp_ref)
    kl = real(mat)
    assert torch.allclose(seen["kl"][mask], kl.detach()[mask], atol=1e-5)
    grad = torch.autograd.grad(kl.sum(), params, allow_unused=True)
    flat = lambda gs: torch.cat([g.flatten() for g in gs if g is not None])
    assert flat(grad).norm() > 1e-3  # the gradient being compared is not trivially zero
    assert torch.allclose(flat(seen["grad"]), flat(grad), atol=1e-5, rtol=1e-4)


def test_step_returns_metrics_and_scores_from_the_sampler_equal_a_second_pass(setup):
    policy, anchor, tok, task, cfg = setup
    res, *_ = run_step(setup, "topk_reverse", tail="paper")
    for key in ("train/loss", "train/kl", "train/reward_mean", "train/entropy", "train/kl_k3", "time/step_s"):
        assert key in res.metrics and res.metrics[key] == res.metrics[key], key
    # pi_old from the sampler (it saw every distribution) vs a no-grad pass of the policy: the same scores
    est = get_estimator("topk_reverse", k=K)
    scorer = OldAndAnchorScorer(est, 1.0, lambda n: 5)
    ro = res.rollouts
    assert ro.old is not None and ro.old.index is not None
    recomputed = scorer(policy, anchor, dataclasses.replace(ro, old=None))
    reused = scorer(policy, anchor, ro)
    mask = ro.response_mask.bool()
    assert torch.allclose(reused.old.logp[mask], recomputed.old.logp[mask], atol=1e-5)
    assert torch.equal(reused.index[mask], recomputed.index[mask])
    assert torch.allclose(reused.anchor_index_logp[mask], recomputed.anchor_index_logp[mask], atol=1e-5)
    assert torch.allclose(reused.old.entropy[mask], recomputed.old.entropy[mask], atol=1e-4)


def test_the_kl_to_policy_gradient_ratio_scales_with_beta_and_leaves_the_run_unchanged(tmp_path):
    """monitor.grad_ratio_every: ||grad beta KL|| / ||grad J|| on the first minibatch. K1's per-sample gradient is
    not zero where policy = anchor, so iteration 1 already has a KL gradient (the tiny cold start earns no reward:
    the entropy bonus gives the non-KL part its gradient); doubling beta doubles the KL part exactly and
    leaves the policy gradient as it was; the diagnostic does not change what the run does."""
    import pandas as pd
    from helpers import compose_cfg

    from ema_pg.train import train

    def first(beta, every, name):
        cfg = compose_cfg(["kl=k1", "algo.entropy_coef=0.01", f"algo.beta={beta}", f"monitor.grad_ratio_every={every}", "algo.iterations=1",
                           "algo.eval_every=1", "algo.minibatch_size=8"], tmp_path / name)
        cfg.sft.cache_dir = str(tmp_path / "cache")
        _, objs = train(cfg)
        return pd.read_csv(objs["run_dir"] / "metrics.csv").groupby("step").first().loc[1]  # first non-empty value

    a, b, off = first(0.1, 1, "a"), first(0.2, 1, "b"), first(0.1, 0, "off")
    assert a["train/grad_norm_pg"] == pytest.approx(b["train/grad_norm_pg"], rel=1e-6) and a["train/grad_norm_pg"] > 0
    assert b["train/grad_norm_kl"] == pytest.approx(2 * a["train/grad_norm_kl"], rel=1e-5) and a["train/grad_norm_kl"] > 0
    assert a["train/kl_pg_grad_ratio"] == pytest.approx(a["train/grad_norm_kl"] / a["train/grad_norm_pg"], rel=1e-6)
    assert "train/kl_pg_grad_ratio" not in off.dropna().index
    for key in ("train/loss", "train/grad_norm", "train/kl", "eval/avg/em"):  # the measurement changes nothing
        assert off[key] == a[key], key


def test_global_normalization_scales_the_kl_by_the_batch_std_as_the_authors_do(setup):
    """algo.global_kl_scale (adv_norm=global): PG uses (R - V)/(sigma + eps) and the KL beta/(sigma + eps), so the
    whole loss is the unnormalized one (adv_norm=none, KL at beta) over sigma + eps: the same gradient direction."""
    policy, anchor, tok, task, cfg = setup
    params = [p for p in policy.parameters() if p.requires_grad]
    est = get_estimator("k3")

    def grads(norm, scale):
        algo = copy.deepcopy(cfg.algo)
        algo.adv_norm, algo.global_kl_scale = norm, scale
        up = RecordingUpdater(params)
        res = rl_step(0, StepParts(policy, anchor, task, HFSampler(tok), est, algo, cfg.rollout, 0, lambda n: 7, up),
                      beta=algo.beta)
        return res, torch.cat([g.flatten() for g in up.grads[0] if g is not None])

    m_none, g_none = grads("none", True)
    m_glob, g_glob = grads("global", True)
    m_off, g_off = grads("global", False)
    beta = cfg.algo.beta
    assert m_none.kl_weight == beta and m_off.kl_weight == beta  # no scale without both settings
    assert m_glob.metrics["train/kl_weight"] == m_glob.kl_weight and "train/kl_weight" not in m_off.metrics
    assert m_glob.metrics["train/kl_coef"] == m_glob.beta == beta  # beta in force: one name, whatever the weight
    over = beta / m_glob.kl_weight  # sigma + eps
    assert over < 1.0  # rewards in [0, 1]: the batch std of R - V(x) is below 1, so the KL weight grows
    assert torch.allclose(g_glob * over, g_none, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(g_off * over, g_none, rtol=1e-3, atol=1e-6)  # the KL left at beta: another balance


def test_the_step_applies_the_beta_it_is_given_and_reads_no_other(setup):
    """beta is bound once, by the caller (the run's KL controller): the step's gradient follows the beta it is
    given, whatever algo.beta says, and the result carries it typed (beta, the loss's weight, the controller's KL)."""
    policy, anchor, tok, task, cfg = setup
    params = [p for p in policy.parameters() if p.requires_grad]
    est = get_estimator("k3")

    def step(raw, given):
        algo = copy.deepcopy(cfg.algo)
        algo.beta = raw
        up = RecordingUpdater(params)
        res = rl_step(0, StepParts(policy, anchor, task, HFSampler(tok), est, algo, cfg.rollout, 0, lambda n: 7, up),
                      beta=given)
        return res, torch.cat([g.flatten() for g in up.grads[0] if g is not None])

    a, ga = step(0.01, 0.3)
    b, gb = step(0.9, 0.3)
    c, gc = step(0.01, 0.0)
    assert torch.equal(ga, gb) and not torch.allclose(ga, gc)  # algo.beta moved nothing; the given beta did
    assert a.beta == a.kl_weight == 0.3 and a.metrics["train/kl_coef"] == 0.3 and c.kl_weight == 0.0
    assert a.ctrl_kl == a.metrics["train/kl_ctrl_kl"] and a.ctrl_kl > 0  # the controller's KL, typed and logged


def test_the_step_runs_from_plain_records_and_reads_no_raw_beta(setup):
    """rl_step driven end to end from the plain records a run binds (ema_pg.config.step_records), not config nodes:
    every field it reads is one of the record's, and algo.beta is not among them (beta is given, bound once)."""
    from ema_pg.config import step_records

    policy, anchor, tok, task, cfg = setup
    algo, rollout = step_records(cfg)
    reads = set()

    class Reading:
        def __init__(self, rec):
            self._rec = rec

        def __getattr__(self, name):
            reads.add(name)
            return getattr(self._rec, name)

    params = [p for p in policy.parameters() if p.requires_grad]
    res = rl_step(0, StepParts(policy, anchor, task, HFSampler(tok), get_estimator("k3"), Reading(algo), rollout, 0,
                               lambda n: 7, RecordingUpdater(params)), beta=0.02)
    assert res.beta == 0.02 and reads and "beta" not in reads
    assert reads <= {f.name for f in dataclasses.fields(algo)}


def test_the_steps_last_line_is_the_anchors_rule_with_its_lag_logged_before_it(setup):
    """Step 5 (Alg 3, line 25): with an EMA rule (eta 0.5, every iteration) the anchor moves half way to the policy,
    which the recording updater leaves as it was, so the lag halves; the logged lag and count are those before the
    rule ran. A rollout worker's parts (no rule) leave the anchor where it is."""
    from ema_pg.anchors import get_scheme
    from ema_pg.anchors.follow import Anchor

    policy, anchor, tok, task, cfg = setup
    model = copy.deepcopy(anchor)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    rule = Anchor(get_scheme("ema", eta=0.5, update_every=1))
    rule.attach(policy, model)
    before = rule.lag_norm(policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    res = rl_step(0, StepParts(policy, model, task, HFSampler(tok), get_estimator("k3"), cfg.algo, cfg.rollout, 0,
                               lambda n: 7, RecordingUpdater(params), anchor=rule), beta=cfg.algo.beta)
    assert res.metrics["anchor/lag_norm"] == before and res.metrics["anchor/updates"] == 0
    assert rule.updates == 1 and rule.lag_norm(policy) == pytest.approx(before / 2, rel=1e-5)
    still = copy.deepcopy(model)
    rl_step(1, StepParts(policy, still, task, HFSampler(tok), get_estimator("k3"), cfg.algo, cfg.rollout, 0,
                         lambda n: 7, RecordingUpdater(params)), beta=cfg.algo.beta)
    assert all(torch.equal(a, b) for a, b in zip(still.parameters(), model.parameters()))


def test_group_estimator_returns_the_kl_scale_by_hand():
    """R = (1,0,0,0 | 1,1,0,0): R - V = (.75,-.25,-.25,-.25 | .5,.5,-.5,-.5), unbiased std sqrt(1.75/7) = 0.5."""
    from ema_pg.advantages import ADVANTAGES, AdvantageInputs

    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    mask = torch.ones(8, 3)
    on = ADVANTAGES["group"](AdvantageInputs(r, 4, mask, mask, norm="global", gamma=1.0, lam=1.0, global_kl_scale=True))
    assert on.kl_scale == pytest.approx(1 / (0.5 + 1e-6), rel=1e-12)
    assert torch.allclose(on.adv, torch.tensor([.75, -.25, -.25, -.25, .5, .5, -.5, -.5]) / (0.5 + 1e-6))
    for norm, flag in (("global", False), ("group", True), ("none", True)):
        assert ADVANTAGES["group"](AdvantageInputs(r, 4, mask, mask, norm=norm, gamma=1.0, lam=1.0, global_kl_scale=flag)).kl_scale == 1.0
