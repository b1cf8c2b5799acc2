"""The process policy of an ema-pg command: settings torch's libraries read as they start, applied where a command
starts (:func:`command_start`, the first thing each ``python -m ema_pg.X`` does), never at import: a library user who
imports ``ema_pg`` or an estimator gets no change to their environment and no read of the machine.

- ``MKL_CBWR=AUTO,STRICT`` unless set (:data:`MKL_DEFAULT`): see below.
- the OpenMP waiting (:func:`thread_wait_default`) and, where the RL iterations begin, their threads
  (:func:`rl_threads_default`, applied by the engine).

Nothing here imports torch: the settings must be in the environment before torch loads OpenMP and before MKL's first
call.
"""

from __future__ import annotations

import os

# A resumed run repeats the uninterrupted one bit for bit only if a matrix product gives the same bits
# for the same numbers wherever they lie in memory. MKL (torch's CPU BLAS) otherwise picks kernels by
# the operands' alignment, so a product over a view of a cache (the sampler's decode on the rows that go
# on) can differ in the last bit from the same product over a fresh tensor. Strict conditional numerical
# reproducibility keeps the fastest code path of this CPU and costs nothing measurable
# (benchmarks/README.md); set MKL_CBWR yourself to choose otherwise. It is read at MKL's first call,
# so it works as long as nothing has multiplied matrices before the command starts.
MKL_DEFAULT = ("MKL_CBWR", "AUTO,STRICT")


def others_running(reads: int = 5, gap_s: float = 0.002) -> int:
    """Threads runnable on this machine besides this one (Linux's ``procs_running``): the fewest over ``reads`` reads
    ``gap_s`` apart, since a busy process is runnable at every read and a command starting or ending is not; 0 where
    the kernel does not say."""
    import time

    seen = []
    for i in range(reads):
        try:
            with open("/proc/stat") as f:
                line = next((ln for ln in f if ln.startswith("procs_running ")), "procs_running 1")
            seen.append(max(0, int(line.split()[1]) - 1))
        except (OSError, ValueError):
            return 0
        if i + 1 < reads:
            time.sleep(gap_s)
    return min(seen)


def thread_wait_default(env: dict, others, cpus: int) -> dict:
    """The OpenMP waiting a run gets unless the user chose (their ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins,
    and ``EMA_PG_THREADS=torch`` leaves OpenMP's default). torch's threads spin at every barrier before they sleep
    (GNU OpenMP: 300,000 spins); beside other work the spinning takes the cores the work needs. A machine on which
    ``others()`` runnable threads and this run's threads (``OMP_NUM_THREADS``, else one per CPU) are more than its
    ``cpus`` gets ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps at once); one with room spins 10,000 times,
    then sleeps (``GOMP_SPINCOUNT=10000``), which costs nothing measurable idle where sleeping at once does.
    ``others`` is asked only when the user has not chosen (a command's child processes inherit its choice, so they
    never read the machine). Measured: benchmarks/results/cpu_load_default_amd_cpu.json (benchmarks/README.md,
    docs/training.md)."""
    if env.get("EMA_PG_THREADS") == "torch" or "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    try:
        threads = int(env.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        threads = cpus
    return {"OMP_WAIT_POLICY": "PASSIVE"} if others() + threads > cpus else {"GOMP_SPINCOUNT": "10000"}


def threads_chosen(env: dict) -> bool:
    """Whether the environment chose torch's thread count (``OMP_NUM_THREADS``, or ``EMA_PG_THREADS=torch``: OpenMP's
    and torch's own defaults)."""
    return env.get("EMA_PG_THREADS") == "torch" or bool(env.get("OMP_NUM_THREADS"))


def rl_threads_default(env: dict, others, cpus: int, threads: int) -> int | None:
    """The torch threads a run's RL iterations get where the user has not chosen (their ``OMP_NUM_THREADS`` or
    ``EMA_PG_THREADS=torch`` wins; ``trainer.num_threads`` is the trainer's to apply): None (torch's ``threads``) where
    ``others()`` runnable threads and these fit the machine's ``cpus``; else the room left, at least one. Asked once,
    where the RL iterations begin (a resume keeps the count its run began with: ``RLModule``). Their steps are small,
    and beside other work a sleeping thread waits for a core at every parallel region. With it the demo beside one
    busy process per core took 1.77x its idle time (benchmarks/results/cpu_load_demo_rl_amd_cpu.json); with the
    waiting alone, on another day, 2.10x (cpu_load_default_amd_cpu.json, cpu_load_demo_amd_cpu.json; docs/training.md)."""
    if threads_chosen(env):
        return None
    busy = others()
    return max(1, cpus - busy) if busy + threads > cpus else None


def command_start(env=None) -> dict:
    """Apply the process policy to ``env`` (default: this process's environment, which the processes a command starts
    inherit) where the user has not chosen; the settings it made. Idempotent: a second call (a child process, whose
    environment holds the first call's choice) reads nothing and changes nothing."""
    env = os.environ if env is None else env
    made = {}
    if MKL_DEFAULT[0] not in env:
        made[MKL_DEFAULT[0]] = MKL_DEFAULT[1]
    made.update(thread_wait_default(dict(env), others_running, os.cpu_count() or 1))
    env.update(made)
    return made
