// generate: samples text from a GPT saved by train_gpt (a training checkpoint or a weights file whose
// metadata holds the config and, for character-level models, the vocabulary).
//
//   generate --model ckpt.safetensors [--prompt TEXT] [--tokens N] [--temperature X] [--top-k K] [--seed N]
//
// Each new token is drawn from softmax(logits / temperature) restricted to the top-k logits (k = 0: all),
// with the uniform draw of token i a pure function of (seed, i) (Philox), so a run is reproducible; the
// sampler is mixtape::sample_tokens (train/training.h), which train_gpt --sample uses too.
// Without a vocabulary (a .bin-trained model) the prompt and output are space-separated token ids.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "train/training.h"

using namespace mixtape;

namespace {

struct Options {
  std::string model;
  std::string prompt;
  int64_t tokens = 500;
  double temperature = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 1337;
  Device device = Device::cpu();
};

void usage() {
  std::cout << "usage: generate --model FILE [--prompt TEXT] [--tokens N] [--temperature X] [--top-k K] [--seed N]\n"
               "                [--device cpu|cuda|cuda:N]\n";
}

Options parse(int argc, char** argv) {
  Options o;
  std::set<std::string> given;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") { usage(); std::exit(0); }
    static const std::set<std::string> known = {"--model",  "--init",  "--checkpoint", "--prompt",     "--device",
                                                "--tokens", "--top-k", "--seed",       "--temperature"};
    if (!known.count(flag)) {
      usage();
      fail("generate: unknown option '", flag, "'");
    }
    check(i + 1 < argc, "generate: ", flag, " needs a value");
    const std::string value = argv[++i];
    // Each option once (the last one silently won), and with a value (an empty --prompt is the default one).
    // --init and --checkpoint are other names of --model.
    const bool is_model = flag == "--model" || flag == "--init" || flag == "--checkpoint";
    check(given.insert(is_model ? "--model" : flag).second, "generate: ", flag,
          is_model ? " names the model a second time (--model, --init and --checkpoint are one option)"
                   : " is given twice (give each option once)");
    check(!value.empty() || flag == "--prompt", "generate: ", flag, " needs a value, got ''");
    auto integer = [&](int64_t low) { return integer_argument("generate", flag, value, low); };
    if (is_model) o.model = value;
    else if (flag == "--prompt") o.prompt = value;
    else if (flag == "--device") o.device = Device::parse(value);
    else if (flag == "--tokens") o.tokens = integer(0);
    else if (flag == "--top-k") o.top_k = integer(0);
    else if (flag == "--seed") o.seed = static_cast<uint64_t>(integer(0));
    else if (flag == "--temperature") {
      o.temperature = number_argument("generate", flag, value);
      check(o.temperature > 0, "generate: --temperature expects a number > 0, got '", value, "'");
    } else {
      fail("generate: option ", flag, " is listed but not read (a bug)");
    }
  }
  check(!o.model.empty(), "generate: --model FILE is required (a train_gpt checkpoint or weights file)");
  return o;
}

int run(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  std::vector<uint8_t> vocab;
  std::unique_ptr<GPT> model = load_model_file(opt.model, &vocab);
  model->to(opt.device);
  const GPTConfig& config = model->config();

  std::vector<int64_t> ids;
  if (!vocab.empty()) {
    for (unsigned char c : opt.prompt) {
      const auto it = std::find(vocab.begin(), vocab.end(), c);
      check(it != vocab.end(), "generate: the prompt's byte ", int(c), " ('", std::string(1, char(c)),
            "') is not in the model's vocabulary");
      ids.push_back(it - vocab.begin());
    }
    if (ids.empty()) ids.push_back(default_start_token(vocab));
  } else {
    std::istringstream in(opt.prompt);
    int64_t id;
    while (in >> id) {
      check(id >= 0 && id < config.vocab_size, "generate: prompt token ", id, " is outside [0, ", config.vocab_size,
            ")");
      ids.push_back(id);
    }
    check(in.eof(), "generate: without a character vocabulary, --prompt must be space-separated token ids");
    if (ids.empty()) ids.push_back(0);
  }

  if (!vocab.empty()) std::fwrite(opt.prompt.data(), 1, opt.prompt.size(), stdout);
  sample_tokens(*model, ids, opt.tokens, opt.temperature, opt.top_k, opt.seed, [&](int64_t next) {
    if (!vocab.empty()) {
      check(next < static_cast<int64_t>(vocab.size()), "generate: sampled token ", next,
            " has no entry in the vocabulary");
      std::fputc(vocab[next], stdout);
    } else {
      std::printf("%lld ", static_cast<long long>(next));
    }
    std::fflush(stdout);
  });
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run_program(run, argc, argv); }
