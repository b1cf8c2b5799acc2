"""The CPU thread default (ema_pg/process.py, applied where a command starts): beside other work OpenMP's threads sleep at once instead of spinning,
so a run does not lose its cores to its own waiting threads; on a machine with room they spin 10,000 times first,
which costs nothing measurable idle (benchmarks/cpu_load.py measures both). A user's OMP_WAIT_POLICY or
GOMP_SPINCOUNT wins, and EMA_PG_THREADS=torch leaves OpenMP's default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ema_pg import others_running, thread_wait_default

OURS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "EMA_PG_THREADS", "OMP_NUM_THREADS")
PROBE = ("import os, ema_pg.process; ema_pg.process.command_start(); import torch; "
         "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), ema_pg.process.others_running())")


@pytest.mark.parametrize("env, others, cpus, expect", [
    ({}, 0, 2, {"GOMP_SPINCOUNT": "10000"}),              # room: spin a little, then sleep
    ({}, 1, 2, {"OMP_WAIT_POLICY": "PASSIVE"}),           # 2 threads + 1 other on 2 CPUs: sleep at once
    ({}, 3, 8, {"OMP_WAIT_POLICY": "PASSIVE"}),           # 8 threads + 3 others on 8 CPUs
    ({"OMP_NUM_THREADS": "1"}, 1, 2, {"GOMP_SPINCOUNT": "10000"}),   # 1 thread + 1 other fit 2 CPUs
    ({"OMP_NUM_THREADS": "2"}, 3, 8, {"GOMP_SPINCOUNT": "10000"}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 5, 2, {}),            # the user's choice wins
    ({"GOMP_SPINCOUNT": "0"}, 5, 2, {}),
    ({"EMA_PG_THREADS": "torch"}, 5, 2, {}),              # OpenMP's own default
])
def test_the_wait_setting_follows_the_room_on_the_machine_unless_the_user_chose(env, others, cpus, expect):
    assert thread_wait_default(env, lambda: others, cpus) == expect


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}, {"EMA_PG_THREADS": "torch"}])
def test_a_users_choice_is_kept_without_reading_the_machine(env):
    """A command's child processes inherit its choice: they must not pay the machine's reads again."""
    def unread():
        raise AssertionError("the machine was read")

    assert thread_wait_default(env, unread, 2) == {}


def test_others_running_counts_busy_processes():
    """Two busy processes are two runnable threads more than before they started (Linux's procs_running)."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("procs_running is Linux's")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        seen = max(others_running() for _ in range(200))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert seen >= 2


@pytest.mark.parametrize("env, expect", [({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None"),
                                         ({"GOMP_SPINCOUNT": "500"}, "None 500"),
                                         ({"EMA_PG_THREADS": "torch"}, "None None")])
def test_a_users_own_setting_reaches_openmp_unchanged(env, expect):
    base = {k: v for k, v in os.environ.items() if k not in OURS}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert " ".join(out[:2]) == expect


def test_a_run_beside_busy_processes_sleeps_at_once_and_its_children_inherit_it():
    """One busy process per CPU: the command's first process sees them and chooses passive waiting; decide's and
    hpo's workers and a sweep's jobs are child processes and read the same environment."""
    base = {k: v for k, v in os.environ.items() if k not in OURS}
    code = ("import ema_pg.process, os, subprocess, sys; ema_pg.process.command_start(); "
            "print(os.environ.get('OMP_WAIT_POLICY')); "
            "print(subprocess.run([sys.executable, '-c', \"import os; print(os.environ.get('OMP_WAIT_POLICY'))\"], "
            "capture_output=True, text=True).stdout)")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        out = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True,
                             check=True).stdout.split()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert out == ["PASSIVE", "PASSIVE"]


# --- the RL iterations' threads (ema_pg.rl_threads_default, RLModule._choose_threads) ---

@pytest.mark.parametrize("env, others, cpus, threads, expect", [
    ({}, 0, 2, 2, None),                        # room: torch's own count
    ({}, 2, 2, 2, 1),                           # one busy process per core: one thread
    ({}, 1, 2, 2, 1),                           # one busy on two CPUs: the one left
    ({}, 3, 8, 8, 5),                           # the room left
    ({}, 9, 8, 8, 1),                           # never fewer than one
    ({}, 1, 8, 4, None),                        # 4 threads + 1 other fit 8 CPUs
])
def test_the_rl_threads_are_the_room_left_where_the_machine_has_too_little(env, others, cpus, threads, expect):
    from ema_pg import rl_threads_default

    assert rl_threads_default(env, lambda: others, cpus, threads) == expect


@pytest.mark.parametrize("env", [{"OMP_NUM_THREADS": "2"}, {"EMA_PG_THREADS": "torch"}])
def test_the_rl_threads_the_environment_chose_are_kept_without_reading_the_machine(env):
    from ema_pg import rl_threads_default

    def unread():
        raise AssertionError("the machine was read")

    assert rl_threads_default(env, unread, 2, 2) is None


def test_the_anchors_lag_is_the_same_number_on_one_thread_and_on_two():
    """A tensor's sum splits among torch's threads (from 32,768 elements), and an fp32 sum's last bits moved with
    the split (the demo's lag differed in the 9th digit between 1 and 2 threads): now the same number."""
    import torch

    from ema_pg.anchors import get_scheme
    from ema_pg.engine.anchor import AnchorCallback

    torch.manual_seed(0)
    pol = torch.nn.Sequential(torch.nn.Linear(1000, 300))
    an = AnchorCallback(get_scheme("ema", eta=0.9, update_every=1))
    an.attach(pol)
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(torch.randn_like(p))
    an.anchor.apply(pol, 1)
    before = torch.get_num_threads()
    try:
        lags = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            lags.append(an.lag_norm(pol))
    finally:
        torch.set_num_threads(before)
    ref = sum(((p.detach().double() - a.detach().double()) ** 2).sum() for p, a in
              zip(pol.parameters(), an.model.parameters())) ** 0.5
    assert lags[0] == lags[1] == lags[2] and abs(lags[0] - float(ref)) < 1e-6 * float(ref)


def test_a_run_beside_other_work_takes_the_room_left_for_its_rl_iterations_and_its_resume_keeps_the_count(
        tmp_path, monkeypatch, caplog):
    """Beside one busy thread per CPU a run's RL iterations go to one thread (the log says so, the checkpoint
    records it); its resume on an idle machine goes on with that one thread, so that it repeats the run; a run that
    found room keeps torch's count."""
    import logging

    import torch
    from helpers import compose_cfg

    import ema_pg.process
    from ema_pg.engine.fit import train

    def recorded(run):
        return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["ema_pg"]["rl_threads"]

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("EMA_PG_THREADS", raising=False)
    before = torch.get_num_threads()
    cpus = os.cpu_count() or 1
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(ema_pg.process, "others_running", lambda: cpus)  # one busy thread per CPU
        with caplog.at_level(logging.INFO, logger="ema_pg"):
            train(compose_cfg(["algo.iterations=2", "algo.eval_every=2"], tmp_path))
        run = tmp_path / "run"
        assert torch.get_num_threads() == 1 and recorded(run) == 1
        assert "the RL iterations run on 1 torch thread(s)" in caplog.text

        torch.set_num_threads(2)
        monkeypatch.setattr(ema_pg.process, "others_running", lambda: 0)  # idle now
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ema_pg"):
            train(compose_cfg(["algo.iterations=4", "algo.eval_every=2", f"resume={run}"], tmp_path))
        assert torch.get_num_threads() == 1 and recorded(run) == 1
        assert "go on with the 1 torch thread(s) their run began with" in caplog.text

        # a fresh run in this process with room (a sweep's next job): back to the count before the runs lowered it
        train(compose_cfg(["algo.iterations=2", "algo.eval_every=2", f"sft.cache_dir={tmp_path.parent / 'cold_start_cache'}"],
                          tmp_path / "room"))
        assert torch.get_num_threads() == 2 and recorded(tmp_path / "room" / "run") == 2
    finally:
        torch.set_num_threads(before)


def test_the_demos_model_trains_to_the_same_numbers_on_one_thread_and_on_two(tmp_path):
    """What lets the RL threads follow the machine's room: the demo's model (1M parameters, tensors past the 32,768
    elements from which a sum splits among threads) logs the same training metrics and evaluation on 1 thread as on
    2 (the anchor's lag included, summed in fp64)."""
    import json

    import pandas as pd
    import torch
    from helpers import compose_cfg

    from ema_pg.engine.fit import train

    before = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2):
            cfg = compose_cfg(["experiment=demo", "sft.steps=20", "algo.iterations=4", "algo.eval_every=2",
                               "task.eval_size=16", f"trainer.num_threads={n}", "trainer.progress_bar=false",
                               f"sft.cache_dir={tmp_path / 'cache'}"], tmp_path / str(n), tiny=False)
            train(cfg)
            run = tmp_path / str(n) / "run"
            m = pd.read_csv(run / "metrics.csv")
            ev = json.loads((run / "eval.json").read_text())
            ev.pop("wall_s", None)
            got[n] = (m[[c for c in m.columns if not c.startswith(("time/", "perf/"))]], ev)
    finally:
        torch.set_num_threads(before)
    pd.testing.assert_frame_equal(got[1][0], got[2][0], check_exact=True)
    assert got[1][1] == got[2][1] and got[1][0]["anchor/lag_norm"].notna().any()


IMPORT_PROBE = """
import json, os, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args else None)
before = dict(os.environ)
import {module}
after = dict(os.environ)
print(json.dumps({{"changed": sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)),
                  "proc": sorted({{f for f in opened if f.startswith("/proc")}})}}))
"""


@pytest.mark.parametrize("module", ["ema_pg", "ema_pg.kl", "ema_pg.losses"])
def test_importing_ema_pg_or_an_estimator_changes_no_environment_variable(module):
    """A library user who imports the package, or an estimator, gets no environment change; the package alone reads
    no /proc file (torch, which an estimator imports, reads its own); a command's start applies the policy."""
    import json

    base = {k: v for k, v in os.environ.items() if k not in (*OURS, "MKL_CBWR")}
    out = json.loads(subprocess.run([sys.executable, "-c", IMPORT_PROBE.format(module=module)], env=base,
                                    capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    assert out["changed"] == []
    if module == "ema_pg":
        assert out["proc"] == []
    started = subprocess.run([sys.executable, "-c", "import os, ema_pg.process as p; p.command_start(); "
                              "print(os.environ['MKL_CBWR'], 'OMP_WAIT_POLICY' in os.environ or 'GOMP_SPINCOUNT' in os.environ)"],
                             env=base, capture_output=True, text=True, check=True).stdout.split()
    assert started == ["AUTO,STRICT", "True"]
