"""A folder of runs -> one table (CSV): resolved config columns, labels, final and base metrics.

    python analysis/load_runs.py multirun/fig6_k/<time>                  # prints a summary, writes runs.csv there
    python analysis/load_runs.py runs/ --out all_runs.csv --curves curves.csv   # + per-step metrics (long form)

The loader itself is ``ema_pg.workbench.results.load_runs`` / ``load_curves`` (importable from scripts,
notebooks and tests); this is its command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ema_pg.workbench.results import load_curves, load_runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", help="a folder holding run folders (any depth)")
    ap.add_argument("--out", help="the table's CSV (default: <runs>/runs.csv)")
    ap.add_argument("--curves", help="also write every run's per-step metrics here (long form CSV)")
    ap.add_argument("--finished", action="store_true", help="only runs that finished all their iterations")
    a = ap.parse_args(argv)
    runs = load_runs(a.runs, finished_only=a.finished)
    out = Path(a.out or Path(a.runs) / "runs.csv")
    runs.to_csv(out, index=False)
    finals = [c for c in runs.columns if c.startswith("final/eval/avg/")]
    show = [c for c in ["run", "method", "seed", "iteration", "finished", *finals] if c in runs]
    print(runs[show].to_string(index=False) if len(runs) else "no runs found")
    print(f"{len(runs)} runs, {runs.shape[1] if len(runs) else 0} columns -> {out}")
    if a.curves:
        curves = load_curves(runs, metrics="")
        curves[["run", "method", "seed", "step", "metric", "value"]].to_csv(a.curves, index=False)
        print(f"per-step metrics -> {a.curves}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
