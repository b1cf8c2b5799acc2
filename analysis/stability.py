"""The EMA stability lemma (§4, Lemma 4.2, Appendix C) checked by simulation.

Simulates the algorithm itself under the local quadratic KL model: with a random PSD Fisher
matrix F (lambda_max scaled to 1) and a constant gradient g,

    theta_{t+1}     = theta_t + alpha g - alpha beta F (theta_t - theta_ema,t)      (eq. 5)
    theta_ema,{t+1} = eta theta_ema,t + (1 - eta) theta_t                          (eq. 2)

for a grid of x = alpha beta lambda_max and eta, then classifies each run from its lag
trajectory delta_t = theta_t - theta_ema,t alone: *unstable* if the increments
delta_{t+1} - delta_t do not shrink over the second half of the run; *oscillatory* if, in some eigen-direction of F, the
increment changes sign between consecutive steps; else *non-oscillatory*. The lemma's regimes
(x <= eta; eta < x < 1 + eta; x >= 1 + eta) are then compared with the simulated classes, and
the simulated final lag with the steady state of eq. 62 / 63.

    python analysis/stability.py --out reproductions/stability
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

CLASSES = ("non-oscillatory", "oscillatory", "unstable")


def random_fisher(d: int, gen: torch.Generator) -> torch.Tensor:
    A = torch.randn(d, d, generator=gen, dtype=torch.float64)
    Q, _ = torch.linalg.qr(A)
    lam = torch.rand(d, generator=gen, dtype=torch.float64)
    lam[0] = 1.0  # lambda_max = 1
    return Q @ torch.diag(lam) @ Q.T


def simulate(xs: np.ndarray, etas: np.ndarray, d: int = 16, steps: int = 3000, alpha: float = 1.0, seed: int = 0):
    """Run every (x, eta) cell at once; returns a DataFrame with the simulated class per cell."""
    gen = torch.Generator().manual_seed(seed)
    F = random_fisher(d, gen)
    evals, evecs = torch.linalg.eigh(F)
    lam_max = float(evals.max())
    g = torch.randn(d, generator=gen, dtype=torch.float64)
    X, E = np.meshgrid(xs, etas, indexing="ij")
    x = torch.tensor(X.ravel(), dtype=torch.float64)  # (C,)
    eta = torch.tensor(E.ravel(), dtype=torch.float64)
    beta = x / (alpha * lam_max)
    C = x.numel()
    theta = torch.randn(d, generator=gen, dtype=torch.float64).expand(C, d).clone()  # (C, d)
    theta_ema = theta + torch.randn(d, generator=gen, dtype=torch.float64)  # a non-zero initial lag
    prev_delta = theta - theta_ema
    prev_inc = None
    flips = torch.zeros(C, dtype=torch.bool)
    inc0 = None
    for t in range(steps):
        delta = theta - theta_ema
        theta, theta_ema = (theta + alpha * g - alpha * beta[:, None] * (delta @ F.T),
                            eta[:, None] * theta_ema + (1 - eta[:, None]) * theta)
        new_delta = theta - theta_ema
        inc = (new_delta - prev_delta) @ evecs  # increments in F's eigenbasis, (C, d)
        if inc0 is None:
            inc0 = inc.norm(dim=-1)
        if prev_inc is not None and t < 200:
            big = (prev_inc.abs() > 1e-12 * inc0[:, None]) & (inc.abs() > 1e-12 * inc0[:, None])
            flips |= ((prev_inc * inc < 0) & big).any(-1)
        prev_inc, prev_delta = inc, new_delta
        if t == steps // 2:
            inc_mid = inc.norm(dim=-1)
        if not torch.isfinite(theta).all():
            theta = torch.nan_to_num(theta, nan=1e300, posinf=1e300, neginf=-1e300)
            theta_ema = torch.nan_to_num(theta_ema, nan=1e300, posinf=1e300, neginf=-1e300)
    inc_final = prev_inc.norm(dim=-1)
    # no decay over the second half of the run: the slowest mode has |chi| >= 1
    # (converged cells sit at rounding noise, far below the first increment: not unstable)
    alive = inc_final > 1e-8 * inc0
    unstable = ~torch.isfinite(inc_final) | (alive & (inc_final >= inc_mid * (1 - 1e-9))) | (inc_final > 1e100)
    sim = np.where(unstable.numpy(), 2, np.where(flips.numpy(), 1, 0))
    lemma = np.where(x.numpy() <= eta.numpy(), 0, np.where(x.numpy() < 1 + eta.numpy(), 1, 2))
    # steady-state lag vs eq. 62: delta* = alpha ((1 - eta) I + alpha beta F)^-1 g
    eye = torch.eye(d, dtype=torch.float64)
    star = torch.stack([alpha * torch.linalg.solve((1 - e) * eye + alpha * b * F, g) for e, b in zip(eta, beta)])
    final = prev_delta
    rel = ((final - star).norm(dim=-1) / star.norm(dim=-1)).numpy()
    chi_max = np.abs(eta.numpy()[:, None] - (alpha * beta.numpy()[:, None]) * evals.numpy()[None, :]).max(-1)
    return pd.DataFrame({"x": x.numpy(), "eta": eta.numpy(), "simulated": [CLASSES[i] for i in sim],
                         "lemma": [CLASSES[i] for i in lemma], "agree": sim == lemma,
                         "steady_lag_rel_err": np.where(sim < 2, rel, np.nan), "max_abs_chi": chi_max})


def plot(df: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="white", context="paper")
    colors = {"non-oscillatory": "#4C72B0", "oscillatory": "#DD8452", "unstable": "#C44E52"}
    fig, ax = plt.subplots(figsize=(6.2, 4.4))
    for cls, c in colors.items():
        s = df[df.simulated == cls]
        ax.scatter(s.x, s.eta, s=14, marker="s", color=c, label=f"simulated: {cls}")
    bad = df[~df.agree]
    ax.scatter(bad.x, bad.eta, s=30, facecolors="none", edgecolors="black", lw=0.8, label="disagrees with lemma")
    e = np.linspace(df.eta.min(), df.eta.max(), 100)
    ax.plot(e, e, "k--", lw=1.2, label=r"$\alpha\beta\lambda_{max}=\eta$")
    ax.plot(1 + e, e, "k-", lw=1.5, label=r"$\alpha\beta\lambda_{max}=1+\eta$ (eq. 9)")
    ax.set_xlabel(r"$\alpha\beta\lambda_{max}$")
    ax.set_ylabel(r"EMA coefficient $\eta$")
    ax.set_xlim(df.x.min(), df.x.max())
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    ax.set_title(f"EMA lag dynamics: agreement with Lemma 4.2 = {df.agree.mean():.4f} ({int(df.agree.sum())}/{len(df)} cells)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "phase_diagram.png", dpi=140)
    fig.savefig(out / "phase_diagram.pdf")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="reproductions/stability")
    ap.add_argument("--nx", type=int, default=81)
    ap.add_argument("--neta", type=int, default=41)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    xs = np.linspace(0.0, 2.5, a.nx)
    etas = np.linspace(0.0, 0.99, a.neta)
    df = simulate(xs, etas, steps=a.steps, seed=a.seed)
    df.to_csv(out / "stability.csv", index=False)
    plot(df, out)
    far = df[(df.simulated != "unstable") & (df.max_abs_chi < 0.99)]
    summary = {
        "cells": len(df), "agreement": float(df.agree.mean()),
        "disagreements": df[~df.agree][["x", "eta", "simulated", "lemma"]].to_dict("records"),
        "steady_lag_rel_err_median": float(far.steady_lag_rel_err.median()),
        "steady_lag_rel_err_max": float(far.steady_lag_rel_err.max()),
        "steady_lag_cells": len(far), "steps": a.steps, "seed": a.seed,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "disagreements"}, indent=2))
    print("disagreements:", len(summary["disagreements"]))


if __name__ == "__main__":
    main()
