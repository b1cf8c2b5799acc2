"""The console of every shipped experiment that runs without outside data or engines (conf/experiment/: demo,
math, search, search_reading; search_r1, search_paper and math_deepscaler need a model, data and the scale path,
and their consoles are checked by the scale and bring-your-own tests), each a few iterations at tiny sizes, with
its progress bars on, and of the commands the README and docs show beside training (``python -m ema_pg.X``): the
project's own lines only. A third-party logger's line, a Python warning or a bar the project did not choose fails
here. ``reports`` and ``hpo`` are checked where their tests run them (tests/engine/test_sweeps.py, tests/workbench/test_optuna.py),
``search_r1`` where the bring-your-own tests run it (tests/engine/test_byo.py); ``math_deepscaler`` and ``search_paper``
(DeepSpeed) run here on the scale path, as ``benchmarks/recipes.py`` runs them at a tiny shape."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "sft.steps=5", "sft.batch_size=8", "sft.num_demos=40", "algo.prompts_per_step=2", "algo.group_size=2",
        "algo.minibatch_size=0", "algo.iterations=2", "algo.eval_every=2", "trainer.progress_bar=true"]
PER_EXPERIMENT = {
    "demo": ["model.tokenizer_vocab=300", "task.eval_size=8", "rollout.max_new_tokens=4"],
    "math": ["task.per_split=2", "rollout.max_new_tokens=8", "trainer.precision=bf16-mixed"],  # and CPU autocast
    "search": ["task.per_split=2", "rollout.max_new_tokens=12"],
    "search_reading": ["task.per_split=2", "rollout.max_new_tokens=12", "sft.stop_at_reward=0"],
}
#: what only third parties print: a logger other than the project's or Hydra's in the log format, Python's
#: warnings, and the libraries' own bars and notices
NOISE = [re.compile(p) for p in (
    r"\]\[(?!ema_pg|HYDRA|__main__)[\w.]+\]\[(DEBUG|INFO|WARNING)\]", r"\b\w*Warning: ", r"warnings\.warn",
    r"Setting accelerator", r"Writing model shards", r"Loading weights", r"Tip:", r"GPU available", r"LeafSpec",
    r"^\s*Epoch \d", r"Building index", r"The query is empty", r"Automatic Mixed Precision",
)]


@pytest.mark.slow
@pytest.mark.parametrize("experiment", list(PER_EXPERIMENT))
def test_a_shipped_experiment_prints_only_the_projects_lines(tmp_path, experiment):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ema_pg.train", f"experiment={experiment}", *TINY, *PER_EXPERIMENT[experiment],
           f"sft.cache_dir={tmp_path / 'cache'}", f"run_dir={run}", f"hydra.run.dir={run}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    console = r.stdout + r.stderr
    assert r.returncode == 0, console[-3000:]
    noise = [line for line in re.split(r"[\r\n]", console) if any(p.search(line) for p in NOISE)]
    assert noise == [], "\n".join(noise[:10])
    assert "RL iterations" in console and "run folder:" in console  # the project's own bar and closing lines
    if "trainer.precision=bf16-mixed" in PER_EXPERIMENT[experiment]:  # the start-up line says what Lightning's did
        assert "parameters, float32, bf16-mixed)" in console, console[:3000]
    log = (run / "train.log").read_text()
    assert not [line for line in log.splitlines() if any(p.search(line) for p in NOISE)]


def noise(console: str) -> list[str]:
    """The lines of a console that only a third party prints (:data:`NOISE`)."""
    return [line for line in re.split(r"[\r\n]", console) if any(p.search(line) for p in NOISE)]


START = """import sys
import ema_pg.decide, ema_pg.track, ema_pg.workbench.claims, ema_pg.workbench.hpo
files_only = [m for m in ("torch", "seaborn") if m in sys.modules]
import ema_pg.reports
from ema_pg.engine.console import quiet_third_party
quiet_third_party()
readers = [m for m in ("lightning", "torchmetrics", "scipy.signal", "transformers") if m in sys.modules]
import runpy
runpy.run_module("ema_pg.train", run_name="__mp_main__", alter_sys=True)  # as a spawned worker imports its parent's
import ema_pg.engine.rollout_workers
print(files_only, readers, [m for m in ("lightning", "torchmetrics", "scipy.signal") if m in sys.modules])
"""


def test_commands_that_read_runs_and_the_rollout_worker_start_without_the_trainers_libraries():
    """A report, the claims ledger and a study's coordinator read files: they imported Lightning (and through it
    torchmetrics, SciPy and transformers) only to silence it, seconds at every start. A rollout worker, spawned
    from ``python -m ema_pg.train``, imports that module again and paid for Lightning too. Neither does now. A plan's
    coordinator (decide), a study's (hpo, which starts its workers), ``track`` and the claims ledger start without torch
    and seaborn as well (torch came through the file helpers, seaborn through the tables' module, Lightning into hpo
    through its pruning callback: ~4 s at every start, ~14 s at hpo's)."""
    r = subprocess.run([sys.executable, "-c", START], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[] [] []", r.stdout


def command(*args: str, ok: bool = True) -> str:
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    console = r.stdout + r.stderr
    assert (r.returncode == 0) == ok, console[-3000:]
    return console


@pytest.mark.slow
def test_the_documented_commands_print_only_the_projects_lines(finished_run, tmp_path):
    """Each ``python -m ema_pg.X`` the README and docs show, run as they show it on this machine's data: a finished
    run, the bring-your-own examples and their retrieval server, the committed reproductions."""
    consoles = {
        "evaluate": command("ema_pg.evaluate", str(finished_run), "--out", str(tmp_path / "eval.json")),
        "export": command("ema_pg.export", str(finished_run), str(tmp_path / "exported")),
        "lab": command("ema_pg.lab", "k3", "topk_reverse[paper]"),
        "byo": command("ema_pg.byo", str(tmp_path / "byo")),
        "reproduce": command("ema_pg.reproduce", "fig6_k", "--scale", "mini", "--dry-run"),
        "decide": command("ema_pg.decide", "reproductions/table2/claims/plan.yaml", "--status"),
        "claims": command("ema_pg.workbench.claims", "--out", str(tmp_path / "CLAIMS.md")),
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "ema_pg.tasks.search.serve", "--corpus",
                               str(tmp_path / "byo" / "search_r1" / "corpus.jsonl"), "--port", str(port)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        body = json.dumps({"queries": ["capital", ""], "topk": 2, "return_scores": True}).encode()
        for _ in range(120):  # the index is built at start
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/retrieve", body, {"Content-Type": "application/json"})
                answer = json.loads(urllib.request.urlopen(req, timeout=5).read())
                break
            except OSError:
                time.sleep(0.5)
        assert len(answer["result"]) == 2  # an empty query too: answered, not logged
    finally:
        server.terminate()
        consoles["tasks.search.serve"] = server.communicate(timeout=30)[0]
    for name, console in consoles.items():
        assert noise(console) == [], (name, noise(console)[:10])
    assert (tmp_path / "exported" / "config.json").is_file() and (tmp_path / "CLAIMS.md").is_file()
    typo = command("ema_pg.train", "algo.iterationz=3", ok=False)  # Hydra's six lines advised +algo.iterationz=3
    assert typo == "config error: unknown key algo.iterationz: did you mean algo.iterations? remove it\n", typo
    usage = command("ema_pg.decide", "--help")  # argparse's own said 'usage: decide.py'
    assert usage.startswith("usage: python -m ema_pg.decide "), usage[:200]


@pytest.mark.scale
@pytest.mark.parametrize("recipe", ["math_deepscaler", "search_paper"])
def test_the_paper_scale_recipes_print_only_the_projects_lines(recipe, tmp_path):
    """The two GPU recipes on this CPU (DeepSpeed ZeRO-2, the HF sampler, a tiny model at the real vocabulary):
    the training process's whole console, evaluations and checkpoint included, holds the project's lines only."""
    out = tmp_path / "recipe.json"
    r = subprocess.run([sys.executable, "benchmarks/recipes.py", "--recipe", recipe, "--shape", "tiny", "--iterations",
                        "2", "--prompts", "2", "--eval-sets", "1", "--max-new-tokens", "12", "--workdir", str(tmp_path),
                        "--extra", "rollout.static_cache=false", "trainer.progress_bar=true",
                        *(["rollout.eval_samples=2"] if recipe == "math_deepscaler" else []),  # the paper's 32
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert result["run"]["rc"] == 0 and len(result["iterations"]) == 2 and "final_eval" in result
    log = (tmp_path / f"{recipe}-tiny-z2" / "train.log").read_text()
    assert "RL iterations" in log and "run folder:" in log
    assert noise(log) == [], noise(log)[:10]
