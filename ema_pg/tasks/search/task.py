"""Search-agent QA in the Search-R1 format, over the synthetic world or Search-R1 parquet files.

A response interleaves policy text and environment observations, laid out byte for byte as Search-R1's
generation loop (``search_r1/llm_agent/generation.py``) lays them out::

    <search> query </search>

    <information>Doc 1(Title: t) text
    Doc 2(Title: t) text ...</information>        <- appended by the environment, loss mask 0

    <answer> answer </answer>

Generation stops at ``</search>`` or ``</answer>``; the turn's action is its first
``<search>...</search>`` or ``<answer>...</answer>`` (Search-R1's rule). An answer ends the episode;
the searches of every row that searched in the turn go to the retriever in one batched request, and
each row gets its top-``topk`` passages; a turn with neither gets Search-R1's "invalid action"
message. After ``max_turns`` turns that did not answer, the episode ends. The reward is exact match,
after SQuAD normalization, of the last ``<answer>`` against any gold answer; a malformed response
scores 0.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from functools import lru_cache

from ..base import Prompt, Task
from .retriever import BM25Retriever, HTTPRetriever
from .world import WORLDS, World, born_first_question, build_world, episode_question, episode_world, questions

SEARCH_RE = re.compile(r"<search>(.*?)</search>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)  #: a turn's action: its first match (Search-R1)
INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
           "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
           "Let me try again.\n")  #: Search-R1's answer to a turn with neither action
OBSERVATION_RE = re.compile(r"\n\n<information>.*?</information>\n\n", re.DOTALL)  #: one observation block
SPLITS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle")
#: what ``SearchTask.diagnostics`` measures of a response, and what each measure means
DIAGNOSTICS = {
    "searches": "well-formed searches made",
    "gold_seen": "a gold answer appears in the returned passages (the search found what answers the question)",
    "grounded": "the stated answer appears in the returned passages (it was read, right or wrong)",
    "read_em": "exact match among responses whose passages held the gold answer (reading, given a good search)",
    "recalled": "an answer that no passage held (from memory or made up)",
    "queries_copied": "queries that are verbatim text of the question or of a passage returned before them (a name "
                      "copied whole, not garbled)",
}
STEP_RE = re.compile(r"<search>(.*?)</search>|<information>(.*?)</information>", re.DOTALL)  #: queries and passages


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower case, drop punctuation and articles, fold white space."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def queries_copied(question: str, response: str) -> float | None:
    """The share of ``response``'s non-empty queries whose text (normalized) occurs in the question or in the
    passages returned before the query; None without a query."""
    seen, copied, n = f" {normalize_answer(question)} ", 0, 0
    for query, passages in STEP_RE.findall(response.replace(INVALID, "")):
        if passages:
            seen += f"{normalize_answer(passages)} "
        elif q := normalize_answer(query):
            n += 1
            copied += f" {q} " in seen
    return copied / n if n else None


def exact_match(prediction: str, golds: list[str]) -> float:
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golds))


def extract_answer(response: str) -> str | None:
    found = ANSWER_RE.findall(response)
    return found[-1].strip() if found else None


QUESTION_ENTITY = re.compile(r"^(?:Where was|What is the birthplace of|Who founded|In which country was|Which city is) (.*?)"
                             r"(?: born| from)?\?$")


def question_entity(question: str) -> str:
    """The entity a synthetic question asks about ("Where was P born?" -> P), for demonstrations."""
    m = QUESTION_ENTITY.match(question)
    return m.group(1).strip() if m else question.rstrip("?")


def format_passages(docs: list[dict]) -> str:
    """The observation block of one search, as Search-R1 writes it: ``Doc i(Title: <first line>) <the rest>``
    per document, each ended by a newline, the whole stripped and wrapped in ``\\n\\n<information>...
    </information>\\n\\n``."""
    ref = ""
    for i, d in enumerate(docs, 1):
        title, _, text = d["contents"].partition("\n")
        ref += f"Doc {i}(Title: {title}) {text}\n"
    return f"\n\n<information>{ref.strip()}</information>\n\n"


CORPUS_EPISODES = 60  #: episode worlds per question shape in the tokenizer's corpus (task.world=episode)


@lru_cache(maxsize=4096)
def _episode_world(key: str, people: int) -> World:
    return episode_world(key, people)


@lru_cache(maxsize=4096)
def _episode_index(key: str, people: int) -> BM25Retriever:
    """One episode world's passages, indexed (about 1 ms)."""
    return BM25Retriever(_episode_world(key, people).docs)


@dataclass(frozen=True)
class SearchKnobs:
    """``task=search_qa``'s knobs, one field each (their values: ``conf/task/search_qa.yaml``), checked together by
    :meth:`check`, each problem in one line that says what to change."""

    seed: int
    topk: int
    max_turns: int
    per_split: int
    retriever: str
    retriever_url: str | None
    retriever_timeout: float
    retriever_retries: int
    data_dir: str | None
    n_people: int
    n_orgs: int
    prompt_template: str
    multihop_demos: float
    demo_people: float
    comparison_demos: float
    world: str
    episode_people: int

    def check(self) -> None:
        topk, max_turns, retriever, retriever_url, data_dir = (self.topk, self.max_turns, self.retriever,
                                                               self.retriever_url, self.data_dir)
        multihop_demos, demo_people, comparison_demos = self.multihop_demos, self.demo_people, self.comparison_demos
        world, episode_people = self.world, self.episode_people
        if world not in WORLDS:
            raise ValueError(f"task.world={world!r}; choose one of {', '.join(WORLDS)}")
        if world == "episode":
            problems = [(data_dir, "task.data_dir reads Search-R1 data, whose questions share one corpus; unset it"),
                        (retriever != "bm25", "task.retriever=http searches one server's corpus, but each question "
                                              "has its own; use task.retriever=bm25"),
                        (demo_people, f"task.demo_people={demo_people}: the demonstrations' worlds are apart from "
                                      "RL's already; set task.demo_people=0"),
                        (episode_people < 4, f"task.episode_people={episode_people}: a question's world needs at "
                                             "least 4 people")]
            for bad, problem in problems:
                if bad:
                    raise ValueError(f"task.world=episode draws a fresh world for every question: {problem}")
        if data_dir:  # every knob of the synthetic world's cold start at once, with the fix
            synthetic = {k: v for k, v in (("task.multihop_demos", multihop_demos), ("task.demo_people", demo_people),
                                           ("task.comparison_demos", comparison_demos)) if v}
            if synthetic:
                raise ValueError(f"task.data_dir reads Search-R1 data, but {', '.join(f'{k}={v}' for k, v in synthetic.items())} "
                                 "shape the synthetic world's cold start (experiment=search sets them); use "
                                 "experiment=search_r1 task.data_dir=DIR, or set them to 0")
        if topk < 1 or max_turns < 1:
            raise ValueError(f"task.topk and task.max_turns must be >= 1; got {topk}, {max_turns}")
        if not 0.0 <= multihop_demos <= 1.0:
            raise ValueError(f"task.multihop_demos={multihop_demos} is a share of the cold-start demonstrations: "
                             "give a number in [0, 1]")
        if multihop_demos > 0 and max_turns < 2:
            raise ValueError(f"task.multihop_demos={multihop_demos} demonstrates two searches, but task.max_turns="
                             f"{max_turns} allows one; raise task.max_turns or set task.multihop_demos=0")
        if not 0.0 <= comparison_demos <= 1.0 - multihop_demos:
            raise ValueError(f"task.comparison_demos={comparison_demos} is a share of the cold-start demonstrations beside "
                             f"task.multihop_demos={multihop_demos}: give a number in [0, {1.0 - multihop_demos:g}]")
        if comparison_demos > 0 and max_turns < 2:
            raise ValueError(f"task.comparison_demos={comparison_demos} demonstrates two searches, but task.max_turns="
                             f"{max_turns} allows one; raise task.max_turns or set task.comparison_demos=0")
        if not 0.0 <= demo_people < 1.0:
            raise ValueError(f"task.demo_people={demo_people} is the share of training people kept for the cold "
                             "start's demonstrations (the rest are RL's): give a number in [0, 1)")
        if retriever not in ("bm25", "http"):
            raise ValueError(f"task.retriever={retriever!r}; choose bm25 or http")
        if retriever == "bm25" and data_dir:
            raise ValueError("task.data_dir is Search-R1 data, whose passages live in a retrieval server: set "
                             "task.retriever=http task.retriever_url=http://HOST:PORT/retrieve (experiment=search_r1 does; "
                             "python -m ema_pg.tasks.search.serve --corpus FILE serves a corpus file with BM25)")
        if retriever == "http" and not retriever_url:
            raise ValueError("task.retriever=http needs task.retriever_url, e.g. http://127.0.0.1:8000/retrieve")


class SearchQATask(Task):
    """``task=search_qa``: the synthetic world by default (one per ``task.seed``, or with ``task.world=episode`` a
    fresh one for every question, each with its own BM25 corpus), Search-R1 parquet files with ``data_dir``."""

    name = "search_qa"
    format_version = 3  #: its demonstrations' layout (3: BM25 ties ranked by document); part of the cold-start key

    Knobs = SearchKnobs  #: the task's knobs as one record (ema_pg.tasks.plugins.class_knobs reads its fields)

    def __init__(self, **knobs):
        k = SearchKnobs(**knobs)
        k.check()
        seed, topk, max_turns, per_split, data_dir = k.seed, k.topk, k.max_turns, k.per_split, k.data_dir
        self.seed, self.topk, self.max_turns, self.template = seed, topk, max_turns, k.prompt_template
        self.multihop_demos, self.demo_people, self.comparison_demos = k.multihop_demos, k.demo_people, k.comparison_demos
        self.data_dir = data_dir
        self.episodic, self.episode_people = k.world == "episode", k.episode_people
        if self.episodic:  # prompts are drawn on demand (a stream of worlds), the eval splits once
            self.world = None
            self.train_set = self.demo_set = None
            self.eval_sets = {s: [self._episode(s, i) for i in range(per_split)] for s in SPLITS}
            self.retriever = None
            return
        if data_dir:
            from .data import load_search_r1

            self.train_set, self.eval_sets = load_search_r1(data_dir, per_split)
            self.demo_set = self.train_set
            self.world = None
            docs = []
        else:
            self.world = build_world(seed, n_people=k.n_people, n_orgs=k.n_orgs)
            qs = questions(self.world, seed, per_split, k.demo_people)
            self.train_set = [self._prompt(q.question, q.answers, q.split, q.hops) for q in qs["train"]]
            self.demo_set = self.train_set if not k.demo_people else \
                [self._prompt(q.question, q.answers, q.split, q.hops) for q in qs["demo"]]
            self.eval_sets = {s: [self._prompt(q.question, q.answers, s, q.hops) for q in qs[s]] for s in SPLITS}
            docs = self.world.docs
        self.retriever = HTTPRetriever(k.retriever_url, k.retriever_timeout, k.retriever_retries) if k.retriever == "http" \
            else BM25Retriever(docs)
        self.retriever.check()  # a server that is down or speaks another protocol is named now, before any model


    def _prompt(self, question: str, answers: list[str], split: str, hops: int = 1, **meta) -> Prompt:
        return Prompt(text=self.template.format(question=question), answer=answers[0],
                      meta={"answers": list(answers), "split": split, "hops": hops, "question": question, **meta})

    @property
    def generated(self) -> bool:
        """The worlds are generated from ``task.seed`` (not read from ``task.data_dir``)."""
        return not self.data_dir

    def _episode(self, split: str, *index, shape: str | None = None) -> Prompt:
        """The prompt of one episode world, named by the task seed, the split and ``index``, asking the
        question of ``shape`` (the split's own by default); ``meta["world"]`` holds the name, from which every
        process rebuilds the world and its corpus."""
        key = ":".join(map(str, (self.seed, split, *index)))
        q = episode_question(_episode_world(key, self.episode_people), key, shape or split)
        return self._prompt(q.question, q.answers, split, q.hops, world=key, entities=q.entities)

    def world_of(self, prompt: Prompt) -> World:
        """The world a prompt's question is about."""
        key = prompt.meta.get("world")
        return self.world if key is None else _episode_world(key, self.episode_people)

    def retrieve(self, prompts: list[Prompt], queries: list[str]) -> list[list[dict]]:
        """Per query, the top-``topk`` passages of the corpus its prompt's question is asked in: one batched
        request to the task's retriever, or each episode world's own BM25 index."""
        if not self.episodic:
            return self.retriever.retrieve(queries, self.topk)
        return [_episode_index(p.meta["world"], self.episode_people).retrieve([q], self.topk)[0]
                for p, q in zip(prompts, queries)]

    # ------------------------------------------------------------------ Task protocol
    def sample(self, n: int, seed: int) -> list[Prompt]:
        if self.episodic:  # a fresh world for every prompt: a question is never asked twice
            return [self._episode("train", seed, j) for j in range(n)]
        rng = random.Random(f"search-train-{self.seed}-{seed}")
        return [rng.choice(self.train_set) for _ in range(n)]

    def eval_splits(self) -> dict[str, list[Prompt]]:
        return self.eval_sets

    def reward(self, prompt: Prompt, response: str) -> float:
        ans = extract_answer(prompt.meta.get("prefix", "") + response)  # only text after the instruction counts
        return 0.0 if ans is None else exact_match(ans, prompt.meta["answers"])

    def answer_key(self, prompt: Prompt, response: str) -> str | None:
        ans = extract_answer(prompt.meta.get("prefix", "") + response)
        return None if ans is None else normalize_answer(ans)

    def on_stop_fn(self, prompts: list[Prompt], n: int):
        """The environment for one batch: called once per turn with every row that stopped and its turn text."""
        turns: dict[int, int] = {}  # turns that did not answer, per row

        def on_stop(rows: list[int], texts: list[str]) -> list[str | None]:
            out: list[str | None] = [None] * len(rows)
            searches: list[tuple[int, str]] = []
            for j, (row, text) in enumerate(zip(rows, texts)):
                m = ACTION_RE.search(text)
                if m and m.group(1) == "answer":
                    continue  # the episode ends
                turns[row] = turns.get(row, 0) + 1
                if turns[row] > self.max_turns:
                    continue
                if m:
                    searches.append((j, m.group(2).strip()))
                else:
                    out[j] = INVALID
            if searches:  # one request for every row that searched in this turn
                asked = [prompts[rows[j] // n] for j, _ in searches]
                for (j, _), docs in zip(searches, self.retrieve(asked, [q for _, q in searches])):
                    out[j] = format_passages(docs)
            return out

        return on_stop

    def corpus(self) -> list[str]:
        """Text for the tokenizer: passages, questions and the action format."""
        fmt = "<search> </search> <information>Doc 1(Title: ) </information> <answer> </answer>" + INVALID
        if self.episodic:  # worlds of their own, drawn like RL's: the tokenizer learns the names' syllables
            ps = [self._episode(s, "corpus", i) for i in range(CORPUS_EPISODES) for s in ("train", *SPLITS)]
            docs = [f"{t} {x}" for p in ps for t, x in self.world_of(p).docs]
            return docs + [p.text for p in ps] + [fmt] * 50
        docs = [] if self.world is None else [f"{t} {x}" for t, x in self.world.docs]
        demo = [] if self.demo_set is self.train_set else [p.text for p in self.demo_set]
        qs = [p.text for p in self.train_set] + demo + [p.text for v in self.eval_sets.values() for p in v]
        return docs + qs + [fmt] * 50

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        """Cold-start trajectories. Most search once, with the question's entity, then answer from the passages.

        A share ``task.multihop_demos`` of them are two-hop bridges on training questions ("In which
        country was P born?"): search P, read the birthplace in the passages, search that city, read
        its country, answer. A base model starts above zero on multi-hop (the paper's: HotpotQA
        0.047 before RL); RL is left to make the second search reliable, not to invent it.
        A share ``task.comparison_demos`` compare two of the demonstrations' people ("Who was born
        first, A or B?", the ``2wiki`` question): search A, search B, answer the one whose passages
        give the earlier year. RL never asks this question (as in the paper, whose RL data are NQ and
        HotpotQA), so on ``2wiki`` the cold start must play the base model's prior (0.051 there); at the
        tiny policy's size it does not yet (2wiki stays 0 at shares 0.1 and 0.3: docs/tasks.md).
        Every demonstration reads its answer (and a bridge its city) from passages it was shown: a
        question whose search returns only other documents (distractors share the name) is not
        demonstrated, so the cold start never teaches answering from memory.
        ``<information>`` spans are masked out of the SFT loss.
        """
        if not self.generated:
            raise ValueError(f"task.data_dir={self.data_dir!r}: Search-R1 data holds no demonstrations, so there is no "
                             "cold start; start from a base model as Search-R1 does: model=local model.path=DIR sft.steps=0 "
                             "(experiment=search_r1 sets sft.steps=0)")
        rng = random.Random(f"search-demo-{self.seed}-{seed}")
        if self.episodic:  # every demonstration in a world of its own, none of them RL's or the eval's
            singles = bridges = people = None
        else:
            singles = [p for p in self.demo_set if p.meta["hops"] == 1]
            bridges = [p for p in self.demo_set if p.meta["hops"] == 2]
            if self.multihop_demos > 0 and not bridges:
                raise ValueError(f"task.multihop_demos={self.multihop_demos} needs the synthetic world's bridge questions "
                                 "(their intermediate city is known); with task.data_dir set task.multihop_demos=0")
            people = sorted({question_entity(p.meta["question"]) for p in self.demo_set}) if self.comparison_demos else []
        out, tries = [], 0
        while len(out) < n:  # only trajectories whose passages hold what is answered: reading, never recall
            tries += 1
            if tries > 20 * n + 100:
                raise ValueError(f"only {len(out)} of {n} demonstrations found their answer in the top-{self.topk} "
                                 "passages; raise task.topk")
            u = rng.random()
            shape = "2wiki" if u >= 1.0 - self.comparison_demos else "bridge" if u < self.multihop_demos else "birthplace"
            if self.episodic:  # (the top of [0, 1) compares: the other draws stay as they were without it)
                p = self._episode("demo", seed, tries, shape=shape)
            elif shape == "2wiki":
                q = born_first_question(self.world, *rng.sample(people, 2))
                p = self._prompt(q.question, q.answers, "demo", q.hops, entities=q.entities)
            else:
                p = rng.choice(bridges if shape == "bridge" else singles)
            demo = self._demonstrate(p, shape)
            if demo:
                out.append(demo)
        return out

    def _demonstrate(self, p: Prompt, shape: str) -> tuple[str, str] | None:
        """The trajectory that answers ``p`` by reading, or None when the passages do not hold what it needs."""
        w = self.world_of(p)
        retrieve = lambda q: format_passages(self.retrieve([p], [q])[0])
        if shape == "2wiki":
            a, b = p.meta["entities"]
            first, second = retrieve(a), retrieve(b)
            if w.people[a].year != w.people[b].year and self._states_birth(w, a, first) and self._states_birth(w, b, second):
                return p.text, f"<search> {a} </search>{first}<search> {b} </search>{second}<answer> {p.answer} </answer>"
        elif shape == "bridge":
            person = question_entity(p.meta["question"])
            city = w.people[person].city
            first, second = retrieve(person), retrieve(city)
            if city in first and p.answer in second:
                return (p.text, f"<search> {person} </search>{first}<search> {city} </search>{second}"
                                f"<answer> {p.answer} </answer>")
        else:
            entity = question_entity(p.meta["question"])
            obs = retrieve(entity)
            if p.answer in obs:
                return p.text, f"<search> {entity} </search>{obs}<answer> {p.answer} </answer>"
        return None

    @staticmethod
    def _states_birth(w: World, person: str, observation: str) -> bool:
        """The passages hold ``person``'s own birth record (their city and year in one passage titled with
        their name), not only a distractor that happens to share the year."""
        p = w.people[person]
        return any(f"(Title: {person})" in line and p.city in line and str(p.year) in line
                   for line in observation.splitlines())

    def diagnostics(self, prompt: Prompt, response: str) -> dict[str, float]:
        """What a response read and where its answer came from (evaluation only; the reward is EM alone):
        the measures of ``DIAGNOSTICS``; ``read_em`` only when a gold answer was seen."""
        answers = prompt.meta["answers"]
        found = SEARCH_RE.findall(response.replace(INVALID, ""))
        seen = normalize_answer(" ".join(re.findall(r"<information>(.*?)</information>", response, re.DOTALL)))
        ans = extract_answer(prompt.meta.get("prefix", "") + response)
        inside = lambda x: bool(x) and f" {x} " in f" {seen} "
        gold_seen = any(inside(normalize_answer(g)) for g in answers)
        stated = normalize_answer(ans) if ans is not None else ""
        out = {"searches": float(sum(1 for q in found if q.strip())), "gold_seen": float(gold_seen),
               "grounded": float(inside(stated)), "recalled": float(bool(stated) and not inside(stated))}
        if gold_seen:
            out["read_em"] = self.reward(prompt, response)
        if (copied := queries_copied(prompt.meta.get("question", prompt.text), response)) is not None:
            out["queries_copied"] = copied
        return out

    def baseline_prompts(self, prompts: list[Prompt], mode: str) -> list[Prompt]:
        """Table 2's baselines that need no RL, as prompts for the same policy.

        ``cot``: answer without search (the response starts with ``<answer>``); ``rag``: retrieve with the
        question itself (Search-R1 data: its ``question`` column, not the whole instruction), show the
        passages, then the policy answers. The start of the response is ``meta["prefix"]``, which the
        prompt encoder appends after the rendered prompt and the reward reads with the response.
        """
        if mode not in ("cot", "rag"):
            raise ValueError(f"unknown baseline {mode!r}; choose cot or rag")
        docs = self.retrieve(prompts, [p.meta["question"] for p in prompts]) if mode == "rag" else []
        out = []
        for j, p in enumerate(prompts):
            prefix = "<answer>" if mode == "cot" else \
                f"<search> {p.meta['question']} </search>" + format_passages(docs[j]) + "<answer>"
            out.append(Prompt(text=p.text, answer=p.answer, meta={**p.meta, "prefix": prefix}, messages=p.messages))
        return out

    def masked_spans(self, response: str) -> list[tuple[int, int]]:
        """Character spans of environment text inside a demonstration (no SFT loss there)."""
        return [(m.start(), m.end()) for m in OBSERVATION_RE.finditer(response)]
