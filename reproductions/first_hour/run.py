"""A first hour on one's own task (plan.md): experiment=tiny on two tasks from outside the package, base -> trained.

    python reproductions/first_hour/run.py            # runs what is missing, then writes results.csv and README.md

Each run is runs/first_hour/<task>_s<seed> (if_exists=resume: a finished one is read, a killed one continued)."""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TASKS = {  # the task and its own response budget (plan.md)
    "countdown": ["task=custom", "task.target=byo_task.countdown:CountdownTask"],
    "guess": ["task=custom", "task.target=byo_task.guess:GuessTask", "rollout.max_new_tokens=40"],
}
LOOKS = {1: (0, 1, 2), 2: tuple(range(3, 10))}  #: each plan's seeds (plan.md), each decided on its own
T975 = {2: 4.303, 6: 2.447}  #: the t quantiles for 3 and 7 seeds


def run(task: str, seed: int) -> dict:
    folder = ROOT / "runs" / "first_hour" / f"{task}_s{seed}"
    if not (folder / "eval.json").is_file():
        cmd = [sys.executable, "-m", "ema_pg.train", "experiment=tiny", *TASKS[task], f"seed={seed}",
               "if_exists=resume", f"run_dir={folder}", f"hydra.run.dir={folder}", "trainer.progress_bar=false"]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "fixtures" / "byo_task")}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    ev = json.loads((folder / "eval.json").read_text())
    return {"plan": next(k for k, v in LOOKS.items() if seed in v), "task": task, "seed": seed, "base": ev["base_avg"], "trained": ev["avg"],
            "gain": ev["avg"] - ev["base_avg"], "run": str(folder.relative_to(ROOT))}


def verdict(gains: list[float]) -> tuple[float, float, float, str]:
    mean = statistics.mean(gains)
    half = T975[len(gains) - 1] * statistics.stdev(gains) / math.sqrt(len(gains))
    lo, hi = mean - half, mean + half
    return mean, lo, hi, "learns" if lo > 0 else "no gain" if hi <= 0 else "not decided"


def main() -> None:
    rows = [run(t, s) for seeds in LOOKS.values() for t in TASKS for s in seeds]
    with open(HERE / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = ["| plan | task | seeds | base | trained | mean gain | 95% interval | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for plan, seeds in LOOKS.items():
        for t in TASKS:
            mine = [r for r in rows if r["task"] == t and r["plan"] == plan]
            mean, lo, hi, say = verdict([r["gain"] for r in mine])
            fmt = lambda k: ", ".join(f"{r[k]:.3f}" for r in mine)
            lines.append(f"| {plan} | {t} | {seeds[0]}-{seeds[-1]} | {fmt('base')} | {fmt('trained')} | {mean:+.3f} | "
                         f"[{lo:+.3f}, {hi:+.3f}] | {say} |")
    readme = HERE / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    start, end = "<!-- table results -->", "<!-- /table -->"
    table = f"{start}\n" + "\n".join(lines) + f"\n\nWritten by `python reproductions/first_hour/run.py` at commit {commit}.\n{end}"
    text = text.split(start)[0] + table + text.split(end)[1] if start in text else text + "\n" + table + "\n"
    readme.write_text(text)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
