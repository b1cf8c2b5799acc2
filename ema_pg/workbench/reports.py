"""The table of reports: one entry per sweep of ``sweeps/``, saying what to plot from its runs.

    python -m ema_pg.reports fig6_k --runs multirun/fig6_k/<time> --out reproductions/fig6_k
    python -m ema_pg.reports table2 --runs runs/reproduce/table2-mini --out reproductions/table2
    make figures NAME=fig6_k RUNS=multirun/fig6_k/<time>

Adding an ablation is a sweep file plus one entry here: ``make reproduce``, the generic notebook
(``analysis/notebooks/ablation.py``) and the tests read this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..cli import command_parser
from ..kl import ESTIMATORS
from .results import METHOD_LABELS, TAIL_VARIANTS, ablation_report, clip_label, load_runs

#: Fig 9: the clip each direction uses by default, read from the estimators' registry (its one home)
_DEFAULT_CLIP = {d: clip_label(ESTIMATORS[f"topk_{d}"].defaults["iw_clip"]) for d in ("forward", "reverse")}


@dataclass(frozen=True)
class Report:
    """What one report plots: final metric by ``x`` (and ``hue``), over seeds, plus learning curves."""

    title: str
    x: str
    hue: str | None = None
    order: tuple = ()  #: the x values in the figure's order (ids)
    labels: dict = field(default_factory=dict)  #: x id -> display label
    where: Callable[[pd.DataFrame], pd.Series] | None = None  #: keep the runs this is True for
    also: dict = field(default_factory=dict)  #: further panels: file name -> Report, from the same runs

    def write(self, runs: pd.DataFrame, out: Path, name: str) -> dict:
        sub = runs[self.where(runs)] if self.where is not None else runs
        res = ablation_report(sub, out, name=name, x=self.x, hue=self.hue, order=list(self.order) or None,
                              title=self.title, labels=self.labels or None)
        for extra_name, extra in self.also.items():
            res[extra_name] = extra.write(runs, out, extra_name)
        return res


def _table2(runs_dir: str, out: str, extra: list[str]) -> dict:
    from .table2 import main

    return main(["--runs", runs_dir, "--out", out, *extra])


def _async_anchor(runs_dir: str, out: str, extra: list[str]) -> dict:
    from .studies.async_study import main

    return main(["--runs", runs_dir, "--out", out, *extra])


def _table3(runs_dir: str, out: str, extra: list[str]) -> dict:
    from .table3 import main

    return main(["--runs", runs_dir, "--out", out, *extra])


REPORTS: dict[str, Report | Callable] = {
    "fig5_methods": Report("Fig 5: EMA anchor and Top-k KL vs GRPO", x="method", labels=METHOD_LABELS,
                           order=("grpo", "ema", "ema_topk_forward", "ema_topk_reverse")),
    "fig6_k": Report("Fig 6: k of Top-k reverse KL", x="kl.k"),
    "fig7_eta_direction": Report("Fig 7: EMA eta x KL direction", x="anchor.eta", hue="direction"),
    "fig8_tail": Report("Fig 8: tail and off-policy correction of Top-k KL", x="tail_variant", hue="direction",
                        order=tuple(TAIL_VARIANTS), labels=TAIL_VARIANTS),
    "fig9_iw_clip": Report(
        "Fig 9 (left): IW clip range x KL direction", x="iw_clip", hue="direction",
        order=("[1, 1]", "[0, 2.5]", "[0, 10]"), where=lambda r: r["algo.adv_norm"] == "group",
        also={"fig9_adv_norm": Report(
            "Fig 9 (right): advantage normalization", x="algo.adv_norm", hue="direction", order=("group", "global"),
            where=lambda r: r["iw_clip"] == r["direction"].map(_DEFAULT_CLIP))}),
    "tail_bias": Report("Top-k KL tail: printed (paper) vs corrected", x="kl.tail", hue="direction",
                        order=("paper", "corrected")),
    "reference_updates": Report("Reference-update schemes: fixed, EMA, hard reset, soft sync", x="anchor_scheme",
                                order=("fixed", "ema", "reset", "sync"),
                                labels={"fixed": "fixed (GRPO)", "ema": "EMA (eta 0.9, every 10 it.)",
                                        "reset": "hard reset (every 10 it.)",
                                        "sync": "soft sync (alpha 0.6, every 20 opt. steps)"}),
    "variants": Report("Base-algorithm variants and KL knobs: one short run each", x="name",
                       order=("demo", "gspo", "cispo", "dual_clip", "entropy", "dynamic_sampling", "overlong",
                              "k3_plus", "k3_clamp", "abs", "token_sum", "lora", "ppo")),
    "beta0_collapse": Report("§6: beta = 0 collapses where a small beta with the EMA anchor does not (lr 7e-4)",
                             x="algo.beta", order=("0.0", "0.01", "0.05")),
    "reasoning_gym_suite": Report("reasoning-gym's suite: EMA anchor and Top-k reverse KL vs GRPO (mean held-out "
                                  "score over its datasets)", x="method", labels=METHOD_LABELS,
                                  order=("grpo", "ema", "ema_topk_reverse")),
    "kl_ctrl": Report("Adapt beta or move the anchor: EMA anchor with a fixed beta vs adaptive beta (issue 79)",
                      x="method", labels=METHOD_LABELS, order=("ema", "grpo_adaptive", "ema_adaptive")),
    "async_anchor": _async_anchor,
    "table2": _table2,
    "table3": _table3,
}


def run_report(name: str, runs_dir: str | Path, out: str | Path, include_unfinished: bool = False,
               extra: list[str] = ()) -> dict:
    """Write report ``name`` of the runs under ``runs_dir`` into ``out``."""
    if name not in REPORTS:
        raise SystemExit(f"unknown report {name!r}; choose one of: {', '.join(REPORTS)}")
    rep = REPORTS[name]
    if not isinstance(rep, Report):
        return rep(str(runs_dir), str(out), list(extra) + (["--all"] if include_unfinished else []))
    runs = load_runs(runs_dir, finished_only=not include_unfinished)
    if not len(runs):
        raise SystemExit(f"no finished runs under {runs_dir}; run `make sweep NAME={name}` (or pass --all)")
    return rep.write(runs, Path(out), name)


def main(argv=None) -> dict:
    from ..engine.console import quiet_third_party

    quiet_third_party()  # no third-party warnings, bars or log lines on a command's console
    ap = command_parser(__doc__)
    ap.add_argument("name", choices=sorted(REPORTS))
    ap.add_argument("--runs", required=True, help="folder of runs (a sweep's multirun folder)")
    ap.add_argument("--out", required=True, help="where the .csv/.md/.png/.pdf go")
    ap.add_argument("--all", action="store_true", help="include unfinished runs (their last evaluation)")
    a, extra = ap.parse_known_args(argv)
    return run_report(a.name, a.runs, a.out, a.all, extra)


if __name__ == "__main__":
    main()
