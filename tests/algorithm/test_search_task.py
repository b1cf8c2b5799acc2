"""The search-agent world, retrievers, Search-R1 environment, SFT masks and the parquet path."""

import numpy as np
import pytest

from ema_pg.tasks import build_task
from ema_pg.tasks.search import exact_match, normalize_answer
from ema_pg.tasks.search.retriever import HTTPRetriever, RetrieverError, serve
from ema_pg.tasks.search.task import DIAGNOSTICS, INVALID, SPLITS, question_entity
from ema_pg.tasks.search.world import build_world, questions


@pytest.fixture(scope="module")
def task():
    return build_task({"name": "search_qa", "seed": 0, "n_people": 200, "n_orgs": 60, "per_split": 30})


def test_world_is_deterministic_and_answers_are_in_the_corpus():
    a, b = build_world(3, n_people=50, n_orgs=10), build_world(3, n_people=50, n_orgs=10)
    assert a.docs == b.docs and build_world(4, n_people=50, n_orgs=10).docs != a.docs
    qs = questions(a, 3, per_split=10)
    text = " ".join(t for _, t in a.docs)
    for q in qs["nq"] + qs["hotpotqa"] + qs["musique"]:
        assert q.answers[0] in text


def test_seven_splits_and_no_leak_from_training(task):
    assert list(task.eval_splits()) == list(SPLITS)
    train_q = " ".join(p.meta["question"] for p in task.train_set)
    for p in task.eval_splits()["bamboogle"]:  # held-out organizations never appear in training questions
        org = p.meta["question"].removeprefix("In which country is ").removesuffix(" headquartered?")
        assert org not in train_q
    nq_people = {p.meta["question"][len("Where was "):-len(" born?")] for p in task.eval_splits()["nq"]}
    assert not any(f"was {n} born" in train_q for n in nq_people)
    hops = {s: {p.meta["hops"] for p in v} for s, v in task.eval_splits().items()}
    assert hops["nq"] == {1} and hops["hotpotqa"] == {2} and hops["musique"] == {3}
    assert {p.meta["hops"] for p in task.train_set} == {1, 2}


def test_bm25_finds_the_entity_and_http_server_agrees(task):
    p = task.eval_splits()["nq"][0]
    name = p.meta["question"][len("Where was "):-len(" born?")]
    docs = task.retriever.retrieve([name], 3)[0]
    assert len(docs) == 3 and any(d["contents"].startswith(name + "\n") for d in docs)
    srv, url = serve(task.retriever)
    try:
        assert url.endswith("/retrieve")
        for given in (url, url.removesuffix("/retrieve"), url + "/"):  # as users write it, or the bare base URL
            remote = HTTPRetriever(given).retrieve([name, "no such thing"], 3)
            assert [d["contents"] for d in remote[0]] == [d["contents"] for d in docs] and len(remote) == 2
    finally:
        srv.shutdown()
    with pytest.raises(RetrieverError, match=r"^retrieval server http://127.0.0.1:9/retrieve did not answer"):
        HTTPRetriever("http://127.0.0.1:9", timeout=2, retries=0).retrieve(["x"])


def test_squad_normalization_and_em():
    assert normalize_answer("  The Karsville. ") == "karsville"
    assert exact_match("the  karsville!", ["Karsville"]) == 1.0 and exact_match("Kars", ["Karsville"]) == 0.0


def test_environment_turns(task):
    """Search-R1's environment: a turn's first <search>/<answer> is its action, one batched retrieval per turn,
    the observation block byte for byte as its generation loop writes it, its invalid-action message."""
    p = task.eval_splits()["nq"][0]
    name = p.meta["question"][len("Where was "):-len(" born?")]
    env = task.on_stop_fn([p], 1)
    obs, = env([0], [f"<search> {name} </search>"])
    docs = task.retriever.retrieve([name], task.topk)[0]
    lines = "".join(f"Doc {i}(Title: {d['contents'].split(chr(10))[0]}) {chr(10).join(d['contents'].split(chr(10))[1:])}\n"
                    for i, d in enumerate(docs, 1))
    assert obs == f"\n\n<information>{lines.strip()}</information>\n\n" and "Doc 3(" in obs
    assert env([0], ["I think </search>"]) == [INVALID]  # closes a search it never opened
    assert INVALID.startswith("\nMy previous action is invalid. If I want to search, I should put the query between")
    assert env([0], ["<answer> x </answer>"]) == [None]  # an answer ends the episode
    env2 = build_task({"name": "search_qa", "seed": 0, "n_people": 50, "n_orgs": 10, "max_turns": 1, "per_split": 5}).on_stop_fn([p], 1)
    assert env2([0], ["<search> a </search>"])[0].startswith("\n\n<information>") and env2([0], ["<search> b </search>"]) == [None]

    class Counting:  # the environment asks the retriever once per turn, for every row that searched
        def __init__(self, inner):
            self.inner, self.calls = inner, []

        def retrieve(self, queries, topk):
            self.calls.append(list(queries))
            return self.inner.retrieve(queries, topk)

    t = build_task({"name": "search_qa", "seed": 0, "n_people": 50, "n_orgs": 10, "per_split": 5})
    t.retriever = Counting(t.retriever)
    out = t.on_stop_fn([p] * 4, 1)([0, 1, 2, 3], ["<search> a </search>", "<answer> b </answer>", "no action </search>",
                                                  "<search>  c d </search>"])
    assert t.retriever.calls == [["a", "c d"]]
    assert out[0].startswith("\n\n<information>") and out[1] is None and out[2] == INVALID and out[3].startswith("\n\n<inf")


def test_reward_is_last_answer_em_and_never_raises(task):
    p = task.eval_splits()["nq"][0]
    assert task.reward(p, f"<answer> wrong </answer> then <answer> {p.answer} </answer>") == 1.0
    for junk in ["", "<answer>", "</answer><answer>", "\x00\xff", "<search> x </search>", p.answer]:
        assert task.reward(p, junk) == 0.0  # malformed: no complete <answer> tag


def test_sft_masks_the_observations_unless_env_loss(task):
    """The cold start trains on the policy's text only; sft.env_loss=true adds the search results' text (every
    response token then has a label), never the prompt."""
    from omegaconf import OmegaConf

    from ema_pg.engine.models import train_bpe_tokenizer
    from ema_pg.engine.sft import _sft_batch, loss_mask_fn

    tok = train_bpe_tokenizer(task.corpus(), vocab_size=600)
    tok.padding_side = "right"
    (prompt, resp), = task.demonstrations(1, 0)
    assert "<information>" in resp and resp.endswith("</answer>")
    for env_loss in (False, True):
        mask = loss_mask_fn(task, OmegaConf.create({"env_loss": env_loss}))
        full, labels = _sft_batch(tok, [(prompt, resp)], None, mask)
        ids, lab = full["input_ids"][0], labels[0]
        trained = tok.decode(ids[lab != -100])
        assert "<search>" in trained and "<answer>" in trained and "Question" not in trained
        assert "Doc 1" in tok.decode(ids) and ("Doc 1" in trained) == env_loss
        n_resp = len(tok(resp, add_special_tokens=False)["input_ids"]) + 1  # + EOS
        assert (int((lab != -100).sum()) == n_resp) == env_loss


def test_observations_from_the_environment_have_loss_mask_zero():
    """Real sampler + search environment: every observation token is attended to with loss mask 0."""

    from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
    from ema_pg.rollout import HFSampler

    t = build_task({"name": "search_qa", "seed": 0, "n_people": 40, "n_orgs": 10, "per_split": 4, "max_turns": 2})
    tok = train_bpe_tokenizer(t.corpus(), vocab_size=400)
    m = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         tokenizer=tok).eval()
    ps = t.eval_splits()["nq"][:2]
    # stop "" fires after every token; a token that is not a search is answered with INVALID,
    # twice (max_turns = 2), then the row ends
    ro = HFSampler(tok).generate(m, [p.text for p in ps], 2, temperature=1.0, max_new_tokens=10, stop=[""],
                                 on_stop=t.on_stop_fn(ps, 2), seed=0)
    inv = tok(INVALID, add_special_tokens=False)["input_ids"]
    for r in range(len(ro)):
        am, lm = ro.attention_mask[r, ro.prompt_len:], ro.loss_mask[r, ro.prompt_len:]
        resp = ro.input_ids[r, ro.prompt_len:]
        obs = (am == 1) & (lm == 0)
        assert resp[obs].tolist() == inv * 2 and int(lm.sum()) == 3
        assert t.reward(ps[r // 2], ro.responses[r]) == 0.0


@pytest.mark.slow
def test_search_task_trains_end_to_end(tmp_path):
    import json

    from helpers import compose_cfg

    from ema_pg.train import train

    cfg = compose_cfg(["task=search_qa", "task.n_people=40", "task.n_orgs=10", "task.per_split=3",
                       "rollout.max_new_tokens=12", "rollout.stop=[\"</search>\",\"</answer>\"]", "algo.iterations=1",
                       "algo.eval_every=1", "model.tokenizer_vocab=400"], tmp_path)
    metrics, objs = train(cfg)
    ev = json.loads((objs["run_dir"] / "eval.json").read_text())
    assert list(ev["splits"]) == list(SPLITS) and all(v["n"] >= 1 for v in ev["splits"].values())


def test_sampled_evaluation_runs_the_environment_for_every_sample(task):
    """rollout.eval_samples > 1 on a multi-turn task: N responses per question, each with its own searches."""
    from omegaconf import OmegaConf

    from ema_pg.engine.evaluation import evaluate_policy
    from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
    from ema_pg.rollout import HFSampler

    tok = train_bpe_tokenizer(task.corpus()[:400], vocab_size=400)
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=0,
                             tokenizer=tok)
    ro = OmegaConf.create({"eval_samples": 3, "eval_temperature": 1.0, "eval_top_p": 1.0, "eval_pass_k": [],
                           "max_new_tokens": 10, "stop": ["</search>", "</answer>"]})
    splits = {s: task.eval_splits()[s][:2] for s in ("nq", "hotpotqa")}
    res = evaluate_policy(model.eval(), HFSampler(tok), task, ro, splits=splits, progress=False)
    for s in res["splits"].values():
        assert s["n"] == 2 and s["samples"] == 3 and set(s) >= {"em", "mean@3", "pass@1", "pass@2", "pass@3", "maj@3"}
        assert 0 <= s["pass@1"] <= s["pass@3"] <= 1
    p = splits["nq"][0]
    assert task.answer_key(p, "<answer> The  Paris! </answer>") == normalize_answer("Paris") == "paris"
    assert task.answer_key(p, "no answer tag") is None


def test_multihop_demonstrations_search_twice_and_reach_the_answer_through_the_passages():
    t = build_task({"name": "search_qa", "seed": 0, "n_people": 200, "n_orgs": 60, "per_split": 10, "multihop_demos": 0.3})
    demos = t.demonstrations(400, seed=1)
    two = [(p, r) for p, r in demos if r.count("<search>") == 2]
    assert 0.2 < len(two) / len(demos) < 0.4  # the share asked for
    assert all(r.count("<search>") == 1 for p, r in demos if (p, r) not in two)
    for prompt, response in two[:20]:
        person = prompt.removeprefix("Question: In which country was ").removesuffix(" born?\n")
        city = t.world.people[person].city
        first, second = response.split("</information>")[:2]
        assert first.startswith(f"<search> {person} </search>") and city in first  # the first passages name the city
        assert second.lstrip("\n").startswith(f"<search> {city} </search>")
        country = response.rsplit("<answer> ", 1)[1].removesuffix(" </answer>")
        assert country == t.world.city_country[city] and country in second  # read from the second passages
    single = build_task({"name": "search_qa", "seed": 0, "n_people": 200, "n_orgs": 60, "per_split": 10})
    one = single.demonstrations(200, seed=1)
    assert all(r.count("<search>") == 1 for _, r in one)
    for _, r in one:  # every answer is read from the passages shown (the world has distractors that share names)
        answer = r.rsplit("<answer> ", 1)[1].removesuffix(" </answer>")
        assert answer in r.split("</information>")[0]
    with pytest.raises(ValueError, match="multihop_demos"):
        build_task({"name": "search_qa", "seed": 0, "n_people": 50, "n_orgs": 10, "multihop_demos": 1.5})
    with pytest.raises(ValueError, match="max_turns"):
        build_task({"name": "search_qa", "seed": 0, "n_people": 50, "n_orgs": 10, "multihop_demos": 0.1, "max_turns": 1})


def test_comparison_demonstrations_read_both_birth_years_and_name_the_earlier_on_demo_people_only():
    kw = {"name": "search_qa", "seed": 0, "n_people": 300, "n_orgs": 60, "per_split": 20, "demo_people": 0.5}
    t = build_task({**kw, "multihop_demos": 0.2, "comparison_demos": 0.3})
    demos = t.demonstrations(400, seed=2)
    comp = [(p, r) for p, r in demos if "born first" in p]
    assert 0.15 < len(comp) / len(demos) < 0.35  # the share asked for (less the pairs whose passages miss a record)
    assert 0.1 < sum("In which country" in p for p, _ in demos) / len(demos) < 0.3  # bridges keep their share
    P = t.world.people
    demo_people = {question_entity(p.meta["question"]) for p in t.demo_set}
    names = lambda q: q.removeprefix("Who was born first, ").removesuffix("?").split(" or ") if "born first" in q \
        else [question_entity(q)]
    elsewhere = {question_entity(p.meta["question"]) for p in t.train_set} | {
        n for ps in t.eval_splits().values() for p in ps for n in names(p.meta["question"])}
    assert len(elsewhere) > 200  # RL's people and the eval splits' people and organizations
    for prompt, response in comp:
        a, b = prompt.removeprefix("Question: Who was born first, ").removesuffix("?\n").split(" or ")
        assert {a, b} <= demo_people and not {a, b} & elsewhere  # never an RL or eval person
        first, second = response.split("</information>")[:2]
        assert first.startswith(f"<search> {a} </search>") and second.lstrip("\n").startswith(f"<search> {b} </search>")
        assert str(P[a].year) in first and str(P[b].year) in second  # both years were read
        answer = response.rsplit("<answer> ", 1)[1].removesuffix(" </answer>")
        assert answer == (a if P[a].year < P[b].year else b)  # the one born first
    two_wiki = t.eval_splits()["2wiki"][0]  # the demonstrations ask the eval split's question, in its wording
    assert two_wiki.text.startswith("Question: Who was born first, ") and two_wiki.meta["hops"] == 2
    with pytest.raises(ValueError, match="comparison_demos"):
        build_task({**kw, "multihop_demos": 0.8, "comparison_demos": 0.3})
    with pytest.raises(ValueError, match="max_turns"):
        build_task({**kw, "comparison_demos": 0.1, "max_turns": 1})


def test_diagnostics_tell_reading_from_recall(task):
    p = task.eval_splits()["nq"][0]
    name, gold = p.meta["question"][len("Where was "):-len(" born?")], p.answer
    env = task.on_stop_fn([p], 1)
    obs, = env([0], [f"<search> {name} </search>"])
    assert gold in obs
    other = next(c for c in task.world.city_country if c not in obs)  # a real city the passages do not name
    wrong_read = next(c for c in task.world.city_country if c in obs and c != gold)  # named there, but not the answer
    read = task.diagnostics(p, f"<search> {name} </search>{obs}<answer> {gold} </answer>")
    assert read == {"searches": 1.0, "gold_seen": 1.0, "grounded": 1.0, "recalled": 0.0, "read_em": 1.0,
                    "queries_copied": 1.0}
    assert set(read) == set(DIAGNOSTICS)  # every measure is named (and explained) in DIAGNOSTICS
    misread = task.diagnostics(p, f"<search> {name} </search>{obs}<answer> {wrong_read} </answer>")
    assert misread == {"searches": 1.0, "gold_seen": 1.0, "grounded": 1.0, "recalled": 0.0, "read_em": 0.0,
                       "queries_copied": 1.0}
    recalled = task.diagnostics(p, f"<search> {name} </search>{obs}<answer> {other} </answer>")
    assert recalled["recalled"] == 1.0 and recalled["grounded"] == 0.0 and recalled["read_em"] == 0.0
    blind = task.diagnostics(p, f"<answer> {gold} </answer>")  # right, but nothing was read: not reading
    assert blind == {"searches": 0.0, "gold_seen": 0.0, "grounded": 0.0, "recalled": 1.0}
    assert task.diagnostics(p, "no answer at all")["recalled"] == 0.0


def test_queries_copied_counts_names_taken_whole_from_the_question_or_earlier_passages():
    from ema_pg.tasks.search.task import INVALID, queries_copied

    q = "Who was born first, Mipol Sanod or Lozan Lekostfen?"
    obs = "\n\n<information>Doc 1(Title: Mipol Sanod) Mipol Sanod was born in Rentorur in 1925.</information>\n\n"
    assert queries_copied(q, "<search> Mipol Sanod </search>" + obs + "<search> Lozan Lekostfen </search>") == 1.0
    assert queries_copied(q, "<search> Mipol Samor </search>" + obs + "<search> Lour Morfen </search>") == 0.0  # garbled
    assert queries_copied(q, "<search> mipol sanod. </search>") == 1.0  # normalized as answers are
    assert queries_copied(q, "<search> Rentorur </search>" + obs) == 0.0  # the passage came after the query
    assert queries_copied(q, "<search> Mipol Sanod </search>" + obs + "<search> Rentorur </search>") == 1.0
    assert queries_copied(q, "<search> Sanod or Lozan </search>") == 1.0  # verbatim, though not a name
    assert queries_copied(q, "<search> Mipol San </search>") == 0.0  # a word cut short is not a copy
    assert queries_copied(q, "<search>  </search>" + INVALID + "<answer> x </answer>") is None  # no query


def test_evaluation_averages_the_tasks_diagnostics_per_split_and_logs_them_apart(task):
    from omegaconf import OmegaConf

    from ema_pg.engine.evaluation import diagnostic_means, eval_metrics, evaluate_policy
    from ema_pg.workbench.evaluate import format_table
    from ema_pg.tasks.base import Prompt

    assert diagnostic_means([{"a": 1.0, "c": 1.0}, {"a": 0.0}, {"a": 0.5}]) == {"a": 0.5, "a_n": 3.0, "c": 1.0, "c_n": 1.0}

    class Scripted:  # answers every question from its first passage set: the policy is not what is tested
        def generate(self, model, prompts, n, *, on_stop=None, **kw):
            from types import SimpleNamespace
            texts = []
            for r, text in enumerate(prompts):
                q = text.removeprefix("Question: ").strip()
                name = q[len("Where was "):-len(" born?")] if q.startswith("Where was ") else q
                obs, = on_stop([r], [f"<search> {name} </search>"])
                gold = next(p.answer for p in splits["nq"] if p.text == text) if q.startswith("Where was ") else "x"
                texts.append(f"<search> {name} </search>{obs}<answer> {gold} </answer>")
            return SimpleNamespace(prompt_index=list(range(len(prompts))), responses=texts)

    splits = {"nq": task.eval_splits()["nq"][:6], "hotpotqa": task.eval_splits()["hotpotqa"][:4]}
    ro = OmegaConf.create({"eval_samples": 1, "eval_temperature": 0.0, "eval_top_p": 1.0, "eval_pass_k": [],
                           "max_new_tokens": 8, "stop": []})
    res = evaluate_policy(None, Scripted(), task, ro, splits=splits, progress=False, batch_size=4)
    nq, hp = res["splits"]["nq"]["diagnostics"], res["splits"]["hotpotqa"]["diagnostics"]
    assert res["splits"]["nq"]["em"] == 1.0 and nq["read_em"] == 1.0 and nq["read_em_n"] == 6.0 and nq["grounded"] == 1.0
    assert res["splits"]["hotpotqa"]["em"] == 0.0 and hp["recalled"] == 1.0 and hp["searches"] == 1.0
    assert res["avg_diagnostics"]["searches"] == 1.0 and res["avg_diagnostics"]["recalled"] == 0.5
    m = eval_metrics("eval", res)
    assert m["eval_diag/nq/grounded"] == 1.0 and m["eval_diag/avg/recalled"] == 0.5 and "eval_diag/nq/read_em_n" not in m
    assert not any(k.startswith("eval/") and "grounded" in k for k in m)  # scores and diagnostics kept apart
    assert "(grounded)" in format_table(res) and [p for p in Prompt.__dataclass_fields__] == ["text", "answer", "meta", "messages"]


def test_demo_people_are_disjoint_from_rl_prompts_and_the_eval_splits_stay_put():
    kw = {"name": "search_qa", "seed": 0, "n_people": 300, "n_orgs": 60, "per_split": 20}
    plain, split = build_task(kw), build_task({**kw, "demo_people": 0.5, "multihop_demos": 0.2})
    person = lambda p: p.meta["question"].removeprefix("Where was ").removeprefix("In which country was ").removesuffix(" born?")
    rl, demo = {person(p) for p in split.train_set}, {person(p) for p in split.demo_set}
    assert rl and demo and not rl & demo  # an RL reward cannot come from a fact the cold start taught
    assert rl | demo == {person(p) for p in plain.train_set} and 0.4 < len(demo) / len(rl | demo) < 0.6
    assert {k: [p.text for p in v] for k, v in split.eval_splits().items()} == \
           {k: [p.text for p in v] for k, v in plain.eval_splits().items()}  # the same eval questions
    prompts = {p for p, _ in split.demonstrations(300, seed=0)}
    assert prompts <= {p.text for p in split.demo_set} and not prompts & {p.text for p in split.train_set}
    assert any("In which country" in p for p in prompts)  # bridges come from the demo people too
    assert {p.text for p in split.sample(200, seed=3)} <= {p.text for p in split.train_set}
    assert plain.demo_set == plain.train_set
    with pytest.raises(ValueError, match="demo_people"):
        build_task({**kw, "demo_people": 1.0})


def test_mean_results_averages_worlds_split_by_split_by_hand():
    from ema_pg.workbench.evaluate import mean_results

    a = {"splits": {"nq": {"em": 0.5, "n": 4, "diagnostics": {"gold_seen": 1.0, "read_em": None}}}, "avg": 0.5,
         "metric": "em", "avg_scores": {"em": 0.5}, "avg_diagnostics": {"gold_seen": 1.0}}
    b = {"splits": {"nq": {"em": 0.0, "n": 4, "diagnostics": {"gold_seen": 0.5, "read_em": 0.25}}}, "avg": 0.0,
         "metric": "em", "avg_scores": {"em": 0.0}, "avg_diagnostics": {"gold_seen": 0.5}}
    m = mean_results([a, b])
    assert m["splits"]["nq"]["em"] == 0.25 and m["splits"]["nq"]["n"] == 8 and m["avg"] == 0.25
    assert m["splits"]["nq"]["diagnostics"] == {"gold_seen": 0.75, "read_em": 0.25}  # None: not defined there
    assert m["per_world"] == [0.5, 0.0] and m["avg_diagnostics"] == {"gold_seen": 0.75}


def test_evaluate_transfer_builds_the_transfer_worlds_and_refuses_a_task_without_one(tmp_path, capsys):
    """--transfer N: the policy also on N worlds rebuilt from the fixed transfer seeds (new names and facts), printed
    apart from the run's own world; a task with no generated world is refused with one line."""
    import json

    from ema_pg.workbench.evaluate import main, transfer_seeds
    from ema_pg.engine.models import build_tiny_model, save_model_dir, train_bpe_tokenizer

    own = build_task({"name": "search_qa", "seed": 0, "n_people": 40, "n_orgs": 10, "per_split": 3})
    tok = train_bpe_tokenizer(own.corpus()[:400], vocab_size=400)
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=0,
                             tokenizer=tok)
    folder = save_model_dir(model, tok, tmp_path / "model")
    main([str(folder), *TRANSFER_OVER, "--transfer", "2", "--out", str(tmp_path / "ev.json")])
    out = json.loads((tmp_path / "ev.json").read_text())
    assert out["transfer"]["seeds"] == transfer_seeds(2) and len(out["transfer"]["per_world"]) == 2
    assert set(out["transfer"]["splits"]) == set(out["splits"])
    for seed in transfer_seeds(2):  # other names: none of the own world's questions is asked there
        other = build_task({"name": "search_qa", "seed": seed, "n_people": 40, "n_orgs": 10, "per_split": 3})
        assert not {p.text for p in other.eval_splits()["nq"]} & {p.text for p in own.eval_splits()["nq"]}
    assert "worlds it never saw (task seeds 1000000..1000001, mean over 2" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="task=toy_add has none"):
        main([str(folder), "task=toy_add", "--transfer", "1"])


TRANSFER_OVER = ["task=search_qa", "task.n_people=40", "task.n_orgs=10", "task.per_split=3", "rollout.max_new_tokens=24",
                 'rollout.stop=["</search>","</answer>"]', "model.tokenizer_vocab=400"]


@pytest.mark.slow
def test_evaluate_transfer_numbers_are_each_worlds_own_evaluation_averaged(tmp_path):
    """A cold-start policy that searches: --transfer's per-world averages and per-split diagnostics are those of
    evaluating each transfer world directly, and its average is their mean."""
    import json

    from omegaconf import OmegaConf

    from ema_pg.config import compose
    from ema_pg.engine.evaluation import evaluate_policy
    from ema_pg.workbench.evaluate import main, transfer_seeds
    from ema_pg.engine.policy import build_policy
    from ema_pg.prompts import PromptEncoder
    from ema_pg.rollout import build_sampler

    # a 64-wide, 2-layer policy searches after 150 steps of 32 (0.86 of its answers) as the default 128 x 4 one
    # does, its cold start in a quarter of the time (18.7 s against 68 s for the command alone)
    over = [*TRANSFER_OVER, "sft.steps=150", "sft.batch_size=32", "model.hidden_size=64", "model.num_layers=2",
            f"sft.cache_dir={tmp_path / 'cache'}"]
    main(["base", *over, "--transfer", "2", "--out", str(tmp_path / "ev.json")])
    out = json.loads((tmp_path / "ev.json").read_text())["transfer"]
    cfg = compose(over)
    model, tok = build_policy(cfg, build_task(cfg.task))  # the same cold start, from its cache
    direct = []
    for seed in transfer_seeds(2):
        other = build_task({**OmegaConf.to_container(cfg.task), "seed": seed})
        direct.append(evaluate_policy(model.eval(), build_sampler(cfg.rollout, tok), other, cfg.rollout, progress=False,
                                      encode=PromptEncoder(tok, cfg.task.chat_template)))
    assert out["per_world"] == [d["avg"] for d in direct]
    assert out["avg_diagnostics"]["searches"] > 0  # it searches: the numbers compared are not all 0
    for split in direct[0]["splits"]:
        for key in ("searches", "recalled"):
            assert out["splits"][split]["diagnostics"][key] == pytest.approx(
                sum(d["splits"][split]["diagnostics"][key] for d in direct) / 2), (split, key)


def test_a_run_never_imports_jax(tmp_path):
    """Where JAX is installed, importing bm25s warmed JAX up, and JAX's GPU backend took 75% of the GPU for itself:
    on an H200 every recipe at 0.5-3B ran out of memory beside it (issue 41). A stand-in ``jax`` package records an
    import; a run's modules and a BM25 search must leave no record, and the search still answers (numpy top-k)."""
    import subprocess
    import sys
    from pathlib import Path

    marker = tmp_path / "jax_imported"
    fake = tmp_path / "site" / "jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('jax\\n')\n"
                                      "raise ImportError('the stand-in jax of the test')\n")
    code = ("import ema_pg.train, ema_pg.engine.fit, ema_pg.tasks.math.task, ema_pg.tasks.search.task\n"
            "from ema_pg.tasks.search.retriever import BM25Retriever\n"
            "r = BM25Retriever([('Paris', 'capital of France'), ('Rome', 'capital of Italy')])\n"
            "print(r.retrieve(['Italy'], 1)[0][0]['contents'].split()[0])\n")
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                       env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path / 'site'}:{root}"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[-1] == "Rome"
    assert not marker.exists(), "a module of the run imported jax"


def test_bm25_ranks_ties_by_document_and_ignores_float_noise():
    """retriever.rank: highest score first; equal scores, and scores equal past SCORE_DECIMALS (a last-bit
    difference of float32 sums between CPU kernels), are ordered by document index, so every CPU ranks alike."""
    from ema_pg.tasks.search.retriever import BM25Retriever, rank

    noisy = np.array([1.5, 2.0, 2.0 + 3e-7, 0.0, 2.0 - 2e-7, 1.5], dtype=np.float32)
    assert rank(noisy, 6)[0] == [1, 2, 4, 0, 5, 3]
    assert rank(noisy[::-1], 3)[0] == [1, 3, 4]  # the same three, by their new indices
    # two documents that BM25 scores exactly alike come back in corpus order whatever the query's other words
    r = BM25Retriever([("Zed", "alpha beta"), ("Amy", "alpha beta"), ("Bob", "gamma delta")])
    assert [d["contents"].split()[0] for d in r.retrieve(["alpha beta"], 2)[0]] == ["Zed", "Amy"]
    assert r.retrieve([""], 1)[0][0]["score"] == 0.0  # a query of no words scores every document 0
