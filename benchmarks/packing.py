"""Padded vs padding-free vs padding-free with a token budget: the update's and the scoring pass's speed and peak
memory, on three batch shapes, in one run, each measurement in a fresh process.

Shapes (the rows' real-token lengths are what matters to the passes; the weights are the tiny policy's):
- ``search_reading``: a batch the cold-start policy of ``experiment=search_reading`` samples (64 multi-turn rows,
  observations inside), from the cached base policy (built if missing);
- ``math``: 32 rows of a 100-token prompt (4 prompts x 8 samples) and responses whose lengths spread from 20 to
  ``--math-len`` tokens, as a math policy's do, over the tiny model at ``experiment=math``'s size;
- ``step``: the step benchmark's shape (``benchmarks/rl_step.py``: 16 prompts x 8 samples, 8-token prompts,
  64-token completions, a quarter of them ending early);
- ``math_qwen``: the ``math`` batch over a random model of a Qwen2.5 shape (``--qwen``, default 1.5B; vocabulary
  151,936, bf16): the math recipe's update on a GPU (``--device cuda``), where the passes run in one process and
  ``peak_gib`` is the GPU's peak allocated memory of each pass (a pass that runs out of memory is a row saying so).

Each (shape, mode) is timed as the update does it (forward, the loss's backward, per minibatch) and as the
anchor's scoring pass does it (no grad), after a warm-up, median of ``--reps``; tokens/s counts the batch's real
tokens. ``peak_rss_mib`` is the process's peak resident memory in a child that runs that one measurement (the
same model and batch, built there): with a budget the update's memory is bounded by the budget, not the batch.

    python benchmarks/packing.py --out benchmarks/results/packing_cpu.json
    python benchmarks/packing.py --device cuda --shapes math_qwen --math-len 1024 --out benchmarks/results/packing_gpu.json
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
MODES = {"padded": dict(padding_free=False, budget=0), "padded + budget": dict(padding_free=False, budget=None),
         "packed": dict(padding_free=True, budget=0), "packed + budget": dict(padding_free=True, budget=None)}
# budget None: the shape's token budget per micro-batch


def qwen_model(shape: str, max_positions: int, device: str):
    """A random bf16 model of a Qwen2.5 shape (benchmarks/recipes.py's table), on ``device``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from recipes import SHAPES, VOCAB

    H, F, L, A, KV = SHAPES[shape]
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=F, num_hidden_layers=L, num_attention_heads=A,
                      num_key_value_heads=KV, max_position_embeddings=max_positions, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1, attn_implementation="sdpa")
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def shape_batch(name: str, math_len: int, qwen: str = "qwen2.5-1.5b", device: str = "cpu"):
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

    if name in ("math", "math_qwen"):
        V, P, N, lens = 1024, 100, 32, [int(20 + (math_len - 20) * (i / 31) ** 1.5) for i in range(32)]
        hidden, layers, budget = 128, 4, 8192
    else:
        V, P, N, lens = 1024, 8, 128, [64 if i % 4 else 16 + i % 48 for i in range(128)]
        hidden, layers, budget = 128, 4, 4096
    if name == "math_qwen":
        model = qwen_model(qwen, P + max(lens) + 8, device)
        V = model.config.vocab_size
    else:
        model = build_tiny_model(V, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, seed=0,
                                 max_positions=P + max(lens) + 8)
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
    return model, Rollouts(input_ids=ids.to(device), attention_mask=am.to(device), loss_mask=lm.to(device), prompt_len=P,
                           prompt_index=[r // 8 for r in range(N)]), budget


def time_pass(model, ro, shape_budget: int, mode: str, pass_: str, reps: int, chunk: int, sync=lambda: None) -> dict:
    """One (mode, pass) of a batch: the median of ``reps`` timed repetitions after a warm-up."""
    import torch

    from ema_pg.heads import head
    from ema_pg.packing import pack
    from ema_pg.microbatches import micro_batches

    m = MODES[mode]
    budget = shape_budget if m["budget"] is None else m["budget"]
    parts = micro_batches(ro, budget)
    batches = [ro.select(p) for p in parts]
    packs = [pack(b, True) if m["padding_free"] else None for b in batches]

    def once():
        for b, p in zip(batches, packs):
            if pass_ == "update":
                out = head(model, b, chunk=chunk, packing=p)
                (out.logp * b.response_mask).sum().backward()
            else:
                with torch.no_grad():
                    head(model, b, chunk=chunk, packing=p)
        sync()

    once()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    real = int(ro.attention_mask.sum())
    s = statistics.median(times)
    computed = sum(p.tokens if p is not None else b.input_ids.numel() for b, p in zip(batches, packs))
    return {"mode": mode, "pass": pass_, "rows": len(ro), "real_tokens": real, "padded_tokens": int(ro.input_ids.numel()),
            "computed_tokens": computed, "micro_batches": len(parts), "budget": budget, "seconds": s,
            "tokens_per_s": real / s}


def measure(shape: str, mode: str, pass_: str, reps: int, math_len: int) -> dict:
    """One (shape, mode, pass) on the CPU, in this (fresh) process: its peak resident memory is the pass's."""
    import torch

    torch.set_num_threads(1)
    model, ro, shape_budget = shape_batch(shape, math_len)
    row = time_pass(model, ro, shape_budget, mode, pass_, reps, chunk=4096)
    return {"shape": shape, **row, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure_cuda(shape: str, reps: int, math_len: int, qwen: str):
    """Every (mode, pass) of a shape on the GPU in one process (one model), each pass's peak allocated memory."""
    import torch

    from ema_pg.chunked import CHUNK_MB, auto_chunk

    model, ro, shape_budget = shape_batch(shape, math_len, qwen, "cuda")
    chunk = auto_chunk(int(ro.attention_mask.sum()), model.config.vocab_size, CHUNK_MB["cuda"])
    for pass_ in ("update", "scoring"):
        for mode in MODES:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                row = time_pass(model, ro, shape_budget, mode, pass_, reps, chunk, torch.cuda.synchronize)
            except torch.OutOfMemoryError as e:
                row = {"mode": mode, "pass": pass_, "out_of_memory": str(e).splitlines()[0]}
            yield {"shape": shape, "model": qwen if shape == "math_qwen" else "tiny", **row, "chunk": chunk,
                   "weights_gib": base / 2**30, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="search_reading,math,step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--math-len", type=int, default=2048, help="the longest math response")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: every pass in one process")
    ap.add_argument("--qwen", default="qwen2.5-1.5b", help="math_qwen's model shape (benchmarks/recipes.py's SHAPES)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "packing_cpu.json")
    ap.add_argument("--child", nargs=3, metavar=("SHAPE", "MODE", "PASS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(measure(*a.child, a.reps, a.math_len)))
        return 0
    from ema_pg.engine.files import atomic_write
    from ema_pg.engine.runs import machine

    rows = []

    def save(r: dict) -> None:
        rows.append(r)
        said = (f"{r['seconds']:8.3f} s {r['tokens_per_s']:9.0f} tok/s computed {r['computed_tokens']}/{r['padded_tokens']}"
                if "seconds" in r else r.get("out_of_memory", ""))
        peak = f"{r['peak_gib']:.1f} GiB" if "peak_gib" in r else f"{r['peak_rss_mib']:.0f} MiB"
        print(f"{r['shape']:15s} {r['pass']:8s} {r['mode']:16s} {said}  peak {peak}", flush=True)
        payload = {"benchmark": "packing", "machine": machine(), "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
            "settings": {"device": a.device, "threads": 1 if a.device == "cpu" else None, "reps": a.reps,
                         "math_len": a.math_len, "qwen": a.qwen}, "rows": rows}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(a.out, json.dumps(payload, indent=2) + "\n")

    for shape in a.shapes.split(","):
        if a.device == "cuda":
            for r in measure_cuda(shape, a.reps, a.math_len, a.qwen):
                save(r)
            continue
        for pass_ in ("update", "scoring"):
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--child", shape, mode, pass_, "--reps", str(a.reps),
                                      "--math-len", str(a.math_len)], cwd=ROOT, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{shape} {mode} {pass_}: {out.stderr[-2000:]}")
                save(json.loads(out.stdout.strip().splitlines()[-1]))
    return 0


if __name__ == "__main__":
    if "--child" not in sys.argv:
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
