"""vLLM rollouts (optional ``gpu`` extra). Needs CUDA and ``pip install -e .[gpu]``."""

from __future__ import annotations


class VLLMSampler:
    def __init__(self, tokenizer, cfg):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("rollout=vllm needs a CUDA GPU; on this machine use rollout=hf (the default)")
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise RuntimeError("rollout=vllm needs the gpu extra: pip install -e '.[gpu]'") from None
        raise NotImplementedError("the vLLM sampler is not built yet; use rollout=hf")
