"""task=reasoning_gym: reasoning-gym's own datasets, configs, answer extraction and score_answer; held-out splits
from seeds and questions that training never uses; weighted mixtures; bad input in one line; a mixture trains."""

from __future__ import annotations

import collections
import json

import pytest
import reasoning_gym
from helpers import compose_cfg
from reasoning_gym.utils import SYSTEM_PROMPTS

from ema_pg.config import compose
from ema_pg.engine.fit import train
from ema_pg.tasks import build_task
from ema_pg.tasks.reasoning_gym import EVAL_OFFSET, SEED_STRIDE, TRAIN_SPAN

MIX = [{"name": "chain_sum", "weight": 3, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
       {"name": "syllogism", "weight": 1, "config": {}},
       {"name": "gcd", "weight": 0, "config": {"max_value": 20}}]


def rg_task(datasets=MIX, **kw):
    return build_task({"name": "reasoning_gym", "datasets": datasets, **kw})


def test_the_reward_is_the_datasets_own_score_of_the_last_answer_tag():
    t = rg_task(eval_size=8)
    for name, split in t.eval_splits().items():
        own = reasoning_gym.create_dataset(name, **MIX[[m["name"] for m in MIX].index(name)]["config"])
        for p in split:
            entry = p.meta["entry"]
            gold = p.answer
            assert t.reward(p, f"<think>so</think>\n<answer>{gold}</answer>") == 1.0
            assert t.reward(p, f"<answer>wrong</answer> then <answer> {gold} </answer>") == 1.0  # the last, stripped
            assert t.reward(p, gold) == own.score_answer(None, entry) == 0.0  # no tag: no answer
            for wrong in ("0", "Yes", "No", f"{gold}{gold}"):  # whatever the dataset's own rule gives, partial too
                assert t.reward(p, f"<answer>{wrong}</answer>") == own.score_answer(wrong, entry)
    p = t.eval_splits()["chain_sum"][0]
    assert t.answer_key(p, "<answer> 7 </answer>") == "7" and t.answer_key(p, "7") is None


def test_held_out_splits_come_from_seeds_and_questions_that_training_never_uses():
    """products of two 1-digit numbers has 100 questions: under 64 eval questions many would also be drawn for
    training by another seed. The eval items come from the evaluation seed, training items from the training one,
    and no training draw asks an eval question."""
    t = rg_task([{"name": "products", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}],
                eval_size=40, seed=3)
    ev = t.eval_splits()["products"]
    assert len(ev) == 40 == len({p.text for p in ev})  # distinct questions
    assert t.eval_ds["products"].seed == 3 * SEED_STRIDE + EVAL_OFFSET and t.train_ds["products"].seed == 3 * SEED_STRIDE
    train = t.sample(3000, seed=0) + t.sample(3000, seed=1)
    assert all(0 <= p.meta["index"] < TRAIN_SPAN for p in train)
    assert not {p.text for p in train} & {p.text for p in ev}
    assert len({p.text for p in train}) == 100 - 40  # every other question is trained on
    # the item is reasoning-gym's own: the dataset at the seed and index recorded in the prompt
    own = reasoning_gym.create_dataset("products", min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                                       seed=3 * SEED_STRIDE)
    assert own[train[5].meta["index"]]["question"] == train[5].text


def test_a_mixture_draws_by_its_weights_and_holds_out_a_dataset_of_weight_zero():
    t = rg_task(eval_size=16)
    a, b = t.sample(400, seed=7), t.sample(400, seed=7)
    assert [p.text for p in a] == [p.text for p in b]  # a function of its seed
    counts = collections.Counter(p.meta["dataset"] for p in t.sample(4000, seed=1))
    assert set(counts) == {"chain_sum", "syllogism"}  # gcd (weight 0) never trained on
    assert abs(counts["chain_sum"] / 4000 - 0.75) < 0.03  # 3 : 1
    assert list(t.eval_splits()) == ["chain_sum", "syllogism", "gcd"]  # one split per dataset, gcd's included
    assert [p.text for p in rg_task(eval_size=16).eval_splits()["gcd"]] == [p.text for p in t.eval_splits()["gcd"]]


def test_prompts_and_the_cold_start_speak_reasoning_gyms_format():
    t = rg_task(eval_size=4, system_prompt="default")
    p = t.eval_splits()["syllogism"][0]
    assert p.messages == [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
                          {"role": "user", "content": p.text}]
    assert rg_task(eval_size=4, system_prompt="none").eval_splits()["syllogism"][0].messages is None
    for prompt, response in t.demonstrations(20, seed=0):
        assert response == f"<answer>{prompt.answer}</answer>" and t.reward(prompt, response) == 1.0
        assert prompt.text not in {q.text for s in t.eval_splits().values() for q in s}


@pytest.mark.parametrize("datasets, words", [
    ([{"name": "chain_sums"}], "reasoning-gym has no dataset 'chain_sums'; did you mean chain_sum or decimal_chain_sum?"),
    ([{"name": "gcd", "config": {"max_val": 3}}], "gcd's config.max_val: gcd takes no max_val; did you mean max_value?"),
    ([{"name": "gcd", "weight": -1}], "gcd's weight=-1; a weight is a finite number >= 0"),
    ([{"name": "gcd", "weight": 0}, {"name": "lcm", "weight": 0}], "every weight is 0 (gcd, lcm); give one a weight > 0"),
    ([{"name": "gcd"}, {"name": "gcd"}], "task.datasets names gcd twice"),
    ([{"name": "gcd", "config": {"min_value": 50, "max_value": 3}}], "reasoning-gym refuses it: max_value must be > min_value"),
    ({"gcd": {}}, "give a list of {name, weight, config}"),
])
def test_bad_mixtures_are_one_line_before_anything_is_built(datasets, words):
    with pytest.raises(ValueError) as e:
        rg_task(datasets)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_config_with_too_few_questions_for_its_eval_split_is_one_line():
    with pytest.raises(ValueError, match="gcd's config asks only 4 distinct questions in 200 draws; lower "
                                         "task.eval_size or widen its config"):
        rg_task([{"name": "gcd", "config": {"min_value": 1, "max_value": 2, "min_numbers": 2, "max_numbers": 2}}],
                eval_size=10)


def test_a_config_whose_every_question_is_held_out_is_one_line_not_an_endless_draw():
    """gcd with max_value 3 has 9 distinct questions: an evaluation split of 9 holds them all out, and the training
    draw used to loop forever looking for one that is not."""
    with pytest.raises(ValueError, match=r"task.eval_size=9 holds out every question of gcd \(1000 training draws "
                                         r"found none left to train on\); lower task.eval_size or widen its config"):
        rg_task([{"name": "gcd", "config": {"max_value": 3}}], eval_size=9)
    assert len(rg_task([{"name": "gcd", "config": {"max_value": 3}}], eval_size=8).sample(4, seed=0)) == 4


def test_a_mixture_given_on_the_command_line_replaces_the_default_one():
    cfg = compose(["task=reasoning_gym", "task.datasets=[{name: gcd, weight: 1, config: {max_value: 20}}]"])
    assert [d["name"] for d in cfg.task.datasets] == ["gcd"]


def test_a_mixture_trains_and_reports_its_held_out_score_per_dataset(tmp_path):
    cfg = compose_cfg(["task=reasoning_gym", "task.system_prompt=none", "task.eval_size=8",
                       "task.datasets=[{name: chain_sum, config: {max_terms: 2, max_digits: 1}}, {name: syllogism}]",
                       "rollout.max_new_tokens=8", "model.max_positions=256"], tmp_path)
    metrics, objs = train(cfg)
    ev = json.loads((objs["run_dir"] / "eval.json").read_text())
    assert list(ev["splits"]) == ["chain_sum", "syllogism"] and all(v["n"] == 8 for v in ev["splits"].values())
    assert ev["avg"] == pytest.approx(sum(v["score"] for v in ev["splits"].values()) / 2)
    assert "eval/avg/score" in metrics


def test_the_split_table_reads_base_from_iteration_0_and_trained_from_eval_json(finished_run):
    """analysis/split_scores.py (the docs row of a task's run): before RL is the iteration-0 evaluation in
    metrics.csv, after RL the final eval.json, split by split, and the average row is eval.json's."""
    import pandas as pd

    from analysis.split_scores import split_scores

    df = split_scores(finished_run).set_index("split")
    ev = json.loads((finished_run / "eval.json").read_text())
    m = pd.read_csv(finished_run / "metrics.csv")
    assert df.loc["heldout", "base"] == m.loc[m["step"] == 0, "eval/heldout/em"].iloc[0]
    assert df.loc["heldout", "trained"] == ev["splits"]["heldout"]["em"]
    assert df.loc["avg", "trained"] == ev["avg"] and df.loc["avg", "base"] == ev["base_avg"]
