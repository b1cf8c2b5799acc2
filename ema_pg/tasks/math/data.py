"""Math data as people have it, from local files (nothing is downloaded).

**Files.** ``task.splits`` maps split names to files (paths relative to ``task.data_dir``, or absolute),
the files keeping their own names: ``train`` is the training set, every other entry an eval split,
e.g. DeepScaleR's raw JSON from rLLM's ``rllm/data``::

    task.data_dir=rllm/data 'task.splits={train: train/math/deepscaler.json, aime24: test/math/aime.json,
                                          amc: test/math/amc.json, math500: test/math/math.json}'

Without ``task.splits`` the folder is read by convention: ``train.*`` (or one ``*_train.*``, as
DeepScaleR's ``deepscaler_train.parquet``) is the training set and every other data file an eval split
named by its stem (verl's ``train.parquet`` + ``test.parquet``; DeepScaleR's ``aime.parquet``, ...);
verl's ``*_example.json`` previews are not data. A folder of rLLM registry datasets (``<name>/train.parquet``,
``<name>/test.parquet``, as the authors' ``prepare_all_math_data.py`` registers them) gives the
training rows of every ``<name>/train.parquet`` and one eval split per ``<name>/test.parquet``.

**Formats** (``.json`` arrays, ``.jsonl`` lines, ``.parquet``), told apart per row:

- raw (DeepScaleR's JSON): ``problem`` and ``answer`` (text, a number such as AMC's ``142.0``, or a list of
  accepted answers such as Minerva's ``['9.6\\n']``); ``solution`` (optional) gives cold-start demonstrations.
  The prompt is ``task.prompt_template`` with the problem.
- verl parquet (DeepScaleR's ``deepscaler_dataset.py``, verl's ``gsm8k.py`` / ``math_dataset.py``):
  ``prompt`` (chat messages holding the instruction, used as they are), ``reward_model.ground_truth``,
  ``data_source``. verl's GSM8K rows (``data_source`` openai/gsm8k) ask for the answer after ``####``
  and are scored as verl scores them (the last ``#### number``, commas dropped, equal to the gold).
- rLLM registry: ``question``, ``ground_truth``, ``data_source``.

A list of gold answers means any of them counts. A row that cannot be read stops the load with its file
and 1-based row number, and what to change.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..base import Prompt, distinct_evals, say_copies

SUFFIXES = (".parquet", ".jsonl", ".json")
GSM8K_SOURCE = "openai/gsm8k"  #: verl's data_source of its GSM8K rows (answer after "####")


def read_text(f: Path) -> str:
    """A data file's text as UTF-8, or one line naming the file, the line and the byte that is not UTF-8."""
    raw = f.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{f}: line {line}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); data files are "
                         "read as UTF-8: convert it (iconv -f <its encoding> -t utf-8)") from None


def read_rows(f: Path) -> list[dict]:
    """The rows of one data file: a parquet table, JSON lines, or a JSON array of objects."""
    if f.suffix == ".parquet":
        import pandas as pd

        try:
            return pd.read_parquet(f).to_dict("records")
        except Exception as e:  # noqa: BLE001 - a broken file is named with what pyarrow said
            raise ValueError(f"{f}: not a readable parquet file ({type(e).__name__}: {e})") from None
    if f.suffix == ".json":
        try:
            rows = json.loads(read_text(f))
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not JSON ({e.msg} at line {e.lineno}); a .json file is one array of rows") from None
        if not isinstance(rows, list):
            raise ValueError(f"{f}: a .json data file is an array of rows (DeepScaleR's format); got a "
                             f"{type(rows).__name__}")
        for i, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise ValueError(f"{f}: row {i}: a row must be a JSON object; got {type(row).__name__}")
        return rows
    rows = []
    for i, line in enumerate(read_text(f).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: row {i}: not a JSON object ({e.msg}); each line of a .jsonl file is one row") from None
        if not isinstance(row, dict):
            raise ValueError(f"{f}: row {i}: a row must be a JSON object with 'problem' and 'answer'; got "
                             f"{type(row).__name__}")
        rows.append(row)
    return rows


def _golds(x) -> list[str]:
    """Gold answers as text: a string, a number (142.0), or a list / array of either. Anything else (an object, a
    NaN, a boolean) raises TypeError: its text would be a gold answer nobody meant (``{"value": "14"}`` read as
    "value", a missing answer as "nan")."""
    import math

    if x is None:
        return []
    if isinstance(x, dict) or (hasattr(x, "keys") and not isinstance(x, str)):
        raise TypeError(f"an object ({x!r}) is not an answer")
    items = [x] if isinstance(x, str | int | float) else list(x) if hasattr(x, "__iter__") else [x]
    out = []
    for a in items:
        if a is None:
            continue
        if hasattr(a, "item") and not isinstance(a, str):  # numpy scalars from parquet
            a = a.item()
        if isinstance(a, bool) or not isinstance(a, str | int | float):
            raise TypeError(f"{a!r} ({type(a).__name__}) is not an answer")
        if isinstance(a, float) and not math.isfinite(a):
            raise TypeError(f"{a!r} is not an answer (a missing value?)")
        if isinstance(a, int | float):
            a = str(int(a)) if float(a).is_integer() else str(a)
        if a.strip():
            out.append(a.strip())
    return out


def _messages(raw) -> list[dict] | None:
    if isinstance(raw, str) or not hasattr(raw, "__iter__"):
        return None
    msgs = [m for m in list(raw) if isinstance(m, dict) and isinstance(m.get("content"), str)]
    return [{"role": str(m.get("role") or "user"), "content": m["content"]} for m in msgs] or None


def row_to_prompt(row: dict, where: str, template: str) -> Prompt:
    """One row of any of the formats above as a :class:`Prompt` (``where``: file and row, for messages)."""
    msgs = _messages(row.get("prompt"))
    rm = row.get("reward_model")
    source = str(row.get("data_source") or "")
    if msgs is not None:  # verl: the chat messages hold the instruction
        gold = rm.get("ground_truth") if isinstance(rm, dict) else row.get("answer", row.get("ground_truth"))
        user = [m["content"] for m in msgs if m["role"] == "user"]
        problem = user[-1] if user else msgs[-1]["content"]
        text = "\n\n".join(m["content"] for m in msgs)
    else:
        problem = row.get("problem", row.get("question"))
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"{where}: the row has no problem text: give 'problem' (DeepScaleR), 'question' (rLLM) "
                             f"or 'prompt' as chat messages (verl); got keys {sorted(row)}")
        gold = row["answer"] if "answer" in row else row.get("ground_truth")
        if gold is None and isinstance(rm, dict):
            gold = rm.get("ground_truth")
        text = template.format(problem=problem)
    try:
        golds = _golds(gold)
    except TypeError as e:
        raise ValueError(f"{where}: the gold answer must be text, a number or a list of them; {e}") from None
    if not golds:
        raise ValueError(f"{where}: the row has no gold answer: 'answer' (DeepScaleR), 'ground_truth' (rLLM) or "
                         f"'reward_model.ground_truth' (verl), as text, a number or a list; got {gold!r}")
    meta = {"problem": problem, "source": where, "answers": golds, "data_source": source}
    if source == GSM8K_SOURCE:
        meta["answer_format"] = "####"
    solution = row.get("solution")
    if isinstance(solution, list | tuple) and solution and isinstance(solution[0], str):  # OlympiadBench: a list
        solution = solution[0]
    if isinstance(solution, str) and solution.strip():
        meta["solution"] = solution
    return Prompt(text=text, answer=golds[0], meta=meta, messages=msgs)


def discover(d: Path) -> dict[str, list[Path]]:
    """Split name -> files, by the folder's convention (see the module docstring)."""
    files = sorted(f for f in d.iterdir() if f.is_file() and f.suffix in SUFFIXES and not f.name.endswith("_example.json"))
    if not files:  # rLLM's registry: <name>/<split>.parquet
        named = sorted(p for p in d.iterdir() if p.is_dir() and any((p / f"{s}.parquet").is_file() for s in ("train", "test")))
        out: dict[str, list[Path]] = {"train": [p / "train.parquet" for p in named if (p / "train.parquet").is_file()]}
        out.update({p.name: [p / "test.parquet"] for p in named if (p / "test.parquet").is_file()})
        return out if named else {}
    train = [f for f in files if f.stem == "train"] or [f for f in files if f.stem.endswith("_train")]
    if len(train) > 1:
        raise ValueError(f"task.data_dir={str(d)!r} has several training files ({', '.join(f.name for f in train)}); "
                         "name the files of each split: task.splits={train: FILE, <split>: FILE, ...}")
    return {"train": train, **{f.stem: [f] for f in files if f not in train}}


def load_math_dir(data_dir: str, template: str, splits: dict | None = None) -> tuple[list[Prompt], dict[str, list[Prompt]]]:
    """(training prompts, {split: eval prompts}) from ``data_dir`` and, if given, the ``splits`` mapping."""
    d = Path(data_dir).expanduser()
    if not d.is_dir():
        raise ValueError(f"task.data_dir={data_dir!r} is not a directory of math files")
    if splits:
        files = {}
        for name, f in dict(splits).items():
            paths = [Path(str(x)) for x in (f if isinstance(f, list | tuple) else [f])]
            paths = [p if p.is_absolute() else d / p for p in paths]
            missing = [str(p) for p in paths if not p.is_file()]
            if missing:
                raise ValueError(f"task.splits.{name}: no such file {missing[0]}")
            files[str(name)] = paths
    else:
        files = discover(d)
    if not files.get("train"):
        raise ValueError(f"task.data_dir={data_dir!r}: no training file (train.*, *_train.* or <name>/train.parquet); "
                         "name the files: task.splits={train: FILE, <split>: FILE, ...}")
    load = lambda fs: [row_to_prompt(r, f"{f}: row {i}", template) for f in fs for i, r in enumerate(read_rows(f), 1)]  # noqa: E731
    train = load(files["train"])
    if not train:
        raise ValueError(f"{files['train'][0]} has no rows")
    evals = {k: load(v) for k, v in files.items() if k != "train"}
    if not evals:
        raise ValueError(f"task.data_dir={data_dir!r} has no eval files besides the training set (one file per "
                         "benchmark, or task.splits={train: FILE, <split>: FILE, ...})")
    empty = [k for k, v in evals.items() if not v]
    if empty:
        raise ValueError(f"task.data_dir={data_dir!r}: eval files with no rows: {', '.join(empty)}")
    say_copies(train, f"task.data_dir={data_dir}")
    return train, distinct_evals(evals, f"task.data_dir={data_dir}")
