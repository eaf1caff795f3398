#!/bin/bash
# Runs on a lent GPU machine, in the repository root, after bench/gpu/pack.sh filled .gpu/ here: every CUDA
# test suite (one process each, so a crash or a sticky CUDA error stays in its suite), the NCCL tests at one
# rank, a short train_gpt per precision on tinyshakespeare, bench_gpu_train beside PyTorch (then its fp8 modes
# against bf16 and PyTorch's fp8), bench_cuda_ops,
# with SANITIZE=1 compute-sanitizer (memcheck, racecheck) over the attention / norm / loss tests, and with
# PROFILE=1 an ncu breakdown of a 2-layer bf16 step by kernel. Each stage runs only while the
# BUDGET (seconds, default 300) lasts; logs land in $OUT.
set -u
t0=$(date +%s); deadline=$((t0 + ${BUDGET:-300}))
left() { echo $((deadline - $(date +%s))); }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/mx /tmp/logs
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
tar -xJf .gpu/bundle.tar.xz -C /tmp/mx
# bench_gpu_train runs bench/pytorch_gpu_train_step.py from the source dir compiled in (/work/main here).
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
cuda_dirs=$(find /usr/local /usr/lib /opt -name 'libcublasLt.so.13' -o -name 'libnccl.so.2' -o -name 'libcudart.so.13' \
  2>/dev/null | xargs -r -n1 dirname | sort -u | paste -sd:)
export LD_LIBRARY_PATH="$cuda_dirs"
mkdir -p /tmp/mx/need  # only the libraries the machine lacks, so python3 keeps its own
for lib in $(ldd /tmp/mx/bin/* | awk '/not found/ {print $1}' | sort -u); do ln -sf /tmp/mx/lib/$lib /tmp/mx/need/; done
export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/tmp/mx/need"
B=/tmp/mx/bin
{ nvidia-smi -L; grep -m1 'model name' /proc/cpuinfo; } | tee "$OUT/info.txt"

suites=$($B/mixtape_tests --gtest_list_tests --gtest_filter='Cuda*:Device.*' | grep -E '^[A-Za-z][A-Za-z0-9_]*\.$' | tr -d .)
printf '%s\n' $suites | xargs -P 4 -I{} bash -c \
  "timeout 150 $B/mixtape_tests --gtest_filter='{}.*' > /tmp/logs/{}.log 2>&1; echo \"rc \$?\" >> /tmp/logs/{}.log"
for s in $suites; do echo "######## $s"; cat /tmp/logs/$s.log; done > "$OUT/cuda_tests.log"
timeout 60 $B/mixtape_dist_tests --gtest_filter='Nccl*' > /tmp/logs/nccl.log 2>&1; echo "rc $?" >> /tmp/logs/nccl.log
cat /tmp/logs/nccl.log >> "$OUT/cuda_tests.log"
for s in $suites nccl; do
  printf '%-18s %s| %s\n' "$s" "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' /tmp/logs/$s.log |
    sed 's/, listed below://' | tr -s ' []' ' ' | tr '\n' ' ')" "$(tail -1 /tmp/logs/$s.log)"
  grep -E '^\[  FAILED  \] [A-Za-z]+\.[A-Za-z]+ ' /tmp/logs/$s.log | sed 's/^/    /'
done | tee "$OUT/summary.txt"
grep -B2 -A14 'Failure' "$OUT/cuda_tests.log" | head -60

if [ "${SANITIZE:-0}" = 1 ] && [ "$(left)" -gt 150 ]; then  # hand-written shared-memory pipelines: memcheck + racecheck
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  timeout 100 $CS --tool memcheck $B/mixtape_tests \
    --gtest_filter='CudaAttention.*:CudaCrossEntropy.*:CudaLayerNorm.*:CudaRmsNorm.*' > "$OUT/memcheck.log" 2>&1
  timeout 100 $CS --tool racecheck $B/mixtape_tests \
    --gtest_filter='CudaAttention.TensorCore*:CudaAttention.TwoRuns*' > "$OUT/racecheck.log" 2>&1
  grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) ' "$OUT/memcheck.log" "$OUT/racecheck.log"
fi

for p in fp32 bf16 fp16; do
  [ "$(left)" -gt 60 ] || break
  echo "######## train_gpt --precision $p"
  timeout 45 $B/train_gpt --data .gpu/tinyshakespeare.txt --device cuda --precision $p --steps 200 --eval-every 100 2>&1 | tail -2
done | tee "$OUT/train.log"

L=$(left)
[ "$L" -gt 100 ] && timeout $((L - 40)) $B/bench_gpu_train --pytorch --modes fp32,tf32,bf16,fp16,fp16_naive --warmup 3 --steps 15 --json "$OUT/gpu_train.json" \
  --pytorch-modes eager_fp32,eager_tf32,eager_bf16,eager_fp16,compile_bf16 > "$OUT/gpu_train.log" 2>&1
grep -v -E '^  median|^mixtape .* \.\.\.$|^running' "$OUT/gpu_train.log" 2>/dev/null | tail -28
# The fp8 modes at GPT-2 small beside bf16 (fp8 / fp8_delayed on the fp8 tensor cores, the block-scaled ones
# emulated) and PyTorch's tensorwise fp8: the summary prints each mode's tokens/s over bf16's (goal >= 1.3x).
L=$(left)
[ "$L" -gt 100 ] && timeout $((L - 40)) $B/bench_gpu_train --pytorch --modes bf16,fp8,fp8_delayed,fp8_rowwise,fp8_block,mxfp8,nvfp4 \
  --pytorch-modes eager_bf16,eager_fp8 --warmup 3 --steps 10 --json "$OUT/gpu_train_fp8.json" > "$OUT/gpu_train_fp8.log" 2>&1
grep -v -E '^  median|^mixtape .* \.\.\.$|^running' "$OUT/gpu_train_fp8.log" 2>/dev/null | tail -24
L=$(left)
[ "$L" -gt 30 ] && timeout $((L - 5)) $B/bench_cuda_ops > "$OUT/bench_cuda_ops.log" 2>&1
grep -A60 '^comparison' "$OUT/bench_cuda_ops.log" 2>/dev/null | cut -c1-150

if [ "${PROFILE:-0}" = 1 ] && [ "$(left)" -gt 30 ]; then
  timeout $(($(left) - 5)) ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    $B/bench_gpu_train --layers 2 --modes bf16 --warmup 1 --steps 1 > "$OUT/ncu_bf16.csv" 2> /dev/null
  python3 .gpu/ncu_by_kernel.py "$OUT/ncu_bf16.csv"
fi
echo "== $(( $(date +%s) - t0 )) s"
