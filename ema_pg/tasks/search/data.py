"""Search-R1 parquet files from a local directory (the GPU path; nothing is downloaded).

Rows: ``data_source`` (nq, hotpotqa, ...), ``prompt`` (a list of chat messages whose user
content already holds the full instruction and the question; used as it is),
``reward_model.ground_truth.target`` (gold answers), ``extra_info.{split,index}``.
``train.parquet`` is the training set; every other ``*.parquet`` is read as test data and
split by ``data_source``.
"""

from __future__ import annotations

from pathlib import Path

from ..base import Prompt


def _row_to_prompt(row: dict, where: str) -> Prompt:
    try:
        msgs = row["prompt"]
        content = "".join(m["content"] for m in msgs if m.get("role") == "user") if not isinstance(msgs, str) else msgs
        target = row["reward_model"]["ground_truth"]["target"]
        golds = [str(t) for t in (list(target) if not isinstance(target, str) else [target])]
        source = str(row["data_source"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: malformed Search-R1 row (missing {e}); expected data_source, "
                         "prompt=[{role, content}], reward_model.ground_truth.target") from None
    if not isinstance(content, str) or not content.strip():
        raise ValueError(f"{where}: the prompt is empty or not text ({content!r}); fix or drop that row")
    if not golds or not any(g.strip() for g in golds):
        raise ValueError(f"{where}: row has no gold answers in reward_model.ground_truth.target")
    return Prompt(text=content, answer=golds[0], meta={"answers": golds, "split": source, "hops": 0,
                                                       "question": content})


def load_search_r1(data_dir: str) -> tuple[list[Prompt], dict[str, list[Prompt]]]:
    import pandas as pd

    d = Path(data_dir).expanduser()
    if not d.is_dir():
        raise ValueError(f"task.data_dir={data_dir!r} is not a directory of Search-R1 parquet files")
    train_file = d / "train.parquet"
    if not train_file.is_file():
        raise ValueError(f"task.data_dir={data_dir!r} has no train.parquet")
    train = [_row_to_prompt(r, f"{train_file}:{i}") for i, r in enumerate(pd.read_parquet(train_file).to_dict("records"))]
    evals: dict[str, list[Prompt]] = {}
    for f in sorted(d.glob("*.parquet")):
        if f.name == "train.parquet":
            continue
        for i, r in enumerate(pd.read_parquet(f).to_dict("records")):
            p = _row_to_prompt(r, f"{f}:{i}")
            evals.setdefault(p.meta["split"], []).append(p)
    if not evals:
        raise ValueError(f"task.data_dir={data_dir!r} has no test parquet files besides train.parquet")
    return train, evals
