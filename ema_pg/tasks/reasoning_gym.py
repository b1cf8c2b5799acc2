"""reasoning-gym's procedurally generated tasks (PyPI ``reasoning-gym``; ``pip install -e ".[envs]"``).

``task=reasoning_gym`` trains on a weighted mixture of its datasets, each with its own config, and evaluates on one
held-out split per dataset:

- **a question** is ``dataset[idx]`` of a dataset built with ``seed`` and its config: reasoning-gym draws item
  ``idx`` from ``Random(seed + idx)``. Training draws ``idx`` in ``[0, 2^31)`` of a dataset seeded
  ``task.seed * 2^33``; evaluation draws from one seeded ``task.seed * 2^33 + 2^32``.
- **held out by problem**: a question's *problem* is what it asks whatever its surface form
  (:func:`problem_key`): the unordered operands of an LCM or GCD, an arithmetic expression with its parentheses
  dropped and the operands of a sum or product in order (``4 + 1`` is ``1 + 4``), the question's text for a dataset
  with no key here. A dataset's held-out split is ``eval_size`` problems drawn uniformly from the distinct problems
  that ``EVAL_TRIES * eval_size`` evaluation items ask (each asked by its first item), so a frequent problem is
  held out no more often than a rare one; a training draw whose problem a split holds out is drawn again, so no
  training prompt asks a held-out problem in any form. Where a config has few problems, a split holds out at most
  half of those found (one line says so, and every split's share of its problems is logged at start).
- **reproducible**: a dataset whose questions change with Python's hash seed (:data:`HASH_SEEDED`, measured) is
  refused unless ``PYTHONHASHSEED`` pins it, since its held-out split would be another in every process.
- **the reward** is the dataset's own ``score_answer(answer, entry)``, with the answer taken as reasoning-gym's own
  examples take it (``reasoning_gym.utils.extract_answer``: the last ``<answer>...</answer>``; no tag scores 0).
- **the prompt** is the question; with a chat template the system prompt is reasoning-gym's
  ``SYSTEM_PROMPTS[task.system_prompt]`` (``default`` asks for ``<think>`` and ``<answer>`` tags), ``none`` for none.
- **the cold start** of a tiny policy trained from scratch: demonstrations ``<answer>{answer}</answer>`` of
  training questions.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import logging
import math
import os
import random

from .base import Prompt, Task

log = logging.getLogger(__name__)

TRAIN_SPAN = 2**31  #: the training draws' item indices, [0, TRAIN_SPAN)
SEED_STRIDE = 2**33  #: task.seed's region of reasoning-gym seeds: training at its start, evaluation 2^32 after
EVAL_OFFSET = 2**32
EVAL_TRIES = 20  #: an evaluation split of n problems draws them from the distinct problems of this many times n items
DRAW_TRIES = 1000  #: a training draw looks at most this many items for a question no split holds out
#: datasets whose questions change with Python's hash seed (reasoning-gym 0.1.25 at their default configs, measured
#: by tests/algorithm/test_reasoning_gym.py over the whole registry under two hash seeds)
HASH_SEEDED = ("isomorphic_strings", "list_functions", "polynomial_multiplication", "ransom_note")


def _canonical(node: ast.AST):
    """An arithmetic expression's problem: parentheses gone (the parse drops them), a negative literal a number,
    the operands of a chain of + (or of *) in a fixed order; every other operation keeps its operands' order."""
    if isinstance(node, ast.Constant):
        return ("num", node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return ("num", -node.operand.value)
    if isinstance(node, ast.UnaryOp):
        return (type(node.op).__name__, _canonical(node.operand))
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        op, terms, todo = type(node.op), [], [node]
        while todo:
            n = todo.pop()
            if isinstance(n, ast.BinOp) and isinstance(n.op, op):
                todo += [n.left, n.right]
            else:
                terms.append(_canonical(n))
        return (op.__name__, tuple(sorted(terms, key=repr)))
    if isinstance(node, ast.BinOp):
        return (type(node.op).__name__, _canonical(node.left), _canonical(node.right))
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


def _expression(entry: dict):
    try:
        return _canonical(ast.parse(entry["metadata"]["expression"], mode="eval").body)
    except (KeyError, SyntaxError, ValueError):
        return entry["question"]


def _operands(entry: dict):
    return tuple(sorted(entry["metadata"]["numbers"]))


#: a dataset's problem key, where its questions ask one problem in several surface forms (read from each entry's
#: metadata); every other dataset's problem is its question's text
PROBLEM_KEYS = {"lcm": _operands, "gcd": _operands, "products": _expression, "chain_sum": _expression,
                "basic_arithmetic": _expression}


def problem_key(name: str, entry: dict):
    """The problem an item of dataset ``name`` asks, whatever its surface form (:data:`PROBLEM_KEYS`)."""
    key = PROBLEM_KEYS.get(name)
    return (name, key(entry) if key else entry["question"])


def _rg():
    """reasoning_gym, imported on first use (about a second); one line when it is not installed."""
    try:
        import reasoning_gym
        import reasoning_gym.utils  # noqa: F401 - extract_answer and SYSTEM_PROMPTS
    except ImportError:
        raise ValueError("task=reasoning_gym needs the reasoning-gym package: pip install -e \".[envs]\" "
                         "(or pip install reasoning-gym)") from None
    return reasoning_gym


def _registry() -> dict:
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _mixture(datasets) -> dict[str, tuple[float, dict]]:
    """``task.datasets`` (reasoning-gym's own mixture layout, its ``CompositeConfig.datasets``: a list of
    ``{name, weight, config}``) as {name: (weight, config)}, every problem of it found here in one line: an unknown
    name (with the close ones), a name given twice, a config key its dataset does not take, a weight that is
    negative or all zero."""
    if not datasets or isinstance(datasets, (str, dict)) or not all(hasattr(d, "get") for d in datasets):
        raise ValueError(f"task.datasets={datasets!r}; give a list of {{name, weight, config}}, e.g. "
                         "task.datasets='[{name: chain_sum, weight: 1, config: {max_terms: 2}}]'")
    known = _registry()
    out = {}
    for spec in datasets:
        spec = dict(spec)
        name = spec.get("name")
        if name == "composite" or name not in known:
            near = difflib.get_close_matches(str(name), [n for n in known if n != "composite"], n=3)
            raise ValueError(f"task.datasets: reasoning-gym has no dataset {name!r}"
                             + (f"; did you mean {' or '.join(near)}?" if near else
                                f"; its {len(known) - 1} datasets are listed by reasoning_gym.factory.DATASETS"))
        if name in out:
            raise ValueError(f"task.datasets names {name} twice; give each dataset once (one weight, one config)")
        if extra := set(spec) - {"name", "weight", "config"}:
            raise ValueError(f"task.datasets: {name} takes name, weight and config; remove {', '.join(sorted(extra))}")
        weight, config = spec.get("weight", 1.0), dict(spec.get("config") or {})
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"task.datasets: {name}'s weight={weight!r}; a weight is a finite number >= 0")
        keys = [f.name for f in dataclasses.fields(known[name][1]) if f.name not in ("seed", "size")]
        for k in config:
            if k not in keys:
                near = difflib.get_close_matches(k, keys, n=1)
                raise ValueError(f"task.datasets: {name}'s config.{k}: {name} takes no {k}"
                                 + (f"; did you mean {near[0]}?" if near else "")
                                 + f" (its keys: {', '.join(keys)})")
        out[str(name)] = (float(weight), config)
    if not sum(w for w, _ in out.values()) > 0:
        raise ValueError(f"task.datasets: every weight is 0 ({', '.join(out)}); give one a weight > 0")
    return out


def _dataset(name: str, config: dict, seed: int, size: int):
    """reasoning-gym's dataset ``name`` with ``config`` at ``seed``; its config's own check as one line."""
    cls, config_cls = _registry()[name]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    kw = {**config, **({"seed": seed} if "seed" in fields else {}), **({"size": size} if "size" in fields else {})}
    try:
        cfg = config_cls(**kw)
        if hasattr(cfg, "validate"):
            cfg.validate()
        return cls(config=cfg)
    except (AssertionError, ValueError, TypeError) as e:
        raise ValueError(f"task.datasets: {name}'s config {config}: reasoning-gym refuses it: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


class ReasoningGymTask(Task):
    name = "reasoning_gym"
    metric = "score"  #: the mean of the datasets' own score_answer (partial credit where a dataset gives it)

    def __init__(self, *, datasets: list, seed: int, eval_size: int, system_prompt: str):
        rg = _rg()
        if eval_size < 1:
            raise ValueError(f"task.eval_size must be >= 1; got {eval_size}")
        if system_prompt != "none" and system_prompt not in rg.utils.SYSTEM_PROMPTS:
            raise ValueError(f"task.system_prompt={system_prompt!r}; choose none or one of reasoning-gym's: "
                             f"{', '.join(rg.utils.SYSTEM_PROMPTS)}")
        self.mixture = _mixture(datasets)
        if (pinned := os.environ.get("PYTHONHASHSEED", "random")) == "random" or not pinned.isdigit():
            if seeded := [n for n in self.mixture if n in HASH_SEEDED]:
                raise ValueError(f"task.datasets: {', '.join(seeded)}'s questions change with Python's hash seed, so "
                                 "its held-out problems would be others in every process: run with PYTHONHASHSEED=0 "
                                 "(any fixed number) in the environment, or leave it out")
        self.seed, self.eval_size, self.system_prompt = seed, eval_size, system_prompt
        base = seed * SEED_STRIDE
        self.train_ds = {n: _dataset(n, c, base, TRAIN_SPAN) for n, (_, c) in self.mixture.items()}
        self.eval_ds = {n: _dataset(n, c, base + EVAL_OFFSET, EVAL_TRIES * eval_size) for n, (_, c) in self.mixture.items()}
        self.names = [n for n, (w, _) in self.mixture.items() if w > 0]  # drawn in training
        self.weights = [self.mixture[n][0] for n in self.names]
        self.found: dict[str, int] = {}  #: each dataset's distinct problems in its evaluation items (eval_splits)
        self._heldout = {p.meta["problem"] for split in self.eval_splits().values() for p in split}
        for name in self.names:  # a config whose every problem is held out, refused now
            self._item(random.Random(f"probe-{seed}"), name)

    # ------------------------------------------------------------------ prompts
    def _prompt(self, name: str, entry: dict, idx: int, split: str) -> Prompt:
        q = entry["question"]
        messages = None
        if self.system_prompt != "none":
            messages = [{"role": "system", "content": _rg().utils.SYSTEM_PROMPTS[self.system_prompt]},
                        {"role": "user", "content": q}]
        return Prompt(text=q, answer=str(entry["answer"]), messages=messages,
                      meta={"dataset": name, "index": idx, "split": split, "entry": entry,
                            "problem": problem_key(name, entry)})

    def _draw(self, rng: random.Random) -> Prompt:
        """A training prompt: a dataset by the mixture's weights, then an item of it whose problem no split holds
        out (the dataset drawn once, so a redraw keeps the weights)."""
        return self._item(rng, rng.choices(self.names, weights=self.weights)[0])

    def _item(self, rng: random.Random, name: str) -> Prompt:
        for _ in range(DRAW_TRIES):
            idx = rng.randrange(TRAIN_SPAN)
            entry = self.train_ds[name][idx]
            if problem_key(name, entry) not in self._heldout:
                return self._prompt(name, entry, idx, "train")
        raise ValueError(f"task.eval_size={self.eval_size} holds out every problem of {name} that training "
                         f"draws ({DRAW_TRIES} draws found none left to train on); lower task.eval_size or widen its "
                         "config")

    def sample(self, n: int, seed: int) -> list[Prompt]:
        rng = random.Random(f"train-{self.seed}-{seed}")
        return [self._draw(rng) for _ in range(n)]

    @functools.cache  # one task object per run; its splits are asked for many times
    def eval_splits(self) -> dict[str, list[Prompt]]:
        """One split per dataset of the mixture (a weight of 0 too: held out, never trained on): ``eval_size``
        problems drawn uniformly from the distinct problems of its evaluation items 0 .. ``EVAL_TRIES * eval_size``
        (each asked as its first item asks it), in item order; at most half the problems found."""
        out = {}
        for name, ds in self.eval_ds.items():
            first: dict = {}  # problem -> its first item (index, entry), in item order
            for i in range(EVAL_TRIES * self.eval_size):
                entry = ds[i]
                first.setdefault(problem_key(name, entry), (i, entry))
            found = self.found[name] = len(first)
            keep = min(self.eval_size, found // 2)
            if keep < 1:
                raise ValueError(f"task.datasets: {name}'s config asks one problem in {EVAL_TRIES * self.eval_size} "
                                 "draws, so none can be held out and trained on apart; widen its config")
            if keep < self.eval_size:
                log.warning("%s: its config asks %d problems in %d draws, so its held-out split is %d of them, not "
                            "task.eval_size=%d: training keeps as many problems as evaluation holds out", name, found,
                            EVAL_TRIES * self.eval_size, keep, self.eval_size)
            picked = random.Random(f"heldout-{self.seed}-{name}").sample(list(first), keep)
            out[name] = [self._prompt(name, e, i, "eval") for i, e in sorted(first[k] for k in picked)]
        log.info("held out: %s", "; ".join(f"{n} {len(s)} of the {self.found[n]} problems found "
                                           f"({len(s) / self.found[n]:.0%})" for n, s in out.items()))
        return out

    # ------------------------------------------------------------------ reward
    def extract(self, response: str) -> str | None:
        """The answer a response states, as reasoning-gym's examples take it: the last ``<answer>...</answer>``."""
        return _rg().utils.extract_answer(response, tag_name="answer")

    def reward(self, prompt: Prompt, response: str) -> float:
        name = prompt.meta["dataset"]
        return float(self.eval_ds[name].score_answer(self.extract(response), prompt.meta["entry"]))

    def answer_key(self, prompt: Prompt, response: str) -> str | None:
        answer = self.extract(response)
        return answer.strip() if answer and answer.strip() else None

    # ------------------------------------------------------------------ a tiny policy from scratch
    def corpus(self) -> list[str]:
        rng = random.Random(f"corpus-{self.seed}")
        return [p.text + demo_response(p.answer) for p in (self._draw(rng) for _ in range(2000))]

    def demonstrations(self, n: int, seed: int) -> list[tuple[str | Prompt, str]]:
        rng = random.Random(f"demo-{self.seed}-{seed}")
        return [(p, demo_response(p.answer)) for p in (self._draw(rng) for _ in range(n))]


def demo_response(answer: str) -> str:
    """A demonstration's response: the answer in reasoning-gym's tags (a tiny policy has no thinking to show)."""
    return f"<answer>{answer}</answer>"
