"""Memory and time of the Top-k reverse KL head: chunked vs materialize-then-topk vs exact KL.

For each size (N tokens, V vocabulary, H hidden), two phases are measured, each in a fresh
subprocess so that peak memory is clean:

- ``anchor``: the no-grad passes: top-k of pi_old (k = 32) and the anchor's log-probs at them;
- ``policy``: the policy's forward + backward of Top-k reverse KL (``tail=corrected``),
  gradients w.r.t. the hidden states and the output embedding.

Methods: (a) ``chunked`` (ema_pg.chunked), (b) ``materialized`` (form the (N, V) logits, then
log-softmax, top-k and gather; autograd keeps them), (c) ``exact`` (full-vocabulary exact
reverse KL from both models' logits). Peak memory is the rise of the process's maximum RSS
above what the inputs already hold (on CUDA: the allocator's peak above what is allocated before the
call; there every configuration runs in one process, after one untimed warm-up call, and the time is the
median of ``--repeats`` calls). ``--dtypes`` gives the dtypes of the hidden states and the output embedding
(float32, bfloat16). Configurations whose estimated size exceeds ``--max-gb`` are not run: the JSON records
that with the estimate.

    python benchmarks/kl_head.py --out benchmarks/results/kl_head_cpu.json
    python benchmarks/kl_head.py --device cuda --dtypes float32,bfloat16 --max-gb 100 \
        --sizes 4096x151936x2048,16384x151936x2048,32768x151936x2048 --out benchmarks/results/kl_head_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

K = 32
GRID = [(n, v, h) for n in (2048, 8192) for v in (32000, 151936) for h in (512, 2048)]


PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class RSSPeak:
    """Samples the current RSS from a thread (torch releases the GIL while it computes)."""

    def __enter__(self):
        import ctypes
        import gc
        import threading

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed memory back so the baseline is what is live
        except OSError:
            pass
        self.base = self.peak = rss_now()
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                self.peak = max(self.peak, rss_now())
                self._stop.wait(0.0005)

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self.peak = max(self.peak, rss_now())
        self._stop.set()
        self._t.join()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def inputs(N: int, V: int, H: int, device: str, dtype: str):
    """Hidden states, the policy's and the anchor's output embeddings, and the sampled tokens (seeded)."""
    dev, dt = torch.device(device), DTYPES[dtype]
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(N, H, generator=g) * 0.05).to(dev, dt)
    W = torch.randn(V, H, generator=g) * 0.05
    W_ref = (W + 0.01 * torch.randn(V, H, generator=g)).to(dev, dt)
    return h, W.to(dev, dt), W_ref, torch.randint(0, V, (N,), generator=g).to(dev)


def child(method: str, phase: str, N: int, V: int, H: int, device: str, chunk: int, dtype: str = "float32",
          data=None) -> dict:
    from ema_pg.chunked import chunked_head_nograd, chunked_logprobs
    from ema_pg.kl import KLInputs, get_estimator

    dev = torch.device(device)
    h, W, W_ref, t = data if data is not None else inputs(N, V, H, device, dtype)
    h, W = h.detach(), W.detach()
    est = get_estimator("topk_reverse", k=K, tail="corrected")
    if phase == "policy":  # inputs of the policy pass: index set and anchor log-probs, computed beforehand
        o = chunked_head_nograd(h, W, t, k=K, chunk=chunk)
        q = o.topk_idx.long()
        r = chunked_head_nograd(h, W_ref, t, index=q, chunk=chunk)
        lo, lr_t, lr_q = o.logp, r.logp, r.index_logp
        ref_logits = (h @ W_ref.T).float() if method == "exact" else None
        h.requires_grad_(True)
        W.requires_grad_(True)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    meter = RSSPeak() if dev.type == "cpu" else None
    if meter:
        meter.__enter__()
    sync(dev)
    t0 = time.perf_counter()
    if phase == "anchor":
        if method == "chunked":
            o = chunked_head_nograd(h, W, t, k=K, chunk=chunk)
            r = chunked_head_nograd(h, W_ref, t, index=o.topk_idx.long(), chunk=chunk)
        elif method == "materialized":
            with torch.no_grad():
                lp = torch.log_softmax((h @ W.T).float(), -1)
                q = lp.topk(K, -1).indices
                kept = [lp.gather(-1, t[:, None])]  # what the training step keeps: O(N k)
                del lp
                lr = torch.log_softmax((h @ W_ref.T).float(), -1)
                kept += [lr.gather(-1, q), lr.gather(-1, t[:, None])]
        else:  # exact: both full log-prob tensors are kept for the KL
            with torch.no_grad():
                lp = torch.log_softmax((h @ W.T).float(), -1)
                lr = torch.log_softmax((h @ W_ref.T).float(), -1)
    else:
        if method == "chunked":
            logp, ixl = chunked_logprobs(h, W, t, q, 1.0, chunk)
            kl = est(KLInputs(logp=logp[None], logp_old=lo[None], logp_ref=lr_t[None], tokens=t[None], topk_idx=q[None],
                              topk_logp=ixl[None], topk_logp_ref=lr_q[None]))
        elif method == "materialized":
            lp = torch.log_softmax((h @ W.T).float(), -1)
            kl = est(KLInputs(logp=lp.gather(-1, t[:, None])[:, 0][None], logp_old=lo[None], logp_ref=lr_t[None],
                              tokens=t[None], topk_idx=q[None], topk_logp=lp.gather(-1, q)[None], topk_logp_ref=lr_q[None]))
        else:
            kl = get_estimator("exact_reverse")(KLInputs(logp=lo[None], logp_old=lo[None], logp_ref=lr_t[None],
                                                         logits=(h @ W.T).float()[None], ref_logits=ref_logits[None]))
        kl.sum().backward()
    sync(dev)
    secs = time.perf_counter() - t0
    if meter:
        meter.__exit__(None, None, None)
    peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else (meter.peak - meter.base)
    return {"seconds": secs, "peak_extra_bytes": int(peak)}


def estimate_bytes(method: str, phase: str, N: int, V: int, k: int = K) -> int:
    NV = N * V * 4
    if method == "chunked":
        return N * (8 * k + 12)
    if method == "materialized":
        return 2 * NV if phase == "anchor" else 3 * NV
    return 2 * NV if phase == "anchor" else 4 * NV


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-gb", type=float, default=12.0, help="skip (b)/(c) runs estimated above this")
    ap.add_argument("--chunk", type=int, default=0, help="tokens per chunk (0 = the trainer's default for the device)")
    ap.add_argument("--sizes", default="all", help="'all' or comma list like 2048x32000x512")
    ap.add_argument("--dtypes", default="float32", help="comma list of float32, bfloat16 (hidden states and weights)")
    ap.add_argument("--repeats", type=int, default=3, help="CUDA: timed calls after the warm-up (the median is kept)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        m, ph, N, V, H, dev, ch, dt = a.child
        print(json.dumps(child(m, ph, int(N), int(V), int(H), dev, int(ch), dt)))
        return
    grid = GRID if a.sizes == "all" else [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",")]
    dtypes = a.dtypes.split(",")
    if unknown := set(dtypes) - set(DTYPES):
        raise SystemExit(f"--dtypes: {sorted(unknown)} unknown; choose from {', '.join(DTYPES)}")
    cuda = a.device.startswith("cuda")
    dev_name = torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine())
    rows = []
    for (N, V, H), dtype in ((g, d) for g in grid for d in dtypes):
        from ema_pg.chunked import auto_chunk, chunk_budget_mb

        chunk = a.chunk or auto_chunk(N, V, chunk_budget_mb(None, "cuda" if cuda else "cpu"))  # the trainer's
        data = inputs(N, V, H, a.device, dtype) if cuda else None
        for phase in ("anchor", "policy"):
            for method in ("chunked", "materialized", "exact"):
                row = {"N": N, "V": V, "H": H, "k": K, "dtype": dtype, "phase": phase, "method": method,
                       "chunk_tokens": chunk, "estimated_bytes": estimate_bytes(method, phase, N, V)}
                if method != "chunked" and row["estimated_bytes"] > a.max_gb * 2**30:
                    row["status"] = f"not run: estimated {row['estimated_bytes'] / 2**30:.1f} GiB > --max-gb {a.max_gb}"
                elif cuda:  # the allocator's peak is exact per call: one process, a warm-up, the median of repeats
                    try:
                        runs = [child(method, phase, N, V, H, a.device, chunk, dtype, data) for _ in range(1 + a.repeats)]
                    except torch.OutOfMemoryError as e:
                        row["status"] = f"failed: out of memory ({str(e).splitlines()[0][:120]})"
                        torch.cuda.empty_cache()
                    else:
                        secs = sorted(r["seconds"] for r in runs[1:])
                        row.update(seconds=secs[len(secs) // 2], seconds_all=secs,
                                   peak_extra_bytes=max(r["peak_extra_bytes"] for r in runs), status="ok")
                else:
                    cmd = [sys.executable, __file__, "--child", method, phase, str(N), str(V), str(H), a.device,
                           str(chunk), dtype]
                    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "131072"}
                    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    if p.returncode != 0:
                        row["status"] = f"failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}"
                    else:
                        row.update(json.loads(p.stdout.strip().splitlines()[-1]))
                        row["status"] = "ok"
                rows.append(row)
                print(json.dumps(row), flush=True)
                write(a, rows, dtypes, dev_name, cuda)  # after every row: a run stopped at its cap keeps what it measured
        del data


def write(a, rows: list[dict], dtypes: list[str], dev_name: str, cuda: bool) -> None:
    """The JSON of the rows so far, with each row's ratios against the materialized head (b) of its size."""
    for r in rows:
        b = next((x for x in rows if (x["N"], x["V"], x["H"], x["dtype"], x["phase"]) == (r["N"], r["V"], r["H"], r["dtype"], r["phase"])
                  and x["method"] == "materialized" and x.get("status") == "ok"), None)
        if b and r.get("status") == "ok":
            r["time_vs_materialized"] = r["seconds"] / b["seconds"]
            r["memory_vs_materialized"] = r["peak_extra_bytes"] / max(b["peak_extra_bytes"], 1)
    out = {"benchmark": "kl_head", "device": a.device, "device_name": dev_name, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "k": K, "dtypes": dtypes, "repeats": a.repeats if cuda else 1, "rows": rows,
           "target": "chunked peak extra <= N*(8k+12) B + one chunk; >= 20x below (b) at N=8192, V=151936; time <= 1.3x (b)"}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        from ema_pg.engine.files import atomic_write

        atomic_write(a.out, json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
