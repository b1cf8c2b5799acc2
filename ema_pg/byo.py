"""``python -m ema_pg.byo``: write the bring-your-own examples of docs/byo.md. The code is :mod:`ema_pg.workbench.byo`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.byo import main  # noqa: E402

if __name__ == "__main__":
    main()
