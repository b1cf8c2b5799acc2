"""Padded vs padding-free vs padding-free with a token budget: the update's and the scoring pass's speed and peak
memory, on three batch shapes, in one run, each measurement in a fresh process.

Shapes (the rows' real-token lengths are what matters to the passes; the weights are the tiny policy's):
- ``search_reading``: a batch the cold-start policy of ``experiment=search_reading`` samples (64 multi-turn rows,
  observations inside), from the cached base policy (built if missing);
- ``math``: 32 rows of a 100-token prompt (4 prompts x 8 samples) and responses whose lengths spread from 20 to
  ``--math-len`` tokens, as a math policy's do, over the tiny model at ``experiment=math``'s size;
- ``step``: the step benchmark's shape (``benchmarks/rl_step.py``: 16 prompts x 8 samples, 8-token prompts,
  64-token completions, a quarter of them ending early).

Each (shape, mode) is timed as the update does it (forward, the loss's backward, per minibatch) and as the
anchor's scoring pass does it (no grad), after a warm-up, median of ``--reps``; tokens/s counts the batch's real
tokens. ``peak_rss_mib`` is the process's peak resident memory in a child that runs that one measurement (the
same model and batch, built there): with a budget the update's memory is bounded by the budget, not the batch.

    python benchmarks/packing.py --out benchmarks/results/packing_cpu.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"padded": dict(padding_free=False, budget=0), "packed": dict(padding_free=True, budget=0),
         "packed + budget": dict(padding_free=True, budget=None)}  # None: the shape's budget


def shape_batch(name: str, math_len: int):
    """(model, rollouts, budget) of a shape."""
    import torch

    from ema_pg.rollout.base import Rollouts

    torch.manual_seed(0)
    if name == "search_reading":
        from ema_pg.config import compose
        from ema_pg.engine.policy import build_policy
        from ema_pg.prompts import PromptEncoder, sampler_prompts
        from ema_pg.rollout import HFSampler
        from ema_pg.scores import ScoreRequest
        from ema_pg.tasks import build_task

        cfg = compose(["experiment=search_reading", "sft.seed=0", "trainer.progress_bar=false",
                       f"sft.cache_dir={ROOT / '.cache' / 'ema_pg' / 'cold_start'}"])
        task = build_task(cfg.task)
        model, tok = build_policy(cfg, task)
        prompts = task.sample(8, seed=5)
        ro = HFSampler(tok, max_obs_tokens=cfg.rollout.max_obs_tokens).generate(
            model, sampler_prompts(prompts, PromptEncoder(tok, cfg.task.chat_template)), 8, temperature=1.0,
            max_new_tokens=cfg.rollout.max_new_tokens, stop=list(cfg.rollout.stop), on_stop=task.on_stop_fn(prompts, 8),
            seed=5, score=ScoreRequest(topk=32))
        return model, ro, 4096
    from ema_pg.engine.models import build_tiny_model

    if name == "math":
        V, P, N, lens = 1024, 100, 32, [int(20 + (math_len - 20) * (i / 31) ** 1.5) for i in range(32)]
        hidden, layers, budget = 128, 4, 8192
    else:
        V, P, N, lens = 1024, 8, 128, [64 if i % 4 else 16 + i % 48 for i in range(128)]
        hidden, layers, budget = 128, 4, 4096
    model = build_tiny_model(V, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, seed=0,
                             max_positions=P + max(lens) + 8, pad_token_id=0, eos_token_id=1)
    T = max(lens)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (N, P + T), generator=g)
    for r in range(N):  # the G samples of a prompt share it
        ids[r, :P] = ids[r - r % 8, :P]
    am = torch.zeros(N, P + T, dtype=torch.long)
    for r, n in enumerate(lens):
        am[r, : P + n] = 1
    lm = am.clone()
    lm[:, :P] = 0
    ids = torch.where(am.bool(), ids, torch.zeros_like(ids))
    return model, Rollouts(input_ids=ids, attention_mask=am, loss_mask=lm, prompt_len=P,
                           prompt_index=[r // 8 for r in range(N)]), budget


def measure(shape: str, mode: str, pass_: str, reps: int, math_len: int) -> dict:
    import torch

    from ema_pg.heads import head
    from ema_pg.packing import pack
    from ema_pg.step import micro_batches

    torch.set_num_threads(1)
    model, ro, shape_budget = shape_batch(shape, math_len)
    m = MODES[mode]
    budget = shape_budget if m["budget"] is None else m["budget"]
    parts = micro_batches(ro, budget)
    batches = [ro.select(p) for p in parts]
    packs = [pack(b, True) if m["padding_free"] else None for b in batches]

    def once():
        for b, p in zip(batches, packs):
            if pass_ == "update":
                out = head(model, b, chunk=4096, packing=p)
                (out.logp * b.response_mask).sum().backward()
            else:
                with torch.no_grad():
                    head(model, b, chunk=4096, packing=p)

    once()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    real = int(ro.attention_mask.sum())
    s = statistics.median(times)
    computed = sum(p.tokens if p is not None else b.input_ids.numel() for b, p in zip(batches, packs))
    return {"shape": shape, "mode": mode, "pass": pass_, "rows": len(ro), "real_tokens": real,
            "padded_tokens": int(ro.input_ids.numel()), "computed_tokens": computed, "micro_batches": len(parts),
            "budget": budget, "seconds": s, "tokens_per_s": real / s,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="search_reading,math,step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--math-len", type=int, default=2048, help="the longest math response")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "packing_cpu.json")
    ap.add_argument("--child", nargs=3, metavar=("SHAPE", "MODE", "PASS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(measure(*a.child, a.reps, a.math_len)))
        return 0
    from ema_pg.engine.files import atomic_write
    from ema_pg.engine.runs import machine

    rows = []
    for shape in a.shapes.split(","):
        for pass_ in ("update", "scoring"):
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--child", shape, mode, pass_, "--reps", str(a.reps),
                                      "--math-len", str(a.math_len)], cwd=ROOT, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{shape} {mode} {pass_}: {out.stderr[-2000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                print(f"{shape:15s} {pass_:8s} {mode:16s} {r['seconds']:8.3f} s {r['tokens_per_s']:9.0f} tok/s "
                      f"computed {r['computed_tokens']}/{r['padded_tokens']}  peak {r['peak_rss_mib']:.0f} MiB", flush=True)
                payload = {"benchmark": "packing", "machine": machine(), "commit": subprocess.run(
                    ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
                    "settings": {"threads": 1, "reps": a.reps, "math_len": a.math_len, "chunk": 4096}, "rows": rows}
                a.out.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(a.out, json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if "--child" not in sys.argv:
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
