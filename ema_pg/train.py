"""Training entry point.

    python -m ema_pg.train                                   # the default: EMA-PG on the toy task
    python -m ema_pg.train experiment=demo seed=1
    python -m ema_pg.train kl=k3 anchor=fixed                # GRPO baseline
    python -m ema_pg.train resume=runs/<name>/<time> algo.iterations=400   # continue a run

``train(cfg)`` returns (metrics, objects); ``main`` returns the metric an Optuna search
optimizes (the final ``eval/avg/<metric>``). Every run writes one folder: ``config.yaml``
(resolved), ``metrics.csv``, ``checkpoints/``, ``eval.json``, ``curves.png``, ``git.txt``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import warnings
from pathlib import Path

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from .anchor import EMAAnchor
from .config import ConfigError, flatten, register_configs, validate
from .models import ModelPathError, load_model_dir
from .module import GRPOModule
from .plotting import plot_run
from .sft import cold_start
from .tasks import build_task

log = logging.getLogger("ema_pg")
# the run folder holds config.yaml before the CSV logger starts: its "not empty" warning is expected
warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
register_configs()
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def git_commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "") if sha else "unknown"
    except Exception:  # noqa: BLE001 - no git is fine
        return "unknown"


def build_policy(cfg, task):
    """(model, tokenizer): a local model directory, or the cached cold-start base policy."""
    if cfg.model.path:
        model, tok = load_model_dir(cfg.model.path, dtype=DTYPES[cfg.model.dtype])
        return model, tok
    model, tok, _ = cold_start(cfg.model, cfg.task, cfg.sft, task, cfg.seed, max_new_tokens=cfg.rollout.max_new_tokens,
                               stop=tuple(cfg.rollout.stop))
    return model.to(DTYPES[cfg.model.dtype]), tok


def load_policy_from_run(run_dir: Path, cfg, initial: bool = False):
    """The policy of a run's last checkpoint (its initial policy if ``initial`` or no checkpoint)."""
    task = build_task(cfg.task)
    model, tok = build_policy(cfg, task)
    ckpt = Path(run_dir) / "checkpoints" / "last.ckpt"
    if ckpt.is_file() and not initial:
        sd = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        model.load_state_dict({k.removeprefix("policy."): v for k, v in sd.items() if k.startswith("policy.")})
    return model, tok


def _loggers(cfg, run_dir: Path, resume_step: int | None):
    from lightning.pytorch.loggers import CSVLogger

    old_rows = []
    metrics_file = run_dir / "metrics.csv"
    if resume_step is not None and metrics_file.is_file():  # the CSV logger starts a fresh file: carry rows over
        import pandas as pd

        df = pd.read_csv(metrics_file)
        old_rows = [{k: v for k, v in r.items() if k != "step" and v == v} | {"step": int(r["step"])}
                    for r in df[df["step"] <= resume_step].to_dict("records")]
    csv = CSVLogger(save_dir=str(run_dir), name="", version="", flush_logs_every_n_steps=10)
    for r in old_rows:
        step = r.pop("step")
        csv.log_metrics(r, step=step)
    loggers = [csv]
    if cfg.logger.name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        os.environ.setdefault("WANDB_MODE", "offline" if cfg.logger.offline else "online")
        loggers.append(WandbLogger(project=cfg.logger.project, save_dir=str(run_dir), name=cfg.name))
    elif cfg.logger.name == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tb"))
    elif cfg.logger.name != "csv":
        raise ConfigError(f"logger={cfg.logger.name!r}; choose one of: csv, wandb, tensorboard")
    return loggers


def resolve_resume(cfg) -> DictConfig:
    """The config of a resumed run.

    From the command line: the run's saved ``config.yaml`` with this command's explicit
    overrides on top (``resume=RUN algo.iterations=400``). From Python: ``cfg`` as given
    (load the saved config, change what you want, set ``resume``).
    """
    run_dir = Path(cfg.resume)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"resume={cfg.resume!r} is not a run folder (no config.yaml there)")
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        saved = OmegaConf.load(run_dir / "config.yaml")
        overrides = [o.lstrip("+") for o in HydraConfig.get().overrides.task if not o.startswith("resume=")]
        cfg = OmegaConf.merge(saved, OmegaConf.from_dotlist([o for o in overrides if "=" in o]))
    cfg.run_dir, cfg.resume = str(run_dir), str(run_dir)
    return cfg


def finished_metrics(run_dir: Path, iterations: int) -> dict | None:
    """The final metrics of a run folder that already finished ``iterations`` iterations (else None)."""
    f = Path(run_dir) / "eval.json"
    if not f.is_file():
        return None
    final = json.loads(f.read_text())
    if final.get("iteration", -1) < iterations:
        return None
    return {f"eval/avg/{final.get('metric', 'em')}": final.get("avg", float("nan")), "iteration": final["iteration"],
            "base/avg": final.get("base_avg", float("nan"))}


# knobs that may change when a run is continued (more iterations, another machine, quieter output)
RESUMABLE_CHANGES = ("run_dir", "resume", "if_exists", "algo.iterations", "trainer.progress_bar", "trainer.num_threads")


def config_differences(saved: DictConfig, cfg: DictConfig) -> list[str]:
    """Keys whose values differ between a run folder's saved config and ``cfg`` (ignoring RESUMABLE_CHANGES)."""
    def flat(c):
        c = OmegaConf.create(OmegaConf.to_container(c, resolve=False))
        for key in RESUMABLE_CHANGES:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(c, parent) if parent else c
            if node is not None and leaf in node:
                node.pop(leaf)
        return flatten(OmegaConf.to_container(c, resolve=True))

    a, b = flat(saved), flat(cfg)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def train(cfg: DictConfig, callbacks: list | tuple = ()) -> tuple[dict, dict]:
    """Run (or resume) one training run; returns (final metrics, objects).

    ``callbacks``: extra Lightning callbacks (an Optuna pruning callback, for instance).
    With ``if_exists=resume`` a run folder that holds a finished run is skipped (its final
    metrics are returned) and one that holds a checkpoint is resumed, so a killed sweep is
    continued by running the same command again.
    """
    if not cfg.get("resume") and cfg.get("if_exists", "error") == "resume":
        run_dir = Path(cfg.run_dir)
        if (run_dir / "config.yaml").is_file():
            diff = config_differences(OmegaConf.load(run_dir / "config.yaml"), cfg)
            if diff:
                raise ConfigError(f"{run_dir} holds a run with another config (differs in: {', '.join(diff[:6])}); "
                                  "give this run another run_dir (or sweep dir), or delete that folder")
        done = finished_metrics(run_dir, cfg.algo.iterations)
        if done is not None:
            log.info("%s already finished %d iterations: skipped", run_dir, done["iteration"])
            return done, {"run_dir": run_dir, "plot": run_dir / "curves.png", "cfg": cfg, "skipped": True}
        if (run_dir / "checkpoints" / "last.ckpt").is_file():
            cfg.resume = str(run_dir)
    if cfg.get("resume"):
        cfg = resolve_resume(cfg)
    validate(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    try:
        task = build_task(cfg.task)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    policy, tok = build_policy(cfg, task)
    validate(cfg, vocab_size=policy.config.vocab_size)
    anchor = None
    if cfg.anchor.name != "none":
        anchor = EMAAnchor(eta=cfg.anchor.eta, update_every=cfg.anchor.update_every, eval_every=cfg.anchor.eval_every)
        anchor.attach(policy)
    module = GRPOModule(cfg, policy, tok, task, anchor)

    ckpt_path, resume_step = None, None
    last = run_dir / "checkpoints" / "last.ckpt"
    if cfg.get("resume"):
        if not last.is_file():
            raise ConfigError(f"resume: {last} does not exist; the run wrote no checkpoint yet (start it again instead)")
        ckpt_path = str(last)
        resume_step = int(torch.load(last, map_location="cpu", weights_only=False)["ema_pg"]["iteration"])
        log.info("resuming %s from iteration %d", run_dir, resume_step)
    else:
        if last.is_file():
            raise ConfigError(f"{run_dir} already holds a run; pass resume={run_dir} to continue it, or another run_dir")
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    (run_dir / "git.txt").write_text(git_commit() + "\n")

    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt_cb = ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), filename="iter{epoch}", save_last=True,
                              save_top_k=1, every_n_epochs=1, save_on_train_epoch_end=True, enable_version_counter=False)
    callbacks = [ckpt_cb, _StopAtIterations()] + ([anchor] if anchor is not None else []) + list(callbacks)
    tc = cfg.trainer
    trainer = L.Trainer(
        accelerator=tc.accelerator, devices=tc.devices, strategy=tc.strategy, precision=tc.precision,
        max_epochs=-1, logger=_loggers(cfg, run_dir, resume_step), callbacks=callbacks,
        enable_progress_bar=tc.progress_bar, enable_model_summary=False, reload_dataloaders_every_n_epochs=1,
        num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1, default_root_dir=str(run_dir),
        deterministic=False,
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


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        metrics, objs = train(cfg)
    except (ConfigError, ModelPathError) as e:
        log.error("config error: %s", e)
        raise SystemExit(f"config error: {e}") from None
    metric_key = next(k for k in metrics if k.startswith("eval/avg/"))
    print(f"run folder: {objs['run_dir']}\nmetrics:    {objs['run_dir'] / 'metrics.csv'}\nplot:       {objs['plot']}")
    print(f"final {metric_key} = {metrics[metric_key]:.3f} (base policy: {metrics['base/avg']:.3f})")
    return float(metrics[metric_key])


if __name__ == "__main__":
    main()
