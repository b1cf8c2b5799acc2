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
# # Table 2: search-agent QA, ours beside the paper's
#
# Reads the runs of the `table2` sweep (`make reproduce-table2 SCALE=mini` puts them in
# `runs/reproduce/table2-mini/`) and writes the table, the orderings check and the figures with
# `analysis/table2.py`. `EMA_PG_RUNS` / `EMA_PG_OUT` choose the folders.

# %%
import os
import sys
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "analysis").is_dir() else Path.cwd().parents[1]
sys.path.insert(0, str(ROOT / "analysis"))
RUNS = os.environ.get("EMA_PG_RUNS", str(ROOT / "runs" / "reproduce" / "table2-mini"))
OUT = os.environ.get("EMA_PG_OUT", str(ROOT / "runs" / "notebooks" / "table2"))

# %%
import pandas as pd  # noqa: E402
from table2 import main  # noqa: E402

report = main(["--runs", RUNS, "--out", OUT, "--all", "--scale", "notebook"])
table = report["table"].pivot(index="method", columns="split", values="mean")
table

# %% [markdown]
# The paper's orderings, checked on the paper's numbers and on ours:

# %%
pd.DataFrame(report["orderings"])

# %%
from IPython.display import Image, display  # noqa: E402

for png in sorted(Path(OUT).glob("*.png")):
    display(Image(filename=str(png)))
