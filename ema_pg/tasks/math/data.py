"""DeepScaleR-style math files from a local directory (nothing is downloaded).

``train.parquet`` or ``train.jsonl`` is the training set; every other ``*.parquet`` / ``*.jsonl``
is an eval split named by its file's stem. Each row needs ``problem`` (text; ``question`` is read
too) and ``answer`` (text or a number; the gold answer math-verify compares against); ``solution``
is optional (a worked solution ending in ``\\boxed{}``, used for the cold start). A malformed row
stops the load with its file and line and what is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..base import Prompt

SUFFIXES = (".parquet", ".jsonl")


def _read(f: Path) -> list[dict]:
    if f.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(f).to_dict("records")
    rows = []
    for i, line in enumerate(f.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}:{i + 1}: not a JSON object ({e.msg}); each line of a .jsonl file is one row") from None
        if not isinstance(row, dict):
            raise ValueError(f"{f}:{i + 1}: a row must be a JSON object with 'problem' and 'answer'; got {type(row).__name__}")
        rows.append(row)
    return rows


def row_to_prompt(row: dict, where: str, template: str) -> Prompt:
    problem = row.get("problem", row.get("question"))
    answer = row.get("answer")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{where}: the row has no problem text (a non-empty 'problem' field); got {problem!r}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"{where}: the row has no gold answer (a non-empty 'answer' field); got {answer!r}")
    solution = row.get("solution")
    meta = {"problem": problem, "source": where}
    if isinstance(solution, str) and solution.strip():
        meta["solution"] = solution
    return Prompt(text=template.format(problem=problem), answer=answer.strip(), meta=meta)


def load_math_dir(data_dir: str, template: str) -> tuple[list[Prompt], dict[str, list[Prompt]]]:
    d = Path(data_dir).expanduser()
    if not d.is_dir():
        raise ValueError(f"task.data_dir={data_dir!r} is not a directory of math files (train.jsonl / train.parquet "
                         "and one file per eval split)")
    files = sorted(f for f in d.iterdir() if f.suffix in SUFFIXES)
    train_files = [f for f in files if f.stem == "train"]
    if len(train_files) != 1:
        raise ValueError(f"task.data_dir={data_dir!r} needs exactly one train.parquet or train.jsonl; found "
                         f"{[f.name for f in train_files] or 'none'}")
    load = lambda f: [row_to_prompt(r, f"{f}:{i + 1}", template) for i, r in enumerate(_read(f))]  # noqa: E731
    train = load(train_files[0])
    if not train:
        raise ValueError(f"{train_files[0]} has no rows")
    evals = {f.stem: load(f) for f in files if f.stem != "train"}
    if not evals:
        raise ValueError(f"task.data_dir={data_dir!r} has no eval files besides {train_files[0].name} (one "
                         "<split>.jsonl or <split>.parquet per benchmark)")
    empty = [k for k, v in evals.items() if not v]
    if empty:
        raise ValueError(f"task.data_dir={data_dir!r}: eval files with no rows: {', '.join(empty)}")
    return train, evals
