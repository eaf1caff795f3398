#pragma once
// Gradient-norm clipping with torch.nn.utils.clip_grad_norm_'s formula, split the way PyTorch 2.6 splits it
// (get_total_norm / clip_grads_with_norm_) so distributed code can all-reduce the squared norm in between.
//
// The norm is the global L2 norm over every defined gradient (parameters without one are skipped):
//   total_norm = sqrt(sum over all gradient elements of g^2)
// accumulated in double, in a fixed order (per-chunk partial sums added in chunk order), so the result does
// not depend on the thread count. Clipping multiplies every gradient by
//   clip_coef = max_norm / (total_norm + 1e-6)          when clip_coef < 1
// and leaves them alone otherwise. That is PyTorch's clamp(clip_coef, max=1) without the no-op multiply
// by 1 — note it also scales by a factor just below 1 when total_norm is within 1e-6 below max_norm.
// Non-finite norms (an inf or NaN gradient) are handled explicitly, where PyTorch would multiply every
// gradient by 0 or NaN: the gradients are left untouched and the norm is returned, so the caller (or a loss
// scaler) sees it and can skip the step; with error_if_nonfinite it throws instead.
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace mixtape {

// sum of g^2 over every defined gradient of `params` (CPU gradients; f64 accumulation).
double grad_squared_norm(const std::vector<Tensor>& params);
// The number of elements equal to 0 in every defined gradient of `params` (naive AMP's log_num_zeros_in_grad).
int64_t grad_zero_count(const std::vector<Tensor>& params);
// sqrt(grad_squared_norm(params)): what the trainer logs as grad_norm.
double grad_norm(const std::vector<Tensor>& params);
// Scales the gradients for a given total norm (max_norm / (total_norm + 1e-6) when that is < 1). Does nothing
// when total_norm is not finite. Each element is multiplied in double and rounded once to its dtype. A
// contiguous gradient is scaled in place; a non-contiguous one (possibly a self-aliasing broadcast view
// given to set_grad) is replaced by a scaled contiguous copy.
void clip_grads_with_norm(const std::vector<Tensor>& params, double max_norm, double total_norm);
// The two above: returns the total norm before clipping. max_norm must be finite and > 0.
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm, bool error_if_nonfinite = false);

}  // namespace mixtape
