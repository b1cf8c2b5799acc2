"""Table 2: our search-agent table (7 splits + average, mean ± std over seeds) beside the paper's.

    python -m ema_pg.reports table2 --runs runs/reproduce/table2-mini --out reproductions/table2
    (make reproduce-table2 SCALE=smoke|mini|full runs the sweep first, then this)

Writes ``results.md`` (both tables, the paper's orderings checked on ours, provenance),
``table2.csv`` (method x split: mean, std, n), ``table2_runs.csv`` (one row per run),
``table2.png/.pdf`` (per-split bars, ours beside the paper's) and ``table2_curves.png/.pdf``.
Rows for methods not run are shown as missing, never filled in.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from ..cli import PACKAGE_ROOT
from .results import (METHOD_LABELS, bootstrap_ci, claim_verdict, format_seeds, load_curves, method_label, min_detectable,
                      paired_differences, provenance_lines, seed_tally, seeds_to_detect, set_style, sign_flip_p, table_args,
                      write_results)
from .results import verdict as interval_side
from .evaluate import transfer_evaluations
from ..tasks.search.task import DIAGNOSTICS as TASK_DIAGNOSTICS
from ..tasks.search.task import SPLITS as TASK_SPLITS

SPLITS = list(TASK_SPLITS)  # general QA first, then multi-hop (the paper's column order)
GENERAL, MULTIHOP = SPLITS[:3], SPLITS[3:]
COLS = SPLITS + ["avg"]
DIAGNOSTICS = list(TASK_DIAGNOSTICS)  # the evaluation's diagnostics (``eval_diag/avg/<name>``), read when runs log them
PAPER = PACKAGE_ROOT / "reproductions" / "table2" / "paper_table2.csv"
ROWS = ["before RL", *METHOD_LABELS.values()]  # the paper's rows, then ours (the corrected tail)
METHODS = list(METHOD_LABELS.values())
EMA, FWD, REV, GRPO, WARP, PPO = (METHOD_LABELS[m] for m in ("ema", "ema_topk_forward", "ema_topk_reverse", "grpo",
                                                             "warp", "ppo"))  # the rows, by their methods' labels
#: the share of its own held-out EM a policy that reads keeps on worlds it never saw (issue 39's bar): the transfer
#: table tests unseen - TRANSFER_BAR x own, paired by seed
TRANSFER_BAR = 0.9
PALETTE = dict(zip(ROWS, sns.color_palette("colorblind", len(ROWS))))  # one colour per method in every panel


def per_run_scores(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, method, seed) with the final EM of each split and the average; plus 'before RL'."""
    missing = [f"final/eval/{s}/em" for s in SPLITS + ["avg"] if f"final/eval/{s}/em" not in runs]
    if missing:
        raise SystemExit(f"these runs are not search-task runs (no {missing[0]}); point --runs at a table2 sweep")
    runs = runs.copy()
    for when in ("final", "base"):  # where the answers came from, mean over the splits (NaN for runs without it)
        for d in DIAGNOSTICS:
            runs[f"{when}/eval/{d}/em"] = runs.get(f"{when}/eval_diag/avg/{d}", np.nan)
    final = runs[["run", "method", "seed"] + [f"final/eval/{s}/em" for s in COLS + DIAGNOSTICS]].rename(
        columns={f"final/eval/{s}/em": s for s in COLS + DIAGNOSTICS})
    base = runs[["run", "seed"] + [f"base/eval/{s}/em" for s in COLS + DIAGNOSTICS]].rename(
        columns={f"base/eval/{s}/em": s for s in COLS + DIAGNOSTICS}).drop_duplicates("seed").assign(method="before RL")
    return pd.concat([base, final], ignore_index=True)


def summarize(scores: pd.DataFrame) -> pd.DataFrame:
    long = scores.melt(id_vars=["run", "method", "seed"], value_vars=COLS, var_name="split", value_name="em")
    t = long.groupby(["method", "split"], sort=False)["em"].agg(mean="mean", std="std", n="count").reset_index()
    return t


def fmt(mean: float, std: float, n: int) -> str:
    if n == 0 or np.isnan(mean):
        return "—"
    return f"{mean:.3f} ± {std:.3f}" if n > 1 else f"{mean:.3f}"


def ours_markdown(t: pd.DataFrame) -> str:
    head = "| Method | " + " | ".join(COLS) + " | seeds |\n|---|" + "---:|" * (len(COLS) + 1)
    lines = [head]
    for m in ROWS:
        sub = t[t["method"] == m].set_index("split")
        if not len(sub):
            why = "missing (not run)"
            lines.append(f"| {m} | " + " | ".join([why] + ["—"] * (len(COLS) - 1)) + " | 0 |")
            continue
        cells = [fmt(sub.loc[s, "mean"], sub.loc[s, "std"], int(sub.loc[s, "n"])) for s in COLS]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {int(sub['n'].max())} |")
    lines += [gain_row(t.pivot(index="method", columns="split", values="mean"), "Improvement over GRPO (ours)")]
    return "\n".join(lines)


def gain_row(means: pd.DataFrame, label: str) -> str:
    if REV not in means.index or GRPO not in means.index:
        return f"| {label} | " + " | ".join(["—"] * len(COLS)) + " | |"
    cells = []
    for s in COLS:
        g, m = means.loc[GRPO, s], means.loc[REV, s]
        cells.append(f"{100 * (m - g) / g:+.1f}%" if g > 0 else ("0 → 0" if m == 0 else f"0 → {m:.3f}"))
    return f"| {label} | " + " | ".join(cells) + " | |"


def paper_markdown(paper: pd.DataFrame) -> str:
    lines = ["| Block | Method | " + " | ".join(COLS) + " |", "|---|---|" + "---:|" * len(COLS)]
    for _, r in paper.iterrows():
        lines.append(f"| {r['block']} | {r['method']} | " + " | ".join(f"{r[s]:.3f}" for s in COLS) + " |")
    rl = paper[paper["block"].str.contains("RL")].set_index("method")
    return "\n".join(lines + [gain_row(rl[COLS], "Improvement over GRPO (paper)").replace("| Improvement", "| | Improvement")])


def _rel_gains(means: pd.Series, base: pd.Series, splits: list[str]) -> float | None:
    if (base[splits] <= 0).any():
        return None
    return float(((means[splits] - base[splits]) / base[splits]).mean())


def paired(by_seed: pd.DataFrame, better: str, worse: str, col: str) -> tuple[np.ndarray, np.ndarray]:
    """``col`` of two methods on the seeds where both have it (``by_seed`` is indexed by method, seed), in seed
    order; empty arrays when they share none."""
    methods = by_seed.index.get_level_values("method")
    if better not in methods or worse not in methods:
        return np.array([]), np.array([])
    seeds = sorted(set(by_seed.loc[better, col].dropna().index) & set(by_seed.loc[worse, col].dropna().index))
    return tuple(by_seed.loc[[(m, s) for s in seeds], col].to_numpy(dtype=float) for m in (better, worse))


def orderings(scores: pd.DataFrame, paper: pd.DataFrame) -> list[dict]:
    """The paper's orderings, checked on the paper's numbers and on ours: paired by seed (same seed = same
    base policy and prompt stream), the mean difference with its 95% bootstrap interval over seeds, the
    verdict (holds: interval above 0, fails: below 0, undecided: contains 0) and the minimum detectable
    difference at this seed count. ``ours_holds`` is only the sign of the mean difference. Rows with
    ``claimed`` False (the corrected tail against the paper's, GRPO against PPO) make no claim: their verdict
    only says where the interval lies (higher / lower / undecided)."""
    scores = scores.assign(multihop=scores[MULTIHOP].mean(axis=1), general=scores[GENERAL].mean(axis=1))
    pm = paper[paper["block"].str.contains("RL")].set_index("method")[COLS]
    pm = pm.assign(multihop=pm[MULTIHOP].mean(axis=1), general=pm[GENERAL].mean(axis=1))
    om = scores.groupby("method")[COLS + DIAGNOSTICS + ["multihop", "general"]].mean()
    by_seed = scores.set_index(["method", "seed"])
    out = []

    def compare(claim, better, worse, col="avg", claimed=True):
        in_paper = col in pm and better in pm.index and worse in pm.index
        row = {"claim": claim, "paper": f"{pm.loc[better, col]:.3f} vs {pm.loc[worse, col]:.3f}",
               "paper_holds": bool(pm.loc[better, col] > pm.loc[worse, col])} if in_paper else \
              {"claim": claim, "paper": "— (ours, not the paper's)" if col not in pm else "— (not in the paper)",
               "paper_holds": None}
        row["claimed"] = claimed
        b, w = paired(by_seed, better, worse, col)
        if len(b):  # on the seeds both methods ran: a paired comparison (same seed = same base policy)
            d = paired_differences(b, w)
            lo, hi = bootstrap_ci(d)
            row.update(ours=f"{b.mean():.3f} vs {w.mean():.3f} (Δ {d.mean():+.4f})", ours_holds=bool(d.mean() > 0),
                       ci=f"[{lo:+.3f}, {hi:+.3f}]" if len(d) > 1 else "—",
                       verdict=claim_verdict(lo, hi) if claimed else interval_side(lo, hi),
                       mde=min_detectable(d), n_detect=seeds_to_detect(d), p=sign_flip_p(d),
                       seeds=f"Δ per seed: {', '.join(f'{x:+.3f}' for x in d)}; {seed_tally(d)}")
        else:
            row.update(ours="missing", ours_holds=None, ci="—", verdict="missing", mde=float("nan"), n_detect=float("nan"),
                       p=float("nan"), seeds="")
        out.append(row)

    compare("EMA anchor > GRPO (avg)", EMA, GRPO)
    compare("Top-k forward > K3, both with the EMA anchor (avg)", FWD, EMA)
    compare("Top-k reverse > K3, both with the EMA anchor (avg)", REV, EMA)
    compare("GRPO > WARP (token-level beats sequence-level KL, §6)", GRPO, WARP)
    compare("RL raises multi-hop EM: Top-k reverse > before RL (mean of the 4 multi-hop splits)", REV, "before RL",
            "multihop")
    compare("RL raises multi-hop EM: GRPO > before RL (multi-hop mean)", GRPO, "before RL", "multihop")
    compare("Top-k reverse > GRPO on multi-hop (multi-hop mean)", REV, GRPO, "multihop")
    compare("Top-k reverse > GRPO on general QA (general mean)", REV, GRPO, "general")

    row = {"claim": "relative gain over GRPO (Top-k reverse) larger on multi-hop than on general QA", "claimed": True}
    pg, pmh = _rel_gains(pm.loc[REV], pm.loc[GRPO], GENERAL), _rel_gains(pm.loc[REV], pm.loc[GRPO], MULTIHOP)
    row.update(paper=f"{100 * pmh:+.1f}% vs {100 * pg:+.1f}%", paper_holds=bool(pmh > pg), ci="—", mde=float("nan"),
               n_detect=float("nan"), p=float("nan"), verdict="(descriptive)")
    if REV in om.index and GRPO in om.index:
        og, omh = _rel_gains(om.loc[REV], om.loc[GRPO], GENERAL), _rel_gains(om.loc[REV], om.loc[GRPO], MULTIHOP)
        ag = float((om.loc[REV, GENERAL] - om.loc[GRPO, GENERAL]).mean())
        amh = float((om.loc[REV, MULTIHOP] - om.loc[GRPO, MULTIHOP]).mean())
        if og is None or omh is None:
            row.update(ours=f"undefined: GRPO scores 0 on a split (absolute gains: multi-hop {amh:+.3f}, general {ag:+.3f})",
                       ours_holds=None, seeds="")
        else:
            row.update(ours=f"{100 * omh:+.1f}% vs {100 * og:+.1f}%", ours_holds=bool(omh > og), seeds="")
    else:
        row.update(ours="missing", ours_holds=None, seeds="")
    out.append(row)

    # ours, not the paper's: does RL's gain reach held-out questions, and is it reading rather than recall?
    compare("RL raises held-out EM: Top-k reverse > before RL (avg)", REV, "before RL")
    if scores["read_em"].notna().any():  # runs that log the evaluation's diagnostics
        compare("RL reads better: Top-k reverse's EM given a passage with the answer > before RL (read_em)", REV,
                "before RL", "read_em")
        compare("RL recalls less: answers no passage holds, before RL > Top-k reverse (recalled)", "before RL",
                REV, "recalled")

    # beside the claims, no claim made: the tail the paper printed against the one unbiased in gradient, and PPO
    for fwd_rev, paper_tail in (("forward", FWD), ("reverse", REV)):
        compare(f"Top-k {fwd_rev}: corrected tail − paper's tail (avg)", f"{paper_tail} (corrected tail)",
                paper_tail, claimed=False)
    compare("GRPO − PPO (avg)", GRPO, PPO, claimed=False)
    return out


def answer_sources(scores: pd.DataFrame) -> pd.DataFrame:
    """Where each method's answers came from, before RL and after, on the seeds that logged the diagnostics.

    One row per (method, diagnostic): the mean before RL and after over those seeds, the mean paired change and
    its 95% bootstrap interval. Descriptive: no claim rests on it beyond R2/R3 (``orderings``)."""
    by_seed = scores.set_index(["method", "seed"])
    rows = []
    for m in [m for m in METHODS if m in set(scores["method"])]:
        for d in DIAGNOSTICS:
            a, b = paired(by_seed, m, "before RL", d)
            if not len(a):
                continue
            lo, hi = bootstrap_ci(paired_differences(a, b)) if len(a) > 1 else (np.nan, np.nan)
            rows.append({"method": m, "diagnostic": d, "seeds": len(a), "before": b.mean(), "after": a.mean(),
                         "delta": (a - b).mean(), "lo": lo, "hi": hi})
    return pd.DataFrame(rows, columns=["method", "diagnostic", "seeds", "before", "after", "delta", "lo", "hi"])


def answer_sources_markdown(src: pd.DataFrame) -> list[str]:
    if not len(src):
        return []
    cell = lambda r: (f"{r.before:.3f} → {r.after:.3f} ({r.delta:+.3f}"
                      + (f" [{r.lo:+.3f}, {r.hi:+.3f}])" if not np.isnan(r.lo) else ")"))
    md = ["## Where the answers came from (descriptive, not a claim)", "",
          "Mean over the seeds that logged the evaluation's diagnostics, before RL → after (mean paired change "
          "[95% bootstrap interval]). " + "; ".join(f"`{d}`: {what}" for d, what in TASK_DIAGNOSTICS.items()) + ".", "",
          "| Method | seeds | " + " | ".join(f"`{d}`" for d in DIAGNOSTICS) + " |", "|---|---:|" + "---|" * len(DIAGNOSTICS)]
    for m, g in src.groupby("method", sort=False):
        by = g.set_index("diagnostic")
        md.append(f"| {m} | {int(g['seeds'].max())} | "
                  + " | ".join(cell(by.loc[d]) if d in by.index else "—" for d in DIAGNOSTICS) + " |")
    return md + [""]


def transfer_scores(runs: pd.DataFrame) -> pd.DataFrame:
    """Held-out avg EM of each run's final policy on its own world and on worlds it never saw, from the run's
    ``evaluations/policy_transfer<N>.json`` (``python -m ema_pg.evaluate RUN --transfer N``; the largest N if
    several): one row per run that has one (run, method, seed, own, transfer, worlds)."""
    rows = []
    for r in runs.itertuples():
        found = transfer_evaluations(r.run_dir)  # not those with other overrides
        if found:
            ev = json.loads(found[max(found)].read_text())
            rows.append({"run": r.run, "method": r.method, "seed": r.seed, "own": ev["avg"],
                         "transfer": ev["transfer"]["avg"], "worlds": len(ev["transfer"]["seeds"])})
    return pd.DataFrame(rows, columns=["run", "method", "seed", "own", "transfer", "worlds"])


def transfer_markdown(tr: pd.DataFrame) -> list[str]:
    """The transfer column: per method, held-out avg EM on its own world and on unseen worlds, and their ratio
    (the paired ratio of the means over seeds)."""
    if not len(tr):
        return []
    md = ["## Worlds never seen in training", "",
          "Held-out avg EM of the final policy on its own world and on worlds built from other seeds (other names and "
          "facts; the same worlds for every run: `python -m ema_pg.evaluate RUN --transfer N`), mean ± std over seeds. "
          "A policy that reads scores alike on both; one that recalls its world's facts does not. "
          f"unseen − {TRANSFER_BAR} × own: its mean over seeds, paired by seed, with the 95% bootstrap interval; "
          f"**holds** = the interval lies above 0 (the policy keeps at least {TRANSFER_BAR:.0%} of its own EM on unseen "
          "worlds), **fails** = below 0, **undecided** = it contains 0.", "",
          f"| Method | own world | unseen worlds | unseen / own | unseen − {TRANSFER_BAR} × own [95% CI] | verdict | worlds "
          "| seeds |", "|---|---:|---:|---:|---|---|---:|---:|"]
    for m, g in tr.groupby("method", sort=False):
        ratio = g["transfer"].mean() / g["own"].mean() if g["own"].mean() > 0 else np.nan
        d = paired_differences(g["transfer"], TRANSFER_BAR * g["own"])
        lo, hi = bootstrap_ci(d)
        interval = f"{d.mean():+.3f} [{lo:+.3f}, {hi:+.3f}]" if len(d) > 1 else f"{d.mean():+.3f}"
        md.append(f"| {m} | {fmt(g['own'].mean(), g['own'].std(), len(g))} | "
                  f"{fmt(g['transfer'].mean(), g['transfer'].std(), len(g))} | {_num(ratio)} | {interval} | "
                  f"**{claim_verdict(lo, hi)}** | {int(g['worlds'].max())} | {len(g)} |")
    return md + [""]


def _num(x: float) -> str:
    return "—" if np.isnan(x) else f"{x:.3f}"


def verdict(x) -> str:
    return "yes" if x is True else "no" if x is False else "n/a"


def plot(t: pd.DataFrame, paper: pd.DataFrame, out: Path) -> None:
    set_style()
    methods = [m for m in ROWS if m in set(t["method"])]
    ours = t[t["method"].isin(methods)].assign(source="ours")
    pl = paper[paper["block"].str.contains("RL")].melt(id_vars=["block", "method"], value_vars=COLS, var_name="split",
                                                       value_name="mean").assign(std=0.0, source="paper")
    fig, axes = plt.subplots(1, 2, figsize=(14, 4), sharey=False)
    for ax, (src, df) in zip(axes, (("ours (mean ± std over seeds)", ours), ("paper (Qwen2.5-3B base)", pl))):
        order = [m for m in ROWS if m in set(df["method"])]
        sns.barplot(df, x="split", y="mean", hue="method", hue_order=order, order=COLS, ax=ax, alpha=0.85,
                    palette=PALETTE)
        if src.startswith("ours"):  # error bars from the seeds' std
            for cont, m in zip(ax.containers, order):
                sub = df[df["method"] == m].set_index("split").reindex(COLS)
                xs = [b.get_x() + b.get_width() / 2 for b in cont]
                ax.errorbar(xs, sub["mean"], yerr=sub["std"].fillna(0), fmt="none", ecolor="k", lw=0.8, capsize=2)
        ax.set(title=f"Table 2, {src}", ylabel="exact match", xlabel="")
        ax.legend(fontsize=7)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(out / f"table2.{ext}")
    plt.close(fig)


def plot_curves(runs: pd.DataFrame, out: Path) -> None:
    set_style()
    curves = load_curves(runs)
    curves = curves[curves["metric"].isin(["eval/avg/em", "eval/hotpotqa/em", "eval/nq/em"])]
    if not len(curves):
        return
    g = sns.relplot(curves, x="step", y="value", hue="method", col="metric", kind="line", errorbar="sd", marker="o",
                    hue_order=[m for m in METHODS if m in set(curves["method"])], height=3.2, aspect=1.2, palette=PALETTE,
                    facet_kws={"sharey": False})
    g.set_axis_labels("RL iteration", "exact match")
    g.figure.suptitle("Table 2 runs: evaluation during RL (mean ± std over seeds)", y=1.03)
    for ext in ("png", "pdf"):
        g.figure.savefig(out / f"table2_curves.{ext}")
    plt.close(g.figure)


def provenance(runs: pd.DataFrame, scale: str, command: str) -> list[str]:
    knobs = ["model.hidden_size", "model.num_layers", "sft.steps", "algo.iterations", "algo.prompts_per_step",
             "algo.group_size", "algo.beta", "optim.lr", "anchor.eta", "anchor.update_every", "kl.k", "task.per_split"]
    return provenance_lines(runs, scale, command, knobs, "table2_runs.csv")


def main(argv=None) -> dict:
    a, out, runs = table_args("table2", __doc__, argv)
    runs["method"] = runs["method"].map(method_label)  # ids -> Table 2's row labels, for printing
    paper = pd.read_csv(PAPER)
    scores = per_run_scores(runs)
    t = summarize(scores)
    t.to_csv(out / "table2.csv", index=False)
    runs[["run", "method", "seed", "finished", "iteration", "wall_s", "commit", "run_dir"]
         + [f"final/eval/{s}/em" for s in COLS]].to_csv(out / "table2_runs.csv", index=False)
    checks = orderings(scores, paper)
    (out / "orderings.json").write_text(json.dumps(checks, indent=1))
    plot(t, paper, out)
    plot_curves(runs, out)
    head = ["| Claim | Paper | Holds in paper | Ours | 95% CI of Δ | Verdict | min. Δ | seeds for Δ | p | Seed by seed |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    md = [f"# Table 2 reproduction ({a.scale} scale)", "", *provenance(runs, a.scale, a.command), "",
          "## Ours: exact match per split, mean ± std over seeds", "", ours_markdown(t), "",
          "A method without runs is shown as missing; nothing is filled in. PPO is `method=ppo` (a critic with GAE). "
          "WARP is the paper's characterisation of it: EMA anchor + sequence-level KL in the reward (eq. 10-12).", "",
          "## The paper's Table 2", "", paper_markdown(paper), "",
          "## The paper's orderings, checked on ours", "",
          "Ours: paired by seed; **holds** = the 95% bootstrap interval of the mean paired difference lies above 0, "
          "**fails** = below 0, **undecided** = it contains 0; min. Δ = the smallest difference these seeds would "
          "detect (2.8 × paired std / √seeds); seeds for Δ = how many seeds would detect the observed Δ by the same rule "
          "(what an undecided verdict needs, if the paired spread stays as it is); p = the exact one-sided sign-flip p-value over seeds, a check beside "
          "the verdict (at 5 seeds it cannot go below 1/32 = 0.031).", "",
          *head]
    row = (lambda c: f"| {c['claim']} | {c['paper']} | {verdict(c['paper_holds'])} | {c['ours']} | {c['ci']} | "
           f"**{c['verdict']}** | {_num(c['mde'])} | {format_seeds(c['n_detect'])} | {_num(c['p'])} | {c['seeds']} |")
    md += [row(c) for c in checks if c["claimed"]]
    beside = [c for c in checks if not c["claimed"]]
    if beside:
        md += ["", "Beside the claims, with no claim made (the same test; **higher** / **lower** = the interval lies "
               "above / below 0, **undecided** = it contains 0): the corrected tail against the paper's printed one, "
               "and PPO.", "", *head, *[row(c) for c in beside]]
    if "mean/train/kl_pg_grad_ratio" in runs and runs["mean/train/kl_pg_grad_ratio"].notna().any():
        ratio = runs.groupby("method")["mean/train/kl_pg_grad_ratio"].agg(["mean", "min", "max"])
        md += ["", "The KL term's pull next to the policy gradient's (‖∇βKL‖ / ‖∇J‖, ratio of the mean norms over a "
               "run's measurements, `monitor.grad_ratio_every`; mean [min, max] over seeds): "
               + "; ".join(f"{m} {r['mean']:.3g} [{r['min']:.3g}, {r['max']:.3g}]"
                           for m, r in ratio.reindex([m for m in METHODS if m in ratio.index]).iterrows()) + "."]
    tr = transfer_scores(runs)
    if len(tr):
        tr.to_csv(out / "transfer.csv", index=False)
    md += ["", *transfer_markdown(tr)]
    src = answer_sources(scores)
    src.to_csv(out / "answer_sources.csv", index=False)
    md += ["", *answer_sources_markdown(src)]
    md += ["", "![per split](table2.png)", "", "![curves](table2_curves.png)", ""]
    write_results(out, md)
    return {"table": t, "orderings": checks, "out": out}


if __name__ == "__main__":
    main()
