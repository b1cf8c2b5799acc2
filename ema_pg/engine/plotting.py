"""Learning-curve plot of one run folder (``curves.png``). The training curves are drawn raw, faint, with their
exponential moving average over them (weight :data:`SMOOTHING` on the previous value, as TensorBoard's and
wandb's smoothing slider do, debiased at the start), so that a trend shows through the batch-to-batch noise."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

SMOOTHING = 0.9  #: the moving average's weight on its previous value (TensorBoard's default slider is 0.6, wandb's 0.8-0.9)


def smoothed(x: pd.Series, weight: float = SMOOTHING) -> pd.Series:
    """The debiased exponential moving average of ``x``: m_t = w m_{t-1} + (1 - w) x_t, divided by 1 - w^t."""
    return x.ewm(alpha=1 - weight, adjust=True).mean()


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import pandas as pd  # here, not at the top: every training process imports this module, and pandas and
    from matplotlib.figure import Figure  # matplotlib cost ~0.7 s of its start. No pyplot: no GUI backend needed

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
        for i, c in enumerate(cols):
            s = df[["step", c]].dropna()
            if c.startswith("eval") or len(s) < 5:
                ax.plot(s["step"], s[c], marker="o" if c.startswith("eval") else None, ms=3, color=f"C{i}", label=c)
                continue
            ax.plot(s["step"], s[c], color=f"C{i}", alpha=0.3, lw=0.8)
            ax.plot(s["step"], smoothed(s[c]), color=f"C{i}", lw=1.6, label=f"{c} (EMA {SMOOTHING})")
        ax.set_title(title)
        ax.set_xlabel("RL iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(run_dir.name, fontsize=9)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    return out
