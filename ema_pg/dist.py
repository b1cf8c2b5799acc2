"""The few collective operations the RL step needs when it runs on several processes.

:class:`World` is the step's view of the process group: one process (``World()``, the default,
where every operation is the identity) or the ``torch.distributed`` group that Lightning (DDP,
DeepSpeed) set up. How a batch is split, once for all the step's readers:

- the B prompts of an iteration are drawn on every rank with the same seed, and rank r takes
  the r-th contiguous block of B / world_size prompts, each with its whole group of samples,
  so group-normalized advantages are exact on one rank;
- every prompt has its own sampling seed (its global number), so a rollout does not depend
  on how the batch is split: one process and several sample the same responses;
- the loss of each rank is scaled so that the gradient the strategy averages over ranks is
  the gradient of the whole batch's loss.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> World:
        """The initialized ``torch.distributed`` group, or one process."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return cls(torch.distributed.get_rank(), torch.distributed.get_world_size())
        return cls()

    def block(self, n: int) -> slice:
        """This rank's contiguous block of ``n`` items (``n`` divisible by the world size)."""
        if n % self.size:
            raise ValueError(f"{n} items do not split evenly over {self.size} processes")
        b = n // self.size
        return slice(self.rank * b, (self.rank + 1) * b)

    def all_gather_cat(self, x: Tensor) -> Tensor:
        """Concatenate every rank's ``x`` (same shape on every rank) along dim 0, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, 0)

    def sum(self, x: Tensor) -> Tensor:
        if self.size == 1:
            return x
        x = x.clone()
        torch.distributed.all_reduce(x)
        return x

    def max(self, n: int) -> int:
        if self.size == 1:
            return n
        t = torch.tensor([n])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank (pickled; any value on the others is ignored)."""
        if self.size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics averaged over ranks; keys ending in ``_max`` / ``_min`` take the max / min."""
        if self.size == 1:
            return metrics
        keys = sorted(metrics)
        v = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        ops = {"mean": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
               "min": torch.distributed.ReduceOp.MIN}
        out = {}
        for kind, op in ops.items():
            sel = [i for i, k in enumerate(keys) if _kind(k) == kind]
            if not sel:
                continue
            part = v[sel].clone()
            torch.distributed.all_reduce(part, op=op)
            if kind == "mean":
                part /= self.size
            out.update({keys[i]: float(x) for i, x in zip(sel, part)})
        return out


def _kind(key: str) -> str:
    return "max" if key.endswith("_max") else "min" if key.endswith("_min") else "mean"


@dataclass(frozen=True)
class Share(World):
    """One of ``size`` rollout workers of a pool (``rollout.workers``): it samples the block of a batch that rank
    ``rank`` of ``size`` processes would (its prompts, each with its whole group and its own seed), and talks to no
    other worker: what a collective would gather is its block's alone, and the trainer joins the blocks
    (:meth:`ema_pg.step.Sampled.join`, the metrics by :func:`join_metrics`)."""

    def all_gather_cat(self, x: Tensor) -> Tensor:
        return x

    def sum(self, x: Tensor) -> Tensor:
        return x

    def max(self, n: int) -> int:
        return n

    def gather_objects(self, obj) -> list:
        return [obj]

    def broadcast(self, obj, src: int = 0):
        return obj

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics


def join_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Metrics of equal blocks of a batch as :meth:`World.reduce_metrics` joins ranks': the mean, or the max / min
    of keys ending in ``_max`` / ``_min``."""
    ops = {"mean": lambda xs: sum(xs) / len(xs), "max": max, "min": min}
    return {k: float(ops[_kind(k)]([float(m[k]) for m in parts])) for k in parts[0]}


# ---------------------------------------------------------------------- ZeRO-3 partitioned parameters
def zero3_partitioned(p: torch.Tensor) -> bool:
    """True for a parameter partitioned by DeepSpeed ZeRO-3 (its local tensor is empty)."""
    return hasattr(p, "ds_tensor")


def full_shape(p: torch.Tensor) -> torch.Size:
    return p.ds_shape if zero3_partitioned(p) else p.shape


@contextmanager
def gathered(params, modifier_rank=None):
    """Full tensors of ZeRO-3 partitioned ``params`` inside the block (no-op for ordinary ones). A weight that is
    whole already (a module running now holds it, as the root module's forward holds the persistent small weights
    during a training step) is read as it is and left to that module: gathering it would partition it at the
    block's end under the module, which DeepSpeed refuses ("still active in submodules"). The ranks run the same
    forwards, so they hold the same weights and gather the same ones."""
    params = [p for p in params if zero3_partitioned(p)]
    if params and modifier_rank is None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = [p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        yield


class Zero3FullWeights:
    """While a rollout samples from a model inside the ZeRO-3 engine's module: its whole weights on every rank,
    gathered once, and none of ZeRO-3's module hooks running, so a decode step is a plain forward instead of one
    collective gather per layer (about 0.18 s per token at 0.5B on an H200, benchmarks/results/
    recipes_h200_attempt.json) plus four Python hooks per module. The hooks stay registered: each module's hook
    tables are set aside for the block and the same tables put back after it, so DeepSpeed's handles and its
    recorded prefetch trace stay valid (re-registering would void the trace at every rollout); other hooks on the
    model keep running. The weights are partitioned again as the block ends, and every rank must enter it together.
    Needs the sampled model whole in one device's memory (``rollout.zero3_gather=false`` when it does not fit). A
    model outside the engine's module is sampled as it is."""

    #: the hook tables of an nn.Module that DeepSpeed's ZeRO-3 forward and backward hooks live in
    TABLES = ("_forward_pre_hooks", "_forward_hooks")

    def __init__(self, offload):
        self.offload = offload  #: DeepSpeed's DeepSpeedZeRoOffload of the engine (its module, its hooks)

    def hook_ids(self) -> set[int]:
        """The ids of every hook DeepSpeed's ZeRO-3 registered on the engine's modules."""
        off = self.offload
        return {h.id for h in (*off.forward_hooks, *off.backward_hooks, off.fwd_pre_hook)}

    @contextmanager
    def __call__(self, model: torch.nn.Module):
        if not any(m is model for m in self.offload.module.modules()):  # the engine's module holds the policy
            yield
            return
        ours, set_aside = self.hook_ids(), []
        with whole([model], self.offload):
            try:
                for m in model.modules():
                    for name in self.TABLES:
                        table = getattr(m, name)
                        if any(k in ours for k in table):
                            set_aside.append((m, name, table))
                            setattr(m, name, OrderedDict((k, h) for k, h in table.items() if k not in ours))
                yield
            finally:
                for m, name, table in set_aside:
                    setattr(m, name, table)


@contextmanager
def whole(models, offload=None):
    """Every parameter of ``models`` whole on every rank inside the block, to be read (a rollout's forward, a copy of
    the weights to push): under ZeRO-3 a collective gather that every rank enters together; for ordinary parameters
    nothing. Prefetches still in flight are waited for and every weight is released first (``offload``: the
    engine's DeepSpeedZeRoOffload): GatheredParameters skips a weight in flight and then cannot partition it
    ("Cannot partition a param in flight", iteration 2 of ZeRO-3 at Qwen2.5-1.5B on an H200,
    benchmarks/results/recipe_math_1.5b_z3_h200.json)."""
    params = [p for m in models for p in m.parameters() if zero3_partitioned(p)]
    if params and offload is not None:
        offload.partition_all_parameters()
    with gathered(params):
        for p in params:  # nothing holds them after the block: released as it ends
            p.ds_active_sub_modules.clear()
        yield


def call_through(module: torch.nn.Module, fn, *inputs):
    """``fn(*inputs)`` run as ``module``'s forward, so ZeRO-3's hooks gather ``module``'s parameters for
    it and again for its backward (a function that uses a parameter outside its module's forward sees
    an empty tensor under ZeRO-3)."""
    module.forward = fn
    try:
        return module(*inputs)
    finally:
        del module.forward
