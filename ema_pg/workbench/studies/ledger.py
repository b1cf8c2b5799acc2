"""A decision plan's ledger, read strictly: ``cells.csv`` (every finished cell's scores) and ``looks.csv`` (every
look's numbers). Both are written whole by the workbench (``atomic_write``); a file that is not as it writes them
was damaged or edited, and it is refused in one line naming the file, the row and what to do, before anything is
written: no row is taken silently, none guessed, none written over.

Each is refused for: an empty file; a missing column; a row with too few or too many fields, or a last row without
its line end (a copy or a write cut short); a seed, look or count that is not a whole number; a score that is not a
JSON object of numbers (``NaN`` is a number here: a cell whose score is NaN is a failed cell, left out of its pairs
and said at the look); a row given twice (the same cell, or the same claim at the same look); a verdict that is not
one of the four.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pandas as pd

from .sequential import VERDICTS

CELL_COLUMNS = ("method", "seed", "scores", "commit")  #: cells.csv's required columns (base, machine: since later)
LOOKS = "looks.csv"  #: every look's numbers, beside the plan
LOOK_COLUMNS = ("look", "claim", "text", "better", "worse", "score", "planned_seeds", "seeds", "left_out", "mean_better",
                "mean_worse", "mean_diff", "sd_diff", "t", "z_bound", "t_bound", "lo", "hi", "verdict", "taken",
                "commits")  #: looks.csv's required columns (``plan``, the contract's fingerprint: since later)
LOOK_INTS = ("look", "planned_seeds", "seeds")
UNDEFINED = ("t", "lo", "hi")  #: left empty (NaN) by a look that decided nothing from a degenerate statistic
LOOK_FLOATS = ("mean_better", "mean_worse", "mean_diff", "sd_diff", "t", "z_bound", "t_bound", "lo", "hi")


class LedgerError(SystemExit):
    """A ledger file that is not as the workbench writes it: one line naming it, the row and what to do."""


def _fix(f: Path) -> str:
    return f"restore it from git (git checkout -- {f}) or repair that row by hand; nothing was written"


def _rows(f: Path, required: tuple[str, ...]) -> pd.DataFrame:
    """The file's rows as text, after the checks every ledger file gets (whole rows, every required column)."""
    text = f.read_text()
    if not text.strip():
        raise LedgerError(f"{f}: the file is empty; {_fix(f)}, or delete it if nothing has been recorded yet")
    if not text.endswith("\n"):
        n = text.count("\n") + 1
        raise LedgerError(f"{f}: row {n} (line {n}) ends without its line end: it was cut short; {_fix(f)}")
    lines = list(csv.reader(io.StringIO(text)))
    header = lines[0]
    if missing := [c for c in required if c not in header]:
        raise LedgerError(f"{f}: no column {', '.join(missing)} (the header is {','.join(header)}); {_fix(f)}")
    for i, row in enumerate(lines[1:], 2):
        if len(row) != len(header):
            raise LedgerError(f"{f}: line {i} has {len(row)} fields, the header {len(header)}: the row is cut or "
                              f"joined; {_fix(f)}")
    return pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)


def _int(f: Path, line: int, col: str, v: str) -> int:
    if not v.strip().lstrip("-").isdigit():
        raise LedgerError(f"{f}: line {line}'s {col} is {v!r}, not a whole number; {_fix(f)}")
    return int(v)


def read_cells_file(f: Path) -> dict[tuple[str, int], dict]:
    """{(method, seed): {"scores", "commit", "base", "machine"}} of a cells.csv, checked row by row."""
    if not f.is_file():
        return {}
    df = _rows(f, CELL_COLUMNS)
    out = {}
    for i, r in enumerate(df.to_dict("records"), 2):
        seed = _int(f, i, "seed", r["seed"])
        try:
            scores = json.loads(r["scores"])
            if not isinstance(scores, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in scores.values()):
                raise ValueError("not an object of numbers")
        except ValueError as e:
            raise LedgerError(f"{f}: line {i}'s scores ({r['scores'][:40]!r}) are not a JSON object of numbers "
                              f"({str(e).splitlines()[0]}); {_fix(f)}") from None
        if not r["method"] or not r["commit"]:
            raise LedgerError(f"{f}: line {i} has no {'method' if not r['method'] else 'commit'}; {_fix(f)}")
        key = (r["method"], seed)
        if key in out:
            raise LedgerError(f"{f}: line {i} repeats the cell {r['method']} seed {seed} (a cell has one row); keep "
                              f"the row its run folder's eval.json agrees with and delete the other")
        out[key] = {"scores": scores, "commit": r["commit"], "base": r.get("base", ""), "machine": r.get("machine", "")}
    return out


def read_looks_file(f: Path) -> pd.DataFrame:
    """A looks.csv, checked row by row; ``left_out`` as text, the counts as ints, the statistics as floats."""
    if not f.is_file():
        return pd.DataFrame()
    df = _rows(f, LOOK_COLUMNS)
    seen = set()
    for i, r in enumerate(df.to_dict("records"), 2):
        for c in LOOK_INTS:
            _int(f, i, c, r[c])
        for c in LOOK_FLOATS:
            if c in UNDEFINED and r[c] == "":
                continue  # a look whose differences did not vary: its t and interval are undefined (NaN)
            try:
                float(r[c])
            except ValueError:
                raise LedgerError(f"{f}: line {i}'s {c} is {r[c]!r}, not a number; {_fix(f)}") from None
        if r["verdict"] not in VERDICTS:
            raise LedgerError(f"{f}: line {i}'s verdict is {r['verdict']!r}, none of {', '.join(VERDICTS)}; {_fix(f)}")
        key = (int(r["look"]), r["claim"])
        if key in seen:
            raise LedgerError(f"{f}: line {i} repeats look {key[0]} of claim {key[1]} (a look is taken once); delete "
                              f"the later row")
        seen.add(key)
    for c in LOOK_INTS:
        df[c] = df[c].astype(int)
    for c in LOOK_FLOATS:
        df[c] = df[c].replace("", "nan").astype(float)
    return df


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
