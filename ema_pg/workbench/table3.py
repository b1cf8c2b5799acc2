"""Table 3 and Fig 3: the math track's Pass@1 per split and Pass@1 / Pass@16 over training, beside the paper's.

    python -m ema_pg.reports table3 --runs runs/reproduce/table3-mini --out reproductions/table3
    (make reproduce-table3 SCALE=smoke|mini|full runs the sweep first, then this)

Rows: the base policy (the cold start, evaluated at iteration 0 of each run), GRPO (``method=grpo``:
fixed anchor, K3) and EMA-PG (``method=ema``: the same with the EMA anchor; Table 3 compares the
anchor alone). Pass@1 is mean@N over the N samples per problem of the track's evaluation. Writes
``results.md`` (ours beside the paper's with its relative-improvement column, the pre-registered
claims with paired 95% intervals and verdicts, per-seed numbers, provenance), ``table3.csv``,
``table3_runs.csv``, ``claims.csv``, ``table3.png`` and ``fig3.png`` (Pass@1 and Pass@16 over
training, mean and 95% band over seeds).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from ..cli import PACKAGE_ROOT
from .results import (bootstrap_ci, claim_verdict, format_seeds, load_curves, min_detectable, paired_differences,
                      provenance_lines, seeds_to_detect, set_style, table_args, write_results)
from ..tasks.math.task import PAPER_NAMES

PAPER = PACKAGE_ROOT / "reproductions" / "table3" / "paper_table3.csv"
SPLITS = list(PAPER_NAMES)  #: Table 3's row order
COLS = SPLITS + ["avg"]
ARMS = {"grpo": "GRPO", "ema": "EMA-PG"}  #: method id -> Table 3's column
ROWS = ["Base", *ARMS.values()]
PALETTE = dict(zip(ROWS, sns.color_palette("colorblind", len(ROWS))))
PASS_N = 16  #: Fig 3's Pass@N


def _col(split: str, score: str) -> str:
    return f"eval/{split}/{score}"


def per_run_scores(runs: pd.DataFrame, score: str) -> pd.DataFrame:
    """One row per (method, seed) with the final ``score`` of each split and the average; plus the base rows."""
    need = [f"final/{_col(s, score)}" for s in COLS]
    missing = [c for c in need if c not in runs]
    if missing:
        raise SystemExit(f"these runs have no {missing[0]}; point --runs at a table3 sweep (experiment=math with "
                         f"rollout.eval_samples >= {PASS_N})")
    final = runs[["run", "method", "seed", *need]].rename(columns=dict(zip(need, COLS)))
    base = runs[["run", "seed", *[f"base/{_col(s, score)}" for s in COLS]]].rename(
        columns={f"base/{_col(s, score)}": s for s in COLS}).drop_duplicates("seed").assign(method="Base")
    return pd.concat([base, final], ignore_index=True)


def summarize(scores: pd.DataFrame) -> pd.DataFrame:
    long = scores.melt(id_vars=["run", "method", "seed"], value_vars=COLS, var_name="split", value_name="value")
    return long.groupby(["method", "split"], sort=False)["value"].agg(mean="mean", std="std", n="count").reset_index()


def rel_improvement(base: float, grpo: float, ema: float) -> str:
    """The paper's column: (EMA-PG - GRPO) / (GRPO - Base)."""
    d = grpo - base
    return "—" if abs(d) < 1e-12 else f"{100 * (ema - grpo) / d:+.0f}%"


def table_markdown(t: pd.DataFrame, paper: pd.DataFrame) -> str:
    m = t.pivot(index="split", columns="method", values="mean")
    s = t.pivot(index="split", columns="method", values="std")
    lines = ["| Benchmark (ours: split) | Base | GRPO | EMA-PG | Δ (Rel) | paper Base | paper GRPO | paper EMA-PG | "
             "paper Δ (Rel) |", "|---|" + "---:|" * 8]
    p = paper.set_index("split")
    for split in COLS:
        ours = [f"{m.loc[split, r]:.3f} ± {s.loc[split, r]:.3f}" if r in m else "missing" for r in ROWS]
        rel = rel_improvement(*(m.loc[split, r] for r in ROWS)) if all(r in m for r in ROWS) else "—"
        pr = p.loc[split]
        lines.append(f"| {pr['paper_name']} ({split}) | " + " | ".join(ours) + f" | {rel} | {pr['Base']:.3f} | "
                     f"{pr['GRPO']:.3f} | {pr['EMA-PG']:.3f} | {rel_improvement(pr['Base'], pr['GRPO'], pr['EMA-PG'])} |")
    return "\n".join(lines)


def paired(scores: pd.DataFrame, better: str, worse: str, col: str = "avg") -> np.ndarray:
    """Per-seed differences better - worse on the seeds both ran (same seed = same cold start, same prompts)."""
    a = scores[scores["method"] == better].set_index("seed")[col]
    b = scores[scores["method"] == worse].set_index("seed")[col]
    seeds = sorted(set(a.index) & set(b.index))
    return paired_differences(a.loc[seeds], b.loc[seeds])


def claims(p1: pd.DataFrame, pn: pd.DataFrame) -> pd.DataFrame:
    """The pre-registered comparisons (reproductions/table3/README.md), each a paired difference over seeds
    with its 95% bootstrap interval, the verdict for the stated direction, and the minimum detectable
    difference at this seed count (2.8 x the paired std / sqrt(seeds): 80% power, two-sided 5%)."""
    spec = [("C1", "RL raises Pass@1: GRPO > Base (avg)", p1, "GRPO", "Base", "avg"),
            ("C2", "RL raises Pass@1: EMA-PG > Base (avg)", p1, "EMA-PG", "Base", "avg"),
            ("C3", "Table 3: EMA-PG > GRPO in Pass@1 (avg)", p1, "EMA-PG", "GRPO", "avg"),
            ("C4", f"Fig 3: EMA-PG > GRPO in Pass@{PASS_N} (avg, end of training)", pn, "EMA-PG", "GRPO", "avg")]
    spec += [(f"C3.{i + 1}", f"Table 3: EMA-PG > GRPO in Pass@1 on {PAPER_NAMES[s]} ({s})", p1, "EMA-PG", "GRPO", s)
             for i, s in enumerate(SPLITS)]
    spec += [("D1", f"(descriptive) GRPO's Pass@{PASS_N} vs Base (Pass@N collapse if < 0)", pn, "GRPO", "Base", "avg"),
             ("D2", f"(descriptive) EMA-PG's Pass@{PASS_N} vs Base", pn, "EMA-PG", "Base", "avg")]
    rows = []
    for cid, text, sc, better, worse, col in spec:
        d = paired(sc, better, worse, col)
        lo, hi = bootstrap_ci(d)
        rows.append({"id": cid, "claim": text, "seeds": len(d), "delta_mean": float(d.mean()) if len(d) else float("nan"),
                     "ci_low": lo, "ci_high": hi, "verdict": claim_verdict(lo, hi) if len(d) > 1 else "undecided",
                     "mde": min_detectable(d), "n_detect": seeds_to_detect(d),
                     "per_seed": ", ".join(f"{x:+.3f}" for x in d)})
    out = pd.DataFrame(rows)
    out.loc[out["id"].str.startswith("D"), "verdict"] = "(descriptive)"
    return out


def claims_markdown(c: pd.DataFrame) -> str:
    lines = ["| id | comparison | seeds | Δ mean | 95% CI | verdict | min. detectable Δ | seeds to detect Δ | Δ per seed |",
             "|---|---|---:|---:|---|---|---:|---:|---|"]
    for _, r in c.iterrows():
        lines.append(f"| {r['id']} | {r['claim']} | {r['seeds']} | {r['delta_mean']:+.4f} | "
                     f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] | **{r['verdict']}** | {r['mde']:.4f} | "
                     f"{format_seeds(r['n_detect'])} | {r['per_seed']} |")
    return "\n".join(lines)


def seeds_markdown(scores: pd.DataFrame, label: str) -> str:
    lines = [f"| {label} | seed | " + " | ".join(COLS) + " |", "|---|---:|" + "---:|" * len(COLS)]
    for _, r in scores.sort_values(["method", "seed"], key=lambda s: s.map({m: i for i, m in enumerate(ROWS)})
                                   if s.name == "method" else s).iterrows():
        lines.append(f"| {r['method']} | {int(r['seed'])} | " + " | ".join(f"{r[s]:.3f}" for s in COLS) + " |")
    return "\n".join(lines)


def plot_table(t: pd.DataFrame, paper: pd.DataFrame, out: Path) -> None:
    set_style()
    pl = paper.melt(id_vars=["split", "paper_name"], value_vars=ROWS, var_name="method", value_name="mean")
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
    for ax, (title, df) in zip(axes, (("ours (mean ± std over seeds)", t), ("paper (R1-Distill-Qwen-1.5B)", pl))):
        order = [r for r in ROWS if r in set(df["method"])]
        sns.barplot(df, x="split", y="mean", hue="method", hue_order=order, order=COLS, ax=ax, palette=PALETTE)
        if "std" in df:
            for cont, m in zip(ax.containers, order):
                sub = df[df["method"] == m].set_index("split").reindex(COLS)
                ax.errorbar([b.get_x() + b.get_width() / 2 for b in cont], sub["mean"], yerr=sub["std"].fillna(0),
                            fmt="none", ecolor="k", lw=0.8, capsize=2)
        ax.set(title=f"Table 3, {title}", ylabel="Pass@1", xlabel="", ylim=(0, 1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(out / f"table3.{ext}")
    plt.close(fig)


def plot_fig3(runs: pd.DataFrame, out: Path, n_samples: int) -> None:
    """Pass@1 and Pass@16 over training per arm (mean, 95% band over seeds), and the paired difference
    EMA-PG − GRPO of each, seed by seed (the comparison the claims test)."""
    set_style()
    curves = load_curves(runs, "eval/avg/")
    names = {"eval/avg/acc": f"Pass@1 (mean@{n_samples})", f"eval/avg/pass@{PASS_N}": f"Pass@{PASS_N}"}
    curves = curves[curves["metric"].isin(list(names))].assign(panel=lambda d: d["metric"].map(names))
    if not len(curves):
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    arms = [a for a in ARMS.values() if a in set(curves["method"])]
    for ax, panel in zip(axes, names.values()):
        sns.lineplot(curves[curves["panel"] == panel], x="step", y="value", hue="method", hue_order=arms,
                     errorbar=("ci", 95), marker="o", palette=PALETTE, ax=ax)
        ax.set(title=panel, xlabel="RL iteration", ylabel="average over the six splits")
    wide = curves.pivot_table(index=["panel", "seed", "step"], columns="method", values="value").reset_index()
    if set(ARMS.values()) <= set(wide.columns):
        wide["delta"] = wide["EMA-PG"] - wide["GRPO"]
        sns.lineplot(wide, x="step", y="delta", hue="panel", errorbar=("ci", 95), marker="o", ax=axes[2])
        axes[2].axhline(0, color="k", lw=0.8)
        axes[2].legend(title="score", fontsize=8)
        axes[2].set(title="EMA-PG − GRPO, paired by seed", xlabel="RL iteration", ylabel="difference")
    fig.suptitle("Fig 3 (ours): the EMA anchor vs GRPO on the math track (mean, 95% band over seeds)", y=1.02)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(out / f"fig3.{ext}", bbox_inches="tight")
    plt.close(fig)


def provenance(runs: pd.DataFrame, scale: str, command: str) -> list[str]:
    knobs = ["model.hidden_size", "model.num_layers", "sft.stop_at_reward", "algo.iterations", "algo.prompts_per_step",
             "algo.group_size", "algo.beta", "optim.lr", "kl.name", "anchor.eta", "anchor.update_every",
             "rollout.max_new_tokens", "rollout.eval_samples", "rollout.eval_temperature", "rollout.eval_top_p",
             "task.per_split", "trainer.num_threads"]
    return provenance_lines(runs, scale, command, knobs, "table3_runs.csv")


def main(argv=None) -> dict:
    a, out, runs = table_args("table3", __doc__, argv)
    unknown = sorted(set(runs["method"]) - set(ARMS))
    if unknown:
        raise SystemExit(f"runs of methods {unknown} under {a.runs}; Table 3 compares {', '.join(ARMS)}")
    runs["method"] = runs["method"].map(ARMS)
    n_samples = int(runs["rollout.eval_samples"].iloc[0])
    paper = pd.read_csv(PAPER)
    p1, pn = per_run_scores(runs, "acc"), per_run_scores(runs, f"pass@{PASS_N}")
    t = summarize(p1)
    t.to_csv(out / "table3.csv", index=False)
    summarize(pn).to_csv(out / f"table3_pass{PASS_N}.csv", index=False)
    keep = ["run", "method", "seed", "finished", "iteration", "wall_s", "commit", "run_dir"]
    runs[keep + [f"final/{_col(s, 'acc')}" for s in COLS]].to_csv(out / "table3_runs.csv", index=False)
    c = claims(p1, pn)
    c.to_csv(out / "claims.csv", index=False)
    plot_table(t, paper, out)
    plot_fig3(runs, out, n_samples)
    md = [f"# Table 3 and Fig 3 reproduction ({a.scale} scale): the math track", "", *provenance(runs, a.scale, a.command),
          "", f"Pass@1 is mean@{n_samples}: the mean reward over {n_samples} samples per problem (temperature "
          f"{runs['rollout.eval_temperature'].iloc[0]}, top-p {runs['rollout.eval_top_p'].iloc[0]}); Pass@{PASS_N} is the "
          "unbiased estimator from the same samples. GRPO = fixed anchor + K3; EMA-PG = EMA anchor + K3 (the anchor is "
          "the only difference, as in the paper's Table 3 comparison). Base = the cold start at iteration 0, the "
          "same policy for both arms of a seed.", "",
          "## Table 3: Pass@1, ours (mean ± std over seeds) beside the paper's", "",
          "Δ (Rel) is the paper's column, (EMA-PG − GRPO) / (GRPO − Base).", "", table_markdown(t, paper), "",
          "## The pre-registered comparisons", "",
          "Written in this folder's README.md before the final sweep ran. Each is a paired difference over seeds "
          "(same seed = same cold start and prompt stream) with its 95% percentile-bootstrap interval; **holds** = the "
          "interval lies above 0, **fails** = below 0, **undecided** = it contains 0. The minimum detectable Δ is "
          "2.8 × the paired std / √seeds (80% power, two-sided 5%); seeds to detect Δ: how many seeds would detect the "
          "observed Δ by that rule, if the paired spread stayed as it is.", "", claims_markdown(c), "",
          "![Table 3](table3.png)", "", "![Fig 3](fig3.png)", "",
          "## Per seed: Pass@1", "", seeds_markdown(p1, "method"), "",
          f"## Per seed: Pass@{PASS_N}", "", seeds_markdown(pn, "method"), ""]
    write_results(out, md)
    return {"table": t, "claims": c, "out": out}


if __name__ == "__main__":
    main()
