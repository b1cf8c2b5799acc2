"""The task interface: prompts in, rewards out. Tasks know nothing of models or training.

:class:`Task` declares every feature a task may have. The required ones raise
NotImplementedError; the optional ones have defaults that mean "this task does not use it"
(single-turn, no masked demonstration text, ``em`` as the metric, no prompt-only baselines).
"""

from __future__ import annotations

import logging
import math
import numbers
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    """One prompt: what the policy is asked and what its reward needs (``answer``, ``meta``).

    ``text`` is the prompt as plain text; ``messages`` (optional) the same prompt as chat messages
    (``[{"role", "content"}, ...]``, a system message included), as real data stores it.
    :class:`ema_pg.prompts.PromptEncoder` renders either for the model's tokenizer."""

    text: str
    answer: str
    meta: dict = field(default_factory=dict)
    messages: list[dict] | None = None


def question_key(p: Prompt) -> tuple:
    """What makes two rows the same question: the prompt as asked and its gold answers."""
    return p.text, repr(p.messages), repr(p.answer), repr(p.meta.get("answers"))


def distinct_evals(evals: dict[str, list[Prompt]], where: str) -> dict[str, list[Prompt]]:
    """Each eval split with every question once (the first row of each): a copy would weigh its question twice in
    the split's mean. One log line names the splits that held copies."""
    out, dropped = {}, {}
    for name, prompts in evals.items():
        seen: set = set()
        out[name] = [p for p in prompts if not (question_key(p) in seen or seen.add(question_key(p)))]
        if len(out[name]) < len(prompts):
            dropped[name] = len(prompts) - len(out[name])
    if dropped:
        log.warning("%s: eval rows that repeat a question are counted once: %s", where,
                    ", ".join(f"{k} {n} of {len(evals[k])}" for k, n in dropped.items()))
    return out


def say_copies(train: list[Prompt], where: str) -> None:
    """One log line if training rows repeat (kept: a copy is sampled as often as its copies say)."""
    copies = len(train) - len({question_key(p) for p in train})
    if copies:
        log.warning("%s: %d of the %d training rows repeat another (kept: each copy is drawn as often as a row)",
                    where, copies, len(train))


class ServiceError(RuntimeError):
    """A service a task depends on (a retrieval server) failed; the message is one line naming it."""


FLOAT32_MAX = 3.4028234663852886e38  #: the largest |reward| a float32 rewards tensor holds


class TaskError(ValueError, ServiceError):
    """A task class that cannot serve the run (not importable, a method missing, a reward not a number); one line.
    At start-up it is a refusal (a ValueError); during a run a failing environment stops it as a failing service
    does (a ServiceError: the run keeps its last checkpoint)."""


class StoppedBySigterm(BaseException):
    """A SIGTERM while a task's own code ran (a reward, an environment's turns): the iteration cannot be saved half
    done, so the run ends as a SIGTERM'd one does (exit 75) and resumes from its last checkpoint. A BaseException,
    as KeyboardInterrupt is: no ``except Exception`` on the way up may take it for the task's failure."""


class _TimeUp(BaseException):
    pass


_inside = threading.local()


def limited(fn: Callable, seconds: float, late: Callable[[], Exception]):
    """``fn()`` under a time limit of ``seconds``: past it, the exception ``late()`` is raised. While it runs a SIGTERM
    is honoured at once (the handler in place, Lightning's, still hears of it; then :class:`StoppedBySigterm`): a
    user's code that never returns neither hangs the run nor deafens it. The main thread uses SIGALRM (a pure-Python
    loop and a sleep are both cut); another thread waits on a helper thread, which is left behind past the limit."""
    if getattr(_inside, "on", False) or not seconds or seconds <= 0:  # nested, or no limit asked for
        return fn()
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        box: dict = {}

        def call():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = e
        t = threading.Thread(target=call, daemon=True, name="ema_pg-limited")
        t.start()
        t.join(seconds)
        if t.is_alive():
            raise late()
        if "error" in box:
            raise box["error"]
        return box["value"]

    before = signal.getsignal(signal.SIGTERM)

    def alarm(signum, frame):
        raise _TimeUp

    def term(signum, frame):
        before(signum, frame)  # Lightning's flag, or the command's own line
        raise StoppedBySigterm

    old_alarm = signal.signal(signal.SIGALRM, alarm)
    if callable(before):  # a default or ignored SIGTERM keeps its own action
        signal.signal(signal.SIGTERM, term)
    _inside.on = True
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    except _TimeUp:
        raise late() from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _inside.on = False
        signal.signal(signal.SIGALRM, old_alarm)
        if callable(before):
            signal.signal(signal.SIGTERM, before)


def checked_reward(task: Task, prompt: Prompt, response: str) -> float:
    """``task.reward(prompt, response)`` as a float; a TaskError naming the task class and the episode when the
    reward raises or is not a finite number (every reward the workbench uses goes through here)."""
    cls = type(task).__name__
    episode = f"prompt {prompt.text[:60]!r} and response {response[:60]!r}"
    limit = task.reward_time_limit_s
    try:
        value = limited(lambda: task.reward(prompt, response), limit, lambda: TaskError(
            f"task {task.name or cls} ({cls}.reward) returned nothing in {limit:g} s on {episode}; a reward returns "
            f"in {cls}.reward_time_limit_s (set it higher on the class if it needs longer)"))
    except TaskError:
        raise
    except Exception as e:  # noqa: BLE001 - a reward "never raises on malformed text" (Task.reward)
        raise TaskError(f"task {task.name or cls} ({cls}.reward) raised {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''} on {episode}; a reward never raises on "
                        "malformed text: return 0.0 for it") from None
    if isinstance(value, bool):  # a number to Python, but a verdict, not a reward's scale: said, not taken
        raise TaskError(f"task {task.name or cls} ({cls}.reward) returned {value!r} (bool) for {episode}; a reward is "
                        f"a finite float: return float({value!r}) in {cls}.reward if that is what you mean")
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):  # numpy's numbers too
        if abs(float(value)) > FLOAT32_MAX:  # the rewards' tensor would hold inf
            raise TaskError(f"task {task.name or cls} ({cls}.reward) returned {float(value):g} for {episode}: past "
                            f"float32's range, the rewards' dtype; scale {cls}.reward's values (near [-1, 1])")
        return float(value)
    raise TaskError(f"task {task.name or cls} ({cls}.reward) returned {value!r} ({type(value).__name__}) for "
                    f"{episode}; a reward is a finite float: fix {cls}.reward")


def sampled(task: Task, n: int, seed: int) -> list[Prompt]:
    """``task.sample(n, seed=seed)``, holding exactly ``n`` prompts: a TaskError naming the class otherwise (the run
    would train on another number of prompts than it says)."""
    got = task.sample(n, seed=seed)
    if isinstance(got, (list, tuple)) and len(got) != n:
        cls = type(task).__name__
        raise TaskError(f"task {task.name or cls}: {cls}.sample({n}, seed={seed}) returned {len(got)} prompts; return "
                        f"exactly n (an iteration trains on algo.prompts_per_step prompts)")
    return got


def bad_prompt(p: Prompt) -> str | None:
    """What is wrong with a prompt's fields, in words; None when nothing is."""
    if not isinstance(p.text, str) or not p.text.strip():
        return f"its text is {p.text!r:.60}; a prompt's text is a non-empty string"
    if not isinstance(p.answer, str):
        return f"its answer is {p.answer!r:.60}; a prompt's answer is a string (the gold the reward and SFT use)"
    return None


def sampler_stops(task: Task, stop) -> list[str]:
    """The texts the sampler pauses a row at: ``rollout.stop``, then the task's own turn ends
    (:attr:`Task.turn_ends`) not among them."""
    out = list(stop)
    return out + [s for s in task.turn_ends if s not in out]


def env_turns(task: Task, prompts: list[Prompt], n: int):
    """The task's ``on_stop`` (:meth:`Task.on_stop_fn`) for the sampler, each batch of turns under the task's
    ``turn_time_limit_s``: an environment that does not answer stops the run in one line (a TaskError); None for a
    single-turn task."""
    on_stop = task.on_stop_fn(prompts, n)
    if on_stop is None:
        return None
    cls, limit = type(task).__name__, task.turn_time_limit_s

    def timed(rows, texts):
        return limited(lambda: on_stop(rows, texts), limit, lambda: TaskError(
            f"task {task.name or cls}: its environment ({cls}.on_stop_fn) answered nothing in {limit:g} s for "
            f"{len(rows)} turns (the first: {texts[0][-60:]!r}); an environment answers in {cls}.turn_time_limit_s "
            "(set it higher on the class if it needs longer)"))
    return timed


class Task:
    name: str = ""
    metric: str = "em"  #: the name of the evaluation metric (the mean reward on an eval split)
    #: part of the cold-start cache key, beside a digest of the demonstrations and corpus: raise it when what builds
    #: the base changed in a way those texts do not show (``masked_spans``, the stop probe's ``sample``/``reward``)
    format_version: int = 0
    #: its questions come from worlds generated from ``task.seed`` (``--transfer`` can score other worlds)
    generated: bool = False
    #: every question is asked in a world of its own (the recall measurement rebuilds each one)
    episodic: bool = False
    #: every training prompt where the task holds a finite set of them (a data file); None where they are generated
    train_set: list[Prompt] | None = None
    #: the texts that end a policy turn (a multi-turn task's): the sampler pauses a row there for its environment's
    #: answer (:meth:`on_stop_fn`), as at ``rollout.stop`` (:func:`sampler_stops`)
    turn_ends: tuple[str, ...] = ()
    #: seconds one call of :meth:`reward` may take; past it the run stops in one line naming the episode (0: none)
    reward_time_limit_s: float = 60.0
    #: seconds one batch of environment turns (the ``on_stop`` of :meth:`on_stop_fn`) may take (0: none)
    turn_time_limit_s: float = 300.0

    # ---------------------------------------------------------------- required
    def sample(self, n: int, seed: int) -> list[Prompt]:
        """``n`` training prompts, a deterministic function of ``seed``."""
        raise NotImplementedError

    def eval_splits(self) -> dict[str, list[Prompt]]:
        """Held-out evaluation prompts by split name."""
        raise NotImplementedError

    def reward(self, prompt: Prompt, response: str) -> float:
        """Scalar reward of one response text (never raises on malformed text)."""
        raise NotImplementedError

    def corpus(self) -> list[str]:
        """Text to train a tokenizer on."""
        raise NotImplementedError

    def demonstrations(self, n: int, seed: int) -> list[tuple[str | Prompt, str]]:
        """(prompt, response) pairs for the supervised cold start; a ValueError says why there are none."""
        raise NotImplementedError

    # ---------------------------------------------------------------- optional
    def train_prompts(self) -> list[Prompt] | None:
        """Every training prompt, where the task holds a finite set of them (a data file); None where they are
        generated (then :meth:`sample` is all there is). The start-up check measures each against the context."""
        return self.train_set

    def on_stop_fn(self, prompts: list[Prompt], n: int) -> Callable[[list[int], list[str]], list[str | None]] | None:
        """Multi-turn tasks: the sampler's batched ``on_stop`` (:data:`ema_pg.rollout.base.OnStop`) for rows
        answering ``prompts`` (``n`` each, row r answers prompt r // n); None = single-turn."""
        return None

    def answer_key(self, prompt: Prompt, response: str) -> str | None:
        """The answer a response states, in a form equal answers share (majority voting, maj@N); None = none."""
        return response.strip() or None

    def diagnostics(self, prompt: Prompt, response: str) -> dict[str, float]:
        """Per-response numbers the evaluation averages per split beside the metric (what a response did, not
        its reward); a key may be left out where it does not apply. None by default."""
        return {}

    def masked_spans(self, response: str) -> list[tuple[int, int]]:
        """Character spans of environment text inside a demonstration (no SFT loss there)."""
        return []

    def baseline_prompts(self, prompts: list[Prompt], mode: str) -> list[Prompt]:
        """Prompt-only baselines (Table 2's CoT / RAG) as prompts for the same policy."""
        raise ValueError(f"task {self.name!r} has no prompt-only baselines (--baseline {mode})")
