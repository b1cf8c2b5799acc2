"""PPO's critic: a value model, GAE over policy tokens, and the clipped value loss.

    V_t      = value(h_t)                         the state before policy token t (the position that predicts it)
    r_t      = R on the last policy token of a response, 0 elsewhere
    delta_t  = r_t + gamma V_{t+1} - V_t          t+1 = the next *policy* token (observations are skipped)
    A_t      = delta_t + gamma lambda A_{t+1}     (GAE, Schulman et al. 2016); returns R_t = A_t + V_t
    L_V      = 1/2 mean_t max((V - R_t)^2, (V_old + clip(V - V_old, -c, c) - R_t)^2)

Observation tokens of a multi-turn response (retrieved passages) are not actions: the recursion
passes over them, so the tokens before and after an observation are consecutive steps.

The value model is a copy of the policy's transformer body with a scalar head (zero-initialized,
so the first values are 0) and its own AdamW optimizer; it is trained after each policy
minibatch update on the same rows (``algo.critic_lr``).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from .losses import Share, masked_mean
from .packing import Packing, packed_states
from .rollout.base import Rollouts


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """(N, T) token rewards: each row's reward on its last policy token (mask 1), 0 elsewhere."""
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), pos, torch.full_like(pos, -1)).max(-1).values  # (N,), -1: no policy token
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    rows = (last >= 0).nonzero().flatten()
    out[rows, last[rows]] = rewards[rows]
    return out


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns), each (N, T), by GAE over the masked (policy) tokens; 0 where mask is 0."""
    N, T = values.shape
    m = mask.bool()
    adv = torch.zeros_like(values)
    next_v = torch.zeros(N, dtype=values.dtype, device=values.device)  # V after the last policy token: 0 (terminal)
    running = torch.zeros_like(next_v)
    for t in range(T - 1, -1, -1):
        mt = m[:, t]
        delta = token_rewards[:, t] + gamma * next_v - values[:, t]
        new = delta + gamma * lam * running
        running = torch.where(mt, new, running)  # observation / padding columns pass the recursion through
        next_v = torch.where(mt, values[:, t], next_v)
        adv[:, t] = torch.where(mt, new, torch.zeros_like(new))
    returns = torch.where(m, adv + values, torch.zeros_like(adv))
    return adv, returns


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked entries (the original PPO's advantage normalization)."""
    m = mask.bool()
    v = x[m]
    if v.numel() < 2:
        return torch.where(m, x - v.mean() if v.numel() else x, torch.zeros_like(x))
    return torch.where(m, (x - v.mean()) / (v.std() + eps), torch.zeros_like(x))


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float,
               share: Share | None = None) -> tuple[Tensor, dict]:
    """The clipped value loss of PPO (``clip`` <= 0: unclipped), a masked token mean, and its metrics (``share``: a
    micro-batch's share of its minibatch's mean, :class:`ema_pg.losses.Share`)."""
    err = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_c = (clipped - returns) ** 2
        loss_tok = 0.5 * torch.maximum(err, err_c)
        frac = masked_mean((err_c > err).float(), mask, share)
    else:
        loss_tok, frac = 0.5 * err, torch.zeros(())
    loss = masked_mean(loss_tok, mask, share)
    return loss, {"value_loss": loss.detach(), "value_clip_frac": frac}


def explained_variance(values: Tensor, returns: Tensor) -> Tensor:
    """1 - Var(R - V) / Var(R) over the policy tokens given (NaN when the returns do not vary)."""
    r, v = returns, values
    return 1 - (r - v).var() / r.var() if r.numel() > 1 and r.var() > 1e-8 else torch.tensor(float("nan"))


class ValueModel(torch.nn.Module):
    """The policy's transformer body (a copy) with a scalar head: V at every response position."""

    def __init__(self, policy):
        super().__init__()
        self.body = copy.deepcopy(policy.get_decoder())
        for p in self.body.parameters():
            p.requires_grad_(True)
        hidden = policy.get_output_embeddings().weight.shape[1]
        self.head = torch.nn.Linear(hidden, 1, dtype=next(policy.parameters()).dtype,
                                    device=next(policy.parameters()).device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: Rollouts, packing: Packing | None = None) -> Tensor:
        """(N, T) values at the states before each response token; with ``packing`` at its scored (policy) tokens
        only, 0 elsewhere."""
        if packing is not None:
            return packing.put(self.head(packed_states(self.body, packing)).squeeze(-1).float())
        out = self.body(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                        use_cache=False)
        h = out.last_hidden_state[:, batch.prompt_len - 1 : -1]  # (N, T, H): the states before each response token
        return self.head(h).squeeze(-1).float()  # (N, T)


class Critic:
    """A :class:`ValueModel` with its own AdamW (not the policy's optimizer), used by :func:`ema_pg.step.rl_step`."""

    def __init__(self, policy, lr: float, clip: float, grad_clip: float):
        self.model = ValueModel(policy)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.clip, self.grad_clip = clip, grad_clip

    @torch.no_grad()
    def values(self, batch: Rollouts, packing: Packing | None = None) -> Tensor:
        self.model.eval()
        return self.model(batch, packing)

    def update(self, parts: list[tuple], share: Share | None = None) -> dict[str, float]:
        """One optimizer step of the value model over a minibatch: ``parts`` are its micro-batches, each (batch,
        old values, returns, mask, packing or None), their gradients accumulated (``share``: the minibatch's counts,
        when there are several)."""
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        seen_v, seen_r = [], []
        for batch, old_values, returns, mask, packing in parts:
            values = self.model(batch, packing)
            loss, metrics = value_loss(values, old_values, returns, mask, self.clip, share)
            if not torch.isfinite(loss):  # the policy's guard handles the policy; a bad value step is skipped here
                self.opt.zero_grad(set_to_none=True)
                return {k: float(v) for k, v in metrics.items()}
            loss.backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            m = mask.bool()
            seen_v.append(values.detach()[m])
            seen_r.append(returns[m])
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        sums["value_explained_var"] = float(explained_variance(torch.cat(seen_v), torch.cat(seen_r)))
        return sums

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
