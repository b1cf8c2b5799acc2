"""ema-pg: GRPO with an EMA anchor and Top-k KL (arXiv 2602.04417)."""

__version__ = "0.1.0"
