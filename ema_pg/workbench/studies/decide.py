"""``python -m ema_pg.decide PLAN``: decide pre-registered claims sequentially, adding paired seeds in batches.

A plan (YAML, committed before its first look) names a sweep, its scale, the claims (each "BETTER > WORSE" on a
score of the final evaluation, paired by seed), the first seed and the looks: the numbers of paired seeds after
which each open claim is looked at. At every look the claim's paired differences are tested against the group-
sequential boundaries of :mod:`ema_pg.workbench.sequential` (overall two-sided error ``alpha``, spent by
``spending``): a claim whose statistic crosses a boundary is decided (holds / fails) and gets no more seeds; at the
last look (the cap) an open claim is "stopped at the cap". The command

1. runs the (method, seed) cells the next look needs (only the methods of open claims; seeds from ``seed0``),
   ``--workers`` at a time, each by the sweep's own per-cell command (``python -m ema_pg.train -m --config-dir
   sweeps --config-name SWEEP +scale=... method=M seed=S``), into the plan's run folder;
2. takes the look once every cell has finished, and appends its numbers to ``looks.csv`` beside the plan (one row
   per claim and look: seeds, mean and sd of the paired difference, t, the boundaries, the repeated interval, the
   verdict, the commit the runs ran from); ``sequential.md`` and ``sequential.png`` are written again from it;
3. goes on to the next look until every claim is decided or capped.

Every finished cell's scores also go to ``cells.csv`` beside the plan (method, seed, the final evaluation's
scores, the commit it ran from, its base policy and the machine it ran on): small enough to commit as cells land, so
that a plan carried to a fresh machine (run folders are never committed) counts the cells it already has and runs
only the rest. A plan's seeds share one base policy (``sft.seed``), but a cold start built on another kind of CPU can
come out another policy (:func:`ema_pg.engine.runs.machine`): a cell whose base differs from the plan's (pinned as
``base:`` in the plan, else the one its recorded cells share) is refused as it lands, before any look pairs it, and
the command will not start cells on a machine other than the one the recorded cells ran on unless told
``--any-machine``.

Run it again after an interruption: finished cells are kept, a killed one resumes from its checkpoint, looks
already taken are read back, never retaken. SIGTERM stops the workers (each saves its checkpoint) and the command
exits 75. A cell that failed (its failed.json) is left out of its claims' pairs at every look from then on, and the
look says so: the boundaries are spent at the number of seeds a look actually has.

    python -m ema_pg.decide reproductions/table2/claims/plan.yaml --workers 2
    python -m ema_pg.decide reproductions/table2/claims/plan.yaml --status      # where it stands and may end; nothing run
    python -m ema_pg.decide PLAN --code ../claims    # the cells run the code of ../claims (a worktree of the plan's
                                                     # commit); the ledger, its checks and the looks are this checkout's
    python -m ema_pg.decide PLAN --launcher submitit --launcher-option slurm_partition=dev   # a job per cell
    python -m ema_pg.decide PLAN --launcher ray --address auto --cell-cpus 2                 # a Ray task per cell

Wherever the cells run (:mod:`ema_pg.workbench.launchers`), this process alone writes the ledger and takes the looks; killed and
started again, it waits for the cells still running rather than starting them twice.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from ...cli import PACKAGE_ROOT as ROOT
from ...cli import command_parser
from ...engine.files import NoRoom
from ...engine.runs import EXIT_INTERRUPTED, machine
from ...engine.sweeps import failed_record
from ..launchers import add_launcher_args, launcher_spec
from ..tracking import cell_overrides, mirror_plan, tracker_args, tracker_choice
from .contract import check as check_contract, deviation_lines, parse_deviations, register
from .ledger import LOOKS, finite, read_cells_file, read_looks_file
from .sequential import OUTLOOKS, Design, look_at, outlook

CELLS = "cells.csv"  #: every finished cell's scores, beside the plan
#: cells that can count in no look (their base policy was not the plan's), with cells.csv's columns, the cold start
#: their train.log showed, and why they were set aside
SET_ASIDE = "set_aside.csv"
DECIDE_CLAIM = ".ema_pg_decide"  #: the lock file of the plan's one live decide (its host and pid)


@dataclass
class Claim:
    id: str
    better: str
    worse: str
    text: str
    score: str = "avg"  #: eval.json's ``avg``, or a split's name (its mean reward)


@dataclass(frozen=True)
class Power:
    """What a plan says it must be able to see, before its first cell: the smallest paired difference that matters
    (``effect``, in the claims' score), the sd of the paired differences it expects and where that sd comes from
    (``sd_from``: a pilot's paired differences, or a guess, said in words)."""

    effect: float
    sd: float
    sd_from: str


POWER_KEYS = ("effect", "sd", "sd_from")


@dataclass
class Plan:
    path: Path
    sweep: str
    scale: str
    seed0: int
    design: Design
    claims: list[Claim]
    runs: Path
    overrides: list[str] = field(default_factory=list)
    base: str | None = None  #: the base policy every cell must start from (``run_base``'s digest), when pinned
    deviations: list[dict] = field(default_factory=list)  #: changes made on purpose (:mod:`.contract`)
    power: Power | None = None  #: the effect the plan must see and the sd it expects, when it states them

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(m for c in self.claims for m in (c.better, c.worse)))

    def seeds(self, n: int) -> list[int]:
        return list(range(self.seed0, self.seed0 + n))

    def run_dir(self, method: str, seed: int) -> Path:
        return self.runs / f"{method}_s{seed}"  # the table sweeps' subdir: ${hydra.runtime.choices.method}_s${seed}


PLAN_KEYS = ("sweep", "scale", "seed0", "looks", "alpha", "spending", "runs", "base", "claims", "overrides",
             "deviations", "power")  #: a plan file's keys; the first five are required (but alpha and spending)
CLAIM_KEYS = ("better", "worse", "text", "score")


def read_plan_file(path: Path, keys: tuple[str, ...], required: tuple[str, ...], what: str, source: str) -> dict:
    """A plan file's YAML mapping (a decide plan's, a pilot's: ``what``), each problem in one line: YAML's own report
    (a key given twice, a bad indent), not a mapping, an unknown key (with the nearest), a required key missing
    (``source``: the module whose docstring describes the file)."""
    import difflib

    from omegaconf import OmegaConf

    try:
        raw = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # noqa: BLE001 - YAML's own report, as one line
        raise SystemExit(f"{path}: not a {what}'s YAML: {' '.join(str(e).split())[:300]}") from None
    if not isinstance(raw, dict):
        raise SystemExit(f"{path}: a {what} is a YAML mapping of {', '.join(keys)}")
    for k in raw:
        if k not in keys:
            near = difflib.get_close_matches(str(k), keys, n=1)
            raise SystemExit(f"{path}: unknown key {k!r}: {f'did you mean {near[0]}? ' if near else ''}remove it "
                             f"(a {what}'s keys: {', '.join(keys)})")
    if missing := [k for k in required if k not in raw]:
        rel = Path(source).resolve().relative_to(ROOT)
        raise SystemExit(f"{path}: the {what} needs {', '.join(missing)} (see {rel})")
    return raw


def load_plan(path: Path) -> Plan:
    """The plan file, checked before anything runs, each problem in one line: its keys (a misspelt one with the
    nearest), every method a Hydra option of ``conf/method``, a claim's two arms different, claims distinct and at
    least one, seeds from 0 up, looks increasing, the deviations each complete."""
    raw = read_plan_file(path, PLAN_KEYS, ("sweep", "scale", "seed0", "looks", "claims"), "plan", __file__)
    if not isinstance(raw["seed0"], int) or isinstance(raw["seed0"], bool) or raw["seed0"] < 0:
        raise SystemExit(f"{path}: seed0={raw['seed0']!r}; the first seed is a whole number >= 0")
    try:
        design = Design(looks=tuple(raw["looks"]), alpha=float(raw.get("alpha", 0.05)),
                        spending=str(raw.get("spending", "obrien_fleming")))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"{path}: {e}") from None
    if not isinstance(raw["claims"], dict) or not raw["claims"]:
        raise SystemExit(f"{path}: claims is empty; a plan decides at least one claim (ID: {{better, worse, text}})")
    claims = []
    for cid, c in raw["claims"].items():
        if not isinstance(c, dict) or not {"better", "worse", "text"} <= set(c):
            raise SystemExit(f"{path}: claim {cid} needs better, worse and text")
        if extra := [k for k in c if k not in CLAIM_KEYS]:
            raise SystemExit(f"{path}: claim {cid} has unknown key {extra[0]!r} (a claim's keys: {', '.join(CLAIM_KEYS)})")
        if c["better"] == c["worse"]:
            raise SystemExit(f"{path}: claim {cid} compares {c['better']} with itself; name two different methods")
        claims.append(Claim(str(cid), str(c["better"]), str(c["worse"]), str(c["text"]), str(c.get("score", "avg"))))
    known = {p.stem for p in (ROOT / "conf" / "method").glob("*.yaml")}
    bad = sorted({m for c in claims for m in (c.better, c.worse)} - known)
    if bad:
        raise SystemExit(f"{path}: method {', '.join(bad)} is not in conf/method/ (there are: {', '.join(sorted(known))})")
    if not (ROOT / "sweeps" / f"{raw['sweep']}.yaml").is_file():
        raise SystemExit(f"{path}: sweep {raw['sweep']!r} is not sweeps/{raw['sweep']}.yaml")
    runs = Path(raw.get("runs") or ROOT / "runs" / "reproduce" / f"{raw['sweep']}-{raw['scale']}")
    return Plan(Path(path), str(raw["sweep"]), str(raw["scale"]), int(raw["seed0"]), design, claims,
                runs if runs.is_absolute() else ROOT / runs, [str(o) for o in raw.get("overrides") or []],
                str(raw["base"]) if raw.get("base") else None, parse_deviations(raw.get("deviations"), Path(path)),
                parse_power(raw.get("power"), Path(path)))


def parse_power(raw, path: Path) -> Power | None:
    """A plan's ``power:`` ({effect, sd, sd_from}), each problem in one line; None when the plan states none."""
    import math

    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != set(POWER_KEYS):
        raise SystemExit(f"{path}: power: takes {', '.join(POWER_KEYS)}, each given (for example power: {{effect: 0.02, "
                         "sd: 0.05, sd_from: 'the pilot's paired differences, reproductions/x/pilot'}); got "
                         f"{raw!r}")
    for k in ("effect", "sd"):
        v = raw[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise SystemExit(f"{path}: power.{k}={v!r}; give a number > 0 in the claims' score")
    if not str(raw["sd_from"]).strip():
        raise SystemExit(f"{path}: power.sd_from is empty; say where the sd comes from (a pilot's paired "
                         "differences, or a guess)")
    return Power(float(raw["effect"]), float(raw["sd"]), str(raw["sd_from"]).strip())


def power_lines(plan: Plan, looks: pd.DataFrame) -> list[str]:
    """What the plan can see by its cap, in lines: from its ``power:`` before any look (low power said so), and
    for each claim from the sd its looks found. The power is the chance of a "holds" by the cap
    (:func:`~ema_pg.workbench.studies.sequential.power_at`); the detectable effect is the one found with
    :data:`~ema_pg.workbench.studies.sequential.POWER`."""
    from .sequential import POWER, detectable, power_at

    d, p = plan.design, plan.power
    k = detectable(d)
    if p is None:
        out = [f"power: the plan states none (power: effect, sd, sd_from): with {POWER:.0%} power by the cap ({d.cap} "
               f"seeds) it finds an effect of {k:.2f} times the paired differences' sd"]
    else:
        pw = power_at(d, p.effect / p.sd)
        out = [f"{'LOW POWER: ' if pw < POWER else ''}power: the smallest effect that matters, {p.effect:.4g} (sd "
               f"{p.sd:.4g}, from {p.sd_from}), holds by the cap ({d.cap} seeds) with probability {pw:.0%}; with "
               f"{POWER:.0%} power the plan finds {k * p.sd:.4g} ({k:.2f} sd)"
               + ("; it runs, but a claim that stops at the cap says little about that effect" if pw < POWER else "")]
    for cid, g in (looks.groupby("claim", sort=False) if len(looks) else ()):
        r = g.iloc[-1]
        sd = float(r["sd_diff"])
        out.append(f"power, {cid}: at the sd its looks found ({sd:.4g}, look {int(r['look'])}) the cap finds "
                   f"{k * sd:.4g} with {POWER:.0%} power"
                   + (f"; the smallest effect that matters, {p.effect:.4g}, holds by the cap with probability "
                      f"{power_at(d, p.effect / sd):.0%}" if p is not None and sd > 0 else ""))
    return out


def check_cells(plan: Plan, code: Path = ROOT) -> None:
    """What the plan's cells will run, checked before the first of them starts (each in one line):
    :func:`cell_config`, and every claim's score ``avg`` or one of the task's evaluation splits."""
    from ...config import task_record
    from ...tasks import build_task

    cfg = cell_config(plan, code, plan.claims[0].better)
    scores = sorted({c.score for c in plan.claims} - {"avg"})
    if scores:
        splits = list(build_task(task_record(cfg)).eval_splits())
        if bad := [x for x in scores if x not in splits]:
            raise SystemExit(f"{plan.path}: score {bad[0]!r} is neither avg nor a split of task {cfg.task.name} "
                             f"({', '.join(splits)}); give one of those")


def cell_config(plan, code: Path, method: str):
    """The config a plan's cell of ``method`` composes (as the cell's ``--config-dir sweeps`` composes it), checked
    in one line each: it composes, and its seeds share one cold start (``sft.seed`` set, or a model of its own):
    otherwise every seed builds its own base policy. ``plan``: a decide or pilot plan (its sweep, scale, overrides,
    path and first seed)."""
    from ...config import CONF_DIR, compose
    from ..sweepfiles import overlay_choices, scale_file

    overlay, sweeps = scale_file(plan.sweep, plan.scale), Path(code) / "sweeps"
    overrides = [f"hydra.searchpath=[file://{CONF_DIR}]", *overlay_choices(overlay, sweeps), f"+scale={overlay}",
                 f"method={method}", f"seed={plan.seed0}", *plan.overrides]
    try:
        cfg = compose(overrides, config_name=plan.sweep, config_dir=sweeps)
    except Exception as e:  # noqa: BLE001 - Hydra's report, as one line
        raise SystemExit(f"{plan.path}: its cells' config does not compose ({' '.join(str(e).split())[:300]}); fix "
                         f"the plan's overrides or sweeps/{plan.sweep}.yaml") from None
    if not cfg.model.path and cfg.sft.seed is None:
        raise SystemExit(f"{plan.path}: its cells leave sft.seed unset, so each seed builds a cold start of its own "
                         f"(seed {plan.seed0}'s, seed {plan.seed0 + 1}'s, ...) and a plan's pairs need one base policy "
                         "for every seed: add sft.seed=0 to the plan's overrides (or use a scale that sets it)")
    return cfg


def cell_command(plan: Plan, method: str, seed: int, code: Path = ROOT) -> list[str]:
    """The sweep's per-cell command (what ``make reproduce-table2 SCALE=...`` runs for one cell), to run in ``code``:
    this checkout, or one of the commit a plan's cells must run (``--code``), whose sweep files it names."""
    from ..sweepfiles import overlay_choices, scale_file

    overlay, sweeps = scale_file(plan.sweep, plan.scale), Path(code) / "sweeps"
    if not (sweeps / "scale" / f"{overlay}.yaml").is_file():
        raise SystemExit(f"--code {code}: it has no sweeps/scale/{overlay}.yaml; give a checkout of the plan's code")
    return [sys.executable, "-m", "ema_pg.train", "-m", "--config-dir", str(sweeps), "--config-name", plan.sweep,
            *overlay_choices(overlay, sweeps), f"+scale={overlay}", f"hydra.sweep.dir={plan.runs}",
            f"method={method}", f"seed={seed}", *plan.overrides]


def finished(run: Path) -> bool:
    return (run / "eval.json").is_file()


def _scores(res: dict) -> dict[str, float]:
    """The scores a claim may name, from an eval.json: ``avg`` and each split's metric."""
    from ...engine.evaluation import result_metric  # here: torch, which it imports, is the cells' and not the coordinator's

    metric = result_metric(res)
    return {"avg": float(res["avg"]), **{k: float(v[metric]) for k, v in res["splits"].items()}}


class OtherBase(SystemExit):
    """A finished cell whose base policy the plan cannot vouch for (another base than the plan's, or a ledger with
    no base to check it against): its seed's pairs might compare two starting points, not two methods."""


def read_cells(plan: Plan) -> dict[tuple[str, int], dict]:
    """{(method, seed): {"scores": {...}, "commit": ..., "base": ..., "machine": ...}} from cells.csv (``base`` and
    ``machine`` are empty for rows recorded before cells.csv carried them), checked (:mod:`.ledger`)."""
    return read_cells_file(plan.folder / CELLS)


def plan_base(plan: Plan, cells: dict) -> tuple[str | None, str]:
    """(the base policy the plan's cells start from, where that is said): the plan's ``base`` when pinned, else the
    one base its recorded cells share (None before any cell records one)."""
    if plan.base:
        return plan.base, f"{plan.path}'s base"
    bases = sorted({c["base"] for c in cells.values() if c["base"]})
    if len(bases) > 1:
        raise OtherBase(f"{plan.folder / CELLS}: its cells start from {len(bases)} base policies ({', '.join(bases)}); "
                        f"a plan's seeds share one: pin the right one as base: in {plan.path} and set the others aside")
    return (bases[0], f"the base of the cells in {plan.folder / CELLS}") if bases else (None, "")


def ledger_machines(cells: dict) -> list[str]:
    """The machines the recorded cells ran on (rows from before cells.csv carried them say none)."""
    return sorted({c["machine"] for c in cells.values() if c["machine"]})


def set_aside_here(plan: Plan) -> list[dict]:
    """The set-aside cells (:data:`SET_ASIDE`) that ran on this machine's kind: a cold start built here came out
    another base policy before, and would again."""
    from ...engine.runs import machine

    f = plan.folder / SET_ASIDE
    if not f.is_file():
        return []
    here = machine()
    return [r for r in pd.read_csv(f, dtype=str, keep_default_na=False).to_dict("records") if r.get("machine") == here]


def record_cells(plan: Plan) -> int:
    """Add every finished cell of the plan's run folder that cells.csv lacks; the number added. A cell that started
    from another base policy than the plan's (:func:`plan_base`) is not added: :class:`OtherBase` says which and what
    to do, before any look could pair it."""
    from ...engine.files import atomic_write
    from ...engine.runs import run_base, run_commit, run_machine

    have = read_cells(plan)
    base, said = plan_base(plan, have)
    unvouched = base is None and any(not c["base"] for c in have.values())  # rows from before bases were recorded
    new = []
    for run in sorted(plan.runs.glob("*_s*")) if plan.runs.is_dir() else []:
        method, _, seed = run.name.rpartition("_s")
        if not seed.isdigit() or (method, int(seed)) in have or not finished(run):
            continue
        res = json.loads((run / "eval.json").read_text())
        cell = {"method": method, "seed": int(seed), "scores": json.dumps(_scores(res), sort_keys=True),
                "commit": run_commit(run), "base": run_base(run), "machine": run_machine(run)}
        if unvouched:
            raise OtherBase(f"{plan.folder / CELLS}: its cells were recorded before cells carried their base policy, so "
                            f"{run}'s ({cell['base']}, built on {cell['machine']}) cannot be checked against theirs: "
                            f"if its train.log shows the plan's cold start, pin it as 'base: {cell['base']}' in "
                            f"{plan.path}, and run again (the cell is kept)")
        if base is None:
            base, said = cell["base"], f"the base of {run}, the first cell recorded"
        if cell["base"] != base:
            raise OtherBase(f"{run}: it started from base policy {cell['base']} (built on {cell['machine']}), not "
                            f"{base}, {said}: a cold start built on another kind of CPU can end elsewhere. Move the "
                            f"folder aside, and run the cells where the cold start comes out as {base}, or carry that "
                            f"machine's cold-start cache here (EMA_PG_CACHE)")
        new.append(cell)
    if new:
        old = (pd.read_csv(plan.folder / CELLS, dtype=str, keep_default_na=False) if (plan.folder / CELLS).is_file()
               else pd.DataFrame())  # as written: no row read back as a number or rewritten
        out = pd.concat([old, pd.DataFrame(new).astype(str)], ignore_index=True).fillna("")
        out = out.sort_values(["method", "seed"], key=lambda c: c.astype(int) if c.name == "seed" else c)
        atomic_write(plan.folder / CELLS, out.to_csv(index=False))
    return len(new)


def done(plan: Plan, method: str, seed: int, cells: dict | None = None) -> bool:
    """Whether a cell has finished: its run folder's eval.json, or its row in cells.csv."""
    cells = read_cells(plan) if cells is None else cells
    return (method, seed) in cells or finished(plan.run_dir(method, seed))


def score(plan: Plan, method: str, seed: int, key: str, cells: dict | None = None) -> float:
    cells = read_cells(plan) if cells is None else cells
    run = plan.run_dir(method, seed)
    if finished(run):
        return _scores(json.loads((run / "eval.json").read_text()))[key]
    return float(cells[(method, seed)]["scores"][key])


def commit_of(plan: Plan, method: str, seed: int, cells: dict) -> str:
    from ...engine.runs import run_commit

    return cells[(method, seed)]["commit"] if (method, seed) in cells else run_commit(plan.run_dir(method, seed))


def read_looks(plan: Plan) -> pd.DataFrame:
    """looks.csv, checked (:mod:`.ledger`); ``left_out`` as text (seeds joined by spaces)."""
    return read_looks_file(plan.folder / LOOKS)


def look_seeds(plan: Plan, row) -> list[int]:
    """The seeds a look of ``looks.csv`` took: its planned seeds less the ones it left out."""
    left_out = {int(s) for s in str(row["left_out"]).split()}
    return [s for s in plan.seeds(int(row["planned_seeds"])) if s not in left_out]


def state(plan: Plan) -> tuple[dict[str, str], int]:
    """(the verdict of each claim so far: decided ones as decided, open ones 'open'; the number of looks taken)."""
    looks = read_looks(plan)
    verdicts = {c.id: "open" for c in plan.claims}
    taken = 0
    if len(looks):
        taken = int(looks["look"].max())
        for c in plan.claims:
            rows = looks[looks["claim"] == c.id]
            if len(rows) and rows["verdict"].iloc[-1] != "continue":
                verdicts[c.id] = str(rows["verdict"].iloc[-1])
    return verdicts, taken


OUTLOOK_SIMS = 20_000  #: simulated futures behind each open claim's outlook


def outlooks(design: Design, looks: pd.DataFrame, sims: int = OUTLOOK_SIMS) -> dict[str, dict[str, dict]]:
    """For each claim still going after its last look in ``looks`` (looks.csv's rows), the chance of each verdict
    by the cap under each future of :data:`~ema_pg.workbench.sequential.OUTLOOKS` ({claim: {future: outlook}});
    the same simulated futures every time (the page it goes on is regenerated and compared)."""
    out = {}
    for cid, g in (looks.groupby("claim", sort=False) if len(looks) else ()):
        r = g.iloc[-1]
        if r["verdict"] != "continue":  # the last look's verdict is never "continue" (take_look passes final)
            continue
        taken = [int(n) for n in g["seeds"]]
        out[str(cid)] = {f: outlook(design, taken, float(r["mean_diff"]), float(r["sd_diff"]), f, sims=sims, seed=0)
                         for f in OUTLOOKS}
    return out


def needed(plan: Plan, k: int, verdicts: dict[str, str]) -> list[tuple[str, int]]:
    """The cells look ``k`` (1-based) needs that have not finished, seed-major (each seed's methods together)."""
    methods = list(dict.fromkeys(m for c in plan.claims if verdicts[c.id] == "open" for m in (c.better, c.worse)))
    cells = read_cells(plan)
    return [(m, s) for s in plan.seeds(plan.design.looks[k - 1]) for m in methods
            if not done(plan, m, s, cells) and failed_record(plan.run_dir(m, s)) is None]


def take_look(plan: Plan, k: int, verdicts: dict[str, str], fingerprint: str = "") -> list[dict]:
    """Look ``k`` at every open claim; rows for looks.csv (``fingerprint``: the plan's contract in force, its
    ``plan`` column). Each claim's boundary is spent at the seeds its earlier looks had when they were taken, as
    looks.csv records them (a cell re-run since does not move them). A seed is left out of a claim's pairs when
    either cell failed (its failed.json), has not finished, or scored NaN (a failed cell too). A look is taken
    once: a claim that looks.csv already holds at look ``k`` is not looked at again."""
    record_cells(plan)
    cells = read_cells(plan)
    looks = read_looks(plan)
    rows = []
    for c in plan.claims:
        if verdicts[c.id] != "open":
            continue
        mine = looks[looks["claim"] == c.id].sort_values("look") if len(looks) else looks
        if len(mine) and (mine["look"] == k).any():
            continue  # taken already (looks.csv is the record): never a second row
        before = [int(n) for n in mine["seeds"]] if len(mine) else []
        if len(before) != k - 1:
            raise SystemExit(f"{plan.folder / LOOKS}: claim {c.id} has {len(before)} looks before look {k}, not "
                             f"{k - 1}; restore the file from git")
        seeds = plan.seeds(plan.design.looks[k - 1])
        ok, nan = [], []
        for s in seeds:
            if done(plan, c.better, s, cells) and done(plan, c.worse, s, cells):
                pair = (score(plan, c.better, s, c.score, cells), score(plan, c.worse, s, c.score, cells))
                (ok if all(finite(x) for x in pair) else nan).append(s)
        left_out = [s for s in seeds if s not in ok]
        if len(ok) < 3:
            failed = [f"{m}:{s}" for s in left_out for m in (c.better, c.worse)
                      if failed_record(plan.run_dir(m, s)) is not None or s in nan]
            raise SystemExit(f"look {k} of claim {c.id} has {len(ok)} paired seeds, and a look needs 3: "
                             f"{', '.join(failed) or 'cells'} failed or scored NaN; run them again (delete their "
                             f"failed.json in {plan.runs}, or their run folders, and run the same command)")
        diffs = [score(plan, c.better, s, c.score, cells) - score(plan, c.worse, s, c.score, cells) for s in ok]
        result = look_at(plan.design, before, diffs, final=k == len(plan.design.looks))
        commits = sorted({commit_of(plan, m, s, cells) for s in ok for m in (c.better, c.worse)})
        rows.append({"look": k, "claim": c.id, "text": c.text, "better": c.better, "worse": c.worse, "score": c.score,
                     "planned_seeds": plan.design.looks[k - 1], "seeds": result.n, "left_out": " ".join(map(str, left_out)),
                     "mean_better": _mean(plan, c.better, ok, c.score, cells),
                     "mean_worse": _mean(plan, c.worse, ok, c.score, cells),
                     "mean_diff": result.mean, "sd_diff": result.sd, "t": result.t, "z_bound": result.z_bound,
                     "t_bound": result.bound, "lo": result.lo, "hi": result.hi, "verdict": result.verdict,
                     "taken": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commits": " ".join(commits),
                     "plan": fingerprint})
        if nan:
            print(f"  look {k}, {c.id}: seeds {' '.join(map(str, nan))} left out: a cell scored NaN (a failed cell)",
                  flush=True)
    if rows:
        out = pd.concat([looks, pd.DataFrame(rows)], ignore_index=True) if len(looks) else pd.DataFrame(rows)
        from ...engine.files import atomic_write

        atomic_write(plan.folder / LOOKS, out.to_csv(index=False))
    return rows


def _mean(plan: Plan, method: str, seeds: list[int], key: str, cells: dict) -> float:
    xs = [score(plan, method, s, key, cells) for s in seeds]
    return sum(xs) / len(xs) if xs else float("nan")


def report(plan: Plan) -> Path:
    """``sequential.md`` and ``sequential.png`` from looks.csv (and the plan)."""
    looks = read_looks(plan)
    d = plan.design
    lines = [f"# Sequential decisions: {plan.path.parent.name}", "",
             f"Plan: [`{plan.path.name}`]({plan.path.name}) (pre-registered); design: looks at {list(d.looks)} paired "
             f"seeds from seed {plan.seed0}, two-sided overall error {d.alpha}, {d.spending.replace('_', '-')} "
             f"spending (`ema_pg/workbench/sequential.py`). Written by `python -m ema_pg.decide {_rel(plan.path)}` "
             "from `looks.csv`; every look's numbers are kept.", "",
             "**holds** / **fails**: the paired t statistic crossed the upper / lower boundary; **continue**: more "
             "seeds; **stopped at the cap**: no boundary crossed by the last look (undecided). The interval is the "
             "repeated 95% confidence interval of the mean paired difference at that look (valid whenever the design "
             "stops).", ""]
    if devs := deviation_lines(plan, state(plan)[1]):
        held = ("`contract.json` beside the plan holds the registered fields and each deviation's value" if
                (plan.folder / "contract.json").is_file() else "this plan has no `contract.json`: its looks were taken "
                "before plans were fingerprinted, and the plan's `deviations:` block is their record")
        lines += ["## Deviations from the registered plan", "",
                  f"Changes made on purpose, each recorded before the look it applies from ({held}):", "", *devs, ""]
    lines += ["## Power", "", "What the plan can see by its cap (`power_lines` in `ema_pg/workbench/studies/decide.py`: "
              "the chance of a **holds** by the cap, simulated with the design's looks and boundaries; the "
              "detectable effect is the one found with 80% power):", "",
              *[f"- {ln}" for ln in power_lines(plan, looks)], ""]
    if not len(looks):
        lines += ["No look taken yet."]
    else:
        lines += ["| claim | look | seeds | better | worse | Δ | sd | t | boundary | interval | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for _, r in looks.iterrows():
            lines.append(f"| {r['claim']}: {r['text']} | {int(r['look'])} | {int(r['seeds'])}"
                         f"{' (left out: ' + str(r['left_out']) + ')' if isinstance(r['left_out'], str) and r['left_out'] else ''} | "
                         f"{r['mean_better']:.3f} | {r['mean_worse']:.3f} | {r['mean_diff']:+.4f} | {r['sd_diff']:.4f} | "
                         f"{r['t']:+.2f} | ±{r['t_bound']:.2f} | [{r['lo']:+.4f}, {r['hi']:+.4f}] | **{r['verdict']}** |")
        verdicts, taken = state(plan)
        lines += ["", "Where each claim stands: " + "; ".join(f"{c.id} {verdicts[c.id]}" for c in plan.claims) + "."]
        ahead = outlooks(d, looks)
        if ahead:
            lines += ["", "## Where the open claims may end", "",
                      f"The chance of each verdict by the cap ({d.cap} seeds) from the last look, over {OUTLOOK_SIMS:,} simulated "
                      "futures of the seeds still to come (each seed's difference normal with the sd so far) and the "
                      "boundaries the remaining looks will apply (`outlook` in `ema_pg/workbench/sequential.py`). "
                      "**predictive** is the one to plan by; **trend** takes the estimate so far for the truth; "
                      "**none** is what noise alone would carry over a boundary from here. Not a verdict: only a "
                      "boundary crossed at a look decides.", "",
                      "| claim | seeds | next look | future | holds | fails | stopped at the cap | mean seeds at the end |",
                      "|---|---|---|---|---|---|---|---|"]
            for cid, fut in ahead.items():
                for f, o in fut.items():
                    lines.append(f"| {cid} | {o['seeds']} | {o['next_look']} | {f}: {OUTLOOKS[f]} | "
                                 f"{o['holds']:.0%} | {o['fails']:.0%} | {o['stopped at the cap']:.0%} | "
                                 f"{o['mean_seeds']:.0f} |")
        _plot(plan, looks, ahead)
        lines += ["", "![the looks](sequential.png)"]
    out = plan.folder / "sequential.md"
    from ...engine.files import atomic_write

    atomic_write(out, "\n".join(lines) + "\n")
    return out


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def _plot(plan: Plan, looks: pd.DataFrame, ahead: dict | None = None) -> None:
    import matplotlib.pyplot as plt

    from ..results import set_style

    set_style()
    d = plan.design
    fig, axes = plt.subplots(1, 3 if ahead else 2, figsize=(16.5 if ahead else 11, 4))
    ns = list(d.looks)
    from .sequential import t_boundary

    zb = d.boundaries()
    tb = [t_boundary(c, n) for c, n in zip(zb, ns)]
    ax = axes[0]
    ax.plot(ns, tb, "k--", lw=1, label="boundaries (planned looks, t scale)")
    ax.plot(ns, [-x for x in tb], "k--", lw=1)
    claims = looks.groupby("claim", sort=False)
    for i, (cid, g) in enumerate(claims):
        ax.plot(g["seeds"], g["t"], "o-", color=f"C{i}", label=cid)
        dodge = i - (claims.ngroups - 1) / 2  # a seed apart, centred on the look
        axes[1].errorbar(g["seeds"] + dodge, g["mean_diff"], yerr=[g["mean_diff"] - g["lo"], g["hi"] - g["mean_diff"]],
                         fmt="o", color=f"C{i}", capsize=3, label=cid)
    top = max(6, min(tb) * 1.5)
    ax.set_ylim(-top, top)
    for n, b in zip(ns, tb):  # an early look's boundary lies far off the scale: its value is written at the edge
        if b > top:
            ax.text(n, top * 0.9, f"±{b:.1f}", ha="center", fontsize=7)
    for a in axes[:2]:  # the planned looks on both panels, whichever have been taken
        a.set_xlim(ns[0] - 3, ns[-1] + 3)
        a.set_xticks(ns)
    ax.set_xlabel("paired seeds")
    ax.set_ylabel("paired t statistic")
    ax.set_title("Each look against the boundaries")
    ax.legend(fontsize=7)
    axes[1].axhline(0, color="k", lw=0.8)
    axes[1].set_xlabel("paired seeds")
    axes[1].set_ylabel("mean paired difference")
    axes[1].set_title("Repeated 95% intervals")
    axes[1].legend(fontsize=7)
    if ahead:  # each open claim's chance of each verdict by the cap, under each future
        ax = axes[2]
        rows = [(f"{cid} {f}", o) for cid, fut in ahead.items() for f, o in fut.items()]
        y = range(len(rows))
        left = [0.0] * len(rows)
        for verdict, color in (("holds", "C2"), ("stopped at the cap", "0.75"), ("fails", "C3")):
            share = [o[verdict] for _, o in rows]
            ax.barh(y, share, left=left, color=color, label=verdict)
            left = [a + b for a, b in zip(left, share)]
        ax.set_yticks(list(y), [r for r, _ in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel(f"chance by the cap ({d.cap} seeds)")
        ax.set_title("Where the open claims may end")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    fig.tight_layout()
    import io

    from ...engine.files import atomic_write

    buf = io.BytesIO()  # drawn in memory, then written whole or not at all (a full disk leaves no half a PNG)
    fig.savefig(buf, format="png", dpi=150)
    plt.close(fig)
    atomic_write(plan.folder / "sequential.png", buf.getvalue())


class Workers:
    """The look's cells through a launcher (:mod:`ema_pg.workbench.launchers`), at most its capacity started at once: each cell is
    reattached (a job the scheduler still holds), waited for (a live trainer already writes its folder) or started;
    finished cells are recorded as they end, by this process alone. A SIGTERM is passed on to each (its checkpoint
    saved)."""

    def __init__(self, launcher, log_dir: Path, code: Path = ROOT, extra=lambda method: [], record=None,
                 what: str = "cells of this look"):
        self.launcher, self.log_dir, self.live, self.code = launcher, log_dir, {}, Path(code)
        self.stopping = False
        self.extra = extra  #: what a cell's command adds that is no part of the plan (its trackers)
        self.record = record or record_cells  #: the ledger's writer, called as cells finish (a pilot has its own)
        self.what = what  #: the progress bar's name

    def _begin(self, plan: Plan, m: str, s: int):
        from ...engine.owner import live_owner, other_host
        from ..launchers import Adopted

        name = f"{m}_s{s}"
        if (cell := self.launcher.reattach(name)) is not None:
            return cell, f"{m} seed {s}: its job {cell.job} is still held by the scheduler; waiting for it"
        run = plan.run_dir(m, s)
        if (owner := live_owner(run)) is not None:
            if other_host(owner):  # a claim whose lock does not reach here: it would hold the folder for ever
                raise SystemExit(f"{run}: a run on {owner[0]} (pid {owner[1]}) claims it, and this file system's locks "
                                 f"are not known to reach here: wait for it to end (or end it), then remove "
                                 f"{run / '.ema_pg_run'} and run again; or set EMA_PG_SHARED_LOCKS=1 where the file "
                                 "system carries flock across hosts")
            return Adopted(run, owner), f"{m} seed {s}: a live run (pid {owner[-1]}) writes it; waiting for it"
        return self.launcher.start(name, cell_command(plan, m, s, self.code) + self.extra(m), self.code,
                                   self.log_dir / f"{name}.log"), ""

    def run(self, plan: Plan, cells: list[tuple[str, int]]) -> None:
        from tqdm.auto import tqdm

        queue = list(cells)
        if queue:  # the launcher starts before the bar: a cluster that cannot be joined says so on a line of its own
            self.launcher.capacity  # noqa: B018 - the lazy launcher's start
        bar = tqdm(total=len(queue), desc=self.what, unit="run")
        while queue or self.live:
            while queue and len(self.live) < self.launcher.capacity and not self.stopping:
                m, s = queue.pop(0)
                cell, said = self._begin(plan, m, s)
                if said:
                    tqdm.write(said)
                self.live[cell] = (m, s)
            time.sleep(1)
            ended = [(c, rc) for c in list(self.live) if (rc := c.poll()) is not None]
            if any(rc == 0 for _, rc in ended):
                try:  # every cell that ended in this poll at once: one reading of the folders, one ledger write
                    self.record(plan)
                except OtherBase:
                    self.stop()  # the other cells save their checkpoints; none is paired meanwhile
                    while any(c.poll() is None for c in self.live):
                        time.sleep(1)
                    bar.close()
                    raise
            for c, rc in ended:
                m, s = self.live.pop(c)
                bar.update(1)
                if rc and rc != EXIT_INTERRUPTED and not self.stopping:
                    tqdm.write(f"{m} seed {s} exited {rc}: see {self.log_dir / f'{m}_s{s}.log'}")
            if self.stopping and not self.live:
                break
        bar.close()

    def stop(self, *_):
        self.stopping = True
        for c in self.live:
            c.stop()


def main(argv=None) -> int:
    from ...engine.console import quiet_third_party

    quiet_third_party()  # no third-party warnings, bars or log lines on a command's console
    ap = command_parser(__doc__)
    ap.add_argument("plan", type=Path)
    ap.add_argument("--workers", type=int, default=2, help="cells run at a time (default 2)")
    ap.add_argument("--status", action="store_true", help="say where the plan stands and what the next look needs; run nothing")
    ap.add_argument("--report-only", action="store_true", help="write sequential.md / .png from looks.csv; run nothing")
    ap.add_argument("--respend", action="store_true",
                    help="recompute every look's boundary at the seeds its claim's earlier looks had when taken (as "
                         "looks.csv records them) and correct the rows that were spent otherwise; run nothing")
    ap.add_argument("--code", type=Path, default=None,
                    help="run the cells from the code in this checkout (say a worktree of the commit the plan was "
                         "registered at), in this checkout's environment; the ledger, its checks and the looks stay "
                         "this command's (default: this checkout)")
    ap.add_argument("--any-machine", action="store_true",
                    help="run cells on a machine other than the one cells.csv's cells ran on (where the cold start "
                         "comes out the same, or its cache is carried here); each cell's base policy is still checked")
    add_launcher_args(ap, what="cells")
    tracker_args(ap)
    a = ap.parse_args(argv)
    a.trackers = tracker_choice(a)
    if a.workers < 1:
        raise SystemExit(f"--workers {a.workers}: give 1 or more (cells run at a time)")
    if not a.plan.is_file():
        raise SystemExit(f"{a.plan}: no such plan file")
    plan = load_plan(a.plan)
    code = (a.code or ROOT).resolve()
    if not (code / "ema_pg" / "train.py").is_file():
        raise SystemExit(f"--code {a.code}: not a checkout of ema-pg (no ema_pg/train.py); make one with "
                         f"git worktree add --detach DIR COMMIT")
    if not a.status:  # one writer per plan: a second decide would run the same cells and take the same look
        claim_plan(plan)
    read_cells(plan), read_looks(plan)  # a damaged ledger is refused now, before anything runs or is written
    launcher_spec(a).check()
    if a.respend:
        return respend(plan)
    runs = not (a.status or a.report_only)  # the contract is checked where cells may run and looks be taken
    fingerprint = check_contract(plan, code, state(plan)[1])[0] if runs else ""
    try:
        return _run(plan, a, code, fingerprint)
    except NoRoom as e:  # a full disk under the plan's folder: named in one line; every file is whole or absent
        raise SystemExit(f"stopped: {e}; free some space and run the same command") from None


def respend(plan: Plan) -> int:
    """``--respend``: each looks.csv row's boundary spent again at the seeds its claim's looks had when taken, the
    rows that differ corrected (z and t boundary, the repeated interval) and said; a verdict that would change is
    refused (that is no correction but a new decision: say so in the plan's README first). Before looks were spent
    at their recorded seeds, a look re-counted earlier looks' seeds from the ledger of its day, where a left-out
    cell run since counted."""
    import math

    from ...engine.files import atomic_write
    from .sequential import t_boundary

    looks = read_looks(plan)
    changed = []
    for cid, g in (looks.groupby("claim", sort=False) if len(looks) else ()):
        g = g.sort_values("look")
        zb = plan.design.boundaries([int(n) for n in g["seeds"]])
        for (i, r), z in zip(g.iterrows(), zb):
            if abs(z - r["z_bound"]) <= 1e-9:
                continue
            n, b = int(r["seeds"]), t_boundary(z, int(r["seeds"]))
            se = r["sd_diff"] / math.sqrt(n)
            verdict = r["verdict"]
            if math.isfinite(r["t"]):
                decided = "holds" if r["t"] >= b else "fails" if r["t"] <= -b else None
                if decided and decided != verdict or not decided and verdict in ("holds", "fails"):
                    raise SystemExit(f"{plan.folder / LOOKS}: look {r['look']} of {cid} spent at the recorded seeds "
                                     f"would change its verdict ({verdict} -> {decided or 'not decided'}); that is a "
                                     "new decision, not a correction: nothing was written")
            changed.append(f"look {r['look']} of {cid}: z boundary {r['z_bound']:.5f} -> {z:.5f}, t boundary "
                           f"{r['t_bound']:.4f} -> {b:.4f}; verdict {verdict}")
            looks.loc[i, ["z_bound", "t_bound", "lo", "hi"]] = [z, b, r["mean_diff"] - b * se, r["mean_diff"] + b * se]
    if not changed:
        print(f"{plan.folder / LOOKS}: every look is spent at its recorded seeds; nothing to correct")
        return 0
    atomic_write(plan.folder / LOOKS, looks.to_csv(index=False))
    report(plan)
    print(f"{plan.folder / LOOKS}: corrected " + "; ".join(changed))
    return 0


def claim_plan(plan: Plan) -> None:
    """Make this process the plan's one writer, or refuse in one line naming the live one (as a second trainer on
    a run folder is refused): the lock is the kernel's, released however the holder ends."""
    from ...engine.owner import try_claim

    owner = try_claim(plan.folder, DECIDE_CLAIM)
    if owner is not None:
        who = f"process {owner[1]} on {owner[0]}" if len(owner) == 2 else "another process"
        raise SystemExit(f"{plan.path}: another decide ({who}) is running this plan; wait for it to end or stop it "
                         "(its cells save their checkpoints), then run this command again")


def _run(plan: Plan, a, code: Path, fingerprint: str) -> int:
    if a.report_only:
        print(f"wrote {report(plan)}")
        return 0
    workers = Workers(_Lazy(launcher_spec(a), plan.runs, a.workers), plan.runs / "logs", code,
                      extra=lambda m: cell_overrides(a, a.trackers, plan, m))
    signal.signal(signal.SIGTERM, workers.stop)
    signal.signal(signal.SIGINT, workers.stop)
    try:
        return _loop(plan, a, code, fingerprint, workers)
    finally:
        workers.launcher.close()


class _Lazy:
    """The launcher, started when the first cell needs it (a look with nothing to run starts no Ray or executor)."""

    def __init__(self, spec, runs: Path, workers: int):
        self.args, self._it = (spec, runs, workers), None

    def __getattr__(self, name):
        if name == "close":
            return self._it.close if self._it is not None else (lambda: None)
        if self._it is None:
            from ..launchers import make_launcher

            self._it = make_launcher(*self.args)
        return getattr(self._it, name)


def _loop(plan: Plan, a, code: Path, fingerprint: str, workers: Workers) -> int:
    if not a.status:
        record_cells(plan)
        machines = ledger_machines(read_cells(plan))
        if machines and machine() not in machines and not a.any_machine:
            raise SystemExit(f"{plan.folder / CELLS}: its cells ran on {' / '.join(machines)}, this machine is "
                             f"{machine()}: a cold start built here can come out another base policy. Run on that "
                             f"machine, or pass --any-machine (each cell's base is still checked as it lands)")
        if (gone := set_aside_here(plan)) and not a.any_machine:
            raise SystemExit(f"{plan.folder / SET_ASIDE}: {len(gone)} cells built on this machine's kind ({machine()}) "
                             f"were set aside (their cold start: {gone[0].get('cold_start') or 'not recorded'}): one "
                             f"built here would be refused too. Run where the plan's base policy comes from, or pass "
                             f"--any-machine (each cell's base is still checked as it lands)")
    verdicts, taken = state(plan)
    if not a.status and taken == 0 and needed(plan, 1, verdicts):
        check_cells(plan, code)  # before the first cell: what they will run is a plan's promise too
        print(power_lines(plan, read_looks(plan))[0], flush=True)  # what the plan can see, before it costs a cell
    while True:
        verdicts, taken = state(plan)
        open_claims = [c for c in plan.claims if verdicts[c.id] == "open"]
        print(f"{plan.path}: looks taken {taken} of {len(plan.design.looks)}; "
              + "; ".join(f"{c.id} {verdicts[c.id]}" for c in plan.claims), flush=True)
        if not open_claims or taken == len(plan.design.looks):
            report(plan)
            if not a.status:
                mirror_plan(plan, a, a.trackers, read_looks(plan))
            else:
                print("\n".join(power_lines(plan, read_looks(plan))))
            print("every claim is decided or at its cap")
            return 0
        k = taken + 1
        todo = needed(plan, k, verdicts)
        if a.status:
            cells = read_cells(plan)
            try:
                base, said = plan_base(plan, cells)
                base = f"{base} ({said})" if base else "none recorded yet"
            except OtherBase as e:
                base = str(e)
            print(f"base policy: {base}; the cells ran on: {' / '.join(ledger_machines(cells)) or 'not recorded'}; "
                  f"this machine: {machine()}")
            if gone := set_aside_here(plan):
                print(f"set aside before on this machine's kind: {len(gone)} cells ({plan.folder / SET_ASIDE}; their cold "
                      f"start: {gone[0].get('cold_start') or 'not recorded'}): a cell run here would be refused")
            print("\n".join(power_lines(plan, read_looks(plan))))
            print(f"look {k} at {plan.design.looks[k - 1]} seeds needs {len(todo)} more cells: "
                  + ", ".join(f"{m}:{s}" for m, s in todo[:12]) + (" ..." if len(todo) > 12 else ""))
            if todo:
                print(f"a cell's command, in {code}: " + shlex.join(cell_command(plan, *todo[0], code)))
            for cid, fut in outlooks(plan.design, read_looks(plan)).items():
                o = fut["predictive"]
                print(f"{cid} by the cap ({o['cap']} seeds): holds {o['holds']:.0%}, fails {o['fails']:.0%}, stopped "
                      f"at the cap {o['stopped at the cap']:.0%} (predictive; sequential.md has the other futures)")
            return 0
        if todo:
            plan.runs.mkdir(parents=True, exist_ok=True)
            (plan.runs / "logs").mkdir(exist_ok=True)
            where = f"{a.workers} at a time" if a.launcher == "local" else f"through {a.launcher}"
            print(f"look {k}: {len(todo)} cells to run ({where})", flush=True)
            workers.run(plan, todo)
            if workers.stopping:
                print("stopped by a signal: the cells saved their checkpoints; run the same command to continue",
                      file=sys.stderr)
                return EXIT_INTERRUPTED
            if needed(plan, k, verdicts):
                left = needed(plan, k, verdicts)
                print(f"look {k}: {len(left)} cells did not finish ({', '.join(f'{m}:{s}' for m, s in left[:6])}); "
                      f"see {plan.runs / 'logs'}; run the same command again", file=sys.stderr)
                return 1
        if k == 1:
            register(plan, code)
            fingerprint, _ = check_contract(plan, code, 0)
        rows = take_look(plan, k, verdicts, fingerprint)
        for r in rows:
            print(f"  look {k}, {r['claim']} ({r['text']}): {r['seeds']} seeds, Δ {r['mean_diff']:+.4f} "
                  f"[{r['lo']:+.4f}, {r['hi']:+.4f}], t {r['t']:+.2f} vs ±{r['t_bound']:.2f}: {r['verdict']}", flush=True)
        report(plan)
        mirror_plan(plan, a, a.trackers, read_looks(plan))  # the plan's tracker run holds every look taken


if __name__ == "__main__":
    raise SystemExit(main())
