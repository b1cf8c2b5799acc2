"""One home per default: a knob's default is written once.

- schema knobs: in the dataclasses of ema_pg/config/schema.py; group option files state only what they
  change (a file's `name` naming the option itself is its identity, not a default);
- estimator parameters: in ema_pg.kl.ESTIMATORS; the functions take them as required keywords
  and the kl option files do not restate them;
- task knobs: in conf/task/<name>.yaml; the task classes take them as required keywords;
- loss coefficients: in AlgoConfig; policy_loss takes them as a LossSpec whose fields have no defaults.
Each test fails when a second default appears, whether or not it agrees with the first.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from omegaconf import OmegaConf

from ema_pg import config as C
from ema_pg.anchors import SCHEMES
from ema_pg.kl import ESTIMATORS
from ema_pg.tasks import TASKS, common_defaults

SCHEMA = {"model": C.ModelConfig, "rollout": C.RolloutConfig, "kl": C.KLConfig, "anchor": C.AnchorConfig,
          "algo": C.AlgoConfig, "trainer": C.TrainerConfig, "logger": C.LoggerConfig}


def defaults_of(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def option_values(group: str, path) -> dict:
    """The keys an option file sets for its group (a _global_ file: its entry under the group)."""
    node = OmegaConf.load(path)
    text = path.read_text()
    if node is None:
        return {}
    if "@package _global_" in text:
        node = node.get(group, {})
    return OmegaConf.to_container(node, resolve=False) or {}


@pytest.mark.parametrize("group", sorted(SCHEMA))
def test_group_options_do_not_restate_schema_defaults(group):
    defaults = defaults_of(SCHEMA[group])
    for path in sorted((C.CONF_DIR / group).glob("*.yaml")):
        for key, value in option_values(group, path).items():
            assert key in defaults, f"{path}: {key} is not a {group} knob"
            if key == "name" and value == path.stem:
                continue  # the option's own name
            assert value != defaults[key], (f"{path} restates {group}.{key}={value!r}, the default in "
                                            f"{SCHEMA[group].__name__}; delete it from the file")


def test_root_config_states_no_defaults():
    root = OmegaConf.load(C.CONF_DIR / "config.yaml")
    assert set(root) <= {"defaults", "hydra"}, set(root) - {"defaults", "hydra"}


def test_kl_options_and_functions_leave_parameter_defaults_to_the_registry():
    for name, spec in ESTIMATORS.items():
        sig = inspect.signature(spec.fn)
        with_default = [p for p in sig.parameters.values() if p.default is not inspect.Parameter.empty]
        assert not with_default, f"{spec.fn.__name__} gives {[p.name for p in with_default]} a default; the registry has it"
        assert set(spec.defaults) == {p for p in sig.parameters if p != "inp"}, name
        opt = C.CONF_DIR / "kl" / f"{name}.yaml"
        restated = set(option_values("kl", opt)) & set(spec.defaults)
        assert not restated, f"{opt} restates {restated}: ESTIMATORS[{name!r}].defaults is their home"


def test_task_knobs_have_their_option_file_as_home():
    from ema_pg.tasks.plugins import class_knobs

    for name, cls in TASKS.items():
        declared = class_knobs(cls)  # its __init__'s keywords, or its Knobs record's fields
        with_default = [k for k, v in declared.items() if v != "???"]
        assert not with_default, f"{cls.__name__} gives {with_default} a default; conf/task/{name}.yaml has it"
        own = OmegaConf.load(C.CONF_DIR / "task" / f"{name}.yaml")
        assert list(own.defaults) == ["_common", "_self_"], f"conf/task/{name}.yaml must include the common task knobs"
        knobs = set(own) - {"name", "defaults"}
        assert knobs == set(declared), name
        assert not knobs & set(common_defaults()), f"conf/task/{name}.yaml restates a common knob"


def test_loss_coefficients_have_no_second_default():
    from ema_pg.losses import SURROGATES, LossSpec, policy_loss, ppo_surrogate

    for fn in (policy_loss, ppo_surrogate, LossSpec, *{cls for cls, _ in SURROGATES.values()}):
        sig = inspect.signature(fn)
        for knob in ("beta", "spec", "eps_low", "eps_high", "loss_agg", "surrogate", "clip_ratio_c", "entropy_coef"):
            if knob in sig.parameters:
                assert sig.parameters[knob].default is inspect.Parameter.empty, (fn.__name__, knob)


def test_advantage_knobs_have_algoconfig_as_their_only_home():
    """algo.adv_norm, gamma, lam and global_kl_scale were restated as defaults of AdvantageInputs and advantages()."""
    from ema_pg.advantages import AdvantageInputs
    from ema_pg.losses import advantages

    fields = {f.name: f for f in dataclasses.fields(AdvantageInputs)}
    algo = defaults_of(C.AlgoConfig)
    for knob, algo_key in (("norm", "adv_norm"), ("gamma", "gamma"), ("lam", "lam"), ("global_kl_scale", "global_kl_scale")):
        assert algo_key in algo
        f = fields[knob]
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, knob
    assert inspect.signature(advantages).parameters["norm"].default is inspect.Parameter.empty


def test_the_reports_read_the_estimators_clip_defaults_from_the_registry(monkeypatch):
    """Fig 9's default clips were typed again in workbench/reports.py."""
    import importlib

    import ema_pg.workbench.reports as reports

    spec = ESTIMATORS["topk_forward"]
    monkeypatch.setitem(ESTIMATORS, "topk_forward", dataclasses.replace(spec, defaults={**spec.defaults, "iw_clip": (0.0, 3.5)}))
    try:
        assert importlib.reload(reports)._DEFAULT_CLIP["forward"] == "[0, 3.5]"
    finally:
        monkeypatch.undo()
        importlib.reload(reports)
    assert reports._DEFAULT_CLIP == {"forward": "[0, 2.5]", "reverse": "[0, 10]"}


def test_the_architecture_keys_are_written_once():
    """A stage's fixed keys restated the cold start's architecture keys (runs.STAGE_FIXED beside sft.ARCH_KEYS)."""
    from ema_pg.engine.runs import STAGE_FIXED

    assert {f"model.{k}" for k in C.ARCH_KEYS} <= set(STAGE_FIXED)
    assert set(C.ARCH_KEYS) <= {f.name for f in dataclasses.fields(C.ModelConfig)}


def test_the_values_in_force_are_written_into_a_copy_never_into_the_config_given():
    """``with_defaults`` states the registry defaults in the config a run saves; the live config keeps its nulls."""
    from helpers import compose_cfg

    from ema_pg.config import with_defaults

    cfg = compose_cfg(["kl=topk_reverse", "anchor=ema"])
    before = OmegaConf.to_yaml(cfg)
    out = with_defaults(cfg)
    assert OmegaConf.to_yaml(cfg) == before and cfg.anchor.eta is None and cfg.kl.k is None
    assert out.anchor.eta == SCHEMES["ema"].defaults["eta"] and out.kl.k == ESTIMATORS["topk_reverse"].defaults["k"]
