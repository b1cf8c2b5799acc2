"""Fig 6: k of Top-k (reverse) KL in EMA-PG (k = 0 is the sampled estimator).

    python analysis/fig6_k.py --runs multirun/fig6_k/<time> --out reproductions/fig6_k
"""

from ema_pg.results import ablation_report, figure_cli


def main(argv=None) -> dict:
    runs, out = figure_cli("fig6_k", __doc__, argv)
    return ablation_report(runs, out, name="fig6_k", x="kl.k", title="Fig 6: k of Top-k reverse KL")


if __name__ == "__main__":
    main()
