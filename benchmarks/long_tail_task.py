"""A task with a long-tailed response length, for benchmarks/partial_rollouts.py: the toy addition task whose
cold-start demonstrations follow the answers of the harder prompts (a sum of at least ``long_from``, about 15% of them
with two-digit operands) with a long working-out (``long_words`` words), so the policy trained on them writes long
responses to those prompts and short ones to the rest: as a reasoning model's lengths spread, by prompt, and a whole
group at once. The reward reads the answer alone (its first word).

    task=custom task.target=long_tail_task:LongTailAddition   (with benchmarks/ on PYTHONPATH)
"""

from __future__ import annotations

from ema_pg.tasks.base import Prompt
from ema_pg.tasks.toy import AdditionTask


class LongTailAddition(AdditionTask):
    name = "long_tail_add"
    format_version = 2  #: the demonstrations' layout: 2 = the working-out follows the harder prompts (1: a hash's 1 in 8)

    def __init__(self, *, long_from: int = 150, long_words: int = 40, digits: int = 2, eval_size: int = 64,
                 heldout_mod: int = 10, reverse_answer: bool = True, seed: int = 0):
        super().__init__(digits=digits, eval_size=eval_size, heldout_mod=heldout_mod, reverse_answer=reverse_answer,
                         seed=seed)
        self.long_from, self.long_words = long_from, long_words

    def _shown(self, p: Prompt) -> str:
        """The demonstration of ``p``: its answer, followed by a working-out when its sum is at least long_from."""
        a, b = (int(x) for x in p.text.rstrip("=").split("+"))
        if a + b < self.long_from:
            return p.answer
        digits = " ".join(p.answer)
        return p.answer + " so " + " ".join([digits] * (self.long_words // max(len(p.answer), 1)))

    def reward(self, prompt: Prompt, response: str) -> float:
        words = response.split()
        return float(bool(words) and words[0] == prompt.answer)

    def corpus(self) -> list[str]:
        return [text + self._shown(Prompt(text, ans)) for text, ans in super().demonstrations(2000, seed=-1)]

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        return [(text, self._shown(Prompt(text, ans))) for text, ans in super().demonstrations(n, seed)]
