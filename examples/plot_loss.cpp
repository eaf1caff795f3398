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
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "train/command_line.h"
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

struct Arguments {
  std::string log, out, title = "train_gpt";
};

// The arguments of the command line, or none when it asked for --help (printed).
std::optional<Arguments> parse(int argc, char** argv) {
  Arguments a;
  cli::CommandLine cli("plot_loss", "plot_loss: the training and validation loss of a train_gpt --log-json file "
                       "as a PNG");
  cli.help_on_unknown = false;
  const std::string count = "plot_loss: expected LOG.jsonl OUT.png [TITLE] (see --help), got " +
                            std::to_string(argc - 1) + " arguments";
  cli.unknown_message = [&count](const std::string& arg) {
    return arg.starts_with("-") ? "plot_loss: unknown option '" + arg + "'" : count;
  };
  cli.required(cli.app.add_option("log", a.log, "train_gpt's --log-json file")->type_name("LOG.jsonl"), count);
  cli.required(cli.app.add_option("out", a.out, "the PNG to write (900 x 540)")->type_name("OUT.png"), count);
  cli.app.add_option("title", a.title, "the chart's title (default train_gpt)")->type_name("TITLE");
  if (!cli.parse(argc, argv)) return std::nullopt;
  return a;
}

int run(int argc, char** argv) {
  const std::optional<Arguments> a = parse(argc, argv);
  if (!a) return 0;  // --help
  plot::write_png(loss_chart(read_log(a->log), a->title), a->out);
  std::printf("plot_loss: wrote %s\n", a->out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run_program(run, argc, argv); }
