"""No module of ema_pg imports, through any chain, a module that imports it back (imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "ema_pg"


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the ema_pg modules it imports (relative or absolute, at any depth in its code)."""
    files = {".".join(("ema_pg", *f.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): f
             for f in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}

    def known(name: str) -> str:
        seen = name
        while name not in files:
            if "." not in name:  # a relative import that climbs out of the package: it would fail when run
                raise AssertionError(f"an import of {seen!r} names no module of ema_pg")
            name = name.rsplit(".", 1)[0]
        return name

    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                elif (node.module or "").startswith("ema_pg"):
                    base = node.module
                else:
                    continue
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files] or [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("ema_pg")]
            else:
                continue
            graph[mod] |= {known(t) for t in targets} - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles, leaving out a package and its own submodules (a package's __init__ re-exports them)."""
    out, seen = [], set()

    def walk(start, node, path):
        for nxt in graph[node]:
            if nxt == start:
                c = path + [nxt]
                if not all(a.startswith(b) or b.startswith(a) for a, b in zip(c, c[1:])) and frozenset(c) not in seen:
                    seen.add(frozenset(c))
                    out.append(c)
            elif nxt not in path and len(path) < 8:
                walk(start, nxt, path + [nxt])

    for m in graph:
        walk(m, m, [m])
    return out


def test_the_package_imports_nothing_in_a_circle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_check_sees_a_cycle_through_an_import_inside_a_function(tmp_path):
    pkg = tmp_path / "ema_pg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n")
    (pkg / "b.py").write_text("def g():\n    from .a import x\n")
    assert cycles(import_graph(pkg)) == [["ema_pg.a", "ema_pg.b", "ema_pg.a"]]
