#!/usr/bin/env bash
# The checks of a lent GPU in one call (issue 51): the GPU tests, the real-scale step, the quickstart step with
# CUDA graphs on and off. Each part has its own time limit (seconds, overridable) and its log under $OUT; a failing
# part does not stop the next. The device image has torch, transformers and peft but no Hydra: what retrain needs
# beyond it travels as wheels in .whl/ (the device's `carry`), fetched once on this machine:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.8 omegaconf==2.3.1 transformers==5.19.0 \
#       peft==0.21.2 python-dotenv datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 math-verify==0.9.0 \
#       latex2sympy2_extended==1.11.0
#   python3 -m pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .whl   # Hydra's pin: a source release only
#
#   bash scripts/device_check.sh [tests] [cli] [kernels] [real_scale] [steps] [real_scale_eager] [real_scale_wide_blocks]
#   (default: all but the last two; WIDE_BLOCK_TOKENS=64 sets the last one's inference.kv_block_tokens)
#
# All parts together outrun one call's 10 minutes: run `tests cli` in one call and `kernels real_scale steps` in the next.
# kernels (benchmarks/decode_kernels.py) times the decode step's attention at several KV block sizes and its token
# choice with and without top-p, each alone at Qwen3-4B's shape: what to change if the profile points at them.
# real_scale ends with a step at 128 tokens under torch.profiler (its kernels by device time, in real_scale.log).
#
# Measured on an H200 (2026-11-30): tests ~60 s, real_scale ~175 s (two scenarios, the first compiling), steps
# ~70 s; cli (8 quickstart runs of 8 steps) did not finish in 110 s. pytest prints failures only at its end: each
# failure's traceback is also appended to $OUT/failures.log as it happens (tests/conftest.py), kept when a part is cut.
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
parts=" ${*:-tests cli kernels real_scale steps} "
wants() { [[ $parts == *" $1 "* ]]; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
export RETRAIN_FAILURE_LOG="$OUT/failures.log"
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

GPU_TESTS=(tests/test_gpu.py tests/inference/test_document_packing.py tests/inference/test_paged_attention.py
    tests/inference/test_packing.py tests/inference/test_attention_kernels.py tests/test_memory_plan.py
    tests/inference/test_fused_elementwise.py)
CLI_TESTS="run_repeats or run_samples or run_resumes"  # test_gpu.py's runs of `python -m retrain`
pytest_part() {  # name, time limit, -k expression
    run_part "$1" "$2" python3 -m pytest -p no:cacheprovider -m "slow or not slow" -n 8 --dist load -v -rfEs \
        --tb=short --timeout=200 --durations=10 -k "$3" "${GPU_TESTS[@]}"
    grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/$1.log" | tail -40
}
if wants tests; then
    pytest_part tests "${TESTS_S:-120}" "(gpu or mode_is_checked) and not ($CLI_TESTS)"
fi
if wants cli; then
    pytest_part cli "${CLI_S:-240}" "$CLI_TESTS"
fi
if wants kernels; then
    run_part kernels "${KERNELS_S:-200}" python3 benchmarks/decode_kernels.py --out "$OUT/decode_kernels.json"
    grep "^|" "$OUT/kernels.log"
fi
if wants real_scale; then
    # twice: the first compiles the kernels (the inductor cache starts empty on a fresh machine)
    run_part real_scale "${REAL_SCALE_S:-250}" python3 benchmarks/real_scale.py --tokens 2048 2048 \
        --budget-s "$((${REAL_SCALE_S:-250} - 40))" --out "$OUT/real_scale.json" --profile-tokens 128
    tail -16 "$OUT/real_scale.log"
fi
if wants real_scale_eager; then
    run_part real_scale_eager 270 python3 benchmarks/real_scale.py --tokens 2048 --budget-s 240 \
        --out "$OUT/real_scale_eager.json" inference.cuda_graphs=false
    tail -12 "$OUT/real_scale_eager.log"
fi
if wants real_scale_wide_blocks; then  # after kernels: the first scenario with the block size it found fastest
    run_part real_scale_wide_blocks 270 python3 benchmarks/real_scale.py --tokens 2048 --budget-s 240 \
        --out "$OUT/real_scale_wide_blocks.json" "inference.kv_block_tokens=${WIDE_BLOCK_TOKENS:-64}"
    tail -12 "$OUT/real_scale_wide_blocks.log"
fi
if wants steps; then
    for graphs in true false; do
        run_part "step_graphs_$graphs" 50 python3 benchmarks/step.py --steps 15 backend.devices=gpu:0 \
            "inference.cuda_graphs=$graphs"
        tail -12 "$OUT/step_graphs_$graphs.log"
    done
fi
printf '%s\n' "${summary[@]}" "total: $((SECONDS - START)) s"
