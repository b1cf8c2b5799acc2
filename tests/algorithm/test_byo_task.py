"""Your own task: a class from a package outside ema_pg/ (tests/fixtures/byo_task), reached by import path
(task=custom task.target=...) and by the entry-point group ema_pg.tasks, checked at start-up and trained."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import BYO_FIXTURE as FIXTURE
from helpers import ROOT, compose_cfg

from ema_pg.config import ConfigError
from ema_pg.engine.fit import train
from ema_pg.tasks import Prompt, TaskError, build_task, task_defaults
from ema_pg.tasks.base import checked_reward
from ema_pg.tasks.plugins import check_task, required_methods

TINY_RUN = ["model.tokenizer_vocab=120", "sft.steps=40", "sft.stop_at_reward=0", "rollout.max_new_tokens=4"]


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
                             "PretrainedOnlyTask, StallingTask, TextRewardTask"),
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


def test_a_users_code_that_never_returns_is_cut_at_its_time_limit_and_hears_a_sigterm():
    """A pure-Python loop and a sleep are both cut at the limit (in the main thread by SIGALRM, elsewhere by a helper
    thread); a reward's and an environment's are named in one line; a SIGTERM while one runs reaches the handler in
    place and ends the call (StoppedBySigterm), where it used to be logged and the process went on waiting."""
    import signal
    import threading
    import time

    from ema_pg.tasks.base import StoppedBySigterm, env_turns, limited

    def forever():
        while True:
            pass

    for fn in (forever, lambda: time.sleep(60)):
        t0 = time.time()
        with pytest.raises(TimeoutError):
            limited(fn, 0.3, lambda: TimeoutError("late"))
        assert time.time() - t0 < 5
    assert limited(lambda: 7, 0.3, lambda: TimeoutError("late")) == 7 and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    got = {}
    th = threading.Thread(target=lambda: got.update(r=pytest.raises(TimeoutError, limited, lambda: time.sleep(60),
                                                                   0.3, lambda: TimeoutError("late"))))
    th.start()
    th.join(10)
    assert not th.is_alive() and got
    task = build_task({"name": "custom", "target": "byo_task.countdown:CountdownTask"})
    task.reward_time_limit_s = 0.3
    task.reward = lambda prompt, response: time.sleep(60)
    with pytest.raises(TaskError, match=r"\(CountdownTask.reward\) returned nothing in 0.3 s on prompt 'before 5:' "
                                        r"and response 'x'; a reward returns in CountdownTask.reward_time_limit_s"):
        checked_reward(task, Prompt(text="before 5:", answer="4"), "x")
    task.turn_time_limit_s = 0.3
    task.on_stop_fn = lambda prompts, n: (lambda rows, texts: time.sleep(60))
    with pytest.raises(TaskError, match=r"its environment \(CountdownTask.on_stop_fn\) answered nothing in 0.3 s "
                                        r"for 2 turns \(the first: 'call'\)"):
        env_turns(task, [Prompt(text="a", answer="b")], 2)([0, 1], ["call", "call"])
    heard = []
    before = signal.signal(signal.SIGTERM, lambda *a: heard.append(a[0]))
    try:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(StoppedBySigterm):
            limited(lambda: time.sleep(60), 30, lambda: TimeoutError("late"))
        assert heard == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_reward_that_stops_returning_stops_the_run_in_one_line_keeping_its_checkpoint(on_path, tmp_path):
    """At start-up the check's reward call is cut and refused; mid-run (the reward stalls after the checkpoint of
    iteration 2) the run stops at the limit naming the episode, its checkpoint kept. It used to hang silently."""
    import lightning as L

    stall = tmp_path / "stall"
    run = ["task=custom", "task.target=byo_task.broken:StallingTask", f"+task.stall={stall}", "+task.limit=1",
           *TINY_RUN, "algo.iterations=4", "algo.eval_every=2"]
    stall.touch()
    with pytest.raises(ConfigError, match=r"\(StallingTask.reward\) returned nothing in 1 s on prompt 'before"):
        train(compose_cfg(run, tmp_path / "a"))
    stall.unlink()

    class StallAfter3(L.Callback):  # the evaluation and checkpoint of iteration 2 done, iteration 4's rewards stall
        def on_train_batch_end(self, trainer, pl_module, *args):
            if pl_module.iteration == 3:
                stall.touch()

    cfg = compose_cfg(run, tmp_path / "b")
    with pytest.raises(TaskError, match=r"returned nothing in 1 s on prompt 'before \d+:' and response '.*'; a "
                                        r"reward returns in StallingTask.reward_time_limit_s") as e:
        train(cfg, callbacks=[StallAfter3()])
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in (tmp_path / "b" / "run" / "checkpoints").glob("iter*.ckpt")) == ["iter2.ckpt"]


@pytest.mark.slow  # a fresh interpreter and a SIGTERM: ~30 s
def test_a_sigterm_while_a_reward_stalls_ends_the_run_with_exit_75_and_its_checkpoint(tmp_path):
    """The probe's run logged "Received SIGTERM" and went on waiting on its reward (killed after 40 s): now the signal
    ends it at once, exit 75, naming the checkpoint the same command resumes from (the last period's where the
    signal came mid-iteration)."""
    import signal
    import time

    from helpers import wait_while_alive

    stall, run = tmp_path / "stall", tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{FIXTURE}:{ROOT}"}
    args = ["task=custom", "task.target=byo_task.broken:StallingTask", f"+task.stall={stall}", "+task.limit=600",
            *TINY_RUN, "algo.iterations=40", "algo.eval_every=2", "trainer.progress_bar=false",
            f"sft.cache_dir={tmp_path / 'cache'}", f"run_dir={run}"]
    proc = subprocess.Popen([sys.executable, "-m", "ema_pg.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    wait_while_alive(proc, lambda: (run / "checkpoints" / "iter2.ckpt").exists(), timeout=300)
    stall.touch()
    time.sleep(2)  # the run is now waiting on a reward
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75 and time.time() - t0 < 30, out[-2000:]
    said = re.search(r"stopped by SIGTERM after iteration (\d+) of 40; it resumes from its checkpoint of iteration (\d+)\n",
                     out)  # mid-iteration: the last checkpoint (the iteration's state is gone; the resume repeats it)
    assert said and 2 <= int(said[2]) <= int(said[1]) and (run / "checkpoints" / f"iter{said[2]}.ckpt").exists(), out
    assert "Traceback" not in out


@pytest.mark.parametrize("body, said", [("import sys\nsys.exit(3)\n", "raised SystemExit(3)"),
                                        ("raise KeyboardInterrupt\n", "raised KeyboardInterrupt")])
def test_a_task_module_that_exits_or_is_interrupted_at_import_is_one_line(tmp_path, monkeypatch, body, said):
    """sys.exit(3) at import ended the run with exit 3 and nothing printed; a KeyboardInterrupt was a traceback."""
    name = f"exits_{abs(hash(body))}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError) as e:
        build_task({"name": "custom", "target": f"{name}:MyTask"})
    assert f"task.target={name}:MyTask: importing {name} {said}: a module ends no process at import" in str(e.value)


def test_an_entry_point_that_does_not_import_or_shadows_a_built_in_is_named(on_path, tmp_path, monkeypatch, caplog):
    """task=ep_missing said "no such option" with a list that left out the installed task that works, and an entry
    point named like a built-in (toy_add) was skipped without a word."""
    from ema_pg.config import compose
    from ema_pg.config.compose import overrides_problem

    info = tmp_path / "fake_eps-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-eps\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ema_pg.tasks]\nep_missing = no_such_module_xyz:MyTask\n"
                                           "ep_ok = byo_task.countdown:CountdownTask\n"
                                           "toy_add = byo_task.countdown:CountdownTask\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    said = overrides_problem(["task=ep_missing"])
    assert said.startswith("the entry point ep_missing (ema_pg.tasks)=no_such_module_xyz:MyTask: cannot import "
                           "no_such_module_xyz (No module named 'no_such_module_xyz')"), said
    listed = overrides_problem(["task=ep_nope"])
    assert listed.startswith("task=ep_nope: no such option; did you mean task=ep_ok? (the options: ") and \
        "countdown" in listed
    with caplog.at_level("WARNING", logger="ema_pg"):
        assert compose(["task=toy_add"]).task.name == "toy_add"
    assert ("the installed entry point task toy_add (byo_task.countdown:CountdownTask) has the name of ema-pg's own "
            "task, which task=toy_add runs") in caplog.text


def test_a_reward_past_float32s_range_is_refused_at_start_naming_its_scale(on_path, tmp_path, monkeypatch):
    """A finite reward of 1e308 passed the reward check, became inf in the rewards' float32 tensor, and the run
    stopped after three non-finite updates blaming optim.lr and algo.beta: now the start-up check names the scale."""
    (tmp_path / "huge_reward.py").write_text("from byo_task.countdown import CountdownTask\n\n\n"
                                             "class HugeTask(CountdownTask):\n"
                                             "    def reward(self, prompt, response):\n"
                                             "        return 1e308 * super().reward(prompt, response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose_cfg(["task=custom", "task.target=huge_reward:HugeTask", *TINY_RUN], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"\(HugeTask.reward\) returned 1e\+308 for prompt .*: past float32's range, "
                                          r"the rewards' dtype; scale HugeTask.reward's values \(near \[-1, 1\]\)"):
        train(cfg)
    task = build_task({"name": "custom", "target": "huge_reward:HugeTask"})
    assert checked_reward(task, Prompt(text="before 5:", answer="4"), "x") == 0.0


def test_a_reward_raising_in_the_rollout_worker_is_one_line_naming_the_episode(on_path, tmp_path, monkeypatch):
    """The synchronous path's one line arrived inside a 29-line traceback of the worker."""
    from ema_pg.engine.rollout_workers import RolloutWorkerError

    (tmp_path / "picky_reward.py").write_text("from byo_task.countdown import CountdownTask\n\n\n"
                                              "class PickyTask(CountdownTask):\n"
                                              "    def reward(self, prompt, response):\n"
                                              "        if response not in ('', prompt.answer):\n"
                                              "            raise ValueError('cannot parse ' + repr(response))\n"
                                              "        return super().reward(prompt, response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose_cfg(["task=custom", "task.target=picky_reward:PickyTask", *TINY_RUN, "rollout.max_staleness=1",
                       "algo.iterations=4", "algo.eval_only_at_end=true"], tmp_path / "run")  # no base evaluation
    with pytest.raises(RolloutWorkerError) as e:
        train(cfg)
    msg = str(e.value)
    assert msg.startswith("the rollout worker failed: task countdown (PickyTask.reward) raised ValueError: cannot parse ")
    assert "on prompt 'before" in msg and "\n" not in msg and "Traceback" not in msg


def test_an_evaluation_split_of_training_prompts_is_said(on_path, caplog):
    """A custom task's eval_splits returning its training questions was taken without a word."""
    from ema_pg.tasks.plugins import check_task

    t = build_task({"name": "custom", "target": "byo_task.countdown:CountdownTask"})
    with caplog.at_level("WARNING", logger="ema_pg"):
        check_task(t, cold_start=True, sft=True)
    assert "evaluation split" not in caplog.text  # its own split is held out
    t.eval_splits = lambda: {"heldout": t.sample(8, seed=0)}
    with caplog.at_level("WARNING", logger="ema_pg"):
        check_task(t, cold_start=True, sft=True)
    assert "8 of the 8 prompts of its evaluation split heldout are among its training prompts (sample(64, seed=0))" \
        in caplog.text


def test_a_class_knob_given_without_its_plus_says_to_add_it(on_path):
    """task.top=40 on task=custom said "unknown key task.top: remove it", where the class takes top and the fix is
    +task.top=40; a misspelt one gets the class's nearest knob."""
    from ema_pg.config.compose import overrides_problem

    run = ["task=custom", "task.target=byo_task.countdown:CountdownTask"]
    assert overrides_problem([*run, "task.top=40"]) == ("task.top is a knob of byo_task.countdown:CountdownTask that "
                                                        "no option file declares: give it with a leading +, "
                                                        "+task.top=...")
    assert overrides_problem([*run, "task.topp=40"]) == "unknown key task.topp: did you mean +task.top? remove it"
    assert overrides_problem([*run, "+task.top=40"]) is None


def test_prompts_of_the_wrong_count_or_fields_are_named_at_start(on_path):
    """sample(n) returning n/2 trained on half the responses while the log said n; an empty text was a traceback in
    the sampler at the base evaluation; a text that is an int one in checked_reward; an answer None a tokenizer's
    words. Each is now one line at start naming the class and the method."""
    from ema_pg.tasks.base import sampled
    from ema_pg.tasks.plugins import check_task

    def task():
        return build_task({"name": "custom", "target": "byo_task.countdown:CountdownTask"})

    t = task()
    real = t.sample
    for k in (lambda n: n // 2, lambda n: n + 3):
        t.sample = lambda n, seed, k=k: real(k(n), seed)
        with pytest.raises(TaskError, match=r"CountdownTask.sample\(2, seed=0\) returned (1|5) prompts; return exactly n"):
            check_task(t, cold_start=True, sft=True)
        with pytest.raises(TaskError, match=r"CountdownTask.sample\(8, seed=3\) returned (4|11) prompts"):
            sampled(t, 8, 3)
    for change, where, said in [({"text": ""}, "sample(2, seed=0)", "its text is ''; a prompt's text is a non-empty"),
                                ({"text": 12}, "sample(2, seed=0)", "its text is 12;"),
                                ({"answer": None}, "eval_splits()", "its answer is None; a prompt's answer is a string")]:
        t = task()
        if where.startswith("sample"):
            real = t.sample
            t.sample = lambda n, seed, real=real, change=change: [Prompt(**{**vars(p), **change}) for p in real(n, seed)]
        else:
            real_ev = t.eval_splits
            t.eval_splits = lambda real_ev=real_ev, change=change: {k: [Prompt(**{**vars(p), **change}) for p in v]
                                                                   for k, v in real_ev().items()}
        with pytest.raises(TaskError) as e:
            check_task(t, cold_start=True, sft=True)
        assert f"CountdownTask.{where}" in str(e.value) and said in str(e.value) and "\n" not in str(e.value)


def test_corpus_and_demonstrations_are_needed_only_by_a_tiny_policy_trained_from_scratch(on_path):
    task = build_task({"name": "custom", "target": "byo_task.broken:PretrainedOnlyTask"})
    assert required_methods(cold_start=False, sft=True) == ("sample", "eval_splits", "reward")
    assert required_methods(cold_start=True, sft=False) == ("sample", "eval_splits", "reward", "corpus")
    check_task(task, cold_start=False, sft=True)  # model.path=DIR: its own tokenizer, no cold start
    own = "model=local model.path=DIR sft.steps=0 (python -m ema_pg.byo writes a small one: examples/byo/model)"
    with pytest.raises(TaskError) as e:
        check_task(task, cold_start=True, sft=False)
    assert str(e.value) == ("task countdown (byo_task.broken.PretrainedOnlyTask) does not define corpus, "
                            f"which a tiny policy trained from scratch needs: use your own model, {own}; or write it "
                            "in the class")
    with pytest.raises(TaskError, match="does not define corpus, demonstrations, which a tiny policy trained from "
                                        "scratch needs: use your own model, model=local"):
        check_task(task, cold_start=True, sft=True)


def test_ema_pgs_own_task_without_demonstrations_says_to_bring_a_model_first(tmp_path):
    """task=text_env with the tiny policy said "TextEnvTask does not define corpus; write it in the class", advice
    to edit a built-in class, with the real fix last: the fix is now the whole line."""
    from ema_pg.workbench.byo import write_examples

    data = write_examples(tmp_path / "byo") / "skyrl_gsm8k"
    cfg = compose_cfg(["task=text_env", f"task.data_dir={data}"], tmp_path)
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert str(e.value) == ("task text_env gives no corpus or demonstrations to train a tiny policy from scratch on: "
                            "use your own model, model=local model.path=DIR sft.steps=0 (python -m ema_pg.byo writes "
                            "a small one: examples/byo/model)")


def test_the_pages_example_is_the_package_the_tests_train():
    """docs/byo.md shows tests/fixtures/byo_task/byo_task/countdown.py and guess.py whole: the examples cannot drift
    from what the tests install and train."""
    import re

    page = (ROOT / "docs" / "byo.md").read_text()
    for name in ("countdown.py", "guess.py"):
        shown = re.search(rf"```python\n# tests/fixtures/byo_task/byo_task/{name}\n(.*?)```", page, re.DOTALL).group(1)
        assert shown == (FIXTURE / "byo_task" / name).read_text()
