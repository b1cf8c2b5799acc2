"""Our ablation: training with the printed tail (tail=paper) vs the corrected, unbiased tail.

    python analysis/tail_bias_sweep.py --runs multirun/tail_bias/<time> --out reproductions/tail_bias

(``analysis/tail_bias.py`` measures the same bias exactly, without training.)
"""

from ema_pg.results import ablation_report, figure_cli


def main(argv=None) -> dict:
    runs, out = figure_cli("tail_bias", __doc__, argv)
    return ablation_report(runs, out, name="tail_bias", x="kl.tail", hue="direction", order=["paper", "corrected"],
                           title="Top-k KL tail: printed (paper) vs corrected")


if __name__ == "__main__":
    main()
