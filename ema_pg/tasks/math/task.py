"""Math reasoning with a chain of thought and a ``\\boxed{}`` answer (Table 3's setting, in miniature).

**The synthetic world** (the default). A problem is a start value and a chain of operations
(``+n``, ``-n`` with n in 1..9, ``*n`` with n in 2..4; every value stays in 0..99), stated in
one of two phrasings, and a solution works through it one step per line::

    Start with 7. Add 5. Multiply by 3. Subtract 4.
    7+5=12
    12*3=36
    36-4=32
    \\boxed{32}

The "story" phrasing states the same chain in words ("Ann has 7 coins. She finds 5 more. ...").
Difficulty is the number of steps: an error at any step carries to the answer, so accuracy falls
with the chain's length as it falls from MATH500 to AIME for a real model. Six held-out splits
stand in for the paper's six benchmarks (Table 3), ordered as the base model's scores order them:

====================  =========  ==========================================
paper benchmark        split      problems
====================  =========  ==========================================
MATH500                math500    2 steps
AMC 2024               amc        3 steps
OlympiadBench (text)   olympiad   4 steps
AIME 2024              aime24     5 steps
Minerva                minerva    5 steps, story phrasing (a reading step)
AIME 2025              aime25     6 steps
====================  =========  ==========================================

Training problems have 1 to ``max_steps`` steps, both phrasings; a problem is held out for
evaluation by a hash of its text, so no eval problem is ever trained on. The cold start imitates
an imperfect teacher ("distilled" from a model that slips): at each step of a demonstration the
teacher writes a wrong result with probability ``demo_error_rate`` and carries it on, and SFT
stops once the greedy reward on training prompts reaches ``sft.stop_at_reward``.

**Real data** (``task.data_dir=DIR``, ``task.splits`` to name files): DeepScaleR's raw JSON, DeepScaleR's and
verl's parquet, the authors' rLLM registry layout (:mod:`ema_pg.tasks.math.data`). A row with a list of gold
answers is right when any is; verl's GSM8K rows are scored as verl scores them (``#### number``); rows with a
``solution`` give cold-start demonstrations. Rewards use the same math-verify check.
"""

from __future__ import annotations

import hashlib
import random

from ..base import Prompt, Task
from .verify import answer_key, gsm8k_answer, is_correct

#: eval split -> (steps, phrasing); the paper's benchmark each stands in for is in the module docstring
SPLITS = {"math500": (2, "plain"), "amc": (3, "plain"), "olympiad": (4, "plain"), "aime24": (5, "plain"),
          "minerva": (5, "story"), "aime25": (6, "plain")}
PAPER_NAMES = {"math500": "MATH500", "amc": "AMC 2024", "minerva": "Minerva", "aime24": "AIME 2024",
               "aime25": "AIME 2025", "olympiad": "OlympiadBench (text)"}  #: Table 3's row names

_PLAIN = {"+": "Add {n}.", "-": "Subtract {n}.", "*": "Multiply by {n}."}
_STORY = {"+": "She finds {n} more.", "-": "She spends {n}.", "*": "Her coins grow {n} times."}


def _apply(v: int, op: str, n: int) -> int:
    return v + n if op == "+" else v - n if op == "-" else v * n


def _draw_chain(rng: random.Random, steps: int) -> tuple[int, list[tuple[str, int]]]:
    v0 = rng.randint(1, 20)
    v, ops = v0, []
    for _ in range(steps):
        choices = [("+", n) for n in range(1, 10) if v + n <= 99] + [("-", n) for n in range(1, 10) if v - n >= 0]
        choices += [("*", n) for n in range(2, 5) if v * n <= 99] * 3  # as likely as + or - when possible
        op, n = rng.choice(choices)
        ops.append((op, n))
        v = _apply(v, op, n)
    return v0, ops


def problem_text(v0: int, ops: list[tuple[str, int]], phrasing: str) -> str:
    if phrasing == "story":
        return " ".join([f"Ann has {v0} coins."] + [_STORY[op].format(n=n) for op, n in ops]
                        + ["How many coins does she have?"])
    return " ".join([f"Start with {v0}."] + [_PLAIN[op].format(n=n) for op, n in ops])


def solution_text(v0: int, ops: list[tuple[str, int]], rng: random.Random | None = None, error_rate: float = 0.0) -> str:
    """One line per step and the boxed result; with ``rng``, each step is wrong with ``error_rate``
    (off by 1 to 3, never negative) and the chain goes on from the wrong value."""
    lines, v = [], v0
    for op, n in ops:
        w = _apply(v, op, n)
        if rng is not None and rng.random() < error_rate:
            w = max(0, w + rng.choice([-3, -2, -1, 1, 2, 3]))
        lines.append(f"{v}{op}{n}={w}")
        v = w
    return "\n".join(lines + [f"\\boxed{{{v}}}"])


class MathTask(Task):
    """``task=math``: the synthetic arithmetic-chain world, or DeepScaleR-style files with ``data_dir``."""

    name = "math"
    metric = "acc"

    def __init__(self, *, seed: int, max_steps: int, per_split: int, heldout_mod: int, story_share: float,
                 demo_error_rate: float, data_dir: str | None, splits: dict | None, prompt_template: str):
        if not 1 <= max_steps <= 8:
            raise ValueError(f"task.max_steps must be in [1, 8]; got {max_steps}")
        if per_split < 1:
            raise ValueError(f"task.per_split must be >= 1; got {per_split}")
        if heldout_mod < 2:
            raise ValueError(f"task.heldout_mod must be >= 2 (1 in heldout_mod problems is held out); got {heldout_mod}")
        if not 0.0 <= story_share <= 1.0 or not 0.0 <= demo_error_rate < 1.0:
            raise ValueError(f"task.story_share must be in [0, 1] and task.demo_error_rate in [0, 1); got "
                             f"{story_share}, {demo_error_rate}")
        if "{problem}" not in prompt_template:
            raise ValueError(f"task.prompt_template must contain {{problem}}; got {prompt_template!r}")
        self.seed, self.max_steps, self.per_split, self.heldout_mod = seed, max_steps, per_split, heldout_mod
        self.story_share, self.demo_error_rate, self.template, self.data_dir = story_share, demo_error_rate, prompt_template, data_dir
        if data_dir:
            from .data import load_math_dir

            self.train_set, self.eval_sets = load_math_dir(data_dir, prompt_template, splits)
        elif splits:
            raise ValueError("task.splits names files inside task.data_dir; set task.data_dir=DIR too")
        else:
            self.train_set = None
            rng = random.Random(f"math-eval-{seed}")
            self.eval_sets = {s: [self._draw(rng, steps, ph, heldout=True) for _ in range(per_split)]
                              for s, (steps, ph) in SPLITS.items()}

    # ------------------------------------------------------------------ the synthetic world
    def _heldout(self, text: str) -> bool:
        h = hashlib.blake2b(text.encode(), digest_size=4).digest()
        return int.from_bytes(h, "little") % self.heldout_mod == 0

    def _draw(self, rng: random.Random, steps: int, phrasing: str, heldout: bool) -> Prompt:
        while True:
            v0, ops = _draw_chain(rng, steps)
            text = problem_text(v0, ops, phrasing)
            if self._heldout(text) == heldout:
                v = v0
                for op, n in ops:
                    v = _apply(v, op, n)
                return Prompt(text=self.template.format(problem=text), answer=str(v),
                              meta={"v0": v0, "ops": ops, "steps": steps, "phrasing": phrasing, "problem": text})

    def _draw_train(self, rng: random.Random) -> Prompt:
        steps = rng.randint(1, self.max_steps)
        return self._draw(rng, steps, "story" if rng.random() < self.story_share else "plain", heldout=False)

    # ------------------------------------------------------------------ Task protocol
    def sample(self, n: int, seed: int) -> list[Prompt]:
        rng = random.Random(f"math-train-{self.seed}-{seed}")
        if self.train_set is not None:
            return [rng.choice(self.train_set) for _ in range(n)]
        return [self._draw_train(rng) for _ in range(n)]

    def eval_splits(self) -> dict[str, list[Prompt]]:
        return self.eval_sets

    def reward(self, prompt: Prompt, response: str) -> float:
        golds = prompt.meta.get("answers") or [prompt.answer]
        if prompt.meta.get("answer_format") == "####":  # verl's GSM8K rows: its strict check
            return float(gsm8k_answer(response) in golds)
        return float(any(is_correct(g, response) for g in golds))

    def answer_key(self, prompt: Prompt, response: str) -> str | None:
        return answer_key(response)

    def corpus(self) -> list[str]:
        if self.train_set is not None:
            return [p.text + p.meta.get("solution", "") for p in self.train_set]
        rng = random.Random(f"math-corpus-{self.seed}")
        out = []
        for _ in range(2000):
            p = self._draw_train(rng)
            out.append(p.text + solution_text(p.meta["v0"], p.meta["ops"]))
        return out + [p.text for v in self.eval_sets.values() for p in v]

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(f"math-demo-{self.seed}-{seed}")
        if self.train_set is not None:
            demos = [(p.text, p.meta["solution"]) for p in self.train_set if p.meta.get("solution")]
            if not demos:
                raise ValueError(f"task.data_dir={self.data_dir!r}: no row has a 'solution', so there is nothing to "
                                 "cold-start from; add solutions, or start from a trained model (model.path=DIR, sft.steps=0)")
            return [rng.choice(demos) for _ in range(n)]
        out = []
        for _ in range(n):
            p = self._draw_train(rng)
            out.append((p.text, solution_text(p.meta["v0"], p.meta["ops"], rng, self.demo_error_rate)))
        return out
