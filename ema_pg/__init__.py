"""ema-pg: GRPO with an EMA anchor and Top-k KL (arXiv 2602.04417).

Importing it changes nothing in the process: a command applies its process policy where it starts
(:func:`ema_pg.process.command_start`)."""

# the process policy's names, here for one release where scripts imported them from the package (docs/changes.md)
from .process import others_running, rl_threads_default, thread_wait_default, threads_chosen  # noqa: F401

__version__ = "0.1.0"
