"""``python -m ema_pg.pilot``: a pilot's rule is registered before its first run, a run folder that already holds
cells is refused, an edited plan is refused, the pick is the rule applied to the ledger alone; end to end (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from ema_pg.workbench.studies.pilot import (LEDGER, REGISTERED, apply_rule, load_pilot, main, record, register)

ROOT = Path(__file__).resolve().parents[2]


def write_pilot(folder: Path, runs: Path, **over) -> Path:
    plan = {"sweep": "fig5_methods", "scale": "smoke", "methods": ["grpo", "ema"], "seeds": [1, 2],
            "runs": str(runs), "rule": {"pick": 2, "above": 0.0}, **over}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pilot.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    return folder / "pilot.yaml"


def fake_cell(runs: Path, method: str, seed: int, before: dict, after: dict) -> None:
    """A finished run as the trainer leaves one: its iteration-0 evaluation in metrics.csv, its final in eval.json."""
    d = runs / f"{method}_s{seed}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "git.txt").write_text("abc123\n")
    (d / "machine.txt").write_text("cpu\n")
    pd.DataFrame([{"step": 0, **{f"eval/{k}/score": v for k, v in before.items()}},
                  {"step": 4, "train/reward": 0.5}]).to_csv(d / "metrics.csv", index=False)
    (d / "eval.json").write_text(json.dumps({"metric": "score", "splits": {k: {"score": v, "n": 8} for k, v in after.items()},
                                             "avg": sum(after.values()) / len(after),
                                             "base_avg": sum(before.values()) / len(before)}))


GAINS = {"a": 0.10, "b": 0.05, "c": -0.02}  #: each split's gain in every cell, so the means are these


def test_the_pick_is_the_registered_rule_applied_to_the_ledger_alone(tmp_path, capsys):
    runs = tmp_path / "runs"
    plan = load_pilot(write_pilot(tmp_path / "pilot", runs))
    rec = register(plan, ROOT)
    assert (plan.folder / REGISTERED).is_file() and register(plan, ROOT) == rec  # a second start: the same record
    before = {"a": 0.3, "b": 0.5, "c": 0.7}
    for i, (m, s) in enumerate(plan.cells[:2]):
        fake_cell(runs, m, s, before, {k: before[k] + g + 0.01 * i for k, g in GAINS.items()})
    assert record(plan) == 2
    assert main([str(plan.path), "--status"]) == 0
    said = capsys.readouterr().out
    assert "registered; 2 of 4 cells recorded" in said and "0.1" not in said  # no gain shown before the pick
    for i, (m, s) in enumerate(plan.cells[2:], 2):
        fake_cell(runs, m, s, before, {k: before[k] + g + 0.01 * i for k, g in GAINS.items()})
    assert record(plan) == 2 and record(plan) == 0  # each cell once
    led = pd.read_csv(plan.folder / LEDGER)
    assert len(led) == 4 * 3 and set(led["split"]) == set(GAINS)
    assert apply_rule(plan, rec) == ["a", "b"]
    picked = pd.read_csv(plan.folder / "pick.csv").set_index("split")
    assert picked.loc["a", "mean_gain"] == pytest.approx(0.10 + 0.015) and list(picked["picked"]) == [True, True, False]
    assert "**The pick: a, b**" in (plan.folder / "pick.md").read_text()
    shutil.rmtree(runs)  # the ledger alone decides: no run folder needed
    assert apply_rule(plan, rec) == ["a", "b"]
    three = load_pilot(write_pilot(tmp_path / "three", runs, rule={"pick": 3, "above": 0.0}))
    shutil.copy(plan.folder / LEDGER, three.folder / LEDGER)
    assert apply_rule(three, rec) == []  # c lost on average: fewer than 3 gained, so nothing is picked
    assert "nothing is picked; widen the pilot" in (three.folder / "pick.md").read_text()


def test_a_pilot_is_registered_before_its_first_run_and_not_edited_after(tmp_path):
    runs = tmp_path / "runs"
    fake_cell(runs, "grpo", 1, {"a": 0.3}, {"a": 0.4})  # a run seen before the rule was written
    late = load_pilot(write_pilot(tmp_path / "late", runs))
    with pytest.raises(SystemExit, match=r"already holds finished cells \(grpo_s1\) and the plan is not registered: a "
                                         "rule written after runs were seen is not blind"):
        register(late, ROOT)
    assert not (late.folder / REGISTERED).exists()
    plan = load_pilot(write_pilot(tmp_path / "ok", tmp_path / "fresh"))
    register(plan, ROOT)
    write_pilot(tmp_path / "ok", tmp_path / "fresh", rule={"pick": 1, "above": 0.0})  # the rule edited after
    with pytest.raises(SystemExit, match="the plan changed after it was registered"):
        register(load_pilot(plan.path), ROOT)


@pytest.mark.parametrize("over, words", [
    ({"rules": {"pick": 1}}, "unknown key 'rules': did you mean rule?"),
    ({"seeds": [1, 1]}, "give a list of distinct whole numbers >= 0"),
    ({"seeds": [1.5]}, "give a list of distinct whole numbers >= 0"),
    ({"methods": ["grpo", "emma"]}, "method emma is not in conf/method/"),
    ({"rule": {"pick": 0}}, "rule.pick=0; give a whole number >= 1"),
    ({"rule": {"pick": 2, "below": 1}}, "rule: takes pick (and above)"),
])
def test_a_pilot_plan_is_checked_in_one_line(tmp_path, over, words):
    with pytest.raises(SystemExit) as e:
        load_pilot(write_pilot(tmp_path, tmp_path / "runs", **over))
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_the_command_runs_a_tiny_pilot_and_writes_its_pick(tmp_path):
    """Real runs (the toy task at smoke scale, one cold start): two cells, the ledger, the pick; run again, nothing
    is run and the pick is the same."""
    plan = write_pilot(tmp_path / "pilot", tmp_path / "runs", methods=["grpo"], seeds=[1, 2],
                       overrides=["sft.seed=0", f"sft.cache_dir={tmp_path / 'cache'}"],
                       rule={"pick": 1, "above": -1.0})
    cmd = [sys.executable, "-m", "ema_pg.pilot", str(plan), "--workers", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "2 cells to run" in out.stdout and "the pick: heldout" in out.stdout
    led = pd.read_csv(tmp_path / "pilot" / LEDGER)
    assert sorted(zip(led["method"], led["seed"])) == [("grpo", 1), ("grpo", 2)]
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "cells to run" not in again.stdout and "the pick: heldout" in again.stdout
