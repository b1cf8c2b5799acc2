"""A run's config: the typed schema (:mod:`.schema`: every knob's one default, each group's own checks), its
composition from ``conf/`` and the command line (:mod:`.compose`), and start-up validation, which binds the run's
estimator and anchor scheme once (:mod:`.validation`).

The YAML files are validated against the schema's dataclasses when the config is composed (an unknown key or a
wrongly typed value fails there); :func:`validate` then checks ranges and combinations, with messages that say
what to change. The machine's checks (packages, CUDA, engine kernels) are the engine's: :mod:`ema_pg.engine.install`.
"""

from .compose import CONF_DIR, compose, flatten, overrides_problem, register_configs
from .schema import (
    ANCHOR_ALIGNS, ARCH_KEYS, DEEPSPEED_STRATEGIES, DTYPES, JOB_TYPES, LOGGERS, MIN_TEMPERATURE, SFT_SCHEDULES, TRACKERS,
    AlgoConfig,
    AnchorConfig, Config, ConfigError, KLConfig, LoggerConfig, ModelConfig, MonitorConfig, OptimConfig, RolloutConfig,
    SFTConfig, TrainerConfig, eval_settings_problem, is_deepspeed, is_tiny,
)
from .validation import (
    CHECKED_GROUPS, KL_PARAMS, Binding, build_estimator, build_scheme, kl_params, stated_world_size, step_records,
    task_record, validate, validate_model, validate_world, with_defaults,
)

__all__ = [
    "ANCHOR_ALIGNS", "ARCH_KEYS", "CHECKED_GROUPS", "CONF_DIR", "DEEPSPEED_STRATEGIES", "DTYPES", "KL_PARAMS",
    "JOB_TYPES", "LOGGERS", "MIN_TEMPERATURE", "SFT_SCHEDULES", "TRACKERS", "AlgoConfig", "AnchorConfig", "Binding", "Config", "ConfigError",
    "KLConfig", "LoggerConfig", "ModelConfig", "MonitorConfig", "OptimConfig", "RolloutConfig", "SFTConfig",
    "TrainerConfig", "build_estimator", "build_scheme", "compose", "eval_settings_problem",
    "flatten", "is_deepspeed", "is_tiny", "kl_params", "overrides_problem", "register_configs", "stated_world_size",
    "step_records", "task_record",
    "validate", "validate_model", "validate_world", "with_defaults",
]
