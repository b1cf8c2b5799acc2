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
# # One ablation's report
#
# Reads a folder of runs of one sweep and draws its report from the table in
# `ema_pg/workbench/reports.py` (the code `make reproduce NAME=...` runs). Set `EMA_PG_REPORT` to the
# sweep's name (`fig5_methods`, `fig6_k`, ..., `table2`), `EMA_PG_RUNS` to its runs folder
# (default: that reproduction's mini runs) and `EMA_PG_OUT` to where the files go.
# Open it with `jupytext --to notebook analysis/notebooks/ablation.py` or run it as a script.

# %%
import os
from pathlib import Path

from ema_pg.workbench.reports import REPORTS, Report, run_report

NAME = os.environ.get("EMA_PG_REPORT", "fig6_k")
RUNS = os.environ.get("EMA_PG_RUNS", f"runs/reproduce/{NAME}-mini")
OUT = os.environ.get("EMA_PG_OUT", f"runs/notebooks/{NAME}")
print(f"{NAME}: {REPORTS[NAME].title if isinstance(REPORTS[NAME], Report) else 'Table 2 beside the paper'}")

# %%
report = run_report(NAME, RUNS, OUT, include_unfinished=True)

# %% [markdown]
# Final metric per variant (mean ± sample std over seeds):

# %%
report["table"]

# %%
from IPython.display import Image, display  # noqa: E402

for png in sorted(Path(OUT).glob("*.png")):
    display(Image(filename=str(png)))
