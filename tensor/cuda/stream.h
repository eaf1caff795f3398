#pragma once
// Public, and compiles without nvcc: the one stream per CUDA device that every kernel of its backend is queued
// on, for code outside tensor/cuda/ that queues its own work in order with those kernels (NCCL collectives in
// dist/nccl.cpp). Built only with CUDA (MIXTAPE_CUDA).
#include <cuda_runtime_api.h>  // cudaStream_t

namespace mixtape::cuda {

// Makes CUDA device `index` current on the calling thread and returns its backend's stream (the backend is
// created on first use; Error when there is no such device).
cudaStream_t device_stream(int index);

}  // namespace mixtape::cuda
