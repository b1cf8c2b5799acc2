"""Compose the real config (ema_pg.config.compose) and shrink it to seconds-long runs."""

from __future__ import annotations

import subprocess
import sys
import time
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


_RACER = """import sys, time
from pathlib import Path
from ema_pg.config import ConfigError
from ema_pg.engine.owner import claim_run_dir, own_run_dir
folder, ready, go, done = map(Path, sys.argv[1:5])
ready.write_text('')  # imported: at the line
while not go.exists():
    time.sleep(0.001)
try:
    print({attempt}, flush=True)
except ConfigError as e:
    print('refused', e, flush=True)
    sys.exit()
while not done.exists():  # what it got, it holds until every other process has tried
    time.sleep(0.01)
"""


def race_for_folder(folder: Path, attempt: str, n: int, tmp_path: Path) -> list[str]:
    """``n`` real processes each do ``attempt`` (an expression of ``folder``, ``claim_run_dir`` and ``own_run_dir``)
    at the same moment and answer one line: its value, or ``refused`` and the one-line error. The go is given when
    every process has imported (waited for, not guessed with a sleep, on however loaded a machine), and a process
    that got a folder holds it until all have answered. They import the claim alone (no torch): a few tenths of a
    second each."""
    ready = [tmp_path / f"ready{i}" for i in range(n)]
    go, done = tmp_path / "go", tmp_path / "done"
    code = _RACER.format(attempt=attempt)
    ps = [subprocess.Popen([sys.executable, "-c", code, str(folder), str(r), str(go), str(done)], stdout=subprocess.PIPE,
                           text=True) for r in ready]
    try:
        deadline = time.monotonic() + 300
        while not all(r.exists() or p.poll() is not None for r, p in zip(ready, ps)) and time.monotonic() < deadline:
            time.sleep(0.02)
        go.write_text("")
        answers = [p.stdout.readline().strip() for p in ps]
        done.write_text("")
        for p in ps:
            p.wait(timeout=60)
        return answers
    finally:
        for p in ps:
            p.kill()
            p.wait()
            p.stdout.close()
