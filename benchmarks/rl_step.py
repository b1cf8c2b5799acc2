"""Time one GRPO step of ema-pg beside TRL's GRPOTrainer: same model, prompts and settings, one run.

Both trainers get the settings of :data:`SETTINGS` (one home; TRL's differing defaults are set
to ours explicitly: its ``loss_type`` ``dapo`` -> ``grpo`` (seq-mean-token-mean, ours),
``use_bias_correction_kl`` True -> False (plain K3, ours), clip 0.2 / 0.28, temperature 1,
top-p 1, one pass per batch, group-scaled rewards, constant LR, grad-norm clip 1, AdamW with
no weight decay). The JSON records each trainer's effective settings as it read them, the
completion tokens per step of each (their ratio should be 1 within sampling noise), seconds
per step (median after a warm-up), completion tokens/s, and for both the split into sampling,
scoring (ema-pg: pi_old and the anchor's pass; TRL: the rest of ``_generate_and_score_completions``,
its reference pass, rewards and advantages) and update (the rest of the step).

Rows: ``fp32`` for both (the headline: equal precision); ``bf16`` for both (each trainer's
best precision on a CPU with AMX: ema-pg ``trainer.precision=bf16-mixed``, TRL ``bf16=True``;
both autocast with fp32 master weights); ``fp32+compile`` for both (ema-pg ``model.compile=true``,
the decoder body compiled with dynamic shapes; TRL ``torch_compile=True``, the Trainer's compiled
model; each one's compile happens in the warm-up steps and is not timed).

``--curve``: step time and tokens/s of both at three model sizes x two completion lengths (``--sizes``,
``--completions``: others, up to Qwen2.5-1.5B's transformer body on a GPU),
beside the physical floor: the step's matmul FLOPs (sampling forward, anchor forward, policy
forward + backward; 2 / 2 / 6 FLOPs per parameter and token plus attention) over this CPU's
measured matmul rate at that precision, and the fraction of it each trainer reaches.

``--device`` (auto: cuda where torch sees a GPU): on cuda both trainers run on the GPU (ema-pg
``trainer=gpu``, TRL ``use_cpu=False``), the floor at the GPU's measured matmul rate, and ema-pg's
sampler uses its default there, the static cache with a CUDA-graph decode step (``--static-cache off``
for the growing cache).

    python benchmarks/rl_step.py --out benchmarks/results/rl_step.json            # headline rows
    python benchmarks/rl_step.py --curve --out benchmarks/results/rl_step_curve.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

#: the settings both trainers run with (ema-pg's defaults; TRL's differing ones are overridden from here)
SETTINGS = {"kl": "k3 (no importance weight)", "beta": 0.001, "eps_low": 0.2, "eps_high": 0.28, "temperature": 1.0,
            "top_p": 1.0, "lr": 1e-6, "grad_clip": 1.0, "weight_decay": 0.0, "lr_schedule": "constant",
            "loss_agg": "seq-mean-token-mean", "adv_norm": "group", "updates_per_batch": 1, "reference": "fixed"}
#: --static-cache choices -> ema-pg's rollout.static_cache
STATIC = {"auto": "null", "on": "true", "off": "false"}
#: model sizes: name -> (hidden, layers, heads, kv heads, intermediate or None = 4 x hidden). The qwen rows are
#: Qwen2.5-0.5B's and 1.5B's transformer bodies (their config.json) at the toy task's vocabulary, for a GPU;
#: ``qwen1.5b-thin`` is Qwen2.5-1.5B's body (28 layers, 12 query and 2 key-value heads, the MLP's 5.83x width) at
#: hidden 96: its matrix work is small (26% of the step on a 2-core CPU: rl_step_thin_amd.json), so most of a
#: step's time is what each trainer spends around the kernels (Python, the dispatcher, its number of operations), as
#: on a fast GPU at 1.5B
SIZES = {"1M": (128, 4, 4, 2, None), "10M": (320, 8, 8, 2, None), "50M": (512, 16, 8, 2, None),
         "qwen0.5b": (896, 24, 14, 2, 4864), "qwen1.5b": (1536, 28, 12, 2, 8960),
         "qwen1.5b-thin": (96, 28, 12, 2, 560)}
#: the sizes and completion lengths of ``--curve`` unless --sizes / --completions name others
CURVE_SIZES, CURVE_COMPLETIONS = ("1M", "10M", "50M"), (64, 256)


def make_model_dir(root: Path, hidden: int, layers: int, heads: int = 4, kv_heads: int = 2,
                   intermediate: int | None = None) -> Path:
    from ema_pg.engine.models import build_tiny_model, save_model_dir, train_bpe_tokenizer
    from ema_pg.tasks import build_task

    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    model = build_tiny_model(len(tok), hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                             intermediate_size=intermediate, tokenizer=tok)
    return save_model_dir(model, tok, root / f"model_{hidden}x{layers}")


def bench_ours(model_dir: Path, root: Path, a, bf16: bool, compiled: bool = False) -> dict:
    import pandas as pd
    from omegaconf import OmegaConf, open_dict

    from ema_pg.config import compose
    from ema_pg.train import train

    n, s = a.warmup + a.steps, SETTINGS
    cfg = compose([f"model.path={model_dir}", "kl=k3", "anchor=fixed", f"algo.beta={s['beta']}",
                   f"algo.eps_low={s['eps_low']}", f"algo.eps_high={s['eps_high']}", f"rollout.temperature={s['temperature']}",
                   f"rollout.top_p={s['top_p']}", f"optim.lr={s['lr']}", f"algo.grad_clip={s['grad_clip']}",
                   f"optim.weight_decay={s['weight_decay']}", "algo.warmup_steps=0", f"algo.loss_agg={s['loss_agg']}",
                   f"algo.adv_norm={s['adv_norm']}", f"algo.ppo_epochs={s['updates_per_batch']}", "algo.minibatch_size=0",
                   f"algo.prompts_per_step={a.prompts}", f"algo.group_size={a.group}", f"algo.iterations={n}",
                   f"algo.eval_every={n}", "task.eval_size=8", f"rollout.max_new_tokens={a.completion}",
                   f"trainer.precision={'bf16-mixed' if bf16 else '32-true'}", "trainer.progress_bar=false",
                   f"model.compile={str(compiled).lower()}"] + (["trainer=gpu", "trainer.devices=1"] if a.device == "cuda" else [])
                  + [f"rollout.static_cache={STATIC[a.static_cache]}"])
    run = root / f"ours_{model_dir.name}_{a.completion}_{'bf16' if bf16 else 'fp32'}{'_compiled' if compiled else ''}"
    with open_dict(cfg):
        cfg.run_dir = str(run)
        cfg.sft.cache_dir = str(root / "cache")
    train(cfg)
    df = pd.read_csv(run / "metrics.csv")
    df = df[df["time/step_s"].notna()].sort_values("step").iloc[a.warmup:]
    med = lambda c: float(df[c].median())
    tokens = float((df["train/response_len"] * a.prompts * a.group).median())
    eff = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("algo", "rollout", "optim", "kl", "anchor")}
    eff["trainer.precision"], eff["model.compile"] = cfg.trainer.precision, cfg.model.compile
    eff["trainer.accelerator"] = cfg.trainer.accelerator
    return {"step_s": med("time/step_s"), "sampling_s": med("time/rollout_s"), "score_s": med("time/score_s"),
            "update_s": med("time/update_s"), "completion_tokens_per_step": tokens,
            "completion_tokens_per_s": tokens / med("time/step_s"), "steps_timed": len(df), "effective_settings": eff}


def bench_trl(model_dir: Path, root: Path, a, bf16: bool, compiled: bool = False) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ema_pg.tasks import build_task

    task = build_task({"name": "toy_add"})
    prompts = task.sample(a.prompts * (a.warmup + a.steps + 2), seed=0)
    answers = {p.text: p.answer for p in prompts}
    ds = Dataset.from_list([{"prompt": p.text} for p in prompts])

    def reward(prompts, completions, **kw):
        return [float(c.strip() == answers.get(p)) for p, c in zip(prompts, completions)]

    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))  # transformers' own sdpa attention
    times: list[float] = []
    lengths: list[float] = []
    #: per step: seconds in generation, and in generation + scoring (reference pass, rewards, advantages)
    phases: list[dict[str, float]] = []
    acc = {"sampling": 0.0, "prepare": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t0
        return wrapper

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            acc.update(sampling=0.0, prepare=0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            phases.append(dict(acc))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    s = SETTINGS
    cfg = GRPOConfig(
        output_dir=str(root / "trl"), torch_compile=compiled, per_device_train_batch_size=a.prompts * a.group, num_generations=a.group,
        max_completion_length=a.completion, beta=s["beta"], learning_rate=s["lr"], use_cpu=a.device == "cpu", report_to="none",
        max_steps=a.warmup + a.steps, logging_steps=1, save_strategy="no", gradient_checkpointing=False,
        disable_tqdm=True, bf16=bf16, seed=0, dataloader_num_workers=0,
        loss_type="grpo", use_bias_correction_kl=False, epsilon=s["eps_low"], epsilon_high=s["eps_high"],
        temperature=s["temperature"], top_p=s["top_p"], num_iterations=s["updates_per_batch"], scale_rewards=s["adv_norm"],
        lr_scheduler_type=s["lr_schedule"], max_grad_norm=s["grad_clip"], weight_decay=s["weight_decay"],
        mask_truncated_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Timer()])
    # the same phases as ema-pg's: generation (_generate), scoring (the rest of _generate_and_score_completions:
    # the reference pass, rewards, advantages), update (the rest of the step)
    trainer._generate = timed(trainer._generate, "sampling")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "prepare")
    trainer.train()
    t = times[a.warmup:]
    ph = phases[a.warmup:]
    med = lambda f: statistics.median(f(p, s) for p, s in zip(ph, t))
    L = lengths[a.warmup:] or lengths
    step = statistics.median(t)
    tokens = statistics.median(L) * a.prompts * a.group
    keys = ("loss_type", "use_bias_correction_kl", "beta", "epsilon", "epsilon_high", "temperature", "top_p", "top_k",
            "num_iterations", "scale_rewards", "learning_rate", "lr_scheduler_type", "warmup_steps", "max_grad_norm",
            "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "bf16", "num_generations",
            "per_device_train_batch_size", "max_completion_length", "mask_truncated_completions", "sync_ref_model",
            "torch_compile", "use_cpu")
    return {"step_s": step, "sampling_s": med(lambda p, s: p["sampling"]),
            "score_s": med(lambda p, s: p["prepare"] - p["sampling"]), "update_s": med(lambda p, s: s - p["prepare"]),
            "completion_tokens_per_step": tokens, "completion_tokens_per_s": tokens / step, "steps_timed": len(t), "trl_version": __import__("trl").__version__,
            "effective_settings": {k: getattr(cfg, k) for k in keys}}


def matmul_rate(hidden: int, dtype: torch.dtype, device: str = "cpu") -> float:
    """FLOP/s of this device on the model's dominant matmul shape: (4096 tokens x hidden) @ (hidden x 4 hidden)."""
    x = torch.randn(4096, hidden, dtype=dtype, device=device)
    w = torch.randn(hidden, 4 * hidden, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        x @ w
    n = 200 if device == "cuda" else 20
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        x @ w
    sync()
    return 2 * 4096 * hidden * 4 * hidden * n / (time.perf_counter() - t0)


def step_flops(model_dir: Path, prompts: int, group: int, completion: int, prompt_len: int = 8) -> float:
    """Matmul FLOPs of one step: sampling forward (2/param/token), anchor forward (2), policy forward +
    backward (6), over N = prompts x group rows of prompt_len + completion tokens, plus attention
    (4 L^2 d per layer and row forward, three times that for forward + backward)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir))
    h, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    kv = h * c.num_key_value_heads // c.num_attention_heads
    per_tok = L * (2 * h * h + 2 * h * kv + 3 * h * c.intermediate_size) + h * V  # multiply-adds per token
    N, T = prompts * group, prompt_len + completion
    attn = 4 * T * T * h * L * N / 2  # causal: half the square, forward
    fwd = 2 * per_tok * N * T + attn
    return fwd + fwd + 3 * fwd  # sampling, anchor, policy forward + backward


def run_pair(model_dir: Path, root: Path, a, bf16: bool, compiled: bool = False) -> dict:
    row = {"precision": ("bf16" if bf16 else "fp32") + ("+compile" if compiled else ""),
           "ema_pg": bench_ours(model_dir, root, a, bf16, compiled)}
    if a.trl:
        row["trl"] = bench_trl(model_dir, root, a, bf16, compiled)
        o, t = row["ema_pg"], row["trl"]
        row["speedup_completion_tokens_per_s"] = o["completion_tokens_per_s"] / t["completion_tokens_per_s"]
        row["completion_tokens_ratio"] = o["completion_tokens_per_step"] / t["completion_tokens_per_step"]
    return row


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'point':<18}{'prec':<14}{'ema-pg s/step':>14}{'tok/s':>9}{'TRL s/step':>12}{'tok/s':>9}{'ratio':>7}"
          f"{'floor':>8}{'ours%':>7}{'TRL%':>7}")
    for r in rows:
        o, t = r["ema_pg"], r.get("trl") or {}
        floor = r.get("floor_s")
        print(f"{r.get('point', 'headline'):<18}{r['precision']:<14}{o['step_s']:>14.3f}{o['completion_tokens_per_s']:>9.0f}"
              f"{t.get('step_s', float('nan')):>12.3f}{t.get('completion_tokens_per_s', float('nan')):>9.0f}"
              f"{r.get('speedup_completion_tokens_per_s', float('nan')):>7.2f}"
              + (f"{floor:>8.3f}{100 * floor / o['step_s']:>6.0f}%{100 * floor / t['step_s'] if t else float('nan'):>6.0f}%"
                 if floor else ""))
    print(f"\n{'point':<18}{'prec':<14}{'seconds: sampling / scoring / update':>40}")
    for r in rows:
        for who in ("ema_pg", "trl"):
            x = r.get(who)
            if x and "sampling_s" in x:
                print(f"{r.get('point', 'headline'):<18}{r['precision']:<14}{who:>8}"
                      f"{x['sampling_s']:>12.3f}{x['score_s']:>10.3f}{x['update_s']:>10.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--size", default="1M", choices=list(SIZES))
    ap.add_argument("--precisions", default="fp32,bf16,fp32+compile",
                    help="rows to run, comma-separated: fp32, bf16, and either with +compile (both trainers compiled: "
                         "ema-pg model.compile=true, TRL torch_compile=True)")
    ap.add_argument("--curve", action="store_true", help="the scale curve: every size x completion length")
    ap.add_argument("--sizes", default=",".join(CURVE_SIZES), help=f"the curve's sizes, from {', '.join(SIZES)}")
    ap.add_argument("--completions", default=",".join(map(str, CURVE_COMPLETIONS)), help="the curve's lengths")
    ap.add_argument("--no-trl", dest="trl", action="store_false")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where both trainers run (auto: cuda where torch sees a GPU, else cpu)")
    ap.add_argument("--static-cache", default="auto", choices=list(STATIC),
                    help="ema-pg's rollout.static_cache (auto: its default, on for a CUDA policy: the decode step a CUDA "
                         "graph); TRL's transformers generation has no such mode (it turns generate's compilation off)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # every trainer here compiles the same transformers forward for its own model and shapes: the curve's six
    # models would pass torch's per-function limit of 8 recompiles, after which it silently runs eagerly
    torch._dynamo.config.recompile_limit = 64
    rows = a.precisions.split(",")
    if unknown := set(a.sizes.split(",")) - set(SIZES):
        sys.exit(f"--sizes: {', '.join(sorted(unknown))} unknown; choose from {', '.join(SIZES)}")
    bad = [p for p in rows if p.removesuffix("+compile") not in ("fp32", "bf16")]
    if bad:
        sys.exit(f"--precisions: {', '.join(bad)}; choose from fp32, bf16, fp32+compile, bf16+compile")
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available (a CPU build of torch, or no GPU); run with --device cpu")
    if a.trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("TRL is not installed: pip install -e '.[bench]' (or run with --no-trl)")
    root = Path(tempfile.mkdtemp(prefix="rl_step_"))
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True)
    from ema_pg.engine.runs import git_commit

    out = {"benchmark": "rl_step_curve" if a.curve else "rl_step", "commit": git_commit(),
           "device": torch.cuda.get_device_name() if a.device == "cuda" else cpu.stdout.strip() or platform.machine(),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "settings": SETTINGS,
           "batch": {"prompts": a.prompts, "group": a.group}, "warmup_steps": a.warmup, "timed_steps": a.steps,
           "rows": []}
    points = ([(s, int(c)) for s in a.sizes.split(",") for c in a.completions.split(",")] if a.curve
              else [(a.size, a.completion)])
    rates = {}
    for size, completion in points:
        model_dir = make_model_dir(root, *SIZES[size])
        a.completion = completion
        from transformers import AutoModelForCausalLM

        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(model_dir)).parameters())
        for prec in rows:
            bf16, compiled = prec.startswith("bf16"), prec.endswith("+compile")
            row = run_pair(model_dir, root, a, bf16, compiled)
            dtype = torch.bfloat16 if bf16 else torch.float32
            if (size, dtype) not in rates:  # measured once per size and precision
                rates[(size, dtype)] = matmul_rate(SIZES[size][0], dtype, a.device)
            flops = step_flops(model_dir, a.prompts, a.group, completion)
            row.update(point=f"{size} x {completion} tok", model_params=params, completion_tokens=completion,
                       step_flops=flops, matmul_flops_per_s=rates[(size, dtype)], floor_s=flops / rates[(size, dtype)])
            out["rows"].append(row)
            print_rows(out["rows"][-1:])
            if a.out:  # after every row: a run stopped at its time cap keeps what it measured
                from ema_pg.engine.files import atomic_write

                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                atomic_write(a.out, json.dumps(out, indent=2, default=str) + "\n")  # a cap mid-write keeps the last
    print_rows(out["rows"])
    if a.out:
        print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
