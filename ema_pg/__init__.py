"""ema-pg: GRPO with an EMA anchor and Top-k KL (arXiv 2602.04417)."""

import os

# A resumed run repeats the uninterrupted one bit for bit only if a matrix product gives the same bits
# for the same numbers wherever they lie in memory. MKL (torch's CPU BLAS) otherwise picks kernels by
# the operands' alignment, so a product over a view of a cache (the sampler's decode on the rows that go
# on) can differ in the last bit from the same product over a fresh tensor. Strict conditional numerical
# reproducibility keeps the fastest code path of this CPU and costs nothing measurable
# (benchmarks/README.md); set MKL_CBWR yourself to choose otherwise. It is read at MKL's first call,
# so it works as long as nothing has multiplied matrices before ema_pg is imported.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
