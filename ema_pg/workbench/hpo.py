"""Optuna hyper-parameter search over training runs (SQLite storage, several workers, resumable).

    python -m ema_pg.hpo conf/hparams_search/ema_topk.yaml                 # one worker
    python -m ema_pg.hpo conf/hparams_search/ema_topk.yaml --workers 2     # two processes, one study
    python -m ema_pg.hpo STUDY --workers 8 --launcher submitit --launcher-option slurm_partition=dev   # 8 Slurm jobs
    python -m ema_pg.hpo STUDY --workers 8 --launcher ray --address auto                              # 8 Ray tasks
    python -m ema_pg.hpo conf/hparams_search/ema_topk.yaml algo.iterations=100   # extra Hydra overrides
    optuna-dashboard sqlite:///runs/optuna/ema_topk.db                        # watch it (make dashboard)

A study file (``conf/hparams_search/*.yaml``) names the study, its storage, the direction,
the total number of trials, the sampler and pruner, the Hydra overrides every trial starts
from and the search space (``params``: a config key -> ``{type: float|int|categorical, ...}``).

Each trial is one training run (``runs/optuna/<study>/trial_<n>/``, a normal run folder); its
objective is the run's final ``eval/avg/<metric>``. After every evaluation the run reports the
average to Optuna, and the study's pruner may stop it early (the trial is then PRUNED).

Workers: any number of processes (on one machine or sharing a file system) may run this
command on the same storage. A lock beside the database makes "count the trials, then start
one" atomic, so together they run exactly ``n_trials`` trials, none twice. Resuming: run the
same command again. Finished trials are kept; a trial interrupted by Ctrl-C / SIGTERM is put
back in the queue with its parameters and resumes its run folder from the last checkpoint. On
SIGTERM (a scheduler's preemption; ``--workers N`` passes it to every worker) the trial's run
first saves a checkpoint of its current iteration, as ``python -m ema_pg.train`` does, and the
worker exits 75; Ctrl-C exits 130 and resumes from the last periodic checkpoint. A
worker killed outright stops sending heartbeats and its trial is re-queued the same way once
``grace_period`` seconds have passed.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from omegaconf import OmegaConf
from optuna.trial import TrialState

from ..cli import PACKAGE_ROOT as ROOT
from ..cli import command_parser
from ..engine.console import masked
from ..engine.files import file_lock
from ..engine.runs import EXIT_INTERRUPTED
from .launchers import STORAGE_ENV

log = logging.getLogger("ema_pg.hpo")


def _expected_optuna_notes(fn):
    """Run ``fn`` with Optuna's expected notes silenced: the heartbeat storage is experimental, and heartbeats are
    driven here (ask/tell under a lock), not by Study.optimize. Held around the calls, not set at import, so that
    they stay silent whoever reset the warning filters (a test runner does, per test)."""

    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
            return fn(*args, **kwargs)

    return quiet


PARAM_TYPES = ("float", "int", "categorical")
SAMPLERS = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler,
            "gp": optuna.samplers.GPSampler, "cmaes": optuna.samplers.CmaEsSampler}
PRUNERS = {"median": optuna.pruners.MedianPruner, "percentile": optuna.pruners.PercentilePruner,
           "hyperband": optuna.pruners.HyperbandPruner, "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
           "threshold": optuna.pruners.ThresholdPruner, "none": optuna.pruners.NopPruner}


class StudyFileError(ValueError):
    """A malformed study file; the message says which key and what to change."""


@dataclass
class StudySpec:
    study_name: str
    params: dict
    storage: str = ""
    direction: str = "maximize"
    n_trials: int = 20
    sampler: dict = field(default_factory=lambda: {"name": "tpe", "seed": 0})
    pruner: dict = field(default_factory=lambda: {"name": "median", "n_startup_trials": 3, "n_warmup_steps": 1})
    overrides: list = field(default_factory=list)
    runs_dir: str = ""
    heartbeat_interval: int = 30
    grace_period: int = 120

    def __post_init__(self):
        self.storage = self.storage or f"sqlite:///runs/optuna/{self.study_name}.db"

    @property
    def trials_dir(self) -> Path:
        """Where the trials' run folders go: ``runs_dir``, else beside a SQLite file (``<db dir>/<study>/``)."""
        if self.runs_dir:
            return Path(self.runs_dir)
        if self.storage.startswith("sqlite:///"):
            return Path(self.storage.removeprefix("sqlite:///")).parent / self.study_name
        return Path("runs/optuna") / self.study_name


def load_study_spec(path: str | Path) -> StudySpec:
    path = Path(path)
    if not path.is_file():
        have = ", ".join(sorted(p.name for p in (ROOT / "conf" / "hparams_search").glob("*.yaml")))
        raise StudyFileError(f"study file {path} does not exist (conf/hparams_search/ has: {have})")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    known = set(StudySpec.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise StudyFileError(f"{path}: unknown key(s) {sorted(unknown)}; a study file has: {', '.join(sorted(known))}")
    for req in ("study_name", "params"):
        if req not in raw:
            raise StudyFileError(f"{path}: missing {req!r}")
    spec = StudySpec(**raw)
    if spec.direction not in ("maximize", "minimize"):
        raise StudyFileError(f"{path}: direction={spec.direction!r}; choose maximize or minimize")
    if spec.n_trials < 1:
        raise StudyFileError(f"{path}: n_trials must be >= 1; got {spec.n_trials}")
    for key, name, table in (("sampler", spec.sampler.get("name"), SAMPLERS), ("pruner", spec.pruner.get("name"), PRUNERS)):
        if name not in table:
            raise StudyFileError(f"{path}: {key}.name={name!r}; choose one of: {', '.join(table)}")
    if not spec.params:
        raise StudyFileError(f"{path}: params is empty; give at least one config key to search over")
    for key, p in spec.params.items():
        if not isinstance(p, dict) or p.get("type") not in PARAM_TYPES:
            raise StudyFileError(f"{path}: params.{key} needs type: one of {', '.join(PARAM_TYPES)}; got {p!r}")
        need = ("choices",) if p["type"] == "categorical" else ("low", "high")
        missing = [k for k in need if k not in p]
        if missing:
            raise StudyFileError(f"{path}: params.{key} ({p['type']}) needs {', '.join(missing)}")
        if p["type"] == "int" and not all(float(p[k]).is_integer() for k in ("low", "high")):
            raise StudyFileError(f"{path}: params.{key} (int): low ({p['low']}) and high ({p['high']}) must be whole "
                                 "numbers; round them, or make it type: float")
        if p["type"] != "categorical" and not p["low"] < p["high"]:
            raise StudyFileError(f"{path}: params.{key}: low ({p['low']}) must be < high ({p['high']})")
        try:  # what Optuna itself refuses (log with low <= 0, an empty choices list, a bad step) is refused here
            distribution(p)
        except (ValueError, TypeError) as e:
            raise StudyFileError(f"{path}: params.{key}: {e}") from None
    for key, table, kw in (("sampler", SAMPLERS, spec.sampler), ("pruner", PRUNERS, spec.pruner)):
        args = {k: v for k, v in kw.items() if k != "name"}
        try:
            table[kw["name"]](**args)
        except (ValueError, TypeError) as e:
            raise StudyFileError(f"{path}: {key} {kw['name']} does not take {args}: {e}") from None
    check_ranges(spec, path)
    return spec


def check_ranges(spec: StudySpec, path: Path) -> None:
    """Each parameter's ends (a categorical's every choice) checked by the config's own rules, as a trial's config
    would be: a range wider than the knob's valid one is refused at load, not when a worker draws a bad value."""
    from ..config import ConfigError, validate
    from ..engine.install import check_config

    runs = ROOT / "runs" / "optuna" / spec.study_name
    base = compose_trial_cfg(spec, {}, runs)  # the study's own overrides first, so no parameter takes their blame
    try:
        check_config(base)
    except ConfigError as e:
        raise StudyFileError(f"{path}: the study's overrides are refused by the config: {e}") from None
    if unknown := _unknown_keys(base, spec.params):
        raise StudyFileError(f"{path}: params.{unknown[0]} is not a config key; see `python -m ema_pg.train --cfg job`")
    for key, p in spec.params.items():
        for v in (p["choices"] if p["type"] == "categorical" else (p["low"], p["high"])):
            cfg = compose_trial_cfg(spec, {key: v}, runs)
            try:
                validate(cfg)
            except ConfigError as e:
                raise StudyFileError(f"{path}: params.{key}={_value(v)} (its range) is refused by the config: {e}; "
                                     "narrow the range") from None


def distribution(p: dict) -> optuna.distributions.BaseDistribution:
    """The Optuna distribution of a study file's parameter entry (its validation is Optuna's)."""
    kw = {k: v for k, v in p.items() if k in ("log", "step")}
    if p["type"] == "float":
        return optuna.distributions.FloatDistribution(float(p["low"]), float(p["high"]), **kw)
    if p["type"] == "int":
        return optuna.distributions.IntDistribution(int(p["low"]), int(p["high"]), **kw)
    return optuna.distributions.CategoricalDistribution(list(p["choices"]))


def suggest(trial: optuna.Trial, params: dict) -> dict:
    out = {}
    for key, p in params.items():
        kw = {k: v for k, v in p.items() if k in ("log", "step")}
        if p["type"] == "float":
            out[key] = trial.suggest_float(key, float(p["low"]), float(p["high"]), **kw)
        elif p["type"] == "int":
            out[key] = trial.suggest_int(key, int(p["low"]), int(p["high"]), **kw)
        else:
            out[key] = trial.suggest_categorical(key, list(p["choices"]))
    return out


def _value(v) -> str:
    return "null" if v is None else str(v)


def _unknown_keys(base, keys) -> list[str]:
    """The keys among ``keys`` that the composed config ``base`` (the study's, without the trial's values) lacks."""
    return [k for k in keys if OmegaConf.select(base, k, default="__missing__") == "__missing__"]


def compose_trial_cfg(spec: StudySpec, params: dict, run_dir: Path, extra: list[str] = ()):
    """The run config of a trial: the study's overrides, the command line's, then the trial's values."""
    from ..config import compose

    overrides = list(spec.overrides) + list(extra) + [f"{k}={_value(v)}" for k, v in params.items()]
    overrides += [f"run_dir={run_dir}", "if_exists=resume"]
    try:
        cfg = compose(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors
        if not params:
            hint = "the study's overrides do not compose"
        elif unknown := _unknown_keys(compose_trial_cfg(spec, {}, run_dir, extra), params):  # (its own error first)
            hint = f"params.{unknown[0]} is not a config key"
        else:  # the keys exist: the trial's values are what is refused (an int knob given 2.7)
            hint = "the trial's values " + " ".join(f"params.{k}={_value(v)}" for k, v in params.items()) + " do not compose"
        raise StudyFileError(f"{hint}: {e}".splitlines()[0] + "; see `python -m ema_pg.train --cfg job`") from None
    if unknown := _unknown_keys(cfg, params):
        raise StudyFileError(f"params.{unknown[0]} is not a config key; see `python -m ema_pg.train --cfg job`")
    return cfg


def link_trial(cfg, spec: StudySpec, trial: optuna.Trial) -> None:
    """A trial's tracker run: grouped under its study, job type ``trial``, tagged with its number (its parameters
    are in its config); where the study's overrides name none of these, they are set here."""
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.logger.group = cfg.logger.group or spec.study_name
        if cfg.logger.job_type == "train":
            cfg.logger.job_type = "trial"
        cfg.logger.tags = [*cfg.logger.tags, f"trial={trial.number}"]


def tracker_runs(run_dir: Path) -> dict:
    """The tracker runs a run folder's ``tracking.json`` names, by tracker ({} where none)."""
    from ..engine.tracking import read_record

    return {k: v for k, v in read_record(run_dir).items() if k != "media_sent"}


def optuna_pruning(trial: optuna.Trial):
    """A callback that reports each evaluation's average to the trial and stops the run when the pruner says so. Its
    class is built here: its base is a Lightning callback, the trial's import and not the coordinator's, which starts
    the workers without Lightning (~10 s at every start)."""
    from ..engine.module import EvalCallback

    class OptunaPruning(EvalCallback):
        def __init__(self, trial: optuna.Trial):
            self.trial, self.pruned = trial, False

        def on_ema_pg_eval(self, trainer, module, result: dict) -> None:
            step = int(result["iteration"])
            self.trial.report(float(result["avg"]), step)
            if step > 0 and self.trial.should_prune():
                self.pruned = True
                trainer.should_stop = True
                log.info("trial %d pruned at iteration %d (avg %.3f)", self.trial.number, step, result["avg"])

    return OptunaPruning(trial)


class StorageLost(RuntimeError):
    """The study's storage failed mid-study (a database server stopped, a connection dropped): the message is the
    one line the console shows, naming the storage (masked) and the trial, and saying how to resume."""


def storage_failure(e: BaseException) -> BaseException | None:
    """The database error at the root of ``e`` where the study's storage failed (Optuna's StorageInternalError, or
    SQLAlchemy's errors: a connection lost, a server gone); None for any other error."""
    import sqlalchemy.exc

    chain: list[BaseException] = []
    while e is not None and all(e is not x for x in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(x, (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError)) for x in chain):
        return chain[-1]
    return None


def storage_lost_line(spec: StudySpec, root: BaseException, trial: int | None, run_dir: Path | None) -> str:
    """One line: which storage failed and why (its password masked), the trial it stopped and where it resumes."""
    why = str(root).strip().splitlines()[0] if str(root).strip() else ""
    at = "" if trial is None else (f" during trial {trial}" + (f" (its run folder {run_dir} keeps its checkpoints)"
                                                               if run_dir is not None else ""))
    return (f"study storage {masked(spec.storage)} failed{at}: {type(root).__name__}: {masked(why)}; nothing is "
            "lost: once the storage answers again, run the same command to resume the study (the trial is re-queued "
            f"after grace_period={spec.grace_period} s and continues its run folder)")


def _heartbeat(storage, trial_id: int, interval: int):
    stop = threading.Event()

    def beat():
        while not stop.wait(interval):
            try:
                storage.record_heartbeat(trial_id)
            except Exception as e:  # noqa: BLE001 - the storage is gone: the worker's next call says so, once
                if storage_failure(e) is None:
                    raise
                return

    storage.record_heartbeat(trial_id)
    t = threading.Thread(target=beat, daemon=True)
    t.start()
    return stop


@_expected_optuna_notes
def open_study(spec: StudySpec, worker_index: int = 0) -> optuna.Study:
    """Create or load the study. The sampler's seed is offset by ``worker_index`` and by the number
    of trials already in storage, so neither two workers sharing a study nor a worker restarted on
    a study that has run trials replays another's proposals (worker 0 of a new study keeps the
    file's seed)."""
    url = spec.storage
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    s, p = dict(spec.sampler), dict(spec.pruner)
    name = s.pop("name")
    pruner = PRUNERS[p.pop("name")](**p)
    # workers starting together must not race to create the tables (SQLAlchemy: "alembic_version already exists")
    with file_lock(spec.trials_dir / ".create.lock"):
        storage = optuna.storages.RDBStorage(
            url, heartbeat_interval=spec.heartbeat_interval, grace_period=spec.grace_period,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3),
            engine_kwargs={"connect_args": {"timeout": 120}} if url.startswith("sqlite") else None)
        study = optuna.create_study(study_name=spec.study_name, storage=storage, direction=spec.direction,
                                    sampler=SAMPLERS[name](**s), pruner=pruner, load_if_exists=True)
        if s.get("seed") is not None:
            n_before = len(study.get_trials(deepcopy=False))
            study.sampler = SAMPLERS[name](**{**s, "seed": int(s["seed"]) + worker_index + 1_000 * n_before})
        return study


def _already_run(study: optuna.Study, trial, params: dict) -> bool:
    """True when a COMPLETE or PRUNED trial (not this one) ran exactly ``params``."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if t.number != trial.number and t.params == params:
            trial.set_user_attr("duplicate_of", t.number)
            return True
    return False


def _requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Put an interrupted trial back in the queue (same parameters and run folder)."""
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.WAITING, params=trial.params, distributions=trial.distributions,
        user_attrs=trial.user_attrs, system_attrs={"failed_trial": trial.number}))


class _Interrupted(Exception):
    pass


@_expected_optuna_notes
def run_worker(spec: StudySpec, extra: list[str] = (), n_trials: int | None = None, worker_index: int = 0) -> list[int]:
    """Run trials until the study holds ``n_trials`` finished or running ones; returns their numbers."""
    from ..config import ConfigError
    from ..engine.models import ModelPathError
    from ..engine.fit import RunInterrupted, train

    n_trials = n_trials or spec.n_trials
    failures, max_failures, duplicates = 0, 3, 0
    study = open_study(spec, worker_index)
    lock = spec.trials_dir / ".study.lock"
    done = []

    def on_term(signum, frame):
        # Inside a trial's training Lightning's SIGTERM handler is installed and calls this one: the run saves its
        # checkpoint and ends in RunInterrupted, handled below. Anywhere else (between trials, before the run's
        # training loop starts) the worker stops here; nothing of the trial is lost, as it is re-queued.
        if signal.getsignal(signal.SIGTERM) is on_term:
            raise _Interrupted(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_term)
    current: tuple[int | None, Path | None] = (None, None)  # the trial running now, and its run folder
    try:
        while True:
            with file_lock(lock):
                optuna.storages.fail_stale_trials(study)  # a killed worker's trial -> FAIL + re-queued
                counted = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                   TrialState.RUNNING))
                if len(counted) >= n_trials:
                    if not any(t.state == TrialState.RUNNING for t in counted):
                        break
                    trial = None  # others still run: wait, so a dead worker's trial is re-queued and run here
                else:
                    trial = study.ask()
            if trial is None:
                time.sleep(spec.heartbeat_interval)
                continue
            stop = _heartbeat(study._storage, trial._trial_id, spec.heartbeat_interval)
            params = suggest(trial, spec.params)
            if _already_run(study, trial, params):  # never run a finished point twice (FAIL is not counted)
                stop.set()
                study.tell(trial, state=TrialState.FAIL)
                duplicates += 1
                if duplicates >= 20:
                    raise RuntimeError("the sampler proposed 20 points that had already run: the search space is "
                                       "exhausted; lower n_trials or widen the space")
                continue
            done.append(trial.number)
            current = (trial.number, None)
            try:
                run_dir = Path(trial.user_attrs.get("run_dir") or spec.trials_dir / f"trial_{trial.number:04d}")
                current = (trial.number, run_dir)
                trial.set_user_attr("run_dir", str(run_dir))
                trial.set_user_attr("worker", f"{os.uname().nodename}:{os.getpid()}")
                cfg = compose_trial_cfg(spec, params, run_dir, extra)
                link_trial(cfg, spec, trial)
                pruning = optuna_pruning(trial)
                try:
                    metrics, _ = train(cfg, callbacks=[pruning])
                finally:  # the trial names its tracker runs, whatever ended it (they name the trial back)
                    if trackers := tracker_runs(run_dir):
                        trial.set_user_attr("trackers", trackers)
                if pruning.pruned:
                    study.tell(trial, state=TrialState.PRUNED)
                    continue
                key = next(k for k in metrics if k.startswith("eval/avg/"))
                study.tell(trial, float(metrics[key]))
                log.info("trial %d: %s = %.4f %s", trial.number, key, metrics[key], params)
            except (KeyboardInterrupt, _Interrupted, RunInterrupted) as e:
                frozen = study._storage.get_trial(trial._trial_id)
                study.tell(trial, state=TrialState.FAIL)
                _requeue(study, frozen)
                saved = f" ({e})" if isinstance(e, RunInterrupted) else ""
                log.warning("trial %d interrupted%s: re-queued; run the same command to resume it", trial.number, saved)
                raise
            except (StudyFileError, ConfigError, ModelPathError):  # every trial would fail the same way
                study.tell(trial, state=TrialState.FAIL)
                raise
            except Exception as e:
                if storage_failure(e) is not None:  # not the trial's fault: nothing can be told; said below, once
                    raise
                log.exception("trial %d failed", trial.number)
                study.tell(trial, state=TrialState.FAIL)
                failures += 1
                if failures >= max_failures:
                    raise RuntimeError(f"{failures} trials failed in this worker; see the log above") from None
            finally:
                stop.set()
            current = (None, None)
    except Exception as e:
        if (root := storage_failure(e)) is None:
            raise
        raise StorageLost(storage_lost_line(spec, root, *current)) from None
    finally:
        signal.signal(signal.SIGTERM, old)
    return done


def summary(spec: StudySpec) -> str:
    study = open_study(spec)
    states = {}
    for t in study.get_trials(deepcopy=False):
        states[t.state.name] = states.get(t.state.name, 0) + 1
    lines = [f"study {spec.study_name} ({masked(spec.storage)}): " + ", ".join(f"{k.lower()} {v}" for k, v in sorted(states.items()))]
    if states.get("COMPLETE"):
        b = study.best_trial
        lines.append(f"best: trial {b.number}, value {b.value:.4f}, params {b.params}, run {b.user_attrs.get('run_dir')}")
    lines.append(f"dashboard: optuna-dashboard {masked(spec.storage)}" + (" (with the storage's password)"
                                                                        if masked(spec.storage) != spec.storage else ""))
    return "\n".join(lines)


def final_summary(spec: StudySpec) -> str:
    """The summary the command ends with; where the storage fails now, one line that says so (the workers' own
    lines said what happened to their trials)."""
    try:
        return summary(spec)
    except Exception as e:  # noqa: BLE001 - only the storage's errors are turned into a line
        if (root := storage_failure(e)) is None:
            raise
        return storage_lost_line(spec, root, None, None)


def worker_command(study: str, n: int, storage: str, threads: int, extra: list[str]) -> list[str]:
    """The command of one worker of this study. A storage URL with a password travels in :data:`STORAGE_ENV`,
    set here in this process's environment, which the workers inherit (a Ray task is handed it: launchers)."""
    cmd = [sys.executable, "-m", "ema_pg.hpo", study, "--n-trials", str(n)]
    if masked(storage) != storage:
        os.environ[STORAGE_ENV] = storage
    else:
        cmd += ["--storage", storage]
    return [*cmd, f"trainer.num_threads={threads}", *extra]


def launched_workers(a, spec: StudySpec, n: int, extra: list[str]) -> int:
    """``--launcher submitit|ray``: the ``--workers`` workers as jobs (each ``--cell-cpus`` threads), their output in
    ``<trials folder>/workers/``; this process waits for them, passes a SIGTERM on, then prints the summary. The
    study's storage must be one every node reaches: PostgreSQL, or SQLite on a file system they share (Optuna warns
    against SQLite on NFS with many workers)."""
    from .launchers import launcher_spec, make_launcher

    folder = spec.trials_dir / "workers"
    launcher = make_launcher(launcher_spec(a), folder, a.workers)
    cmd = worker_command(str(Path(a.study).resolve()), n, spec.storage, a.cell_cpus, extra)
    jobs = [launcher.start(f"worker{i}", cmd + ["--worker-index", str(i)], Path.cwd(), folder / f"worker{i}.log")
            for i in range(a.workers)]
    print(f"{a.workers} workers started through {a.launcher} ({', '.join(j.job for j in jobs)}); their output: {folder}",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: [j.stop() for j in jobs])
    try:
        while (rcs := [j.poll() for j in jobs]) and None in rcs:
            time.sleep(2)
    finally:
        launcher.close()
    print(final_summary(spec))
    return EXIT_INTERRUPTED if EXIT_INTERRUPTED in rcs else max(rcs)


def main(argv=None) -> int:
    from ..engine.console import quiet_third_party

    quiet_third_party()  # no third-party warnings, bars or log lines on a command's console
    from .launchers import add_launcher_args, launcher_spec

    ap = command_parser(__doc__)
    ap.add_argument("study", help="a study file, e.g. conf/hparams_search/ema_topk.yaml")
    ap.add_argument("--n-trials", type=int, help="total trials of the study (over all workers); default: the file's")
    ap.add_argument("--workers", type=int, default=1, help="worker processes to start on this machine")
    ap.add_argument("--storage", help=f"override the file's storage URL (or set {STORAGE_ENV}, which keeps a "
                                      "password off the command line)")
    ap.add_argument("--worker-index", type=int, default=0,
                    help="this worker's index when workers are started separately (SLURM array: $SLURM_ARRAY_TASK_ID); "
                         "offsets the sampler seed")
    add_launcher_args(ap, what="workers")
    a, extra = ap.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    try:
        spec = load_study_spec(a.study)
    except StudyFileError as e:
        raise SystemExit(f"study file error: {e}") from None
    if a.storage or os.environ.get(STORAGE_ENV):
        spec.storage = a.storage or os.environ[STORAGE_ENV]
    if a.n_trials is not None and a.n_trials < 1:
        raise SystemExit(f"--n-trials {a.n_trials}: give the study's total number of trials, >= 1 (or leave it out "
                         f"for the file's {spec.n_trials})")
    if a.workers < 1:
        raise SystemExit(f"--workers {a.workers}: give at least 1")
    launcher_spec(a).check()
    n = spec.n_trials if a.n_trials is None else a.n_trials
    try:
        open_study(spec, a.worker_index)  # a storage that cannot be opened is one line, before any trial
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's and Optuna's storage errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"study storage {masked(spec.storage)} cannot be opened ({masked(first)}); give another --storage, or move "
                         "the damaged file away") from None
    if a.launcher != "local":
        return launched_workers(a, spec, n, extra)
    if a.workers > 1:
        threads = max(1, (os.cpu_count() or 2) // a.workers)
        cmd = worker_command(a.study, n, spec.storage, threads, extra)
        procs = [subprocess.Popen(cmd + ["--worker-index", str(i)], cwd=os.getcwd()) for i in range(a.workers)]

        def forward(signum, frame):  # a scheduler's SIGTERM reaches every worker: each saves its trial and exits 75
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        rcs = [p.wait() for p in procs]
        print(final_summary(spec))
        return EXIT_INTERRUPTED if EXIT_INTERRUPTED in rcs else max(rcs)
    from ..engine.fit import RunInterrupted  # this process trains: Lightning is its import from here

    try:
        run_worker(spec, extra, n, a.worker_index)
    except StorageLost as e:
        raise SystemExit(str(e)) from None
    except StudyFileError as e:
        raise SystemExit(f"study file error: {e}") from None
    except ValueError as e:  # ConfigError / ModelPathError: the overrides or the model path
        raise SystemExit(f"config error: {e}") from None
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume the study", file=sys.stderr)
        return 130
    except (_Interrupted, RunInterrupted) as e:  # SIGTERM: the trial's checkpoint is saved where it had one
        what = e if isinstance(e, RunInterrupted) else "stopped by SIGTERM before a trial's training started"
        print(f"{what}; run the same command again to resume the study", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(final_summary(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
