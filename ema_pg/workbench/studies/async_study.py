"""Issue 40's study, its report: the EMA anchor's benefit under rollout staleness (``sweeps/async_anchor.yaml``).

    python -m ema_pg.reports async_anchor --runs runs/reproduce/async_anchor-mini --out reproductions/async_anchor

Arms: ``rollout.max_staleness`` in {0, 1, 2} x {fixed anchor, EMA aligned current, EMA aligned behaviour}, paired
by seed. The claims, their directions and the test are the pre-registration's (reproductions/async_anchor/README.md):
final held-out EM, the mean paired difference over seeds and its 95% percentile bootstrap interval.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ...cli import command_parser
from ..results import (bootstrap_ci, claim_verdict, format_seeds, load_curves, load_runs, min_detectable, paired_sd,
                      paired_differences, seed_tally, seeds_to_detect, set_style, verdict)

METRIC = "final/eval/avg/em"
ARMS = {"fixed": "fixed anchor", "ema_current": "EMA, aligned current", "ema_behaviour": "EMA, aligned behaviour"}
STALENESS = (0, 1, 2)
#: the pre-registered claims: id -> (what, the difference as ((arm, staleness), sign) terms, kind)
#: kind "greater": holds if the interval is above 0; "two-sided": grows / shrinks / undecided
CLAIMS = {
    "E0": ("EMA beats the fixed anchor, synchronous (staleness 0)",
           [(("ema_current", 0), 1), (("fixed", 0), -1)], "greater"),
    "E1": ("EMA (aligned current) beats the fixed anchor at staleness 1",
           [(("ema_current", 1), 1), (("fixed", 1), -1)], "greater"),
    "E2": ("EMA (aligned current) beats the fixed anchor at staleness 2",
           [(("ema_current", 2), 1), (("fixed", 2), -1)], "greater"),
    "H": ("the EMA benefit changes from staleness 0 to 2: (EMA - fixed at 2) - (EMA - fixed at 0)",
          [(("ema_current", 2), 1), (("fixed", 2), -1), (("ema_current", 0), -1), (("fixed", 0), 1)], "two-sided"),
    "B1": ("aligning the anchor to the behaviour version beats the current anchor at staleness 1",
           [(("ema_behaviour", 1), 1), (("ema_current", 1), -1)], "greater"),
    "B2": ("aligning the anchor to the behaviour version beats the current anchor at staleness 2",
           [(("ema_behaviour", 2), 1), (("ema_current", 2), -1)], "greater"),
    "D1": ("(descriptive) what staleness 2 costs the EMA run: EMA at 2 - EMA at 0",
           [(("ema_current", 2), 1), (("ema_current", 0), -1)], "two-sided"),
    "D2": ("(descriptive) what staleness 2 costs the fixed-anchor run: fixed at 2 - fixed at 0",
           [(("fixed", 2), 1), (("fixed", 0), -1)], "two-sided"),
}
TRAIN_STATS = ("train/kl", "train/clip_frac_high", "train/clip_frac_low", "train/approx_kl_old", "anchor/lag_norm")
#: an inference engine's mismatch with the trainer's pi_old (runs with rollout=vllm log them)
ENGINE_STATS = ("rollout/mismatch_kl_k3", "rollout/logp_gap_max")
TIME_STATS = ("time/step_s", "time/rollout_wait_s", "time/rollout_worker_s")  #: shown as step s, waited s, worker s


def arm_of(row) -> str:
    """The arm from the run's config: its anchor scheme and, for the EMA, its alignment."""
    return "fixed" if row["anchor_scheme"] == "fixed" else f"{row['anchor_scheme']}_{row['anchor.align']}"


def decide(table: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for cid, (what, terms, kind) in CLAIMS.items():
        d = paired_differences(sum(sign * table[key] for key, sign in terms), 0.0)
        lo, hi = bootstrap_ci(d)
        v = claim_verdict(lo, hi) if kind == "greater" else {"higher": "grows", "lower": "shrinks"}.get(
            verdict(lo, hi), "undecided") if cid == "H" else verdict(lo, hi)
        rows.append({"id": cid, "claim": what, "kind": kind, "mean": d.mean(), "sd": paired_sd(d), "ci_lo": lo,
                     "ci_hi": hi, "verdict": v, "mde": min_detectable(d), "seeds_to_decide": seeds_to_detect(d),
                     "tally": seed_tally(d), "per_seed": " ".join(f"{x:+.3f}" for x in d)})
    return pd.DataFrame(rows)


def main(argv=None) -> dict:
    ap = command_parser(__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--all", action="store_true", help="(refused: the verdicts need every run finished)")
    a = ap.parse_args(argv)
    runs = load_runs(a.runs)
    if (~runs.finished).any() or a.all:
        raise SystemExit(f"{int((~runs.finished).sum())} runs did not finish; the verdicts need all of them")
    runs["arm"] = runs.apply(arm_of, axis=1)
    runs["staleness"] = runs["rollout.max_staleness"].astype(int)
    table = runs.pivot_table(index="seed", columns=["arm", "staleness"], values=METRIC)
    missing = [(arm, s) for arm in ARMS for s in STALENESS if (arm, s) not in table.columns]
    if missing or table.isna().any().any():
        raise SystemExit(f"arms without every seed: {missing or 'some seeds missing'}")
    res = decide(table)
    same0 = bool(np.array_equal(table[("ema_current", 0)].values, table[("ema_behaviour", 0)].values))
    stats = {}
    shown = TRAIN_STATS + (ENGINE_STATS if (runs["rollout.name"] == "vllm").any() else ())
    for r in runs.itertuples():
        df = pd.read_csv(Path(r.run_dir) / "metrics.csv")
        for c in shown + TIME_STATS:
            if c in df:
                stats.setdefault((r.arm, r.staleness, c), []).append(float(df[c].dropna().mean()))
    a.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(a.out / "final_em.csv", float_format="%.4f")
    res.to_csv(a.out / "verdicts.csv", index=False, float_format="%.4f")
    runs[["run", "arm", "staleness", "seed", METRIC, "base/eval/avg/em", "wall_s", "commit", "machine"]].sort_values(
        ["arm", "staleness", "seed"]).to_csv(a.out / "runs.csv", index=False, float_format="%.4f")
    base = runs.groupby("seed")["base/eval/avg/em"].first()
    cols = [(arm, s) for s in STALENESS for arm in ARMS]
    lines = ["# The EMA anchor under staleness: results (generated by `python -m ema_pg.reports async_anchor`)", "",
             f"- runs: {len(runs)} finished; commit(s) {', '.join(sorted(set(runs.commit)))}; machine(s) "
             f"{', '.join(sorted(set(runs.machine)))}; {runs.wall_s.sum() / 60:.0f} min of runs (sum)",
             "- which variant ran: " + _variant(runs),
             f"- staleness 0, EMA aligned current vs aligned behaviour: identical on every seed: **{same0}** (at "
             "staleness 0 the two are the same run)", "",
             "## Final held-out EM per seed", "",
             "before RL: " + ", ".join(f"seed {s} {base[s]:.3f}" for s in sorted(base.index)), "",
             "| seed | " + " | ".join(f"s{s} {ARMS[arm]}" for arm, s in cols) + " |", "|---:|" + "---:|" * len(cols)]
    for s, row in table.iterrows():
        lines.append(f"| {s} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    lines.append("| mean | " + " | ".join(f"{table[c].mean():.3f}" for c in cols) + " |")
    lines += ["", "## The pre-registered claims", "",
              "| id | claim | Δ mean ± sd | 95% CI | verdict | min. detectable Δ | seeds to decide | seed by seed |",
              "|---|---|---|---|---|---:|---:|---|"]
    for r in res.itertuples():
        lines.append(f"| {r.id} | {r.claim} | {r.mean:+.3f} ± {r.sd:.3f} | [{r.ci_lo:+.3f}, {r.ci_hi:+.3f}] | "
                     f"**{r.verdict}** | {r.mde:.3f} | {format_seeds(r.seeds_to_decide)} | {r.per_seed} ({r.tally}) |")
    lines += ["", "## What the runs did (means over iterations, then over seeds; descriptive)", "",
              "| staleness | arm | " + " | ".join(f"`{c}`" for c in shown) + " | step s | waited s | worker s |",
              "|---:|---|" + "---:|" * (len(shown) + len(TIME_STATS))]
    for s in STALENESS:
        for arm in ARMS:
            vals = [np.mean(stats.get((arm, s, c), [np.nan])) for c in
                    shown + TIME_STATS]
            lines.append(f"| {s} | {ARMS[arm]} | " + " | ".join(f"{v:.4g}" for v in vals) + " |")
    (a.out / "async_anchor.md").write_text("\n".join(lines) + "\n")
    _figure(runs, table, res, a.out)
    print(f"results: {a.out / 'async_anchor.md'}")
    return {"verdicts": res, "table": table}


def _variant(runs: pd.DataFrame) -> str:
    """The settings the arms share, read from the runs' configs."""
    def one(col, rows=runs):
        vals = sorted({str(v) for v in rows[col]}) if col in rows else ["?"]
        return "/".join(vals)

    ema = runs[runs.arm != "fixed"]

    return (f"task {one('task.name')}, kl={one('kl.name')} (k = {one('kl.k')}, tail {one('kl.tail')}), lr {one('optim.lr')}, "
            f"beta {one('algo.beta')}, {one('algo.iterations')} iterations of {one('algo.prompts_per_step')} prompts x "
            f"{one('algo.group_size')} samples, EMA eta {one('anchor.eta', ema)} every {one('anchor.update_every', ema)} "
            f"iterations (the EMA arms), {_sampler(runs)}")


def _sampler(runs: pd.DataFrame) -> str:
    """Which sampler the runs' configs name: the HF sampler, or a vLLM engine in its dtype."""
    names = sorted({str(v) for v in runs["rollout.name"]})
    if names != ["vllm"]:
        return f"rollouts by the {'/'.join(names)} sampler (in a worker process when staleness > 0)"
    dtypes = "/".join(sorted({str(v) for v in runs["rollout.engine_dtype"]}))
    return (f"rollouts on a vLLM engine (dtype {dtypes}, correction {'/'.join(sorted(set(runs['rollout.correction'])))}"
            "; in the trainer at staleness 0, in the worker process above)")


def _figure(runs: pd.DataFrame, table: pd.DataFrame, res: pd.DataFrame, out: Path) -> None:
    set_style()
    import matplotlib.pyplot as plt

    curves = load_curves(runs)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    colors = {"fixed": "tab:grey", "ema_current": "tab:blue", "ema_behaviour": "tab:orange"}
    em = curves[curves.metric == "eval/avg/em"].pivot_table(index="step", columns=["arm", "staleness", "seed"],
                                                             values="value")
    for ax in axes[1:3]:
        ax.sharey(axes[0])
    for ax, s in zip(axes[:3], STALENESS):
        for arm in ("ema_current", "ema_behaviour"):  # paired by seed: the same cold start and prompt stream
            d = em[arm][s] - em["fixed"][s]  # (steps, seeds)
            m, sd = d.mean(axis=1), d.std(axis=1, ddof=1)
            ax.plot(d.index, m, color=colors[arm], label=f"{ARMS[arm]} - fixed")
            ax.fill_between(d.index, m - sd, m + sd, color=colors[arm], alpha=0.15)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(f"staleness {s}")
        ax.set_xlabel("RL iteration")
        ax.set_ylabel("EMA - fixed, held-out EM (paired; mean ± sd)")
    axes[0].legend(fontsize=8)
    ax = axes[3]
    for arm, off in (("ema_current", -0.05), ("ema_behaviour", 0.05)):
        ms, los, his = [], [], []
        for s in STALENESS:
            d = paired_differences(table[(arm, s)], table[("fixed", s)])
            lo, hi = bootstrap_ci(d)
            ms.append(d.mean())
            los.append(d.mean() - lo)
            his.append(hi - d.mean())
        ax.errorbar(np.array(STALENESS) + off, ms, yerr=[los, his], marker="o", capsize=4, color=colors[arm],
                    label=f"{ARMS[arm]} - fixed")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(STALENESS)
    ax.set_xlabel("rollout.max_staleness")
    ax.set_ylabel("final EM, paired difference (95% CI)")
    ax.set_title("the EMA anchor's benefit vs staleness")
    ax.legend(fontsize=8)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(out / f"async_anchor.{ext}", dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    main()
