"""The run folder's lifecycle under faults: one writer per folder, resume that trusts only the checkpoint, exit codes
a scheduler can trust, SIGTERM, full disks, sweeps that survive their jobs. Each case failed on the code before
this file (the reliability issue's probe); the subprocess ones run the real command, as a user or a scheduler does.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict
from helpers import training_under_way, wait_while_alive
from test_faults import cli_tiny

from ema_pg.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PY = [sys.executable, "-m", "ema_pg.train"]


def _run(args, timeout=600, **kw):
    return subprocess.run(PY + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


# ---------------------------------------------------------------------- metrics.csv
def _csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_metrics_line_cut_mid_number_is_dropped_not_read_as_data(tmp_path, caplog):
    from ema_pg.engine.runs import metrics_rows

    whole = "step,train/kl_k1,eval/avg/em\n1,2.56387622243892e-08,\n2,,0.5\n3,2.56387622243892e-08,\n"
    cut = whole[: whole.rindex("e-08")]  # the kill landed inside the last number: "3,2.56387622243892"
    rows = metrics_rows(_csv(tmp_path / "metrics.csv", cut), upto=10)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/kl_k1"] == pytest.approx(2.56387622243892e-08) and rows[1]["eval/avg/em"] == 0.5
    assert "partial line" in caplog.text


def test_an_empty_or_damaged_metrics_file_is_recovered_not_fatal(tmp_path, caplog):
    from ema_pg.engine.runs import metrics_rows

    assert metrics_rows(_csv(tmp_path / "a.csv", ""), upto=5) == []
    assert metrics_rows(_csv(tmp_path / "b.csv", "step,x\n"), upto=5) == []
    assert metrics_rows(tmp_path / "missing.csv", upto=5) == []
    rows = metrics_rows(_csv(tmp_path / "c.csv", "step,x\n1,0.5\n2,0.5,9\n3,zz\n4,1.0\n9,2.0\n"), upto=5)
    assert [(r["step"], r["x"]) for r in rows] == [(1, 0.5), (4, 1.0)]  # damaged rows and rows past the checkpoint
    assert "2 damaged line(s)" in caplog.text


def test_a_resume_writes_the_rows_before_its_checkpoint_as_they_were(tmp_path):
    """The rows up to the checkpoint are carried into the resumed run's file: an integer-valued column was written
    back as 0.0 where the run had written 0 (same numbers, other bytes)."""
    from omegaconf import OmegaConf

    from ema_pg.engine.console import quiet_third_party
    from ema_pg.engine.tracking import make_loggers

    quiet_third_party()  # as a run's console is: Lightning's note on a resumed folder is expected
    rows = "eval/avg/em,step,train/kl_k1,train/skipped\n,1,2.56387622243892e-08,0\n0.5,2,0.125,3\n,3,0.25,0\n"  # as
    # Lightning's CSV logger writes them: columns sorted
    _csv(tmp_path / "metrics.csv", rows)
    csv = make_loggers(OmegaConf.create({"logger": {}}), tmp_path, resume_step=2)[0]
    csv.save()
    assert (tmp_path / "metrics.csv").read_text() == rows[: rows.index(",3,0.25")]


# ---------------------------------------------------------------------- one writer per run folder
HOLD = ("import sys, time; from pathlib import Path; from ema_pg.engine.owner import own_run_dir\n"
        "own_run_dir(Path(sys.argv[1])); print('holding', flush=True); time.sleep(600)")


def holder(run: Path) -> subprocess.Popen:
    """A real process that claims ``run`` (as a run does) and lives on holding it."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "holding"
    return p


def test_a_live_runs_folder_refuses_a_second_writer_and_a_killed_ones_is_free_at_once(tmp_path):
    """The claim is a lock the kernel drops when its process ends, however it ends: a SIGKILLed run's folder is free
    at once, even before its parent reaps it (a killed sweep worker re-queued by its launcher is not refused)."""
    from ema_pg.engine.owner import CLAIM, live_owner, own_run_dir, release_run_dir

    run = tmp_path / "run"
    p = holder(run)
    try:
        with pytest.raises(ConfigError, match=f"being written by a live run \\(process {p.pid} on"):
            own_run_dir(run)
        assert live_owner(run) == [socket.gethostname(), str(p.pid)]
        p.send_signal(signal.SIGKILL)
        t0 = time.time()
        while live_owner(run) is not None:  # the lock goes with the process (not yet reaped: no wait() here)
            assert time.time() - t0 < 10
            time.sleep(0.02)
        own_run_dir(run)
        assert (run / CLAIM).read_text() == f"{socket.gethostname()} {os.getpid()}"
        release_run_dir(run)
    finally:
        p.kill()
        p.wait()


def test_of_many_processes_reaching_for_a_dead_runs_folder_exactly_one_gets_it(tmp_path):
    """A scheduler's requeue and a person resuming at once, or more: every process tries at the same moment, one
    proceeds, the others are refused naming it. (The rename-based takeover let two win: each replaced the claim with
    its own and read its own back.)"""
    from helpers import race_for_folder

    from ema_pg.engine.owner import CLAIM

    run = tmp_path / "run"
    run.mkdir()
    (run / CLAIM).write_text(f"{socket.gethostname()} 999999999")  # a dead run's claim
    outs = race_for_folder(run, "own_run_dir(folder) or 'won'", 8, tmp_path)
    assert outs.count("won") == 1, outs
    assert all("being written by a live run" in o for o in outs if o != "won"), outs


def test_asking_who_writes_a_folder_imports_no_torch():
    """The race tests start many processes that ask only this, and ``evaluate`` asks it of a live run: it stays
    seconds cheaper than the run folder's lifecycle (which loads torch and the models)."""
    code = "import sys, ema_pg.engine.owner; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_resume_of_a_live_run_is_refused(finished_run):
    from ema_pg.engine.fit import train

    p = holder(finished_run)
    try:
        cfg = OmegaConf.load(finished_run / "config.yaml")
        with open_dict(cfg):
            cfg.resume, cfg.algo.iterations = str(finished_run), 6
        with pytest.raises(ConfigError, match="being written by a live run"):
            train(cfg)
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------------- resume trusts the checkpoint
def test_a_hand_edited_config_yaml_is_refused_on_resume(finished_run, tmp_path):
    import shutil

    from ema_pg.engine.fit import train

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.rollout.max_new_tokens, cfg.optim.lr = 2, 0.5  # what a hand edit of config.yaml does
    OmegaConf.save(cfg, run / "config.yaml")
    with open_dict(cfg):
        cfg.resume, cfg.run_dir, cfg.algo.iterations = str(run), str(run), 6
    with pytest.raises(ConfigError, match=r"trained with \(optim.lr, rollout.max_new_tokens\)"):
        train(cfg)


def test_the_checkpoint_carries_its_settings_and_only_resumable_ones_may_change(finished_run):
    from ema_pg.engine.policy import checkpoint_file, checkpoint_state
    from ema_pg.engine.runs import check_trained_with

    state = checkpoint_state(checkpoint_file(finished_run))
    cfg = OmegaConf.load(finished_run / "config.yaml")
    assert state["ema_pg"]["settings"]["optim.lr"] == cfg.optim.lr
    cfg.algo.iterations, cfg.trainer.progress_bar = 100, True  # resumable
    check_trained_with(state, cfg, Path("last.ckpt"))
    cfg.algo.beta = 0.5
    with pytest.raises(ConfigError, match=r"\(algo.beta\)"):
        check_trained_with(state, cfg, Path("last.ckpt"))


def test_resuming_with_fewer_iterations_than_done_is_refused(finished_run):
    from ema_pg.engine.fit import train

    cfg = OmegaConf.load(finished_run / "config.yaml")
    with open_dict(cfg):
        cfg.resume, cfg.algo.iterations = str(finished_run), 2
    with pytest.raises(ConfigError, match="is at iteration 4; algo.iterations=2 would undo"):
        train(cfg)


# ---------------------------------------------------------------------- records written whole
def _no_room_child(kind: str, folder: str, limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from ema_pg.engine import files

    target = Path(folder) / "record"
    try:
        if kind == "torch":
            files.atomic_torch_save({"w": torch.zeros(100_000)}, target)
        elif kind == "dir":
            with files.atomic_dir(target, needed=400_000) as tmp:
                (tmp / "weights.bin").write_bytes(b"\0" * 400_000)
        else:
            files.atomic_write(target, "x" * 400_000)
    except files.NoRoom as e:
        print(str(e))
        raise SystemExit(3) from None


@pytest.mark.parametrize("kind", ["torch", "dir", "text"])
def test_a_full_disk_is_one_line_naming_the_folder_and_leaves_the_old_record(tmp_path, kind):
    """A file-size limit (RLIMIT_FSIZE) is a disk that fills: the write fails with EFBIG like ENOSPC."""
    target = tmp_path / "record"
    if kind == "dir":
        target.mkdir()
        (target / "old.bin").write_bytes(b"old")
    else:
        target.write_bytes(b"old")
    code = f"import sys; sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(ROOT / 'tests' / 'faults')!r}]; from test_faults_lifecycle import _no_room_child; " \
           f"_no_room_child({kind!r}, {str(tmp_path)!r}, 100_000)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr[-2000:]
    assert f"no room to write record in {tmp_path}" in r.stdout and "MiB needed" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record"]  # no temporary file left beside it
    assert (target / "old.bin").read_bytes() == b"old" if kind == "dir" else target.read_bytes() == b"old"


def test_checkpoints_are_written_beside_their_destination_not_in_the_system_temp(tmp_path, monkeypatch):
    """Lightning's own writer puts the whole checkpoint in the system temp folder first (a small node-local /tmp
    killed runs whose disk had room); ours never touches it."""
    import tempfile

    from ema_pg.engine.files import atomic_checkpoint_io

    def no_tmp(*a, **k):
        raise OSError(28, "No space left on device (the system temp folder)")

    monkeypatch.setattr(tempfile, "mkstemp", no_tmp)
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", no_tmp)
    atomic_checkpoint_io().save_checkpoint({"w": torch.ones(3)}, tmp_path / "last.ckpt")
    assert torch.equal(torch.load(tmp_path / "last.ckpt")["w"], torch.ones(3))


# ---------------------------------------------------------------------- reproduce
def test_reproduce_writes_no_report_from_an_incomplete_sweep(tmp_path, capsys):
    from ema_pg.workbench.reproduce import main

    runs, out = tmp_path / "runs", tmp_path / "out"
    (runs / "0_a").mkdir(parents=True)
    (runs / "1_b").mkdir()
    for r in ("0_a", "1_b"):
        (runs / r / "config.yaml").write_text("seed: 0\n")
    (runs / "0_a" / "eval.json").write_text("{}")
    (runs / "1_b" / "failed.json").write_text(json.dumps({"kind": "diverged", "error": "NaN"}))
    (runs / "sweep.json").write_text(json.dumps({"jobs": [["a"], ["b"], ["c"]]}))
    assert main(["table2", "--scale", "smoke", "--analysis-only", "--runs", str(runs), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "2 of 3 runs of the sweep did not finish" in err and "1_b: failed (diverged)" in err and "<job 2?>" in err
    assert not out.exists()
    with pytest.raises(SystemExit, match="holds no runs"):
        main(["table2", "--analysis-only", "--runs", str(tmp_path / "nowhere")])


# ---------------------------------------------------------------------- subprocess: what a scheduler sees
def _steps(run: Path) -> list[int]:
    import csv

    return [int(float(r["step"])) for r in csv.DictReader(open(run / "metrics.csv"))]


@pytest.mark.slow
def test_a_sigterm_before_training_starts_ends_the_command_with_one_line_and_exit_75(tmp_path):
    """A SIGTERM that came before Lightning's handler was in place (here: in a cold start's SFT, minutes long at a
    real size) ended the command by the signal's default action: exit -15, no line, and a scheduler could not
    tell it from a crash. Now it is exit 75 and one line, no traceback, and the cache holds no half-built policy."""
    from ema_pg.engine.sft import LOCKS

    run, cache = tmp_path / "run", tmp_path / "cache"
    p = subprocess.Popen(PY + cli_tiny(tmp_path) + ["sft.steps=100000", f"run_dir={run}", f"hydra.run.dir={run}"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_while_alive(p, lambda: list((cache / LOCKS).glob("*.lock")))  # held while the base policy is built: in SFT
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 75, out[-2000:]
    assert ("stopped by SIGTERM outside the training loop; it had written no checkpoint: the same command starts it "
            "again") in out
    assert "Traceback" not in out
    assert [f.name for f in cache.iterdir()] == [LOCKS]  # no base policy, whole or in part


@pytest.mark.slow
def test_sigterm_saves_the_iteration_exits_75_and_the_resume_repeats_the_uninterrupted_run(tmp_path):
    """SIGTERM inside an evaluation period (a scheduler's preemption): the run used to finish the period and exit 0
    with no checkpoint. Now it saves that iteration, exits 75, and the same command ends where an uninterrupted run
    does: weights bit for bit, the same metrics rows (no evaluation at the interruption)."""
    from ema_pg.engine.policy import checkpoint_iteration, load_run_model

    args = cli_tiny(tmp_path) + ["algo.iterations=200", "algo.eval_every=100", "if_exists=resume"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert _run(args + [f"run_dir={ref}", f"hydra.run.dir={ref}"]).returncode == 0
    p = subprocess.Popen(PY + args + [f"run_dir={run}", f"hydra.run.dir={run}"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    wait_while_alive(p, lambda: training_under_way(run))
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 75, out[-2000:]
    it = checkpoint_iteration(run)
    assert 0 < it < 200 and it % 100 and not (run / "eval.json").exists()  # inside an evaluation period
    assert f"stopped by SIGTERM after iteration {it} of 200; it resumes from its checkpoint of iteration {it}" in out
    again = _run(args + [f"run_dir={run}", f"hydra.run.dir={run}"])
    assert again.returncode == 0, again.stderr[-2000:]
    for which in ("policy", "anchor"):
        a, b = load_run_model(ref, which=which)[0].state_dict(), load_run_model(run, which=which)[0].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), which
    assert _steps(run) == _steps(ref)


@pytest.mark.slow
def test_two_writers_of_one_folder_the_second_refused_and_no_step_written_twice(tmp_path):
    args = cli_tiny(tmp_path) + ["algo.eval_every=100"]
    run = tmp_path / "run"
    assert _run(args + ["algo.iterations=2", f"run_dir={run}", f"hydra.run.dir={run}"]).returncode == 0
    first = subprocess.Popen(PY + [f"resume={run}", "algo.iterations=400", f"hydra.run.dir={tmp_path / 'h1'}"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_while_alive(first, lambda: "resuming" in (run / "train.log").read_text())
    second = _run([f"resume={run}", "algo.iterations=400", f"hydra.run.dir={tmp_path / 'h2'}"])
    first.wait(600)
    assert second.returncode == 1 and f"process {first.pid} on" in second.stderr, second.stderr[-2000:]
    assert first.returncode == 0
    steps = _steps(run)
    train_steps = [s for s in steps if s > 0]
    assert len(steps) == len(set(steps)) + 5  # evaluations share their step with the iteration: 0, 2, 100..400
    assert sorted(set(train_steps)) == list(range(1, 401))


@pytest.mark.slow
def test_a_disk_that_fills_at_the_first_checkpoint_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
    """The first checkpoint (policy, anchor master, Adam's moments) is several times the initial model, so a file
    limit between the two lets the run start and stops it at the checkpoint."""
    args = cli_tiny(tmp_path) + ["algo.iterations=2", "algo.eval_every=1"]
    assert _run(args + [f"run_dir={tmp_path / 'warm'}", f"hydra.run.dir={tmp_path / 'warm'}"]).returncode == 0
    model = (tmp_path / "warm" / "model" / "model.safetensors").stat().st_size
    ckpt = (tmp_path / "warm" / "checkpoints" / "last.ckpt").stat().st_size
    assert 2 * model < ckpt

    def limited(limit):
        return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = tmp_path / "run"
    r = _run(args + [f"run_dir={run}", f"hydra.run.dir={run}"], preexec_fn=limited((model + ckpt) // 2))
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: no room to write ") and f"in {run / 'checkpoints'}" in last, last
    assert "Traceback" not in r.stderr
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".") or p.stat().st_size < ckpt // 2]
    assert json.loads((run / "failed.json").read_text())["kind"] == "disk"
    small = tmp_path / "small"
    r = _run(args + [f"run_dir={small}", f"hydra.run.dir={small}"], preexec_fn=limited(model // 2))
    assert r.returncode == 1 and "no room to write model in" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert not (small / "model").exists() and not [p for p in small.iterdir() if p.name.startswith(".model")]


@pytest.mark.slow
def test_a_sweep_checks_every_job_first_and_survives_a_job_that_fails_at_run_time(tmp_path):
    base = cli_tiny(tmp_path) + ["algo.iterations=2", "algo.eval_every=1", "if_exists=resume"]
    bad = _run(["-m", *base, "anchor.eta=0.9,1.5,0.95", f"hydra.sweep.dir={tmp_path / 'bad'}"])
    assert bad.returncode == 1
    assert "config error in job 1 of 3 (anchor.eta=1.5): anchor.eta must be in [0, 1]" in bad.stderr
    assert "no job has run" in bad.stderr and not (tmp_path / "bad").exists()
    sweep = tmp_path / "sweep"
    # float16 weights diverge at the first update (a documented failure): job 0 fails, job 1 must still run
    r = _run(["-m", *base, "model.dtype=float16,float32", f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 1 and "sweep: 1 of 2 jobs finished" in r.stderr, r.stderr[-3000:]
    failed, ok = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert json.loads((failed / "failed.json").read_text())["kind"] == "diverged"
    assert (ok / "eval.json").is_file()
    again = _run(["-m", *base, "model.dtype=float16,float32", f"hydra.sweep.dir={sweep}"])
    assert again.returncode == 1 and "failed earlier" in again.stdout + again.stderr  # it would diverge again
    # a refusal known only once a job's model is built (its context) is recorded too, and the sweep goes on
    ctx = tmp_path / "ctx"
    r = _run(["-m", *base, "rollout.max_new_tokens=600,4", f"hydra.sweep.dir={ctx}"])
    assert r.returncode == 1 and "sweep: 1 of 2 jobs finished" in r.stderr and "context is 512 tokens" in r.stderr
    assert [json.loads(f.read_text())["kind"] for f in ctx.glob("*/failed.json")] == ["config"]
    # several multiruns may fill one sweep folder a cell each (the reproductions do): each judges its own jobs,
    # not another one's that is still running there
    shared = tmp_path / "shared"
    (shared / "other_cell_s9").mkdir(parents=True)
    (shared / "other_cell_s9" / "config.yaml").write_text("seed: 9\n")  # another multirun's job, under way
    r = _run(["-m", *base, "seed=0", f"hydra.sweep.dir={shared}"])
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_a_refused_run_leaves_no_folder_and_the_console_has_no_third_party_noise(tmp_path):
    out = tmp_path / "refused"
    r = _run(cli_tiny(tmp_path) + ["model.num_heads=3", f"hydra.run.dir={out}"])
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("config error: model.hidden_size=32")
    assert not out.exists()
    run = tmp_path / "run"
    r = _run(cli_tiny(tmp_path) + ["algo.iterations=4", "trainer.progress_bar=true", f"run_dir={run}",
                                   f"hydra.run.dir={run}"])
    assert r.returncode == 0, r.stderr[-2000:]
    console = r.stdout + r.stderr
    for noise in ("Tip:", "LeafSpec", "eval mode", "FutureWarning", "Warning:", "Setting accelerator", "Epoch",
                  "GPU available", "Writing model shards", "Loading weights"):
        assert noise not in console, noise
    assert "RL iterations" in console and "4/4" in console and "run: tiny cold-start policy" in console
    # evaluate builds a cold start of its own (another seed: a fresh cache entry) just as quietly
    r = subprocess.run([sys.executable, "-m", "ema_pg.evaluate", "base", *cli_tiny(tmp_path), "seed=5",
                        "--out", str(tmp_path / "base.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    console = r.stdout + r.stderr
    for noise in ("Warning:", "WARNING", "Setting accelerator", "Writing model shards", "Loading weights"):
        assert noise not in console, noise
    assert "| em |" in console


@pytest.mark.slow
def test_a_sigtermed_sweep_exits_75_and_the_same_command_finishes_it(tmp_path):
    """A SIGTERM to a multirun used to skip its remaining jobs and exit 0 (and reproduce then wrote a report from
    the runs that were there)."""
    from ema_pg.engine.sweeps import sweep_state

    args = ["-m", *cli_tiny(tmp_path), "algo.iterations=150", "algo.eval_every=75", "if_exists=resume", "seed=0,1",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    p = subprocess.Popen(PY + args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_while_alive(p, lambda: any(training_under_way(j) for j in (tmp_path / "sweep").glob("0_*")))  # job 0 trains
    p.send_signal(signal.SIGTERM)
    assert p.wait(300) == 75
    finished, failed, unfinished = sweep_state(tmp_path / "sweep")
    assert not finished and not failed and len(unfinished) == 2  # job 0 interrupted, job 1 never started
    again = _run(args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(sweep_state(tmp_path / "sweep")[0]) == 2
