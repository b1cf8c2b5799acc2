"""The wheels a lent GPU's image lacks: the wanted packages and what they need, down to what the image holds.

Each wheel is fetched with ``--no-deps`` for the image's Python and its METADATA read for the next names (a whole-set
resolve would pull torch's CUDA wheels, which the registries here may lack); versions are this environment's where it
has them (what the tests ran), else the newest the requirement allows. Called by ``benchmarks/gpu_wheels.sh``.

    python benchmarks/gpu_wheels_deps.py OUT "IMAGE NAMES" --platform ... -- NAME[==VERSION] ...
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

#: the image's interpreter and platform, for requirement markers
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython", "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(argv: list[str]) -> None:
    out, image = Path(argv[0]), {norm(n) for n in argv[1].split()}
    split = argv.index("--")
    plat, want = argv[2:split], argv[split + 1:]
    wheels = lambda: {norm(w.name.split("-")[0]): w for w in out.glob("*.whl")}
    todo, seen = [Requirement(w) for w in want], set()
    while todo:
        r = todo.pop()
        name = norm(r.name)
        if name in seen or name in image:
            continue
        seen.add(name)
        if name not in wheels():
            try:
                spec = str(r) if r.specifier else f"{r.name}=={metadata.version(r.name)}"
            except metadata.PackageNotFoundError:
                spec = r.name
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *plat,
                            "-d", str(out), spec], check=True)
        with zipfile.ZipFile(wheels()[name]) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        for line in meta.splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate(ENV):
                    todo.append(req)


if __name__ == "__main__":
    main(sys.argv[1:])
