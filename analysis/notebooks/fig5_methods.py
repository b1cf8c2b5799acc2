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
# # Fig 5: EMA anchor and Top-k KL vs GRPO
#
# Reads a folder of runs of the `fig5_methods` sweep and draws its figure with `analysis/fig5_methods.py`
# (the same code `make reproduce NAME=fig5_methods` runs). Set `EMA_PG_RUNS` to the sweep's multirun
# folder (default: the mini reproduction's runs) and `EMA_PG_OUT` to where the files go.
# Open it with `jupytext --to notebook analysis/notebooks/fig5_methods.py` or run it as a script.

# %%
import os
import sys
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "analysis").is_dir() else Path.cwd().parents[1]
sys.path.insert(0, str(ROOT / "analysis"))
RUNS = os.environ.get("EMA_PG_RUNS", str(ROOT / "runs" / "reproduce" / "fig5_methods-mini"))
OUT = os.environ.get("EMA_PG_OUT", str(ROOT / "runs" / "notebooks" / "fig5_methods"))

# %%
from fig5_methods import main  # noqa: E402

report = main(["--runs", RUNS, "--out", OUT, "--all"])

# %% [markdown]
# Final metric per variant (mean ± sample std over seeds):

# %%
report["table"]

# %%
from IPython.display import Image, display  # noqa: E402

for png in sorted(Path(OUT).glob("*.png")):
    display(Image(filename=str(png)))
