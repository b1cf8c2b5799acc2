"""Fig 7: EMA coefficient eta x KL direction (Top-k KL, k = 32; eta = 1 is a fixed anchor).

    python analysis/fig7_eta_direction.py --runs multirun/fig7_eta_direction/<time>
"""

from ema_pg.results import ablation_report, figure_cli


def main(argv=None) -> dict:
    runs, out = figure_cli("fig7_eta_direction", __doc__, argv)
    return ablation_report(runs, out, name="fig7_eta_direction", x="anchor.eta", hue="direction", title="Fig 7: EMA eta x KL direction")


if __name__ == "__main__":
    main()
