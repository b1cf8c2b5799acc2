"""One command per reproduction: run a sweep at a scale, then its report (``ema_pg.workbench.reports``).

    python -m ema_pg.reproduce table2 --scale smoke          # = make reproduce-table2 SCALE=smoke
    python -m ema_pg.reproduce table3 --scale mini           # = make reproduce-table3 SCALE=mini
    python -m ema_pg.reproduce fig6_k --scale mini           # = make reproduce NAME=fig6_k SCALE=mini
    python -m ema_pg.reproduce table2 --scale mini --dry-run # print the commands only
    python -m ema_pg.reproduce fig5_methods --scale decide   # the demo task where the KL decides (5 paired seeds)
    python -m ema_pg.reproduce table2 --scale mini --launcher submitit --launcher-option slurm_partition=dev   # Slurm jobs
    python -m ema_pg.reproduce table2 --scale mini --launcher ray --address auto                      # Ray tasks

The sweep is ``sweeps/<name>.yaml`` with the scale overlay ``sweeps/scale/<name>_<scale>.yaml``
(or ``sweeps/scale/<scale>.yaml``); its runs go to ``runs/reproduce/<name>-<scale>/``, a fixed
folder, so running the same command again after an interruption resumes the killed run from its
last checkpoint and skips the finished ones. Results: ``reproductions/<name>/`` for ``mini``
(the committed CPU-scale reproduction), ``reproductions/<name>/<scale>/`` for ``decide`` (the demo
task at the collapse edge, ``sweeps/scale/decide.yaml``), ``decide_strong`` (the same from a stronger
cold start), ``decide_reading`` (Table 2 in the world where RL's gain is reading), ``decide_episode`` (Table 2 where
every question has a world of its own), ``vllm`` (a sweep's mini runs with a bfloat16 vLLM engine sampling:
``sweeps/scale/<name>_vllm.yaml``) and ``full``, and
``runs/reproduce/<name>-smoke/report/`` for ``smoke`` (a pipeline check, not a result).
Extra arguments are Hydra overrides passed to every run of the sweep.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..cli import PACKAGE_ROOT as ROOT
from ..cli import command_parser
from ..engine.runs import EXIT_INTERRUPTED
from ..engine.sweeps import failed_record, sweep_state
from .launchers import add_launcher_args, launcher_spec
from .reports import REPORTS
from .sweepfiles import SWEEPS, TABLES, overlay_choices, overlay_transfer, scale_file

SCALES = ("smoke", "mini", "decide", "decide_strong", "decide_reading", "decide_episode", "vllm", "full")
#: what a full-scale reproduction needs in the environment (beside a GPU)
FULL_SCALE_ENV = {"table2": ("EMA_PG_MODEL", "EMA_PG_SEARCH_DATA", "EMA_PG_RETRIEVER"),
                  "table3": ("EMA_PG_MODEL", "EMA_PG_MATH_DATA")}


def transfer_commands(runs: list[Path], n: int) -> list[list[str]]:
    """The transfer evaluations of the finished ``runs`` that do not have theirs yet (so a rerun skips them)."""
    from .evaluate import evaluation_file

    return [[sys.executable, "-m", "ema_pg.evaluate", str(r), "--transfer", str(n)]
            for r in sorted(runs) if n and not evaluation_file(r, transfer=n).is_file()]


def launcher_overrides(spec) -> list[str]:
    """The sweep's Hydra launcher for a :class:`~ema_pg.workbench.launchers.LauncherSpec`: ``submitit`` is Hydra's
    submitit launcher (``submitit_slurm``, or ``submitit_local`` with ``--cluster local``; each ``--launcher-option``
    a ``hydra.launcher`` key, named as submitit's executor names it for decide and hpo: ``slurm_partition=dev`` is
    the launcher's ``partition``), ``ray`` this project's Ray launcher (``hydra_plugins/ema_pg_launchers``)."""
    if spec.name == "local":
        return []
    if spec.name == "submitit":
        import shutil

        cluster = spec.cluster or ("slurm" if shutil.which("sbatch") else "local")
        return [f"hydra/launcher=submitit_{cluster}", f"hydra.launcher.cpus_per_task={spec.cell_cpus}",
                *(f"hydra.launcher.{o.removeprefix('slurm_')}" for o in spec.options)]
    return ["hydra/launcher=ema_pg_ray", f"hydra.launcher.cpus_per_job={spec.cell_cpus}",
            *([f"hydra.launcher.address={spec.address}"] if spec.address else [])]


def commands(name: str, scale: str, overrides: list[str], runs: Path | None = None, out: Path | None = None):
    if name not in REPORTS:
        raise SystemExit(f"unknown reproduction {name!r}; choose one of: {', '.join(REPORTS)}")
    if scale not in SCALES:
        raise SystemExit(f"--scale {scale!r}; choose one of: {', '.join(SCALES)}")
    runs = runs or ROOT / "runs" / "reproduce" / f"{name}-{scale}"
    out = out or (ROOT / "reproductions" / name if scale == "mini" else
                  runs / "report" if scale == "smoke" else ROOT / "reproductions" / name / scale)
    overlay = scale_file(name, scale)
    sweep = [sys.executable, "-m", "ema_pg.train", "-m", "--config-dir", str(SWEEPS), "--config-name", name,
             *overlay_choices(overlay), f"+scale={overlay}", f"hydra.sweep.dir={runs}", *overrides]
    analysis = [sys.executable, "-m", "ema_pg.reports", name, "--runs", str(runs), "--out", str(out)]
    return sweep, analysis, runs, out


def main(argv=None) -> int:
    from ..engine.console import quiet_third_party

    quiet_third_party()  # no third-party warnings, bars or log lines on a command's console
    ap = command_parser(__doc__)
    ap.add_argument("name", choices=sorted(REPORTS), help="the sweep (sweeps/<name>.yaml)")
    ap.add_argument("--scale", default="smoke", choices=SCALES)
    ap.add_argument("--runs", type=Path, help="where the runs go (default runs/reproduce/<name>-<scale>)")
    ap.add_argument("--out", type=Path, help="where the results go")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--analysis-only", action="store_true", help="skip the sweep; analyse the runs already there")
    add_launcher_args(ap, what="sweep's runs")
    a, overrides = ap.parse_known_args(argv)
    spec = launcher_spec(a)
    spec.check()
    sweep, analysis, runs, out = commands(a.name, a.scale, [*launcher_overrides(spec), *overrides], a.runs, a.out)
    print("sweep:    " + shlex.join(sweep), "analysis: " + shlex.join(analysis), sep="\n", flush=True)
    n_transfer = overlay_transfer(scale_file(a.name, a.scale))
    if n_transfer:
        print(f"transfer: {sys.executable} -m ema_pg.evaluate <each finished run> --transfer {n_transfer}  (before the analysis)",
              flush=True)
    if a.dry_run:
        return 0
    if a.scale == "full" and a.name in FULL_SCALE_ENV:
        import os

        import torch

        need = [v for v in FULL_SCALE_ENV[a.name] if not os.environ.get(v)]
        if need or not torch.cuda.is_available():
            raise SystemExit(f"{a.name} at full scale needs a GPU machine and, set in the environment: "
                             + ", ".join(need or ["(all set)"]) + f" -- see sweeps/scale/{a.name}_full.yaml")
    t0 = time.time()
    if not a.analysis_only:
        rc = subprocess.run(sweep, cwd=ROOT).returncode
        if rc:
            why = "was stopped by a signal" if rc == EXIT_INTERRUPTED or rc < 0 else f"failed (exit {rc})"
            print(f"the sweep {why}; no report is written. Run the same command again: finished runs are kept and "
                  f"skipped, a killed one resumes from its checkpoint (a diverged one stays failed: see its failed.json)",
                  file=sys.stderr)
            return rc
    sweep_s = time.time() - t0
    if not runs.is_dir():
        raise SystemExit(f"--analysis-only: {runs} holds no runs; run the sweep first (without --analysis-only)")
    finished, failed, unfinished = sweep_state(runs)
    if failed or unfinished:  # a report over committed results only from a whole sweep
        missing = [f"  {r}: failed ({(failed_record(r) or {}).get('kind', '?')})" for r in failed]
        missing += [f"  {r}: did not finish" for r in unfinished]
        print(f"{len(failed) + len(unfinished)} of {len(finished) + len(failed) + len(unfinished)} runs of the sweep "
              "did not finish; no report is written:\n" + "\n".join(missing), file=sys.stderr)
        return 1
    todo = transfer_commands(finished, n_transfer)
    for i, cmd in enumerate(todo, 1):
        print(f"transfer evaluation {i}/{len(todo)}: {shlex.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc:
            print(f"the transfer evaluation of {cmd[3]} failed (exit {rc}); no report is written. Run the same command "
                  "again: the evaluations already written are kept", file=sys.stderr)
            return rc
    plain = not overrides and a.runs is None and a.out is None
    invoked = (["make", f"reproduce-{a.name}", f"SCALE={a.scale}"] if plain and a.name in TABLES else
               ["python", "-m", "ema_pg.reproduce", *(sys.argv[1:] if argv is None else argv)])
    extra = ["--scale", a.scale, "--command", shlex.join(invoked)] if a.name in TABLES else []
    rc = subprocess.run(analysis + extra, cwd=ROOT).returncode
    print(f"{a.name} at scale {a.scale}: sweep {sweep_s / 60:.1f} min; runs in {runs}; results in {out}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
