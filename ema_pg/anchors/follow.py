"""Applying a scheme to an anchor model, in plain torch: :class:`Anchor`.

    anchor = Anchor(get_scheme("ema", eta=0.9)); anchor.attach(policy, copy.deepcopy(policy))
    ... after each RL iteration t:        anchor.after_iteration(policy, t)
    ... after each applied optimizer step: anchor.after_optimizer_step(policy)   (TorchUpdater(after_step=...))

The anchor model holds the scheme's weights in the model's dtype; a scheme with ``master`` keeps them
in an fp32 copy too (an EMA step of (1 - eta) * 1e-6 vanishes in bf16), and its ``buffers`` in fp32.
Two hooks let the engine reuse this object: ``follow(policy)`` lists the (name, parameter) pairs the
anchor follows (a LoRA policy: its adapter's), ``local(p)`` the tensor of a parameter this process holds
(ZeRO-3: its shard).
"""

from __future__ import annotations

import torch

from . import Scheme


class Anchor:
    def __init__(self, scheme: Scheme):
        self.scheme = scheme
        self.model: torch.nn.Module | None = None
        self.master: dict[str, torch.Tensor] = {}  # the fp32 master (schemes with master)
        self.buffers: dict[str, dict[str, torch.Tensor]] = {b: {} for b in scheme.spec.buffers}
        self.updates = 0  # rule applications
        self.optimizer_steps = 0  # counted for the optimizer clock

    # ------------------------------------------------------------------ hooks the engine may replace
    @staticmethod
    def follow(policy: torch.nn.Module):
        return policy.named_parameters()

    @staticmethod
    def local(p: torch.Tensor) -> torch.Tensor:
        return p

    # ------------------------------------------------------------------ construction
    def attach(self, policy: torch.nn.Module, model: torch.nn.Module) -> None:
        """theta_ref <- ``model`` (Alg 3, line 1: a copy of the policy, or a model of its own), frozen."""
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        self.start(policy)

    @torch.no_grad()
    def start(self, policy: torch.nn.Module) -> None:
        """The fp32 master from the anchor's weights and the buffers from the policy's (the scheme's start)."""
        spec, params = self.scheme.spec, dict(self.model.named_parameters())
        if spec.master:
            self.master = {n: self.local(params[n]).detach().float().clone() for n, _ in self.follow(policy)}
        if spec.buffers:
            per = {n: spec.start(self.local(p).detach().float()) for n, p in self.follow(policy)}
            self.buffers = {b: {n: s[b] for n, s in per.items()} for b in spec.buffers}

    # ------------------------------------------------------------------ the clock
    def after_iteration(self, policy: torch.nn.Module, iteration: int) -> None:
        """After RL iteration ``iteration`` (the count of iterations done)."""
        if self.scheme.starts_at(iteration):
            self.start(policy)
        if self.scheme.due(iteration):
            self.apply(policy, self.scheme.clock_t(iteration))

    def after_optimizer_step(self, policy: torch.nn.Module) -> None:
        """After every applied optimizer step (the soft sync counts them)."""
        self.optimizer_steps += 1
        if self.scheme.due_optimizer(self.optimizer_steps):
            self.apply(policy, self.optimizer_steps)

    @torch.no_grad()
    def apply(self, policy: torch.nn.Module, t: int) -> None:
        """One application of the scheme's rule to every followed parameter."""
        spec, kw = self.scheme.spec, self.scheme.params
        if spec.rule is None:  # fixed, teacher: nothing to apply
            return
        params = dict(self.model.named_parameters())
        for n, p in self.follow(policy):
            a = self.local(params[n])
            cur, pol = (self.master[n], self.local(p).detach().float()) if spec.master else (a, self.local(p).detach())
            new, state = spec.rule(cur, pol, {b: self.buffers[b][n] for b in spec.buffers}, t, **kw)
            if spec.master:
                self.master[n].copy_(new)
            a.copy_(new)
            for b in spec.buffers:
                self.buffers[b][n].copy_(state[b])
        self.updates += 1

    # ------------------------------------------------------------------ diagnostics
    @torch.no_grad()
    def lag_norm(self, policy: torch.nn.Module) -> float:
        """||theta - theta_ref|| over the followed parameters (nan for a model of its own), summed in fp64 and given
        to fp32's precision: the same number on any count of torch threads (a tensor's sum splits among them, and an
        fp32 sum's last bits moved with the split; a run's RL threads follow the machine's room, ema_pg.rl_threads_default)."""
        if not self.scheme.spec.follows:
            return float("nan")
        return float(torch.tensor(float(self.reduce(self._lag_sq(policy))) ** 0.5, dtype=torch.float32))

    def _lag_sq(self, policy) -> torch.Tensor:
        params = dict(self.model.named_parameters())
        ref = (lambda n: self.master[n]) if self.scheme.spec.master else (lambda n: self.local(params[n]))
        return sum((((self.local(p).detach().double() - ref(n).double()) ** 2).sum() for n, p in self.follow(policy)),
                   torch.zeros((), dtype=torch.float64))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A sum over the processes that hold pieces of the anchor (one process: itself)."""
        return x

    # ------------------------------------------------------------------ state
    def weights(self) -> dict[str, torch.Tensor]:
        """The anchor's weights as saved: the fp32 master, or the anchor model's own (its dtype)."""
        if self.scheme.spec.master:
            return {n: t.detach().cpu().clone() for n, t in self.master.items()}
        return {n: self.local(p).detach().cpu().clone() for n, p in self.model.named_parameters()}

    def state_dict(self) -> dict:
        if not self.scheme.spec.follows:  # a fixed model from a path: nothing changes, nothing to save
            return {"scheme": self.scheme.name, "updates": 0}
        return {"scheme": self.scheme.name, "updates": self.updates, "optimizer_steps": self.optimizer_steps,
                "master": self.weights(), **self._buffers_state()}

    def _buffers_state(self) -> dict:
        if not self.buffers:
            return {}
        return {"buffers": {b: {n: t.detach().cpu().clone() for n, t in d.items()} for b, d in self.buffers.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state.get("updates", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        if "master" in state:
            self.load_weights(state["master"], state.get("buffers", {}))

    @torch.no_grad()
    def load_weights(self, master: dict, buffers: dict) -> None:
        params = dict(self.model.named_parameters())
        for n, t in master.items():
            a = self.local(params[n])
            if self.scheme.spec.master:
                self.master[n] = t.to(a.device).float().clone()
                a.copy_(self.master[n])
            else:
                a.copy_(t.to(a.device, a.dtype))
        for b, d in buffers.items():
            for n, t in d.items():
                self.buffers[b][n] = t.to(self.buffers[b][n].device).float().clone()
