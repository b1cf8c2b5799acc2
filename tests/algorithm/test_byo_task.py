"""Your own task: a class from a package outside ema_pg/ (tests/fixtures/byo_task), reached by import path
(task=custom task.target=...) and by the entry-point group ema_pg.tasks, checked at start-up and trained."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import compose_cfg

from ema_pg.config import ConfigError
from ema_pg.engine.fit import train
from ema_pg.tasks import Prompt, TaskError, build_task, task_defaults
from ema_pg.tasks.base import checked_reward
from ema_pg.tasks.plugins import check_task, required_methods

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "byo_task"
TINY_RUN = ["model.tokenizer_vocab=120", "sft.steps=40", "sft.stop_at_reward=0", "rollout.max_new_tokens=4"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The fixture package installed by pip, as a researcher installs theirs (into a folder of its own, so that the
    test's environment is left as it was): its module and its dist-info with the entry point."""
    tmp = tmp_path_factory.mktemp("byo")
    shutil.copytree(FIXTURE, tmp / "src")  # pip builds in the source folder: a copy keeps the repository clean
    out = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(out), str(tmp / "src")], check=True, capture_output=True, text=True)
    return out


@pytest.fixture
def on_path(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    import importlib

    importlib.invalidate_caches()
    return site


def test_a_task_class_by_import_path_trains_and_is_evaluated_on_its_own_splits(on_path, tmp_path):
    cfg = compose_cfg(["task=custom", "task.target=byo_task.countdown:CountdownTask", "+task.top=40", *TINY_RUN], tmp_path)
    metrics, objs = train(cfg)
    ev = json.loads((objs["run_dir"] / "eval.json").read_text())
    assert list(ev["splits"]) == ["heldout"] and ev["splits"]["heldout"]["n"] == 12
    assert metrics["iteration"] == cfg.algo.iterations
    task = build_task(cfg.task)
    assert task.top == 40 and {p.text for p in task.eval_splits()["heldout"]} == {f"before {n}:" for n in
                                                                                   range(3, 39, 3)}


@pytest.mark.slow  # pip install and a fresh interpreter: ~20 s; the import path's in-process run stays fast
def test_an_installed_packages_entry_point_is_a_task_by_name_with_its_knobs_as_an_option_file(site, tmp_path):
    """A fresh interpreter with the package on its path: task=countdown composes the class's keyword defaults
    (task.top=40 without a +), a misspelt knob is one line with the nearest, and the run finishes."""
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}
    args = ["task=countdown", "task.top=40", *TINY_RUN, "algo.iterations=2", "algo.eval_every=2",
            "algo.prompts_per_step=4", "algo.group_size=4", "model.hidden_size=32", "model.num_layers=2",
            "model.num_heads=2", "model.num_kv_heads=1", "trainer.progress_bar=false",
            f"sft.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"]
    run = subprocess.run([sys.executable, "-m", "ema_pg.train", *args], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "final eval/avg/em" in run.stdout
    ev = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert list(ev["splits"]) == ["heldout"] and ev["splits"]["heldout"]["n"] == 12
    typo = subprocess.run([sys.executable, "-m", "ema_pg.train", "task=countdown", "task.topp=3"], capture_output=True,
                          text=True, env=env, cwd=tmp_path)
    assert typo.returncode != 0 and typo.stderr.strip().splitlines()[-1] == (
        "config error: unknown key task.topp: did you mean task.top? remove it")


def test_task_defaults_of_a_class_are_its_keyword_parameters(on_path):
    assert task_defaults("custom", "byo_task.countdown:CountdownTask") == {
        "chat_template": "auto", "name": "custom", "target": "byo_task.countdown:CountdownTask", "top": 30, "eval_size": 12,
        "seed": 0}


@pytest.mark.parametrize("target, words", [
    ("byo_task.broken:NoRewardTask", "does not define reward, corpus, demonstrations; write them in the class"),
    ("no_such_pkg.envs:MyTask", "cannot import no_such_pkg.envs (No module named 'no_such_pkg'); install its package"),
    ("byo_task.broken:Nope", "byo_task.broken has no Nope; its task classes: CountdownTask, NoRewardTask, "
                             "PretrainedOnlyTask, TextRewardTask"),
    ("byo_task.countdown:random", "is not a task class; subclass ema_pg.tasks.Task"),
    ("???", "task.target is not set; give the class as task.target=my_pkg.envs:MyTask"),
])
def test_a_class_that_cannot_serve_is_refused_at_start_in_one_line_naming_it(on_path, tmp_path, target, words):
    cfg = compose_cfg(["task=custom", *([f"task.target={target}"] if target != "???" else []), *TINY_RUN], tmp_path)
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("*.ckpt"))


def test_a_reward_that_is_not_a_float_is_named_at_start_and_during_a_run(on_path, tmp_path):
    cfg = compose_cfg(["task=custom", "task.target=byo_task.broken:TextRewardTask", *TINY_RUN], tmp_path)
    with pytest.raises(ConfigError, match=r"\(TextRewardTask.reward\) returned '0' \(str\) for prompt 'before \d+:' "
                                          r"and response ''; a reward is a finite float: fix TextRewardTask.reward"):
        train(cfg)
    task = build_task({"name": "custom", "target": "byo_task.countdown:CountdownTask"})
    p = Prompt(text="before 5:", answer="4")
    assert checked_reward(task, p, "4") == 1.0 and type(checked_reward(task, p, "4")) is float
    task.reward = lambda prompt, response: float("nan")  # mid-run: the same check, a ServiceError that stops it
    with pytest.raises(TaskError, match=r"returned nan \(float\) for prompt 'before 5:' and response 'x'"):
        checked_reward(task, p, "x")
    task.reward = lambda prompt, response: 1 / 0
    with pytest.raises(TaskError, match="raised ZeroDivisionError: division by zero on prompt 'before 5:'"):
        checked_reward(task, p, "x")


def test_corpus_and_demonstrations_are_needed_only_by_a_tiny_policy_trained_from_scratch(on_path):
    task = build_task({"name": "custom", "target": "byo_task.broken:PretrainedOnlyTask"})
    assert required_methods(cold_start=False, sft=True) == ("sample", "eval_splits", "reward")
    assert required_methods(cold_start=True, sft=False) == ("sample", "eval_splits", "reward", "corpus")
    check_task(task, cold_start=False, sft=True)  # model.path=DIR: its own tokenizer, no cold start
    with pytest.raises(TaskError, match="does not define corpus; write it in the class"):
        check_task(task, cold_start=True, sft=False)
    with pytest.raises(TaskError, match="does not define corpus, demonstrations; write them"):
        check_task(task, cold_start=True, sft=True)


def test_the_pages_example_is_the_package_the_tests_train():
    """docs/byo.md shows tests/fixtures/byo_task/byo_task/countdown.py whole: the example cannot drift from what
    the tests install and train."""
    import re

    page = (ROOT / "docs" / "byo.md").read_text()
    shown = re.search(r"```python\n# tests/fixtures/byo_task/byo_task/countdown.py\n(.*?)```", page, re.DOTALL).group(1)
    assert shown == (FIXTURE / "byo_task" / "countdown.py").read_text()
