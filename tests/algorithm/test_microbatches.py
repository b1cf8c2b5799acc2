"""Micro-batches and padding-free passes in the RL step: one iteration of ema_pg.step.rl_step gives the loss, the
gradient and the metrics of the padded single pass, to float rounding, for every loss aggregation, every surrogate,
every KL estimator family (sampled, Top-k with its index set, exact), with a critic, and with rows that share
prefixes; and the micro-batches keep to their token budget."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import compose_cfg
from omegaconf import open_dict

from ema_pg.config import build_estimator
from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
from ema_pg.rollout import HFSampler
from ema_pg.step import StepParts, rl_step
from ema_pg.microbatches import micro_batches
from ema_pg.tasks import build_task


@pytest.fixture(scope="module")
def setup():
    task = build_task({"name": "toy_add", "eval_size": 8})
    tok = train_bpe_tokenizer(task.corpus(), vocab_size=300)
    policy = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=0,
                              tokenizer=tok)
    anchor = copy.deepcopy(policy).eval()
    with torch.no_grad():  # an anchor apart from the policy: the KL and its index set matter
        g = torch.Generator().manual_seed(1)
        for p in anchor.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
            p.requires_grad_(False)
    return policy, anchor, tok, task


class Recorder:
    """Sums the gradients of the losses it is given (the micro-batches' accumulate) and applies none."""

    def __init__(self, params):
        self.params, self.grad, self.loss = list(params), None, 0.0

    def step(self, losses, count=None):
        for loss in [losses] if torch.is_tensor(losses) else losses:
            g = torch.autograd.grad(loss, self.params, allow_unused=True)
            g = torch.cat([(x if x is not None else torch.zeros_like(p)).flatten() for x, p in zip(g, self.params)])
            self.grad = g if self.grad is None else self.grad + g
            self.loss += float(loss.detach())
        return {}

    @property
    def lr(self):
        return 0.0


def one_step(setup, overrides: list[str], critic: bool = False):
    policy, anchor, tok, task = setup
    policy = copy.deepcopy(policy)
    cfg = compose_cfg(["algo.prompts_per_step=4", "algo.group_size=3", "rollout.max_new_tokens=6", "algo.beta=0.5",
                       *overrides])
    est = build_estimator(cfg.kl)
    rec = Recorder(p for p in policy.parameters() if p.requires_grad)
    crit = None
    if critic:
        from ema_pg.critic import Critic

        torch.manual_seed(3)
        crit = Critic(policy, lr=1e-3, clip=0.2, grad_clip=1.0)
        with torch.no_grad():  # a value head away from zero: the values depend on the pass
            crit.model.head.weight.normal_(0, 0.5)
    res = rl_step(0, StepParts(policy, anchor, task, HFSampler(tok), est, cfg.algo, cfg.rollout, 0, lambda n: 5, rec,
                               critic=crit), beta=cfg.algo.beta)
    crit_w = None if crit is None else torch.cat([p.detach().flatten() for p in crit.model.parameters()])
    return rec, res.metrics, crit_w


PASSES = {  # each against the padded single pass
    "packed": ["algo.padding_free=true", "algo.share_prefixes=false"],
    "packed, shared prefixes": ["algo.padding_free=true", "algo.share_prefixes=true"],
    "micro-batches of 20 tokens, packed": ["algo.padding_free=true", "algo.max_tokens_per_microbatch=20"],
    "micro-batches of 20 tokens, padded": ["algo.padding_free=false", "algo.max_tokens_per_microbatch=20"],
}
CASES = ([[f"algo.loss_agg={a}"] for a in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum",
                                          "seq-mean-token-sum-norm")]
         + [["algo.loss=gspo", "algo.eps_low=0.01", "algo.eps_high=0.01"], ["algo.loss=cispo"],
            ["algo.entropy_coef=0.01"]]
         + [[f"kl={k}"] for k in ("k3", "topk_forward", "exact_reverse", "exact_forward")] + [["kl=topk_reverse", "kl.k=4"]])


@pytest.mark.parametrize("case", CASES, ids=lambda c: " ".join(c))
def test_every_pass_gives_the_padded_single_pass_loss_gradient_and_metrics(setup, case):
    ref, ref_m, _ = one_step(setup, ["algo.padding_free=false", *case])
    assert ref.grad.norm() > 1e-4  # the guard: there is a gradient to compare
    for name, over in PASSES.items():
        got, m, _ = one_step(setup, [*over, *case])
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-6, msg=f"{name}: gradient")
        assert got.loss == pytest.approx(ref.loss, rel=1e-5, abs=1e-7), name
        for k in ("train/pg_loss", "train/kl", "train/clip_frac_high", "train/ratio_mean", "train/ratio_max",
                  "train/approx_kl_old", "train/entropy"):
            if k in ref_m:
                assert m[k] == pytest.approx(ref_m[k], rel=1e-4, abs=1e-6, nan_ok=True), (name, k)


def test_with_a_critic_the_values_returns_and_value_step_are_the_single_passes(setup):
    case = ["method=ppo", "algo.minibatch_size=12"]
    ref, ref_m, ref_w = one_step(setup, ["algo.padding_free=false", *case], critic=True)
    for name, over in PASSES.items():
        got, m, w = one_step(setup, [*over, *case], critic=True)
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-6, msg=name)
        # Adam's first step moves each weight by about lr (1e-3) times the sign of its gradient; a gradient near
        # Adam's eps (1e-8) moves by a fraction of that which the last bits of the gradient decide, so the weights
        # agree to 1% of a step, not to the gradient's tolerance (a wrong value step is off by a whole step)
        torch.testing.assert_close(w, ref_w, rtol=1e-4, atol=1e-5, msg=f"{name}: the value model after its step")
        for k in ("train/value_loss", "train/value_clip_frac", "train/value_explained_var"):
            assert m[k] == pytest.approx(ref_m[k], rel=1e-4, abs=1e-6, nan_ok=True), (name, k)


def test_micro_batches_keep_to_the_budget_and_to_a_prompts_rows(setup):
    policy, _, tok, task = setup
    prompts = task.sample(6, seed=2)
    ro = HFSampler(tok).generate(policy, [p.text for p in prompts], 3, temperature=1.0, max_new_tokens=6, seed=0)
    tokens = ro.attention_mask.sum(1)
    for budget in (1, 12, 25, 60, 10_000):
        parts = micro_batches(ro, budget)
        assert sorted(torch.cat(parts).tolist()) == list(range(len(ro)))  # every row once
        for p in parts:
            assert len(p) == 1 or int(tokens[p].sum()) <= budget  # within the budget, or a row alone
        if budget >= int(tokens.sum()):
            assert len(parts) == 1
    parts = micro_batches(ro, 25)
    assert len(parts) > 2
    order = [ro.prompt_index[i] for p in parts for i in p.tolist()]
    assert order == sorted(order)  # a prompt's samples stay together (and share their prefix)


def test_a_run_with_micro_batches_and_packing_repeats_the_padded_runs_first_iteration(tmp_path):
    """Through train(): the first iteration's logged metrics of a padded run and of a packed run with micro-batches
    agree to rounding (the runs then part by rounding, as any two numerics do)."""
    import pandas as pd

    from ema_pg.train import train

    rows = {}
    for name, over in (("padded", ["algo.padding_free=false"]),
                       ("packed", ["algo.padding_free=true", "algo.max_tokens_per_microbatch=30"])):
        cfg = compose_cfg(["algo.iterations=2", "algo.eval_every=2", *over], tmp_path / name)
        with open_dict(cfg):
            cfg.sft.cache_dir = str(tmp_path / "cache")
        train(cfg)
        m = pd.read_csv(tmp_path / name / "run" / "metrics.csv")
        rows[name] = m[m["train/loss"].notna()].iloc[0]  # the first iteration's
    for k in ("train/loss", "train/pg_loss", "train/kl", "train/grad_norm", "train/reward_mean", "train/entropy"):
        assert rows["packed"][k] == pytest.approx(rows["padded"][k], rel=1e-4, abs=1e-6), k
