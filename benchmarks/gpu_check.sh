#!/bin/bash
# The device check on a lent GPU: the paper's recipes at Qwen2.5 sizes under DeepSpeed (benchmarks/recipes.py), the
# RL step beside TRL at Qwen2.5-1.5B's body (benchmarks/rl_step.py), and what else fits. Each step has its own time cap
# and leaves its JSON in $OUT whatever the others do. The packages the image lacks travel as wheels (.whl, built
# here first by `make gpu-wheels`).
#   run: bash benchmarks/gpu_check.sh   (with OUT set; carry .whl; timeout_s 600); STEPS="math15_z3" BUDGET=170 for one step
# A lease is 15 minutes of device time, the machine's start included, so the default is issue 81's first two items
# (about 5 minutes: room to run it again), and its item 4 is the second call:
#   1. STEPS default          math15_z3 (1.5B, ZeRO-3, 3 iterations: phases, peak memory, the anchor's lag)
#                             kr05_z3 (0.5B, ZeRO-3, killed, resumed, exported: the export's lag = the run's)
#   2. STEPS="step15 step15_eager" BUDGET=330: the step beside TRL at 1.5B, bf16, ema-pg's static cache and CUDA-graph
#                             decode, then ema-pg alone with the growing cache (today's sampler without graphs)
#   then, where time is left: search3_z2 (MAX_NEW=500 for the recipe's own length), math15_z2, pack15, kl_head, curve
set -u
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
left() { echo $(( ${BUDGET:-565} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; df -h / /tmp /dev/shm; free -g;
  python3 -c "import torch, transformers, lightning, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'deepspeed', deepspeed.__version__)"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
# the roomiest of the candidate folders holds the models and runs
W=$(python3 -c "import shutil; c=['/tmp','/dev/shm','/root']; print(max(c, key=lambda p: shutil.disk_usage(p).free))")/recipes
echo "workdir $W"
# the default steps are issue 81's first two items (the header). Every step's evaluations are the run's last only
# (algo.eval_only_at_end): the 2026-11-26 check spent its caps on first evaluations (40 s at 1.5B/3B)
STEPS=${STEPS:-math15_z3 kr05_z3}
step() {  # step NAME CAP ARGS...: one benchmark under its cap (SIGTERM: it writes what it measured), its runs ended after it
  local name=$1 cap=$2; shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  local l; l=$(left); [ "$l" -lt 45 ] && { echo "skip $name: ${l}s left"; return; }
  [ "$cap" -gt "$l" ] && cap=$l
  echo "== $name (cap ${cap}s) $(date +%T)"
  timeout -k 8 "$cap" "$@" > /tmp/$name.log 2>&1; echo "rc=$? $(date +%T)"
  pkill -9 -f ema_pg; tail -n 3 /tmp/$name.log | cut -c1-400
}
R="python3 benchmarks/recipes.py --workdir $W --iterations 2 --prompts 4 --eval-sets 1 --extra rollout.static_cache=false algo.eval_only_at_end=true"
M="rollout.eval_samples=4"  # the math recipe's 32 samples per eval problem cost 20-40 s per evaluation at 1.5B
step pack15 80 python3 benchmarks/packing.py --device cuda --shapes math_qwen --qwen qwen2.5-1.5b --math-len 1024 \
  --out $OUT/packing_math_1.5b_gpu.json
step math15_z3 150 $R $M --iterations 3 --timeout 140 --recipe math_deepscaler --shape qwen2.5-1.5b --stage 3 \
  --max-new-tokens 128 --steps-only --out $OUT/recipe_math_1.5b_z3.json
rm -rf $W/math_deepscaler-*/model
step search3_z2 130 $R --timeout 120 --recipe search_paper --shape qwen2.5-3b --stage 2 --max-new-tokens ${MAX_NEW:-128} \
  --steps-only --out $OUT/recipe_search_3b_z2.json
rm -rf $W/search_paper-*/model
step kr05_z3 190 $R $M --timeout 85 --recipe math_deepscaler --shape qwen2.5-0.5b --stage 3 --max-new-tokens 64 \
  --kill-resume --out $OUT/recipe_math_0.5b_z3_kill_resume.json
rm -rf $W/math_deepscaler-*/model $W/math_deepscaler-*/export-* $W/math_deepscaler-*/run/checkpoints
step math15_z2 120 $R $M --timeout 110 --recipe math_deepscaler --shape qwen2.5-1.5b --stage 2 --max-new-tokens 128 \
  --steps-only --out $OUT/recipe_math_1.5b_z2.json
step kl_head 70 python3 benchmarks/kl_head.py --device cuda --dtypes bfloat16,float32 --max-gb 100 --repeats 3 \
  --sizes 16384x151936x2048,32768x151936x2048 --out $OUT/kl_head_gpu.json
# the step beside TRL at Qwen2.5-1.5B's body, bf16: ema-pg's default sampler on CUDA (static cache, the decode step a
# CUDA graph) and TRL's (carry TRL, datasets and multiprocess as wheels too); then ema-pg alone with the growing cache
S15="python3 benchmarks/rl_step.py --size qwen1.5b --completion 256 --precisions bf16 --prompts 4 --warmup 1 --steps 2 --device cuda"
step step15 200 $S15 --static-cache on --out $OUT/rl_step_1.5b_gpu.json
step step15_eager 110 $S15 --static-cache off --no-trl --out $OUT/rl_step_1.5b_growing_cache_gpu.json
# the step beside TRL up to Qwen2.5-1.5B's body (carry TRL, datasets and multiprocess as wheels too), ema-pg's static cache on
step curve 300 python3 benchmarks/rl_step.py --curve --sizes ${CURVE_SIZES:-qwen0.5b,50M} --completions 256 \
  --precisions bf16 --prompts 4 --warmup 1 --steps 2 --device cuda --out $OUT/rl_step_curve_gpu.json
tar czf $OUT/logs.tgz -C / $(cd / && ls -d tmp/*.log ${W#/}/*/train.log 2>/dev/null)
echo "done in $(( $(date +%s) - T0 ))s"
