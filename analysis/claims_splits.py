"""Where a sequential plan's claims gain or lose, split by split: described after the fact, no claim made.

    python analysis/claims_splits.py reproductions/table2/claims/plan.yaml   # writes splits.md and splits.png beside it

For a plan whose every claim has ended (decided, or stopped at the cap), reads its ledger (``cells.csv``: every
finished cell's scores per split) and, for each claim, the paired difference better - worse on each evaluation
split and on the average, over the seeds of the claim's last look (``looks.csv``: its planned seeds less any left
out): mean, paired sd, each split's share of the average's paired variance, a percentile bootstrap 95% interval
over seeds, and the seeds on which the better method scored higher. The plan's verdicts come from its looks alone
(``sequential.md``); these intervals are many, not pre-registered and not corrected for their number, so some
exclude 0 by chance.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ema_pg.workbench.studies.decide import load_plan, look_seeds, read_cells, read_looks, state  # noqa: E402
from ema_pg.workbench.results import bootstrap_ci, paired_differences, paired_sd, seed_tally, set_style  # noqa: E402

AVG = "avg"  # eval.json's average over the splits


def split_table(plan_path: Path) -> pd.DataFrame:
    """One row per claim x score (each split, then the average): seeds, means, Δ, paired sd, variance share,
    bootstrap interval, tally."""
    plan = load_plan(plan_path)
    cells, looks = read_cells(plan), read_looks(plan)
    rows = []
    for c in plan.claims:
        seeds = look_seeds(plan, looks[looks["claim"] == c.id].iloc[-1])
        splits = sorted(k for k in cells[(c.better, seeds[0])]["scores"] if k != AVG)
        score = {m: {k: np.array([cells[(m, s)]["scores"][k] for s in seeds]) for k in [*splits, AVG]}
                 for m in (c.better, c.worse)}
        d = {k: paired_differences(score[c.better][k], score[c.worse][k]) for k in [*splits, AVG]}
        is_mean = np.allclose(d[AVG], np.mean([d[k] for k in splits], axis=0))  # the average is the splits' mean
        for k in [*splits, AVG]:
            lo, hi = bootstrap_ci(d[k])
            # its part of var(avg's Δ): cov(Δ_k / n, Δ_avg) / var(Δ_avg), summing to 1 over the splits
            share = (float(np.cov(d[k], d[AVG])[0, 1] / len(splits) / np.var(d[AVG], ddof=1))
                     if is_mean and k != AVG else float("nan"))
            rows.append(dict(claim=c.id, text=c.text, split=k, seeds=len(seeds),
                             better=float(score[c.better][k].mean()), worse=float(score[c.worse][k].mean()),
                             delta=float(d[k].mean()), sd=paired_sd(d[k]), share=share, lo=lo, hi=hi,
                             tally=seed_tally(d[k])))
    return pd.DataFrame(rows)


def markdown(t: pd.DataFrame, plan_path: Path) -> str:
    lines = [f"# Where the claims gain or lose, split by split: {plan_path.parent.name}", "",
             f"Written by `python analysis/claims_splits.py {plan_path}` from `cells.csv`. **Described after the "
             "fact; no claim is made here.** The plan's verdicts are its looks' ([sequential.md](sequential.md)): "
             "those were pre-registered on the average alone. Each row is the mean paired difference (better − "
             "worse) of greedy EM on one split over the seeds both methods have, its paired sd (what sets the seeds a "
             "split's claim would need), its share of the paired variance of the average (the covariance of its Δ / "
             f"{t['split'].nunique() - 1} with the average's Δ, over the average's variance: the shares add to 100%), "
             f"and a percentile bootstrap 95% interval over seeds. There are {len(t)} intervals here, none corrected "
             "for their number: some would exclude 0 with no effect at all.", "",
             "| claim | split | seeds | better | worse | Δ | paired sd | share of the average's variance "
             "| 95% interval (bootstrap) | seeds better |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in t.itertuples():
        split = f"**{r.split}**" if r.split == AVG else r.split
        lines.append(f"| {r.claim}: {r.text} | {split} | {r.seeds} | {r.better:.3f} | {r.worse:.3f} | {r.delta:+.4f} "
                     f"| {r.sd:.4f} | {'' if np.isnan(r.share) else f'{round(r.share, 2) + 0.0:.0%}'} "
                     f"| [{r.lo:+.4f}, {r.hi:+.4f}] | {r.tally} |")
    return "\n".join(lines + ["", "![per split](splits.png)", ""])


def plot(t: pd.DataFrame, out: Path) -> None:
    set_style()
    claims = list(dict.fromkeys(t["claim"]))
    splits = list(dict.fromkeys(t["split"]))
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(splits) + 1.2))
    for i, c in enumerate(claims):
        g = t[t["claim"] == c].set_index("split").loc[splits]
        y = np.arange(len(splits)) + (i - (len(claims) - 1) / 2) * 0.22
        ax.errorbar(g["delta"], y, xerr=[g["delta"] - g["lo"], g["hi"] - g["delta"]], fmt="o", capsize=2,
                    label=f"{c}: {g['text'].iloc[0]}")
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(np.arange(len(splits)), splits)
    ax.invert_yaxis()
    ax.set_xlabel("paired difference in EM (better − worse), bootstrap 95% interval")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8)
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plan", type=Path, help="a sequential plan's plan.yaml")
    a = ap.parse_args(argv)
    still = [cid for cid, v in state(load_plan(a.plan))[0].items() if v == "open"]
    if still:
        raise SystemExit(f"{a.plan}: claim {', '.join(still)} still open; the split table is written once every claim "
                         "has ended (its looks alone speak until then)")
    t = split_table(a.plan)
    (a.plan.parent / "splits.md").write_text(markdown(t, a.plan))
    plot(t, a.plan.parent / "splits.png")
    print(f"wrote {a.plan.parent / 'splits.md'} and splits.png ({len(t)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
