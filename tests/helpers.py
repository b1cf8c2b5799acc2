"""Compose the real config (ema_pg.config.compose) and shrink it to seconds-long runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf, open_dict

from ema_pg.config import compose

ROOT = Path(__file__).resolve().parents[1]  #: the repository
BYO_FIXTURE = ROOT / "tests" / "fixtures" / "byo_task"  #: the package of a researcher's own tasks

TINY = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.tokenizer_vocab=300",
    "sft.steps=20", "sft.batch_size=16", "sft.num_demos=200",
    "algo.prompts_per_step=4", "algo.group_size=4", "algo.iterations=4", "algo.eval_every=2",
    "rollout.max_new_tokens=4", "optim.lr=1e-3", "trainer.progress_bar=false",
]


def compose_cfg(overrides: list[str] = (), tmp_path: Path | None = None, tiny: bool = True):
    task_set = any(o.startswith("task=") for o in overrides)
    tiny_task = ["task.eval_size=16"] if tiny and not task_set else []
    cfg = compose((TINY + tiny_task if tiny else []) + list(overrides))
    with open_dict(cfg):
        if tmp_path is not None:
            cfg.run_dir = str(tmp_path / "run")
            if not any(o.startswith("sft.cache_dir=") for o in overrides):
                cfg.sft.cache_dir = str(tmp_path.parent / "cold_start_cache")
    return cfg


def wait_while_alive(proc: subprocess.Popen, ready, timeout: float = 300, every: float = 0.1) -> None:
    """Poll ``ready()`` until it is true; fails if ``proc`` ends first or ``timeout`` seconds pass."""
    deadline = time.time() + timeout
    while not ready():
        assert time.time() < deadline and proc.poll() is None, f"not ready after {timeout} s, or the process ended"
        time.sleep(every)


def training_under_way(run: Path) -> bool:
    """True once the run's ``metrics.csv`` holds a row past iteration 0: its training loop is running (the CSV logger
    writes every 10 steps). A fixed wait after the model is written is not enough on a slow machine: a SIGTERM that
    comes before the loop ends the run with no checkpoint."""
    import csv

    try:
        with open(run / "metrics.csv", newline="") as f:
            return any(r.get("step") not in (None, "") and float(r["step"]) >= 1 for r in csv.DictReader(f))
    except (OSError, ValueError):  # not written yet, or a row half-written
        return False


def resolved(cfg):
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))


def per_row(fn):
    """A batched ``on_stop`` (the sampler's protocol) from a function of one row: fn(row, turn_text) -> obs | None."""
    return lambda rows, texts: [fn(r, t) for r, t in zip(rows, texts)]


_RACER = """import sys, time
from pathlib import Path
from ema_pg.config import ConfigError
from ema_pg.engine.owner import claim_run_dir, own_run_dir
folder, ready, go, done = map(Path, sys.argv[1:5])
ready.write_text('')  # imported: at the line
while not go.exists():
    time.sleep(0.001)
try:
    print({attempt}, flush=True)
except ConfigError as e:
    print('refused', e, flush=True)
    sys.exit()
while not done.exists():  # what it got, it holds until every other process has tried
    time.sleep(0.01)
"""


def race_for_folder(folder: Path, attempt: str, n: int, tmp_path: Path) -> list[str]:
    """``n`` real processes each do ``attempt`` (an expression of ``folder``, ``claim_run_dir`` and ``own_run_dir``)
    at the same moment and answer one line: its value, or ``refused`` and the one-line error. The go is given when
    every process has imported (waited for, not guessed with a sleep, on however loaded a machine), and a process
    that got a folder holds it until all have answered. They import the claim alone (no torch): a few tenths of a
    second each."""
    ready = [tmp_path / f"ready{i}" for i in range(n)]
    go, done = tmp_path / "go", tmp_path / "done"
    code = _RACER.format(attempt=attempt)
    ps = [subprocess.Popen([sys.executable, "-c", code, str(folder), str(r), str(go), str(done)], stdout=subprocess.PIPE,
                           text=True) for r in ready]
    try:
        deadline = time.monotonic() + 300
        while not all(r.exists() or p.poll() is not None for r, p in zip(ready, ps)) and time.monotonic() < deadline:
            time.sleep(0.02)
        go.write_text("")
        answers = [p.stdout.readline().strip() for p in ps]
        done.write_text("")
        for p in ps:
            p.wait(timeout=60)
        return answers
    finally:
        for p in ps:
            p.kill()
            p.wait()
            p.stdout.close()


def postgres_server(tmp_root: Path | None = None):
    """A real PostgreSQL server from Debian's package, started for a test (a context manager yielding its SQLAlchemy
    URL, ``postgresql+psycopg2://postgres@/optuna?host=SOCKET_DIR&port=PORT``): initdb into a fresh folder, a Unix
    socket only, trust authentication, one database ``optuna``; stopped and removed at the end. As root (CI, this
    machine) the server runs as the ``postgres`` user the package created."""
    import contextlib
    import glob
    import os
    import shutil
    import socket
    import subprocess
    import tempfile

    @contextlib.contextmanager
    def server():
        bindir = next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin"))[::-1]), None)
        initdb = shutil.which("initdb") or (bindir and f"{bindir}/initdb")
        pg_ctl = shutil.which("pg_ctl") or (bindir and f"{bindir}/pg_ctl")
        if not (initdb and pg_ctl and shutil.which("psql")):
            raise RuntimeError("PostgreSQL is not installed: apt-get install postgresql (Debian's package)")
        root = Path(tempfile.mkdtemp(prefix="ema_pg_pg_", dir=tmp_root))  # /tmp: the postgres user must reach it
        as_user = []
        if os.geteuid() == 0:
            import pwd

            pw = pwd.getpwnam("postgres")
            os.chown(root, pw.pw_uid, pw.pw_gid)
            as_user = ["runuser", "-u", "postgres", "--"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        data, log = root / "data", root / "server.log"
        run = lambda *cmd: subprocess.run([*as_user, *cmd], check=True, capture_output=True, text=True)  # noqa: E731
        run(initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        run(pg_ctl, "-D", str(data), "-l", str(log), "-w", "-o", f"-k {root} -p {port} -c listen_addresses=''", "start")
        try:
            run("psql", "-h", str(root), "-p", str(port), "-U", "postgres", "-c", "CREATE DATABASE optuna")
            yield f"postgresql+psycopg2://postgres@/optuna?host={root}&port={port}"
        finally:
            subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], capture_output=True)
            shutil.rmtree(root, ignore_errors=True)

    return server()


def postgres_ctl(url: str, action: str) -> None:
    """Stop (``immediate``: as a crash does) or start again the server :func:`postgres_server` started for ``url``."""
    import glob
    import os
    import subprocess

    root = url.split("host=")[1].split("&")[0]
    port = url.split("port=")[1].split("&")[0]
    pg_ctl = f"{sorted(glob.glob('/usr/lib/postgresql/*/bin'))[-1]}/pg_ctl"
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    how = (["-m", "immediate", "stop"] if action == "stop" else
           ["-l", f"{root}/server.log", "-o", f"-k {root} -p {port} -c listen_addresses=''", "start"])
    subprocess.run([*as_user, pg_ctl, "-D", f"{root}/data", "-w", *how], check=True, capture_output=True)


def moved(model, scale: float, seed: int):
    """A copy of ``model`` with every weight moved by ``scale`` of its spread: another version of it."""
    import copy

    import torch

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return out


def frozen(model):
    """A copy of ``model`` in eval mode with no gradients: an anchor."""
    import copy

    out = copy.deepcopy(model).eval()
    for p in out.parameters():
        p.requires_grad_(False)
    return out



def mlflow_server(root: Path, backend: str | None = None, port: int | None = None):
    """A real ``mlflow server`` (the mlflow package's own, on loopback), started for tests: a context manager yielding
    its URL. Its job runner stays off (a process per job queue, started for features the tracking REST API does not
    use). ``backend``: its store (default a SQLite file in ``root``; a PostgreSQL URL works the same);
    artifacts go to ``root/artifacts`` through the server; ``port``: a port of its own (default a free one). Stopped
    at the end."""
    import contextlib
    import os
    import signal
    import socket

    import requests

    @contextlib.contextmanager
    def server(port=port):
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        root.mkdir(parents=True, exist_ok=True)
        store = backend or f"sqlite:///{root / 'mlflow.db'}"
        log = open(root / "server.log", "a")
        proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", store,
                                 "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
                                 "--port", str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 120
            while True:
                try:
                    if requests.get(url + "/health", timeout=2).ok:
                        break
                except requests.RequestException:
                    pass
                assert proc.poll() is None and time.time() < deadline, (root / "server.log").read_text()[-2000:]
                time.sleep(0.3)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()

    return server()


#: ``python -m MODULE ARGV`` for each (label, ARGV) of a JSON list, one after another in one process: ``runpy`` runs the
#: module as ``-m`` does, with a fresh Hydra for each (as a fresh process has one); each command's console lies between
#: its marker lines, its exit code on the closing one. One interpreter start serves many commands (an
#: interpreter start with the trainer's libraries is ~10 s here)
DRIVER = """import json, runpy, sys, traceback
from hydra.core.global_hydra import GlobalHydra
module = sys.argv[1]
for label, argv in json.loads(sys.argv[2]):
    for f in (sys.stdout, sys.stderr):
        print(f"\\n<<< {label}", file=f, flush=True)  # on a line of its own, whatever came before
    sys.argv = [module, *argv]
    GlobalHydra.instance().clear()
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter ends on it: None is 0, a message is printed and is 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if code and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    for f in (sys.stdout, sys.stderr):
        print(f"\\n>>> {label} {code}", file=f, flush=True)
"""


def run_in_one_process(module: str, commands: dict[str, list[str]], timeout: float, env=None, cwd=ROOT) -> dict[str, tuple]:
    """``python -m module argv`` for each label -> argv of ``commands``, in one process (:data:`DRIVER`) started in
    ``cwd``: label -> (exit code, or None where the command never ended; its console, stdout then stderr; its
    stderr alone)."""
    r = subprocess.run([sys.executable, "-c", DRIVER, module, json.dumps(list(commands.items()))], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=timeout)

    def section(text: str, label: str) -> tuple[str, int | None]:
        m = re.search(rf"^<<< {re.escape(label)}\n(.*?)^>>> {re.escape(label)} (-?\d+)$", text, re.DOTALL | re.MULTILINE)
        return (m.group(1), int(m.group(2))) if m else (text[-3000:], None)

    out = {}
    for label in commands:
        (o, code), (e, _) = section(r.stdout, label), section(r.stderr, label)
        out[label] = (code, o + e, e)
    return out


def spawned_children(proc, recursive: bool = False) -> list:
    """The children of ``proc`` (a psutil.Process) that multiprocessing spawned (rollout workers). A short-lived child
    (a git call) may end, or be a zombie, between the listing and the look at its command line: it is not one."""
    import psutil

    found = []
    for c in proc.children(recursive=recursive):
        try:
            if "spawn_main" in " ".join(c.cmdline()):
                found.append(c)
        except psutil.NoSuchProcess:  # ZombieProcess included
            pass
    return found
