"""Learning-curve plot of one run folder (``curves.png``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure  # no pyplot: no GUI backend is chosen or needed


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    df = pd.read_csv(run_dir / "metrics.csv")
    panels = [("reward", ["train/reward_mean"] + sorted(c for c in df.columns if c.startswith("eval/") and "/avg/" in c)),
              ("KL", ["train/kl", "train/kl_k3"]), ("anchor lag", ["anchor/lag_norm"]),
              ("clip fraction", ["train/clip_frac_low", "train/clip_frac_high"])]
    panels = [(t, [c for c in cols if c in df.columns]) for t, cols in panels]
    panels = [(t, cols) for t, cols in panels if cols]
    fig = Figure(figsize=(4.2 * len(panels), 3.3))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (title, cols) in zip(axes[0], panels):
        for c in cols:
            s = df[["step", c]].dropna()
            ax.plot(s["step"], s[c], marker="o" if c.startswith("eval") else None, ms=3, label=c)
        ax.set_title(title)
        ax.set_xlabel("RL iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(run_dir.name, fontsize=9)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    return out
