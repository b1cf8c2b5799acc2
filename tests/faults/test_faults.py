"""Faults a demanding user runs into: each case fails on the code before the reliability work.

Non-finite updates are skipped and counted, never applied; bad knobs stop at start with one line
naming the knob; two runs never share a folder; a corrupted last checkpoint falls back to an
intact one; Optuna never runs a finished point again; bad data rows are named by their index.
"""

import copy
import math
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import compose_cfg

from ema_pg.config import ConfigError, validate
from ema_pg.update import NonFiniteUpdates, TorchUpdater


def cli_tiny(tmp_path) -> list[str]:
    """helpers.TINY for a command line (no kl.k: the defaults' estimator takes it from its registry)."""
    from helpers import TINY

    keep = [o for o in TINY if not o.startswith(("algo.iterations", "kl.k"))]
    return keep + ["task.eval_size=16", f"sft.cache_dir={tmp_path / 'cache'}"]


# ---------------------------------------------------------------------- the numerical guard
def _model_and_updater(limit=3):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    up = TorchUpdater(m.parameters(), opt, grad_clip=1.0, max_bad_steps=limit)
    x = torch.randn(8, 4)
    up.step(m(x).pow(2).mean())  # one good update: the optimizer has state
    return m, opt, up, x


def _snapshot(m, opt):
    return copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())


def _same(a, b):
    (pa, oa), (pb, ob) = a, b
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    for sa, sb in zip(oa["state"].values(), ob["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k] for k in sa)


@pytest.mark.parametrize("poison", ["nan_loss", "inf_gradient"])
def test_a_non_finite_update_is_skipped_and_leaves_weights_and_optimizer_bit_identical(poison):
    m, opt, up, x = _model_and_updater()
    before = _snapshot(m, opt)
    if poison == "nan_loss":
        loss = m(x).mean() * float("nan")
    else:  # a finite loss whose gradient norm overflows (sqrt(2) * 3e38 > float32's max)
        loss = (m.weight[0, 0] + m.weight[0, 1]) * 3e38
        assert torch.isfinite(loss)
    out = up.step(loss)
    assert out["skipped_steps"] == 1.0
    _same(before, _snapshot(m, opt))
    ok = up.step(m(x).pow(2).mean())  # a good update goes through and resets the count
    assert ok["skipped_steps"] == 0.0 and up.guard.consecutive == 0


def test_consecutive_non_finite_updates_stop_with_a_message():
    m, opt, up, x = _model_and_updater(limit=2)
    up.step(m(x).mean() * float("inf"))
    with pytest.raises(NonFiniteUpdates, match="2 consecutive updates"):
        up.step(m(x).mean() * float("nan"))


def test_a_float16_run_stops_at_its_first_bad_update_and_saves_nothing_non_finite(tmp_path):
    """model.dtype=float16 (a documented option): Adam's eps underflows and the first update makes weights
    NaN. The run used to save NaN into the policy, the anchor and the checkpoint and exit 0."""
    from ema_pg.train import train

    cfg = compose_cfg(["model.dtype=float16", "algo.iterations=6"], tmp_path)
    with pytest.raises(NonFiniteUpdates, match="model.dtype=float16"):
        train(cfg)
    run = Path(cfg.run_dir)
    assert not (run / "checkpoints").exists() and not (run / "eval.json").exists()


# ---------------------------------------------------------------------- knobs checked at start
@pytest.mark.parametrize("overrides,match", [
    (["algo.beta=inf"], "algo.beta=inf is not a finite number"),
    (["optim.lr=nan"], "optim.lr=nan is not a finite number"),
    (["kl.iw_clip=[0.0,inf]"], "kl.iw_clip=.* is not a finite number"),
    (["algo.grad_clip=-1"], "algo.grad_clip must be >= 0"),
    (["algo.warmup_steps=-5"], "algo.warmup_steps must be >= 0"),
    (["rollout.eval_temperature=-1"], "rollout.eval_temperature must be >= 0"),
    (["monitor.every=-1"], "monitor.every must be >= 0"),
    (["anchor.eval_every=-1"], "anchor.eval_every must be >= 0"),
    (["seed=-1"], "seed must be >= 0"),
    (["optim.betas=[0.9]"], "optim.betas must be two numbers"),
    (["optim.weight_decay=-1"], "optim.weight_decay must be >= 0"),
    (["sft.batch_size=0"], "sft.batch_size must be >= 1"),
    (["algo.max_bad_steps=0"], "algo.max_bad_steps must be >= 1"),
    (["+anchor.etaa=0.9"], "unknown key anchor.etaa: did you mean anchor.eta"),
    (["+task.digitz=3"], "unknown key task.digitz: did you mean task.digits"),
    (["model=local"], "model=local needs model.path"),
    (["kl.k=400"], "larger than the vocabulary of the tiny model"),
    (["trainer=deepspeed", "model.compile=true"], "model.compile=true is not built under DeepSpeed"),
])
def test_bad_knobs_stop_at_start_naming_the_knob(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(overrides))


def test_task_knobs_are_checked_before_any_model_is_built(tmp_path):
    from ema_pg.train import train

    for bad, match in (("task.heldout_mod=1", "task.heldout_mod must be >= 2"), ("task.eval_size=0", "eval_size must be >= 1")):
        cfg = compose_cfg([bad], tmp_path)
        with pytest.raises(ConfigError, match=match):
            train(cfg)
        assert not (tmp_path / "cold_start_cache").exists()  # stopped before the cold start


def test_search_r1_rows_are_checked_on_load_with_their_index(tmp_path):
    import pandas as pd

    from ema_pg.tasks.search.data import load_search_r1

    good = {"data_source": "nq", "prompt": [{"role": "user", "content": "Who?"}],
            "reward_model": {"ground_truth": {"target": ["x"]}}}
    empty = {**good, "prompt": [{"role": "user", "content": "  "}]}
    pd.DataFrame([good, empty]).to_parquet(tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"train.parquet: row 2: the prompt is empty"):  # rows count from 1
        load_search_r1(str(tmp_path))


# ---------------------------------------------------------------------- run folders
def test_runs_started_at_the_same_moment_get_different_folders(tmp_path):
    from helpers import race_for_folder

    got = race_for_folder(tmp_path / "run", "claim_run_dir(folder)", 4, tmp_path)
    assert len(set(got)) == 4 and str(tmp_path / "run") in got, got
    assert {Path(g).parent for g in got} == {tmp_path}, got


def test_a_dead_runs_claim_is_taken_over_and_a_live_ones_is_not(tmp_path):
    import socket

    from test_faults_lifecycle import holder

    from ema_pg.engine.owner import CLAIM, claim_run_dir, release_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / CLAIM).write_text(f"{socket.gethostname()} 999999999")  # a dead run's claim: nobody holds its lock
    assert claim_run_dir(run) == run
    release_run_dir(run)
    p = holder(run)  # a live run
    try:
        assert claim_run_dir(run) == tmp_path / "run-2"
        release_run_dir(tmp_path / "run-2")
    finally:
        p.kill()
        p.wait()


def test_a_truncated_last_checkpoint_falls_back_to_the_intact_one(tmp_path, caplog):
    import shutil

    from ema_pg.engine.runs import readable_checkpoint

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"ema_pg": {"iteration": 4}}, folder / "iter4.ckpt")
    shutil.copy(folder / "iter4.ckpt", folder / "last.ckpt")
    with open(folder / "last.ckpt", "r+b") as f:
        f.truncate(40)
    ckpt, state = readable_checkpoint(tmp_path)
    assert ckpt.name == "iter4.ckpt" and state["ema_pg"]["iteration"] == 4
    assert "last.ckpt is unreadable" in caplog.text
    (folder / "iter4.ckpt").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="no readable checkpoint"):
        readable_checkpoint(tmp_path)


def test_a_kill_between_a_periods_checkpoint_and_its_link_resumes_from_that_checkpoint(tmp_path, caplog):
    """A period's checkpoint is saved, the previous one removed, then last.ckpt linked to the new one: a kill in
    between leaves last.ckpt dangling. The run still has a checkpoint, the newest one, and a link and its target
    count once."""
    from ema_pg.engine.policy import checkpoint_file, run_checkpoints
    from ema_pg.engine.runs import readable_checkpoint

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"ema_pg": {"iteration": 8}}, folder / "iter8.ckpt")
    (folder / "last.ckpt").symlink_to("iter4.ckpt")  # removed before the link moved on
    assert checkpoint_file(tmp_path) == folder / "iter8.ckpt"
    ckpt, state = readable_checkpoint(tmp_path)
    assert ckpt.name == "iter8.ckpt" and state["ema_pg"]["iteration"] == 8
    (folder / "last.ckpt").unlink()
    (folder / "last.ckpt").symlink_to("iter8.ckpt")
    assert run_checkpoints(tmp_path) == [folder / "last.ckpt"]
    assert "unreadable" not in caplog.text


class _Counter(L.LightningModule):
    """A Lightning module with a run's iteration bookkeeping (an epoch is an evaluation period of 4 iterations)."""

    def __init__(self):
        from omegaconf import OmegaConf

        super().__init__()
        self.layer, self.iteration = torch.nn.Linear(2, 1), 0
        self.cfg = OmegaConf.create({"algo": {"eval_every": 4, "iterations": 8}})

    def training_step(self, batch, batch_idx):
        self.iteration += 1
        return self.layer(batch).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["ema_pg"] = {"iteration": self.iteration}


@pytest.mark.parametrize("at, saved", [(2, 3), (4, 4)])
def test_a_sigterm_just_after_an_iterations_save_point_is_held_so_the_run_still_stops_saved(tmp_path, at, saved):
    """A SIGTERM sent at the end of iteration ``at``, after the save point's look (a callback after it sends it):
    Lightning alone would stop at that iteration's end with nothing saved. Held, it stops after the next iteration,
    saved (2 -> 3), or, at a period's end, after the period's checkpoint (4 -> 4)."""
    import signal

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from ema_pg.engine.console import quiet_third_party
    from ema_pg.engine.fit import _CheckpointOnSigterm, _PeriodCheckpoint, interrupted_line
    from ema_pg.engine.policy import checkpoint_iteration

    class Sender(L.Callback):
        def on_train_batch_end(self, trainer, module, *_):
            if module.iteration == at:
                os.kill(os.getpid(), signal.SIGTERM)

    quiet_third_party()  # as a run does: Lightning's own deprecated LeafSpec use
    folder = tmp_path / "checkpoints"
    trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[_PeriodCheckpoint(folder), _CheckpointOnSigterm(folder / "last.ckpt"), Sender()],
                        default_root_dir=tmp_path)
    module, before = _Counter(), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SIGTERMException):
        trainer.fit(module)
    assert module.iteration == saved and checkpoint_iteration(tmp_path) == saved
    assert (folder / "last.ckpt").is_symlink() == (saved % 4 == 0)  # mid-period: its own file, the period's link kept
    assert interrupted_line(module.iteration, 8, tmp_path).endswith(f"resumes from its checkpoint of iteration {saved}")
    assert signal.getsignal(signal.SIGTERM) == before  # neither the wrapper nor Lightning's handler is left behind


# ---------------------------------------------------------------------- Optuna
@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed:UserWarning")  # this test asks and tells itself
def test_a_restarted_worker_does_not_propose_a_point_already_run(tmp_path):
    import optuna

    from ema_pg.workbench.hpo import StudySpec, open_study

    spec = StudySpec(study_name="s", params={"x": {"type": "float", "low": 0.0, "high": 1.0}},
                     storage=f"sqlite:///{tmp_path}/s.db", sampler={"name": "random", "seed": 0})
    first = open_study(spec)
    t = first.ask()
    x0 = t.suggest_float("x", 0.0, 1.0)
    first.tell(t, x0)
    restarted = open_study(spec)  # the same worker index and seed, started again on the same study
    t2 = restarted.ask()
    assert t2.suggest_float("x", 0.0, 1.0) != x0
    assert len(restarted.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) == 1
    assert math.isfinite(x0)


@pytest.mark.slow
def test_resume_refuses_changed_settings_and_writes_its_log_into_the_run_folder(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    tiny = cli_tiny(tmp_path)
    run, stray = tmp_path / "run", tmp_path / "hydra_out"
    py = [sys.executable, "-m", "ema_pg.train"]
    first = subprocess.run(py + tiny + ["algo.iterations=2", f"run_dir={run}", f"hydra.run.dir={run}"], cwd=root,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    for change, says in (("algo.beta=0.5", "settings differ from the run's (algo.beta"),
                         ("kl=k3", "changes the config group kl")):
        refused = subprocess.run(py + [f"resume={run}", change, f"hydra.run.dir={stray}"], cwd=root,
                                 capture_output=True, text=True, timeout=600)
        assert refused.returncode != 0 and says in refused.stdout + refused.stderr, refused.stderr[-2000:]
    again = subprocess.run(py + [f"resume={run}", "algo.iterations=4", f"hydra.run.dir={stray}"], cwd=root,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not stray.exists()
    assert "resuming" in (run / "train.log").read_text()


@pytest.mark.slow
def test_a_sweep_with_a_group_overlay_continues_its_killed_run(tmp_path):
    """A reproduction's sweep appends its scale overlay as a config group (``+scale=decide``, a
    ``@package _global_`` file); the same command again must continue the run it left (it was refused:
    "settings differ (scale)"), while a hand ``resume=`` that names a group is refused as a change."""
    import json
    import subprocess
    import sys

    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "conf" / "scale").mkdir(parents=True)
    (tmp_path / "conf" / "scale" / "lean.yaml").write_text("# @package _global_\nalgo:\n  beta: 0.07\n")
    run = tmp_path / "run"
    py = [sys.executable, "-m", "ema_pg.train", "--config-dir", str(tmp_path / "conf")]
    common = cli_tiny(tmp_path) + ["+scale=lean", "if_exists=resume", f"run_dir={run}", f"hydra.run.dir={run}"]
    first = subprocess.run(py + common + ["algo.iterations=1"], cwd=root, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run(py + common + ["algo.iterations=2"], cwd=root, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming" in (run / "train.log").read_text()
    assert json.loads((run / "eval.json").read_text())["iteration"] == 2
    assert OmegaConf.load(run / "config.yaml").algo.beta == 0.07
    refused = subprocess.run(py + [f"resume={run}", "+scale=lean", f"hydra.run.dir={tmp_path / 'stray'}"], cwd=root,
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "changes the config group scale" in refused.stdout + refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["model.compile=true"], ["rollout.max_staleness=2", "anchor.align=behaviour"],
                                   ["rollout.max_staleness=2", "anchor.align=behaviour", "rollout.workers=2"],
                                   ["rollout.max_staleness=2", "anchor.align=behaviour", "rollout.partial=true",
                                    "rollout.partial_spare=2"]],
                         ids=["eager", "compiled", "async", "async_pool", "async_partial"])
def test_kill_9_at_random_moments_then_the_same_command_ends_where_an_uninterrupted_run_does(tmp_path, extra,
                                                                                           kill_cache):
    """Three runs each SIGKILLed once at a random moment (cold start, an iteration, an evaluation or a
    checkpoint write), then continued by the same command (``if_exists=resume``): the final policy and
    anchor are bit-identical to an uninterrupted run's. Each other case is killed once (the moments are the eager
    runs' to cover). With ``model.compile=true``: the resumed process compiles afresh and must still repeat the
    uninterrupted run bit for bit. Asynchronous (a rollout worker two versions behind, the anchor aligned): the batches
    in flight travel with the checkpoint, and the worker dies with its trainer; with a pool of two workers, the joined
    batches in flight do. The cases share one cold-start cache, built before the first (:func:`kill_cache`), so that
    each case's reference run is timed as its killed runs go (cold start cached)."""
    import random
    import signal
    import subprocess
    import sys
    import time

    from ema_pg.engine.policy import load_run_model

    root = Path(__file__).resolve().parents[2]
    tiny = [o for o in cli_tiny(tmp_path) if not o.startswith("sft.cache_dir=")] + [
        "algo.iterations=8", "if_exists=resume", *extra, f"sft.cache_dir={kill_cache}"]

    def cmd(run):
        return [sys.executable, "-m", "ema_pg.train", *tiny, f"run_dir={run}", f"hydra.run.dir={run}"]

    def timed(run) -> float:
        t0 = time.time()
        assert subprocess.run(cmd(run), cwd=root, capture_output=True, timeout=600).returncode == 0
        return time.time() - t0

    ref = tmp_path / "ref"
    whole = timed(ref)
    rng = random.Random(0)
    for trial in range(1 if extra else 3):  # the moments are the eager runs' to cover
        run = tmp_path / f"killed{trial}"
        p = subprocess.Popen(cmd(run), cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        time.sleep(rng.uniform(0.2, 0.9) * whole)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        again = subprocess.run(cmd(run), cwd=root, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-2000:]
        for which in ("policy", "anchor"):
            a, b = load_run_model(ref, which=which)[0].state_dict(), load_run_model(run, which=which)[0].state_dict()
            assert all(torch.equal(a[k], b[k]) for k in a), (trial, which)


@pytest.fixture(scope="module")
def kill_cache(tmp_path_factory):
    """The kill -9 cases' one cold-start cache (their cold starts are one: the cases differ in RL settings alone),
    built here by a one-iteration run in this process, so that every case's reference run meets it cached."""
    from helpers import compose_cfg

    from ema_pg.engine.fit import train

    cache = tmp_path_factory.mktemp("kill_cache")
    cfg = compose_cfg([*[o for o in cli_tiny(cache) if not o.startswith("sft.cache_dir=")], "algo.iterations=1",
                       f"sft.cache_dir={cache}"], tmp_path_factory.mktemp("kill_cache_build"), tiny=False)
    train(cfg)
    assert any(cache.iterdir())
    return cache


def test_a_collapsed_policy_is_warned_once(caplog):
    from types import SimpleNamespace

    from ema_pg.engine.module import RLModule

    me = SimpleNamespace(policy=SimpleNamespace(config=SimpleNamespace(vocab_size=300)), _collapse_warned=False, _was_peaked=False,
                         iteration=7, cfg=SimpleNamespace(optim=SimpleNamespace(lr=1e3)))
    RLModule._warn_collapse(me, {"train/entropy": math.log(300), "train/reward_mean": 0.0})
    assert "policy collapse" not in caplog.text  # uniform from the start (random init): nothing collapsed
    RLModule._warn_collapse(me, {"train/entropy": 0.5 * math.log(300), "train/reward_mean": 0.0})
    RLModule._warn_collapse(me, {"train/entropy": math.log(300), "train/reward_mean": 0.25})
    assert "policy collapse" not in caplog.text  # low entropy, or some reward: not a collapse
    RLModule._warn_collapse(me, {"train/entropy": 0.99 * math.log(300), "train/reward_mean": 0.0})
    RLModule._warn_collapse(me, {"train/entropy": math.log(300), "train/reward_mean": 0.0})
    assert caplog.text.count("policy collapse at iteration 7") == 1 and "optim.lr=1000" in caplog.text


def test_a_run_that_diverges_before_its_first_checkpoint_says_there_is_none_to_resume(tmp_path):
    """A run whose first update is non-finite (algo.beta=1e308: the KL term overflows; the probe's optim.lr=1e6 on
    the default model did the same): the last line says the run wrote no checkpoint (it once said 'continue with
    resume=', which then found none) and, in a float32 run, does not blame float16."""
    import subprocess
    import sys

    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "ema_pg.train", *cli_tiny(tmp_path), "algo.beta=1e308", "algo.iterations=4",
                        "algo.eval_every=4", "algo.max_bad_steps=1", f"run_dir={run}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("stopped: ") and "non-finite" in last, r.stderr[-2000:]
    assert last.endswith("it had written no checkpoint: fix the cause and run the same command again (a new run)")
    assert "algo.beta=1e+308 too large" in last and "float16" not in last and "resume=" not in last
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("*.ckpt"))
