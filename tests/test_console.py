"""The console of every shipped experiment that runs without outside data or engines (conf/experiment/: demo,
math, search, search_reading; search_r1, search_paper and math_deepscaler need a model, data and the scale path,
and their consoles are checked by the scale and bring-your-own tests), each a few iterations at tiny sizes, with
its progress bars on: the project's own lines only. A third-party logger's line, a Python warning or a bar the
project did not choose fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "sft.steps=5", "sft.batch_size=8", "sft.num_demos=40", "algo.prompts_per_step=2", "algo.group_size=2",
        "algo.minibatch_size=0", "algo.iterations=2", "algo.eval_every=2", "trainer.progress_bar=true"]
PER_EXPERIMENT = {
    "demo": ["model.tokenizer_vocab=300", "task.eval_size=8", "rollout.max_new_tokens=4"],
    "math": ["task.per_split=2", "rollout.max_new_tokens=8"],
    "search": ["task.per_split=2", "rollout.max_new_tokens=12"],
    "search_reading": ["task.per_split=2", "rollout.max_new_tokens=12", "sft.stop_at_reward=0"],
}
#: what only third parties print: a logger other than the project's or Hydra's in the log format, Python's
#: warnings, and the libraries' own bars and notices
NOISE = [re.compile(p) for p in (
    r"\]\[(?!ema_pg|HYDRA|__main__)[\w.]+\]\[(DEBUG|INFO|WARNING)\]", r"\b\w*Warning: ", r"warnings\.warn",
    r"Setting accelerator", r"Writing model shards", r"Loading weights", r"Tip:", r"GPU available", r"LeafSpec",
    r"^\s*Epoch \d", r"Building index", r"The query is empty",
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
    log = (run / "train.log").read_text()
    assert not [line for line in log.splitlines() if any(p.search(line) for p in NOISE)]
