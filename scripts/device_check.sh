#!/usr/bin/env bash
# The checks of a lent GPU in one call (issue 51): the GPU tests, the real-scale step, the quickstart step with
# CUDA graphs on and off. Each part has its own time limit and its log under $OUT; a failing part does not stop
# the next. The device image has torch, transformers and peft but no Hydra: the packages retrain needs beyond it
# travel as wheels in .whl/ (see docs/benchmarks.md, "GPU").
#
#   bash scripts/device_check.sh [tests] [real_scale] [steps] [real_scale_eager]   (default: the first three)
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
parts=" ${*:-tests real_scale steps} "
wants() { [[ $parts == *" $1 "* ]]; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
ln -sfn ../conf retrain/conf  # what the editable install maps; no install here
trap 'rm -f retrain/conf' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, transformers, peft, hydra; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'hydra', hydra.__version__)"
START=$SECONDS
summary=()

run_part() {  # name, time limit (s), command...
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$name: rc=$rc in $((SECONDS - began)) s")
    echo "== $name: rc=$rc in $((SECONDS - began)) s"
}

if wants tests; then
    run_part tests "${TESTS_S:-170}" python3 -m pytest -p no:cacheprovider -m "slow or not slow" -n 8 --dist load -v -rfEs \
        --durations=10 -k "gpu or mode_is_checked" \
        tests/test_gpu.py tests/inference/test_document_packing.py tests/inference/test_paged_attention.py \
        tests/inference/test_packing.py tests/inference/test_attention_kernels.py tests/test_memory_plan.py
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/tests.log" | tail -40
fi
if wants real_scale; then
    # twice: the first compiles the kernels (the inductor cache starts empty on a fresh machine)
    run_part real_scale "${REAL_SCALE_S:-250}" python3 benchmarks/real_scale.py --tokens 2048 2048 \
        --budget-s "$((${REAL_SCALE_S:-250} - 15))" --out "$OUT/real_scale.json"
    tail -16 "$OUT/real_scale.log"
fi
if wants real_scale_eager; then
    run_part real_scale_eager 270 python3 benchmarks/real_scale.py --tokens 2048 --budget-s 240 \
        --out "$OUT/real_scale_eager.json" inference.cuda_graphs=false
    tail -12 "$OUT/real_scale_eager.log"
fi
if wants steps; then
    for graphs in true false; do
        run_part "step_graphs_$graphs" 50 python3 benchmarks/step.py --steps 15 backend.devices=gpu:0 \
            "inference.cuda_graphs=$graphs"
        tail -12 "$OUT/step_graphs_$graphs.log"
    done
fi
printf '%s\n' "${summary[@]}" "total: $((SECONDS - START)) s"
