"""Where the paired variance of a claim comes from: training seeds, or the evaluation's questions.

A claim "A > B" is decided on D_s = score(A, s) - score(B, s), paired by training seed s, where a score is the
mean over the splits of each split's mean reward over its questions. Every run is scored on the same questions, so
per split j, question q and seed s the paired reward difference d_sjq (in {-1, 0, 1} for exact match) follows a
two-way layout without replication:

    d_sjq = mu_j + a_sj + b_jq + e_sjq     (seed, question and seed-by-question parts)

and with n_j questions in split j (J splits):

- **the seeds' part**, sigma2_seed = Var(a_s), a_s the mean of a_sj over splits: what more seeds average away;
- **the questions' part of the seed-to-seed spread**, sum_j sigma2_e,j / (J^2 n_j): a seed's policy answers some
  questions well by chance, so D_s moves with the question set; it shrinks as 1 / n with more questions per split;
- **the common questions' offset**, sum_j sigma2_b,j / (J^2 n_j): every seed sees the same questions, so what those
  questions favour is shared by all seeds; it is not in the seeds' spread (nor in a bootstrap over seeds) but it
  is what the claim would move by on another draw of questions.

The observed Var_s(D_s) estimates sigma2_seed + the questions' part; sigma2_e,j is the mean square of the two-way
residuals and sigma2_b,j = (MS_questions - sigma2_e,j) / S (the method of moments; negative estimates are 0). The
projected paired variance at n questions per split is sigma2_seed + sum_j sigma2_e,j / (J^2 n). Beside the model,
the spread is also measured directly, by scoring every seed on random subsets of n questions per split (the same
subset for every seed, as the design has it).

    python -m ema_pg.workbench.variance --runs runs/reproduce/table2-claims_pilot --eval policy_task.per_split-500 \\
        --pair ema:grpo --pair ema_topk_forward:ema --pair ema_topk_reverse:ema --out reproductions/table2/claims/variance
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ...cli import command_parser
from ..results import DETECT_Z, write_results


def per_question(runs: Path, eval_name: str) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    """{(method, seed): {split: per-problem rewards}} of every run under ``runs`` with the evaluation ``eval_name``
    (``<run>/evaluations/<eval_name>.json``, as ``python -m ema_pg.evaluate RUN <overrides>`` writes it; ``eval`` =
    the run's own final evaluation, ``eval.json``)."""
    from omegaconf import OmegaConf

    out = {}
    for run in sorted(p.parent for p in Path(runs).rglob("config.yaml")):
        f = run / "eval.json" if eval_name == "eval" else run / "evaluations" / f"{eval_name}.json"
        if not f.is_file():
            continue
        cfg = OmegaConf.load(run / "config.yaml")
        res = json.loads(f.read_text())
        if any("per_problem" not in v for v in res["splits"].values()):
            raise SystemExit(f"{f} has no per-problem rewards (an evaluation from before they were kept): evaluate "
                             "the run again")
        out[(str(cfg.get("method") or cfg.name), int(cfg.seed))] = {k: np.asarray(v["per_problem"], dtype=float)
                                                                     for k, v in res["splits"].items()}
    return out


def components(d: dict[str, np.ndarray]) -> dict:
    """The variance components of paired differences ``d[split]`` (seeds x questions), splits weighted equally."""
    J = len(d)
    S = next(iter(d.values())).shape[0]
    if S < 3:
        raise ValueError(f"{S} seeds: the seeds' part needs at least 3")
    D = np.mean([x.mean(1) for x in d.values()], axis=0)  # (S,) each seed's paired score difference
    e, b, n = {}, {}, {}
    for j, x in d.items():
        n[j] = x.shape[1]
        resid = x - x.mean(1, keepdims=True) - x.mean(0, keepdims=True) + x.mean()
        e[j] = float((resid ** 2).sum() / ((S - 1) * (n[j] - 1)))
        ms_q = float(S * x.mean(0).var(ddof=1))
        b[j] = max(0.0, (ms_q - e[j]) / S)
    total = float(D.var(ddof=1))
    q_part = sum(e[j] / n[j] for j in d) / J ** 2
    return {"seeds": S, "questions_per_split": n, "mean_difference": float(D.mean()), "observed_var": total,
            "questions_var": q_part, "seed_var": max(0.0, total - q_part), "common_offset_var": sum(b[j] / n[j] for j in d) / J ** 2,
            "interaction_var_per_split": e, "question_var_per_split": b}


def projected_var(c: dict, n: int) -> float:
    """The paired variance of D_s at ``n`` questions per split."""
    J = len(c["interaction_var_per_split"])
    return c["seed_var"] + sum(v / n for v in c["interaction_var_per_split"].values()) / J ** 2


def subsampled_sd(d: dict[str, np.ndarray], n: int, draws: int = 200, seed: int = 0) -> float:
    """The seed-to-seed sd of D_s when every seed is scored on the same random ``n`` questions per split, averaged
    (as a variance) over ``draws`` subsets."""
    rng = np.random.default_rng(seed)
    v = []
    for _ in range(draws):
        D = np.mean([x[:, rng.choice(x.shape[1], size=min(n, x.shape[1]), replace=False)].mean(1) for x in d.values()],
                    axis=0)
        v.append(D.var(ddof=1))
    return float(np.sqrt(np.mean(v)))


def analyse(table, pairs: list[tuple[str, str]], sizes=(25, 50, 100, 200, 500)) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    rows, curve, comps = [], [], {}
    for better, worse in pairs:
        seeds = sorted({s for m, s in table if m == better} & {s for m, s in table if m == worse})
        if len(seeds) < 3:
            raise SystemExit(f"{better} vs {worse}: {len(seeds)} paired seeds; the analysis needs at least 3")
        splits = list(table[(better, seeds[0])])
        d = {j: np.stack([table[(better, s)][j] - table[(worse, s)][j] for s in seeds]) for j in splits}
        c = components(d)
        name = f"{better} - {worse}"
        comps[name] = c
        share = c["questions_var"] / c["observed_var"] if c["observed_var"] > 0 else float("nan")
        rows.append({"pair": name, "seeds": len(seeds), "questions per split": min(c["questions_per_split"].values()),
                     "mean D": c["mean_difference"], "sd of D (observed)": np.sqrt(c["observed_var"]),
                     "seeds' sd": np.sqrt(c["seed_var"]), "questions' sd": np.sqrt(c["questions_var"]),
                     "questions' share": share, "common offset sd": np.sqrt(c["common_offset_var"])})
        for n in sizes:
            if n > min(c["questions_per_split"].values()):
                continue
            sd_model = np.sqrt(projected_var(c, n))
            curve.append({"pair": name, "questions per split": n, "sd (model)": sd_model,
                          "sd (subsets)": subsampled_sd(d, n), "questions' share (model)":
                          1 - c["seed_var"] / projected_var(c, n) if projected_var(c, n) > 0 else float("nan"),
                          "seeds to detect mean D": (DETECT_Z * sd_model / abs(c["mean_difference"])) ** 2
                          if c["mean_difference"] else float("inf")})
    return pd.DataFrame(rows), pd.DataFrame(curve), comps


def plot(curve: pd.DataFrame, out: Path) -> None:
    import matplotlib.pyplot as plt

    from ..results import set_style

    set_style()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (pair, g) in enumerate(curve.groupby("pair", sort=False)):
        color = f"C{i}"
        ax.plot(g["questions per split"], g["sd (model)"], "-", color=color, label=f"{pair} (model)")
        ax.plot(g["questions per split"], g["sd (subsets)"], "o", color=color, label=f"{pair} (question subsets)")
    ax.set_xscale("log")
    ax.set_xlabel("questions per split (7 splits)")
    ax.set_ylabel("sd over seeds of the paired difference")
    ax.set_title("Paired spread against evaluation size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(out / f"variance.{ext}", dpi=150)
    plt.close(fig)


def main(argv=None) -> int:
    from ...engine.console import quiet_third_party

    quiet_third_party()  # no third-party warnings, bars or log lines on a command's console
    ap = command_parser(__doc__)
    ap.add_argument("--runs", type=Path, required=True, help="a folder of run folders (a sweep's)")
    ap.add_argument("--eval", default="eval", help="the evaluation to read: 'eval' (the run's own eval.json) or the "
                                                   "stem of <run>/evaluations/<stem>.json")
    ap.add_argument("--pair", action="append", required=True, metavar="BETTER:WORSE", help="methods, paired by seed")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    pairs = []
    for p in a.pair:
        better, sep, worse = p.partition(":")
        if not sep or not better or not worse:
            raise SystemExit(f"--pair {p!r}: give BETTER:WORSE, two methods")
        pairs.append((better, worse))
    table = per_question(a.runs, a.eval)
    if not table:
        raise SystemExit(f"{a.runs}: no run has the evaluation {a.eval!r}")
    summary, curve, comps = analyse(table, pairs)
    a.out.mkdir(parents=True, exist_ok=True)
    summary.to_csv(a.out / "variance.csv", index=False)
    curve.to_csv(a.out / "variance_by_size.csv", index=False)
    (a.out / "variance.json").write_text(json.dumps(comps, indent=2))
    plot(curve, a.out)
    md = ["# Where the paired variance comes from", "",
          f"Runs: `{a.runs}`; evaluation `{a.eval}`; the model and the estimators: `ema_pg/workbench/variance.py`.", "",
          summary.to_markdown(index=False, floatfmt=".4f"), "", "By evaluation size (model: seeds' variance + the "
          "questions' part at n per split; subsets: the seeds' spread measured on random question subsets):", "",
          curve.to_markdown(index=False, floatfmt=".4f"), "", "![paired sd by evaluation size](variance.png)"]
    write_results(a.out, md)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
