"""docs/byo.md: every command on the page runs, as written (each training run cut to two iterations), from a folder
holding only the examples it writes."""

from __future__ import annotations

import os
import re
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


@pytest.mark.slow
def test_every_command_on_the_page_runs(tmp_path):
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
            if c.startswith("make "):
                continue  # the set-up this test already runs in
            c = re.sub(r"(^|\s)python -m ", rf"\g<1>{py} -m ", c).replace("8000", port)  # the project's environment
            c = c.replace("pip install -q --no-build-isolation -e ",
                          f"pip install -q --no-build-isolation --no-deps --no-index --target {site} ")
            if c.endswith("&"):
                server = subprocess.Popen(c.rstrip("&").split(), cwd=tmp_path, stdout=subprocess.PIPE, text=True)
                assert "serving" in server.stdout.readline()
                continue
            out = subprocess.run(["bash", "-c", c + SHORT * ("ema_pg.train" in c)], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=600, env=env)
            assert out.returncode == 0, (c, out.stdout[-2000:], out.stderr[-3000:])
            if "ema_pg.train" in c:
                assert "final eval/avg/" in out.stdout, c
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
