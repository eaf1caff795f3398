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
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "train/command_line.h"
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

// The options of the command line, or none when it asked for --help (printed).
std::optional<Options> parse(int argc, char** argv) {
  Options o;
  cli::CommandLine cli("generate", "generate: samples text from a GPT saved by train_gpt (a training checkpoint "
                       "or a weights file)");
  // --init and --checkpoint are other names of --model.
  cli.repeated_message = [](const CLI::Option& option, const std::string& written) {
    return "generate: " + written +
           (option.check_name("--model") ? " names the model a second time (--model, --init and --checkpoint are "
                                           "one option)"
                                         : " is given twice (give each option once)");
  };
  cli.required(cli.text("--model,--init,--checkpoint", o.model, "FILE", "a train_gpt checkpoint or weights file"),
               "generate: --model FILE is required (a train_gpt checkpoint or weights file)");
  // An empty --prompt is the default one.
  cli.add("--prompt", [&o](const std::string& value) { o.prompt = value; }, "TEXT",
          "the text to continue (space-separated token ids for a .bin-trained model; default: a newline, or "
          "token 0)");
  cli.integer("--tokens", o.tokens, 0, "tokens to generate (default 500)");
  cli.positive_number("--temperature", o.temperature, "softmax temperature, > 0 (default 1)");
  cli.integer("--top-k", o.top_k, 0, "sample from the K likeliest tokens (0 = all, the default)");
  cli.integer("--seed", o.seed, 0, "the seed of the draws (default 1337)");
  cli.device("--device", o.device, "where the model runs (default cpu)");
  if (!cli.parse(argc, argv)) return std::nullopt;
  return o;
}

// The prompt as token ids: its bytes in the model's character vocabulary, or the ids it lists (without one);
// an empty prompt starts from the default start token.
std::vector<int64_t> prompt_ids(const Options& opt, const std::vector<uint8_t>& vocab, const GPTConfig& config) {
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
  return ids;
}

int run(int argc, char** argv) {
  const std::optional<Options> parsed = parse(argc, argv);
  if (!parsed) return 0;  // --help
  const Options& opt = *parsed;
  std::vector<uint8_t> vocab;
  std::unique_ptr<GPT> model = load_model_file(opt.model, &vocab);
  model->to(opt.device);
  const std::vector<int64_t> ids = prompt_ids(opt, vocab, model->config());

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
