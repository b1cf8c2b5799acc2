"""Lightning strategies for ``trainer=deepspeed``: the stock one on CUDA, a CPU subclass elsewhere.

``trainer.strategy=deepspeed_stage_2`` / ``deepspeed_stage_3`` builds Lightning's
``DeepSpeedStrategy`` with the run's DeepSpeed config (ZeRO stage, gradient clipping from
``algo.grad_clip``). Without CUDA, :class:`CPUDeepSpeedStrategy` is used instead: the same
strategy minus three CUDA-only steps of Lightning 2.6 (the accelerator check in
``setup_environment``, the device-index check in ``setup_distributed``, and the ``device_rank``
it hands DeepSpeed, which is None on CPU). It exists for tests and CPU runs of the scale path
(``DS_ACCELERATOR=cpu``, gloo); on a GPU node the stock strategy runs.

The helpers that ask about ZeRO-3 partitioning without importing DeepSpeed are in :mod:`ema_pg.dist`.
"""

from __future__ import annotations

import os

import torch

from ..config import is_deepspeed


def deepspeed_config(cfg) -> dict:
    stage = int(str(cfg.trainer.strategy).rsplit("_", 1)[-1])
    return {
        "zero_optimization": {"stage": stage},
        "gradient_clipping": float(cfg.algo.grad_clip),
        "train_micro_batch_size_per_gpu": 1,  # one RL iteration per step; the step sizes its own batches
        "zero_allow_untested_optimizer": True,  # the torch AdamW of configure_optimizers
    }


def build_strategy(cfg):
    """The Lightning strategy for ``cfg.trainer`` (a name for the stock ones, an object for DeepSpeed)."""
    name = str(cfg.trainer.strategy)
    if not is_deepspeed(cfg):
        return name
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if torch.cuda.is_available():
        return DeepSpeedStrategy(config=deepspeed_config(cfg))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return _cpu_strategy_class()(config=deepspeed_config(cfg), process_group_backend="gloo")


def _cpu_strategy_class():
    import deepspeed
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning's DeepSpeedStrategy on CPU processes (gloo); see the module docstring."""

        strategy_name = "deepspeed_cpu"

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)  # skips the CUDAAccelerator check

        def setup_distributed(self) -> None:
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()  # without _validate_device_index_selection (index None on CPU)

        def init_deepspeed(self) -> None:
            original = deepspeed.initialize

            def initialize(*args, **kwargs):
                a = kwargs.get("args")
                if a is not None and getattr(a, "device_rank", 0) is None:
                    a.device_rank = self.local_rank  # DeepSpeed checks device_rank >= 0
                return original(*args, **kwargs)

            deepspeed.initialize = initialize
            try:
                super().init_deepspeed()
            finally:
                deepspeed.initialize = original

    return CPUDeepSpeedStrategy


def __getattr__(name):
    if name == "CPUDeepSpeedStrategy":  # built on first use: importing DeepSpeed is slow and optional
        cls = _cpu_strategy_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
