"""The anchor (reference) policy as a Lightning Callback: fixed, an EMA of the policy, a hard
reset, the peers' soft sync, or a teacher model. One ``anchor=`` value picks the scheme:

    ema     theta_ema <- eta * theta_ema + (1 - eta) * theta   every ``update_every`` iterations (Alg 3, l. 25)
    fixed   the EMA with eta = 1: the initial policy, never updated (standard GRPO)
    reset   the EMA with eta = 0: theta_ref <- theta every ``update_every`` iterations (a hard reset)
    sync    theta_ref <- (1 - alpha) theta_ref + alpha theta every ``sync_steps`` *optimizer* steps, mixed in
            the anchor's own dtype (TRL's ``sync_ref_model`` with ``ref_model_mixup_alpha`` /
            ``ref_model_sync_steps``); no fp32 master
    teacher a fixed model from ``anchor.path`` (``model.teacher_path``), any architecture with the
            policy's vocabulary: on-policy distillation through the same Top-k estimators

Any scheme but ``teacher`` starts from the policy, or from ``anchor.path`` when it is set (the
authors' ``ref.model.path``: a separate initial anchor with the policy's architecture).

A LoRA policy (``model.lora_rank`` > 0) gets an anchor *adapter* beside its own in the same model
(:mod:`ema_pg.engine.lora`): the schemes then act on the adapter weights, the base is shared, not copied.

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


SCHEMES = ("ema", "sync", "teacher")  #: anchor.name values that keep an anchor model (besides none)


class EMAAnchor(L.Callback):
    def __init__(self, eta: float = 0.9, update_every: int = 10, eval_every: int = 0, *, scheme: str = "ema",
                 sync_alpha: float = 0.0, sync_steps: int = 0, path: str | None = None):
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"anchor.eta must be in [0, 1]; got {eta}")
        if update_every < 1:
            raise ValueError(f"anchor.update_every must be >= 1; got {update_every}")
        if scheme not in SCHEMES:
            raise ValueError(f"anchor scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")
        if scheme == "sync" and not (0.0 < sync_alpha <= 1.0 and sync_steps >= 1):
            raise ValueError(f"anchor=sync needs anchor.sync_alpha in (0, 1] and anchor.sync_steps >= 1; got "
                             f"{sync_alpha}, {sync_steps}")
        if scheme == "teacher" and not path:
            raise ValueError("anchor=teacher needs a teacher model: model.teacher_path=DIR (a save_pretrained folder)")
        self.eta, self.update_every, self.eval_every = float(eta), int(update_every), int(eval_every)
        self.scheme, self.sync_alpha, self.sync_steps, self.path = scheme, float(sync_alpha), int(sync_steps), path
        self.model: torch.nn.Module | None = None
        self.master: dict[str, torch.Tensor] = {}  # the fp32 EMA master (scheme ema only)
        self.updates = 0
        self.optimizer_steps = 0  # counted for scheme sync
        self._pending: dict | None = None
        self.sharded = False  # ZeRO-3: model and master hold this rank's shards
        self.lora = False  # a LoRA policy: the anchor is an adapter of the policy model (ema_pg.engine.lora)
        self._engine = None  # the anchor's inference-only DeepSpeed engine (keeps its partitioning hooks alive)
        self._shard_dir: Path | None = None
        self._iteration = 0

    # ------------------------------------------------------------------ construction
    def attach(self, policy: torch.nn.Module) -> None:
        """theta_ema <- theta (Alg 3, line 1): a frozen copy of the policy (or the model at ``path``; for a
        LoRA policy, a second adapter over the same base) plus, for the EMA, an fp32 master."""
        from .lora import add_anchor_adapter, is_lora

        self.lora = is_lora(policy) and self.scheme != "teacher"
        if self.lora:
            self.model = add_anchor_adapter(policy)
        elif self.path:
            self.model = self._load(policy)
        else:
            self.model = copy.deepcopy(policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        if self.scheme == "ema":
            self.master = {n: p.detach().float().clone() for n, p in self.model.named_parameters()}
        if self._pending is not None:
            self._apply_state(self._pending)
            self._pending = None

    def _followed(self, policy):
        """(name, parameter) of what the anchor follows: the policy's weights, or its LoRA adapter's."""
        if self.lora:
            from .lora import POLICY, adapter_params

            return adapter_params(policy, POLICY).items()
        return policy.named_parameters()
        if self._pending is not None:
            self._apply_state(self._pending)
            self._pending = None

    def _load(self, policy: torch.nn.Module) -> torch.nn.Module:
        from .models import load_model_dir

        first = next(policy.parameters())
        model, _ = load_model_dir(self.path, dtype=first.dtype)
        what = "model.teacher_path" if self.scheme == "teacher" else "anchor.path"
        V, Vp = model.get_output_embeddings().weight.shape[0], policy.get_output_embeddings().weight.shape[0]
        if V != Vp:
            raise ValueError(f"{what}={self.path}: its vocabulary has {V} entries, the policy's {Vp}; the anchor must "
                             "share the policy's tokenizer")
        if self.scheme != "teacher":  # the anchor follows the policy's weights: same names and shapes
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
        self.master = {n: t.to(pl_module.device) for n, t in self.master.items()}
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
        self.master = {n: p.ds_tensor.detach().float().clone() for n, p in self.model.named_parameters()}
        self.sharded = True
        if pending is not None:
            self._pending = None
            self._apply_state(pending)

    # ------------------------------------------------------------------ the EMA step
    @torch.no_grad()
    def update(self, policy: torch.nn.Module) -> None:
        if self.scheme != "ema" or self.eta >= 1.0:
            return
        params = dict(self.model.named_parameters())
        for n, p in self._followed(policy):
            m = self.master[n]
            if self.sharded:  # this rank's shard of the policy's parameter into this rank's shard of the master
                m.mul_(self.eta).add_(p.ds_tensor.detach().float(), alpha=1.0 - self.eta)
                params[n].ds_tensor.copy_(m)
            else:
                m.mul_(self.eta).add_(p.detach().float(), alpha=1.0 - self.eta)
                params[n].copy_(m)
        self.updates += 1

    @torch.no_grad()
    def after_optimizer_step(self, policy: torch.nn.Module) -> None:
        """Scheme ``sync``: every ``sync_steps`` optimizer steps theta_ref <- (1 - alpha) theta_ref + alpha theta,
        in the anchor's own dtype (as the peers mix it)."""
        if self.scheme != "sync":
            return
        self.optimizer_steps += 1
        if self.optimizer_steps % self.sync_steps:
            return
        params = dict(self.model.named_parameters())
        for n, p in self._followed(policy):
            a = params[n]
            a.mul_(1.0 - self.sync_alpha).add_(p.detach().to(a.dtype), alpha=self.sync_alpha)
        self.updates += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._iteration = pl_module.iteration
        if pl_module.iteration % self.update_every == 0:
            self.update(pl_module.policy)

    @torch.no_grad()
    def lag_norm(self, policy: torch.nn.Module) -> float:
        """||theta - theta_ema|| over all parameters (fp32); under ZeRO-3 a sum over shards (collective).
        ``sync``: against the anchor's weights; ``teacher``: nan (another model)."""
        if self.scheme == "teacher":
            return float("nan")
        if self.scheme == "sync":
            params = dict(self.model.named_parameters())
            return sum(float(((p.detach().float() - params[n].float()) ** 2).sum())
                       for n, p in self._followed(policy)) ** 0.5
        if not self.sharded:
            sq = sum(float(((p.detach().float() - self.master[n]) ** 2).sum()) for n, p in self._followed(policy))
            return sq**0.5
        sq = sum(((p.ds_tensor.detach().float() - self.master[n]) ** 2).sum() for n, p in policy.named_parameters())
        sq = torch.as_tensor(sq, dtype=torch.float64)
        torch.distributed.all_reduce(sq)
        return float(sq) ** 0.5

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        # eta and update_every are settings, recorded in the run's config.yaml (which a resume may not change)
        if self.scheme == "teacher":  # a fixed model from a path: nothing changes, nothing to save
            return {"updates": 0, "teacher": str(self.path)}
        if self.scheme == "sync":  # no master: the anchor's own weights (its dtype) are the state
            return {"master": {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()},
                    "updates": self.updates, "optimizer_steps": self.optimizer_steps}
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
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        params = dict(self.model.named_parameters())
        if "teacher" in state:
            return
        if self.scheme == "sync":
            for n, t in state["master"].items():
                params[n].copy_(t.to(params[n].device, params[n].dtype))
            return
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
