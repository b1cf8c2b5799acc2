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

# A CPU run beside other work (a sweep's second worker, decide --workers 2, a laptop's other programs): torch's
# OpenMP threads spin at every barrier before they sleep, and on a loaded machine the spinning takes the cores the
# work needs (the demo's SFT step: about 10x slower beside one busy process per core). Threads that sleep at once
# cost nothing measurable idle on an Intel Xeon (benchmarks/results/cpu_load_cpu.json) but 1.14x on an AMD EPYC
# (cpu_load_amd_cpu.json; docs/training.md). OpenMP reads the
# setting when torch loads it, so it holds where ema_pg is imported before torch (every ema-pg command, and the
# processes they start); your own OMP_WAIT_POLICY wins, and EMA_PG_THREADS=torch leaves OpenMP's default.
if os.environ.get("EMA_PG_THREADS") != "torch":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
