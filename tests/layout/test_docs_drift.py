"""The docs cannot drift from the code: every config knob README.md and docs/*.md name in code (``group.key=...``)
is a key of its group, every ``group=option`` an option of it, every ``make`` target a target of the Makefile, every
``python -m ema_pg...`` module importable, and every relative link a file. A rename that leaves the docs behind
fails here."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from ema_pg.config import Config
from ema_pg.tasks import task_defaults
from ema_pg.tasks.plugins import class_knobs, load_target

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code(text: str) -> str:
    """The text's code: fenced blocks and inline spans, where commands and knobs are written."""
    fenced = re.findall(r"```.*?```", text, re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return "\n".join(fenced + re.findall(r"`([^`\n]+)`", rest))


def known() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(the keys of each config group, the options of each config group)."""
    keys = {f.name: {g.name for g in fields(f.default_factory)} for f in fields(Config)
            if callable(f.default_factory) and is_dataclass(f.default_factory)}
    keys["task"] = set().union(*(task_defaults(p.stem) for p in (ROOT / "conf" / "task").glob("[!_]*.yaml"))) | {"name"}
    options = {d.name: {p.stem for p in d.glob("*.yaml")} for d in (ROOT / "conf").iterdir() if d.is_dir()}
    # the docs' own task package (tests/fixtures/byo_task): its entry points are task options once it is installed
    fixture = ROOT / "tests" / "fixtures" / "byo_task"
    sys.path.insert(0, str(fixture))
    try:
        for name, target in tomllib.loads((fixture / "pyproject.toml").read_text())["project"]["entry-points"][
                "ema_pg.tasks"].items():
            options["task"].add(name)
            keys["task"] |= set(class_knobs(load_target(target)))
    finally:
        sys.path.remove(str(fixture))
    return keys, options


def drift(doc: Path) -> list[str]:
    text = doc.read_text()
    src = code(text)
    keys, options = known()
    targets = set(re.findall(r"^([a-zA-Z0-9_-]+):", (ROOT / "Makefile").read_text(), re.M))
    bad = [f"{m.group(0)} ({m.group(1)} has no key {m.group(2)})"
           for m in re.finditer(r"(?<![\w.+/$-])([a-z_]+)\.([a-z_]+)(?:\.[a-z_]+)*=", src)
           if m.group(1) in keys and m.group(2) not in keys[m.group(1)]]
    bad += [f"{m.group(0)} (no conf/{m.group(1)}/{m.group(2)}.yaml)"
            for m in re.finditer(r"(?<![\w.+/$-])([a-z_]+)=([a-z_0-9]+)\b(?![.\w/])", src)
            if options.get(m.group(1)) and m.group(2) not in options[m.group(1)]]
    bad += [f"make {t} (no such Makefile target)" for t in re.findall(r"\bmake ([a-z][a-z0-9-]+)", src)
            if t not in targets]
    bad += [f"python -m {m} (no such module)" for m in re.findall(r"python -m (ema_pg(?:\.[a-z_]+)*)", src)
            if importlib.util.find_spec(m) is None]
    bad += [f"link {t} (no such file)" for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
            if "://" not in t and not (doc.parent / t).exists()]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_name_only_what_exists(doc):
    assert drift(doc) == [], f"{doc.relative_to(ROOT)}: " + "; ".join(drift(doc))


def test_the_checker_catches_each_kind_of_drift(tmp_path):
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text("Run `make tset` or `python -m ema_pg.trian algo.betta=0.1 anchor=emma`, "
                   "see [the guide](missing.md); `algo.beta=0.1 anchor=ema make test python -m ema_pg.train`.\n")
    found = drift(doc)
    assert len(found) == 5 and {f.split(" (")[0] for f in found} == {
        "make tset", "python -m ema_pg.trian", "algo.betta=", "anchor=emma", "link missing.md"}, found
