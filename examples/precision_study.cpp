// precision_study: one GPT, one data set, one seed, trained once under each precision mode, and a comparison.
//
//   precision_study                                   # every mode of the table (amp/precision_mode.h)
//   precision_study --modes fp32,bf16,fp16_naive --steps 300 --out /tmp/study
//   precision_study --data other.txt --layers 2 --width 64 ...
//
// Each mode runs the train_gpt executable that sits next to this one, as a child process with identical flags
// plus --precision MODE --log-json OUT/<mode>.jsonl (':' in a mode becomes '_' in file names:
// fp16_apex_O2.jsonl). A process per mode gives each mode its own peak RSS and keeps tf32's process-wide
// switch from leaking into the other modes. The child's output is streamed with a "[mode]" prefix.
//
// Peak RSS is the child's own: the "peak_rss_kib" its log reports (VmHWM of its /proc/self/status: the
// high-water mark of resident memory since its exec, model + optimizer + activations + allocator caches).
// Not wait4's ru_maxrss: posix_spawn starts the child with vfork, and at exec Linux records the old (our)
// memory's high-water mark into the child's maxrss, so ru_maxrss is never below this process's own peak.
//
// Written to --out (default: <build>/precision_study), each through a temporary file and a rename, so a file
// is complete or absent:
//   results.md, results.csv  one row per mode that ran to the end:
//       final train loss   mean of the last 10 steps' batch losses (one batch is noisy; 10 hold 10x the
//                          tokens); nan when a loss was not finite
//       final val loss     the validation loss after the last step (train_gpt's final evaluation)
//       val diff vs fp32   final val loss - fp32's, absolute and relative to fp32's (empty without fp32),
//                          from the unrounded losses
//       tokens/s           median of the per-step rates (robust to the odd step slowed by another process)
//       peak RSS MiB       the child's peak_rss_kib (empty if its log has none)
//       skipped steps      steps whose update was skipped on a gradient overflow
//       final loss scale   the scale of the last step's loss, exact (shortest round-trip text)
//   <mode>.jsonl             train_gpt's per-step log, checked (a line per step) before its rename into place
//   precision_study.png      a curve per mode in each panel: the training loss (trailing mean of 20 steps)
//                            and the loss scale on a log2 axis; with fp32 in the study each mode's
//                            smoothed loss minus fp32's; with fp8 or block-scaled modes the fraction of each
//                            step's gradient values flushed to zero and of its values saturated, and
//                            fp8_delayed's scales (its first Linear's three tensors). Drawn by train/plot.h
//                            (no outside tool). results.md adds a table of what quantization saturated and
//                            flushed over the run, per fp8 mode and tensor kind.
// The Markdown table is also printed at the end. Errors (unknown mode or option, a bad value, missing data or
// train_gpt, a child failing) print "error: ..." and exit non-zero; a failing mode does not stop the others,
// so the study reports what it can. When no mode succeeds nothing is written (no tables, no plot).
// SIGINT, SIGTERM, SIGHUP or SIGPIPE kill the running child, remove the temporary file being written and exit with
// 128 + the signal.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <optional>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "amp/config.h"
#include "train/command_line.h"
#include "train/plot.h"
#include "train/training.h"
#include "io/json.h"
#include "io/state_dict.h"
#include "tensor/error.h"

extern char** environ;

using namespace mixtape;
namespace fs = std::filesystem;

namespace {

// Every precision mode, Apex's at each opt level.
const std::vector<std::string> kDefaultModes = precision_mode_names(kApexOptLevels);
constexpr size_t kFinalTrainSteps = 10;  // final train loss = mean of the last 10 batch losses
constexpr size_t kSmooth = 20;           // the plotted training loss: trailing mean of 20 steps

// train_gpt flags passed through to every child, by the kind of value train_gpt's own parser accepts; the
// value's form is checked here (before anything runs), its meaning (heads dividing width, ...) by train_gpt.
enum class TrainValue { PositiveInteger, Count, Real, Text };  // Count: an integer >= 0; Real: >= 0
struct TrainFlag {
  const char* name;
  TrainValue value;
};
constexpr TrainFlag kTrainFlags[] = {
    {"--layers", TrainValue::PositiveInteger}, {"--heads", TrainValue::PositiveInteger},
    {"--width", TrainValue::PositiveInteger},  {"--block", TrainValue::PositiveInteger},
    {"--batch", TrainValue::PositiveInteger},  {"--steps", TrainValue::PositiveInteger},
    {"--eval-every", TrainValue::Count},       {"--lr", TrainValue::Real},
    {"--min-lr", TrainValue::Real},            {"--warmup", TrainValue::Count},
    {"--seed", TrainValue::Count},             {"--dropout", TrainValue::Real},
    {"--optimizer", TrainValue::Text},         {"--weight-decay", TrainValue::Real},
    {"--beta1", TrainValue::Real},             {"--beta2", TrainValue::Real},
    {"--momentum", TrainValue::Real},          {"--schedule", TrainValue::Text},
    {"--grad-clip", TrainValue::Real},         {"--vocab-size", TrainValue::PositiveInteger}};

struct Options {
  std::string data;
  std::vector<std::string> modes = kDefaultModes;
  std::string out;
  // The study's defaults: 4 layers of width 128 on tinyshakespeare, val loss ~2.1 after 600 steps (docs/amp.md
  // shows a run of the ten 16-bit modes, docs/low_precision.md of the fp8 ones). Every one can be overridden;
  // they go on the child's command line in this order.
  std::vector<std::pair<std::string, std::string>> train = {
      {"--layers", "4"},  {"--heads", "4"},        {"--width", "128"}, {"--block", "64"},
      {"--batch", "16"},  {"--steps", "600"},      {"--eval-every", "200"},
      {"--lr", "2e-3"},   {"--min-lr", "2e-4"},    {"--warmup", "50"}, {"--seed", "1337"}};
  int64_t steps = 600;  // --steps: each log must have this many lines
  bool sequential = false;
};

// "1 mode", "3 modes"
std::string count_text(size_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

fs::path self_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  check(!ec, "precision_study: cannot read /proc/self/exe (", ec.message(), ")");
  return exe.parent_path();
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, sep)) parts.push_back(part);
  if (!text.empty() && text.back() == sep) parts.push_back("");
  return parts;
}

std::string default_data() {
  // The shared data sits beside the main checkout (<root>/shared/data with the source in <root>/main); a
  // worktree one level deeper (<root>/wt/<name>) finds it one more level up.
  const fs::path source = MIXTAPE_SOURCE_DIR;
  const fs::path candidates[] = {source / ".." / "shared" / "data" / "tinyshakespeare.txt",
                                 source / ".." / ".." / "shared" / "data" / "tinyshakespeare.txt"};
  for (const fs::path& p : candidates)
    if (fs::is_regular_file(p)) return fs::weakly_canonical(p).string();
  fail("precision_study: no --data given and the default data is missing (looked for ",
       candidates[0].string(), " and ", candidates[1].string(), "); pass --data FILE");
}

// The value of a pass-through flag, checked as train_gpt's parser checks it (the same functions: a bad value
// is reported once, before any child runs, not by every child); --steps must be >= 1: a study needs a step to
// compare. Returns the integer for integer flags.
int64_t check_train_value(const cli::CommandLine& cli, const TrainFlag& flag, const std::string& value) {
  switch (flag.value) {
    case TrainValue::PositiveInteger: return integer_argument("precision_study", flag.name, value, 1);
    case TrainValue::Count: return integer_argument("precision_study", flag.name, value, 0);
    case TrainValue::Real: number_argument("precision_study", flag.name, value); return 0;
    case TrainValue::Text: cli.nonempty(flag.name, value); return 0;
  }
  return 0;
}

// --modes: comma-separated modes that AmpConfig knows, none twice (under any of its names).
std::vector<std::string> read_modes(const std::string& value) {
  std::vector<std::string> modes = split(value, ',');
  check(!modes.empty(), "precision_study: --modes needs at least one mode");
  std::map<std::string, std::string> seen;  // canonical name -> as written
  for (const std::string& mode : modes) {
    check(!mode.empty(), "precision_study: --modes '", value, "' has an empty entry");
    std::string name;  // canonical: "fp16_apex" is "fp16_apex:O1"
    try {
      name = AmpConfig::parse(mode).name();
    } catch (const Error& e) {
      fail("precision_study: --modes: unknown precision mode '", mode, "' (", e.what(), ")");
    }
    const auto [first, inserted] = seen.emplace(name, mode);
    check(inserted, "precision_study: --modes names '", name, "' twice (as '", first->second, "' and '", mode,
          "')");
  }
  return modes;
}

// The modes --modes takes by default, as its help lists them.
std::string default_modes_help() {
  std::string text;
  for (const std::string& mode : kDefaultModes) text += (text.empty() ? "" : ",") + mode;
  return text;
}

void add_study_options(cli::CommandLine& cli, Options& o) {
  cli.text("--data", o.data, "FILE", "training text (or .bin with --vocab-size); default: "
           "../shared/data/tinyshakespeare.txt beside the source tree", "a file name");
  cli.add("--modes", [&o](const std::string& value) { o.modes = read_modes(value); }, "LIST",
          "comma-separated precision modes (default: all ten: " + default_modes_help() + ")");
  cli.text("--out", o.out, "DIR", "output directory (default: <build>/precision_study): results.md, results.csv, "
           "<mode>.jsonl and precision_study.png (loss curves and loss scale per mode)", "a directory");
}

// The pass-through flags, each value checked (and kept in `given`, by flag) as it is read.
void add_train_options(cli::CommandLine& cli, Options& o, std::map<std::string, std::string>& given) {
  cli.app.option_defaults()->group("passed to every train_gpt run");
  for (const TrainFlag& flag : kTrainFlags) {
    std::string help = "train_gpt's " + std::string(flag.name);
    for (const auto& [name, value] : o.train)
      if (name == flag.name) help += " (default " + value + ")";
    if (std::string_view(flag.name) == "--steps") help += "; >= 1";
    cli.add(flag.name, [&cli, &o, &given, flag](const std::string& value) {
      const int64_t number = check_train_value(cli, flag, value);
      if (std::string_view(flag.name) == "--steps") o.steps = number;
      given[flag.name] = value;
    }, flag.value == TrainValue::Text ? "TEXT" : flag.value == TrainValue::Real ? "X" : "N", help);
  }
  cli.flag("--sequential", o.sequential, true, "train_gpt's --sequential");
}

// The child's train_gpt flags: the study's defaults in their order, each replaced by its given value, then the
// other given flags in the order of the command line.
void set_train_flags(Options& o, const CLI::App& app, std::map<std::string, std::string>& given) {
  for (auto& [flag, value] : o.train)
    if (const auto it = given.find(flag); it != given.end()) {
      value = it->second;
      given.erase(it);
    }
  for (const CLI::Option* option : app.parse_order())
    if (const auto it = given.find(option->get_name()); it != given.end()) {
      o.train.emplace_back(it->first, it->second);
      given.erase(it);
    }
}

// The options of the command line, or none when it asked for --help (printed).
std::optional<Options> parse(int argc, char** argv) {
  Options o;
  cli::CommandLine cli("precision_study", "precision_study: one GPT, one data set, one seed, trained once under "
                       "each precision mode (train_gpt, a process per mode), and a comparison");
  cli.help_on_unknown = false;
  cli.unknown_message = [](const std::string& arg) {
    return "precision_study: unknown option '" + arg + "'" +
           (arg == "--precision" || arg == "--amp-config" || arg == "--log-json"
                ? " (set per mode by precision_study; choose the modes with --modes)"
                : " (see --help)");
  };
  cli.repeated_message = [](const CLI::Option&, const std::string& written) {
    return "precision_study: " + written + " given twice";
  };
  add_study_options(cli, o);
  std::map<std::string, std::string> given;
  add_train_options(cli, o, given);
  if (!cli.parse(argc, argv)) return std::nullopt;
  set_train_flags(o, cli.app, given);
  if (o.data.empty()) o.data = default_data();
  check(fs::is_regular_file(o.data), "precision_study: --data '", o.data, "' is not a readable file");
  if (o.out.empty()) o.out = (self_dir().parent_path() / "precision_study").string();
  return o;
}

// ---- interruption: SIGINT, SIGTERM and SIGHUP ----

// What the signal handler must clean up: the running child (killed and reaped) and the temporary file being
// written (removed). The only global mutable state here, because a signal handler can reach nothing else;
// lock-free atomics, so the handler reads them safely at any point.
std::atomic<pid_t> g_child{0};
std::atomic<const char*> g_temp{nullptr};
static_assert(std::atomic<pid_t>::is_always_lock_free && std::atomic<const char*>::is_always_lock_free);
// SIGPIPE too: `precision_study | head` closes the pipe it prints to, and the write that finds it closed must
// not leave the child and a temporary file behind.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};

// Async-signal-safe: only kill, waitpid, unlink, write and _exit.
extern "C" void on_stop_signal(int sig) {
  const pid_t child = g_child.load();
  if (child > 0) {
    kill(child, SIGKILL);
    while (waitpid(child, nullptr, 0) < 0 && errno == EINTR) {}
  }
  if (const char* temp = g_temp.load()) unlink(temp);
  static const char note[] = "\nprecision_study: interrupted: stopped the running child and removed its "
                             "temporary file\n";
  [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, note, sizeof note - 1);
  _exit(128 + sig);
}

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  for (int sig : kStopSignals) sigaddset(&action.sa_mask, sig);  // one cleanup, not one per signal
  for (int sig : kStopSignals) {
    struct sigaction old {};
    sigaction(sig, nullptr, &old);
    if (old.sa_handler == SIG_IGN) continue;  // ignored when we started (nohup, a background job): stays so
    check(sigaction(sig, &action, nullptr) == 0, "precision_study: sigaction failed: ", std::strerror(errno));
  }
}

// Blocks the stop signals while alive (a signal that comes meanwhile is handled when it ends): for the
// moments when g_child is out of step with the truth, between a spawn and its store or a reap and its reset.
class StopSignalsBlocked {
 public:
  StopSignalsBlocked() {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : kStopSignals) sigaddset(&set, sig);
    pthread_sigmask(SIG_BLOCK, &set, &old_);
  }
  ~StopSignalsBlocked() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  const sigset_t& old_mask() const { return old_; }
  StopSignalsBlocked(const StopSignalsBlocked&) = delete;
  StopSignalsBlocked& operator=(const StopSignalsBlocked&) = delete;

 private:
  sigset_t old_;
};

// ---- files ----

std::string file_stem(const std::string& mode) {
  std::string s = mode;
  std::replace(s.begin(), s.end(), ':', '_');
  return s;
}

// A temporary file (written by us or by a child) that becomes `target` by a rename only once it is complete:
// removed if it is not renamed (an error on the way) and by the stop-signal handler. One at a time.
class TempFile {
 public:
  explicit TempFile(const fs::path& target) : target_(target), path_(target.string() + ".tmp") {
    std::error_code ec;
    fs::remove(path_, ec);  // left by an earlier run that was killed outright
    const char* expected = nullptr;
    check(g_temp.compare_exchange_strong(expected, path_.c_str()),
          "precision_study: internal error: two temporary files at once (", path_.string(), ")");
  }
  ~TempFile() {
    std::error_code ec;
    if (!renamed_) fs::remove(path_, ec);
    g_temp.store(nullptr);  // after the removal: a signal in between unlinks a missing file, harmlessly
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  const fs::path& path() const { return path_; }
  void rename_into_place() {
    std::error_code ec;
    fs::rename(path_, target_, ec);
    check(!ec, "precision_study: cannot rename '", path_.string(), "' to '", target_.string(), "' (",
          ec.message(), ")");
    renamed_ = true;
  }

 private:
  fs::path target_, path_;
  bool renamed_ = false;
};

// Writes `path` complete or not at all: a temporary file beside it, then a rename over it.
void write_file(const fs::path& path, const std::string& text) {
  TempFile tmp(path);
  {
    std::ofstream f(tmp.path(), std::ios::binary | std::ios::trunc);
    check(f.good(), "precision_study: cannot write '", tmp.path().string(), "'");
    f << text;
    f.flush();
    check(f.good(), "precision_study: writing '", tmp.path().string(), "' failed");
  }
  tmp.rename_into_place();
}

// ---- child processes ----

struct ChildResult {
  int status = 0;                // as from waitpid
  double seconds = 0;
  std::deque<std::string> tail;  // the last lines of its output, for error messages
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// Starts args[0] (a path) with its stdout and stderr into `out` (a pipe's write end): 0 with its pid in `pid`,
// or posix_spawn's error. The child is g_child from the moment it exists, for the stop-signal handler.
int spawn_child(const std::vector<std::string>& args, int out, pid_t& pid) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out, STDOUT_FILENO);  // dup2 clears O_CLOEXEC on the copy
  posix_spawn_file_actions_adddup2(&actions, out, STDERR_FILENO);
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int err = 0;
  {
    // A stop signal between the spawn and the store would leave the child running: it waits for the store.
    // The child starts with our usual mask (the handlers themselves become SIG_DFL at its exec).
    StopSignalsBlocked blocked;
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigmask(&attr, &blocked.old_mask());
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
    err = posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), environ);
    posix_spawnattr_destroy(&attr);
    if (err == 0) g_child.store(pid);
  }
  posix_spawn_file_actions_destroy(&actions);
  return err;
}

// Each line read from `in` until its end goes to our stdout behind `prefix`; the last 8 are kept in `tail`.
void stream_lines(int in, const std::string& prefix, std::deque<std::string>& tail) {
  std::string pending;
  auto emit = [&](const std::string& line) {
    std::printf("%s%s\n", prefix.c_str(), line.c_str());
    std::fflush(stdout);
    tail.push_back(line);
    if (tail.size() > 8) tail.pop_front();
  };
  char buffer[4096];
  for (;;) {
    const ssize_t n = read(in, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buffer, static_cast<size_t>(n));
    for (size_t nl; (nl = pending.find('\n')) != std::string::npos; pending.erase(0, nl + 1))
      emit(pending.substr(0, nl));
  }
  if (!pending.empty()) emit(pending);
}

// The child's status (as from waitpid) once it ended. Waits for its end without reaping it (the handler can
// still kill and reap it), then reaps it and forgets it with the stop signals blocked, so the handler never
// sees a reaped (possibly reused) pid.
int reap_child(pid_t pid, const std::string& path) {
  siginfo_t info{};
  while (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) < 0 && errno == EINTR) {}
  pid_t waited;
  int status = 0;
  {
    StopSignalsBlocked blocked;
    while ((waited = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {}
    g_child.store(0);
  }
  check(waited == pid, "precision_study: waitpid for '", path, "' failed: ", std::strerror(errno));
  return status;
}

// Runs args[0] (a path) with its stdout and stderr into one pipe, so its lines keep their order; each line
// goes to our stdout behind `prefix`, and the last 8 are kept for an error message.
ChildResult run_child(const std::vector<std::string>& args, const std::string& prefix) {
  int fds[2];
  check(pipe2(fds, O_CLOEXEC) == 0, "precision_study: pipe failed: ", std::strerror(errno));
  const auto t0 = std::chrono::steady_clock::now();
  pid_t pid = 0;
  const int err = spawn_child(args, fds[1], pid);
  close(fds[1]);
  if (err != 0) {
    close(fds[0]);
    fail("precision_study: cannot start '", args[0], "': ", std::strerror(err));
  }
  ChildResult result;
  stream_lines(fds[0], prefix, result.tail);
  close(fds[0]);
  result.status = reap_child(pid, args[0]);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

// ---- the logs and their summary ----

struct StepLog {
  int64_t step = 0;
  double loss = NAN, loss_scale = NAN, tokens_per_s = NAN, val_loss = NAN;
  bool evaluated = false;  // has a val_loss (a number, or null when it was not finite)
  bool skipped = false;
  std::optional<int64_t> peak_rss_kib;  // train_gpt's VmHWM so far, where its log has it
  // The fp8 and block-scaled modes' "fp8" entry: per tensor kind (activation, weight, gradient) the values
  // quantized in the step and how many saturated and flushed to zero; fp8_delayed's "fp8_scales".
  struct Quantized {
    double values = 0, saturated = 0, flushed = 0;  // counts (the log's fractions times its values)
  };
  std::optional<std::array<Quantized, 3>> quantized;
  std::optional<std::array<double, 3>> delayed_scales;
};

constexpr std::array<const char*, 3> kTensorKinds = {"activation", "weight", "gradient"};

struct ModeResult {
  std::string mode;
  bool ok = false;
  std::string error;  // why it failed
  std::vector<StepLog> steps;
  double final_train_loss = NAN, tokens_per_s = NAN, final_loss_scale = NAN, seconds = 0;
  std::optional<double> final_val_loss;  // absent when no step evaluated
  std::optional<double> peak_rss_mib;    // absent when the log has no peak_rss_kib
  int64_t skipped = 0;
};

// Reads and checks a train_gpt log before it is renamed into place: a JSON object per line, steps 0, 1, ...,
// one per step of the run.
std::vector<StepLog> read_log(const fs::path& path, int64_t expected_steps) {
  std::ifstream in(path);
  check(in.good(), "precision_study: cannot read the log '", path.string(), "'");
  std::vector<StepLog> steps;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    try {
      const Json v = json::parse(line);
      StepLog s;
      const Json* step = json::find(v, "step");
      check(step != nullptr, "no \"step\"");
      s.step = json::as_integer(*step);
      check(s.step == static_cast<int64_t>(steps.size()), "step ", s.step, ", expected ", steps.size());
      s.loss = log_number(json::find(v, "loss"));
      s.loss_scale = log_number(json::find(v, "loss_scale"));
      s.tokens_per_s = log_number(json::find(v, "tokens_per_s"));
      const Json* val_loss = json::find(v, "val_loss");
      s.evaluated = val_loss != nullptr;
      s.val_loss = log_number(val_loss);
      const Json* skipped = json::find(v, "skipped");
      s.skipped = skipped && json::as_bool(*skipped);
      if (const Json* fp8 = json::find(v, "fp8")) {
        std::array<StepLog::Quantized, 3> q;
        for (size_t k = 0; k < q.size(); ++k) {
          const Json* kind = json::find(*fp8, kTensorKinds[k]);
          check(kind != nullptr, "\"fp8\" has no \"", kTensorKinds[k], "\"");
          q[k].values = log_number(json::find(*kind, "values"));
          q[k].saturated = log_number(json::find(*kind, "saturated")) * q[k].values;
          q[k].flushed = log_number(json::find(*kind, "flushed")) * q[k].values;
        }
        s.quantized = q;
      }
      if (const Json* scales = json::find(v, "fp8_scales")) {
        std::array<double, 3> d;
        for (size_t k = 0; k < d.size(); ++k) d[k] = log_number(json::find(*scales, kTensorKinds[k]));
        s.delayed_scales = d;
      }
      if (const Json* rss = json::find(v, "peak_rss_kib"); rss && !rss->is_null()) {
        s.peak_rss_kib = json::as_integer(*rss);
        check(*s.peak_rss_kib > 0, "peak_rss_kib ", *s.peak_rss_kib, " is not a positive size");
      }
      steps.push_back(s);
    } catch (const Error& e) {
      fail("precision_study: ", path.string(), " line ", number, ": ", e.what());
    }
  }
  check(static_cast<int64_t>(steps.size()) == expected_steps, "precision_study: the log '", path.string(),
        "' has ", count_text(steps.size(), "step"), ", expected ", expected_steps, " (--steps)");
  return steps;
}

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

void summarise(ModeResult& r) {
  const std::vector<StepLog>& s = r.steps;
  const size_t first = s.size() > kFinalTrainSteps ? s.size() - kFinalTrainSteps : 0;
  double sum = 0;
  for (size_t i = first; i < s.size(); ++i) sum += s[i].loss;  // a NaN loss makes the mean NaN: visible
  r.final_train_loss = sum / double(s.size() - first);
  for (const StepLog& step : s)  // the last evaluation's, NaN included: not an earlier, finite one
    if (step.evaluated) r.final_val_loss = step.val_loss;
  std::vector<double> rates;
  for (const StepLog& step : s) rates.push_back(step.tokens_per_s);
  r.tokens_per_s = median(rates);
  r.skipped = std::count_if(s.begin(), s.end(), [](const StepLog& step) { return step.skipped; });
  r.final_loss_scale = s.back().loss_scale;
  for (const StepLog& step : s)  // a high-water mark only grows; the maximum all the same
    if (step.peak_rss_kib) r.peak_rss_mib = std::max(r.peak_rss_mib.value_or(0), *step.peak_rss_kib / 1024.0);
}

// ---- tables ----

// A difference with `digits` decimals, never a negative zero: -0.00001 rounds to "0.0000", not "-0.0000".
std::string difference(double x, int digits) {
  const std::string text = fixed_text(x, digits);
  if (!std::isfinite(x)) return text;
  return text.find_first_not_of("-0.") == std::string::npos ? text.substr(text[0] == '-') : text;
}

// Cells as in results.csv; empty: not applicable (no fp32 reference, no peak RSS in the log).
struct Row {
  std::string mode, train, val, diff, diff_pct, rate, rss, skipped, scale;
};

std::vector<Row> table_rows(const std::vector<ModeResult>& results) {
  std::optional<double> reference;
  for (const ModeResult& r : results)
    if (r.ok && AmpConfig::parse(r.mode).mode == PrecisionMode::Fp32) reference = r.final_val_loss;
  std::vector<Row> rows;
  for (const ModeResult& r : results) {
    if (!r.ok) continue;
    Row row;
    row.mode = r.mode;
    row.train = fixed_text(r.final_train_loss, 4);
    if (r.final_val_loss) row.val = fixed_text(*r.final_val_loss, 4);
    if (r.final_val_loss && reference) {  // from the unrounded losses
      row.diff = difference(*r.final_val_loss - *reference, 4);
      row.diff_pct = difference((*r.final_val_loss - *reference) / *reference * 100.0, 2);
    }
    row.rate = fixed_text(r.tokens_per_s, 0);
    if (r.peak_rss_mib) row.rss = fixed_text(*r.peak_rss_mib, 1);
    row.skipped = std::to_string(r.skipped);
    row.scale = std::isfinite(r.final_loss_scale) ? exact_number_text(r.final_loss_scale)
                                                   : fixed_text(r.final_loss_scale, 0);
    rows.push_back(row);
  }
  return rows;
}

std::string csv_table(const std::vector<Row>& rows) {
  std::string out =
      "mode,final_train_loss,final_val_loss,val_diff_vs_fp32,val_diff_vs_fp32_pct,tokens_per_s,peak_rss_mib,"
      "skipped_steps,final_loss_scale\n";
  for (const Row& r : rows)
    out += r.mode + "," + r.train + "," + r.val + "," + r.diff + "," + r.diff_pct + "," + r.rate + "," +
           r.rss + "," + r.skipped + "," + r.scale + "\n";
  return out;
}

std::string markdown_table(const std::vector<Row>& rows) {
  const std::vector<std::string> header = {"mode",          "final train loss", "final val loss",
                                           "val diff vs fp32", "val diff vs fp32 (%)", "tokens/s",
                                           "peak RSS (MiB)", "skipped steps",    "final loss scale"};
  std::vector<std::vector<std::string>> cells;
  for (const Row& r : rows) {
    auto dash = [](const std::string& s) { return s.empty() ? std::string("—") : s; };
    // A difference shows its sign, zero included ("+0.0000"): difference() never writes "-0.0000".
    auto sign = [&](const std::string& s) {
      return s.empty() || s[0] == '-' || s == "nan" ? dash(s) : "+" + s;
    };
    cells.push_back({r.mode, dash(r.train), dash(r.val), sign(r.diff), sign(r.diff_pct), dash(r.rate),
                     dash(r.rss), r.skipped, dash(r.scale)});
  }
  std::vector<size_t> width(header.size());
  auto length = [](const std::string& s) {  // display width: count UTF-8 lead bytes ("—" is one column)
    return static_cast<size_t>(std::count_if(s.begin(), s.end(), [](char c) { return (c & 0xC0) != 0x80; }));
  };
  for (size_t c = 0; c < header.size(); ++c) {
    width[c] = length(header[c]);
    for (const auto& row : cells) width[c] = std::max(width[c], length(row[c]));
  }
  auto line = [&](const std::vector<std::string>& values) {
    std::string out = "|";
    for (size_t c = 0; c < values.size(); ++c) {
      const std::string pad(width[c] - length(values[c]), ' ');
      out += ' ';
      if (c == 0) out.append(values[c]).append(pad);  // the mode left-aligned, numbers right-aligned
      else out.append(pad).append(values[c]);
      out += " |";
    }
    return out + "\n";
  };
  std::string out = line(header) + "|";
  for (size_t c = 0; c < header.size(); ++c) {
    out += c == 0 ? " :" : " ";
    out.append(width[c] - 1, '-');
    out += c == 0 ? " |" : ": |";
  }
  out += "\n";
  for (const auto& row : cells) out += line(row);
  return out;
}

// The fp8 modes' quantization over the whole run: per mode and tensor kind, the percentage of the values
// quantized that saturated and that flushed to zero. Empty when no mode quantized.
std::string quantization_table(const std::vector<ModeResult>& results) {
  std::string out;
  for (const ModeResult& r : results) {
    if (!r.ok) continue;
    std::array<StepLog::Quantized, 3> total{};
    bool any = false;
    for (const StepLog& step : r.steps)
      if (step.quantized) {
        any = true;
        for (size_t k = 0; k < total.size(); ++k) {
          total[k].values += (*step.quantized)[k].values;
          total[k].saturated += (*step.quantized)[k].saturated;
          total[k].flushed += (*step.quantized)[k].flushed;
        }
      }
    if (!any) continue;
    out += "| " + r.mode;
    for (const StepLog::Quantized& q : total) {
      const double n = q.values > 0 ? q.values : 1;
      out += " | " + fixed_text(100 * q.saturated / n, 4) + " | " + fixed_text(100 * q.flushed / n, 4);
    }
    out += " |\n";
  }
  if (out.empty()) return out;
  return "\nQuantization over training (% of the values quantized; the fp8 and block-scaled modes):\n\n"
         "| mode | activations saturated | activations flushed | weights saturated | weights flushed | "
         "gradients saturated | gradients flushed |\n"
         "| :-- | --: | --: | --: | --: | --: | --: |\n" + out;
}

// ---- the plot ----

// The trailing mean of the last kSmooth finite training losses at each step.
std::vector<double> smoothed_losses(const ModeResult& r) {
  std::vector<double> out;
  std::deque<double> window;
  double sum = 0;
  for (const StepLog& step : r.steps) {
    if (std::isfinite(step.loss)) {
      window.push_back(step.loss);
      sum += step.loss;
      if (window.size() > kSmooth) { sum -= window.front(); window.pop_front(); }
    }
    out.push_back(window.empty() ? NAN : sum / double(window.size()));
  }
  return out;
}

// The panels the study adds when it has them: each mode's smoothed training loss minus fp32's (with fp32 in
// the study), and for the fp8 and block-scaled modes the fraction of each step's gradient values that flushed
// to zero, the fraction of its values (every kind) that saturated, and fp8_delayed's scales of its first Linear.
std::vector<plot::Panel> comparison_panels(const std::vector<ModeResult>& results) {
  std::vector<plot::Panel> panels;
  const ModeResult* fp32 = nullptr;
  for (const ModeResult& r : results)
    if (r.ok && AmpConfig::parse(r.mode).mode == PrecisionMode::Fp32) fp32 = &r;
  plot::Panel diff{.title = "training loss minus fp32's (trailing means of " + std::to_string(kSmooth) + " steps)",
                   .x_label = "step", .y_label = "loss difference"};
  plot::Panel flushed{.title = "fp8 and fp4: gradient values flushed to zero (fraction of each step's)",
                      .x_label = "step", .y_label = "fraction"};
  plot::Panel saturated{.title = "fp8 and fp4: values saturated (fraction of each step's, all kinds)",
                        .x_label = "step", .y_label = "fraction"};
  plot::Panel scales{.title = "fp8_delayed: the scales of its first Linear (log2 axis)", .x_label = "step",
                     .y_label = "scale", .log2_y = true};
  const std::vector<double> reference = fp32 ? smoothed_losses(*fp32) : std::vector<double>{};
  size_t index = 0;
  for (const ModeResult& r : results) {
    if (!r.ok) continue;
    const plot::Rgb colour = plot::palette()[index++ % plot::palette().size()];
    if (fp32 && &r != fp32 && r.steps.size() == reference.size()) {
      plot::Series d{.label = r.mode, .colour = colour};
      const std::vector<double> mine = smoothed_losses(r);
      for (size_t i = 0; i < mine.size(); ++i) {
        d.x.push_back(static_cast<double>(i + 1));
        d.y.push_back(mine[i] - reference[i]);
      }
      diff.series.push_back(std::move(d));
    }
    if (r.steps.empty() || !r.steps.front().quantized) continue;
    plot::Series f{.label = r.mode, .colour = colour}, s{.label = r.mode, .colour = colour};
    for (const StepLog& step : r.steps) {
      const double x = static_cast<double>(step.step + 1);
      const auto& q = *step.quantized;
      const double gradient_values = q[2].values > 0 ? q[2].values : 1;
      double all = 0, sat = 0;
      for (const StepLog::Quantized& k : q) {
        all += k.values;
        sat += k.saturated;
      }
      f.x.push_back(x);
      f.y.push_back(q[2].flushed / gradient_values);
      s.x.push_back(x);
      s.y.push_back(sat / (all > 0 ? all : 1));
    }
    flushed.series.push_back(std::move(f));
    saturated.series.push_back(std::move(s));
    if (!r.steps.front().delayed_scales) continue;
    for (size_t k = 0; k < kTensorKinds.size(); ++k) {
      plot::Series sc{.label = r.mode + " " + kTensorKinds[k], .colour = plot::palette()[k], .dash = static_cast<int>(k)};
      for (const StepLog& step : r.steps) {
        sc.x.push_back(static_cast<double>(step.step + 1));
        sc.y.push_back(step.delayed_scales ? (*step.delayed_scales)[k] : NAN);
      }
      scales.series.push_back(std::move(sc));
    }
  }
  for (plot::Panel* p : {&diff, &flushed, &saturated, &scales})
    if (!p->series.empty()) panels.push_back(std::move(*p));
  return panels;
}

// Two panels, a curve per successful mode in --modes order: the training loss (trailing mean of the last
// kSmooth finite losses) and the loss scale, against optimizer steps done (the log's 0-based step + 1); then
// comparison_panels'.
plot::Chart plot_chart(const std::vector<ModeResult>& results, const std::string& title) {
  plot::Panel loss{.title = "training loss (trailing mean of " + std::to_string(kSmooth) + " steps)",
                   .x_label = "step", .y_label = "loss (nats per token)"};
  plot::Panel scale{.title = "loss scale (log2 axis)", .x_label = "step", .y_label = "loss scale",
                    .log2_y = true};
  size_t index = 0;
  for (const ModeResult& r : results) {
    if (!r.ok) continue;
    const plot::Rgb colour = plot::palette()[index % plot::palette().size()];
    plot::Series l{.label = r.mode, .colour = colour};
    // Dashed scale curves: modes with the same scale overlap, and the dashes keep each one visible.
    plot::Series s{.label = r.mode, .colour = colour, .dash = static_cast<int>(index % 5)};
    const std::vector<double> smoothed = smoothed_losses(r);
    for (size_t i = 0; i < r.steps.size(); ++i) {
      const StepLog& step = r.steps[i];
      const double x = static_cast<double>(step.step + 1);
      l.x.push_back(x);
      l.y.push_back(smoothed[i]);
      s.x.push_back(x);
      s.y.push_back(step.loss_scale);
    }
    loss.series.push_back(std::move(l));
    scale.series.push_back(std::move(s));
    ++index;
  }
  // The scale axis: one power of two of headroom below 1 (the modes without a scaler log 1) and above the
  // largest scale, so that no trace runs along the frame.
  double top = 1;
  for (const plot::Series& s : scale.series)
    for (double y : s.y)
      if (std::isfinite(y)) top = std::max(top, y);
  scale.y_min = 0.5;
  scale.y_max = std::exp2(std::ceil(std::log2(top)) + 1);
  std::vector<plot::Panel> panels = {loss, scale};
  for (plot::Panel& p : comparison_panels(results)) panels.push_back(std::move(p));
  return plot::Chart{.width = 1000, .height = 500 * static_cast<int>(panels.size()), .title = title,
                     .panels = panels};
}

// ---- main ----

// The study's files (and their temporary names) must not be its data: a table or a mode's log written over
// the corpus left exit code 0 and the corpus lost, and a later mode trained on the earlier one's log.
void check_data_is_no_output(const Options& opt) {
  const fs::path out = opt.out;
  std::vector<fs::path> outputs = {out / "results.md", out / "results.csv", out / "precision_study.png"};
  for (const std::string& mode : opt.modes) outputs.push_back(out / (file_stem(mode) + ".jsonl"));
  for (const fs::path& output : outputs)
    for (const std::string& file : {output.string(), output.string() + ".tmp"})
      check(!same_file(opt.data, file), "precision_study: --data '", opt.data, "' is '", file,
            "', a file the study writes (--out '", out.string(), "'): it would overwrite what it trains on");
}

// The train_gpt arguments every mode shares, and their text for the output and results.md.
struct ChildFlags {
  std::vector<std::string> args;
  std::string text;
};

ChildFlags child_flags(const Options& opt) {
  ChildFlags flags{.args = {"--data", opt.data}, .text = ""};
  for (const auto& [flag, value] : opt.train) {
    flags.args.push_back(flag);
    flags.args.push_back(value);
    flags.text += " " + flag + " " + value;
  }
  if (opt.sequential) { flags.args.push_back("--sequential"); flags.text += " --sequential"; }
  return flags;
}

// Mode k of the study: train_gpt with its log in a temporary file, renamed into place once the run succeeded
// and its log checks out. A failure is the result's error (the other modes still run).
ModeResult run_mode(const Options& opt, const fs::path& train_gpt, const ChildFlags& flags, size_t k,
                    size_t prefix_width) {
  ModeResult r;
  r.mode = opt.modes[k];
  const fs::path log = fs::path(opt.out) / (file_stem(r.mode) + ".jsonl");
  std::printf("\n=== [%zu/%zu] %s\n", k + 1, opt.modes.size(), r.mode.c_str());
  std::fflush(stdout);
  std::string prefix = "[" + r.mode + "]";
  prefix += std::string(prefix_width - prefix.size() + 1, ' ');
  try {
    TempFile log_tmp(log);  // renamed once the run succeeded and its log checks out; removed otherwise
    std::vector<std::string> args = {train_gpt.string()};
    args.insert(args.end(), flags.args.begin(), flags.args.end());
    args.insert(args.end(), {"--precision", r.mode, "--log-json", log_tmp.path().string()});
    const ChildResult child = run_child(args, prefix);
    r.seconds = child.seconds;
    if (child.status != 0) {
      std::string last;
      for (const std::string& l : child.tail) last += "\n    " + l;
      fail("train_gpt --precision ", r.mode, " failed (", describe_status(child.status),
           "); its last output:", last);
    }
    r.steps = read_log(log_tmp.path(), opt.steps);
    log_tmp.rename_into_place();
    summarise(r);
    r.ok = true;
    const std::string val = r.final_val_loss ? fixed_text(*r.final_val_loss, 4) : "none";
    const std::string rss = r.peak_rss_mib ? fixed_text(*r.peak_rss_mib, 1) + " MiB" : "not in the log";
    std::printf("%sdone in %.0f s: final val loss %s, median %.0f tok/s, peak RSS %s, %lld skipped\n",
                prefix.c_str(), r.seconds, val.c_str(), r.tokens_per_s, rss.c_str(),
                static_cast<long long>(r.skipped));
  } catch (const std::exception& e) {
    r.error = e.what();
    std::printf("%sFAILED: %s\n", prefix.c_str(), r.error.c_str());  // the summary error follows on stderr
  }
  std::fflush(stdout);
  return r;
}

// results.md, results.csv and the plot of the modes that succeeded; the table is printed too.
void write_results(const Options& opt, const std::vector<ModeResult>& results, const std::vector<std::string>& failed,
                   const std::string& flags_text) {
  const fs::path out = opt.out;
  const std::vector<Row> rows = table_rows(results);
  const std::string table = markdown_table(rows);
  const std::string notes =
      "\nfinal train loss: mean of the last 10 steps' batch losses; final val loss: after the last step; "
      "val diff: vs fp32's final val loss, computed from the unrounded losses (so it may differ in the last "
      "digit from the difference of the rounded losses shown); tokens/s: median of the per-step rates; "
      "peak RSS: the train_gpt process's own peak resident memory (VmHWM, its log's peak_rss_kib); "
      "final loss scale: the last step's, exact; nan: a value that was not finite (the mode diverged).\n";
  const std::string quantization = quantization_table(results);
  std::string md = "# Precision study\n\n"
                   "One GPT, one data set, one seed, trained once per precision mode (train_gpt --data " +
                   opt.data + flags_text + " --precision MODE).\n\n" + table + notes + quantization;
  if (!failed.empty()) {
    md += "\nFailed modes (not in the table):\n\n";
    for (const std::string& f : failed) md += "- " + f + "\n";
  }
  write_file(out / "results.md", md);
  write_file(out / "results.csv", csv_table(rows));
  const fs::path png = out / "precision_study.png";
  write_file(png, plot::encode_png(plot::render(plot_chart(results, "precision_study:" + flags_text))));

  std::printf("\n%s%s%s\nwrote %s, %s, %s\n", table.c_str(), notes.c_str(), quantization.c_str(),
              (out / "results.md").string().c_str(),
              (out / "results.csv").string().c_str(), png.string().c_str());
}

// The tables of the modes that succeeded, then an error naming the failed ones. When none succeeded nothing is
// written: the files of an earlier study stay as they were, not replaced by empty tables (and an --out
// directory made for this study goes again, if it is still empty).
void finish_study(const Options& opt, const std::vector<ModeResult>& results, bool created_out,
                  const std::string& flags_text) {
  const fs::path out = opt.out;
  std::vector<std::string> failed;
  for (const ModeResult& r : results)
    if (!r.ok) failed.push_back(r.mode + ": " + r.error);
  std::string failed_list;
  for (const std::string& f : failed) failed_list += "\n  " + f;
  std::error_code ec;
  if (failed.size() == results.size()) {
    if (created_out && fs::is_empty(out, ec)) fs::remove(out, ec);
    fail("precision_study: ", results.size() == 1 ? "the mode" : "all " + count_text(results.size(), "mode"),
         " failed, so nothing was written to '", out.string(), "':", failed_list);
  }
  // The new tables replace an earlier study's: a failed mode's log of that study would sit beside them as if
  // it were this one's.
  for (const ModeResult& r : results)
    if (!r.ok) fs::remove(out / (file_stem(r.mode) + ".jsonl"), ec);
  write_results(opt, results, failed, flags_text);
  if (!failed.empty())
    fail("precision_study: ", failed.size(), " of ", count_text(results.size(), "mode"), " failed:",
         failed_list);
}

int run(int argc, char** argv) {
  const std::optional<Options> parsed = parse(argc, argv);
  if (!parsed) return 0;  // --help
  const Options& opt = *parsed;
  const fs::path train_gpt = self_dir() / "train_gpt";
  check(access(train_gpt.c_str(), X_OK) == 0, "precision_study: cannot find the train_gpt executable next to "
        "this one (looked for ", train_gpt.string(), "); build it: cmake --build build --target train_gpt");
  check_data_is_no_output(opt);
  const fs::path out = opt.out;
  std::error_code ec;
  const bool created_out = fs::create_directories(out, ec);
  check(!ec && fs::is_directory(out), "precision_study: cannot create --out directory '", out.string(), "'",
        ec ? " (" + ec.message() + ")" : "");
  install_stop_handlers();

  const ChildFlags flags = child_flags(opt);
  size_t prefix_width = 0;
  for (const std::string& m : opt.modes) prefix_width = std::max(prefix_width, m.size() + 2);
  std::printf("precision_study: %s, train_gpt --data %s%s\n  writing to %s\n",
              count_text(opt.modes.size(), "mode").c_str(), opt.data.c_str(), flags.text.c_str(),
              out.string().c_str());
  std::fflush(stdout);
  std::vector<ModeResult> results;
  for (size_t k = 0; k < opt.modes.size(); ++k) results.push_back(run_mode(opt, train_gpt, flags, k, prefix_width));
  finish_study(opt, results, created_out, flags.text);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run_program(run, argc, argv); }
