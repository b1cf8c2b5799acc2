"""What ``make demo`` shows on this machine: its command once per seed, each from a cold start built in a cache of its
own (as on a fresh clone), the base policy's and the trained policy's held-out exact match as the run's
``eval.json`` records them, and the wall time. Writes JSON; ``benchmarks/tables.py`` writes the README's and
docs/training.md's tables from it.

    python benchmarks/demo_scores.py --seeds 0,1,2 --out benchmarks/results/demo_scores_<machine>.json

CPU float results differ between kinds of CPU (the cold start's and every update's last bits, then the
trajectory), so a file names the machine its runs record (``machine.txt``) and the commit; run it on an idle machine
(the wall times are a fresh clone's first ``make demo``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "ema_pg.train", "experiment=demo", f"seed={seed}",
                            f"run_dir={tmp}/run", f"sft.cache_dir={tmp}/cache", "trainer.progress_bar=false"],
                           cwd=ROOT, capture_output=True, text=True, timeout=7200)
        wall = time.perf_counter() - t
        if r.returncode:
            sys.exit(f"demo seed {seed} failed (exit {r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
        from ema_pg.engine.runs import run_commit, run_machine

        ev = json.loads(Path(f"{tmp}/run/eval.json").read_text())
        split = next(iter(ev["splits"]))
        return {"seed": seed, "base": ev["base_avg"], "final": ev["avg"], "gain": ev["avg"] - ev["base_avg"],
                "metric": f"{split} {ev['metric']}", "n": ev["splits"][split]["n"], "wall_s": wall,
                "machine": run_machine(Path(tmp) / "run"), "commit": run_commit(Path(tmp) / "run")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one demo each (in turn)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    from tqdm.auto import tqdm

    rows = [one(int(s)) for s in tqdm(a.seeds.split(","), desc="make demo, one seed at a time")]
    gains = [r["gain"] for r in rows]
    out = {"benchmark": "demo_scores", "command": "python -m ema_pg.train experiment=demo seed=S (make demo)",
           "machine": rows[0]["machine"], "cpus": os.cpu_count(), "commit": rows[0]["commit"],
           "python": platform.python_version(), "rows": rows, "gain_mean": statistics.mean(gains),
           "gain_std": statistics.stdev(gains) if len(gains) > 1 else None}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}: gains {', '.join(f'{g:+.3f}' for g in gains)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
