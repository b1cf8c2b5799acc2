"""Toy task: multi-digit addition with an exact reward.

Prompt ``"37+58="``, correct response ``"95"`` followed by end-of-sequence; reward 1.0 for
the exact sum, else 0.0 (whitespace ignored). With ``reverse_answer`` (the default) the sum is
written least-significant digit first (``"59"``), the order in which carries are computed: a
tiny causal model learns it in minutes on a CPU, while most-significant-first stays near
chance for thousands of SFT steps. Operand pairs are split into train and held-out
eval sets by a hash, so eval prompts never appear in training or in the cold-start data.
"""

from __future__ import annotations

import functools
import hashlib
import random

from .base import Prompt, Task


EXACT_POOL = 250_000  #: up to this many operand pairs the held-out ones are counted; above, their expected number


def _held_out(a: int, b: int, mod: int) -> bool:
    h = hashlib.blake2b(f"{a}+{b}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") % mod == 0


@functools.lru_cache(maxsize=16)
def _heldout_count(lo: int, hi: int, mod: int) -> tuple[int, bool]:
    """(held-out operand pairs, whether counted exactly rather than expected)."""
    n = hi - lo + 1
    if n * n > EXACT_POOL:
        return n * n // mod, False
    return sum(_held_out(a, b, mod) for a in range(lo, hi + 1) for b in range(lo, hi + 1)), True


class AdditionTask(Task):
    name = "toy_add"

    def __init__(self, *, digits: int, eval_size: int, heldout_mod: int, reverse_answer: bool, seed: int):
        if digits < 1 or digits > 6:
            raise ValueError(f"task.digits must be in [1, 6]; got {digits}")
        if heldout_mod < 2:  # 1 would hold every pair out and leave nothing to train on (the draw never ends)
            raise ValueError(f"task.heldout_mod must be >= 2 (1 in heldout_mod operand pairs is held out); got {heldout_mod}")
        if eval_size < 1:
            raise ValueError(f"task.eval_size must be >= 1; got {eval_size}")
        self.digits, self.eval_size, self.heldout_mod, self.seed = digits, eval_size, heldout_mod, seed
        self.reverse_answer = reverse_answer
        self.lo, self.hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
        pool, exact = _heldout_count(self.lo, self.hi, heldout_mod)  # the eval split is drawn without replacement:
        limit = pool if exact else pool // 2  # it must fit (an expected count with room to spare)
        if eval_size > limit:
            raise ValueError(f"task.eval_size={eval_size} distinct held-out prompts are too many: task.digits={digits} "
                             f"with task.heldout_mod={heldout_mod} holds out {pool} operand pairs; "
                             + (f"give task.eval_size <= {limit}, " if limit >= 1 else "")
                             + "a smaller heldout_mod or more digits")

    def _heldout(self, a: int, b: int) -> bool:
        return _held_out(a, b, self.heldout_mod)

    def heldout_pool(self) -> int:
        """How many operand pairs are held out: counted up to EXACT_POOL pairs, else expected."""
        return _heldout_count(self.lo, self.hi, self.heldout_mod)[0]

    def _prompt(self, a: int, b: int) -> Prompt:
        ans = str(a + b)[::-1] if self.reverse_answer else str(a + b)
        return Prompt(text=f"{a}+{b}=", answer=ans, meta={"a": a, "b": b})

    def _draw(self, rng: random.Random, heldout: bool) -> Prompt:
        while True:
            a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
            if self._heldout(a, b) == heldout:
                return self._prompt(a, b)

    def sample(self, n: int, seed: int) -> list[Prompt]:
        rng = random.Random(f"train-{self.seed}-{seed}")
        return [self._draw(rng, heldout=False) for _ in range(n)]

    def eval_splits(self) -> dict[str, list[Prompt]]:
        """``eval_size`` distinct held-out prompts (a repeat of the draw is skipped, so n counts distinct ones)."""
        rng = random.Random(f"eval-{self.seed}")
        out, seen = [], set()
        while len(out) < self.eval_size:
            p = self._draw(rng, heldout=True)
            if p.text not in seen:
                seen.add(p.text)
                out.append(p)
        return {"heldout": out}

    def reward(self, prompt: Prompt, response: str) -> float:
        return float(response.strip() == prompt.answer)

    def corpus(self) -> list[str]:
        rng = random.Random(f"corpus-{self.seed}")
        return [p.text + p.answer for p in (self._draw(rng, heldout=False) for _ in range(2000))]

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(f"demo-{self.seed}-{seed}")
        return [(p.text, p.answer) for p in (self._draw(rng, heldout=False) for _ in range(n))]
