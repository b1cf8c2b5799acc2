#!/bin/bash
# The Python packages a lent GPU machine's image lacks, as wheels in .whl/ (git-ignored), for
# benchmarks/gpu_check.sh to carry (the device call names .whl in carry). Run here, where the package registries
# are reachable; the GPU machine reaches none. `make gpu-wheels`.
#
# The image (Python 3.12, torch, transformers, Lightning, peft, pandas, pyarrow, matplotlib, ...) holds the names in
# IMAGE below, as its package list read on the machine said on 2026-11-17. Everything else the project, DeepSpeed
# and the TRL comparison need comes from here: pip resolves the whole set for Python 3.12 on manylinux, and what the
# image holds is left out. Versions are this checkout's .venv's where it has them (what the tests ran).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${WHL:-.whl}
IMAGE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx opencv-python-headless optax opt-einsum packaging pandas
pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pytest python-dateutil pytorch-lightning pyyaml regex requests rich
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard threadpoolctl tifffile tiktoken
timm tokenizers toolz torch torchaudio torchmetrics torchvision tqdm transformers triton typer typing-extensions
typing-inspect urllib3 wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
# what gpu_check.sh runs: the project's own dependencies, DeepSpeed, and TRL for the step beside it
WANT="hydra-core omegaconf optuna bm25s math-verify deepspeed==0.19.8 trl==1.16.0 datasets==5.2.0"
PLAT="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
--platform manylinux2014_x86_64"
pin() {  # NAME -> NAME==VERSION of .venv, or NAME as given
  local name=${1%%==*}
  [[ $1 == *==* ]] && { echo "$1"; return; }
  local v; v=$($PY -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] && echo "$name==$v" || echo "$name"
}
rm -rf "$OUT" && mkdir -p "$OUT"
# DeepSpeed and antlr4 (hydra's parser) are source distributions only: built here as pure-Python wheels
# (DeepSpeed with no prebuilt ops; on the GPU it builds the ones it needs just in time)
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$(pin deepspeed==0.19.8)" \
  "$(pin antlr4-python3-runtime)"
pins=(); for p in $WANT; do pins+=("$(pin "$p")"); done
# the whole set for the image's Python, the local wheels found first
$PY -m pip install -q --dry-run --ignore-installed --no-warn-conflicts --only-binary=:all: $PLAT --target /tmp/gpu-wheels-plan \
  --find-links "$OUT" --report /tmp/gpu-wheels-plan.json "${pins[@]}"
mapfile -t need < <($PY - "$OUT" "$IMAGE" "${pins[@]}" <<'EOF'
import json, re, sys
from pathlib import Path
from packaging.requirements import Requirement

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
built = {norm(w.name.split("-")[0]) for w in Path(sys.argv[1]).glob("*.whl")}
image = {norm(n) for n in sys.argv[2].split()}
plan = {norm(i["metadata"]["name"]): i for i in json.load(open("/tmp/gpu-wheels-plan.json"))["install"]}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython", "extra": ""}
todo, seen = [norm(Requirement(p).name) for p in sys.argv[3:]], set()
while todo:  # what the wanted packages need, down to what the image holds (its own needs are met there)
    name = todo.pop()
    if name in seen or name in image:
        continue
    seen.add(name)
    for r in map(Requirement, plan[name]["metadata"].get("requires_dist", [])):
        if r.marker is None or r.marker.evaluate(env):
            todo.append(norm(r.name))
for name in sorted(seen - built):
    print(f"{plan[name]['metadata']['name']}=={plan[name]['metadata']['version']}")
EOF
)
$PY -m pip download -q --no-deps --only-binary=:all: $PLAT -d "$OUT" "${need[@]}"
echo "$(ls "$OUT" | wc -l) wheels in $OUT, $(du -sm "$OUT" | cut -f1) MiB (a device call carries 64 MiB in all):"
ls "$OUT"
