"""GRPOModule: one RL iteration of Algorithm 3 per ``training_step``, read top to bottom.

    prompts  -> rollouts (B*G responses) -> rewards -> advantages
    no_grad: old log-probs + top-k of pi_old (from the sampler, which computed them) ; anchor log-probs
    for epoch in ppo_epochs: for minibatch: loss = agg(-J + beta * KL); step
    EMAAnchor callback: theta_ema <- eta theta_ema + (1 - eta) theta every T_ema iterations

Departures from the paper's Algorithm 3, all deliberate:
- prompts, sampling and minibatch order are seeded by (seed, iteration), so a resumed run
  repeats an uninterrupted one exactly;
- log-probs are those of softmax(logits / temperature), the distribution sampled from.
"""

from __future__ import annotations

import logging
import time

import lightning as L
import torch

from .anchor import EMAAnchor
from .config import kl_params
from .evaluate import evaluate_policy
from .heads import HeadOut, head
from .kl import KLInputs, get_estimator, sequence_kl_penalty
from .kl.sampled import k3_core
from .losses import advantages, grpo_loss, masked_mean
from .monitor import StabilityMonitor
from .rollout import build_sampler

log = logging.getLogger(__name__)


class GRPOModule(L.LightningModule):
    def __init__(self, cfg, policy, tokenizer, task, anchor: EMAAnchor | None = None):
        super().__init__()
        self.cfg, self.policy, self.tokenizer, self.task, self.anchor = cfg, policy, tokenizer, task, anchor
        self.automatic_optimization = False
        self.estimator = get_estimator(cfg.kl.name, **kl_params(cfg.kl))
        self.sampler = build_sampler(cfg.rollout, tokenizer)
        self.monitor = StabilityMonitor(cfg.monitor.every, cfg.monitor.num_sequences, cfg.anchor.eta, cfg.algo.beta)
        self.iteration = 0  # RL iterations done (Alg 3's t), saved in checkpoints
        if self.estimator.needs_full_logits:
            V = policy.get_output_embeddings().weight.shape[0]
            n = cfg.algo.prompts_per_step * cfg.algo.group_size * cfg.rollout.max_new_tokens
            log.warning("kl=%s needs full logits: the policy, pi_old and the anchor each hold (tokens x %d) float32 "
                        "logits, about %.2f GiB per batch of %d responses (Top-k estimators keep O(k) per token)",
                        self.estimator.name, V, 3 * n * V * 4 / 2**30, n // cfg.rollout.max_new_tokens)
        self.eval_history: list[dict] = []

    # ------------------------------------------------------------------ one RL iteration
    def training_step(self, batch, batch_idx):
        a, r, k = self.cfg.algo, self.cfg.rollout, self.estimator.k
        seed = self.cfg.seed * 1_000_003 + self.iteration  # prompts, sampling and minibatch order
        src = self.estimator.topk_source
        metrics, t0 = {}, time.perf_counter()

        # 1. prompts and rollouts from pi_old = the current policy
        full = self.estimator.needs_full_logits
        reuse = r.reuse_old_logprobs and not full  # pi_old from the sampler itself (it saw every distribution)
        prompts = self.task.sample(a.prompts_per_step, seed=seed)
        ro = self.sampler.generate(self.policy, [p.text for p in prompts], a.group_size, temperature=r.temperature,
                                   top_p=r.top_p, max_new_tokens=r.max_new_tokens, stop=list(r.stop),
                                   on_stop=self._on_stop(prompts, a.group_size), seed=seed,
                                   topk=k if reuse and src == "policy_old" else 0, entropy=reuse)
        mask = ro.response_mask  # (N, T): policy tokens only (no prompt, observation or padding)
        rewards = torch.tensor([self.task.reward(prompts[i], txt) for i, txt in zip(ro.prompt_index, ro.responses)],
                               dtype=torch.float32, device=self.device)  # (N,)
        t1 = time.perf_counter()

        # 2. old and anchor log-probs, index sets (Alg 3, lines 6-11)
        ch = self._chunk(len(ro) * mask.shape[1])
        with torch.no_grad():
            if reuse and ro.sample_logp is not None:
                old = HeadOut(logp=ro.sample_logp, topk_idx=ro.sample_topk_idx, topk_logp=ro.sample_topk_logp,
                              entropy=ro.sample_entropy)
            else:
                old = head(self.policy, ro, k=k if src == "policy_old" else 0, full_logits=full, entropy=True,
                           temperature=r.temperature, chunk=ch)
            t2 = time.perf_counter()
            ref = None
            if self.anchor is not None:
                ref = head(self.anchor.model, ro, k=k if src == "anchor" else 0,
                           index=old.topk_idx if src == "policy_old" else None, full_logits=full, temperature=r.temperature,
                           chunk=ch)
        q = old.topk_idx if src == "policy_old" else (ref.topk_idx if src == "anchor" else None)  # (N, T, k)
        q_ref = ref.index_logp if src == "policy_old" else (ref.topk_logp if src == "anchor" else None)
        if a.reward_kl == "sequence" and ref is not None:  # WARP: sequence-level KL in the reward (eq. 10-12)
            rewards_used = rewards - a.beta * sequence_kl_penalty(old.logp, ref.logp, mask)
        else:
            rewards_used = rewards
        adv = advantages(rewards_used, a.group_size, a.adv_norm)  # (N,)
        t3 = time.perf_counter()

        # 3. Lambda passes of minibatch updates (Alg 3, lines 13-23)
        opt, sched = self.optimizers(), self.lr_schedulers()
        N = len(ro)
        mb = a.minibatch_size or N
        token_kl = a.beta != 0.0 and a.reward_kl == "none" and self.estimator.name != "none" and ref is not None
        sums: dict[str, float] = {}
        n_updates = 0
        gen = torch.Generator().manual_seed(seed)
        for _epoch in range(a.ppo_epochs):
            order = torch.randperm(N, generator=gen) if mb < N else torch.arange(N)
            for s in range(0, N, mb):
                rows = order[s : s + mb].to(self.device)
                sub = ro.select(rows)
                qi = None if q is None else q[rows]
                cur = head(self.policy, sub, index=qi, full_logits=full, temperature=r.temperature, chunk=ch)
                kl = None
                if token_kl:
                    kl = self.estimator(KLInputs(
                        logp=cur.logp, logp_old=old.logp[rows], logp_ref=ref.logp[rows], tokens=sub.input_ids[:, ro.prompt_len:],
                        topk_idx=qi, topk_logp=cur.index_logp, topk_logp_ref=None if q_ref is None else q_ref[rows],
                        logits=cur.logits, ref_logits=None if ref.logits is None else ref.logits[rows],
                    ))  # (mb, T)
                loss, m = grpo_loss(cur.logp, old.logp[rows], adv[rows], mask[rows], kl, beta=a.beta,
                                    eps_low=a.eps_low, eps_high=a.eps_high, loss_agg=a.loss_agg,
                                    norm_len=r.max_new_tokens)
                opt.zero_grad(set_to_none=True)
                self.manual_backward(loss)
                if a.grad_clip > 0:
                    gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), a.grad_clip)
                    m["grad_norm"] = gn
                opt.step()
                sched.step()
                n_updates += 1
                m["loss"] = loss.detach()
                for key, v in m.items():
                    sums[key] = sums.get(key, 0.0) + float(v)
        t4 = time.perf_counter()
        self.iteration += 1
        if self.anchor is not None and self.monitor.due(self.iteration):  # eq. 28, off by default
            metrics.update(self.monitor(self.policy, ro, lr=float(sched.get_last_lr()[0]), temperature=r.temperature))

        # 4. metrics (namespaced; the README has the table)
        with torch.no_grad():
            metrics.update({f"train/{key}": v / max(n_updates, 1) for key, v in sums.items()})
            metrics["train/reward_mean"] = float(rewards.mean())
            metrics["train/reward_std"] = float(rewards.std()) if len(rewards) > 1 else 0.0
            metrics["train/entropy"] = float(masked_mean(old.entropy, mask))
            metrics["train/response_len"] = float(mask.sum(-1).float().mean())
            metrics["train/lr"] = float(sched.get_last_lr()[0])
            if ref is not None:  # cleanrl-style diagnostics of KL(pi_old || anchor) from the samples
                log_w = ref.logp - old.logp
                metrics["train/kl_k1"] = float(masked_mean(-log_w, mask))
                metrics["train/kl_k3"] = float(masked_mean(k3_core(log_w), mask))
                metrics["anchor/lag_norm"] = self.anchor.lag_norm(self.policy)
                metrics["anchor/updates"] = self.anchor.updates
            metrics.update({"time/rollout_s": t1 - t0, "time/old_logp_s": t2 - t1, "time/anchor_s": t3 - t2,
                            "time/update_s": t4 - t3, "time/step_s": t4 - t0,
                            "time/tokens_per_s": float(mask.sum()) / max(t4 - t0, 1e-9)})
        self._log_metrics(metrics)
        self.log("reward", metrics["train/reward_mean"], prog_bar=True, logger=False)
        self.log("kl", metrics.get("train/kl", 0.0), prog_bar=True, logger=False)
        self.last_metrics = metrics

    def _chunk(self, n_tokens: int) -> int:
        from .chunked import auto_chunk

        m = self.cfg.model
        V = self.policy.get_output_embeddings().weight.shape[0]
        return m.head_chunk_tokens or auto_chunk(n_tokens, V, m.head_chunk_mb)

    def _on_stop(self, prompts, n):
        return self.task.on_stop_fn(prompts, n) if hasattr(self.task, "on_stop_fn") else None

    # ------------------------------------------------------------------ evaluation
    def run_eval(self) -> dict:
        res = evaluate_policy(self.policy, self.sampler, self.task, self.cfg.rollout,
                              progress=self.cfg.trainer.progress_bar, desc=f"eval @ {self.iteration}")
        metric = res["metric"]
        m = {f"eval/{name}/{metric}": v[metric] for name, v in res["splits"].items()}
        m[f"eval/avg/{metric}"] = res["avg"]
        an = self.anchor
        if an is not None and an.eval_every and self.iteration % an.eval_every == 0:
            ra = evaluate_policy(an.model, self.sampler, self.task, self.cfg.rollout, progress=False)
            m.update({f"eval_anchor/{name}/{metric}": v[metric] for name, v in ra["splits"].items()})
            m[f"eval_anchor/avg/{metric}"] = ra["avg"]
        self._log_metrics(m)
        self.eval_history.append({"iteration": self.iteration, **res})
        if self._trainer is not None:  # callbacks that follow the evaluations (an Optuna pruner, for instance)
            for cb in self.trainer.callbacks:
                if hasattr(cb, "on_ema_pg_eval"):
                    cb.on_ema_pg_eval(self.trainer, self, self.eval_history[-1])
        return res

    def on_train_start(self) -> None:
        if self.iteration == 0:
            self.run_eval()

    def on_train_epoch_end(self) -> None:
        self.run_eval()
        for lg in self.loggers:
            lg.save()

    def _log_metrics(self, metrics: dict) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step=self.iteration)

    # ------------------------------------------------------------------ data, optimizer, state
    def train_dataloader(self):
        """Iteration indices of one epoch = ``eval_every`` iterations (checkpoints fall on epoch ends)."""
        a = self.cfg.algo
        n = min(a.eval_every - self.iteration % a.eval_every, a.iterations - self.iteration)
        return torch.utils.data.DataLoader(list(range(self.iteration, self.iteration + max(n, 0))), batch_size=None)

    def configure_optimizers(self):
        o = self.cfg.optim
        opt = torch.optim.AdamW(self.policy.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas))
        w = self.cfg.algo.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / w) if w > 0 else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["ema_pg"] = {"iteration": self.iteration, "eval_history": self.eval_history}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        st = checkpoint.get("ema_pg", {})
        self.iteration = int(st.get("iteration", 0))
        self.eval_history = list(st.get("eval_history", []))
