#!/bin/bash
# Builds what a lent GPU machine runs, on this (GPU-less) machine, and bundles it into .gpu/ (git-ignored) for
# bench/gpu/run.sh there: the machine has CUDA 13 and PyTorch but neither oneDNN, OpenMPI nor GoogleTest.
#   bash bench/gpu/pack.sh [build dir, default /tmp/mixtape-gpu-build]
# The library is built for any AVX2 CPU (-DMIXTAPE_MARCH=x86-64-v3: the GPU host's CPU is not this one) and for
# sm_90 only (H100/H200), which keeps the bundle small (~21 MB with libdnnl, xz-compressed).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-/tmp/mixtape-gpu-build}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMIXTAPE_MARCH=x86-64-v3 -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DMIXTAPE_CUDA=ON > /dev/null
cmake --build "$build" -j"$(nproc)" --target mixtape_tests mixtape_dist_tests train_gpt bench_cuda_ops bench_gpu_train
stage=$(mktemp -d)
mkdir -p "$stage/bin" "$stage/lib"
for b in tests/mixtape_tests tests/mixtape_dist_tests examples/train_gpt bench/bench_cuda_ops bench/bench_gpu_train; do
  strip -o "$stage/bin/$(basename $b)" "$build/$b"
done
# Every library the binaries load except CUDA's own and the C/C++ runtime (run.sh links only the missing ones).
for lib in $(ldd "$stage"/bin/* | awk '/=>/ {print $3}' | sort -u |
             grep -v -E 'cuda|nccl|/libc\.so|/libm\.so|libstdc|libgcc_s|ld-linux|libdl|libpthread|librt'); do
  cp -L "$lib" "$stage/lib/"
done
mkdir -p "$root/.gpu"
tar -C "$stage" -cJf "$root/.gpu/bundle.tar.xz" bin lib
rm -rf "$stage"
# The device receives this checkout only (../shared does not travel): the corpus goes in the carried, git-ignored
# .gpu/ for that call alone; nothing under ../shared/data is ever committed. Delete .gpu/ after the run.
cp "$root/../shared/data/tinyshakespeare.txt" "$root/.gpu/"
cp "$root/bench/gpu/run.sh" "$root/bench/gpu/ncu_by_kernel.py" "$root/.gpu/"
ls -la "$root/.gpu"
echo "now: device run with carry [\".gpu\"] and command 'bash .gpu/run.sh' (BUDGET=seconds, PROFILE=1 for ncu)"
