"""The run loader, the ablation report and the Table 2 analysis on hand-made run folders with known numbers."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import compose_cfg
from omegaconf import OmegaConf

from ema_pg.workbench import table2
from ema_pg.config import with_defaults
from ema_pg.workbench.results import (DETECT_Z, ablation_report, derived_columns, format_seeds, load_curves, load_runs, method_label,
                            min_detectable, paired_differences, paired_sd, seed_tally, seeds_for, seeds_for_t, seeds_to_detect, sign_flip_p, summarize,
                            unpaired_seeds)
from ema_pg.engine.runs import machine

SPLITS = table2.SPLITS
METHOD_OVERRIDES = {"grpo": "GRPO", "ema": "EMA-PG: w/ EMA anchor", "ema_topk_forward": "+ Top-k forward KL",
                    "ema_topk_reverse": "+ Top-k reverse KL", "warp": "WARP"}


def fake_run(root: Path, name: str, overrides: list[str], evals: dict[int, dict[str, float]], finished=True,
             iterations=None) -> Path:
    """A run folder as ema_pg.train writes it: resolved config.yaml, metrics.csv, eval.json when finished."""
    d = root / name
    d.mkdir(parents=True)
    cfg = compose_cfg(overrides + ([f"algo.iterations={iterations or max(evals)}"]))
    cfg.run_dir = str(d)
    OmegaConf.save(with_defaults(cfg), d / "config.yaml", resolve=True)
    rows = [{"step": s, **{f"eval/{k}/em": v for k, v in m.items()}} for s, m in evals.items()]
    rows += [{"step": s, "train/reward_mean": 0.1 * s} for s in range(1, max(evals) + 1)]
    pd.DataFrame(rows).to_csv(d / "metrics.csv", index=False)
    if finished:
        last = max(evals)
        (d / "eval.json").write_text(json.dumps({"iteration": last, "avg": evals[last]["avg"], "metric": "em"}))
    (d / "git.txt").write_text("abc123\n")
    return d


def test_wall_time_is_what_the_run_recorded_not_the_span_of_its_files(tmp_path):
    """A copied or resumed run folder's file times say nothing of its run time: eval.json's wall_s (the run's
    processes summed), else the last time/elapsed_s logged; only runs older than that record fall back to the files'."""
    import os

    a = fake_run(tmp_path, "a", ["seed=0"], {0: {"avg": 0.1}, 2: {"avg": 0.3}})
    ev = json.loads((a / "eval.json").read_text())
    (a / "eval.json").write_text(json.dumps({**ev, "wall_s": 123.5}))
    b = fake_run(tmp_path, "b", ["seed=1"], {0: {"avg": 0.1}, 2: {"avg": 0.3}}, finished=False, iterations=4)
    pd.read_csv(b / "metrics.csv").assign(**{"time/elapsed_s": [1.0, 9.0, 4.0, 8.0]}).to_csv(b / "metrics.csv", index=False)
    c = fake_run(tmp_path, "c", ["seed=2"], {0: {"avg": 0.1}, 2: {"avg": 0.3}})
    for d in (a, b, c):  # copied a day later: the files' times span 50 s
        os.utime(d / "config.yaml", (1e9, 1e9))
        os.utime(d / "metrics.csv", (1e9 + 50, 1e9 + 50))
    assert load_runs(tmp_path)["wall_s"].tolist() == [123.5, 9.0, 50.0]


def test_runs_record_their_method_id_and_labels_come_from_ids():
    for m, label in METHOD_OVERRIDES.items():
        cfg = OmegaConf.to_container(with_defaults(compose_cfg([f"method={m}"])), resolve=False)
        assert cfg["method"] == m and derived_columns(cfg)["method"] == m
        assert method_label(m) == label
    assert method_label("ema_topk_reverse_corrected") == "+ Top-k reverse KL (corrected tail)"
    assert method_label(None) == "custom" and method_label("my_method") == "my_method"
    # the paper's rows run the printed tail; the corrected rows run ours
    assert compose_cfg(["method=ema_topk_reverse"]).kl.tail == "paper"
    assert compose_cfg(["method=ema_topk_forward_corrected"]).kl.tail == "corrected"


@pytest.mark.parametrize("overrides,direction", [
    (["kl=topk_fdiv", "kl.divergence=forward_kl"], "forward"), (["kl=topk_fdiv", "kl.divergence=reverse_kl"], "reverse"),
    (["kl=topk_fdiv", "kl.divergence=js"], "js"), (["kl=k3", "kl.k=null"], "forward"),
    (["kl=k4", "kl.k=null"], "reverse"), (["kl=topk_forward"], "forward"), (["kl=none", "kl.k=null"], "none")])
def test_direction_comes_from_the_estimator_not_its_name(overrides, direction):
    cfg = OmegaConf.to_container(with_defaults(compose_cfg(overrides)), resolve=False)
    assert derived_columns(cfg)["direction"] == direction


def test_tail_variant_comes_from_values():
    variant = lambda o: derived_columns(OmegaConf.to_container(with_defaults(compose_cfg(o)), resolve=False))
    assert variant(["kl.tail=none"])["tail_variant"] == "truncated"
    assert variant(["kl.iw_clip=[1.0,1.0]"])["tail_variant"] == "tail_no_iw"
    assert variant(["method=ema_topk_forward"])["tail_variant"] == "tail_iw"
    assert variant(["method=ema_topk_forward"])["iw_clip"] == "[0, 2.5]"


def test_loader_table_and_curves(tmp_path):
    fake_run(tmp_path, "a", ["kl.k=16", "seed=0"], {0: {"avg": 0.1}, 2: {"avg": 0.3}, 4: {"avg": 0.5}})
    fake_run(tmp_path, "b", ["kl.k=16", "seed=1"], {0: {"avg": 0.1}, 2: {"avg": 0.2}, 4: {"avg": 0.7}})
    fake_run(tmp_path, "c", ["kl.k=0", "seed=0"], {0: {"avg": 0.1}, 2: {"avg": 0.2}}, finished=False, iterations=4)
    runs = load_runs(tmp_path)
    assert list(runs["run"]) == ["a", "b", "c"]
    assert runs["final/eval/avg/em"].tolist() == [0.5, 0.7, 0.2]
    assert runs["base/eval/avg/em"].tolist() == [0.1, 0.1, 0.1]
    assert runs["finished"].tolist() == [True, True, False]
    assert runs["kl.k"].tolist() == [16, 16, 0] and runs["seed"].tolist() == [0, 1, 0]
    assert set(runs["method"]) == {"custom"} and set(runs["direction"]) == {"reverse"}
    assert len(load_runs(tmp_path, finished_only=True)) == 2
    curves = load_curves(runs)
    a = curves[(curves["run"] == "a") & (curves["metric"] == "eval/avg/em")].sort_values("step")
    assert a["value"].tolist() == [0.1, 0.3, 0.5] and a["step"].tolist() == [0, 2, 4]
    t = summarize(runs[runs["finished"]], ["kl.k"], "eval/avg/em")
    assert t["mean"].iloc[0] == pytest.approx(0.6) and t["std"].iloc[0] == pytest.approx(0.1414213, rel=1e-5)
    assert t["n"].iloc[0] == 2 and t["mean ± std"].iloc[0] == "0.600 ± 0.141"


def test_ablation_report_writes_every_format(tmp_path):
    for seed, v in enumerate([0.2, 0.4]):
        fake_run(tmp_path / "runs", f"k0_s{seed}", ["kl.k=0", f"seed={seed}"], {0: {"avg": 0.0}, 2: {"avg": v}})
        fake_run(tmp_path / "runs", f"k16_s{seed}", ["kl.k=16", f"seed={seed}"], {0: {"avg": 0.0}, 2: {"avg": v + 0.5}})
    rep = ablation_report(load_runs(tmp_path / "runs"), tmp_path / "out", name="fig6_k", x="kl.k")
    for f in ["fig6_k.csv", "fig6_k_runs.csv", "fig6_k.md", "fig6_k.png", "fig6_k.pdf"]:
        assert (tmp_path / "out" / f).stat().st_size > 0, f
    md = (tmp_path / "out" / "fig6_k.md").read_text()
    assert "0.300 ± 0.141" in md and "0.800 ± 0.141" in md
    assert rep["table"].set_index("kl.k")["mean"].to_dict() == pytest.approx({"0": 0.3, "16": 0.8})


def test_a_float_tie_is_a_tie_not_a_win():
    # equal 4-split means summed from different parts differ by float rounding alone
    a, b = np.mean([0.1, 0.2, 0.0, 0.0]), np.mean([0.3, 0.0, 0.0, 0.0])
    assert a - b != 0
    d = paired_differences([a, 0.25, 0.2], [b, 0.2, 0.25])
    assert d.tolist() == [0.0, pytest.approx(0.05), pytest.approx(-0.05)] and d[0] == 0.0
    assert seed_tally(d) == "better on 1/3, tied on 1"
    assert seed_tally([0.1, 0.2]) == "better on 2/2"


def test_seeds_to_detect_is_the_count_where_the_observed_difference_becomes_detectable():
    """The seed count an undecided verdict would need: at n seeds (same paired spread) the minimum detectable
    difference has fallen to the observed mean, at n - 1 it has not."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        d = rng.normal(rng.uniform(-0.05, 0.05), rng.uniform(0.005, 0.05), size=int(rng.integers(2, 9)))
        n = int(seeds_to_detect(d))
        sd = d.std(ddof=1)
        mde_at = lambda k: min_detectable(d.mean() + sd * np.sqrt(k - 1) * np.r_[1, -1, np.zeros(k - 2)] / np.sqrt(2))
        assert mde_at(n) <= abs(d.mean()) + 1e-12
        if n > 2:
            assert mde_at(n - 1) > abs(d.mean())
    # known value: deltas 0.1, 0.3 (mean 0.2, std 0.1414): (2.8016 x 0.1414 / 0.2)^2 = 3.92 -> 4 seeds
    assert seeds_to_detect([0.1, 0.3]) == 4
    assert seeds_to_detect([-0.1, -0.3]) == 4  # either direction
    assert seeds_to_detect([0.2, 0.2]) == 2  # no spread: the fewest seeds a paired std needs
    assert seeds_to_detect([0.1, -0.1]) == np.inf and format_seeds(np.inf) == "> 1000"
    assert np.isnan(seeds_to_detect([0.1])) and format_seeds(float("nan")) == "—" and format_seeds(37.0) == "37"
    # from a look's mean and sd, the same rule: (2.8016 x 0.1 / 0.1)^2 = 7.85 -> 8, either direction
    assert seeds_for(0.1, 0.1) == seeds_for(-0.1, 0.1) == 8 and seeds_for(0.2, np.sqrt(0.02)) == 4
    # exact quantiles: 1.959964 + 0.841621; the claims plan's P2 at look 5 needs 466 (465.6), 468 by the t test
    assert DETECT_Z == pytest.approx(2.801585, abs=1e-6)
    assert seeds_for(-0.0022142857142857094, 0.017052921878277883) == 466
    assert seeds_for_t(-0.0022142857142857094, 0.017052921878277883) == 468
    # the t count is the fewest seeds whose noncentral-t power reaches 80%: one fewer falls short
    from scipy.stats import nct
    from scipy.stats import t as student_t
    power = lambda n: nct.sf(student_t.isf(0.025, n - 1), n - 1, 0.1 / 0.1 * np.sqrt(n))
    assert power(seeds_for_t(0.1, 0.1)) >= 0.8 > power(seeds_for_t(0.1, 0.1) - 1)
    assert np.isnan(seeds_for(0.1, float("nan"))) and seeds_for(0.0, 0.1) == np.inf


def test_one_seed_has_no_paired_sd_and_says_so_without_a_numpy_warning():
    import warnings

    assert paired_sd([0.1, 0.3]) == pytest.approx(0.1414, abs=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a report of a one-seed sweep prints the project's lines only
        assert np.isnan(paired_sd([0.1])) and np.isnan(min_detectable([0.1])) and np.isnan(seeds_to_detect([0.1]))


def test_sign_flip_p_by_enumeration():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 7):
        d = rng.normal(0.01, 0.02, n)
        sums = [sum(s * abs(x) for s, x in zip(signs, d)) for signs in itertools.product((1, -1), repeat=n)]
        assert sign_flip_p(d) == pytest.approx(np.mean([t >= d.sum() - 1e-12 for t in sums]))
    assert sign_flip_p([0.01, 0.02, 0.03, 0.04, 0.05]) == 1 / 32  # every seed better: the floor at 5 seeds
    assert sign_flip_p([0.02, 0.0, 0.01, 0.0, 0.025]) == 4 / 32  # a tie flips to itself: 2 ties, 4 copies
    assert sign_flip_p([-0.01, -0.02]) == 1.0 and sign_flip_p([1.0, -1.0]) == 3 / 4
    assert np.isnan(sign_flip_p([]))
    with pytest.raises(ValueError, match="<= 20"):
        sign_flip_p(np.ones(21))


def test_table2_counts_a_float_tie_on_multihop_as_a_tie(tmp_path):
    # seed 0: the multi-hop splits (0.1, 0.2, 0, 0) against (0.3, 0, 0, 0): equal means; seed 1: +0.05 on each
    mh = table2.MULTIHOP
    grpo = [{s: 0.3 for s in table2.GENERAL} | dict(zip(mh, [0.3, 0.0, 0.0, 0.0])) | {"avg": 0.3},
            _scores(0.3, 0.1)]
    rev = [{s: 0.3 for s in table2.GENERAL} | dict(zip(mh, [0.1, 0.2, 0.0, 0.0])) | {"avg": 0.3},
           _scores(0.3, 0.15)]
    _t2_runs(tmp_path / "runs", {"grpo": grpo, "ema_topk_reverse": rev})
    res = table2.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--scale", "test"])
    c = next(c for c in res["orderings"] if c["claim"].startswith("Top-k reverse > GRPO on multi-hop"))
    assert c["seeds"] == "Δ per seed: +0.000, +0.050; better on 1/2, tied on 1"
    assert c["p"] == 0.5  # signs of (0, 0.05): the sum 0.05 is reached by 2 of 4
    assert c["n_detect"] == 16  # (2.8 x 0.0354 / 0.025)^2 = 15.7 seeds to detect a mean of 0.025
    assert "| 16 | 0.500 | Δ per seed: +0.000, +0.050" in (tmp_path / "out" / "results.md").read_text()


def _t2_runs(root: Path, scores: dict[str, list[dict]]):
    for m, per_seed in scores.items():
        for seed, sc in enumerate(per_seed):
            fake_run(root, f"{m}_s{seed}", [f"method={m}", f"seed={seed}"],
                     {0: {**{s: 0.05 for s in SPLITS}, "avg": 0.05}, 4: sc})


def _scores(general: float, multihop: float) -> dict:
    d = {s: general for s in SPLITS[:3]} | {s: multihop for s in SPLITS[3:]}
    return d | {"avg": (3 * general + 4 * multihop) / 7}


def test_table2_orderings_and_missing_rows(tmp_path):
    # EMA > GRPO on every seed; Top-k forward < EMA; Top-k reverse > EMA; WARP worst;
    # relative multi-hop gain of Top-k reverse over GRPO: 0.2/0.1 = +100% vs general 0.1/0.4 = +25%
    _t2_runs(tmp_path / "runs", {
        "grpo": [_scores(0.4, 0.1), _scores(0.4, 0.1)],
        "ema": [_scores(0.45, 0.12), _scores(0.47, 0.12)],
        "ema_topk_forward": [_scores(0.40, 0.11), _scores(0.40, 0.11)],
        "ema_topk_reverse": [_scores(0.5, 0.2), _scores(0.5, 0.2)],
        "warp": [_scores(0.1, 0.01), _scores(0.1, 0.01)],
        "ema_topk_reverse_corrected": [_scores(0.55, 0.2), _scores(0.52, 0.2)],
    })
    res = table2.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--scale", "test"])
    checks = {c["claim"]: c for c in res["orderings"]}
    # beside the claims, no claim made: corrected - paper's tail is +0.15/7 and +0.06/7 on the two seeds
    tail = checks["Top-k reverse: corrected tail − paper's tail (avg)"]
    assert tail["claimed"] is False and tail["verdict"] == "higher" and tail["paper"] == "— (not in the paper)"
    assert tail["seeds"] == "Δ per seed: +0.021, +0.009; better on 2/2"
    assert checks["Top-k forward: corrected tail − paper's tail (avg)"]["verdict"] == "missing"
    assert checks["GRPO − PPO (avg)"]["verdict"] == "missing" and checks["GRPO − PPO (avg)"]["paper"] == "0.312 vs 0.303"
    assert checks["EMA anchor > GRPO (avg)"]["ours_holds"] is True
    assert checks["EMA anchor > GRPO (avg)"]["seeds"].endswith("better on 2/2")
    assert checks["Top-k forward > K3, both with the EMA anchor (avg)"]["ours_holds"] is False
    assert checks["Top-k reverse > K3, both with the EMA anchor (avg)"]["ours_holds"] is True
    assert checks["GRPO > WARP (token-level beats sequence-level KL, §6)"]["ours_holds"] is True
    mh = [c for c in res["orderings"] if c["claim"].startswith("relative gain")][0]
    assert mh["ours_holds"] is True and mh["ours"] == "+100.0% vs +25.0%" and mh["paper_holds"] is True
    assert all(c["paper_holds"] for c in res["orderings"] if c["claimed"])  # the paper's own numbers satisfy its claims
    # paired verdicts: EMA - GRPO is +0.05 / +0.07 on the two seeds (interval above 0), forward - EMA below 0
    ema = checks["EMA anchor > GRPO (avg)"]
    assert ema["verdict"] == "holds" and ema["ci"] == "[+0.033, +0.041]"
    # deltas 0.23/7 and 0.29/7: paired sd (0.06/7)/sqrt(2), over sqrt(2 seeds), times z(0.975) + z(0.8)
    assert ema["mde"] == pytest.approx(2.801585 * (0.06 / 7) / 2 ** 0.5 / 2 ** 0.5, rel=1e-6)
    # (2.8 x 0.0424 / 0.26)^2 = 0.21: already detectable, so the floor of 2 seeds
    assert ema["n_detect"] == 2
    assert checks["Top-k forward > K3, both with the EMA anchor (avg)"]["verdict"] == "fails"
    # multi-hop: Top-k reverse 0.2 vs before RL 0.05 and vs GRPO 0.1 (holds); general QA vs GRPO +0.1 (holds)
    up = checks["RL raises multi-hop EM: Top-k reverse > before RL (mean of the 4 multi-hop splits)"]
    assert up["verdict"] == "holds" and up["ours"].startswith("0.200 vs 0.050") and up["paper"] == "0.334 vs 0.039"
    assert checks["Top-k reverse > GRPO on multi-hop (multi-hop mean)"]["ours"].startswith("0.200 vs 0.100")
    assert checks["Top-k reverse > GRPO on general QA (general mean)"]["verdict"] == "holds"
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| PPO | missing (not run)" in md and "| **holds** |" in md and "| **fails** |" in md
    assert "| GRPO | 0.400 ± 0.000 |" in md and "| EMA-PG: w/ EMA anchor | 0.460 ± 0.014 |" in md
    assert "| before RL | 0.050 ± 0.000 |" in md
    claims_md, beside_md = md.split("Beside the claims, with no claim made")
    assert "corrected tail − paper's tail" not in claims_md and "| **higher** |" in beside_md
    assert "0.479" in md  # the paper's Top-k reverse NQ score, beside ours
    t = pd.read_csv(tmp_path / "out" / "table2.csv")
    assert t[(t["method"] == "GRPO") & (t["split"] == "musique")]["mean"].item() == pytest.approx(0.1)
    for f in ["table2.png", "table2.pdf", "table2_curves.png", "table2_runs.csv", "orderings.json"]:
        assert (tmp_path / "out" / f).is_file(), f


def test_table2_tests_whether_the_gain_is_reading_and_reports_the_kl_pull(tmp_path):
    # before RL: read_em 0.5, recalled 0.3 on both seeds; Top-k reverse ends at read_em 0.7 / 0.6 and recalled
    # 0.1 / 0.2; GRPO logs no diagnostics. The KL/PG gradient norms are logged on one iteration per run.
    _t2_runs(tmp_path / "runs", {"grpo": [_scores(0.4, 0.1)] * 2, "ema_topk_reverse": [_scores(0.5, 0.2)] * 2})
    for seed, (read, recalled) in enumerate([(0.7, 0.1), (0.6, 0.2)]):
        d = tmp_path / "runs" / f"ema_topk_reverse_s{seed}"
        m = pd.read_csv(d / "metrics.csv")
        ev = m["eval/avg/em"].notna()
        m.loc[ev & (m["step"] == 0), ["eval_diag/avg/read_em", "eval_diag/avg/recalled"]] = [0.5, 0.3]
        m.loc[ev & (m["step"] == 4), ["eval_diag/avg/read_em", "eval_diag/avg/recalled"]] = [read, recalled]
        m.loc[~ev & (m["step"] == 2), ["train/grad_norm_pg", "train/grad_norm_kl"]] = [1.0, 0.1 * (seed + 1)]
        m.to_csv(d / "metrics.csv", index=False)
    res = table2.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--scale", "test"])
    checks = {c["claim"].split(":")[0]: c for c in res["orderings"]}
    held = checks["RL raises held-out EM"]
    assert held["ours"].startswith(f"{_scores(0.5, 0.2)['avg']:.3f} vs 0.050") and held["paper_holds"] is True
    read, recall = checks["RL reads better"], checks["RL recalls less"]
    assert read["ours"] == "0.650 vs 0.500 (Δ +0.1500)" and read["seeds"] == "Δ per seed: +0.200, +0.100; better on 2/2"
    assert recall["ours"] == "0.300 vs 0.150 (Δ +0.1500)" and recall["verdict"] == "holds"
    assert read["paper_holds"] is None and read["paper"].startswith("— (ours")
    md = (tmp_path / "out" / "results.md").read_text()
    assert "+ Top-k reverse KL 0.15 [0.1, 0.2]" in md and "GRPO 0" not in md  # GRPO logged no gradient norms
    # where the answers came from: before → after on the seeds with diagnostics, paired change; GRPO has none
    src = pd.read_csv(tmp_path / "out" / "answer_sources.csv").set_index(["method", "diagnostic"])
    assert set(src.index.get_level_values("method")) == {"+ Top-k reverse KL"}
    assert src.loc[("+ Top-k reverse KL", "read_em"), ["before", "after", "delta"]].tolist() == pytest.approx([0.5, 0.65, 0.15])
    assert src.loc[("+ Top-k reverse KL", "recalled"), ["before", "after", "delta", "seeds"]].tolist() == pytest.approx(
        [0.3, 0.15, -0.15, 2])
    assert "| + Top-k reverse KL | 2 |" in md and "0.500 → 0.650 (+0.150 [" in md and "`gold_seen`: a gold answer" in md
    # runs without diagnostics: no reading rows, and the other claims unchanged
    rows = table2.orderings(table2.per_run_scores(load_runs(tmp_path / "runs").query("method == 'grpo'").assign(
        method="GRPO")), pd.read_csv(table2.PAPER))
    assert not any(c["claim"].startswith("RL reads") for c in rows)


def test_table2_multihop_gain_undefined_when_grpo_scores_zero(tmp_path, monkeypatch):
    _t2_runs(tmp_path / "runs", {"grpo": [_scores(0.4, 0.0)], "ema_topk_reverse": [_scores(0.5, 0.0)]})
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    res = table2.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    # the figures carry a fixed date, so drawing the same report again leaves its files unchanged
    assert b"/CreationDate (D:19700101000000Z)" in (tmp_path / "out" / "table2.pdf").read_bytes()
    mh = [c for c in res["orderings"] if c["claim"].startswith("relative gain")][0]
    assert mh["ours_holds"] is None and mh["ours"].startswith("undefined")
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| WARP | missing (not run)" in md


def test_loader_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_runs(tmp_path / "nope")
    with pytest.raises(SystemExit, match="no finished runs"):
        table2.main(["--runs", str(tmp_path), "--out", str(tmp_path / "o")])


def test_load_runs_command_writes_the_table_and_curves(tmp_path):
    from analysis import load_runs as cli

    fake_run(tmp_path / "runs", "a", ["seed=0"], {0: {"avg": 0.1}, 2: {"avg": 0.4}})
    assert cli.main([str(tmp_path / "runs"), "--out", str(tmp_path / "t.csv"), "--curves", str(tmp_path / "c.csv")]) == 0
    t = pd.read_csv(tmp_path / "t.csv")
    assert t["final/eval/avg/em"].tolist() == [0.4] and "kl.name" in t and "anchor.eta" in t
    c = pd.read_csv(tmp_path / "c.csv")
    assert set(c["metric"]) == {"eval/avg/em", "train/reward_mean"}
    assert c[c["metric"] == "train/reward_mean"]["value"].tolist() == pytest.approx([0.1, 0.2])


def test_ablation_report_counts_runs_below_base_and_gives_the_kl_gradient_share(tmp_path):
    # beta 0: both seeds end below their start; beta 0.05 ends above on both. Gradient norms logged on two
    # iterations, one with no policy gradient at all (every group tied): the ratio of mean norms stays finite
    for seed in (0, 1):
        fake_run(tmp_path / "runs", f"b0_s{seed}", ["algo.beta=0.0", f"seed={seed}"], {0: {"avg": 0.3}, 2: {"avg": 0.1 + seed / 10}})
        d = fake_run(tmp_path / "runs", f"b5_s{seed}", ["algo.beta=0.05", f"seed={seed}"], {0: {"avg": 0.3}, 2: {"avg": 0.5 + seed / 10}})
        m = pd.read_csv(d / "metrics.csv")
        train = m["train/reward_mean"].notna()
        m.loc[train & (m["step"] == 1), ["train/grad_norm_pg", "train/grad_norm_kl", "train/kl_pg_grad_ratio"]] = [2.0, 0.5, 0.25]
        m.loc[train & (m["step"] == 2), ["train/grad_norm_pg", "train/grad_norm_kl", "train/kl_pg_grad_ratio"]] = [0.0, 0.5, float("inf")]
        m.to_csv(d / "metrics.csv", index=False)
    runs = load_runs(tmp_path / "runs")
    assert runs.set_index("run").loc["b5_s0", "mean/train/kl_pg_grad_ratio"] == pytest.approx(0.5 / 1.0)
    rep = ablation_report(runs, tmp_path / "out", name="b", x="algo.beta")
    t = rep["table"].set_index("algo.beta")
    assert t.loc["0.0", "ended below base"] == "2/2" and t.loc["0.05", "ended below base"] == "0/2"
    assert t.loc["0.05", "‖∇βKL‖/‖∇J‖"] == "0.5" and t.loc["0.05", "Δ vs 0.0 (paired)"] == "0.400 ± 0.000"
    assert t.loc["0.05", "min. detectable Δ"] == "0.000" and t.loc["0.05", "Δ vs 0"] == "higher"
    md = (tmp_path / "out" / "b.md").read_text()
    assert t.loc["0.05", "seeds to detect Δ"] == "2"
    assert "ended below base" in md and "min. detectable Δ" in md and "seeds to detect Δ" in md


def test_a_seed_whose_runs_began_from_different_base_policies_is_reported_not_paired(tmp_path):
    """Runs of one seed and one cold-start config share a cached base policy, so their iteration-0
    evaluations agree; a base made again elsewhere (another CPU kind) breaks the pairing, and the reports say so."""
    both = {**{s: 0.2 for s in SPLITS}, "avg": 0.2}
    other = {**both, "nq": 0.3, "avg": 0.2 + 0.1 / 7}
    final = {**{s: 0.25 for s in SPLITS}, "avg": 0.25}
    root = tmp_path / "runs"
    fake_run(root, "grpo_s1", ["method=grpo", "seed=1"], {0: both, 4: final})
    fake_run(root, "rev_s1", ["method=ema_topk_reverse", "seed=1"], {0: both, 4: final})
    fake_run(root, "grpo_s2", ["method=grpo", "seed=2"], {0: both, 4: final})
    assert unpaired_seeds(load_runs(root)) == []
    fake_run(tmp_path / "more", "sft_s1", ["method=grpo", "seed=1", "sft.steps=7"], {0: other, 4: final})
    with_other_sft = pd.concat([load_runs(root), load_runs(tmp_path / "more")], ignore_index=True)
    assert unpaired_seeds(with_other_sft) == []  # its base differs where its cold start does: not a broken pair
    late = fake_run(root, "rev_s2", ["method=ema_topk_reverse", "seed=2"], {0: other, 4: final})
    (late / "machine.txt").write_text("AMD EPYC (AVX2); torch 2.13.0+cpu\n")
    runs = load_runs(root)
    assert set(runs["machine"]) == {"unknown", "AMD EPYC (AVX2); torch 2.13.0+cpu"}
    [warning] = unpaired_seeds(runs)
    assert warning.startswith("seed 2: its 2 runs began from 2 different base policies") and "0.200, 0.214" in warning
    res = table2.main(["--runs", str(root), "--out", str(tmp_path / "out"), "--scale", "test"])
    md = (tmp_path / "out" / "results.md").read_text()
    assert f"- **not paired**: {warning}" in md and "`AMD EPYC (AVX2); torch 2.13.0+cpu`; `unknown`" in md
    assert res["orderings"]
    ablation_report(runs, tmp_path / "abl", x="method")
    assert f"**Not paired**: {warning}." in (tmp_path / "abl" / "abl.md").read_text()


def test_machine_names_the_cpu_and_the_torch_build():
    import platform

    import torch

    m = machine()
    assert f"torch {torch.__version__}" in m
    if Path("/proc/cpuinfo").is_file() and platform.system() == "Linux":
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), None)
        assert model is None or m.startswith(model)


def test_table2_transfer_column_reads_each_runs_transfer_evaluation_by_hand(tmp_path):
    """The Table 2 report's unseen-worlds table: per method the mean own-world and unseen-world avg EM over the
    runs that have ``evaluations/policy_transfer<N>.json`` (the largest N), and their ratio."""
    import json

    import pandas as pd

    from ema_pg.workbench.table2 import transfer_markdown, transfer_scores

    def run(name, method, seed, files):
        d = tmp_path / name
        (d / "evaluations").mkdir(parents=True)
        for fname, own, unseen, n in files:
            (d / "evaluations" / fname).write_text(json.dumps({"avg": own, "transfer": {"avg": unseen,
                                                                                         "seeds": list(range(n))}}))
        return {"run": name, "method": method, "seed": seed, "run_dir": str(d)}

    runs = pd.DataFrame([
        run("a", "GRPO", 1, [("policy_transfer2.json", 0.4, 0.1, 2), ("policy_transfer5.json", 0.4, 0.2, 5)]),
        run("b", "GRPO", 2, [("policy_transfer5.json", 0.2, 0.1, 5), ("policy_transfer5_task.seed-3.json", 0.9, 0.9, 5)]),
        run("c", "EMA", 1, []),
    ])
    tr = transfer_scores(runs)
    assert list(tr["run"]) == ["a", "b"] and list(tr["transfer"]) == [0.2, 0.1]  # the largest N; no override files
    md = "\n".join(transfer_markdown(tr))
    # unseen - 0.9 x own per seed: 0.2 - 0.36 and 0.1 - 0.18; the bootstrap's means of two values lie in [-0.16, -0.08]
    assert "| GRPO | 0.300 ± 0.141 | 0.150 ± 0.071 | 0.500 | -0.120 [-0.160, -0.080] | **fails** | 5 | 2 |" in md
    assert "| EMA |" not in md


def test_the_run_plot_smooths_training_curves_by_a_debiased_moving_average():
    """TensorBoard's debiased EMA: m_t = w m_(t-1) + (1 - w) x_t over 1 - w^t; by hand for w = 0.5 on 1, 0, 0: 1, 1/3, 1/7."""
    from ema_pg.engine.plotting import smoothed

    assert smoothed(pd.Series([1.0, 0.0, 0.0]), 0.5).tolist() == pytest.approx([1.0, 1 / 3, 1 / 7])
    assert smoothed(pd.Series([2.0] * 4)).tolist() == pytest.approx([2.0] * 4)  # a constant stays itself


def test_the_async_report_names_the_sampler_the_runs_used():
    """The async study's report says which sampler ran, from the runs' configs: a vLLM study's report said "the HF
    sampler" (the line was written for the first study)."""
    from ema_pg.workbench.studies.async_study import _sampler

    hf = pd.DataFrame({"rollout.name": ["hf", "hf"], "rollout.engine_dtype": ["auto", "auto"],
                       "rollout.correction": ["none", "none"]})
    vllm = hf.assign(**{"rollout.name": "vllm", "rollout.engine_dtype": "bfloat16"})
    assert "HF" not in _sampler(vllm) and "vLLM engine (dtype bfloat16, correction none" in _sampler(vllm)
    assert _sampler(hf).startswith("rollouts by the hf sampler")
