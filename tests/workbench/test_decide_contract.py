"""Decisions you can trust: a plan is a contract after its first look, one decide per plan, no verdict from a
degenerate statistic, a damaged ledger refused in one line, every bad plan value found before the first cell, a
failed cell never leaves a plan stuck, the boundaries spent at the seeds each look had, a full disk in one line."""

from __future__ import annotations

import csv
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_decide import fake_run, write_plan

from ema_pg.workbench.studies.contract import CONTRACT, check, register
from ema_pg.workbench.studies.decide import (CELLS, DECIDE_CLAIM, LOOKS, check_cells, load_plan, main, read_looks, record_cells, report,
                                     state, take_look)
from ema_pg.workbench.studies.sequential import Design, look, look_at

ROOT = Path(__file__).resolve().parents[2]


def first_look(tmp_path, diffs=(0.02, 0.05, 0.03), looks=(3, 5), **extra) -> Path:
    """A plan with claim A (ema > grpo) whose look 1 has been taken on finished cells with these differences."""
    runs = tmp_path / "runs"
    path = write_plan(tmp_path / "plan", runs, looks=looks,
                      claims={"A": {"better": "ema", "worse": "grpo", "text": "EMA anchor > GRPO"}}, **extra)
    plan = load_plan(path)
    for s, d in zip(plan.seeds(looks[0]), diffs):
        fake_run(runs, "grpo", s, 0.3)
        fake_run(runs, "ema", s, 0.3 + d)
    register(plan, ROOT)
    take_look(plan, 1, state(plan)[0], check(plan, ROOT, 0)[0])
    return path


def edit(path: Path, **changes) -> None:
    raw = yaml.safe_load(path.read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


# ---------------------------------------------------------------------- the plan is a contract
@pytest.mark.parametrize("field, change, said", [
    ("looks", {"looks": [3, 8]}, "looks is [3, 8], but the plan was registered with [3, 5]"),
    ("alpha", {"alpha": 0.5, "spending": "pocock"}, "alpha is 0.5, but the plan was registered with 0.05"),
    ("seeds", {"seed0": 200}, "seeds is 200, but the plan was registered with 100"),
    ("arms", {"claims": {"A": {"better": "ema_topk_reverse", "worse": "grpo", "text": "EMA anchor > GRPO"}}},
     'arms is {"A": ["ema_topk_reverse", "grpo"]}, but the plan was registered with {"A": ["ema", "grpo"]}'),
    ("score", {"claims": {"A": {"better": "ema", "worse": "grpo", "text": "x", "score": "test"}}},
     'score is {"A": "test"}, but the plan was registered with {"A": "avg"}'),
    ("overrides", {"overrides": ["algo.iterations=60"]},
     'overrides is ["algo.iterations=60"], but the plan was registered with []'),
    ("scale", {"scale": "mini"}, "scale is mini, but the plan was registered with smoke"),
])
def test_a_change_of_a_decisions_field_after_the_first_look_is_refused_naming_it(tmp_path, field, change, said):
    path = first_look(tmp_path)
    before = {f: (path.parent / f).read_bytes() for f in (LOOKS, CELLS, CONTRACT)}
    edit(path, **change)
    with pytest.raises(SystemExit) as e:
        main([str(path), "--workers", "1"])
    msg = str(e.value)
    assert said in msg and "\n" not in msg
    assert f"deviations: - {{field: {field}, reason: ..., date: ..., from_look: 2}}" in msg
    assert {f: (path.parent / f).read_bytes() for f in before} == before  # nothing written


def test_a_deviation_recorded_before_its_look_is_taken_in_and_shown(tmp_path):
    path = first_look(tmp_path)
    edit(path, overrides=["algo.iterations=8"],
         deviations=[{"field": "overrides", "reason": "the cells were too short to learn", "date": "2026-12-01",
                      "from_look": 1}])
    plan = load_plan(path)
    with pytest.raises(SystemExit, match="applies from look 1, which was taken already .* give from_look: 2"):
        check(plan, ROOT, 1)
    edit(path, deviations=[{"field": "overrides", "reason": "the cells were too short to learn",
                            "date": "2026-12-01", "from_look": 2}])
    plan = load_plan(path)
    fp, devs = check(plan, ROOT, 1)
    assert [(d["field"], d["value"]) for d in devs] == [("overrides", ["algo.iterations=8"])]
    assert check(plan, ROOT, 1) == (fp, devs)  # taken in once; the same plan passes from then on
    edit(path, overrides=["algo.iterations=9"])  # a second change of the field needs a deviation of its own
    with pytest.raises(SystemExit, match='overrides is \\["algo.iterations=9"\\], but the plan was registered with '
                                         '\\["algo.iterations=8"\\]'):
        check(load_plan(path), ROOT, 1)
    edit(path, overrides=["algo.iterations=8"])
    report(load_plan(path))
    md = (path.parent / "sequential.md").read_text()
    assert "## Deviations from the registered plan" in md
    assert "- from look 2 (2026-12-01): overrides: the cells were too short to learn" in md
    look1 = read_looks(load_plan(path))["plan"].iloc[0]
    assert len(look1) == 12 and look1 != fp  # look 1's row carries the contract in force when it was taken


def test_an_edit_of_the_sweep_its_cells_run_is_refused(tmp_path):
    code = tmp_path / "code"
    shutil.copytree(ROOT / "sweeps", code / "sweeps")
    path = first_look(tmp_path / "p")
    plan = load_plan(path)
    (path.parent / CONTRACT).unlink()
    register(plan, code)
    check(plan, code, 1)
    (code / "sweeps" / "fig5_methods.yaml").write_text((code / "sweeps" / "fig5_methods.yaml").read_text() + "\n# x\n")
    with pytest.raises(SystemExit, match="sweeps/fig5_methods.yaml changed since the plan was fingerprinted"):
        check(plan, code, 1)


def test_pinning_the_base_the_ledger_asks_for_is_no_deviation_and_changing_it_is(tmp_path):
    """The pin is recorded in the contract (it used to be taken and forgotten: a second change went through)."""
    path = first_look(tmp_path)
    edit(path, base="abc")
    check(load_plan(path), ROOT, 1)
    assert json.loads((path.parent / CONTRACT).read_text())["fields"]["base"] == "abc"
    check(load_plan(path), ROOT, 1)  # the row of look 1, taken before the pin, still matches
    edit(path, base="def")
    with pytest.raises(SystemExit, match="base is def, but the plan was registered with abc"):
        check(load_plan(path), ROOT, 1)


def test_a_plan_from_before_fingerprints_is_fingerprinted_at_its_next_start_and_says_so(tmp_path):
    path = first_look(tmp_path)
    (path.parent / CONTRACT).unlink()
    looks = path.parent / LOOKS  # its looks were taken before rows carried the contract's fingerprint
    rows = list(csv.DictReader(looks.open()))
    with looks.open("w", newline="") as out:
        w = csv.DictWriter(out, list(rows[0]))
        w.writeheader()
        w.writerows({**r, "plan": ""} for r in rows)
    check(load_plan(path), ROOT, 1)
    c = json.loads((path.parent / CONTRACT).read_text())
    assert c["registered_at_look"] == 2 and "fingerprinted after look 1" in c["note"]


def test_a_contract_removed_after_a_look_is_rebuilt_only_from_the_plan_its_looks_were_taken_under(tmp_path, capsys):
    """Deleting contract.json and changing alpha used to register the new alpha silently: the fingerprint look 1
    recorded is now compared with the plan, the change refused; the unchanged plan rebuilds it, the rebuilding
    recorded and shown with the deviations."""
    path = first_look(tmp_path)
    (path.parent / CONTRACT).unlink()
    edit(path, alpha=0.5, spending="pocock")
    before = {f: (path.parent / f).read_bytes() for f in (LOOKS, CELLS)}
    with pytest.raises(SystemExit) as e:
        main([str(path), "--workers", "1"])
    assert "contract.json is gone, and the plan is not the one its looks were taken under (look 1 recorded the " \
           "contract" in str(e.value) and "git checkout -- " in str(e.value) and "\n" not in str(e.value)
    assert not (path.parent / CONTRACT).exists() and {f: (path.parent / f).read_bytes() for f in before} == before
    edit(path, alpha=0.05, spending="obrien_fleming")
    fp = read_looks(load_plan(path))["plan"].iloc[-1]
    assert check(load_plan(path), ROOT, 1)[0] == fp
    assert f"missing; rebuilt from the plan, which gives the fingerprint look 1 recorded ({fp})" in capsys.readouterr().out
    report(load_plan(path))
    assert "contract: contract.json was missing; rebuilt from the plan" in (path.parent / "sequential.md").read_text()
    edit(path, alpha=0.5, spending="pocock")  # and the rebuilt contract holds the plan to its registered alpha
    with pytest.raises(SystemExit, match="alpha is 0.5, but the plan was registered with 0.05"):
        check(load_plan(path), ROOT, 1)


def test_a_contract_edited_by_hand_is_not_the_one_its_looks_were_taken_under(tmp_path):
    """Editing contract.json (and the plan with it) to a new alpha after look 1 used to be taken."""
    path = first_look(tmp_path)
    f = path.parent / CONTRACT
    c = json.loads(f.read_text())
    f.write_text(json.dumps({**c, "fields": {**c["fields"], "alpha": 0.5, "spending": "pocock"}}))
    edit(path, alpha=0.5, spending="pocock")
    with pytest.raises(SystemExit) as e:
        main([str(path), "--workers", "1"])
    assert "contract.json is not the contract its looks were taken under (look 1 recorded " in str(e.value)
    assert "it was edited; restore it (git checkout -- " in str(e.value) and "\n" not in str(e.value)
    assert state(load_plan(path))[1] == 1  # no look 2


# ---------------------------------------------------------------------- bad plans, before any cell
@pytest.mark.parametrize("change, said", [
    ({"claims": {"A": {"better": "ema", "worse": "ema", "text": "x"}}}, "claim A compares ema with itself"),
    ({"claims": {}}, "claims is empty"),
    ({"seed0": -3}, "seed0=-3; the first seed is a whole number >= 0"),
    ({"lookz": [3, 5]}, "unknown key 'lookz': did you mean looks? remove it"),
    ({"claims": {"A": {"better": "ema", "worse": "grpo", "text": "x", "scor": "avg"}}},
     "claim A has unknown key 'scor'"),
])
def test_a_bad_plan_value_is_one_line_before_anything_runs(tmp_path, change, said):
    path = write_plan(tmp_path / "plan", tmp_path / "runs")
    edit(path, **change)
    with pytest.raises(SystemExit) as e:
        load_plan(path)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_two_claims_with_one_id_and_workers_below_one_are_one_line(tmp_path):
    path = write_plan(tmp_path / "plan", tmp_path / "runs")
    text = path.read_text().replace("claims:\n", "claims:\n  A:\n    better: ema\n    worse: grpo\n    text: y\n", 1)
    path.write_text(text)
    with pytest.raises(SystemExit, match="not a plan's YAML: .*duplicate key"):
        load_plan(path)
    path = write_plan(tmp_path / "p2", tmp_path / "runs")
    with pytest.raises(SystemExit, match="--workers 0: give 1 or more"):
        main([str(path), "--workers", "0"])


def test_the_cells_config_is_checked_before_the_first_cell_the_score_and_one_cold_start(tmp_path):
    path = write_plan(tmp_path / "plan", tmp_path / "runs", overrides=["sft.seed=0"],
                      claims={"A": {"better": "ema", "worse": "grpo", "text": "x", "score": "bogus"}})
    with pytest.raises(SystemExit, match="score 'bogus' is neither avg nor a split of task toy_add \\(heldout\\)"):
        check_cells(load_plan(path))
    path = write_plan(tmp_path / "p2", tmp_path / "runs")  # scale smoke leaves sft.seed unset
    with pytest.raises(SystemExit, match="its cells leave sft.seed unset, so each seed builds a cold start of its own"):
        main([str(path), "--workers", "1"])
    assert not (tmp_path / "runs").exists()  # refused before a cell started


# ---------------------------------------------------------------------- one writer
def test_a_second_decide_on_a_live_plan_is_refused_naming_the_first(tmp_path):
    path = first_look(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from ema_pg.workbench.studies.decide import claim_plan, load_plan; "
        f"claim_plan(load_plan(Path({str(path)!r}))); print('held', flush=True); time.sleep(60)")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match=f"another decide \\(process {holder.pid} on .*\\) is running this plan"):
            main([str(path), "--workers", "1"])
    finally:
        holder.kill()
        holder.wait()


def test_a_look_is_written_once(tmp_path):
    path = first_look(tmp_path)
    plan = load_plan(path)
    assert take_look(plan, 1, {"A": "open"}) == []  # look 1 is in looks.csv: not taken again
    assert len(read_looks(plan)) == 1


# ---------------------------------------------------------------------- no verdict from a degenerate statistic
def test_identical_differences_decide_nothing_and_nan_scores_are_failed_cells(tmp_path, capsys):
    path = first_look(tmp_path, diffs=(0.0625, 0.0625, 0.0625))  # one question of 16 apart, at every seed
    r = read_looks(load_plan(path)).iloc[0]
    assert r["verdict"] == "continue" and np.isnan(r["t"]) and r["sd_diff"] == 0
    assert look(Design((3, 5)), [[0.1] * 3, [0.1] * 5])[-1].verdict == "stopped at the cap"
    assert look_at(Design((3, 5)), [], [0.1, float("nan"), 0.2]).verdict == "continue"
    runs = tmp_path / "n" / "runs"
    p2 = write_plan(tmp_path / "n" / "plan", runs, looks=(4, 6),
                    claims={"A": {"better": "ema", "worse": "grpo", "text": "x"}})
    plan = load_plan(p2)
    for s, d in zip(plan.seeds(4), (0.02, 0.05, 0.03, 0.04)):
        fake_run(runs, "grpo", s, 0.3)
        fake_run(runs, "ema", s, float("nan") if s == 101 else 0.3 + d)
    rows = take_look(plan, 1, {"A": "open"})
    assert rows[0]["seeds"] == 3 and rows[0]["left_out"] == "101" and np.isfinite(rows[0]["t"])
    assert "seeds 101 left out: a cell scored NaN (a failed cell)" in capsys.readouterr().out


def test_a_failed_cell_at_a_minimal_first_look_says_what_to_run_again(tmp_path):
    runs = tmp_path / "runs"
    path = write_plan(tmp_path / "plan", runs, looks=(3, 5), claims={"A": {"better": "ema", "worse": "grpo",
                                                                          "text": "x"}})
    plan = load_plan(path)
    for s in plan.seeds(3):
        fake_run(runs, "grpo", s, 0.3)
        if s != 101:
            fake_run(runs, "ema", s, 0.35)
    (runs / "ema_s101").mkdir()
    (runs / "ema_s101" / "failed.json").write_text(json.dumps({"kind": "diverged", "error": "x"}))
    with pytest.raises(SystemExit, match="look 1 of claim A has 2 paired seeds, and a look needs 3: ema:101 failed "
                                         "or scored NaN; run them again"):
        take_look(plan, 1, {"A": "open"})


# ---------------------------------------------------------------------- a damaged ledger is one line
def ledger_files(folder: Path) -> dict:
    """Every file of a plan's folder and its bytes, but the live decide's lock (taken before the ledger is read)."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != DECIDE_CLAIM}


def _damage(folder: Path, kind: str) -> str:
    cells, looks = folder / CELLS, folder / LOOKS
    c, lk = cells.read_text(), looks.read_text()
    if kind == "renamed column":
        cells.write_text(c.replace("scores", "score_s", 1))
        return f"{cells}: no column scores"
    if kind == "empty cells":
        cells.write_text("")
        return f"{cells}: the file is empty"
    if kind == "bad json":
        cells.write_text(c.replace('""avg"": ', '""avg"": [', 1))
        return f"{cells}: line 2's scores"
    if kind == "seed 2.0":
        lines = c.splitlines(keepends=True)
        lines[1] = lines[1].replace(",100,", ",100.0,", 1)
        cells.write_text("".join(lines))
        return f"{cells}: line 2's seed is '100.0', not a whole number"
    if kind == "duplicate cell":
        lines = c.splitlines(keepends=True)
        cells.write_text(c + lines[1].replace("0.32", "0.45"))
        return "repeats the cell"
    if kind == "cut row":
        cells.write_text(c[:-5])
        return "ends without its line end: it was cut short"
    if kind == "empty looks":
        looks.write_text("")
        return f"{looks}: the file is empty"
    if kind == "cut looks row":
        lines = lk.splitlines(keepends=True)
        looks.write_text(lines[0] + lines[1][: len(lines[1]) // 2] + "\n")
        return f"{looks}: line 2 has"
    if kind == "bad verdict":
        looks.write_text(lk.replace(",continue,", ",maybe,", 1))
        return "verdict is 'maybe', none of holds, fails, continue, stopped at the cap"
    if kind == "look twice":
        lines = lk.splitlines(keepends=True)
        looks.write_text(lk + lines[1])
        return "repeats look 1 of claim A (a look is taken once)"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["renamed column", "empty cells", "bad json", "seed 2.0", "duplicate cell", "cut row",
                                  "empty looks", "cut looks row", "bad verdict", "look twice"])
def test_a_damaged_ledger_is_one_line_naming_the_file_and_nothing_is_written(tmp_path, kind):
    path = first_look(tmp_path, diffs=(0.02, 0.05, 0.03))
    record_cells(load_plan(path))
    said = _damage(path.parent, kind)
    before = ledger_files(path.parent)
    with pytest.raises(SystemExit) as e:
        main([str(path), "--workers", "1"])
    assert said in str(e.value) and "\n" not in str(e.value)
    assert ledger_files(path.parent) == before


# ---------------------------------------------------------------------- exact to the reference
def test_a_looks_boundary_is_spent_at_the_seeds_earlier_looks_had_when_taken(tmp_path):
    """Look 2 took 4 of its 5 seeds (one cell had failed); the cell is re-run before look 3, which must still spend
    alpha at [3, 4, 7], as looks.csv records look 2, not at [3, 5, 7]."""
    runs = tmp_path / "runs"
    path = write_plan(tmp_path / "plan", runs, looks=(3, 5, 7), claims={"A": {"better": "ema", "worse": "grpo",
                                                                             "text": "x"}})
    plan = load_plan(path)
    rng = np.random.default_rng(1)
    for s in plan.seeds(5):
        fake_run(runs, "grpo", s, 0.3)
        if s != 104:
            fake_run(runs, "ema", s, 0.3 + rng.normal(0.001, 0.02))
    take_look(plan, 1, {"A": "open"})
    assert take_look(plan, 2, {"A": "open"})[0]["seeds"] == 4
    for s in [104, 105, 106]:
        fake_run(runs, "ema", s, 0.3 + rng.normal(0.001, 0.02))
        if s > 104:
            fake_run(runs, "grpo", s, 0.3)
    row = take_look(plan, 3, {"A": "open"})[0]
    d = plan.design
    assert row["z_bound"] == pytest.approx(d.boundaries([3, 4, 7])[-1], abs=1e-12)
    assert abs(row["z_bound"] - d.boundaries([3, 5, 7])[-1]) > 1e-4


# ---------------------------------------------------------------------- a full disk
def _full_disk_child(plan: str) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # room for sequential.md, not for the figure
    sys.argv = ["decide", plan, "--report-only"]
    raise SystemExit(main())


def test_a_full_disk_is_one_line_and_leaves_no_half_figure(tmp_path):
    path = first_look(tmp_path)
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(ROOT / 'tests' / 'workbench')!r}]; from test_decide_contract import "
            f"_full_disk_child; _full_disk_child({str(path)!r})")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"stopped: no room to write sequential.png in {path.parent}")
    assert not (path.parent / "sequential.png").exists()
    assert not [p for p in path.parent.iterdir() if ".tmp" in p.name]
