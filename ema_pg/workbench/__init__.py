"""The workbench: what researchers do with finished runs and sweeps.

Reading runs (:mod:`.results`), the reports of the sweeps and the paper's tables (:mod:`.reports`,
:mod:`.table2`, :mod:`.table3`), one command per reproduction (:mod:`.reproduce`), Optuna searches
(:mod:`.hpo`: ``python -m ema_pg.hpo``), exporting a run's model (:mod:`.export`) and the bring-your-own examples (:mod:`.byo`).
It imports the engine and the algorithm; nothing below imports it.
"""
