#!/usr/bin/env bash
# The first GPU run, as one script: in NVIDIA's TensorRT-LLM image (or anywhere with
# tensorrt_llm and the NVIDIA driver), prepare a small Hugging Face checkpoint, serve it with
# prefill and decode on separate GPUs (or memory slices of one), send a streamed and a
# non-streamed request through the gateway and through Triton gRPC, check the replies and the
# KV hand-off metric. Exits non-zero naming the failing step; meant to finish in 10 minutes.
#
#   SMOKE_CHECKPOINT=checkpoints/TinyLlama-1.1B-Chat-v1.0 bash deploy/gpu_smoke.sh
#   SMOKE_CHECKPOINT=checkpoints/TinyLlama-1.1B-Chat-v1.0 docker compose --profile gpu-smoke \
#       run --rm gpu-smoke                                   # the same, in the TensorRT-LLM image
#
# SMOKE_CPU=1 runs the same serve-and-request steps on disagg's CPU engine (SmolLM2), with no
# GPU and no TensorRT-LLM: the test suite does that, to keep the request half honest. Both
# halves serve the same way: their own ports on loopback, their own gateway, and every prompt
# through the prefill pool (mode disaggregated, whatever `auto` would pick: on one GPU it picks
# conditional, whose cost model keeps short prompts co-located, and no hand-off would happen).
set -uo pipefail
cd "$(dirname "$0")/.."
work="${SMOKE_WORK:-$(mktemp -d /tmp/disagg-smoke.XXXXXX)}"
log="$work/serve.log"
server_pid=""
step() { echo "== $1" >&2; }
fail() {
  echo "FAILED at step: $1" >&2
  [ -f "$log" ] && { echo "-- last lines of $log:" >&2; tail -n 30 "$log" >&2; }
  exit 1
}
cleanup() { [ -n "$server_pid" ] && kill -TERM -- "-$server_pid" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
get() {  # GET a URL (python3, not curl: the image need not have curl); status 0 on a 2xx
  python3 - "$@" <<'PY'
import sys, urllib.request
req = urllib.request.Request(sys.argv[1], headers=dict(h.split(": ", 1) for h in sys.argv[2:]))
try:
    sys.stdout.write(urllib.request.urlopen(req, timeout=5).read().decode())
except Exception:
    sys.exit(1)
PY
}

export DISAGG_HTTP_PORT="$(port)" DISAGG_GRPC_PORT="$(port)" DISAGG_METRICS_PORT="$(port)"
export DISAGG_GATEWAY_PORT="$(port)" DISAGG_BUILD_DIR="$work/triton"
export DISAGG_ADMIN_KEY="smoke-admin-$RANDOM$RANDOM" DISAGG_API_KEYS="sk-smoke-$RANDOM$RANDOM"
# what a compose service's environment may say otherwise (its gateway is another service,
# it binds 0.0.0.0): this script serves, and waits for, a gateway of its own on loopback
export DISAGG_HOST=127.0.0.1 DISAGG_GATEWAY_ENABLED=true DISAGG_ROLE=all
export DISAGG_MODE=disaggregated  # the hand-off is what the smoke test checks
config_args=()
step "mode $DISAGG_MODE, ports on 127.0.0.1, gateway :$DISAGG_GATEWAY_PORT"

if [ "${SMOKE_CPU:-0}" = 1 ]; then
  step "cpu mode: disagg's engine, no GPU"
else
  step "preflight: nvidia-smi"
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  [ "$gpus" -ge 1 ] || fail "preflight: nvidia-smi (no NVIDIA driver or no GPU: disagg doctor)"
  step "preflight: import tensorrt_llm"
  python3 -c "import tensorrt_llm; print('TensorRT-LLM', tensorrt_llm.__version__)" >&2 \
    || fail "preflight: import tensorrt_llm (run in the -trtllm-python-py3 image)"
  ckpt="${SMOKE_CHECKPOINT:-}"
  [ -n "$ckpt" ] && [ -f "$ckpt/config.json" ] \
    || fail "checkpoint: set SMOKE_CHECKPOINT to a small Llama Hugging Face directory"
  decode_gpu=0; [ "$gpus" -ge 2 ] && decode_gpu=1  # one GPU: both pools, fractions that fit
  step "prepare: build_trtllm_engine.py (prefill GPU 0, decode GPU $decode_gpu)"
  python3 build_engines/build_trtllm_engine.py --checkpoint "$ckpt" --out "$work/engine" \
    --max-seq-len 2048 --prefill-devices 0 --decode-devices "$decode_gpu" >"$work/build.log" 2>&1 \
    || { cat "$work/build.log" >&2; fail "prepare: build_trtllm_engine.py"; }
  config_args=(--config "$work/engine/serve.toml")
fi

step "serve: python3 -m disagg serve ${config_args[*]}"
setsid python3 -m disagg serve "${config_args[@]}" >"$log" 2>&1 &
server_pid=$!
deadline=$((SECONDS + ${SMOKE_READY_S:-1200}))  # settings.startup_budget_s with TensorRT-LLM
until get "http://127.0.0.1:$DISAGG_GATEWAY_PORT/ready" >/dev/null; do
  kill -0 "$server_pid" 2>/dev/null || fail "serve: the server exited"
  [ "$SECONDS" -lt "$deadline" ] || fail "serve: not ready in ${SMOKE_READY_S:-1200} s"
  sleep 2
done
echo "ready after $SECONDS s" >&2

step "disagg doctor"
python3 -m disagg doctor "${config_args[@]}" >&2 || fail "disagg doctor (see its FAIL lines)"

step "requests and metrics (deploy/smoke_check.py)"
model=$(get "http://127.0.0.1:$DISAGG_GATEWAY_PORT/v1/models" \
  "Authorization: Bearer $DISAGG_API_KEYS" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])') \
  || fail "requests: GET /v1/models"
python3 deploy/smoke_check.py --triton-grpc "127.0.0.1:$DISAGG_GRPC_PORT" \
  --metrics "http://127.0.0.1:$DISAGG_METRICS_PORT/metrics" \
  --gateway "http://127.0.0.1:$DISAGG_GATEWAY_PORT" --key "$DISAGG_API_KEYS" --model "$model" \
  || fail "requests (the step named above)"
echo "smoke passed in $SECONDS s" >&2
