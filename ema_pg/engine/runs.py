"""The run folder's lifecycle: what a run writes, how it is resumed or continued as a stage, and when it is
refused. :func:`open_run` is the one place a run decides where it writes and from which checkpoint it starts.

A run folder holds ``config.yaml`` (resolved, every default filled in), ``model/`` (tokenizer,
model config, initial weights: see :mod:`ema_pg.engine.policy`), ``checkpoints/``, ``metrics.csv``,
``eval.json`` (written only when the run finished its iterations), ``curves.png`` and
``git.txt`` (the commit it ran from) and ``machine.txt`` (the machine it ran on, :func:`machine`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..cli import PACKAGE_ROOT
from ..config import ARCH_KEYS, TRACKERS, Binding, ConfigError, flatten, with_defaults
from .files import atomic_write
from .install import check_config
from .owner import CLAIM, claim_run_dir, own_run_dir
from .sweeps import FAILED, failed_record

log = logging.getLogger("ema_pg")
#: the exit code of a run stopped by SIGTERM with its checkpoint saved (resumable: the same command, or resume=RUN,
#: continues it). The others: 0 finished (eval.json written), 1 failed or refused (one line says why).
EXIT_INTERRUPTED = 75
RUN_DIR_ENV = "EMA_PG_RUN_DIR"  #: the run folder rank 0 claimed, for the processes it launches

#: settings a user may change when continuing a run (more iterations, another machine, quieter output, the
#: retrieval server restarted elsewhere or given more patience: where the service lives, not what it serves; the
#: rollout workers' count, of whole rollouts: a pool samples the batches one worker does, and its checkpoint holds
#: whole batches; partial rollouts' streams are the workers' own: see :func:`check_workers`)
RESUMABLE_SETTINGS = ("algo.iterations", "trainer.progress_bar", "trainer.num_threads", "task.retriever_url",
                      "task.retriever_timeout", "task.retriever_retries", "rollout.workers")
#: keys that differ between a run and its continuation by construction, or by the user's leave
RESUMABLE_CHANGES = ("run_dir", "resume", "if_exists", "logger", *RESUMABLE_SETTINGS)  # logger: the trackers it
# reports to, which a continuation may add (it sends them the record so far: ema_pg.engine.tracking)


@functools.lru_cache(maxsize=1)
def machine() -> str:
    """The kind of machine a run ran on, in one line: CPU model and its widest vector extension, torch build, GPU.

    Runs repeat bit for bit on one machine; on another kind of CPU (say AMX against AVX2) the matrix kernels
    can round differently, a 500-step cold start then ends elsewhere, and two runs of one seed no longer start from one
    base policy. Reports print the machines their runs ran on (``ema_pg.workbench.results.provenance_lines``)."""
    import platform

    import torch

    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name":
                cpu = val.strip()
            elif key.strip() == "flags":
                flags = set(val.split())
                break
    except OSError:  # not Linux: the platform's name is what there is
        pass
    isa = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags),
               None)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return "; ".join(x for x in (cpu + (f" ({isa})" if isa else ""), f"torch {torch.__version__}", gpu) if x)


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """The commit of the code this process runs: read once, at the first call (a run's start, right after the
    modules are loaded), so every run of a multirun records the code it ran even when the repository moves on
    during the sweep (its later runs once recorded the newer HEAD). ``-dirty`` marks uncommitted changes."""
    try:
        root = PACKAGE_ROOT
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "") if sha else "unknown"
    except Exception:  # noqa: BLE001 - no git is fine
        return "unknown"


def run_commit(run_dir: Path) -> str:
    """The commit a run folder's run ran from (its ``git.txt``), or ``unknown``."""
    f = Path(run_dir) / "git.txt"
    return f.read_text().strip() if f.is_file() else "unknown"


def run_machine(run_dir: Path) -> str:
    """The machine a run folder's run ran on (its ``machine.txt``, :func:`machine`), or ``unknown``."""
    f = Path(run_dir) / "machine.txt"
    return f.read_text().strip() if f.is_file() else "unknown"


def run_base(run_dir: Path) -> str:
    """The identity of the policy a run started from, in 16 hex digits: a digest of the initial weights in
    ``<run>/model/`` (every tensor's name, dtype, shape and bytes, in name order, so the file's layout and metadata
    do not count), or ``path:DIR`` for a run that started from ``model.path`` (its ``initial.json``); ``unknown``
    when the folder has neither. Two runs of a sweep that share one base policy (``sft.seed``) have one value here
    when, and only when, their cold starts came out the same: on another kind of CPU they may not (:func:`machine`)."""
    model = Path(run_dir) / "model"
    if (model / "initial.json").is_file():
        return "path:" + json.loads((model / "initial.json").read_text())["path"]
    from .models import weights_digest

    return weights_digest(model) or "unknown"


def metrics_rows(metrics_file: Path, upto: int) -> list[dict]:
    """The intact rows of a run's ``metrics.csv`` up to step ``upto`` (a checkpoint's iteration), for a resumed run.

    A file cut mid-line by a kill (its last line has no newline, or fewer fields than the header) loses that line,
    never reads it as a number; an empty file, or one with a header only, has no rows. A value written as an integer
    is read back as one, so that the rows are written again as they were (``0``, not ``0.0``)."""
    import csv

    try:
        text = metrics_file.read_text()
    except FileNotFoundError:
        return []
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        log.warning("resume: %s ends in a partial line (a kill while it was written); that line is dropped",
                    metrics_file)
        lines = lines[:-1]
    reader = csv.reader(lines)
    header = next(reader, None)
    rows, dropped = [], 0
    for values in reader:
        if header is None or len(values) != len(header):
            dropped += 1
            continue
        try:
            r = {k: x for k, v in zip(header, values) if v != "" and (x := _number(v)) == x}  # no NaN, as logged
        except ValueError:
            dropped += 1
            continue
        if "step" in r and int(r["step"]) <= upto:
            rows.append(r | {"step": int(r["step"])})
    if dropped:
        log.warning("resume: %d damaged line(s) of %s dropped", dropped, metrics_file)
    return rows


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def resolve_resume(cfg, composed: bool = False) -> DictConfig:
    """The config of a resumed run.

    From the command line: the run's saved ``config.yaml`` with this command's explicit
    overrides on top (``resume=RUN algo.iterations=400``). From Python, or with ``composed``
    (``if_exists=resume``: the command composed the whole config, group overlays such as a
    sweep's ``+scale=...`` included): ``cfg`` as given.
    """
    run_dir = Path(cfg.resume)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"resume={cfg.resume!r} is not a run folder (no config.yaml there)")
    from hydra.core.hydra_config import HydraConfig

    saved = OmegaConf.load(run_dir / "config.yaml")
    if HydraConfig.initialized() and not composed:
        overrides = [o.lstrip("+") for o in HydraConfig.get().overrides.task if not o.startswith("resume=")]
        trackers = [o for o in overrides if o.split("=", 1)[0].split(".")[0] == "logger"]
        overrides = [o for o in overrides if o not in trackers]  # the trackers: this command's, composed whole
        groups = set(HydraConfig.get().runtime.choices)
        for o in overrides:
            key = o.split("=", 1)[0]
            if key in groups or isinstance(OmegaConf.select(saved, key), DictConfig):
                raise ConfigError(f"resume: '{o}' changes the config group {key}; a resumed run keeps the settings it "
                                  f"started with (only {', '.join(RESUMABLE_SETTINGS)} may change)")
        merged = OmegaConf.merge(saved, OmegaConf.from_dotlist([o for o in overrides if "=" in o]))
        if trackers:  # a continuation may report to other trackers: they are sent the record so far
            merged.logger = cfg.logger
        cfg = merged
    cfg = upgraded(cfg)  # knobs added after the run was saved take their defaults
    cfg.run_dir, cfg.resume = str(run_dir), str(run_dir)
    diff = config_differences(saved, with_defaults(cfg))
    if diff:
        raise ConfigError(f"resume: the settings differ from the run's ({', '.join(diff[:6])}); a resumed run keeps the "
                          f"settings it started with (only {', '.join(RESUMABLE_SETTINGS)} may change); start a new "
                          "run for other settings")
    check_workers(upgraded(saved), cfg)
    return cfg


def check_workers(saved: DictConfig, cfg: DictConfig) -> None:
    """A run of partial rollouts continues on as many rollout workers as it ran on: each worker's stream (its
    groups in flight) is saved with the batches in flight, and only that many workers can take them back."""
    was, now = saved.rollout.workers, cfg.rollout.workers
    if cfg.rollout.partial and was != now:
        raise ConfigError(f"resume: rollout.workers={now}, but this run of partial rollouts ran on {was} workers, each "
                          f"continuing its own stream of groups in flight: resume with rollout.workers={was} (a run of "
                          "whole rollouts may change it)")
    if was != now:
        log.info("resume: rollout.workers %s -> %s (a pool samples the batches one worker does: the same prompts, "
                 "tokens and rewards; each block's pi_old is its own forward pass, the same within rounding)", was, now)


def outcome(metric: str, avg: float, iteration: int | None, base: float = float("nan"), **extra) -> dict:
    """A run's outcome record, as ``train`` returns it and a sweep or a search reads it: the final average of the
    task's metric (``eval/avg/<metric>``), the iteration it reached, and the base policy's average (``base/avg``)."""
    return {f"eval/avg/{metric}": avg, "iteration": iteration, "base/avg": base, **extra}


def finished_metrics(run_dir: Path, iterations: int) -> dict | None:
    """The final metrics of a run folder that already finished ``iterations`` iterations (else None)."""
    f = Path(run_dir) / "eval.json"
    if not f.is_file():
        return None
    final = json.loads(f.read_text())
    if final.get("iteration", -1) < iterations:
        return None
    from .evaluation import result_metric

    return outcome(result_metric(final), final.get("avg", float("nan")), final["iteration"],
                   final.get("base_avg", float("nan")))


def upgraded(saved: DictConfig) -> DictConfig:
    """A saved config as the current code reads it: knobs added to the schema after the run was saved take
    their defaults (which keep the old behaviour), as do the estimator's parameters (its registry)."""
    from ..anchors import scheme_of
    from ..config import Config, with_defaults

    from ..tasks import task_defaults

    try:
        if "logger" in saved and "name" in saved.logger:  # saved when logger.name chose the one tracker
            saved = OmegaConf.create(OmegaConf.to_container(saved))
            name = saved.logger.pop("name")
            if name in TRACKERS:
                saved.logger[name] = True
        merged = OmegaConf.merge(OmegaConf.structured(Config), saved)
        if "anchor" in saved:  # saved before the scheme registry: fixed and reset were the EMA at eta 1 and 0
            merged.anchor.name = scheme_of(OmegaConf.to_container(saved.anchor))
        if "task" in saved and saved.task.get("name"):  # task knobs added later, at their defaults
            merged.task = OmegaConf.merge(task_defaults(saved.task.name, saved.task.get("target")), saved.task)
        return with_defaults(merged)
    except Exception:  # noqa: BLE001 - a config the schema cannot read is compared as it was saved
        return saved


def settings(c: DictConfig) -> dict:
    """A config as flat ``{key: value}``, resolved, without the keys a continuation may change (RESUMABLE_CHANGES)."""
    c = OmegaConf.create(OmegaConf.to_container(c, resolve=False))
    for key in RESUMABLE_CHANGES:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(c, parent) if parent else c
        if node is not None and leaf in node:
            node.pop(leaf)
    return flatten(OmegaConf.to_container(c, resolve=True))


def config_differences(saved: DictConfig, cfg: DictConfig) -> list[str]:
    """Keys whose values differ between a run folder's saved config and ``cfg`` (ignoring RESUMABLE_CHANGES).
    A knob the saved config lacks because it was added later is compared at its default."""
    a, b = settings(upgraded(saved)), settings(cfg)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


# ---------------------------------------------------------------------- opening a run
def is_rank_zero() -> bool:
    """True in the first process of a run (the only one, unless Lightning launched several)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def adopt_hydra_output(run_dir: Path) -> None:
    """A resume writes its log into the run folder it resumes: Hydra opened a fresh output folder for this
    invocation (``runs/<name>/<time>``); its log handler is moved to ``run_dir`` and the folder, which
    then holds nothing of the run, removed."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    out = Path(HydraConfig.get().runtime.output_dir).resolve()
    if out == run_dir.resolve() or run_dir.resolve() in out.parents:
        return
    for h in _release_log_files(out):
        new = logging.FileHandler(run_dir / Path(h.baseFilename).name, mode="a")
        new.setFormatter(h.formatter)
        new.setLevel(h.level)
        logging.getLogger().addHandler(new)
    if {p.name for p in out.iterdir()} <= {".hydra", f"{HydraConfig.get().job.name}.log"}:
        shutil.rmtree(out, ignore_errors=True)


def _release_log_files(folder: Path) -> list[logging.FileHandler]:
    """Detach and close the root logger's file handlers that write into ``folder``; returns them."""
    root, folder = logging.getLogger(), Path(folder).resolve()
    found = [h for h in root.handlers
             if isinstance(h, logging.FileHandler) and Path(h.baseFilename).resolve().parent == folder]
    for h in found:
        root.removeHandler(h)
        h.close()
    return found


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def job_folder() -> Path | None:
    """The folder Hydra opened for this job (a sweep job's own), or None outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def discard_hydra_output(run_dir: str | None = None) -> None:
    """A run refused at start leaves no folder: Hydra's output folder and the run folder are removed when they hold
    only Hydra's own files (``.hydra/``, the log) or the run's claim, and no run (no ``config.yaml``); a sweep's
    folders are kept."""
    from hydra.core.hydra_config import HydraConfig

    if in_multirun():
        return
    folders = [Path(run_dir)] if run_dir else []
    if HydraConfig.initialized():
        folders.append(Path(HydraConfig.get().runtime.output_dir))
    spare = {".hydra", CLAIM} | ({f"{HydraConfig.get().job.name}.log"} if HydraConfig.initialized() else set())
    for out in folders:
        if not out.is_dir() or not {p.name for p in out.iterdir()} <= spare:
            continue
        _release_log_files(out)  # the log handler holds its file open
        shutil.rmtree(out, ignore_errors=True)
        for parent in out.parents:  # runs/<name>/ when this was its only run (rmdir removes empty folders only)
            if parent.resolve() == Path.cwd().resolve() or parent.name == "runs":
                break
            try:
                parent.rmdir()
            except OSError:
                break


def record_failure(run_dir: str | os.PathLike, e: BaseException) -> None:
    """Write ``failed.json`` in the run folder: what stopped it (``kind``: diverged, service, disk, config) and
    where."""
    from ..update import NonFiniteUpdates
    from .policy import checkpoint_iteration

    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not is_rank_zero():
        return
    kind = ("diverged" if isinstance(e, NonFiniteUpdates) else "disk" if isinstance(e, OSError) else
            "config" if isinstance(e, ValueError) else "service")  # ConfigError and ModelPathError are ValueErrors
    try:
        it = checkpoint_iteration(run_dir)
    except Exception:  # noqa: BLE001 - an unreadable checkpoint: the record is still worth writing
        it = None
    try:
        atomic_write(run_dir / FAILED, json.dumps({"kind": kind, "error": str(e), "checkpoint_iteration": it}) + "\n")
    except OSError:  # a full disk may refuse even this: the console line is the record then
        pass


def readable_checkpoint(run_dir: Path) -> tuple[Path, dict]:
    """The newest checkpoint of ``run_dir`` that can be read, and its state (:func:`~.policy.newest_readable`); says
    so when a newer one could not be read."""
    from .policy import newest_readable

    try:
        found = newest_readable(run_dir)
    except ValueError as e:
        raise ConfigError(f"resume: {e}; start the run again") from None
    if found is None:
        raise ConfigError(f"resume: no readable checkpoint in {run_dir / 'checkpoints'} (none there); start the run "
                          "again")
    ckpt, state, errors = found
    if errors:
        log.warning("resume: %s is unreadable (%s); resuming from %s (iteration %d) instead", *errors[0],
                    ckpt.name, state["ema_pg"]["iteration"])
    return ckpt, state


#: what a stage (init_from) must share with the run it continues: the same network, tokenizer and task
STAGE_FIXED = ("model.name", "model.path", *(f"model.{k}" for k in ARCH_KEYS), "model.lora_rank", "task.name",
               "anchor.name", "algo.advantage", "seed")


def stage_start(cfg: DictConfig, run_dir: Path) -> tuple[Path, int]:
    """The checkpoint a stage (``init_from=RUN``) starts from, and its iteration, after checking that the
    stage can continue that run: same network and task, more iterations, another folder."""
    from .policy import checkpoint_file

    src = Path(cfg.init_from)
    if not (src / "config.yaml").is_file():
        raise ConfigError(f"init_from={cfg.init_from!r} is not a run folder (no config.yaml there)")
    if src.resolve() == run_dir.resolve():
        raise ConfigError(f"init_from={src} is this run's own folder; a stage writes a new run folder (or use resume=)")
    prev = upgraded(OmegaConf.load(src / "config.yaml"))  # a run saved before a knob existed: at its default
    differ = [k for k in STAGE_FIXED if OmegaConf.select(prev, k) != OmegaConf.select(cfg, k)]
    if differ:
        raise ConfigError(f"init_from={src}: a stage continues the same network and task, but {', '.join(differ)} "
                          "differ from that run's; set them as that run had them")
    if checkpoint_file(src) is None:
        raise ConfigError(f"init_from={src} holds no checkpoint yet; let that stage write one first")
    ckpt, state = readable_checkpoint(src)
    it = int(state["ema_pg"]["iteration"])
    if cfg.algo.iterations <= it:
        raise ConfigError(f"init_from={src} ends at iteration {it}; this stage's algo.iterations={cfg.algo.iterations} "
                          f"must be larger (it counts from the first stage's start)")
    return ckpt, it


@dataclass
class OpenedRun:
    """Where a run writes and where it starts: ``ckpt_path`` None = from scratch; ``skipped`` holds the final
    metrics of a finished run that ``if_exists=resume`` leaves as it is."""

    cfg: DictConfig
    run_dir: Path
    ckpt_path: str | None = None
    resume_step: int | None = None
    skipped: dict | None = None
    bound: Binding | None = None  #: what the run runs, bound once from its config (estimator, anchor scheme)


def open_run(cfg: DictConfig) -> OpenedRun:
    """Decide, before any model is built, where the run writes and which checkpoint it starts from.

    ``if_exists=resume``: a folder with a finished run is skipped, one with a checkpoint resumed (a killed
    sweep continues by running the same command); ``resume=RUN`` continues RUN with its saved config;
    ``init_from=RUN`` starts a new run (a stage) where RUN's last checkpoint ends. The config is validated
    and its defaults filled in here; rank 0 claims the folder (another process that started into the
    same folder at the same moment gets a fresh one) and tells the processes it launches.
    """
    from .policy import checkpoint_file

    git_commit()  # read now, before a cold start of minutes: git.txt names the code this process loaded, not
    # the commit the repository had moved on to by the time the run wrote its folder
    composed = False  # True: this command composed the run's own config (a sweep continuing a killed run)
    if not cfg.get("resume") and cfg.get("if_exists", "error") == "resume":
        run_dir = Path(cfg.run_dir)
        if (run_dir / "config.yaml").is_file():
            diff = config_differences(OmegaConf.load(run_dir / "config.yaml"), with_defaults(cfg))
            if diff:
                raise ConfigError(f"{run_dir} holds a run with another config (differs in: {', '.join(diff[:6])}); "
                                  "give this run another run_dir (or sweep dir), or delete that folder")
        done = finished_metrics(run_dir, cfg.algo.iterations)
        if done is not None:
            log.info("%s already finished %d iterations: skipped", run_dir, done["iteration"])
            return OpenedRun(cfg, run_dir, skipped=done)
        failed = failed_record(run_dir)
        if failed is not None and failed.get("kind") == "diverged":  # deterministic: it would diverge again
            from ..tasks import task_metric  # (math's is acc: a skipped math run once reported eval/avg/em)

            return OpenedRun(cfg, run_dir, skipped=outcome(task_metric(cfg.task.name, cfg.task.get("target")),
                                                           float("nan"), failed.get("checkpoint_iteration"),
                                                           failed=failed["error"]))
        if checkpoint_file(run_dir) is not None:
            cfg.resume, composed = str(run_dir), True
    if cfg.get("resume"):
        cfg = resolve_resume(cfg, composed=composed)
    bound = check_config(cfg)  # once per run: the consumers take the estimator and the anchor scheme from ``bound``
    cfg = with_defaults(cfg, bound)  # the run's config states every value in force; the caller's is left as is
    run_dir = Path(cfg.run_dir)
    if cfg.get("resume"):
        if checkpoint_file(run_dir) is None:
            raise ConfigError(f"resume: {run_dir / 'checkpoints'} holds no checkpoint; the run wrote none yet (start "
                              "it again instead)")
        ckpt, state = readable_checkpoint(run_dir)
        it = int(state["ema_pg"]["iteration"])
        check_trained_with(state, cfg, ckpt)
        if cfg.algo.iterations < it:
            raise ConfigError(f"resume: {run_dir} is at iteration {it}; algo.iterations={cfg.algo.iterations} would "
                              f"undo iterations it already ran: pass algo.iterations={it} or more")
        if is_rank_zero():
            own_run_dir(run_dir)  # one writer per run folder: a live run there refuses this one
            os.environ[RUN_DIR_ENV] = str(run_dir)  # where a failure is recorded (and the resume line points)
            adopt_hydra_output(run_dir)
        log.info("resuming %s from iteration %d", run_dir, it)
        return OpenedRun(cfg, run_dir, str(ckpt), it, bound=bound)
    if is_rank_zero() and cfg.get("if_exists", "error") == "resume":
        own_run_dir(run_dir)  # a sweep's fixed folder: the same command running twice must not share it
        os.environ[RUN_DIR_ENV] = str(run_dir)
    elif is_rank_zero():
        claimed = claim_run_dir(run_dir)
        if claimed != run_dir:
            log.warning("%s is taken by another run started at the same time: this run writes to %s", run_dir, claimed)
            cfg.run_dir = run_dir = claimed
        os.environ[RUN_DIR_ENV] = str(run_dir)  # the processes Lightning launches next write here too
    elif os.environ.get(RUN_DIR_ENV):
        cfg.run_dir = run_dir = Path(os.environ[RUN_DIR_ENV])
    if checkpoint_file(run_dir) is not None:
        raise ConfigError(f"{run_dir} already holds a run; pass resume={run_dir} to continue it, or another run_dir")
    if cfg.get("init_from"):
        ckpt, it = stage_start(cfg, run_dir)
        log.info("stage: starting from %s at iteration %d", ckpt, it)
        return OpenedRun(cfg, run_dir, str(ckpt), bound=bound)
    return OpenedRun(cfg, run_dir, bound=bound)


def check_trained_with(state: dict, cfg: DictConfig, ckpt: Path) -> None:
    """A resumed run continues the settings its checkpoint was trained with: the config in force (the run's
    ``config.yaml`` and this command's overrides) is compared with the copy the checkpoint carries, so a hand-edited
    ``config.yaml`` is refused like a changed command line. Checkpoints written before they carried it pass."""
    trained = state.get("ema_pg", {}).get("settings")
    if trained is None:
        return
    now = settings(cfg)  # a knob added after the checkpoint was written is not in it: only shared keys compare
    diff = sorted(k for k in set(trained) & set(now) if trained[k] != now[k])
    if diff:
        raise ConfigError(f"resume: the settings in force differ from those {ckpt.name} was trained with "
                          f"({', '.join(diff[:6])}); was {Path(cfg.run_dir) / 'config.yaml'} edited? A resumed run keeps "
                          f"its settings (only {', '.join(RESUMABLE_SETTINGS)} may change): restore them, or start a new run")


def record_run(opened: OpenedRun, policy, tokenizer) -> None:
    """Rank 0 writes what the run is: its config and initial model (a new run only), the commit and the machine."""
    from .policy import save_run_model

    if not is_rank_zero():
        return
    cfg, run_dir = opened.cfg, opened.run_dir
    (run_dir / FAILED).unlink(missing_ok=True)  # a failure recorded before is the past once the run goes again
    if not cfg.get("resume"):
        save_run_model(run_dir, policy, tokenizer, cfg.model.path)
        atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))  # last: a run folder with a
        # config.yaml is one whose model is whole
    atomic_write(run_dir / "git.txt", git_commit() + "\n")
    atomic_write(run_dir / "machine.txt", machine() + "\n")
