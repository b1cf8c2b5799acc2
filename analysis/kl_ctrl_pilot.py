"""The adaptive-beta study's pilot, read by its committed rule (reproductions/kl_ctrl/README.md): the controller's
target is the mean over the run's iterations of ``train/kl_ctrl_kl`` (the sampled KL(pi_old || anchor) the
controller measures), to two significant digits.

    python analysis/kl_ctrl_pilot.py runs/reproduce/kl_ctrl-pilot/ema_s0 --out reproductions/kl_ctrl/pilot.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pandas as pd

HORIZON = 2560  #: the README's, fixed before the pilot: a tenth of a run's 25,600 responses


def target(run: Path) -> dict:
    """The pilot's numbers: its iterations, the mean sampled KL, the target it gives and the run's commit."""
    if not (run / "eval.json").is_file():
        raise SystemExit(f"{run}: the pilot run has not finished (no eval.json); run it to its end first")
    m = pd.read_csv(run / "metrics.csv")
    kl = m.dropna(subset=["train/kl_ctrl_kl"]).groupby("step")["train/kl_ctrl_kl"].last()
    mean = float(kl.mean())
    digits = 1 - int(math.floor(math.log10(abs(mean))))
    return {"run": str(run), "commit": (run / "git.txt").read_text().split()[0] if (run / "git.txt").is_file() else "",
            "iterations": int(len(kl)), "mean_kl_ctrl_kl": mean, "kl_target": round(mean, digits),
            "kl_horizon": HORIZON}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    res = target(a.run)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"kl_target {res['kl_target']} (mean train/kl_ctrl_kl {res['mean_kl_ctrl_kl']:.5f} over "
          f"{res['iterations']} iterations); kl_horizon {res['kl_horizon']}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
