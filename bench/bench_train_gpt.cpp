// bench_train_gpt: the end-to-end training step of a GPT (4 layers, 4 heads, width 256,
// block 128, batch 16, vocab 65) under each precision mode, in mixtape and in PyTorch, timed in the same run.
//
//   ./build/bench/bench_train_gpt                    # Google Benchmark rows, then the comparison table
//   ./build/bench/bench_train_gpt --compare-only --rounds 5 --steps 10 --precision fp32,bf16
//   ./build/bench/bench_train_gpt --rounds 1 --steps 2 --no-pytorch     # a quick functional check
//   ./build/bench/bench_train_gpt --compare-only --precision bf16 --no-pytorch --phases  # where a step goes
//   ./build/bench/bench_train_gpt --compare-only --precision bf16 --gemms  # the GEMMs of both sides
//
// A step is what train_gpt does per step: forward, fused cross-entropy, backward, global gradient clipping
// at norm 1, AdamW (weight decay 0.1 on matrices and embeddings), on a random batch (the Trainer's own
// sampling over a random token stream: the cost of a step does not depend on the token values). Each mixtape
// mode (--precision a,b,c; default every mode of amp/precision_mode.h, Apex's at O2) is its own Trainer
// with TrainOptions::amp = AmpConfig::parse(mode), so a step includes the mode's casts, loss scaling,
// overflow check and master-weight update. tf32 is a process-wide switch (tensor/precision.h) that building
// a tf32 trainer turns on: it is set to the mode's tf32_matmuls before every step, so it never leaks into
// another mode.
//
// The PyTorch side is bench/pytorch_train_step.py (the same model as tests/pytorch_parity.py, torch threads =
// this process's OpenMP threads), run as a child process, once in fp32 and once under bf16 autocast
// (torch.autocast("cpu", dtype=torch.bfloat16) around forward + loss, no GradScaler: PyTorch's CPU AMP). The
// comparison runs in rounds: the mixtape modes' steps of a round interleaved in cycles (one step of every
// mode, the first mode rotating from cycle to cycle), then both PyTorch runs, so a burst of load from another
// process on a shared machine hits every side; each side's figure is the median of all its timed steps (first
// steps of each side excluded as warm-up), and the table also shows the best step. --blocked runs each mode's
// steps of a round in one block instead: two modes' medians then come from
// windows seconds apart, and a mode-against-fp32 ratio carries the machine's drift between them. A ratio "vs X"
// is X's median ms/step / the row's median ms/step = the row's tokens/s / X's tokens/s (> 1: the row is
// faster). "paired vs mixtape fp32" is the median over the cycles c of fp32's step c / the row's step c: the
// two steps of a pair ran within one cycle (a mode k places after fp32 in the run order runs k or n - k steps
// from it, n sides in all), so load that comes and goes over seconds cancels out of it.
//
// Targets printed at the end: mixtape fp32 >= 3x PyTorch fp32, mixtape bf16 >= 1.5x PyTorch bf16
// autocast, and every fp16/bf16 mode at least as fast as mixtape fp32, judged on the paired ratio (the verdict
// names the slowest such mode, with its ratio of medians and that ratio's range over the rounds, each round's
// median against fp32's in the same round); and the fp8 modes' emulated step (fp8, fp8_delayed, fp8_rowwise,
// fp8_block, mxfp8) at most 1.5x mixtape bf16's ms per step, as a ratio of medians (nvfp4 printed, not judged).
//
// --control adds a second fp32 trainer ("fp32 control": the same code, starting from the same weights) and
// prints its paired ratio and ratio of medians against fp32: how far from 1.00 the machine's noise alone moves
// them in the same run. It runs n / 2 places from fp32 in the run order, as far from it as any side can be, so
// its pairs are no closer in time than any mode's.
//
// --phases adds a table after the comparison: for each mixtape mode the median forward, backward and
// optimizer time of its timed steps (StepStats), and its forward and backward per op (a ForwardProfiler and a
// BackwardProfiler around each timed step: mean ms per step, largest first; the forward's "(rest)" is what
// its time has beyond its recorded ops, zero_grad and reading the loss; "engine" is backward()'s own
// bookkeeping). Without it no profiler runs.
//
// --gemms adds the bf16 step's GEMM time on both sides, as oneDNN itself measures it: this program (bf16 only)
// and the PyTorch script under bf16 autocast (PyTorch bundles its own oneDNN) are each run as a child process
// with ONEDNN_VERBOSE=1 for 4 and then 12 steps, the execution times of their logs summed (bench/onednn_verbose.h)
// and the difference divided by 8: the per-step time of 2-D matmuls (the linear layers' GEMMs), of batched ones
// (PyTorch's attention) and of every other oneDNN primitive, beside each side's median step in its 12-step run
// (the sides' runs alternate, so both meet the same load). It then prints what the 1.5x target leaves beyond
// mixtape's GEMMs. The two sides run the same GEMM kernels, so this is the part of the step the target does not
// touch.
//
// --neighbour runs a study of its own instead (bench/neighbour_study.cpp): the step of a smaller model
// quiet and beside a busy process, at the default thread count, at 1 thread and under train_gpt's thread
// tuner, in --rounds timed blocks of --steps steps, e.g. --neighbour --rounds 6 --steps 60.
//
// PyTorch missing (no python3-torch) prints a note and only mixtape's figures. The verdicts against PyTorch
// say "n/a" (the ratios are still printed) where PyTorch is not the baseline the targets mean: when it runs
// on Debian's reference BLAS (no libopenblas0-pthread: ~10x slower in fp32), and, for the bf16 target, on a
// CPU without bf16 instructions, where PyTorch 1.13's bf16 autocast has no fast path at all (16.5-17 s a step
// on a Zen 3 core pair, 12x-16x its own fp32) and the target, set on a CPU with AVX512-BF16, does not apply.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "autograd/autograd.h"
#include "bench/bench_training.h"
#include "bench/neighbour_study.h"
#include "bench/onednn_verbose.h"
#include "train/training.h"
#include "io/json.h"
#include "tensor/backend.h"
#include "tensor/cpu/attention_bf16.h"
#include "tensor/cpu/cpu_backend.h"
#include "tensor/cpu/gemm16.h"
#include "tensor/precision.h"

using namespace mixtape;

namespace {

using bench::median;
using bench::random_tokens;

constexpr double kTargetFp32 = 3.0;       // mixtape fp32 >= 3x PyTorch fp32 tokens/s
constexpr double kTargetBf16 = 1.5;       // mixtape bf16 >= 1.5x PyTorch bf16 autocast tokens/s
constexpr double kTargetLowVsFp32 = 1.0;  // every fp16/bf16 mode at least as fast as mixtape fp32
// The fp8 modes' emulated step (fp8, fp8_delayed, fp8_rowwise, fp8_block, mxfp8) at most 1.5x mixtape bf16's
// ms per step; nvfp4 (stochastic rounding and the Hadamard transform on the CPU) is reported, not judged.
constexpr double kTargetFp8VsBf16 = 1.5;

// Every precision mode, Apex's at O2 (fp16 model, fp32 norms and masters: the level Apex recommends).
constexpr std::array<std::string_view, 1> kApexBenchLevel{"O2"};
const std::vector<std::string> kDefaultModes = precision_mode_names(kApexBenchLevel);

const bench::BenchModel kModel{.layers = 4, .heads = 4, .width = 256, .block = 128, .vocab = 65, .batch = 16};

const TokenData& bench_data() {
  static const TokenData data = random_tokens(kModel.vocab, 200000);
  return data;
}

// One mode's trainer. Every mode starts from the same initial weights (same seed) and sees the same batches.
struct Side {
  std::string mode, name;  // name: the mode, or "fp32 control" (--control)
  std::unique_ptr<Trainer> trainer;
  // --phases: each timed step's phases (ms) and the backward per op summed over the timed steps.
  std::vector<double> forward_ms, backward_ms, optimizer_ms;
  std::map<std::string, double> forward_op_ms, backward_op_ms;
  double forward_rest_ms = 0, backward_engine_ms = 0;

  explicit Side(std::string m, std::string label = "") : mode(std::move(m)), name(label.empty() ? mode : label) {
    trainer = bench::make_trainer(kModel, mode, 1e-3, Device::cpu(), bench_data());
    set_allow_tf32(false);  // building a tf32 trainer turned it on process-wide; step() sets it per mode
  }
  bool is_control() const { return name != mode; }  // only the control has a name of its own
  StepStats step() {
    set_allow_tf32(trainer->options().amp.row().tf32_matmuls);
    return trainer->train_step();
  }
  double step_ms(bool phases) {
    std::optional<ForwardProfiler> forward_profiler;
    std::optional<BackwardProfiler> profiler;
    if (phases) {
      forward_profiler.emplace();
      profiler.emplace();
    }
    const auto t0 = std::chrono::steady_clock::now();
    const StepStats stats = step();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (phases) {
      forward_ms.push_back(stats.forward_seconds * 1e3);
      backward_ms.push_back(stats.backward_seconds * 1e3);
      optimizer_ms.push_back(stats.optimizer_seconds * 1e3);
      for (const auto& [op, entry] : forward_profiler->entries()) forward_op_ms[op] += entry.seconds * 1e3;
      forward_rest_ms += (stats.forward_seconds - forward_profiler->total_seconds()) * 1e3;
      double parts = 0;
      for (const auto& [op, entry] : profiler->entries()) {
        backward_op_ms[op] += entry.seconds * 1e3;
        parts += entry.seconds;
      }
      backward_engine_ms += (profiler->total_seconds() - parts) * 1e3;
    }
    return ms;
  }
};

// The mixtape sides, in --precision order; built once, shared by the Google Benchmark rows and the
// comparison.
std::vector<std::unique_ptr<Side>>& sides() {
  static std::vector<std::unique_ptr<Side>> s;
  return s;
}

void BM_GPTTrainStep(benchmark::State& state, Side* side) {
  side->step();  // warm-up: oneDNN primitives, the allocator's cache
  for (auto _ : state) side->step();
  state.counters["tokens_per_s"] =
      benchmark::Counter(double(kModel.tokens_per_step()), benchmark::Counter::kIsIterationInvariantRate);
  set_allow_tf32(false);
}

// The command that runs the PyTorch script for `steps` timed steps (autocast "none" or "bf16"), its output and
// errors on standard output.
std::string pytorch_command(int steps, const std::string& autocast) {
  return std::string("python3 ") + MIXTAPE_SOURCE_DIR + "/bench/pytorch_train_step.py" + " --layers " +
         std::to_string(kModel.layers) + " --heads " + std::to_string(kModel.heads) + " --width " +
         std::to_string(kModel.width) + " --block " + std::to_string(kModel.block) + " --batch " +
         std::to_string(kModel.batch) + " --vocab " + std::to_string(kModel.vocab) + " --threads " +
         std::to_string(omp_get_max_threads()) + " --warmup 2 --steps " + std::to_string(steps) + " --autocast " +
         autocast + " 2>&1";
}

// Runs `command` (a child process, named `what` in messages) and reads all it prints into `out`; false with
// `why` set when it cannot start or fails (exit status 77: the PyTorch scripts' "PyTorch is missing").
bool run_child(const std::string& command, const std::string& what, std::string& out, std::string& why) {
  int status = 0;
  if (!bench::run_command(command, out, status)) {
    why = "cannot start " + what;
    return false;
  }
  if (status != 0) {
    why = bench::exited_with(status, 77) ? std::string("PyTorch is not installed (apt-get install python3-torch)")
                                         : what + " failed:\n" + out.substr(out.size() - std::min<size_t>(
                                                                                out.size(), 4000));
    return false;
  }
  return true;
}

// The PyTorch script's last line, JSON: {"torch": version, "blas": path, "step_ms": [...], ...}.
struct PytorchOutput {
  std::string version, blas;
  std::vector<double> step_ms;
};
PytorchOutput read_pytorch_output(const std::string& out) {
  const size_t start = out.rfind('{');
  check(start != std::string::npos, "no JSON line");
  const Json v = json::parse(std::string_view(out).substr(start));
  const Json* torch_version = json::find(v, "torch");
  const Json* step_ms = json::find(v, "step_ms");
  check(torch_version && step_ms, "no \"torch\" or \"step_ms\" key");
  const Json* blas_path = json::find(v, "blas");
  PytorchOutput result{json::as_string(*torch_version), blas_path ? json::as_string(*blas_path) : "", {}};
  for (const Json& t : json::as_array(*step_ms)) result.step_ms.push_back(json::as_number(t));
  return result;
}

// Runs the PyTorch script (autocast "none" or "bf16"); returns its step times, or an empty vector with `why`
// set.
std::vector<double> pytorch_steps(int steps, const std::string& autocast, std::string& version,
                                  std::string& blas, std::string& why) {
  std::string out;
  if (!run_child(pytorch_command(steps, autocast), "the PyTorch script", out, why)) return {};
  try {
    PytorchOutput result = read_pytorch_output(out);
    version = result.version;
    blas = result.blas;
    return std::move(result.step_ms);
  } catch (const std::exception& e) {
    why = std::string("cannot read the PyTorch script's output (") + e.what() + "):\n" + out;
    return {};
  }
}

// --gemms: one side's child runs, each with oneDNN's log on: `command(steps)` runs it, `median_ms(output)`
// reads its median step (ms) from what it prints.
struct LoggedSide {
  const char* name;
  std::function<std::string(int)> command;
  std::function<double(const std::string&)> median_ms;
  std::string why = "";             // why the side has no figures ("" when it has)
  bench::OnednnTimes logs[2] = {};  // the runs of kLoggedSteps[0] and kLoggedSteps[1] steps
  double step_ms = NAN;             // the median step of the longer run
};
constexpr int kLoggedSteps[2] = {4, 12};

// Runs side's child for kLoggedSteps[k] steps, unless an earlier run failed; on failure sets side.why.
void run_logged(LoggedSide& side, int k) {
  std::string out;
  if (!side.why.empty() || !run_child(side.command(kLoggedSteps[k]), side.name, out, side.why)) return;
  side.logs[k] = bench::parse_onednn_verbose(out);
  if (k == 1) side.step_ms = side.median_ms(out);
}

// The per-step sums: the difference of the two runs' logs over the difference of their steps, so start-up,
// warm-up and primitive creation cancel out.
bench::OnednnTimes per_step(const LoggedSide& side) {
  const double steps = kLoggedSteps[1] - kLoggedSteps[0];
  auto sum = [&](const bench::OnednnTimes::Sum& few, const bench::OnednnTimes::Sum& many) {
    return bench::OnednnTimes::Sum{static_cast<int64_t>(std::llround((many.calls - few.calls) / steps)),
                                   (many.ms - few.ms) / steps};
  };
  bench::OnednnTimes result;
  result.matmul = sum(side.logs[0].matmul, side.logs[1].matmul);
  result.batched = sum(side.logs[0].batched, side.logs[1].batched);
  for (const auto& [name, many] : side.logs[1].other) {
    const auto few = side.logs[0].other.find(name);
    const bench::OnednnTimes::Sum per = sum(few == side.logs[0].other.end() ? bench::OnednnTimes::Sum{} : few->second,
                                            many);
    if (per.calls > 0) result.other[name] = per;
  }
  return result;
}

// One row of the --gemms table.
void print_logged_row(const LoggedSide& side, const bench::OnednnTimes& t) {
  if (!side.why.empty()) {
    std::printf("%-24s skipped: %s\n", side.name, side.why.c_str());
    return;
  }
  std::string others;
  for (const auto& [primitive, sum] : t.other) {
    char item[96];
    std::snprintf(item, sizeof(item), "%s%s %lld x %.1f ms", others.empty() ? "" : ", ", primitive.c_str(),
                  static_cast<long long>(sum.calls), sum.ms);
    others += item;
  }
  std::printf("%-24s %10.1f %10lld %10.1f %10lld %10.1f  %s\n", side.name, side.step_ms,
              static_cast<long long>(t.matmul.calls), t.matmul.ms, static_cast<long long>(t.batched.calls),
              t.batched.ms, others.empty() ? "none" : others.c_str());
}

// --gemms (see the header): the bf16 step and its oneDNN time on both sides, from child runs alternated
// between the sides (mixtape 4 steps, PyTorch 4, mixtape 12, PyTorch 12) so that both meet the same load, and
// what the 1.5x target leaves beyond mixtape's GEMMs at those runs' steps.
void print_gemms(bool with_pytorch) {
  std::fprintf(stderr, "--gemms: child runs of each side with ONEDNN_VERBOSE=1\n");
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  check(length > 0, "bench_train_gpt --gemms: cannot find this program's path (/proc/self/exe)");
  self[length] = '\0';
  LoggedSide mixtape{
      "mixtape bf16",
      [&](int steps) {
        return "ONEDNN_VERBOSE=1 '" + std::string(self) + "' --compare-only --no-pytorch --precision bf16 " +
               "--rounds 1 --steps " + std::to_string(steps) + " 2>&1";
      },
      [](const std::string& out) {  // the median of the child's comparison row "mixtape bf16  <median> ..."
        const std::string label = "\nmixtape bf16 ";
        for (size_t row = out.find(label); row != std::string::npos; row = out.find(label, row + 1)) {
          const char* number = out.c_str() + row + label.size();
          char* end = nullptr;
          const double ms = std::strtod(number, &end);
          if (end != number) return ms;  // (the verdict line "mixtape bf16 / PyTorch ..." has no number)
        }
        fail("bench_train_gpt --gemms: no 'mixtape bf16' row with a median in the child's output");
      }};
  LoggedSide pytorch{"PyTorch bf16 autocast",
                     [](int steps) { return "ONEDNN_VERBOSE=1 DNNL_VERBOSE=1 " + pytorch_command(steps, "bf16"); },
                     [](const std::string& out) { return median(read_pytorch_output(out).step_ms); }};
  if (!with_pytorch) pytorch.why = "--no-pytorch";
  for (int k = 0; k < 2; ++k)
    for (LoggedSide* side : {&mixtape, &pytorch}) run_logged(*side, k);
  const bench::OnednnTimes m = per_step(mixtape), p = per_step(pytorch);

  std::printf("\nThe bf16 step and its GEMMs (--gemms): child runs of 4 and 12 steps per side, alternated, with "
              "ONEDNN_VERBOSE=1;\nthe median step of the 12-step run, and oneDNN's own execution times per step "
              "(the runs' difference / 8)\n");
  std::printf("%-24s %10s %10s %10s %10s %10s  %s\n", "", "step ms", "matmuls", "ms", "batched", "ms",
              "other oneDNN primitives");
  print_logged_row(mixtape, m);
  print_logged_row(pytorch, p);
  if (!mixtape.why.empty()) return;
  if (m.matmul.calls == 0) {
    // bf16 on the f32 route (no AVX512-BF16, or a slow bf16 dot product: cpu::bf16_gemm): mixtape's bf16
    // products run in its own kernel (tensor/cpu/gemm16.cpp), which oneDNN's log does not see, so there is no
    // G to subtract.
    std::printf("mixtape's bf16 GEMMs do not run in oneDNN in this run (the f32 route: its own kernel, "
                "tensor/cpu/gemm16.cpp): no GEMM time to split off\n");
  } else if (pytorch.why.empty()) {
    const double budget = pytorch.step_ms / kTargetBf16, gemm_ms = m.matmul.ms + m.batched.ms;
    if (budget < gemm_ms)
      std::printf("%.1fx PyTorch's step (%.1f ms) is a mixtape step of %.1f ms: less than its %.1f ms of GEMMs "
                  "alone\n",
                  kTargetBf16, pytorch.step_ms, budget, gemm_ms);
    else
      std::printf("%.1fx PyTorch's step (%.1f ms) is a mixtape step of %.1f ms: %.1f ms beyond its %.1f ms of "
                  "GEMMs, against %.1f ms now\n",
                  kTargetBf16, pytorch.step_ms, budget, budget - gemm_ms, gemm_ms, mixtape.step_ms - gemm_ms);
  }
}

// One phase's ops as "op ms" items, mean ms per step, largest first (`rest` under its own name), comma-separated
// and wrapped before 110 characters.
void print_ops(const char* phase, const std::map<std::string, double>& op_ms, double steps, double rest_ms,
               const char* rest_name) {
  std::vector<std::pair<double, std::string>> ops;
  for (const auto& [op, ms] : op_ms) ops.emplace_back(ms / steps, op);
  ops.emplace_back(rest_ms / steps, rest_name);
  std::sort(ops.rbegin(), ops.rend());
  std::string line = std::string("    ") + phase;
  const std::string indent(line.size(), ' ');
  for (size_t i = 0; i < ops.size(); ++i) {
    char item[96];
    std::snprintf(item, sizeof(item), " %s %.2f", ops[i].second.c_str(), ops[i].first);
    const std::string separator = i == 0 ? "" : ",";
    if (line.size() + separator.size() + std::strlen(item) > 110) {
      std::printf("%s%s\n", line.c_str(), separator.c_str());
      line = indent;
    } else {
      line += separator;
    }
    line += item;
  }
  std::printf("%s\n", line.c_str());
}

// --phases: where each mode's step goes (see the header).
void print_phases() {
  std::printf("\nWhere the step goes (--phases): median ms per step of each phase; forward and backward by op: mean "
              "ms per step, largest first\n");
  std::printf("%-24s %10s %10s %10s\n", "", "forward", "backward", "optimizer");
  for (const auto& side : sides()) {
    const double steps = static_cast<double>(side->forward_ms.size());  // the profiled steps
    if (steps == 0) continue;
    std::printf("%-24s %10.1f %10.1f %10.1f\n", ("mixtape " + side->name).c_str(), median(side->forward_ms),
                median(side->backward_ms), median(side->optimizer_ms));
    print_ops("forward:", side->forward_op_ms, steps, side->forward_rest_ms, "(rest)");
    print_ops("backward:", side->backward_op_ms, steps, side->backward_engine_ms, "engine");
  }
}

void compare(int rounds, int steps, bool blocked, bool with_pytorch, bool phases, bool gemms) {
  struct Timed {
    std::string name;
    std::vector<double> ms;
  };
  std::vector<Timed> mixtape;
  for (const auto& side : sides()) mixtape.push_back({"mixtape " + side->name, {}});
  Timed torch_fp32{"PyTorch fp32", {}}, torch_bf16{"PyTorch bf16 autocast", {}};
  std::string version, blas, why;
  for (const auto& side : sides()) side->step();  // warm-up
  // The run order: the sides in --precision order, the control (the last side, when there is one) moved to the
  // middle, n / 2 places from fp32 either way round the cycle.
  const size_t n = sides().size();
  std::vector<size_t> order(n);
  for (size_t k = 0; k < n; ++k) order[k] = k;
  if (n > 1 && sides().back()->is_control()) {
    order.pop_back();
    order.insert(order.begin() + static_cast<std::ptrdiff_t>(n / 2), n - 1);
  }
  size_t cycle = 0;
  for (int r = 0; r < rounds; ++r) {
    if (blocked) {
      for (size_t k : order)
        for (int i = 0; i < steps; ++i) mixtape[k].ms.push_back(sides()[k]->step_ms(phases));
    } else {  // a cycle: one step of every side, in the run order from place (cycle mod n) on
      for (int i = 0; i < steps; ++i, ++cycle)
        for (size_t j = 0; j < n; ++j) {
          const size_t k = order[(cycle + j) % n];
          mixtape[k].ms.push_back(sides()[k]->step_ms(phases));
        }
    }
    set_allow_tf32(false);
    if (with_pytorch && why.empty()) {
      for (Timed* t : {&torch_fp32, &torch_bf16}) {
        const std::vector<double> ms =
            pytorch_steps(steps, t == &torch_fp32 ? "none" : "bf16", version, blas, why);
        if (!why.empty()) break;
        t->ms.insert(t->ms.end(), ms.begin(), ms.end());
      }
    }
    std::fprintf(stderr, "round %d/%d done\n", r + 1, rounds);
  }
  if (!why.empty()) {  // a partial PyTorch side is not comparable
    torch_fp32.ms.clear();
    torch_bf16.ms.clear();
  }

  const double tokens = double(kModel.tokens_per_step());
  std::printf("\nGPT training step: %lld layers, %lld heads, width %lld, block %lld, batch %lld, vocab %lld "
              "(%lld tokens/step), %d threads; %d rounds x %d steps per side, %s\n",
              static_cast<long long>(kModel.layers), static_cast<long long>(kModel.heads),
              static_cast<long long>(kModel.width), static_cast<long long>(kModel.block),
              static_cast<long long>(kModel.batch), static_cast<long long>(kModel.vocab),
              static_cast<long long>(kModel.tokens_per_step()), omp_get_max_threads(), rounds, steps,
              blocked ? "each side's steps of a round in one block (--blocked)"
                      : "the mixtape modes interleaved step by step, then PyTorch");
  {  // how mixtape multiplies in bf16 here (tensor/cpu/matmul.cpp, "bf16 products")
    const double rate = cpu::bf16_dot_rate();
    char measured[96] = "";
    if (rate > 0)
      std::snprintf(measured, sizeof(measured), "; this core's bf16 dot product runs at %.2fx its f32 FMA rate",
                    rate);
    std::printf("mixtape bf16 products: %s%s%s\n",
                cpu::bf16_gemm() == cpu::Bf16Gemm::Onednn ? "oneDNN's bf16 GEMM"
                : cpu::gemm16_isa() != cpu::Gemm16Isa::None
                    ? "f32 FMAs (gemm16, else the f32 GEMM)"
                    : "f32 FMAs (the f32 GEMM)",
                measured, cpu::onednn_has_bf16_gemm() ? " (MIXTAPE_BF16_GEMM=onednn|f32 picks a route)" : "");
    std::printf("mixtape bf16 attention: the %s kernel (tensor/cpu/attention_bf16.h)\n",
                cpu::bf16_attention_kernel_name(cpu::bf16_attention_kernel()));
  }
  // Why a PyTorch verdict would not measure what its target means ("" where it does).
  std::string unfair_fp32, unfair_bf16;
  if (!version.empty()) {
    std::printf("PyTorch %s, BLAS %s\n", version.c_str(), blas.empty() ? "(none mapped)" : blas.c_str());
    // Debian's reference BLAS is /usr/lib/<triplet>/blas/libblas.so.3; OpenBLAS's lies under openblas-*/.
    if (blas.find("/blas/libblas.so") != std::string::npos)
      unfair_fp32 = "PyTorch runs on Debian's reference BLAS, not a fair baseline: apt-get install "
                    "libopenblas0-pthread";
    unfair_bf16 = unfair_fp32;
    if (unfair_bf16.empty() && !cpu::onednn_has_bf16_gemm())
      unfair_bf16 = "this CPU has no bf16 instructions, so PyTorch 1.13's bf16 autocast has no fast path "
                    "here; the target is set against a CPU with AVX512-BF16";
  }
  const Timed* mixtape_fp32 = nullptr;
  const Timed* mixtape_bf16 = nullptr;
  for (const Timed& t : mixtape) {
    if (t.name == "mixtape fp32") mixtape_fp32 = &t;
    if (t.name == "mixtape bf16") mixtape_bf16 = &t;
  }
  const Timed* pt_fp32 = torch_fp32.ms.empty() ? nullptr : &torch_fp32;
  const Timed* pt_bf16 = torch_bf16.ms.empty() ? nullptr : &torch_bf16;
  // X's median / the row's median: the row's speed relative to X (tokens/s ratio).
  auto ratio = [](const Timed* reference, const Timed& row) {
    return reference ? median(reference->ms) / median(row.ms) : NAN;
  };
  auto cell = [](double x) {
    char buffer[32];
    if (std::isnan(x)) return std::string("n/a");
    std::snprintf(buffer, sizeof(buffer), "%.2fx", x);
    return std::string(buffer);
  };
  // The median over the step cycles c of fp32's step c / the row's step c (a mixtape row only; see the header).
  auto paired = [&](const Timed* t) -> double {
    if (!mixtape_fp32 || !t || t->ms.size() != mixtape_fp32->ms.size()) return NAN;
    std::vector<double> r;
    for (size_t c = 0; c < t->ms.size(); ++c) r.push_back(mixtape_fp32->ms[c] / t->ms[c]);
    return median(r);
  };
  std::printf("%-24s %10s %10s %12s %12s %14s %14s %12s %12s\n", "", "median", "best", "median", "best",
              "vs PyTorch", "vs PyTorch", "vs mixtape", "paired vs");
  std::printf("%-24s %10s %10s %12s %12s %14s %14s %12s %12s\n", "", "ms/step", "ms/step", "tokens/s", "tokens/s",
              "fp32", "bf16 autocast", "fp32", "mixtape fp32");
  auto row = [&](const Timed& t, bool ours) {
    if (t.ms.empty()) return;
    const double m = median(t.ms), b = *std::min_element(t.ms.begin(), t.ms.end());
    const double p = ours ? paired(&t) : NAN;
    char pair[32] = "n/a";
    if (!std::isnan(p)) std::snprintf(pair, sizeof(pair), "%.3fx", p);
    std::printf("%-24s %10.1f %10.1f %12.0f %12.0f %14s %14s %12s %12s\n", t.name.c_str(), m, b, tokens / m * 1e3,
                tokens / b * 1e3, cell(ratio(pt_fp32, t)).c_str(), cell(ratio(pt_bf16, t)).c_str(),
                cell(ratio(mixtape_fp32, t)).c_str(), pair);
  };
  row(torch_fp32, false);
  row(torch_bf16, false);
  for (const Timed& t : mixtape) row(t, true);
  if (with_pytorch && !why.empty()) std::printf("PyTorch: skipped: %s\n", why.c_str());

  std::printf("\n");
  auto verdict = [](double x, double target) {
    return std::isnan(x) ? "n/a" : x >= target ? "met" : "NOT met";
  };
  auto judged = [&](double x, double target, const std::string& unfair) {
    return unfair.empty() ? std::string(verdict(x, target)) : "n/a (" + unfair + ")";
  };
  if (mixtape_fp32 && pt_fp32) {
    const double x = ratio(pt_fp32, *mixtape_fp32);
    std::printf("mixtape fp32 / PyTorch fp32 = %.2f (target >= %.1f): %s\n", x, kTargetFp32,
                judged(x, kTargetFp32, unfair_fp32).c_str());
  }
  if (mixtape_bf16 && pt_bf16) {
    const double x = ratio(pt_bf16, *mixtape_bf16);
    std::printf("mixtape bf16 / PyTorch bf16 autocast = %.2f (target >= %.1f): %s\n", x, kTargetBf16,
                judged(x, kTargetBf16, unfair_bf16).c_str());
  } else {
    std::printf("mixtape bf16 / PyTorch bf16 autocast = n/a (needs bf16 in --precision and PyTorch)\n");
  }
  // A row's ratio of medians against fp32 within each round (round r of a side is its steps r * steps ...
  // (r + 1) * steps - 1): how far the machine's round-to-round noise reaches.
  auto round_range = [&](const Timed& t) {
    std::vector<double> per_round;
    auto round_of = [&](const Timed& s, int r) {
      return std::vector<double>(s.ms.begin() + r * steps, s.ms.begin() + (r + 1) * steps);
    };
    for (int r = 0; r < rounds; ++r)
      per_round.push_back(median(round_of(*mixtape_fp32, r)) / median(round_of(t, r)));
    const auto [low, high] = std::minmax_element(per_round.begin(), per_round.end());
    return std::pair<double, double>{*low, *high};
  };
  if (mixtape_fp32) {
    // The verdict takes the paired ratio (its column above): on a shared machine it spreads far less than a
    // ratio of medians does (--control's identical fp32 side on a Xeon without AMX: 0.97-1.06 as a ratio of
    // medians, 0.987-1.023 paired).
    const size_t cycles = mixtape_fp32->ms.size();
    double lowest = NAN;
    size_t which = 0;
    for (size_t k = 0; k < mixtape.size(); ++k) {
      if (!bench::is_low_precision(AmpConfig::parse(sides()[k]->mode))) continue;
      const double x = paired(&mixtape[k]);
      if (std::isnan(lowest) || x < lowest) {
        lowest = x;
        which = k;
      }
    }
    if (std::isnan(lowest)) {
      std::printf("fp16/bf16 modes vs mixtape fp32: n/a (no fp16/bf16 mode in --precision)\n");
    } else {
      const auto [low, high] = round_range(mixtape[which]);
      std::printf("fp16/bf16 modes vs mixtape fp32, paired over %zu step cycles%s: lowest %.4f (%s; its ratio of "
                  "medians %.2f, %.2f-%.2f over the %d rounds) (target >= %.1f): %s\n",
                  cycles, blocked ? " (--blocked: a cycle's steps seconds apart)" : "", lowest,
                  sides()[which]->name.c_str(), ratio(mixtape_fp32, mixtape[which]), low, high, rounds,
                  kTargetLowVsFp32, verdict(lowest, kTargetLowVsFp32));
    }
    for (size_t k = 0; k < mixtape.size(); ++k) {
      if (!sides()[k]->is_control()) continue;
      const auto [low, high] = round_range(mixtape[k]);
      std::printf("the noise alone (--control): fp32 / fp32 control paired %.4f (ratio of medians %.2f, %.2f-%.2f "
                  "over the %d rounds)\n",
                  paired(&mixtape[k]), ratio(mixtape_fp32, mixtape[k]), low, high, rounds);
    }
  } else {
    std::printf("fp16/bf16 modes vs mixtape fp32: n/a (needs fp32 in --precision)\n");
  }
  // Each fp8 / block-scaled side's median ms per step over mixtape bf16's, and the verdict on the slowest judged
  // one.
  [&](const Timed* bf16) {
    std::string rows, slowest;
    double worst = NAN;
    for (size_t k = 0; k < mixtape.size(); ++k) {
      const AmpConfig config = AmpConfig::parse(sides()[k]->mode);
      if (!config.quantizes_gemms() || !bf16) continue;
      const double slowdown = median(mixtape[k].ms) / median(bf16->ms);
      char text[64];
      std::snprintf(text, sizeof(text), "%s%s %.2fx", rows.empty() ? "" : ", ", config.name().c_str(), slowdown);
      rows += text;
      if (config.mode != PrecisionMode::Nvfp4 && (std::isnan(worst) || slowdown > worst)) {
        worst = slowdown;
        slowest = config.name();
      }
    }
    if (rows.empty()) return;
    std::printf("fp8 modes' ms per step / mixtape bf16's (ratio of medians): %s; slowest judged %s %.2f (target <= %.1f, "
                "nvfp4 not judged): %s\n",
                rows.c_str(), slowest.c_str(), worst, kTargetFp8VsBf16,
                std::isnan(worst) ? "n/a" : worst <= kTargetFp8VsBf16 ? "met" : "NOT met");
  }(mixtape_bf16);
  if (phases) print_phases();
  if (gemms) print_gemms(with_pytorch);
}

std::vector<std::string> split_modes(const std::string& text) {
  std::vector<std::string> modes;
  std::string mode;
  std::istringstream in(text);
  while (std::getline(in, mode, ',')) modes.push_back(mode);
  check(!modes.empty() && !text.empty() && text.back() != ',', "bench_train_gpt: --precision '", text,
        "' is not a comma-separated list of modes");
  for (const std::string& m : modes) {
    check(!m.empty(), "bench_train_gpt: --precision '", text, "' has an empty entry");
    AmpConfig::parse(m);  // Error naming an unknown mode
    check(std::count(modes.begin(), modes.end(), m) == 1, "bench_train_gpt: --precision names '", m,
          "' twice");
  }
  return modes;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  int rounds = 3, steps = 10;
  bool with_pytorch = true, only_compare = false, phases = false, gemms = false, blocked = false, control = false,
       neighbour = false;
  std::string precision;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--rounds" && i + 1 < argc) rounds = std::max(1, std::atoi(argv[++i]));
    else if (a == "--steps" && i + 1 < argc) steps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--precision" && i + 1 < argc) precision = argv[++i];
    else if (a == "--no-pytorch") with_pytorch = false;
    else if (a == "--compare-only") only_compare = true;
    else if (a == "--phases") phases = true;
    else if (a == "--gemms") gemms = true;
    else if (a == "--blocked") blocked = true;
    else if (a == "--control") control = true;
    else if (a == "--neighbour") neighbour = true;
    else {
      std::fprintf(stderr, "bench_train_gpt: unknown option %s (own options: --rounds N --steps N "
                   "--precision a,b,c --no-pytorch --compare-only --phases --gemms --blocked --control --neighbour; "
                   "others go to Google Benchmark)\n",
                   a.c_str());
      return 2;
    }
  }
  if (neighbour) {  // a study of its own: --rounds timed blocks of --steps steps
    try {
      return bench::neighbour_study(rounds, steps);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_train_gpt: %s\n", e.what());
      return 1;
    }
  }
  try {
    const std::vector<std::string> modes = precision.empty() ? kDefaultModes : split_modes(precision);
    auto is_fp32 = [](const std::string& mode) { return AmpConfig::parse(mode).mode == PrecisionMode::Fp32; };
    check(!control || std::count_if(modes.begin(), modes.end(), is_fp32) == 1,
          "--control needs fp32 in --precision (the control is a second fp32 side)");
    for (const std::string& mode : modes) sides().push_back(std::make_unique<Side>(mode));
    if (control) sides().push_back(std::make_unique<Side>("fp32", "fp32 control"));
    set_allow_tf32(false);
    for (const auto& side : sides()) {
      const std::string label = side->is_control() ? "fp32_control" : side->mode;
      benchmark::RegisterBenchmark(("train_step/gpt_4l_4h_w256_b128_bs16/mixtape_" + label).c_str(),
                                   BM_GPTTrainStep, side.get())
          ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
    }
    if (!only_compare) benchmark::RunSpecifiedBenchmarks();
    compare(rounds, steps, blocked, with_pytorch, phases, gemms);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_gpt: %s\n", e.what());
    return 1;
  }
  benchmark::Shutdown();
  return 0;
}
