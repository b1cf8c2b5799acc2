"""Your own multi-turn environment: a task whose episodes take turns (docs/byo.md, "Your own multi-turn environment").

A subclass of :class:`Environment` is a task (reached by ``task=custom task.target=...`` or an entry point, checked at
start, trained and evaluated as any task is) that also says how an episode goes::

    class GuessTask(Environment):
        turn_end = "</guess>"                       # the text that ends a policy turn

        def sample(self, n, seed): ...              # prompts, as any task's
        def eval_splits(self): ...
        def reset(self, prompt):                    # an episode's start: any state object (copied with deepcopy)
            return {"secret": int(prompt.answer), "turns": 0}
        def step(self, state, turn):                # one policy turn: the state changed in place, and the answer
            ...
            return Step(observation=" higher\\n", reward=0.0, done=False)

An episode, as the sampler runs it: each row of a batch samples until ``turn_end`` (or its end-of-sequence token,
or its token budget); the row's :meth:`Environment.step` answers the turn; unless the step is ``done``, its
``observation`` goes into the sequence as text with loss mask 0 (no policy loss, no KL) and the row samples its
next turn. The episode ends at ``done``, at the end-of-sequence token, or at ``rollout.max_new_tokens``.

**The reward** is the episode's return, the sum of its turns' rewards, the final turn's included (the text after
the last observation, ended by EOS or the budget, is stepped too). It is computed by replaying the episode from its
text in a fresh state (:meth:`Environment.replay`), so that a reward is a function of (prompt, response) in any
process, as every task's is: ``step`` must answer the same turn in the same state the same way.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass
from typing import Any

from .base import Prompt, Task, TaskError


ENV_METHODS = ("reset", "step")  #: what an :class:`Environment` writes besides a task's prompts


@dataclass(frozen=True)
class Step:
    """An environment's answer to one policy turn."""

    observation: str  #: the text that goes into the sequence after the turn (loss mask 0); ignored when ``done``
    reward: float  #: this turn's reward; the episode's reward is the sum over its turns
    done: bool  #: the episode ends after this turn


class Environment(Task):
    """A multi-turn task: :meth:`reset` and :meth:`step` besides a task's prompts (:meth:`sample`,
    :meth:`eval_splits`); :meth:`reward` is the episode's return, replayed from its text."""

    turn_end: str = ""  #: the text that ends a policy turn: the sampler pauses each row there for :meth:`step`
    metric = "return"  #: the mean episode return

    # ---------------------------------------------------------------- required
    def reset(self, prompt: Prompt) -> Any:
        """The state of a new episode that answers ``prompt`` (any object; :meth:`replay` copies it with
        ``copy.deepcopy`` to try a turn)."""
        raise NotImplementedError

    def step(self, state: Any, turn: str) -> Step:
        """The environment's answer to one policy turn (its text, ``turn_end`` included where the turn ended there);
        changes ``state`` in place."""
        raise NotImplementedError

    # ---------------------------------------------------------------- provided
    @property
    def turn_ends(self) -> tuple[str, ...]:
        return (self.turn_end,) if self.turn_end else ()

    def episode_name(self, prompt: Prompt) -> str:
        """How an error names the episode (its environment and prompt)."""
        return f"environment {type(self).__name__} (prompt {prompt.text[:40]!r})"

    def _fault(self, prompt: Prompt, what: str, e: BaseException | str) -> TaskError:
        why = e if isinstance(e, str) else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return TaskError(f"{self.episode_name(prompt)} {what}: {why}")

    def _reset(self, prompt: Prompt):
        try:
            return self.reset(prompt)
        except TaskError:
            raise
        except Exception as e:  # noqa: BLE001 - the environment's own error, as one line naming it
            raise self._fault(prompt, "could not start", e) from None

    def _step(self, state, prompt: Prompt, turn: str) -> tuple[float, bool, str]:
        """(reward, done, observation) of one turn, the environment's answer checked."""
        try:
            out = self.step(state, turn)
        except TaskError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._fault(prompt, f"raised on turn {turn[:40]!r}", e) from None
        return self._checked(out, prompt, turn)

    def _checked(self, out, prompt: Prompt, turn: str) -> tuple[float, bool, str]:
        cls = type(self).__name__
        if not isinstance(out, Step):
            raise self._fault(prompt, f"returned {type(out).__name__} {str(out)[:40]} on turn {turn[:40]!r}",
                              f"{cls}.step returns ema_pg.tasks.Step(observation, reward, done)")
        r, obs = out.reward, out.observation
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r)):
            raise self._fault(prompt, f"returned reward {r!r} ({type(r).__name__}) on turn {turn[:40]!r}",
                              "a reward is a finite float")
        if not isinstance(obs, str):
            raise self._fault(prompt, f"returned observation {obs!r} ({type(obs).__name__}) on turn {turn[:40]!r}",
                              "an observation is text ('' for none)")
        return float(r), bool(out.done), obs

    def on_stop_fn(self, prompts: list[Prompt], n: int):
        """The live episodes of one batch: row r's state is made at its first turn end."""
        states: dict[int, Any] = {}

        def on_stop(rows: list[int], texts: list[str]) -> list[str | None]:
            out: list[str | None] = []
            for row, text in zip(rows, texts):
                p = prompts[row // n]
                if row not in states:
                    states[row] = self._reset(p)
                _, done, obs = self._step(states[row], p, text)
                out.append(None if done else obs)
            return out

        return on_stop

    def replay(self, prompt: Prompt, response: str) -> list[tuple[str, float, bool, str]]:
        """The episode of ``response`` turn by turn from a fresh state: [(turn, reward, done, observation)].

        The sampler ends a turn at the first token after which the turn's text ends with ``turn_end``; a token may
        hold ``turn_end`` inside it, so the text alone does not say which occurrence ended the turn. The one that
        did is the first that the environment's answer to it follows in the response (the observation the sampler
        put there; or nothing, where the episode ended or the budget ran out inside it): each occurrence is tried
        on a copy of the state. A response with no such occurrence left is the final turn, whole."""
        state, rest, turns = self._reset(prompt), response, []
        while True:
            for cut in _occurrences(rest, self.turn_end) if self.turn_end else ():
                turn = rest[: cut + len(self.turn_end)]
                after = rest[len(turn):]
                trial = copy.deepcopy(state)
                r, done, obs = self._step(trial, prompt, turn)
                ends = not after or (not done and obs.startswith(after))  # the response ends here or inside obs
                if ends or (not done and after.startswith(obs)):
                    turns.append((turn, r, done, obs))
                    if ends:
                        return turns
                    state, rest = trial, after[len(obs):]
                    break
            else:
                r, done, obs = self._step(state, prompt, rest)
                turns.append((rest, r, done, obs))
                return turns

    def played(self, prompt: Prompt, turns: list[str]) -> str:
        """The response of an episode whose policy turns are ``turns``, each followed by the environment's
        observation until a step is ``done``: a demonstration's response for the cold start (write
        :meth:`demonstrations` with it). Its observations get no SFT loss (:meth:`masked_spans`)."""
        state, text, spans = self._reset(prompt), "", []
        for turn in turns:
            text += turn
            _, done, obs = self._step(state, prompt, turn)
            if done:
                break
            spans.append((len(text), len(text) + len(obs)))
            text += obs
        self.__dict__.setdefault("_played", {})[text] = spans
        return text

    def masked_spans(self, response: str) -> list[tuple[int, int]]:
        """The observations of a response :meth:`played` wrote (none for any other text)."""
        return self.__dict__.get("_played", {}).get(response, [])

    def _episode(self, prompt: Prompt, response: str) -> list[tuple[str, float, bool, str]]:
        """:meth:`replay`, once per (prompt, response): evaluation asks the reward and the diagnostics of one text."""
        last = self.__dict__.get("_last_episode")
        if last is None or last[0] is not prompt or last[1] != response:  # the prompt object itself: its meta counts
            self._last_episode = (prompt, response, self.replay(prompt, response))
        return self._last_episode[2]

    def reward(self, prompt: Prompt, response: str) -> float:
        return sum(r for _, r, _, _ in self._episode(prompt, response))

    def diagnostics(self, prompt: Prompt, response: str) -> dict[str, float]:
        return {"turns": float(len(self._episode(prompt, response)))}


def _occurrences(text: str, sub: str):
    """The start of every occurrence of ``sub`` in ``text``, in order."""
    i = text.find(sub)
    while i >= 0:
        yield i
        i = text.find(sub, i + 1)
