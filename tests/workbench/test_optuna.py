"""Optuna search: study files, pruning from intermediate evaluations, resuming, two workers on one study."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from helpers import TINY, training_under_way, wait_while_alive
from omegaconf import OmegaConf
from optuna.trial import TrialState

from ema_pg.workbench.hpo import StudyFileError, _requeue, load_study_spec, open_study, run_worker
from ema_pg.workbench.launchers import launched

ROOT = Path(__file__).resolve().parents[2]
TINY_RUN = [o for o in TINY if not o.startswith(("kl.k=", "algo.iterations", "algo.eval_every"))] + [
    "task.eval_size=16", "algo.iterations=4", "algo.eval_every=2", "algo.minibatch_size=0"]


def study_file(tmp_path: Path, **changes) -> Path:
    spec = {"study_name": "t", "storage": f"sqlite:///{tmp_path}/t.db", "direction": "maximize", "n_trials": 3,
            "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"},
            "overrides": ["experiment=demo", *TINY_RUN, f"sft.cache_dir={tmp_path.parent}/optuna_cache"],
            "params": {"anchor.eta": {"type": "float", "low": 0.8, "high": 0.99},
                       "kl.k": {"type": "categorical", "choices": [0, 8]},
                       "optim.lr": {"type": "float", "low": 1e-4, "high": 1e-3, "log": True}}}
    spec.update(changes)
    p = tmp_path / "study.yaml"
    p.write_text(yaml.safe_dump(spec))
    return p


def test_shipped_study_files_load():
    files = sorted((ROOT / "conf" / "hparams_search").glob("*.yaml"))
    assert files
    for f in files:
        spec = load_study_spec(f)
        assert spec.storage.startswith("sqlite:///") and spec.params


@pytest.mark.parametrize("change, msg", [
    ({"bogus": 1}, "unknown key"),
    ({"direction": "up"}, "direction='up'"),
    ({"params": {"anchor.eta": {"type": "float", "low": 0.9, "high": 0.8}}}, "low .* must be < high"),
    ({"params": {"anchor.eta": {"type": "uniform", "low": 0.8, "high": 0.9}}}, "type: one of float, int, categorical"),
    ({"params": {"kl.k": {"type": "categorical"}}}, "needs choices"),
    ({"sampler": {"name": "grid"}}, "sampler.name='grid'"),
    ({"n_trials": 0}, "n_trials must be >= 1"),
    # a non-whole end of an int knob: it used to be refused as "params.algo.group_size is not a config key"
    ({"params": {"algo.group_size": {"type": "int", "low": 2.7, "high": 8}}},
     r"params.algo.group_size \(int\): low \(2.7\) and high \(8\) must be whole numbers"),
    # the study's own overrides refused: it used to be blamed on the first parameter's range (params.anchor.eta)
    ({"overrides": ["experiment=demo", *TINY_RUN, "algo.group_size=1"]},
     r"the study's overrides are refused by the config: algo.group_size"),
])
def test_bad_study_files_say_what_to_change(tmp_path, change, msg):
    with pytest.raises(StudyFileError, match=msg):
        load_study_spec(study_file(tmp_path, **change))


def test_unknown_config_key_in_space_stops_the_worker(tmp_path):
    import dataclasses

    bad = {"algo.nonsense": {"type": "float", "low": 0, "high": 1}}
    with pytest.raises(StudyFileError, match="algo.nonsense is not a config key"):  # at load, before any trial
        load_study_spec(study_file(tmp_path, params=bad))
    spec = dataclasses.replace(load_study_spec(study_file(tmp_path)), params=bad)  # a worker given it all the same
    with pytest.raises(StudyFileError, match="algo.nonsense is not a config key"):
        run_worker(spec)
    assert [t.state for t in open_study(spec).trials] == [TrialState.FAIL]  # one failed trial, no endless loop


@pytest.mark.slow
def test_trials_run_resume_and_record_their_params(tmp_path, mlflow_url):
    """Each trial's run gets its params; with logger=mlflow (a real server) it is its own tracker run, grouped under
    the study and tagged with its number, and the trial names that run: linked both ways."""
    from mlflow import MlflowClient

    spec = load_study_spec(study_file(tmp_path, n_trials=2))
    trackers = ["logger=mlflow", f"logger.mlflow_uri={mlflow_url}", "logger.project=study_t"]
    assert run_worker(spec, extra=trackers) == [0, 1]
    study = open_study(spec)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    client = MlflowClient(mlflow_url)
    for t in study.trials:  # the objective is the run's final eval metric, and the run got the trial's params
        run = Path(t.user_attrs["run_dir"])
        cfg = OmegaConf.load(run / "config.yaml")
        assert cfg.anchor.eta == pytest.approx(t.params["anchor.eta"]) and cfg.kl.k == t.params["kl.k"]
        assert cfg.optim.lr == pytest.approx(t.params["optim.lr"])
        assert t.value == pytest.approx(__import__("json").loads((run / "eval.json").read_text())["avg"])
        assert sorted(t.intermediate_values) == [0, 2, 4]
        r = client.get_run(t.user_attrs["trackers"]["mlflow"]["run_id"])
        assert r.data.tags["trial"] == str(t.number) and r.data.tags["ema_pg.group"] == "t"
        assert r.data.tags["ema_pg.job_type"] == "trial" and r.info.run_name == run.name
        assert float(r.data.params["anchor.eta"]) == pytest.approx(t.params["anchor.eta"])
        assert r.data.metrics["final/avg"] == pytest.approx(t.value)
    assert len(client.search_runs([client.get_experiment_by_name("study_t").experiment_id])) == 2
    # resuming: the same command with a larger budget adds only the missing trial
    assert run_worker(spec, n_trials=3) == [2]
    assert len(open_study(spec).trials) == 3


def test_pruner_stops_a_trial_from_its_intermediate_evaluations(tmp_path):
    # a threshold no run can reach: every trial is pruned at its first evaluation after iteration 0
    spec = load_study_spec(study_file(tmp_path, n_trials=1, pruner={"name": "threshold", "lower": 2.0},
                                      overrides=["experiment=demo", *TINY_RUN, "algo.iterations=6",
                                                 f"sft.cache_dir={tmp_path.parent}/optuna_cache"]))
    run_worker(spec)
    (t,) = open_study(spec).trials
    assert t.state == TrialState.PRUNED and sorted(t.intermediate_values) == [0, 2]
    run = Path(t.user_attrs["run_dir"])
    assert not (run / "eval.json").exists()  # not a finished run
    assert (run / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed:UserWarning")  # this test asks and tells itself
def test_an_interrupted_trial_is_requeued_with_its_params_and_run_folder(tmp_path):
    spec = load_study_spec(study_file(tmp_path))
    study = open_study(spec)
    trial = study.ask()
    eta = trial.suggest_float("anchor.eta", 0.8, 0.99)
    trial.set_user_attr("run_dir", "runs/x/trial_0000")
    frozen = study._storage.get_trial(trial._trial_id)
    study.tell(trial, state=TrialState.FAIL)
    _requeue(study, frozen)
    again = study.ask()
    assert again.number == 1 and again.suggest_float("anchor.eta", 0.8, 0.99) == eta
    assert again.user_attrs["run_dir"] == "runs/x/trial_0000"


@pytest.mark.slow
def test_two_workers_share_one_study_without_losing_or_duplicating_trials(tmp_path):
    n = 5
    f = study_file(tmp_path, n_trials=n)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "ema_pg.hpo", str(f), "--workers", "2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    from test_console import noise

    assert noise(r.stdout + r.stderr) == []  # two workers' consoles: the project's lines only
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path}/t.db")
    trials = study.get_trials()
    assert len(trials) == n and all(t.state == TrialState.COMPLETE for t in trials)
    assert sorted(t.number for t in trials) == list(range(n))
    runs = [t.user_attrs["run_dir"] for t in trials]
    assert len(set(runs)) == n and all((Path(d) / "eval.json").is_file() for d in runs)
    assert len({t.user_attrs["worker"] for t in trials}) == 2, "both workers ran trials"
    params = {tuple(sorted(t.params.items())) for t in trials}
    assert len(params) == n, "the workers' samplers proposed distinct parameters"


@pytest.mark.slow
def test_a_studys_workers_run_as_submitit_jobs_and_as_tasks_of_a_ray_cluster(tmp_path, ray_cluster):
    """``--launcher``: the two workers as jobs of submitit's local executor, then as tasks of a Ray cluster started
    here; each time the study ends with its trials, each once, both workers' among them."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name, args in [("submitit", ["--cluster", "local"]), ("ray", ["--address", ray_cluster])]:
        (tmp_path / name).mkdir()
        f = study_file(tmp_path / name, n_trials=3)
        r = subprocess.run([sys.executable, "-m", "ema_pg.hpo", str(f), "--workers", "2", "--launcher", name, *args],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{name}: " + (r.stdout + r.stderr)[-3000:]
        assert f"2 workers started through {name}" in r.stdout and "best: trial" in r.stdout
        trials = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path / name}/t.db").get_trials()
        assert sorted(t.number for t in trials) == [0, 1, 2] and all(t.state == TrialState.COMPLETE for t in trials)
        assert len({t.user_attrs["worker"] for t in trials}) == 2, f"{name}: both workers ran trials"
        assert sorted(r["cell"] for r in launched(tmp_path / name / "t" / "workers")) == ["worker0", "worker1"]


def _workers_with_one_killed(tmp_path: Path, f: Path, storage: str, n_workers: int):
    """Start ``n_workers`` workers on one study, SIGKILL the last the moment it runs a trial (a trial of a few
    seconds could end during a wait on a busy machine), and wait for the others to finish (exit 0). Returns the
    killed trial, the command and its environment."""
    import signal
    import time

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ema_pg.hpo", str(f)]
    logs = [open(tmp_path / f"worker{i}.log", "w") for i in range(n_workers)]
    procs = [subprocess.Popen(cmd + ["--worker-index", str(i)], cwd=ROOT, env=env, stdout=logs[i],
                              stderr=subprocess.STDOUT) for i in range(n_workers)]
    victim, killed, t0 = procs[-1], None, time.time()
    while killed is None and time.time() - t0 < 600:
        time.sleep(0.5)
        try:
            study = optuna.load_study(study_name="t", storage=storage)
        except KeyError:
            continue
        mine = [t for t in study.get_trials(states=(TrialState.RUNNING,))
                if t.user_attrs.get("worker", "").endswith(f":{victim.pid}")]
        if mine:
            victim.send_signal(signal.SIGKILL)
            killed = mine[0]
    assert killed is not None, "the victim never started a trial"
    for i, proc in enumerate(procs[:-1]):
        assert proc.wait(timeout=900) == 0, (tmp_path / f"worker{i}.log").read_text()[-3000:]
    return killed, cmd, env


def _assert_requeued_once(storage: str, killed, n: int) -> list:
    """The study ends with exactly ``n`` trials complete, none run twice: the killed trial failed (a live worker's
    stale-heartbeat check) and ran again with its point and run folder. Returns the study's trials."""
    trials = optuna.load_study(study_name="t", storage=storage).get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == n and len({tuple(sorted(t.params.items())) for t in complete}) == n
    assert next(t for t in trials if t.number == killed.number).state == TrialState.FAIL
    retry = [t for t in complete if t.user_attrs.get("run_dir") == killed.user_attrs["run_dir"]]
    assert len(retry) == 1 and retry[0].params == killed.params
    return trials


@pytest.mark.slow
def test_three_workers_one_killed_the_others_requeue_its_trial_and_finish_the_study(tmp_path):
    """A worker SIGKILLed mid-trial stops sending heartbeats; a live worker fails the stale trial and
    re-queues it with its parameters and run folder, without any restart; the study ends with exactly
    n_trials complete, none run twice."""
    n = 6
    f = study_file(tmp_path, n_trials=n, heartbeat_interval=1, grace_period=4,
                   overrides=["experiment=demo", *TINY_RUN, "algo.iterations=8", "algo.eval_every=2",
                              f"sft.cache_dir={tmp_path.parent}/optuna_cache"])
    storage = f"sqlite:///{tmp_path}/t.db"
    killed, _, _ = _workers_with_one_killed(tmp_path, f, storage, 3)
    _assert_requeued_once(storage, killed, n)


@pytest.mark.slow  # command-line processes, 11-15 s: the fast suite stays under 5 minutes
def test_the_search_command_runs_and_its_earlier_name_is_gone(tmp_path):
    """`python -m ema_pg.hpo` is the Optuna search ("search" is the search task's word); `python -m ema_pg.search`,
    its earlier name, is gone (docs/changes.md)."""
    r = subprocess.run([sys.executable, "-m", "ema_pg.search"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "No module named ema_pg.search" in r.stderr, r.stderr[-500:]
    for name in ("ema_pg.hpo",):
        r = subprocess.run([sys.executable, "-m", name, str(tmp_path / "none.yaml")], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1 and "none.yaml does not exist" in r.stderr, (name, r.stderr[-500:])


@pytest.mark.slow  # a worker process trained and stopped, then the study finished: about a minute
def test_a_sigtermed_worker_saves_its_trials_iteration_exits_75_and_the_same_command_finishes_from_it(tmp_path):
    """A scheduler's SIGTERM inside a trial's evaluation period: the worker used to exit 130 with nothing saved (its
    trial at iteration 12 resumed from 10). Now the trial's run saves the iteration it reached, the worker exits 75,
    and the same command resumes that trial from that checkpoint and finishes the study."""
    import signal

    from ema_pg.engine.policy import checkpoint_iteration

    f = study_file(tmp_path, n_trials=1, overrides=["experiment=demo", *TINY_RUN, "algo.iterations=200",
                                                     "algo.eval_every=100", f"sft.cache_dir={tmp_path.parent}/optuna_cache"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "ema_pg.hpo", str(f)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = load_study_spec(f).trials_dir / "trial_0000"
    wait_while_alive(p, lambda: training_under_way(run), every=0.2)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 75, out[-3000:]
    it = checkpoint_iteration(run)
    assert 0 < it < 200 and it % 100, it  # the iteration it reached, inside an evaluation period
    assert f"stopped by SIGTERM after iteration {it} of 200" in out and "run the same command again" in out
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path}/t.db")
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL, TrialState.WAITING]  # re-queued, same point
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming {run} from iteration {it}" in again.stdout + again.stderr and (run / "eval.json").is_file()
    trials = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path}/t.db").get_trials()
    assert trials[1].state == TrialState.COMPLETE and trials[1].params == trials[0].params
    assert trials[1].user_attrs["run_dir"] == str(run)


@pytest.mark.slow  # a PostgreSQL server, two workers and a rerun: a minute or two
def test_a_study_on_a_postgresql_server_survives_a_killed_worker_and_resumes(tmp_path):
    """The study's storage a real PostgreSQL server (Debian's package, started here as CI starts it): two workers on
    it, one SIGKILLed mid-trial; the other fails the stale trial and re-queues it with its point, the study ends with
    n_trials complete, none run twice; the same command run again finds it finished."""
    from helpers import postgres_server

    n = 4
    with postgres_server() as url:
        f = study_file(tmp_path, n_trials=n, storage=url, heartbeat_interval=1, grace_period=4,
                       runs_dir=str(tmp_path / "trials"),
                       overrides=["experiment=demo", *TINY_RUN, "algo.iterations=8", "algo.eval_every=2",
                                  f"sft.cache_dir={tmp_path.parent}/optuna_cache"])
        killed, cmd, env = _workers_with_one_killed(tmp_path, f, url, 2)
        trials = _assert_requeued_once(url, killed, n)
        again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert len(optuna.load_study(study_name="t", storage=url).get_trials()) == len(trials)  # nothing run twice


def test_a_storage_password_is_never_printed(tmp_path):
    """A PostgreSQL storage that cannot be reached: one line naming it, its password masked, the cause's too."""
    from ema_pg.workbench.hpo import main

    url = "postgresql+psycopg2://postgres:s3cret@127.0.0.1:1/optuna"
    with pytest.raises(SystemExit) as e:
        main([str(study_file(tmp_path)), "--storage", url])
    line = str(e.value)
    assert "cannot be opened" in line and "postgres:***@127.0.0.1:1/optuna" in line and "s3cret" not in line
    assert len(line.splitlines()) == 1


@pytest.mark.slow  # a PostgreSQL server stopped mid-study, then started again: about 30 s
def test_a_storage_that_stops_mid_study_is_one_line_and_the_same_command_resumes(tmp_path):
    """PostgreSQL stopped while a trial trained: 407 lines and 9 Optuna tracebacks, exit 1 (the same command then
    finished the study). Now one line naming the storage (password masked), the trial and its run folder, and how
    to resume; the same command, once the server is back, finishes the study with no trial run twice."""
    import time

    from helpers import postgres_ctl, postgres_server

    with postgres_server() as trust:
        url = trust.replace("postgres@", "postgres:s3cret@")  # trust authentication: the password is only shown
        f = study_file(tmp_path, n_trials=2, storage=url, heartbeat_interval=1, grace_period=3,
                       runs_dir=str(tmp_path / "trials"),
                       overrides=["experiment=demo", *TINY_RUN, "algo.iterations=60", "algo.eval_every=2",
                                  f"sft.cache_dir={tmp_path.parent}/optuna_cache"])
        cmd = [sys.executable, "-m", "ema_pg.hpo", str(f)]
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 300
        while not (tmp_path / "trials" / "trial_0000" / "metrics.csv").is_file() and p.poll() is None:
            assert time.time() < deadline
            time.sleep(0.2)
        postgres_ctl(url, "stop")
        out, _ = p.communicate(timeout=300)
        last = out.strip().splitlines()[-1]
        assert p.returncode == 1 and "Traceback" not in out and "s3cret" not in out, out[-3000:]
        assert last.startswith("study storage postgresql+psycopg2://postgres:***@/optuna?") and " failed during trial 0 " \
            f"(its run folder {tmp_path / 'trials' / 'trial_0000'} keeps its checkpoints): " in last, last
        assert last.endswith("run the same command to resume the study (the trial is re-queued after grace_period=3 s "
                             "and continues its run folder)")
        postgres_ctl(url, "start")
        again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        trials = optuna.load_study(study_name="t", storage=url).get_trials()
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        assert len(done) == 2 and len({t.user_attrs["run_dir"] for t in done}) == 2
        assert str(tmp_path / "trials" / "trial_0000") in {t.user_attrs["run_dir"] for t in done}  # continued


def test_a_url_password_in_a_third_party_log_line_is_masked(tmp_path):
    """Optuna's and SQLAlchemy's own lines went out as they were: after any command's start-up every log record,
    its exception's text included, has its URLs' passwords masked, whichever handler prints it."""
    import io
    import logging

    from ema_pg.engine.console import quiet_third_party

    quiet_third_party()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    lg = logging.getLogger("optuna.storages._rdb.storage")
    lg.addHandler(handler)
    try:
        lg.warning("Caught an error from sqlalchemy: %s", "postgresql://me:hunter2@db:5432/x refused")
        try:
            raise RuntimeError("cannot reach mysql+pymysql://root:pa55@10.0.0.1/optuna")
        except RuntimeError:
            lg.exception("storage failed")
    finally:
        lg.removeHandler(handler)
    text = out.getvalue()
    assert "postgresql://me:***@db:5432/x refused" in text and "mysql+pymysql://root:***@10.0.0.1/optuna" in text
    assert "hunter2" not in text and "pa55" not in text and "Traceback" in text


def test_a_storage_password_stays_off_the_workers_command_lines(tmp_path, monkeypatch):
    """--workers N and the launchers put the storage URL on each worker's command line, which ps shows and
    submitit writes into its job files: a URL with a password now travels in EMA_PG_STORAGE, which hpo reads."""
    from ema_pg.workbench.hpo import main, worker_command
    from ema_pg.workbench.launchers import STORAGE_ENV

    monkeypatch.delenv(STORAGE_ENV, raising=False)
    url = "postgresql+psycopg2://postgres:s3cret@127.0.0.1:1/optuna"
    cmd = worker_command("study.yaml", 4, url, 2, ["algo.iterations=3"])
    assert "s3cret" not in " ".join(cmd) and "--storage" not in cmd and os.environ[STORAGE_ENV] == url
    assert cmd[-2:] == ["trainer.num_threads=2", "algo.iterations=3"]
    plain = f"sqlite:///{tmp_path}/t.db"
    assert worker_command("study.yaml", 4, plain, 2, [])[6:8] == ["--storage", plain]
    with pytest.raises(SystemExit) as e:  # the worker's side: it opens the URL the variable holds
        main([str(study_file(tmp_path))])
    assert "postgres:***@127.0.0.1:1/optuna cannot be opened" in str(e.value) and "s3cret" not in str(e.value)
