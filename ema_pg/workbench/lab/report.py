"""The estimator lab's report and command line (``python -m ema_pg.lab``): verdict table, bias/variance against k
and KL, the two-token variance map, one figure.

    python -m ema_pg.lab --all                       # the report, reproductions/estimator_lab/
    python -m ema_pg.lab k3 topk_reverse[paper]      # verdicts of some entries, printed
    python -m ema_pg.lab --list                      # the entries and their sources

Everything here is computed by the lab (:mod:`ema_pg.workbench.lab`, the conformance library: pure torch over the
KL registry) at run time; the README it writes holds no number that this module did not compute.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from ...cli import command_parser
from ...engine.runs import git_commit
from . import DTYPE, ENTRIES, PANEL, TOL, Case, Row, index_set, measure, moments, verdicts

SWEEP_T = (0.0, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)  #: anchor = policy + t * direction
SWEEP_ENTRIES = ("topk_reverse[paper]", "topk_reverse[corrected]", "topk_reverse[none]", "topk_fdiv[reverse_kl]",
                 "nemo-rl:topk_score_tail", "topk_forward[paper]", "topk_forward[corrected]",
                 "verl-rfc:topk_tail_bucket", "verl:forward_kl_topk (clamp_min 0)")
REGION_N = 49  #: grid points per axis of the two-token map


def panel_rows(entries=None, progress=None) -> pd.DataFrame:
    out = []
    for e in (entries or ENTRIES).values():
        out += [dataclasses.asdict(r) for r in measure(e)]
        if progress:
            progress(e.name)
    return pd.DataFrame(out)


def verdict_table(rows: pd.DataFrame, entries=None) -> pd.DataFrame:
    entries = entries or ENTRIES
    out = []
    for name, e in entries.items():
        rs = [Row(**r) for r in rows[rows.entry == name].to_dict("records")]
        v = verdicts(e, rows_=rs)
        v["documented"], v["equals"] = e.documented, e.equals
        out.append(v)
    return pd.DataFrame(out)


def kl_k_sweep(V: int = 8) -> pd.DataFrame:
    """Bias and variance of the index-set entries against k and KL(pi || anchor), on-policy."""
    z = torch.randn(V, generator=torch.Generator().manual_seed(11), dtype=DTYPE) * 1.2
    d = torch.randn(V, generator=torch.Generator().manual_seed(12), dtype=DTYPE)
    k4, k5 = ENTRIES["k4"].make(0), ENTRIES["k5"].make(0)
    out = []
    for t in SWEEP_T:
        case = Case(f"t={t}", z, z + t * d)
        base = {"reverse": moments(k4, case, "reverse"), "forward": moments(k5, case, "forward")}
        for name in SWEEP_ENTRIES:
            e = ENTRIES[name]
            for k in range(V + 1):
                m = moments(e.make(k), case, e.target, index_set(case, e.index_source, k))
                b = base[e.target]
                out.append({"entry": name, "target": e.target, "t": t, "kl_reverse": case.kl("reverse"),
                             "kl_forward": case.kl("forward"), "k": k, "rel_grad_bias": m.rel_grad_bias,
                             "rel_value_bias": m.rel_value_bias, "grad_var": m.grad_var, "value_var": m.value_var,
                             "grad_var_sampled": b.grad_var, "grad_var_ratio": _ratio(m.grad_var, b.grad_var)})
    return pd.DataFrame(out)


def region_v2(n: int = REGION_N) -> pd.DataFrame:
    """Two tokens, k = 1: gradient variance of Top-1 against the sampled estimator over (pi_0, anchor_0).

    Reverse: top-1 of pi (on-policy) against K4; forward: top-1 of the anchor against K5.
    """
    grid = [0.02 + i * (0.96 / (n - 1)) for i in range(n)]
    est = {name: ENTRIES[name].make(1) for name in ("topk_reverse[corrected]", "topk_reverse[paper]",
                                                     "topk_forward[corrected]")}
    k4, k5 = ENTRIES["k4"].make(0), ENTRIES["k5"].make(0)
    out = []
    for a in grid:
        for b in grid:
            case = Case("v2", torch.log(torch.tensor([a, 1 - a], dtype=DTYPE)), torch.log(torch.tensor([b, 1 - b], dtype=DTYPE)))
            row = {"pi_0": a, "anchor_0": b, "kl_reverse": case.kl("reverse")}
            vr, vf = moments(k4, case, "reverse").grad_var, moments(k5, case, "forward").grad_var
            row["var_k4"], row["var_k5"] = vr, vf
            for name, fn in est.items():
                target, src = ENTRIES[name].target, ENTRIES[name].index_source
                var = moments(fn, case, target, index_set(case, src, 1)).grad_var
                row[f"var[{name}]"] = var
                base = vr if target == "reverse" else vf
                row[f"ratio[{name}]"] = _ratio(var, base)
            out.append(row)
    return pd.DataFrame(out)


def _ratio(var: float, sampled: float) -> float:
    """A Top-k gradient variance over its sampled estimator's; NaN where that one is 0 (moments() reads rounding
    as exactly 0), e.g. where the anchor is the policy."""
    return var / sampled if sampled > 0 else float("nan")


def variance_comparison(rows: pd.DataFrame) -> pd.DataFrame:
    """Panel cases x k: tr Cov of the Top-k gradient over that of its sampled estimator (K4 / K5)."""
    out = []
    for name, base_name in (("topk_reverse[corrected]", "k4"), ("topk_reverse[paper]", "k4"),
                            ("topk_forward[corrected]", "k5"), ("topk_forward[paper]", "k5")):
        base = rows[rows.entry == base_name].set_index(["case", "setting"]).grad_var
        for r in rows[(rows.entry == name) & (rows.k > 0)].to_dict("records"):
            b = float(base[(r["case"], r["setting"])])
            out.append({"entry": name, "case": r["case"], "setting": r["setting"], "V": r["V"], "k": r["k"],
                        "grad_var": r["grad_var"], "grad_var_sampled": b,
                        "ratio": _ratio(r["grad_var"], b)})
    return pd.DataFrame(out)


def topk_loses(rows: pd.DataFrame, verd: pd.DataFrame) -> pd.DataFrame:
    """Every (Top-k entry, sampled estimator of ours, quantity, case, setting, k > 0) where the sampled estimator is
    unbiased for the same quantity (its value, or its gradient, of the same KL, in that setting, by the verdicts):
    the two variances and whether the Top-k one is higher (``loses``). A Top-k entry is any with an index set."""
    v = verd.set_index("entry")
    measured = [ENTRIES[n] for n in v.index]
    topk = [e.name for e in measured if e.index_source is not None]
    sampled = [e.name for e in measured if e.index_source is None and e.family == "ours" and not e.name.startswith("exact_")]
    out = []
    for t in topk:
        mine = rows[(rows.entry == t) & (rows.k > 0)]
        for s_name in sampled:
            if ENTRIES[s_name].target != ENTRIES[t].target:
                continue
            base = rows[rows.entry == s_name].set_index(["case", "setting"])
            for quantity, col in (("value", "value_var"), ("gradient", "grad_var")):
                for r in mine.to_dict("records"):
                    if v.loc[s_name, f"{quantity}_{r['setting']}"] != "unbiased":
                        continue
                    b = float(base.loc[(r["case"], r["setting"]), col])
                    out.append({"entry": t, "sampled": s_name, "quantity": quantity, "case": r["case"],
                                "setting": r["setting"], "k": r["k"], "var": r[col], "var_sampled": b,
                                "loses": bool(r[col] > b * (1 + 1e-9) + 1e-15)})
    return pd.DataFrame(out)


def _loses_text(loses: pd.DataFrame, rows: pd.DataFrame) -> list[str]:
    """The pairs where Top-k's variance is higher somewhere, one table row each, then the two-token case."""
    out = ["Each Top-k estimator against each sampled estimator of ours that is unbiased for the same quantity (its "
           "value, or its gradient, of the same KL, in the same setting), cell by cell over the panel (case, on- or "
           "off-policy, k > 0): where the Top-k one's variance is the higher (`topk_loses.csv` has every cell). "
           f"{int(loses.loses.sum())} of {len(loses)} cells; the pairs where it happens:", "",
           "| Top-k estimator | sampled, unbiased for the same | quantity | cells where Top-k's variance is higher | cases |",
           "|---|---|---|---|---|"]
    for (t, s_name, q), g in loses.groupby(["entry", "sampled", "quantity"], sort=False):
        if g.loses.any():
            where = ", ".join(sorted({f"{c} ({st})" for c, st in zip(g[g.loses].case, g[g.loses].setting)}))
            out.append(f"| `{t}` | `{s_name}` | {q} | {int(g.loses.sum())} of {len(g)} | {where} |")
    ce = rows[(rows.case == "counterexample") & (rows.setting == "on")].set_index(["entry", "k"])
    tk = ce.loc[("topk_reverse[corrected]", 1)]
    peers = {n: ce.loc[(n, 0)] for n in ("k1", "k3", "k3pp", "k4")}
    out += ["", f"- **The two-token case** (pi = (0.6, 0.4), anchor = (0.9, 0.1), k = 1, on-policy): every estimator "
            f"here has mean {tk.kl_reverse + tk.value_bias:.3f} (the KL); the value variance of `topk_reverse` (either "
            f"tail) is {tk.value_var:.3f}, above `k3`'s and `k3pp`'s {peers['k3'].value_var:.3f} and below `k1`'s and "
            f"`k4`'s {peers['k4'].value_var:.3f}. So \"Top-k has lower variance than sampled KL\" holds against some "
            "sampled estimators and not others, and depends on the distributions."]
    rn = rows[(rows.entry == "opd:topk_renormalized")]
    if len(rn):
        worst = rn.groupby("k").rel_value_bias.max()
        out.append("- **The renormalized top-K KL** (`opd:topk_renormalized`, arXiv 2603.25562): deterministic given "
                   "its support (variance 0), and biased: its value is off the KL by up to "
                   + ", ".join(f"{_pct(x)} at k = {k}" for k, x in worst.items() if k < rn.V.max())
                   + " (relative, over the panel; exact only where the support is the whole vocabulary), and its "
                   "gradient follows neither KL.")
    return out


# ---------------------------------------------------------------------------------------------- figure
def figure(verd: pd.DataFrame, sweep: pd.DataFrame, region: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig = plt.figure(figsize=(17, 10))
    gs = fig.add_gridspec(2, 3, width_ratios=[1.25, 1, 1])
    ax = [fig.add_subplot(gs[:, 0]), fig.add_subplot(gs[0, 1]), fig.add_subplot(gs[0, 2]), fig.add_subplot(gs[1, 1]),
          fig.add_subplot(gs[1, 2])]
    cols = [("value_on", "value\non-policy"), ("value_off", "value\noff-policy"),
            ("gradient_on", "gradient\non-policy"), ("gradient_off", "gradient\noff-policy")]
    mat = np.array([[0.0 if r[c] == "unbiased" else math.log10(max(r[c + "_rel"], 1e-3)) + 3.5 for c, _ in cols]
                    for r in verd.to_dict("records")])
    a = ax[0]
    a.imshow(mat, cmap="Reds", vmin=0, vmax=5, aspect="auto")
    for i, r in enumerate(verd.to_dict("records")):
        for j, (c, _) in enumerate(cols):
            text = "ok" if r[c] == "unbiased" else f"{r[c + '_rel']:.0%}" if r[c + "_rel"] < 10 else f"{r[c + '_rel']:.0f}x"
            a.text(j, i, text, ha="center", va="center", fontsize=7, color="black")
    a.set_xticks(range(len(cols)), [lab for _, lab in cols], fontsize=8)
    a.set_yticks(range(len(verd)), [f"{n}  ({t[:3]})" for n, t in zip(verd.entry, verd.target)], fontsize=7)
    a.set_title("Bias against the true KL (worst relative, exact)\nok = unbiased to 1e-9", fontsize=10)

    a = ax[1]
    sub = sweep[(sweep.entry == "topk_reverse[corrected]") & (sweep.k > 0) & (sweep.k < sweep.k.max())]
    for t, g in sub.groupby("t"):
        if t in (0.1, 0.5, 1.0, 2.0, 3.0):
            a.plot(g.k, g.grad_var_ratio, marker="o", label=f"KL(pi||anchor) = {g.kl_reverse.iloc[0]:.3f}")
    a.axhline(1.0, color="grey", lw=1, ls="--")
    a.set_yscale("log")
    a.set_xlabel("k (V = 8)")
    a.set_ylabel("tr Cov[grad]: Top-k (corrected tail) / K4")
    a.set_title("Top-k reverse lowers gradient variance\nby k and distance to the anchor", fontsize=10)
    a.legend(fontsize=7)

    a = ax[3]
    for name, style in (("topk_reverse[paper]", "-"), ("nemo-rl:topk_score_tail", ":")):
        sub = sweep[(sweep.entry == name) & (sweep.t > 0) & sweep.k.isin([1, 3, 5])]
        for k, g in sub.groupby("k"):
            a.plot(g.kl_reverse, g.rel_grad_bias, marker="o", ls=style, label=f"{name}, k = {k}")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("KL(pi || anchor)")
    a.set_ylabel("||E[grad] - grad KL|| / ||grad KL||")
    a.set_title("The printed tail's gradient bias grows as the anchor nears the policy\n"
                "(corrected tail: 0 to 1e-15 everywhere)", fontsize=10)
    a.legend(fontsize=7)

    for a, col, base, mark in ((ax[2], "ratio[topk_reverse[corrected]]", "K4", True),
                               (ax[4], "ratio[topk_forward[corrected]]", "K5", False)):
        piv = region.pivot(index="anchor_0", columns="pi_0", values=col)
        z = np.log2(piv.values.astype(float))
        im = a.imshow(z, origin="lower", extent=(0.02, 0.98, 0.02, 0.98), cmap="RdBu_r", vmin=-4, vmax=4, aspect="auto")
        a.contour(piv.columns, piv.index, z, levels=[0.0], colors="black", linewidths=1)
        if mark:
            a.plot([0.6], [0.9], marker="*", color="gold", markersize=14, markeredgecolor="black")
            a.annotate("counterexample\npi=(0.6, 0.4)\nanchor=(0.9, 0.1)", (0.6, 0.9), (0.7, 0.6), fontsize=8,
                       arrowprops={"arrowstyle": "->"}, bbox={"boxstyle": "round", "fc": "white", "alpha": 0.85})
        a.set_xlabel("pi_theta(token 0)")
        a.set_ylabel("anchor(token 0)")
        kind = "reverse, top-1 of pi" if mark else "forward, top-1 of the anchor"
        a.set_title(f"V = 2, {kind}: log2 Var[Top-1] / Var[{base}]\nred = Top-k has MORE gradient variance",
                    fontsize=10)
        fig.colorbar(im, ax=a, fraction=0.046)
    fig.tight_layout()
    fig.savefig(out / "estimator_lab.png", dpi=130)
    fig.savefig(out / "estimator_lab.pdf")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- README
def _verdict_cell(r: dict, key: str) -> str:
    return "unbiased" if r[key] == "unbiased" else f"**biased** ({_pct(r[key + '_rel'])})"


def _pct(x: float) -> str:
    return f"{x:.0%}" if x < 10 else f"{x:.0f}x"


def _commit() -> str:
    """The code's commit, short (``-dirty`` kept): :func:`ema_pg.engine.runs.git_commit` reads it."""
    sha, _, dirty = git_commit().partition("-")
    return sha[:7] + (f"-{dirty}" if dirty else "")


def readme(rows: pd.DataFrame, verd: pd.DataFrame, var: pd.DataFrame, sweep: pd.DataFrame, region: pd.DataFrame, seconds: float,
           commit: str, loses: pd.DataFrame | None = None) -> str:
    lines = [
        "# KL-estimator conformance lab",
        "",
        f"Regenerate: `python -m ema_pg.lab --all` ({seconds:.0f} s on this CPU; commit `{commit}`). Exact",
        "enumeration in float64 over a panel of small vocabularies: no sampling, so *unbiased* means equal to the true",
        f"KL or its gradient to {TOL:g}, and *biased* gives the worst relative error over the panel",
        "(|E[value] - KL| / KL; ||E[grad] - grad KL|| / ||grad KL||, gradients w.r.t. the policy's logits).",
        "",
        "**Panel** (`ema_pg.workbench.lab.PANEL`): " + "; ".join(f"`{c.name}` ({c.note}, KL = {c.kl():.3f})"
                                                      for c in PANEL if c.setting == "on") + ".",
        "Each case runs on-policy and off-policy (tokens from pi_old = softmax(policy logits + N(0, 0.6^2)));",
        "estimators with an index set run k in {0, 1, 2, 3, 5, 8} (capped at V) with the top-k of their source, and",
        "the *any index set* column checks every k-subset of the vocabulary as the index set.",
        "Our importance-weighted estimators run with a clip that never binds; K1-K3 and the peers' plain K3 variants",
        "without an off-policy weight, as they are used.",
        "",
        "## Verdicts",
        "",
        "| estimator | KL | index set | value, on-policy | value, off-policy | gradient, on-policy | gradient, off-policy "
        "| E[grad] follows (on / off) | any index set | source | source says |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in verd.to_dict("records"):
        lines.append(
            f"| `{r['entry']}` | {r['target']} | {r['index_set'] or '-'} | {_verdict_cell(r, 'value_on')} | "
            f"{_verdict_cell(r, 'value_off')} | {_verdict_cell(r, 'gradient_on')} | {_verdict_cell(r, 'gradient_off')} | "
            f"{r['follows_on']} / {r['follows_off']} | {r['any_index_set'] or '-'} | {r['source']} | {r['documented']} |")
    lines += [
        "",
        "*follows*: the KL whose gradient E[grad] equals (*neither*: none of the reverse KL, the forward KL or 0).",
        "",
        "## Where the lab contradicts a source",
        "",
    ]
    lines += _contradictions(verd, rows)
    lines += ["", "## When Top-k lowers gradient variance, and when it does not", ""]
    lines += _variance_text(var, sweep, region)
    if loses is not None:
        lines += ["", "## Where Top-k loses: its variance above a sampled estimator's", ""]
        lines += _loses_text(loses, rows)
    lines += ["", "![estimator lab](estimator_lab.png)", "",
              "Files: `verdicts.csv` (the table), `panel.csv` (every entry x case x k), `variance.csv` (Top-k over",
              "its sampled estimator per case and k), `bias_variance_k_kl.csv` (against k and KL),",
              "`region_v2.csv` (the two-token map), `topk_loses.csv` (Top-k's variances against the sampled "
              "estimators unbiased for the same quantity)."]
    return "\n".join(lines) + "\n"


def same_rows(rows: pd.DataFrame, a: str, b: str, setting: str | None = None) -> bool:
    """Whether two entries have the same bias and variance at every (case, setting, k) of the panel."""
    cols = ["value_bias", "grad_bias", "value_var", "grad_var"]
    sel = (lambda d: d) if setting is None else (lambda d: d[d.setting == setting])
    x, y = (sel(rows[rows.entry == n]).set_index(["case", "setting", "k"])[cols].sort_index() for n in (a, b))
    return len(x) > 0 and x.index.equals(y.index) and bool(((x - y).abs() <= 1e-12 * (1 + x.abs())).all().all())


def _contradictions(verd: pd.DataFrame, rows: pd.DataFrame) -> list[str]:
    v = verd.set_index("entry")
    out = []

    def cell(name, key):
        return v.loc[name, key], v.loc[name, key + "_rel"]

    g_on, rel = cell("nemo-rl:topk_score_tail", "gradient_on")
    if g_on != "unbiased":
        out.append(f"- **NeMo-RL's top-k support estimator** (PR #3608; its review calls it unbiased on-policy): its "
                   f"gradient is biased *on-policy* too, by up to {_pct(rel)}, the same head-mass term as the paper's "
                   f"printed Alg 1; its on-policy rows "
                   f"{'equal' if same_rows(rows, 'nemo-rl:topk_score_tail', 'topk_reverse[paper]', 'on') else 'differ from'}"
                   f" `topk_reverse[paper]`'s. Off-policy its value is biased as well ({_pct(v.loc['nemo-rl:topk_score_tail', 'value_off_rel'])}: no importance weight).")
    for name in ("topk_reverse[paper]", "topk_forward[paper]"):
        g, rel = cell(name, "gradient_on")
        if g != "unbiased":
            out.append(f"- **The paper's printed {'Alg 1' if 'reverse' in name else 'Alg 2'}** (`{name}`): unbiased in "
                       f"value, biased in gradient by up to {_pct(rel)} on-policy; the corrected tail is unbiased on "
                       f"any index set.")
    val, rel = cell("verl:low_var_kl", "value_on")
    if val != "unbiased":
        a = rows[rows.entry == "verl:low_var_kl"].set_index(["case", "setting"])
        b = rows[rows.entry == "k3"].set_index(["case", "setting"])
        differ = sorted({c for (c, s_), d in (a.value_bias - b.value_bias).abs().items() if d > 1e-12})
        out.append(f"- **verl `low_var_kl`** (documented as K3 with a numerical clamp): its value clamp at 10 binds "
                   f"where pi_ref/pi_theta > ~12 (cases {', '.join(f'`{c}`' for c in differ)}), so its value is biased by "
                   f"up to {_pct(rel)} and its gradient follows neither KL there; on the other cases it equals `k3`.")
    g, rel = cell("verl:k3+", "gradient_off")
    if g != "unbiased":
        out.append(f"- **verl `k3+` / OpenRLHF PR #1101 (straight-through K2)**: unbiased reverse-KL gradient "
                   f"on-policy only; off-policy (PPO epochs > 1, async) biased by up to {_pct(rel)}. OpenRLHF's "
                   "`unbiased_gradient` (PR #1309) adds the importance weight and is unbiased off-policy in gradient; "
                   f"its logged value (K3 without weight) is biased off-policy by "
                   f"{_pct(v.loc['openrlhf:unbiased_gradient', 'value_off_rel'])}.")
    if same_rows(rows, "trl:bias_corrected_k3", "k3pp") and same_rows(rows, "deepseek-v3.2:iw_k3", "k3pp"):
        out.append("- **TRL `use_bias_correction_kl` = DeepSeek-V3.2's importance-weighted K3 = our `k3pp` with an "
                   "unbounded clip**: identical rows everywhere; unbiased in value and gradient on- and off-policy "
                   f"({v.loc['trl:bias_corrected_k3', 'gradient_off']} off-policy gradient), as documented.")
    val, rel = cell("verl-rfc:topk_tail_bucket", "value_on")
    tb = rows[(rows.entry == "verl-rfc:topk_tail_bucket") & (rows.k > 0)]
    below = bool((tb.value_bias <= 1e-12).all())
    out.append(f"- **The tail bucket** (verl RFC #7856) is{' ' if below else ' not everywhere '}a lower bound "
               f"(E[value] - KL <= 0 on every case with k > 0: {below}): biased by up to {_pct(rel)} (at k = 0; at "
               f"k > 0 up to {_pct(tb.rel_value_bias.max())}), and its gradient is that of the coarse (k+1)-category KL, not of "
               "the KL; it is never negative, so no clamp is needed. The clamped truncated loss it replaces is "
               f"biased by up to {_pct(v.loc['verl:forward_kl_topk (clamp_min 0)', 'gradient_on_rel'])} in gradient.")
    return out


def _variance_text(var: pd.DataFrame, sweep: pd.DataFrame, region: pd.DataFrame) -> list[str]:
    out = []
    for name in ("topk_reverse[corrected]", "topk_forward[corrected]", "topk_reverse[paper]"):
        sub = var[var.entry == name]
        worse = sub[sub.ratio > 1.0 + 1e-9]
        where = ", ".join(sorted({f"{c} ({s})" for c, s in zip(worse.case, worse.setting)})) or "none"
        out.append(f"- `{name}` over its sampled estimator, {len(sub)} (case, setting, k > 0) cells: median ratio of "
                   f"gradient variance {sub.ratio.median():.2f}; higher variance in {len(worse)} cells: {where}.")
    ce = var[(var.case == "counterexample") & (var.setting == "on") & (var.entry == "topk_reverse[corrected]")]
    if len(ce):
        r = ce.iloc[0]
        out.append(f"- **The counterexample** (pi = (0.6, 0.4), anchor = (0.9, 0.1), k = 1): tr Cov of the Top-1 "
                   f"gradient {r.grad_var:.4f} against K4's {r.grad_var_sampled:.4f} (ratio {r.ratio:.2f}): "
                   f"{'confirmed, Top-k is noisier here' if r.ratio > 1 else 'not reproduced'}.")
    col = "ratio[topk_reverse[corrected]]"
    frac = float((region[col] > 1).mean())
    out.append(f"- **The two-token map** (V = 2, k = 1, {len(region)} pairs (pi_0, anchor_0)): Top-1 has the higher "
               f"gradient variance on {frac:.0%} of the square. With two tokens, head h and tail t, the ratio is "
               "(l_t pi_h)^2 / (l_h pi_t + l_t pi_h)^2 (l_j = log pi_j / anchor_j): l_h and l_t have opposite signs "
               "whenever pi != anchor, so K4's two terms partly cancel while Top-1 keeps the tail's alone. Forward "
               f"(top-1 of the anchor vs K5): higher on {float((region['ratio[topk_forward[corrected]]'] > 1).mean()):.0%}.")
    s = sweep[(sweep.entry == "topk_reverse[corrected]") & (sweep.k > 0) & (sweep.k < sweep.k.max())].dropna(
        subset=["grad_var_ratio"])
    worse = s[s.grad_var_ratio > 1 + 1e-9]
    out.append(f"- **V = 8, against k and KL** (anchor = policy + t d, t in {list(SWEEP_T)}): the ratio falls with k "
               f"(median {s[s.k == 1].grad_var_ratio.median():.2f} at k = 1, {s[s.k == 3].grad_var_ratio.median():.2f} at "
               f"k = 3, {s[s.k == 5].grad_var_ratio.median():.2f} at k = 5); Top-k is noisier than K4 in "
               f"{len(worse)} of {len(s)} (t, k) cells"
               + (f" (k = {sorted(set(worse.k))}, KL {worse.kl_reverse.min():.2f}-{worse.kl_reverse.max():.2f})."
                  if len(worse) else "."))
    out.append("- So the paper's framing (Top-k lowers variance) holds for most of the panel but is not a theorem: "
               "the map above is where it fails, and `region_v2.csv` gives it point by point; below, the same for "
               "the value's variance and against every sampled estimator unbiased for the same quantity.")
    return out


def write_all(out: Path, progress=None) -> dict:
    """Compute everything and write the report folder; returns the verdict table as records."""
    t0, commit = time.time(), _commit()  # before writing: a report folder inside the repository makes the tree dirty
    out.mkdir(parents=True, exist_ok=True)
    rows = panel_rows(progress=progress)
    verd = verdict_table(rows)
    var = variance_comparison(rows)
    loses = topk_loses(rows, verd)
    sweep = kl_k_sweep()
    if progress:
        progress("sweep over k and KL")
    region = region_v2()
    if progress:
        progress("two-token map")
    rows.to_csv(out / "panel.csv", index=False, float_format="%.6g")
    verd.to_csv(out / "verdicts.csv", index=False, float_format="%.6g")
    var.to_csv(out / "variance.csv", index=False, float_format="%.6g")
    sweep.to_csv(out / "bias_variance_k_kl.csv", index=False, float_format="%.6g")
    region.to_csv(out / "region_v2.csv", index=False, float_format="%.6g")
    loses.to_csv(out / "topk_loses.csv", index=False, float_format="%.6g")
    figure(verd, sweep, region, out)
    (out / "README.md").write_text(readme(rows, verd, var, sweep, region, time.time() - t0, commit, loses))
    return verd.to_dict("records")


def main(argv: list[str] | None = None) -> int:
    ap = command_parser("The estimator lab from the command line.")
    ap.add_argument("entries", nargs="*", help="entry names (see --list); their verdicts are printed")
    ap.add_argument("--all", action="store_true", help="write the whole report to --out")
    ap.add_argument("--out", type=Path, default=Path("reproductions/estimator_lab"),
                    help="the report's folder (made if missing; its parent must exist)")
    ap.add_argument("--list", action="store_true", help="list the entries")
    args = ap.parse_args(argv)

    if args.list:
        for name, e in ENTRIES.items():
            print(f"{name:40s} {e.target:8s} {e.source}")
        return 0
    unknown = [n for n in args.entries if n not in ENTRIES]
    if unknown:
        print(f"error: unknown entr{'y' if len(unknown) == 1 else 'ies'} {unknown}; `--list` shows them", file=sys.stderr)
        return 2
    if args.all and (args.out.exists() and not args.out.is_dir() or args.out.suffix in (".md", ".png", ".csv")
                     or not args.out.parent.is_dir()):
        why = ("is a file" if args.out.exists() and not args.out.is_dir() else
               "names a file, not a folder" if args.out.suffix in (".md", ".png", ".csv") else
               f"has no parent folder {args.out.parent}")
        print(f"error: --out {args.out} {why}: give the report's folder (README.md, CSVs and the figure go in it)",
              file=sys.stderr)
        return 2
    if not args.all and not args.entries:
        ap.print_usage(sys.stderr)
        print("error: give entry names, --all or --list", file=sys.stderr)
        return 2
    for name in args.entries:
        v = verdicts(ENTRIES[name])
        cells = [f"{k.replace('_', ' ')}: {v[k]}" + (f" ({v[k + '_rel']:.3g})" if v[k] == "biased" else "")
                 for k in ("value_on", "value_off", "gradient_on", "gradient_off")]
        print(f"{name} [{v['target']} KL]: " + "; ".join(cells) + f"; follows {v['follows_on']} / {v['follows_off']}")
    if args.all:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ENTRIES) + 2, desc="estimator lab", unit="step")
        write_all(args.out, progress=lambda what: (bar.set_postfix_str(what[:30]), bar.update(1)))
        bar.close()
        print(f"report: {args.out / 'README.md'}  figure: {args.out / 'estimator_lab.png'}")
    return 0
