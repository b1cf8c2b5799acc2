"""Samplers behind one interface (:class:`Sampler`): ``hf`` (default) and ``vllm`` (the scale or gpu extra)."""

from __future__ import annotations

from .base import OnStop, Rollouts, Sampler
from .hf import HFSampler, sample_token


def build_sampler(cfg, tokenizer) -> Sampler:
    if cfg.name == "hf":
        return HFSampler(tokenizer, max_obs_tokens=cfg.max_obs_tokens, static_cache=cfg.static_cache)
    if cfg.name == "vllm":
        from .vllm import VLLMSampler

        return VLLMSampler(tokenizer, cfg)
    raise ValueError(f"unknown rollout backend {cfg.name!r}; choose one of: hf, vllm")


__all__ = ["HFSampler", "OnStop", "Rollouts", "Sampler", "build_sampler", "sample_token"]
