"""task=text_env: skyrl-gym's multi-turn environments (the real package) on data in SkyRL's layout: an episode laid
out token for token with its masks, its return replayed from its text, and a failing environment named."""

from __future__ import annotations

import pytest
import skyrl_gym
import torch
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
from ema_pg.rollout import HFSampler
from ema_pg.scores import ScoreRequest
from ema_pg.tasks import TaskError, build_task
from ema_pg.workbench.byo import write_examples

OBS = ("Please provide your step-by-step reasoning, and also include a tentative numeric answer at the end in the "
       "exact format: '#### ANSWER'.")  # gsm8k_multi_turn's own words for every turn but the last


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_examples(tmp_path_factory.mktemp("byo")) / "skyrl_gsm8k"


def env_task(data, **kw):
    return build_task({"name": "text_env", "data_dir": str(data), **{"turn_end": " ", **kw}})


def test_rows_are_skyrls_and_the_environment_is_skyrl_gyms(data):
    t = env_task(data, turn_end="</answer>")
    p = t.sample(1, seed=0)[0]
    assert p.meta["env_class"] == "gsm8k_multi_turn" and p.messages[0]["role"] == "user"
    assert p.meta["extras"]["reward_spec"]["method"] == "rule" and p.meta["extras"]["extra_info"]["max_turns"] == 3
    assert list(t.eval_splits()) == ["openai/gsm8k"] and len(t.eval_splits()["openai/gsm8k"]) == 5
    gold = p.answer  # the environment's own rule: a correct '#### N' is 1.0 and ends the episode
    assert t.reward(p, f"so #### {gold}") == 1.0 and len(t.replay(p, f"so #### {gold}")) == 1
    # a wrong but well-formatted first turn, the environment's prompt, then the right answer: 0.2 / 3 + 1
    obs = f"\n{OBS}\n"
    assert t.reward(p, f"#### 0</answer>{obs}#### {gold}") == pytest.approx(0.2 / 3 + 1.0)


def test_an_episode_is_laid_out_token_for_token_with_its_masks(data):
    """A tiny random policy on gsm8k_multi_turn (3 turns): a turn ends at an "e" (often, from a random policy; inside
    a token too, which the replay tells apart by the observation that follows); the environment's observation,
    rendered by observation_format, is in the sequence verbatim with loss mask 0; the replayed return equals the
    sum of the rewards the live environments gave."""
    t = env_task(data, observation_format="\n<obs>{content}</obs>\n", turn_end="e")
    prompts = t.sample(3, seed=1)
    tok = train_bpe_tokenizer([p.text for p in t.train_set] + [OBS] * 5 + ["#### 7 so"] * 5, vocab_size=300)
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                             tokenizer=tok).eval()
    live: list[tuple[str, float, str]] = []  # (turn, reward, observation) of every live step, in order
    step = t._step

    def recording(env, prompt, turn):
        r, done, obs = step(env, prompt, turn)
        live.append((turn, r, "" if done else obs))
        return r, done, obs

    t._step = recording
    on_stop, rows = t.on_stop_fn(prompts, 2), []

    def answering(rs, texts):
        rows.extend(rs)
        return on_stop(rs, texts)

    ro = HFSampler(tok).generate(model, [p.text for p in prompts], 2, temperature=1.0, max_new_tokens=60,
                                 stop=["e"], on_stop=answering, seed=3, score=ScoreRequest())
    t._step = step
    seen_obs = 0
    for r in range(len(ro)):
        resp = ro.input_ids[r, ro.prompt_len:]
        lm, am = ro.loss_mask[r, ro.prompt_len:], ro.attention_mask[r, ro.prompt_len:]
        env_pos = ((am == 1) & (lm == 0)).nonzero().flatten().tolist()
        turns = t.replay(prompts[r // 2], ro.responses[r])
        assert len(turns) <= 3  # gsm8k_multi_turn's max_turns
        # the masked tokens are the environment's observations after each turn but the last, verbatim, in order
        said = [obs for _, _, done, obs in turns[:-1]]
        assert all(o.startswith("\n<obs>") and o.endswith("</obs>\n") for o in said)
        expect = [i for o in said for i in tok(o, add_special_tokens=False)["input_ids"]]
        assert resp[env_pos].tolist() == expect
        # each observation is one contiguous block that starts right after its turn's last policy token
        blocks = [b for b in _runs(env_pos)]
        assert len(blocks) == len(said) and all(lm[b[0] - 1] == 1 for b in blocks)
        seen_obs += len(said)
    assert seen_obs >= 4  # turns did end and the environment did answer
    # the replay meets the live episode: each row's live turns (the text the sampler gave the environment, the
    # reward and the observation it answered) are its replay's turns but the last (ended by EOS or the budget)
    def plain(text):  # the sampler hands the environment the turn's special tokens too; a response has none
        for sp in tok.all_special_tokens:
            text = text.replace(sp, "")
        return text

    for r in range(len(ro)):
        mine = [(plain(turn), rew, obs) for (turn, rew, obs), row in zip(live, rows) if row == r]
        assert [(turn, rew, obs) for turn, rew, _, obs in t.replay(prompts[r // 2], ro.responses[r])[:len(mine)]] == mine
    with torch.no_grad():
        from ema_pg.heads import head

        h = head(model, ro)  # scoring the interleaved sequence reproduces the sampler's log-probs
    mask = ro.response_mask.bool()
    assert (h.logp - ro.old.logp)[mask].abs().max() < 1e-5


class _Raises(BaseTextEnv):
    def __init__(self, env_config=None, extras=None):
        super().__init__()

    def step(self, action):
        raise RuntimeError("the grader is down")


class _TextReward(BaseTextEnv):
    def __init__(self, env_config=None, extras=None):
        super().__init__()

    def step(self, action):
        return BaseTextEnvStepOutput(observations=[], reward="1", done=True, metadata={})


@pytest.mark.parametrize("env, said", [
    ("test_raises", "environment test_raises (row 0 of train) raised on turn 'x ': RuntimeError: the grader is down"),
    ("test_text_reward", "environment test_text_reward (row 0 of train) returned reward '1' (str) on turn 'x '"),
])
def test_an_environment_that_raises_or_returns_no_float_is_named_with_its_episode(data, env, said):
    for name, cls in (("test_raises", _Raises), ("test_text_reward", _TextReward)):
        if name not in skyrl_gym.registry:
            skyrl_gym.register(id=name, entry_point=cls)
    t = env_task(data, env_class=env)
    with pytest.raises(TaskError) as e:
        t.reward(t.train_set[0], "x y")
    assert said in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw, said", [
    ({"env_class": "gsm8k_multiturn"}, "env_class 'gsm8k_multiturn' is not a skyrl-gym environment"),
    ({"data_dir": "/nonexistent"}, "no train.parquet, validation.parquet; SkyRL's dataset scripts write"),
    ({"turn_end": ""}, "task.turn_end is empty"),
    ({"observation_format": "{obs}"}, "task.observation_format='{obs}'"),
    ({"max_turns": -3}, "task.max_turns=-3: give a whole number >= 1"),
    ({"max_turns": 0}, "task.max_turns=0: give a whole number >= 1"),
])
def test_bad_settings_are_one_line(data, kw, said):
    with pytest.raises(ValueError) as e:
        env_task(data, **kw) if "data_dir" not in kw else build_task({"name": "text_env", "turn_end": " ", **kw})
    assert said in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("prompt, said", [
    ("plain text", "row 0's prompt is 'plain text'; SkyRL's prompt is a list of chat messages"),
    ([{"role": "user", "content": "  "}], "row 1's prompt has no user message with text"),
])
def test_data_rows_whose_prompt_is_not_chat_messages_are_named_by_file_and_row(data, tmp_path, prompt, said):
    """A prompt column of plain strings said "string indices must be integers" with the wrong advice, and a row
    with an empty user message was taken."""
    import shutil

    import pandas as pd

    d = tmp_path / "data"
    shutil.copytree(data, d)
    df = pd.read_parquet(d / "train.parquet")
    df["prompt"] = ([prompt] * len(df) if isinstance(prompt, str)  # a column of plain strings
                    else [df["prompt"].iloc[0], prompt, *df["prompt"].iloc[2:]])
    df.to_parquet(d / "train.parquet")
    with pytest.raises(ValueError) as e:
        env_task(d)
    assert f"{d / 'train.parquet'}: {said}" in str(e.value) and "\n" not in str(e.value)


def _runs(positions: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted positions."""
    out: list[list[int]] = []
    for p in positions:
        if out and p == out[-1][-1] + 1:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def test_an_episode_that_could_pass_the_models_context_is_refused_before_any_work(data, tmp_path):
    """One observation of up to rollout.max_obs_tokens after the longest prompt and the response budget must fit the
    model's context, or the sampler would cut or overrun it mid-episode: one line at start, naming the task."""
    from helpers import compose_cfg
    from transformers import GPT2Config, GPT2LMHeadModel

    from ema_pg.config import ConfigError
    from ema_pg.engine.fit import check_fits
    from ema_pg.prompts import PromptEncoder

    task = env_task(data)
    tok = train_bpe_tokenizer([p.text for p in task.train_set] + [OBS] * 5, vocab_size=300)
    encode = PromptEncoder(tok, "off")
    longest = max(len(ids) for ids in encode(list(task.train_prompts())))
    cfg = compose_cfg(["task=text_env", f"task.data_dir={data}", "rollout.max_new_tokens=8",
                       "rollout.max_obs_tokens=64"])
    room = longest + 8 + 64
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=room - 1, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match=f"one observation of up to rollout.max_obs_tokens=64 an episode of task "
                                          f"text_env needs {room}; lower rollout.max_obs_tokens"):
        check_fits(cfg, model, task, encode)
    check_fits(cfg, GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=room, n_embd=16, n_layer=1,
                                               n_head=2)), task, encode)


@pytest.mark.parametrize("env_class", ["byo_task.skyguess:SkyGuessEnv", "byo_task.skyguess:skyguess"])
def test_a_skyrl_gym_environment_of_ones_own_runs_by_its_import_path_or_its_modules_id(data, on_path, tmp_path,
                                                                                         env_class):
    """A BaseTextEnv subclass ema-pg does not register, named module:Class (or module:id, the id its module
    registers): the task imports it, no package __init__ needed; it used to be "not a skyrl-gym environment". A
    short run on it with a model of one's own finishes, evaluated by the environment's return."""
    import json

    from helpers import compose_cfg

    from ema_pg.engine.fit import train

    t = env_task(data, env_class=env_class, turn_end="</answer>")
    p = t.sample(1, seed=0)[0]
    assert t.replay(p, f"#### 0</answer>\ntry again\n#### {p.answer}") == [
        ("#### 0</answer>", 0.0, False, "\ntry again\n"), (f"#### {p.answer}", 1.0, True, "")]
    cfg = compose_cfg(["task=text_env", f"task.data_dir={data}", f"task.env_class={env_class}", "model=local",
                       f"model.path={data.parent / 'model'}", "sft.steps=0", "algo.iterations=1", "algo.eval_every=1",
                       "algo.prompts_per_step=2", "algo.group_size=2", "rollout.max_new_tokens=24",
                       "trainer.progress_bar=false"], tmp_path, tiny=False)
    train(cfg)
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["metric"] == "return"


@pytest.mark.parametrize("env_class, said", [
    ("guess_env", "env_class 'guess_env' is not a skyrl-gym environment (there are: "),
    ("no_such_pkg.envs:Env", "env_class 'no_such_pkg.envs:Env': importing no_such_pkg.envs raised "
                             "ModuleNotFoundError"),
    ("byo_task.skyguess:Nope", "byo_task.skyguess has no skyrl-gym environment class or registered id 'Nope'"),
])
def test_an_environment_that_cannot_be_had_is_one_line_with_the_fix(data, on_path, env_class, said):
    with pytest.raises(ValueError) as e:
        env_task(data, env_class=env_class)
    assert said in str(e.value) and "\n" not in str(e.value)
    assert env_class != "guess_env" or "write env_class as module:Class" in str(e.value)
