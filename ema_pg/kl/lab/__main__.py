"""``python -m ema_pg.kl.lab``: the estimator lab from the command line.

    python -m ema_pg.kl.lab --all                       # the report, reproductions/estimator_lab/
    python -m ema_pg.kl.lab k3 topk_reverse[paper]      # verdicts of some entries, printed
    python -m ema_pg.kl.lab --list                      # the entries and their sources
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ema_pg.kl.lab", description=__doc__.split("\n")[0])
    ap.add_argument("entries", nargs="*", help="entry names (see --list); their verdicts are printed")
    ap.add_argument("--all", action="store_true", help="write the whole report to --out")
    ap.add_argument("--out", type=Path, default=Path("reproductions/estimator_lab"),
                    help="the report's folder (made if missing; its parent must exist)")
    ap.add_argument("--list", action="store_true", help="list the entries")
    args = ap.parse_args(argv)

    from . import ENTRIES, verdicts

    if args.list:
        for name, e in ENTRIES.items():
            print(f"{name:40s} {e.target:8s} {e.source}")
        return 0
    unknown = [n for n in args.entries if n not in ENTRIES]
    if unknown:
        print(f"error: unknown entr{'y' if len(unknown) == 1 else 'ies'} {unknown}; `--list` shows them", file=sys.stderr)
        return 2
    if args.all and (args.out.exists() and not args.out.is_dir() or args.out.suffix in (".md", ".png", ".csv")
                     or not args.out.parent.is_dir()):
        why = ("is a file" if args.out.exists() and not args.out.is_dir() else
               "names a file, not a folder" if args.out.suffix in (".md", ".png", ".csv") else
               f"has no parent folder {args.out.parent}")
        print(f"error: --out {args.out} {why}: give the report's folder (README.md, CSVs and the figure go in it)",
              file=sys.stderr)
        return 2
    if not args.all and not args.entries:
        ap.print_usage(sys.stderr)
        print("error: give entry names, --all or --list", file=sys.stderr)
        return 2
    for name in args.entries:
        v = verdicts(ENTRIES[name])
        cells = [f"{k.replace('_', ' ')}: {v[k]}" + (f" ({v[k + '_rel']:.3g})" if v[k] == "biased" else "")
                 for k in ("value_on", "value_off", "gradient_on", "gradient_off")]
        print(f"{name} [{v['target']} KL]: " + "; ".join(cells) + f"; follows {v['follows_on']} / {v['follows_off']}")
    if args.all:
        from tqdm.auto import tqdm

        from .report import write_all

        bar = tqdm(total=len(ENTRIES) + 2, desc="estimator lab", unit="step")
        write_all(args.out, progress=lambda what: (bar.set_postfix_str(what[:30]), bar.update(1)))
        bar.close()
        print(f"report: {args.out / 'README.md'}  figure: {args.out / 'estimator_lab.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
