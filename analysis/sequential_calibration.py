"""The false-"holds" rate of the sequential design as decide applies it (t statistics of an estimated sd against
z boundaries carried to the t scale), measured by simulation under no effect. Writes calibration.json.

    python analysis/sequential_calibration.py --out reproductions/sequential_calibration [--sims 4000000]

The z boundaries keep the one-sided error at alpha / 2 for a Brownian motion; carrying each to the t distribution
with n - 1 degrees of freedom at the same nominal p-value is the usual small-sample correction, not an exact one.
This measures what it gives: the share of simulated null claims that end "holds", with its Monte-Carlo standard
error, per design (the claims plan's looks, the default, Pocock's spending, a short plan). Seeded: the same numbers
every time.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ema_pg.workbench.studies.sequential import Design, _verdict_shares

DESIGNS = {"claims plan (10, 20, 30, 45, 60), O'Brien-Fleming": Design((10, 20, 30, 45, 60)),
           "pocock (10, 20, 30, 45, 60)": Design((10, 20, 30, 45, 60), spending="pocock"),
           "short (3, 5), O'Brien-Fleming": Design((3, 5)),
           "unequal (5, 12, 20), O'Brien-Fleming": Design((5, 12, 20))}
CHUNK = 200_000


def measure(design: Design, sims: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    zb = design.boundaries()
    holds = fails = 0
    for _ in tqdm(range(sims // CHUNK), desc=str(design.looks), leave=False):
        d = rng.standard_normal((CHUNK, design.cap))
        s, q = np.cumsum(d, 1), np.cumsum(d * d, 1)

        def t_at(n):
            m = s[:, n - 1] / n
            return m / np.sqrt((q[:, n - 1] - n * m * m) / (n - 1) / n)
        r = _verdict_shares(design.looks, zb, t_at, CHUNK)
        holds += r["holds"] * CHUNK
        fails += r["fails"] * CHUNK
    n = (sims // CHUNK) * CHUNK
    p = holds / n
    return {"looks": list(design.looks), "alpha": design.alpha, "spending": design.spending, "sims": n, "seed": seed,
            "holds": p, "holds_mc_se": math.sqrt(p * (1 - p) / n), "fails": fails / n,
            "nominal_holds": design.alpha / 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("reproductions/sequential_calibration"))
    ap.add_argument("--sims", type=int, default=4_000_000)
    a = ap.parse_args()
    out = {name: measure(d, a.sims, seed=i) for i, (name, d) in enumerate(DESIGNS.items())}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "calibration.json").write_text(json.dumps(out, indent=2) + "\n")
    for name, r in out.items():
        print(f"{name}: holds {r['holds']:.5f} (MC se {r['holds_mc_se']:.5f}; nominal {r['nominal_holds']})")


if __name__ == "__main__":
    main()
