"""The fixture package of a researcher's own tasks (tests/fixtures/byo_task), installed by pip as theirs would be."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BYO_FIXTURE as FIXTURE


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The fixture package installed by pip, as a researcher installs theirs (into a folder of its own, so that the
    test's environment is left as it was): its module and its dist-info with the entry point."""
    tmp = tmp_path_factory.mktemp("byo")
    shutil.copytree(FIXTURE, tmp / "src")  # pip builds in the source folder: a copy keeps the repository clean
    out = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(out), str(tmp / "src")], check=True, capture_output=True, text=True)
    return out


@pytest.fixture
def on_path(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    import importlib

    importlib.invalidate_caches()
    return site
