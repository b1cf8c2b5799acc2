# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Printed vs corrected Top-k tail (our ablation)
#
# Reads a folder of runs of the `tail_bias` sweep and draws its figure with `analysis/tail_bias_sweep.py`
# (the same code `make reproduce NAME=tail_bias` runs). Set `EMA_PG_RUNS` to the sweep's multirun
# folder (default: the mini reproduction's runs) and `EMA_PG_OUT` to where the files go.
# Open it with `jupytext --to notebook analysis/notebooks/tail_bias.py` or run it as a script.

# %%
import os
import sys
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "analysis").is_dir() else Path.cwd().parents[1]
sys.path.insert(0, str(ROOT / "analysis"))
RUNS = os.environ.get("EMA_PG_RUNS", str(ROOT / "runs" / "reproduce" / "tail_bias-mini"))
OUT = os.environ.get("EMA_PG_OUT", str(ROOT / "runs" / "notebooks" / "tail_bias"))

# %%
from tail_bias_sweep import main  # noqa: E402

report = main(["--runs", RUNS, "--out", OUT, "--all"])

# %% [markdown]
# Final metric per variant (mean ± sample std over seeds):

# %%
report["table"]

# %%
from IPython.display import Image, display  # noqa: E402

for png in sorted(Path(OUT).glob("*.png")):
    display(Image(filename=str(png)))
