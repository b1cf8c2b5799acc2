"""The reasoning-gym suite's pilot (issue 75): each candidate dataset's held-out gain under RL, per run, and the five
datasets the pilot's rule picks (reproductions/reasoning_gym/suite/pilot/README.md).

    python analysis/suite_pilot.py runs/reproduce/reasoning_gym_suite-pilot --out reproductions/reasoning_gym/suite/pilot

A run's gain on a dataset is its held-out score after RL minus before (the cold start's evaluation at iteration 0).
The suite is the ``--pick`` candidates with the largest mean gain over the runs, each with a positive mean gain
(``pick`` of :mod:`ema_pg.workbench.studies.pilot`, whose command ``python -m ema_pg.pilot`` now registers such a
rule before a pilot's first run and applies it to its ledger; this script read the suite's pilot, which predates it). Writes ``gains.csv`` (one row per run and dataset), ``gains.md`` and ``gains.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import yaml

from ema_pg.workbench.studies.pilot import Rule, pick, split_scores


def pilot_gains(runs: Path) -> pd.DataFrame:
    """(run, method, seed, split, base, trained, gain) of every finished run under ``runs``."""
    rows = []
    for run in sorted(p for p in runs.iterdir() if (p / "eval.json").is_file()):
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        for r in split_scores(run).itertuples():
            if r.split != "avg":
                rows.append({"run": run.name, "method": cfg.get("method"), "seed": int(cfg["seed"]), "split": r.split,
                             "base": r.base, "trained": r.trained, "gain": r.delta})
    if not rows:
        raise SystemExit(f"{runs}: no finished run (eval.json) under it")
    return pd.DataFrame(rows)


def _plot(gains: pd.DataFrame, order: list[str], chosen: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(8, 3.6))
    sns.stripplot(data=gains, x="split", y="gain", hue="method", order=order, dodge=True, ax=ax, size=6)
    ax.axhline(0, color="k", lw=0.8)
    for i, s in enumerate(order):
        if s in chosen:
            ax.axvspan(i - 0.5, i + 0.5, color="tab:green", alpha=0.08, lw=0)
    ax.set_xlabel("")
    ax.set_ylabel("held-out score: after RL - before")
    ax.set_title("suite pilot: each run's gain per dataset (shaded: the suite)")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pick", type=int, default=5)
    a = ap.parse_args()
    gains = pilot_gains(a.runs)
    summary, chosen = pick(gains, Rule(a.pick, 0.0))
    a.out.mkdir(parents=True, exist_ok=True)
    gains.to_csv(a.out / "gains.csv", index=False, float_format="%.4f")
    first = a.runs / gains["run"].iloc[0]
    commit = (first / "git.txt").read_text().strip()
    machine = (first / "machine.txt").read_text().strip() if (first / "machine.txt").is_file() else "not recorded"
    n_runs = gains["run"].nunique()
    lines = ["# The suite's pilot: held-out gain under RL per candidate dataset", "",
             f"{n_runs} runs ({', '.join(sorted(gains['run'].unique()))}), commit `{commit}`, machine `{machine}`; "
             f"written by `python analysis/suite_pilot.py {a.runs} --out {a.out}`. Gain = held-out score after RL "
             "minus before (the cold start's, at iteration 0), 48 questions a dataset. The rule (README.md): the "
             f"{a.pick} datasets with the largest mean gain, each positive.", "",
             "| dataset | before RL (mean) | after RL (mean) | mean gain | runs raised | in the suite |",
             "|---|---|---|---|---|---|"]
    for s, r in summary.iterrows():
        lines.append(f"| {s} | {r.base:.3f} | {r.trained:.3f} | {r.mean_gain:+.3f} | {int(r.runs_raised)} of {int(r.runs)} | "
                     f"{'yes' if s in chosen else ''} |")
    lines += ["", f"**The suite: {', '.join(chosen)}**" if chosen else
              f"**Fewer than {a.pick} datasets gained on average: the rule picks nothing; the pilot is to be widened "
              "before a plan is registered.**", "",
              "Gain per run and arm:", "", "![gains](gains.png)"]
    (a.out / "gains.md").write_text("\n".join(lines) + "\n")
    _plot(gains, list(summary.index), chosen, a.out / "gains.png")
    print(f"wrote {a.out / 'gains.md'}: suite {chosen}")


if __name__ == "__main__":
    main()
