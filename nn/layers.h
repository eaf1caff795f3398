#pragma once
// The basic layers, with PyTorch's parameter names and layouts so weights move to and from PyTorch unchanged.
#include <cstdint>

#include "nn/module.h"
#include "tensor/ops.h"

namespace mixtape {

// y = x @ weight^T + bias, weight [out, in] (PyTorch's layout), bias [out]. Initialised like PyTorch:
// uniform(-1/sqrt(in), 1/sqrt(in)) for both, drawn from `seed` (the weight) and seed + 1 (the bias).
class Linear : public UnaryModule {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, uint64_t seed = 0);
  Tensor forward(const Tensor& x) override;  // x [..., in] -> [..., out]
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

  Tensor weight;
  Tensor bias;  // undefined without bias

 private:
  int64_t in_features_, out_features_;
};

// A lookup table weight [num_embeddings, embedding_dim], initialised normal(0, 1) from `seed` like PyTorch.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, uint64_t seed = 0);
  Tensor forward(const Tensor& indices);  // i32/i64 [...] -> [..., embedding_dim]
  Tensor operator()(const Tensor& indices) { return forward(indices); }

  Tensor weight;
};

// Over the last dim: (x - mean) / sqrt(var + eps) * weight + bias; weight starts at 1, bias at 0.
class LayerNorm : public UnaryModule {
 public:
  explicit LayerNorm(int64_t normalized_size, bool bias = true, double eps = 1e-5);
  Tensor forward(const Tensor& x) override;

  Tensor weight;
  Tensor bias;  // undefined without bias
  double eps;
};

// Over the last dim: x / sqrt(mean(x^2) + eps) * weight; weight starts at 1.
class RMSNorm : public UnaryModule {
 public:
  explicit RMSNorm(int64_t normalized_size, double eps = 1e-5);
  Tensor forward(const Tensor& x) override;

  Tensor weight;
  double eps;
};

// Zeroes elements with probability p (scaling the rest by 1/(1-p)) in training mode; identity in eval mode.
// Its random stream is registered as the generator "rng": a checkpoint saves (seed, offset) to resume exactly.
class Dropout : public UnaryModule {
 public:
  explicit Dropout(double p = 0.0, uint64_t seed = 0);
  Tensor forward(const Tensor& x) override;
  Generator& generator() { return generator_; }
  double p;

 private:
  Generator generator_;
};

class GELU : public UnaryModule {
 public:
  explicit GELU(GeluApproximation approximation = GeluApproximation::None) : approximation(approximation) {}
  Tensor forward(const Tensor& x) override { return gelu(x, approximation); }
  GeluApproximation approximation;
};

}  // namespace mixtape
