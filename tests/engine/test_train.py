"""End-to-end runs on CPU with a tiny model: run folder, exact resume, cold-start cache, evaluation."""

import json
import math

import pandas as pd
import pytest
from helpers import compose_cfg
from omegaconf import OmegaConf

from ema_pg.config import ConfigError
from ema_pg.train import train

REQUIRED = ["train/reward_mean", "train/loss", "train/kl", "train/clip_frac_low", "train/clip_frac_high",
            "train/entropy", "train/response_len", "anchor/lag_norm", "eval/heldout/em", "eval/avg/em"]


def comparable(df):
    return df[[c for c in df.columns if not c.startswith("time/")]].sort_values("step", kind="stable").reset_index(drop=True)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    cfg = compose_cfg(["anchor.update_every=1", "algo.ppo_epochs=2", "algo.minibatch_size=8"], tmp)
    metrics, objs = train(cfg)
    return cfg, metrics, objs


def test_run_folder_has_everything(full_run):
    cfg, metrics, objs = full_run
    d = objs["run_dir"]
    for f in ["config.yaml", "metrics.csv", "eval.json", "curves.png", "git.txt", "machine.txt", "checkpoints/last.ckpt"]:
        assert (d / f).is_file(), f
    # the last period's checkpoint is written once: last.ckpt links to it (the earlier period's is gone)
    written = [p.name for p in (d / "checkpoints").iterdir() if not p.is_symlink()]
    assert written == ["iter4.ckpt"] and (d / "checkpoints" / "last.ckpt").is_symlink()  # named by its iteration
    assert (d / "checkpoints" / "last.ckpt").resolve() == (d / "checkpoints" / "iter4.ckpt").resolve()
    df = pd.read_csv(d / "metrics.csv")
    for c in REQUIRED:
        assert c in df.columns and df[c].notna().any(), c
    assert df["train/reward_mean"].notna().sum() == 4
    assert df.loc[df["eval/avg/em"].notna(), "step"].tolist() == [0, 2, 4]  # base policy, then every eval_every
    assert OmegaConf.load(d / "config.yaml").kl.name == "topk_reverse"
    ev = json.loads((d / "eval.json").read_text())
    assert set(ev["splits"]) == {"heldout"} and ev["splits"]["heldout"]["n"] == 16
    assert metrics["iteration"] == 4
    # the anchor moved (EMA) and lags the policy; with 2 epochs x 2 minibatches some ratios left 1
    assert df["anchor/lag_norm"].dropna().iloc[-1] > 0
    assert (df["train/ratio_max"].dropna() > 1.0).any()


def test_resume_repeats_an_uninterrupted_run_exactly(full_run, tmp_path):
    cfg, _, objs = full_run
    half = compose_cfg(["anchor.update_every=1", "algo.ppo_epochs=2", "algo.minibatch_size=8", "algo.iterations=2"], tmp_path)
    train(half)
    resumed = OmegaConf.load(tmp_path / "run" / "config.yaml")
    resumed.algo.iterations = 4
    resumed.resume = str(tmp_path / "run")
    _, objs2 = train(resumed)
    a = comparable(pd.read_csv(objs["run_dir"] / "metrics.csv"))
    b = comparable(pd.read_csv(objs2["run_dir"] / "metrics.csv"))
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    # the run's wall time counts both processes: the resumed one's rows go on from the first one's checkpoint
    elapsed = pd.read_csv(objs2["run_dir"] / "metrics.csv").groupby("step")["time/elapsed_s"].max()
    assert elapsed.is_monotonic_increasing and elapsed.is_unique
    assert json.loads((objs2["run_dir"] / "eval.json").read_text())["wall_s"] >= elapsed.max()


def test_starting_over_an_existing_run_is_refused(full_run):
    cfg, _, _ = full_run
    with pytest.raises(ConfigError, match="already holds a run; pass resume="):
        train(cfg)


@pytest.mark.slow
def test_cold_start_is_cached_and_reused(full_run, tmp_path):
    cfg, _, _ = full_run
    from pathlib import Path

    cache = Path(cfg.sft.cache_dir)
    entries = sorted(p.name for p in cache.iterdir())
    train(compose_cfg(["algo.iterations=2", "kl=k3", "kl.k=null", f"sft.cache_dir={cache}"], tmp_path))  # same task/model/seed
    assert sorted(p.name for p in cache.iterdir()) == entries
    train(compose_cfg(["algo.iterations=2", "seed=5", f"sft.cache_dir={cache}"], tmp_path / "s5"))  # another seed: another base policy
    assert len(list(cache.iterdir())) == len(entries) + 1


_COLD_START = """import hashlib, logging, sys
sys.path.insert(0, {tests!r})
from helpers import compose_cfg
from ema_pg.engine.sft import cold_start
from ema_pg.tasks import build_task
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s", force=True)
cfg = compose_cfg(["sft.cache_dir=" + sys.argv[1]])
model, _, d = cold_start(cfg.model, cfg.task, cfg.sft, build_task(cfg.task), cfg.seed, progress=False)
sd = model.state_dict()
print(d.name, hashlib.sha256(b"".join(sd[k].numpy().tobytes() for k in sorted(sd))).hexdigest())
"""


def _cold_start_child(cache, err, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    code = _COLD_START.format(tests=str(Path(__file__).parents[1]))
    with open(err, "w") as fh:  # the child keeps its own copy of the handle
        return subprocess.Popen([sys.executable, "-c", code, str(cache)], stdout=subprocess.PIPE, text=True,
                                stderr=fh, cwd=tmp_path)


@pytest.mark.slow  # three processes build one cold start: ~18 s; the fast suite stays under 5 minutes
def test_processes_that_ask_for_one_cold_start_together_build_it_once(tmp_path):
    """Two processes asking for a base policy that a third is building wait, then one builds it and the other
    reuses that build: one set of SFT steps, not two, and the same weights as a build in another cache."""
    import time

    from ema_pg.engine.files import file_lock
    from ema_pg.engine.sft import LOCKS, cold_start_lock

    first = _cold_start_child(tmp_path / "elsewhere", tmp_path / "elsewhere.err", tmp_path)
    name, digest = first.communicate(timeout=300)[0].split()[-2:]  # the last line (a venv with DeepSpeed logs above)
    cache = tmp_path / "cache"
    errs = [tmp_path / f"child{i}.err" for i in range(2)]
    with file_lock(cold_start_lock(cache / name)):  # the lock a builder holds: both children find it taken
        kids = [_cold_start_child(cache, e, tmp_path) for e in errs]
        deadline = time.monotonic() + 300
        while not all("waiting to reuse it" in e.read_text() for e in errs):
            assert time.monotonic() < deadline and all(k.poll() is None for k in kids), [e.read_text() for e in errs]
            time.sleep(0.1)
        assert not (cache / name).exists()  # nothing built while the lock was held
    outs = [k.communicate(timeout=300)[0].split()[-2:] for k in kids]
    assert all(k.returncode == 0 for k in kids) and outs == [[name, digest]] * 2
    logs = [e.read_text() for e in errs]
    assert sum("SFT steps" in t for t in logs) == 1 and sum("cold start: reusing" in t for t in logs) == 1, logs
    assert sorted(p.name for p in cache.iterdir()) == sorted([LOCKS, name])


@pytest.mark.slow
def test_a_run_that_reuses_a_cold_start_equals_the_run_that_built_it(tmp_path, caplog):
    """What makes waiting for another process's cold start safe: the run reseeds after its cold start, so it does
    not matter whether this process built the base policy or found it built."""
    import logging

    cache, said, finals = tmp_path / "cache", [], []
    for d in ("built", "reused"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ema_pg.engine.sft"):
            metrics, _ = train(compose_cfg(["algo.iterations=3", f"sft.cache_dir={cache}"], tmp_path / d))
        said.append(caplog.text)
        finals.append({k: v for k, v in metrics.items() if not k.startswith("time/")})
    assert "SFT steps" in said[0] and "cold start: reusing" in said[1]
    a, b = (comparable(pd.read_csv(tmp_path / d / "run" / "metrics.csv")) for d in ("built", "reused"))
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert finals[0] == finals[1]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["kl=k3", "kl.k=null", "anchor=fixed"], ["kl=topk_forward", "kl.tail=paper"],
                                       ["kl=exact_reverse", "kl.k=null"], ["anchor=none", "kl.k=null"],
                                       ["kl=none", "kl.k=null", "algo.reward_kl=sequence", "algo.adv_norm=global"]])
def test_method_variants_run(overrides, tmp_path):
    metrics, _ = train(compose_cfg(overrides + ["algo.iterations=2"], tmp_path))
    assert metrics["iteration"] == 2 and metrics["eval/avg/em"] == metrics["eval/avg/em"]


def test_evaluate_cli_on_a_run_folder(full_run, capsys):
    from ema_pg.workbench.evaluate import main

    _, _, objs = full_run
    main([str(objs["run_dir"]), "--out", str(objs["run_dir"] / "eval_cli.json"), "--show", "1"])
    out = json.loads((objs["run_dir"] / "eval_cli.json").read_text())
    printed = capsys.readouterr().out
    assert out["splits"]["heldout"]["n"] == 16 and "| em |" in printed and "--- [heldout]" in printed
    assert len(out["samples"]["heldout"]) == 1
    # the CLI evaluates the final policy: its number equals the run's own final evaluation
    assert out["avg"] == json.loads((objs["run_dir"] / "eval.json").read_text())["avg"]


def test_evaluation_keeps_samples_across_batches_with_their_prompts_index(full_run):
    """``show`` keeps that many samples per split over every generate call, not the first call's only, each with
    its prompt's index in the split (what traces a response back to its question)."""
    from ema_pg.engine.evaluation import evaluate_policy
    from ema_pg.engine.policy import load_run_model
    from ema_pg.rollout import build_sampler
    from ema_pg.tasks import build_task

    cfg, _, objs = full_run
    model, tok = load_run_model(objs["run_dir"], "policy")
    task = build_task(cfg.task)
    prompts = task.eval_splits()["heldout"]
    res = evaluate_policy(model.eval(), build_sampler(cfg.rollout, tok), task, cfg.rollout, batch_size=5,
                          progress=False, show=13)
    kept = res["samples"]["heldout"]
    assert [s["index"] for s in kept] == list(range(13))  # three calls of 5 prompts, 13 kept in order
    assert all(s["prompt"] == prompts[s["index"]].text and s["gold"] == prompts[s["index"]].answer for s in kept)


def test_evaluate_cli_scores_training_prompts_apart_from_the_eval_splits(full_run, capsys):
    """--train N: the policy on N distinct training prompts, kept out of the eval splits' average."""
    from ema_pg.engine.evaluation import evaluate_policy
    from ema_pg.workbench.evaluate import main, training_prompts
    from ema_pg.engine.policy import load_run_model
    from ema_pg.rollout import build_sampler

    cfg, _, objs = full_run
    run = objs["run_dir"]
    main([str(run), "--out", str(run / "eval_train.json"), "--train", "8"])
    out = json.loads((run / "eval_train.json").read_text())
    assert out["avg"] == json.loads((run / "eval.json").read_text())["avg"] and "train" not in out["splits"]
    assert "training questions (8 distinct; not in avg)" in capsys.readouterr().out
    task = objs["module"].task
    prompts = training_prompts(task, 8)
    assert len({p.text for p in prompts}) == 8
    model, tok = load_run_model(run, "policy")
    direct = evaluate_policy(model.eval(), build_sampler(cfg.rollout, tok), task, cfg.rollout,
                             splits={"t": prompts}, progress=False)
    assert out["train"]["n"] == 8 and out["train"]["em"] == direct["splits"]["t"]["em"]
    with pytest.raises(SystemExit, match="--train -1"):
        main([str(run), "--train", "-1"])


def test_run_folder_rebuilds_its_policy_without_the_cache_from_another_directory(full_run, tmp_path, monkeypatch):
    """evaluate and export need nothing but the run folder: the cold-start cache is gone, the cwd is elsewhere."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from ema_pg.workbench.evaluate import main as evaluate_main
    from ema_pg.workbench.export import main as export_main

    cfg, _, objs = full_run
    run = tmp_path / "moved_run"
    shutil.copytree(objs["run_dir"], run)
    cache = tmp_path / "gone_cache"  # the run's cache path now points nowhere
    monkeypatch.setenv("EMA_PG_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    evaluate_main([str(run)])
    out = json.loads((run / "evaluations" / "policy.json").read_text())
    assert out["avg"] == json.loads((run / "eval.json").read_text())["avg"]  # the final policy, exactly
    assert json.loads((run / "eval.json").read_text())["iteration"] == 4  # the run's own record is untouched
    evaluate_main([str(run), "--which", "anchor"])
    evaluate_main([str(run), "--initial"])
    assert (json.loads((run / "evaluations" / "initial.json").read_text())["avg"]
            == pd.read_csv(run / "metrics.csv").dropna(subset=["eval/avg/em"])["eval/avg/em"].iloc[0])
    assert not cache.exists()
    # export: a save_pretrained folder of the policy and of the anchor that from_pretrained loads
    from ema_pg.engine.anchor import anchor_state

    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    export_main([str(run), str(tmp_path / "policy")])
    export_main([str(run), str(tmp_path / "anchor"), "--anchor"])
    pol = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", local_files_only=True)
    anc = AutoModelForCausalLM.from_pretrained(tmp_path / "anchor", local_files_only=True)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(pol.state_dict()[w], ckpt["state_dict"][f"policy.{w}"])
    master = anchor_state(ckpt)["master"]
    assert torch.equal(anc.state_dict()[w], master[w]) and not torch.equal(anc.state_dict()[w], pol.state_dict()[w])
    # model=local trains from the export
    metrics, _ = train(compose_cfg(["model=local", f"model.path={tmp_path / 'policy'}", "model.dtype=float32",
                                    "algo.iterations=1", "algo.eval_every=1"], tmp_path / "from_export"))
    assert metrics["iteration"] == 1 and metrics["base/avg"] == out["avg"]


def test_stability_monitor_logs_when_on(tmp_path):
    _, objs = train(compose_cfg(["algo.iterations=2", "monitor.every=1", "monitor.num_sequences=2"], tmp_path))
    df = pd.read_csv(objs["run_dir"] / "metrics.csv")
    for c in ("anchor/trF", "anchor/alpha_beta_trF", "anchor/regime", "monitor/seconds"):
        assert df[c].notna().sum() == 2, c
    assert (df["anchor/trF"].dropna() > 0).all()


def test_the_monitors_beta_is_the_one_the_loss_applied_under_global_kl_scale(tmp_path):
    """adv_norm=global with global_kl_scale divides the token KL's beta by the batch's reward std; the monitor's
    bound used the raw algo.beta, a beta the loss did not apply."""
    _, objs = train(compose_cfg(["algo.iterations=2", "monitor.every=1", "monitor.num_sequences=2", "algo.beta=0.05",
                                 "algo.adv_norm=global", "algo.global_kl_scale=true"], tmp_path))
    df = pd.read_csv(objs["run_dir"] / "metrics.csv").dropna(subset=["anchor/alpha_beta_trF"])
    assert len(df) == 2 and (abs(df["train/kl_weight"] - 0.05) > 1e-3).all()  # the loss's beta is not algo.beta here
    assert (df["train/kl_coef"] == 0.05).all()  # beta in force: algo.beta (kl_ctrl=fixed)
    bound = df["train/lr"] * df["train/kl_weight"] * df["anchor/trF"]
    assert ((df["anchor/alpha_beta_trF"] - bound).abs() <= 1e-6 * bound.abs()).all()


def test_anchor_policy_is_evaluated_when_asked(tmp_path):
    _, objs = train(compose_cfg(["algo.iterations=2", "anchor.eval_every=2", "anchor.eta=0.5", "anchor.update_every=1"],
                                tmp_path))
    df = pd.read_csv(objs["run_dir"] / "metrics.csv")
    assert df["eval_anchor/avg/em"].notna().sum() == 2  # iterations 0 and 2
    assert df["eval_anchor/heldout/em"].notna().sum() == 2


def test_a_run_evaluated_only_at_its_end_has_one_evaluation_and_checkpoints_as_before(tmp_path):
    metrics, objs = train(compose_cfg(["algo.iterations=4", "algo.eval_every=2", "algo.eval_only_at_end=true"], tmp_path))
    df = pd.read_csv(objs["run_dir"] / "metrics.csv")
    assert df.dropna(subset=["eval/avg/em"])["step"].tolist() == [4]  # not at 0, not at 2
    res = json.loads((objs["run_dir"] / "eval.json").read_text())
    assert res["iteration"] == 4 and "base_avg" not in res and math.isnan(metrics["base/avg"])
    assert sorted(p.name for p in (objs["run_dir"] / "checkpoints").iterdir()) == ["iter4.ckpt", "last.ckpt"]
    assert len(res["splits"]["heldout"]["per_problem"]) == res["splits"]["heldout"]["n"]  # runs pair by question


def test_cold_start_key_ignores_run_time_knobs():
    from ema_pg.engine.sft import cold_start_key

    a = compose_cfg([])
    b = compose_cfg(["model.head_chunk_tokens=7", "model.dtype=bfloat16", "sft.cache_dir=/elsewhere"])
    c = compose_cfg(["model.hidden_size=48"])
    key = lambda cfg: cold_start_key(cfg.model, cfg.task, cfg.sft, 0)
    assert key(a) == key(b) != key(c)


def test_sft_seed_gives_every_run_seed_the_same_base_policy(tmp_path):
    """sft.seed=S: the cold start of a run of any seed is the one a run of seed S builds by default (the same cache
    entry and weights); without it the run's seed makes its own."""
    import torch

    from ema_pg.engine.policy import build_policy
    from ema_pg.engine.sft import LOCKS
    from ema_pg.tasks import build_task

    def base(*over):
        cfg = compose_cfg([*over, f"sft.cache_dir={tmp_path}"])
        return build_policy(cfg, build_task(cfg.task))[0].state_dict()

    own3, shared, own0 = base("seed=3"), base("seed=0", "sft.seed=3"), base("seed=0")
    bases = [p for p in tmp_path.iterdir() if p.name != LOCKS]  # the cache's entries, its lock folder aside
    assert len(bases) == 2  # seed 3's entry served the run of seed 0 with sft.seed=3
    assert all(torch.equal(own3[k], shared[k]) for k in own3)
    assert not all(torch.equal(own3[k], own0[k]) for k in own3)


def test_sft_lr_schedule_keys_and_factors():
    """The SFT knobs added later (lr_schedule, env_loss, seed) at their defaults keep the key cold starts had before
    they existed; cosine warms up linearly over 5% of the steps, then decays by a half cosine to a tenth of sft.lr."""
    import math

    import torch
    from omegaconf import OmegaConf

    from ema_pg.engine.sft import cold_start_key, lr_scheduler

    a, cos = compose_cfg([]), compose_cfg(["sft.lr_schedule=cosine"])
    before = OmegaConf.create({k: v for k, v in OmegaConf.to_container(a.sft).items()
                               if k not in ("lr_schedule", "env_loss", "seed")})
    assert cold_start_key(a.model, a.task, a.sft, 0) == cold_start_key(a.model, a.task, before, 0)
    for other in (cos, compose_cfg(["sft.env_loss=true"])):
        assert cold_start_key(other.model, other.task, other.sft, 0) != cold_start_key(a.model, a.task, a.sft, 0)

    steps, w = 200, 10
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = lr_scheduler(opt, "cosine", steps)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [2.0 * (t / w if t < w else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - w) / (steps - w))))
            for t in range(steps)]
    assert lrs == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert max(lrs) == pytest.approx(2.0) and lrs[-1] == pytest.approx(0.2, rel=1e-3)
    assert lr_scheduler(opt, "constant", steps) is None
    with pytest.raises(ValueError, match="constant, cosine"):
        lr_scheduler(opt, "linear", steps)
    from ema_pg.config import ConfigError, SFTConfig

    with pytest.raises(ConfigError, match="sft.lr_schedule='linear'; choose one of constant, cosine"):
        SFTConfig(lr_schedule="linear").check()


@pytest.mark.slow
def test_command_line_errors_are_one_clear_line(tmp_path):
    """Three bad command lines, run one after another in one process (:func:`helpers.run_in_one_process`): each
    ends non-zero, its last line of stderr says what to change, and no traceback is printed."""
    from helpers import run_in_one_process

    wants = {"model.path='/nope' does not exist": ["model=local", "model.path=/nope"],
             "task.digits must be in [1, 6]": ["task.digits=9"],
             "anchor.eta must be in [0, 1]": ["anchor.eta=1.5"]}
    done = run_in_one_process("ema_pg.train", {w: [*a, f"hydra.run.dir={tmp_path}"] for w, a in wants.items()},
                              timeout=300)
    for want, (code, console, stderr) in done.items():
        assert code not in (0, None) and want in stderr.strip().splitlines()[-1] and "Traceback" not in stderr, console


def test_evaluate_base_policy_of_a_config(tmp_path, capsys):
    from ema_pg.workbench.evaluate import main
    from helpers import TINY

    main(["base", *TINY, "task.eval_size=16", f"sft.cache_dir={tmp_path}/cache", "--out", str(tmp_path / "e.json")])
    assert "| em |" in capsys.readouterr().out
    assert json.loads((tmp_path / "e.json").read_text())["splits"]["heldout"]["n"] == 16


@pytest.mark.slow
def test_if_exists_resume_skips_finished_runs_continues_longer_ones_and_refuses_other_configs(tmp_path):
    """What lets a killed sweep continue: the same command again skips finished runs and resumes the rest."""
    base = ["algo.iterations=2", "if_exists=resume"]
    metrics, objs = train(compose_cfg(base, tmp_path))
    assert metrics["iteration"] == 2 and (objs["run_dir"] / "eval.json").is_file()
    again, objs2 = train(compose_cfg(base, tmp_path))
    assert objs2.get("skipped") and again["eval/avg/em"] == metrics["eval/avg/em"]
    longer, _ = train(compose_cfg(["algo.iterations=4", "if_exists=resume"], tmp_path))
    assert longer["iteration"] == 4
    df = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert df["train/reward_mean"].notna().sum() == 4  # iterations 1-2 kept, 3-4 added: nothing lost or repeated
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["iteration"] == 4
    with pytest.raises(ConfigError, match="another config .*kl.k"):
        train(compose_cfg(["algo.iterations=4", "if_exists=resume", "kl.k=4"], tmp_path))
    with pytest.raises(ConfigError, match="if_exists='skip'"):
        train(compose_cfg(["if_exists=skip"], tmp_path / "other"))


@pytest.mark.slow
def test_model_compile_compiles_the_policy_and_the_anchor_each_its_own(tmp_path):
    """``model.compile=true`` reaches both models of a run (the anchor's copy is made before and compiled
    separately, so it runs its own weights), and the run trains and evaluates through them without reaching
    dynamo's recompile limit (past it a frame runs eagerly: the sampler's cache had taken a tiny model's layers
    there, so the update's passes ran uncompiled)."""
    import torch._dynamo

    torch._dynamo.reset()  # this process's earlier compiles count towards the limit
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        metrics, objs = train(compose_cfg(["model.compile=true", "algo.iterations=2"], tmp_path))
    policy, anchor = objs["module"].policy, objs["module"].anchor.model
    p_call, a_call = policy.model._compiled_call_impl, anchor.model._compiled_call_impl
    assert p_call is not None and a_call is not None and p_call is not a_call
    assert metrics["iteration"] == 2


@pytest.mark.slow
def test_the_grad_ratio_monitor_runs_on_a_compiled_model(tmp_path):
    """monitor.grad_ratio_every backpropagates twice through one graph before the update; a compiled backward
    that donates its buffers refuses the second pass (RuntimeError: "non-empty donated buffers")."""
    import pandas as pd

    metrics, objs = train(compose_cfg(["model.compile=true", "monitor.grad_ratio_every=1", "algo.iterations=2",
                                       "kl=k1", "algo.entropy_coef=0.01"], tmp_path))
    m = pd.read_csv(objs["run_dir"] / "metrics.csv")
    ratio = m["train/kl_pg_grad_ratio"].dropna()
    assert metrics["iteration"] == 2 and len(ratio) == 2 and (m["train/grad_norm_pg"].dropna() > 0).all()


def test_the_policys_optimizer_step_is_seen_by_the_engines_weight_sync(full_run):
    """The vLLM sampler pushes weights when their in-place version counters moved (weights_version). torch's fused
    AdamW updates without moving them: with it, the engine kept sampling from the first weights and the vLLM
    training test's reward stayed flat (0.134 -> 0.130). The optimizer the trainer builds must be one the sync sees."""
    import torch

    from ema_pg.rollout.vllm import weights_version

    module = full_run[2]["module"]
    saved = {k: v.clone() for k, v in module.policy.state_dict().items()}  # the fixture is shared: put it back
    opt = module.configure_optimizers()["optimizer"]
    for p in module.policy.parameters():
        p.grad = torch.randn_like(p)
    before = weights_version(module.policy)
    opt.step()
    moved = weights_version(module.policy) != before
    module.policy.zero_grad(set_to_none=True)
    module.policy.load_state_dict(saved)
    assert moved


def test_a_run_binds_its_estimator_and_anchor_scheme_once_and_leaves_the_callers_config_as_it_was(tmp_path,
                                                                                                  monkeypatch):
    """validate ran twice and the scheme was built about six times in one run, and the registry defaults were written
    back into the caller's config, which the stability monitor then read (anchor.eta)."""
    import ema_pg.config.validation as C  # the home of build_scheme and build_estimator, where validate calls them

    counts = {"build_scheme": 0, "build_estimator": 0}
    for name in counts:
        real = getattr(C, name)

        def counted(*a, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(C, name, counted)
    cfg = compose_cfg(["algo.iterations=2", "monitor.every=1", "monitor.num_sequences=2"], tmp_path)
    before = OmegaConf.to_container(cfg, resolve=False)
    _, objs = train(cfg)
    assert counts == {"build_scheme": 1, "build_estimator": 1}
    assert OmegaConf.to_container(cfg, resolve=False) == before and cfg.anchor.eta is None  # the caller's, untouched
    saved = OmegaConf.load(objs["run_dir"] / "config.yaml")
    assert saved.anchor.eta == 0.9 and saved.kl.k == 32  # the folder records the values in force
    assert objs["module"].monitor.eta == 0.9  # from the bound scheme


@pytest.mark.slow  # two command-line runs, about a minute
def test_a_base_built_under_one_kernel_setting_is_loaded_not_rebuilt_under_another(tmp_path):
    """A plan across machines (issue 80): the cold start is built once into a cache the machines share
    (``sft.cache_dir`` / ``EMA_PG_CACHE``) and every later run loads it, whatever its CPU kernels: a run under
    ``ATEN_CPU_CAPABILITY=avx2`` reuses the base a run under ``default`` built, and starts from the same weights
    (``run_base``, the digest a plan's ledger checks each cell against)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ema_pg.engine.runs import run_base

    from test_faults import cli_tiny

    root = Path(__file__).resolve().parents[2]
    runs = {}
    for kernels in ("default", "avx2"):
        run = tmp_path / kernels
        env = {**os.environ, "ATEN_CPU_CAPABILITY": kernels}
        p = subprocess.run([sys.executable, "-m", "ema_pg.train", *cli_tiny(tmp_path), "sft.seed=0", "algo.iterations=1",
                            "algo.eval_every=1", f"hydra.run.dir={run}"], cwd=root, env=env, capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        runs[kernels] = (run, (run / "train.log").read_text())
    (built, built_log), (loaded, loaded_log) = runs["default"], runs["avx2"]
    assert "SFT steps, final loss" in built_log and "cold start: reusing" not in built_log
    assert "cold start: reusing" in loaded_log and "SFT steps, final loss" not in loaded_log
    assert run_base(built) == run_base(loaded) != "unknown"


def test_the_algorithm_floor_is_handed_no_config_node_in_a_run(tmp_path, monkeypatch):
    """What a run hands rl_step (StepParts: the policy, task, sampler, estimator, the algo and rollout records, ...)
    holds no OmegaConf node anywhere below it: the engine binds the config into plain records once
    (ema_pg.config.step_records) and the algorithm floor reads those. The engine's own objects (its updater wraps the
    Lightning module) are not walked: they are the engine's."""
    from omegaconf import DictConfig, ListConfig

    import ema_pg.engine.module as module

    found, calls = [], []

    def walk(x, path, seen):
        if id(x) in seen or len(path) > 200:
            return
        seen.add(id(x))
        if isinstance(x, (DictConfig, ListConfig)):
            found.append(path)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}[{k!r}]", seen)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]", seen)
        elif hasattr(x, "__dict__") and not isinstance(x, type) and type(x).__module__.startswith("ema_pg") \
                and not type(x).__module__.startswith("ema_pg.engine"):
            for k, v in vars(x).items():
                walk(v, f"{path}.{k}", seen)

    real = module.rl_step

    def handed(iteration, parts, **kw):
        calls.append(type(parts.algo).__name__ + "/" + type(parts.rollout).__name__)
        walk(parts, "parts", set())
        return real(iteration, parts, **kw)

    monkeypatch.setattr(module, "rl_step", handed)
    train(compose_cfg(["algo.iterations=2", "algo.eval_every=2"], tmp_path))
    assert calls == ["AlgoConfig/RolloutConfig"] * 2 and found == []
