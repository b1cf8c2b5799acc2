"""docs/byo.md: every command on the page runs, as written (each training run cut to two iterations), from a folder
holding only the examples it writes."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "byo.md"


def page_commands() -> list[str]:
    """The shell commands of the page's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.DOTALL)
    cmds = []
    for b in blocks:
        for c in re.sub(r"\\\n\s*", "", b).splitlines():
            c = c.split("  #")[0].strip()
            if c:
                cmds.append(c)
    return cmds


#: appended to each training command: no bar, and two iterations each evaluated (the page's 20 and 40 are for a reader
#: who watches the reward move; the command's task, data, model and environment are what is tested, and they are
#: built in full at any length)
SHORT = " trainer.progress_bar=false algo.iterations=2 algo.eval_every=1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_argv(command: str) -> list[str]:
    """The arguments of a page's ``[VAR=value ...] python -m ema_pg.train ARGS`` command, split as bash splits them."""
    words = shlex.split(command)
    at = words.index("ema_pg.train")
    assert words[at - 2:at] == ["python", "-m"] and all("=" in w for w in words[:at - 2]), command
    return words[at + 1:]


@pytest.mark.slow
def test_every_command_on_the_page_runs(tmp_path):
    """The page's commands in its order, each in a process of its own, but for its training commands: those run one
    after another in one process (:func:`helpers.run_in_one_process`, a fresh Hydra for each), started after every
    other command, with the page's ``PYTHONPATH=tests/fixtures/byo_task`` on its path. No training command reads what
    another writes. The page's other commands come before its training commands but two: the ``pip install`` after
    the first (which imports the task by its path and needs no entry point) and the search server's start, which the
    search command needs running. One interpreter start instead of thirteen (each ~10 s of imports here); what is tested of each is
    its task, data, model and environment, built in full, and its exit code and final evaluation line."""
    from helpers import run_in_one_process

    cmds = page_commands()
    trains = [c for c in cmds if "ema_pg.train " in c]
    assert len(trains) == 13 and any("ema_pg.tasks.search.serve" in c for c in cmds)  # every format has its command
    port = str(free_port())
    py = sys.executable
    root = Path(__file__).resolve().parents[2]
    shutil.copytree(root / "tests" / "fixtures" / "byo_task", tmp_path / "tests" / "fixtures" / "byo_task")
    site = tmp_path / "site"  # `pip install -e` goes here instead: the test's environment is left as it was
    env = {**os.environ, "PYTHONPATH": f"{site}:{root}"}
    server = None
    try:
        for c in cmds:
            if c.startswith("make ") or "ema_pg.train " in c:
                continue  # the set-up this test already runs in; the training commands, below
            c = re.sub(r"(^|\s)python -m ", rf"\g<1>{py} -m ", c).replace("8000", port)  # the project's environment
            c = c.replace("pip install -q --no-build-isolation -e ",
                          f"pip install -q --no-build-isolation --no-deps --no-index --target {site} ")
            if c.endswith("&"):
                server = subprocess.Popen(c.rstrip("&").split(), cwd=tmp_path, stdout=subprocess.PIPE, text=True)
                assert "serving" in server.stdout.readline()
                continue
            out = subprocess.run(["bash", "-c", c], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
            assert out.returncode == 0, (c, out.stdout[-2000:], out.stderr[-3000:])
        assert all(c.startswith("python -m ema_pg.train ") or c.startswith("PYTHONPATH=tests/fixtures/byo_task ")
                   for c in trains), trains  # the one variable the page sets, put on the process's path below
        commands = {f"{i}: {c[:120]}": train_argv(c.replace("8000", port)) + SHORT.split() for i, c in enumerate(trains)}
        both = {**env, "PYTHONPATH": f"{env['PYTHONPATH']}:{tmp_path / 'tests' / 'fixtures' / 'byo_task'}"}
        done = run_in_one_process("ema_pg.train", commands, timeout=600 * len(trains), env=both, cwd=tmp_path)
        for label, (code, console, _) in done.items():
            assert code == 0 and "final eval/avg/" in console, (label, console[-3000:])
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
