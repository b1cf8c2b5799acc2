"""``python -m ema_pg.pilot PLAN``: a pilot that picks what a plan will decide on, by a rule fixed before its first run.

A pilot answers "on which datasets (evaluation splits) does RL move this policy?" so that a decision plan asks its
claims where there is something to see. Its pick can steer the result if the rule is written after some runs were
seen, or applied by hand. Here the rule is part of the pilot's plan (YAML, committed before the first run):

    sweep: reasoning_gym_suite            # sweeps/<sweep>.yaml
    scale: reasoning_gym_suite_pilot      # its scale overlay
    methods: [grpo, ema, ema_topk_reverse]
    seeds: [1, 2]                         # seeds the decision plan will not use
    overrides: [sft.seed=0]               # optional: every cell's extra overrides
    runs: runs/reproduce/my-pilot         # optional: the cells' run folder
    rule: {pick: 5, above: 0.0}           # the pick: the `pick` splits with the largest mean gain, each above `above`

A split's **gain** in a cell is its held-out score after RL minus before (the cold start's evaluation at iteration
0). The rule ranks the splits by their mean gain over every cell and picks the first ``pick`` whose mean gain is above
``above``; with fewer such splits it picks nothing, and the pilot is to be widened before a plan is registered.

The command

1. registers the plan at its first start (``registered.json`` beside it: the plan's and its sweep files' sha256,
   when, the commit), and refuses to register a plan whose run folder already holds a finished cell: a rule written
   after runs were seen is not blind. Later starts refuse an edited plan or sweep file in one line;
2. runs the (method, seed) cells that have not finished, ``--workers`` at a time, by the sweep's per-cell command
   (:func:`ema_pg.workbench.studies.decide.cell_command`);
3. records every finished cell's per-split scores before and after RL in ``pilot_cells.csv`` beside the plan (small:
   commit it; a fresh machine then runs only the rest);
4. once every cell is in the ledger, applies the rule to the ledger alone and writes ``pick.csv`` and ``pick.md``.
   Until then no gain is shown (``--status`` counts the cells).

    python -m ema_pg.pilot reproductions/x/pilot/pilot.yaml --workers 2
    python -m ema_pg.pilot reproductions/x/pilot/pilot.yaml --status
"""

from __future__ import annotations

import hashlib
import json
import math
import signal
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from ...cli import PACKAGE_ROOT as ROOT
from ...cli import command_parser

LEDGER = "pilot_cells.csv"  #: every finished cell's per-split scores before and after RL, beside the plan
REGISTERED = "registered.json"  #: the plan as registered before its first run
PILOT_KEYS = ("sweep", "scale", "methods", "seeds", "overrides", "runs", "rule")
RULE_KEYS = ("pick", "above")


@dataclass
class Rule:
    pick: int  #: how many splits the pilot picks
    above: float = 0.0  #: each picked split's mean gain is above this


@dataclass
class PilotPlan:
    path: Path
    sweep: str
    scale: str
    methods: list[str]
    seeds: list[int]
    rule: Rule
    runs: Path
    overrides: list[str] = field(default_factory=list)

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def seed0(self) -> int:
        return self.seeds[0]

    @property
    def cells(self) -> list[tuple[str, int]]:
        return [(m, s) for s in self.seeds for m in self.methods]

    def run_dir(self, method: str, seed: int) -> Path:
        return self.runs / f"{method}_s{seed}"


def load_pilot(path: Path) -> PilotPlan:
    """The pilot's plan, checked before anything runs, each problem in one line."""
    from .decide import read_plan_file

    raw = read_plan_file(path, PILOT_KEYS, ("sweep", "scale", "methods", "seeds", "rule"), "pilot plan", __file__)
    seeds, methods = raw["seeds"], raw["methods"]
    if not isinstance(seeds, list) or not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                                        for s in seeds) or len(set(seeds)) != len(seeds):
        raise SystemExit(f"{path}: seeds={seeds!r}; give a list of distinct whole numbers >= 0")
    known = {p.stem for p in (ROOT / "conf" / "method").glob("*.yaml")}
    if not isinstance(methods, list) or not methods or len(set(methods)) != len(methods):
        raise SystemExit(f"{path}: methods={methods!r}; give a list of distinct conf/method/ options")
    if bad := sorted(set(map(str, methods)) - known):
        raise SystemExit(f"{path}: method {', '.join(bad)} is not in conf/method/ (there are: {', '.join(sorted(known))})")
    if not (ROOT / "sweeps" / f"{raw['sweep']}.yaml").is_file():
        raise SystemExit(f"{path}: sweep {raw['sweep']!r} is not sweeps/{raw['sweep']}.yaml")
    runs = Path(raw.get("runs") or ROOT / "runs" / "reproduce" / f"{raw['sweep']}-{raw['scale']}")
    return PilotPlan(Path(path), str(raw["sweep"]), str(raw["scale"]), [str(m) for m in methods], [int(s) for s in seeds],
                     _rule(raw["rule"], Path(path)), runs if runs.is_absolute() else ROOT / runs,
                     [str(o) for o in raw.get("overrides") or []])


def _rule(raw, path: Path) -> Rule:
    if not isinstance(raw, dict) or "pick" not in raw or set(raw) - set(RULE_KEYS):
        raise SystemExit(f"{path}: rule: takes pick (and above); got {raw!r}")
    pick, above = raw["pick"], raw.get("above", 0.0)
    if isinstance(pick, bool) or not isinstance(pick, int) or pick < 1:
        raise SystemExit(f"{path}: rule.pick={pick!r}; give a whole number >= 1 (how many splits the pilot picks)")
    if isinstance(above, bool) or not isinstance(above, (int, float)) or not math.isfinite(above):
        raise SystemExit(f"{path}: rule.above={above!r}; give a number (the mean gain a picked split exceeds)")
    return Rule(int(pick), float(above))


# ---------------------------------------------------------------------------------------------- registration
def _fingerprint(plan: PilotPlan, code: Path) -> dict:
    from .contract import plan_files

    return {"plan": hashlib.sha256(plan.path.read_bytes()).hexdigest(), "files": plan_files(plan, code)}


def register(plan: PilotPlan, code: Path) -> dict:
    """The plan as registered (written at its first start, before any cell), or refused in one line: a run folder
    that holds a finished cell before registration, or a plan or sweep file edited since."""
    f = plan.folder / REGISTERED
    now = _fingerprint(plan, code)
    if not f.is_file():
        if seen := [f"{m}_s{s}" for m, s in plan.cells if (plan.run_dir(m, s) / "eval.json").is_file()]:
            raise SystemExit(f"{plan.path}: {plan.runs} already holds finished cells ({', '.join(seen[:4])}) and the "
                             "plan is not registered: a rule written after runs were seen is not blind. Register it "
                             "with an empty run folder (give the plan another runs:), before its first run")
        from ...engine.files import atomic_write
        from ...engine.runs import git_commit

        rec = {**now, "registered": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit()}
        atomic_write(f, json.dumps(rec, indent=1) + "\n")
        return rec
    rec = json.loads(f.read_text())
    if rec.get("plan") != now["plan"]:
        raise SystemExit(f"{plan.path}: the plan changed after it was registered ({rec.get('registered')}, {f}): a "
                         "pilot's rule is fixed before its first run; restore the plan from git")
    if changed := sorted(p for p in set(rec.get("files", {})) | set(now["files"])
                         if rec.get("files", {}).get(p) != now["files"].get(p)):
        raise SystemExit(f"{plan.path}: {changed[0]} changed after the plan was registered ({rec.get('registered')}): "
                         "its cells would run otherwise than the ones before; restore it from git")
    return rec


# ---------------------------------------------------------------------------------------------- the ledger
def split_scores(run: Path) -> pd.DataFrame:
    """(split, n, base, trained, delta) of a finished run, base from metrics.csv's iteration-0 evaluation; its last
    row is ``avg``."""
    ev = json.loads((run / "eval.json").read_text())
    metric = ev["metric"]
    m = pd.read_csv(run / "metrics.csv")
    base = m[m["step"] == 0].iloc[0] if (m["step"] == 0).any() else None
    rows = []
    for split, v in ev["splits"].items():
        b = float(base[f"eval/{split}/{metric}"]) if base is not None else float("nan")
        rows.append({"split": split, "n": int(v["n"]), "base": b, "trained": float(v[metric]),
                     "delta": float(v[metric]) - b})
    rows.append({"split": "avg", "n": sum(r["n"] for r in rows), "base": float(ev.get("base_avg", "nan")),
                 "trained": float(ev["avg"]), "delta": float(ev["avg"]) - float(ev.get("base_avg", "nan"))})
    return pd.DataFrame(rows)


def read_ledger(plan: PilotPlan) -> pd.DataFrame:
    f = plan.folder / LEDGER
    return pd.read_csv(f, dtype={"method": str, "split": str, "commit": str, "machine": str}) if f.is_file() else \
        pd.DataFrame(columns=["method", "seed", "split", "base", "trained", "commit", "machine"])


def record(plan: PilotPlan) -> int:
    """Add every finished cell of the plan that the ledger lacks (its splits' scores before and after RL); the
    number of cells added. A cell with no iteration-0 evaluation is refused in one line: it has no gain."""
    from ...engine.files import atomic_write
    from ...engine.runs import run_commit, run_machine

    have = read_ledger(plan)
    done = set(zip(have["method"], have["seed"].astype(int)))
    new = []
    for m, s in plan.cells:
        run = plan.run_dir(m, s)
        if (m, s) in done or not (run / "eval.json").is_file():
            continue
        sc = split_scores(run)
        sc = sc[sc["split"] != "avg"]
        if sc["base"].isna().any():
            raise SystemExit(f"{run}: no evaluation at iteration 0, so no gain: a pilot's cells evaluate before RL "
                             "(drop algo.eval_only_at_end from the pilot's scale)")
        new += [{"method": m, "seed": s, "split": r.split, "base": r.base, "trained": r.trained,
                 "commit": run_commit(run), "machine": run_machine(run)} for r in sc.itertuples()]
    if new:
        out = pd.concat([have, pd.DataFrame(new)], ignore_index=True) if len(have) else pd.DataFrame(new)
        atomic_write(plan.folder / LEDGER, out.sort_values(["seed", "method", "split"], kind="stable")
                     .to_csv(index=False, float_format="%.6g"))
    return len({(r["method"], r["seed"]) for r in new})


def pick(gains: pd.DataFrame, rule: Rule) -> tuple[pd.DataFrame, list[str]]:
    """(per split: mean gain, runs raised, runs, mean before and after, ranked by mean gain; the rule's pick) from
    rows of (split, base, trained, gain): the first ``rule.pick`` splits whose mean gain is above ``rule.above``, or
    none when fewer are."""
    g = gains.groupby("split", sort=False)
    summary = pd.DataFrame({"mean_gain": g["gain"].mean(), "runs_raised": g["gain"].apply(lambda x: int((x > 0).sum())),
                            "runs": g["gain"].size(), "base": g["base"].mean(), "trained": g["trained"].mean()})
    summary = summary.sort_values("mean_gain", ascending=False, kind="stable")
    above = [s for s, m in summary["mean_gain"].items() if m > rule.above][: rule.pick]
    return summary, above if len(above) == rule.pick else []


def apply_rule(plan: PilotPlan, registered: dict) -> list[str]:
    """The rule on the ledger alone (every cell recorded): ``pick.csv`` and ``pick.md``; the pick."""
    from ...engine.files import atomic_write

    led = read_ledger(plan)
    gains = led.assign(gain=led["trained"] - led["base"])
    summary, chosen = pick(gains, plan.rule)
    atomic_write(plan.folder / "pick.csv", summary.assign(picked=[s in chosen for s in summary.index])
                 .rename_axis("split").to_csv(float_format="%.6g"))
    r = plan.rule
    lines = [f"# Pilot: {plan.folder.name}", "",
             f"Plan [`{plan.path.name}`]({plan.path.name}), registered {registered.get('registered')} at commit "
             f"`{str(registered.get('commit', ''))[:12]}` before its first run; the rule applied by `python -m "
             f"ema_pg.pilot` to `{LEDGER}` ({led[['method', 'seed']].drop_duplicates().shape[0]} cells: "
             f"{', '.join(plan.methods)} at seeds {', '.join(map(str, plan.seeds))}). Gain = held-out score after RL "
             f"minus before (iteration 0). The rule: the {r.pick} splits with the largest mean gain, each above "
             f"{r.above:g}.", "",
             "| split | before RL (mean) | after RL (mean) | mean gain | runs raised | picked |", "|---|---|---|---|---|---|"]
    for s, row in summary.iterrows():
        lines.append(f"| {s} | {row.base:.3f} | {row.trained:.3f} | {row.mean_gain:+.3f} | {int(row.runs_raised)} of "
                     f"{int(row.runs)} | {'yes' if s in chosen else ''} |")
    lines += ["", f"**The pick: {', '.join(chosen)}**" if chosen else
              f"**Fewer than {r.pick} splits gained above {r.above:g}: nothing is picked; widen the pilot before a "
              "plan is registered.**"]
    atomic_write(plan.folder / "pick.md", "\n".join(lines) + "\n")
    return chosen


# ---------------------------------------------------------------------------------------------- the command
def main(argv=None) -> int:
    from ...engine.console import quiet_third_party
    from ...engine.runs import EXIT_INTERRUPTED
    from ..launchers import add_launcher_args, launcher_spec
    from .decide import Workers, _Lazy, cell_config, claim_plan

    quiet_third_party()
    ap = command_parser(__doc__)
    ap.add_argument("plan", type=Path)
    ap.add_argument("--workers", type=int, default=2, help="cells run at a time (default 2)")
    ap.add_argument("--status", action="store_true", help="say which cells remain; run nothing, show no gain")
    add_launcher_args(ap, what="cells")
    a = ap.parse_args(argv)
    if a.workers < 1:
        raise SystemExit(f"--workers {a.workers}: give 1 or more (cells run at a time)")
    if not a.plan.is_file():
        raise SystemExit(f"{a.plan}: no such pilot plan")
    plan = load_pilot(a.plan)
    if a.status:
        led = read_ledger(plan)
        n = led[["method", "seed"]].drop_duplicates().shape[0]
        print(f"{plan.path}: {'registered' if (plan.folder / REGISTERED).is_file() else 'not registered yet'}; "
              f"{n} of {len(plan.cells)} cells recorded" + ("; the pick: pick.md" if n == len(plan.cells) else ""))
        return 0
    claim_plan(plan)  # one writer per plan, as decide's
    cfg = cell_config(plan, ROOT, plan.methods[0])
    if cfg.algo.eval_only_at_end:
        raise SystemExit(f"{plan.path}: its cells evaluate only at the end (algo.eval_only_at_end), so they have no "
                         "score before RL and no gain: drop it from the pilot's scale or overrides")
    registered = register(plan, ROOT)
    launcher_spec(a).check()
    record(plan)
    led = read_ledger(plan)
    todo = [c for c in plan.cells if c not in set(zip(led["method"], led["seed"].astype(int)))]
    if todo:
        (plan.runs / "logs").mkdir(parents=True, exist_ok=True)
        workers = Workers(_Lazy(launcher_spec(a), plan.runs, a.workers), plan.runs / "logs", ROOT, record=record,
                          what="cells of the pilot")
        signal.signal(signal.SIGTERM, workers.stop)
        signal.signal(signal.SIGINT, workers.stop)
        print(f"{plan.path}: {len(todo)} cells to run", flush=True)
        try:
            workers.run(plan, todo)
        finally:
            workers.launcher.close()
        if workers.stopping:
            print("stopped by a signal: the cells saved their checkpoints; run the same command to continue",
                  file=sys.stderr)
            return EXIT_INTERRUPTED
    record(plan)
    n = read_ledger(plan)[["method", "seed"]].drop_duplicates().shape[0]
    if n < len(plan.cells):
        print(f"{plan.path}: {len(plan.cells) - n} cells did not finish; see {plan.runs / 'logs'}; run the same "
              "command again", file=sys.stderr)
        return 1
    chosen = apply_rule(plan, registered)
    print(f"{plan.folder / 'pick.md'}: " + (f"the pick: {', '.join(chosen)}" if chosen else "nothing picked"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
