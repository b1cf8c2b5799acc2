"""reasoning-gym's procedurally generated tasks (PyPI ``reasoning-gym``; ``pip install -e ".[envs]"``).

``task=reasoning_gym`` trains on a weighted mixture of its datasets, each with its own config, and evaluates on one
held-out split per dataset:

- **a question** is ``dataset[idx]`` of a dataset built with ``seed`` and its config: reasoning-gym draws item
  ``idx`` from ``Random(seed + idx)``. Training draws ``idx`` in ``[0, 2^31)`` of a dataset seeded
  ``task.seed * 2^33``; evaluation takes the first ``eval_size`` distinct questions of items 0, 1, ... of one seeded
  ``task.seed * 2^33 + 2^32``, so no training prompt comes from an evaluation seed. A training draw whose question an evaluation split asks is
  drawn again, so none is asked in training either (a small config can repeat a question under two seeds).
- **the reward** is the dataset's own ``score_answer(answer, entry)``, with the answer taken as reasoning-gym's own
  examples take it (``reasoning_gym.utils.extract_answer``: the last ``<answer>...</answer>``; no tag scores 0).
- **the prompt** is the question; with a chat template the system prompt is reasoning-gym's
  ``SYSTEM_PROMPTS[task.system_prompt]`` (``default`` asks for ``<think>`` and ``<answer>`` tags), ``none`` for none.
- **the cold start** of a tiny policy trained from scratch: demonstrations ``<answer>{answer}</answer>`` of
  training questions.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import random

from .base import Prompt, Task

TRAIN_SPAN = 2**31  #: the training draws' item indices, [0, TRAIN_SPAN)
SEED_STRIDE = 2**33  #: task.seed's region of reasoning-gym seeds: training at its start, evaluation 2^32 after
EVAL_OFFSET = 2**32
EVAL_TRIES = 20  #: an evaluation split of n distinct questions looks at most this many times n items
DRAW_TRIES = 1000  #: a training draw looks at most this many items for a question no split holds out


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
        self.seed, self.eval_size, self.system_prompt = seed, eval_size, system_prompt
        base = seed * SEED_STRIDE
        self.train_ds = {n: _dataset(n, c, base, TRAIN_SPAN) for n, (_, c) in self.mixture.items()}
        self.eval_ds = {n: _dataset(n, c, base + EVAL_OFFSET, EVAL_TRIES * eval_size) for n, (_, c) in self.mixture.items()}
        self.names = [n for n, (w, _) in self.mixture.items() if w > 0]  # drawn in training
        self.weights = [self.mixture[n][0] for n in self.names]
        self._heldout = {p.text for split in self.eval_splits().values() for p in split}
        self._draw(random.Random(f"probe-{seed}"))  # a config whose every question is held out, refused now

    # ------------------------------------------------------------------ prompts
    def _prompt(self, name: str, entry: dict, idx: int, split: str) -> Prompt:
        q = entry["question"]
        messages = None
        if self.system_prompt != "none":
            messages = [{"role": "system", "content": _rg().utils.SYSTEM_PROMPTS[self.system_prompt]},
                        {"role": "user", "content": q}]
        return Prompt(text=q, answer=str(entry["answer"]), messages=messages,
                      meta={"dataset": name, "index": idx, "split": split, "entry": entry})

    def _draw(self, rng: random.Random) -> Prompt:
        for _ in range(DRAW_TRIES):
            name = rng.choices(self.names, weights=self.weights)[0]
            idx = rng.randrange(TRAIN_SPAN)
            entry = self.train_ds[name][idx]
            if entry["question"] not in self._heldout:
                return self._prompt(name, entry, idx, "train")
        raise ValueError(f"task.eval_size={self.eval_size} holds out every question of {', '.join(self.names)} "
                         f"({DRAW_TRIES} training draws found none left to train on); lower task.eval_size or "
                         "widen its config")

    def sample(self, n: int, seed: int) -> list[Prompt]:
        rng = random.Random(f"train-{self.seed}-{seed}")
        return [self._draw(rng) for _ in range(n)]

    @functools.cache  # one task object per run; its splits are asked for many times
    def eval_splits(self) -> dict[str, list[Prompt]]:
        """One split per dataset of the mixture (a weight of 0 too: held out, never trained on): the first
        ``eval_size`` distinct questions of its evaluation seed (items 0, 1, ... with a repeat skipped)."""
        out = {}
        for name, ds in self.eval_ds.items():
            seen, split = set(), []
            for i in range(EVAL_TRIES * self.eval_size):
                entry = ds[i]
                if entry["question"] not in seen:
                    seen.add(entry["question"])
                    split.append(self._prompt(name, entry, i, "eval"))
                    if len(split) == self.eval_size:
                        break
            else:
                raise ValueError(f"task.eval_size={self.eval_size}: {name}'s config asks only {len(split)} distinct "
                                 f"questions in {EVAL_TRIES * self.eval_size} draws; lower task.eval_size or widen "
                                 "its config")
            out[name] = split
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
