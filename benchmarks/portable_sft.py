"""Would a cold start come out the same on another kind of CPU, and what would pinning it cost?

A cold start is a few hundred SFT steps; where two machines' matrix kernels round differently its weights drift
apart, and a cold start that stops at a reward threshold can stop at another step (the claims plan's 500-step base
came out at 660 steps on an Intel Xeon). This runs the same steps of the tiny policy (the claims' shape: 128 wide,
4 layers, a 1024-token vocabulary; AdamW on one fixed batch of 64 x 160 random tokens, one thread) under several
kernel settings, each in a fresh process (MKL reads its settings once), and reports each one's time per step
and the digest of its weights:

- ``default``: as every run goes (``MKL_CBWR=AUTO,STRICT``, set by ``ema_pg``; torch's widest kernels);
- ``mkl_avx2``: MKL allowed no more than AVX2, a stand-in here for a CPU on which MKL dispatches otherwise;
- ``neutral``: MKL pinned to its vendor-neutral branch (``MKL_CBWR=COMPATIBLE,STRICT``) and torch to its baseline
  kernels (``ATEN_CPU_CAPABILITY=default``): the setting meant to round alike on every x86 CPU;
- ``neutral_mkl_avx2``: ``neutral`` with MKL allowed no more than AVX2 (its digest should be ``neutral``'s);
- ``neutral_aten_avx2``: ``neutral`` with torch's AVX2 kernels (faster; the same on every AVX2 CPU).

The same-digest check is within one machine; the JSON keeps the digests so that a run on another vendor's CPU
can be compared with it (equal ``neutral`` digests there would show the setting portable).

    python benchmarks/portable_sft.py --steps 10 --out benchmarks/results/portable_sft_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

NEUTRAL = {"MKL_CBWR": "COMPATIBLE,STRICT", "ATEN_CPU_CAPABILITY": "default"}
MKL_AVX2 = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
VARIANTS = {
    "default": {},
    "mkl_avx2": MKL_AVX2,
    "neutral": NEUTRAL,
    "neutral_mkl_avx2": {**NEUTRAL, **MKL_AVX2},
    "neutral_aten_avx2": {**NEUTRAL, "ATEN_CPU_CAPABILITY": "avx2"},
}


def steps(n: int) -> dict:
    """In this process: n AdamW steps of the tiny policy on one fixed batch; its time per step and weights' digest."""
    import hashlib
    import time

    import torch

    from ema_pg.engine.models import build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=512,
                             seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ids = torch.randint(3, 1024, (64, 160), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    for _ in range(n):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    took = time.perf_counter() - start
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    return {"s_per_step": took / n, "digest": digest, "final_loss": loss.item(),
            "torch_kernels": torch.backends.cpu.get_cpu_capability()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(steps(a.steps)))
        return 0
    from tqdm import tqdm

    from ema_pg.engine.runs import machine

    rows = {}
    for name, env in tqdm(VARIANTS.items(), desc="kernel settings", unit="setting"):
        out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(a.steps)], env={**os.environ, **env},
                             capture_output=True, text=True, check=True)
        rows[name] = {"env": env, **json.loads(out.stdout.strip().splitlines()[-1])}
    base = rows["default"]["s_per_step"]
    for r in rows.values():
        r["slowdown"] = r["s_per_step"] / base
    result = {"machine": machine(), "steps": a.steps, "batch": [64, 160], "threads": 1,
              "load_average_1min": os.getloadavg()[0], "variants": rows,
              "neutral_same_across_mkl_isa": rows["neutral"]["digest"] == rows["neutral_mkl_avx2"]["digest"],
              "default_same_across_mkl_isa": rows["default"]["digest"] == rows["mkl_avx2"]["digest"]}
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
