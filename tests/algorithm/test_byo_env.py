"""Your own multi-turn environment (ema_pg.tasks.Environment): a guessing game from a package outside ema_pg/
(tests/fixtures/byo_task/byo_task/guess.py), by import path and by entry point: an episode laid out token for token
with its masks, its return replayed from its text, trained and evaluated on its own split, and checked at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, compose_cfg

from ema_pg.config import ConfigError
from ema_pg.engine.fit import train
from ema_pg.tasks import Environment, Prompt, Step, TaskError, build_task
from ema_pg.tasks.plugins import check_task

GUESS = ["task=custom", "task.target=byo_task.guess:GuessTask"]
RUN = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
       "model.tokenizer_vocab=200", "sft.steps=300", "sft.stop_at_reward=0", "algo.prompts_per_step=4",
       "algo.group_size=4", "algo.iterations=2", "algo.eval_every=2", "rollout.max_new_tokens=40",
       "optim.lr=1e-3", "trainer.progress_bar=false"]


def guess():
    return build_task({"name": "custom", "target": "byo_task.guess:GuessTask"})


def test_an_episode_is_replayed_from_its_text_and_a_demonstration_masks_the_environment(on_path):
    t = guess()
    p = Prompt(text="10-17:", answer="12")
    assert t.replay(p, "<guess>13</guess> lower\n<guess>12</guess>") == [
        ("<guess>13</guess>", 0.0, False, " lower\n"), ("<guess>12</guess>", 1.0, True, "")]
    assert t.reward(p, "<guess>13</guess> lower\n<guess>12</guess>") == 1.0
    assert t.reward(p, "<guess>13</guess> lower\n<guess>11</guess> higher\n<guess>1") == 0.0  # cut by the budget
    assert t.diagnostics(p, "<guess>13</guess> lower\n<guess>11</guess> higher\n<guess>1") == {"turns": 3.0}
    response = t.played(p, ["<guess>13</guess>", "<guess>11</guess>", "<guess>12</guess>"])
    assert response == "<guess>13</guess> lower\n<guess>11</guess> higher\n<guess>12</guess>"
    assert [response[a:b] for a, b in t.masked_spans(response)] == [" lower\n", " higher\n"]
    assert t.turn_ends == ("</guess>",) and t.metric == "return"


def test_a_users_environment_trains_on_its_own_turns_with_their_masks_and_is_evaluated(on_path, tmp_path,
                                                                                       capsys, caplog):
    """By import path, a tiny policy cold-started on the class's own demonstrations: the run pauses at the class's
    turn end without rollout.stop (the sampler is told it), each observation is in the sequence verbatim with loss
    mask 0 right after its turn, the sampler's reward is the replayed return, and the held-out split is evaluated.
    Its console names the task (it said "on custom") and gives each evaluation's per-split scores (it gave only the
    final average)."""
    from ema_pg.engine.policy import load_run_model
    from ema_pg.prompts import PromptEncoder
    from ema_pg.rollout import HFSampler
    from ema_pg.tasks.base import env_turns, sampler_stops

    caplog.set_level("INFO", logger="ema_pg")
    cfg = compose_cfg([*GUESS, *RUN], tmp_path)
    metrics, objs = train(cfg)
    assert "on guess; kl=" in caplog.text and "on custom" not in caplog.text
    assert "eval @ 0: heldout " in caplog.text and "eval @ 2: heldout " in caplog.text
    assert ", avg return " in caplog.text
    ev = json.loads((objs["run_dir"] / "eval.json").read_text())
    assert list(ev["splits"]) == ["heldout"] and ev["splits"]["heldout"]["n"] == 10 and ev["metric"] == "return"
    assert ev["avg_diagnostics"]["turns"] > 1  # episodes took turns
    model, tok = load_run_model(objs["run_dir"], which="initial")
    t = guess()
    prompts = t.sample(4, seed=5)
    encode = PromptEncoder(tok, "off")
    assert sampler_stops(t, cfg.rollout.stop) == ["</guess>"]
    ro = HFSampler(tok).generate(model, encode(prompts), 2, temperature=1.0, max_new_tokens=40,
                                 stop=sampler_stops(t, []), on_stop=env_turns(t, prompts, 2), seed=3)
    observations = 0
    for r in range(len(ro)):
        resp = ro.input_ids[r, ro.prompt_len:]
        lm, am = ro.loss_mask[r, ro.prompt_len:], ro.attention_mask[r, ro.prompt_len:]
        env_pos = ((am == 1) & (lm == 0)).nonzero().flatten().tolist()
        turns = t.replay(prompts[r // 2], ro.responses[r])
        said = [obs for _, _, done, obs in turns[:-1]]
        assert resp[env_pos].tolist() == [i for o in said for i in tok(o, add_special_tokens=False)["input_ids"]]
        assert all(lm[b - 1] == 1 for b in env_pos if b - 1 not in env_pos)  # each block right after a turn
        observations += len(said)
    assert observations >= 4
    from ema_pg.workbench.episode import main

    main([str(objs["run_dir"]), "--prompt", "1", "--seed", "2"])  # the episode command, on the same run
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "prompt: '7-14:'" and out[1] == "gold: '10'"
    kinds = [line.split()[0] for line in out if line.startswith("[")]
    assert kinds[0] == "[policy" and set(kinds) <= {"[policy", "[env"}
    turns = [line for line in out if line.startswith("turn ")]
    assert turns and kinds.count("[env") == len(turns) - 1 and all(", observation " in t for t in turns[:-1])
    assert turns[-1].endswith((", done", ", the episode ended here (end-of-sequence or the token budget)"))
    total = sum(float(line.split(" -> reward ")[1].split(",")[0]) for line in turns)
    assert out[-1].startswith(f"reward {total:g} (return); ") and out[-1].endswith("environment tokens (loss mask 0)")
    main([str(objs["run_dir"]), "--tokens", "--which", "initial"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:4].strip().isdigit()]
    assert rows and [int(r[0]) for r in rows] == list(range(len(rows))) and {r[1] for r in rows} <= {"policy", "env"}


class _NoStep(Environment):
    turn_end = "</g>"

    def sample(self, n, seed):
        return [Prompt(text="1-8:", answer="3")] * n

    def eval_splits(self):
        return {"heldout": [Prompt(text="2-9:", answer="4")]}

    def reset(self, prompt):
        return {}


class _NoTurnEnd(_NoStep):
    turn_end = ""

    def step(self, state, turn):
        return Step("", 0.0, True)


class _Tuple(_NoStep):
    def step(self, state, turn):
        return ("x", 1.0, False)


class _Raises(_NoStep):
    def step(self, state, turn):
        raise KeyError("secret")


@pytest.mark.parametrize("cls, said", [
    (_NoStep, "does not define step; write it in the class"),
    (_NoTurnEnd, "turn_end is ''; give the text that ends a policy turn"),
    (_Tuple, "environment _Tuple (prompt '1-8:') returned tuple ('x', 1.0, False) on turn '': _Tuple.step returns "
             "ema_pg.tasks.Step(observation, reward, done)"),
    (_Raises, "environment _Raises (prompt '1-8:') raised on turn '': KeyError: 'secret'"),
])
def test_an_environment_that_cannot_serve_is_one_line_at_start_naming_the_class(cls, said):
    with pytest.raises(TaskError) as e:
        check_task(cls(), cold_start=False, sft=False)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_partial_rollouts_refuse_a_task_with_turn_ends(on_path, tmp_path):
    cfg = compose_cfg([*GUESS, *RUN, "rollout.max_staleness=1", "rollout.partial=true"], tmp_path)
    with pytest.raises(ConfigError, match="rollout.partial=true is built for single-turn tasks; task custom ends its "
                                          "turns at '</guess>'"):
        train(cfg)


@pytest.mark.slow  # a fresh interpreter with the package installed by pip: ~25 s
def test_an_installed_environment_trains_by_its_entry_point_name(site, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}
    run = subprocess.run([sys.executable, "-m", "ema_pg.train", "task=guess", "task.width=6", *RUN,
                          f"sft.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "final eval/avg/return" in run.stdout
    ev = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert ev["splits"]["heldout"]["n"] == 10 and ev["avg_diagnostics"]["turns"] >= 1


def test_the_console_on_ones_own_task(on_path, capsys, finished_run):
    """What a first hour on one's own task met besides the start line and the per-split scores (checked on the
    training test's run above): evaluate refused its options after the run's overrides and named its file after
    trainer.num_threads; --show rounded 0.667 to 1; a bool reward was taken as 1.0; a misspelt task name suggested
    nothing."""
    import numpy as np

    from ema_pg.config.compose import overrides_problem
    from ema_pg.tasks.base import checked_reward
    from ema_pg.workbench.evaluate import _show, main

    main([str(finished_run), "trainer.num_threads=1", "--show", "1"])  # options after the overrides
    assert (finished_run / "evaluations" / "policy.json").is_file()
    _show({"samples": {"s": [{"prompt": "p", "gold": "g", "reward": 2 / 3, "response": "r"}]}, "splits": {"s": {
        "em": 0.5, "n": 1}}, "avg": 0.5, "metric": "em", "avg_scores": {}}, "out.json")
    assert "reward 0.6667)" in capsys.readouterr().out
    t = guess()
    p = t.sample(1, seed=0)[0]
    t.reward = lambda prompt, response: True
    with pytest.raises(TaskError, match=r"returned True \(bool\) .* return float\(True\) in GuessTask.reward"):
        checked_reward(t, p, "x")
    t.reward = lambda prompt, response: np.float32(0.25)
    assert checked_reward(t, p, "x") == 0.25 and type(checked_reward(t, p, "x")) is float
    said = overrides_problem(["task=countdwn"])
    assert said.startswith("task=countdwn: no such option; did you mean task=countdown? (the options: ")
    assert "countdown" in said and "guess" in said  # the installed plugins are options
