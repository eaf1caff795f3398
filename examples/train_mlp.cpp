// train_mlp: the foundation's demo. A character-level language model with a 2-layer MLP (Bengio et al.
// 2003, "A Neural Probabilistic Language Model"): the previous `context` characters are embedded,
// concatenated, passed through a tanh hidden layer and a softmax over the vocabulary, and trained with SGD
// on real English text to predict the next character. Everything runs through mixtape's ops and tape.
//
// By default it reads the GNU GPL v3 text that every Debian system ships in base-files
// (/usr/share/common-licenses/GPL-3); --data FILE trains on any other text file.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "train/training.h"
#include "tensor/ops.h"

using namespace mixtape;

namespace {

struct Options {
  std::string data = "/usr/share/common-licenses/GPL-3";
  int64_t context = 3, embed = 16, hidden = 128, batch = 64, steps = 3000;
  double lr = 0.2, min_lr = 0.02;
  int64_t print_every = 250;
  uint64_t seed = 42;
  DType dtype = DType::F32;
};

void usage() {
  std::cout << "usage: train_mlp [--data FILE] [--context N] [--embed N] [--hidden N] [--batch N] [--steps N]\n"
               "                 [--lr X] [--min-lr X] [--print-every N] [--seed N] [--dtype f32|bf16|f16]\n";
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") { usage(); std::exit(0); }
    check(i + 1 < argc, "train_mlp: ", flag, " needs a value");
    const std::string value = argv[++i];
    auto integer = [&](int64_t low) { return integer_argument("train_mlp", flag, value, low); };
    auto real = [&]() {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);
      check(end && *end == 0 && std::isfinite(v) && v > 0, "train_mlp: ", flag, " expects a positive number, got '",
            value, "'");
      return v;
    };
    if (flag == "--data") o.data = value;
    else if (flag == "--context") o.context = integer(1);
    else if (flag == "--embed") o.embed = integer(1);
    else if (flag == "--hidden") o.hidden = integer(1);
    else if (flag == "--batch") o.batch = integer(1);
    else if (flag == "--steps") o.steps = integer(0);
    else if (flag == "--lr") o.lr = real();
    else if (flag == "--min-lr") o.min_lr = real();
    else if (flag == "--print-every") o.print_every = integer(1);
    else if (flag == "--seed") o.seed = static_cast<uint64_t>(integer(0));
    else if (flag == "--dtype") {
      if (value == "f32") o.dtype = DType::F32;
      else if (value == "bf16") o.dtype = DType::BF16;
      else if (value == "f16") o.dtype = DType::F16;
      else fail("train_mlp: --dtype expects f32, bf16 or f16, got '", value, "'");
    } else {
      usage();
      fail("train_mlp: unknown option ", flag);
    }
  }
  return o;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(in.good(), "train_mlp: cannot open --data file '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The model's parameters, stored in the training dtype.
struct Mlp {
  Tensor embedding, w1, b1, w2, b2;
  std::vector<Tensor*> params() { return {&embedding, &w1, &b1, &w2, &b2}; }
};

// Log-probabilities of the next character for each row of `contexts` [B, context] (token ids).
Tensor forward_log_probs(const Mlp& m, const Tensor& contexts) {
  const int64_t rows = contexts.size(0);
  const Tensor x = embedding(m.embedding, contexts).reshape({rows, -1});  // [B, context * embed]
  const Tensor h = tanh(matmul(x, m.w1) + m.b1);                         // [B, hidden]
  return log_softmax(matmul(h, m.w2) + m.b2, -1);                      // [B, vocab]
}

// Mean negative log-likelihood of `targets` [B]: the one-hot rows come from embedding an identity matrix.
Tensor nll(const Tensor& log_probs, const Tensor& targets, const Tensor& identity) {
  const Tensor one_hot = embedding(identity, targets);  // [B, vocab]
  return neg(mean(sum(mul(log_probs, one_hot), {-1})));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options opt = parse(argc, argv);
    const std::string text = read_file(opt.data);
    std::array<int, 256> id{};
    id.fill(-1);
    std::string vocab;
    for (unsigned char c : text) id[c] = 1;
    for (int c = 0; c < 256; ++c)
      if (id[c] == 1) { id[c] = static_cast<int>(vocab.size()); vocab.push_back(static_cast<char>(c)); }
    const int64_t vocab_size = static_cast<int64_t>(vocab.size());
    const int64_t n = static_cast<int64_t>(text.size());
    check(n > 10 * (opt.context + 1), "train_mlp: '", opt.data, "' is too short (", n, " bytes)");
    std::vector<int64_t> tokens(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) tokens[i] = id[static_cast<unsigned char>(text[i])];
    const int64_t n_train = n * 9 / 10;  // first 90% trains, the rest validates

    // Gathers (context, target) rows starting at the given positions.
    auto make_batch = [&](const std::vector<int64_t>& starts) {
      std::vector<int64_t> ctx, tgt;
      for (int64_t s : starts) {
        for (int64_t j = 0; j < opt.context; ++j) ctx.push_back(tokens[s + j]);
        tgt.push_back(tokens[s + opt.context]);
      }
      const int64_t rows = static_cast<int64_t>(starts.size());
      return std::pair{Tensor::from_vector(ctx, {rows, opt.context}), Tensor::from_vector(tgt, {rows})};
    };

    // Initialisation: N(0, 1) embeddings; tanh layer scaled by 5/3 / sqrt(fan_in) (Kaiming for tanh);
    // the output layer small so the first loss is close to log(vocab).
    Mlp m;
    const int64_t fan_in = opt.context * opt.embed;
    m.embedding = Tensor::randn({vocab_size, opt.embed}, opt.seed);
    m.w1 = Tensor::randn({fan_in, opt.hidden}, opt.seed + 1) * (5.0 / 3.0 / std::sqrt(double(fan_in)));
    m.b1 = Tensor::zeros({opt.hidden});
    m.w2 = Tensor::randn({opt.hidden, vocab_size}, opt.seed + 2) * 0.01;
    m.b2 = Tensor::zeros({vocab_size});
    for (Tensor* p : m.params()) *p = p->to(opt.dtype).detach().requires_grad_();
    Tensor identity = Tensor::zeros({vocab_size, vocab_size}, opt.dtype);
    for (int64_t v = 0; v < vocab_size; ++v) identity.select(0, v).select(0, v).fill_(1);

    // Validation: every position of the held-out 10% (up to 8192 rows, evenly spaced).
    std::vector<int64_t> val_starts;
    const int64_t val_rows = std::min<int64_t>(8192, n - n_train - opt.context);
    for (int64_t i = 0; i < val_rows; ++i) val_starts.push_back(n_train + i * (n - n_train - opt.context) / val_rows);
    const auto [val_x, val_y] = make_batch(val_starts);
    auto val_loss = [&]() {
      NoGradGuard no_grad;
      return nll(forward_log_probs(m, val_x), val_y, identity).item();
    };

    std::printf("train_mlp: %s, %lld bytes, vocab %lld, context %lld, embed %lld, hidden %lld, dtype %s\n",
                opt.data.c_str(), static_cast<long long>(n), static_cast<long long>(vocab_size),
                static_cast<long long>(opt.context), static_cast<long long>(opt.embed),
                static_cast<long long>(opt.hidden), dtype_name(opt.dtype));
    std::printf("uniform guess: %.4f nats/char; initial val loss %.4f\n", std::log(double(vocab_size)), val_loss());

    const auto start = std::chrono::steady_clock::now();
    double train_loss_sum = 0;
    int64_t train_loss_count = 0;
    for (int64_t step = 1; step <= opt.steps; ++step) {
      // Random windows of the training split; the draw depends only on (seed, step).
      const std::vector<int64_t> starts =
          Tensor::randint(0, n_train - opt.context, {opt.batch}, opt.seed * 1000003 + static_cast<uint64_t>(step))
              .to_vector<int64_t>();
      const auto [x, y] = make_batch(starts);
      const Tensor loss = nll(forward_log_probs(m, x), y, identity);
      for (Tensor* p : m.params()) p->set_grad(Tensor());
      backward(loss);
      // SGD with a cosine decay from lr to min_lr.
      const double progress = double(step - 1) / double(std::max<int64_t>(1, opt.steps - 1));
      const double lr = opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + std::cos(M_PI * progress));
      {
        NoGradGuard no_grad;
        for (Tensor* p : m.params()) p->add_(p->grad(), -lr);
      }
      train_loss_sum += loss.item();
      ++train_loss_count;
      if (step % opt.print_every == 0 || step == opt.steps) {
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::printf("step %5lld/%lld | train loss %.4f | val loss %.4f | lr %.4f | %.0f chars/s\n",
                    static_cast<long long>(step), static_cast<long long>(opt.steps),
                    train_loss_sum / double(train_loss_count), val_loss(), lr,
                    double(step * opt.batch) / seconds);
        std::fflush(stdout);
        train_loss_sum = 0;
        train_loss_count = 0;
      }
    }

    // A sample: start from the first context of the validation split, draw characters from the model.
    NoGradGuard no_grad;
    std::vector<int64_t> window(tokens.begin() + n_train, tokens.begin() + n_train + opt.context);
    std::string sample;
    for (int64_t i = 0; i < opt.context; ++i) sample.push_back(vocab[window[i]]);
    for (int i = 0; i < 200; ++i) {
      const Tensor logp = forward_log_probs(m, Tensor::from_vector(window, {1, opt.context}));
      const std::vector<double> p = exp(logp).to_vector<double>();
      const double u = Tensor::rand({1}, opt.seed + 7 + i, DType::F64).item();
      double acc = 0;
      int64_t next = vocab_size - 1;
      for (int64_t v = 0; v < vocab_size; ++v)
        if ((acc += p[v]) > u) { next = v; break; }
      sample.push_back(vocab[next]);
      window.erase(window.begin());
      window.push_back(next);
    }
    std::printf("sample:\n%s\n", sample.c_str());
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
