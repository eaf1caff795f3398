// bench_gpu_train: the GPT-2 small training step on a CUDA device under each precision mode, timed with CUDA
// events (DeviceTimer), with MFU, peak memory, the GradScaler overhead and (with --pytorch) the same model in
// PyTorch (bench/pytorch_gpu_train_step.py, run as a child process in the same job).
//
//   ./build/bench/bench_gpu_train                                  # GPT-2 small, every mode but Apex's
//   ./build/bench/bench_gpu_train --pytorch --json gpu_train.json  # plus PyTorch eager / torch.compile
//   ./build/bench/bench_gpu_train --modes bf16,fp16 --warmup 5 --steps 50
//   ./build/bench/bench_gpu_train --layers 2 --block 256 --batch 4 --steps 3 --modes fp32   # a quick check
//   ./build/bench/bench_gpu_train --cpu --layers 2 --heads 2 --width 64 --block 64 --vocab 256 --batch 4
//       --warmup 1 --steps 3 --json /tmp/t.json   # checks this program itself on the CPU (no GPU needed)
//
// Model: GPTConfig's defaults = GPT-2 small as nanoGPT trains it: 12 layers, 12 heads, width 768, block 1024,
// vocab 50304, layernorm with bias, exact GELU, tied embeddings, no dropout; batch 16 (16384 tokens/step).
// --layers --heads --width --block --vocab --batch override each.
//
// A step is Trainer::train_step() on Device::cuda(--device): the batch (Trainer's random sampling over an
// in-memory stream of uniform random tokens; the cost of a step does not depend on the token values) copied
// to the GPU, forward, fused cross-entropy, backward, global gradient clipping at norm 1, AdamW (weight decay
// 0.1 on matrices and embeddings, constant lr), under TrainOptions::amp = AmpConfig::parse(mode): the mode's
// casts, loss scaling, overflow check and master-weight update included. The step syncs with the host (the
// logged loss, the gradient norm), as in train_gpt.
//
// Timing: every mode runs alone, one after the other (its Trainer is destroyed and the allocator's cache
// emptied before the next, so each mode's peak memory is its own): --warmup steps (default 3; when one of
// them was skipped by a loss scaler, the warm-up goes on, up to 200 more steps, until 5 consecutive steps
// were not, so the timed steps do not include the scaler's initial back-off: a skipped step does no update;
// skipped timed steps are counted and printed),
// then the device's peak-memory counter is reset, then --steps steps (default 20), each timed by CUDA events
// on the backend's stream around train_step() (the device is idle when a step starts: the previous one ended
// with a wait). Reported: the median and best step, tokens/s of the median, peak memory = the allocator's
// peak_allocated_bytes over the timed steps (live tensors: weights, optimizer state, activations; not the
// allocator's cache, not cuBLAS workspaces, not the CUDA context).
//
// MFU (model FLOPs utilisation) = model FLOPs per step / median step time / the device's dense peak for the
// mode's matmul dtype, with
//   model FLOPs per step = 6 * N * B * T  +  6 * L * B * T^2 * C
//     N = parameters excluding the position embedding (nanoGPT's get_num_params(non_embedding=True)):
//         V*C + L*(12*C^2 + 13*C) + 2*C; the tied wte is counted once, as the lm_head matmul's weight.
//         6*N per token = 2 (multiply-add) * 3 (forward, backward for inputs, backward for weights).
//     attention scores and weighted sum (q k^T and p v, 2 * 2*T*C FLOP per token per layer forward, x3 for
//         forward + backward = 12*L*T*C per token, the PaLM paper's term), halved because a causal mask
//         leaves half the score matrix to compute: 6 * L * B * T^2 * C per step.
//   The column "MFU nanoGPT" uses nanoGPT's estimate_mfu formula instead (6*N + 12*L*T*C per token: the
//   attention term not halved), for comparison with figures quoted from nanoGPT / llm.c-style logs.
//   Recomputation is not counted (mixtape's attention backward recomputes the probabilities: hardware FLOPs
//   exceed model FLOPs).
//   Peaks (dense, TFLOP/s), by cuda_device_name substring: the mode's dtype is fp16/bf16 when it autocasts or
//   casts the model to 16 bits, tf32 when it leaves allow_tf32 on, else fp32:
//     H100 SXM (and H200):    bf16/fp16 989.4   tf32 494.7   fp32 66.9
//     H100 PCIe:              756               378          51
//     H100 NVL / H200 NVL:    835.5             417.5        60
//     A100:                   312               156          19.5
//   --peak-tflops X uses X for every mode; an unknown device without it prints MFU as n/a.
//
// Summary lines: "fp16 (GradScaler) vs bf16 (no scaler)" = median fp16 / median bf16 - 1 (the cost of the
// loss scaling: scaled backward, unscale + finite check; target <= 3 %); with --pytorch, mixtape bf16 vs
// PyTorch eager bf16 autocast and vs torch.compile bf16 autocast (ratio = PyTorch's median / mixtape's: > 1
// means mixtape is faster), and each mixtape mode vs the PyTorch eager run of the same precision. Each fp8 /
// block-scaled mode (fp8, fp8_delayed on the fp8 tensor cores; fp8_rowwise, fp8_block, mxfp8, nvfp4 emulated:
// tensor/cuda/fp8.cu) is set against mixtape bf16's tokens/s, with the goal of >= 1.3x; --pytorch's eager_fp8
// is PyTorch's tensorwise fp8 training (torchao's Float8Linear, or torch._scaled_mm where torchao is missing),
// the counterpart of fp8 and fp8_delayed.
//
// --json FILE writes every figure (and each mode's step times) as one JSON object. Without a CUDA device the
// program prints why and exits with status 77 (CTest's skip code).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_training.h"
#include "train/training.h"
#include "io/json.h"
#include "tensor/backend.h"
#include "tensor/precision.h"
#include "tensor/timer.h"

using namespace mixtape;

namespace {

using bench::is_low_precision;
using bench::median;
using bench::random_tokens;

constexpr double kScalerOverheadTarget = 0.03;  // fp16 + GradScaler at most 3 % slower than bf16
constexpr int kMaxExtraWarmup = 200;            // loss-scaler back-off steps allowed beyond --warmup
constexpr int kCleanSteps = 5;                  // ... until this many consecutive steps were not skipped

// Every precision mode outside the Apex family (whose O1 is PyTorch's fp16 and whose O2 is fp16_naive with fp32
// norm layers: nothing a GPU step time tells apart from those).
std::vector<std::string> default_modes() {
  std::vector<std::string> modes;
  for (const PrecisionModeRow& row : kPrecisionModes)
    if (row.family != ModeFamily::Apex) modes.emplace_back(row.name);
  return modes;
}

struct Options {
  int64_t layers = 12, heads = 12, width = 768, block = 1024, vocab = 50304, batch = 16;
  std::vector<std::string> modes = default_modes();
  int warmup = 3, steps = 20, device = 0;
  bool cpu = false;  // --cpu: a functional check of this program on the CPU (tiny models), not a benchmark
  bool pytorch = false;
  std::string pytorch_modes = "eager_fp32,eager_tf32,eager_bf16,eager_fp16,compile_bf16,eager_fp8";
  std::string pytorch_attention = "sdpa";
  std::string pytorch_adamw = "fused";
  std::string json_path;
  double peak_tflops = 0;  // 0: from the device table
  int64_t tokens_per_step() const { return batch * block; }
};

// ---- FLOPs and device peaks -------------------------------------------------------------------------------

// Parameters without the position embedding (see the header): GPTConfig's defaults (bias, tied embeddings,
// GELU MLP of width 4C).
double non_embedding_params(const Options& o) {
  const double C = double(o.width), L = double(o.layers), V = double(o.vocab);
  return V * C + L * (12 * C * C + 13 * C) + 2 * C;
}

// Model FLOPs of one step; nanogpt = true: nanoGPT's estimate_mfu (attention term not halved for causal).
double flops_per_step(const Options& o, bool nanogpt) {
  const double B = double(o.batch), T = double(o.block), C = double(o.width), L = double(o.layers);
  const double dense = 6 * non_embedding_params(o) * B * T;
  const double attention = 12 * L * B * T * T * C;  // forward + backward of q k^T and p v, full square
  return dense + (nanogpt ? attention : attention / 2);
}

enum class PeakClass { Fp32, Tf32, Half };
const char* to_string(PeakClass c) {
  return c == PeakClass::Half ? "fp16/bf16" : c == PeakClass::Tf32 ? "tf32" : "fp32";
}

struct DevicePeaks {
  const char* match;  // substring of cuda_device_name
  const char* label;
  double half, tf32, fp32;  // dense TFLOP/s
};
// More specific names first (an "H100 PCIe" also contains "H100").
const DevicePeaks kPeaks[] = {
    {"H100 PCIe", "H100 PCIe", 756.0, 378.0, 51.0},   {"H100 NVL", "H100 NVL", 835.5, 417.5, 60.0},
    {"H200 NVL", "H200 NVL", 835.5, 417.5, 60.0},     {"H100", "H100 SXM", 989.4, 494.7, 66.9},
    {"H200", "H200 (as H100 SXM)", 989.4, 494.7, 66.9}, {"A100", "A100", 312.0, 156.0, 19.5},
};

const DevicePeaks* find_peaks(const std::string& name) {
  for (const DevicePeaks& p : kPeaks)
    if (name.find(p.match) != std::string::npos) return &p;
  return nullptr;
}

// TFLOP/s for a class; NaN when unknown.
double peak_tflops(const Options& o, const DevicePeaks* peaks, PeakClass c) {
  if (o.peak_tflops > 0) return o.peak_tflops;
  if (!peaks) return NAN;
  return c == PeakClass::Half ? peaks->half : c == PeakClass::Tf32 ? peaks->tf32 : peaks->fp32;
}

// ---- the mixtape side -------------------------------------------------------------------------------------

struct Result {
  std::string name;  // "mixtape bf16", "PyTorch eager_bf16"
  std::string mode;  // the mode as given
  std::vector<double> ms;
  double peak_bytes = NAN;
  PeakClass peak_class = PeakClass::Fp32;
  int64_t skipped = 0;  // timed steps skipped by the loss scaler
  int64_t extra_warmup = 0;
  std::string error;  // non-empty: the mode did not run
  std::string detail;  // PyTorch: its settings
};

double best(const std::vector<double>& v) { return v.empty() ? NAN : *std::min_element(v.begin(), v.end()); }

Result run_mixtape(const Options& o, const std::string& mode, const TokenData& data) {
  Result r;
  r.name = "mixtape " + mode;
  r.mode = mode;
  const Device device = o.cpu ? Device::cpu() : Device::cuda(o.device);
  try {
    const bench::BenchModel model{.layers = o.layers, .heads = o.heads, .width = o.width, .block = o.block,
                                  .vocab = o.vocab, .batch = o.batch};
    set_allow_tf32(false);
    auto trainer = bench::make_trainer(model, mode, 1e-4, device, data);
    // Building a tf32 trainer turns tf32 on process-wide: that is what decides the mode's peak.
    // The fp8 modes' MFU is taken against the bf16 peak (the rest of their step runs in bf16).
    const AmpConfig amp = AmpConfig::parse(mode);
    r.peak_class = is_low_precision(amp) || amp.quantizes_gemms() ? PeakClass::Half
                   : allow_tf32()                                ? PeakClass::Tf32
                                                                 : PeakClass::Fp32;

    // Dynamic loss scalers start high (naive AMP at 2^32) and back off through skipped steps: once a warm-up
    // step was skipped, the warm-up goes on until kCleanSteps consecutive steps were not, so the timed steps
    // are steady-state steps.
    int clean = 0;
    bool any_skipped = false;
    for (int i = 0; i < o.warmup; ++i) {
      const bool skipped = trainer->train_step().skipped;
      any_skipped = any_skipped || skipped;
      clean = skipped ? 0 : clean + 1;
    }
    while (any_skipped && clean < kCleanSteps && r.extra_warmup < kMaxExtraWarmup) {
      clean = trainer->train_step().skipped ? 0 : clean + 1;
      ++r.extra_warmup;
    }

    synchronize(device);
    backend_for(device).reset_peak_memory_stats();
    DeviceTimer timer(device);
    for (int i = 0; i < o.steps; ++i) {
      timer.start();
      const StepStats s = trainer->train_step();
      timer.stop();
      r.ms.push_back(timer.seconds() * 1e3);
      if (s.skipped) ++r.skipped;
    }
    r.peak_bytes = double(memory_stats(device).peak_allocated_bytes);
  } catch (const std::exception& e) {
    r.error = e.what();
    r.ms.clear();
  }
  set_allow_tf32(false);
  try {
    synchronize(device);
    backend_for(device).empty_cache();  // the next mode (and PyTorch) gets the memory
  } catch (const std::exception& e) {
    if (r.error.empty()) r.error = e.what();
  }
  return r;
}

// ---- the PyTorch side -------------------------------------------------------------------------------------

// Runs bench/pytorch_gpu_train_step.py; one Result per JSON line it prints. `why` is set when nothing ran.
std::vector<Result> run_pytorch(const Options& o, std::string& version, std::string& why) {
  std::ostringstream command;
  command << "python3 " << MIXTAPE_SOURCE_DIR << "/bench/pytorch_gpu_train_step.py --layers " << o.layers
          << " --heads " << o.heads << " --width " << o.width << " --block " << o.block << " --vocab " << o.vocab
          << " --batch " << o.batch << " --warmup " << o.warmup << " --steps " << o.steps << " --device "
          << o.device << " --modes " << o.pytorch_modes << " --attention " << o.pytorch_attention
          << " --adamw " << o.pytorch_adamw << " 2>&1";
  std::fprintf(stderr, "running %s\n", command.str().c_str());
  std::string out;
  int status = 0;
  if (!bench::run_command(command.str(), out, status)) {
    why = "cannot start python3";
    return {};
  }
  if (status != 0) {
    why = bench::exited_with(status, 77) ? "skipped by the script:\n" + out
                                         : "the PyTorch script failed:\n" + out;
    return {};
  }
  std::vector<Result> results;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] != '{') continue;
    try {
      const Json v = json::parse(line);
      Result r;
      const Json* mode = json::find(v, "mode");
      check(mode != nullptr, "no \"mode\" key");
      r.mode = json::as_string(*mode);
      r.name = "PyTorch " + r.mode;
      if (const Json* t = json::find(v, "torch")) version = json::as_string(*t);
      if (const Json* e = json::find(v, "error")) {
        r.error = json::as_string(*e);
      } else {
        const Json* step_ms = json::find(v, "step_ms");
        check(step_ms != nullptr, "no \"step_ms\" key");
        for (const Json& t : json::as_array(*step_ms)) r.ms.push_back(json::as_number(t));
        if (const Json* p = json::find(v, "peak_bytes")) r.peak_bytes = json::as_number(*p);
        if (const Json* k = json::find(v, "skipped_steps")) r.skipped = int64_t(json::as_number(*k));
      }
      const std::string m = r.mode;
      r.peak_class = m.find("fp32") != std::string::npos   ? PeakClass::Fp32
                     : m.find("tf32") != std::string::npos ? PeakClass::Tf32
                                                           : PeakClass::Half;
      std::string detail;
      for (const char* key : {"attention", "adamw", "grad_scaler", "fp8"})
        if (const Json* d = json::find(v, key))
          detail += std::string(detail.empty() ? "" : ", ") + key + " " + json::dump(*d);
      r.detail = detail;
      results.push_back(std::move(r));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_gpu_train: cannot read a line of the PyTorch script (%s): %s\n", e.what(),
                   line.c_str());
    }
  }
  if (results.empty()) why = "the PyTorch script printed no result:\n" + out;
  return results;
}

// ---- report -----------------------------------------------------------------------------------------------

const Result* find_result(const std::vector<Result>& results, const std::string& name) {
  for (const Result& r : results)
    if (r.name == name && r.error.empty() && !r.ms.empty()) return &r;
  return nullptr;
}

// The PyTorch eager mode of the same precision as a mixtape mode ("" when there is none).
std::string pytorch_counterpart(const std::string& mode) {
  const AmpConfig amp = AmpConfig::parse(mode);
  const ModeFamily family = amp.family();
  if (family == ModeFamily::Plain || family == ModeFamily::PytorchAmp) return "PyTorch eager_" + mode;
  // PyTorch's tensorwise fp8 (torchao's Float8Linear or torch._scaled_mm): the recipe of fp8 and fp8_delayed.
  if (mode == "fp8" || mode == "fp8_delayed") return "PyTorch eager_fp8";
  return "";
}

constexpr double kFp8SpeedupGoal = 1.3;  // an fp8 mode's tokens/s at least 1.3x mixtape bf16's

std::string cell(double x, const char* format) {
  if (std::isnan(x)) return "n/a";
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), format, x);
  return buffer;
}

// JSON has no NaN: an unknown figure is null.
Json number(double x) { return std::isnan(x) ? Json() : Json(x); }

std::vector<std::string> split_list(const std::string& text, const char* what) {
  std::vector<std::string> items;
  std::string item;
  std::istringstream in(text);
  while (std::getline(in, item, ',')) items.push_back(item);
  check(!items.empty() && !text.empty() && text.back() != ',', "bench_gpu_train: ", what, " '", text,
        "' is not a comma-separated list");
  for (const std::string& m : items) {
    check(!m.empty(), "bench_gpu_train: ", what, " '", text, "' has an empty entry");
    check(std::count(items.begin(), items.end(), m) == 1, "bench_gpu_train: ", what, " names '", m, "' twice");
  }
  return items;
}

void usage() {
  std::fprintf(stderr,
               "usage: bench_gpu_train [--layers N] [--heads N] [--width N] [--block N] [--vocab N] [--batch N]\n"
               "         [--modes MODE,... (default: every mode but fp16_apex)] [--warmup N] [--steps N] [--device N]\n"
               "         [--peak-tflops X] [--json FILE] [--pytorch] [--pytorch-modes "
               "eager_fp32,eager_tf32,eager_bf16,eager_fp16,compile_bf16,eager_fp8]\n"
               "         [--pytorch-attention sdpa|math] [--pytorch-adamw fused|foreach|single]\n"
               "         [--cpu]   (a functional check of this program on the CPU with a tiny model)\n");
}

int run(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    auto integer = [&](int64_t& field) {
      field = std::atoll(argv[++i]);
      check(field > 0, "bench_gpu_train: ", a, " must be a positive integer, got '", argv[i], "'");
    };
    if (!has_value && a != "--pytorch" && a != "--cpu" && a != "--help" && a != "-h") {
      std::fprintf(stderr, "bench_gpu_train: %s needs a value\n", a.c_str());
      usage();
      return 2;
    }
    if (a == "--layers") integer(o.layers);
    else if (a == "--heads") integer(o.heads);
    else if (a == "--width") integer(o.width);
    else if (a == "--block") integer(o.block);
    else if (a == "--vocab") integer(o.vocab);
    else if (a == "--batch") integer(o.batch);
    else if (a == "--modes") {
      o.modes = split_list(argv[++i], "--modes");
      for (const std::string& m : o.modes) AmpConfig::parse(m);  // Error naming an unknown mode
    } else if (a == "--warmup") o.warmup = std::max(0, std::atoi(argv[++i]));
    else if (a == "--steps") o.steps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--device") o.device = std::max(0, std::atoi(argv[++i]));
    else if (a == "--peak-tflops") {
      o.peak_tflops = std::atof(argv[++i]);
      check(o.peak_tflops > 0, "bench_gpu_train: --peak-tflops must be > 0, got '", argv[i], "'");
    } else if (a == "--json") o.json_path = argv[++i];
    else if (a == "--pytorch") o.pytorch = true;
    else if (a == "--cpu") o.cpu = true;
    else if (a == "--pytorch-modes") {
      split_list(argv[++i], "--pytorch-modes");
      o.pytorch_modes = argv[i];
    } else if (a == "--pytorch-attention") o.pytorch_attention = argv[++i];
    else if (a == "--pytorch-adamw") o.pytorch_adamw = argv[++i];
    else {
      if (a != "--help" && a != "-h") std::fprintf(stderr, "bench_gpu_train: unknown option %s\n", a.c_str());
      usage();
      return 2;
    }
  }
  check(o.width % o.heads == 0, "bench_gpu_train: --width must be a multiple of --heads");

  const int count = cuda_device_count();
  if (count == 0 && !o.cpu) {
    std::printf("bench_gpu_train: SKIPPED: no CUDA device (this program times training on a GPU; "
                "bench_train_gpt is the CPU benchmark)\n");
    return 77;
  }
  check(o.cpu || o.device < count, "bench_gpu_train: --device ", o.device, " but this machine has ", count,
        " CUDA device(s)");
  const std::string device_name = o.cpu ? std::string("cpu") : cuda_device_name(o.device);
  const DevicePeaks* peaks = find_peaks(device_name);

  // Enough tokens that the batches do not repeat much; the values do not matter.
  const TokenData data = random_tokens(o.vocab, std::max<int64_t>(1 << 22, 4 * o.tokens_per_step()));

  std::vector<Result> results;
  for (const std::string& mode : o.modes) {
    std::fprintf(stderr, "mixtape %s ...\n", mode.c_str());
    results.push_back(run_mixtape(o, mode, data));
    const Result& r = results.back();
    if (!r.error.empty()) std::fprintf(stderr, "  failed: %s\n", r.error.c_str());
    else std::fprintf(stderr, "  median %.2f ms/step\n", median(r.ms));
  }
  std::string version, why;
  if (o.pytorch) {
    const std::vector<Result> torch_results = run_pytorch(o, version, why);
    results.insert(results.end(), torch_results.begin(), torch_results.end());
  }

  // ---- the table
  const double tokens = double(o.tokens_per_step());
  const double flops = flops_per_step(o, false), flops_nanogpt = flops_per_step(o, true);
  std::printf("\nGPT training step on %s (%s): %lld layers, %lld heads, width %lld, block %lld, vocab %lld, "
              "batch %lld (%lld tokens/step); %d warm-up + %d timed steps per mode, timed by %s\n",
              device_name.c_str(), o.cpu ? "cpu" : ("cuda:" + std::to_string(o.device)).c_str(), (long long)o.layers,
              (long long)o.heads, (long long)o.width, (long long)o.block, (long long)o.vocab, (long long)o.batch,
              (long long)o.tokens_per_step(),
              o.warmup, o.steps, o.cpu ? "the host clock" : "CUDA events");
  std::printf("N = %.2fM parameters without wpe; model FLOPs/step = 6*N*B*T + 6*L*B*T^2*C (causal attention "
              "counted half) = %.4g TFLOP (nanoGPT's 6*N*B*T + 12*L*B*T^2*C = %.4g TFLOP)\n",
              non_embedding_params(o) / 1e6, flops / 1e12, flops_nanogpt / 1e12);
  if (o.peak_tflops > 0)
    std::printf("peak: %.1f TFLOP/s for every mode (--peak-tflops)\n", o.peak_tflops);
  else if (peaks)
    std::printf("peak (dense, TFLOP/s) for %s: fp16/bf16 %.1f, tf32 %.1f, fp32 %.1f\n", peaks->label, peaks->half,
                peaks->tf32, peaks->fp32);
  else
    std::printf("peak: unknown device '%s' (MFU n/a; give --peak-tflops X)\n", device_name.c_str());
  if (!version.empty()) std::printf("PyTorch %s\n", version.c_str());

  std::printf("\n%-26s %9s %9s %11s %7s %9s %8s %9s %10s\n", "", "median", "best", "tokens/s", "MFU", "MFU",
              "peak", "peak mem", "vs PyTorch");
  std::printf("%-26s %9s %9s %11s %7s %9s %8s %9s %10s\n", "", "ms/step", "ms/step", "(median)", "", "nanoGPT",
              "dtype", "GiB", "same prec.");
  Json json_rows = Json::array();
  for (const Result& r : results) {
    if (!r.error.empty() || r.ms.empty()) {
      std::printf("%-26s error: %s\n", r.name.c_str(), r.error.substr(0, 200).c_str());
      json_rows.push_back(Json::object({{"name", r.name}, {"mode", r.mode}, {"error", r.error}}));
      continue;
    }
    const double m = median(r.ms), b = best(r.ms);
    const double peak = peak_tflops(o, peaks, r.peak_class) * 1e12;
    const double mfu = flops / (m * 1e-3) / peak, mfu_nanogpt = flops_nanogpt / (m * 1e-3) / peak;
    double vs = NAN;
    if (r.name.rfind("mixtape ", 0) == 0) {
      const std::string other = pytorch_counterpart(r.mode);
      if (const Result* t = other.empty() ? nullptr : find_result(results, other)) vs = median(t->ms) / m;
    }
    std::printf("%-26s %9.2f %9.2f %11.0f %7s %9s %8s %9s %10s\n", r.name.c_str(), m, b, tokens / m * 1e3,
                cell(mfu * 100, "%.1f%%").c_str(), cell(mfu_nanogpt * 100, "%.1f%%").c_str(), to_string(r.peak_class),
                cell(r.peak_bytes / double(1 << 30), "%.2f").c_str(), cell(vs, "%.2fx").c_str());
    if (r.skipped > 0 || r.extra_warmup > 0)
      std::printf("%-26s   (loss scaler: %lld extra warm-up steps, %lld of %d timed steps skipped)\n", "",
                  (long long)r.extra_warmup, (long long)r.skipped, o.steps);
    if (!r.detail.empty()) std::printf("%-26s   (%s)\n", "", r.detail.c_str());
    Json step_ms = Json::array();
    for (double t : r.ms) step_ms.push_back(t);
    json_rows.push_back(Json::object({
        {"name", r.name}, {"mode", r.mode}, {"median_ms", m}, {"best_ms", b}, {"tokens_per_s", tokens / m * 1e3},
        {"mfu", number(mfu)}, {"mfu_nanogpt", number(mfu_nanogpt)}, {"peak_dtype", to_string(r.peak_class)},
        {"peak_allocated_bytes", number(r.peak_bytes)},
        {"skipped_steps", r.skipped}, {"extra_warmup_steps", r.extra_warmup}, {"step_ms", step_ms}}));
  }
  std::printf("(vs PyTorch same prec. = the PyTorch eager run of the same precision's median / this row's: "
              "> 1 means mixtape is faster)\n");
  if (o.pytorch && !why.empty()) std::printf("PyTorch: not measured: %s\n", why.c_str());

  // ---- the summary lines
  std::printf("\n");
  Json summary = Json::object();
  const Result* fp16 = find_result(results, "mixtape fp16");
  const Result* bf16 = find_result(results, "mixtape bf16");
  if (fp16 && bf16) {
    const double overhead = median(fp16->ms) / median(bf16->ms) - 1;
    std::printf("fp16 (GradScaler) vs bf16 (no scaler): %+.1f%% step time (target <= +%.0f%%): %s\n",
                overhead * 100, kScalerOverheadTarget * 100, overhead <= kScalerOverheadTarget ? "met" : "NOT met");
    summary.emplace("fp16_vs_bf16_overhead", overhead);
  } else {
    std::printf("fp16 (GradScaler) vs bf16 (no scaler): n/a (needs fp16 and bf16 in --modes, both run)\n");
  }
  for (const char* other : {"PyTorch eager_bf16", "PyTorch compile_bf16"}) {
    const Result* t = find_result(results, other);
    if (bf16 && t) {
      const double x = median(t->ms) / median(bf16->ms);
      std::printf("mixtape bf16 vs %s autocast: %.2fx tokens/s (%s)\n", other, x,
                  x >= 1 ? "mixtape faster" : "PyTorch faster");
      summary.emplace(std::string("mixtape_bf16_vs_") + (other + 8), x);
    } else if (o.pytorch) {
      std::printf("mixtape bf16 vs %s autocast: n/a (one side did not run)\n", other);
    }
  }
  // Each fp8 / block-scaled mode against mixtape bf16 (the same step with every GEMM in bf16).
  for (const Result& r : results) {
    if (r.name.rfind("mixtape ", 0) != 0 || !r.error.empty() || r.ms.empty() ||
        !AmpConfig::parse(r.mode).quantizes_gemms())
      continue;
    if (!bf16) {
      std::printf("mixtape %s vs mixtape bf16: n/a (needs bf16 in --modes, run)\n", r.mode.c_str());
      continue;
    }
    const double x = median(bf16->ms) / median(r.ms);
    std::printf("mixtape %s vs mixtape bf16: %.2fx tokens/s (goal >= %.1fx: %s)\n", r.mode.c_str(), x,
                kFp8SpeedupGoal, x >= kFp8SpeedupGoal ? "met" : "NOT met");
    summary.emplace("mixtape_" + r.mode + "_vs_bf16", x);
  }
  if (const Result* t = find_result(results, "PyTorch eager_fp8"); t && bf16)
    std::printf("PyTorch eager_fp8 vs mixtape bf16: %.2fx tokens/s\n", median(bf16->ms) / median(t->ms));
  if (!o.pytorch) std::printf("(--pytorch adds PyTorch eager and torch.compile to the comparison)\n");

  if (!o.json_path.empty()) {
    const Json config = Json::object({{"layers", o.layers}, {"heads", o.heads}, {"width", o.width},
                                      {"block", o.block}, {"vocab", o.vocab}, {"batch", o.batch},
                                      {"warmup", int64_t{o.warmup}}, {"steps", int64_t{o.steps}}});
    const Json doc = Json::object({
        {"device", device_name},
        {"config", config},
        {"non_embedding_params", non_embedding_params(o)},
        {"flops_per_step", flops},
        {"flops_per_step_nanogpt", flops_nanogpt},
        {"flops_formula", "6*N*B*T + 6*L*B*T^2*C (N without wpe; causal attention counted half)"},
        {"peak_tflops", Json::object({{"fp16_bf16", number(peak_tflops(o, peaks, PeakClass::Half))},
                                      {"tf32", number(peak_tflops(o, peaks, PeakClass::Tf32))},
                                      {"fp32", number(peak_tflops(o, peaks, PeakClass::Fp32))}})},
        {"torch", version},
        {"results", json_rows},
        {"summary", summary}});
    std::ofstream out(o.json_path);
    check(bool(out), "bench_gpu_train: cannot write ", o.json_path);
    out << json::dump(doc) << "\n";
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_train: %s\n", e.what());
    return 1;
  }
}
