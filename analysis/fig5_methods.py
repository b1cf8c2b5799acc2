"""Fig 5: GRPO vs EMA anchor vs EMA + Top-k forward vs EMA + Top-k reverse (learning curves, final bars).

    python analysis/fig5_methods.py --runs multirun/fig5_methods/<time> --out reproductions/fig5_methods
"""

from ema_pg.results import METHODS, ablation_report, figure_cli


def main(argv=None) -> dict:
    runs, out = figure_cli("fig5_methods", __doc__, argv)
    return ablation_report(runs, out, name="fig5_methods", x="method", order=METHODS, title="Fig 5: EMA anchor and Top-k KL vs GRPO")


if __name__ == "__main__":
    main()
