// Fused softmax_cross_entropy, causal scaled_dot_product_attention and causal_self_attention: front ends.
// The cross-entropy kernel (tensor/cpu/cross_entropy.cpp) sees contiguous rows; the attention kernels
// (tensor/cpu/attention.cpp) read and write [B, H, T, D] heads with any strides but a contiguous head dim, so
// the attention front ends pass views (a copy only for a strided last dim). The front ends check the
// arguments and record the fused backward kernels.
#include <cmath>
#include <string>

#include "tensor/autocast_state.h"
#include "tensor/autograd_node.h"
#include "tensor/backend.h"
#include "tensor/kernel_contract.h"
#include "tensor/ops.h"

namespace mixtape {

namespace {

// Every counted target must address a class: the kernels index without checking.
void check_targets_in_range(const Tensor& flat_targets, int64_t V, int64_t ignore_index,
                            const Tensor& logits) {
  // Device targets are read through the host (a small copy: a bad target must be an Error, never a read
  // outside the logits row).
  const Tensor host = flat_targets.device().is_cpu() ? flat_targets : flat_targets.to(Device::cpu());
  dispatch_index(host.dtype(), "softmax_cross_entropy", [&]<typename I>() {
    const I* target = host.data<I>();
    for (int64_t i = 0; i < host.numel(); ++i) {
      const int64_t t = static_cast<int64_t>(target[i]);
      check(t == ignore_index || (t >= 0 && t < V), "softmax_cross_entropy: target ", t, " at row ", i,
            " is out of range for V = ", V, " classes (logits ", logits.described(),
            "; expected 0 <= target < ", V, " or ignore_index ", ignore_index, ")");
    }
  });
}

// A [B, H, T, D] operand for the attention kernels, which read rows in place: t itself when its head dim is
// contiguous (whatever the other strides), else a contiguous copy.
Tensor rows_contiguous(const Tensor& t) {
  const Tensor data = t.detach();
  return data.stride(-1) == 1 || data.size(-1) == 1 ? data : data.contiguous();
}

// Columns [first, first + H*D) of x [B, T, W] as heads [B, H, T, D]: element (b, h, t, d) =
// x[b, t, first + h*D + d]. A view (no autograd history); no copy.
Tensor heads_view(const Tensor& x, int64_t first, int64_t H, int64_t D) {
  const int64_t s = x.stride(2);  // 1 for what the front end passes (see rows_contiguous)
  return make_view(x, {x.size(0), H, x.size(1), D}, {x.stride(0), D * s, x.stride(1), s},
                   x.offset() + first * s);
}

}  // namespace

Tensor softmax_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  // Only the logits take part in autocast; the integer targets are never cast. Under the op's Fp32 policy,
  // f16/bf16 logits are read in place rather than widened first: the kernels compute in fp32 and give the f32
  // loss of the widened logits, and their gradient rounded once to the logits' dtype, bit for bit (tested:
  // Autocast.CrossEntropyReadsSixteenBitLogitsInPlace), without the cast's [N, V] f32 copy each way.
  if (!is_low_precision(logits.dtype()))
    if (const auto cast = autocast_inputs(AutocastOp::SoftmaxCrossEntropy, logits)) [[unlikely]]
      return softmax_cross_entropy((*cast)[0], targets, ignore_index);
  const char* op = "softmax_cross_entropy";
  check(logits.defined() && targets.defined(), op, ": logits ", logits.described(), " and targets ",
        targets.described(), " must both be defined");
  check(is_floating(logits.dtype()), op, ": logits must be floating (f32, f16, bf16 or f64), got ",
        logits.described());
  check(logits.dim() >= 1, op, ": logits must have a class dim (the last), got ", logits.described());
  check(targets.dtype() == DType::I32 || targets.dtype() == DType::I64, op,
        ": targets must be i32 or i64, got ", targets.described());
  const Shape row_shape(logits.shape().begin(), logits.shape().end() - 1);
  check(targets.shape() == row_shape, op, ": targets ", targets.described(),
        " must have the shape of logits ", logits.described(), " without the class dim (expected ",
        shape_text(row_shape), ")");
  check(targets.device() == logits.device(), op, ": logits on ", logits.device(), ", targets on ",
        targets.device());

  const int64_t V = logits.shape().back(), N = shape_numel(row_shape);
  const Tensor rows = logits.detach().contiguous().reshape({N, V});
  const Tensor flat_targets = targets.detach().contiguous().reshape({N});
  check_targets_in_range(flat_targets, V, ignore_index, logits);

  const DType loss_dtype = stats_dtype(logits.dtype());
  Tensor loss = Tensor::empty({}, loss_dtype, logits.device());
  const Tensor lse = Tensor::empty({N}, loss_dtype, logits.device());
  backend_of(logits).softmax_cross_entropy(rows, flat_targets, ignore_index, loss, lse);

  const Shape logits_shape = logits.shape();
  record_backward(op, {logits}, loss,
                  [rows, flat_targets, lse, ignore_index, loss_dtype, logits_shape](const Tensor& g) {
                    Tensor grad = Tensor::empty(rows.shape(), rows.dtype(), rows.device());
                    backend_of(rows).softmax_cross_entropy_backward(g.to(loss_dtype).contiguous(), rows,
                                                                    flat_targets, lse, ignore_index, grad);
                    return Grads{grad.view(logits_shape)};
                  },
                  {logits, targets});
  return loss;
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (const auto cast = autocast_inputs(AutocastOp::ScaledDotProductAttention, q, k, v)) [[unlikely]]
    return scaled_dot_product_attention((*cast)[0], (*cast)[1], (*cast)[2]);
  const char* op = "scaled_dot_product_attention";
  auto describe = [](const Tensor& t) { return t.defined() ? t.description() : std::string("undefined"); };
  check(q.defined() && k.defined() && v.defined(), op, ": q ", describe(q), ", k ", describe(k), " and v ",
        describe(v), " must all be defined");
  check(is_floating(q.dtype()) && q.dtype() == k.dtype() && q.dtype() == v.dtype(), op,
        ": q, k and v must share one floating dtype (f32, f16, bf16 or f64), got q ", q.described(), ", k ",
        k.described(), ", v ", v.described());
  check(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k and v must be [B, H, T, D], got q ",
        q.described(), ", k ", k.described(), ", v ", v.described());
  check(k.shape().back() == q.shape().back() && v.shape().back() == q.shape().back(), op,
        ": head dim D differs: q ", q.described(), ", k ", k.described(), ", v ", v.described(),
        " (expected the same last dim)");
  check(k.shape() == q.shape() && v.shape() == q.shape(), op, ": k ", k.described(), " and v ",
        v.described(), " must have q's shape ", q.described(),
        " (causal self-attention: the same B, H and T)");
  check(q.shape()[3] >= 1, op, ": head dim D must be at least 1, got q ", q.described());
  check(k.device() == q.device() && v.device() == q.device(), op, ": q on ", q.device(), ", k on ",
        k.device(), ", v on ", v.device());

  const Shape& shape = q.shape();
  const double scale = 1.0 / std::sqrt(static_cast<double>(shape[3]));
  // The kernel reads any B, H, T strides (e.g. the qkv split of a fused projection) in place.
  const Tensor qd = rows_contiguous(q), kd = rows_contiguous(k), vd = rows_contiguous(v);
  Tensor out = Tensor::empty(shape, q.dtype(), q.device());
  const Tensor lse = Tensor::empty({shape[0], shape[1], shape[2]}, stats_dtype(q.dtype()), q.device());
  backend_of(q).causal_attention(qd, kd, vd, scale, out, lse);

  const Tensor out_data = out.detach();  // not `out` itself: the node it gets would own a cycle
  record_backward(op, {q, k, v}, out,
                  [qd, kd, vd, out_data, lse, scale](const Tensor& g) {
                    const Tensor gd = rows_contiguous(g.to(qd.dtype()));
                    Tensor grad_q = Tensor::empty(qd.shape(), qd.dtype(), qd.device());
                    Tensor grad_k = Tensor::empty(qd.shape(), qd.dtype(), qd.device());
                    Tensor grad_v = Tensor::empty(qd.shape(), qd.dtype(), qd.device());
                    backend_of(qd).causal_attention_backward(gd, qd, kd, vd, out_data, lse, scale, grad_q,
                                                             grad_k, grad_v);
                    return Grads{grad_q, grad_k, grad_v};
                  },
                  {q, k, v, out});
  return out;
}

Tensor causal_self_attention(const Tensor& qkv, int64_t n_head) {
  if (const auto cast = autocast_inputs(AutocastOp::CausalSelfAttention, qkv)) [[unlikely]]
    return causal_self_attention((*cast)[0], n_head);
  const char* op = "causal_self_attention";
  // Messages are built only on failure: this runs once per layer per step.
  if (!qkv.defined()) [[unlikely]]
    fail(op, ": qkv is undefined (expected [B, T, 3C] with q, k, v along the last dim)");
  if (!is_floating(qkv.dtype())) [[unlikely]]
    fail(op, ": qkv must be floating (f32, f16, bf16 or f64), got ", qkv.description());
  if (qkv.dim() != 3) [[unlikely]]
    fail(op, ": qkv must be [B, T, 3C] (q, k, v along the last dim), got ", qkv.description());
  if (n_head < 1) [[unlikely]]
    fail(op, ": n_head must be at least 1, got ", n_head, " (qkv ", qkv.description(), ")");
  const int64_t width = qkv.size(2);
  if (width == 0 || width % 3 != 0 || (width / 3) % n_head != 0) [[unlikely]]
    fail(op, ": the last dim of qkv ", qkv.description(), " is ", width,
         "; expected 3C (q, k, v) with C a positive multiple of n_head = ", n_head);

  const int64_t B = qkv.size(0), T = qkv.size(1), C = width / 3, H = n_head, D = C / H;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // q, k, v are the thirds of qkv seen as heads, read in place (a copy only when the last dim is strided).
  const Tensor x = rows_contiguous(qkv);
  Tensor out = Tensor::empty({B, T, C}, qkv.dtype(), qkv.device());
  const Tensor lse = Tensor::empty({B, H, T}, stats_dtype(qkv.dtype()), qkv.device());
  // The kernel writes head h of row (b, t) straight to out[b, t, h*D : (h+1)*D]: the heads come out merged.
  backend_of(qkv).causal_attention(heads_view(x, 0, H, D), heads_view(x, C, H, D), heads_view(x, 2 * C, H, D),
                                   scale, heads_view(out, 0, H, D), lse);

  const Tensor out_data = out.detach();  // not `out` itself: the node it gets would own a cycle
  record_backward(op, {qkv}, out,
                  [x, out_data, lse, scale, C, H, D](const Tensor& g) {
                    const Tensor gd = rows_contiguous(g.to(x.dtype()));
                    // One [B, T, 3C] gradient; the kernel writes dq, dk, dv into its thirds.
                    Tensor grad_qkv = Tensor::empty(x.shape(), x.dtype(), x.device());
                    backend_of(x).causal_attention_backward(
                        heads_view(gd, 0, H, D), heads_view(x, 0, H, D), heads_view(x, C, H, D),
                        heads_view(x, 2 * C, H, D), heads_view(out_data, 0, H, D), lse, scale,
                        heads_view(grad_qkv, 0, H, D), heads_view(grad_qkv, C, H, D),
                        heads_view(grad_qkv, 2 * C, H, D));
                    return Grads{grad_qkv};
                  },
                  {qkv, out});
  return out;
}

}  // namespace mixtape
