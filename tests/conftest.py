"""tests/ has one folder per floor of the package (README, "Layout"): algorithm, config, engine, workbench, the scale
path, the fault probes, and the layout's own checks. The helpers (helpers.py, retrieval_server.py, fixtures/) stay
here; every floor's folder is on the import path, so a test module can use another floor's helpers by name."""

import os
import sys
from pathlib import Path

from ema_pg.process import command_start

command_start()  # the tests run as a command does: MKL's strict reproducibility and OpenMP's waiting, set before use

import pytest  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
FLOORS = ("algorithm", "config", "engine", "workbench", "scale", "faults", "layout")
sys.path[:0] = [str(HERE)] + [str(HERE / floor) for floor in FLOORS]

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `make test`'s worker processes (pytest-xdist)
    # One CPU thread for the worker and every process it starts. The tests' models are tiny, so a second thread
    # buys nothing, and two workers with two OpenMP threads each on two cores spin against one another: a
    # 600-iteration run took 600 s instead of 100 s. A test that needs threads sets them itself.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


#: The slow and scale suites' longest files, longest first: their test-seconds on a 2-core CI-class machine
#: (``pytest -m "slow and not scale" -n 2 --dist loadfile --durations=0`` and the same of ``-m scale``, at 1e53dfb,
#: before that session's cuts to the scale files, the byo page and the SIGTERM tests). pytest-xdist's loadfile with
#: ``--no-loadscope-reorder`` (as the Makefile runs it) hands out whole files in collection order, the next one to the
#: first worker left with two tests or fewer: the longest start first and the short ones fill the end. xdist's own
#: order (most tests first) and the alphabetical one could each start a long file last while the other worker had
#: nothing left.
LONGEST_FIRST = (
    "tests/scale/test_scale_multiproc.py",  # ~990 s
    "tests/scale/test_scale_vllm.py",  # ~990 s
    "tests/faults/test_faults.py",  # ~625 s
    "tests/engine/test_sweeps.py",  # ~570 s, its every-sweep fixture ~320 s of it
    "tests/workbench/test_launchers.py",  # ~510 s
    "tests/workbench/test_optuna.py",  # ~460 s
    "tests/faults/test_faults_lifecycle.py",  # ~370 s
    "tests/workbench/test_byo_page.py",  # ~355 s
    "tests/engine/test_async.py",  # ~200 s
    "tests/engine/test_tracking_e2e.py",  # ~170 s
    "tests/engine/test_train.py",  # ~150 s
    "tests/workbench/test_decide.py",  # ~135 s
    "tests/engine/test_console.py",  # ~130 s slow, ~75 s scale
)


def pytest_collection_modifyitems(items):
    """The longest files first (:data:`LONGEST_FIRST`), every other file after them in its own order; a file's tests
    keep theirs."""
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A tiny finished run (4 iterations, checkpoints at 2 and 4), trained in this process; tests that change it
    copy it first."""
    from pathlib import Path

    from helpers import compose_cfg

    from ema_pg.engine.fit import train

    cfg = compose_cfg(["algo.iterations=4", "algo.eval_every=2"], tmp_path_factory.mktemp("finished"))
    train(cfg)
    return Path(cfg.run_dir)


@pytest.fixture(scope="session")
def mlflow_url(tmp_path_factory):
    """One real MLflow tracking server (SQLite store) for the session's tests: its URL."""
    from helpers import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow_server")) as url:
        yield url


@pytest.fixture
def ray_token(monkeypatch, tmp_path):
    """Ray's token authentication on, with a token of the test's own (``RAY_AUTH_MODE=token``,
    ``RAY_AUTH_TOKEN_PATH``) for this process and the commands it starts. Ray turns it on by itself once a token sits
    in ``~/.ray/auth_token`` (the first ``ray.init`` that starts a cluster writes one there, and every ``ray start``
    after it finds it), where a client given an explicit address sends none: the tests pin the mode rather than
    depend on what an earlier test or user left in the home folder, and leave nothing there."""
    import secrets

    token = tmp_path / "ray_auth_token"
    token.write_text(secrets.token_hex(32))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    return token


@pytest.fixture
def ray_cluster(ray_token):
    """A Ray cluster on this machine, started as a user starts one (``ray start --head``, token authentication on:
    :func:`ray_token`) and stopped after, alone: ``ray stop`` would stop every Ray here, a Ray that another test's
    coordinator started in its own process among them (CI's slow suite lost two cells of a Ray plan that way, their
    raylet gone at once). Its session folder is short: a Unix socket's path has at most 107 bytes, and pytest's
    tmp_path is longer. One at a time on this machine (a lock across the suite's worker processes): a head takes
    fixed ports (its client server's 10001)."""
    import shutil
    import socket
    import subprocess
    import tempfile

    from filelock import FileLock

    one_at_a_time = FileLock("/tmp/ema_pg_ray_cluster.lock")
    one_at_a_time.acquire(timeout=3600)
    ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    up = None
    try:  # a session of its own: the daemons it leaves share its process group, and nothing else does
        up = subprocess.Popen([ray, "start", "--head", "--num-cpus", "2", "--port", str(port), "--include-dashboard",
                               "false", "--temp-dir", str(temp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env, start_new_session=True)
        said = up.communicate(timeout=180)[0]
        assert up.returncode == 0, said[-3000:]
        yield f"127.0.0.1:{port}"
    finally:
        if up is not None:
            stop_process_group(up.pid)
        shutil.rmtree(temp, ignore_errors=True)
        one_at_a_time.release()


def stop_process_group(pgid: int, timeout: float = 60) -> None:
    """SIGKILL a process group and every descendant of its members (a Ray head's workers each begin a session of
    their own, as children of its raylet), as ``ray stop --force`` does, but for this group alone; return once they
    are gone."""
    import signal

    import psutil

    group = [p for p in psutil.process_iter() if _pgid(p) == pgid]
    victims = {p.pid: p for p in group}
    for p in group:
        try:
            victims.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for p in victims.values():
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(victims.values()), timeout=timeout)
    assert not alive, f"still alive after SIGKILL: {[p.pid for p in alive]}"


def _pgid(p) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """tests/fixtures/byo_task, a researcher's own task package, installed by pip as they install theirs (into a
    folder of its own, so that the test's environment is left as it was): its modules and its dist-info with the
    entry points."""
    import shutil
    import subprocess

    from helpers import BYO_FIXTURE

    tmp = tmp_path_factory.mktemp("byo")
    shutil.copytree(BYO_FIXTURE, tmp / "src")  # pip builds in the source folder: a copy keeps the repository clean
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
