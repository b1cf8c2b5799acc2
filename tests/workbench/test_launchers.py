"""``decide --launcher``: a plan's cells through local processes, submitit (its local executor, the Slurm path's code
on one machine) and a Ray cluster started here. The coordinator alone writes the ledger, so cells ending at one
instant are recorded once each; a cell a live trainer still writes is waited for, never started again; a tiny real
plan reaches the same ledger through every launcher, and a coordinator killed mid-look resumes without running a
cell twice (slow)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from ema_pg.workbench.studies import decide
from ema_pg.workbench.studies.decide import CELLS, LOOKS, Workers, load_plan, read_cells, state, take_look
from ema_pg.workbench.launchers import LauncherSpec, launched, make_launcher
from test_decide import write_plan

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

FAKE_CELL = """import sys, time
sys.path[:0] = [{tests!r}, {here!r}]
from test_decide import fake_run
from pathlib import Path
method, seed, at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
time.sleep(max(0.0, at - time.time()))  # every cell ends at the same instant
fake_run(Path({runs!r}), method, seed, 0.3 + (0.1 if method == "ema" else 0.0) + 0.001 * seed)
"""


def _fake_cells(monkeypatch, tmp_path: Path, runs: Path, at: float) -> None:
    script = tmp_path / "fake_cell.py"
    script.write_text(FAKE_CELL.format(tests=str(ROOT / "tests"), here=str(HERE), runs=str(runs)))
    monkeypatch.setattr(decide, "cell_command", lambda plan, m, s, code=ROOT: [sys.executable, str(script), m, str(s),
                                                                                 str(at)])


@pytest.mark.slow  # each launcher ~12 s; the fast suite keeps the live-trainer and cannot-start cases
@pytest.mark.parametrize("launcher", ["local", "submitit"])
def test_cells_that_end_at_one_instant_are_recorded_once_each_and_the_look_is_taken_once(launcher, tmp_path,
                                                                                        monkeypatch):
    runs = tmp_path / "runs"
    plan = load_plan(write_plan(tmp_path / "plan", runs, looks=(3, 4),
                                claims={"A": {"better": "ema", "worse": "grpo", "text": "EMA anchor > GRPO"}}))
    _fake_cells(monkeypatch, tmp_path, runs, at=time.time() + 8)
    (runs / "logs").mkdir(parents=True)
    todo = decide.needed(plan, 1, state(plan)[0])
    assert len(todo) == 6
    spec = LauncherSpec(launcher, cluster="local" if launcher == "submitit" else None)
    w = Workers(make_launcher(spec, runs, 6), runs / "logs")
    w.run(plan, todo)
    cells = pd.read_csv(plan.folder / CELLS)
    assert sorted(zip(cells["method"], cells["seed"])) == sorted(todo)  # each once, none lost
    assert sorted((r["cell"], r["launcher"]) for r in launched(runs)) == sorted((f"{m}_s{s}", launcher) for m, s in todo)
    rows = take_look(plan, 1, state(plan)[0])
    assert [r["seeds"] for r in rows] == [3] and len(pd.read_csv(plan.folder / LOOKS)) == 1
    assert decide.needed(plan, 1, state(plan)[0]) == []


HOLDER = """import sys, time
sys.path[:0] = [{tests!r}, {here!r}]
from pathlib import Path
from ema_pg.engine.owner import own_run_dir
from test_decide import fake_run
run = Path({run!r})
own_run_dir(run)  # a trainer a killed coordinator started: it holds its folder
print("holding", flush=True)
time.sleep(4)
fake_run(run.parent, "ema", 100, 0.5)
"""


def test_a_cell_a_live_trainer_writes_is_waited_for_and_not_started_again(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    plan = load_plan(write_plan(tmp_path / "plan", runs, looks=(3, 4),
                                claims={"A": {"better": "ema", "worse": "grpo", "text": "EMA anchor > GRPO"}}))
    (runs / "logs").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(tests=str(ROOT / "tests"), here=str(HERE),
                                                                   run=str(runs / "ema_s100"))],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    _fake_cells(monkeypatch, tmp_path, runs, at=0)
    w = Workers(make_launcher(LauncherSpec("local"), runs, 2), runs / "logs")
    w.run(plan, [("ema", 100), ("grpo", 100)])
    assert holder.wait(timeout=30) == 0
    assert [r["cell"] for r in launched(runs)] == ["grpo_s100"]  # the live one was not started
    assert f"ema seed 100: a live run (pid {holder.pid}) writes it; waiting for it" in capsys.readouterr().out
    assert set(read_cells(plan)) == {("ema", 100), ("grpo", 100)}


def test_a_launcher_that_cannot_start_says_so_in_one_line(tmp_path):
    for spec, said in [(LauncherSpec("local", options=("slurm_partition=dev",)), "use it with --launcher submitit"),
                       (LauncherSpec("submitit", options=("partition",)), "give KEY=VALUE"),
                       (LauncherSpec("local", address="auto"), "--address with --launcher ray"),
                       (LauncherSpec("submitit", cluster="local", options=("no_such_knob=1",)),
                        "submitit's local executor refuses it")]:
        with pytest.raises(SystemExit, match=said):
            make_launcher(spec, tmp_path, 2)
    t0 = time.time()
    for address, said in [("127.0.0.1:1", "Ray cluster 127.0.0.1:1: nothing accepts a connection there (Connection "
                                          "refused); start one"),
                          ("notahost:xyz", "Ray cluster notahost:xyz: give its address as HOST:PORT"),
                          ("10.0.0.5", "give its address as HOST:PORT")]:
        with pytest.raises(SystemExit, match=re.escape(said)):  # Ray's own join waited minutes without a word
            make_launcher(LauncherSpec("ray", address=address), tmp_path, 2)
    assert time.time() - t0 < 30


def test_submitit_without_sbatch_says_it_runs_the_cells_here(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on it
    make_launcher(LauncherSpec("submitit"), tmp_path / "runs", 2)
    assert "no sbatch on this machine, so the cells run through submitit's local executor" in capsys.readouterr().out


# --- the real cells, through every launcher (slow) ---

def _tiny_plan(folder: Path, runs: Path, cache: Path, *more: str) -> Path:
    return write_plan(folder, runs, looks=(3,), claims={"A": {"better": "ema", "worse": "grpo",
                                                              "text": "EMA anchor > GRPO"}},
                      overrides=["sft.seed=0", f"sft.cache_dir={cache}", *more])


def _decide(plan: Path, *args: str, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ema_pg.decide", str(plan), "--workers", "2", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _ledger(folder: Path) -> tuple[list, list]:
    cells = pd.read_csv(folder / CELLS)
    looks = pd.read_csv(folder / LOOKS)
    return (sorted(zip(cells["method"], cells["seed"], cells["scores"], cells["base"])),
            looks[["claim", "look", "seeds", "mean_diff", "sd_diff", "t", "lo", "hi", "verdict"]].astype(str).values.tolist())


@pytest.fixture(scope="module")
def plan_cache(tmp_path_factory):
    """The real-cell plans' one cold-start cache: their cells share the plan's task, model and ``sft.seed``."""
    return tmp_path_factory.mktemp("plan_cache")


@pytest.mark.slow
def test_a_tiny_plan_reaches_the_same_ledger_through_local_processes_submitit_and_a_ray_cluster(tmp_path, killed_plans,
                                                                                                  plan_cache,
                                                                                                  ray_cluster):
    """Real cells (the toy task at smoke scale, one cold start shared): the same cells, looks and verdicts. The local
    and submitit plans are the kill test's (below): their coordinator was killed mid-look and the same command finished
    them, each cell run once and never stopped, so their ledgers are what an uninterrupted plan writes; the Ray plan
    runs here, uninterrupted."""
    plan = _tiny_plan(tmp_path / "ray", tmp_path / "runs_ray", plan_cache)
    out = _decide(plan, "--launcher", "ray", "--address", ray_cluster)
    consoles = {"ray": (out.returncode, out.stdout, out.stderr)}
    consoles |= {name: (k["rc"], k["stdout"], k["stderr"]) for name, k in killed_plans.items()}
    for name, (rc, stdout, stderr) in consoles.items():
        assert rc == 0, f"{name}: " + stdout[-2000:] + stderr[-2000:]
        assert "every claim is decided or at its cap" in stdout, f"{name}: " + stdout[-2000:]
        assert not stderr.strip() or "cells of this look" in stderr, f"{name}: " + stderr[-2000:]  # the project's lines and its bar only
    assert len(launched(tmp_path / "runs_ray")) == 6
    ledgers = {"ray": _ledger(tmp_path / "ray")} | {name: _ledger(k["plan"]) for name, k in killed_plans.items()}
    assert ledgers["submitit"] == ledgers["local"] and ledgers["ray"] == ledgers["local"]


@pytest.mark.slow
def test_a_cluster_that_asks_for_a_token_this_process_does_not_send_is_one_line(tmp_path, ray_cluster):
    """A cluster with token authentication on, joined by address without ``RAY_AUTH_MODE=token`` (Ray sends no token
    to an explicit address unless told): one line that says what to set, none of the connection retries Ray's core
    prints a second, and no cell started."""
    plan = _tiny_plan(tmp_path / "plan", tmp_path / "runs", tmp_path / "cache")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    out = subprocess.run([sys.executable, "-m", "ema_pg.decide", str(plan), "--launcher", "ray", "--address",
                          ray_cluster], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    said = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]  # no bar: it would start after the join
    assert said and "set RAY_AUTH_MODE=token" in said[-1], said[-5:]
    assert not [x for x in said if "gcs_client" in x or "InvalidAuthToken" in x], said[:5]
    assert not launched(tmp_path / "runs")


@pytest.mark.slow
def test_without_an_address_the_ray_launcher_starts_its_own_ray_beside_a_ray_start_cluster_and_joins_ray_address(
        tmp_path, ray_cluster):
    """A ``ray start`` on the machine records its cluster where Ray's own default address looks (RAY_TMPDIR's
    ray/ray_current_cluster): without ``--address`` the command still starts a Ray of its own with the CPUs it asks
    (Ray's default joined that cluster, then refused the CPU count: a ValueError traceback). ``RAY_ADDRESS``, as Ray's
    job API sets it, is joined: the cluster's 2 CPUs, not the 1 asked."""
    import shutil
    import tempfile

    short = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # a Ray's sockets live under it: a short path
    try:
        (short / "ray").mkdir()
        (short / "ray" / "ray_current_cluster").write_text(ray_cluster)
        probe = ("from ema_pg.workbench.launchers import ray_init; import ray; joined = ray_init(None, 1); "
                 "print(joined, ray.cluster_resources()['CPU']); ray.shutdown()")
        for extra, said in [({"RAY_TMPDIR": str(short)}, "False 1.0"), ({"RAY_ADDRESS": ray_cluster}, "True 2.0")]:
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | extra
            out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=300)
            lines = out.stdout.strip().splitlines()
            assert out.returncode == 0 and lines and lines[-1] == said, (extra, out.stdout[-1500:], out.stderr[-1500:])
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_the_tests_ray_head_is_stopped_alone(tmp_path):
    """``stop_process_group`` (the ray_cluster fixture's teardown) ends its group and the descendants that began
    sessions of their own (a Ray head's workers), and leaves another group, a Ray another test's command started in
    its own process, running (``ray stop`` ended every Ray here: CI lost a plan's two running cells that way)."""
    from conftest import stop_process_group

    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
            "start_new_session=True); open(sys.argv[1], 'w').write(str(c.pid)); time.sleep(600)")
    groups = []
    for k in range(2):
        f = tmp_path / f"child{k}"
        p = subprocess.Popen([sys.executable, "-c", code, str(f)], start_new_session=True)
        while not f.is_file() or not f.read_text():
            time.sleep(0.05)
        groups.append((p, int(f.read_text())))
    (head, worker), (other, its_worker) = groups
    assert os.getpgid(worker) != head.pid  # a session of its own, as a Ray worker's

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as st:
                return st.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    stop_process_group(head.pid)
    head.wait(timeout=30)
    assert not alive(worker) and alive(other.pid) and alive(its_worker)
    stop_process_group(other.pid)
    other.wait(timeout=30)
    assert not alive(its_worker)

def _killed_mid_look_and_resumed(launcher: str, tmp_path: Path, cache: Path) -> dict:
    """A tiny real plan's coordinator killed (SIGKILL) when two cells had finished and another was running (paused
    meanwhile, so that it still runs however slow the next start), then the same command run to the end: its plan
    folder, the cells found live, and the second coordinator's exit code, stdout and stderr."""
    plan = _tiny_plan(tmp_path / "plan", tmp_path / "runs", cache)
    args = ["--launcher", "submitit", "--cluster", "local"] if launcher == "submitit" else []
    cmd = [sys.executable, "-m", "ema_pg.decide", str(plan), "--workers", "2", *args]
    coord = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = tmp_path / "runs"

    def owner(d: Path) -> int | None:  # the pid of the cell writing d, read without taking the lock a cell takes
        o = (d / ".ema_pg_run").read_text().split() if (d / ".ema_pg_run").is_file() else []
        return int(o[1]) if len(o) == 2 and Path(f"/proc/{o[1]}").exists() else None

    def running() -> list[int]:
        return [p for d in runs.glob("*_s*") if not (d / "eval.json").is_file() and (p := owner(d)) is not None]

    deadline = time.time() + 600  # a cell claims its folder a second or two before it ends: poll often
    while time.time() < deadline and not (len(list(runs.glob("*_s*/eval.json"))) >= 2 and running()):
        time.sleep(0.05)
    live = running()
    assert live, "no cell ran after two finished, in 10 minutes"
    for pid in live:
        os.kill(pid, signal.SIGSTOP)
    coord.send_signal(signal.SIGKILL)
    coord.wait()
    assert not (tmp_path / "plan" / LOOKS).is_file()
    # a cell the killed coordinator started that has not claimed its folder yet will: let it, so that the command
    # below meets every started cell finished or live (a start between the two is a race no coordinator can see)
    while time.time() < deadline and any(not (runs / r["cell"] / "eval.json").is_file()
                                         and owner(runs / r["cell"]) is None for r in launched(runs)):
        time.sleep(0.2)
    errors = open(tmp_path / "again.err", "w")
    again = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True)
    said = []
    for line in again.stdout:  # the new coordinator finds the paused cells live and waits for them
        said.append(line)
        if sum("writes it; waiting for it" in x for x in said) == len(live):
            break
    for pid in live:
        os.kill(pid, signal.SIGCONT)
    said += again.stdout.readlines()
    rc = again.wait(timeout=900)
    errors.close()
    return {"plan": tmp_path / "plan", "runs": runs, "live": live, "rc": rc, "stdout": "".join(said),
            "stderr": (tmp_path / "again.err").read_text()}


@pytest.fixture(scope="module")
def killed_plans(tmp_path_factory, plan_cache):
    """launcher -> :func:`_killed_mid_look_and_resumed` through it (local processes, submitit): the kill test's runs,
    whose finished ledgers are also the ledger test's local and submitit plans."""
    return {launcher: _killed_mid_look_and_resumed(launcher, tmp_path_factory.mktemp(f"killed_{launcher}"), plan_cache)
            for launcher in ("local", "submitit")}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "submitit"])
def test_a_coordinator_killed_mid_look_resumes_without_running_a_cell_twice(launcher, killed_plans):
    """Killed (SIGKILL) when two cells had finished and another was running: the same command records the two,
    waits for the one still running, starts only the cells no coordinator started, and takes the look once."""
    k = killed_plans[launcher]
    assert k["rc"] == 0, k["stdout"][-2000:] + k["stderr"][-2000:]
    assert k["stdout"].count("writes it; waiting for it") >= len(k["live"]), k["stdout"]
    starts = pd.Series([r["cell"] for r in launched(k["runs"])]).value_counts()
    assert len(starts) == 6 and starts.max() == 1, starts.to_dict()  # every cell started once, by either coordinator
    looks = pd.read_csv(k["plan"] / LOOKS)
    assert list(looks["look"]) == [1] and list(looks["seeds"]) == [3]
    logs = list(k["runs"].glob("*_s*/train.log"))
    assert len(logs) == 6 and not [g for g in logs if "resuming" in g.read_text()]  # no cell stopped and began again


@pytest.mark.slow
def test_a_sigterm_to_a_coordinator_on_ray_stops_its_cells_at_a_checkpoint_and_the_same_command_resumes_them(
        tmp_path, ray_token, plan_cache):
    """Ray's start put its own SIGTERM handler in place (it aborted the coordinator, exit 134), and a cancelled task's
    KeyboardInterrupt never reached a wrapper blocked on its cell (the cells ran on to their end). Now: the coordinator
    exits 75, each running cell saves its checkpoint, and the same command resumes them to the look."""
    plan = _tiny_plan(tmp_path / "plan", tmp_path / "runs", plan_cache, "algo.iterations=100")
    cmd = [sys.executable, "-m", "ema_pg.decide", str(plan), "--workers", "2", "--launcher", "ray"]
    coord = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = tmp_path / "runs"
    deadline = time.time() + 600
    # both first cells into RL: their first metrics rows written (every 10 iterations), so that the trainer's SIGTERM
    # handler is in place (the log's lines before it come seconds earlier on a loaded machine, where the signal
    # would end a cell that has nothing to save yet)
    training = lambda: [g for g in runs.glob("*_s*/metrics.csv") if len(g.read_text().splitlines()) > 1]  # noqa: E731
    while time.time() < deadline and len(training()) < 2:
        time.sleep(0.2)
    coord.send_signal(signal.SIGTERM)
    out = coord.communicate(timeout=600)[0]
    assert coord.returncode == 75, out[-3000:]
    stopped = [g for g in runs.glob("*_s*/train.log") if "stopped by SIGTERM" in g.read_text()]
    assert stopped and not [g.parent for g in stopped if (g.parent / "eval.json").is_file()], out[-3000:]
    again = _decide(plan, "--launcher", "ray")
    cells = "".join(f"\n--- {g.name}:\n" + g.read_text()[-1500:] for g in sorted((runs / "logs").glob("*.log")))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:] + cells
    assert all("resuming" in g.read_text() for g in stopped)
    assert len(pd.read_csv(tmp_path / "plan" / CELLS)) == 6
