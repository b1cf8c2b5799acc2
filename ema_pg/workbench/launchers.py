"""Where the jobs of a command run: a plan's cells (``python -m ema_pg.decide PLAN --launcher NAME``) and a
search's workers (``python -m ema_pg.hpo STUDY --launcher NAME``).

- ``local``: processes of this machine, ``--workers`` at a time (the default).
- ``submitit``: one job per cell through submitit, the library under Hydra's submitit launcher: a Slurm cluster's
  jobs (``--cluster slurm``, the default where ``sbatch`` is found) or its local executor (``--cluster local``: the
  same code path on one machine, what the tests run). ``--launcher-option KEY=VALUE`` sets the executor's
  parameters (``slurm_partition=dev``, ``timeout_min=600``, ``cpus_per_task=2``, ``slurm_array_parallelism``...).
- ``ray``: one Ray task per cell on a Ray cluster (``--address HOST:PORT``, or ``auto``: the cluster ``ray start``
  left on this node; without it, ``RAY_ADDRESS`` where set, else a Ray this process starts), through Ray's own task
  API. Hydra's Ray launcher was not used: its last release (1.2, 2022)
  pins a Ray of that year and launches through Ray's autoscaler YAML on AWS, where a plan needs only "run this
  command somewhere with N CPUs and tell me when it ended".

Each cell is the sweep's own per-cell command (:func:`~ema_pg.workbench.studies.decide.cell_command`), run by
:func:`run_cell` wherever the job lands: it writes its run folder, whose ``eval.json`` is the cell's result. The
jobs never write the ledger; the coordinator (the one ``decide`` that holds the plan's lock) records finished cells
and takes every look, so many jobs ending at once cannot interleave a ledger write. Every job started is written to
``launched.csv`` in the plan's run folder (cell, launcher, job id, when); a coordinator started again after it was
killed reattaches to a job the scheduler still holds (a Slurm job waiting in the queue or running), waits for a
cell whose run folder a live trainer still writes (:func:`~ema_pg.engine.owner.live_owner`), and starts only the
cells that neither finished nor live anywhere: no cell runs twice.

The nodes need the checkout (``--code``) and the environment at the same paths, and the run folders on a file
system they share (Slurm and Ray clusters usually mount one). A run folder's claim written on another host is
taken over only where ``EMA_PG_SHARED_LOCKS=1`` says that file system carries ``flock`` across hosts (NFSv4,
Lustre mounted ``-o flock``, GPFS): a cell preempted on one node then resumes on another.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

LAUNCHERS = ("local", "submitit", "ray")
LAUNCHED = "launched.csv"  #: every job a coordinator started, in the plan's run folder
_FIELDS = ("cell", "launcher", "job", "started")
#: the exit code a cell reports when its job ended without telling one (cancelled, its node lost)
EXIT_LOST = 1
#: the environment variable a study's worker reads its storage URL from where the URL holds a password: a command
#: line is shown by ps and written into a scheduler's job files (submitit's), the environment is not
STORAGE_ENV = "EMA_PG_STORAGE"
HANDED_ENV = (STORAGE_ENV,)  #: the coordinator's variables a Ray task is handed (the others inherit its environment)
RAY_ANSWER_S = 5.0  #: seconds a Ray cluster's address has to accept a connection (Ray's own join retries for minutes)


def run_cell(cmd: list[str], cwd: str, log: str) -> int:
    """Run one cell's command to its end in a process group of its own, its output appended to ``log``; its exit
    code. A SIGTERM or SIGINT to this process (a cancelled job or task) is passed on to the cell as SIGTERM, on
    which it saves its checkpoint and exits 75: the job's wrapper never outlives its cell or leaves it orphaned."""
    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def forward(*_):
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    before = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            before[sig] = signal.signal(sig, forward)
    except ValueError:  # not this interpreter's main thread: a cancel arrives as KeyboardInterrupt below
        pass
    try:
        while True:
            try:  # in short waits: Ray's cancel raises KeyboardInterrupt in the task's thread, which a blocking
                # wait on the child would never see (the exception lands only between Python's own steps)
                while (rc := p.poll()) is None:
                    time.sleep(0.2)
                return rc
            except KeyboardInterrupt:  # Ray's cancel, Python's default SIGINT
                forward()
    finally:  # a Ray worker runs other tasks after this one: its own handlers come back
        for sig, h in before.items():
            signal.signal(sig, h)


class Cell:
    """One started cell: its exit code once it ended (None while it runs), and a way to stop it (its checkpoint
    saved)."""

    job = ""

    def poll(self) -> int | None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class _Process(Cell):
    def __init__(self, cmd: list[str], cwd: Path, log: Path):
        with open(log, "ab") as out:
            self.p = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.job = str(self.p.pid)

    def poll(self):
        return self.p.poll()

    def stop(self):
        try:
            os.killpg(self.p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


class Adopted(Cell):
    """A cell a live trainer already writes (started by a coordinator that was killed): waited for, never started
    again; it ended well when its folder holds its result."""

    def __init__(self, run_dir: Path, owner: list[str]):
        self.run_dir, self.owner = run_dir, owner
        self.job = " ".join(owner)

    def poll(self):
        from ..engine.owner import live_owner

        if live_owner(self.run_dir) is not None:
            return None
        return 0 if (self.run_dir / "eval.json").is_file() else EXIT_LOST

    def stop(self):
        import socket

        if len(self.owner) == 2 and self.owner[0] == socket.gethostname() and self.owner[1].isdigit():
            try:
                os.kill(int(self.owner[1]), signal.SIGTERM)  # the trainer saves its checkpoint
            except ProcessLookupError:
                pass


class _Submitit(Cell):
    def __init__(self, job):
        self.j, self.job = job, str(job.job_id)

    def poll(self):
        if not self.j.done():
            return None
        try:
            return int(self.j.result())
        except Exception:  # noqa: BLE001 - the job ended without its result (cancelled, timed out, node lost)
            return EXIT_LOST

    def stop(self):
        self.j.cancel(check=False)


class _Ray(Cell):
    def __init__(self, ref):
        self.ref, self.job = ref, ref.hex()

    def poll(self):
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        if not ready:
            return None
        try:
            return int(ray.get(self.ref))
        except Exception:  # noqa: BLE001 - cancelled, or its worker or node died
            return EXIT_LOST

    def stop(self):
        import ray

        ray.cancel(self.ref)  # a KeyboardInterrupt in run_cell, passed on to the cell as SIGTERM


@dataclass
class LauncherSpec:
    """What ``--launcher``, ``--cluster``, ``--address``, ``--cell-cpus`` and ``--launcher-option`` said."""

    name: str = "local"
    cluster: str | None = None  #: submitit: slurm | local (None: slurm where sbatch is found, else local)
    address: str | None = None  #: ray: the cluster's address (None: :func:`ray_init`'s default)
    cell_cpus: int = 1  #: CPUs a cell asks its scheduler for
    options: tuple[str, ...] = ()  #: submitit executor parameters, KEY=VALUE

    def check(self) -> None:
        """One line for a launcher that cannot start, before any cell or look (a missing library, a bad option)."""
        if self.name not in LAUNCHERS:
            raise SystemExit(f"--launcher {self.name}: give one of {', '.join(LAUNCHERS)}")
        if self.cell_cpus < 1:
            raise SystemExit(f"--cell-cpus {self.cell_cpus}: give 1 or more")
        if bad := [o for o in self.options if "=" not in o]:
            raise SystemExit(f"--launcher-option {bad[0]}: give KEY=VALUE (say slurm_partition=dev)")
        if self.options and self.name != "submitit":
            raise SystemExit("--launcher-option sets submitit's executor: use it with --launcher submitit")
        if self.cluster and self.name != "submitit" or self.address and self.name != "ray":
            raise SystemExit("--cluster goes with --launcher submitit, --address with --launcher ray")
        lib = {"submitit": "submitit", "ray": "ray"}.get(self.name)
        if lib:
            import importlib.util

            if importlib.util.find_spec(lib) is None:
                raise SystemExit(f"--launcher {self.name}: {lib} is not installed; pip install 'ema-pg[cluster]'")
            try:
                importlib.import_module(lib)
            except Exception as e:  # noqa: BLE001 - a broken install: one line naming it
                raise SystemExit(f"--launcher {self.name}: {lib} is installed but does not import ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:160] if str(e) else ''}); reinstall it: "
                                 f"pip install --force-reinstall 'ema-pg[cluster]'") from None
        if self.name == "ray":
            check_ray_address(self.address or os.environ.get("RAY_ADDRESS") or None)
        if self.name == "submitit" and self.cluster is None and not shutil.which("sbatch"):
            print("submitit: no sbatch on this machine, so the cells run through submitit's local executor here "
                  "(--cluster local says so; on a Slurm login node sbatch is found)", flush=True)


class Launcher:
    """Starts cells and keeps ``launched.csv``; the scheduler-specific part is :meth:`_start`."""

    def __init__(self, spec: LauncherSpec, runs: Path, workers: int):
        self.spec, self.runs, self.workers = spec, Path(runs), workers
        self.capacity = workers  #: cells the coordinator keeps started at once

    def start(self, cell: str, cmd: list[str], cwd: Path, log: Path) -> Cell:
        c = self._start(cell, cmd, cwd, log)
        row = {"cell": cell, "launcher": self.spec.name, "job": c.job,
               "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        f = self.runs / LAUNCHED
        new = not f.is_file()
        with open(f, "a", newline="") as out:  # one coordinator writes it (the plan's lock); rows are appended whole
            w = csv.DictWriter(out, _FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)
        return c

    def reattach(self, cell: str) -> Cell | None:
        """The cell's job as the scheduler still holds it (waiting or running), started by an earlier coordinator."""
        return None

    def _start(self, cell: str, cmd: list[str], cwd: Path, log: Path) -> Cell:
        return _Process(cmd, cwd, log)

    def close(self) -> None:
        pass


class _SubmititLauncher(Launcher):
    def __init__(self, spec: LauncherSpec, runs: Path, workers: int):
        import submitit

        super().__init__(spec, runs, workers)
        self.cluster = spec.cluster or ("slurm" if shutil.which("sbatch") else "local")
        self.folder = self.runs / "submitit"
        self.executor = submitit.AutoExecutor(folder=self.folder / "%j", cluster=self.cluster)
        params = {"cpus_per_task": spec.cell_cpus, "timeout_min": 24 * 60}
        for o in spec.options:
            k, _, v = o.partition("=")
            params[k] = int(v) if v.isdigit() else v
        try:
            self.executor.update_parameters(**params)
        except (ValueError, TypeError, NameError) as e:  # NameError: submitit's word for an unknown parameter
            raise SystemExit(f"--launcher-option: submitit's {self.cluster} executor refuses it: "
                             f"{str(e).splitlines()[0][:200]}") from None
        if self.cluster == "slurm":  # the scheduler queues the rest; the coordinator submits the look's cells
            self.capacity = max(workers, int(params.get("slurm_array_parallelism", 0)) or 10**6)

    def _start(self, cell, cmd, cwd, log):
        self.executor.update_parameters(name=cell)
        return _Submitit(self.executor.submit(run_cell, cmd, str(cwd), str(log)))

    def reattach(self, cell):
        if self.cluster != "slurm":  # a local job lives only in the coordinator that started it
            return None
        import submitit

        job = _last_job(self.runs, cell, self.spec.name)
        if job is None:
            return None
        j = submitit.SlurmJob(self.folder / "%j", job)
        return _Submitit(j) if j.state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING") else None


class _RayLauncher(Launcher):
    def __init__(self, spec: LauncherSpec, runs: Path, workers: int):
        import ray

        super().__init__(spec, runs, workers)
        joined = ray_init(spec.address, workers * spec.cell_cpus)
        self._remote = ray.remote(num_cpus=spec.cell_cpus, max_retries=0)(run_cell)
        if joined:  # the cluster's CPUs decide; the coordinator hands it the look's cells
            self.capacity = max(workers, int(ray.cluster_resources().get("CPU", 1)) // spec.cell_cpus)

    def _start(self, cell, cmd, cwd, log):
        env = {k: os.environ[k] for k in HANDED_ENV if k in os.environ}  # a Ray worker's environment is the node's
        return _Ray(self._remote.options(name=cell, **({"runtime_env": {"env_vars": env}} if env else {}))
                    .remote(cmd, str(cwd), str(log)))

    def close(self):
        import ray

        ray.shutdown()


def check_ray_address(address: str | None) -> None:
    """One line, within seconds, where a Ray address is not ``HOST:PORT`` (``ray://HOST:PORT``, ``auto`` and none are
    Ray's own) or nothing accepts a connection there: Ray's join would retry for minutes without a word."""
    import socket

    if address is None or address in ("auto", "local"):
        return
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(f"Ray cluster {address}: give its address as HOST:PORT (say 10.0.0.5:6379), or auto")
    try:
        socket.create_connection((host, int(port)), timeout=RAY_ANSWER_S).close()
    except OSError as e:
        why = "no answer in %g s" % RAY_ANSWER_S if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise SystemExit(f"Ray cluster {address}: nothing accepts a connection there ({why}); start one "
                         "(ray start --head) or give its address") from None


def ray_init(address: str | None, num_cpus: int) -> bool:
    """Join the Ray cluster at ``address`` (``auto``: the one ``ray start`` left on this node; None: ``RAY_ADDRESS``
    where set, as a job Ray's job API started finds its cluster), or else start one in this process with ``num_cpus``
    CPUs, whatever cluster a ``ray start`` left on this node (Ray's own default joins that one, and then refuses the
    CPU count); whether it joined a cluster. The cluster's own logs stay in its session folder, so the console keeps the
    project's lines. A cluster that does not answer is one line; so is one that asks for a token this process does
    not send (Ray's token authentication: a ``ray start`` finds the token an earlier ``ray.init`` left in
    ``~/.ray/auth_token`` and turns it on, but a client given an explicit address sends it only under
    ``RAY_AUTH_MODE=token``). Ray's core prints each of its connection retries (a line a second, for about 20
    seconds) to this process's stderr: those lines are held back while it joins, and kept out of the console unless
    the join fails for a reason they alone say. The caller's SIGTERM and SIGINT handlers are kept: Ray's start puts
    its own in their place (a SIGTERM then aborts the process, exit 134, before the caller's cells could save their
    checkpoints)."""
    import logging
    import signal

    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    if ray.is_initialized():
        return address is not None
    kw = {"address": address} if address else {"address": "local", "num_cpus": num_cpus}
    mine = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with _held_stderr() as held:
        try:
            ray.init(**kw, log_to_driver=False, logging_level=logging.ERROR, include_dashboard=False)
            failed = None
        except ConnectionError as e:
            failed = " ".join(str(e).split())[:160]
    if failed is not None:
        if "InvalidAuthToken" in held.text or "Unauthenticated" in held.text:
            raise SystemExit(f"Ray cluster {address}: it asks for a token this process does not send (its token "
                             "authentication is on); set RAY_AUTH_MODE=token here, with the cluster's token in "
                             "~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH")
        raise SystemExit(f"Ray cluster {address}: it does not answer ({failed}); start one (ray start --head) or give "
                         "its address")
    for s, handler in mine.items():
        if handler is not None:
            signal.signal(s, handler)
    return address is not None


class _held_stderr:
    """File descriptor 2 sent to a temporary file while the block runs (what a library's C++ core prints there), its
    text in ``.text`` after; the descriptor is restored however the block ends."""

    def __enter__(self):
        import sys
        import tempfile

        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc):
        import sys

        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace")
        self.file.close()
        return False


def _last_job(runs: Path, cell: str, launcher: str) -> str | None:
    rows = [r for r in launched(runs) if r.get("cell") == cell and r.get("launcher") == launcher]
    return rows[-1]["job"] if rows else None


def launched(runs: Path) -> list[dict]:
    """The rows of ``launched.csv`` (every job started for the plan's cells)."""
    f = Path(runs) / LAUNCHED
    if not f.is_file():
        return []
    with open(f, newline="") as src:
        return list(csv.DictReader(src))


def add_launcher_args(ap, what: str) -> None:
    """The launcher's options on a command's parser (``what``: the command's jobs, said in the help)."""
    ap.add_argument("--launcher", default="local", choices=LAUNCHERS,
                    help=f"where the {what} run: local processes (default), submitit jobs (Slurm, or its local "
                         "executor), or Ray tasks (docs/scale.md)")
    ap.add_argument("--cluster", default=None, choices=("slurm", "local"),
                    help="submitit's executor (default: slurm where sbatch is found, else local)")
    ap.add_argument("--address", default=None,
                    help="a Ray cluster's address, HOST:PORT or auto (default: $RAY_ADDRESS where set, else a Ray of "
                         "this process with --workers CPUs)")
    ap.add_argument("--cell-cpus", type=int, default=1, help=f"CPUs each of the {what} asks its scheduler for (default 1)")
    ap.add_argument("--launcher-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a submitit executor parameter (slurm_partition=dev, timeout_min=600, ...); repeat for more")


def launcher_spec(a) -> LauncherSpec:
    """The :class:`LauncherSpec` of parsed arguments (:func:`add_launcher_args`)."""
    return LauncherSpec(a.launcher, a.cluster, a.address, a.cell_cpus, tuple(a.launcher_option))


def make_launcher(spec: LauncherSpec, runs: Path, workers: int) -> Launcher:
    spec.check()
    Path(runs).mkdir(parents=True, exist_ok=True)
    cls = {"local": Launcher, "submitit": _SubmititLauncher, "ray": _RayLauncher}[spec.name]
    return cls(spec, runs, workers)
