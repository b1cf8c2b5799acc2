"""The CPU thread default (ema_pg/__init__.py): OpenMP's threads sleep at once instead of spinning, so a run beside
other work does not lose its cores to its own waiting threads (benchmarks/cpu_load.py measures it); a user's
OMP_WAIT_POLICY wins, and EMA_PG_THREADS=torch leaves OpenMP's default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import os, ema_pg, torch; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize("env, expect", [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                                         ({"EMA_PG_THREADS": "torch"}, "None")])
def test_the_wait_policy_is_passive_unless_the_user_says_otherwise(env, expect):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "EMA_PG_THREADS")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         check=True).stdout.split()[-1]
    assert out == expect


def test_the_processes_a_command_starts_inherit_it():
    """decide's and hpo's workers and a sweep's jobs are child processes: they read the same environment."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "EMA_PG_THREADS")}
    code = ("import ema_pg, subprocess, sys; print(subprocess.run([sys.executable, '-c', "
            "\"import os; print(os.environ.get('OMP_WAIT_POLICY'))\"], capture_output=True, text=True).stdout)")
    out = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "PASSIVE"
