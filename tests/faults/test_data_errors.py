"""Every kind of bad data file is one line that names the file (and the row or line where there is one): not UTF-8,
not JSON, not parquet, a truncated parquet, answers of the wrong type; nothing is accepted silently."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ema_pg.tasks.math.data import load_math_dir
from ema_pg.tasks.search.data import load_search_r1

TEMPLATE = "{problem}"


def math_dir(tmp_path, train: bytes | list, name: str = "train.json"):
    d = tmp_path / "math"
    d.mkdir()
    (d / name).write_bytes(train if isinstance(train, bytes) else json.dumps(train).encode())
    (d / "test.json").write_text(json.dumps([{"problem": "1+1?", "answer": "2"}]))
    return d


@pytest.mark.parametrize("content, where, says", [
    ('[{"problem": "caf\xe9?", "answer": "1"}]'.encode("latin-1"), "line 1", "not UTF-8 (byte 0xe9"),
    ('[{"problem": "x?", "answer": "1"}]'.encode("utf-16"), "line 1", "not UTF-8 (byte 0xff"),
    (b'[{"problem": "x?", "answer": "1"},\n{"problem": ', "", "not JSON"),
    ([{"problem": "x?", "answer": {"value": "14"}}], "row 1", "is not an answer"),
    ([{"problem": "x?", "answer": "1"}, {"problem": "y?", "answer": float("nan")}], "row 2", "a missing value"),
    ([{"problem": "x?", "answer": [True]}], "row 1", "is not an answer"),
])
def test_a_bad_math_file_is_one_line_naming_the_file_and_where(tmp_path, content, where, says):
    d = math_dir(tmp_path, content)
    with pytest.raises(ValueError) as e:
        load_math_dir(str(d), TEMPLATE)
    msg = str(e.value)
    assert str(d / "train.json") in msg and where in msg and says in msg and "\n" not in msg, msg


def test_a_parquet_that_is_not_one_or_is_cut_short_or_has_struct_answers_is_named(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    pd.DataFrame({"question": ["a?", "b?"], "ground_truth": ["1", "2"], "data_source": ["x", "x"]}).to_parquet(d / "whole.parquet")
    raw = (d / "whole.parquet").read_bytes()
    (d / "test.json").write_text(json.dumps([{"problem": "1+1?", "answer": "2"}]))
    for name, data, says in (("train.parquet", b"not a parquet file at all", "not a readable parquet file"),
                             ("train.parquet", raw[: len(raw) // 2], "not a readable parquet file")):
        (d / name).write_bytes(data)
        with pytest.raises(ValueError, match="not a readable parquet file") as e:
            load_math_dir(str(d), TEMPLATE, splits={"train": name, "test": "test.json"})
        assert str(d / name) in str(e.value) and says in str(e.value)
    pd.DataFrame({"question": ["a?"], "ground_truth": [{"value": "14"}], "data_source": ["x"]}).to_parquet(d / "train.parquet")
    with pytest.raises(ValueError, match=r"train\.parquet: row 1: the gold answer must be text"):
        load_math_dir(str(d), TEMPLATE, splits={"train": "train.parquet", "test": "test.json"})


def test_a_search_r1_row_with_an_object_for_an_answer_is_refused(tmp_path):
    row = {"data_source": "nq", "prompt": [{"role": "user", "content": "q?"}],
           "reward_model": {"style": "rule", "ground_truth": {"target": [{"text": "Paris"}]}}}
    pd.DataFrame([row]).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame([{**row, "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris"]}}}]).to_parquet(
        tmp_path / "test.parquet")
    with pytest.raises(ValueError, match=r"train\.parquet: row 1: a gold answer must be text or a number"):
        load_search_r1(str(tmp_path))


def test_repeated_eval_rows_count_once_and_repeated_training_rows_are_said(tmp_path, caplog):
    """Training rows x20 and eval rows x10 weighed the eval metric by their copies, silently."""
    d = math_dir(tmp_path, [{"problem": "x?", "answer": "1"}] * 20 + [{"problem": "y?", "answer": "2"}])
    (d / "test.json").write_text(json.dumps([{"problem": "1+1?", "answer": "2"}] * 10
                                            + [{"problem": "1+1?", "answer": "3"}, {"problem": "2+2?", "answer": "4"}]))
    with caplog.at_level("WARNING"):
        train, evals = load_math_dir(str(d), TEMPLATE)
    assert len(train) == 21 and "19 of the 21 training rows repeat another" in caplog.text
    # the same question with another gold answer is another row; the split's mean is over 3 questions, not 12
    assert [p.answer for p in evals["test"]] == ["2", "3", "4"] and "test 9 of 12" in caplog.text
