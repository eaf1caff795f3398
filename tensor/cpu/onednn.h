#pragma once
// The process's oneDNN CPU engine and this thread's stream, shared by every oneDNN primitive of the CPU backend
// (matmul.cpp, gemm_f32_out.cpp).
#include <dnnl.hpp>

namespace mixtape::cpu {

dnnl::engine& dnnl_engine();
// A CPU stream only orders executions; one per thread keeps concurrent callers independent.
dnnl::stream& dnnl_stream();

}  // namespace mixtape::cpu
