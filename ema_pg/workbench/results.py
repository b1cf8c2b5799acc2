"""Runs -> tables and figures: the loader and the report every analysis script uses.

    from ema_pg.workbench.results import load_runs, load_curves
    runs = load_runs("multirun/fig6_k")       # one row per run: config columns + final metrics
    curves = load_curves(runs)                # long form: one row per (run, step, metric)

A run is any folder holding ``config.yaml`` and ``metrics.csv`` (what ``ema_pg.train``
writes), found recursively, so a Hydra multirun folder, a ``runs/`` tree or an Optuna
study's trial folders all load the same way. Config columns are the resolved config
flattened with dots (``kl.name``, ``anchor.eta``, ...); derived columns name the method
(Table 2's row labels), the KL direction, the Fig 8 tail variant and the IW clip.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from ..cli import command_parser
from ..config import flatten
from ..engine.runs import run_commit

#: Display labels of the named methods (conf/method/<id>.yaml), in Table 2's row order; the run
#: table holds the ids, and reports map them to these labels only when they print.
METHOD_LABELS = {
    "warp": "WARP", "ppo": "PPO", "grpo": "GRPO", "ema": "EMA-PG: w/ EMA anchor",
    "ema_topk_forward": "+ Top-k forward KL", "ema_topk_reverse": "+ Top-k reverse KL",
    "ema_topk_forward_corrected": "+ Top-k forward KL (corrected tail)",
    "ema_topk_reverse_corrected": "+ Top-k reverse KL (corrected tail)",
    "grpo_adaptive": "fixed anchor, adaptive beta", "ema_adaptive": "EMA anchor, adaptive beta",
}
#: Fig 8's tail variants (ids), in the figure's order, and their labels
TAIL_VARIANTS = {"truncated": "truncated", "tail_no_iw": "tail w/o off-policy corr.", "tail_iw": "tail w/ off-policy corr."}


def method_label(method_id) -> str:
    """The display label of a method id (the id itself for methods without one; 'custom' for none)."""
    if method_id is None or (isinstance(method_id, float) and math.isnan(method_id)):
        return "custom"
    return METHOD_LABELS.get(method_id, str(method_id))


def set_style() -> None:
    """The one look of every figure the project draws; PDFs carry a fixed creation date (matplotlib reads
    ``SOURCE_DATE_EPOCH``), so re-drawing a report from the same runs gives the same bytes."""
    import seaborn as sns  # here, not at import: the commands that only read runs start without it (~1.7 s)

    os.environ.setdefault("SOURCE_DATE_EPOCH", "0")
    sns.set_theme(context="paper", style="whitegrid", palette="colorblind", font_scale=1.1)
    matplotlib.rcParams.update({"figure.dpi": 110, "savefig.bbox": "tight", "legend.frameon": False})


def find_runs(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist; point the loader at a folder of runs (a multirun or runs/ folder)")
    found = [p.parent for p in root.rglob("config.yaml") if (p.parent / "metrics.csv").is_file() and ".hydra" not in p.parts]
    return sorted(found)


def derived_columns(cfg: dict) -> dict:
    """Columns computed from a run's (nested) config values: method id, KL direction, IW clip, tail variant,
    anchor scheme (fixed / ema / reset / sync / teacher / none: ``anchor_scheme``)."""
    from ..anchors import scheme_of
    from ..kl import get_estimator

    kl = dict(cfg.get("kl", {}))
    params = {k: v for k, v in kl.items() if k != "name" and v is not None}
    est = get_estimator(kl.get("name", "none"), **params)
    d = {"method": cfg.get("method") or "custom", "direction": est.direction or "none"}
    d["anchor_scheme"] = scheme_of(dict(cfg.get("anchor", {})))
    clip = est.params.get("iw_clip")
    if clip is not None:
        d["iw_clip"] = clip_label(clip)
    if "tail" in est.params:
        d["tail"] = est.params["tail"]
        d["tail_variant"] = ("truncated" if est.params["tail"] == "none" else
                             "tail_no_iw" if tuple(clip) == (1.0, 1.0) else "tail_iw")
    return d


def clip_label(clip) -> str:
    """An importance-weight clip (s_min, s_max) as the reports group runs by it: ``[0, 2.5]``."""
    return f"[{clip[0]:g}, {clip[1]:g}]"


def wall_seconds(run: Path, final: dict, metrics: pd.DataFrame) -> float:
    """A run's wall time as it recorded it (see :func:`load_runs`)."""
    if "wall_s" in final:
        return float(final["wall_s"])
    if "time/elapsed_s" in metrics and metrics["time/elapsed_s"].notna().any():
        return float(metrics["time/elapsed_s"].max())
    return (run / "metrics.csv").stat().st_mtime - (run / "config.yaml").stat().st_mtime


def load_runs(root: str | Path, finished_only: bool = False) -> pd.DataFrame:
    """One row per run folder under ``root``: config columns, derived labels, final and base metrics.

    Metric columns: ``final/<metric>`` is the last logged value of every ``eval/...`` metric,
    ``base/<metric>`` its value at iteration 0 (the policy before RL); ``iteration`` is the last
    logged step, ``finished`` whether ``eval.json`` marks the run complete, ``wall_s`` the run's wall
    time as it recorded it (its processes summed over resumes: ``eval.json``'s ``wall_s``, else the last
    ``time/elapsed_s``; runs older than that record: from its start to its last metrics write, by the files' times), ``commit`` the git commit it ran from, ``machine`` the
    machine it ran on (``unknown`` for runs older than ``machine.txt``).
    """
    rows = []
    for run in find_runs(root):
        cfg = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=False)
        row = {**flatten(cfg), "run_dir": str(run), "run": run.name, **derived_columns(cfg)}  # the folder where it is
        # now (its config's run_dir is where it ran: a copied or moved run's differs)
        df = pd.read_csv(run / "metrics.csv")
        evals = [c for c in df.columns if c.startswith("eval")]
        ev = df.dropna(subset=evals, how="all").sort_values("step") if evals else df.iloc[:0]
        if len(ev):
            for c in evals:
                s = ev[["step", c]].dropna()
                if len(s):
                    row[f"final/{c}"] = s[c].iloc[-1]
                    if s["step"].iloc[0] == 0:
                        row[f"base/{c}"] = s[c].iloc[0]
        if "train/grad_norm_kl" in df:  # monitor.grad_ratio_every: the KL term's pull next to the policy gradient's,
            # as a ratio of the run's mean norms (an iteration whose groups all tie has no policy gradient at all)
            kl, pg = df["train/grad_norm_kl"].dropna(), df["train/grad_norm_pg"].dropna()
            row["mean/train/kl_pg_grad_ratio"] = float(kl.mean() / pg.mean()) if pg.mean() > 0 else float("nan")
        row["iteration"] = int(df["step"].max()) if len(df) else 0
        final = json.loads((run / "eval.json").read_text()) if (run / "eval.json").is_file() else {}
        row["finished"] = final.get("iteration", -1) >= int(cfg.get("algo", {}).get("iterations", 0))
        row["wall_s"] = wall_seconds(run, final, df)
        row["commit"] = run_commit(run)
        host = run / "machine.txt"
        row["machine"] = host.read_text().strip() if host.is_file() else "unknown"
        rows.append(row)
    out = pd.DataFrame(rows)
    if finished_only and len(out):
        out = out[out["finished"]].reset_index(drop=True)
    return out


def load_curves(runs: pd.DataFrame | str | Path, metrics: str = "eval") -> pd.DataFrame:
    """Per-step metrics in long form (run_dir, step, metric, value) joined with the runs' columns.

    ``metrics`` is a prefix (``eval`` = the evaluation curves, ``train/`` = training metrics).
    """
    if not isinstance(runs, pd.DataFrame):
        runs = load_runs(runs)
    parts = []
    for run_dir in runs["run_dir"] if len(runs) else []:
        df = pd.read_csv(Path(run_dir) / "metrics.csv")
        cols = [c for c in df.columns if c.startswith(metrics) and c != "step"]
        if not cols:
            continue
        long = df[["step"] + cols].melt(id_vars="step", var_name="metric", value_name="value").dropna()
        long["run_dir"] = run_dir
        parts.append(long)
    if not parts:
        return pd.DataFrame(columns=["run_dir", "step", "metric", "value"])
    long = pd.concat(parts, ignore_index=True)
    return long.merge(runs, on="run_dir", how="left")


def main_metric(runs: pd.DataFrame) -> str:
    """The average evaluation metric the runs logged (``eval/avg/em`` for both tasks)."""
    cands = sorted(c.removeprefix("final/") for c in runs.columns
                   if c.startswith("final/eval/avg/") and "@" not in c)  # not a sampled eval's pass@k / maj@N
    if not cands:
        raise ValueError("no run has an evaluation yet (no eval/avg/* column); are the runs still starting?")
    return cands[0]


def mean_std(x: pd.Series) -> str:
    x = x.dropna()
    if not len(x):
        return "—"
    return f"{x.mean():.3f} ± {x.std(ddof=1):.3f}" if len(x) > 1 else f"{x.mean():.3f}"


def summarize(runs: pd.DataFrame, by: list[str], metric: str) -> pd.DataFrame:
    """Mean, sample std and count over seeds of the final ``metric`` (and its value before RL)."""
    col = f"final/{metric}"
    g = runs.groupby(by, dropna=False, sort=False)
    out = g[col].agg(mean="mean", std="std", n="count").reset_index()
    if f"base/{metric}" in runs:
        out["base_mean"] = g[f"base/{metric}"].mean().values
    out["mean ± std"] = g[col].apply(mean_std).values
    return out


def paired_differences(better, worse) -> np.ndarray:
    """better - worse, seed by seed, with a difference below 1e-12 set to 0. Scores are means of a few hundred
    0/1 outcomes, so a smaller difference is float rounding of a tie (equal means summed from different parts: the 4-split
    means (0.1 + 0.2 + 0 + 0) / 4 and (0.3 + 0 + 0 + 0) / 4 differ by 1.4e-17), which would otherwise count
    as a win or a loss and could tip an interval's edge off 0."""
    d = np.asarray(better, dtype=float) - np.asarray(worse, dtype=float)
    return np.where(np.abs(d) < 1e-12, 0.0, d)


def seed_tally(d) -> str:
    """'better on W/N' seeds, with the ties when there are any."""
    d = np.asarray(d, dtype=float)
    ties = int((d == 0).sum())
    return f"better on {int((d > 0).sum())}/{len(d)}" + (f", tied on {ties}" if ties else "")


def bootstrap_ci(deltas, level: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired differences (resampling seeds)."""
    d = np.asarray(list(deltas), dtype=float)
    if len(d) < 2:
        return (float("nan"), float("nan"))
    means = np.random.default_rng(seed).choice(d, size=(n_boot, len(d)), replace=True).mean(1)
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def sign_flip_p(deltas) -> float:
    """Exact one-sided p-value of the paired sign-flip (randomization) test that the mean difference is > 0:
    the share of the 2^n sign assignments of |d| whose sum is at least the observed sum (ties with it count).
    It assumes only that, without an effect, each seed's difference is as likely negative as positive. At
    n = 5 its smallest value is 1/32, so no two-sided 5% test can be met with 5 seeds, and the percentile
    bootstrap, which can, is the more liberal of the two. nan with no seeds; n > 20 is refused (2^n sums)."""
    d = np.asarray(list(deltas), dtype=float)
    if len(d) == 0:
        return float("nan")
    if len(d) > 20:
        raise ValueError(f"sign_flip_p enumerates 2^n sign assignments; n = {len(d)} is too many (use <= 20)")
    signs = 1 - 2 * ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1)  # (2^n, n) of +-1
    return float(np.mean(signs @ np.abs(d) >= d.sum() - 1e-12))


def detect_z(alpha: float = 0.05, power: float = 0.8) -> float:
    """z_{1-alpha/2} + z_{power}, exact: a paired difference this many standard errors from 0 is found with chance
    ``power`` by a two-sided test at ``alpha``."""
    from scipy.special import ndtri

    return float(ndtri(1 - alpha / 2) + ndtri(power))


DETECT_Z = detect_z()  #: 2.80158 (80% power, two-sided 5%; reports round it to 2.8)


def paired_sd(deltas) -> float:
    """The sample standard deviation of paired differences (ddof 1); nan below two seeds, without numpy's warning."""
    d = np.asarray(list(deltas), dtype=float)
    return float(d.std(ddof=1)) if len(d) > 1 else float("nan")


def min_detectable(deltas) -> float:
    """The smallest mean paired difference these seeds would detect: 2.8 x the paired std / sqrt(seeds)
    (80% power, two-sided 5%); nan below two seeds."""
    d = np.asarray(list(deltas), dtype=float)
    return float(DETECT_Z * paired_sd(d) / np.sqrt(len(d))) if len(d) > 1 else float("nan")


def seeds_to_detect(deltas) -> float:
    """How many paired seeds would make the observed mean difference the minimum detectable one (the same
    rule as ``min_detectable``: 80% power, two-sided 5%), if the paired std stayed what these seeds show:
    ceil((2.8 x std / |mean|)^2). It is what an undecided verdict would need to be decided either way; inf
    when the mean difference is 0, nan below two seeds."""
    d = np.asarray(list(deltas), dtype=float)
    return seeds_for(float(d.mean()), paired_sd(d)) if len(d) > 1 else float("nan")


def seeds_for(mean: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """``seeds_to_detect`` from a mean paired difference and its paired std (as a sequential look reports them):
    ceil((:func:`detect_z` sd / |mean|)^2) with the exact normal quantiles (2.80158 at 5% and 80%; a rounded 2.8
    gave the claims plan's P2 one seed fewer, 465 for 465.6); at least 2."""
    m = abs(mean)
    if np.isnan(m) or np.isnan(sd):
        return float("nan")
    if m == 0:
        return float("inf") if sd > 0 else float("nan")
    return float(max(2, int(np.ceil((detect_z(alpha, power) * sd / m) ** 2))))


def seeds_for_t(mean: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The same count by the paired t test itself: the fewest seeds n whose two-sided t test at ``alpha`` finds
    the effect with chance >= ``power``, from the noncentral t distribution (n - 1 degrees of freedom, noncentrality
    |mean| / sd * sqrt(n)); a few more than :func:`seeds_for`'s normal count, which ignores that sd is estimated."""
    from scipy.stats import nct
    from scipy.stats import t as student_t

    n0 = seeds_for(mean, sd, alpha, power)
    if not np.isfinite(n0):
        return n0
    n = max(2, int(n0))
    while nct.sf(student_t.isf(alpha / 2, n - 1), n - 1, abs(mean) / sd * np.sqrt(n)) < power:
        n += 1
    return float(n)


def format_seeds(n: float) -> str:
    """A seed count from ``seeds_to_detect`` for a report: '—' when undefined, '> 1000' past any budget."""
    return "—" if np.isnan(n) else "> 1000" if n > 1000 else f"{int(n)}"


def verdict(lo: float, hi: float) -> str:
    """Where a difference's interval lies: higher (above 0) / lower (below 0) / undecided (it contains 0)."""
    if np.isnan(lo):
        return "undecided"
    return "higher" if lo > 0 else "lower" if hi < 0 else "undecided"


def claim_verdict(lo: float, hi: float) -> str:
    """The verdict on a claim that a difference is positive: holds (interval above 0) / fails (below 0) / undecided."""
    return {"higher": "holds", "lower": "fails"}.get(verdict(lo, hi), "undecided")


def paired_delta(runs: pd.DataFrame, by: list[str], metric: str, ref_x, x: str) -> pd.DataFrame | None:
    """Per group: final metric minus the reference variant's (``x == ref_x``, same hue) on the same seed,
    as mean ± std, its 95% paired bootstrap interval, and whether the interval is above, below or around 0."""
    col = f"final/{metric}"
    if "seed" not in runs or runs.groupby(by)["seed"].nunique().min() < 2:
        return None
    hue = [c for c in by if c != x]
    ref = runs[runs[x] == ref_x][hue + ["seed", col]].rename(columns={col: "ref"})
    merged = runs.merge(ref, on=hue + ["seed"], how="inner")
    if not len(merged):
        return None
    merged["delta"] = paired_differences(merged[col], merged["ref"])
    g = merged.groupby(by, sort=False)["delta"]
    out = g.apply(mean_std).reset_index().rename(columns={"delta": f"Δ vs {ref_x} (paired)"})
    cis = g.apply(lambda d: bootstrap_ci(d)).reset_index(drop=True)
    out["Δ 95% CI"] = [f"[{lo:+.3f}, {hi:+.3f}]" if not np.isnan(lo) else "—" for lo, hi in cis]
    out["Δ vs 0"] = [verdict(lo, hi) for lo, hi in cis]
    out["min. detectable Δ"] = g.apply(lambda d: f"{min_detectable(d):.3f}").values
    out["seeds to detect Δ"] = g.apply(lambda d: format_seeds(seeds_to_detect(d))).values
    return out


def _order(values, order):
    vals = list(dict.fromkeys(values))
    if order:
        return [o for o in order if o in vals] + [v for v in vals if v not in order]
    try:
        return sorted(vals, key=float)
    except (TypeError, ValueError):
        return sorted(vals, key=str)


def ablation_report(runs: pd.DataFrame, out: str | Path, x: str, hue: str | None = None, title: str = "",
                    order: list | None = None, name: str | None = None, metric: str | None = None,
                    labels: dict | None = None) -> dict:
    """The CSV/MD/PNG/PDF of one ablation: final metric by ``x`` (and ``hue``) over seeds, plus curves.

    Writes ``<name>.csv`` (one row per group: mean, std, n), ``<name>_runs.csv`` (one row per
    run), ``<name>.md`` (mean ± std) and ``<name>.png``/``.pdf`` (learning curves of the mean
    with a ±1 std band, and the final value per group with each seed as a dot).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name = name or out.name
    if not len(runs):
        raise ValueError(f"no runs to report for {name}; run the sweep first (make sweep NAME={name})")
    metric = metric or main_metric(runs)
    runs = runs.copy()
    by = [x] + ([hue] if hue else [])
    for c in by:
        runs[c] = runs[c].astype(str)
    if labels:  # ids -> display labels: the report is where they are printed
        runs[x] = runs[x].map(lambda v: labels.get(v, v))
        order = [labels.get(o, o) for o in order] if order else None
    table = summarize(runs, by, metric)
    xs = _order(runs[x], order)
    table = table.sort_values(x, key=lambda c: c.map({v: i for i, v in enumerate(xs)}), kind="stable")
    ref = paired_delta(runs, by, metric, xs[0], x)
    if ref is not None:
        table = table.merge(ref, on=by, how="left")
    g = runs.groupby(by, sort=False)
    if f"base/{metric}" in runs:  # runs that ended below their own cold start
        below = g.apply(lambda r: f"{int((r[f'final/{metric}'] < r[f'base/{metric}']).sum())}/{len(r)}")
        table = table.merge(below.rename("ended below base").reset_index(), on=by, how="left")
    if "mean/train/kl_pg_grad_ratio" in runs:
        ratio = g["mean/train/kl_pg_grad_ratio"].mean().map(lambda v: f"{v:.3g}").rename("‖∇βKL‖/‖∇J‖").reset_index()
        table = table.merge(ratio, on=by, how="left")
    keep = [c for c in ["run", "seed", *by, "finished", "iteration", f"base/{metric}", f"final/{metric}",
                        "mean/train/kl_pg_grad_ratio", "wall_s", "commit"] if c in runs]
    runs[keep].to_csv(out / f"{name}_runs.csv", index=False)
    table.to_csv(out / f"{name}.csv", index=False)
    dcol = [c for c in table.columns if c.startswith("Δ ") or c in ("min. detectable Δ", "seeds to detect Δ")]
    extra = [c for c in ("ended below base", "‖∇βKL‖/‖∇J‖") if c in table]
    md = [f"# {title or name}", "", f"Final `{metric}` over seeds (mean ± sample std; n = seeds)"
          + (f"; `{dcol[0]}`: the difference to that variant on the same seed (same cold start), mean ± std, "
             "with its 95% paired bootstrap interval over seeds and whether that interval lies above 0, below 0 or "
             "around it (undecided), and the smallest difference these seeds would detect (2.8 × paired std / √seeds: "
             "80% power, two-sided 5%), and how many seeds would detect the observed mean difference by that rule" if dcol else "") + ".", "",
          table[by + ["mean ± std", *dcol, *extra, "n"]].to_markdown(index=False, disable_numparse=True), "",
          *[f"**Not paired**: {w}." for w in unpaired_seeds(runs)],
          *(["`ended below base`: runs whose final value is below their own value before RL (iteration 0). "
             "`‖∇βKL‖/‖∇J‖`: the KL term's gradient norm over the policy gradient's (monitor.grad_ratio_every), "
             "as the ratio of the run's mean norms, averaged over seeds."] if extra else [])]
    (out / f"{name}.md").write_text("\n".join(md))

    import seaborn as sns

    set_style()
    curves = load_curves(runs)
    curves = curves[curves["metric"] == metric]
    for c in by:
        curves[c] = curves[c].astype(str)
    fig = Figure(figsize=(11, 3.8))  # no pyplot: no GUI backend is chosen or needed
    a1, a2 = fig.subplots(1, 2)
    label = (lambda r: f"{r[x]} / {r[hue]}") if hue else (lambda r: r[x])
    if len(curves):
        curves["variant"] = curves.apply(label, axis=1)
        variants = [label({x: v, hue: h}) for v in xs for h in (_order(runs[hue], None) if hue else [None])]
        sns.lineplot(curves, x="step", y="value", hue="variant", errorbar="sd", marker="o", ax=a1,
                     hue_order=[v for v in variants if v in set(curves["variant"])],
                     palette=None if hue else dict(zip(xs, sns.color_palette("colorblind", len(xs)))))
        a1.legend(fontsize=7)
    a1.set(xlabel="RL iteration", ylabel=metric, title="learning curves (mean ± std over seeds)")
    sns.barplot(runs, x=x, y=f"final/{metric}", hue=hue or x, order=xs, errorbar="sd", ax=a2, alpha=0.8,
                legend=bool(hue), hue_order=None if hue else xs,
                palette=None if hue else dict(zip(xs, sns.color_palette("colorblind", len(xs)))))
    sns.stripplot(runs, x=x, y=f"final/{metric}", hue=hue, order=xs, dodge=bool(hue), ax=a2, size=3, legend=False,
                  **({"palette": "dark:k"} if hue else {"color": "k"}))  # black dots, with or without hue
    a2.set(xlabel=x, ylabel=f"final {metric}", title="final (bars: mean ± std; dots: seeds)")
    a2.tick_params(axis="x", labelrotation=15)
    fig.suptitle(title or name)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(out / f"{name}.{ext}")
    return {"table": table, "runs": runs, "metric": metric, "files": sorted(str(p) for p in out.glob(f"{name}*"))}


def unpaired_seeds(runs: pd.DataFrame) -> list[str]:
    """Seeds whose runs should share one base policy but do not: a sentence each, empty when pairing holds.

    Runs with the same seed and the same cold-start knobs (``task.*``, ``sft.*``, the model's architecture:
    what :func:`ema_pg.engine.sft.cold_start_key` hashes) start from one cached base policy, which is what makes a
    difference between them paired. Their evaluations at iteration 0 must then agree exactly. They do not
    when the base policy was made again on another kind of machine (its float kernels round differently),
    or by other code: the seed's differences compare two starting points, not two methods."""
    from ..config import ARCH_KEYS

    base = [c for c in runs.columns if c.startswith("base/")]
    if not base or "seed" not in runs or not len(runs):
        return []
    keys = [c for c in runs.columns if (c.startswith(("task.", "sft.")) and c != "sft.cache_dir")
            or c in {f"model.{k}" for k in ARCH_KEYS}]
    out = []
    group = runs[["seed", *keys]].map(repr).agg("|".join, axis=1)  # (lists, None and NaN among the knobs group too)
    for _, g in runs.groupby(group, sort=False):
        values = g[base].round(12).drop_duplicates()
        if len(values) > 1:
            col = "base/eval/avg/em" if "base/eval/avg/em" in g else base[0]
            seen = ", ".join(f"{v:.3f}" for v in sorted(g[col].dropna().unique()))
            machines = sorted(set(g["machine"])) if "machine" in g else []
            out.append(f"seed {g['seed'].iloc[0]}: its {len(g)} runs began from {len(values)} different base policies "
                       f"(`{col}` before RL: {seen}; machines: {' / '.join(machines) or 'unknown'}), so its paired "
                       "differences compare starting points as well as methods")
    return out


def provenance_lines(runs: pd.DataFrame, scale: str, command: str, knobs: list[str], listing: str) -> list[str]:
    """A reproduction's provenance as Markdown bullets: scale and command, commits, runs per method, run time
    (the sum of the runs' wall times, and the wall clock from the first start to the last end), the values
    ``knobs`` took across runs, where each run's config is (``listing`` names the CSV of run folders), the
    machines the runs ran on, and a **not paired** line for each seed whose runs began from different base
    policies (:func:`unpaired_seeds`)."""
    def show(v):
        return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)

    start = min(Path(r, "config.yaml").stat().st_mtime for r in runs["run_dir"])
    end = max(Path(r, "metrics.csv").stat().st_mtime for r in runs["run_dir"])
    cfg = {k: sorted({show(v) for v in runs[k].dropna()}) for k in knobs if k in runs}
    lines = [f"- scale: `{scale}`" + (f"; command: `{command}`" if command else ""),
             f"- commit(s) the runs ran from: {', '.join(f'`{c}`' for c in sorted(set(runs['commit'])))}",
             f"- runs: {len(runs)} finished ({', '.join(f'{m}: {n}' for m, n in runs['method'].value_counts().items())})",
             f"- run time: {runs['wall_s'].sum() / 60:.1f} min of runs (sum), {(end - start) / 60:.1f} min wall clock "
             "from the first run's start to the last run's end",
             "- config (values across runs): " + "; ".join(f"`{k}`={'/'.join(v)}" for k, v in cfg.items()),
             f"- each run's resolved config: `config.yaml` in its run folder (`{listing}` lists the folders)",
             "- machine(s) the runs ran on: " + "; ".join(f"`{m}`" for m in sorted(set(runs.get("machine", ["unknown"]))))]
    return lines + [f"- **not paired**: {w}" for w in unpaired_seeds(runs)]


def table_args(name: str, doc: str, argv=None):
    """The command line of a table's writer (``ema_pg.workbench.table2``, ``ema_pg.workbench.table3``): runs, out, scale, command, all."""
    from ..engine.console import quiet_third_party

    quiet_third_party()

    ap = command_parser(doc)
    ap.add_argument("--runs", default=f"runs/reproduce/{name}-mini", help=f"the {name} sweep's folder")
    ap.add_argument("--out", default=f"reproductions/{name}")
    ap.add_argument("--scale", default="mini")
    ap.add_argument("--command", default="", help="the command that ran the sweep (for provenance)")
    ap.add_argument("--all", action="store_true", help="include unfinished runs")
    a = ap.parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    runs = load_runs(a.runs, finished_only=not a.all)
    if not len(runs):
        raise SystemExit(f"no finished runs under {a.runs}; run `make reproduce-{name}` (or pass --all)")
    return a, Path(a.out), runs


def write_results(out: Path, md: list[str]) -> Path:
    """A table's ``results.md``: the generated lines, then the hand-written ``discussion.md`` of the folder if any."""
    notes = out / "discussion.md"
    text = "\n".join(md + ([notes.read_text()] if notes.is_file() else []))
    (out / "results.md").write_text(text)
    print(f"wrote {out / 'results.md'}")
    return out / "results.md"
