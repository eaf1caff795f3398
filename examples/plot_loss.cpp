// plot_loss: the loss curve of a train_gpt run as a PNG, from its --log-json file.
//
//   plot_loss run.jsonl loss.png ["title"]
//
// Plots the training loss of every step (light), its centred mean over 51 steps (fewer at the ends, so the
// curve does not lag), and the validation loss at the steps that evaluated (points), in nats per token,
// against optimizer steps done (the log's 0-based step + 1). A resumed run appends to its log; where a
// resume repeated steps of an interrupted run, the later lines replace the earlier ones. A non-finite loss
// (null in the log) leaves a gap. The PNG (900 x 540) is drawn by train/plot.h and written complete or
// not at all.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "train/plot.h"
#include "train/training.h"
#include "io/json.h"
#include "tensor/error.h"

using namespace mixtape;

namespace {

constexpr int64_t kHalfWindow = 25;  // the centred mean spans 2 * 25 + 1 = 51 steps

struct Point {
  double loss = NAN;
  std::optional<double> val_loss = {};  // present when the step evaluated (NaN when it was not finite)
};

// Step -> its losses. A line whose step is not after the previous line's starts a resumed run: the steps
// from there on are replaced by the lines that follow.
std::map<int64_t, Point> read_log(const std::string& path) {
  std::ifstream in(path);
  check(in.good(), "plot_loss: cannot read the log '", path, "'");
  std::map<int64_t, Point> points;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    try {
      const Json v = json::parse(line);
      const Json* step = json::find(v, "step");
      check(step && step->is_number_integer() && step->get<int64_t>() >= 0, "no \"step\" (an integer >= 0)");
      check(json::find(v, "loss") != nullptr, "no \"loss\"");
      const int64_t s = json::as_integer(*step);
      points.erase(points.lower_bound(s), points.end());
      Point p{.loss = log_number(json::find(v, "loss"))};
      if (const Json* val = json::find(v, "val_loss")) p.val_loss = log_number(val);
      points[s] = p;
    } catch (const Error& e) {
      fail("plot_loss: ", path, " line ", number, ": ", e.what(), " (is it a train_gpt --log-json file?)");
    }
  }
  check(!points.empty(), "plot_loss: no training steps in '", path, "'");
  return points;
}

plot::Chart loss_chart(const std::map<int64_t, Point>& points, const std::string& title) {
  plot::Series batch{.label = "training loss (batch)", .colour = plot::parse_rgb("#c8d7ee"), .line_width = 1};
  plot::Series mean{.label = "training loss (centred mean of 51 steps)", .colour = plot::parse_rgb("#1f5fbf")};
  plot::Series val{.colour = plot::parse_rgb("#d9480f"), .points = true};
  std::vector<std::pair<double, double>> losses;  // (step done, loss), in step order
  for (const auto& [step, p] : points) {
    const double x = static_cast<double>(step + 1);
    losses.emplace_back(x, p.loss);
    if (p.val_loss) {
      val.x.push_back(x);
      val.y.push_back(*p.val_loss);
    }
  }
  const int64_t n = static_cast<int64_t>(losses.size());
  for (int64_t i = 0; i < n; ++i) {
    batch.x.push_back(losses[i].first);
    batch.y.push_back(losses[i].second);
    double sum = 0;
    int64_t count = 0;
    for (int64_t j = std::max<int64_t>(0, i - kHalfWindow); j <= std::min(n - 1, i + kHalfWindow); ++j)
      if (std::isfinite(losses[j].second)) { sum += losses[j].second; ++count; }
    mean.x.push_back(losses[i].first);
    mean.y.push_back(std::isfinite(losses[i].second) && count ? sum / double(count) : NAN);
  }
  val.label = "validation loss";
  if (!val.y.empty()) val.label += " (final " + fixed_text(val.y.back(), 4) + ")";
  plot::Panel panel{.x_label = "step", .y_label = "loss (nats per token)"};
  panel.series = {batch, mean};
  if (!val.x.empty()) panel.series.push_back(val);
  return plot::Chart{.width = 900, .height = 540, .title = title, .panels = {panel}};
}

int run(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << "usage: plot_loss LOG.jsonl OUT.png [TITLE]\n"
                   "  the training and validation loss of a train_gpt --log-json file as a PNG\n";
      return 0;
    }
  }
  check(argc == 3 || argc == 4, "plot_loss: expected LOG.jsonl OUT.png [TITLE] (see --help), got ",
        argc - 1, " arguments");
  const std::string log = argv[1], out = argv[2];
  const std::string title = argc == 4 ? argv[3] : "train_gpt";
  plot::write_png(loss_chart(read_log(log), title), out);
  std::printf("plot_loss: wrote %s\n", out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run_program(run, argc, argv); }
