#!/usr/bin/env bash
# GPU check for jagg-autograd, < 10 min on one H200-class GPU.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # on a CUDA machine
#   bash benchmarks/gpu_check.sh --cpu [OUT_DIR]  # exercise it on CPU (interpreter, tiny)
#
# 1. kernel tests compiled for the real GPU: tests/test_kernels_aot.py (sm_80/sm_90 AOT)
#    and benchmarks/gpu_kernels.py (Triton vs torch reference on CUDA tensors, not
#    interpreted; odd sizes, every dtype, non-contiguous), plus the kernel bandwidth
#    microbenchmark vs the device's peak;
# 2. the GPU preset timing (SD3.5-medium-like MMDiT, bf16, 64x64x16 latent, B=2):
#    python -m benchmarks.run --gpu --no-fidelity;
# 3. the deferred path on the same preset (python -m benchmarks.floor --gpu): training-phase
#    time of values + deferred (uniform / adaptive) and of eager JAGG vs the per-step loop,
#    and peak CUDA memory above the model's vs the per-step loop; the per-sample anchor
#    kernel is in the compiled kernel tests of step 1;
# 4. the demo trainer on CUDA, bf16 autocast, values + deferred (3 steps).
# Results: $OUT_DIR/gpu_kernels.json, $OUT_DIR/gpu/results.json (+ RESULTS.md, PNGs),
# $OUT_DIR/pytest_aot.txt and $OUT_DIR/gpu_check.json (summary, exit codes).
# Note: tests/test_kernels.py builds CPU tensors, so on CUDA its kernels only run
# interpreted; the CUDA numbers come from benchmarks/gpu_kernels.py instead.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
if [[ "${1:-}" == "--cpu" || "${1:-}" == "--dry" ]]; then MODE=cpu; shift; fi
OUT_DIR="${1:-${OUT:-benchmarks/results/gpu_check}}"
mkdir -p "$OUT_DIR"
start=$(date +%s)

if [[ "$MODE" == gpu ]]; then
  unset TRITON_INTERPRET
  python - <<'PY' || { echo "no CUDA device"; exit 2; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PY
  nvidia-smi --query-gpu=name,memory.total,clocks.max.mem --format=csv > "$OUT_DIR/nvidia_smi.csv" 2>&1 || true
  timeout 180 python -m pytest -q -x tests/test_kernels_aot.py > "$OUT_DIR/pytest_aot.txt" 2>&1
  rc_aot=$?
  # The kernel-vs-reference tests, compiled (not interpreted) on CUDA tensors.
  JAGG_TEST_DEVICE=cuda TRITON_INTERPRET=0 timeout 240 python -m pytest -q \
      tests/test_kernels.py -k "matches_reference or non_contiguous or per_sample" \
      >> "$OUT_DIR/pytest_aot.txt" 2>&1
  rc_aot=$(( rc_aot | $? ))
  TRITON_INTERPRET=0 timeout 120 python -m benchmarks.gpu_kernels --out "$OUT_DIR"
  rc_kern=$?
  timeout 240 python -m benchmarks.run --gpu --device cuda --no-fidelity --no-progress \
      --out "$OUT_DIR/gpu" > "$OUT_DIR/gpu_run.txt" 2>&1
  rc_run=$?
  timeout 180 python -m benchmarks.floor --gpu --device cuda --no-progress \
      --out "$OUT_DIR/floor" > "$OUT_DIR/floor_run.txt" 2>&1
  rc_floor=$?
  # The trainer on CUDA in bf16 autocast through the deferred on-policy path.
  timeout 180 python -m jagg_autograd.demo --device cuda --precision bf16 --steps 3 \
      --eval-per-digit 2 --reuse-values --deferred --no-progress \
      --out "$OUT_DIR/demo_cuda" > "$OUT_DIR/demo_cuda.txt" 2>&1
  rc_demo=$?
else
  export TRITON_INTERPRET=1
  rc_aot=0
  echo "skipped on CPU" > "$OUT_DIR/pytest_aot.txt"
  timeout 300 python -m benchmarks.gpu_kernels --cpu --out "$OUT_DIR"
  rc_kern=$?
  # The same code path as --gpu, with the tiny preset on CPU.
  unset TRITON_INTERPRET
  timeout 300 python -m benchmarks.run --tiny --no-fidelity --no-progress \
      --out "$OUT_DIR/gpu" > "$OUT_DIR/gpu_run.txt" 2>&1
  rc_run=$?
  timeout 300 python -m benchmarks.floor --tiny --no-progress \
      --out "$OUT_DIR/floor" > "$OUT_DIR/floor_run.txt" 2>&1
  rc_floor=$?
  timeout 300 python -m jagg_autograd.demo --device cpu --precision bf16 --steps 2 \
      --eval-per-digit 1 --reuse-values --deferred --no-progress \
      --out "$OUT_DIR/demo_cuda" > "$OUT_DIR/demo_cuda.txt" 2>&1
  rc_demo=$?
fi
tail -n 3 "$OUT_DIR/demo_cuda.txt" || true
cat "$OUT_DIR/floor/FLOOR.md" 2>/dev/null | head -n 20 || true
tail -n 8 "$OUT_DIR/gpu_run.txt" || true
end=$(date +%s)
cat > "$OUT_DIR/gpu_check.json" <<JSON
{"mode": "$MODE", "rc_test_kernels_aot": $rc_aot, "rc_gpu_kernels": $rc_kern,
 "rc_gpu_preset_timing": $rc_run, "rc_floor": $rc_floor, "rc_demo": $rc_demo, "wall_s": $((end - start))}
JSON
cat "$OUT_DIR/gpu_check.json"
[[ $rc_aot -eq 0 && $rc_kern -eq 0 && $rc_run -eq 0 && $rc_floor -eq 0 && $rc_demo -eq 0 ]]
