"""The task interface: prompts in, rewards out. Tasks know nothing of models or training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Prompt:
    """One prompt: the text the policy sees and what its reward needs (``answer``, ``meta``)."""

    text: str
    answer: str
    meta: dict = field(default_factory=dict)


class Task(Protocol):
    name: str

    def sample(self, n: int, seed: int) -> list[Prompt]:
        """``n`` training prompts, a deterministic function of ``seed``."""

    def eval_splits(self) -> dict[str, list[Prompt]]:
        """Held-out evaluation prompts by split name."""

    def reward(self, prompt: Prompt, response: str) -> float:
        """Scalar reward of one response text (never raises on malformed text)."""

    def corpus(self) -> list[str]:
        """Text to train a tokenizer on."""

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        """(prompt, response) pairs for the supervised cold start."""
