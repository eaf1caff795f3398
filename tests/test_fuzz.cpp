// Seeded, deterministic mutation tests of the two inputs a user hands train_gpt: a training checkpoint (a
// safetensors file) and an --amp-config JSON text. Each mutant either loads (and then trains a step) or fails
// with a mixtape::Error; any other exception is a failure of the test, and a crash, a sanitizer report or a
// hang fails the run.
//
// Every mutant i is derived from (kSeed, i) alone, so one can be replayed by itself:
//   MIXTAPE_FUZZ_ONLY=<i>   run mutant i only (of each test; see the failure message for the test's name)
//   MIXTAPE_FUZZ_TRACE=1    print each mutant before it runs (to find the one a crash happened in)
//   MIXTAPE_FUZZ_COUNT=<n>  run n mutants per test instead of the default
//   MIXTAPE_FUZZ_SEED=<s>   another seed (to explore; the suite runs kSeed)
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <unistd.h>
#include <vector>

#include "amp/booster.h"
#include "amp/config.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "nn/gpt.h"
#include "nn/layers.h"
#include "optim/sgd.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/precision.h"
#include "train/training.h"

namespace mixtape {
namespace {

constexpr uint64_t kSeed = 0x6d69787461706521ull;  // "mixtape!"
constexpr int kCheckpointMutants = 1200;  // about 0.5 ms each on one core, 4 under ASan
constexpr int kAmpConfigMutants = 4000;  // well under 0.1 ms each

// ---- deterministic randomness: splitmix64, one stream per mutant ----
struct Random {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(next() % n); }
  bool chance(int percent) { return below(100) < static_cast<size_t>(percent); }
  template <class T>
  const T& pick(const std::vector<T>& items) { return items[below(items.size())]; }
};

Random mutant_random(uint64_t seed, int index) {
  Random mix{seed ^ (0xa0761d6478bd642full * static_cast<uint64_t>(index + 1))};
  return Random{mix.next()};
}

std::optional<long> env_number(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  return std::strtol(text, nullptr, 10);
}

// ---- what a mutant is and how each is run ----
struct Mutant {
  std::string bytes;
  std::string how;  // the mutation, for the failure message
};

std::string byte_text(unsigned char byte) {
  char text[8];
  std::snprintf(text, sizeof text, "0x%02x", byte);
  return text;
}

// Runs `body` and records anything but success or a mixtape::Error as a failure of `stage`.
struct Outcome {
  std::vector<std::string> failures;
  int loaded = 0;
  int refused = 0;

  // Whether body ran through.
  bool run(const std::string& label, const char* stage, const std::function<void()>& body) {
    try {
      body();
      return true;
    } catch (const Error&) {
      return false;
    } catch (const std::exception& e) {
      failures.push_back(label + ": " + stage + " threw " + typeid(e).name() + " (not mixtape::Error): " +
                         echo(e.what(), 300));
    } catch (...) {
      failures.push_back(label + ": " + stage + " threw a non-std exception");
    }
    return false;
  }
};

void report(const Outcome& outcome, const char* test, int count) {
  std::printf("[fuzz] %s: %d mutants, %d loaded, %d refused with mixtape::Error, %zu failures\n", test, count,
              outcome.loaded, outcome.refused, outcome.failures.size());
  for (size_t i = 0; i < outcome.failures.size() && i < 40; ++i) ADD_FAILURE() << outcome.failures[i];
  if (outcome.failures.size() > 40) ADD_FAILURE() << (outcome.failures.size() - 40) << " more failures";
}

// Runs mutants [0, count) (or MIXTAPE_FUZZ_ONLY) of `make` (given the mutant's own random stream and its
// index), each through `run`.
template <class Make, class Run>
void fuzz(const char* test, int count, const Make& make, const Run& run) {
  count = static_cast<int>(env_number("MIXTAPE_FUZZ_COUNT").value_or(count));
  const std::optional<long> only = env_number("MIXTAPE_FUZZ_ONLY");
  const bool trace = env_number("MIXTAPE_FUZZ_TRACE").value_or(0) != 0;
  const uint64_t seed = env_number("MIXTAPE_FUZZ_SEED").value_or(kSeed);
  Outcome outcome;
  int ran = 0;
  for (int i = 0; i < count; ++i) {
    if (only && *only != i) continue;
    Random random = mutant_random(seed, i);
    const Mutant mutant = make(random, i);
    const std::string label = std::string(test) + " seed " + std::to_string(seed) + " mutant " +
                              std::to_string(i) + " (" + mutant.how + ")";
    if (trace) std::printf("[fuzz] %s\n", echo(label, 400).c_str()), std::fflush(stdout);
    if (run(mutant, label, outcome)) ++outcome.loaded;
    else ++outcome.refused;
    ++ran;
  }
  report(outcome, test, ran);
}

// ---- mutations of any text ----
// The tokens of a JSON-like text: strings (with their quotes), numbers and the literals true/false/null.
struct Token {
  size_t begin, end;
  enum Kind { String, Number, Literal } kind;
  bool is_key;  // a string followed by ':'
};

std::vector<Token> tokens_of(const std::string& text) {
  std::vector<Token> tokens;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '"') {
      size_t j = i + 1;
      while (j < text.size() && text[j] != '"') j += text[j] == '\\' ? 2 : 1;
      j = std::min(j + 1, text.size());
      size_t k = j;
      while (k < text.size() && text[k] == ' ') ++k;
      tokens.push_back({i, j, Token::String, k < text.size() && text[k] == ':'});
      i = j;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      size_t j = i + 1;
      while (j < text.size() && std::string_view("0123456789.eE+-").find(text[j]) != std::string_view::npos) ++j;
      tokens.push_back({i, j, Token::Number, false});
      i = j;
    } else if (c == 't' || c == 'f' || c == 'n') {
      size_t j = i;
      while (j < text.size() && text[j] >= 'a' && text[j] <= 'z') ++j;
      tokens.push_back({i, j, Token::Literal, false});
      i = j;
    } else {
      ++i;
    }
  }
  return tokens;
}

// Numbers that stress a reader: out of every range, NaN-ish, fractional, negative, the loss-scale bounds.
const std::vector<std::string> kNastyNumbers = {
    "0", "-0", "-1", "1", "0.5", "1.5", "-1.5", "1e-45", "2.938735877055719e-39", "2.938737278354183e-39",
    "3.4028234663852886e+38", "3.4028235677973366e+38", "1e308", "1e309", "-1e309", "1E400", "1e-400",
    "4294967296", "4294967297", "9007199254740993", "9223372036854775807", "9223372036854775808",
    "-9223372036854775808", "-9223372036854775809", "18446744073709551615", "18446744073709551616",
    "99999999999999999999999999999999", "NaN", "nan", "Infinity", "-inf", "0x10", "01", "1.", "-", "1e", "",
    "1e2", "2e3"};
// The numbers the sweep of a checkpoint's AMP entries sets: the loss-scale bounds, integer range ends, NaN-ish.
const std::vector<std::string> kSweepNumbers = {
    "0", "-1", "0.5", "1e-45", "2.938735877055719e-39", "2.938737278354183e-39", "3.4028235677973366e+38",
    "1e309", "9223372036854775808", "18446744073709551616", "NaN", ""};
// Values of other JSON types.
const std::vector<std::string> kOtherValues = {
    "true", "false", "null", "[]", "{}", "[1]", "{\"a\":1}", "\"\"", "\"x\"", "\"dynamic\"", "\"128.0\"",
    "\" 1e-45 \"", "\"nan\"", "\"inf\"", "\"fp16\"", "\"bf16\"", "\"fp32\"", "\"O2\"", "\"F16\"", "\"F64\"",
    "\"BF16\"", "\"I64\"", "\"U8\"", "\"BOOL\"", "\"\\u0000\"", "\"\\ud800\"", "[-1]", "[0,0]", "[1,0]",
    "[18446744073709551615]", "[4294967296,4294967296]", "[0,18446744073709551615]"};

std::string random_bytes(Random& random, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += static_cast<char>(random.below(256));
  return out;
}

// One textual mutation of `text` in [begin, end) (the part that is JSON), described in `how`.
std::string mutate_text(Random& random, std::string text, size_t begin, size_t end, std::string& how) {
  end = std::min(end, text.size());
  const std::string region = text.substr(begin, end - begin);
  const std::vector<Token> tokens = tokens_of(region);
  const size_t kind = random.below(8);
  auto at = [&] { return begin + random.below(end - begin + 1); };
  if (kind == 0 || tokens.empty()) {  // flip 1..3 bytes
    const size_t n = 1 + random.below(3);
    for (size_t i = 0; i < n && end > begin; ++i) {
      const size_t offset = begin + random.below(end - begin);
      const unsigned char byte = static_cast<unsigned char>(random.below(256));
      how += "flip offset " + std::to_string(offset) + " " + byte_text(static_cast<unsigned char>(text[offset])) +
             " -> " + byte_text(byte) + "; ";
      text[offset] = static_cast<char>(byte);
    }
    return text;
  }
  if (kind == 1) {  // insert bytes
    const size_t offset = at();
    const std::string bytes = random.chance(50) ? random_bytes(random, 1 + random.below(8))
                                                : random.pick(std::vector<std::string>{",", "{", "}", "[", "]", ":",
                                                                                        "\"", "\\", "\\u", "0", " "});
    how += "insert " + std::to_string(bytes.size()) + " bytes at offset " + std::to_string(offset) + " (" +
           echo(bytes) + "); ";
    return text.insert(offset, bytes);
  }
  if (kind == 2) {  // delete a range
    const size_t offset = at();
    const size_t n = std::min<size_t>(1 + random.below(16), end - offset);
    how += "delete " + std::to_string(n) + " bytes at offset " + std::to_string(offset) + "; ";
    return text.erase(offset, n);
  }
  const Token& token = tokens[random.below(tokens.size())];
  const size_t offset = begin + token.begin, length = token.end - token.begin;
  const std::string old = text.substr(offset, length);
  std::string replacement;
  if (kind == 3 || kind == 4) {  // a value token replaced: numbers by numbers, anything by another type
    replacement = token.kind == Token::Number && kind == 3 ? random.pick(kNastyNumbers)
                  : random.chance(50)                      ? random.pick(kNastyNumbers)
                                                           : random.pick(kOtherValues);
  } else if (kind == 5) {  // a number edited in place: a digit more, a sign, a fraction
    replacement = random.pick(std::vector<std::string>{old + "0", old + "000000000000", "-" + old, old + ".5",
                                                       old + "e300", old + "e-300", "1" + old});
  } else if (kind == 6 && token.is_key) {  // a duplicated key, before the original
    replacement = old + ":" + random.pick(random.chance(50) ? kNastyNumbers : kOtherValues) + "," + old;
  } else {  // a string's contents
    replacement = random.pick(std::vector<std::string>{"\"\"", "\"" + random_bytes(random, 4) + "\"",
                                                       "\"" + std::string(5000, 'x') + "\"", "\"a\\\"b\"",
                                                       "\"\\n\\u0001\"", old + old, "\"\\x\""});
  }
  how += "replace token at offset " + std::to_string(offset) + " " + echo(old, 40) + " -> " +
         echo(replacement, 40) + "; ";
  return text.replace(offset, length, replacement);
}

// ---- (1) training checkpoints ----
const std::string& fuzz_text() {
  static const std::string text = [] {
    std::string t;
    for (int i = 0; i < 24; ++i) t += "a fuzzy cat sat. ";
    return t;
  }();
  return text;
}

GPTConfig fuzz_gpt(int64_t vocab) {
  GPTConfig c;
  c.n_layer = 1;
  c.n_head = 2;
  c.n_embd = 8;
  c.block_size = 4;
  c.vocab_size = vocab;
  return c;
}

// A mode per checkpoint base: each family of scaler state and master weights.
const std::vector<std::string> kCheckpointModes = {"fp16_apex:O2", "fp16", "fp16_naive"};

TrainOptions fuzz_options(const std::string& mode) {
  TrainOptions o;
  o.batch = 2;
  o.steps = 4;
  o.lr = 1e-3;
  o.min_lr = 1e-4;
  o.warmup = 1;
  o.optimizer = "adamw";
  o.seed = 3;
  o.amp = mode == "fp16_apex:O2" ? AmpConfig::from_json(R"({"verbosity":0})", mode) : AmpConfig::parse(mode);
  return o;
}

std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("mixtape_fuzz_" + name + "_" + std::to_string(getpid())))
      .string();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

uint64_t le64(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0 && bytes.size() >= 8; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  return n;
}

std::string le64_bytes(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A file rebuilt around a new header, padded with blanks to the old header's alignment (8 bytes).
std::string with_header(const std::string& file, const std::string& header) {
  const uint64_t old = le64(file);
  std::string padded = header;
  while (padded.size() % 8 != 0) padded += ' ';
  return le64_bytes(padded.size()) + padded + file.substr(std::min<size_t>(8 + old, file.size()));
}

// A metadata value made hostile.
std::string nasty_value(Random& random, const std::string& old, std::string& how) {
  if (!old.empty() && (old[0] == '{' || old[0] == '[') && random.chance(50))  // a JSON value: its tokens
    return mutate_text(random, old, 0, old.size(), how);
  std::vector<std::string> values = {"", "nan", "NaN", "inf", "-inf", "1e309", "-1", "0", "-0", "1e-45",
                                     "2.938735877055719e-39", "0.5", "1.5", "18446744073709551616",
                                     "9223372036854775807", "-9223372036854775808", "true", "null", "[]", "{}",
                                     "\n\x01\xff", std::string(100000, '9'), old + "0", "-" + old, old + ".5",
                                     old + " ", " " + old, "0x" + old};
  const std::string value = random.pick(values);
  how += "value " + echo(old, 40) + " -> " + echo(value, 40) + "; ";
  return value;
}

// `text` as JSON, or as a JSON string where it is not JSON by itself ("NaN", "0x10", a lone surrogate).
Json json_or_string(const std::string& text) {
  try {
    return json::parse(text);
  } catch (const Error&) {
    return Json(text);
  }
}

constexpr const char* kPlaceholder = "mixtape-fuzz-placeholder";

// `bytes` as a JSON string literal, escaping only what JSON must: the bytes themselves are kept.
std::string raw_json_string(const std::string& bytes) {
  std::string out = "\"";
  for (const char c : bytes) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned char>(c));
      out += escape;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// One structured edit of the header (valid JSON afterwards): a metadata value, a tensor's entry, a key.
std::optional<std::string> mutate_header(Random& random, const std::string& file, std::string& how) {
  const uint64_t n = le64(file);
  Json header = json::parse(std::string_view(file).substr(8, n));
  Json& metadata = header["__metadata__"];
  std::vector<std::string> tensors, keys;
  for (const auto& [key, value] : header.items())
    if (key != "__metadata__") tensors.push_back(key);
  for (const auto& [key, value] : metadata.items()) keys.push_back(key);
  const size_t kind = random.below(5);
  std::string raw_value;  // a metadata value spliced in as raw bytes (invalid UTF-8 stays invalid)
  if (kind <= 1) {  // a metadata value; half the time one of the loss scalers' or the AMP config's
    std::vector<std::string> amp_keys;
    for (const std::string& key : keys)
      if (key.find("scaler.") != std::string::npos || key.find("amp") != std::string::npos) amp_keys.push_back(key);
    const std::string key = random.pick(random.chance(50) && !amp_keys.empty() ? amp_keys : keys);
    how += "metadata '" + key + "' ";
    raw_value = nasty_value(random, metadata[key].get<std::string>(), how);
    metadata[key] = kPlaceholder;
  } else if (kind == 2) {  // a metadata entry removed or added
    if (random.chance(50)) {
      const std::string key = random.pick(keys);
      how += "metadata '" + key + "' removed; ";
      metadata.erase(key);
    } else {
      const std::string key = random.pick(std::vector<std::string>{"scaler.9.scale", "scaler.0.bogus", "train.x",
                                                                   "amp.x", "", "rng.x.seed", "step"});
      how += "metadata '" + key + "' added; ";
      metadata[key] = "1";
    }
  } else if (kind == 3) {  // a tensor's dtype, shape or offsets
    const std::string name = random.pick(tensors);
    const std::string field = random.pick(std::vector<std::string>{"dtype", "shape", "data_offsets"});
    const std::string value = random.pick(kOtherValues);
    how += "tensor '" + name + "' " + field + " -> " + value + "; ";
    header[name][field] = json_or_string(value);
  } else {  // a tensor renamed, removed or duplicated under another name
    const std::string name = random.pick(tensors);
    const size_t what = random.below(3);
    if (what == 0) {
      how += "tensor '" + name + "' removed; ";
    } else {
      const std::string other = random.pick(tensors);
      const std::string new_name = what == 1 ? name + ".x" : other;
      how += "tensor '" + name + "' copied to '" + new_name + "'; ";
      header[new_name] = header[name];
    }
    if (what != 2) header.erase(name);
  }
  std::string text = json::dump(header);
  if (const size_t at = text.find(std::string("\"") + kPlaceholder + "\""); at != std::string::npos)
    text.replace(at, std::string(kPlaceholder).size() + 2, raw_json_string(raw_value));
  return with_header(file, text);
}

Mutant mutate_checkpoint(Random& random, const std::string& file) {
  Mutant m{file, ""};
  const uint64_t header_end = std::min<uint64_t>(8 + le64(file), file.size());
  const size_t kind = random.below(10);
  if (kind <= 3) {  // the header's text (its tokens, bytes)
    m.how = "header text: ";
    std::string mutated = mutate_text(random, file, 8, header_end, m.how);
    if (random.chance(75)) {  // the length prefix follows the header's new length, else it is stale
      const uint64_t grown = mutated.size() - file.size();
      const std::string prefix = le64_bytes(le64(file) + grown);
      mutated.replace(0, 8, prefix);
    } else {
      m.how += "length prefix kept; ";
    }
    m.bytes = mutated;
  } else if (kind <= 5) {
    m.how = "header edit: ";
    m.bytes = *mutate_header(random, file, m.how);
  } else if (kind == 6) {  // bytes anywhere
    m.how = "file bytes: ";
    m.bytes = mutate_text(random, file, 0, file.size(), m.how);
  } else if (kind == 7) {  // truncated
    const size_t length = random.chance(50) ? random.below(header_end + 1) : random.below(file.size());
    m.how = "truncated to " + std::to_string(length) + " bytes";
    m.bytes = file.substr(0, length);
  } else if (kind == 8) {  // the length prefix
    const uint64_t n = le64(file);
    const uint64_t value = random.pick(std::vector<uint64_t>{0, 1, n - 1, n + 1, n + 8, file.size(), file.size() - 8,
                                                             ~0ull, 1ull << 63, 1ull << 32, 100000000});
    m.how = "length prefix " + std::to_string(n) + " -> " + std::to_string(value);
    m.bytes.replace(0, 8, le64_bytes(value));
  } else {  // a data byte
    const size_t offset = header_end + random.below(file.size() - header_end);
    const unsigned char byte = static_cast<unsigned char>(random.pick(std::vector<int>{0xff, 0x7f, 0x80, 0x00,
                                                                                        0x7c, 0xfc}));
    m.how = "data byte at offset " + std::to_string(offset) + " -> " + byte_text(byte);
    m.bytes[offset] = static_cast<char>(byte);
  }
  return m;
}

void train_step_or_fail(Trainer& trainer, const std::string& label, Outcome& outcome) {
  try {
    trainer.train_step();
  } catch (const Error& e) {
    outcome.failures.push_back(label + ": loaded, but the next step failed: " + echo(e.what(), 300));
  } catch (const std::exception& e) {
    outcome.failures.push_back(label + ": loaded, but the next step threw " + typeid(e).name() + ": " +
                               echo(e.what(), 300));
  }
}

// The checkpoints the mutants start from (one per mode, after one step) and how a mutant is loaded.
struct CheckpointFuzz {
  TokenData data = char_tokens(fuzz_text());
  GPTConfig config = fuzz_gpt(data.vocab_size);
  std::string path = temp_file("checkpoint");
  std::vector<std::string> bases;  // kCheckpointModes' files

  CheckpointFuzz() {
    for (const std::string& mode : kCheckpointModes) {
      Trainer trainer(config, fuzz_options(mode), data);
      trainer.train_step();
      save_safetensors(path, trainer.checkpoint());
      bases.push_back(read_bytes(path));
      Trainer fresh(config, fuzz_options(mode), data);  // the unmutated file loads
      fresh.load_checkpoint(load_safetensors(path));
    }
  }
  ~CheckpointFuzz() { std::filesystem::remove(path); }

  // `mutant.how` starts with the mode of its base. load_model_file reads the model part (and the metadata that
  // describes it) alone: `model_file` false skips it for mutants of the optimizer's entries.
  bool load(const Mutant& mutant, const std::string& label, Outcome& outcome, bool model_file = true) {
    AllowTf32Guard restore_tf32(allow_tf32());  // a mutated train.amp_config may name tf32
    write_bytes(path, mutant.bytes);
    const std::string mode = mutant.how.substr(0, mutant.how.find(' '));
    StateDict state;
    bool ok = outcome.run(label, "load_safetensors", [&] { state = load_safetensors(path); });
    if (ok) {
      std::unique_ptr<Trainer> fresh;
      ok = outcome.run(label, "Trainer::load_checkpoint", [&] {
        fresh = std::make_unique<Trainer>(config, fuzz_options(mode), data);
        fresh->load_checkpoint(state);
      });
      // A checkpoint that loads is one the run can go on from: an Error at its next step means the load let
      // through what cannot work.
      if (ok) train_step_or_fail(*fresh, label, outcome);
    }
    if (model_file) outcome.run(label, "load_model_file", [&] { load_model_file(path); });
    return ok;
  }
};

TEST(Fuzz, MutatedTrainingCheckpointsLoadOrFailWithAnError) {
  CheckpointFuzz checkpoints;
  fuzz(
      "Fuzz.MutatedTrainingCheckpointsLoadOrFailWithAnError", kCheckpointMutants,
      [&](Random& random, int) {
        const size_t base = random.below(checkpoints.bases.size());
        Mutant m = mutate_checkpoint(random, checkpoints.bases[base]);
        m.how = kCheckpointModes[base] + " checkpoint, " + m.how;
        return m;
      },
      [&](const Mutant& mutant, const std::string& label, Outcome& outcome) {
        return checkpoints.load(mutant, label, outcome);
      });
}

// Every metadata entry of the loss scalers and the AMP state ("optimizer.scaler.<k>.*", "optimizer.amp.*",
// "train.amp_config") of each checkpoint, set to each of kSweepNumbers in turn.
TEST(Fuzz, EveryAmpEntryOfACheckpointSetToEachHostileNumberLoadsOrFailsWithAnError) {
  CheckpointFuzz checkpoints;
  struct Edit {
    size_t base;
    std::string key;
  };
  std::vector<Edit> edits;
  for (size_t base = 0; base < checkpoints.bases.size(); ++base) {
    const std::string& file = checkpoints.bases[base];
    const Json header = json::parse(std::string_view(file).substr(8, le64(file)));
    for (const auto& [key, value] : header["__metadata__"].items())
      if (key.find("scaler.") != std::string::npos || key.find("amp") != std::string::npos)
        edits.push_back({base, key});
  }
  const int count = static_cast<int>(edits.size() * kSweepNumbers.size());
  fuzz(
      "Fuzz.EveryAmpEntryOfACheckpointSetToEachHostileNumberLoadsOrFailsWithAnError", count,
      [&](Random&, int index) {
        const size_t i = static_cast<size_t>(index) % static_cast<size_t>(count);  // MIXTAPE_FUZZ_COUNT may say more
        const Edit& edit = edits[i / kSweepNumbers.size()];
        const std::string& value = kSweepNumbers[i % kSweepNumbers.size()];
        const std::string& file = checkpoints.bases[edit.base];
        Json header = json::parse(std::string_view(file).substr(8, le64(file)));
        header["__metadata__"][edit.key] = value;
        return Mutant{with_header(file, json::dump(header)), kCheckpointModes[edit.base] + " checkpoint, metadata '" +
                                                                 edit.key + "' -> " + echo(value)};
      },
      [&](const Mutant& mutant, const std::string& label, Outcome& outcome) {
        return checkpoints.load(mutant, label, outcome, /*model_file=*/false);
      });
}

// ---- (2) --amp-config texts ----
// Every option key of every family, for unknown-key and cross-family mutants.
std::vector<std::string> all_option_keys() {
  std::vector<std::string> keys = {"mixed_precision", "bogus", ""};
  for (std::string_view key : kGradScalerKeys) keys.emplace_back(key);
  for (std::string_view key : kApexKeys) keys.emplace_back(key);
  for (std::string_view key : kNaiveKeys) keys.emplace_back(key);
  return keys;
}

Mutant mutate_amp_config(Random& random, const std::vector<std::string>& bases) {
  const std::string& base = random.pick(bases);
  Mutant m{base, ""};
  const size_t kind = random.below(6);
  if (kind <= 2) {
    m.how = "text: ";
    m.bytes = mutate_text(random, base, 0, base.size(), m.how);
  } else if (kind == 3) {
    const size_t length = random.below(base.size());
    m.how = "truncated to " + std::to_string(length) + " bytes";
    m.bytes = base.substr(0, length);
  } else {  // an option set (any family's key) to a hostile value, the rest valid JSON
    static const std::vector<std::string> keys = all_option_keys();
    Json config = json::parse(base);
    const std::string key = random.pick(keys);
    const std::string value = random.chance(50) ? random.pick(kNastyNumbers) : random.pick(kOtherValues);
    const Json parsed = json_or_string(value);
    if (kind == 5 && random.chance(50)) {
      m.how = "option '" + key + "' removed";
      config.erase(key);
    } else {
      m.how = "option '" + key + "' -> " + json::dump(parsed);
      config[key] = parsed;
    }
    m.bytes = json::dump(config);
  }
  m.how = echo(base, 60) + ": " + m.how;
  return m;
}

// One training step of a Linear(4, 2) through the booster of `config`. The tf32 modes switch tf32 matmuls on
// process-wide when they boost: the switch is restored for the tests that follow.
void boost_and_step(const AmpConfig& config) {
  AllowTf32Guard restore_tf32(allow_tf32());
  Booster booster(config);
  Linear model(4, 2, true, 5);
  auto sgd = std::make_unique<SGD>(model.parameters(), 0.01);
  BoostOptions options;
  options.print_verbose = false;
  auto optimizer = booster.boost(model, std::move(sgd), options);
  const Tensor x = Tensor::from_vector(std::vector<float>{0.5f, -1, 0.25f, 2, 1, 1, -0.5f, 0.75f}, {2, 4});
  for (int loss_id = 0; loss_id < optimizer->num_losses(); ++loss_id) {
    const Tensor loss = booster.forward(
        [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{sum(model(in[0]).to(DType::F32))}; },
        {x})[0];
    booster.backward(loss, *optimizer, loss_id);
  }
  booster.step(*optimizer);
}

TEST(Fuzz, MutatedAmpConfigsParseOrFailWithAnErrorAndTrainWhenAccepted) {
  const bool tf32_before = allow_tf32();
  std::vector<std::string> bases;
  for (const std::string& name : precision_mode_names(kApexOptLevels))
    bases.push_back(AmpConfig::parse(name).to_json());
  bases.push_back(R"({"mixed_precision":"fp16_apex","opt_level":"O2","loss_scale":"128.0","num_losses":2})");
  bases.push_back(R"({"mixed_precision":"fp16_naive","initial_scale":65536,"min_scale":1,"hysteresis":3})");
  fuzz(
      "Fuzz.MutatedAmpConfigsParseOrFailWithAnErrorAndTrainWhenAccepted", kAmpConfigMutants,
      [&](Random& random, int) { return mutate_amp_config(random, bases); },
      [&](const Mutant& mutant, const std::string& label, Outcome& outcome) {
        AmpConfig config;
        if (!outcome.run(label, "AmpConfig::from_json", [&] { config = AmpConfig::from_json(mutant.bytes); }))
          return false;
        // An accepted config is one the run can use: its text form reads back as itself, and a step trains
        // (an Error there is a failure too: validation let through a config that cannot work).
        outcome.run(label, "to_json round trip", [&] {
          const std::string text = config.to_json();
          if (AmpConfig::from_json(text).to_json() != text)
            outcome.failures.push_back(label + ": to_json " + echo(text, 300) + " does not read back as itself");
        });
        try {
          boost_and_step(config);
        } catch (const Error& e) {
          // The one check that needs the model: an fp8 exclude entry must name one of its Linear modules.
          if (std::string(e.what()).find("names no Linear module") != std::string::npos) return true;
          outcome.failures.push_back(label + ": accepted, but its first step failed: " + echo(e.what(), 300));
        } catch (const std::exception& e) {
          outcome.failures.push_back(label + ": accepted, but its first step threw " + typeid(e).name() + ": " +
                                     echo(e.what(), 300));
        }
        return true;
      });
  EXPECT_EQ(allow_tf32(), tf32_before) << "the fuzz leaves the process-wide tf32 switch as it found it";
}

}  // namespace
}  // namespace mixtape
