"""A seeded run's fingerprint, to show that a change of the code's shape left every run as it was.

    python analysis/fingerprint.py OUT [--code CHECKOUT]
    python analysis/fingerprint.py --compare OUT_A OUT_B

Trains the demo, search_reading and math for 4 iterations (evaluated at 2 and 4; search_reading's and math's cold
starts cut to 60 SFT steps) with the code of CHECKOUT (default: this one), each into OUT/<experiment>, and prints per
experiment the first iteration's loss, KL and gradient norm, the final evaluation, and a hash of every logged
training metric (the wall-clock ``time/`` and ``perf/`` columns left out). Two checkouts that print the same lines
train bit for bit alike. ``--compare`` reads two such folders and says, per experiment, whether every metric column
they share is equal at every iteration and the final evaluations are equal, and which columns only one logs (a
metric added between the two checkouts changes the hash, not the training).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = {"demo": [], "search_reading": ["sft.steps=60", "sft.stop_at_reward=0"],
               "math": ["sft.steps=60", "sft.stop_at_reward=0"]}


def fingerprint(run_dir: Path) -> dict:
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    kept = [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]
    first = next(r for r in kept if r.get("train/loss"))
    splits = json.loads((run_dir / "eval.json").read_text())["splits"]
    return {"loss": first["train/loss"], "kl": first["train/kl"], "grad_norm": first["train/grad_norm"],
            "final": {s: {k: v for k, v in x.items() if k not in ("per_problem", "diagnostics")} for s, x in splits.items()},
            "metrics_sha": hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]}


def compare(a: Path, b: Path) -> bool:
    import pandas as pd

    same = True
    for name in EXPERIMENTS:
        x, y = pd.read_csv(a / name / "metrics.csv"), pd.read_csv(b / name / "metrics.csv")
        cols = [c for c in x.columns if c in y.columns and not c.startswith(("time/", "perf/"))]
        fx, fy = fingerprint(a / name)["final"], fingerprint(b / name)["final"]
        equal = x[cols].equals(y[cols]) and fx == fy
        same &= equal
        print(f"{name}: {'equal' if equal else 'DIFFERENT'} on {len(cols)} shared metric columns and the final "
              f"evaluation; only in {a}: {sorted(set(x.columns) - set(y.columns))}; only in {b}: "
              f"{sorted(set(y.columns) - set(x.columns))}")
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("OUT_A", "OUT_B"))
    a = ap.parse_args()
    if a.compare:
        return 0 if compare(*a.compare) else 1
    if a.out is None:
        ap.error("give OUT (or --compare OUT_A OUT_B)")
    for name, extra in EXPERIMENTS.items():
        run_dir = (a.out / name).resolve()
        cmd = [sys.executable, "-m", "ema_pg.train", f"experiment={name}", "algo.iterations=4", "algo.eval_every=2",
               *extra, f"hydra.run.dir={run_dir}"]
        done = subprocess.run(cmd, cwd=a.code, capture_output=True, text=True)
        if done.returncode:
            print(f"{name}: the run failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        print(name, json.dumps(fingerprint(run_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
