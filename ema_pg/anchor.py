"""The anchor (reference) policy as a Lightning Callback: fixed or an EMA of the policy.

    theta_ema <- eta * theta_ema + (1 - eta) * theta      every ``update_every`` iterations (Alg 3, l. 25)

The EMA is accumulated in an fp32 master copy, so it stays exact when the model runs in
bf16/fp16 (an EMA step of (1 - eta) * 1e-6 vanishes in bf16); the anchor model used for
scoring holds the master cast to the model's dtype. ``eta = 1`` is the fixed anchor of
standard GRPO (``anchor=fixed`` is that preset). The master copy and the update count are saved in checkpoints.

Under DeepSpeed ZeRO-3 the anchor is never gathered into a full copy: at fit start the anchor
model is partitioned like the policy (an inference-only ZeRO-3 engine), each rank keeps the
fp32 master of its own shard and updates it from the policy's shard of the same parameter
(the two partitions line up element for element), and each rank saves its shard beside the
checkpoint (``checkpoints/anchor_shards/iter<t>_rank<r>.pt``; DeepSpeed writes the callback
state from rank 0 only).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import lightning as L
import torch

log = logging.getLogger(__name__)


def shard_file(shard_dir: Path, iteration: int, rank: int) -> Path:
    """Where rank ``rank`` keeps its fp32 master shard of the checkpoint at ``iteration`` (ZeRO-3)."""
    return Path(shard_dir) / f"iter{iteration}_rank{rank}.pt"


def load_shard(shard_dir: Path, iteration: int, rank: int) -> dict:
    f = shard_file(shard_dir, iteration, rank)
    if not f.is_file():
        raise FileNotFoundError(f"the anchor's shard {f} is missing; the checkpoint of iteration {iteration} "
                                "cannot be read without it")
    return torch.load(f, map_location="cpu", weights_only=True)


class EMAAnchor(L.Callback):
    def __init__(self, eta: float = 0.9, update_every: int = 10, eval_every: int = 0):
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"anchor.eta must be in [0, 1]; got {eta}")
        if update_every < 1:
            raise ValueError(f"anchor.update_every must be >= 1; got {update_every}")
        self.eta, self.update_every, self.eval_every = float(eta), int(update_every), int(eval_every)
        self.model: torch.nn.Module | None = None
        self.master: dict[str, torch.Tensor] = {}
        self.updates = 0
        self._pending: dict | None = None
        self.sharded = False  # ZeRO-3: model and master hold this rank's shards
        self._engine = None  # the anchor's inference-only DeepSpeed engine (keeps its partitioning hooks alive)
        self._shard_dir: Path | None = None
        self._iteration = 0

    # ------------------------------------------------------------------ construction
    def attach(self, policy: torch.nn.Module) -> None:
        """theta_ema <- theta (Alg 3, line 1): a frozen copy of the policy plus an fp32 master."""
        self.model = copy.deepcopy(policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.master = {n: p.detach().float().clone() for n, p in policy.named_parameters()}
        if self._pending is not None:
            self._apply_state(self._pending)
            self._pending = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.model is None:
            self.attach(pl_module.policy)
        self.model.to(pl_module.device)
        self.master = {n: t.to(pl_module.device) for n, t in self.master.items()}
        self._shard_dir = Path(trainer.default_root_dir) / "checkpoints" / "anchor_shards"

    def on_fit_start(self, trainer, pl_module) -> None:
        """Under ZeRO-3 (the policy is partitioned by now) partition the anchor the same way."""
        from .strategies import zero3_partitioned

        if self.sharded or not any(zero3_partitioned(p) for p in pl_module.policy.parameters()):
            return
        import deepspeed

        pending = self._pending
        self._engine, *_ = deepspeed.initialize(model=self.model, config={
            "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
        self.model.eval()
        self.master = {n: p.ds_tensor.detach().float().clone() for n, p in self.model.named_parameters()}
        self.sharded = True
        if pending is not None:
            self._pending = None
            self._apply_state(pending)

    # ------------------------------------------------------------------ the EMA step
    @torch.no_grad()
    def update(self, policy: torch.nn.Module) -> None:
        if self.eta >= 1.0:
            return
        params = dict(self.model.named_parameters())
        for n, p in policy.named_parameters():
            m = self.master[n]
            if self.sharded:  # this rank's shard of the policy's parameter into this rank's shard of the master
                m.mul_(self.eta).add_(p.ds_tensor.detach().float(), alpha=1.0 - self.eta)
                params[n].ds_tensor.copy_(m)
            else:
                m.mul_(self.eta).add_(p.detach().float(), alpha=1.0 - self.eta)
                params[n].copy_(m)
        self.updates += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._iteration = pl_module.iteration
        if pl_module.iteration % self.update_every == 0:
            self.update(pl_module.policy)

    @torch.no_grad()
    def lag_norm(self, policy: torch.nn.Module) -> float:
        """||theta - theta_ema|| over all parameters (fp32); under ZeRO-3 a sum over shards (collective)."""
        if not self.sharded:
            sq = sum(float(((p.detach().float() - self.master[n]) ** 2).sum()) for n, p in policy.named_parameters())
            return sq**0.5
        sq = sum(((p.ds_tensor.detach().float() - self.master[n]) ** 2).sum() for n, p in policy.named_parameters())
        sq = torch.as_tensor(sq, dtype=torch.float64)
        torch.distributed.all_reduce(sq)
        return float(sq) ** 0.5

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        # eta and update_every are settings, recorded in the run's config.yaml (which a resume may not change)
        if not self.sharded:
            return {"master": {n: t.detach().cpu() for n, t in self.master.items()}, "updates": self.updates}
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self._shard_dir.mkdir(parents=True, exist_ok=True)
        it = self._iteration
        final = shard_file(self._shard_dir, it, rank)
        tmp = final.with_name(f".{final.name}.tmp")
        torch.save({n: t.detach().cpu() for n, t in self.master.items()}, tmp)
        tmp.replace(final)
        done = sorted({int(f.name[4:].split("_")[0]) for f in self._shard_dir.glob(f"iter*_rank{rank}.pt")})
        keep = {it} | {max((t for t in done if t < it), default=it)}  # this checkpoint's and the one before
        for t in done:  # (the one before stays until this checkpoint is surely written)
            if t not in keep:
                shard_file(self._shard_dir, t, rank).unlink(missing_ok=True)
        return {"updates": self.updates, "shards": {"iteration": it, "world_size": world}}

    def load_state_dict(self, state: dict) -> None:
        if self.model is None:
            self._pending = state
        else:
            self._apply_state(state)

    @torch.no_grad()
    def _apply_state(self, state: dict) -> None:
        if "shards" in state and not self.sharded:  # restored before the anchor is partitioned: wait for it
            self._pending = state
            return
        self.updates = int(state["updates"])
        params = dict(self.model.named_parameters())
        if "shards" in state:
            world = torch.distributed.get_world_size()
            if state["shards"]["world_size"] != world:
                raise RuntimeError(f"the checkpoint's anchor is sharded over {state['shards']['world_size']} processes; "
                                   f"resume it with trainer.devices={state['shards']['world_size']} (not {world})")
            self._iteration = int(state["shards"]["iteration"])
            master = load_shard(self._shard_dir, self._iteration, torch.distributed.get_rank())
            for n, t in master.items():
                self.master[n] = t.to(self.master[n].device).float().clone()
                params[n].ds_tensor.copy_(self.master[n])
            return
        for n, t in state["master"].items():
            self.master[n] = t.to(self.master[n].device).float().clone()
            params[n].copy_(self.master[n])
