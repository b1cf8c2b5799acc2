"""One run's held-out score per evaluation split, before RL (iteration 0) and after (its eval.json): a table for a
task's docs row, written beside the run's commit and command.

    python analysis/split_scores.py runs/reasoning_gym/s0 --out reproductions/reasoning_gym

Writes ``splits.csv`` and ``splits.md``. One run, one seed: it shows what a setting learns, it decides nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from ema_pg.workbench.studies.pilot import split_scores  # one home: the pilot ledger reads runs so too


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    df = split_scores(a.run)
    cfg = yaml.safe_load((a.run / "config.yaml").read_text())
    commit = (a.run / "git.txt").read_text().strip()
    machine = (a.run / "machine.txt").read_text().strip() if (a.run / "machine.txt").is_file() else "not recorded"
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "splits.csv", index=False, float_format="%.4f")
    ev = json.loads((a.run / "eval.json").read_text())
    metric, wall = ev["metric"], ev.get("wall_s")
    lines = [f"# {cfg.get('name', a.run.name)}: held-out {metric} per split, before and after RL", "",
             f"One run (seed {cfg['seed']}), commit `{commit}`, machine `{machine}`"
             + (f", RL wall time {wall:.0f} s (eval.json's wall_s; the cold start before it not counted)" if wall else "")
             + "; written by "
             f"`python analysis/split_scores.py {a.run} --out {a.out}`. Before RL = the cold-start policy's "
             "evaluation at iteration 0; after = its final evaluation (greedy). One seed shows what the setting "
             "learns; it decides no claim.", "",
             "| split | questions | before RL | after RL | Δ |", "|---|---|---|---|---|"]
    for r in df.itertuples():
        lines.append(f"| {r.split} | {r.n} | {r.base:.3f} | {r.trained:.3f} | {r.delta:+.3f} |")
    (a.out / "splits.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out / 'splits.md'}")


if __name__ == "__main__":
    main()
