"""Samplers behind one interface (:class:`Sampler`): ``hf`` (default) and ``vllm`` (the scale or gpu extra)."""

from __future__ import annotations

from .base import OnStop, Rollouts, Sampler
from .hf import HFSampler, sample_token

SAMPLERS = ("hf", "vllm")  #: rollout=<name>: the sampler backends build_sampler builds


def build_sampler(cfg, tokenizer, lora: bool = False) -> Sampler:
    """The sampler of ``rollout=<name>``; ``lora``: the policy has LoRA adapters (the HF sampler's static cache,
    when ``rollout.static_cache`` is null, is then not tried)."""
    if cfg.name == "hf":
        static = False if cfg.static_cache is None and lora else cfg.static_cache
        return HFSampler(tokenizer, max_obs_tokens=cfg.max_obs_tokens, static_cache=static)
    if cfg.name == "vllm":
        from .vllm import VLLMSampler

        return VLLMSampler(tokenizer, cfg)
    raise ValueError(f"unknown rollout backend {cfg.name!r}; choose one of: {', '.join(SAMPLERS)}")


__all__ = ["SAMPLERS", "HFSampler", "OnStop", "Rollouts", "Sampler", "build_sampler", "sample_token"]
