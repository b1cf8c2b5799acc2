"""benchmarks/README.md's tables and the README's line of what ran on a GPU are written from the result files
(benchmarks/tables.py): the committed pages are what the script writes, an edited number is put back, and "finished
on a GPU" means what it says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "benchmarks" / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_committed_table_is_what_its_files_give(tables):
    assert tables.main(["--check"]) == 0  # run python benchmarks/tables.py after a new result or a changed builder
    pages = [p.read_text() for p in tables.PAGES]
    names = [m[1] for text in pages for m in tables.MARK.finditer(text)]
    assert len(names) >= 20 and {"rl_step", "kl_head_gpu", "recipes_second", "gpu_line", "gpu_runs"} <= set(names)
    bench = (ROOT / "benchmarks" / "README.md").read_text()
    outside = [line for line in tables.MARK.sub("", bench).splitlines() if line.startswith("|---")]
    assert outside == [], "a table of benchmarks/README.md outside the markers is typed by hand"


def test_a_number_typed_into_a_table_is_put_back_from_its_file(tables):
    text = (ROOT / "benchmarks" / "README.md").read_text()
    m = next(m for m in tables.MARK.finditer(text) if m[1] == "kl_head_gpu")
    body = m[3]
    assert "| 105x |" in body  # the materialized head's peak over the chunked one's: 104.7x in the JSON
    edited = text.replace(body, body.replace("| 105x |", "| 101x |", 1))
    assert tables.render(edited) == text


def test_finished_on_a_gpu_means_every_iteration_and_a_clean_exit(tables):
    its = [{"time/step_s": 1.0}] * 2
    base = {"overrides": ["algo.iterations=2"], "iterations": its}
    assert tables.recipe_state({**base, "run": {"rc": 0}})[0]
    assert not tables.recipe_state({**base, "run": {"rc": 1}, "iterations": its[:1]})[0]  # the 1.5B ZeRO-3 case
    assert not tables.recipe_state({**base, "run": {"rc": -9, "killed": "the benchmark's time cap (SIGTERM)"}})[0]
    assert tables.recipe_state({**base, "run": {"rc": -9, "killed": "after iteration 2's metrics"}})[0]  # --steps-only
    assert tables.recipe_state({**base, "run": {"rc": -9}, "resume": {"rc": 0}})[0]  # killed on purpose, resumed
    line = tables.gpu_line([])[0]
    assert "not finished: the math_deepscaler recipe at 1.5B under ZeRO-3" in line.replace("Started there and ", "")
    assert "whose exported anchor equalled the policy" in line
