"""ema-pg's Hydra plugins: the Ray launcher (``hydra/launcher=ema_pg_ray``)."""
