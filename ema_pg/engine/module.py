"""RLModule: the Lightning adapter around :func:`ema_pg.step.rl_step`.

The algorithm lives in :mod:`ema_pg.step`; this module only connects it to Lightning:
one ``training_step`` = one RL iteration (the dataloader yields iteration numbers), the
optimizer update goes through the strategy (``manual_backward``, ``clip_gradients``), metrics
go to the loggers, evaluations run at epoch ends, and the iteration counter and evaluation
history travel in checkpoints. The anchor is a callback (:class:`ema_pg.engine.anchor.AnchorCallback`).
"""

from __future__ import annotations

import logging
import math
import time

import lightning as L
import torch

from ..advantages import ADVANTAGES
from ..chunked import HeadChunk, chunk_budget_mb
from ..config import Binding, is_deepspeed, stated_world_size, task_record, validate, validate_world
from ..dist import World, Zero3FullWeights, full_shape, whole, zero3_partitioned
from ..kl_control import build_kl_controller
from ..prompts import PromptEncoder
from ..rollout import build_sampler
from ..step import StepParts, rl_step
from ..update import NonFiniteUpdates, Updater
from .anchor import AnchorCallback
from .evaluation import eval_metrics, evaluate_policy, split_scores
from .models import compile_body
from .monitor import StabilityMonitor
from .runs import settings

log = logging.getLogger(__name__)
#: torch's thread count before a run of this process set it (``before``), and the count it set (``set``)
_THREADS_SET: dict[str, int] = {}


class EvalCallback(L.Callback):
    """A callback that follows the evaluations (an Optuna pruner, for instance)."""

    def on_ema_pg_eval(self, trainer: L.Trainer, module: RLModule, result: dict) -> None:
        """Called after every evaluation with its result (``iteration``, ``splits``, ``avg``, ``metric``)."""


class _StrategyUpdater(Updater):
    """The :class:`ema_pg.update.Updater` of a Lightning module: backward and clipping through the strategy. Several
    losses (micro-batches) accumulate: under DDP only the last backward all-reduces (the ranks may have different
    numbers of micro-batches); under DeepSpeed the engine is told which backward ends the accumulation, and it
    clips (``gradient_clipping`` = algo.grad_clip) and reports the norm after its step."""

    def __init__(self, module: RLModule, grad_clip: float, max_bad_steps: int, deepspeed: bool, after_step=None):
        super().__init__(max_bad_steps, after_step)
        self.module, self.grad_clip, self.deepspeed = module, grad_clip, deepspeed
        self.norm_after_step = deepspeed

    def _zero(self):
        self.module.optimizers().zero_grad(set_to_none=True)

    def _loss_value(self, loss):
        if self.deepspeed:  # every rank must skip together: the check is global
            return float("nan") if World.current().max(int(not torch.isfinite(loss.detach()).item())) else float(loss.detach())
        return float(loss.detach())

    def _backward(self, loss, last):
        strategy = self.module.trainer.strategy
        if self.deepspeed:
            engine = strategy.model
            # what the engine's own forward does first: ZeRO-3 counts a micro-batch there, and copies (not adds)
            # the gradients of a backward it counts as the first; the passes here call the module, not the engine
            clear = getattr(getattr(engine, "optimizer", None), "clear_backward_seen_flag", None)
            if clear is not None:
                clear()
            engine.set_gradient_accumulation_boundary(last)
            self.module.manual_backward(loss)
        elif last or not hasattr(strategy, "block_backward_sync"):
            self.module.manual_backward(loss)  # DDP: the accumulated gradients are all-reduced here
        else:
            with strategy.block_backward_sync():
                self.module.manual_backward(loss)

    def _norm(self) -> float:
        if self.deepspeed:
            return float(self.module.trainer.model.get_global_grad_norm() or 0.0)
        grads = [p.grad for p in self.module.policy.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def _clip(self, norm):
        if self.grad_clip > 0:
            opt = self.module.optimizers()
            self.module.clip_gradients(opt, gradient_clip_val=self.grad_clip, gradient_clip_algorithm="norm")

    def _opt_step(self):
        self.module.optimizers().step()

    def _check_params(self):
        self.guard.check_params(self.module.policy.parameters())

    def _sched_step(self):
        self.module.lr_schedulers().step()

    @property
    def lr(self) -> float:
        return float(self.module.lr_schedulers().get_last_lr()[0])


class RLModule(L.LightningModule):
    """A run's RL iterations as a LightningModule: one training step is one iteration of Algorithm 3
    (:func:`ema_pg.step.rl_step`), whatever the surrogate (GRPO, PPO with a critic, GSPO, CISPO, DPPO)."""

    def __init__(self, cfg, policy, tokenizer, task, anchor: AnchorCallback | None = None,
                 encode: PromptEncoder | None = None, bound: Binding | None = None):
        super().__init__()
        self.cfg, self.policy, self.tokenizer, self.task, self.anchor = cfg, policy, tokenizer, task, anchor
        self.automatic_optimization = False
        bound = bound or validate(cfg)  # what the run runs, bound once (ema_pg.engine.runs.open_run binds it)
        self.estimator = bound.estimator
        self.staleness = bound.staleness  #: rollout.max_staleness as bound (0: synchronous)
        self.records = (bound.algo, bound.rollout)  #: the algo and rollout groups as plain records, for the step
        self.loss = bound.loss  #: the loss compiled from them
        self.sampler = build_sampler(bound.rollout, tokenizer, lora=bool(cfg.model.lora_rank))
        self.encode = encode or PromptEncoder.of(tokenizer, task_record(cfg))  # the one prompt -> ids
        self.updater = _StrategyUpdater(self, cfg.algo.grad_clip, cfg.algo.max_bad_steps,
                                        deepspeed=is_deepspeed(cfg),
                                        after_step=None if anchor is None else lambda: anchor.after_optimizer_step(policy))
        self.critic = None
        if ADVANTAGES[cfg.algo.advantage].needs_critic:  # PPO's value model: its own optimizer, saved in checkpoints
            from ..critic import Critic

            self.critic = Critic(policy, cfg.algo.critic_lr, cfg.algo.cliprange_value, cfg.algo.grad_clip)
            self.value_model = self.critic.model  # a submodule: it moves with the module
        eta = None if anchor is None else anchor.scheme.params.get("eta")  # the bound scheme's, not the config's
        self.monitor = StabilityMonitor(cfg.monitor.every, cfg.monitor.num_sequences, eta)
        self.kl_ctrl = build_kl_controller(bound.algo)  # beta in force: algo.beta, or the adaptive controller's
        self.iteration = 0  # RL iterations done (Alg 3's t), saved in checkpoints
        self.ahead = None  # rollout.max_staleness > 0: the rollout worker (ema_pg.engine.rollout_workers), started at the first step
        self._restored_in_flight: dict[int, bytes] = {}  # the batches in flight at the checkpoint resumed from
        self.staleness_counts: dict[int, int] = {}  # iterations per staleness of their batch (the run's histogram)
        self.eval_history: list[dict] = []
        #: wall seconds of the run before this process (a resume's checkpoint carries them), and this process's start
        self.elapsed_before, self._started = 0.0, time.monotonic()
        self.rl_threads: int | None = None  #: the torch threads of the RL iterations, as the run began them
        self.last_metrics: dict = {}
        self._collapse_warned, self._was_peaked = False, False
        if self.estimator.needs_full_logits:
            V = policy.get_output_embeddings().weight.shape[0]
            n = cfg.algo.prompts_per_step * cfg.algo.group_size * cfg.rollout.max_new_tokens
            log.warning("kl=%s needs full logits: the policy, pi_old and the anchor each hold (tokens x %d) float32 "
                        "logits, about %.2f GiB per batch of %d responses (Top-k estimators keep O(k) per token)",
                        self.estimator.name, V, 3 * n * V * 4 / 2**30, n // cfg.rollout.max_new_tokens)

    def head_chunk_rule(self) -> HeadChunk:
        """How many tokens a chunk of the log-prob head takes: ``model.head_chunk_tokens``, or sized by memory."""
        m = self.cfg.model
        return HeadChunk(m.head_chunk_tokens, full_shape(self.policy.get_output_embeddings().weight)[0],
                         chunk_budget_mb(m.head_chunk_mb, self.device.type))

    # ------------------------------------------------------------------ one RL iteration
    def training_step(self, iteration, batch_idx):
        iteration = int(iteration)
        if iteration != self.iteration:
            raise RuntimeError(f"the dataloader yielded iteration {iteration} but the module is at {self.iteration}")
        try:
            res = self._rl_step(iteration)
        except NonFiniteUpdates as e:
            c = self.cfg
            causes = ([f"model.dtype={c.model.dtype} (float16 overflows: use bfloat16 or float32)"]
                      if c.model.dtype == "float16" else []) + [f"optim.lr={c.optim.lr} too large",
                                                                 f"algo.beta={c.algo.beta} too large"]
            raise NonFiniteUpdates(  # what the run keeps is said where it stops (fit.command), from its folder
                f"{e} at iteration {iteration}. Likely causes: {', '.join(causes)}; algo.max_bad_steps="
                f"{c.algo.max_bad_steps} sets how many bad updates in a row end the run") from None
        self.iteration += 1
        metrics = res.metrics
        if self.anchor is not None:  # the step followed the anchor (its step 5) and logged its lag before that
            beta = res.kl_weight  # the loss's, not algo.beta: they differ under algo.global_kl_scale
            if self.monitor.due(self.iteration, beta):  # eq. 28, off by default
                metrics.update(self.monitor(self.policy, res.rollouts, lr=self.updater.lr, beta=beta,
                                            temperature=self.cfg.rollout.temperature))
        if self.device.type == "cuda":  # the run's peak so far: what a GPU must hold for this recipe
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self._log_metrics(metrics)
        self._warn_collapse(metrics)
        self.last_metrics = metrics

    def _rl_step(self, iteration: int):
        anchor_model = None if self.anchor is None else self.anchor.model
        sampled = None
        world, chunk = World.current(), self.head_chunk_rule()  # (ZeRO-3: the head's shape is read by a collective)
        if self.staleness:  # sampled ahead by the worker, with the weights of max(0, t - k)
            if self.ahead is None and world.rank == 0:  # one worker, rank 0's (ahead.shared_next)
                self.ahead = self._rollouts_ahead(chunk)
            if world.size == 1:
                sampled = self.ahead.next(iteration, self.policy, anchor_model)
                wait = self.ahead.last_wait_s
            else:
                sampled, wait = self._shared_next(iteration, anchor_model, world)
        parts = StepParts(self.policy, anchor_model, self.task, self.sampler, self.estimator, *self.records,
                          self.cfg.seed, chunk, self.updater, world, self.critic, self.encode,
                          anchor=None if self.anchor is None else self.anchor.anchor, loss=self.loss)
        res = rl_step(iteration, parts, beta=self.kl_ctrl.value, grad_ratio=self._grad_ratio_due(iteration),
                      sampled=sampled)
        if res.ctrl_kl is not None:  # beta for the next iteration, from this one's KL and responses
            self.kl_ctrl.update(res.ctrl_kl, n_steps=len(res.rollouts) * world.size)
        if sampled is not None:
            lag = iteration - sampled.version
            self.staleness_counts[lag] = self.staleness_counts.get(lag, 0) + 1
            res.metrics["time/rollout_wait_s"] = wait
            if self.ahead is not None:  # rank 0's: what this iteration's push carried
                res.metrics["rollout/push_mb"] = self.ahead.last_push_mb
            res.metrics["time/step_s"] += wait
        return res

    def _shared_next(self, iteration: int, anchor_model, world: World):
        """Several trainer processes: rank 0's worker samples the whole batch, each rank takes its share."""
        from .rollout_workers import shared_next

        aligned = anchor_model is not None and self.cfg.anchor.align == "behaviour"  # the anchor is pushed too
        models = [self.policy] + ([anchor_model] if aligned else [])
        return shared_next(self.ahead, iteration, self.policy, anchor_model, world,
                           lambda: whole(models, self._zero3_offload()), self.cfg.algo.group_size)

    def _zero3_offload(self):
        """The DeepSpeed ZeRO-3 engine's DeepSpeedZeRoOffload (None outside ZeRO-3)."""
        return getattr(getattr(self.trainer.strategy.model, "optimizer", None), "parameter_offload", None)

    def _rollouts_ahead(self, chunk: HeadChunk):
        """The worker's trainer side, on one rank only: nothing here may be collective (see ahead.shared_next)."""
        from .rollout_workers import RolloutsAhead

        ahead = RolloutsAhead(self.cfg, self.policy, None if self.anchor is None else self.anchor.model,
                              self.tokenizer, self.task, self.encode, chunk, k=self.staleness, records=self.records)
        ahead.restore(self._restored_in_flight)
        return ahead

    def teardown(self, stage: str) -> None:
        # a vLLM engine and its KV cache (1 GiB on CPU) end with their run: a Hydra sweep runs its runs in one
        # process, and each run's engine stayed (a sweep of 27 vLLM runs swapped at 9 GiB)
        self.sampler.close()
        if self.ahead is not None:
            if self.staleness_counts:
                log.info("rollouts by staleness (iterations): %s",
                         ", ".join(f"{k}: {v}" for k, v in sorted(self.staleness_counts.items())))
            self.ahead.close()
            self.ahead = None

    def _grad_ratio_due(self, iteration: int) -> bool:
        every = self.cfg.monitor.grad_ratio_every
        return bool(every) and iteration % every == 0

    def _warn_collapse(self, metrics: dict) -> None:
        """A policy that was peaked and is now at (near) uniform entropy, earning nothing, has collapsed: say
        so once. A policy that starts uniform (a random initialization, as in the benchmarks) is not warned."""
        V, entropy = self.policy.config.vocab_size, metrics.get("train/entropy", 0.0)
        if entropy < 0.9 * math.log(V):
            self._was_peaked = True
        if (not self._collapse_warned and self._was_peaked and entropy >= 0.95 * math.log(V)
                and metrics.get("train/reward_mean", 1.0) == 0.0):
            self._collapse_warned = True
            log.warning("policy collapse at iteration %d: entropy %.2f is near ln V = %.2f (uniform) and the reward "
                        "is 0; optim.lr=%g is likely too large", self.iteration, metrics["train/entropy"], math.log(V),
                        self.cfg.optim.lr)

    # ------------------------------------------------------------------ evaluation
    def run_eval(self) -> dict:
        world = World.current()
        hub = next((lg for lg in self.loggers if lg.name == "trackers"), None) if self._trainer is not None else None
        show = self.cfg.logger.samples if hub is not None else 0  # a few generations per split for the trackers
        res = evaluate_policy(self.policy, self.sampler, self.task, self.cfg.rollout, world=world,
                              progress=self.cfg.trainer.progress_bar and world.rank == 0 and f"eval @ {self.iteration}",
                              encode=self.encode, show=show)
        if show:
            hub.samples(self.iteration, res.pop("samples", {}))
        m = eval_metrics("eval", res)
        an = self.anchor
        if an is not None and an.eval_every and self.iteration % an.eval_every == 0:
            ra = evaluate_policy(an.model, self.sampler, self.task, self.cfg.rollout, progress=False, world=world,
                                 encode=self.encode)
            m.update(eval_metrics("eval_anchor", ra))
        self._log_metrics(m)
        if world.rank == 0:  # the console: each split's score, as the files hold them
            log.info("eval @ %d: %s", self.iteration, split_scores(res))
        self.eval_history.append({"iteration": self.iteration, **res})
        if self._trainer is not None:
            for cb in self.trainer.callbacks:
                if isinstance(cb, EvalCallback):
                    cb.on_ema_pg_eval(self.trainer, self, self.eval_history[-1])
        return res

    def setup(self, stage: str) -> None:
        """The rules that need the world size, where the config did not state it (``trainer.devices=auto``):
        Lightning has counted the processes by now."""
        if stated_world_size(self.cfg.trainer) != self.trainer.world_size:
            validate_world(self.cfg, self.trainer.world_size)

    def on_fit_start(self) -> None:
        if any(zero3_partitioned(p) for p in self.policy.parameters()):
            self.sampler.lockstep = World.current()  # every forward is collective under ZeRO-3
            offload = self._zero3_offload()
            if self.cfg.rollout.name == "vllm":  # each rank's engine is pushed the gathered weights
                self.sampler.zero3_offload = offload
            elif self.cfg.rollout.zero3_gather and offload is not None:
                self.sampler.full_weights = Zero3FullWeights(offload)
            log.info("ZeRO-3: rollouts sample from %s", "an engine pushed the gathered weights"
                     if self.cfg.rollout.name == "vllm" else "the gathered weights (rollout.zero3_gather)"
                     if self.sampler.full_weights is not None else "the partitioned weights")
        if self.cfg.model.compile:  # after the anchor's copy (attached at setup): each model compiles its own body
            for model in (self.policy, None if self.anchor is None else self.anchor.model):
                if model is not None:
                    compile_body(model, backward_twice=bool(self.cfg.monitor.grad_ratio_every))

    def _choose_threads(self) -> None:
        """The RL iterations' torch threads, where neither ``trainer.num_threads`` nor the environment chose
        (:func:`ema_pg.process.rl_threads_default`), in one process with no sampler ahead: the room the machine has as the run
        begins them; a resume keeps its run's count, so that it repeats the uninterrupted run. A later run in this
        process (a sweep's next job) starts again from the count an earlier one lowered."""
        import os

        from .. import process

        if self.cfg.trainer.num_threads or self.trainer.world_size > 1 or self.staleness:
            return
        now = torch.get_num_threads()
        base = _THREADS_SET.get("before", now) if _THREADS_SET.get("set") == now else now
        if self.rl_threads is not None:  # a resume
            if process.threads_chosen(os.environ):  # the environment chose since
                return
            want = self.rl_threads
            if want != now:
                log.info("the RL iterations go on with the %d torch thread(s) their run began with", want)
        else:
            cpus = os.cpu_count() or 1
            chosen = process.rl_threads_default(dict(os.environ), process.others_running, cpus, base)
            want = base if chosen is None else chosen
            if want != base:
                log.info("beside other work (%d CPUs, not room for %d threads): the RL iterations run on %d torch "
                         "thread(s); trainer.num_threads chooses", cpus, base, want)
        if want != now:
            torch.set_num_threads(want)
        _THREADS_SET.update(before=base, set=want)
        self.rl_threads = want

    def on_train_start(self) -> None:
        self._choose_threads()
        if self.iteration == 0 and not self.cfg.algo.eval_only_at_end:
            self.run_eval()

    def on_train_epoch_end(self) -> None:
        a = self.cfg.algo
        if not a.eval_only_at_end or self.iteration >= a.iterations:
            self.run_eval()
        for lg in self.loggers:
            lg.save()

    def elapsed_s(self) -> float:
        """The run's wall seconds so far, summed over its processes (a resumed run: up to its checkpoint, then
        this process's), so a resume or a copied run folder reports what the run took, not the span of its files."""
        return self.elapsed_before + time.monotonic() - self._started

    def _log_metrics(self, metrics: dict) -> None:
        metrics = {**metrics, "time/elapsed_s": self.elapsed_s()}
        for lg in self.loggers:
            lg.log_metrics(metrics, step=self.iteration)

    # ------------------------------------------------------------------ data, optimizer, state
    def train_dataloader(self):
        """Iteration numbers of one epoch = up to ``eval_every`` iterations (checkpoints fall on epoch ends)."""
        a = self.cfg.algo
        n = min(a.eval_every - self.iteration % a.eval_every, a.iterations - self.iteration)
        return torch.utils.data.DataLoader(list(range(self.iteration, self.iteration + max(n, 0))), batch_size=None)

    def configure_optimizers(self):
        o = self.cfg.optim
        params = [p for p in self.policy.parameters() if p.requires_grad]  # LoRA: the adapters only
        # not fused=True: the fused kernel leaves the version counters that the vLLM weight sync keys on unmoved
        opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas))
        w = self.cfg.algo.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / w) if w > 0 else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # what a resume must continue (runs.check_trained_with), and the run's wall time so far
        checkpoint["ema_pg"] = {"iteration": self.iteration, "eval_history": self.eval_history,
                                "settings": settings(self.cfg), "elapsed_s": self.elapsed_s()}
        if self.rl_threads is not None:  # the count a resume keeps
            checkpoint["ema_pg"]["rl_threads"] = self.rl_threads
        if self.kl_ctrl.adaptive:  # the coefficient it reached: a resume continues from it
            checkpoint["ema_pg"]["kl_ctrl"] = self.kl_ctrl.state_dict()
        if self.critic is not None:  # its weights are in the module's state_dict; its optimizer is not Lightning's
            checkpoint["ema_pg"]["critic_opt"] = self.critic.opt.state_dict()
        if self.staleness:  # the batches sampled ahead, awaited: a resume takes them as they are
            checkpoint["ema_pg"]["in_flight"] = (self.ahead.state() if self.ahead is not None
                                                 else dict(self._restored_in_flight))
            checkpoint["ema_pg"]["staleness_counts"] = dict(self.staleness_counts)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        st = checkpoint.get("ema_pg", {})
        self.iteration = int(st.get("iteration", 0))
        if self.iteration % self.cfg.algo.eval_every:  # saved inside an evaluation period (on SIGTERM)
            # the dataloader of the resumed period yields its remaining iterations, so its batch count starts at 0
            # (Lightning would count the ones done before it and end the period early). Lightning then counts
            # the batch the checkpoint was written at the end of as completed (its restart "on train batch end"):
            # -1 + 1 = 0.
            current = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {}).get("current")
            if current is not None:
                current.update(ready=0, started=0, processed=0, completed=-1)
        self.eval_history = list(st.get("eval_history", []))
        self.elapsed_before = float(st.get("elapsed_s", 0.0))  # this process's own time counts from its start
        self.rl_threads = st.get("rl_threads")
        self._restored_in_flight = dict(st.get("in_flight", {}))
        self.staleness_counts = dict(st.get("staleness_counts", {}))
        if self.kl_ctrl.adaptive and "kl_ctrl" in st:
            self.kl_ctrl.load_state_dict(st["kl_ctrl"])
        if self.critic is not None and "critic_opt" in st:
            self.critic.opt.load_state_dict(st["critic_opt"])


GRPOModule = RLModule  #: its name before it was named for what it runs, for one release
