"""Multi-turn text environments behind a Gymnasium-style protocol: skyrl-gym's (PyPI ``skyrl-gym``; ``pip install
-e ".[envs]"``), on data in SkyRL's own layout.

``task=text_env task.data_dir=DIR``: ``DIR/train.parquet`` and ``DIR/validation.parquet`` as SkyRL's dataset scripts
write them (``examples/gsm8k/gsm8k_dataset.py`` and its multi-turn variant): each row a ``prompt`` (chat messages),
an ``env_class`` (a skyrl-gym environment id), a ``reward_spec`` (``ground_truth``), ``extra_info`` and
``data_source``. The row itself is the environment's ``extras``, as SkyRL's generator passes it.

An episode, as SkyRL runs one: ``env = skyrl_gym.make(env_class, env_config=..., extras=row)``, ``env.init(prompt)``;
then each policy turn is ``env.step(turn text)``, which answers ``observations`` (chat messages), a ``reward`` and
``done``. Here:

- **a turn ends** at ``task.turn_end`` (a stop string the sampler pauses at; the episode itself ends at the
  end-of-sequence token, at ``done``, or at the response budget);
- **the observations** go into the sequence as text, each message by ``task.observation_format`` (``{role}``,
  ``{content}``), with loss mask 0, as the search task's passages do; one longer than
  ``rollout.max_obs_tokens`` is cut by the sampler, and the replay then stops the run with the episode and
  the environment named (after the episode ran, where a later turn follows the cut observation);
- **the reward** is the episode's return, the sum of its turns' rewards (SkyRL puts each turn's reward on that
  turn's last token; a scalar per episode is what GRPO's group advantage takes). :meth:`TextEnvTask.reward`
  replays the episode from its text in a fresh environment (turns split at ``turn_end``, the final turn being
  whatever follows the last observation), so it is a function of (prompt, response) as every task's reward is,
  in any process; an environment that answers a replay otherwise than the live episode is named.
"""

from __future__ import annotations

import math
import numbers
import random
from pathlib import Path

from .base import Prompt, Task, TaskError

FILES = ("train.parquet", "validation.parquet")  #: SkyRL's dataset scripts' two files


def _gym():
    try:
        import skyrl_gym
    except ImportError:
        raise ValueError("task=text_env needs the skyrl-gym package: pip install -e \".[envs]\" "
                         "(or pip install skyrl-gym)") from None
    return skyrl_gym


def _plain(v):
    """A parquet cell as plain Python (numpy arrays and scalars inside lists and dicts made lists and numbers)."""
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        v = v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


class TextEnvTask(Task):
    name = "text_env"
    metric = "return"  #: the mean episode return (the sum of its turns' rewards)

    def __init__(self, *, data_dir: str | None, env_class: str | None, env_config: dict | None, turn_end: str,
                 observation_format: str, max_turns: int | None, seed: int):
        gym = _gym()
        if not data_dir:
            raise ValueError("task=text_env needs task.data_dir: a folder with SkyRL's train.parquet and "
                             "validation.parquet (python -m ema_pg.byo writes an example: examples/byo/skyrl_gsm8k)")
        d = Path(data_dir).expanduser()
        if missing := [f for f in FILES if not (d / f).is_file()]:
            raise ValueError(f"task.data_dir={data_dir}: no {', '.join(missing)}; SkyRL's dataset scripts write "
                             f"{' and '.join(FILES)}")
        if not turn_end:
            raise ValueError("task.turn_end is empty; give the text that ends a policy turn (e.g. '</answer>')")
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"task.max_turns={max_turns!r}: give a whole number >= 1 (the turns an episode may take), "
                             "or null for each row's own")
        try:
            observation_format.format(role="user", content="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"task.observation_format={observation_format!r}: {e}; use {{role}} and {{content}}") \
                from None
        self.turn_end, self.observation_format, self.seed = turn_end, observation_format, seed
        self._last: tuple = (None, None)  # the last episode replayed: (key, turns)
        self.env_class, self.env_config, self.max_turns = env_class, dict(env_config or {}), max_turns
        self.train_set = self._load(d / FILES[0], "train")
        evals: dict[str, list[Prompt]] = {}
        for p in self._load(d / FILES[1], "validation"):
            evals.setdefault(p.meta["data_source"], []).append(p)
        self.eval_sets = evals
        envs = sorted({p.meta["env_class"] for p in self.train_set + [q for v in evals.values() for q in v]})
        if unknown := [e for e in envs if e not in gym.registry]:
            raise ValueError(f"env_class {unknown[0]!r} is not a skyrl-gym environment (there are: "
                             f"{', '.join(sorted(gym.registry))}); fix the data's env_class or give task.env_class")

    def _load(self, f: Path, split: str) -> list[Prompt]:
        import pandas as pd

        df = pd.read_parquet(f)
        if missing := [c for c in ("prompt", "reward_spec") if c not in df.columns] + (
                [] if "env_class" in df.columns or self.env_class else ["env_class"]):
            raise ValueError(f"{f}: no column {', '.join(missing)} (SkyRL's layout: prompt, env_class, reward_spec, "
                             "extra_info, data_source)")
        out = []
        for i, row in enumerate(df.to_dict("records")):
            row = {k: _plain(v) for k, v in row.items()}
            if self.max_turns is not None:
                row["max_turns"] = int(self.max_turns)  # the generator's override, as SkyRL passes it
            messages = row.pop("prompt")
            if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and "content" in m
                                                                    for m in messages)):
                raise ValueError(f"{f}: row {i}'s prompt is {str(messages)[:60]!r}; SkyRL's prompt is a list of chat "
                                 "messages, [{role: user, content: ...}, ...]")
            if not any(m.get("role") == "user" and str(m["content"]).strip() for m in messages):
                raise ValueError(f"{f}: row {i}'s prompt has no user message with text; give each row the question "
                                 "as a user message")
            env_class = self.env_class or row.get("env_class")
            gold = (row.get("reward_spec") or {}).get("ground_truth")
            out.append(Prompt(text="\n\n".join(str(m["content"]) for m in messages), answer=str(gold), messages=messages,
                              meta={"env_class": env_class, "extras": row, "row": i, "split": split,
                                    "data_source": str(row.get("data_source") or "validation")}))
        if not out:
            raise ValueError(f"{f}: no rows")
        return out

    # ------------------------------------------------------------------ prompts
    def sample(self, n: int, seed: int) -> list[Prompt]:
        rng = random.Random(f"text-env-{self.seed}-{seed}")
        return [rng.choice(self.train_set) for _ in range(n)]

    def eval_splits(self) -> dict[str, list[Prompt]]:
        return self.eval_sets

    # ------------------------------------------------------------------ episodes
    def _env(self, prompt: Prompt):
        """A fresh environment for ``prompt``'s episode, initialised with its prompt."""
        try:
            env = _gym().make(prompt.meta["env_class"], env_config=self.env_config, extras=prompt.meta["extras"])
            env.init(prompt.messages)
        except Exception as e:  # noqa: BLE001 - the environment's own error, as one line naming it
            raise self._fault(prompt, "could not start", e) from None
        return env

    def _fault(self, prompt: Prompt, what: str, e: BaseException | str) -> TaskError:
        why = e if isinstance(e, str) else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return TaskError(f"environment {prompt.meta['env_class']} (row {prompt.meta['row']} of {prompt.meta['split']}) "
                         f"{what}: {why}")

    def _step(self, env, prompt: Prompt, turn: str) -> tuple[float, bool, str]:
        """(reward, done, the observation text) of one turn, the environment's answer checked."""
        try:
            out = env.step(turn)
        except Exception as e:  # noqa: BLE001
            raise self._fault(prompt, f"raised on turn {turn[:40]!r}", e) from None
        r = out.get("reward") if isinstance(out, dict) else None
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r)):
            raise self._fault(prompt, f"returned reward {r!r} ({type(r).__name__}) on turn {turn[:40]!r}",
                              "a reward is a finite float")
        obs = "".join(self.observation_format.format(role=m.get("role", "user"), content=m.get("content", ""))
                      for m in (out.get("observations") or []))
        return float(r), bool(out.get("done")), obs

    def on_stop_fn(self, prompts: list[Prompt], n: int):
        """The live episodes of one batch: row r's environment is made at its first turn end."""
        envs: dict[int, object] = {}

        def on_stop(rows: list[int], texts: list[str]) -> list[str | None]:
            out: list[str | None] = []
            for row, text in zip(rows, texts):
                p = prompts[row // n]
                if row not in envs:
                    envs[row] = self._env(p)
                _, done, obs = self._step(envs[row], p, text)
                out.append(None if done else obs)
            return out

        return on_stop

    def replay(self, prompt: Prompt, response: str) -> list[tuple[str, float, bool, str]]:
        """The episode of ``response`` turn by turn in a fresh environment: [(turn, reward, done, observation)].

        The sampler ends a turn at the first token after which the turn's text ends with ``turn_end``; a token may
        hold ``turn_end`` inside it, so the text alone does not say which occurrence ended the turn. The one that
        did is the first that the environment's answer to it follows in the response (the observation the sampler
        put there; or nothing, where the episode ended or the budget ran out inside it): each occurrence is tried
        on a copy of the environment. A response with no such occurrence left is the final turn, whole."""
        import copy

        env, rest, turns = self._env(prompt), response, []
        while True:
            for cut in _occurrences(rest, self.turn_end):
                turn = rest[: cut + len(self.turn_end)]
                after = rest[len(turn):]
                trial = copy.deepcopy(env)
                r, done, obs = self._step(trial, prompt, turn)
                ends = not after or (not done and obs.startswith(after))  # the response ends here or inside obs
                if ends or (not done and after.startswith(obs)):
                    turns.append((turn, r, done, obs))
                    if ends:
                        return turns
                    env, rest = trial, after[len(obs):]
                    break
            else:
                r, done, obs = self._step(env, prompt, rest)
                turns.append((rest, r, done, obs))
                return turns

    def _episode(self, prompt: Prompt, response: str) -> list[tuple[str, float, bool, str]]:
        """:meth:`replay`, once per (row, response): evaluation asks the reward and the diagnostics of one text."""
        key = (prompt.meta["split"], prompt.meta["row"], response)
        if self._last[0] != key:
            self._last = (key, self.replay(prompt, response))
        return self._last[1]

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
