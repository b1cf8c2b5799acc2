"""Step time of a 2-process DeepSpeed ZeRO-3 run against 1 process, same global batch, through the CLI.

Both runs train the demo's model (EMA-PG, Top-k reverse KL) for ``--iterations`` iterations of
``--prompts`` x ``--group`` responses; the median ``time/step_s`` (and its rollout / score /
update parts) over the iterations after the first is reported. On a 2-core CPU the two ZeRO-3
processes share the cores the one process had, so this measures the overhead of partitioning
(gathers, gloo collectives, lock-stepped sampling), not a speed-up; a GPU node gives each
process its own device. A third run samples with ``rollout.zero3_gather=false`` (each decode step gathering
layer by layer through ZeRO-3's hooks) beside the default (the policy gathered once per rollout, hooks off).
Writes JSON with the settings beside the numbers.

    python benchmarks/zero3_step.py --out benchmarks/results/zero3_step_cpu.json     (make bench-zero3)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("time/step_s", "time/rollout_s", "time/score_s", "time/update_s")


def run(run_dir: Path, extra: list[str], a) -> dict:
    cmd = [sys.executable, "-m", "ema_pg.train", "experiment=demo", f"algo.iterations={a.iterations}",
           f"algo.eval_every={a.iterations}", f"algo.prompts_per_step={a.prompts}", f"algo.group_size={a.group}",
           "algo.minibatch_size=0", "task.eval_size=16", "trainer.progress_bar=false", f"run_dir={run_dir}", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    d = pd.read_csv(run_dir / "metrics.csv")
    return {k: float(d[k].dropna().iloc[1:].median()) for k in PARTS}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    out = {"settings": {"iterations": a.iterations, "prompts_per_step": a.prompts, "group_size": a.group,
                        "experiment": "demo", "OMP_NUM_THREADS": 1, "cpus": os.cpu_count()}}
    with tempfile.TemporaryDirectory() as tmp:
        out["one_process"] = run(Path(tmp) / "one", [], a)
        z3 = ["trainer=deepspeed", "trainer.strategy=deepspeed_stage_3", "trainer.devices=2"]
        out["zero3_two_processes"] = run(Path(tmp) / "z3", z3, a)  # rollout.zero3_gather (the default)
        out["zero3_two_processes_hooked_rollouts"] = run(Path(tmp) / "z3h", z3 + ["rollout.zero3_gather=false"], a)
    out["ratio_step_s"] = out["zero3_two_processes"]["time/step_s"] / out["one_process"]["time/step_s"]
    out["ratio_rollout_s_gathered_vs_hooked"] = (out["zero3_two_processes"]["time/rollout_s"]
                                                 / out["zero3_two_processes_hooked_rollouts"]["time/rollout_s"])
    for k in ("one_process", "zero3_two_processes", "zero3_two_processes_hooked_rollouts"):
        print(k, {p: round(v, 3) for p, v in out[k].items()})
    print(f"ZeRO-3 x2 / one process step time: {out['ratio_step_s']:.2f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
