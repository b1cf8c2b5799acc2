"""Run folders in the terminal and in a tracker: ``python -m ema_pg runs`` lists, filters and compares them;
``python -m ema_pg track import`` sends finished (or stopped) run folders to a tracker, as a run sends itself
(:mod:`ema_pg.engine.tracking`), so an old sweep sits beside new ones in the tracker's UI.

    python -m ema_pg runs multirun/                       # each run, the config keys the runs differ in, scores
    python -m ema_pg runs multirun/ --where method=ema seed=0
    python -m ema_pg runs --diff RUN_A RUN_B              # the settings two runs differ in
    python -m ema_pg track import multirun/2026-12-06_10-00-00 --logger mlflow [--mlflow-uri http://HOST:PORT]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from ..cli import command_parser
from ..config import TRACKERS
from ..engine.runs import config_differences, settings
from .results import find_runs, load_runs

#: columns of load_runs that are a run's circumstances, not its settings: never "what the runs differ in"
NOT_SETTINGS = ("run_dir", "run", "commit", "machine", "wall_s", "iteration", "finished", "resume", "run_dir",
                "if_exists", "init_from", "sft.cache_dir", "name")


def differing(runs: pd.DataFrame) -> list[str]:
    """The config columns in which the runs differ (a column some runs lack counts as differing)."""
    keys = []
    for c in runs.columns:
        if c in NOT_SETTINGS or c.startswith(("final/", "base/", "mean/", "logger.")) or c == "run_dir":
            continue
        values = {str(v) for v in runs[c]}
        if len(values) > 1:
            keys.append(c)
    return keys


def where(runs: pd.DataFrame, conditions: list[str]) -> pd.DataFrame:
    """The runs whose config has each ``key=value`` (numbers compared as numbers); a key no run has is one line."""
    for cond in conditions:
        key, eq, value = cond.partition("=")
        if not eq:
            raise SystemExit(f"--where {cond}: give key=value, e.g. --where method=ema seed=0")
        if key not in runs.columns:
            import difflib

            near = difflib.get_close_matches(key, [c for c in runs.columns if c not in NOT_SETTINGS], n=1)
            raise SystemExit(f"--where {cond}: no run has the key {key!r}" + (f"; did you mean {near[0]}?" if near else ""))
        runs = runs[[_equal(v, value) for v in runs[key]]]
    return runs


def _equal(v, value: str) -> bool:
    try:
        return math.isclose(float(v), float(value))
    except (TypeError, ValueError):
        return str(v) == value


def score_columns(runs: pd.DataFrame) -> list[str]:
    avg = [c for c in runs.columns if c.startswith("final/eval/avg/")]
    return avg[:1] + [c.replace("final/", "base/", 1) for c in avg[:1] if c.replace("final/", "base/", 1) in runs]


def listing(root: Path, conditions: list[str]) -> str:
    runs = load_runs(root)
    if not len(runs):
        return f"{root}: no run folders (a folder with config.yaml and metrics.csv) under it"
    runs = where(runs, conditions)
    if not len(runs):
        return f"{root}: no run has {' '.join(conditions)}"
    keys = differing(runs)
    table = runs[["run_dir", *keys, *score_columns(runs), "iteration", "finished"]].copy()
    table["run_dir"] = [_short(p, root) for p in table["run_dir"]]
    table = table.rename(columns={**{c: c.replace("eval/avg/", "") for c in table.columns}, "run_dir": "run"})
    head = f"{len(runs)} runs under {root}" + (f" with {' '.join(conditions)}" if conditions else "")
    head += f"; they differ in: {', '.join(keys)}" if keys else "; their settings are the same"
    return head + "\n" + table.to_markdown(index=False, floatfmt=".3f")


def _short(path: str, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve())) or "."
    except ValueError:
        return path


def diff(a: Path, b: Path) -> str:
    """The settings two run folders differ in, each with both values (resume-only keys left out)."""
    for run in (a, b):
        if not (run / "config.yaml").is_file():
            raise SystemExit(f"--diff {run}: not a run folder (no config.yaml there)")
    ca, cb = OmegaConf.load(a / "config.yaml"), OmegaConf.load(b / "config.yaml")
    keys = config_differences(ca, cb)
    if not keys:
        return f"{a} and {b} have the same settings"
    sa, sb = settings(ca), settings(cb)
    rows = [{"key": k, str(a): sa.get(k, "(absent)"), str(b): sb.get(k, "(absent)")} for k in keys]
    return f"{len(keys)} settings differ\n" + pd.DataFrame(rows).to_markdown(index=False)


def runs_main(argv=None) -> int:
    ap = command_parser(__doc__)
    ap.add_argument("root", nargs="?", type=Path, default=Path("runs"), help="a folder of run folders (default runs/)")
    ap.add_argument("--where", nargs="+", default=[], metavar="KEY=VALUE",
                    help="only the runs whose config has each value (e.g. method=ema seed=0 anchor.eta=0.1)")
    ap.add_argument("--diff", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"), help="the settings two runs differ in")
    a = ap.parse_args(argv)
    if a.diff:
        print(diff(*a.diff))
        return 0
    if not a.root.exists():
        raise SystemExit(f"{a.root}: no such folder; give a folder of run folders (runs/, a multirun folder)")
    print(listing(a.root, a.where))
    return 0


def track_main(argv=None) -> int:
    from ..engine.tracking import import_run

    ap = command_parser(__doc__)
    sub = ap.add_subparsers(dest="verb", required=True)
    imp = sub.add_parser("import", help="send run folders to trackers (what they already hold is not sent again)")
    imp.add_argument("root", type=Path, help="a run folder, or a folder of them (found recursively)")
    imp.add_argument("--logger", default=None,
                     help=f"the trackers, comma-separated ({', '.join(TRACKERS)}); default: each run's own")
    imp.add_argument("--mlflow-uri", default=None, help="an MLflow tracking server or store (default: the run's "
                     "logger.mlflow_uri, $MLFLOW_TRACKING_URI, else runs/mlflow.db)")
    imp.add_argument("--project", default=None, help="the wandb project / MLflow experiment (default: the run's)")
    imp.add_argument("--group", default=None, help="the group of the runs in the tracker (default: their sweep)")
    a = ap.parse_args(argv)
    names = None
    if a.logger is not None:
        names = [n.strip() for n in a.logger.split(",") if n.strip()]
        if bad := [n for n in names if n not in TRACKERS]:
            raise SystemExit(f"--logger {a.logger}: {bad[0]!r} is not a tracker; choose from {', '.join(TRACKERS)}")
    if not a.root.exists():
        raise SystemExit(f"{a.root}: no such folder")
    runs = find_runs(a.root)
    if not runs:
        raise SystemExit(f"{a.root}: no run folders (a folder with config.yaml and metrics.csv) under it")
    lc = {k: v for k, v in (("mlflow_uri", a.mlflow_uri), ("project", a.project), ("group", a.group)) if v}
    from tqdm.auto import tqdm

    total: dict[str, int] = {}
    for run in tqdm(runs, desc="runs", unit="run", disable=len(runs) < 2):
        own = [t for t in TRACKERS if OmegaConf.load(run / "config.yaml").get("logger", {}).get(t)]
        chosen = names if names is not None else own
        if not chosen:
            raise SystemExit(f"{run}: its config names no tracker; give --logger {','.join(TRACKERS)}")
        for name, n in import_run(run, chosen, OmegaConf.create(lc)).items():
            total[name] = total.get(name, 0) + n
    print(f"{len(runs)} run folders: " + "; ".join(f"{k} was sent {v} rows" for k, v in total.items()), file=sys.stdout)
    return 0


# ---------------------------------------------------------------------- a decide plan in the trackers
#: a look's verdict as a number a tracker can plot: +1 holds, -1 fails, 0 not decided at that look
VERDICT_CODE = {"holds": 1.0, "fails": -1.0}
LOOK_COLUMNS = ("seeds", "mean_better", "mean_worse", "mean_diff", "sd_diff", "t", "t_bound", "lo", "hi")


def tracker_args(ap) -> None:
    """The options of a command whose runs report to trackers (decide's cells and its plan run)."""
    ap.add_argument("--logger", default=None, metavar="NAMES",
                    help=f"report the cells and the plan to these trackers, comma-separated ({', '.join(TRACKERS)}): "
                         "each cell its own run, grouped under the plan, and a plan run with every look")
    ap.add_argument("--mlflow-uri", default=None, help="with --logger mlflow: a tracking server or store (default: "
                    "$MLFLOW_TRACKING_URI, else runs/mlflow.db)")
    ap.add_argument("--project", default=None, help="the wandb project / MLflow experiment (default ema-pg)")


def tracker_choice(a) -> list[str]:
    """The trackers ``--logger`` names, checked (one line for a name that is not one)."""
    if not getattr(a, "logger", None):
        return []
    names = [n.strip() for n in a.logger.split(",") if n.strip()]
    if bad := [n for n in names if n not in TRACKERS]:
        raise SystemExit(f"--logger {a.logger}: {bad[0]!r} is not a tracker; choose from {', '.join(TRACKERS)}")
    return names


def plan_logger(a, names: list[str], tags: list[str] = ()) -> dict:
    lc = {"project": a.project or "ema-pg", "offline": True, "mlflow_uri": a.mlflow_uri, "tags": list(tags),
          "job_type": "plan"}
    return {**lc, **{n: n in names for n in TRACKERS}}


def cell_overrides(a, names: list[str], plan, method: str) -> list[str]:
    """What a cell's command adds so that its run reports to the plan's trackers: grouped under the plan, job type
    ``cell``, tagged with the claims it serves."""
    if not names:
        return []
    claims = [f"'claim={c.id}'" for c in plan.claims if method in (c.better, c.worse)]  # quoted: Hydra's grammar
    out = [f"logger=[{','.join(names)}]", f"logger.group={plan.folder.name}", "logger.job_type=cell",
           f"logger.tags=[{','.join(claims)}]"]
    if a.mlflow_uri:
        out.append(f"logger.mlflow_uri={a.mlflow_uri}")
    if a.project:
        out.append(f"logger.project={a.project}")
    return out


def mirror_plan(plan, a, names: list[str], looks: pd.DataFrame) -> None:
    """The plan's own tracker run (its record in the plan's runs folder): the plan's design and claims as its
    parameters, each look's numbers per claim at step = the look (``P1/mean_diff``, ``P1/lo``, ``P1/verdict``: +1
    holds, -1 fails, 0 open), and the looks as a table. looks.csv stays the record; what a tracker holds of it is
    not sent again."""
    from ..engine.tracking import Identity, Trackers

    if not names:
        return
    rows = []
    for k, g in (looks.groupby("look", sort=True) if len(looks) else ()):
        row = {}
        for _, r in g.iterrows():
            for c in LOOK_COLUMNS:
                if c in r and pd.notna(r[c]):
                    row[f"{r['claim']}/{c}"] = float(r[c])
            row[f"{r['claim']}/verdict"] = VERDICT_CODE.get(str(r["verdict"]), 0.0)
        rows.append((int(k), row))
    params = {"plan.sweep": plan.sweep, "plan.scale": plan.scale, "plan.seed0": plan.seed0,
              "plan.looks": str(list(plan.design.looks)), "plan.runs": str(plan.runs), "plan.base": str(plan.base),
              **{f"claim.{c.id}": f"{c.better} > {c.worse} ({c.score}): {c.text}" for c in plan.claims}}
    for attr in ("alpha", "spending"):
        if hasattr(plan.design, attr):
            params[f"plan.{attr}"] = str(getattr(plan.design, attr))
    ident = Identity(name=plan.folder.name, group=plan.folder.name, job_type="plan",
                     tags=["plan", *[f"claim={c.id}" for c in plan.claims]], params=params,
                     step=max((k for k, _ in rows), default=0))
    plan.runs.mkdir(parents=True, exist_ok=True)
    hub = Trackers(OmegaConf.create(plan_logger(a, names)), plan.runs, ident, names)
    sent = hub.sync(rows)
    if any(sent.values()) and len(looks):
        table = {"looks": [{"prompt": f"look {r['look']}, {r['claim']}", "response": str(r["verdict"]),
                            "reward": float(r["mean_diff"])} for _, r in looks.iterrows()]}
        hub.media(ident.step, samples=table)
    hub.finish("success")
    from ..engine.tracking import write_record

    write_record(plan.runs, hub.record)
