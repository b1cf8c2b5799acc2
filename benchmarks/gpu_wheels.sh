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
$PY benchmarks/gpu_wheels_deps.py "$OUT" "$IMAGE" $PLAT -- $WANT
echo "$(ls "$OUT" | wc -l) wheels in $OUT, $(du -sm "$OUT" | cut -f1) MiB (a device call carries 64 MiB in all):"
ls "$OUT"
