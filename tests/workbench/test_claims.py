"""reproductions/CLAIMS.md: generated, up to date, and holding every verdict every committed results file states."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from ema_pg.workbench.claims import PAGE, REPRO, all_verdicts, render, table_verdicts


def _norm(x: str) -> str:
    return re.sub(r"\s+", "", x.replace("−", "-"))


def test_the_committed_page_is_the_one_the_command_writes():
    assert PAGE.read_text() == render(all_verdicts()), \
        "reproductions/CLAIMS.md is out of date: run python -m ema_pg.workbench.claims"


def test_every_verdict_of_every_results_file_is_on_the_page():
    """Each verdict row (its reproduction, its verdict and its interval, or its claim where it has no interval) is on
    a line of the page; the verdict CSVs' rows too (by id and verdict)."""
    page = PAGE.read_text().splitlines()
    verdicts = all_verdicts()
    assert len(verdicts) > 100  # the guard: the parser reads the committed results
    for v in verdicts:
        mark = _norm(v.interval) if v.interval.startswith("[") else None
        hits = [ln for ln in page if f"({v.folder}/" in ln and f"**{v.verdict}**" in ln
                and (mark in _norm(ln) if mark else (v.key in ln or v.text in ln))]
        assert hits, f"{v.file}: {v.key} ({v.verdict} {v.interval}) is not on reproductions/CLAIMS.md"
    for csv in list(REPRO.rglob("verdicts.csv")) + list(REPRO.rglob("claims.csv")):
        rows = pd.read_csv(csv)
        if "verdict" not in rows or "id" not in rows:
            continue
        folder = str(csv.parent.relative_to(REPRO))
        for _, r in rows.iterrows():
            verdict = str(r['verdict']).strip('()')
            assert any(f"({folder}/" in ln and f"**{verdict}**" in ln for ln in page), (csv, r["id"])


def test_the_parser_reads_a_verdict_table_as_the_reports_write_it(tmp_path, monkeypatch):
    import ema_pg.workbench.claims as claims

    monkeypatch.setattr(claims, "REPRO", tmp_path)
    f = tmp_path / "fig0" / "README.md"
    f.parent.mkdir()
    f.write_text("Intro.\n\n| id | claim | direction | verdict |\n|---|---|---|---|\n| E1 | a plan's row | x > 0 | holds / fails"
                 " / undecided |\n\n| id | claim | Δ mean ± sd | 95% CI | verdict | min. detectable Δ |\n|---|---|---|---|---|---|\n"
                 "| E1 | eta 0.9 > eta 1.0 | +0.034 ± 0.029 | [+0.014, +0.059] | **holds** (5/5 seeds) | 0.036 |\n"
                 "| E2 | forward | +0.016 ± 0.091 | [−0.064, +0.070] | **undecided** (4/5 seeds) | 0.114 |\n")
    got = table_verdicts(f)
    assert [(v.key, v.verdict, v.interval, v.seeds, v.delta) for v in got] == [
        ("E1", "holds", "[+0.014, +0.059]", "5", "+0.034 ± 0.029"), ("E2", "undecided", "[−0.064, +0.070]", "5", "+0.016 ± 0.091")]


def test_plans_that_ran_side_by_side_are_each_a_latest_verdict_and_a_newer_one_supersedes(tmp_path, monkeypatch):
    """Two sequential plans from two base policies stand side by side on the page (neither is history of the
    other), while an older reproduction's verdict of the same claim moves to the history."""
    import shutil

    import ema_pg.workbench.claims as claims

    monkeypatch.setattr(claims, "REPRO", tmp_path)
    src = REPRO / "table2" / "claims"
    for name, shift in (("claims", 0.0), ("claims_base660", 0.5)):
        d = tmp_path / "table2" / name
        d.mkdir(parents=True)
        shutil.copy(src / "plan.yaml", d / "plan.yaml")
        looks = pd.read_csv(src / "looks.csv")
        looks[["mean_diff", "lo", "hi"]] += shift  # the second plan's numbers differ from the first's
        looks.to_csv(d / "looks.csv", index=False)
    old = tmp_path / "table2" / "decide_episode" / "results.md"
    old.parent.mkdir()
    old.write_text("| id | claim | Δ | 95% CI | verdict |\n|---|---|---|---|---|\n"
                   "| P1 | EMA anchor > GRPO | +0.013 | [−0.010, +0.034] | **undecided** |\n")
    page, history = claims.render(claims.all_verdicts(tmp_path)).split("## History")
    history = history.split("## Deviations")[0]  # the history table alone (both plans' deviations follow it)
    p1 = [ln for ln in page.splitlines() if ln.startswith("| EMA anchor > GRPO") and "reasoning-gym" not in ln]
    assert len(p1) == 2 and any("(table2/claims/looks.csv)" in ln for ln in p1) \
        and any("(table2/claims_base660/looks.csv)" in ln for ln in p1), p1
    assert "table2/decide_episode/results.md" in history and "claims_base660" not in history
    assert "side by side (`table2/claims` and `table2/claims_base660`" in page  # the reader is told why two rows


def test_reasoning_gyms_verdicts_stand_beside_the_search_worlds_not_over_them(tmp_path, monkeypatch):
    """The suite plan asks P1 and P3 again on reasoning-gym: its verdicts get rows of their own under the paper's
    claims, and the search world's stay the latest of theirs."""
    import shutil

    import ema_pg.workbench.claims as claims

    monkeypatch.setattr(claims, "REPRO", tmp_path)
    src = REPRO / "table2" / "claims"
    for rel in ("table2/claims", "reasoning_gym/suite"):
        d = tmp_path / rel
        d.mkdir(parents=True)
        shutil.copy(src / "plan.yaml", d / "plan.yaml")
        looks = pd.read_csv(src / "looks.csv")
        if rel.startswith("reasoning_gym"):
            looks = looks[looks["claim"].isin(["P1", "P3"])].copy()
            looks[["mean_diff", "lo", "hi"]] -= 1.0  # numbers of its own
        looks.to_csv(d / "looks.csv", index=False)
    page = claims.render(claims.all_verdicts(tmp_path)).split("## History")[0]
    rg = [ln for ln in page.splitlines() if "asked on tasks nobody here wrote" in ln]
    assert len(rg) == 2 and all("(reasoning_gym/suite/looks.csv)" in ln for ln in rg), rg
    search = [ln for ln in page.splitlines() if ln.startswith("| EMA anchor > GRPO (average EM)")]
    assert len(search) == 1 and "(table2/claims/looks.csv)" in search[0]


def test_a_claim_stopped_at_the_cap_says_what_a_decision_would_take(tmp_path, monkeypatch):
    """A sequential claim that ended undecided gets the seeds a fixed design would need at the effect and sd its
    seeds show (the rule of ``seeds_to_detect``); a decided one gets none."""
    import shutil

    import ema_pg.workbench.claims as claims

    monkeypatch.setattr(claims, "REPRO", tmp_path)
    d = tmp_path / "table2" / "claims"
    d.mkdir(parents=True)
    src = REPRO / "table2" / "claims"
    shutil.copy(src / "plan.yaml", d / "plan.yaml")
    looks = pd.read_csv(src / "looks.csv")
    last = looks["look"] == looks["look"].max()
    looks.loc[last, "verdict"] = ["holds", "stopped at the cap", "stopped at the cap"]
    looks.loc[last, "mean_diff"], looks.loc[last, "sd_diff"] = [0.01, -0.1, 0.2], [0.01, 0.1, np.sqrt(0.02)]
    looks.to_csv(d / "looks.csv", index=False)
    by = {v.key: v.to_decide for v in claims.look_verdicts(d / "looks.csv")}
    assert by["P1"] == "" and by["P2"].startswith("8 (noncentral t: 10; a fixed design") \
        and by["P3"].startswith("4 (noncentral t: 7; a fixed design")


def test_the_split_table_agrees_with_the_looks_and_its_variance_shares_add_up():
    """analysis/claims_splits.py on the committed ledger: its average row is the last look's mean paired difference
    (decide computes that from the same cells), each split's Δ is the hand-computed paired mean, and the splits'
    shares of the average's paired variance add to 1 (the average is the splits' mean). The committed splits.md is
    the one the script writes."""
    import json

    from analysis.claims_splits import AVG, markdown, split_table

    plan = REPRO / "table2" / "claims" / "plan.yaml"
    t = split_table(plan)
    looks = pd.read_csv(plan.parent / "looks.csv")
    last = looks[looks["look"] == looks["look"].max()].set_index("claim")
    for cid, g in t.groupby("claim"):
        g = g.set_index("split")
        assert g.loc[AVG, "delta"] == pytest.approx(last.loc[cid, "mean_diff"], abs=1e-12)
        assert g.loc[AVG, "seeds"] == last.loc[cid, "seeds"]
        assert g.drop(AVG)["share"].sum() == pytest.approx(1.0, abs=1e-9)
    cells = pd.read_csv(plan.parent / "cells.csv")
    s = {(m, k): json.loads(v) for m, k, v in zip(cells["method"], cells["seed"], cells["scores"])}
    hand = np.mean([s[("ema", k)]["hotpotqa"] - s[("grpo", k)]["hotpotqa"] for k in range(101, 161)])
    assert t.set_index(["claim", "split"]).loc[("P1", "hotpotqa"), "delta"] == pytest.approx(hand, abs=1e-12)
    assert (plan.parent / "splits.md").read_text() == markdown(t, plan.relative_to(REPRO.parent))


def test_the_split_table_uses_each_claims_last_look_and_waits_for_the_plan_to_end(tmp_path):
    """With the ledger as it stood at look 4 (every claim continuing; P2 and P3 with a seed left out) the table's
    average rows are look 4's, over look 4's seeds, never the cells beyond it; and the command refuses to write a
    table while a claim is open."""
    import shutil

    from analysis.claims_splits import AVG, main, split_table

    src = REPRO / "table2" / "claims"
    for f in ("plan.yaml", "cells.csv"):
        shutil.copy(src / f, tmp_path / f)
    looks = pd.read_csv(src / "looks.csv", dtype={"left_out": str})
    looks[looks["look"] <= 4].to_csv(tmp_path / "looks.csv", index=False)
    at4 = looks[looks["look"] == 4].set_index("claim")
    t = split_table(tmp_path / "plan.yaml").set_index(["claim", "split"])
    for cid in ("P1", "P2", "P3"):
        assert t.loc[(cid, AVG), "seeds"] == at4.loc[cid, "seeds"]
        assert t.loc[(cid, AVG), "delta"] == pytest.approx(at4.loc[cid, "mean_diff"], abs=1e-12)
    with pytest.raises(SystemExit, match="P1, P2, P3 still open"):
        main([str(tmp_path / "plan.yaml")])
    assert not (tmp_path / "splits.md").exists()


def test_a_plans_rows_say_what_it_could_detect_and_which_of_its_cells_carry_no_base():
    """The detectable effect is the plan's design's (80% power by its cap) at the sd its last look found; a ledger
    whose cells were recorded before cells carried their base says how many, on every row of its plan."""
    from ema_pg.workbench.claims import look_verdicts
    from ema_pg.workbench.studies.decide import load_plan
    from ema_pg.workbench.studies.sequential import detectable

    for rel, unpinned in (("table2/claims", 178), ("reasoning_gym/suite", 0)):
        looks = pd.read_csv(REPRO / rel / "looks.csv")
        k = detectable(load_plan(REPRO / rel / "plan.yaml").design)
        for v in look_verdicts(REPRO / rel / "looks.csv"):
            sd = looks[looks["claim"] == v.key]["sd_diff"].iloc[-1]
            assert v.detectable == f"{k * sd:.4f} (sd {sd:.4f})"
            assert (v.note == f"{unpinned} of its 240 cells carry no base policy or machine: recorded before cells "
                    "did, their base is not checked") if unpinned else v.note == ""
    page = PAGE.read_text()
    assert "detectable at the cap" in page and "178 of its 240 cells carry no base policy" in page
