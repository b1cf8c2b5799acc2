#!/bin/bash
# Issue 41's device check, one call on a lent GPU (about 6-9 minutes): the paper's recipes at Qwen2.5 sizes
# under DeepSpeed (benchmarks/recipes.py) and the chunked head at V = 151,936 with the trainer's default chunk. Each step has its own time cap
# and leaves its JSON in $OUT whatever the others do. The packages the image lacks travel as wheels (.whl).
#   run: bash benchmarks/gpu_check.sh   (with OUT set; carry .whl); STEPS="math15_z3" BUDGET=170 for the last one
set -u
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
left() { echo $(( ${BUDGET:-380} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; df -h / /tmp /dev/shm; free -g;
  python3 -c "import torch, transformers, lightning, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'deepspeed', deepspeed.__version__)"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
# the roomiest of the candidate folders holds the models and runs
W=$(python3 -c "import shutil; c=['/tmp','/dev/shm','/root']; print(max(c, key=lambda p: shutil.disk_usage(p).free))")/recipes
echo "workdir $W"
STEPS=${STEPS:-math15_z2 kr05_z3 search3_z2 math15_z3 kl_head}
step() {  # step NAME CAP ARGS...: one benchmark under its cap, its training processes ended after it
  local name=$1 cap=$2; shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  local l; l=$(left); [ "$l" -lt 45 ] && { echo "skip $name: ${l}s left"; return; }
  [ "$cap" -gt "$l" ] && cap=$l
  echo "== $name (cap ${cap}s) $(date +%T)"
  timeout -k 5 "$cap" "$@" > /tmp/$name.log 2>&1; echo "rc=$? $(date +%T)"
  pkill -9 -f ema_pg.train; tail -n 3 /tmp/$name.log | cut -c1-400
}
R="python3 benchmarks/recipes.py --workdir $W --iterations 2 --prompts 4 --eval-sets 1 --extra rollout.static_cache=false"
step math15_z2 110 $R --timeout 90 --recipe math_deepscaler --shape qwen2.5-1.5b --stage 2 --max-new-tokens 256 \
  --out $OUT/recipe_math_1.5b_z2.json
rm -rf $W/math_deepscaler-*/model $W/math_deepscaler-*/export-*
step kr05_z3 120 $R --timeout 50 --recipe math_deepscaler --shape qwen2.5-0.5b --stage 3 --max-new-tokens 128 \
  --kill-resume --out $OUT/recipe_math_0.5b_z3_kill_resume.json
rm -rf $W/math_deepscaler-*/model $W/math_deepscaler-*/export-*
step search3_z2 105 $R --timeout 85 --recipe search_paper --shape qwen2.5-3b --stage 2 --out $OUT/recipe_search_3b_z2.json
rm -rf $W/search_paper-*/model
step math15_z3 120 $R --timeout 95 --recipe math_deepscaler --shape qwen2.5-1.5b --stage 3 --max-new-tokens 256 \
  --out $OUT/recipe_math_1.5b_z3.json
step kl_head 60 python3 benchmarks/kl_head.py --device cuda --dtypes bfloat16,float32 --max-gb 100 --repeats 3 \
  --sizes 16384x151936x2048,32768x151936x2048 --out $OUT/kl_head_gpu.json
tar czf $OUT/logs.tgz -C / $(cd / && ls -d tmp/*.log ${W#/}/*/train.log 2>/dev/null)
echo "done in $(( $(date +%s) - T0 ))s"
