"""The math track: Pass@k / maj@N by enumeration, the synthetic math task and math-verify rewards,
DeepScaleR-style files, sampled evaluation on a real sampler, and staged runs (init_from)."""

import itertools
import json
import random
from pathlib import Path

import pandas as pd
import pytest
from helpers import compose_cfg
from omegaconf import OmegaConf

from ema_pg.config import ConfigError, validate
from ema_pg.engine.evaluation import majority_reward, pass_at_k, pass_ks, sample_scores
from ema_pg.tasks import build_task
from ema_pg.tasks.math.task import SPLITS, solution_text
from ema_pg.train import train


# ---------------------------------------------------------------- Pass@k, maj@N
@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_equals_enumerating_every_k_subset(n):
    for c in range(n + 1):
        samples = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_known_values_and_bad_arguments():
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(32, 0, 16) == 0.0 and pass_at_k(32, 17, 16) == 1.0
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_pass_at_1_is_the_mean_and_pass_at_k_rises_with_k():
    rng = random.Random(0)
    rewards = [[float(rng.random() < p) for _ in range(16)] for p in (0.05, 0.3, 0.9, 0.0)]
    s = sample_scores(rewards, [[None] * 16] * 4)
    assert s["pass@1"] == pytest.approx(s["mean@16"]) == pytest.approx(sum(map(sum, rewards)) / 64)
    vals = [s[f"pass@{k}"] for k in (1, 2, 4, 8, 16)]
    solved = sum(any(r) for r in rewards) / 4  # pass@N: the share of problems solved at least once
    assert vals == sorted(vals) and vals[-1] == pytest.approx(solved) and 0 < solved < 1


def test_majority_vote_takes_the_most_stated_answer_and_ties_go_first():
    assert majority_reward(["3", "4", "4", None], [0, 1, 1, 0]) == 1
    assert majority_reward(["3", "4", "3", "4"], [1, 0, 1, 0]) == 1  # tie: "3" was stated first
    assert majority_reward(["4", "3", "3", "4"], [0, 1, 1, 0]) == 0
    assert majority_reward([None, None], [0, 0]) == 0
    s = sample_scores([[1, 0, 0], [0, 1, 1]], [["a", "b", "b"], ["x", "y", "y"]])
    assert s["maj@3"] == 0.5 and s["pass@3"] == 1.0 and s["mean@3"] == pytest.approx(0.5)


def test_the_reported_k_are_powers_of_two_and_n():
    assert pass_ks(32) == [1, 2, 4, 8, 16, 32] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]
    assert pass_ks(8, [8, 1, 1]) == [1, 8]
    with pytest.raises(ConfigError, match=r"rollout.eval_pass_k=\[16\]: each k must be in \[1, rollout.eval_samples=8\]"):
        validate(compose_cfg(["rollout.eval_samples=8", "rollout.eval_temperature=0.8", "rollout.eval_pass_k=[16]"]))


# ---------------------------------------------------------------- the task
@pytest.fixture(scope="module")
def task():
    return build_task({"name": "math"})


def test_splits_stand_in_for_table3_and_no_eval_problem_is_trained_on(task):
    ev = task.eval_splits()
    assert list(ev) == list(SPLITS) and all(len(v) == 32 for v in ev.values())
    for name, (steps, phrasing) in SPLITS.items():
        assert all(p.meta["steps"] == steps and p.meta["phrasing"] == phrasing for p in ev[name])
    held = {p.meta["problem"] for v in ev.values() for p in v}
    train_texts = {p.meta["problem"] for p in task.sample(3000, seed=1)}
    assert not held & train_texts
    assert {p.meta["steps"] for p in task.sample(500, seed=2)} == set(range(1, 7))
    assert task.sample(20, seed=3) == task.sample(20, seed=3) != task.sample(20, seed=4)


def test_the_worked_solution_earns_the_reward_and_values_stay_in_range(task):
    for v in task.eval_splits().values():
        for p in v:
            sol = solution_text(p.meta["v0"], p.meta["ops"])
            assert task.reward(p, sol) == 1.0
            assert all(0 <= int(line.split("=")[1]) <= 99 for line in sol.splitlines()[:-1])


def test_answers_are_checked_with_math_verify_not_string_equality(task):
    p = task.eval_splits()["math500"][0]
    a = int(p.answer)
    right = [f"\\boxed{{{a}}}", f"\\boxed{{{a}.0}}", f"\\boxed{{\\frac{{{2 * a}}}{{2}}}}", f"so ${a}$"]
    wrong = [f"\\boxed{{{a + 1}}}", f"the answer is {a}", "", "\\boxed{", f"\\boxed{{{a}}} \\boxed{{{a + 1}}}"]
    assert [task.reward(p, r) for r in right] == [1.0] * len(right)
    assert [task.reward(p, r) for r in wrong] == [0.0] * len(wrong)
    same = [f"\\boxed{{{a}}}", f"x \\boxed{{{a}.0}}", f"\\boxed{{\\frac{{{2 * a}}}{{2}}}}"]
    assert len({task.answer_key(p, r) for r in same}) == 1 and task.answer_key(p, same[0]) is not None  # one vote
    assert task.answer_key(p, "\\boxed{0.5}") == task.answer_key(p, "\\boxed{\\frac{1}{2}}") != task.answer_key(p, same[0])
    assert task.answer_key(p, "no answer") is None


def test_rewards_are_checked_off_the_main_thread_too(task):
    from concurrent.futures import ThreadPoolExecutor

    p = task.eval_splits()["amc"][1]
    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(task.reward, p, f"\\boxed{{{int(p.answer) * 3}/3}}").result() == 1.0


def test_the_cold_start_teacher_slips_at_its_error_rate(task):
    wrong, steps = count_wrong_steps(task.demonstrations(600, seed=0))
    assert steps > 1500 and 0.07 < wrong / steps < 0.13  # demo_error_rate = 0.1 (a slip of 1-3, never 0)
    clean = build_task({"name": "math", "demo_error_rate": 0.0}).demonstrations(200, seed=0)
    clean_wrong, clean_steps = count_wrong_steps(clean)
    assert clean_wrong == 0 and clean_steps > 400


def count_wrong_steps(demos) -> tuple[int, int]:
    """(wrong steps, steps) of demonstrations: each line "a<op>b=c" checked by arithmetic; the boxed answer
    must be the last line's result (the chain carries on from what was written)."""
    wrong = steps = 0
    for _, sol in demos:
        lines = sol.splitlines()
        for line in lines[:-1]:
            lhs, rhs = line.split("=")
            op = next(o for o in "+-*" if o in lhs)
            a, b = lhs.split(op)
            steps += 1
            wrong += int(rhs) != eval(f"{a}{op}{b}")
        assert lines[-1] == f"\\boxed{{{lines[-2].split('=')[1]}}}"
    return wrong, steps


def test_bad_task_knobs_are_refused():
    for kw, msg in [({"max_steps": 0}, "max_steps"), ({"per_split": 0}, "per_split"), ({"heldout_mod": 1}, "heldout_mod"),
                    ({"demo_error_rate": 1.0}, "demo_error_rate"), ({"prompt_template": "Q:"}, "{problem}")]:
        with pytest.raises(ValueError, match=msg):
            build_task({"name": "math", **kw})


# ---------------------------------------------------------------- real data files
def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_deepscaler_style_files_load_as_train_and_eval_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}",
                                            "solution": "1/2 + 1/4 = 3/4. \\boxed{\\frac{3}{4}}"},
                                           {"problem": "2+2?", "answer": 4}])
    pd.DataFrame({"problem": ["x^2=9, x>0. x?"], "answer": ["3"]}).to_parquet(tmp_path / "aime24.parquet")
    write_jsonl(tmp_path / "math500.jsonl", [{"question": "3*3?", "answer": "9"}])
    t = build_task({"name": "math", "data_dir": str(tmp_path), "prompt_template": "{problem} Put it in \\boxed{{}}.\n"})
    assert sorted(t.eval_splits()) == ["aime24", "math500"]
    p = t.eval_splits()["aime24"][0]
    assert p.text == "x^2=9, x>0. x? Put it in \\boxed{}.\n" and p.answer == "3"
    assert t.reward(p, "\\boxed{3}") == 1.0 and t.reward(p, "\\boxed{-3}") == 0.0
    tr = t.sample(10, seed=0)
    assert {q.answer for q in tr} <= {"\\frac{3}{4}", "4"}
    frac = next(q for q in t.train_set if q.answer == "\\frac{3}{4}")
    assert t.reward(frac, "\\boxed{0.75}") == 1.0
    demos = t.demonstrations(5, seed=0)
    assert {d[1] for d in demos} == {"1/2 + 1/4 = 3/4. \\boxed{\\frac{3}{4}}"}  # only rows with a solution


@pytest.mark.parametrize("rows,match", [
    ([{"answer": "3"}], "train.jsonl: row 1: the row has no problem text"),
    ([{"problem": "p", "answer": "1"}, {"problem": "q", "answer": ""}], "train.jsonl: row 2: the row has no gold answer"),
    ([{"problem": "p"}], "no gold answer"),
])
def test_malformed_rows_name_their_file_and_line(tmp_path, rows, match):
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "aime24.jsonl", [{"problem": "p", "answer": "1"}])
    with pytest.raises(ValueError, match=match):
        build_task({"name": "math", "data_dir": str(tmp_path)})


def test_missing_or_unreadable_files_say_what_to_add(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        build_task({"name": "math", "data_dir": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="no training file"):
        build_task({"name": "math", "data_dir": str(tmp_path)})
    write_jsonl(tmp_path / "train.jsonl", [{"problem": "p", "answer": "1"}])
    with pytest.raises(ValueError, match="no eval files"):
        build_task({"name": "math", "data_dir": str(tmp_path)})
    (tmp_path / "aime24.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="aime24.jsonl: row 1: not a JSON object"):
        build_task({"name": "math", "data_dir": str(tmp_path)})
    write_jsonl(tmp_path / "aime24.jsonl", [{"problem": "p", "answer": "1"}])
    t = build_task({"name": "math", "data_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="no row has a 'solution'"):
        t.demonstrations(4, seed=0)


# ---------------------------------------------------------------- sampled evaluation, real sampler
@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from ema_pg.engine.policy import build_policy

    cfg = compose_cfg(["task=math", "rollout.max_new_tokens=12"], tmp_path_factory.mktemp("mp"))
    task = build_task(cfg.task)
    model, tok = build_policy(cfg, task)
    return cfg, task, model, tok


def test_sampled_evaluation_reports_pass_at_k_from_its_own_samples(tiny_policy):
    from ema_pg.engine.evaluation import evaluate_policy
    from ema_pg.rollout import HFSampler

    cfg, task, model, tok = tiny_policy
    ro = OmegaConf.merge(cfg.rollout, {"eval_samples": 4, "eval_temperature": 1.0, "eval_top_p": 0.9})
    splits = {k: v[:6] for k, v in task.eval_splits().items() if k in ("math500", "aime25")}
    res = evaluate_policy(model, HFSampler(tok), task, ro, splits=splits, progress=False, show=2)
    for name, s in res["splits"].items():
        assert s["n"] == 6 and s["samples"] == 4
        assert s["acc"] == s["mean@4"] == pytest.approx(s["pass@1"])
        assert s["pass@1"] <= s["pass@2"] <= s["pass@4"] <= 1.0
    assert res["avg_scores"]["pass@4"] == pytest.approx(sum(s["pass@4"] for s in res["splits"].values()) / 2)
    assert res["eval_settings"] == {"samples": 4, "temperature": 1.0, "top_p": 0.9}
    # each problem samples from its own stream: the batching does not change the result
    again = evaluate_policy(model, HFSampler(tok), task, ro, splits=splits, progress=False, batch_size=8)
    assert again["splits"] == res["splits"]
    # greedy evaluation (eval_samples = 1) keeps its single score
    greedy = evaluate_policy(model, HFSampler(tok), task, cfg.rollout, splits=splits, progress=False)
    assert set(greedy["splits"]["math500"]) == {"acc", "n", "per_problem"} and "avg_scores" not in greedy


def test_sampled_eval_settings_are_checked_at_start():
    cfg = compose_cfg(["rollout.eval_samples=4"])
    with pytest.raises(ConfigError, match="eval_temperature > 0"):
        validate(cfg)
    with pytest.raises(ConfigError, match="eval_pass_k"):
        validate(compose_cfg(["rollout.eval_samples=4", "rollout.eval_temperature=0.8", "rollout.eval_pass_k=[8]"]))
    with pytest.raises(ConfigError, match="eval_top_p"):
        validate(compose_cfg(["rollout.eval_top_p=0"]))


# ---------------------------------------------------------------- one command: train and evaluate the track
MATH_TINY = ["experiment=math", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
             "model.num_kv_heads=1", "model.tokenizer_vocab=300", "sft.steps=20", "sft.batch_size=16",
             "sft.num_demos=200", "sft.stop_at_reward=0", "algo.prompts_per_step=4", "algo.group_size=4",
             "algo.minibatch_size=0", "algo.iterations=2", "algo.eval_every=1", "rollout.max_new_tokens=12", "rollout.eval_samples=4",
             "task.per_split=3", "trainer.progress_bar=false"]


def test_the_math_experiment_trains_and_logs_pass_at_k(tmp_path):
    cfg = compose_cfg(MATH_TINY, tmp_path, tiny=False)
    assert cfg.rollout.eval_temperature == 0.8 and cfg.rollout.eval_top_p == 0.9
    metrics, objs = train(cfg)
    df = pd.read_csv(objs["run_dir"] / "metrics.csv")
    for col in ["eval/avg/acc", "eval/avg/pass@4", "eval/avg/maj@4", "eval/aime25/pass@2", "eval/math500/mean@4"]:
        assert df[col].notna().sum() == 3, col  # the base policy and after each iteration
    ev = json.loads((objs["run_dir"] / "eval.json").read_text())
    assert set(ev["splits"]) == set(SPLITS) and ev["avg_scores"]["pass@1"] == pytest.approx(ev["avg"])


@pytest.mark.slow  # three math runs: ~11 s; the fast suite resumes runs exactly elsewhere (test_train)
def test_a_stage_continues_a_run_exactly_and_may_change_its_length(tmp_path, recwarn):
    common = [o for o in MATH_TINY if not o.startswith("algo.iterations")]
    full = compose_cfg(common + ["algo.iterations=4"], tmp_path / "full", tiny=False)
    full.sft.cache_dir = str(tmp_path / "cache")
    _, o_full = train(full)
    s1 = compose_cfg(common + ["algo.iterations=2"], tmp_path / "s1", tiny=False)
    s1.sft.cache_dir = str(tmp_path / "cache")
    train(s1)
    s2 = compose_cfg(common + ["algo.iterations=4", f"init_from={s1.run_dir}"], tmp_path / "s2", tiny=False)
    s2.sft.cache_dir = str(tmp_path / "cache")
    _, o2 = train(s2)
    drop = lambda df: df[[c for c in df.columns if not c.startswith("time/")]].reset_index(drop=True)  # noqa: E731
    a = pd.read_csv(o_full["run_dir"] / "metrics.csv")
    b = pd.read_csv(o2["run_dir"] / "metrics.csv")
    assert b["step"].min() > 2  # the stage's own record starts after the first stage's end
    pd.testing.assert_frame_equal(drop(a[a["step"] > 2]), drop(b)[list(drop(a).columns)], check_exact=True)
    # a longer context in the next stage (the paper's 8k -> 16k -> 24k) is a new setting, not a new network
    s3 = compose_cfg(common + ["algo.iterations=5", f"init_from={o2['run_dir']}", "rollout.max_new_tokens=16"],
                     tmp_path / "s3", tiny=False)
    s3.sft.cache_dir = str(tmp_path / "cache")
    m3, _ = train(s3)
    assert m3["iteration"] == 5
    # each stage links last.ckpt to its own checkpoint and leaves the stage before it whole, without a word
    # from Lightning about the folder that changed (a stage's folder is new by design)
    for run in (s1.run_dir, o2["run_dir"], s3.run_dir):
        last = Path(run) / "checkpoints" / "last.ckpt"
        assert last.is_symlink() and last.resolve().parent == last.parent.resolve() and last.resolve().is_file()
    assert not [w for w in recwarn if "dirpath has changed" in str(w.message)]
    for bad, match in [(["algo.iterations=4"], "must be larger"), (["model.hidden_size=64"], "model.hidden_size")]:
        c = compose_cfg(common + [f"init_from={o2['run_dir']}"] + bad, tmp_path / "bad", tiny=False)
        c.sft.cache_dir = str(tmp_path / "cache")
        with pytest.raises(ConfigError, match=match):
            train(c)


# ---------------------------------------------------------------- Table 3's report on hand-made runs
def fake_math_run(root, method, seed, base: float, final: float, base16: float, final16: float):
    """A finished run folder as ema_pg.train writes it, with known Pass@1 / Pass@16 on every split."""
    from ema_pg.config import with_defaults
    from ema_pg.tasks.math.task import SPLITS as S

    d = root / f"{method}_s{seed}"
    d.mkdir(parents=True)
    cfg = compose_cfg(["experiment=math", f"method={method}", f"seed={seed}", "algo.iterations=4",
                       "rollout.eval_samples=16"], tiny=False)
    cfg.run_dir = str(d)
    OmegaConf.save(with_defaults(cfg), d / "config.yaml", resolve=True)
    rows = []
    for step, p1, p16 in [(0, base, base16), (2, (base + final) / 2, (base16 + final16) / 2), (4, final, final16)]:
        row = {"step": step}
        for s in [*S, "avg"]:
            row |= {f"eval/{s}/acc": p1, f"eval/{s}/pass@16": p16, f"eval/{s}/mean@16": p1}
        rows.append(row)
    pd.DataFrame(rows).to_csv(d / "metrics.csv", index=False)
    (d / "eval.json").write_text(json.dumps({"iteration": 4, "avg": final, "metric": "acc"}))
    (d / "git.txt").write_text("abc123\n")


def test_table3_report_gives_the_papers_column_and_decides_the_claims(tmp_path):
    from ema_pg.workbench import table3

    for seed in range(5):  # EMA beats GRPO on every seed in Pass@1 and loses in Pass@16
        fake_math_run(tmp_path / "runs", "grpo", seed, 0.2, 0.4 + 0.01 * seed, 0.6, 0.5)
        fake_math_run(tmp_path / "runs", "ema", seed, 0.2, 0.45 + 0.01 * seed + 0.002 * (seed % 2), 0.6, 0.45)
    res = table3.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--scale", "test"])
    c = res["claims"].set_index("id")
    assert c.loc["C1", "verdict"] == "holds" and c.loc["C1", "delta_mean"] == pytest.approx(0.22)
    assert c.loc["C3", "verdict"] == "holds" and c.loc["C3", "delta_mean"] == pytest.approx(0.0508)
    assert c.loc["C4", "verdict"] == "fails" and c.loc["C4", "delta_mean"] == pytest.approx(-0.05)
    assert c.loc["C3", "seeds"] == 5 and 0.05 - 1e-9 <= c.loc["C3", "ci_low"] < c.loc["C3", "ci_high"] <= 0.052 + 1e-9
    assert c.loc["D1", "verdict"] == "(descriptive)" and c.loc["D1", "delta_mean"] == pytest.approx(-0.1)
    assert c.loc["C3", "n_detect"] == 2  # sd 0.0011 against a mean of 0.0508: decided at the fewest seeds
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| min. detectable Δ | seeds to detect Δ |" in md
    # the paper's relative-improvement column, on the paper's numbers and ours: (0.4508 - 0.42) / (0.42 - 0.2)
    assert "| Average (avg) | 0.200 ± 0.000 | 0.420 ± 0.016 | 0.471 ± 0.016 | +23% | 0.430 | 0.503 | 0.528 | +34% |" in md
    assert "| 0.446 | 0.508 | 0.539 | +50% |" in md  # OlympiadBench, the paper's row
    for f in ["table3.png", "fig3.png", "table3.csv", "table3_runs.csv", "claims.csv", "table3_pass16.csv"]:
        assert (tmp_path / "out" / f).is_file(), f


def test_table3_report_refuses_runs_of_other_methods(tmp_path):
    from ema_pg.workbench import table3

    fake_math_run(tmp_path / "runs", "ema_topk_reverse", 0, 0.2, 0.4, 0.6, 0.5)
    with pytest.raises(SystemExit, match="Table 3 compares grpo, ema"):
        table3.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])


def test_a_run_saved_before_sampled_evaluation_existed_evaluates_and_resumes(tmp_path):
    from ema_pg.workbench.evaluate import main as evaluate_main

    cfg = compose_cfg(["algo.iterations=2"], tmp_path)
    train(cfg)
    run = tmp_path / "run"
    old = OmegaConf.load(run / "config.yaml")
    for key in ("eval_samples", "eval_top_p", "eval_pass_k"):
        old.rollout.pop(key)
    old.pop("init_from")
    OmegaConf.save(old, run / "config.yaml")  # as a version without these knobs saved it
    evaluate_main([str(run)])
    ev = json.loads((run / "evaluations" / "policy.json").read_text())
    assert set(ev["splits"]["heldout"]) == {"em", "n", "per_problem"}  # greedy, as that run evaluated
    resumed = OmegaConf.load(run / "config.yaml")
    resumed.algo.iterations, resumed.resume = 3, str(run)
    metrics, _ = train(resumed)
    assert metrics["iteration"] == 3


def test_a_process_records_the_commit_its_code_was_loaded_from(monkeypatch):
    """A sweep's runs share one process: each records the commit read at the first run, not a HEAD that moved
    while the sweep ran (git is not asked again)."""
    import subprocess

    from ema_pg.engine.runs import git_commit

    git_commit.cache_clear()
    first = git_commit()
    assert first != "unknown" and len(first.removesuffix("-dirty")) == 40

    def moved(*a, **k):
        raise AssertionError("git asked again")

    monkeypatch.setattr(subprocess, "run", moved)
    assert git_commit() == first


def test_a_run_reads_its_commit_when_it_opens_before_any_cold_start(tmp_path):
    """git.txt once named the commit the repository had moved to by the end of a minutes-long cold start (a run
    started at 846e25f recorded 5e8c0e3); the commit is now read when the run opens, before any model is built."""
    from helpers import compose_cfg

    from ema_pg.engine.owner import release_run_dir
    from ema_pg.engine.runs import git_commit, open_run

    git_commit.cache_clear()
    opened = open_run(compose_cfg([], tmp_path))
    try:
        assert git_commit.cache_info().currsize == 1  # read by open_run itself
    finally:
        release_run_dir(opened.run_dir)
