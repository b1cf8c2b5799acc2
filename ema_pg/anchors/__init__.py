"""The anchor-scheme registry: how the reference ("anchor") policy follows the policy.

>>> from ema_pg.anchors import get_scheme
>>> get_scheme("ema", eta=0.95).params
{'eta': 0.95, 'update_every': 10}

Each scheme is one entry of :data:`SCHEMES`: a pure update rule of (anchor weights, policy weights,
its buffers, t) (:mod:`ema_pg.anchors.rules`), the one home of its parameters' defaults, its check,
its clock, whether it keeps an fp32 master and which buffers it saves. ``anchor=<name>`` picks one;
the parameters of ``anchor.*`` left null take the entry's defaults (``with_defaults`` writes them
into the run's config).

    fixed    the initial policy, never updated (standard GRPO: the EMA with eta = 1)
    ema      theta_ema <- eta theta_ema + (1 - eta) theta every update_every iterations (eq. 2, the paper's)
    reset    theta_ref <- theta every update_every iterations (the EMA with eta = 0)
    sync     theta_ref <- (1 - alpha) theta_ref + alpha theta every sync_steps optimizer steps (TRL's soft sync)
    bema     the bias-corrected EMA of Block and Zhang (2025): EMA_t + alpha_t (theta_t - theta_0)
    teacher  a fixed model of another architecture (``model.teacher_path``): on-policy distillation

:class:`ema_pg.anchors.follow.Anchor` applies a scheme to an anchor model in plain torch; the
engine's callback (:mod:`ema_pg.engine.anchor`) adds ZeRO-3 shards, LoRA adapters and checkpoints.
Adding a scheme is one rule, one entry here, one option file ``conf/anchor/<name>.yaml`` and its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from . import rules

CLOCKS = ("never", "iteration", "optimizer")  #: when a scheme's rule runs


@dataclass(frozen=True)
class SchemeSpec:
    """One registry entry.

    ``rule`` (None: the anchor never changes) runs every ``update_every`` iterations (clock ``iteration``)
    or every ``sync_steps`` optimizer steps (clock ``optimizer``). ``defaults`` is the one home of the
    parameters' defaults; ``pinned`` names parameters whose value is a fact of the scheme (fixed's eta = 1).
    ``master``: the anchor is accumulated in an fp32 master copy (exact in bf16); ``buffers``: further fp32
    per-parameter state, started by ``start`` from the policy. ``follows``: False for a model of its own.
    ``zero3``: built under DeepSpeed ZeRO-3 (its anchor's update runs on the policy's partitions).
    """

    rule: Callable | None
    defaults: dict = field(default_factory=dict)
    check: Callable[[dict], None] | None = None
    clock: str = "never"
    master: bool = False
    buffers: tuple[str, ...] = ()
    start: Callable | None = None
    follows: bool = True
    pinned: tuple[str, ...] = ()
    zero3: bool = True


_EVERY = {"update_every": 10}  # T_ema (Alg 3, line 25; the paper's 10)

SCHEMES: dict[str, SchemeSpec] = {
    "fixed": SchemeSpec(None, {"eta": 1.0}, rules.check_pinned_eta(1.0, "fixed", "ema"), pinned=("eta",)),
    "ema": SchemeSpec(rules.ema, {"eta": 0.9, **_EVERY}, rules.check_ema, "iteration", master=True),
    "reset": SchemeSpec(rules.reset, {"eta": 0.0, **_EVERY}, rules.check_pinned_eta(0.0, "reset", "ema"), "iteration",
                        pinned=("eta",)),
    "sync": SchemeSpec(rules.sync, {"sync_alpha": 0.6, "sync_steps": 512}, rules.check_sync, "optimizer",
                       zero3=False),  # TRL's
    "bema": SchemeSpec(rules.bema, {**_EVERY, "ema_power": 0.5, "bias_power": 0.2, "lag": 10.0, "multiplier": 1.0,
                                    "min_ema_multiplier": 0.0, "update_after": 0},  # BEMA's defaults (TRL's callback)
                       rules.check_bema, "iteration", master=True, buffers=("ema", "theta0"), start=rules.bema_start,
                       zero3=False),
    "teacher": SchemeSpec(None, follows=False, zero3=False),
}

#: every parameter some scheme takes (the keys of ``anchor.*`` besides name, eval_every, path)
PARAMS = tuple(dict.fromkeys(k for s in SCHEMES.values() for k in s.defaults))


@dataclass(frozen=True)
class Scheme:
    """A registry entry bound to its parameters (:func:`get_scheme`)."""

    name: str
    spec: SchemeSpec
    params: dict

    def due(self, iteration: int) -> bool:
        """Whether the rule runs after RL iteration ``iteration`` (1-based count of iterations done)."""
        if self.spec.clock != "iteration":
            return False
        start = self.params.get("update_after", 0)
        return iteration > start and (iteration - start) % self.params["update_every"] == 0

    def due_optimizer(self, steps: int) -> bool:
        """Whether the rule runs after the ``steps``-th applied optimizer step."""
        return self.spec.clock == "optimizer" and steps % self.params["sync_steps"] == 0

    def starts_at(self, iteration: int) -> bool:
        """Whether the buffers restart from the policy after iteration ``iteration`` (BEMA's burn-in end)."""
        return bool(self.spec.buffers) and iteration == self.params.get("update_after", 0) and iteration > 0

    def clock_t(self, iteration: int) -> int:
        """The rule's t: iterations since the scheme's start."""
        return iteration - self.params.get("update_after", 0)


def get_scheme(name: str, **params) -> Scheme:
    """A registered scheme bound to ``params`` (defaults filled); unknown names or values raise ValueError."""
    if name not in SCHEMES:
        raise ValueError(f"unknown anchor scheme {name!r}; choose one of: {', '.join(SCHEMES)} (or none)")
    spec = SCHEMES[name]
    unknown = set(params) - set(spec.defaults)
    if unknown:
        raise ValueError(f"anchor={name} takes no parameter(s) {sorted(unknown)}; it takes: "
                         f"{', '.join(spec.defaults) or 'nothing'}")
    p = {**spec.defaults, **params}
    if spec.check is not None:
        spec.check(p)
    return Scheme(name, spec, p)


def scheme_of(anchor: dict) -> str:
    """The scheme's id of a saved ``anchor`` config. Configs saved before this registry (they lack the
    ``ema_power`` key) wrote anchor=fixed and anchor=reset as ``ema`` at eta 1 and 0."""
    name = anchor.get("name", "ema")
    if name == "ema" and "ema_power" not in anchor:
        return {1.0: "fixed", 0.0: "reset"}.get(anchor.get("eta"), name)
    return name


__all__ = ["CLOCKS", "PARAMS", "SCHEMES", "Scheme", "SchemeSpec", "get_scheme", "scheme_of"]
