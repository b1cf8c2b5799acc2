"""Partial rollouts against whole rollouts at a long-tailed response length: how long the trainer waits for its batch.

Every row is the same asynchronous run (``rollout.max_staleness=1``; the trainer and each rollout worker one torch
thread) of ``experiment=demo`` on :class:`long_tail_task.LongTailAddition`, whose cold-start policy writes a long
working-out after the answers of about 15% of the prompts (``rollout.max_new_tokens=128``): the same seed, prompts, cold start (cached)
and settings; ``--iterations`` iterations, evaluation only at the start and the end. Rows: whole rollouts and partial
rollouts (``rollout.partial=true``, the default spare: one block of groups in flight beyond the batch), each with one and with two rollout workers (``rollout.workers``). Per row, the median after ``--warmup``
iterations (benchmarks/async_step.py's columns: ``step_s``, ``wait_s`` = the trainer's wait for its batch,
``worker_s`` = the worker's time for it, ``update_s``), and the means of the response length, of the tokens' staleness
at their update and, partial, of the token steps a batch's sampling took and of the responses that crossed a weight
update.

    python benchmarks/partial_rollouts.py --out benchmarks/results/partial_rollouts_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from async_step import folder_of, run, save, timed

HERE = Path(__file__).resolve().parent


def rows() -> dict[str, list[str]]:
    partial = ["rollout.partial=true"]
    return {f"{kind}, {n} worker{'s' if n > 1 else ''}": [f"rollout.workers={n}", *extra]
            for n in (1, 2) for kind, extra in (("whole", []), ("partial", partial))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])  # the task's module
    common = ["experiment=demo", "task=custom", "task.target=long_tail_task:LongTailAddition",
              "rollout.max_new_tokens=128", "rollout.max_staleness=1", "trainer.num_threads=1",
              "rollout.worker_threads=1", f"algo.iterations={a.iterations}", f"algo.eval_every={a.iterations}",
              f"seed={a.seed}", "trainer.progress_bar=false", "logger=csv"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in rows().items():
            print(f"{name} ...", flush=True)
            r = results[name] = run(name, overrides, common, Path(tmp), a.warmup)
            df = timed(folder_of(Path(tmp), name), a.warmup)
            mean = lambda c: float(df[c].mean()) if c in df and df[c].notna().any() else None  # noqa: E731
            r.update({"response_len_mean": mean("train/response_len"), "staleness_token_mean":
                      mean("rollout/staleness_token_mean") or mean("rollout/staleness"),
                      "partial_steps_mean": mean("rollout/partial_steps"),
                      "frac_mixed_versions_mean": mean("rollout/frac_mixed_versions"),
                      "wait_s_mean": mean("time/rollout_wait_s"), "step_s_mean": mean("time/step_s"),
                      "reward_mean": mean("train/reward_mean")})
            print(f"  step {r['step_s']:.3f} s (wait {r['wait_s']:.3f}, worker {r['worker_s']:.3f}, update "
                  f"{r['update_s']:.3f}); response length {r['response_len_mean']:.1f}; run {r['wall_s']:.0f} s", flush=True)
    for n in (1, 2):
        s = "s" if n > 1 else ""
        whole, part = results[f"whole, {n} worker{s}"], results[f"partial, {n} worker{s}"]
        part["wait_vs_whole"] = part["wait_s_mean"] / whole["wait_s_mean"] if whole["wait_s_mean"] else None
        part["step_vs_whole"] = part["step_s_mean"] / whole["step_s_mean"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    payload = {"benchmark": "partial_rollouts", "commit": commit, "device": platform.processor() or platform.machine(),
               "cores": os.cpu_count(), "torch": torch.__version__,
               "settings": {"experiment": "demo", "task": "long_tail_task:LongTailAddition", "max_new_tokens": 128,
                            "max_staleness": 1, "partial_spare": "the block",
                            "iterations": a.iterations, "warmup_skipped": a.warmup, "seed": a.seed,
                            "threads": "trainer 1 + rollout.worker_threads 1 per worker"},
               "rows": results}
    save(a.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
