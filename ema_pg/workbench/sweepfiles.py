"""The sweep files' layout: ``sweeps/<name>.yaml`` and its scale overlays ``sweeps/scale/<name>_<scale>.yaml`` (or a
shared ``<scale>.yaml``), with the directives an overlay's comment lines give (``# choices:``, ``# transfer:``). Read
by reproduce and by the studies' plans."""

from __future__ import annotations

from pathlib import Path

from ..cli import PACKAGE_ROOT

SWEEPS = PACKAGE_ROOT / "sweeps"
TABLES = ("table2", "table3")  #: reproductions with their own make target and a provenance line


def scale_file(name: str, scale: str) -> str:
    if name in TABLES and scale.startswith("decide") and not (SWEEPS / "scale" / f"{name}_{scale}.yaml").is_file():
        raise SystemExit(f"scale {scale!r} (sweeps/scale/{scale}.yaml) is the demo task's decisive regime; {name} runs "
                         f"another task: add sweeps/scale/{name}_{scale}.yaml for it")
    for cand in (f"{name}_{scale}", scale):
        if (SWEEPS / "scale" / f"{cand}.yaml").is_file():
            return cand
    have = sorted(p.stem for p in (SWEEPS / "scale").glob("*.yaml"))
    raise SystemExit(f"no scale {scale!r} for {name}: add sweeps/scale/{name}_{scale}.yaml (there are: {', '.join(have)})")


def overlay_directive(overlay: str, key: str, sweeps: Path | None = None) -> list[str]:
    """The words of a scale overlay's ``# <key>:`` line ([] without one); ``sweeps``: another checkout's sweep files."""
    for line in ((SWEEPS if sweeps is None else sweeps) / "scale" / f"{overlay}.yaml").read_text().splitlines():
        if line.startswith(f"# {key}:"):
            return line.split(":", 1)[1].split()
    return []


def overlay_choices(overlay: str, sweeps: Path | None = None) -> list[str]:
    """Group choices a scale overlay asks for on its ``# choices:`` line (``experiment=search_paper``):
    an overlay cannot re-choose a group the sweep file already chose, the command line can."""
    return overlay_directive(overlay, "choices", sweeps)


def overlay_transfer(overlay: str) -> int:
    """N of a scale overlay's ``# transfer: N`` line: every finished run is also evaluated on N worlds it never
    saw (``python -m ema_pg.evaluate RUN --transfer N``) before the report, which reads them (0: none)."""
    words = overlay_directive(overlay, "transfer")
    if words and not (words[0].isdigit() and int(words[0]) > 0):
        raise SystemExit(f"sweeps/scale/{overlay}.yaml: '# transfer: {' '.join(words)}'; give a number of worlds >= 1")
    return int(words[0]) if words else 0
