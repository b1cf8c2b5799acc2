"""The trackers end to end, as a researcher runs them (slow): a 3-job sweep into wandb, MLflow (a real ``mlflow
server``, read back through its REST client) and TensorBoard; a run killed with -9 and resumed, still one run in each
with every iteration once; an MLflow server that goes away mid-run. decide's and hpo's trackers are checked in their
own end-to-end tests (test_decide.py, test_optuna.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY, mlflow_server, wait_while_alive
from omegaconf import OmegaConf
from test_tracking import (as_mlflow, mlflow_held, record_of, settled, tensorboard_held, unlike,
                           wandb_metrics)

from ema_pg.config import flatten
from ema_pg.engine.tracking import read_record, wandb_files, wandb_records

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
RUN = [o for o in TINY if not o.startswith(("algo.iterations", "algo.eval_every"))] + ["task.eval_size=16"]


def train_cmd(*overrides: str, multirun: bool = False) -> list[str]:
    return [sys.executable, "-m", "ema_pg.train", *(["-m"] if multirun else []), *RUN, *overrides]


def env() -> dict:  # the console as a researcher's: wandb's own switch left unset
    return {k: v for k, v in os.environ.items() if k != "WANDB_SILENT"}


def test_a_three_job_sweep_is_three_runs_in_each_tracker_with_its_config_name_group_and_tags(tmp_path, mlflow_url):
    from mlflow import MlflowClient

    sweep = tmp_path / "sweep"
    out = subprocess.run(train_cmd("seed=0,1,2", "algo.iterations=4", "algo.eval_every=2", "sft.seed=0",
                                   f"sft.cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={sweep}",
                                   "logger=[wandb,mlflow,tensorboard]", f"logger.mlflow_uri={mlflow_url}",
                                   "logger.project=sweep3", "logger.tags=[fig6]", multirun=True),
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env())
    assert out.returncode == 0, out.stderr[-3000:]
    noise = [line for line in (out.stdout + out.stderr).splitlines()
             if line.startswith(("wandb:", "INFO", "WARNING")) or " INFO mlflow" in line or "alembic" in line
             or "Experiment with name" in line]
    assert not noise, noise  # no tracker's banner or log line on the console
    runs = sorted(p for p in sweep.iterdir() if (p / "config.yaml").is_file())
    assert [p.name for p in runs] == [f"{i}_topk_reverse-ema_s{i}" for i in range(3)]
    client = MlflowClient(mlflow_url)
    found = client.search_runs([client.get_experiment_by_name("sweep3").experiment_id])
    assert sorted(r.info.run_name for r in found) == [p.name for p in runs]
    ids = set()
    for run in runs:
        cfg = OmegaConf.load(run / "config.yaml")
        rec = read_record(run)
        want = record_of(run)
        config = {k: str(v) for k, v in flatten(OmegaConf.to_container(cfg, resolve=True)).items()
                  if not k.startswith("logger.")}
        # MLflow: its own run, finished, the whole config, the sweep as group, its tags, every row once
        r = client.get_run(rec["mlflow"]["run_id"])
        assert r.info.run_name == run.name and r.info.status == "FINISHED"
        assert {k: v for k, v in r.data.params.items() if not k.startswith("run.")} == config
        assert r.data.tags["ema_pg.group"] == "sweep" and r.data.tags["seed"] == str(cfg.seed)
        assert r.data.tags["fig6"] == "true" and r.data.tags["method"] == "topk_reverse+ema"
        assert mlflow_held(client, r.info.run_id) == as_mlflow(want)
        # wandb: its own run id and files, finished, its identity, every row once
        files = wandb_files(run, rec["wandb"]["id"])
        ids.add(rec["wandb"]["id"])
        settled(files[0])
        kinds = [x.WhichOneof("record_type") for x in wandb_records(files[0])]
        assert len(files) == 1 and kinds.count("run") == 1 and kinds.count("exit") == 1
        wr = next(x.run for x in wandb_records(files[0]) if x.WhichOneof("record_type") == "run")
        assert (wr.display_name, wr.run_group, wr.project) == (run.name, "sweep", "sweep3")  # relative to the cwd
        assert list(wr.tags) == ["topk_reverse+ema", f"seed={cfg.seed}", "task=toy_add", "fig6"]
        assert {u.key for u in wr.config.update} >= set(config)
        assert wandb_metrics(run) == want
        # TensorBoard: one folder per run, every row, the config
        assert tensorboard_held(run / "tb")[0] == want
        assert OmegaConf.load(run / "tb" / "hparams.yaml")["seed"] == cfg.seed
    assert len(ids) == 3


def test_a_run_killed_with_9_and_resumed_is_one_run_in_each_tracker_with_every_iteration_once(tmp_path, mlflow_url):
    """kill -9 a few iterations past a checkpoint (the rows since are in no tracker's files yet, or in wandb's
    buffer), then ``resume=RUN`` adding MLflow: wandb and TensorBoard continue their run, MLflow gets the whole
    record, and each holds every (iteration, metric) of metrics.csv exactly once."""
    from mlflow import MlflowClient

    run = tmp_path / "run"
    first = train_cmd("algo.iterations=200", "algo.eval_every=16", f"run_dir={run}", f"sft.cache_dir={tmp_path / 'c'}",
                      "logger=[wandb,tensorboard]", "logger.project=killed")
    proc = subprocess.Popen(first, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    wait_while_alive(proc, lambda: (run / "checkpoints" / "iter32.ckpt").exists(), timeout=300, every=0.02)
    time.sleep(0.4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wandb_id = read_record(run)["wandb"]["id"]
    out = subprocess.run([sys.executable, "-m", "ema_pg.train", f"resume={run}", "logger=[wandb,mlflow,tensorboard]",
                          f"logger.mlflow_uri={mlflow_url}", "logger.project=killed"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env=env())
    assert out.returncode == 0, out.stderr[-3000:]
    want = record_of(run)
    assert {s for s, _ in want} == set(range(201))
    rec = read_record(run)
    assert rec["wandb"]["id"] == wandb_id and len(wandb_files(run, wandb_id)) == 2  # one run, two processes
    assert unlike(wandb_metrics(run), want) == ([], [])
    held, _ = tensorboard_held(run / "tb")
    assert unlike(held, want) == ([], []) and not any((run / "tb").glob("version_*"))
    client = MlflowClient(mlflow_url)
    found = client.search_runs([client.get_experiment_by_name("killed").experiment_id])
    assert [r.info.run_id for r in found] == [rec["mlflow"]["run_id"]]
    assert unlike(mlflow_held(client, rec["mlflow"]["run_id"]), as_mlflow(want)) == ([], [])


def test_an_mlflow_server_gone_mid_run_costs_the_run_nothing_and_track_import_fills_the_gap(tmp_path):
    """The server is stopped once it holds the rows of the run's first checkpoint: the run finishes (exit 0) with
    metrics.csv whole and one line naming the tracker; a server started again on the same store and port takes the
    rest from ``track import``."""
    from mlflow import MlflowClient

    run, store = tmp_path / "run", tmp_path / "store"
    with mlflow_server(store) as url:
        proc = subprocess.Popen(train_cmd("algo.iterations=60", "algo.eval_every=4", f"run_dir={run}",
                                          f"sft.cache_dir={tmp_path / 'c'}", "logger=mlflow", f"logger.mlflow_uri={url}"),
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        client = MlflowClient(url)
        # stopped once the server holds the rows of the first checkpoint (sent just after it is written)
        wait_while_alive(proc, lambda: (run / "checkpoints" / "iter4.ckpt").exists() and "mlflow" in read_record(run)
                         and sum(mlflow_held(client, read_record(run)["mlflow"]["run_id"]).values()) > 0,
                         timeout=300, every=0.05)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    said = [line for line in (stdout + stderr).splitlines() if "tracker mlflow" in line]
    assert len(said) == 1 and "set aside for the rest of this run" in said[0] and f"track import {run}" in said[0]
    assert json.loads((run / "eval.json").read_text())["iteration"] == 60
    want = record_of(run)
    assert {s for s, _ in want} == set(range(61))
    with mlflow_server(store, port=int(url.rsplit(":", 1)[1])) as url2:
        assert url2 == url
        run_id = read_record(run)["mlflow"]["run_id"]
        assert 0 < sum(mlflow_held(client, run_id).values()) < sum(want.values())
        out = subprocess.run([sys.executable, "-m", "ema_pg", "track", "import", str(run)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300, env=env())
        assert out.returncode == 0, out.stderr[-2000:]
        assert mlflow_held(client, run_id) == as_mlflow(want)
        assert client.get_run(run_id).info.status == "FINISHED"


def test_mlflow_on_a_postgresql_server_store_holds_a_run_as_on_sqlite(tmp_path):
    """The tracking server's store on PostgreSQL (Debian's server, started by the test as the Optuna tests start it):
    a run's rows, config and summary read back through the server's REST client."""
    from helpers import postgres_server
    from mlflow import MlflowClient

    run = tmp_path / "run"
    with postgres_server() as db, mlflow_server(tmp_path / "store", backend=db) as url:
        out = subprocess.run(train_cmd("algo.iterations=4", "algo.eval_every=2", f"run_dir={run}",
                                       f"sft.cache_dir={tmp_path / 'c'}", "logger=mlflow", f"logger.mlflow_uri={url}"),
                             cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env())
        assert out.returncode == 0, out.stderr[-3000:]
        client = MlflowClient(url)
        r = client.get_run(read_record(run)["mlflow"]["run_id"])
        assert r.info.run_name == "run" and r.info.status == "FINISHED"
        assert mlflow_held(client, r.info.run_id) == as_mlflow(record_of(run))
        assert r.data.params["algo.iterations"] == "4" and "final/avg" in r.data.metrics
