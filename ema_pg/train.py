"""Training entry point.

    python -m ema_pg.train                                   # the default: EMA-PG on the toy task
    python -m ema_pg.train experiment=demo seed=1
    python -m ema_pg.train kl=k3 anchor=fixed                # GRPO baseline
    python -m ema_pg.train resume=runs/<name>/<time> algo.iterations=400   # continue a run
    python -m ema_pg.train experiment=math init_from=runs/<stage1> rollout.max_new_tokens=96 algo.iterations=400
                                                              # a stage: a new run from another's last checkpoint

``train(cfg)`` returns (metrics, objects); ``main`` returns the metric an Optuna search
optimizes (the final ``eval/avg/<metric>``). Every run writes one folder: ``config.yaml``
(resolved), ``metrics.csv``, ``checkpoints/``, ``eval.json``, ``curves.png``, ``git.txt``, ``machine.txt``.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from .anchor import EMAAnchor
from .config import CONF_DIR, ConfigError, fill_defaults, register_configs, validate
from .models import ModelPathError
from .module import GRPOModule
from .step import NonFiniteUpdates
from .plotting import plot_run
from .policy import build_policy, checkpoint_file, checkpoint_state, save_run_model
from .strategies import build_strategy
from .runs import (claim_run_dir, config_differences, finished_metrics, git_commit, machine, make_loggers, resolve_resume,
                   upgraded)
from .heads import check_head
from .prompts import PromptEncoder
from .tasks import ServiceError, build_task

log = logging.getLogger("ema_pg")
RUN_DIR_ENV = "EMA_PG_RUN_DIR"  #: the run folder rank 0 claimed, for the processes it launches


def _adopt_hydra_output(run_dir: Path) -> None:
    """A resume writes its log into the run folder it resumes: Hydra opened a fresh output folder for this
    invocation (``runs/<name>/<time>``); its log handler is moved to ``run_dir`` and the folder, which
    then holds nothing of the run, removed."""
    import shutil

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    out = Path(HydraConfig.get().runtime.output_dir).resolve()
    if out == run_dir.resolve() or run_dir.resolve() in out.parents:
        return
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).resolve().parent == out:
            new = logging.FileHandler(run_dir / Path(h.baseFilename).name, mode="a")
            new.setFormatter(h.formatter)
            new.setLevel(h.level)
            root.removeHandler(h)
            h.close()
            root.addHandler(new)
    if {p.name for p in out.iterdir()} <= {".hydra", f"{HydraConfig.get().job.name}.log"}:
        shutil.rmtree(out, ignore_errors=True)


def readable_checkpoint(run_dir: Path) -> tuple[Path, dict]:
    """The newest checkpoint of ``run_dir`` that can be read, and its state; says so when it is not last.ckpt."""
    folder = run_dir / "checkpoints"
    last = folder / "last.ckpt"
    others = sorted((p for p in folder.glob("*.ckpt") if p.name != "last.ckpt"), key=lambda p: p.stat().st_mtime,
                    reverse=True)
    errors = []
    for ckpt in [last, *others]:
        try:
            state = checkpoint_state(ckpt)
        except Exception as e:  # noqa: BLE001 - a truncated or corrupted file: try the next one
            errors.append(f"{ckpt.name}: {type(e).__name__}: {e}")
            continue
        if ckpt != last:
            log.warning("resume: %s is unreadable (%s); resuming from %s (iteration %d) instead", last.name,
                        errors[0], ckpt.name, state["ema_pg"]["iteration"])
        return ckpt, state
    raise ConfigError(f"resume: no readable checkpoint in {folder} ({'; '.join(errors)}); start the run again")


#: what a stage (init_from) must share with the run it continues: the same network, tokenizer and task
STAGE_FIXED = ("model.name", "model.path", "model.hidden_size", "model.num_layers", "model.num_heads",
               "model.num_kv_heads", "model.max_positions", "model.tokenizer_vocab", "model.lora_rank", "task.name",
               "anchor.name", "algo.advantage", "seed")


def stage_start(cfg: DictConfig, run_dir: Path) -> tuple[Path, int]:
    """The checkpoint a stage (``init_from=RUN``) starts from, and its iteration, after checking that the
    stage can continue that run: same network and task, more iterations, another folder."""
    src = Path(cfg.init_from)
    if not (src / "config.yaml").is_file():
        raise ConfigError(f"init_from={cfg.init_from!r} is not a run folder (no config.yaml there)")
    if src.resolve() == run_dir.resolve():
        raise ConfigError(f"init_from={src} is this run's own folder; a stage writes a new run folder (or use resume=)")
    prev = upgraded(OmegaConf.load(src / "config.yaml"))  # a run saved before a knob existed: at its default
    differ = [k for k in STAGE_FIXED if OmegaConf.select(prev, k) != OmegaConf.select(cfg, k)]
    if differ:
        raise ConfigError(f"init_from={src}: a stage continues the same network and task, but {', '.join(differ)} "
                          "differ from that run's; set them as that run had them")
    if checkpoint_file(src) is None:
        raise ConfigError(f"init_from={src} holds no checkpoint yet; let that stage write one first")
    ckpt, state = readable_checkpoint(src)
    it = int(state["ema_pg"]["iteration"])
    if cfg.algo.iterations <= it:
        raise ConfigError(f"init_from={src} ends at iteration {it}; this stage's algo.iterations={cfg.algo.iterations} "
                          f"must be larger (it counts from the first stage's start)")
    return ckpt, it


def is_rank_zero() -> bool:
    """True in the first process of a run (the only one, unless Lightning launched several)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def train(cfg: DictConfig, callbacks: list | tuple = ()) -> tuple[dict, dict]:
    """Run (or resume) one training run; returns (final metrics, objects).

    ``callbacks``: extra Lightning callbacks (an Optuna pruning callback, for instance).
    With ``if_exists=resume`` a run folder that holds a finished run is skipped (its final
    metrics are returned) and one that holds a checkpoint is resumed, so a killed sweep is
    continued by running the same command again.
    """
    composed = False  # True: this command composed the run's own config (a sweep continuing a killed run)
    if not cfg.get("resume") and cfg.get("if_exists", "error") == "resume":
        run_dir = Path(cfg.run_dir)
        if (run_dir / "config.yaml").is_file():
            diff = config_differences(OmegaConf.load(run_dir / "config.yaml"), fill_defaults(cfg.copy()))
            if diff:
                raise ConfigError(f"{run_dir} holds a run with another config (differs in: {', '.join(diff[:6])}); "
                                  "give this run another run_dir (or sweep dir), or delete that folder")
        done = finished_metrics(run_dir, cfg.algo.iterations)
        if done is not None:
            log.info("%s already finished %d iterations: skipped", run_dir, done["iteration"])
            return done, {"run_dir": run_dir, "plot": run_dir / "curves.png", "cfg": cfg, "skipped": True}
        if checkpoint_file(run_dir) is not None:
            cfg.resume, composed = str(run_dir), True
    if cfg.get("resume"):
        cfg = resolve_resume(cfg, composed=composed)
    validate(cfg)
    fill_defaults(cfg)
    run_dir = Path(cfg.run_dir)
    if cfg.get("resume"):
        run_dir.mkdir(parents=True, exist_ok=True)
        if is_rank_zero():
            _adopt_hydra_output(run_dir)
    elif is_rank_zero():
        claimed = claim_run_dir(run_dir)
        if claimed != run_dir:
            log.warning("%s is taken by another run started at the same time: this run writes to %s", run_dir, claimed)
            cfg.run_dir = run_dir = claimed
        os.environ[RUN_DIR_ENV] = str(run_dir)  # the processes Lightning launches next write here too
    elif os.environ.get(RUN_DIR_ENV):
        cfg.run_dir = run_dir = Path(os.environ[RUN_DIR_ENV])
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    try:
        task = build_task(cfg.task)  # a retrieval server is checked here, before any model is built
        policy, tok = build_policy(cfg, task)
        check_head(policy)  # an architecture the log-prob head cannot score is refused now, not at the first step
        encode = PromptEncoder(tok, cfg.task.chat_template)
    except (ValueError, ServiceError, NotImplementedError) as e:  # NoColdStart is a ValueError
        raise ConfigError(str(e)) from None
    mc = policy.config
    validate(cfg, vocab_size=mc.vocab_size,
             head_dim=getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads)
    if cfg.model.lora_rank:  # the base is frozen; only the adapters train (and the anchor is an adapter too)
        from .lora import wrap_lora

        policy = wrap_lora(policy, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets)
    anchor = None
    if cfg.anchor.name != "none":
        an = cfg.anchor
        anchor = EMAAnchor(eta=an.eta, update_every=an.update_every, eval_every=an.eval_every, scheme=an.name,
                           sync_alpha=an.sync_alpha, sync_steps=an.sync_steps, path=an.path)
        try:
            anchor.attach(policy)
        except (ValueError, ModelPathError) as e:
            raise ConfigError(str(e)) from None
    module = GRPOModule(cfg, policy, tok, task, anchor, encode=encode)
    if is_rank_zero():  # what the model reads, once: the chat template (or not), the BOS, the instruction
        log.info("prompts as the model reads them (%s), e.g.:\n%s", encode.describe(),
                 tok.decode(encode.encode(task.sample(1, seed=cfg.seed)[0])))

    ckpt_path, resume_step = None, None
    last = run_dir / "checkpoints" / "last.ckpt"
    if cfg.get("resume"):
        if checkpoint_file(run_dir) is None:
            raise ConfigError(f"resume: {last} does not exist; the run wrote no checkpoint yet (start it again instead)")
        ckpt, state = readable_checkpoint(run_dir)
        ckpt_path, resume_step = str(ckpt), int(state["ema_pg"]["iteration"])
        log.info("resuming %s from iteration %d", run_dir, resume_step)
    else:
        if last.exists():
            raise ConfigError(f"{run_dir} already holds a run; pass resume={run_dir} to continue it, or another run_dir")
        if cfg.get("init_from"):
            ckpt, it = stage_start(cfg, run_dir)
            ckpt_path = str(ckpt)
            log.info("stage: starting from %s at iteration %d", ckpt, it)
        if is_rank_zero():  # the other processes of a multi-process run run this function too
            OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
            save_run_model(run_dir, policy, tok, cfg.model.path)
    if is_rank_zero():
        (run_dir / "git.txt").write_text(git_commit() + "\n")
        (run_dir / "machine.txt").write_text(machine() + "\n")

    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt_cb = ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), filename="iter{epoch}", save_last=True,
                              save_top_k=1, every_n_epochs=1, save_on_train_epoch_end=True, enable_version_counter=False)
    callbacks = [ckpt_cb, _StopAtIterations()] + ([anchor] if anchor is not None else []) + list(callbacks)
    tc = cfg.trainer
    with warnings.catch_warnings():
        # the run folder holds config.yaml before the CSV logger starts: its "not empty" warning is expected
        warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
        trainer = L.Trainer(
            accelerator=tc.accelerator, devices=tc.devices, strategy=build_strategy(cfg), precision=tc.precision,
            max_epochs=-1, logger=make_loggers(cfg, run_dir, resume_step), callbacks=callbacks,
            enable_progress_bar=tc.progress_bar, enable_model_summary=False, reload_dataloaders_every_n_epochs=1,
            num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1, default_root_dir=str(run_dir),
            deterministic=False, use_distributed_sampler=False,  # every rank runs every iteration number
        )
        try:
            trainer.fit(module, ckpt_path=ckpt_path)
        finally:
            for lg in trainer.loggers:
                try:
                    lg.finalize("success")
                except Exception:  # noqa: BLE001 - closing must not mask the real error
                    pass
    final = dict(module.eval_history[-1]) if module.eval_history else {}
    plot = run_dir / "curves.png"
    if is_rank_zero():
        if module.eval_history and module.iteration >= cfg.algo.iterations:  # a finished run (not a pruned one)
            final["base_avg"] = module.eval_history[0]["avg"]
            (run_dir / "eval.json").write_text(json.dumps(final, indent=2))
        plot = plot_run(run_dir)
    metric = final.get("metric", "em")
    metrics = {f"eval/avg/{metric}": final.get("avg", float("nan")), "iteration": module.iteration,
               "base/avg": module.eval_history[0]["avg"] if module.eval_history else float("nan"),
               **getattr(module, "last_metrics", {})}
    return metrics, {"module": module, "trainer": trainer, "run_dir": run_dir, "plot": plot, "cfg": cfg}


class _StopAtIterations(L.Callback):
    """Ends fit once ``algo.iterations`` RL iterations are done (epochs are evaluation periods)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if pl_module.iteration >= pl_module.cfg.algo.iterations:
            trainer.should_stop = True

    def on_train_start(self, trainer, pl_module) -> None:
        if pl_module.iteration >= pl_module.cfg.algo.iterations:
            trainer.should_stop = True


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        metrics, objs = train(cfg)
    except (ConfigError, ModelPathError) as e:
        log.error("config error: %s", e)
        raise SystemExit(f"config error: {e}") from None
    except (NonFiniteUpdates, ServiceError) as e:
        log.error("stopped: %s", e)
        run = os.environ.get(RUN_DIR_ENV, "<run folder>")
        raise SystemExit(f"stopped: {e}; the run folder keeps its last checkpoint: continue with "
                         f"python -m ema_pg.train resume={run}") from None
    metric_key = next(k for k in metrics if k.startswith("eval/avg/"))
    if not is_rank_zero():
        return float(metrics[metric_key])
    print(f"run folder: {objs['run_dir']}\nmetrics:    {objs['run_dir'] / 'metrics.csv'}\nplot:       {objs['plot']}")
    print(f"final {metric_key} = {metrics[metric_key]:.3f} (base policy: {metrics['base/avg']:.3f})")
    return float(metrics[metric_key])


if __name__ == "__main__":
    register_configs()  # the schema must be in Hydra's store before @hydra.main composes
    main()
