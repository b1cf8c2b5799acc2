"""One decode step's attention on CPU: the fused kernel against two batched products.

The sampler's attention at a decode step is one query per row over the row's cached keys and
values, grouped-query (each key/value head serves several query heads), with a padding mask.
Two ways to compute it, checked equal before timing:

- ``fused``: ``scaled_dot_product_attention(..., enable_gqa=True)`` with a boolean mask, what
  ``ema_pg.engine.attention`` runs on CPU;
- ``products``: the query heads grouped as a view over their key/value head (no copy of the
  cache), scores = Q K^T, masked softmax, then times V: two batched matrix products.

Each row also gives the rate at which the fused kernel reads the cache, beside the memory bandwidth
measured in the same run by a large copy: near it, the step is bound by reading the cache and no
rewrite of the kernel can win. Shapes come from ``rl_step.SIZES`` (the step benchmark's models).

    python benchmarks/decode_attention.py --out benchmarks/results/decode_attention_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rl_step import SIZES


def fused(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def products(q, k, v, mask):
    (B, Hq, _, D), Hkv, S = q.shape, k.shape[1], k.shape[2]
    s = q.view(B, Hkv, Hq // Hkv, D) @ k.transpose(-1, -2) * D**-0.5  # (B, Hkv, group, S)
    s = s.masked_fill(~mask.view(B, 1, 1, S), float("-inf"))
    return (s.softmax(-1) @ v).view(B, Hq, 1, D)


def timed(fn, args, reps: int) -> float:
    for _ in range(5):
        fn(*args)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - t0) / reps


def copy_rate() -> float:
    """Bytes moved per second (read + write) by copying a 128 MB tensor: this machine's memory bandwidth."""
    x = torch.empty(32 * 2**20)
    y = torch.empty_like(x)
    t = timed(y.copy_, (x,), 20)
    return 2 * x.numel() * x.element_size() / t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1M", choices=list(SIZES))
    ap.add_argument("--rows", type=int, default=128, help="batch rows (the step benchmark's 16 prompts x 8)")
    ap.add_argument("--keys", default="30,70,100,130", help="cached keys per row, comma-separated")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    hidden, _, heads, kv_heads = SIZES[a.size]
    D, B = hidden // heads, a.rows
    torch.manual_seed(0)
    rows, bandwidth = [], copy_rate()
    print(f"memory bandwidth (128 MB copy, read + write): {bandwidth / 1e9:.1f} GB/s")
    for S in (int(s) for s in a.keys.split(",")):
        q, k, v = torch.randn(B, heads, 1, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        mask[: B // 3, ..., : S // 10 + 1] = False  # left padding on a third of the rows
        err = (fused(q, k, v, mask) - products(q, k, v, mask)).abs().max().item()
        assert err < 1e-5, f"the two attentions differ by {err}"
        t_f, t_p = timed(fused, (q, k, v, mask), a.reps), timed(products, (q, k, v, mask), a.reps)
        cache_bytes = 2 * k.numel() * k.element_size()
        rows.append({"keys": S, "fused_us": 1e6 * t_f, "products_us": 1e6 * t_p, "max_abs_diff": err,
                     "cache_mb": cache_bytes / 1e6, "fused_cache_gb_per_s": cache_bytes / t_f / 1e9})
        r = rows[-1]
        print(f"keys {S:4d}: fused {r['fused_us']:7.1f} us, products {r['products_us']:7.1f} us, "
              f"cache {r['cache_mb']:.2f} MB read at {r['fused_cache_gb_per_s']:.1f} GB/s")
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True)
    from ema_pg.engine.runs import git_commit

    out = {"benchmark": "decode_attention", "commit": git_commit(), "device": cpu.stdout.strip() or platform.machine(),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "shape": {"size": a.size, "rows": B, "query_heads": heads, "kv_heads": kv_heads, "head_dim": D,
                     "dtype": "float32"}, "reps": a.reps,
           "copy_gb_per_s": bandwidth / 1e9, "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
