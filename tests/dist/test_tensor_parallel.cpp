// Tensor parallelism under MPI (4 ranks): tp = 2 (two tp groups of 2, make_groups({2, 1, 2})) and tp = 4.
// Every rank builds the full single-process module from the same seed, runs it locally as the reference, and
// checks that its tensor-parallel shard module gives the same output and the same gradients (of the input and
// of every weight shard, sliced the same way as the shard).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "autograd/autograd.h"
#include "dist/groups.h"
#include "dist/tensor_parallel.h"
#include "dist/tp_ops.h"
#include "dist/world.h"
#include "nn/attention.h"
#include "nn/gpt.h"
#include "nn/layers.h"
#include "optim/adam.h"
#include "tensor/autograd_node.h"
#include "tensor/ops.h"
#include "../test_util.h"

using namespace mixtape;
using namespace mixtape::dist;
using mixtape::testing::all_close;
using mixtape::testing::uniform_tensor;

namespace {

// The tensor-parallel group of a world split into tp groups (tp = 2: two groups; tp = 4: the world).
Communicator tp_group(int tp) {
  const int world = Communicator::world().size();
  return make_groups({tp, 1, world / tp}).tp;
}

double tolerance(DType dtype) { return dtype == DType::F64 ? 1e-12 : 1e-5; }

// Chunk `rank` of `parts` along `dim`, of each of `blocks` equal blocks (the layout of a shard).
Tensor slice_of(const Tensor& full, int64_t dim, int rank, int parts, int64_t blocks = 1) {
  NoGradGuard no_grad;
  const int64_t block = full.size(dim) / blocks, chunk = block / parts;
  std::vector<Tensor> pieces;
  for (int64_t b = 0; b < blocks; ++b) pieces.push_back(full.narrow(dim, b * block + rank * chunk, chunk));
  return (blocks == 1 ? pieces[0] : cat(pieces, dim)).contiguous();
}

// x as a fresh leaf requiring grad.
Tensor leaf(const Tensor& x) {
  Tensor t = x.detach().clone().detach();
  t.requires_grad_(true);
  return t;
}

// sum(y * weights): a scalar whose gradient with respect to y is `weights` (a fixed, non-uniform tensor).
Tensor weighted_sum(const Tensor& y, const Tensor& weights) { return sum(mul(y, weights)); }

}  // namespace

TEST(TensorParallelOps, RegionOpsForwardAndBackward) {
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    // Same x on every rank of the group; y's gradient is rank-dependent to make the reductions visible.
    const Tensor base = uniform_tensor({2, 3, 8}, 11, -1, 1, DType::F64);
    const Tensor gy = uniform_tensor({2, 3, 8}, 100 + r, -1, 1, DType::F64);
    std::vector<Tensor> all_gy;
    for (int i = 0; i < tp_size; ++i) all_gy.push_back(uniform_tensor({2, 3, 8}, 100 + i, -1, 1, DType::F64));
    Tensor gy_sum = all_gy[0];
    for (int i = 1; i < tp_size; ++i) gy_sum = add(gy_sum, all_gy[i]);

    {  // copy: identity forward, all-reduce backward
      Tensor x = leaf(base);
      Tensor y = copy_to_tp_region(x, tp);
      EXPECT_TRUE(all_close(y, base, 0, 0));
      backward({y}, {gy});
      EXPECT_TRUE(all_close(x.grad(), gy_sum, 1e-14, 1e-14)) << "tp " << tp_size;
    }
    {  // reduce: all-reduce forward, identity backward
      Tensor x = leaf(mul(base, double(r + 1)));
      Tensor y = reduce_from_tp_region(x, tp);
      EXPECT_TRUE(all_close(y, mul(base, tp_size * (tp_size + 1) / 2.0), 1e-14, 1e-14));
      backward({y}, {gy});
      EXPECT_TRUE(all_close(x.grad(), gy, 0, 0));
    }
    {  // scatter: own chunk forward, all-gather backward
      Tensor x = leaf(base);
      Tensor y = scatter_to_tp_region(x, tp);
      EXPECT_TRUE(all_close(y, slice_of(base, 2, r, tp_size), 0, 0));
      const Tensor g_local = slice_of(gy, 2, r, tp_size);
      backward({y}, {g_local});
      std::vector<Tensor> chunks;
      for (int i = 0; i < tp_size; ++i) chunks.push_back(slice_of(all_gy[i], 2, i, tp_size));
      EXPECT_TRUE(all_close(x.grad(), cat(chunks, 2), 0, 0)) << "tp " << tp_size;
    }
    {  // gather: all-gather forward (rank i's [.., 2] chunks side by side), own chunk backward
      Tensor x = leaf(slice_of(uniform_tensor({2, 3, 8}, 200 + r, -1, 1, DType::F64), 2, r, tp_size));
      Tensor y = gather_from_tp_region(x, tp);
      std::vector<Tensor> chunks;
      for (int i = 0; i < tp_size; ++i)
        chunks.push_back(slice_of(uniform_tensor({2, 3, 8}, 200 + i, -1, 1, DType::F64), 2, i, tp_size));
      EXPECT_TRUE(all_close(y, cat(chunks, 2), 0, 0)) << "tp " << tp_size;
      backward({y}, {gy});
      EXPECT_TRUE(all_close(x.grad(), slice_of(gy, 2, r, tp_size), 0, 0));
    }
  }
}

TEST(TensorParallelOps, RegionOpsInSixteenBitDtypes) {
  const Communicator tp = tp_group(2);
  for (DType dtype : {DType::F16, DType::BF16, DType::F32}) {
    const Tensor base = uniform_tensor({3, 4}, 5, -1, 1, dtype);
    Tensor x = leaf(base);
    const Tensor y = gather_from_tp_region(scatter_to_tp_region(x, tp), tp);
    EXPECT_EQ(y.dtype(), dtype);
    EXPECT_TRUE(all_close(y, base, 0, 0)) << dtype_name(dtype);
    backward({reduce_from_tp_region(copy_to_tp_region(y, tp), tp)}, {Tensor::ones({3, 4}, dtype)});
    EXPECT_EQ(x.grad().dtype(), dtype);
    EXPECT_TRUE(all_close(x.grad(), Tensor::full({3, 4}, 2.0, dtype), 0, 0)) << dtype_name(dtype);
  }
}

TEST(TensorParallel, ColumnAndRowParallelLinearMatchTheFullLinear) {
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    for (DType dtype : {DType::F64, DType::F32}) {
      const double tol = tolerance(dtype);
      for (bool gather_output : {false, true}) {
        Linear full(8, 12, true, 3);
        full.to(dtype);
        ColumnParallelLinear column(full, tp, gather_output);
        EXPECT_EQ(column.weight.shape(), (Shape{12 / tp_size, 8}));
        const Tensor x0 = uniform_tensor({2, 3, 8}, 7, -1, 1, dtype);
        const Tensor w = uniform_tensor({2, 3, 12}, 8, -1, 1, dtype);
        Tensor x = leaf(x0), xp = leaf(x0);
        const Tensor y = full(x);
        backward(weighted_sum(y, w));
        const Tensor yp = column(xp);
        if (gather_output) {
          EXPECT_TRUE(all_close(yp, y, tol, tol));
          backward(weighted_sum(yp, w));
        } else {
          EXPECT_TRUE(all_close(yp, slice_of(y, 2, r, tp_size), tol, tol)) << "tp " << tp_size;
          backward(weighted_sum(yp, slice_of(w, 2, r, tp_size)));
        }
        EXPECT_TRUE(all_close(xp.grad(), x.grad(), tol, tol)) << "tp " << tp_size << " gather " << gather_output;
        EXPECT_TRUE(all_close(column.weight.grad(), slice_of(full.weight.grad(), 0, r, tp_size), tol, tol));
        EXPECT_TRUE(all_close(column.bias.grad(), slice_of(full.bias.grad(), 0, r, tp_size), tol, tol));
      }
      for (bool input_is_parallel : {false, true}) {
        Linear full(12, 8, true, 5);
        full.to(dtype);
        RowParallelLinear row(full, tp, input_is_parallel);
        EXPECT_EQ(row.weight.shape(), (Shape{8, 12 / tp_size}));
        const Tensor x0 = uniform_tensor({2, 3, 12}, 9, -1, 1, dtype);
        const Tensor w = uniform_tensor({2, 3, 8}, 10, -1, 1, dtype);
        Tensor x = leaf(x0), xp = leaf(input_is_parallel ? slice_of(x0, 2, r, tp_size) : x0);
        const Tensor y = full(x);
        backward(weighted_sum(y, w));
        const Tensor yp = row(xp);
        EXPECT_TRUE(all_close(yp, y, tol, tol)) << "tp " << tp_size << " " << dtype_name(dtype);
        backward(weighted_sum(yp, w));
        EXPECT_TRUE(all_close(xp.grad(), input_is_parallel ? slice_of(x.grad(), 2, r, tp_size) : x.grad(), tol, tol));
        EXPECT_TRUE(all_close(row.weight.grad(), slice_of(full.weight.grad(), 1, r, tp_size), tol, tol));
        EXPECT_TRUE(all_close(row.bias.grad(), full.bias.grad(), tol, tol));
      }
    }
  }
}

TEST(TensorParallel, ParallelMLPMatchesTheFullMLP) {
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    for (Activation activation : {Activation::Gelu, Activation::SwiGLU}) {
      for (DType dtype : {DType::F64, DType::F32}) {
        const double tol = tolerance(dtype);
        GPTConfig config;
        config.n_embd = 8;
        config.n_head = 4;
        config.activation = activation;
        MLP full(config, 21);
        full.to(dtype);
        ParallelMLP mlp(full, tp);
        const Tensor x0 = uniform_tensor({2, 3, 8}, 22, -1, 1, dtype);
        const Tensor w = uniform_tensor({2, 3, 8}, 23, -1, 1, dtype);
        Tensor x = leaf(x0), xp = leaf(x0);
        backward(weighted_sum(full(x), w));
        const Tensor yp = mlp(xp);
        EXPECT_TRUE(all_close(yp, full(x0), tol, tol)) << "tp " << tp_size << " " << dtype_name(dtype);
        backward(weighted_sum(yp, w));
        const int64_t blocks = activation == Activation::SwiGLU ? 2 : 1;
        EXPECT_TRUE(all_close(xp.grad(), x.grad(), tol, tol));
        EXPECT_TRUE(all_close(mlp.c_fc->weight.grad(), slice_of(full.c_fc->weight.grad(), 0, r, tp_size, blocks),
                              tol, tol));
        EXPECT_TRUE(
            all_close(mlp.c_fc->bias.grad(), slice_of(full.c_fc->bias.grad(), 0, r, tp_size, blocks), tol, tol));
        EXPECT_TRUE(
            all_close(mlp.c_proj->weight.grad(), slice_of(full.c_proj->weight.grad(), 1, r, tp_size), tol, tol));
        EXPECT_TRUE(all_close(mlp.c_proj->bias.grad(), full.c_proj->bias.grad(), tol, tol));
      }
    }
  }
}

TEST(TensorParallel, ParallelAttentionSplitsHeadsAndMatchesTheFullAttention) {
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    for (DType dtype : {DType::F64, DType::F32}) {
      const double tol = tolerance(dtype);
      CausalSelfAttention full(16, 4, true, 0.0, 31);  // 4 heads of 4
      full.to(dtype);
      ParallelCausalSelfAttention attn(full, tp);
      EXPECT_EQ(attn.local_heads, 4 / tp_size);
      EXPECT_EQ(attn.c_attn->weight.shape(), (Shape{3 * 16 / tp_size, 16}));
      const Tensor x0 = uniform_tensor({2, 5, 16}, 32, -1, 1, dtype);
      const Tensor w = uniform_tensor({2, 5, 16}, 33, -1, 1, dtype);
      Tensor x = leaf(x0), xp = leaf(x0);
      const Tensor y = full(x);
      backward(weighted_sum(y, w));
      const Tensor yp = attn(xp);
      EXPECT_TRUE(all_close(yp, y, tol, tol)) << "tp " << tp_size << " " << dtype_name(dtype);
      backward(weighted_sum(yp, w));
      EXPECT_TRUE(all_close(xp.grad(), x.grad(), tol, tol));
      // q, k and v rows of this rank's heads.
      EXPECT_TRUE(
          all_close(attn.c_attn->weight.grad(), slice_of(full.c_attn->weight.grad(), 0, r, tp_size, 3), tol, tol));
      EXPECT_TRUE(all_close(attn.c_attn->bias.grad(), slice_of(full.c_attn->bias.grad(), 0, r, tp_size, 3), tol, tol));
      EXPECT_TRUE(all_close(attn.c_proj->weight.grad(), slice_of(full.c_proj->weight.grad(), 1, r, tp_size), tol, tol));
      EXPECT_TRUE(all_close(attn.c_proj->bias.grad(), full.c_proj->bias.grad(), tol, tol));
    }
  }
}

TEST(TensorParallel, VocabParallelEmbeddingMatchesTheFullEmbedding) {
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    for (DType dtype : {DType::F64, DType::F32}) {
      const double tol = tolerance(dtype);
      Embedding full(12, 6, 41);
      full.to(dtype);
      VocabParallelEmbedding emb(full, tp);
      EXPECT_EQ(emb.weight.shape(), (Shape{12 / tp_size, 6}));
      // Every id appears, some several times (their gradients add up).
      const Tensor ids = Tensor::from_vector(std::vector<int64_t>{0, 11, 3, 3, 7, 5, 6, 2, 9, 1, 4, 10, 8, 11, 0},
                                             {3, 5});
      const Tensor w = uniform_tensor({3, 5, 6}, 42, -1, 1, dtype);
      const Tensor y = full(ids);
      backward(weighted_sum(y, w));
      const Tensor yp = emb(ids);
      EXPECT_TRUE(all_close(yp, y, 0, 0)) << "tp " << tp_size;  // one nonzero term per element: exact
      backward(weighted_sum(yp, w));
      EXPECT_TRUE(all_close(emb.weight.grad(), slice_of(full.weight.grad(), 0, r, tp_size), tol, tol));
    }
  }
}

TEST(TensorParallel, VocabParallelCrossEntropyMatchesSoftmaxCrossEntropy) {
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    for (DType dtype : {DType::F64, DType::F32, DType::BF16}) {
      const double tol = dtype == DType::BF16 ? 1e-5 : tolerance(dtype);
      const Tensor logits0 = uniform_tensor({2, 3, 16}, 51, -4, 4, dtype);
      for (bool with_ignored : {false, true}) {
        const Tensor targets = Tensor::from_vector(
            std::vector<int64_t>{0, 15, with_ignored ? -100 : 7, 8, with_ignored ? -100 : 3, 12}, {2, 3});
        Tensor full = leaf(logits0), shard = leaf(slice_of(logits0, 2, r, tp_size));
        const Tensor loss = softmax_cross_entropy(full, targets);
        backward(loss);
        const Tensor loss_p = vocab_parallel_cross_entropy(shard, targets, tp);
        EXPECT_EQ(loss_p.dtype(), loss.dtype());
        EXPECT_TRUE(all_close(loss_p, loss, tol, tol)) << "tp " << tp_size << " " << dtype_name(dtype);
        backward(loss_p);
        EXPECT_EQ(shard.grad().dtype(), dtype);
        // bf16 gradients: both round the same fp32 value once (allow one bf16 ulp for a different sum order).
        const double gtol = dtype == DType::BF16 ? 1.0 / 128 : tol;
        EXPECT_TRUE(all_close(shard.grad(), slice_of(full.grad(), 2, r, tp_size), gtol, gtol))
            << "tp " << tp_size << " " << dtype_name(dtype);
      }
      // Every target ignored: loss 0 and gradient 0, as softmax_cross_entropy.
      Tensor shard = leaf(slice_of(logits0, 2, r, tp_size));
      const Tensor none = Tensor::full({2, 3}, -100, DType::I64);
      const Tensor loss_p = vocab_parallel_cross_entropy(shard, none, tp);
      EXPECT_EQ(loss_p.item(), 0.0);
      backward(loss_p);
      EXPECT_TRUE(all_close(shard.grad(), Tensor::zeros(shard.shape(), dtype), 0, 0));
    }
  }
}

TEST(TensorParallel, TwoLayerParallelStackMatchesTheSingleProcessStack) {
  // embedding -> 2 x (x + attn(x), x + mlp(x)) -> lm_head column-parallel -> vocab-parallel loss, against the
  // same stack built from nn/ modules and softmax_cross_entropy.
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    const DType dtype = DType::F64;
    GPTConfig config;
    config.n_embd = 8;
    config.n_head = 4;
    Embedding wte(16, 8, 61);
    std::vector<std::shared_ptr<CausalSelfAttention>> attns;
    std::vector<std::shared_ptr<MLP>> mlps;
    for (int l = 0; l < 2; ++l) {
      attns.push_back(std::make_shared<CausalSelfAttention>(8, 4, true, 0.0, 70 + 10 * l));
      mlps.push_back(std::make_shared<MLP>(config, 75 + 10 * l));
    }
    Linear lm_head(8, 16, false, 90);
    wte.to(dtype);
    lm_head.to(dtype);
    for (int l = 0; l < 2; ++l) {
      attns[l]->to(dtype);
      mlps[l]->to(dtype);
    }
    VocabParallelEmbedding p_wte(wte, tp);
    std::vector<std::shared_ptr<ParallelCausalSelfAttention>> p_attns;
    std::vector<std::shared_ptr<ParallelMLP>> p_mlps;
    for (int l = 0; l < 2; ++l) {
      p_attns.push_back(std::make_shared<ParallelCausalSelfAttention>(*attns[l], tp));
      p_mlps.push_back(std::make_shared<ParallelMLP>(*mlps[l], tp));
    }
    ColumnParallelLinear p_head(lm_head, tp, false);

    const Tensor ids = Tensor::from_vector(std::vector<int64_t>{1, 5, 9, 13, 2, 0, 15, 7}, {2, 4});
    const Tensor targets = Tensor::from_vector(std::vector<int64_t>{5, 9, 13, 2, 0, 15, 7, 3}, {2, 4});
    Tensor h = wte(ids);
    Tensor hp = p_wte(ids);
    for (int l = 0; l < 2; ++l) {
      h = add(h, (*attns[l])(h));
      h = add(h, (*mlps[l])(h));
      hp = add(hp, (*p_attns[l])(hp));
      hp = add(hp, (*p_mlps[l])(hp));
    }
    EXPECT_TRUE(all_close(hp, h, 1e-12, 1e-12));
    const Tensor loss = softmax_cross_entropy(lm_head(h), targets);
    const Tensor loss_p = vocab_parallel_cross_entropy(p_head(hp), targets, tp);
    EXPECT_TRUE(all_close(loss_p, loss, 1e-12, 1e-12)) << "tp " << tp_size;
    backward(loss);
    backward(loss_p);
    EXPECT_TRUE(all_close(p_wte.weight.grad(), slice_of(wte.weight.grad(), 0, r, tp_size), 1e-12, 1e-12));
    EXPECT_TRUE(all_close(p_head.weight.grad(), slice_of(lm_head.weight.grad(), 0, r, tp_size), 1e-12, 1e-12));
    for (int l = 0; l < 2; ++l) {
      EXPECT_TRUE(all_close(p_attns[l]->c_attn->weight.grad(),
                            slice_of(attns[l]->c_attn->weight.grad(), 0, r, tp_size, 3), 1e-12, 1e-12));
      EXPECT_TRUE(all_close(p_attns[l]->c_proj->bias.grad(), attns[l]->c_proj->bias.grad(), 1e-12, 1e-12));
      EXPECT_TRUE(all_close(p_mlps[l]->c_fc->weight.grad(), slice_of(mlps[l]->c_fc->weight.grad(), 0, r, tp_size),
                            1e-12, 1e-12));
      EXPECT_TRUE(all_close(p_mlps[l]->c_proj->weight.grad(), slice_of(mlps[l]->c_proj->weight.grad(), 1, r, tp_size),
                            1e-12, 1e-12));
    }
  }
}

TEST(TensorParallel, GatherFullWritesTheShardsBackAndLoadFullReslices) {
  const Communicator tp = tp_group(2);
  CausalSelfAttention full(8, 2, true, 0.0, 81);
  ParallelCausalSelfAttention attn(full, tp);
  GPTConfig config;
  config.n_embd = 8;
  config.n_head = 2;
  config.activation = Activation::SwiGLU;
  MLP mlp_full(config, 82);
  ParallelMLP mlp(mlp_full, tp);
  Embedding wte_full(6, 8, 83);
  VocabParallelEmbedding wte(wte_full, tp);
  // Round trip: gather into fresh modules of other seeds gives back the originals exactly.
  CausalSelfAttention other(8, 2, true, 0.0, 91);
  MLP mlp_other(config, 92);
  Embedding wte_other(6, 8, 93);
  attn.gather_full(other);
  mlp.gather_full(mlp_other);
  wte.gather_full(wte_other);
  for (const auto& [name, t] : full.named_parameters())
    EXPECT_TRUE(all_close(other.state_dict().tensors.at(name), t, 0, 0)) << name;
  for (const auto& [name, t] : mlp_full.named_parameters())
    EXPECT_TRUE(all_close(mlp_other.state_dict().tensors.at(name), t, 0, 0)) << name;
  EXPECT_TRUE(all_close(wte_other.weight, wte_full.weight, 0, 0));
  // load_full slices another module's values into the shards.
  CausalSelfAttention third(8, 2, true, 0.0, 95);
  attn.load_full(third);
  EXPECT_TRUE(all_close(attn.c_attn->weight, slice_of(third.c_attn->weight, 0, tp.rank(), 2, 3), 0, 0));
  EXPECT_TRUE(all_close(attn.c_proj->weight, slice_of(third.c_proj->weight, 1, tp.rank(), 2), 0, 0));
}

TEST(TensorParallel, SizesTheGroupDoesNotDivideAreErrors) {
  const Communicator tp4 = tp_group(4);
  CausalSelfAttention six_heads(12, 6, true, 0.0, 1);  // 6 heads over tp 4
  EXPECT_ERROR_MENTIONS(ParallelCausalSelfAttention(six_heads, tp4), "ParallelCausalSelfAttention", "n_head (6)",
                        "size 4");
  Embedding vocab(10, 4, 2);  // a vocabulary is padded instead: ceil(10 / 4) = 3 rows on every rank
  EXPECT_EQ(VocabParallelEmbedding(vocab, tp4).weight.shape(), (Shape{3, 4}));
  Linear odd(6, 6, true, 3);
  EXPECT_ERROR_MENTIONS(ColumnParallelLinear(odd, tp4, false), "ColumnParallelLinear", "out_features (6)", "size 4");
  EXPECT_ERROR_MENTIONS(RowParallelLinear(odd, tp4, false), "RowParallelLinear", "in_features (6)", "size 4");
  EXPECT_ERROR_MENTIONS(scatter_to_tp_region(Tensor::zeros({2, 6}), tp4), "scatter_to_tp_region", "(6)", "size 4");
  // Wrong input width: an Error before any collective (on every rank alike).
  Linear ok(8, 8, true, 4);
  RowParallelLinear row(ok, tp4, true);
  EXPECT_ERROR_MENTIONS(row(Tensor::zeros({2, 8})), "RowParallelLinear", "[..., 2]");
}

namespace {

// How a ParallelGPT parameter is cut from the full GPT's parameter of the same name: (dim, blocks), or
// dim = -1 for a replicated one.
std::pair<int64_t, int64_t> gpt_layout(const std::string& name) {
  auto ends_with = [&name](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("attn.c_attn.weight") || ends_with("attn.c_attn.bias")) return {0, 3};
  if (ends_with("mlp.c_fc.weight") || ends_with("mlp.c_fc.bias")) return {0, 1};
  if (ends_with("c_proj.weight")) return {1, 1};
  if (name == "transformer.wte.weight" || name == "lm_head.weight") return {0, 1};
  return {-1, 1};
}

}  // namespace

TEST(TensorParallel, ParallelGPTMatchesTheSingleProcessGPT) {
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    for (bool tied : {true, false}) {
      for (DType dtype : {DType::F64, DType::F32}) {
        const double tol = tolerance(dtype);
        GPTConfig config;
        config.n_layer = 2;
        config.n_head = 4;
        config.n_embd = 16;
        config.block_size = 8;
        config.vocab_size = 32;
        config.tie_embeddings = tied;
        GPT full(config, 7);
        full.to(dtype);
        ParallelGPT model(full, tp);
        const Tensor idx = Tensor::randint(0, 32, {2, 6}, 8);
        Tensor targets = Tensor::randint(0, 32, {2, 6}, 9);
        {
          std::vector<int64_t> t = targets.to_vector<int64_t>();
          t[3] = -1;  // ignored, as in nanoGPT
          targets = Tensor::from_vector(t, {2, 6});
        }
        const GPTOutput out = full.forward(idx, targets);
        backward(out.loss);
        const ParallelGPTOutput pout = model.forward(idx, targets);
        EXPECT_TRUE(all_close(pout.loss, out.loss, tol, tol)) << "tp " << tp_size << " tied " << tied;
        EXPECT_TRUE(all_close(pout.logits, slice_of(out.logits, 2, r, tp_size), tol, tol));
        backward(pout.loss);
        const StateDict reference = full.state_dict();
        std::map<std::string, Tensor> full_grads;
        for (const auto& [name, t] : full.named_parameters()) full_grads[name] = t.grad();
        const std::vector<Tensor> sharded = tensor_parallel_parameters(model);
        int n_sharded = 0;
        for (const auto& [name, t] : model.named_parameters()) {
          if (!full_grads.count(name)) {
            ADD_FAILURE() << "no parameter " << name << " in the full GPT";
            continue;
          }
          const auto [dim, blocks] = gpt_layout(name);
          const Tensor expected = dim < 0 ? full_grads[name] : slice_of(full_grads[name], dim, r, tp_size, blocks);
          EXPECT_TRUE(all_close(t.grad(), expected, tol, tol)) << name << " tp " << tp_size << " tied " << tied;
          EXPECT_EQ(is_tensor_parallel_parameter(model, t), dim >= 0) << name;
          n_sharded += dim >= 0;
        }
        EXPECT_EQ(static_cast<int>(sharded.size()), n_sharded);
        EXPECT_EQ(model.named_parameters().size(), full.named_parameters().size());
        // The shards written back into a GPT of another seed give the original weights.
        GPT other(config, 99);
        other.to(dtype);
        model.gather_full(other);
        for (const auto& [name, t] : reference.tensors)
          EXPECT_TRUE(all_close(other.state_dict().tensors.at(name), t, 0, 0)) << name;
      }
    }
  }
}

TEST(TensorParallel, SixteenBitShardsRunInTheirDtypeAndStayCloseToTheFullModule) {
  // fp16/bf16: the sums run in another order (the partial products of RowParallelLinear are rounded to 16 bits
  // before the fp32 all-reduce), so only closeness is expected; the dtypes must be kept throughout.
  const Communicator tp = tp_group(2);
  const int r = tp.rank();
  for (DType dtype : {DType::BF16, DType::F16}) {
    GPTConfig config;
    config.n_embd = 16;
    config.n_head = 4;
    MLP full(config, 101);
    full.to(dtype);
    ParallelMLP mlp(full, tp);
    const Tensor x0 = uniform_tensor({2, 3, 16}, 102, -1, 1, dtype);
    Tensor x = leaf(x0), xp = leaf(x0);
    const Tensor y = full(x);
    const Tensor yp = mlp(xp);
    EXPECT_EQ(yp.dtype(), dtype);
    EXPECT_TRUE(all_close(yp, y, 2e-2, 2e-2)) << dtype_name(dtype);
    backward(sum(y.to(DType::F32)));
    backward(sum(yp.to(DType::F32)));
    EXPECT_EQ(xp.grad().dtype(), dtype);
    EXPECT_TRUE(all_close(xp.grad(), x.grad(), 2e-2, 2e-2)) << dtype_name(dtype);
    EXPECT_EQ(mlp.c_fc->weight.grad().dtype(), dtype);
    EXPECT_TRUE(all_close(mlp.c_fc->weight.grad(), slice_of(full.c_fc->weight.grad(), 0, r, 2), 2e-2, 2e-2));
    EXPECT_TRUE(all_close(mlp.c_proj->weight.grad(), slice_of(full.c_proj->weight.grad(), 1, r, 2), 2e-2, 2e-2));
  }
}

TEST(TensorParallel, UnderAutocastTheParallelMLPGivesTheFullModulesDtypes) {
  // fp32 master weights, autocast bf16: the output of RowParallelLinear (bias included) must come out in bf16
  // like the full Linear's, and the weight gradients in fp32.
  const Communicator tp = tp_group(2);
  const int r = tp.rank();
  GPTConfig config;
  config.n_embd = 16;
  config.n_head = 4;
  MLP full(config, 111);
  ParallelMLP mlp(full, tp);
  const Tensor x0 = uniform_tensor({2, 3, 16}, 112, -1, 1, DType::F32);
  Tensor x = leaf(x0), xp = leaf(x0);
  Tensor y, yp;
  {
    Autocast autocast(DType::BF16);
    y = full(x);
    yp = mlp(xp);
  }
  EXPECT_EQ(yp.dtype(), y.dtype());
  EXPECT_TRUE(all_close(yp, y, 2e-2, 2e-2));
  backward(sum(y.to(DType::F32)));
  backward(sum(yp.to(DType::F32)));
  EXPECT_EQ(mlp.c_proj->bias.grad().dtype(), DType::F32);
  EXPECT_TRUE(all_close(xp.grad(), x.grad(), 2e-2, 2e-2));
  EXPECT_TRUE(all_close(mlp.c_fc->weight.grad(), slice_of(full.c_fc->weight.grad(), 0, r, 2), 2e-2, 2e-2));
  EXPECT_TRUE(all_close(mlp.c_proj->bias.grad(), full.c_proj->bias.grad(), 1e-6, 1e-6));
}

// ---- Vocabularies the group does not divide (padding), ShardSpec ----

namespace {

// The padded layout, written out here independently of shard_of: `blocks` equal blocks along `dim`, each cut
// into `parts` chunks of ceil(block / parts); rank's chunk of each block, zero-padded to the chunk, side by side.
Tensor padded_slice_of(const Tensor& full, int64_t dim, int rank, int parts, int64_t blocks = 1) {
  NoGradGuard no_grad;
  const int64_t block = full.size(dim) / blocks, chunk = (block + parts - 1) / parts;
  const int64_t begin = std::min(block, rank * chunk), end = std::min(block, (rank + 1) * chunk);
  std::vector<Tensor> pieces;
  for (int64_t b = 0; b < blocks; ++b) {
    if (end > begin) pieces.push_back(full.detach().narrow(dim, b * block + begin, end - begin));
    if (chunk > end - begin) {
      Shape shape = full.shape();
      shape[static_cast<size_t>(dim)] = chunk - (end - begin);
      pieces.push_back(Tensor::zeros(shape, full.dtype()));
    }
  }
  return (pieces.size() == 1 ? pieces[0] : cat(pieces, dim)).contiguous();
}

// The padding rows (dim 0) of a vocabulary shard of rank r: rows [real, chunk).
Tensor padding_rows(const Tensor& shard, int64_t vocab, int r, int parts) {
  const int64_t chunk = (vocab + parts - 1) / parts;
  const int64_t real = std::clamp<int64_t>(vocab - r * chunk, 0, chunk);
  return shard.narrow(0, real, chunk - real);
}

bool all_zero(const Tensor& t) { return all_close(t, Tensor::zeros(t.shape(), t.dtype()), 0, 0); }

GPTConfig small_gpt(int64_t vocab, bool tied, Activation activation = Activation::Gelu) {
  GPTConfig config;
  config.n_layer = 2;
  config.n_head = 4;
  config.n_embd = 16;
  config.block_size = 8;
  config.vocab_size = vocab;
  config.tie_embeddings = tied;
  config.activation = activation;
  return config;
}

}  // namespace

TEST(TensorParallel, ParallelGPTWithAVocabularyTheGroupDoesNotDivideMatchesTheSingleProcessGPT) {
  // V = 11: chunks of 6 (tp 2) or 3 (tp 4), the last rank holding one padding row; V = 9 over tp 4: chunks of
  // 3, rank 3 holding no real row at all.
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    for (int64_t vocab : {11, 9}) {
      const int64_t chunk = (vocab + tp_size - 1) / tp_size;
      for (bool tied : {true, false}) {
        for (DType dtype : {DType::F64, DType::F32}) {
          const double tol = tolerance(dtype);
          const std::string where = "tp " + std::to_string(tp_size) + " V " + std::to_string(vocab) + " tied " +
                                    std::to_string(tied) + " " + dtype_name(dtype);
          const GPTConfig config = small_gpt(vocab, tied);
          GPT full(config, 7);
          full.to(dtype);
          ParallelGPT model(full, tp);
          EXPECT_EQ(model.wte->weight.shape(), (Shape{chunk, 16})) << where;
          EXPECT_TRUE(all_zero(padding_rows(model.wte->weight, vocab, r, tp_size))) << where;
          if (!tied) {
            EXPECT_TRUE(all_zero(padding_rows(model.lm_head->weight, vocab, r, tp_size))) << where;
          }
          const Tensor idx = Tensor::randint(0, vocab, {2, 6}, 8);
          std::vector<int64_t> t = Tensor::randint(0, vocab, {2, 6}, 9).to_vector<int64_t>();
          t[3] = -1;
          t[4] = vocab - 1;  // the last real row is a target
          const Tensor targets = Tensor::from_vector(t, {2, 6});
          const GPTOutput out = full.forward(idx, targets);
          backward(out.loss);
          const ParallelGPTOutput pout = model.forward(idx, targets);
          EXPECT_TRUE(all_close(pout.loss, out.loss, tol, tol)) << where;
          // The logits shard: this rank's columns, padding columns 0; gathered: the full logits.
          EXPECT_EQ(pout.logits.shape(), (Shape{2, 6, chunk})) << where;
          EXPECT_TRUE(all_close(pout.logits, padded_slice_of(out.logits, 2, r, tp_size), tol, tol)) << where;
          EXPECT_TRUE(all_close(gather_shards(pout.logits, model.logits_spec(), tp), out.logits, tol, tol)) << where;
          backward(pout.loss);
          std::map<std::string, Tensor> full_grads;
          for (const auto& [name, p] : full.named_parameters()) full_grads[name] = p.grad();
          const std::map<std::string, ShardSpec> specs = shard_specs(model);
          for (const auto& [name, p] : model.named_parameters()) {
            const auto [dim, blocks] = gpt_layout(name);
            EXPECT_EQ(specs.count(name), dim >= 0 ? 1u : 0u) << name;
            if (dim < 0) {
              EXPECT_TRUE(all_close(p.grad(), full_grads.at(name), tol, tol)) << name << " " << where;
              continue;
            }
            const ShardSpec spec = specs.at(name);
            EXPECT_EQ(spec.dim, dim) << name;
            EXPECT_EQ(spec.blocks, blocks) << name;
            EXPECT_EQ(spec.full_size, full_grads.at(name).size(dim)) << name;
            EXPECT_TRUE(all_close(p.grad(), padded_slice_of(full_grads.at(name), dim, r, tp_size, blocks), tol, tol))
                << name << " " << where;
            EXPECT_TRUE(all_close(p.grad(), shard_of(full_grads.at(name), spec, r, tp_size), tol, tol)) << name;
          }
          // The padding rows' gradient is exactly zero (not merely small).
          EXPECT_TRUE(all_zero(padding_rows(model.wte->weight.grad(), vocab, r, tp_size))) << where;
          if (!tied) {
            EXPECT_TRUE(all_zero(padding_rows(model.lm_head->weight.grad(), vocab, r, tp_size))) << where;
          }
          // gather_full gives the same [V, C] model back.
          GPT other(config, 99);
          other.to(dtype);
          model.gather_full(other);
          for (const auto& [name, p] : full.named_parameters())
            EXPECT_TRUE(all_close(other.state_dict().tensors.at(name), p, 0, 0)) << name << " " << where;
        }
      }
    }
  }
}

TEST(TensorParallel, AdamWWithWeightDecayKeepsThePaddingRowsExactlyZero) {
  // Three AdamW steps (weight decay 0.1) on the full GPT and on the ParallelGPT: the padding rows stay exactly
  // zero, and so do their exp_avg / exp_avg_sq; gathered, the weights and the optimizer state equal the single
  // process's, and gather_full equals gather_shards of each parameter.
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    for (int64_t vocab : {11, 9}) {
      for (bool tied : {true, false}) {
        const std::string where =
            "tp " + std::to_string(tp_size) + " V " + std::to_string(vocab) + " tied " + std::to_string(tied);
        const GPTConfig config = small_gpt(vocab, tied);
        GPT full(config, 17);
        full.to(DType::F64);
        ParallelGPT model(full, tp);
        AdamW opt_full(full.parameters(), 1e-2, 0.1);
        AdamW opt(model.parameters(), 1e-2, 0.1);
        for (int step = 0; step < 3; ++step) {
          const Tensor idx = Tensor::randint(0, vocab, {2, 6}, 30 + step);
          const Tensor targets = Tensor::randint(0, vocab, {2, 6}, 40 + step);
          opt_full.zero_grad();
          backward(full.forward(idx, targets).loss);
          opt_full.step();
          opt.zero_grad();
          backward(model.forward(idx, targets).loss);
          opt.step();
          EXPECT_TRUE(all_zero(padding_rows(model.wte->weight, vocab, r, tp_size))) << where << " step " << step;
          if (!tied) {
            EXPECT_TRUE(all_zero(padding_rows(model.lm_head->weight, vocab, r, tp_size))) << where << " step " << step;
          }
        }
        std::vector<Tensor> vocab_params{model.wte->weight};
        if (!tied) vocab_params.push_back(model.lm_head->weight);
        for (const Tensor& p : vocab_params)
          for (const char* buffer : {"exp_avg", "exp_avg_sq"})
            EXPECT_TRUE(all_zero(padding_rows(opt.state(p)->buffers.at(buffer), vocab, r, tp_size)))
                << where << " " << buffer;
        GPT gathered(config, 98);
        gathered.to(DType::F64);
        model.gather_full(gathered);
        const StateDict gathered_dict = gathered.state_dict();
        for (const auto& [name, p] : full.named_parameters())
          EXPECT_TRUE(all_close(gathered_dict.tensors.at(name), p, 1e-10, 1e-10)) << name << " " << where;
        std::map<std::string, Tensor> parameters, full_parameters;
        for (const auto& [name, p] : model.named_parameters()) parameters[name] = p;
        for (const auto& [name, p] : full.named_parameters()) full_parameters[name] = p;
        for (const auto& [name, spec] : shard_specs(model)) {
          EXPECT_TRUE(all_close(gather_shards(parameters.at(name), spec, tp), gathered_dict.tensors.at(name), 0, 0))
              << name;
          // Optimizer state of the same shape gathers the same way.
          const Tensor exp_avg = gather_shards(opt.state(parameters.at(name))->buffers.at("exp_avg"), spec, tp);
          EXPECT_TRUE(all_close(exp_avg, opt_full.state(full_parameters.at(name))->buffers.at("exp_avg"), 1e-10,
                                1e-10))
              << name << " " << where;
        }
      }
    }
  }
}

TEST(TensorParallel, GatherShardsInvertsShardOfForEveryParameterOfAParallelGPT) {
  // SwiGLU (c_fc in 2 blocks), c_attn (3 blocks), RowParallel (dim 1), and a padded vocabulary (wte, lm_head).
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    const GPTConfig config = small_gpt(11, false, Activation::SwiGLU);
    const GPT full(config, 5);
    const ParallelGPT model(full, tp);
    std::map<std::string, Tensor> parameters, full_parameters;
    for (const auto& [name, p] : model.named_parameters()) parameters[name] = p;
    for (const auto& [name, p] : full.named_parameters()) full_parameters[name] = p;
    const std::map<std::string, ShardSpec> specs = shard_specs(model);
    EXPECT_EQ(specs.size(), tensor_parallel_parameters(model).size());
    EXPECT_EQ(specs.size(), 2u * (2 + 2 + 2) + 2);  // per layer: c_attn w/b, c_fc w/b, 2 c_proj w; wte, lm_head
    for (const auto& [name, spec] : specs) {
      EXPECT_TRUE(is_tensor_parallel_parameter(model, parameters.at(name))) << name;
      const auto [dim, layout_blocks] = gpt_layout(name);
      const int64_t blocks = name.find("mlp.c_fc") != std::string::npos ? 2 : layout_blocks;  // SwiGLU: gate | value
      EXPECT_EQ(spec, (ShardSpec{dim, blocks, full_parameters.at(name).size(dim)})) << name;
      for (DType dtype : {DType::F32, DType::BF16}) {
        const Tensor x = uniform_tensor(full_parameters.at(name).shape(), 300 + specs.size(), -1, 1, dtype);
        const Tensor s = shard_of(x, spec, r, tp_size);
        EXPECT_EQ(s.dtype(), dtype);
        EXPECT_TRUE(s.is_contiguous());
        EXPECT_EQ(s.shape(), parameters.at(name).shape()) << name;
        EXPECT_TRUE(all_close(s, padded_slice_of(x, dim, r, tp_size, blocks), 0, 0)) << name;
        const Tensor g = gather_shards(s, spec, tp);
        EXPECT_EQ(g.dtype(), dtype);
        EXPECT_TRUE(all_close(g, x, 0, 0)) << name << " tp " << tp_size << " " << dtype_name(dtype);
        if (s.dim() == 2) {  // a non-contiguous shard of the same values
          const Tensor strided = s.mT().contiguous().mT();
          EXPECT_FALSE(strided.is_contiguous());
          EXPECT_TRUE(all_close(gather_shards(strided, spec, tp), x, 0, 0)) << name;
        }
      }
    }
  }
}

TEST(TensorParallel, PaddedColumnParallelLinearMatchesTheFullLinear) {
  // out = 11 over tp 2 / 4 with pad: shards of 6 / 3 rows; the padding rows' output columns are 0 (dropped by
  // gather_output) and their weight and bias gradients exactly 0.
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    for (bool gather_output : {false, true}) {
      Linear full(8, 11, true, 3);
      full.to(DType::F64);
      ColumnParallelLinear column(full, tp, gather_output, 1, true);
      const int64_t chunk = (11 + tp_size - 1) / tp_size;
      EXPECT_EQ(column.weight.shape(), (Shape{chunk, 8}));
      const Tensor x0 = uniform_tensor({2, 3, 8}, 7, -1, 1, DType::F64);
      const Tensor w = uniform_tensor({2, 3, 11}, 8, -1, 1, DType::F64);
      Tensor x = leaf(x0), xp = leaf(x0);
      const Tensor y = full(x);
      backward(weighted_sum(y, w));
      const Tensor yp = column(xp);
      if (gather_output) {
        EXPECT_TRUE(all_close(yp, y, 1e-12, 1e-12)) << "tp " << tp_size;
        backward(weighted_sum(yp, w));
      } else {
        EXPECT_TRUE(all_close(yp, padded_slice_of(y, 2, r, tp_size), 1e-12, 1e-12)) << "tp " << tp_size;
        backward(weighted_sum(yp, padded_slice_of(w, 2, r, tp_size)));
      }
      EXPECT_TRUE(all_close(xp.grad(), x.grad(), 1e-12, 1e-12)) << "tp " << tp_size << " gather " << gather_output;
      EXPECT_TRUE(all_close(column.weight.grad(), padded_slice_of(full.weight.grad(), 0, r, tp_size), 1e-12, 1e-12));
      EXPECT_TRUE(all_zero(padding_rows(column.weight.grad(), 11, r, tp_size)));
      EXPECT_TRUE(all_zero(padding_rows(column.bias.grad(), 11, r, tp_size)));
      Linear other(8, 11, true, 4);
      other.to(DType::F64);
      column.gather_full(other);
      EXPECT_TRUE(all_close(other.weight, full.weight, 0, 0));
      EXPECT_TRUE(all_close(other.bias, full.bias, 0, 0));
    }
  }
}

TEST(TensorParallel, VocabParallelCrossEntropyIgnoresPaddingColumns) {
  // V = 9: tp 2 -> widths 5 (rank 1: 4 real + 1 padding); tp 4 -> widths 3 (rank 3: all padding). The padding
  // columns hold 50 (larger than every logit): were they read, the loss would change.
  for (int tp_size : {2, 4}) {
    const Communicator tp = tp_group(tp_size);
    const int r = tp.rank();
    const int64_t vocab = 9, width = (vocab + tp_size - 1) / tp_size;
    const int64_t real = std::clamp<int64_t>(vocab - r * width, 0, width);
    for (DType dtype : {DType::F64, DType::F32}) {
      const double tol = tolerance(dtype);
      const Tensor logits0 = uniform_tensor({2, 3, vocab}, 61, -4, 4, dtype);
      const Tensor targets = Tensor::from_vector(std::vector<int64_t>{0, 8, -100, 4, 7, 5}, {2, 3});
      Tensor padded = padded_slice_of(logits0, 2, r, tp_size);
      if (real < width) padded = cat({padded.narrow(2, 0, real), Tensor::full({2, 3, width - real}, 50.0, dtype)}, 2);
      Tensor full = leaf(logits0), shard = leaf(padded);
      const Tensor loss = softmax_cross_entropy(full, targets);
      backward(loss);
      const Tensor loss_p = vocab_parallel_cross_entropy(shard, targets, tp, -100, vocab);
      EXPECT_TRUE(all_close(loss_p, loss, tol, tol)) << "tp " << tp_size << " " << dtype_name(dtype);
      backward(loss_p);
      EXPECT_TRUE(all_close(shard.grad(), padded_slice_of(full.grad(), 2, r, tp_size), tol, tol)) << "tp " << tp_size;
      EXPECT_TRUE(all_zero(shard.grad().narrow(2, real, width - real))) << "tp " << tp_size;
    }
  }
}

TEST(TensorParallel, ShardSpecErrorsNameTheSizes) {
  const Communicator tp4 = tp_group(4);
  // vocab_size more than the shards can hold; a target past the (unpadded) vocabulary.
  EXPECT_ERROR_MENTIONS(vocab_parallel_cross_entropy(Tensor::zeros({2, 2}), Tensor::zeros({2}, DType::I64), tp4,
                                                     -100, 10),
                        "vocab_parallel_cross_entropy", "vocab_size (10)", "size 4", "width 2");
  const Tensor past_the_end = Tensor::from_vector(std::vector<int64_t>{0, 9}, {2});
  EXPECT_ERROR_MENTIONS(vocab_parallel_cross_entropy(Tensor::zeros({2, 3}), past_the_end, tp4, -100, 9),
                        "vocab_parallel_cross_entropy", "target 9", "vocabulary of 9");
  // shard_of: a full tensor of another size; full_size not a multiple of blocks; a rank outside the group.
  EXPECT_ERROR_MENTIONS(shard_of(Tensor::zeros({10, 4}), ShardSpec{0, 1, 12}, 0, 4), "shard_of", "size 10",
                        "full_size 12");
  EXPECT_ERROR_MENTIONS(shard_of(Tensor::zeros({10}), ShardSpec{0, 3, 10}, 0, 4), "shard_of", "full_size (10)",
                        "blocks (3)");
  EXPECT_ERROR_MENTIONS(shard_of(Tensor::zeros({10}), ShardSpec{0, 1, 10}, 4, 4), "shard_of", "rank 4");
  EXPECT_ERROR_MENTIONS(shard_of(Tensor::zeros({10}), ShardSpec{1, 1, 10}, 0, 4), "shard_of", "dim 1");
  // gather_shards of a tensor that is not a shard (here the full one): an Error before any collective.
  EXPECT_ERROR_MENTIONS(gather_shards(Tensor::zeros({11, 4}), ShardSpec{0, 1, 11}, Communicator(tp4)),
                        "gather_shards", "size 11", "= 3", "size 4");
}
