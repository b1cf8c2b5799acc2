"""``python -m ema_pg.decide``: a plan is checked before anything runs; looks are taken on the finished pairs,
recorded once, and a decided claim asks for no more seeds; end to end on a tiny sweep (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ema_pg.workbench.studies.decide import (CELLS, LOOKS, load_plan, main, needed, outlooks, read_cells, record_cells, report,
                                     state, take_look)
from ema_pg.workbench.studies.sequential import OUTLOOKS, Design, detectable, look, outlook, power_at

ROOT = Path(__file__).resolve().parents[2]


def write_plan(folder: Path, runs: Path, looks=(3, 5), claims=None, **extra) -> Path:
    claims = claims or {"A": {"better": "ema", "worse": "grpo", "text": "EMA anchor > GRPO"},
                        "B": {"better": "ema_topk_reverse", "worse": "ema", "text": "Top-k reverse > K3"}}
    plan = {"sweep": "fig5_methods", "scale": "smoke", "seed0": 100, "looks": list(looks), "alpha": 0.05,
            "spending": "obrien_fleming", "runs": str(runs), "claims": claims, **extra}
    folder.mkdir(parents=True, exist_ok=True)
    import yaml

    (folder / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    return folder / "plan.yaml"


def fake_run(runs: Path, method: str, seed: int, avg: float, commit: str = "abc123", base: float | None = None,
             machine: str | None = None) -> None:
    """A finished run folder as the trainer leaves one: config.yaml, git.txt and eval.json; with ``base``, the
    initial weights in model/ (one tensor filled with it) and, with ``machine``, machine.txt."""
    d = runs / f"{method}_s{seed}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(f"method: {method}\nseed: {seed}\nname: demo\n")
    (d / "git.txt").write_text(commit + "\n")
    if base is not None:
        import torch
        from safetensors.torch import save_file

        (d / "model").mkdir(exist_ok=True)
        save_file({"w": torch.full((2, 3), base), "b": torch.zeros(3)}, str(d / "model" / "model.safetensors"))
    if machine is not None:
        (d / "machine.txt").write_text(machine + "\n")
    (d / "eval.json").write_text(json.dumps({"iteration": 4, "splits": {"test": {"acc": avg, "n": 16}}, "avg": avg,
                                             "metric": "acc"}))


def test_a_plan_is_checked_before_anything_runs(tmp_path):
    bad = write_plan(tmp_path / "a", tmp_path / "runs", claims={"A": {"better": "emma", "worse": "grpo", "text": "x"}})
    with pytest.raises(SystemExit, match="method emma is not in conf/method/"):
        load_plan(bad)
    with pytest.raises(SystemExit, match="increasing"):
        load_plan(write_plan(tmp_path / "b", tmp_path / "runs", looks=(5, 5)))
    with pytest.raises(SystemExit, match="needs better, worse and text"):
        load_plan(write_plan(tmp_path / "c", tmp_path / "runs", claims={"A": {"better": "ema"}}))


@pytest.mark.parametrize("looks, words", [
    ((3.9, 5.5), "3.9 is not a whole number of seeds"),
    ((3, "5"), "'5' is not a whole number of seeds"),
    ((5, 4), "increasing"),
])
def test_looks_that_are_not_whole_increasing_numbers_are_refused_in_one_line(tmp_path, looks, words):
    with pytest.raises(SystemExit) as e:
        load_plan(write_plan(tmp_path, tmp_path / "runs", looks=looks))
    assert words in str(e.value) and "\n" not in str(e.value)
    assert load_plan(write_plan(tmp_path, tmp_path / "runs", looks=(3.0, 5))).design.looks == (3, 5)  # whole: taken


@pytest.mark.parametrize("power, words", [
    ({"effect": 0.02, "sd": 0.05}, "power: takes effect, sd, sd_from, each given"),
    ({"effect": -0.02, "sd": 0.05, "sd_from": "x"}, "power.effect=-0.02; give a number > 0"),
    ({"effect": 0.02, "sd": 0.05, "sd_from": " "}, "power.sd_from is empty"),
])
def test_a_plans_power_is_checked_in_one_line(tmp_path, power, words):
    with pytest.raises(SystemExit, match=words):
        load_plan(write_plan(tmp_path, tmp_path / "runs", power=power))


def test_a_plans_power_at_its_cap_is_said_before_any_cell_and_with_the_sd_each_look_finds(tmp_path, capsys):
    """A plan whose sd is known (0.05) and whose smallest effect that matters is 0.02: its power at the cap (5
    seeds, looks at 3 and 5) is the design's simulated chance of a holds at 0.4 sd, low, and said so; the effect it
    finds with 80% power is detectable() sd. Once a look lands, the sd it found takes the plan's."""
    runs = tmp_path / "runs"
    plan = load_plan(write_plan(tmp_path / "plan", runs, power={"effect": 0.02, "sd": 0.05, "sd_from": "a guess"}))
    d = plan.design
    pw, k = power_at(d, 0.4), detectable(d)
    assert pw < 0.2 and power_at(d, k) >= 0.8 > power_at(d, k - 0.01)
    assert main([str(plan.path), "--status"]) == 0
    said = capsys.readouterr().out
    assert (f"LOW POWER: power: the smallest effect that matters, 0.02 (sd 0.05, from a guess), holds by the cap (5 "
            f"seeds) with probability {pw:.0%}; with 80% power the plan finds {k * 0.05:.4g} ({k:.2f} sd); it runs, "
            "but a claim that stops at the cap says little about that effect") in said
    for s in plan.seeds(3):
        fake_run(runs, "grpo", s, 0.3)
        fake_run(runs, "ema", s, 0.3 + 0.1 * (s - 100))  # differences 0, 0.1, 0.2: sd 0.1
        fake_run(runs, "ema_topk_reverse", s, 0.3 + 0.1 * (s - 100) + 0.01 * (s % 2))
    take_look(plan, 1, state(plan)[0])
    assert main([str(plan.path), "--status"]) == 0
    said = capsys.readouterr().out
    assert (f"power, A: at the sd its looks found (0.1, look 1) the cap finds {k * 0.1:.4g} with 80% power; the "
            f"smallest effect that matters, 0.02, holds by the cap with probability {power_at(d, 0.2):.0%}") in said
    md = report(plan).read_text()
    assert "## Power" in md and "- LOW POWER: power: the smallest effect that matters, 0.02" in md
    bare = load_plan(write_plan(tmp_path / "bare", runs))  # a plan that states no power still learns its reach
    assert main([str(bare.path), "--status"]) == 0
    assert f"with 80% power by the cap (5 seeds) it finds an effect of {k:.2f} times the paired differences' sd" in \
        capsys.readouterr().out


def test_a_look_is_the_designs_on_the_finished_pairs_and_a_decided_claim_needs_no_more_seeds(tmp_path, capsys):
    runs = tmp_path / "runs"
    plan = load_plan(write_plan(tmp_path / "plan", runs))
    rng = np.random.default_rng(0)
    assert len(needed(plan, 1, state(plan)[0])) == 3 * 3  # three methods, three seeds
    for s in plan.seeds(3):  # claim A: a huge effect, decided at once; claim B: nothing
        g = 0.3 + rng.normal(0, 0.01)
        fake_run(runs, "grpo", s, g)
        fake_run(runs, "ema", s, g + 0.5 + rng.normal(0, 0.001))
        fake_run(runs, "ema_topk_reverse", s, g + 0.5 + rng.normal(0, 0.05))
    verdicts, taken = state(plan)
    assert taken == 0 and needed(plan, 1, verdicts) == []
    rows = {r["claim"]: r for r in take_look(plan, 1, verdicts)}
    diff = [json.loads((runs / f"ema_s{s}/eval.json").read_text())["avg"]
            - json.loads((runs / f"grpo_s{s}/eval.json").read_text())["avg"] for s in plan.seeds(3)]
    expect = look(Design(looks=(3, 5)), [diff])[-1]
    assert rows["A"]["verdict"] == "holds" == expect.verdict
    assert rows["A"]["mean_diff"] == pytest.approx(expect.mean) and rows["A"]["lo"] == pytest.approx(expect.lo)
    assert rows["B"]["verdict"] == "continue" and rows["A"]["commits"] == "abc123"
    verdicts, taken = state(plan)
    assert taken == 1 and verdicts == {"A": "holds", "B": "open"}
    # the open claim's outlook from where it stands (a decided one has none), on its page
    ahead = outlooks(plan.design, pd.read_csv(plan.folder / LOOKS))
    b = rows["B"]
    assert list(ahead) == ["B"] and list(ahead["B"]) == list(OUTLOOKS)
    assert ahead["B"]["predictive"] == outlook(plan.design, [3], b["mean_diff"], b["sd_diff"], "predictive", seed=0)
    md = report(plan).read_text()
    assert "## Where the open claims may end" in md
    assert f"| B | 3 | 5 | predictive: {OUTLOOKS['predictive']} | {ahead['B']['predictive']['holds']:.0%} |" in md
    assert "| A | 3 |" not in md
    assert main([str(plan.path), "--status"]) == 0  # and --status says it, running nothing
    said = capsys.readouterr().out
    assert f"B by the cap (5 seeds): holds {ahead['B']['predictive']['holds']:.0%}" in said and "A by the cap" not in said
    assert "look 2 at 5 seeds needs 4 more cells" in said
    todo = needed(plan, 2, verdicts)  # only claim B's methods, seeds 103-104
    assert sorted(todo) == sorted((m, s) for m in ("ema", "ema_topk_reverse") for s in (103, 104))
    fake_run(runs, "ema", 103, 0.4)
    (runs / "ema_topk_reverse_s103").mkdir()
    (runs / "ema_topk_reverse_s103" / "failed.json").write_text(json.dumps({"kind": "diverged"}))
    fake_run(runs, "ema", 104, 0.4)
    fake_run(runs, "ema_topk_reverse", 104, 0.41)
    assert needed(plan, 2, verdicts) == []  # a failed cell is not run again
    rows = take_look(plan, 2, verdicts)
    assert [r["claim"] for r in rows] == ["B"] and rows[0]["seeds"] == 4 and rows[0]["left_out"] == "103"
    assert rows[0]["verdict"] == "stopped at the cap"
    looks = pd.read_csv(plan.folder / LOOKS)
    assert list(looks["look"]) == [1, 1, 2] and state(plan) == ({"A": "holds", "B": "stopped at the cap"}, 2)
    md = report(plan).read_text()
    assert "**holds**" in md and "stopped at the cap" in md and (plan.folder / "sequential.png").is_file()
    assert "| B: Top-k reverse > K3 | 2 | 4 (left out: 103) |" in md  # a lone seed left out, read back from looks.csv
    assert "Where the open claims may end" not in md  # every claim decided or capped: nothing is ahead


def test_a_plan_carried_to_a_fresh_machine_counts_the_cells_its_ledger_holds(tmp_path):
    """Run folders are never committed; cells.csv is. With the folders gone, the finished cells are not run again
    and the next look is the one it would have been with them."""
    import shutil

    runs = tmp_path / "runs"
    plan = load_plan(write_plan(tmp_path / "plan", runs, claims={"A": {"better": "ema", "worse": "grpo", "text": "x"},
                                                               "S": {"better": "ema", "worse": "grpo", "text": "y",
                                                                     "score": "test"}}))
    rng = np.random.default_rng(1)
    for s in plan.seeds(5):
        fake_run(runs, "grpo", s, 0.3 + rng.normal(0, 0.02), commit="c1")
        fake_run(runs, "ema", s, 0.31 + rng.normal(0, 0.02), commit="c2" if s == 104 else "c1")
    here = take_look(plan, 1, state(plan)[0])
    cells = read_cells(plan)
    assert len(cells) == 10 and cells[("ema", 104)] == {"scores": {"avg": pytest.approx(
        json.loads((runs / "ema_s104/eval.json").read_text())["avg"]), "test": pytest.approx(
        json.loads((runs / "ema_s104/eval.json").read_text())["splits"]["test"]["acc"])}, "commit": "c2",
        "base": "unknown", "machine": "unknown"}
    both = take_look(plan, 2, state(plan)[0])
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "plan", moved / "plan")
    (moved / "plan" / LOOKS).unlink()  # the same plan at its first look, on a machine without the run folders
    shutil.rmtree(runs)
    fresh = load_plan(moved / "plan" / "plan.yaml")
    assert needed(fresh, 2, state(fresh)[0]) == [] and record_cells(fresh) == 0
    again = take_look(fresh, 1, state(fresh)[0]) + take_look(fresh, 2, state(fresh)[0])
    for a, b in zip(here + both, again):
        assert {k: a[k] for k in ("claim", "seeds", "mean_diff", "lo", "hi", "verdict", "commits")} == \
               {k: b[k] for k in ("claim", "seeds", "mean_diff", "lo", "hi", "verdict", "commits")}
    assert again[-1]["look"] == 2 and again[-1]["commits"] == "c1 c2" and (moved / "plan" / CELLS).is_file()


def test_a_runs_base_is_its_initial_weights_whatever_the_files_layout(tmp_path):
    import torch
    from safetensors.torch import save_file

    from ema_pg.engine.runs import run_base

    w = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(3)}
    for name, tensors, meta in (("one", w, None), ("two", dict(reversed(list(w.items()))), {"format": "pt", "x": "y"})):
        (tmp_path / name / "model").mkdir(parents=True)
        save_file(tensors, str(tmp_path / name / "model" / "model.safetensors"), metadata=meta)
    assert (tmp_path / "one/model/model.safetensors").read_bytes() != (tmp_path / "two/model/model.safetensors").read_bytes()
    assert run_base(tmp_path / "one") == run_base(tmp_path / "two") and len(run_base(tmp_path / "one")) == 16
    nudged = dict(w, **{"b.bias": torch.tensor([1.0, 1.0, float(np.nextafter(np.float32(1), np.float32(2)))])})
    (tmp_path / "three" / "model").mkdir(parents=True)
    save_file(nudged, str(tmp_path / "three" / "model" / "model.safetensors"))
    assert run_base(tmp_path / "three") != run_base(tmp_path / "one")  # one ulp of one weight is another policy
    (tmp_path / "four" / "model").mkdir(parents=True)
    (tmp_path / "four" / "model" / "initial.json").write_text(json.dumps({"path": "/models/qwen"}))
    assert run_base(tmp_path / "four") == "path:/models/qwen" and run_base(tmp_path / "none") == "unknown"


def test_a_cell_from_another_base_policy_is_refused_before_a_look_pairs_it(tmp_path):
    """Two cold starts of one sft.seed on two kinds of CPU can end apart; a seed whose two methods start from two
    base policies compares starting points. Such a cell is not recorded and no look is taken with it."""
    from ema_pg.engine.runs import run_base
    from ema_pg.workbench.studies.decide import OtherBase

    runs = tmp_path / "runs"
    plan = load_plan(write_plan(tmp_path / "plan", runs, looks=(3, 5)))
    for s in plan.seeds(3):
        for m in ("grpo", "ema", "ema_topk_reverse"):
            fake_run(runs, m, s, 0.3 + 0.01 * (s - 100), base=0.5, machine="cpu A")
    assert record_cells(plan) == 9 and {c["base"] for c in read_cells(plan).values()} == {run_base(runs / "ema_s100")}
    ledger = (plan.folder / CELLS).read_text()
    fake_run(runs, "ema", 103, 0.4, base=0.5, machine="cpu A")
    fake_run(runs, "grpo", 103, 0.3, base=0.6, machine="cpu B")  # the cold start came out elsewhere
    with pytest.raises(OtherBase, match=r"grpo_s103: it started from base policy \w{16} \(built on cpu B\), not \w{16}"):
        record_cells(plan)
    assert (plan.folder / CELLS).read_text() == ledger  # nothing recorded, not even the good cell beside it
    with pytest.raises(OtherBase):
        take_look(plan, 1, state(plan)[0])
    assert not (plan.folder / LOOKS).exists()
    import shutil

    shutil.rmtree(runs / "grpo_s103")  # set aside: the ledger goes on
    assert record_cells(plan) == 1
    pinned = load_plan(write_plan(tmp_path / "pinned", runs, looks=(3, 5), base="0123456789abcdef"))
    with pytest.raises(OtherBase, match="not 0123456789abcdef, .*pinned/plan.yaml's base"):
        record_cells(pinned)  # a pinned base outranks the cells


def test_a_ledger_from_before_bases_were_recorded_takes_a_new_cell_only_once_its_base_is_pinned(tmp_path):
    """Rows without a base cannot vouch for the first cell that has one: the plan must pin it, after a person checked
    the cell's cold start; then the cell is recorded, and one from another base is refused."""
    from ema_pg.engine.runs import run_base
    from ema_pg.workbench.studies.decide import OtherBase

    runs = tmp_path / "runs"
    path = write_plan(tmp_path / "plan", runs, looks=(3, 5))
    pd.DataFrame([{"method": "ema", "seed": 100, "scores": json.dumps({"avg": 0.3}), "commit": "c0"}]).to_csv(
        tmp_path / "plan" / CELLS, index=False)  # a ledger as it was before: no base, no machine
    fake_run(runs, "grpo", 100, 0.29, base=0.5, machine="cpu A")
    digest = run_base(runs / "grpo_s100")
    with pytest.raises(OtherBase, match=f"pin it as 'base: {digest}'"):
        record_cells(load_plan(path))
    assert len(read_cells(load_plan(path))) == 1
    path = write_plan(tmp_path / "plan", runs, looks=(3, 5), base=digest)
    assert record_cells(load_plan(path)) == 1
    cells = read_cells(load_plan(path))
    assert cells[("ema", 100)]["base"] == "" and cells[("grpo", 100)]["base"] == digest
    fake_run(runs, "ema", 101, 0.3, base=0.7, machine="cpu B")
    with pytest.raises(OtherBase, match="ema_s101: it started from base policy"):
        record_cells(load_plan(path))


def test_cells_on_another_machine_start_only_when_told(tmp_path, capsys):
    from ema_pg.engine.runs import machine, run_base

    runs = tmp_path / "runs"
    path = write_plan(tmp_path / "plan", runs, looks=(3,), claims={"A": {"better": "ema", "worse": "grpo", "text": "x"}})
    for s in range(100, 103):
        for m in ("grpo", "ema"):
            fake_run(runs, m, s, 0.3 + 0.01 * (m == "ema") + 0.001 * s, base=0.5, machine="a machine of another kind")
    assert machine() != "a machine of another kind"
    assert record_cells(load_plan(path)) == 6
    assert main([str(path), "--status"]) == 0  # what the check will see, before anything runs
    said = capsys.readouterr().out
    assert f"base policy: {run_base(runs / 'ema_s100')} (the base of the cells in" in said
    assert f"the cells ran on: a machine of another kind; this machine: {machine()}" in said
    with pytest.raises(SystemExit, match="this machine is .*--any-machine"):
        main([str(path)])
    assert not (tmp_path / "plan" / LOOKS).exists()
    assert main([str(path), "--any-machine"]) == 0 and (tmp_path / "plan" / LOOKS).is_file()  # every cell was there


def test_a_machine_whose_cells_were_set_aside_is_refused_before_a_cold_start(tmp_path, capsys):
    """set_aside.csv names the machine each set-aside cell ran on: on that kind of machine the plan's cold start came
    out another base policy, so a run stops there at once (no cold start built to be refused), and --status says so;
    --any-machine goes on."""
    from ema_pg.engine.runs import machine
    from ema_pg.workbench.studies.decide import SET_ASIDE

    runs = tmp_path / "runs"
    path = write_plan(tmp_path / "plan", runs, looks=(3,), claims={"A": {"better": "ema", "worse": "grpo", "text": "x"}})
    for s in range(100, 103):
        for m in ("grpo", "ema"):
            fake_run(runs, m, s, 0.3 + 0.01 * (m == "ema") + 0.001 * s, base=0.5, machine=machine())
    aside = {"method": "ema", "seed": 99, "scores": json.dumps({"avg": 0.4}), "commit": "c0", "base": "b1",
             "cold_start": "660 SFT steps, final loss 0.457", "why": "another base"}
    pd.DataFrame([{**aside, "machine": "a machine of another kind"}]).to_csv(tmp_path / "plan" / SET_ASIDE, index=False)
    assert main([str(path), "--status"]) == 0 and "set aside" not in capsys.readouterr().out  # another kind: no word
    pd.DataFrame([{**aside, "machine": machine()}]).to_csv(tmp_path / "plan" / SET_ASIDE, index=False)
    assert main([str(path), "--status"]) == 0
    assert "set aside before on this machine's kind: 1 cells" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"1 cells built on this machine's kind .* \(their cold start: 660 SFT steps"):
        main([str(path)])
    assert not (tmp_path / "plan" / LOOKS).exists()
    assert main([str(path), "--any-machine"]) == 0 and (tmp_path / "plan" / LOOKS).is_file()


def test_cells_can_run_the_code_of_another_checkout(tmp_path):
    """--code: a plan's cells run the code it was registered at (a worktree), named by its own sweep files."""
    import shutil

    from ema_pg.workbench.studies.decide import cell_command

    plan = load_plan(write_plan(tmp_path / "plan", tmp_path / "runs"))
    other = tmp_path / "frozen"
    shutil.copytree(ROOT / "sweeps", other / "sweeps")
    here, there = cell_command(plan, "ema", 101), cell_command(plan, "ema", 101, other)
    assert here[here.index("--config-dir") + 1] == str(ROOT / "sweeps")
    assert there[there.index("--config-dir") + 1] == str(other / "sweeps")
    assert [w for w in here if w != str(ROOT / "sweeps")] == [w for w in there if w != str(other / "sweeps")]
    (other / "sweeps" / "scale" / "smoke.yaml").unlink()
    with pytest.raises(SystemExit, match="has no sweeps/scale/.*smoke.yaml"):
        cell_command(plan, "ema", 101, other)
    with pytest.raises(SystemExit, match="not a checkout of ema-pg"):
        main([str(plan.path), "--code", str(other)])


@pytest.mark.slow
def test_the_command_runs_a_tiny_sweep_to_its_looks_and_continues_after_an_interruption(tmp_path, mlflow_url):
    """Real runs (the toy task at smoke scale, one cold start for every seed): look 1 at 3 seeds, look 2 at 4. With
    --logger the cells report to MLflow (a real server) and TensorBoard, grouped under the plan, and the plan's own
    run holds each look."""
    from mlflow import MlflowClient

    from ema_pg.engine.tracking import read_record

    runs = tmp_path / "runs"
    plan = write_plan(tmp_path / "plan", runs, looks=(3, 4), claims={"A": {"better": "ema", "worse": "grpo",
                                                                          "text": "EMA anchor > GRPO"}},
                      overrides=["sft.seed=0", f"sft.cache_dir={tmp_path / 'cache'}"],
                      power={"effect": 0.05, "sd": 0.1, "sd_from": "a guess"})
    cmd = [sys.executable, "-m", "ema_pg.decide", str(plan), "--workers", "2", "--logger", "mlflow,tensorboard",
           "--mlflow-uri", mlflow_url, "--project", "plan_t"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # the plan's power, said before its first cell: 3 and 4 seeds cannot see half an sd
    said = f"LOW POWER: power: the smallest effect that matters, 0.05 (sd 0.1, from a guess), holds by the cap (4 " \
           f"seeds) with probability {power_at(Design(looks=(3, 4)), 0.5):.0%}"
    assert said in out.stdout and out.stdout.index(said) < out.stdout.index("look 1: 6 cells to run")
    looks = pd.read_csv(tmp_path / "plan" / LOOKS)
    assert list(looks["seeds"])[:1] == [3] and set(looks["claim"]) == {"A"}
    assert all((runs / f"{m}_s{s}" / "eval.json").is_file() for m in ("ema", "grpo") for s in (100, 101, 102))
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)  # nothing left: no look retaken
    assert again.returncode == 0 and pd.read_csv(tmp_path / "plan" / LOOKS).equals(looks)
    assert "every claim is decided or at its cap" in again.stdout
    # the trackers: each cell its own run in the plan's group, tagged with its claim; the plan run holds each look
    client = MlflowClient(mlflow_url)
    found = client.search_runs([client.get_experiment_by_name("plan_t").experiment_id])
    cells = [r for r in found if r.data.tags["ema_pg.job_type"] == "cell"]
    finished = sorted(p.name for p in runs.iterdir() if (p / "eval.json").is_file())
    assert sorted(r.info.run_name for r in cells) == finished
    assert all(r.data.tags["ema_pg.group"] == "plan" and r.data.tags["claim"] == "A" for r in cells)
    assert all(read_record(runs / r.info.run_name)["mlflow"]["run_id"] == r.info.run_id for r in cells)
    (plan_run,) = [r for r in found if r.data.tags["ema_pg.job_type"] == "plan"]
    assert plan_run.info.run_name == "plan" and plan_run.data.params["claim.A"].startswith("ema > grpo")
    diffs = client.get_metric_history(plan_run.info.run_id, "A/mean_diff")
    assert [(m.step, m.value) for m in diffs] == [(int(r["look"]), pytest.approx(r["mean_diff"]))
                                                  for _, r in looks.iterrows()]  # sent once, though decide ran twice
    assert (runs / "tb").is_dir() and all((runs / n / "tb").is_dir() for n in finished)
