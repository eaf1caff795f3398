#include "dist/fp8_collectives.h"

#include <algorithm>

#include "tensor/autograd_node.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/quantize.h"

namespace mixtape::dist {

namespace {

void check_payload(const Tensor& x, DType format, const char* op) {
  check(format == DType::F8E4M3 || format == DType::F8E5M2, "dist::", op, ": format ", dtype_name(format),
        " is not an fp8 payload format (expected f8e4m3 or f8e5m2)");
  check(x.defined(), "dist::", op, ": the tensor is undefined");
  check(x.dim() == 1 && is_floating(x.dtype()), "dist::", op, ": expected a 1-d floating tensor, got ", x.described());
}

// rows [R, C] (f32, CPU) as codes with one decode scale per row.
Quantized quantize_rows(const Tensor& rows, DType format) {
  QuantizeOptions options;
  options.format = format;
  options.block_rows = 1;
  return quantize(rows, options);
}

// codes [R, C] and scales [R, 1] that arrived from the peers, back to f32 [R, C].
Tensor dequantize_rows(const Tensor& codes, const Tensor& scales) {
  Quantized q;
  q.codes = codes;
  q.scales = scales;
  q.block_rows = 1;
  q.block_cols = std::max<int64_t>(codes.size(1), 1);
  return dequantize(q);
}

}  // namespace

Tensor fp8_all_reduce_mean(const Communicator& group, const Tensor& x, DType format) {
  check_payload(x, format, "fp8_all_reduce_mean");
  NoGradGuard no_grad;
  const int64_t n = x.numel(), p = group.size(), S = (n + p - 1) / p;
  if (n == 0) return Tensor::zeros({0}, DType::F32, x.device());
  // Padded to p chunks of S (the padding is zero: it moves as code 0 and adds nothing).
  Tensor flat = Tensor::zeros({p * S}, DType::F32);
  flat.narrow(0, 0, n).copy_(x.detach().to(Device::cpu()));
  // Reduce-scatter: chunk j of every rank to rank j, each with its own scale; summed in fp32.
  const Quantized sent = quantize_rows(flat.reshape({p, S}), format);
  const Tensor received = dequantize_rows(group.all_to_all(sent.codes), group.all_to_all(sent.scales));
  Tensor mean = sum(received, {0}, true);
  mean.mul_(1.0 / static_cast<double>(p));
  // All-gather of the mean chunk, quantized again with its own scale.
  const Quantized mine = quantize_rows(mean, format);
  const Tensor full = dequantize_rows(group.all_gather(mine.codes), group.all_gather(mine.scales));
  return full.reshape({p * S}).narrow(0, 0, n).contiguous().to(x.device());
}

}  // namespace mixtape::dist
