#include "tensor/cpu/gemm_f32_out.h"

#include <dnnl.hpp>

#include "tensor/cpu/onednn.h"

#include <map>
#include <string>
#include <tuple>
#include <unordered_map>

namespace mixtape::cpu {

namespace {

using dnnl::memory;

struct Primitive {
  dnnl::matmul matmul;
  memory::desc a, b, out;
  bool tried = false;
  bool usable = false;  // false: oneDNN has only its reference kernel for this (the f32 route is used)
};

// One primitive per shape, operand strides and dtype, per thread (a primitive is cheap to keep, slow to create).
// a [M, K] has strides (sa0, sa1), b [N, K] (sb0, sb1): one of each pair is 1 (row- or column-major, the
// other >= the dim it steps over, so that a column block of a wider matrix is a view).
using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int>;
Primitive& primitive_for(int64_t M, int64_t N, int64_t K, const Strides& sa, const Strides& sb,
                         memory::data_type type) {
  thread_local std::map<Key, Primitive> cache;
  Primitive& p = cache[{M, N, K, sa[0], sa[1], sb[0], sb[1], static_cast<int>(type)}];
  if (p.tried) return p;
  p.tried = true;
  p.a = memory::desc({M, K}, type, memory::dims{sa[0], sa[1]});
  p.b = memory::desc({K, N}, type, memory::dims{sb[1], sb[0]});  // b [N, K] read as its transpose
  p.out = memory::desc({M, N}, memory::data_type::f32, memory::dims{N, 1});
  try {
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p.a, p.b, p.out), dnnl_engine(), /*allow_empty=*/true);
    if (pd && std::string(pd.impl_info_str()).rfind("ref", 0) != 0) {
      p.matmul = dnnl::matmul(pd);
      p.usable = true;
    }
  } catch (const dnnl::error&) {
    p.usable = false;
  }
  return p;
}

}  // namespace

namespace {

// Row-major with rows at least a row apart, or column-major with columns at least a column apart.
bool dense_2d(const Tensor& t) {
  const Strides& s = t.strides();
  return (s[1] == 1 && s[0] >= t.size(1)) || (s[0] == 1 && s[1] >= t.size(0));
}

}  // namespace

void gemm_nt_f32_out(const Tensor& a, const Tensor& b, const Tensor& out) {
  check(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(1) && out.size(0) == a.size(0) &&
            out.size(1) == b.size(0) && a.dtype() == b.dtype() &&
            (a.dtype() == DType::BF16 || a.dtype() == DType::F32) && out.dtype() == DType::F32 && dense_2d(a) &&
            dense_2d(b) && out.is_contiguous(),
        "gemm_nt_f32_out: expected a [M, K] and b [N, K] (both bf16 or f32, each row- or column-major, rows or "
        "columns may be strided) and contiguous f32 out [M, N], got ",
        a.description(), ", ", b.description(), ", ", out.description());
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    Tensor(out).fill_(0);
    return;
  }
  const memory::data_type type = a.dtype() == DType::BF16 ? memory::data_type::bf16 : memory::data_type::f32;
  Primitive& p = primitive_for(M, N, K, a.strides(), b.strides(), type);
  if (!p.usable) {
    check(type == memory::data_type::bf16, "gemm_nt_f32_out: oneDNN has no f32 matmul for [", M, ", ", K,
          "] x [", K, ", ", N, "]");
    // A CPU without a bf16 GEMM: exact in f32.
    gemm_nt_f32_out(a.to(DType::F32).contiguous(), b.to(DType::F32).contiguous(), out);
    return;
  }
  try {
    memory a_mem(p.a, dnnl_engine(), a.data_ptr()), b_mem(p.b, dnnl_engine(), b.data_ptr()),
        out_mem(p.out, dnnl_engine(), out.data_ptr());
    p.matmul.execute(dnnl_stream(), {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, out_mem}});
    dnnl_stream().wait();
  } catch (const dnnl::error& error) {
    fail("gemm_nt_f32_out: oneDNN failed on ", a.description(), " x ", b.description(), ": ", error.what());
  }
}

}  // namespace mixtape::cpu
