"""The command line of every ``python -m ema_pg.X`` command: one parser, whose usage line names the command as it
was typed (argparse's own names the file: ``usage: decide.py``, which no one can run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  #: the folder that holds the ema_pg package (a checkout: conf/, runs/, reproductions/ beside it)


def typed_command(argv0: str | None = None) -> str | None:
    """``python -m ema_pg.decide`` for a process started so (``sys.argv[0]`` is then the module's file); None when
    the process is not one of the package's modules (a test calling ``main(argv)``, an embedding program)."""
    path = Path(sys.argv[0] if argv0 is None else argv0).resolve()
    try:
        parts = path.with_suffix("").relative_to(PACKAGE_ROOT).parts
    except ValueError:
        return None
    if path.suffix != ".py" or not parts or parts[0] != "ema_pg":
        return None
    parts = parts[:-1] if parts[-1] == "__main__" else parts
    return "python -m " + ".".join(parts)


def command_parser(description: str | None, **kw) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for a command: its usage line is :func:`typed_command`, its description kept as written
    (a module's docstring, paragraphs and all)."""
    return argparse.ArgumentParser(prog=typed_command(), description=description,
                                   formatter_class=kw.pop("formatter_class", argparse.RawDescriptionHelpFormatter), **kw)
