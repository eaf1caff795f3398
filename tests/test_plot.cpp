// The PNG line charts of train/plot.h. Ticks against the properties the header promises; chart geometry read
// back from the pixels (curves are antialiased, so their colour is looked for within a tolerance; the frame
// and the point markers cover whole pixels exactly); PNG files decoded back by cairo and by an independent
// decoder (Python's zlib, through tests/check_png.py); every documented error, word for word.
#include <cairo.h>
#include <gtest/gtest.h>
#include <stdlib.h>  // mkdtemp

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "train/plot.h"
#include "tensor/error.h"

namespace mixtape::plot {
namespace {

namespace fs = std::filesystem;

constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kRed{255, 0, 0}, kGreen{0, 160, 0}, kBlue{0, 0, 255};

// Whether pixel p shows colour c: each channel within `tolerance`. 64 asks for a curve's core: a pixel at
// least three quarters covered, blended over white or the grid.
bool shows(Rgb p, Rgb c, int tolerance = 64) {
  return std::abs(p.r - c.r) <= tolerance && std::abs(p.g - c.g) <= tolerance &&
         std::abs(p.b - c.b) <= tolerance;
}

// How much of colour c (not a grey) pixel p carries, blended over any grey (white, the grid, black text):
// 1 for c itself, 0 for a grey. A grey adds the same to every channel, so the channels c differs in most
// differ in p by c's share of it.
double tint(Rgb p, Rgb c) {
  const int pixel[3] = {p.r, p.g, p.b}, colour[3] = {c.r, c.g, c.b};
  int i = 0, j = 1;
  for (auto [a, b] : {std::pair{0, 2}, std::pair{1, 2}})
    if (std::abs(colour[a] - colour[b]) > std::abs(colour[i] - colour[j])) i = a, j = b;
  return static_cast<double>(pixel[i] - pixel[j]) / (colour[i] - colour[j]);
}

// Whether any pixel of column x in rows [y0, y1] shows colour c; or carries a quarter of it (tinted): a
// curve's antialiased fringe included.
bool column_has(const Image& image, int x, int y0, int y1, Rgb c, int tolerance = 64) {
  for (int y = y0; y <= y1; ++y)
    if (shows(image.at(x, y), c, tolerance)) return true;
  return false;
}
bool column_tinted(const Image& image, int x, int y0, int y1, Rgb c) {
  for (int y = y0; y <= y1; ++y)
    if (tint(image.at(x, y), c) > 0.25) return true;
  return false;
}

// The pixels of exactly colour c.
int count(const Image& image, Rgb c) {
  int n = 0;
  for (int y = 0; y < image.height(); ++y)
    for (int x = 0; x < image.width(); ++x) n += image.at(x, y) == c;
  return n;
}

// A line through (x0, y0) and (x1, y1) sampled at `n` points.
Series line(Rgb colour, double x0, double y0, double x1, double y1, int n = 2) {
  Series s;
  s.colour = colour;
  for (int i = 0; i < n; ++i) {
    const double t = n == 1 ? 0 : static_cast<double>(i) / (n - 1);
    s.x.push_back(x0 + t * (x1 - x0));
    s.y.push_back(y0 + t * (y1 - y0));
  }
  return s;
}

// (Structs are filled member by member: GCC 12's -Wextra warns about designated initializers that leave
// members to their defaults.)
Chart one_panel(Panel panel, int width = 400, int height = 300) {
  Chart chart;
  chart.width = width, chart.height = height;
  chart.panels = {std::move(panel)};
  return chart;
}

// A panel of `series`, its axes fixed to [0, 10] unless `fixed` is false.
Panel panel_of(std::vector<Series> series, bool fixed = true) {
  Panel panel;
  panel.series = std::move(series);
  if (fixed) panel.x_min = 0, panel.x_max = 10, panel.y_min = 0, panel.y_max = 10;
  return panel;
}

// The frame of a one-panel chart: the outermost columns (rows) that are exactly black over more than a
// third of the image's height (width). Text, tick marks and curves never are.
struct Frame {
  int left = -1, top = -1, right = -1, bottom = -1;
  // The pixel at fraction (tx, ty) of the plot area, from its bottom left corner.
  int column(double tx) const { return static_cast<int>(std::lround(left + tx * (right - left))); }
  int row(double ty) const { return static_cast<int>(std::lround(bottom - ty * (bottom - top))); }
};
Frame find_frame(const Image& image) {
  Frame f;
  for (int x = 0; x < image.width(); ++x) {
    int black = 0;
    for (int y = 0; y < image.height(); ++y) black += image.at(x, y) == kBlack;
    if (black > image.height() / 3) (f.left < 0 ? f.left : f.right) = x;
  }
  for (int y = 0; y < image.height(); ++y) {
    int black = 0;
    for (int x = 0; x < image.width(); ++x) black += image.at(x, y) == kBlack;
    if (black > image.width() / 3) (f.top < 0 ? f.top : f.bottom) = y;
  }
  return f;
}

// Something like precision_study's figure: ten noisy loss curves over 600 steps and four loss-scale traces.
Chart typical_chart() {
  Panel loss, scale;
  loss.title = "training loss", scale.title = "loss scale";
  loss.x_label = scale.x_label = "step";
  loss.y_label = "loss", scale.y_label = "loss scale";
  scale.log2_y = true;
  std::mt19937 rng(7);
  std::normal_distribution<double> noise(0, 0.01);
  for (int m = 0; m < 10; ++m) {
    Series l;
    l.label = "mode " + std::to_string(m), l.colour = palette()[m];
    for (int step = 1; step <= 600; ++step) {
      l.x.push_back(step);
      l.y.push_back(2.05 + 2.15 * std::exp(-step / 40.0) + noise(rng));
    }
    loss.series.push_back(std::move(l));
  }
  for (double log2_scale : {0.0, 16.0, 32.0, -1.0}) {
    Series s;
    s.label = "scale " + std::to_string(scale.series.size());
    s.colour = palette()[scale.series.size()], s.dash = static_cast<int>(scale.series.size());
    for (int step = 1; step <= 600; ++step) {
      s.x.push_back(step);
      s.y.push_back(std::exp2(log2_scale >= 0 ? log2_scale : std::max(14, 32 - step)));
    }
    scale.series.push_back(std::move(s));
  }
  Chart chart;
  chart.title = "a typical chart";
  chart.panels = {loss, scale};
  return chart;
}

// ---- ticks ---------------------------------------------------------------------------------------

TEST(PlotTicks, PinnedExamples) {
  EXPECT_EQ(nice_ticks(2.03, 4.21), (std::vector<double>{2, 2.5, 3, 3.5, 4, 4.5}));
  EXPECT_EQ(nice_ticks(0, 600), (std::vector<double>{0, 100, 200, 300, 400, 500, 600}));
  EXPECT_EQ(nice_ticks(0.0012, 0.0047), (std::vector<double>{0.001, 0.002, 0.003, 0.004, 0.005}));
  EXPECT_EQ(nice_ticks(-0.37, 0.81), (std::vector<double>{-0.4, -0.2, 0, 0.2, 0.4, 0.6, 0.8, 1}));
  // 0.1 + 0.2 is 0.30000000000000004: within rounding of the tick 0.3, so no tick 0.35 beyond it.
  EXPECT_EQ(nice_ticks(0.1, 0.1 + 0.2), (std::vector<double>{0.1, 0.15, 0.2, 0.25, 0.3}));
}

TEST(PlotTicks, CoverTheRangeWithFiveToEightNiceSteps) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> unit(0, 1);
  for (int trial = 0; trial < 5000; ++trial) {
    const double span = std::pow(10.0, -6 + 12 * unit(rng));
    const double lo = (unit(rng) - 0.5) * span * std::pow(10.0, 3 * unit(rng)), hi = lo + span;
    const std::vector<double> ticks = nice_ticks(lo, hi);
    std::ostringstream text;
    text.precision(17);
    text << "[" << lo << ", " << hi << "]";
    const std::string what = text.str();
    ASSERT_GE(ticks.size(), 5u) << what;
    ASSERT_LE(ticks.size(), 8u) << what;
    const double step = ticks[1] - ticks[0];
    const double mantissa = step / std::pow(10.0, std::floor(std::log10(step) + 1e-9));
    EXPECT_TRUE(std::ranges::any_of(std::vector<double>{1, 2, 2.5, 5},
                                    [&](double nice) { return std::abs(mantissa - nice) < 1e-6; }))
        << what << " step " << step;
    for (size_t i = 1; i < ticks.size(); ++i) EXPECT_NEAR(ticks[i] - ticks[i - 1], step, 1e-6 * step) << what;
    for (double t : ticks) EXPECT_NEAR(t / step, std::round(t / step), 1e-6) << what << " tick " << t;
    // Covers the range (to rounding), and tightly: no whole step to spare at either end.
    EXPECT_LE(ticks.front(), lo + 1e-9 * step) << what;
    EXPECT_GE(ticks.back(), hi - 1e-9 * step) << what;
    EXPECT_GT(ticks.front(), lo - step) << what;
    EXPECT_LT(ticks.back(), hi + step) << what;
  }
}

TEST(PlotTicks, RejectAnEmptyOrInfiniteRange) {
  EXPECT_THROW(nice_ticks(1, 1), Error);
  EXPECT_THROW(nice_ticks(2, 1), Error);
  EXPECT_THROW(nice_ticks(0, INFINITY), Error);
  EXPECT_THROW(nice_ticks(NAN, 1), Error);
  EXPECT_THROW(nice_ticks(-1e308, 1e308), Error);  // the span overflows
}

// ---- rendering -----------------------------------------------------------------------------------

TEST(PlotRender, ARedLineRunsWhereItsDataIs) {
  const Image image = render(one_panel(panel_of({line(kRed, 0, 0, 10, 10)})));
  ASSERT_EQ(image.width(), 400);
  ASSERT_EQ(image.height(), 300);
  const Frame f = find_frame(image);
  ASSERT_GT(f.left, 0);
  ASSERT_GT(f.right - f.left, 200);
  ASSERT_GT(f.bottom - f.top, 150);
  for (double t : {0.25, 0.5, 0.75}) {
    const int x = f.column(t), y = f.row(t);
    EXPECT_TRUE(column_has(image, x, y - 2, y + 2, kRed)) << "t " << t;
    EXPECT_FALSE(column_tinted(image, x, f.top + 1, y - 6, kRed)) << "t " << t;  // and nowhere else
    EXPECT_FALSE(column_tinted(image, x, y + 6, f.bottom - 1, kRed)) << "t " << t;
  }
  // The background outside and inside the plot area (away from grid lines at multiples of 2) is white.
  EXPECT_EQ(image.at(2, 2), kWhite);
  EXPECT_EQ(image.at(image.width() - 3, image.height() - 3), kWhite);
  EXPECT_EQ(image.at(f.right + 5, (f.top + f.bottom) / 2), kWhite);
  EXPECT_EQ(image.at(f.column(0.1), f.row(0.9)), kWhite);
  // The frame is black on all four sides, and the grid light grey: a dotted line at x = 4 inside the frame.
  EXPECT_EQ(image.at(f.left, (f.top + f.bottom) / 2), kBlack);
  EXPECT_EQ(image.at(f.right, (f.top + f.bottom) / 2), kBlack);
  EXPECT_EQ(image.at((f.left + f.right) / 2, f.top), kBlack);
  EXPECT_EQ(image.at((f.left + f.right) / 2, f.bottom), kBlack);
  const Rgb grid{200, 200, 200};
  EXPECT_TRUE(column_has(image, f.column(0.4), f.row(0.9), f.row(0.6), grid, 0));
  EXPECT_FALSE(column_has(image, f.column(0.3), f.row(0.9), f.row(0.6), grid, 0));
}

TEST(PlotRender, ANonFinitePointBreaksTheLine) {
  Series s = line(kRed, 0, 5, 10, 5, 11);  // x = 0, 1, ..., 10 at y = 5
  s.y[2] = NAN, s.y[4] = -INFINITY, s.x[8] = INFINITY;
  s.y[5] = NAN;
  const Image image = render(one_panel(panel_of({s})));
  const Frame f = find_frame(image);
  const int y = f.row(0.5);
  // Drawn: the runs 0-1, 6-7 and 9-10, and point 3 on its own (a polyline's first point shows even when
  // it is its last).
  for (double x : {0.2, 0.5, 0.8, 3.0, 6.2, 6.5, 6.8, 9.5})
    EXPECT_TRUE(column_has(image, f.column(x / 10), y - 2, y + 2, kRed)) << "x " << x;
  // Around the breaks nothing: no segment ends at a non-finite point.
  for (double x : {1.5, 2.0, 2.5, 3.5, 4.0, 5.0, 5.5, 7.5, 8.0, 8.5})
    EXPECT_FALSE(column_tinted(image, f.column(x / 10), f.top, f.bottom, kRed)) << "x " << x;
}

TEST(PlotRender, Log2AxisSpansTheDataInWholePowersOfTwo) {
  // 1 and 2^16 are the ends of the data: they fall on the frame's bottom and top rows; 2^4 a quarter up.
  // (The curves span the middle fifth only, so the frame stays black enough for find_frame.)
  Panel panel =
      panel_of({line(kBlue, 4, 1, 6, 1), line(kGreen, 4, 65536, 6, 65536), line(kRed, 4, 16, 6, 16)});
  panel.log2_y = true, panel.y_min.reset(), panel.y_max.reset();
  const Image image = render(one_panel(panel));
  const Frame f = find_frame(image);
  const int x = (f.left + f.right) / 2;
  EXPECT_TRUE(shows(image.at(x, f.bottom), kBlue))
      << "over the frame: a curve along an axis end stays visible";
  EXPECT_TRUE(shows(image.at(x, f.top), kGreen));
  const int quarter = f.row(0.25);
  EXPECT_TRUE(column_has(image, x, quarter - 1, quarter + 1, kRed));
  EXPECT_FALSE(column_tinted(image, x, f.top, quarter - 4, kRed));
  EXPECT_FALSE(column_tinted(image, x, quarter + 4, f.bottom, kRed));
  // Curves stay inside the frame: nothing blue below it, nothing green above it.
  EXPECT_FALSE(column_tinted(image, x, f.bottom + 1, f.bottom + 3, kBlue));
  EXPECT_FALSE(column_tinted(image, x, f.top - 3, f.top - 1, kGreen));

  // Non-positive values have no logarithm: they break the line like a NaN.
  Series gap = line(kRed, 0, 16, 10, 16, 11);
  gap.y[5] = 0;
  Panel gapped = panel_of({gap});
  gapped.log2_y = true, gapped.y_min.reset(), gapped.y_max.reset();
  const Image broken = render(one_panel(gapped));
  const Frame g = find_frame(broken);
  EXPECT_FALSE(column_tinted(broken, g.column(0.5), g.top, g.bottom, kRed));
  EXPECT_TRUE(column_has(broken, g.column(0.25), g.top, g.bottom, kRed));
}

TEST(PlotRender, DashPatternsAreDistinctAndPointsAreFiveByFive) {
  // One horizontal line per dash pattern; the set of red columns along it tells the patterns apart.
  std::vector<std::vector<bool>> patterns;
  for (int dash = 0; dash <= 4; ++dash) {
    Series s = line(kRed, 0, 5, 10, 5);
    s.dash = dash;
    const Image image = render(one_panel(panel_of({s})));
    const Frame f = find_frame(image);
    std::vector<bool> on;
    for (int x = f.left + 1; x < f.right; ++x)
      on.push_back(column_has(image, x, f.top + 1, f.bottom - 1, kRed));
    const auto drawn = std::count(on.begin(), on.end(), true);
    if (dash == 0) EXPECT_EQ(drawn, static_cast<long>(on.size()));
    else EXPECT_TRUE(drawn > 0.1 * on.size() && drawn < 0.9 * on.size()) << "dash " << dash << ": " << drawn;
    for (const auto& other : patterns) EXPECT_NE(on, other) << "dash " << dash;
    patterns.push_back(on);
  }
  Series point = line(kRed, 5, 5, 5, 5, 1);
  point.line_width = 0, point.points = true;
  const Image image = render(one_panel(panel_of({point})));
  EXPECT_EQ(count(image, kRed), 25);
  const Frame f = find_frame(image);
  EXPECT_TRUE(column_has(image, f.column(0.5), f.row(0.5) - 2, f.row(0.5) + 2, kRed, 0));
}

TEST(PlotRender, TheLegendListsTheLabelledSeriesRightOfThePlotArea) {
  Series red = line(kRed, 0, 1, 10, 1), blue = line(kBlue, 0, 2, 10, 2), green = line(kGreen, 0, 3, 10, 3);
  red.label = "red", blue.label = "blue";  // green has no label: not in the legend
  const Image image = render(one_panel(panel_of({red, blue, green})));
  const Frame f = find_frame(image);
  auto first_row = [&](Rgb c) {  // the first row right of the frame that shows c, or -1
    for (int y = 0; y < image.height(); ++y)
      for (int x = f.right + 1; x < image.width(); ++x)
        if (shows(image.at(x, y), c)) return y;
    return -1;
  };
  const int red_row = first_row(kRed), blue_row = first_row(kBlue);
  EXPECT_GT(red_row, f.top);
  EXPECT_GT(blue_row, red_row + 8) << "one entry a line, in the series' order";
  EXPECT_LT(blue_row, f.top + 60);
  EXPECT_EQ(first_row(kGreen), -1);
  // Each entry's label is set beside its line sample: ink (dark pixels) to the right of the sample.
  int ink = 0;
  for (int y = red_row - 6; y <= red_row + 6; ++y)
    for (int x = f.right + 14 + 28 + 4; x < image.width(); ++x) ink += shows(image.at(x, y), kBlack, 100);
  EXPECT_GT(ink, 10);
}

TEST(PlotRender, PanelsStackTopToBottomOverOneSharedPlotWidth) {
  Panel top = panel_of({line(kRed, 0, 0, 10, 10)}), bottom = panel_of({line(kBlue, 0, 0, 10, 10)});
  top.y_label = "a long label for the y axis";
  bottom.series[0].label = "a long label for the legend";
  Chart chart = one_panel(top, 500, 600);
  chart.panels.push_back(bottom);
  const Image image = render(chart);
  // Each half holds one frame: the black runs down the frame's left column, and only its own curve.
  const Image upper = [&] {
    Image half(500, 300, kWhite);
    for (int y = 0; y < 300; ++y)
      for (int x = 0; x < 500; ++x) half.set(x, y, image.at(x, y));
    return half;
  }();
  const Frame f = find_frame(upper);
  ASSERT_GT(f.bottom - f.top, 150);
  int runs = 0;
  for (int y = 1; y < image.height(); ++y)
    runs += image.at(f.left, y) == kBlack && image.at(f.left, y - 1) != kBlack;
  EXPECT_EQ(runs, 2);
  EXPECT_TRUE(column_has(image, f.right, 300, 599, kBlack, 0))
      << "the lower frame's right side: same columns";
  int red_below = 0, blue_above = 0;
  for (int x = 0; x < 500; ++x) {
    red_below += column_tinted(image, x, 300, 599, kRed);
    blue_above += column_tinted(image, x, 0, 299, kBlue);
  }
  EXPECT_EQ(red_below, 0);
  EXPECT_EQ(blue_above, 0);
}

TEST(PlotRender, TextIsSetInPrintableAsciiWithinTheChart) {
  // Titles draw ink above the frame; a byte outside printable ASCII draws exactly as '?'.
  auto titled = [](const std::string& title) {
    Chart chart = one_panel(Panel{});
    chart.title = title;
    return render(chart);
  };
  auto ink_above = [](const Image& image) {  // over the plot area's columns: the top tick label is left of it
    const Frame f = find_frame(image);
    int ink = 0;
    for (int y = 0; y < f.top; ++y)
      for (int x = f.left + 1; x < f.right; ++x) ink += !shows(image.at(x, y), kWhite, 100);
    return ink;
  };
  EXPECT_EQ(ink_above(titled("")), 0);
  EXPECT_GT(ink_above(titled("Loss")), 20);
  const Image odd = titled("a\x01\xff\x7f\tb"), asked = titled("a????b");
  EXPECT_EQ(odd.rgb(), asked.rgb());
  EXPECT_NE(odd.rgb(), titled("a????c").rgb());
  // A chart title wider than the chart is set smaller: none of it is cut off at the sides.
  const Image wide = titled(std::string(150, 'W'));
  int edge_ink = 0;
  for (int y = 0; y < find_frame(wide).top; ++y)
    for (int x : {0, 1, 2, 3, 396, 397, 398, 399}) edge_ink += !shows(wide.at(x, y), kWhite, 100);
  EXPECT_EQ(edge_ink, 0);
  EXPECT_GT(ink_above(wide), ink_above(titled("Loss")));
}

TEST(PlotRender, RangesFallBackSensibly) {
  // No data, a single value, one fixed end on the far side of the data: all draw a frame.
  std::vector<Panel> panels(6);
  panels[1] = panel_of({line(kRed, 3, 7, 3, 7)}, false);
  panels[2] = panel_of({line(kRed, 3, 7, 3, 7)}, false);
  panels[2].log2_y = true;
  panels[3] = panel_of({line(kRed, 0, 0, 10, 10)}, false);
  panels[3].x_min = 20, panels[3].y_max = -5;
  panels[4] = panel_of({line(kRed, 0, 0, 10, 10)}, false);
  panels[4].log2_y = true, panels[4].y_min = 1024;
  panels[5] = panel_of({line(kRed, -1e300, 0, 1e300, 1)}, false);  // far outside a fixed x range: clipped
  panels[5].x_min = 0, panels[5].x_max = 1;
  for (size_t i = 0; i < panels.size(); ++i) {
    const Frame f = find_frame(render(one_panel(panels[i])));
    EXPECT_GT(f.right - f.left, 200) << "panel " << i;
    EXPECT_GT(f.bottom - f.top, 150) << "panel " << i;
  }
}

// ---- errors --------------------------------------------------------------------------------------

// Renders `chart` and expects an Error whose message starts with "plot: " and contains `fragment`.
void expect_error(const Chart& chart, const std::string& fragment) {
  try {
    render(chart);
    ADD_FAILURE() << "no error; expected one with: " << fragment;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("plot: ", 0), 0u) << message;
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
  }
}

TEST(PlotErrors, EveryInvalidChartIsNamed) {
  Panel good = panel_of({line(kRed, 0, 1, 1, 2)}, false);
  good.title = "loss";
  expect_error(one_panel(good, 199, 1000), "the chart is 199x1000 pixels");
  expect_error(one_panel(good, 1000, 8001), "the chart is 1000x8001 pixels");
  expect_error(Chart{}, "the chart has no panels");

  auto with = [&](auto change) {
    Series s = line(kRed, 0, 1, 1, 2);
    s.label = "fp16";
    Panel p = good;
    change(s, p);
    p.series.push_back(s);
    return one_panel(p);
  };
  expect_error(with([](Series& s, Panel&) { s.x.assign(600, 0), s.y.assign(599, 0); }),
               "series 'fp16' has 600 x values but 599 y values");
  expect_error(with([](Series& s, Panel& p) { s.label = "", s.y.pop_back(), p.title = ""; }),
               "series 2 of panel 1 has 2 x values but 1 y values");
  expect_error(with([](Series& s, Panel&) { s.dash = 5; }), "series 'fp16' has dash 5");
  expect_error(with([](Series& s, Panel&) { s.dash = -1; }), "series 'fp16' has dash -1");
  expect_error(with([](Series& s, Panel&) { s.line_width = 5; }), "series 'fp16' has line width 5");
  expect_error(with([](Series& s, Panel&) { s.line_width = -1; }), "series 'fp16' has line width -1");
  expect_error(with([](Series& s, Panel&) { s.line_width = 0; }), "series 'fp16' draws nothing");
  EXPECT_NO_THROW(render(with([](Series& s, Panel&) { s.line_width = 0, s.points = true; })));
  expect_error(with([](Series&, Panel& p) { p.x_min = 3, p.x_max = 1; }),
               "panel 'loss' has the empty x range [3, 1]");
  expect_error(with([](Series&, Panel& p) { p.y_min = 2, p.y_max = 2; }),
               "panel 'loss' has the empty y range [2, 2]");
  expect_error(with([](Series&, Panel& p) { p.y_min = NAN; }),
               "panel 'loss' has y_min nan; a fixed axis end must be finite");
  expect_error(with([](Series&, Panel& p) { p.x_max = INFINITY; }), "panel 'loss' has x_max inf");
  expect_error(with([](Series&, Panel& p) { p.log2_y = true, p.y_min = 0; }),
               "panel 'loss' has y_min 0; a log2 axis needs positive values");
  expect_error(with([](Series&, Panel& p) { p.log2_y = true, p.y_max = -4; }), "panel 'loss' has y_max -4");
}

TEST(PlotErrors, ColoursAndPixels) {
  EXPECT_EQ(parse_rgb("#1f77b4"), (Rgb{0x1f, 0x77, 0xb4}));
  EXPECT_EQ(parse_rgb("#FFA500"), (Rgb{0xff, 0xa5, 0x00}));
  EXPECT_EQ(palette().size(), 10u);
  EXPECT_EQ(palette()[3], parse_rgb("#d62728"));  // tab10's red
  for (const char* bad : {"", "#12345", "#1234567", "123456", "#12345g", "red"}) {
    try {
      parse_rgb(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "plot: colour '" + std::string(bad) + "' is not of the form #rrggbb");
    }
  }
  Image image(3, 2, kWhite);
  image.set(-1, 0, kRed);  // drawing clips silently
  image.set(3, 1, kRed);
  image.set(2, 1, kRed);
  EXPECT_EQ(image.at(2, 1), kRed);
  EXPECT_EQ(count(image, kRed), 1);
  EXPECT_THROW(image.at(3, 0), Error);
  EXPECT_THROW(image.at(0, -1), Error);
}

// ---- files ---------------------------------------------------------------------------------------

// The pixels of a PNG file as cairo reads them back, or an image of 1x1 black with `problem` set.
Image decode_png(const std::string& png, std::string& problem) {
  struct Reader {
    const std::string& bytes;
    size_t at = 0;
  } reader{png};
  auto read = [](void* closure, unsigned char* data, unsigned int length) {
    Reader& r = *static_cast<Reader*>(closure);
    if (r.bytes.size() - r.at < length) return CAIRO_STATUS_READ_ERROR;
    std::copy_n(r.bytes.data() + r.at, length, data);
    r.at += length;
    return CAIRO_STATUS_SUCCESS;
  };
  cairo_surface_t* surface = cairo_image_surface_create_from_png_stream(read, &reader);
  Image image(1, 1, kBlack);
  if (cairo_surface_status(surface) != CAIRO_STATUS_SUCCESS) {
    problem = cairo_status_to_string(cairo_surface_status(surface));
  } else if (cairo_image_surface_get_format(surface) != CAIRO_FORMAT_RGB24) {
    problem = "not an opaque RGB image";
  } else {
    const int width = cairo_image_surface_get_width(surface),
              height = cairo_image_surface_get_height(surface);
    image = Image(width, height, kBlack);
    for (int y = 0; y < height; ++y) {
      const auto* row = reinterpret_cast<const uint32_t*>(cairo_image_surface_get_data(surface) +
                                                          y * cairo_image_surface_get_stride(surface));
      for (int x = 0; x < width; ++x)
        image.set(x, y, Rgb{uint8_t(row[x] >> 16), uint8_t(row[x] >> 8), uint8_t(row[x])});
    }
  }
  cairo_surface_destroy(surface);
  return image;
}

// A fresh directory per test, removed afterwards.
class PlotFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "mixtape_plot_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  fs::path path(const std::string& name) const { return dir_ / name; }
  void write(const std::string& name, const std::string& bytes) const {
    std::ofstream out(path(name), std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good()) << name;
  }
  static std::string read(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::recursive_directory_iterator(dir_))
      names.push_back(fs::relative(entry.path(), dir_).string());
    std::sort(names.begin(), names.end());
    return names;
  }
  // Runs tests/check_png.py on A and B: "ok" when it accepts, else its reason and exit status.
  std::string python_check(const std::string& a, const std::string& b) const {
    const fs::path output = path("checker.txt");
    const std::string command = "python3 '" + std::string(MIXTAPE_SOURCE_DIR) + "/tests/check_png.py' '" +
                                path(a).string() + "' '" + path(b).string() + "' > '" + output.string() +
                                "' 2>&1";
    const int status = std::system(command.c_str());
    std::string text = read(output);
    fs::remove(output);
    while (!text.empty() && text.back() == '\n') text.pop_back();
    return status == 0 ? text : text + " (exit status " + std::to_string(status) + ")";
  }
  static bool have_python() { return std::system("python3 -c pass > /dev/null 2>&1") == 0; }

  fs::path dir_;
};

// Images whose PNG files must decode back to exactly their pixels.
std::vector<std::pair<std::string, Image>> sample_images() {
  Image known(7, 5, kWhite);  // every pixel a different colour
  for (int y = 0; y < 5; ++y)
    for (int x = 0; x < 7; ++x)
      known.set(x, y, Rgb{uint8_t(x * 40), uint8_t(y * 60), uint8_t(255 - 7 * (x + 7 * y))});
  Image noise(160, 160, kWhite);  // incompressible
  std::mt19937 rng(5);
  for (int y = 0; y < 160; ++y)
    for (int x = 0; x < 160; ++x) noise.set(x, y, Rgb{uint8_t(rng()), uint8_t(rng()), uint8_t(rng())});
  return {{"7x5 known", known},
          {"noise", noise},
          {"a small chart", render(one_panel(typical_chart().panels[0]))}};
}

TEST(PlotPng, FilesDecodeToTheirPixelsInCairo) {
  for (const auto& [name, image] : sample_images()) {
    const std::string png = encode_png(image);
    ASSERT_EQ(png.substr(0, 8), "\x89PNG\r\n\x1a\n") << name;
    std::string problem;
    const Image back = decode_png(png, problem);
    ASSERT_EQ(problem, "") << name;
    EXPECT_EQ(back.width(), image.width()) << name;
    EXPECT_EQ(back.height(), image.height()) << name;
    EXPECT_EQ(back.rgb(), image.rgb()) << name;
  }
}

TEST_F(PlotFiles, PngFilesDecodeToTheirPixelsInPython) {
  if (!have_python()) GTEST_SKIP() << "python3 is not on PATH: the PNG files cannot be checked";
  const auto images = sample_images();
  for (const auto& [name, image] : images) {
    write("image.png", encode_png(image));
    write("image.rgb", std::string(image.rgb().begin(), image.rgb().end()));
    EXPECT_EQ(python_check("image.png", "image.rgb"), "ok") << name;
  }
  // The checker itself rejects a corrupted file.
  const Image& known = images[0].second;
  std::string bad = encode_png(known);
  bad[bad.size() / 2] ^= 1;
  write("image.png", bad);
  write("image.rgb", std::string(known.rgb().begin(), known.rgb().end()));
  EXPECT_NE(python_check("image.png", "image.rgb"), "ok");
}

TEST_F(PlotFiles, WritePngLeavesExactlyTheFile) {
  const Chart chart = one_panel(panel_of({line(kRed, 0, 0, 1, 1)}));
  write_png(chart, path("chart.png"));
  write_png(chart, path("chart.png"));  // replaces it
  EXPECT_EQ(listing(), std::vector<std::string>{"chart.png"});
  const std::string png = read(path("chart.png"));
  EXPECT_EQ(png, encode_png(render(chart)));
  std::string problem;
  const Image back = decode_png(png, problem);
  ASSERT_EQ(problem, "");
  EXPECT_EQ(back.width(), 400);
  EXPECT_EQ(back.height(), 300);
  EXPECT_EQ(back.rgb(), render(chart).rgb());
}

TEST_F(PlotFiles, WritePngFailuresLeaveNoTemporaryFile) {
  const Chart chart = one_panel(panel_of({line(kRed, 0, 0, 1, 1)}));
  const fs::path missing = path("missing") / "chart.png";
  try {
    write_png(chart, missing);
    ADD_FAILURE() << "wrote into a missing directory";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "plot: cannot write '" + missing.string() + "': cannot create " +
                                         missing.string() + ".tmp (No such file or directory)");
  }
  EXPECT_TRUE(listing().empty());
  // The rename fails (a directory is in the way): the written temporary file is removed again.
  fs::create_directory(path("taken"));
  try {
    write_png(chart, path("taken"));
    ADD_FAILURE() << "replaced a directory";
  } catch (const Error& e) {
    const std::string start = "plot: cannot write '" + path("taken").string() + "': cannot rename " +
                              path("taken").string() + ".tmp to it (";
    EXPECT_EQ(std::string(e.what()).rfind(start, 0), 0u) << e.what();
  }
  EXPECT_EQ(listing(), std::vector<std::string>{"taken"});
  // An invalid chart fails before anything is written.
  EXPECT_THROW(write_png(Chart{}, path("chart.png")), Error);
  EXPECT_EQ(listing(), std::vector<std::string>{"taken"});
}

}  // namespace
}  // namespace mixtape::plot
