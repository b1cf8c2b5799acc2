"""The CPU thread default (ema_pg/__init__.py): beside other work OpenMP's threads sleep at once instead of spinning,
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
PROBE = ("import os, ema_pg, torch; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), "
         "ema_pg.others_running())")


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
    code = ("import ema_pg, os, subprocess, sys; print(os.environ.get('OMP_WAIT_POLICY')); "
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
