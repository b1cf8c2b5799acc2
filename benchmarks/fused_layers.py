"""The policy's forward and backward on CPU: transformers' Qwen2 body against the same weights run as
hand-fused layers.

The question this answers: does the update (and the anchor's pass) lose time to transformers'
module structure, so that a model implementation of our own could make the step faster? The
fused body computes the same function from the same parameters with fewer, larger operations:

- one product for the query, key and value projections (their weights and biases concatenated),
  and one for the gate and up projections of the MLP, instead of three and two;
- ``torch.nn.functional.rms_norm`` instead of transformers' five-operation RMSNorm;
- the rotary embedding computed once per batch, not once per forward of each layer's caller.

Both are checked equal (hidden states at every real position) before timing; the two are then
timed alternately, ``--reps`` rounds, so that drift of a shared machine falls on both. Rows: the
no-grad forward (the anchor's pass) and forward + backward through a log-prob loss (the update),
on the step benchmark's batch (16 prompts x 8 samples, 8 prompt + 64 completion tokens, a third of
the rows left-padded by 3) and models (``rl_step.SIZES``).

    python benchmarks/fused_layers.py --out benchmarks/results/fused_layers_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from rl_step import SIZES  # noqa: E402


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def fused_body(model, ids, am, pos):
    """(N, L, H) final hidden states of ``model``'s Qwen2 body, computed with fused projections."""
    body, c = model.get_decoder(), model.config
    H, nh, nkv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    d, eps = H // nh, c.rms_norm_eps
    N, L = ids.shape
    freqs = pos[..., None].float() * body.rotary_emb.inv_freq  # (N, L, d/2)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = (emb.cos() * body.rotary_emb.attention_scaling)[:, None], (emb.sin() * body.rotary_emb.attention_scaling)[:, None]
    mask = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()[None, None] & am.bool()[:, None, None, :]
    x = body.embed_tokens(ids)
    for layer in body.layers:
        a, mlp = layer.self_attn, layer.mlp
        h = F.rms_norm(x, (H,), layer.input_layernorm.weight, eps)
        qkv = F.linear(h, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                       torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        q, k, v = qkv.split([H, nkv * d, nkv * d], -1)
        q, k, v = (t.view(N, L, -1, d).transpose(1, 2) for t in (q, k, v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(N, L, H), a.o_proj.weight)
        h = F.rms_norm(x, (H,), layer.post_attention_layernorm.weight, eps)
        g, u = F.linear(h, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])).chunk(2, -1)
        x = x + F.linear(F.silu(g) * u, mlp.down_proj.weight)
    return F.rms_norm(x, (H,), body.norm.weight, eps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M", help="comma-separated, from " + ", ".join(SIZES))
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from ema_pg.engine.models import build_tiny_model
    from ema_pg.engine.runs import git_commit

    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True)
    out = {"benchmark": "fused_layers", "commit": git_commit(), "device": cpu.stdout.strip() or platform.machine(),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "batch": {"rows": a.rows, "prompt_tokens": a.prompt, "completion_tokens": a.completion,
                     "left_padded": "every third row by 3"}, "reps": a.reps, "rows": []}
    for size in a.sizes.split(","):
        hidden, layers, heads, kv = SIZES[size]
        torch.manual_seed(0)
        model = build_tiny_model(300, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv)
        T = a.prompt + a.completion
        ids = torch.randint(5, 300, (a.rows, T))
        am = torch.ones(a.rows, T, dtype=torch.long)
        am[::3, :3] = 0
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        W = model.get_output_embeddings().weight
        hf = lambda: model.get_decoder()(input_ids=ids, attention_mask=am, position_ids=pos).last_hidden_state
        fused = lambda: fused_body(model, ids, am, pos)
        with torch.no_grad():
            diff = float((hf() - fused())[am.bool()].abs().max())
        if diff > 1e-4:
            sys.exit(f"{size}: the fused body differs from transformers' by {diff:.2e}")

        def update(body):
            hid = body()[:, a.prompt - 1 : -1]
            torch.log_softmax(hid @ W.T, -1).gather(-1, ids[:, a.prompt:, None]).sum().backward()

        def forward(body):
            with torch.no_grad():
                body()

        times = {(k, p): [] for k in ("transformers", "fused") for p in ("forward", "forward+backward")}
        for rep in range(a.reps + 2):  # two warm-up rounds
            for k, body in (("transformers", hf), ("fused", fused)):
                for p, run in (("forward", forward), ("forward+backward", update)):
                    t0 = time.perf_counter()
                    run(body)
                    if rep >= 2:
                        times[(k, p)].append(time.perf_counter() - t0)
                    model.zero_grad(set_to_none=True)
        params = sum(p.numel() for p in model.parameters())
        for p in ("forward", "forward+backward"):
            t_hf, t_f = statistics.median(times[("transformers", p)]), statistics.median(times[("fused", p)])
            row = {"size": size, "params": params, "pass": p, "transformers_s": t_hf, "fused_s": t_f,
                   "speedup": t_hf / t_f, "max_abs_diff": diff}
            out["rows"].append(row)
            print(f"{size:>4} {p:<17} transformers {t_hf:.3f} s  fused {t_f:.3f} s  speedup {t_hf / t_f:.2f}x"
                  f"  (max |diff| {diff:.1e})")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
