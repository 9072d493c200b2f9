#!/usr/bin/env bash
# disagg's PyTorch engine on a CUDA GPU: one prepared run for a GPU machine that has PyTorch
# with CUDA (no TensorRT-LLM, no network needed). Compares the engine on cuda with the CPU
# (logits, greedy tokens of a continuous batch) and measures prefill/decode tokens/s, then
# writes results to $OUT (default results/). Exits non-zero naming the failing step.
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
engine_args=()
if [ -f engines/smollm2-135m-instruct/model.safetensors ]; then
  engine_args=(--engine-dir engines/smollm2-135m-instruct)
fi
step "engine on cpu and cuda (benchmarks/device_check.py)"
PYTHONPATH=src timeout 480 python3 benchmarks/device_check.py --devices cpu,cuda \
  "${engine_args[@]}" --out "$out" 2>&1 | tee "$out/device_check.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || fail "device_check (rc $rc: logits off by 1e-2 or more, or an error above)"
echo "ok: $out/device_check.json" >&2
