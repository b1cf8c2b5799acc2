"""One training run assembled from its config: :func:`train`.

The run folder is opened first (:func:`ema_pg.engine.runs.open_run`: resume, stage, ``if_exists``),
then the task (a retrieval server is checked here), the policy and its tokenizer, the anchor, the
Lightning module around :func:`ema_pg.step.rl_step` and the Trainer. ``python -m ema_pg.train`` is
the command (:mod:`ema_pg.train`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig

from ..config import ConfigError, is_deepspeed, task_record, validate_model
from ..update import NonFiniteUpdates
from ..heads import check_head
from ..packing import pack_problem
from ..prompts import PromptEncoder
from ..tasks import ServiceError, build_task, task_metric
from ..tasks.plugins import check_task
from ..tasks.base import StoppedBySigterm
from .rollout_workers import RolloutWorkerError
from .anchor import AnchorCallback
from .console import log_file_only, quiet_third_party
from .evaluation import split_scores
from .files import NoRoom, atomic_checkpoint_io, atomic_write, no_room_errno
from .models import ModelPathError, head_dim
from .module import RLModule
from .plotting import plot_run
from .policy import build_policy
from .owner import release_run_dir
from .install import check_head_dim, trackers_of
from .tracking import TrackerHub, check_reachable, import_run, make_loggers
from .runs import (EXIT_INTERRUPTED, RUN_DIR_ENV, discard_hydra_output, in_multirun, is_rank_zero, job_folder,
                   open_run, outcome, record_failure, record_run)
from .strategies import build_strategy

log = logging.getLogger("ema_pg")


class IterationBar(L.Callback):
    """One bar over the run's RL iterations (``k/N``, with the batch's reward and KL), in place of Lightning's
    epoch bar (an epoch here is an evaluation period, and Lightning counted them out of -1)."""

    def __init__(self):
        self.bar = None

    def on_train_start(self, trainer, pl_module) -> None:
        from tqdm.auto import tqdm

        if trainer.is_global_zero:
            n = pl_module.cfg.algo.iterations
            self.bar = tqdm(total=n, initial=min(pl_module.iteration, n), desc="RL iterations", dynamic_ncols=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.bar is not None:
            m = pl_module.last_metrics
            self.bar.set_postfix(reward=f"{m.get('train/reward_mean', float('nan')):.3f}",
                                 kl=f"{m.get('train/kl', 0.0):.2e}", refresh=False)
            self.bar.update(1)

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def train(cfg: DictConfig, callbacks: list | tuple = ()) -> tuple[dict, dict]:
    """Run (or resume) one training run; returns (final metrics, objects).

    ``callbacks``: extra Lightning callbacks (an Optuna pruning callback, for instance).
    With ``if_exists=resume`` a run folder that holds a finished run is skipped (its final
    metrics are returned) and one that holds a checkpoint is resumed, so a killed sweep is
    continued by running the same command again.
    """
    quiet_third_party()
    opened = open_run(cfg)
    try:
        return _train(opened, callbacks)
    finally:
        release_run_dir(opened.run_dir)  # the folder is free once its run ends (this process may go on: a sweep)


def _train(opened, callbacks) -> tuple[dict, dict]:
    cfg, run_dir = opened.cfg, opened.run_dir
    if opened.skipped is not None:
        if trackers_of(cfg.logger) and is_rank_zero() and (run_dir / "config.yaml").is_file():
            import_run(run_dir, trackers_of(cfg.logger), cfg.logger)  # a finished run's trackers given what they lack
        return opened.skipped, {"run_dir": run_dir, "plot": run_dir / "curves.png", "cfg": cfg, "skipped": True,
                                "failed": opened.skipped.get("failed")}
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    try:
        if is_rank_zero():
            check_reachable(cfg.logger)  # an online tracker out of reach: one line, before any model is built
        task_spec = task_record(cfg)  # the task group as a plain dict, for the algorithm floor
        task = build_task(task_spec)  # a retrieval server is checked here, before any model is built
        check_task(task, cold_start=not cfg.model.path, sft=cfg.sft.steps > 0)  # (a class from outside, above all)
        if cfg.rollout.partial and task.turn_ends:
            raise ConfigError(f"rollout.partial=true is built for single-turn tasks; task {cfg.task.name} ends its "
                              f"turns at {', '.join(map(repr, task.turn_ends))} (its environment's turns are not "
                              "continued across versions): use rollout.partial=false")
        policy, tok = build_policy(cfg, task, check=lambda tok: check_context(  # before a cold start's SFT
            cfg, task, PromptEncoder.of(tok, task_spec), cfg.model.max_positions))
        check_head(policy)  # an architecture the log-prob head cannot score is refused now, not at the first step
        if cfg.algo.padding_free and (problem := pack_problem(policy)):
            raise ValueError(problem)
        encode = PromptEncoder.of(tok, task_spec)
    except (ValueError, ServiceError, NotImplementedError) as e:  # NoColdStart is a ValueError
        raise ConfigError(str(e)) from None
    mc = policy.config
    validate_model(cfg, opened.bound, vocab_size=mc.vocab_size)
    check_head_dim(cfg, head_dim(mc))  # vLLM's CPU kernels take a few head sizes
    check_fits(cfg, policy, task, encode)
    k, n = opened.bound.staleness, cfg.algo.iterations
    if k and k >= n - 1:  # batch t is sampled by version max(0, t - k): all of them by the initial policy
        log.warning("rollout.max_staleness=%d with algo.iterations=%d: every batch of this run is sampled by the "
                    "initial policy (batch t by version t - %d); lower rollout.max_staleness for an off-policy run",
                    k, n, k)
    if cfg.model.lora_rank:  # the base is frozen; only the adapters train (and the anchor is an adapter too)
        from .lora import wrap_lora

        try:
            policy = wrap_lora(policy, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets)
        except ValueError as e:  # PEFT: target modules not found in the model
            raise ConfigError(f"model.lora_targets={cfg.model.lora_targets!r}: {str(e).splitlines()[0]}") from None
    anchor = None
    if cfg.anchor.name != "none":
        anchor = AnchorCallback(opened.bound.scheme, cfg.anchor.eval_every, cfg.anchor.path)
        try:
            anchor.attach(policy)
        except (ValueError, ModelPathError) as e:
            raise ConfigError(str(e)) from None
        if cfg.algo.padding_free and (problem := pack_problem(anchor.model)):  # a teacher of another architecture
            raise ConfigError(f"the anchor: {problem}")
    module = RLModule(cfg, policy, tok, task, anchor, encode=encode, bound=opened.bound)
    if is_rank_zero():  # what runs, once: model, task, estimator, anchor, and one prompt as the model reads it
        a, precision = cfg.algo, str(cfg.trainer.precision)
        numbers = cfg.model.dtype if precision.startswith("32") else f"{cfg.model.dtype}, {precision}"  # 32, 32-true
        log.info("run: %s (%.1fM parameters, %s) on %s; kl=%s, anchor=%s, beta=%g; %d iterations of %d prompts x %d "
                 "samples; writing to %s", cfg.model.path or "tiny cold-start policy",
                 sum(p.numel() for p in policy.parameters()) / 1e6, numbers, task.name or type(task).__name__, cfg.kl.name,
                 cfg.anchor.name, a.beta, a.iterations, a.prompts_per_step, a.group_size, run_dir)
        log.info("prompts as the model reads them (%s), e.g.:\n%s", encode.describe(),
                 tok.decode(encode.encode(task.sample(1, seed=cfg.seed)[0])))

    record_run(opened, policy, tok)

    ckpt_cb = _PeriodCheckpoint(run_dir / "checkpoints")
    callbacks = ([ckpt_cb, _StopAtIterations()] + ([anchor] if anchor is not None else []) + list(callbacks)
                 + [_CheckpointOnSigterm(run_dir / "checkpoints" / "last.ckpt")]  # last: after the anchor's update
                 + ([IterationBar()] if cfg.trainer.progress_bar else []))
    deepspeed = is_deepspeed(cfg)  # DeepSpeed writes its own checkpoint folders
    tc = cfg.trainer
    loggers = make_loggers(cfg, run_dir, opened.resume_step)
    hub = next((lg for lg in loggers if isinstance(lg, TrackerHub)), None)
    if hub is not None and is_rank_zero():
        hub.start()  # the tracker runs, opened or continued, before the first iteration
    status = "failed"
    try:
        out = _fit(cfg, opened, module, anchor, loggers, callbacks, deepspeed, tc)
        status = "success"
        return out
    except RunInterrupted:
        status = "interrupted"
        raise
    finally:
        if hub is not None:  # a run that ended short of its iterations (pruned) is closed as interrupted
            finished = status == "success" and module.iteration >= cfg.algo.iterations
            hub.close(status if finished or status != "success" else "interrupted", finished=finished)


def _fit(cfg, opened, module, anchor, loggers, callbacks, deepspeed, tc) -> tuple[dict, dict]:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    run_dir = opened.run_dir
    trainer = L.Trainer(
        accelerator=tc.accelerator, devices=tc.devices, strategy=build_strategy(cfg), precision=tc.precision,
        max_epochs=-1, logger=loggers, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, reload_dataloaders_every_n_epochs=1,
        num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1, default_root_dir=str(run_dir),
        deterministic=False, use_distributed_sampler=False,  # every rank runs every iteration number
        plugins=None if deepspeed else [atomic_checkpoint_io()],
    )
    try:
        trainer.fit(module, ckpt_path=opened.ckpt_path, weights_only=False)  # the run's own checkpoint
    except (SIGTERMException, StoppedBySigterm):  # the latter: while the task's own code ran, mid-iteration
        raise RunInterrupted(interrupted_line(module.iteration, cfg.algo.iterations, run_dir)) from None
    finally:
        module.teardown("fit")  # the rollout worker ends with its run, whatever ended the run (Lightning skips it on errors)
        for lg in trainer.loggers:
            try:
                lg.finalize("success")
            except Exception:  # noqa: BLE001 - closing must not mask the real error
                pass
    final = dict(module.eval_history[-1]) if module.eval_history else {}
    first = module.eval_history[0] if module.eval_history else {}
    base = first["avg"] if first.get("iteration") == 0 else float("nan")  # (algo.eval_only_at_end: not evaluated)
    plot = run_dir / "curves.png"
    if is_rank_zero():
        if module.eval_history and module.iteration >= cfg.algo.iterations:  # a finished run (not a pruned one)
            if first.get("iteration") == 0:
                final["base_avg"] = base
            final["wall_s"] = module.elapsed_s()  # the run's wall time, its resumes summed (workbench.results)
            atomic_write(run_dir / "eval.json", json.dumps(final, indent=2))
        plot = plot_run(run_dir)
    metric = task_metric(cfg.task.name, cfg.task.get("target"))
    metrics = {**outcome(metric, final.get("avg", float("nan")), module.iteration, base), **module.last_metrics}
    return metrics, {"module": module, "trainer": trainer, "run_dir": run_dir, "plot": plot, "cfg": cfg}


def check_fits(cfg, policy, task, encode) -> None:
    """What the built model must hold, checked before anything is written: the longest prompt (of a sample of the
    training prompts and of every evaluation prompt) plus the response fits its context; one iteration's rollouts fit
    in memory (their KV cache and last logits, a lower bound)."""
    mc = policy.config
    ro, a = cfg.rollout, cfg.algo
    context = getattr(mc, "max_position_embeddings", None) or getattr(mc, "n_positions", None)
    longest = check_context(cfg, task, encode, context)
    n, t = a.prompts_per_step * a.group_size, longest + ro.max_new_tokens
    heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
    elem = torch.finfo(next(policy.parameters()).dtype).bits // 8
    need = n * (t * mc.num_hidden_layers * 2 * heads * head_dim(mc) * elem + mc.vocab_size * 4)
    have = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if need > 0.8 * have:
        raise ConfigError(f"one iteration samples {n} responses (algo.prompts_per_step={a.prompts_per_step} x "
                          f"algo.group_size={a.group_size}) of up to {t} tokens: their KV cache alone needs about "
                          f"{need / 2**30:.1f} GiB of the {have / 2**30:.0f} GiB here; lower them")


def check_context(cfg, task, encode, context: int | None) -> int:
    """The longest prompt (of a sample of the training prompts and of every evaluation prompt), in tokens; refused
    in one line when it and a response (and, for a multi-turn task, one observation) do not fit ``context``. Run
    on the built model, and on a tiny policy's tokenizer before its cold start trains (a prompt too long for the
    context made the cold start's SFT ask for tens of GiB)."""
    ro = cfg.rollout
    train = task.train_prompts() or task.sample(64, seed=cfg.seed)  # every one a data file holds
    where = [("training prompt", i) for i in range(len(train))] + [
        (f"prompt of eval split {name}", i) for name, split in task.eval_splits().items() for i in range(len(split))]
    lengths = [len(ids) for ids in encode(list(train) + [p for split in task.eval_splits().values() for p in split])]
    at = max(range(len(lengths)), key=lengths.__getitem__)
    longest = lengths[at]
    if context and longest + ro.max_new_tokens > context:
        what, i = where[at]
        raise ConfigError(f"the model's context is {context} tokens, but {what} {i} has {longest} tokens and with "
                          f"rollout.max_new_tokens={ro.max_new_tokens} needs {longest + ro.max_new_tokens}; lower "
                          "rollout.max_new_tokens, drop that prompt from the data (or use a model with a longer "
                          "context)")
    multi_turn = task.on_stop_fn(list(train[:1]), 1) is not None  # its environment answers turns
    if context and multi_turn and longest + ro.max_new_tokens + ro.max_obs_tokens > context:
        what, i = where[at]
        raise ConfigError(f"the model's context is {context} tokens, but {what} {i} has {longest} tokens: with "
                          f"rollout.max_new_tokens={ro.max_new_tokens} and one observation of up to "
                          f"rollout.max_obs_tokens={ro.max_obs_tokens} an episode of task {cfg.task.name} needs "
                          f"{longest + ro.max_new_tokens + ro.max_obs_tokens}; lower rollout.max_obs_tokens or "
                          "rollout.max_new_tokens (or use a model with a longer context)")
    return longest


def command(cfg: DictConfig) -> float:
    """``python -m ema_pg.train``: run :func:`train` and turn its outcome into one line and an exit code; returns the
    metric an Optuna search optimizes (the final ``eval/avg/<metric>``)."""
    try:
        metrics, objs = train(cfg)
    except (ConfigError, ModelPathError) as e:
        if in_multirun():  # one job's refusal (say, its model's context): recorded, and the sweep goes on
            log.error("config error: %s", e)
            record_failure(os.environ.get(RUN_DIR_ENV) or job_folder(), e)
            return float("nan")
        discard_hydra_output(os.environ.get(RUN_DIR_ENV))  # a refused run leaves no folder behind
        raise SystemExit(f"config error: {e}") from None
    except RunInterrupted as e:
        log.warning("%s", e)
        raise SystemExit(EXIT_INTERRUPTED) from None  # a sweep stops here too: the same command continues it
    except (NonFiniteUpdates, ServiceError, RolloutWorkerError, OSError) as e:
        if isinstance(e, OSError) and not isinstance(e, NoRoom):  # a full disk outside our own writers (a log)
            if no_room_errno(e) is None:
                raise
            e = NoRoom(Path(e.filename or "?"), None, e)
        run = os.environ.get(RUN_DIR_ENV, "<run folder>")
        record_failure(run, e)
        if in_multirun():  # recorded in the run's folder; the sweep goes on and names it at its end
            log.error("stopped: %s", e)
            return float("nan")
        log_file_only(log, logging.ERROR, "stopped: %s", e)  # the console gets it once, as the last line below
        raise SystemExit(f"stopped: {e}; {kept(run)}") from None
    metric_key = next(k for k in metrics if k.startswith("eval/avg/"))
    if objs.get("failed"):
        log.warning("%s failed earlier (%s): skipped; delete its failed.json to run it again", objs["run_dir"],
                    objs["failed"])
        return float("nan")
    if not is_rank_zero():
        return float(metrics[metric_key])
    print(f"run folder: {objs['run_dir']}\nmetrics:    {objs['run_dir'] / 'metrics.csv'}\nplot:       {objs['plot']}")
    base = metrics["base/avg"]
    print(f"final {metric_key} = {metrics[metric_key]:.3f}" + ("" if math.isnan(base) else f" (base policy: {base:.3f})"))
    history = objs["module"].eval_history if "module" in objs else []
    if history and len(history[-1]["splits"]) > 1:  # one split: the line above is it
        first = history[0] if history[0].get("iteration") == 0 and len(history) > 1 else None
        print(f"per split:  {split_scores(history[-1], first)}")
    return float(metrics[metric_key])


#: what a stop that leaves nothing to resume from says, where the same command then starts the run again
STARTS_AGAIN = "it had written no checkpoint: the same command starts it again"


def kept(run: str, none: str = "it had written no checkpoint: fix the cause and run the same command again (a new "
                                 "run)") -> str:
    """What a stopped run leaves to go on from, read from its folder: its checkpoint's iteration, or ``none``."""
    from .policy import checkpoint_iteration

    try:
        saved = checkpoint_iteration(run)
    except (ValueError, OSError):
        saved = None
    if saved is None:
        return none
    return f"the run folder keeps its checkpoint of iteration {saved}: continue with python -m ema_pg.train resume={run}"


class _StoppedOutsideTraining(BaseException):
    """A SIGTERM outside the training loop (a BaseException, as KeyboardInterrupt is: no ``except Exception`` on the
    way up may swallow it)."""


@contextmanager
def stop_on_sigterm_outside_training():
    """``python -m ema_pg.train`` under a SIGTERM that comes before Lightning's handler is in place (a cold start's
    SFT, building the models) or after Lightning has put this one back (the final evaluation): the command ends
    with one line and exit 75, where the signal's default action ended it at -15 with none. Inside the training
    loop Lightning's handler, which calls this one too, is the active one: this one then does nothing, and the run
    saves its iteration (:class:`_CheckpointOnSigterm`)."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        yield
        return
    before = os.environ.get(RUN_DIR_ENV)  # a sweep's earlier job set it: not this job's folder

    def on_term(signum, frame):
        if signal.getsignal(signal.SIGTERM) is on_term:
            raise _StoppedOutsideTraining

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except (_StoppedOutsideTraining, StoppedBySigterm):  # the latter: in a task's reward (a cold start's probe)
        run = os.environ.get(RUN_DIR_ENV)
        this_job = run and (run != before or not in_multirun())
        log.warning("stopped by SIGTERM outside the training loop; %s",
                    kept(run, none=STARTS_AGAIN) if this_job else STARTS_AGAIN)
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        signal.signal(signal.SIGTERM, old)


class RunInterrupted(RuntimeError):
    """A run stopped by a signal after saving its checkpoint: unfinished, and resumable as it was."""


def interrupted_line(iteration: int, iterations: int, run_dir: Path) -> str:
    """The line a SIGTERM'd run ends with, naming the iteration its checkpoint holds (read back, not assumed)."""
    from .policy import checkpoint_iteration

    saved = checkpoint_iteration(run_dir)
    line = f"stopped by SIGTERM after iteration {iteration} of {iterations}; "
    if saved is None:
        return line + STARTS_AGAIN
    return line + f"it resumes from its checkpoint of iteration {saved}"


class _PeriodCheckpoint(ModelCheckpoint):
    """Lightning's checkpoint callback, once per evaluation period: ``iter<N>.ckpt`` for the RL iteration N it
    holds, written once, and ``last.ckpt`` a link to it (at a paper size a copy is tens of GB); the previous
    period's is removed once the new one is written."""

    def __init__(self, folder: Path):
        super().__init__(dirpath=str(folder), save_last="link", save_top_k=1, every_n_epochs=1,
                         save_on_train_epoch_end=True, enable_version_counter=False)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.filename = f"iter{pl_module.iteration}"  # an epoch is a period: named by its iteration instead
        super().on_train_epoch_end(trainer, pl_module)
        send_covered(trainer)  # only now: until the link moves, a resume takes the previous period's checkpoint


def send_covered(trainer) -> None:
    """The trackers take the rows held: the checkpoint a resume would take (``last.ckpt``) now covers them. Sent
    earlier (Lightning's ``after_save_checkpoint``, before the link moves), a kill in between left a tracker holding
    rows its resume runs again: one run's iteration twice in wandb."""
    for lg in trainer.loggers:
        if isinstance(lg, TrackerHub):
            lg.flush()


class _CheckpointOnSigterm(L.Callback):
    """On SIGTERM (a scheduler's preemption) Lightning stops after the current iteration without a checkpoint, or
    after the evaluation period when the iteration ends one: save the iteration's state first, so a resume loses
    nothing. At a period's end the period's own checkpoint (after its evaluation) follows and replaces it. The save
    replaces the link ``last.ckpt`` is after a period, never the period's checkpoint it points to.

    A SIGTERM that comes after an iteration's save point is held (Lightning's handler, wrapped, is called later):
    Lightning would otherwise stop at the end of that iteration unsaved. It is passed on when the next iteration
    starts (which is then saved) or at the period's end (the period's checkpoint is the save)."""

    def __init__(self, last: Path):
        self.last = last
        self.lightning = None  #: Lightning's SIGTERM handler, wrapped
        self.held = False  #: between this iteration's save point and the next iteration (or the period's end)
        self.pending = None  #: a SIGTERM that came while held

    def on_train_start(self, trainer, pl_module) -> None:
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler) and threading.current_thread() is threading.main_thread():
            self.lightning = handler
            signal.signal(signal.SIGTERM, self._on_sigterm)  # Lightning's teardown restores the one it replaced

    def _on_sigterm(self, signum, frame) -> None:
        if self.held:
            self.pending = (signum, frame)
        else:
            self.lightning(signum, frame)

    def _release(self, *_) -> None:
        self.held = False
        if self.pending is not None:
            (signum, frame), self.pending = self.pending, None
            self.lightning(signum, frame)

    on_train_batch_start = on_train_epoch_end = _release  # the period's end: before its checkpoint and Lightning's look

    def on_train_end(self, *_) -> None:  # past the loop's last look: Lightning would have ignored it there too
        self.held, self.pending = False, None

    on_exception = on_train_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.held = self.lightning is not None  # before the look: a SIGTERM from here on waits for the next one
        a = pl_module.cfg.algo
        stop = trainer.received_sigterm
        if trainer.world_size > 1:  # the save is collective: every rank decides alike (Lightning stops them all)
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop and pl_module.iteration % a.eval_every and pl_module.iteration < a.iterations:
            if trainer.is_global_zero and self.last.is_symlink():  # a DeepSpeed folder would be written through the
                self.last.unlink()  # link, into the period's checkpoint: that one stays whole, the fallback
            trainer.strategy.barrier()
            trainer.save_checkpoint(self.last, weights_only=False)  # the whole state (Lightning logs a line when unsaid)
            send_covered(trainer)
            log.warning("SIGTERM: checkpoint of iteration %d saved in %s", pl_module.iteration, self.last.parent)


class _StopAtIterations(L.Callback):
    """Ends fit once ``algo.iterations`` RL iterations are done (epochs are evaluation periods)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if pl_module.iteration >= pl_module.cfg.algo.iterations:
            trainer.should_stop = True

    def on_train_start(self, trainer, pl_module) -> None:
        if pl_module.iteration >= pl_module.cfg.algo.iterations:
            trainer.should_stop = True
