"""Time one GRPO step of ema-pg, and of TRL's GRPOTrainer on the same model and prompts.

Settings (the peer comparison of the training-engine issue): a tiny Qwen2 model, 16 prompts
x 8 samples, 64-token completions, beta = 0.001 with a reference model, K3 KL, one update
per batch. Prints and writes JSON: seconds per step split into sampling, old log-probs,
anchor log-probs and updates (median over the steps after a warm-up), completion tokens/s,
and, when TRL is installed (``pip install -e '.[bench]'``), TRL's numbers from the same run.

    python benchmarks/rl_step.py --steps 8 --warmup 2 --out benchmarks/results/rl_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch



def make_model_dir(root: Path, hidden: int, layers: int) -> Path:
    from ema_pg.models import build_tiny_model, save_model_dir, train_bpe_tokenizer
    from ema_pg.tasks import build_task

    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    model = build_tiny_model(len(tok), hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return save_model_dir(model, tok, root / "model")


def bench_ours(model_dir: Path, root: Path, a) -> dict:
    import pandas as pd
    from omegaconf import open_dict

    from ema_pg.config import compose
    from ema_pg.train import train

    n = a.warmup + a.steps
    cfg = compose([f"model.path={model_dir}", "kl=k3", "anchor=fixed", "algo.beta=0.001",
                       f"algo.prompts_per_step={a.prompts}", f"algo.group_size={a.group}", "algo.ppo_epochs=1",
                       "algo.minibatch_size=0", f"algo.iterations={n}", f"algo.eval_every={n}", "task.eval_size=8",
                       f"rollout.max_new_tokens={a.completion}", "optim.lr=1e-6", "trainer.progress_bar=false"])
    with open_dict(cfg):
        cfg.run_dir = str(root / "ours")
        cfg.sft.cache_dir = str(root / "cache")
    train(cfg)
    df = pd.read_csv(root / "ours" / "metrics.csv")
    df = df[df["time/step_s"].notna()].sort_values("step").iloc[a.warmup:]
    med = lambda c: float(df[c].median())
    tokens = float((df["train/response_len"] * a.prompts * a.group).median())
    return {"step_s": med("time/step_s"), "sampling_s": med("time/rollout_s"), "score_s": med("time/score_s"),
            "update_s": med("time/update_s"),
            "completion_tokens_per_step": tokens, "completion_tokens_per_s": tokens / med("time/step_s"),
            "steps_timed": len(df)}


def bench_trl(model_dir: Path, root: Path, a) -> dict:
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
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    times: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    cfg = GRPOConfig(
        output_dir=str(root / "trl"), per_device_train_batch_size=a.prompts * a.group, num_generations=a.group,
        max_completion_length=a.completion, beta=0.001, learning_rate=1e-6, use_cpu=True, report_to="none",
        max_steps=a.warmup + a.steps, logging_steps=1, save_strategy="no", gradient_checkpointing=False,
        disable_tqdm=True, bf16=False, seed=0, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Timer()])
    trainer.train()
    t = times[a.warmup:]
    L = lengths[a.warmup:] or lengths
    step = statistics.median(t)
    tokens = statistics.median(L) * a.prompts * a.group
    return {"step_s": step, "completion_tokens_per_step": tokens, "completion_tokens_per_s": tokens / step,
            "steps_timed": len(t), "trl_version": __import__("trl").__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rl_step_"))
    model_dir = make_model_dir(root, a.hidden, a.layers)
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(model_dir)).parameters())
    out = {"benchmark": "rl_step", "device": platform.processor() or platform.machine(), "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "model_params": params,
           "settings": {"prompts": a.prompts, "group": a.group, "completion_tokens": a.completion, "kl": "k3",
                        "beta": 0.001, "updates_per_step": 1, "warmup_steps": a.warmup, "timed_steps": a.steps}}
    out["ema_pg"] = bench_ours(model_dir, root, a)
    have_trl = False
    if not a.no_trl:
        try:
            import trl  # noqa: F401

            have_trl = True
        except ImportError:
            out["trl"] = "not installed (pip install -e '.[bench]')"
    if have_trl:
        out["trl"] = bench_trl(model_dir, root, a)
        out["speedup_completion_tokens_per_s"] = (out["ema_pg"]["completion_tokens_per_s"]
                                                  / out["trl"]["completion_tokens_per_s"])
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
