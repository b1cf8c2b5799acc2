"""CPU runs beside other work: a cold start's SFT steps, and with --demo the whole demo, idle and beside a controlled
load (one busy process per core, started and stopped here), under each thread setting. Writes JSON.

    python benchmarks/cpu_load.py --out benchmarks/results/cpu_load_cpu.json [--demo]

Settings (each measured in a fresh process, the environment set before torch starts its threads):
- ``torch default``: torch's own choice (one thread per core) with OpenMP's default waiting (GNU OpenMP spins
  a while at every barrier before it sleeps);
- ``1 thread``: ``torch.set_num_threads(1)``;
- ``passive``: one thread per core with ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps at once);
- ``spin 10k``: OpenMP's default waiting with ``GOMP_SPINCOUNT`` cut to 10,000 spins (GNU OpenMP's default is
  300,000), and ``spin 3k`` (with ``--settings``) to 3,000;
- ``ema-pg default``: what a run gets without a setting of the user's (``ema_pg.thread_wait_default``: passive
  where the machine's runnable threads and the run's are more than its CPUs, spin 10k where there is room); each
  row records what it chose.

Each cell is the median over ``--repeats`` rounds (interleaved) of the median seconds per step of ``--steps``
steps after one warm-up step, each round in a fresh process. ``--demo`` also times the
whole of ``python -m ema_pg.train experiment=demo`` (its cold start included, in a cache of its own) idle and
loaded, ``--demo-repeats`` times each (interleaved), with the ema-pg default: the bar is loaded <= 2x idle;
``--demo-only`` times only that. A demo's row splits its time at the RL iterations' start (``rl_s``, their
own seconds from its metrics; ``before_rl_s``, the imports and the cold start) and gives their torch threads as its
checkpoint records them (``rl_threads``; the file made at 3095545 says ``torch's`` where they were torch's own).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"torch default": {"EMA_PG_THREADS": "torch"},
            "1 thread": {"EMA_PG_THREADS": "torch", "OMP_NUM_THREADS": "1"},
            "passive": {"EMA_PG_THREADS": "torch", "OMP_WAIT_POLICY": "PASSIVE"},
            "ema-pg default": {},
            "spin 3k": {"EMA_PG_THREADS": "torch", "GOMP_SPINCOUNT": "3000"},
            "spin 10k": {"EMA_PG_THREADS": "torch", "GOMP_SPINCOUNT": "10000"}}
#: the settings a run measures unless --settings names others (the spin counts are candidates for the default: GNU
#: OpenMP spins that many times at a barrier before it sleeps, where its default spins 300,000 and PASSIVE none)
DEFAULT_SETTINGS = ("torch default", "1 thread", "passive", "spin 10k", "ema-pg default")
#: what a timing process does: SFT steps of the demo's cold start (batch 64, 1.1M parameters); prints JSON
#: {"sft": [s...], "threads": N, "wait": the OpenMP waiting it ran with}
CHILD = r"""
import json, sys, time
steps = int(sys.argv[1])
import ema_pg.process; ema_pg.process.command_start()  # the thread default, set before torch starts its threads (as a command does)
import torch
from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
from ema_pg.config import SFTConfig
from ema_pg.engine.sft import sft_train
from ema_pg.tasks import build_task
task = build_task({"name": "toy_add"})
tok = train_bpe_tokenizer(task.corpus(), vocab_size=300)
model = build_tiny_model(len(tok), hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, seed=0,
                         tokenizer=tok)
demos = task.demonstrations(2000, seed=0)
sft = []
for i in range(steps + 1):
    t = time.perf_counter()
    sft_train(model, tok, demos, SFTConfig(steps=1, batch_size=64, lr=2e-3), i, progress=False)
    sft.append(time.perf_counter() - t)
import os
wait = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
print(json.dumps({"sft": sft[1:], "threads": torch.get_num_threads(), "wait": wait}))
"""


def busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes that each keep one core busy until stopped."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(ps: list[subprocess.Popen]) -> None:
    for p in ps:
        p.kill()
        p.wait()


def child_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "EMA_PG_THREADS")}
    return {**env, **extra, "PYTHONPATH": str(ROOT)}


def measure(setting: str, loaded: bool, steps: int) -> tuple[float, int, dict]:
    """(median seconds per SFT step, torch's thread count, the OpenMP waiting it ran with) of one timing
    process."""
    load = busy(os.cpu_count() or 1) if loaded else []
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, str(steps)], env=child_env(SETTINGS[setting]),
                           capture_output=True, text=True, timeout=3600, check=True)
    finally:
        stop(load)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return statistics.median(out["sft"]), out["threads"], out["wait"]


def paired_ratio(ours: list[float], theirs: list[float]) -> dict:
    """One setting's seconds per step over another's: the geometric mean over rounds of the paired ratio (each round
    runs every cell once, interleaved, so a round's cells saw the same minute of the machine), with the 95% t interval
    of the mean log ratio. The default's idle cost against torch's is the issue's bar: at most 1.05."""
    from scipy import stats

    logs = [math.log(a / b) for a, b in zip(ours, theirs)]
    n, m = len(logs), statistics.fmean(logs)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(logs) / math.sqrt(n) if n > 1 else math.inf
    return {"ratio": math.exp(m), "ci95": [math.exp(m - half), math.exp(m + half)], "rounds": n,
            "per_round": [a / b for a, b in zip(ours, theirs)]}


#: what the ema-pg default chooses in a process started now (run just before the demo, under the same load)
PROBE = "import json, os, ema_pg.process; ema_pg.process.command_start(); print(json.dumps({k: os.environ[k] for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT') " \
        "if k in os.environ}))"


def demo(loaded: bool) -> dict:
    load = busy(os.cpu_count() or 1) if loaded else []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            wait = json.loads(subprocess.run([sys.executable, "-c", PROBE], env=child_env({}), capture_output=True,
                                             text=True, check=True).stdout)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "ema_pg.train", "experiment=demo", f"run_dir={tmp}/run",
                            f"sft.cache_dir={tmp}/cache", "trainer.progress_bar=false"], cwd=ROOT,
                           env=child_env({}), capture_output=True, text=True, timeout=7200, check=True)
            wall = time.perf_counter() - t
        finally:
            stop(load)
        with open(f"{tmp}/run/metrics.csv", newline="") as f:  # the RL iterations' own seconds, the rest before them
            rl = max(float(r["time/elapsed_s"]) for r in csv.DictReader(f) if r.get("time/elapsed_s"))
        import torch  # the RL iterations' thread count as the run recorded it for its resumes (RLModule)

        threads = torch.load(f"{tmp}/run/checkpoints/last.ckpt", map_location="cpu",
                             weights_only=False)["ema_pg"]["rl_threads"]
        return {"load": "one busy process per core" if loaded else "idle", "wall_s": wall, "wait": wait,
                "rl_s": rl, "before_rl_s": wall - rl, "rl_threads": threads}


def step_cells(names: list[str], repeats: int, steps: int) -> tuple[list[dict], dict, dict]:
    """Every setting idle and loaded, ``repeats`` interleaved rounds: the rows, the default's idle ratio to torch's
    and every setting's paired ratios to torch's."""
    from tqdm.auto import tqdm

    cells = [(s, loaded) for s in names for loaded in (False, True)]
    got: dict = {c: [] for c in cells}
    for _ in tqdm(range(repeats), desc="rounds (every setting x load, interleaved)"):
        for c in cells:  # interleaved: a slow minute of the machine falls on every setting alike
            got[c].append(measure(*c, steps))
    rows = [{"setting": s, "load": "one busy process per core" if loaded else "idle",
             "sft_s_per_step": statistics.median(t for t, _, _ in got[(s, loaded)]),
             "rounds": [t for t, _, _ in got[(s, loaded)]], "sft_steps": steps,
             "torch_threads": got[(s, loaded)][0][1], "env": SETTINGS[s],
             "wait": sorted({json.dumps(w, sort_keys=True) for _, _, w in got[(s, loaded)]})} for s, loaded in cells]
    secs = lambda s, loaded: [t for t, _, _ in got[(s, loaded)]]  # noqa: E731
    idle = paired_ratio(secs("ema-pg default", False), secs("torch default", False))
    paired = {s: {"idle" if not loaded else "loaded": paired_ratio(secs(s, loaded), secs("torch default", loaded))
                  for loaded in (False, True)} for s in names if s != "torch default"}
    return rows, idle, paired


def demo_pairs(repeats: int) -> tuple[list[dict], float]:
    """The whole demo idle then loaded, ``repeats`` times; and loaded over idle, medians."""
    from tqdm.auto import tqdm

    demos = [d for _ in tqdm(range(repeats), desc="demo, idle then loaded") for d in (demo(False), demo(True))]
    walls = {w: [d["wall_s"] for d in demos if d["load"] == w] for w in ("idle", "one busy process per core")}
    return demos, statistics.median(walls["one busy process per core"]) / statistics.median(walls["idle"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_load_cpu.json")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every cell, interleaved; the median is reported")
    ap.add_argument("--demo", action="store_true", help="also time the whole demo, idle and loaded")
    ap.add_argument("--demo-only", action="store_true", help="time only the whole demo, idle and loaded")
    ap.add_argument("--demo-repeats", type=int, default=1, help="demo runs idle and loaded each, interleaved")
    ap.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help=f"comma list of {', '.join(SETTINGS)}")
    a = ap.parse_args()
    names = [s.strip() for s in a.settings.split(",")]
    if unknown := [s for s in names if s not in SETTINGS]:
        ap.error(f"--settings: no setting {unknown}; choose from {', '.join(SETTINGS)}")
    if missing := [s for s in ("torch default", "ema-pg default") if s not in names]:
        ap.error(f"--settings must include {missing}: the idle bar compares the two")
    rows, idle, paired = step_cells(names, a.repeats, a.steps) if not a.demo_only else ([], None, {})
    demos, ratio = demo_pairs(a.demo_repeats) if a.demo or a.demo_only else ([], None)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"what": "seconds per cold-start SFT step (batch 64, the demo's 1.1M-parameter model), median of rounds",
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "commit": commit,
           "python": platform.python_version(), "rows": rows, "idle_cost_of_the_default": idle,
           "paired_vs_torch_default": paired, "demo": demos, "demo_loaded_over_idle": ratio}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(f"{r['setting']:>15} {r['load']:>28}: {r['sft_s_per_step']:.3f} s/step ({r['torch_threads']} threads)")
    if idle:
        print(f"idle, ema-pg default / torch default: {idle['ratio']:.3f} [{idle['ci95'][0]:.3f}, "
              f"{idle['ci95'][1]:.3f}] over {idle['rounds']} paired rounds")
    for d in demos:
        print(f"demo {d['load']}: {d['wall_s']:.0f} s, of which RL {d['rl_s']:.0f} s on {d['rl_threads']} thread(s) "
              f"({d['wait']})")
    if ratio:
        print(f"demo, loaded / idle (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
