#pragma once
// oneDNN's own execution times, read from its verbose log (ONEDNN_VERBOSE=1, or DNNL_VERBOSE=1 for older
// builds): one line per primitive execution,
//   onednn_verbose,exec,cpu,matmul,brg:avx512_core_bf16,undef,<memory descs>,<attrs>,,2048x256:256x768:2048x768,5.05
// whose last field is the execution time in ms and the one before it the problem (for a matmul: src:wei:dst
// dims). Newer oneDNN versions put more fields before "exec" (a version, "primitive", a timestamp); the
// engine kind and the primitive follow it in every version. bench_train_gpt --gemms runs mixtape and PyTorch
// (which bundles its own oneDNN) with the log on and sums it, so the GEMM time of both sides comes from the same
// clock, oneDNN's.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tensor/error.h"

namespace mixtape::bench {

struct OnednnTimes {
  struct Sum {
    int64_t calls = 0;
    double ms = 0;
  };
  Sum matmul;                         // matmuls with 2-D operands (the linear layers' GEMMs)
  Sum batched;                        // matmuls with batch dims (e.g. PyTorch's attention bmm)
  std::map<std::string, Sum> other;   // every other primitive, by name (eltwise, reorder, ...)
};

namespace onednn_verbose_detail {

inline std::vector<std::string_view> split(std::string_view line, char separator) {
  std::vector<std::string_view> fields;
  size_t start = 0;
  for (size_t at; (at = line.find(separator, start)) != std::string_view::npos; start = at + 1)
    fields.push_back(line.substr(start, at - start));
  fields.push_back(line.substr(start));
  return fields;
}

}  // namespace onednn_verbose_detail

// Sums the "exec" lines of `log`; every other line (the log's "info" and "create" lines, the program's own
// output) is skipped. An exec line whose time or problem cannot be read is an Error naming the line: a sum
// that silently dropped executions would understate a side's GEMM time.
inline OnednnTimes parse_onednn_verbose(std::string_view log) {
  using onednn_verbose_detail::split;
  OnednnTimes times;
  for (std::string_view line : split(log, '\n')) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.starts_with("onednn_verbose,") && !line.starts_with("dnnl_verbose,")) continue;
    const std::vector<std::string_view> fields = split(line, ',');
    size_t exec = 1;
    while (exec < fields.size() && fields[exec] != "exec") ++exec;
    if (exec == fields.size()) continue;  // info, create, ... lines
    auto bad = [&](const char* what) {
      fail("oneDNN verbose log: ", what, " in the exec line '", std::string(line), "'");
    };
    if (fields.size() < exec + 5) bad("too few fields");
    const std::string time_text(fields.back());
    char* end = nullptr;
    const double ms = std::strtod(time_text.c_str(), &end);
    if (time_text.empty() || *end != '\0' || !(ms >= 0)) bad("no execution time (ms) as the last field");
    const std::string primitive(fields[exec + 2]);
    if (primitive != "matmul") {
      OnednnTimes::Sum& sum = times.other[primitive];
      ++sum.calls;
      sum.ms += ms;
      continue;
    }
    // The problem: src:wei:dst, each dims joined by 'x'; a src of 3 or more dims has batch dims.
    const std::string_view problem = fields[fields.size() - 2];
    const size_t colon = problem.find(':');
    if (colon == std::string_view::npos || colon == 0) bad("no matmul problem (src:wei:dst) before the time");
    const std::string_view src = problem.substr(0, colon);
    OnednnTimes::Sum& sum = split(src, 'x').size() >= 3 ? times.batched : times.matmul;
    ++sum.calls;
    sum.ms += ms;
  }
  return times;
}

}  // namespace mixtape::bench
