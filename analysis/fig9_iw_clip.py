"""Fig 9: importance-weight clip range x KL direction, and group vs global advantage normalization.

    python analysis/fig9_iw_clip.py --runs multirun/fig9_iw_clip/<time>

Writes two reports: ``fig9_iw_clip`` (clip x direction, group normalization) and
``fig9_adv_norm`` (normalization x direction, each direction at its default clip).
"""

from ema_pg.results import ablation_report, figure_cli

DEFAULT_CLIP = {"forward": "[0, 2.5]", "reverse": "[0, 10]"}


def main(argv=None) -> dict:
    runs, out = figure_cli("fig9_iw_clip", __doc__, argv)
    group = runs[runs["algo.adv_norm"] == "group"] if "algo.adv_norm" in runs else runs
    res = ablation_report(group, out, name="fig9_iw_clip", x="iw_clip", hue="direction", order=["[1, 1]", "[0, 2.5]", "[0, 10]"],
                          title="Fig 9 (left): IW clip range x KL direction")
    default = runs[runs.apply(lambda r: DEFAULT_CLIP.get(r["direction"]) == r.get("iw_clip"), axis=1)]
    if len(default) and "algo.adv_norm" in runs:
        res["adv_norm"] = ablation_report(default, out, x="algo.adv_norm", hue="direction", name="fig9_adv_norm",
                                          order=["group", "global"], title="Fig 9 (right): advantage normalization")
    return res


if __name__ == "__main__":
    main()
