"""Compose the real config (ema_pg.config.compose) and shrink it to seconds-long runs."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf, open_dict

from ema_pg.config import compose

TINY = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.tokenizer_vocab=300",
    "sft.steps=20", "sft.batch_size=16", "sft.num_demos=200",
    "algo.prompts_per_step=4", "algo.group_size=4", "algo.iterations=4", "algo.eval_every=2",
    "rollout.max_new_tokens=4", "optim.lr=1e-3", "trainer.progress_bar=false",
]


def compose_cfg(overrides: list[str] = (), tmp_path: Path | None = None, tiny: bool = True):
    task_set = any(o.startswith("task=") for o in overrides)
    tiny_task = ["task.eval_size=16"] if tiny and not task_set else []
    cfg = compose((TINY + tiny_task if tiny else []) + list(overrides))
    with open_dict(cfg):
        if tmp_path is not None:
            cfg.run_dir = str(tmp_path / "run")
            if not any(o.startswith("sft.cache_dir=") for o in overrides):
                cfg.sft.cache_dir = str(tmp_path.parent / "cold_start_cache")
    return cfg


def resolved(cfg):
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))


def per_row(fn):
    """A batched ``on_stop`` (the sampler's protocol) from a function of one row: fn(row, turn_text) -> obs | None."""
    return lambda rows, texts: [fn(r, t) for r, t in zip(rows, texts)]
