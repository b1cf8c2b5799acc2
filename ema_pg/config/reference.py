"""``python -m ema_pg.config.reference``: docs/config.md, every knob of the schema, written from the schema itself.

Each knob's key, type, default and meaning come from :mod:`.schema` (the ``#:`` comment beside or above its field is
its meaning); its source is what that meaning cites: the paper (an equation, algorithm, section, table or appendix
of arXiv 2602.04417), a peer project or method it names, or ema-pg's own. The KL estimators' and anchor schemes'
own parameters come from their registries (``ema_pg.kl.ESTIMATORS``, ``ema_pg.anchors.SCHEMES``), each task's
settings from its option file under ``conf/task/``.

    python -m ema_pg.config.reference            # writes docs/config.md
    python -m ema_pg.config.reference --check    # exit 1 if the committed page differs from the schema's

A test fails when the page and the schema drift, and when a knob has no meaning.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import typing

from . import schema
from ..cli import PACKAGE_ROOT
from .compose import CONF_DIR

PAGE = PACKAGE_ROOT / "docs" / "config.md"
#: what a meaning cites that makes the paper its source
PAPER = re.compile(r"(\beqs?\.|\bAlg(orithm)? ?\d|§\s?\d|\bTable \d|\bApp(\.|endix) ?[A-H]\b|\bFig\.? ?\d|\bLemma|"
                   r"\bthe paper|\bpaper's|\bpaper \d)")
#: the peers a meaning may name, as it names them (the first found is the source given)
PEERS = ("AReaL", "DeepSeek-V3.2", "Ziegler", "verl", "TRL", "OpenRLHF", "prime-rl", "DeepSpeed", "vLLM", "Lightning", "Hydra", "wandb", "MLflow",
         "TensorBoard", "PPO", "GSPO", "CISPO", "DPPO", "GAE", "Search-R1", "skyrl-gym", "reasoning-gym",
         "DeepScaleR", "LoRA", "peft", "Optuna", "Ray", "submitit", "torch.compile", "FSDP", "ZeRO", "Adam",
         "Schulman", "WARP", "Dr. GRPO", "DAPO", "GRPO")


def _comments(cls) -> dict[str, str]:
    """{field: its ``#:`` comment}: the one after the field on its line, or the block of ``#:`` lines above it."""
    lines, start = inspect.getsourcelines(cls)
    src = "".join(lines)
    tree = ast.parse(inspect.cleandoc("\n" + src) if src.startswith(" ") else src)
    out = {}
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        row = lines[node.end_lineno - 1] if node.end_lineno - 1 < len(lines) else ""
        said = row.split("#:", 1)[1].strip() if "#:" in row else ""
        if not said:
            above, i = [], node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):
                above.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            said = " ".join(above)
        out[node.target.id] = said
    return out


def _type(t) -> str:
    s = t if isinstance(t, str) else getattr(t, "__name__", None) or str(t)
    return str(s).replace("typing.", "").replace("NoneType", "None")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def source(meaning: str) -> str:
    """The paper where the meaning cites it, else the first peer it names, else ema-pg."""
    if PAPER.search(meaning):
        return "paper"
    for p in PEERS:
        if re.search(rf"(?<![\w-]){re.escape(p)}(?![\w-])", meaning):
            return f"peer: {p}"
    return "ema-pg"


def knobs(cls=schema.Config, prefix: str = "") -> list[dict]:
    """Every leaf knob under ``cls``: key, type, default, meaning, source (the nested groups walked in order)."""
    hints = typing.get_type_hints(cls, vars(schema))
    said = _comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        t = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(t):
            out += knobs(t, f"{key}.")
            continue
        if key == "task":
            continue  # its fields are the task's: conf/task/ (task_settings)
        meaning = said.get(f.name, "")
        out.append({"key": key, "type": _type(t), "default": _default(f), "meaning": meaning,
                    "source": source(meaning)})
    return out


def registry_defaults() -> list[tuple[str, str, dict]]:
    """(group, option, its parameters' defaults) of every KL estimator and anchor scheme."""
    from ..anchors import SCHEMES
    from ..kl import ESTIMATORS

    return ([("kl", n, dict(s.defaults)) for n, s in ESTIMATORS.items()]
            + [("anchor", n, dict(s.defaults)) for n, s in SCHEMES.items()])


def surrogate_knobs() -> list[tuple[str, str, tuple[str, ...]]]:
    """(algo.loss option, its record type's name, the algo knobs it reads) of every surrogate."""
    from .. import losses

    return [(n, cls.__name__, losses.surrogate_knobs(n)) for n, (cls, _) in losses.SURROGATES.items()]


def task_settings() -> list[tuple[str, str, object, str]]:
    """(task option, key, value, its comment) of every setting of ``conf/task/<option>.yaml`` (``_common`` first)."""
    import yaml

    out = []
    for f in sorted((CONF_DIR / "task").glob("*.yaml"), key=lambda p: (p.stem != "_common", p.stem)):
        data = yaml.safe_load(f.read_text()) or {}
        notes = {}
        for line in f.read_text().splitlines():
            m = re.match(r"^([A-Za-z_]\w*):.*?#\s*(.*)$", line)
            if m:
                notes[m.group(1)] = m.group(2).strip()
        for k, v in data.items():
            if k != "defaults":
                out.append((f.stem, k, v, notes.get(k, "")))
    return out


def _cell(x, quote: bool = False) -> str:
    """A table cell: ``x`` as text (a string default quoted, so that "" and "none" read as strings), pipes escaped."""
    text = repr(x) if quote and isinstance(x, str) else str(x)
    return text.replace("|", "\\|").replace("``", "`")


def _section(title: str, intro: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A section of the page: its heading, one line of introduction and a table of ``rows`` (cells already written)."""
    return (["", f"## {title}", "", intro, "", f"| {' | '.join(header)} |", "|" + "---|" * len(header)]
            + [f"| {' | '.join(r)} |" for r in rows])


def page() -> str:
    rows = knobs()
    lines = ["# Config reference", "",
             "Written by `python -m ema_pg.config.reference` from the schema (`ema_pg/config/schema.py`), never by "
             f"hand; a test fails when they differ. {len(rows)} knobs. Each is set as `group.key=value` on the command "
             "line (`python -m ema_pg train algo.beta=0.02`) or in an experiment file; the files under `conf/<group>/` "
             "are options that change some of them. **source**: *paper* where the meaning cites arXiv 2602.04417, "
             "*peer* where it names the project or method the knob follows, else *ema-pg*.", ""]
    group = None
    for r in rows:
        g = r["key"].split(".")[0] if "." in r["key"] else "(top level)"
        if g != group:
            lines += [""] if group is not None else []
            group = g
            lines += [f"## {g}", "", "| knob | type | default | meaning | source |", "|---|---|---|---|---|"]
        lines.append(f"| `{r['key']}` | {_cell(r['type'])} | `{_cell(r['default'], True)}` | {_cell(r['meaning'])} | "
                     f"{r['source']} |")
    lines += _section("The estimators' and anchor schemes' parameters",
                      "`kl.<param>` and `anchor.<param>` left unset (null) take the chosen option's default from its "
                      "registry (`ema_pg.kl.ESTIMATORS`, `ema_pg.anchors.SCHEMES`):",
                      ["group", "option", "parameters' defaults"],
                      [[grp, f"`{name}`", ", ".join(f"`{k}={_cell(v, True)}`" for k, v in d.items()) or "(none)"]
                       for grp, name, d in registry_defaults()])
    lines += _section("The surrogates' knobs",
                      "`algo.loss=<option>` compiles, once per run, to the option's record (`ema_pg.losses.SURROGATES`), "
                      "which holds the `algo` knobs it reads; setting one it does not read is refused:",
                      ["`algo.loss`", "record", "knobs it reads"],
                      [[f"`{name}`", f"`{record}`", ", ".join(f"`algo.{k}`" for k in read)]
                       for name, record, read in surrogate_knobs()])
    lines += _section("The tasks' settings",
                      "`task=<option>` chooses a task; its settings are the option file's (`conf/task/<option>.yaml`, "
                      "with `_common.yaml`'s beneath each), set as `task.<key>=value`:",
                      ["task", "key", "default", "meaning"],
                      [[t, f"`task.{k}`", f"`{_cell(v, True)}`", _cell(note)] for t, k, v, note in task_settings()])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from ..cli import command_parser

    ap = command_parser(__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/config.md differs from the schema's page")
    a = ap.parse_args(argv)
    text = page()
    if a.check:
        same = PAGE.is_file() and PAGE.read_text() == text
        print(f"{PAGE}: {'up to date' if same else 'out of date: run python -m ema_pg.config.reference'}")
        return 0 if same else 1
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
