"""The paper's recipes at their model sizes, random weights: a few iterations of ``experiment=math_deepscaler``
or ``experiment=search_paper`` under DeepSpeed, measured as a researcher's first GPU run would meet them.

A model is built from the config of a Qwen2.5 size (``--shape``; vocabulary 151,936, random weights, bf16)
with a byte-level BPE tokenizer trained here, and saved the way ``save_pretrained`` writes it; the data are
written the way the original projects' scripts write theirs (DeepScaleR's raw JSON: ``problem`` / ``answer``;
Search-R1's parquet rows and its ``POST /retrieve`` server, the tests' fixtures). The recipe then runs with
every knob as it has it except: ``rollout=hf`` (vLLM's CUDA build is not here), ``trainer.strategy`` (``--stage``),
``algo.iterations`` / ``algo.eval_every`` (``--iterations``), ``algo.prompts_per_step`` / ``minibatch_size``
(``--prompts``: one minibatch), ``anchor.update_every=1`` (the EMA anchor moves within the few iterations)
and, where given, ``rollout.max_new_tokens`` (``--max-new-tokens``: a random model never stops, so every
response runs to the limit).

Recorded per iteration: the step's time and its phases (rollout, scoring, update), policy tokens per second,
the GPU's peak memory, the anchor's lag ``||theta_anchor - theta||`` and its update count; per run: the
start-up time, the checkpoint's size and time, and with ``--kill-resume`` a SIGKILL after the first
checkpoint and the resume to the end, then the export of policy and anchor and their reload with
``from_pretrained``. A checkpoint that the disk cannot hold (``--disk-check``: about 18 bytes per parameter,
one copy: ``last.ckpt`` links to the period's checkpoint) is not written: the run is stopped after its last iteration's metrics
and the JSON says so.

    python benchmarks/recipes.py --recipe math_deepscaler --shape qwen2.5-1.5b --stage 2 --iterations 2 \\
        --prompts 4 --max-new-tokens 512 --out benchmarks/results/recipe_math_1.5b_z2_h200.json
    python benchmarks/recipes.py --recipe search_paper --shape qwen2.5-3b --stage 3 --iterations 2 --prompts 4 ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Qwen2.5 sizes (the models' config.json): hidden, intermediate, layers, heads, key/value heads
SHAPES = {"tiny": (64, 128, 2, 4, 2), "qwen2.5-0.5b": (896, 4864, 24, 14, 2), "qwen2.5-1.5b": (1536, 8960, 28, 12, 2),
          "qwen2.5-3b": (2048, 11008, 36, 16, 2),
          "rehearsal": (768, 2048, 6, 12, 2)}  # not a Qwen2.5 size: 153M parameters, the kill/resume/export path on a CPU
VOCAB = 151936
#: eval files of experiment=math_deepscaler (its comment names them)
MATH_EVALS = ("math500", "amc", "minerva", "aime24", "aime25", "olympiad")
HEADROOM = 40e9  #: bytes kept free beside a checkpoint (a tmpfs such as /dev/shm shares the machine's memory)
CKPT_BYTES_PER_PARAM = 2 + 12 + 4  #: bf16 weights, fp32 master + Adam moments, fp32 EMA master (last.ckpt links to it)


def build_model(shape: str, texts: list[str], out: Path, device: str) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ema_pg.engine.models import save_model_dir, train_bpe_tokenizer

    H, F, L, A, KV = SHAPES[shape]
    tok = train_bpe_tokenizer(texts, vocab_size=1000)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=F, num_hidden_layers=L, num_attention_heads=A,
                      num_key_value_heads=KV, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    save_model_dir(model, tok, out)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":  # the GPU is the training run's: this process held 7 GiB of cache beside it
        torch.cuda.empty_cache()
    return n


def math_data(d: Path, eval_sets: int) -> tuple[list[str], dict]:
    """DeepScaleR's raw JSON (problem, answer, solution): a training file and one file per eval benchmark."""
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b), "solution": f"{a} + {b} = {a + b}"}
            for a in range(1, 9) for b in range(1, 9)]
    (d / "train.json").write_text(json.dumps(rows))
    for i, name in enumerate(MATH_EVALS[:eval_sets]):  # one problem each: every one is sampled rollout.eval_samples times
        (d / f"{name}.json").write_text(json.dumps([{"problem": f"What is {i} * 7?", "answer": str(7 * i)}]))
    return [r["problem"] + " " + r["solution"] for r in rows] * 3, {"EMA_PG_MATH_DATA": str(d)}


def search_data(d: Path, eval_sets: int):
    """Search-R1's parquet rows (qa_search_*_merge.py) over the tests' documents, and its retrieval server."""
    import pandas as pd

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "engine")]  # the helpers; test_byo's fixture writers
    from retrieval_server import FaultServer
    from test_byo import DOCS, search_r1_rows

    d.mkdir(parents=True, exist_ok=True)
    qs = [{"id": f"q{i}", "question": f"what is the capital of {c}", "golden_answers": [a]}
          for i, (c, a) in enumerate([("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid")])]
    pd.DataFrame(search_r1_rows(qs, "nq", "train")).to_parquet(d / "train.parquet")
    test = [r for s in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")[:eval_sets]
            for r in search_r1_rows(qs[:1], s, "test")]
    pd.DataFrame(test).to_parquet(d / "test.parquet")
    server = FaultServer(DOCS)
    texts = [r["prompt"][0]["content"] for r in test] + [x["contents"] for x in DOCS] * 5
    texts += ["<search> capital </search> <information> </information> <answer> Paris </answer>"] * 5
    return texts, {"EMA_PG_SEARCH_DATA": str(d), "EMA_PG_RETRIEVER": server.url}, server


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's training iterations as logged (metrics.csv rows with a step time), numbers only."""
    import pandas as pd

    f = run_dir / "metrics.csv"
    if not f.is_file():
        return []
    d = pd.read_csv(f)
    d = d[d["time/step_s"].notna()] if "time/step_s" in d else d.iloc[:0]
    return [{k: float(v) for k, v in row.items() if pd.notna(v)} for row in d.select_dtypes("number").to_dict("records")]


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) if path.exists() else 0


#: ema_pg.train with faulthandler on SIGUSR1, so that a run stopped at its time cap says where it was
TRAIN_WITH_STACKS = ("import faulthandler, runpy, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
                     "sys.argv[0] = 'ema_pg.train'; runpy.run_module('ema_pg.train', run_name='__main__')")


class Stopped(Exception):
    """SIGTERM (the caller's time cap): the training process is ended and the JSON keeps what was measured."""


def _stopped(signum, frame):
    raise Stopped


def run_train(args: list[str], env: dict, log: Path, run_dir: Path, stop_after: int | None = None,
              kill_at_checkpoint: bool = False, timeout: float = 3600) -> dict:
    """One ``ema_pg.train`` process; stopped (SIGKILL) once ``stop_after`` iterations are logged, or once the
    first checkpoint is complete with ``kill_at_checkpoint``."""
    t0 = time.time()
    with log.open("a") as fh:
        p = subprocess.Popen([sys.executable, "-c", TRAIN_WITH_STACKS, *args], stdout=fh, stderr=subprocess.STDOUT,
                             env=env, cwd=ROOT)
        out = {"killed": None}
        try:
            wait_train(p, out, t0, run_dir, stop_after, kill_at_checkpoint, timeout)
        except Stopped:
            p.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            p.kill()
            out["killed"] = "the benchmark's time cap (SIGTERM)"
            p.wait()
            out.update(rc=p.returncode, seconds=time.time() - t0)
            raise Stopped(out) from None
        p.wait()
    out.update(rc=p.returncode, seconds=time.time() - t0)
    return out


def wait_train(p: subprocess.Popen, out: dict, t0: float, run_dir: Path, stop_after: int | None,
               kill_at_checkpoint: bool, timeout: float) -> None:
    """Polls the training process until it ends, stopping it on ``timeout``, ``stop_after`` or the checkpoint."""
    while p.poll() is None:
        time.sleep(0.5)
        if time.time() - t0 > timeout:
            p.send_signal(signal.SIGUSR1)  # where it was: every thread's stack into the log
            time.sleep(2.0)
            p.kill()
            out["killed"] = "timeout"
        elif stop_after is not None and len(read_metrics(run_dir)) >= stop_after:
            p.kill()
            out["killed"] = f"after iteration {stop_after}'s metrics, before its checkpoint"
        elif kill_at_checkpoint and (run_dir / "checkpoints" / "last.ckpt" / "latest").is_file():
            time.sleep(1.0)
            p.send_signal(signal.SIGKILL)
            out["killed"] = "SIGKILL after the first checkpoint"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=["math_deepscaler", "search_paper"], required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--stage", type=int, choices=[2, 3], default=2)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per iteration (the group size is the recipe's)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0 = the recipe's")
    ap.add_argument("--kill-resume", action="store_true", help="checkpoint every iteration, SIGKILL after the first, "
                    "resume; then export policy and anchor")
    ap.add_argument("--eval-sets", type=int, default=7, help="eval files (benchmarks / data sources) written, one "
                    "question each: an evaluation samples them one split after another")
    ap.add_argument("--disk-check", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--steps-only", action="store_true", help="stop the run after its last iteration's metrics: no "
                    "checkpoint, no final evaluation (the step's phases, memory and anchor lag only)")
    ap.add_argument("--workdir", default="/tmp/ema_pg_recipes")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for ema_pg.train")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.steps_only and a.kill_resume:
        ap.error("--steps-only writes no checkpoint, which --kill-resume needs: give one of them")

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tag = f"{a.recipe}-{a.shape}-z{a.stage}" + ("-kr" if a.kill_resume else "")
    work = Path(a.workdir) / tag
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result = {"benchmark": "recipes", "recipe": a.recipe, "shape": a.shape, "stage": a.stage, "vocab": VOCAB,
              "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__}
    t = time.time()
    server = None
    if a.recipe == "math_deepscaler":
        texts, env_data = math_data(work / "data", a.eval_sets)
    else:
        texts, env_data, server = search_data(work / "data", a.eval_sets)
    result["params"] = build_model(a.shape, texts, work / "model", device)
    result["build_s"] = time.time() - t
    group = 8 if a.recipe == "math_deepscaler" else 5  # the recipes' algo.group_size
    run_dir = work / "run"
    over = [f"experiment={a.recipe}", "rollout=hf", f"trainer.strategy=deepspeed_stage_{a.stage}",
            f"algo.iterations={a.iterations}", f"algo.eval_every={1 if a.kill_resume else a.iterations}",
            f"algo.prompts_per_step={a.prompts}", f"algo.minibatch_size={a.prompts * group}", "anchor.update_every=1",
            f"run_dir={run_dir}", *a.extra]
    if a.max_new_tokens:
        over.append(f"rollout.max_new_tokens={a.max_new_tokens}")
    if device == "cpu":
        over += ["trainer.accelerator=cpu", "trainer.precision=32-true", "model.dtype=float32"]
    result["overrides"] = over
    env = {**os.environ, **env_data, "EMA_PG_MODEL": str(work / "model"), "PYTHONUNBUFFERED": "1",
           "EMA_PG_CACHE": str(work / "cache")}
    need = CKPT_BYTES_PER_PARAM * result["params"]
    free = shutil.disk_usage(work).free
    result["checkpoint_estimate_gb"], result["disk_free_gb"] = need / 1e9, free / 1e9
    stop_after = a.iterations if a.steps_only else None
    if stop_after:
        result["checkpoint"] = "not written: --steps-only stopped the run after its last iteration's metrics"
    elif a.disk_check and need * 1.05 > free - HEADROOM and not a.kill_resume:
        stop_after = a.iterations
        result["checkpoint"] = (f"not written: about {need / 1e9:.0f} GB against {free / 1e9:.0f} GB free; "
                                "the run was stopped after its last iteration's metrics")
    log = work / "train.log"
    signal.signal(signal.SIGTERM, _stopped)
    stopped = None  # the phase the caller's SIGTERM came in
    try:
        measure(a, result, over, env, log, run_dir, stop_after, work)
    except Stopped as e:  # the caller's cap: what was measured is kept, and the JSON says where it stopped
        stopped = ("resume" if "run" in result else "run") if e.args else "export"
        if e.args:
            result[stopped] = e.args[0]
        result["stopped"] = f"SIGTERM (the caller's time cap) during the {stopped}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM does not cut the JSON short
        if server is not None:
            server.close()
        rows = read_metrics(run_dir)
        keys = ("time/step_s", "time/rollout_s", "time/score_s", "time/update_s", "time/tokens_per_s",
                "memory/peak_gib", "anchor/lag_norm", "anchor/updates", "train/kl", "train/reward_mean")
        result["iterations"] = [{k: r[k] for k in keys if k in r} for r in rows]
        result["checkpoint_bytes"] = du(run_dir / "checkpoints")
        if (run_dir / "eval.json").is_file():
            result["final_eval"] = json.loads((run_dir / "eval.json").read_text())
        result["log_tail"] = log.read_text().splitlines()[-15:] if log.is_file() else []
        from ema_pg.engine.files import atomic_write

        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(a.out, json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k not in ("log_tail", "overrides")})[:3000])
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # tens of GB at these sizes, measured above
    if stopped:
        sys.exit(f"stopped by SIGTERM during the {stopped}; {a.out} holds what was measured")


def measure(a, result: dict, over: list[str], env: dict, log: Path, run_dir: Path, stop_after: int | None,
            work: Path) -> None:
    """The run (and with ``--kill-resume`` its SIGKILL, resume, export and reload), into ``result`` as it goes."""
    import torch

    result["run"] = run_train(over, env, log, run_dir, stop_after=stop_after, kill_at_checkpoint=a.kill_resume,
                              timeout=a.timeout)
    if not a.kill_resume:
        return
    result["resume"] = run_train(over + ["if_exists=resume"], env, log, run_dir, timeout=a.timeout)
    if result["resume"]["rc"] != 0:
        return
    from transformers import AutoModelForCausalLM

    exported = result["export"] = {}
    for which in ("policy", "anchor"):
        t = time.time()
        dest = work / f"export-{which}"
        p = subprocess.run([sys.executable, "-m", "ema_pg.workbench.export", str(run_dir), str(dest), "--dtype",
                            "float32"] + (["--anchor"] if which == "anchor" else []), cwd=ROOT, env=env,
                           capture_output=True, text=True)
        exported[which] = {"rc": p.returncode, "seconds": time.time() - t,
                           "said": (p.stdout + p.stderr).strip().splitlines()[-1:]}
    if all(e["rc"] == 0 for e in exported.values()):
        pol, anc = (AutoModelForCausalLM.from_pretrained(str(work / f"export-{w}"), dtype=torch.float32)
                    for w in ("policy", "anchor"))
        sq = sum(float((x - y).pow(2).sum()) for x, y in zip(pol.state_dict().values(), anc.state_dict().values()))
        exported["lag_of_the_exports"] = sq ** 0.5


if __name__ == "__main__":
    main()
