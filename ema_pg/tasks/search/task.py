"""Search-agent QA in the Search-R1 format, over the synthetic world or Search-R1 parquet files.

A response interleaves policy text and environment observations::

    <search> query </search>
    <information>Doc 1(Title: t) text
    Doc 2(Title: t) text ...</information>        <- appended by the environment, loss mask 0
    <answer> answer </answer>

Generation stops at ``</search>`` (the environment answers with the top-``topk`` passages and
generation resumes) or ``</answer>`` (the episode ends), at most ``max_turns`` searches. A
turn that closes ``</search>`` without a well-formed ``<search>`` gets an observation that
says how to search or answer: it is not an error. The reward is exact match, after SQuAD
normalization, of the last ``<answer>`` against any gold answer; a malformed response scores 0.
"""

from __future__ import annotations

import random
import re
import string

from ..base import Prompt, Task
from .retriever import BM25Retriever, HTTPRetriever
from .world import build_world, comparison_question, questions

SEARCH_RE = re.compile(r"<search>(.*?)</search>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
INVALID = ("\nMy previous action is invalid. To search, write <search> query </search>. "
           "To answer, write <answer> answer </answer>.\n")
SPLITS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle")
#: what ``SearchTask.diagnostics`` measures of a response, and what each measure means
DIAGNOSTICS = {
    "searches": "well-formed searches made",
    "gold_seen": "a gold answer appears in the returned passages (the search found what answers the question)",
    "grounded": "the stated answer appears in the returned passages (it was read, right or wrong)",
    "read_em": "exact match among responses whose passages held the gold answer (reading, given a good search)",
    "recalled": "an answer that no passage held (from memory or made up)",
}


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower case, drop punctuation and articles, fold white space."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


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
    lines = []
    for i, d in enumerate(docs, 1):
        title, _, text = d["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n<information>" + "\n".join(lines) + "</information>\n"


class SearchQATask(Task):
    """``task=search_qa``: the synthetic world by default, Search-R1 parquet files with ``data_dir``."""

    name = "search_qa"

    def __init__(self, *, seed: int, topk: int, max_turns: int, per_split: int, retriever: str,
                 retriever_url: str | None, data_dir: str | None, n_people: int, n_orgs: int, prompt_template: str,
                 multihop_demos: float, demo_people: float, comparison_demos: float):
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
        if comparison_demos > 0 and data_dir:
            raise ValueError("task.comparison_demos needs the synthetic world's birth years; with task.data_dir set "
                             "task.comparison_demos=0")
        if not 0.0 <= demo_people < 1.0:
            raise ValueError(f"task.demo_people={demo_people} is the share of training people kept for the cold "
                             "start's demonstrations (the rest are RL's): give a number in [0, 1)")
        if demo_people > 0 and data_dir:
            raise ValueError("task.demo_people splits the synthetic world's people; with task.data_dir set task.demo_people=0")
        self.seed, self.topk, self.max_turns, self.template = seed, topk, max_turns, prompt_template
        self.multihop_demos, self.demo_people, self.comparison_demos = multihop_demos, demo_people, comparison_demos
        self.data_dir = data_dir
        if retriever not in ("bm25", "http"):
            raise ValueError(f"task.retriever={retriever!r}; choose bm25 or http")
        if retriever == "bm25" and data_dir:
            raise ValueError("with task.data_dir (a real corpus) use task.retriever=http and a retrieval server")
        if retriever == "http" and not retriever_url:
            raise ValueError("task.retriever=http needs task.retriever_url (e.g. http://127.0.0.1:8000)")
        if data_dir:
            from .data import load_search_r1

            self.train_set, self.eval_sets = load_search_r1(data_dir)
            self.demo_set = self.train_set
            self.world = None
            docs = []
        else:
            self.world = build_world(seed, n_people=n_people, n_orgs=n_orgs)
            qs = questions(self.world, seed, per_split, demo_people)
            self.train_set = [self._prompt(q.question, q.answers, q.split, q.hops) for q in qs["train"]]
            self.demo_set = self.train_set if not demo_people else \
                [self._prompt(q.question, q.answers, q.split, q.hops) for q in qs["demo"]]
            self.eval_sets = {s: [self._prompt(q.question, q.answers, s, q.hops) for q in qs[s]] for s in SPLITS}
            docs = self.world.docs
        self.retriever = HTTPRetriever(retriever_url) if retriever == "http" else BM25Retriever(docs)

    def _prompt(self, question: str, answers: list[str], split: str, hops: int = 1) -> Prompt:
        return Prompt(text=self.template.format(question=question), answer=answers[0],
                      meta={"answers": list(answers), "split": split, "hops": hops, "question": question})

    # ------------------------------------------------------------------ Task protocol
    def sample(self, n: int, seed: int) -> list[Prompt]:
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
        """The environment for one batch: called with (row, response so far) at every stop string."""
        turns: dict[int, int] = {}
        searches: dict[int, int] = {}  # well-formed searches already answered, per row

        def on_stop(row: int, text: str) -> str | None:
            if text.rstrip().endswith("</answer>"):
                return None
            turns[row] = turns.get(row, 0) + 1
            if turns[row] > self.max_turns:
                return None
            # A turn is a new search iff the response holds one more closed <search> than before.
            # Counting (our own INVALID message, which shows the tags, removed) does not depend on
            # how much of earlier observations the sampler kept (it truncates them).
            found = SEARCH_RE.findall(text.replace(INVALID, ""))
            is_new = len(found) > searches.get(row, 0) and found[-1].strip()
            searches[row] = len(found)
            if not is_new:
                return INVALID
            return format_passages(self.retriever.retrieve([found[-1].strip()], self.topk)[0])

        return on_stop

    def corpus(self) -> list[str]:
        """Text for the tokenizer: passages, questions and the action format."""
        fmt = "<search> </search> <information>Doc 1(Title: ) </information> <answer> </answer>" + INVALID
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
        tiny policy's size it does not yet (2wiki stays 0 at shares 0.1 and 0.3: README, Search-agent QA).
        Every demonstration reads its answer (and a bridge its city) from passages it was shown: a
        question whose search returns only other documents (distractors share the name) is not
        demonstrated, so the cold start never teaches answering from memory.
        ``<information>`` spans are masked out of the SFT loss.
        """
        rng = random.Random(f"search-demo-{self.seed}-{seed}")
        singles = [p for p in self.demo_set if p.meta["hops"] == 1]
        bridges = [p for p in self.demo_set if p.meta["hops"] == 2]
        if self.multihop_demos > 0 and (self.world is None or not bridges):
            raise ValueError(f"task.multihop_demos={self.multihop_demos} needs the synthetic world's bridge questions "
                             "(their intermediate city is known); with task.data_dir set task.multihop_demos=0")
        retrieve = lambda q: format_passages(self.retriever.retrieve([q], self.topk)[0])
        people = sorted({question_entity(p.meta["question"]) for p in self.demo_set}) if self.comparison_demos else []
        out, tries = [], 0
        while len(out) < n:  # only trajectories whose passages hold what is answered: reading, never recall
            tries += 1
            if tries > 20 * n + 100:
                raise ValueError(f"only {len(out)} of {n} demonstrations found their answer in the top-{self.topk} "
                                 "passages; raise task.topk")
            u = rng.random()
            if u >= 1.0 - self.comparison_demos:  # (the top of [0, 1): the other draws stay as they were)
                a, b = rng.sample(people, 2)
                ya, yb = self.world.people[a].year, self.world.people[b].year
                first, second = retrieve(a), retrieve(b)
                if ya != yb and self._states_birth(a, first) and self._states_birth(b, second):
                    question = self.template.format(question=comparison_question(a, b))
                    out.append((question, f"<search> {a} </search>{first}<search> {b} </search>{second}"
                                          f"<answer> {a if ya < yb else b} </answer>"))
            elif u < self.multihop_demos:
                p = rng.choice(bridges)
                person = question_entity(p.meta["question"])
                city = self.world.people[person].city
                first, second = retrieve(person), retrieve(city)
                if city in first and p.answer in second:
                    out.append((p.text, f"<search> {person} </search>{first}<search> {city} </search>{second}"
                                        f"<answer> {p.answer} </answer>"))
            else:
                p = rng.choice(singles)
                entity = question_entity(p.meta["question"])
                obs = retrieve(entity)
                if p.answer in obs:
                    out.append((p.text, f"<search> {entity} </search>{obs}<answer> {p.answer} </answer>"))
        return out

    def _states_birth(self, person: str, observation: str) -> bool:
        """The passages hold ``person``'s own birth record (their city and year in one passage titled with
        their name), not only a distractor that happens to share the year."""
        p = self.world.people[person]
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
        return out

    def baseline_prompts(self, prompts: list[Prompt], mode: str) -> list[Prompt]:
        """Table 2's baselines that need no RL, as prompts for the same policy.

        ``cot``: answer without search (the prompt ends with ``<answer>``); ``rag``: retrieve with the
        question itself, show the passages, then the policy answers.
        """
        if mode not in ("cot", "rag"):
            raise ValueError(f"unknown baseline {mode!r}; choose cot or rag")
        out = []
        for p in prompts:
            if mode == "cot":
                prefix = "<answer>"
            else:
                q = p.meta["question"]
                prefix = f"<search> {q} </search>" + format_passages(self.retriever.retrieve([q], self.topk)[0]) + "<answer>"
            out.append(Prompt(text=p.text + prefix, answer=p.answer, meta={**p.meta, "prefix": prefix}))
        return out

    def masked_spans(self, response: str) -> list[tuple[int, int]]:
        """Character spans of environment text inside a demonstration (no SFT loss there)."""
        return [(m.start(), m.end()) for m in re.finditer(r"\n<information>.*?</information>\n", response, re.DOTALL)]
