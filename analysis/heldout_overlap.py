"""How much the suite's held-out splits overlapped its training problems under the rule its cells ran with.

The suite's cells (``reproductions/reasoning_gym/suite``, code 609a9d2) held out the first ``eval_size`` distinct
question *texts* of each dataset's evaluation seed and redrew a training item only when its text was a held-out
question's. Problems are now keyed by :func:`ema_pg.tasks.reasoning_gym.problem_key` (``4 + 1`` is ``1 + 4``). This
script rebuilds that old split and the old training draw from the same reasoning-gym datasets and measures, per
dataset:

- ``shared``: held-out questions whose problem a training draw of the old rule asked in another form (over
  ``--draws`` admissible draws, far more than a cell's 300 x 16);
- ``raw_hit``: the share of the dataset's raw training items whose problem the old split held out (how much the
  first-distinct split favoured frequent problems);
- ``admitted_hit``: the share of admissible old-rule training draws that asked a held-out problem;
- ``problems``: the distinct problems its 960 evaluation items ask, and what the new split holds out.

    python analysis/heldout_overlap.py --out reproductions/reasoning_gym/suite/heldout

Writes ``overlap.csv`` and ``overlap.md``. No training is run; the cells' final policies were not kept, so the suite
cannot be re-evaluated on problem-disjoint splits.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pandas as pd
import yaml

SUITE = "sweeps/scale/reasoning_gym_suite_claims.yaml"


def old_split(ds, eval_size: int, tries: int) -> list[dict]:
    """The rule the cells ran with: the first ``eval_size`` distinct question texts of items 0, 1, ..."""
    seen, out = set(), []
    for i in range(tries):
        e = ds[i]
        if e["question"] not in seen:
            seen.add(e["question"])
            out.append(e)
            if len(out) == eval_size:
                break
    return out


def measure(root: Path, draws: int) -> pd.DataFrame:
    from ema_pg.tasks import build_task
    from ema_pg.tasks.reasoning_gym import EVAL_TRIES, TRAIN_SPAN, problem_key

    mix = yaml.safe_load((root / SUITE).read_text())["task"]
    t = build_task({"name": "reasoning_gym", "datasets": mix["datasets"], "seed": 0, "eval_size": mix["eval_size"],
                    "system_prompt": "default"})
    old = {n: old_split(t.eval_ds[n], t.eval_size, EVAL_TRIES * t.eval_size) for n in t.names}
    texts = {q["question"] for s in old.values() for q in s}
    rng, rows = random.Random("overlap-0"), []
    admitted: dict[str, list] = {n: [] for n in t.names}
    raw: dict[str, list] = {n: [] for n in t.names}
    while sum(map(len, admitted.values())) < draws:  # the old draw: dataset and item drawn again on a held-out text
        name = rng.choice(t.names)
        e = t.train_ds[name][rng.randrange(TRAIN_SPAN)]
        raw[name].append(problem_key(name, e))
        if e["question"] not in texts:
            admitted[name].append(problem_key(name, e))
    for n in t.names:
        held = {problem_key(n, q) for q in old[n]}
        trained = set(admitted[n])
        rows.append({"dataset": n, "held_out": len(old[n]), "shared": len(held & trained),
                     "raw_hit": sum(k in held for k in raw[n]) / len(raw[n]),
                     "admitted_hit": sum(k in held for k in admitted[n]) / len(admitted[n]),
                     "problems": t.found[n], "new_held_out": len(t.eval_splits()[n])})
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--draws", type=int, default=20_000)
    a = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    df = measure(root, a.draws)
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "overlap.csv", index=False, float_format="%.4f")
    total = df["shared"].sum(), df["held_out"].sum()
    lines = ["# The suite's held-out splits, held out by text: how far they overlapped training's problems", "",
             f"Written by `python analysis/heldout_overlap.py --out {a.out}` over {a.draws:,} training draws of the "
             "rule the cells ran with (its docstring says what each column counts).", "",
             "| dataset | held out (old) | shared a problem with training | raw draws on held-out problems | "
             "admitted draws on held-out problems | problems found | held out now |", "|---|---|---|---|---|---|---|"]
    for _, r in df.iterrows():
        lines.append(f"| {r['dataset']} | {r['held_out']} | {r['shared']} ({r['shared'] / r['held_out']:.0%}) | "
                     f"{r['raw_hit']:.0%} | {r['admitted_hit']:.0%} | {r['problems']} | {r['new_held_out']} |")
    lines += ["", f"In all, {total[0]} of the {total[1]} held-out questions ({total[0] / total[1]:.0%}) asked a problem "
              "that training asked in another form."]
    (a.out / "overlap.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
