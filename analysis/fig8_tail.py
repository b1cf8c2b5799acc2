"""Fig 8: truncated Top-k KL vs + tail without off-policy correction vs + tail with it, per direction.

    python analysis/fig8_tail.py --runs multirun/fig8_tail/<time>
"""

from ema_pg.results import ablation_report, figure_cli

ORDER = ["truncated", "tail w/o off-policy corr.", "tail w/ off-policy corr."]


def main(argv=None) -> dict:
    runs, out = figure_cli("fig8_tail", __doc__, argv)
    return ablation_report(runs, out, name="fig8_tail", x="tail_variant", hue="direction", order=ORDER,
                           title="Fig 8: tail and off-policy correction of Top-k KL")


if __name__ == "__main__":
    main()
