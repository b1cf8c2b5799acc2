"""The front door under faults: each bad input stops with one line that says what to change, before any
expensive work and before any folder is made; evaluate and export say which checkpoint they read and refuse
what is not there; held-out prompts are distinct. Each case failed on the code before this file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import compose_cfg
from omegaconf import OmegaConf, open_dict

from ema_pg.config import ConfigError, validate


# ---------------------------------------------------------------------- knobs
@pytest.mark.parametrize("overrides,match", [
    (["name=../../x"], "name='../../x' names the run's folder under runs/"),
    (["model.num_heads=3"], "model.hidden_size=32 must be a multiple of model.num_heads=3"),
    (["model.num_kv_heads=3", "model.num_heads=2"], "num_heads of model.num_kv_heads=3"),
    (["model.head_chunk_tokens=-1"], "model.head_chunk_tokens must be >= 0"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens must be >= 1"),  # it blamed algo.overlong_buffer
    (["rollout.temperature=1e-9"], "is \\(nearly\\) greedy"),
])
def test_bad_knobs_are_one_line_naming_the_knob(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(overrides))


@pytest.mark.parametrize("overrides,says", [
    (["algo.iterationz=3", "hydra.run.dir=/tmp/x"], "unknown key algo.iterationz: did you mean algo.iterations? remove it"),
    (["experiment=search", "task.per_splt=3"], "unknown key task.per_splt: did you mean task.per_split? remove it"),
    (["algoo.iterations=3"], "unknown key algoo: did you mean algo? remove it"),
    (["experiment=nosuch"], "experiment=nosuch: no such option; choose one of: demo, math, math_deepscaler, reasoning_gym, search,"),
    (["algo.iterations=abc"], "algo.iterations: Value 'abc' of type 'str' could not be converted to Integer"),
    (["experiment=search", "task.per_split=3", "kl=k3"], None),  # they compose: Hydra takes them as they are
    (["-m", "seed=1,2"], None),  # a sweep: Hydra's
])
def test_a_command_line_typo_is_one_line_with_the_nearest_key(overrides, says):
    """Hydra's report of a misspelt key is six lines ending in advice to add it with +key=value; ours names the
    nearest key (python -m ema_pg.train prints it as 'config error: ...' and exits 1 before Hydra starts)."""
    from ema_pg.config import overrides_problem

    got = overrides_problem(overrides)
    assert got == says if says is None or not says.endswith(",") else got.startswith(says)
    assert got is None or "\n" not in got


def test_toy_held_out_prompts_are_distinct_and_an_impossible_size_is_refused():
    from ema_pg.tasks.toy import AdditionTask

    task = AdditionTask(digits=2, eval_size=256, heldout_mod=10, reverse_answer=True, seed=0)
    prompts = task.eval_splits()["heldout"]
    assert len(prompts) == 256 and len({p.text for p in prompts}) == 256
    assert all(task._heldout(p.meta["a"], p.meta["b"]) for p in prompts)
    pool = task.heldout_pool()
    assert pool == sum(task._heldout(a, b) for a in range(10, 100) for b in range(10, 100))
    with pytest.raises(ValueError, match=f"holds out {pool} operand pairs; give task.eval_size <= {pool}"):
        AdditionTask(digits=2, eval_size=pool + 1, heldout_mod=10, reverse_answer=True, seed=0)
    with pytest.raises(ValueError, match="task.heldout_mod=100000 holds out 0 operand pairs; a smaller"):
        AdditionTask(digits=2, eval_size=256, heldout_mod=100000, reverse_answer=True, seed=0)  # it never ended
    whole = AdditionTask(digits=1, eval_size=7, heldout_mod=10, reverse_answer=True, seed=0)  # the whole pool
    assert len({p.text for p in whole.eval_splits()["heldout"]}) == 7 == whole.heldout_pool()


def test_the_models_context_and_the_rollouts_memory_are_checked_before_anything_is_written(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ema_pg.engine.fit import check_fits
    from ema_pg.prompts import PromptEncoder
    from ema_pg.engine.models import train_bpe_tokenizer
    from ema_pg.tasks import build_task

    cfg = compose_cfg(["rollout.max_new_tokens=8"])
    task = build_task(cfg.task)
    tok = train_bpe_tokenizer(task.corpus(), vocab_size=300)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=12, n_embd=16, n_layer=1, n_head=2))
    encode = PromptEncoder(tok, "off")
    with pytest.raises(ConfigError, match="the model's context is 12 tokens, but .* prompt .* has .* tokens and with "
                                          "rollout.max_new_tokens=8 needs"):
        check_fits(cfg, gpt2, task, encode)
    cfg.rollout.max_new_tokens = 2
    check_fits(cfg, gpt2, task, encode)
    cfg.algo.group_size = 10**9
    with pytest.raises(ConfigError, match="their KV cache alone needs about .* GiB .*; lower them"):
        check_fits(cfg, gpt2, task, encode)


def test_every_training_prompt_of_a_data_file_is_measured_not_a_sample(tmp_path):
    """One long prompt among 200 training rows, outside the 64 the check sampled, got to the sampler (killed by
    the kernel at 24 GiB with a 9,000-token prompt); the check now reads every row a data file holds."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from ema_pg.engine.fit import check_fits
    from ema_pg.engine.models import train_bpe_tokenizer
    from ema_pg.prompts import PromptEncoder
    from ema_pg.tasks import build_task

    rows = [{"problem": f"What is {i}+1?", "answer": str(i + 1)} for i in range(200)]
    rows[137]["problem"] = "Add these: " + " + ".join(["1"] * 300) + "?"
    (tmp_path / "train.json").write_text(json.dumps(rows))
    (tmp_path / "amc.json").write_text(json.dumps([{"problem": "What is 2+2?", "answer": "4"}]))
    cfg = compose_cfg(["task=math", f"task.data_dir={tmp_path}", "rollout.max_new_tokens=8"])
    task = build_task(cfg.task)
    assert all(p.text != rows[137]["problem"] for p in task.sample(64, seed=cfg.seed))  # the old check's sample
    tok = train_bpe_tokenizer(task.corpus(), vocab_size=300)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match="training prompt 137 has .* tokens"):
        check_fits(cfg, gpt2, task, PromptEncoder(tok, "off"))


@pytest.mark.parametrize("where", ["file", "sys"])
def test_a_cache_folder_that_cannot_be_written_is_one_line_before_any_work(tmp_path, where):
    """An unwritable EMA_PG_CACHE was a PermissionError traceback from the lock file's folder (here a file where the
    folder should be, and /sys, which even root cannot write)."""
    from ema_pg.engine.fit import train

    (tmp_path / "afile").write_text("")
    cache = tmp_path / "afile" / "cache" if where == "file" else Path("/sys/ema_pg_cache")
    cfg = compose_cfg(["sft.steps=5", f"sft.cache_dir={cache}"], tmp_path)
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert f"sft.cache_dir {cache}: cannot write there (" in str(e.value) and "\n" not in str(e.value)
    assert "set EMA_PG_CACHE (or sft.cache_dir) to a folder you can write" in str(e.value)


def test_a_cached_base_is_checked_by_its_content_before_reuse(tmp_path, caplog):
    """One bit flipped in a cached base (same size, finite weights) was reused, and the runs' base digest changed
    without a word: the digest recorded when it was built is now compared, and the base rebuilt to it."""
    from safetensors.torch import load_file, save_file

    from ema_pg.engine.models import weights_digest
    from ema_pg.engine.policy import build_policy
    from ema_pg.engine.sft import DIGEST, LOCKS
    from ema_pg.tasks import build_task

    cfg = compose_cfg(["sft.steps=5", f"sft.cache_dir={tmp_path / 'cache'}"], tmp_path)
    task = build_task(cfg.task)
    model, _ = build_policy(cfg, task)
    cache, = (p for p in Path(cfg.sft.cache_dir).iterdir() if p.name != LOCKS)
    built = (cache / DIGEST).read_text().strip()
    assert built == weights_digest(cache) and len(built) == 16
    w = load_file(cache / "model.safetensors")
    name = sorted(w)[0]
    flat = w[name].reshape(-1).view(torch.int32)
    flat[0] ^= 1  # the lowest mantissa bit of one weight
    save_file(w, cache / "model.safetensors", metadata={"format": "pt"})
    assert weights_digest(cache) != built and torch.isfinite(w[name]).all()
    caplog.clear()
    again, _ = build_policy(cfg, task)
    assert f"not the {built} recorded when it was built" in caplog.text and "building it again" in caplog.text
    assert weights_digest(cache) == built
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_a_task_whose_demonstrations_or_corpus_changed_builds_a_new_base(tmp_path, caplog):
    """A task class whose demonstrations were edited, same config, reused the old cold start: the key now holds a
    digest of the demonstrations and the corpus, so each edit builds its own base and the old one stays."""
    from ema_pg.engine.policy import build_policy
    from ema_pg.engine.sft import LOCKS
    from ema_pg.tasks import build_task

    caplog.set_level("INFO", logger="ema_pg.engine.sft")
    cfg = compose_cfg(["sft.steps=3", f"sft.cache_dir={tmp_path / 'cache'}"], tmp_path)
    task = build_task(cfg.task)
    bases = lambda: sorted(p.name for p in Path(cfg.sft.cache_dir).iterdir() if p.name != LOCKS)
    build_policy(cfg, task)
    first = bases()
    caplog.clear()
    build_policy(cfg, task)  # unchanged: reused
    assert bases() == first and "cold start: reusing" in caplog.text
    demos = task.demonstrations
    task.demonstrations = lambda n, seed: [(p, r + " ") if i == 0 else (p, r) for i, (p, r) in enumerate(demos(n, seed))]
    caplog.clear()
    build_policy(cfg, task)  # one response of 4000 edited: a new base
    assert len(bases()) == 2 and set(first) < set(bases()) and "cold start: reusing" not in caplog.text
    corpus = task.corpus
    task.demonstrations = demos
    task.corpus = lambda: [*corpus(), "one more line"]
    build_policy(cfg, task)
    assert len(bases()) == 3


def test_a_prompt_or_demonstration_longer_than_the_context_is_refused_before_the_cold_start(tmp_path, monkeypatch):
    """A prompt of 16k characters with the cold start on was measured against the context only after the cold
    start, whose SFT asked for 25.6 GB; both are now one line once the tokenizer is trained, and no base is built."""
    from ema_pg.engine.fit import train
    from ema_pg.engine.sft import LOCKS
    from ema_pg.tasks import Prompt
    from ema_pg.tasks.toy import AdditionTask

    cfg = compose_cfg(["sft.steps=200", f"sft.cache_dir={tmp_path / 'cache'}"], tmp_path)
    bases = lambda: [p for p in Path(cfg.sft.cache_dir).iterdir() if p.name != LOCKS]
    sample = AdditionTask.sample
    monkeypatch.setattr(AdditionTask, "sample", lambda self, n, seed: [
        Prompt(text=p.text + " 12" * 5000, answer=p.answer, meta=p.meta) if i == 0 else p
        for i, p in enumerate(sample(self, n, seed))])
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert str(e.value).startswith("the model's context is 512 tokens, but training prompt 0 has ") and not bases()
    monkeypatch.setattr(AdditionTask, "sample", sample)
    demos = AdditionTask.demonstrations
    monkeypatch.setattr(AdditionTask, "demonstrations", lambda self, n, seed: [
        (p, r + " 12" * 5000) if i == 3 else (p, r) for i, (p, r) in enumerate(demos(self, n, seed))])
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert str(e.value).startswith("AdditionTask.demonstrations: demonstration 3 has ") and not bases()
    assert "model.max_positions=512; shorten it" in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_cold_start_cache_is_rebuilt_and_nan_weights_are_refused(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    from ema_pg.engine.policy import build_policy
    from ema_pg.engine.sft import DIGEST, LOCKS
    from ema_pg.tasks import build_task

    cfg = compose_cfg(["sft.steps=5", f"sft.cache_dir={tmp_path / 'cache'}"], tmp_path)  # its own: one base in it
    task = build_task(cfg.task)
    model, _ = build_policy(cfg, task)
    cache, = (p for p in Path(cfg.sft.cache_dir).iterdir() if p.name != LOCKS)
    (cache / "model.safetensors").write_bytes(b"garbage")
    again, _ = build_policy(cfg, task)
    assert "is damaged" in caplog.text and "building it again" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    w = load_file(cache / "model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in w.items()}, cache / "model.safetensors")
    (cache / DIGEST).unlink()  # a base from before bases recorded their digest
    caplog.clear()
    rebuilt, _ = build_policy(cfg, task)  # NaN weights in the cache: rebuilt, not an IndexError in the sampler
    assert "hold NaN or inf" in caplog.text and all(torch.isfinite(p).all() for p in rebuilt.parameters())
    local = compose_cfg(["model=local", f"model.path={cache}"], tmp_path)
    save_file({k: torch.full_like(v, float("nan")) for k, v in w.items()}, cache / "model.safetensors")
    with pytest.raises(ValueError, match=f"the weights at model.path={cache} hold NaN or inf"):
        build_policy(local, task)


# ---------------------------------------------------------------------- evaluate and export
def test_evaluate_checks_its_overrides_and_output_before_evaluating_and_records_the_iteration(finished_run, tmp_path,
                                                                                               capsys):
    from ema_pg.workbench.evaluate import main

    with pytest.raises(SystemExit, match="config error: rollout.max_new_tokens must be >= 1; got -5"):
        main([str(finished_run), "rollout.max_new_tokens=-5"])
    with pytest.raises(SystemExit, match="config error: unknown key trainer.num_thread: did you mean trainer.num_threads"):
        main([str(finished_run), "trainer.num_thread=1"])  # a typo: omegaconf's ConfigKeyError traceback before
    with pytest.raises(SystemExit, match="is neither a run folder .* nor a saved model"):
        main([str(tmp_path)])
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="cannot write the result to"):
        main([str(finished_run), "--out", str(blocker / "eval.json")])
    out = tmp_path / "e.json"
    main([str(finished_run), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["iteration"] == 4 and result["run_live"] is False


def test_evaluate_and_export_refuse_a_run_without_checkpoint_unless_asked_for_the_initial_policy(finished_run,
                                                                                                 tmp_path):
    import shutil

    from ema_pg.workbench.evaluate import main as evaluate
    from ema_pg.workbench.export import main as export

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoints")  # killed before its first checkpoint
    with pytest.raises(SystemExit, match="has no checkpoint yet .* ask for the initial policy"):
        evaluate([str(run), "--out", str(tmp_path / "e.json")])
    with pytest.raises(SystemExit, match="has no checkpoint yet"):
        export([str(run), str(tmp_path / "x")])
    export([str(run), str(tmp_path / "x"), "--initial"])
    assert json.loads((tmp_path / "x" / "ema_pg_source.json").read_text())["which"] == "initial"


def test_export_is_written_whole_never_mixed_into_a_folder_and_says_what_it_read(finished_run, tmp_path):
    from ema_pg.workbench.export import main as export

    out = tmp_path / "exported"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "old.bin").write_text("old")
    with pytest.raises(SystemExit, match="is not empty; give a new folder, or --overwrite"):
        export([str(finished_run), str(out)])
    assert (out / "config.json").read_text() == "{}"
    export([str(finished_run), str(out), "--overwrite"])
    assert not (out / "old.bin").exists()
    assert json.loads((out / "ema_pg_source.json").read_text())["iteration"] == 4
    with pytest.raises(SystemExit, match="is a file; give a folder"):
        export([str(finished_run), str(out / "config.json")])


def test_a_bf16_runs_anchor_is_read_as_its_fp32_master(finished_run, tmp_path):
    """The EMA anchor's master is fp32 whatever the model's dtype: reading a run whose model folder says bfloat16
    (the GPU recipes') as float32 gives the master's values, not their bf16 rounding (which made the exported
    anchor of a ZeRO-3 run at Qwen2.5-0.5B equal to its policy)."""
    import shutil

    from ema_pg.engine.policy import load_run_model

    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    conf = json.loads((run / "model" / "config.json").read_text())
    (run / "model" / "config.json").write_text(json.dumps({**conf, "dtype": "bfloat16"}))
    fp32 = load_run_model(finished_run, "anchor")[0].state_dict()
    read = load_run_model(run, "anchor")[0].state_dict()
    assert all(read[k].dtype == torch.float32 and torch.equal(read[k], fp32[k]) for k in fp32)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in fp32.values())  # bf16 rounding would have shown


def test_anchor_of_an_anchorless_run_is_one_line(tmp_path):
    from ema_pg.workbench.evaluate import main as evaluate
    from ema_pg.engine.fit import train
    from ema_pg.workbench.export import main as export

    cfg = compose_cfg(["anchor=none", "kl=none", "algo.beta=0", "algo.iterations=2", "algo.eval_every=2"], tmp_path)
    train(cfg)
    with pytest.raises(SystemExit, match="holds no anchor"):
        export([cfg.run_dir, str(tmp_path / "a"), "--anchor"])
    with pytest.raises(SystemExit, match="holds no anchor"):
        evaluate([cfg.run_dir, "--which", "anchor", "--out", str(tmp_path / "a.json")])


def test_evaluate_of_a_live_run_says_so(finished_run, tmp_path):
    from test_faults_lifecycle import holder

    from ema_pg.workbench.evaluate import run_is_live

    assert not run_is_live(finished_run)
    p = holder(finished_run)
    try:
        assert run_is_live(finished_run)
    finally:
        p.kill()
        p.wait()
    assert not run_is_live(finished_run)


# ---------------------------------------------------------------------- the Optuna search
def _study(tmp_path, **changes) -> Path:
    spec = {"study_name": "t", "storage": f"sqlite:///{tmp_path}/t.db", "n_trials": 3,
            "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"}, "overrides": [],
            "params": {"optim.lr": {"type": "float", "low": 1e-4, "high": 1e-3, "log": True}}}
    spec.update(changes)
    p = tmp_path / "study.yaml"
    p.write_text(yaml.safe_dump(spec))
    return p


@pytest.mark.parametrize("changes,match", [
    ({"params": {"optim.lr": {"type": "float", "low": 0.0, "high": 1e-3, "log": True}}}, "params.optim.lr: .*"),
    ({"params": {"kl.k": {"type": "categorical", "choices": []}}}, "params.kl.k: .*"),
    ({"pruner": {"name": "median", "n_startup_trials": -3}}, "pruner median does not take"),
    ({"pruner": {"name": "median", "no_such_arg": 1}}, "pruner median does not take"),
    # a range wider than the knob's valid one: refused at load, not when a worker draws a bad value
    ({"params": {"algo.beta": {"type": "float", "low": -0.1, "high": 0.1}}},
     "params.algo.beta=-0.1 \\(its range\\) is refused by the config: algo.beta must be >= 0"),
    ({"params": {"anchor.eta": {"type": "categorical", "choices": [0.9, 1.5]}}}, "params.anchor.eta=1.5"),
])
def test_what_optuna_itself_refuses_is_a_study_file_error(tmp_path, changes, match):
    from ema_pg.workbench.hpo import StudyFileError, load_study_spec

    with pytest.raises(StudyFileError, match=match):
        load_study_spec(_study(tmp_path, **changes))


def test_search_refuses_bad_trial_counts_and_a_storage_it_cannot_open_before_any_trial(tmp_path):
    from ema_pg.workbench.hpo import main

    f = _study(tmp_path)
    for n in ("0", "-1"):
        with pytest.raises(SystemExit, match=f"--n-trials {n}: give the study's total number of trials, >= 1"):
            main([str(f), "--n-trials", n])
    (tmp_path / "t.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(SystemExit, match="study storage sqlite:///.* cannot be opened"):
        main([str(f)])


def test_in_process_train_of_a_refused_config_leaves_no_run_folder(tmp_path):
    from ema_pg.engine.fit import command

    cfg = compose_cfg(["rollout.max_new_tokens=600"], tmp_path)  # refused once the model is built
    with open_dict(cfg):
        cfg.run_dir = str(tmp_path / "refused")
    with pytest.raises(SystemExit, match="config error: the model's context is 512 tokens"):
        command(cfg)
    assert not (tmp_path / "refused").exists()
    assert OmegaConf.select(cfg, "name")


@pytest.mark.parametrize("args, line", [
    (["trainer.num_threads=-2"], "config error: trainer.num_threads must be >= 0; got -2"),
    (["task=custom", "task.target=no_such_pkg:Task"],
     "config error: task.target=no_such_pkg:Task: cannot import no_such_pkg (No module named 'no_such_pkg'); install "
     "its package (pip install -e PATH) or put its folder on PYTHONPATH"),
])
def test_a_refusal_is_printed_once_and_leaves_no_run_folder(tmp_path, args, line):
    """A refused run says its one line once, as its last (not once by the log and once by its exit), and writes
    nothing: a bad trainer.num_threads once ended in torch's traceback with a train.log left behind."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ema_pg.train", *args, f"run_dir={tmp_path / 'run'}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and out.count(line) == 1 and out.strip().splitlines()[-1] == line, out[-2000:]
    assert "Traceback" not in out and not (tmp_path / "run").exists()


@pytest.mark.parametrize("target", ["run", "run/model", "run/checkpoints", "."])
def test_export_never_writes_into_a_run_folder_whatever_overwrite_says(finished_run, tmp_path, target):
    """The fourth fault probe's three ways to destroy a run with one export: into the run folder itself, into its
    model/ (the run's base policy: --initial and decide's base check read it), into its checkpoints/; and a folder
    that holds a run. Each is refused in one line, --overwrite or not, and the run is left as it was."""
    import shutil

    from ema_pg.workbench.export import main as export

    run = tmp_path / "parent" / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    out = tmp_path / "parent" / target
    with pytest.raises(SystemExit) as e:
        export([str(run), str(out), "--overwrite"])
    said = str(e.value)
    assert "\n" not in said and ("is a run folder" in said or "lies inside" in said or "holds the run folder" in said)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


def test_export_and_evaluate_take_the_newest_intact_checkpoint_and_say_so(finished_run, tmp_path, caplog):
    """A truncated last.ckpt beside an intact earlier checkpoint: export and evaluate read the intact one, as resume
    does, and say which in one line (they ended in a PytorchStreamReader traceback)."""
    import logging
    import shutil

    from ema_pg.engine.policy import checkpoint_iteration
    from ema_pg.workbench.export import main as export

    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=False)  # last.ckpt a copy of iter4.ckpt, not a link to it
    last = run / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in last.parent.glob("*.ckpt")) == ["iter4.ckpt", "last.ckpt"]
    last.write_bytes(last.read_bytes()[:4096])  # cut short by a full disk or a kill mid-copy
    with caplog.at_level(logging.WARNING):
        export([str(run), str(tmp_path / "x")])
    assert json.loads((tmp_path / "x" / "ema_pg_source.json").read_text())["iteration"] == 4 == checkpoint_iteration(run)
    said = [r.message for r in caplog.records if "unreadable" in r.message]
    assert len(said) == 1 and said[0].startswith("last.ckpt is unreadable (") and \
        said[0].endswith("using iter4.ckpt (iteration 4) instead")
    from ema_pg.workbench.evaluate import main as evaluate

    evaluate([str(run), "--out", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text())["iteration"] == 4
