"""Sweeps that survive their jobs (a Hydra callback, set in ``conf/config.yaml``'s ``hydra.callbacks``).

Before the first job of a multirun starts, every job's config is composed and validated, so a bad value
queued behind hours of runs stops the sweep now, with one line naming the job, and not when its turn comes.
A job that fails while it runs (its updates diverged, its retrieval server went away, its disk filled) is
recorded in its folder (``failed.json``, written by ``ema_pg.train``) and the sweep goes on; when the sweep
ends it names the jobs that did not finish and exits 1. A job stopped by SIGTERM stops the sweep (exit 75):
run the same command again to continue it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger("ema_pg")
FAILED = "failed.json"  #: the record of a run that stopped on an error: {"kind", "error", "iteration"}
SWEEP = "sweep.json"  #: what a multirun's folder holds beside its jobs: {"jobs": [their overrides]}


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """Each job's overrides, in the order Hydra's basic sweeper launches them (its params first, then the
    command line's; a comma list is a sweep dimension)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_jobs(config: DictConfig, jobs: list[list[str]]) -> None:
    """Compose and validate every job's config; the first invalid one ends the sweep before anything runs."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ..config import ConfigError
    from .install import check_config

    loader = GlobalHydra.instance().config_loader()
    common = set.intersection(*(set(j) for j in jobs)) if len(jobs) > 1 else set()
    for i, job in enumerate(jobs):
        try:
            cfg = loader.load_sweep_config(config, list(job))
            with open_dict(cfg):
                del cfg["hydra"]
            check_config(cfg)
            with open_dict(cfg):
                del cfg["run_dir"]  # Hydra's job folder, known only when the job runs
            OmegaConf.to_container(cfg, resolve=True)  # an environment variable the job needs, say
        except (ConfigError, OmegaConfBaseException, HydraException) as e:  # a bad value, a missing env variable
            named = " ".join(o for o in job if o not in common)
            first = str(e).strip().splitlines()[0]
            raise SystemExit(f"config error in job {i} of {len(jobs)} ({named}): {first}; no job has run") from None


def failed_record(run_dir: Path) -> dict | None:
    f = Path(run_dir) / FAILED
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def sweep_state(sweep_dir: Path, runs: list[Path] | None = None, n_jobs: int | None = None
                ) -> tuple[list[Path], list[Path], list[Path]]:
    """(finished, failed, unfinished) run folders of a sweep folder written by this callback; unfinished also
    counts the jobs that never made a folder (as ``<sweep>/<job #>?``). ``runs`` and ``n_jobs`` restrict it to
    one multirun's own jobs (several multiruns may write into one sweep folder, one cell each)."""
    sweep_dir = Path(sweep_dir)
    if runs is None:
        runs = sorted({p.parent for pattern in ("*/config.yaml", f"*/{FAILED}") for p in sweep_dir.glob(pattern)})
    finished = [r for r in runs if (r / "eval.json").is_file()]
    failed = [r for r in runs if r not in finished and (r / FAILED).is_file()]
    unfinished = [r for r in runs if r not in finished and r not in failed]
    try:
        n = n_jobs if n_jobs is not None else len(json.loads((sweep_dir / SWEEP).read_text())["jobs"])
    except (OSError, ValueError, KeyError):
        n = len(runs)
    unfinished += [sweep_dir / f"<job {i}?>" for i in range(len(runs), n)]
    return finished, failed, unfinished


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - Hydra < 1.1
    Callback = object


class SweepGuard(Callback):
    """Checks every job first; at the end judges this multirun's own jobs (not other multiruns' in the folder)."""

    def __init__(self) -> None:
        self.n_jobs: int | None = None
        self.mine: list[Path] = []  # the job folders this process launched (in-process launchers)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        jobs = sweep_jobs(config)
        self.n_jobs, self.mine = len(jobs), []
        check_jobs(config, jobs)
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        from .files import atomic_write

        atomic_write(sweep_dir / SWEEP, json.dumps({"jobs": jobs}, indent=1))
        log.info("sweep: %d jobs checked, writing to %s", len(jobs), sweep_dir)

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        out = OmegaConf.select(config, "hydra.runtime.output_dir")
        if out:
            self.mine.append(Path(out))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        # a launcher that runs jobs elsewhere (submitit) calls on_job_start there: then the folder is judged whole
        own = (sorted(set(self.mine)), self.n_jobs) if self.mine else (None, None)
        finished, failed, unfinished = sweep_state(Path(config.hydra.sweep.dir), *own)
        if not failed and not unfinished:
            return
        lines = [f"  {r}: {(failed_record(r) or {}).get('error', '?')}" for r in failed]
        lines += [f"  {r}: did not finish" for r in unfinished]
        raise SystemExit(f"sweep: {len(finished)} of {len(finished) + len(failed) + len(unfinished)} jobs finished; "
                         "the others:\n" + "\n".join(lines))
