"""Multi-turn text environments behind a Gymnasium-style protocol: skyrl-gym's (PyPI ``skyrl-gym``; ``pip install
-e ".[envs]"``), on data in SkyRL's own layout.

``task=text_env task.data_dir=DIR``: ``DIR/train.parquet`` and ``DIR/validation.parquet`` as SkyRL's dataset scripts
write them (``examples/gsm8k/gsm8k_dataset.py`` and its multi-turn variant): each row a ``prompt`` (chat messages),
an ``env_class`` (a skyrl-gym environment id), a ``reward_spec`` (``ground_truth``), ``extra_info`` and
``data_source``. The row itself is the environment's ``extras``, as SkyRL's generator passes it.

An episode, as SkyRL runs one: ``env = skyrl_gym.make(env_class, env_config=..., extras=row)``, ``env.init(prompt)``;
then each policy turn is ``env.step(turn text)``, which answers ``observations`` (chat messages), a ``reward`` and
``done``. The task is an :class:`~ema_pg.tasks.env.Environment` (its ``reset`` makes and initialises the skyrl-gym
environment, its ``step`` calls it), so it runs as one's own environment does. Here:

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

import random
from pathlib import Path

from .base import Prompt
from .env import Environment, Step

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


def register_env(gym, name: str) -> None:
    """Make ``name`` an id skyrl-gym's ``make`` knows: one of its registry's, or one of your own, written
    ``module:Class`` (your ``BaseTextEnv`` subclass, registered here under that name) or ``module:id`` (the module
    that registers ``id`` when imported, imported here). Refused in one line naming the fix."""
    import importlib

    if name in gym.registry:
        return
    module, sep, attr = str(name).partition(":")
    if not sep:
        raise ValueError(f"env_class {name!r} is not a skyrl-gym environment (there are: {', '.join(sorted(gym.registry))});"
                         " for your own, write env_class as module:Class (your BaseTextEnv subclass) or module:id (the "
                         "module that registers it), in the data or as task.env_class")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the user's module: its error in one line
        raise ValueError(f"env_class {name!r}: importing {module} raised {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}; install its package or put it on PYTHONPATH") \
            from None
    if attr in gym.registry:  # the module registered its environment under this id
        gym.register(id=name, entry_point=gym.registry[attr].entry_point, kwargs=dict(gym.registry[attr].kwargs))
        return
    cls = getattr(mod, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, gym.Env)):
        raise ValueError(f"env_class {name!r}: {module} has no skyrl-gym environment class or registered id {attr!r}; "
                         "subclass skyrl_gym.envs.base_text_env.BaseTextEnv")
    gym.register(id=name, entry_point=name)


class TextEnvTask(Environment):
    name = "text_env"

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
        self.env_class, self.env_config, self.max_turns = env_class, dict(env_config or {}), max_turns
        self.train_set = self._load(d / FILES[0], "train")
        evals: dict[str, list[Prompt]] = {}
        for p in self._load(d / FILES[1], "validation"):
            evals.setdefault(p.meta["data_source"], []).append(p)
        self.eval_sets = evals
        for name in sorted({p.meta["env_class"] for p in self.train_set + [q for v in evals.values() for q in v]}):
            register_env(gym, name)

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
    def episode_name(self, prompt: Prompt) -> str:
        return f"environment {prompt.meta['env_class']} (row {prompt.meta['row']} of {prompt.meta['split']})"

    def reset(self, prompt: Prompt):
        """A fresh skyrl-gym environment for ``prompt``'s episode, initialised with its prompt."""
        env = _gym().make(prompt.meta["env_class"], env_config=self.env_config, extras=prompt.meta["extras"])
        env.init(prompt.messages)
        return env

    def step(self, env, turn: str) -> Step:
        out = env.step(turn)
        if not isinstance(out, dict):
            return out  # named by the check: not a Step
        obs = "".join(self.observation_format.format(role=m.get("role", "user"), content=m.get("content", ""))
                      for m in (out.get("observations") or []))
        return Step(observation=obs, reward=out.get("reward"), done=bool(out.get("done")))
