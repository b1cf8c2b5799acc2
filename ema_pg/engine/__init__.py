"""The engine: what runs the algorithm on real hardware and keeps a run's folder.

The Lightning adapter around :func:`ema_pg.step.rl_step` (:mod:`.module`), the anchor callback
that applies a scheme of :mod:`ema_pg.anchors` to the models it holds (:mod:`.anchor`), the
strategies (DDP, DeepSpeed), models, attention, LoRA, policy building and the cold-start SFT,
the run folder's lifecycle (:mod:`.runs`), the stability monitor, plots and evaluation. The
engine imports the algorithm, never the workbench (``make lint-imports`` checks it).
"""
