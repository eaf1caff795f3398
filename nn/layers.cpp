#include "nn/layers.h"

#include <cmath>

#include "tensor/autograd_node.h"
#include "tensor/error.h"

namespace mixtape {

namespace {

// uniform(-bound, bound) of `shape`, as a fresh leaf.
Tensor uniform(const Shape& shape, double bound, uint64_t seed) {
  NoGradGuard no_grad;
  return (Tensor::rand(shape, seed) * (2 * bound) - bound).detach();
}

}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, uint64_t seed)
    : in_features_(in_features), out_features_(out_features) {
  check(in_features > 0 && out_features > 0, "Linear: sizes must be positive, got in_features=", in_features,
        ", out_features=", out_features);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  weight = uniform({out_features, in_features}, bound, seed);
  register_parameter("weight", weight);
  if (bias) {
    this->bias = uniform({out_features}, bound, seed + 1);
    register_parameter("bias", this->bias);
  }
}

Tensor Linear::forward(const Tensor& x) {
  check(x.defined() && x.dim() >= 1 && x.size(-1) == in_features_, "Linear: expected input [..., ", in_features_,
        "], got ", x.described(), " (weight ", weight.described(), ")");
  return linear(x, weight, bias);
}

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, uint64_t seed) {
  check(num_embeddings > 0 && embedding_dim > 0, "Embedding: sizes must be positive, got num_embeddings=",
        num_embeddings, ", embedding_dim=", embedding_dim);
  weight = Tensor::randn({num_embeddings, embedding_dim}, seed);
  register_parameter("weight", weight);
}

Tensor Embedding::forward(const Tensor& indices) { return embedding(weight, indices); }

LayerNorm::LayerNorm(int64_t normalized_size, bool bias, double eps) : eps(eps) {
  check(normalized_size > 0, "LayerNorm: size must be positive, got ", normalized_size);
  weight = Tensor::ones({normalized_size});
  register_parameter("weight", weight);
  if (bias) {
    this->bias = Tensor::zeros({normalized_size});
    register_parameter("bias", this->bias);
  }
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, weight, bias, eps).out; }

RMSNorm::RMSNorm(int64_t normalized_size, double eps) : eps(eps) {
  check(normalized_size > 0, "RMSNorm: size must be positive, got ", normalized_size);
  weight = Tensor::ones({normalized_size});
  register_parameter("weight", weight);
}

Tensor RMSNorm::forward(const Tensor& x) { return rms_norm(x, weight, eps).out; }

Dropout::Dropout(double p, uint64_t seed) : p(p), generator_(seed) {
  check(p >= 0 && p < 1, "Dropout: p must be in [0, 1), got ", p);
  register_generator("rng", generator_);
}

Tensor Dropout::forward(const Tensor& x) { return dropout(x, p, generator_, is_training()); }

}  // namespace mixtape
