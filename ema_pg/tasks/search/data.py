"""Search-R1 parquet files from a local directory, as ``scripts/data_process/qa_search_{train,test}_merge.py``
write them (nothing is downloaded).

Columns: ``id``, ``question`` (stripped, ending in "?"), ``golden_answers``, ``data_source`` (nq, hotpotqa,
...), ``prompt`` (chat messages; the user message holds the full instruction and the question), ``ability``,
``reward_model{style, ground_truth{target: [gold answers]}}``, ``extra_info{split, index}``.
``train.parquet`` is the training set; every other ``*.parquet`` (Search-R1 writes one ``test.parquet``
with every benchmark) is test data, split by ``data_source``.

A row becomes a :class:`Prompt` whose ``messages`` are the row's chat messages, every one kept (rendered
by :class:`ema_pg.prompts.PromptEncoder`: the tokenizer's chat template when it has one, as Search-R1's
RL dataset does); ``meta["question"]`` is the ``question`` column (the RAG baseline's query), and the
gold answers come from ``reward_model.ground_truth.target`` (``golden_answers`` where that is absent).
A row that cannot be read stops the load with its file and 1-based row number.
"""

from __future__ import annotations

from pathlib import Path

from ..base import Prompt, distinct_evals, say_copies


def _as_list(x) -> list:
    if x is None or isinstance(x, str | bytes | dict):
        return [] if x is None else [x]
    return list(x)  # numpy arrays (parquet lists), lists, tuples


def _messages(raw, where: str) -> list[dict]:
    if isinstance(raw, str):  # a prompt stored as text
        return [{"role": "user", "content": raw}]
    msgs = []
    for m in _as_list(raw):
        if not isinstance(m, dict) or "content" not in m or not isinstance(m["content"], str):
            raise ValueError(f"{where}: 'prompt' must be a list of chat messages {{role, content}}; got {m!r:.80}")
        msgs.append({"role": str(m.get("role") or "user"), "content": m["content"]})
    if not any(m["content"].strip() for m in msgs):
        raise ValueError(f"{where}: the prompt is empty; fix or drop that row")
    return msgs


def row_to_prompt(row: dict, where: str) -> Prompt:
    missing = [k for k in ("data_source", "prompt") if k not in row]
    if missing:
        raise ValueError(f"{where}: malformed Search-R1 row (missing {', '.join(missing)}); expected data_source, "
                         "prompt=[{role, content}], reward_model.ground_truth.target")
    msgs = _messages(row["prompt"], where)
    rm = row.get("reward_model")
    gt = rm.get("ground_truth") if isinstance(rm, dict) else None
    target = gt.get("target") if isinstance(gt, dict) else gt
    golds = []
    for t in _as_list(target if target is not None else row.get("golden_answers")):
        t = t.item() if hasattr(t, "item") and not isinstance(t, str) else t
        if isinstance(t, bool) or not isinstance(t, str | int | float) or (isinstance(t, float) and t != t):
            raise ValueError(f"{where}: a gold answer must be text or a number; got {t!r:.80} "
                             f"({type(t).__name__}) in reward_model.ground_truth.target / golden_answers")
        golds.append(str(t))
    if not any(g.strip() for g in golds):
        raise ValueError(f"{where}: the row has no gold answers (reward_model.ground_truth.target, or golden_answers)")
    user = [m["content"] for m in msgs if m["role"] == "user"]
    question = row.get("question")
    question = question.strip() if isinstance(question, str) and question.strip() else (user[-1] if user else msgs[-1]["content"])
    text = "\n\n".join(m["content"] for m in msgs)
    return Prompt(text=text, answer=golds[0], messages=msgs,
                  meta={"answers": golds, "split": str(row["data_source"]), "hops": 0, "question": question})


def _rows(f: Path) -> list[dict]:
    import pandas as pd

    try:
        return pd.read_parquet(f).to_dict("records")
    except Exception as e:  # noqa: BLE001 - a broken file is named with what pyarrow said
        raise ValueError(f"{f}: not a readable parquet file ({type(e).__name__}: {e})") from None


def load_search_r1(data_dir: str, per_split: int = 0) -> tuple[list[Prompt], dict[str, list[Prompt]]]:
    """(training prompts, {data_source: test prompts}); ``per_split`` > 0 keeps the first ``per_split`` rows of
    each test split, in file order."""
    d = Path(data_dir).expanduser()
    if not d.is_dir():
        raise ValueError(f"task.data_dir={data_dir!r} is not a directory of Search-R1 parquet files")
    train_file = d / "train.parquet"
    if not train_file.is_file():
        raise ValueError(f"task.data_dir={data_dir!r} has no train.parquet (qa_search_train_merge.py writes it)")
    train = [row_to_prompt(r, f"{train_file}: row {i}") for i, r in enumerate(_rows(train_file), 1)]
    if not train:
        raise ValueError(f"{train_file} has no rows")
    evals: dict[str, list[Prompt]] = {}
    for f in sorted(d.glob("*.parquet")):
        if f.name == "train.parquet":
            continue
        for i, r in enumerate(_rows(f), 1):
            p = row_to_prompt(r, f"{f}: row {i}")
            evals.setdefault(p.meta["split"], []).append(p)
    say_copies(train, f"task.data_dir={data_dir}")
    evals = distinct_evals(evals, f"task.data_dir={data_dir}")  # copies out before the first per_split are kept
    if per_split:
        evals = {k: v[:per_split] for k, v in evals.items()}
    if not evals:
        raise ValueError(f"task.data_dir={data_dir!r} has no test parquet files besides train.parquet "
                         "(qa_search_test_merge.py writes test.parquet)")
    return train, evals
