#include "autograd/gradcheck.h"

#include <cmath>
#include <sstream>

#include "autograd/autograd.h"

namespace mixtape {

namespace {

double project(const Tensor& y, const std::vector<double>& r) {
  const std::vector<double> values = y.to_vector<double>();
  double total = 0;
  for (size_t i = 0; i < values.size(); ++i) total += values[i] * r[i];
  return total;
}

}  // namespace

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& options) {
  std::vector<Tensor> leaves;
  for (const Tensor& t : inputs) {
    if (t.defined() && is_floating(t.dtype())) {
      Tensor leaf = t.detach().to(DType::F64).clone().detach();
      leaf.requires_grad_(true);
      leaves.push_back(leaf);
    } else {
      leaves.push_back(t);
    }
  }

  GradcheckResult result;
  std::ostringstream report;
  int reported = 0;
  const Tensor y = f(leaves);
  check(y.defined() && y.dtype() == DType::F64, "gradcheck: f must return an f64 tensor, got ", y.described());
  const Tensor r = Tensor::randn(y.shape(), options.seed, DType::F64);
  const std::vector<double> r_values = r.to_vector<double>();
  if (y.requires_grad()) backward({y}, {r});

  NoGradGuard no_grad;
  for (size_t k = 0; k < leaves.size(); ++k) {
    Tensor& leaf = leaves[k];
    if (!leaf.defined() || !leaf.requires_grad()) continue;
    const Tensor grad = leaf.grad();
    const std::vector<double> analytic =
        grad.defined() ? grad.to_vector<double>() : std::vector<double>(static_cast<size_t>(leaf.numel()), 0.0);
    double* x = leaf.data<double>();
    for (int64_t j = 0; j < leaf.numel(); ++j) {
      const double saved = x[j];
      x[j] = saved + options.eps;
      leaf.bump_version();
      const double plus = project(f(leaves), r_values);
      x[j] = saved - options.eps;
      leaf.bump_version();
      const double minus = project(f(leaves), r_values);
      x[j] = saved;
      leaf.bump_version();
      const double numeric = (plus - minus) / (2 * options.eps);
      const double error = std::abs(analytic[j] - numeric);
      result.max_abs_error = std::max(result.max_abs_error, std::isnan(error) ? INFINITY : error);
      if (!(error <= options.atol + options.rtol * std::abs(numeric))) {
        result.ok = false;
        if (reported++ < 8)
          report << "input " << k << " " << leaf.description() << " element " << j << ": backward "
                 << analytic[j] << ", finite difference " << numeric << "\n";
      }
    }
  }
  if (reported > 8) report << "(" << reported - 8 << " more mismatches)\n";
  result.message = report.str();
  return result;
}

}  // namespace mixtape
