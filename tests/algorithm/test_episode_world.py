"""task.world=episode: a world of its own for every question, so only searching and reading earns a reward."""

import os
import re
import subprocess
import sys

import pytest

from ema_pg.tasks import build_task
from ema_pg.tasks.search.task import SPLITS, format_passages, question_entity
from ema_pg.tasks.search.world import episode_question, episode_world

EPISODE = {"name": "search_qa", "world": "episode", "per_split": 12}


@pytest.fixture(scope="module")
def task():
    return build_task({**EPISODE, "multihop_demos": 0.3, "comparison_demos": 0.2})


def facts(w):
    """Every (entity, relation, value) a world states, for comparing worlds."""
    return ({(n, "city", p.city) for n, p in w.people.items()} | {(n, "year", p.year) for n, p in w.people.items()}
            | {(c, "country", k) for c, k in w.city_country.items()}
            | {(o, "founder", v.founder) for o, v in w.orgs.items()} | {(o, "hq", v.city) for o, v in w.orgs.items()})


def answer_by_hand(w, q: str) -> str:
    """The answer of a question read off the world's relations, one hop at a time."""
    country = lambda city: w.city_country[city]
    for prefix, suffix, f in [("Where was ", " born?", lambda e: w.people[e].city),
                              ("What is the birthplace of ", "?", lambda e: w.people[e].city),
                              ("Which city is ", " from?", lambda e: w.people[e].city),
                              (" was born in which city?", None, lambda e: w.people[e].city),
                              ("In which country was the founder of ", " born?",
                               lambda e: country(w.people[w.orgs[e].founder].city)),
                              ("In which country was ", " born?", lambda e: country(w.people[e].city)),
                              ("In which country is ", " headquartered?", lambda e: country(w.orgs[e].city)),
                              ("Who founded ", "?", lambda e: w.orgs[e].founder)]:
        if suffix is None and q.endswith(prefix):
            return f(q[:-len(prefix)])
        if suffix and q.startswith(prefix) and q.endswith(suffix):
            return f(q[len(prefix):-len(suffix)])
    a, b = q.removeprefix("Who was born first, ").removesuffix("?").split(" or ")
    return a if w.people[a].year < w.people[b].year else b


def test_every_question_has_a_world_of_its_own_rebuilt_from_its_name_alone(task):
    prompts = task.sample(64, seed=3) + task.sample(64, seed=4) + [p for v in task.eval_splits().values() for p in v]
    keys = [p.meta["world"] for p in prompts]
    assert len(set(keys)) == len(keys)  # no world is asked twice, in training or evaluation
    assert task.sample(64, seed=3)[5].meta == prompts[5].meta  # the stream is a function of its seed
    worlds = [task.world_of(p) for p in prompts[:40]]
    shared = [len(facts(a) & facts(b)) for i, a in enumerate(worlds) for b in worlds[i + 1:]]
    assert max(shared) <= 1  # (two worlds may draw one equal short name and year by chance; never a fact set)
    # a fresh interpreter rebuilds the same world and passages from the name (the rollout worker does)
    code = ("from ema_pg.tasks.search.world import episode_world; import hashlib; "
            f"print(hashlib.md5(repr(episode_world({keys[7]!r}, 8).docs).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    import hashlib
    assert out == hashlib.md5(repr(episode_world(keys[7], 8).docs).encode()).hexdigest()


def test_the_seven_splits_keep_their_shapes_and_answers_follow_the_worlds_relations(task):
    hops = {"nq": 1, "triviaqa": 1, "popqa": 1, "hotpotqa": 2, "2wiki": 2, "musique": 3, "bamboogle": 2}
    assert list(task.eval_splits()) == list(SPLITS)
    for split, ps in task.eval_splits().items():
        assert len(ps) == 12 and {p.meta["hops"] for p in ps} == {hops[split]} and {p.meta["split"] for p in ps} == {split}
        for p in ps:
            w = task.world_of(p)
            assert p.meta["answers"] == [answer_by_hand(w, p.meta["question"])]
            if split in ("nq", "triviaqa"):  # popular people: two passages each
                assert w.people[p.meta["entities"][0]].popular
    popqa = [p.meta["question"] for p in task.eval_splits()["popqa"]]
    assert any(q.startswith("Who founded") for q in popqa) and any(q.startswith("Where was") for q in popqa)
    for p in task.eval_splits()["popqa"]:
        if p.meta["question"].startswith("Where was"):
            assert not task.world_of(p).people[p.meta["entities"][0]].popular  # the long tail: one passage
    train = task.sample(200, seed=0)
    assert {p.meta["hops"] for p in train} == {1, 2} and 60 < sum(p.meta["hops"] == 2 for p in train) < 140
    for p in train:
        assert p.meta["answers"] == [answer_by_hand(task.world_of(p), p.meta["question"])]


def test_each_row_searches_its_own_questions_world(task):
    a, b = task.eval_splits()["nq"][:2]
    name_a = a.meta["entities"][0]
    env = task.on_stop_fn([a, b], 2)  # rows 0, 1 ask a; rows 2, 3 ask b; all four search a's person
    obs = env([0, 1, 2, 3], [f"<search> {name_a} </search>"] * 4)
    assert obs[0] == obs[1] == format_passages(task.retrieve([a], [name_a])[0])
    assert a.answer in obs[0] and f"(Title: {name_a})" in obs[0]
    assert name_a not in obs[2] and obs[2] == obs[3] == format_passages(task.retrieve([b], [name_a])[0])
    rag = task.baseline_prompts([a, b], "rag")  # the RAG baseline retrieves in each question's world too
    assert a.answer in rag[0].meta["prefix"] and b.meta["question"] in rag[1].meta["prefix"]
    assert rag[1].meta["prefix"].count("(Title: ") == task.topk and name_a not in rag[1].meta["prefix"]


def test_an_answer_from_another_world_is_wrong_and_counted_as_recalled(task):
    """What a memorizing policy would do: answer with the fact of a world it saw before."""
    p, other = task.eval_splits()["nq"][3], task.sample(1, seed=0)[0]
    seen = task.on_stop_fn([p], 1)([0], [f"<search> {p.meta['entities'][0]} </search>"])[0]
    from_memory = f"<search> {p.meta['entities'][0]} </search>{seen}<answer> {other.answer} </answer>"
    read = f"<search> {p.meta['entities'][0]} </search>{seen}<answer> {p.answer} </answer>"
    assert other.answer != p.answer
    assert task.reward(p, from_memory) == 0.0 and task.diagnostics(p, from_memory)["recalled"] == 1.0
    assert task.reward(p, read) == 1.0 and task.diagnostics(p, read)["read_em"] == 1.0


def test_demonstrations_read_in_worlds_that_neither_rl_nor_evaluation_asks(task):
    demos = task.demonstrations(300, seed=0)
    assert demos == task.demonstrations(300, seed=0)
    rl_and_eval = {p.meta["question"] for p in task.sample(2000, seed=0)} | \
        {p.meta["question"] for v in task.eval_splits().values() for p in v}
    assert not {q.removeprefix("Question: ").strip() for q, _ in demos} & rl_and_eval
    two = [r for _, r in demos if r.count("<search>") == 2]
    compare = [(q, r) for q, r in demos if "born first" in q]
    assert 0.35 < len(two) / len(demos) < 0.65 and 0.1 < len(compare) / len(demos) < 0.3  # shares 0.3 + 0.2
    for q, r in demos:  # every answer is read from the passages the demonstration was shown
        answer = r.rsplit("<answer> ", 1)[1].removesuffix(" </answer>")
        assert answer in r.rsplit("<answer>", 1)[0].split("<information>", 1)[1]
    for q, r in compare:
        a, b = q.removeprefix("Question: Who was born first, ").strip().removesuffix("?").split(" or ")
        assert f"<search> {a} </search>" in r and f"<search> {b} </search>" in r
        year = lambda who: min(int(y) for line in r.splitlines() if f"(Title: {who})" in line and ("born" in line.lower() or "native" in line)
                               for y in re.findall(r"\b(1\d{3})\b", line))
        answer = r.rsplit("<answer> ", 1)[1].removesuffix(" </answer>")
        assert answer == (a if year(a) < year(b) else b)  # the one born first, read off the passages shown


def test_the_tokenizers_corpus_draws_worlds_of_every_shape_but_none_of_rls_or_the_evals(task):
    corpus = task.corpus()
    text = "\n".join(corpus)
    assert "Who was born first" in text and "headquartered" in text and "(Title: )" in text
    for p in task.sample(20, seed=0) + task.eval_splits()["nq"]:
        assert p.meta["question"] not in text


def test_episode_question_names_its_shapes():
    w = episode_world("k", 8)
    assert episode_question(w, "k", "bridge").hops == 2 and episode_question(w, "k", "birthplace").hops == 1
    assert question_entity(episode_question(w, "k", "birthplace").question) in w.people
    with pytest.raises(ValueError, match="no question shape"):
        episode_question(w, "k", "trivia")


@pytest.mark.parametrize("over, match", [
    ({"world": "episodes"}, "task.world='episodes'; choose one of fixed, episode"),
    ({"retriever": "http", "retriever_url": "http://127.0.0.1:1/retrieve"}, "use task.retriever=bm25"),
    ({"demo_people": 0.5}, "set task.demo_people=0"),
    ({"episode_people": 3}, "at least 4 people"),
])
def test_episode_world_refuses_what_it_cannot_do_with_one_line(over, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(".", r"\.")) as e:
        build_task({**EPISODE, **over})
    assert "\n" not in str(e.value)


FIXED_WORLD = """
import hashlib
from ema_pg.tasks import build_task
t = build_task({"name": "search_qa", "n_people": 60, "n_orgs": 12, "per_split": 5, "multihop_demos": 0.2,
                "comparison_demos": 0.2, "demo_people": 0.5})
rows = repr([(p.text, p.meta) for p in t.train_set + [p for v in t.eval_splits().values() for p in v]]
            + t.demonstrations(40, seed=1))
print(hashlib.md5(rows.encode()).hexdigest())
"""
#: numpy's CPU dispatch turned off down to a kernel level (``NPY_DISABLE_CPU_FEATURES``); each setting is one that
#: some machine runs: AVX-512 (none off), AVX2 (an AMD EPYC of CI's kind), SSE only
NUMPY_KERNELS = {"native": "", "avx2": "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR",
                 "sse": "AVX2 FMA3 AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"}


def test_the_fixed_world_is_the_same_under_every_cpu_kernel():
    """task.world=fixed draws the same questions and demonstrations on every CPU: a fresh interpreter under each of
    numpy's kernel levels (and torch's and MKL's AVX2 setting) computes the same digest, the pinned one. Before BM25
    ranked ties by document (retriever.rank), numpy's AVX-512 and AVX2 top-k ordered tied passages differently and
    the demonstrations differed between an Intel Xeon and an AMD EPYC (md5 bf522a3a... against 00dc54a7...)."""
    out = {}
    for kernel, off in NUMPY_KERNELS.items():
        env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": off, "ATEN_CPU_CAPABILITY": "avx2" if off else "default",
               "MKL_ENABLE_INSTRUCTIONS": "AVX2" if off else os.environ.get("MKL_ENABLE_INSTRUCTIONS", "")}
        run = subprocess.run([sys.executable, "-W", "ignore", "-c", FIXED_WORLD], capture_output=True, text=True,
                             env={k: v for k, v in env.items() if v}, check=True)
        out[kernel] = run.stdout.split()[-1]
    assert out == dict.fromkeys(NUMPY_KERNELS, FIXED_WORLD_MD5)


#: the fixed world since BM25 ranks ties by document (the first digest that every CPU computes; the world before,
#: bf522a3a... on AVX-512, had the same questions and differed in the order of tied passages)
FIXED_WORLD_MD5 = "b7f2bb01d20e041eea89357dd2d5479a"


@pytest.mark.slow
def test_a_run_in_episode_worlds_trains_with_a_rollout_worker_that_rebuilds_each_world_from_its_name(tmp_path):
    """End to end: cold start on demonstrations from their own worlds, RL with the sampler in another process
    (rollout.max_staleness=1: the worker rebuilds every question's world and corpus from meta["world"]), and the
    seven-split evaluation; the run's training prompts were answered in their own worlds (searches found them)."""
    import json

    from helpers import compose_cfg

    from ema_pg.train import train

    cfg = compose_cfg(["task=search_qa", "experiment=search_reading", "task.per_split=3", "rollout.max_new_tokens=24",
                       "model.hidden_size=64", "model.num_layers=2",
                       "model.tokenizer_vocab=400", "sft.steps=150", "sft.stop_at_reward=0", "sft.batch_size=16", "sft.num_demos=400", "algo.iterations=2",
                       "algo.eval_every=2", "algo.prompts_per_step=2", "algo.group_size=2", "algo.minibatch_size=4",
                       "rollout.max_staleness=1", "trainer.progress_bar=false"], tmp_path, tiny=False)
    metrics, objs = train(cfg)
    ev = json.loads((objs["run_dir"] / "eval.json").read_text())
    assert list(ev["splits"]) == list(SPLITS) and all(v["n"] == 3 for v in ev["splits"].values())
    assert ev["avg_diagnostics"]["searches"] > 0  # the cold start searches: the worlds' corpora were used


def test_reading_probe_feeds_each_demonstration_up_to_its_answer(task):
    """analysis/reading_probe.py: the context is a demonstration up to its (last) <answer> tag, the target is the
    answer after it (which the passages in the context hold); a whole answer right needs its first token right
    (em <= top1 <= top5)."""
    from analysis.reading_probe import answer_cut, probe
    from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
    from ema_pg.prompts import PromptEncoder

    demos = task.demonstrations(40, 3)
    for prompt, resp in demos:
        ctx, answer = answer_cut(resp)
        assert resp == f"{ctx}{answer}</answer>" and ctx.endswith("<answer>") and "<answer>" not in ctx[:-8]
        assert answer == " " + resp.rsplit("<answer> ", 1)[1].removesuffix(" </answer>") + " "
        assert answer.strip() in ctx.split("<information>", 1)[1]
    tok = train_bpe_tokenizer(task.corpus()[:300], vocab_size=300)
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=0,
                             tokenizer=tok)
    out = probe(model.eval(), tok, PromptEncoder(tok, "off"), demos)
    assert out["all"]["n"] == 40 == sum(v["n"] for k, v in out.items() if k != "all")
    assert set(out) - {"all"} <= {"1", "2"}
    for v in out.values():
        assert 0 <= v["em"] <= v["top1"] <= v["top5"] <= 1


# ---------------------------------------------------------------------- where a recalled answer comes from
def test_a_recalled_answer_is_traced_to_its_own_world_a_trained_world_or_none(task):
    """``ema_pg.workbench.studies.recall``: an answer no passage held is a name of the question's own world (unread), of
    a world the policy trained on (memory), or of none (invented); a read answer is not recalled at all."""
    from omegaconf import OmegaConf

    from ema_pg.workbench.studies.recall import answer_source, control_world_keys, names_of, trained_world_keys, world_names

    p = task.eval_splits()["nq"][3]
    w = task.world_of(p)
    cfg = OmegaConf.create({"seed": 5, "sft": {"steps": 10, "num_demos": 20, "seed": 0},
                            "algo": {"iterations": 3, "prompts_per_step": 4, "dynamic_sampling": False}})
    keys = trained_world_keys(cfg, task)
    rl = [q.meta["world"] for it in range(4) for q in task.sample(4, 5 * 1_000_003 + it)]
    assert keys[-16:] == rl and len(keys) >= 16 + 20  # RL's worlds, after every world the demonstrations drew
    assert keys[:-16] == [f"{task.seed}:demo:0:{t}" for t in range(1, len(keys) - 15)]
    cfg.algo.dynamic_sampling = True  # extra prompt rounds are not rebuilt: refused, not undercounted
    with pytest.raises(ValueError, match="dynamic_sampling"):
        trained_world_keys(cfg, task)
    trained = names_of(task, keys)
    demo_answers = {re.search(r"<answer> (.*?) </answer>", d).group(1) for _, d in task.demonstrations(20, seed=0)}
    assert {a.lower() for a in demo_answers} <= trained  # the demonstrations' worlds are among the trained ones
    control = names_of(task, control_world_keys(task, len(keys)))
    entity = p.meta["entities"][0]
    seen = task.on_stop_fn([p], 1)([0], [f"<search> {entity} </search>"])[0]
    unshown = next(c for c in w.city_country if c != p.answer and c not in seen)  # own world, not in the passages
    memory = next(n for n in sorted(trained - world_names(w) - control) if " " not in n)
    say = lambda a: f"<search> {entity} </search>{seen}<answer> {a} </answer>"
    assert answer_source(task, p, say(p.answer), trained, control)["recalled"] == 0.0  # read: not recalled
    own = answer_source(task, p, say(unshown), trained, control)
    assert own["recalled"] == own["own_world"] == 1.0 and own["trained"] == own["invented"] == 0.0
    mem = answer_source(task, p, say(memory.capitalize()), trained, control)
    assert mem["trained"] == 1.0 and mem["invented"] == mem["own_world"] == mem["control"] == 0.0
    made_up = answer_source(task, p, say("Qqzx Vvb"), trained, control)
    assert made_up["invented"] == made_up["recalled"] == 1.0 and made_up["trained"] == 0.0


def test_the_recall_summary_gives_memory_as_trained_minus_control_per_method_over_seeds():
    from ema_pg.workbench.studies.recall import summarize

    row = lambda seed, which, trained, control, split="avg": {
        "method": "grpo", "seed": seed, "which": which, "split": split, "recalled": 0.5, "own_world": 0.0,
        "trained": trained, "control": control, "invented": 0.5 - trained}
    rows = [row(11, "initial", 0.30, 0.30), row(11, "policy", 0.30, 0.20), row(12, "policy", 0.25, 0.25),
            row(12, "policy", 0.9, 0.0, split="nq"), row(11, "policy", 0.30, 0.20)]  # (a split row, a duplicate)
    lines = summarize(rows).splitlines()
    grpo = next(x for x in lines if x.startswith("| grpo |"))
    assert grpo == "| grpo | 2 | 0.500 | 0.000 | 0.275 | 0.225 | 0.225 | +0.050 [+0.000, +0.100] |"  # (0.10 + 0.00) / 2
    assert next(x for x in lines if x.startswith("| before RL |")).endswith("+0.000 (one seed) |")
