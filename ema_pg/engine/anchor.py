"""The anchor as a Lightning Callback: a scheme of :mod:`ema_pg.anchors` applied to the models it holds.

The rules live in the registry; this callback keeps what depends on where the models live:

- the anchor model: a frozen copy of the policy, the model at ``anchor.path`` (the authors'
  ``ref.model.path``; ``model.teacher_path`` for ``anchor=teacher``), or, for a LoRA policy
  (``model.lora_rank`` > 0), a second *adapter* beside the policy's in the same model
  (:mod:`ema_pg.engine.lora`): the schemes then act on the adapter weights, the base is shared;
- the clocks: the RL step applies the rule after each iteration (:func:`ema_pg.step.follow_anchor`, handed
  :attr:`anchor`), and after each applied optimizer step the updater calls :meth:`after_optimizer_step`;
- ZeRO-3: the anchor is never gathered into a full copy. At fit start the anchor model is partitioned
  like the policy (an inference-only ZeRO-3 engine), each rank keeps the fp32 master and the buffers
  of its own shard and updates them from the policy's shard of the same parameter (the two partitions
  line up element for element), and saves them beside the checkpoint
  (``checkpoints/anchor_shards/iter<t>_rank<r>.pt``; DeepSpeed writes the callback state from rank 0 only);
- checkpoints: the scheme's state (the anchor's weights, its buffers, the update counts) under the
  state key ``anchor``.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import lightning as L
import torch

from ..anchors import Scheme
from ..anchors.follow import Anchor

log = logging.getLogger(__name__)

STATE_KEY = "anchor"  #: the callback's key in a checkpoint's ``callbacks``
LEGACY_KEY = "EMAAnchor"  #: the key of checkpoints written before the scheme registry


def shard_file(shard_dir: Path, iteration: int, rank: int) -> Path:
    """Where rank ``rank`` keeps its fp32 shard of the anchor for the checkpoint at ``iteration`` (ZeRO-3)."""
    return Path(shard_dir) / f"iter{iteration}_rank{rank}.pt"


def load_shard(shard_dir: Path, iteration: int, rank: int, buffers: bool = False) -> dict:
    """Rank ``rank``'s fp32 master shard (``buffers``: its scheme buffers) of the checkpoint at ``iteration``."""
    f = shard_file(shard_dir, iteration, rank)
    if not f.is_file():
        raise FileNotFoundError(f"the anchor's shard {f} is missing; the checkpoint of iteration {iteration} "
                                "cannot be read without it")
    payload = torch.load(f, map_location="cpu", weights_only=True)
    if "master" not in payload:  # written before the scheme registry: the master alone
        payload = {"master": payload, "buffers": {}}
    return payload["buffers"] if buffers else payload["master"]


def anchor_state(checkpoint: dict) -> dict | None:
    """The anchor callback's state in a checkpoint (None: the run had no anchor)."""
    cbs = checkpoint.get("callbacks", {})
    if STATE_KEY in cbs:
        return cbs[STATE_KEY]
    return next((v for k, v in cbs.items() if k.startswith(LEGACY_KEY)), None)


class AnchorCallback(L.Callback):
    def __init__(self, scheme: Scheme, eval_every: int = 0, path: str | None = None):
        if not scheme.spec.follows and not path:
            raise ValueError("anchor=teacher needs a teacher model: model.teacher_path=DIR (a save_pretrained folder)")
        self.scheme, self.eval_every, self.path = scheme, int(eval_every), path
        self.anchor = Anchor(scheme)
        self.sharded = False  # ZeRO-3: model, master and buffers hold this rank's shards
        self._pending: dict | None = None
        self._engine = None  # the anchor's inference-only DeepSpeed engine (keeps its partitioning hooks alive)
        self._shard_dir: Path | None = None
        self._iteration = 0

    @property
    def state_key(self) -> str:
        return STATE_KEY

    # what the module and the tests read
    model = property(lambda self: self.anchor.model)
    master = property(lambda self: self.anchor.master)
    updates = property(lambda self: self.anchor.updates)
    optimizer_steps = property(lambda self: self.anchor.optimizer_steps)

    # ------------------------------------------------------------------ construction
    def attach(self, policy: torch.nn.Module) -> None:
        """theta_ref <- theta (Alg 3, line 1): a frozen copy of the policy, the model at ``path``, or for a LoRA
        policy a second adapter over the same base."""
        from .lora import POLICY, add_anchor_adapter, adapter_params, is_lora

        if is_lora(policy) and self.scheme.spec.follows:
            model = add_anchor_adapter(policy)
            self.anchor.follow = lambda pol: adapter_params(pol, POLICY).items()
        elif self.path:
            model = self._load(policy)
        else:
            model = copy.deepcopy(policy).eval()
        self.anchor.attach(policy, model)
        if self._pending is not None:
            self._apply_state(self._pending)
            self._pending = None

    def _load(self, policy: torch.nn.Module) -> torch.nn.Module:
        from .models import load_model_dir

        first = next(policy.parameters())
        model, _ = load_model_dir(self.path, dtype=first.dtype)
        what = "anchor.path" if self.scheme.spec.follows else "model.teacher_path"
        V, Vp = model.get_output_embeddings().weight.shape[0], policy.get_output_embeddings().weight.shape[0]
        if V != Vp:
            raise ValueError(f"{what}={self.path}: its vocabulary has {V} entries, the policy's {Vp}; the anchor must "
                             "share the policy's tokenizer")
        if self.scheme.spec.follows:  # the anchor follows the policy's weights: same names and shapes
            mine = {n: tuple(p.shape) for n, p in policy.named_parameters()}
            theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
            if mine != theirs:
                diff = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
                raise ValueError(f"{what}={self.path} has another architecture than the policy ({diff}); an anchor that "
                                 "follows the policy needs the same one (a different model fits anchor=teacher)")
        return model.to(first.device).eval()

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.model is None:
            self.attach(pl_module.policy)
        self.model.to(pl_module.device)
        a = self.anchor
        a.master = {n: t.to(pl_module.device) for n, t in a.master.items()}
        a.buffers = {b: {n: t.to(pl_module.device) for n, t in d.items()} for b, d in a.buffers.items()}
        self._shard_dir = Path(trainer.default_root_dir) / "checkpoints" / "anchor_shards"

    def on_fit_start(self, trainer, pl_module) -> None:
        """Under ZeRO-3 (the policy is partitioned by now) partition the anchor the same way."""
        from ..dist import zero3_partitioned

        if self.sharded or not any(zero3_partitioned(p) for p in pl_module.policy.parameters()):
            return
        import deepspeed

        pending = self._pending
        self._engine, *_ = deepspeed.initialize(model=self.model, config={
            "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
        self.model.eval()
        self.anchor.local = lambda p: p.ds_tensor
        self.anchor.reduce = _all_reduce
        self.anchor.start(pl_module.policy)  # the master and buffers of this rank's shards
        self.sharded = True
        if pending is not None:
            self._pending = None
            self._apply_state(pending)

    # ------------------------------------------------------------------ the clocks
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._iteration = pl_module.iteration  # the step applied the rule (ema_pg.step.follow_anchor)

    def after_optimizer_step(self, policy: torch.nn.Module) -> None:
        self.anchor.after_optimizer_step(policy)

    def lag_norm(self, policy: torch.nn.Module) -> float:
        """||theta - theta_ref|| (fp32); under ZeRO-3 a sum over shards (collective); nan for a teacher."""
        return self.anchor.lag_norm(policy)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        if not self.scheme.spec.follows:  # a fixed model from a path: nothing changes, nothing to save
            return {"scheme": self.scheme.name, "updates": 0, "teacher": str(self.path)}
        if not self.sharded:
            return self.anchor.state_dict()
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self._shard_dir.mkdir(parents=True, exist_ok=True)
        it = self._iteration
        final = shard_file(self._shard_dir, it, rank)
        tmp = final.with_name(f".{final.name}.tmp")
        own = self.anchor.state_dict()
        torch.save({"master": own["master"], "buffers": own.get("buffers", {})}, tmp)
        tmp.replace(final)
        done = sorted({int(f.name[4:].split("_")[0]) for f in self._shard_dir.glob(f"iter*_rank{rank}.pt")})
        keep = {it} | {max((t for t in done if t < it), default=it)}  # this checkpoint's and the one before
        for t in done:  # (the one before stays until this checkpoint is surely written)
            if t not in keep:
                shard_file(self._shard_dir, t, rank).unlink(missing_ok=True)
        return {"scheme": self.scheme.name, "updates": self.updates, "optimizer_steps": self.optimizer_steps,
                "shards": {"iteration": it, "world_size": world}}

    def load_state_dict(self, state: dict) -> None:
        if self.model is None:
            self._pending = state
        else:
            self._apply_state(state)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """A checkpoint written before the registry keeps the state under the old callback's name."""
        cbs = checkpoint.get("callbacks", {})
        if STATE_KEY not in cbs and (legacy := anchor_state(checkpoint)) is not None:
            self.load_state_dict(legacy)

    @torch.no_grad()
    def _apply_state(self, state: dict) -> None:
        if "shards" in state and not self.sharded:  # restored before the anchor is partitioned: wait for it
            self._pending = state
            return
        if "teacher" in state or not self.scheme.spec.follows:
            return
        if "shards" not in state:
            self.anchor.load_state_dict(state)
            return
        world = torch.distributed.get_world_size()
        if state["shards"]["world_size"] != world:
            raise RuntimeError(f"the checkpoint's anchor is sharded over {state['shards']['world_size']} processes; "
                               f"resume it with trainer.devices={state['shards']['world_size']} (not {world})")
        self._iteration = int(state["shards"]["iteration"])
        rank = torch.distributed.get_rank()
        self.anchor.load_state_dict({k: v for k, v in state.items() if k != "shards"})
        self.anchor.load_weights(load_shard(self._shard_dir, self._iteration, rank),
                                 load_shard(self._shard_dir, self._iteration, rank, buffers=True))


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    torch.distributed.all_reduce(x)
    return x
