#!/usr/bin/env bash
# One device session's GPU work in one command (the device tool's H200: torch 2.11, Triton 3.6, no network).
# Usage: bash scripts/h200_session.sh [tests] [matrix] [bench] [oracle] [old]   (default: tests matrix bench)
# Logs go to $OUT (or ./h200-out), one file per part, then one tarball.
#   tests   pytest tests/gpu
#   matrix  the whole suite with triton-cuda forced (tests/gpu apart)
#   bench   multiwrite bench --configs G3 --stage (vLLM 0.33's files from $MULTIWRITE_VLLM_SRC, default .vllm-src)
#   oracle  tests/vllm against vLLM 0.33's own class on CUDA
#   sweep   multiwrite bench --stage --groups 3,11,20 (the stage designs over 3, 11 and 20 KV-cache groups)
#   sglang  tests/sglang on CUDA and multiwrite bench --sglang (SGLang's files from $MULTIWRITE_SGLANG_SRC,
#           default .sglang-src: allocation.py, common.py, memory_pool.py out of SGLang 0.5.23's wheel)
#   old     the named new GPU tests ($OLD_TESTS) against the tree in .old-tree.tar (they must fail there)
#   costs   scripts/stage_host_costs.py (where the eager stage's host time goes)
#   oldcosts  the same script of the tree in .old-tree.tar, run against that tree (a before/after in one session)
#   graphcosts  scripts/graph_mode_costs.py --stage (graph mode's host work and the captured stage's device time)
#   oldgraphcosts  the same script of the tree in .old-tree.tar, run against that tree
set -u
out=${OUT:-$PWD/h200-out}
mkdir -p "$out"
parts=${*:-tests matrix bench}
export PYTHONUNBUFFERED=1
export MULTIWRITE_VLLM_SRC=${MULTIWRITE_VLLM_SRC:-$PWD/.vllm-src}
export MULTIWRITE_SGLANG_SRC=${MULTIWRITE_SGLANG_SRC:-$PWD/.sglang-src}
python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || { cat "$out/build.log"; exit 3; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 3; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; python3 -m multiwrite info; } >"$out/env.log" 2>&1
cat "$out/env.log"
# The tree in .old-tree.tar, unpacked into /tmp/old with its own helper built (its backends importable as
# multiwrite.backends when /tmp/old leads PYTHONPATH).
old_tree() {
  rm -rf /tmp/old && mkdir -p /tmp/old && tar -xf .old-tree.tar -C /tmp/old && \
    (cd /tmp/old && ln -sfn ../backends multiwrite/backends 2>/dev/null; python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
}
for part in $parts; do
  start=$(date +%s)
  case $part in
    tests) timeout ${TESTS_S:-360} python3 -m pytest -q -rs -p no:cacheprovider tests/gpu >"$out/tests_gpu.log" 2>&1 ;;
    matrix) MULTIWRITE_BACKEND=triton-cuda timeout ${MATRIX_S:-480} python3 -m pytest -q -rfE -p no:cacheprovider -m "not slow" \
              tests --ignore=tests/gpu --maxfail=30 >"$out/matrix.log" 2>&1 ;;
    bench) timeout 420 python3 -m multiwrite bench --configs G3 --stage --steps 300 --concurrency 40,256 \
              --burst-reps 0 --no-progress --csv "$out/bench.csv" >"$out/bench.log" 2>&1 ;;
    sweep) timeout ${SWEEP_S:-420} python3 -m multiwrite bench --stage --groups 3,11,20 --steps ${SWEEP_STEPS:-200} \
              --concurrency 40,256 --burst-reps 0 --no-progress --csv "$out/sweep.csv" >"$out/sweep.log" 2>&1 ;;
    sglang) { timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/sglang; \
              timeout 240 python3 -m multiwrite bench --sglang --no-progress --csv "$out/sglang.csv" \
              --plot "$out/sglang.png"; } >"$out/sglang.log" 2>&1 ;;
    oracle) MULTIWRITE_VLLM_SCENARIOS=${SCENARIOS:-100} timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider \
              tests/vllm >"$out/oracle.log" 2>&1 ;;
    old) old_tree && for t in ${OLD_TESTS:-}; do mkdir -p "/tmp/old/$(dirname "$t")"; cp "$t" "/tmp/old/$t"; done && \
         (cd /tmp/old && PYTHONPATH=/tmp/old timeout ${OLD_S:-180} python3 -m pytest -q -rfE -p no:cacheprovider \
          ${OLD_TESTS:-}) >"$out/old.log" 2>&1 ;;
    costs) PYTHONPATH=$PWD timeout 240 python3 scripts/stage_host_costs.py --profile ${PROFILE_N:-14} \
              --configs ${COSTS_CONFIGS:-G3} >"$out/costs.log" 2>&1 ;;
    oldcosts) old_tree && (cd /tmp/old && PYTHONPATH=/tmp/old timeout 240 python3 scripts/stage_host_costs.py \
              --profile ${PROFILE_N:-14} --configs ${COSTS_CONFIGS:-G3}) >"$out/oldcosts.log" 2>&1 ;;
    graphcosts) PYTHONPATH=$PWD timeout 240 python3 scripts/graph_mode_costs.py --stage \
              --steps ${GRAPH_STEPS:-200} >"$out/graphcosts.log" 2>&1 ;;
    oldgraphcosts) old_tree && (cd /tmp/old && PYTHONPATH=/tmp/old timeout 240 python3 scripts/graph_mode_costs.py \
              --stage --steps ${GRAPH_STEPS:-200}) >"$out/oldgraphcosts.log" 2>&1 ;;
    *) echo "unknown part $part"; continue ;;
  esac
  rc=$?
  echo "== $part: rc $rc in $(( $(date +%s) - start )) s"; tail -n 4 "$out"/*"${part}"*.log 2>/dev/null | tail -n 4
done
