"""The trackers (wandb, MLflow, TensorBoard) against their real packages: wandb's transaction log read back as wandb
wrote it, each row sent once, a run's identity and record in each tracker, ``track import`` and the ``runs`` listing.
The sweep, kill -9, decide, hpo and server-failure cases run end to end in test_tracking_e2e.py (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import compose_cfg
from omegaconf import OmegaConf

from ema_pg.config import ConfigError, compose, flatten
from ema_pg.engine.install import trackers_of
from ema_pg.engine.tracking import (masked, missing, read_record, run_rows, wandb_files, wandb_history,
                                    wandb_present, wandb_records)

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- reading back what each tracker holds
def mlflow_held(client, run_id: str) -> Counter:
    """(step, key) -> how many values an MLflow run holds, through its client (REST against a server)."""
    held = Counter()
    for k in client.get_run(run_id).data.metrics:
        held.update((m.step, k) for m in client.get_metric_history(run_id, k))
    return held


def tensorboard_held(folder: Path) -> tuple[Counter, object]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    held = Counter()
    for tag in acc.Tags()["scalars"]:
        held.update((e.step, tag) for e in acc.Scalars(tag))
    return held, acc


def record_of(run: Path) -> Counter:
    """What a run folder's trackers must hold: every (iteration, metric) of metrics.csv and of its summary row."""
    return Counter((s, k) for s, row in run_rows(run) for k in row)


def unlike(got: Counter, want: Counter) -> tuple[list, list]:
    """What ``got`` holds beyond ``want`` and what it lacks, sorted: ([], []) when they are alike, and otherwise the
    few (step, key) pairs that differ, where a whole Counter's repr would hide them among 3,000 alike."""
    return sorted((got - want).items()), sorted((want - got).items())


def as_mlflow(c: Counter) -> Counter:
    return Counter({(s, k.replace("@", "_at_")): n for (s, k), n in c.items()})


def wandb_metrics(run: Path) -> Counter:
    """What a run's wandb files hold of its metrics (the media rows' own keys left out)."""
    files = wandb_files(run, read_record(run)["wandb"]["id"])
    settled(files[-1])  # the last process's file (a killed one before it has no exit record)
    held = wandb_present(files)
    return Counter({k: n for k, n in held.items() if not k[1].startswith(("curves", "samples"))})


# ---------------------------------------------------------------------- units
def test_the_wandb_reader_reads_back_what_wandb_wrote_and_stops_at_a_torn_tail(tmp_path, monkeypatch):
    """wandb (the real package, offline) writes 60 rows of ~2 KB: records cross the 32 KiB blocks of its log. Every
    row reads back with its values; a copy cut in the middle of a record (a killed writer) reads to the last whole
    record, without an error."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="t", dir=str(tmp_path), mode="offline", id="readback1",
                     settings=wandb.Settings(x_disable_stats=True, console="off"))
    for i in range(60):
        run.log({"trainer/global_step": i, "train/x": i * 0.5, **{f"pad/{j}": float(j) for j in range(60)}})
    run.finish()
    files = wandb_files(tmp_path, "readback1")
    settled(files[0])
    assert len(files) == 1 and files[0].stat().st_size >= 3 * 32768
    rows = wandb_history(files)
    assert [r["trainer/global_step"] for r in rows] == list(range(60))
    assert [r["train/x"] for r in rows] == [i * 0.5 for i in range(60)] and rows[7]["pad/59"] == 59.0
    kinds = Counter(r.WhichOneof("record_type") for r in wandb_records(files[0]))
    assert kinds["run"] == 1 and kinds["exit"] == 1
    cut = tmp_path / "cut" / "wandb" / "offline-run-x-readback1"
    cut.mkdir(parents=True)
    data = files[0].read_bytes()
    (cut / "run-readback1.wandb").write_bytes(data[: len(data) // 3 + 11])
    part = wandb_history(wandb_files(tmp_path / "cut", "readback1"))
    assert 0 < len(part) < 60 and [r["trainer/global_step"] for r in part] == list(range(len(part)))
    # a killed run's service still holding its file, silent for 3 s before its last rows land: read after it is done
    # (waiting for 2 s of silence read the file early: a resume would have sent those rows again)
    rest = tmp_path / "rest"
    rest.write_bytes(data[len(data) // 3 + 11:])
    late = subprocess.Popen([sys.executable, "-c", "import sys, time, shutil\n"
                             f"f = open({str(cut / 'run-readback1.wandb')!r}, 'ab'); print('open', flush=True)\n"
                             f"time.sleep(3); f.write(open({str(rest)!r}, 'rb').read()); f.close()"],
                            stdout=subprocess.PIPE, text=True)
    assert late.stdout.readline().strip() == "open"
    assert wandb_present(wandb_files(tmp_path / "cut", "readback1")) == \
        Counter((i, k) for i in range(60) for k in ["train/x", *(f"pad/{j}" for j in range(60))])
    assert late.wait(timeout=30) == 0
    (tmp_path / "other.wandb").write_bytes(b"PK\x03\x04 not a log")
    with pytest.raises(ValueError, match="not a wandb transaction log"):
        list(wandb_records(tmp_path / "other.wandb"))


def settled(f: Path, timeout: float = 60) -> None:
    """Wait until wandb's service process has written the run's last record: ``finish()`` can return while it still
    holds the last, partial block (seen under load: the file at 3 whole blocks, 46 of 60 rows). A run's trackers read
    a file whose writer has ended (a resume, a re-run, an import), never one still being written."""
    import time

    deadline = time.time() + timeout
    while not any(x.WhichOneof("record_type") == "exit" for x in wandb_records(f)):
        assert time.time() < deadline, f"{f}: no exit record after {timeout} s"
        time.sleep(0.2)


def test_missing_sends_each_value_once_against_what_a_tracker_holds():
    """Worked by hand: a step logged twice with one key (train then eval rows both carry time/elapsed_s) needs two
    values; a tracker holding one of them and none of step 2 lacks the second value and step 2 whole."""
    rows = [(1, {"train/kl": 0.1, "time/elapsed_s": 3.0}), (1, {"eval/avg/em": 0.5, "time/elapsed_s": 3.5}),
            (2, {"train/kl": 0.2, "time/elapsed_s": 4.0})]
    held = Counter({(1, "train/kl"): 1, (1, "time/elapsed_s"): 1, (1, "eval/avg/em"): 1})
    assert missing(rows, held) == [(1, {"time/elapsed_s": 3.5}), (2, {"train/kl": 0.2, "time/elapsed_s": 4.0})]
    assert missing(rows, Counter(held) + Counter({(1, "time/elapsed_s"): 1, (2, "train/kl"): 1,
                                                   (2, "time/elapsed_s"): 1})) == []
    assert missing(rows, Counter()) == rows


def test_two_runs_that_start_together_share_one_experiment(tmp_path):
    """A plan's or a sweep's parallel jobs both ask for the project's experiment before either created it: the store
    refuses the second creation, and that run takes the first's experiment (it used to be set aside, its run lost).
    The interleaving is forced: the other job creates the experiment just after this one found none."""
    from mlflow import MlflowClient

    from ema_pg.engine.tracking import experiment_id

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    other = MlflowClient(uri)

    class Late(MlflowClient):  # the real store; only the moment the other job creates the experiment is chosen
        def get_experiment_by_name(self, name):
            found = super().get_experiment_by_name(name)
            if found is None and not other.get_experiment_by_name(name):
                self.theirs = other.create_experiment(name)
            return found

    late = Late(uri)
    assert experiment_id(late, "plan_t", uri) == late.theirs
    assert [e.name for e in other.search_experiments()] == ["plan_t", "Default"]
    assert experiment_id(late, "plan_t", uri) == late.theirs  # found at once the next time


def test_a_password_in_a_url_is_masked():
    assert masked("postgresql+psycopg2://postgres:secret@db:5432/x") == "postgresql+psycopg2://postgres:***@db:5432/x"
    assert masked("http://user:tok3n@host:5000") == "http://user:***@host:5000"
    assert masked("http://127.0.0.1:5000") == "http://127.0.0.1:5000" and masked("sqlite:////a/b.db") == "sqlite:////a/b.db"


def test_the_logger_group_takes_a_list_and_refuses_what_it_cannot_take():
    assert trackers_of(compose(["logger=[wandb,mlflow]"]).logger) == ["wandb", "mlflow"]
    assert trackers_of(compose(["logger=[csv,tensorboard]"]).logger) == ["tensorboard"]
    assert trackers_of(compose([]).logger) == []
    out = subprocess.run([sys.executable, "-m", "ema_pg.train", "logger=[wandb,foo]"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        "config error: logger=foo: no such option; choose one of: csv, mlflow, tensorboard, wandb")
    from ema_pg.config import validate

    with pytest.raises(ConfigError, match="logger.job_type='sweep'; choose one of: train, cell"):
        validate(compose_cfg(["logger.job_type=sweep"]))


def test_a_config_saved_when_logger_name_chose_the_tracker_reads_as_the_tracker_switched_on():
    from ema_pg.engine.runs import upgraded

    saved = compose_cfg([], Path("/tmp/unused"))
    old = OmegaConf.create(OmegaConf.to_container(saved, resolve=True))
    old.logger = {"name": "wandb", "project": "p", "offline": True}
    up = upgraded(old)
    assert trackers_of(up.logger) == ["wandb"] and up.logger.project == "p"


# ---------------------------------------------------------------------- a run in the trackers (in process, local)
@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, monkeypatch_module):
    """A tiny run (4 iterations, evaluations at 0, 2, 4) reporting to all three trackers, MLflow on a local SQLite
    store: the run folder and the store's URI."""
    from ema_pg.engine.fit import train

    tmp = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    cfg = compose_cfg(["logger=[wandb,mlflow,tensorboard]", f"logger.mlflow_uri={uri}", "logger.tags=[ablation]",
                       "logger.samples=2", "logger.checkpoints=true", "algo.iterations=4", "algo.eval_every=2"], tmp)
    train(cfg)
    return Path(cfg.run_dir), uri


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_a_run_is_one_run_in_each_tracker_with_its_identity_config_record_and_media(tracked_run):
    from mlflow import MlflowClient

    run, uri = tracked_run
    cfg = OmegaConf.load(run / "config.yaml")
    record = record_of(run)
    rec = read_record(run)
    assert sorted(rec) == ["media_sent", "mlflow", "tensorboard", "wandb"]
    # MLflow: one run, named by the folder, its group and job type, tags, the whole config, every row, the media
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("ema-pg").experiment_id])
    assert [r.info.run_id for r in runs] == [rec["mlflow"]["run_id"]]
    r = runs[0]
    assert r.info.run_name == run.name and r.info.status == "FINISHED"
    assert r.data.tags["ema_pg.group"] == cfg.name and r.data.tags["ema_pg.job_type"] == "train"
    assert r.data.tags["method"] == "topk_reverse+ema" and r.data.tags["seed"] == "0" and r.data.tags["ablation"] == "true"
    want = {k: str(v) for k, v in flatten(OmegaConf.to_container(cfg, resolve=True)).items() if not k.startswith("logger.")}
    assert {k: v for k, v in r.data.params.items() if not k.startswith("run.")} == want
    assert r.data.params["run.commit"] == (run / "git.txt").read_text().strip()
    assert r.data.params["run.machine"] == (run / "machine.txt").read_text().strip()
    assert len(r.data.params["run.base"]) == 16 and r.data.params["run.task"] == "toy_add"
    assert mlflow_held(client, r.info.run_id) == as_mlflow(record)
    final = json.loads((run / "eval.json").read_text())
    assert r.data.metrics["final/avg"] == pytest.approx(final["avg"]) and r.data.metrics["base/avg"] == pytest.approx(
        final["base_avg"])
    arts = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert {"curves.png", "eval.json", "samples"} <= arts
    assert sorted(a.path for a in client.list_artifacts(r.info.run_id, "samples")) == [
        f"samples/iter_00000{i}.json" for i in (0, 2, 4)]
    assert sorted(a.path for a in client.list_artifacts(r.info.run_id, "checkpoint")) == [
        "checkpoint/iter2.ckpt", "checkpoint/iter4.ckpt"]  # logger.checkpoints: each period's
    # wandb: one run (one id, one offline folder), its config and identity, every row once, the summary
    files = wandb_files(run, rec["wandb"]["id"])
    settled(files[-1])
    assert len(files) == 1 and wandb_metrics(run) == record
    recs = [x for x in wandb_records(files[0]) if x.WhichOneof("record_type") == "run"]
    wr = recs[0].run
    assert wr.display_name == run.name and wr.run_group == cfg.name and wr.job_type == "train"
    assert list(wr.tags) == ["topk_reverse+ema", "seed=0", "task=toy_add", "ablation"]
    conf = {u.key: json.loads(u.value_json) for x in wandb_records(files[0]) if x.WhichOneof("record_type") == "config"
            for u in x.config.update} | {u.key: json.loads(u.value_json) for u in wr.config.update}
    assert conf["algo.beta"] == cfg.algo.beta and conf["run.task"] == "toy_add"
    summary = {}
    for x in wandb_records(files[0]):
        if x.WhichOneof("record_type") == "summary":
            summary.update({u.key: json.loads(u.value_json) for u in x.summary.update})
    assert summary["final/avg"] == pytest.approx(final["avg"])
    # TensorBoard: one folder, every row, the hyperparameters
    held, acc = tensorboard_held(run / "tb")
    assert held == record and not any((run / "tb").glob("version_*"))
    assert OmegaConf.load(run / "tb" / "hparams.yaml")["algo.beta"] == cfg.algo.beta
    assert "curves" in acc.Tags()["images"]


def test_track_import_sends_a_folder_once_and_runs_lists_filters_and_diffs(tracked_run, finished_run, tmp_path,
                                                                           capsys):
    """A finished run that reported to no tracker, imported into MLflow (a new local store) and TensorBoard: every
    row and its summary; a second import sends nothing. ``runs`` lists the folders with what they differ in."""
    from mlflow import MlflowClient

    from ema_pg.workbench.tracking import runs_main, track_main

    root = tmp_path / "sweep"
    for seed in (0, 1):
        shutil.copytree(finished_run, root / f"s{seed}", ignore=shutil.ignore_patterns("checkpoints", "model"))
        cfg = OmegaConf.load(root / f"s{seed}" / "config.yaml")
        cfg.seed = seed
        (root / f"s{seed}" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    uri = f"sqlite:///{tmp_path / 'import.db'}"
    assert track_main(["import", str(root), "--logger", "mlflow,tensorboard", "--mlflow-uri", uri]) == 0
    out = capsys.readouterr().out
    n = len(run_rows(root / "s0"))
    assert f"2 run folders: mlflow was sent {2 * n} rows; tensorboard was sent {2 * n} rows" in out
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("ema-pg").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["s0", "s1"]
    for r in runs:
        folder = root / r.info.run_name
        assert mlflow_held(client, r.info.run_id) == as_mlflow(record_of(folder))
        assert {a.path for a in client.list_artifacts(r.info.run_id)} >= {"curves.png", "eval.json"}
        assert tensorboard_held(folder / "tb")[0] == record_of(folder)
    assert track_main(["import", str(root), "--logger", "mlflow,tensorboard", "--mlflow-uri", uri]) == 0
    assert "mlflow was sent 0 rows; tensorboard was sent 0 rows" in capsys.readouterr().out
    assert len(client.search_runs([client.get_experiment_by_name("ema-pg").experiment_id])) == 2
    with pytest.raises(SystemExit, match="'neptune' is not a tracker; choose from wandb, mlflow, tensorboard"):
        track_main(["import", str(root), "--logger", "neptune"])
    # the listing: the key the runs differ in, their scores; a filter; a diff; a misspelt key
    assert runs_main([str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"2 runs under {root}; they differ in: seed")
    lines = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()[3:]}
    assert lines == {"s0": "0", "s1": "1"}  # run, then seed
    assert runs_main([str(root), "--where", "seed=1"]) == 0
    out = capsys.readouterr().out
    assert "1 runs under" in out and "s1" in out and "s0 " not in out
    assert runs_main(["--diff", str(root / "s0"), str(root / "s1")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 settings differ") and "| seed  |" in out
    with pytest.raises(SystemExit, match="no run has the key 'sed'; did you mean seed"):
        runs_main([str(root), "--where", "sed=1"])


def test_an_exported_model_is_kept_with_the_run_naming_its_run_and_base(tracked_run, tmp_path, capsys):
    from mlflow import MlflowClient

    from ema_pg.workbench.export import main as export_main

    run, uri = tracked_run
    export_main([str(run), str(tmp_path / "hf")])
    assert "kept as a model artifact of the run in wandb, mlflow" in capsys.readouterr().out
    client = MlflowClient(uri)
    run_id = read_record(run)["mlflow"]["run_id"]
    files = {a.path for a in client.list_artifacts(run_id, f"model/{run.name}-hf")}
    assert f"model/{run.name}-hf/config.json" in files
    meta = json.loads(client.get_run(run_id).data.tags[f"model.{run.name}-hf"])
    assert meta["run"] == str(run.resolve()) and meta["base"] == client.get_run(run_id).data.params["run.base"]
    assert meta["iteration"] == 4 and client.get_run(run_id).info.status == "FINISHED"
    files = wandb_files(run, read_record(run)["wandb"]["id"])
    settled(files[-1])
    arts = [x.artifact for f in files for x in wandb_records(f)
            if x.WhichOneof("record_type") == "artifact"]
    model = [a for a in arts if a.type == "model"]
    assert len(model) == 1 and json.loads(model[0].metadata)["base"] == meta["base"]


def test_an_mlflow_server_out_of_reach_at_start_is_one_line_before_any_model_is_built(tmp_path):
    from ema_pg.engine.fit import train

    cfg = compose_cfg(["logger=mlflow", "logger.mlflow_uri=http://user:pw@127.0.0.1:1"], tmp_path)
    with pytest.raises(ConfigError) as e:
        train(cfg)
    line = str(e.value)
    assert line.startswith("logger.mlflow_uri=http://user:***@127.0.0.1:1: no MLflow server answers there")
    assert "unset logger.mlflow_uri" in line and "pw@" not in line and "\n" not in line
    assert not (tmp_path / "run" / "model").exists()  # no policy built or saved


def test_a_tracker_takes_rows_only_once_the_checkpoint_a_resume_takes_covers_them(tmp_path, monkeypatch):
    """Rows go to a tracker when the checkpoint a resume would take (``last.ckpt``, else the newest) holds their
    iteration: at every send of a 6-iteration run, checkpoints every 2. Sent when Lightning's save returns, before the
    link moves on, a kill there left wandb holding iterations the resume ran again (iteration 33 twice in CI)."""
    from ema_pg.engine import tracking
    from ema_pg.engine.fit import train
    from ema_pg.engine.policy import checkpoint_iteration

    cfg = compose_cfg(["logger=tensorboard", "algo.iterations=6", "algo.eval_every=2"], tmp_path)
    sends, send = [], tracking.Trackers.send

    def watched(self, rows):
        if rows:
            sends.append((max(s for s, _ in rows), checkpoint_iteration(cfg.run_dir)))
        send(self, rows)

    monkeypatch.setattr(tracking.Trackers, "send", watched)
    train(cfg)
    assert [s for s, _ in sends] == [2, 4, 6, 6]  # three periods' rows, then the summary row
    assert all(covered is not None and step <= covered for step, covered in sends), sends
