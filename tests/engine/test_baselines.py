"""PPO's critic (GAE, value loss), DAPO's controls, and the anchor schemes in real runs."""

import json

import pandas as pd
import pytest
import torch
from helpers import compose_cfg
from omegaconf import OmegaConf

from ema_pg.config import ConfigError
from ema_pg.critic import Critic, gae, last_token_rewards, value_loss, whiten
from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
from ema_pg.rollout import HFSampler
from ema_pg.rollout.base import Rollouts
from ema_pg.step import overlong_penalty
from ema_pg.tasks import build_task
from ema_pg.train import train


# ---------------------------------------------------------------- GAE and the value loss, by hand
def test_gae_by_hand_skips_observation_tokens():
    # row 0: policy tokens at 0, 1, (observation at 2), 3; row 1: policy tokens 0, 1 then padding
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    values = torch.tensor([[0.5, 0.2, 9.0, 0.4], [0.1, 0.3, 9.0, 9.0]])
    rewards = last_token_rewards(torch.tensor([1.0, 2.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 1.0], [0, 2.0, 0, 0]]
    g, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, mask, g, lam)
    # row 0, backwards over tokens 3, 1, 0 (the observation's value 9.0 is never read)
    d3 = 1.0 + g * 0 - 0.4
    d1 = 0 + g * 0.4 - 0.2
    d0 = 0 + g * 0.2 - 0.5
    a3, a1 = d3, d1 + g * lam * d3
    a0 = d0 + g * lam * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, 0.0, a3])
    e1 = 2.0 - 0.3
    e0 = g * 0.3 - 0.1 + g * lam * e1
    assert adv[1].tolist() == pytest.approx([e0, e1, 0.0, 0.0])
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, 0.0, a3 + 0.4])
    # gamma = lambda = 1: every policy token's advantage is R - V_t (Monte-Carlo with a value baseline)
    adv1, _ = gae(rewards, values, mask, 1.0, 1.0)
    assert adv1[0].tolist() == pytest.approx([1 - 0.5, 1 - 0.2, 0.0, 1 - 0.4])


def test_whiten_and_clipped_value_loss_by_hand():
    mask = torch.tensor([[1, 1, 0]])
    w = whiten(torch.tensor([[1.0, 3.0, 100.0]]), mask)
    assert w[0, :2].tolist() == pytest.approx([-2 ** -0.5, 2 ** -0.5], rel=1e-6) and float(w[0, 2]) == 0.0
    v, old, ret = torch.tensor([[1.0, 0.0, 5.0]]), torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[2.0, 1.0, 0.0]])
    loss, m = value_loss(v, old, ret, mask, clip=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> max 3.24; token 1: (0-1)^2 = 1 both
    assert float(loss) == pytest.approx(0.5 * (3.24 + 1.0) / 2)
    assert float(m["value_clip_frac"]) == pytest.approx(0.5)
    loss0, _ = value_loss(v, old, ret, mask, clip=0.0)
    assert float(loss0) == pytest.approx(0.5 * (1.0 + 1.0) / 2)


@pytest.fixture(scope="module")
def toy_rollouts():
    task = build_task({"name": "toy_add"})
    tok = train_bpe_tokenizer(task.corpus(), vocab_size=300)
    torch.manual_seed(0)
    m = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         tokenizer=tok)
    prompts = task.sample(8, seed=0)
    ro = HFSampler(tok).generate(m, [p.text for p in prompts], 4, temperature=1.0, max_new_tokens=5, seed=0)
    return m, tok, ro


def test_the_value_loss_falls_on_toy_task_rollouts(toy_rollouts):
    m, _, ro = toy_rollouts
    mask = ro.response_mask
    # a return the critic can read off the response: 1 when the first response token is even
    R = (ro.input_ids[:, ro.prompt_len] % 2 == 0).float()
    critic = Critic(m, lr=3e-3, clip=0.0, grad_clip=1.0)
    old = critic.values(ro)
    assert float(old.abs().max()) == 0.0  # zero-initialized head: the first values are 0
    _, ret = gae(last_token_rewards(R, mask), old, mask, 1.0, 1.0)
    losses = [critic.update([(ro, old, ret, mask, None)])["value_loss"] for _ in range(40)]
    assert losses[-1] < 0.2 * losses[0], losses[::8]
    assert all(p.grad is None for p in m.parameters())  # the policy is not touched by the critic


def test_truncated_rows_are_flagged_by_the_sampler(toy_rollouts):
    m, tok, ro = toy_rollouts
    n_policy = ro.response_mask.sum(-1)
    ended_eos = torch.tensor([tok.eos_token_id in row.tolist() for row in ro.input_ids[:, ro.prompt_len:]])
    assert torch.equal(ro.truncated, (n_policy == 5) & ~ended_eos)
    assert bool(ro.truncated.any())


def test_rollouts_cat_pads_prompts_left_and_responses_right(toy_rollouts):
    m, tok, ro = toy_rollouts
    short = HFSampler(tok).generate(m, ["1+2="], 2, temperature=1.0, max_new_tokens=2, seed=3)
    both = Rollouts.cat([short, ro.select([0, 1])], pad_id=tok.pad_token_id)
    from ema_pg.heads import head

    with torch.no_grad():  # scoring the joined batch = scoring each part (positions follow the attention mask)
        joined = head(m, both).logp
        a, b = head(m, short).logp, head(m, ro.select([0, 1])).logp
    mask = both.response_mask.bool()
    assert torch.allclose(joined[:2, : a.shape[1]][mask[:2, : a.shape[1]]], a[short.response_mask.bool()], atol=1e-5)
    assert torch.allclose(joined[2:, : b.shape[1]][mask[2:, : b.shape[1]]], b[ro.response_mask.bool()[:2]], atol=1e-5)
    assert both.truncated.tolist() == short.truncated.tolist() + ro.truncated[:2].tolist()


def test_overlong_penalty_is_dapos_soft_punishment():
    lengths = torch.tensor([10, 12, 14, 16])  # max 16, buffer 4: free up to 12, then linear to -1 at 16
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5])


# ---------------------------------------------------------------- in real runs
def metrics_of(objs):
    return pd.read_csv(objs["run_dir"] / "metrics.csv")


LEARNABLE = ["task.digits=1", "task.eval_size=7", "sft.steps=100", "sft.stop_at_reward=0"]  # a cold start with some reward


def test_ppo_run_trains_its_critic_and_resumes_exactly(tmp_path):
    base = ["method=ppo", *LEARNABLE, "algo.critic_lr=1e-3", "algo.minibatch_size=8", "algo.eval_every=2"]
    _, full = train(compose_cfg(base, tmp_path / "full"))
    df = metrics_of(full)
    assert df["train/value_loss"].notna().sum() == 4 and (df["train/value_loss"].dropna() > 0).any()
    for clip, binds in (("1e-4", True), ("0", False)):  # algo.cliprange_value: a tight clip binds, 0 never clips
        _, short = train(compose_cfg([*base, "algo.iterations=2", "algo.ppo_epochs=2", f"algo.cliprange_value={clip}"],
                                     tmp_path / clip))  # a second epoch: values moved from the old ones
        assert bool((metrics_of(short)["train/value_clip_frac"].dropna() > 0).any()) is binds
    cfg = OmegaConf.load(full["run_dir"] / "config.yaml")
    assert cfg.algo.advantage == "gae" and cfg.algo.adv_norm == "global" and cfg.anchor.eta == 1.0
    train(compose_cfg([*base, "algo.iterations=2"], tmp_path / "half"))
    resumed = OmegaConf.load(tmp_path / "half" / "run" / "config.yaml")
    resumed.algo.iterations, resumed.resume = 4, str(tmp_path / "half" / "run")
    _, again = train(resumed)
    cols = lambda d: d[[c for c in d.columns if not c.startswith("time/")]].sort_values("step", kind="stable").reset_index(drop=True)
    pd.testing.assert_frame_equal(cols(df), cols(metrics_of(again)), check_exact=True)  # the critic and its Adam came back


def test_sync_anchor_counts_optimizer_steps_in_a_run(tmp_path):
    # 2 minibatches per iteration = 2 optimizer steps; a mix every 3 steps -> 8 steps give 2 mixes
    _, objs = train(compose_cfg(["anchor=sync", "anchor.sync_steps=3", "anchor.sync_alpha=0.5", "algo.minibatch_size=8",
                                 *LEARNABLE],
                                tmp_path))
    df = metrics_of(objs)
    assert df["anchor/updates"].dropna().tolist() == [0, 1, 2, 2]
    assert df["anchor/lag_norm"].dropna().iloc[-1] > 0  # the anchor trails the policy between mixes


def test_reset_anchor_equals_the_policy_after_each_update(tmp_path):
    _, objs = train(compose_cfg(["anchor=reset", "anchor.update_every=2", *LEARNABLE], tmp_path))
    from ema_pg.engine.policy import load_run_model

    df = metrics_of(objs)
    assert df["anchor/updates"].dropna().tolist() == [0, 0, 1, 1]  # logged before the reset after iterations 2 and 4
    assert df["anchor/lag_norm"].dropna().iloc[-1] > 0  # logged before the reset: the policy had moved
    pol, _ = load_run_model(objs["run_dir"], "policy")
    anc, _ = load_run_model(objs["run_dir"], "anchor")
    pa = dict(anc.named_parameters())
    assert all(torch.equal(p, pa[n]) for n, p in pol.named_parameters())  # after the last reset: theta_ref = theta


def test_teacher_anchor_of_another_architecture_and_a_bad_anchor_path(tmp_path):
    _, objs = train(compose_cfg(["algo.iterations=2"], tmp_path / "student"))
    from ema_pg.engine.models import load_model_dir

    student, tok = load_model_dir(objs["run_dir"] / "model")
    teacher = build_tiny_model(len(tok), hidden_size=48, num_layers=3, num_heads=2, num_kv_heads=1,
                               tokenizer=tok)
    tdir = tmp_path / "teacher"
    teacher.save_pretrained(tdir)
    tok.save_pretrained(tdir)
    _, objs2 = train(compose_cfg(["anchor=teacher", f"model.teacher_path={tdir}", "algo.iterations=2", "algo.beta=0.1"],
                                 tmp_path / "distill"))
    df = metrics_of(objs2)
    assert (df["train/kl"].dropna() > 0.1).all()  # a random teacher is far from the policy
    pytest.importorskip("peft")
    _, objs_l = train(compose_cfg(["anchor=teacher", f"model.teacher_path={tdir}", "algo.iterations=2", "algo.beta=0.1",
                                   "model.lora_rank=4"], tmp_path / "distill_lora"))  # a LoRA student of the same teacher
    assert (metrics_of(objs_l)["train/kl"].dropna() > 0.1).all()
    with pytest.raises(ConfigError, match="another architecture"):  # an anchor that follows the policy must match it
        train(compose_cfg([f"anchor.path={tdir}", "algo.iterations=2"], tmp_path / "bad"))
    with pytest.raises(ConfigError, match="model.teacher_path"):
        train(compose_cfg(["anchor=teacher"], tmp_path / "none"))
    # anchor.path with the policy's architecture: the anchor starts there, not at the policy
    _, objs3 = train(compose_cfg([f"anchor.path={objs['run_dir'] / 'model'}", "algo.iterations=2", "seed=3"],
                                 tmp_path / "path"))
    assert metrics_of(objs3)["anchor/lag_norm"].dropna().iloc[0] > 0


def test_dynamic_sampling_keeps_groups_with_a_reward_spread(tmp_path):
    _, objs = train(compose_cfg(["algo.dynamic_sampling=true", *LEARNABLE, "algo.max_sampling_rounds=3"], tmp_path))
    df = metrics_of(objs)
    rounds, zero = df["train/sampling_rounds"].dropna(), df["train/frac_groups_zero_std"].dropna()
    assert ((rounds > 1) == (zero > 0)).all()  # a refill round exactly when the first round had a flat group
    assert (rounds <= 3).all() and (rounds > 1).any()
    kept_flat = df["train/frac_groups_kept_zero_std"].dropna()
    assert (kept_flat <= zero + 1e-9).all()  # refilling never leaves more flat groups than the first round had
    assert (kept_flat < zero).any()  # and it did replace some
    assert json.loads((objs["run_dir"] / "eval.json").read_text())["splits"]


def test_mask_truncated_and_overlong_penalty_in_a_run(tmp_path):
    _, objs = train(compose_cfg(["algo.mask_truncated=true", "algo.overlong_buffer=2", *LEARNABLE], tmp_path))
    df = metrics_of(objs)
    assert (df["train/frac_truncated"].dropna() > 0).any()
    # overlong rewards are negative for responses in the buffer: the reward mean falls below the exact-match rate
    assert (df["train/reward_mean"].dropna() < 0).any()


def test_masking_truncated_responses_removes_their_loss(tmp_path):
    # one policy token per response: every row that does not end at once is truncated, so no loss is left
    _, objs = train(compose_cfg(["algo.mask_truncated=true", "rollout.max_new_tokens=1", "algo.beta=0.1", *LEARNABLE],
                                tmp_path))
    df = metrics_of(objs).dropna(subset=["train/loss"])
    full = df[df["train/frac_truncated"] == 1.0]
    assert len(full) and (full["train/loss"] == 0).all() and (full["train/grad_norm"] == 0).all()


def test_a_run_saved_before_a_knob_existed_still_resumes_at_its_default():
    from ema_pg.config import with_defaults
    from ema_pg.engine.runs import config_differences

    cfg = with_defaults(compose_cfg([]))
    cfg.run_dir = "runs/x"  # as a run saves it, resolved
    old = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for node, key in (("model", "lora_rank"), ("algo", "entropy_coef"), ("kl", "straight_through")):
        old[node].pop(key)  # a run saved by a version without these knobs
    assert config_differences(old, cfg) == []  # at their defaults they change nothing
    changed = with_defaults(compose_cfg(["algo.entropy_coef=0.1"]))
    changed.run_dir = "runs/x"
    assert config_differences(old, changed) == ["algo.entropy_coef"]
