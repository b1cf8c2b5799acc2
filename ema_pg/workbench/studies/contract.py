"""A decision plan is a contract: what its verdicts depend on is fingerprinted at its first look, and a later change
is refused unless it is recorded as a deviation.

``contract.json`` beside the plan holds, from the first look on:

- ``fields``: every plan field a decision depends on (:data:`FIELDS`: the looks, alpha, spending, the seeds
  (``seed0``), each claim's arms and score, the cells' overrides, the sweep, the scale, the base policy), as the
  plan gave them;
- ``files``: the sha256 of the sweep file and of its scale overlay, as the cells' code holds them (an edit of a
  sweep changes what every cell runs as surely as an edit of the plan);
- ``deviations``: the changes made on purpose since, each as the plan's ``deviations:`` list records it (the field,
  the reason, the date, the look it applies from) with the value it gave the field.

At every later start the plan and the files are compared with it. A field that differs, with no deviation for it
in the plan, is refused in one line naming the field, its registered value and its new one, and how to record the
change. A deviation is taken once, before the look it applies from (``from_look`` > the looks taken): it is then
part of the contract, shown in ``sequential.md`` and on ``CLAIMS.md``, and a later change of the same field needs
a deviation of its own. Pinning the base policy where none was registered (the ledger's own advice) is no deviation.
Every looks.csv row carries the short fingerprint (``plan``) of the contract in force when it was taken, and every
start compares the contract with the last one: a ``contract.json`` edited by hand is refused, and a missing one is
rebuilt from the plan only where the plan gives the fingerprint its looks recorded (the rebuilding is recorded and
shown with the deviations); otherwise it is refused, the file to be restored.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

CONTRACT = "contract.json"  #: the fingerprint, beside the plan
#: the fields a decision depends on, by the name a deviation gives them
FIELDS = ("looks", "alpha", "spending", "seeds", "arms", "score", "overrides", "sweep", "scale", "base")
DEVIATION_KEYS = ("field", "reason", "date", "from_look")


def plan_fields(plan) -> dict:
    """The decision's fields of a loaded :class:`~ema_pg.workbench.decide.Plan`, as plain data."""
    d = plan.design
    return {"looks": list(d.looks), "alpha": d.alpha, "spending": d.spending, "seeds": plan.seed0,
            "arms": {c.id: [c.better, c.worse] for c in plan.claims}, "score": {c.id: c.score for c in plan.claims},
            "overrides": list(plan.overrides), "sweep": plan.sweep, "scale": plan.scale, "base": plan.base}


def plan_files(plan, code: Path) -> dict[str, str]:
    """{path: sha256} of the files that define what a cell runs besides the plan: its sweep and scale overlay."""
    from ..sweepfiles import scale_file

    paths = [Path("sweeps") / f"{plan.sweep}.yaml", Path("sweeps") / "scale" / f"{scale_file(plan.sweep, plan.scale)}.yaml"]
    return {str(p): hashlib.sha256((Path(code) / p).read_bytes()).hexdigest() for p in paths if (Path(code) / p).is_file()}


def short(fields: dict, files: dict) -> str:
    """The short fingerprint of a contract's fields and files (a looks.csv row's ``plan``)."""
    return hashlib.sha256(json.dumps([fields, files], sort_keys=True).encode()).hexdigest()[:12]


def read_contract(plan) -> dict | None:
    f = plan.folder / CONTRACT
    if not f.is_file():
        return None
    try:
        c = json.loads(f.read_text())
        if not {"fields", "files", "deviations"} <= set(c):
            raise ValueError("it lacks fields, files or deviations")
        return c
    except ValueError as e:
        raise SystemExit(f"{f}: unreadable ({str(e).splitlines()[0]}); restore it from git (git checkout -- {f})") \
            from None


def in_force(contract: dict, upto: int | None = None) -> tuple[dict, dict]:
    """(fields, files) of a contract with its recorded deviations applied (those applying from look ``upto`` or
    earlier where it is given: the contract in force when that look was taken)."""
    fields, files = dict(contract["fields"]), dict(contract["files"])
    for dev in contract["deviations"]:
        if upto is not None and dev["from_look"] > upto:
            continue
        if dev["field"] == "files":
            files = dict(dev["value"])
        else:
            fields[dev["field"]] = dev["value"]
    return fields, files


def _said(v) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def last_fingerprint(plan) -> tuple[int, str] | None:
    """(look, fingerprint) of the last looks.csv row that carries the contract's fingerprint (rows from before plans
    were fingerprinted carry none)."""
    from .ledger import LOOKS, read_looks_file

    looks = read_looks_file(plan.folder / LOOKS)
    if not len(looks) or "plan" not in looks:
        return None
    rows = looks[looks["plan"].astype(str).str.len() == 12]
    return (int(rows["look"].iloc[-1]), str(rows["plan"].iloc[-1])) if len(rows) else None


def _fingerprints(fields: dict, files: dict, base) -> set[str]:
    """The short fingerprints a look may have recorded under these fields: its base as the contract holds it, unset,
    or pinned by the plan (a pin is no deviation)."""
    return {short({**fields, "base": b}, files) for b in (fields.get("base"), None, base)}


def check(plan, code: Path, taken: int) -> tuple[str, list[dict]]:
    """Compare the plan (and the files its cells run) with its contract, recording it at the first look or taking a
    new deviation in; returns (the short fingerprint in force, the deviations of the contract). Refuses, in one
    line, a change of a decision's field that the plan records no deviation for, a contract that is not the one its
    looks were taken under, and a missing one that the plan cannot rebuild."""
    now_fields, now_files = plan_fields(plan), plan_files(plan, code)
    contract = read_contract(plan)
    f = plan.folder / CONTRACT
    seen = last_fingerprint(plan) if taken else None
    if contract is None and seen is not None:
        k, fp = seen
        if fp not in _fingerprints(now_fields, now_files, now_fields.get("base")):
            raise SystemExit(f"{plan.path}: {f} is gone, and the plan is not the one its looks were taken under (look "
                             f"{k} recorded the contract {fp}; the plan gives {short(now_fields, now_files)}): restore "
                             f"{f} (git checkout -- {f}); a change of the plan is then recorded as a deviation")
        contract = {"fields": now_fields, "files": now_files, "deviations": [],
                    "rebuilt": [{"from_look": taken + 1, "recorded": _now(),
                                 "reason": f"{CONTRACT} was missing; rebuilt from the plan, which gives the fingerprint "
                                           f"look {k} recorded ({fp})"}]}
        _write(f, contract)
        print(f"{f}: missing; rebuilt from the plan, which gives the fingerprint look {k} recorded ({fp})", flush=True)
    if contract is not None and seen is not None:
        k, fp = seen
        if fp not in _fingerprints(*in_force(contract, upto=k), now_fields.get("base")):
            raise SystemExit(f"{plan.path}: {f} is not the contract its looks were taken under (look {k} recorded "
                             f"{fp}; the file gives {short(*in_force(contract, upto=k))}): it was edited; restore it "
                             f"(git checkout -- {f}), and record a change of the plan as a deviation (deviations: - "
                             f"{{field: ..., reason: ..., date: ..., from_look: {taken + 1}}})")
    if contract is None:
        if taken == 0:
            return short(now_fields, now_files), []  # written when the first look is taken (register)
        contract = {"fields": now_fields, "files": now_files, "deviations": [], "registered_at_look": taken + 1,
                    "note": f"fingerprinted after look {taken}: the looks before it were taken before plans were "
                            "fingerprinted"}
        _write(f, contract)
        return short(now_fields, now_files), []
    fields, files = in_force(contract)
    recorded = {(d["field"], d["from_look"]) for d in contract["deviations"]}
    declared = plan.deviations
    changed = [k for k in FIELDS if fields.get(k) != now_fields.get(k)
               and not (k == "base" and fields.get(k) is None)]  # pinning the base the ledger asked for
    if files != now_files:
        changed.append("files")
    new = []
    for k in changed:
        devs = [d for d in declared if d["field"] == k and (k, d["from_look"]) not in recorded]
        if not devs:
            if k == "files":
                which = sorted(p for p in set(files) | set(now_files) if files.get(p) != now_files.get(p))
                raise SystemExit(f"{plan.path}: {', '.join(which)} changed since the plan was fingerprinted "
                                 f"({f}): its cells would run otherwise than its looks' cells; restore the file, or "
                                 f"record a deviation in the plan (deviations: - {{field: files, reason: ..., date: "
                                 f"..., from_look: {taken + 1}}})")
            raise SystemExit(f"{plan.path}: {k} is {_said(now_fields.get(k))}, but the plan was registered with "
                             f"{_said(fields.get(k))} ({f}); put it back, or record the change as a deviation in the "
                             f"plan (deviations: - {{field: {k}, reason: ..., date: ..., from_look: {taken + 1}}})")
        dev = devs[-1]
        if dev["from_look"] <= taken:
            raise SystemExit(f"{plan.path}: the deviation of {k} applies from look {dev['from_look']}, which was "
                             f"taken already ({taken} looks); a deviation is written before the look it applies "
                             f"from: give from_look: {taken + 1}")
        new.append({**dev, "value": now_files if k == "files" else now_fields.get(k), "recorded": _now()})
    pinned = contract["fields"].get("base") is None and now_fields.get("base") and "base" not in changed
    if pinned:  # pinning the base is no deviation, but a later change of it is one
        contract["fields"]["base"], contract["base_pinned_from_look"] = now_fields["base"], taken + 1
    if new or pinned:
        contract["deviations"] += new
        _write(f, contract)
    fields, files = in_force(contract)
    return short(fields, files), contract["deviations"]


def register(plan, code: Path) -> None:
    """Fingerprint the plan at its first look (nothing happens if it has its contract already)."""
    f = plan.folder / CONTRACT
    if not f.is_file():
        _write(f, {"fields": plan_fields(plan), "files": plan_files(plan, code), "deviations": [],
                   "registered_at_look": 1, "registered": _now()})


def deviation_lines(plan, taken: int) -> list[str]:
    """The plan's deviations as sequential.md and CLAIMS.md list them: those its contract recorded, and those the plan
    states beside them (one for a look still to come is taken in at the next start; one for a look already taken
    was made before plans were fingerprinted, and the plan's text is its record)."""
    contract = read_contract(plan)
    recorded = contract["deviations"] if contract else []
    keys = {(d["field"], d["from_look"]) for d in recorded}
    recorded = recorded + [{"field": "contract", "date": d["recorded"], **d} for d in (contract or {}).get("rebuilt", [])]
    stated = [d for d in plan.deviations if (d["field"], d["from_look"]) not in keys]
    return [f"- from look {d['from_look']} ({d['date']}): {d['field']}: {d['reason']}"
            + (" (to be taken in at the next start)" if d in stated and d["from_look"] > taken else "")
            for d in sorted([*recorded, *stated], key=lambda d: d["from_look"])]


def parse_deviations(raw, path: Path) -> list[dict]:
    """The plan's ``deviations:`` list, checked: each has a field of :data:`FIELDS` (or ``files``), a reason, a
    date and the look it applies from."""
    out = []
    for i, d in enumerate(raw or []):
        if not isinstance(d, dict) or set(d) != set(DEVIATION_KEYS):
            raise SystemExit(f"{path}: deviation {i + 1} needs exactly {', '.join(DEVIATION_KEYS)}; got {d}")
        if d["field"] not in (*FIELDS, "files"):
            raise SystemExit(f"{path}: deviation {i + 1}'s field {d['field']!r} is none of {', '.join(FIELDS)}, files")
        if not isinstance(d["from_look"], int) or d["from_look"] < 1 or not str(d["reason"]).strip():
            raise SystemExit(f"{path}: deviation {i + 1} needs a reason and from_look, a look number >= 1")
        out.append({"field": str(d["field"]), "reason": str(d["reason"]), "date": str(d["date"]),
                    "from_look": int(d["from_look"])})
    return out


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _write(f: Path, contract: dict) -> None:
    from ...engine.files import atomic_write

    atomic_write(f, json.dumps(contract, indent=2, sort_keys=True) + "\n")
