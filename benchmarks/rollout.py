"""Rollout throughput: the HF sampler against the vLLM engine, same prompts, lengths and model.

Two model sizes built from config (no download): the tiny Qwen2 of the tests' scale path and one
of about 100M parameters. Each backend samples ``--prompts`` x ``--n`` responses of exactly
``--tokens`` tokens (EOS never wins: its logit is pushed down in both models), temperature 1; the
median over ``--repeats`` timed calls after one warm-up is reported, with tokens/s. Writes JSON
with the settings beside the numbers.

    python benchmarks/rollout.py --out benchmarks/results/rollout_cpu.json     (make bench-rollout)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

SIZES = {  # name -> Qwen2 shape (head size 32 or 64: vLLM's CPU attention takes both)
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, vocab=512),
    "100M": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, vocab=32000),
}


def build(size: str):
    from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
    from ema_pg.tasks import build_task

    s = SIZES[size]
    corpus = build_task({"name": "search_qa", "seed": 0, "n_people": 200, "n_orgs": 40, "per_split": 4}).corpus()
    tok = train_bpe_tokenizer(corpus * (1 + s["vocab"] // 2000), vocab_size=s["vocab"])
    m = build_tiny_model(len(tok), hidden_size=s["hidden_size"], num_layers=s["num_layers"], num_heads=s["num_heads"],
                         num_kv_heads=s["num_kv_heads"], tokenizer=tok)
    with torch.no_grad():  # fixed-length responses in both backends
        m.get_output_embeddings().weight[tok.eos_token_id].zero_()
        m.get_input_embeddings().weight[tok.eos_token_id].zero_()
    return m.eval(), tok, corpus


def time_backend(sampler, model, prompts, a) -> dict:
    kw = dict(temperature=1.0, max_new_tokens=a.tokens)
    sampler.generate(model, prompts, a.n, seed=0, **kw)  # warm-up (the engine starts here)
    times = []
    for r in range(a.repeats):
        t0 = time.perf_counter()
        ro = sampler.generate(model, prompts, a.n, seed=r + 1, **kw)
        times.append(time.perf_counter() - t0)
    tokens = int(ro.response_mask.sum())
    sec = statistics.median(times)
    return {"seconds": sec, "tokens": tokens, "tokens_per_s": tokens / sec, "all_seconds": times}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from omegaconf import OmegaConf

    from ema_pg.config import RolloutConfig
    from ema_pg.rollout import HFSampler
    from ema_pg.rollout.vllm import VLLMSampler

    out = {"settings": {"prompts": a.prompts, "n": a.n, "tokens": a.tokens, "repeats": a.repeats, "temperature": 1.0,
                        "dtype": "float32", "threads": torch.get_num_threads(), "machine": platform.processor() or
                        platform.machine(), "torch": torch.__version__}, "results": {}}
    for size in a.sizes:
        model, tok, corpus = build(size)
        prompts = [f"Question: {line[:60]}\n" for line in corpus[: a.prompts]]
        n_params = sum(p.numel() for p in model.parameters())
        hf = time_backend(HFSampler(tok), model, prompts, a)
        v = VLLMSampler(tok, OmegaConf.structured(RolloutConfig(name="vllm")))
        vl = time_backend(v, model, prompts, a)
        v.close()
        out["results"][size] = {"parameters": n_params, "hf": hf, "vllm": vl, "vllm_speedup": hf["seconds"] / vl["seconds"]}
        print(f"{size:>5} ({n_params / 1e6:.1f}M params): HF {hf['tokens_per_s']:.0f} tok/s, vLLM {vl['tokens_per_s']:.0f} "
              f"tok/s, vLLM/HF speed-up {hf['seconds'] / vl['seconds']:.2f}x", flush=True)
    import vllm

    out["settings"]["vllm"] = vllm.__version__
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
