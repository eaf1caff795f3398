// Line charts as PNG files: the chart layout (ranges, ticks, labels, legend) is worked out here in pixels;
// cairo strokes the lines, sets the text and encodes the PNG.
#include "train/plot.h"

#include <cairo.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <numbers>
#include <system_error>
#include <utility>

#include "tensor/error.h"

namespace mixtape::plot {

// ---- colours and pixels --------------------------------------------------------------------------

Rgb parse_rgb(const std::string& hex) {
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  bool ok = hex.size() == 7 && hex[0] == '#';
  for (size_t i = 1; ok && i < hex.size(); ++i) ok = digit(hex[i]) >= 0;
  check(ok, "plot: colour '", hex, "' is not of the form #rrggbb");
  auto byte = [&](size_t i) { return static_cast<uint8_t>(digit(hex[i]) * 16 + digit(hex[i + 1])); };
  return {byte(1), byte(3), byte(5)};
}

const std::vector<Rgb>& palette() {
  static const std::vector<Rgb> colours = [] {
    std::vector<Rgb> c;
    for (const char* hex : {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                            "#7f7f7f", "#bcbd22", "#17becf"})
      c.push_back(parse_rgb(hex));
    return c;
  }();
  return colours;
}

Image::Image(int width, int height, Rgb background) : width_(width), height_(height) {
  check(width > 0 && height > 0, "plot: an image of ", width, "x", height, " pixels has no pixels");
  rgb_.resize(static_cast<size_t>(width) * static_cast<size_t>(height) * 3);
  for (size_t i = 0; i < rgb_.size(); i += 3) {
    rgb_[i] = background.r;
    rgb_[i + 1] = background.g;
    rgb_[i + 2] = background.b;
  }
}

Rgb Image::at(int x, int y) const {
  check(x >= 0 && x < width_ && y >= 0 && y < height_, "plot: pixel (", x, ", ", y, ") is outside the ",
        width_, "x", height_, " image");
  const uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
  return {p[0], p[1], p[2]};
}

void Image::set(int x, int y, Rgb c) {
  if (x < 0 || x >= width_ || y < 0 || y >= height_) return;
  uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
  p[0] = c.r;
  p[1] = c.g;
  p[2] = c.b;
}

// ---- cairo ---------------------------------------------------------------------------------------

namespace {

using Surface = std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)>;
using Context = std::unique_ptr<cairo_t, decltype(&cairo_destroy)>;
using FontOptions = std::unique_ptr<cairo_font_options_t, decltype(&cairo_font_options_destroy)>;

void check_cairo(cairo_status_t status, const char* what) {
  check(status == CAIRO_STATUS_SUCCESS, "plot: cairo cannot ", what, ": ", cairo_status_to_string(status));
}

// An RGB24 image surface: a pixel is a native-endian uint32_t 0x00RRGGBB, rows `stride` bytes apart.
Surface rgb_surface(int width, int height) {
  Surface surface(cairo_image_surface_create(CAIRO_FORMAT_RGB24, width, height), cairo_surface_destroy);
  check_cairo(cairo_surface_status(surface.get()), "create an image");
  return surface;
}

uint32_t* pixel_row(cairo_surface_t* surface, int y) {
  return reinterpret_cast<uint32_t*>(cairo_image_surface_get_data(surface) +
                                     static_cast<size_t>(y) * cairo_image_surface_get_stride(surface));
}

Image image_of(cairo_surface_t* surface) {
  cairo_surface_flush(surface);
  const int width = cairo_image_surface_get_width(surface), height = cairo_image_surface_get_height(surface);
  Image image(width, height, Rgb{});
  for (int y = 0; y < height; ++y) {
    const uint32_t* row = pixel_row(surface, y);
    for (int x = 0; x < width; ++x)
      image.set(x, y, Rgb{uint8_t(row[x] >> 16), uint8_t(row[x] >> 8), uint8_t(row[x])});
  }
  return image;
}

Surface surface_of(const Image& image) {
  Surface surface = rgb_surface(image.width(), image.height());
  cairo_surface_flush(surface.get());
  const uint8_t* rgb = image.rgb().data();
  for (int y = 0; y < image.height(); ++y) {
    uint32_t* row = pixel_row(surface.get(), y);
    for (int x = 0; x < image.width(); ++x, rgb += 3) row[x] = uint32_t{rgb[0]} << 16 | rgb[1] << 8 | rgb[2];
  }
  cairo_surface_mark_dirty(surface.get());
  return surface;
}

}  // namespace

std::string encode_png(const Image& image) {
  const Surface surface = surface_of(image);
  std::string png;
  auto append = [](void* closure, const unsigned char* data, unsigned int length) {
    static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
    return CAIRO_STATUS_SUCCESS;
  };
  check_cairo(cairo_surface_write_to_png_stream(surface.get(), append, &png), "encode a PNG");
  return png;
}

void write_png(const Chart& chart, const std::filesystem::path& path) {
  const std::string png = encode_png(render(chart));  // a bad chart fails before the file system is touched
  const std::filesystem::path temporary = path.string() + ".tmp";
  std::string problem;
  {
    errno = 0;
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) {
      problem = "cannot create " + temporary.string();
      if (errno) problem += " (" + std::generic_category().message(errno) + ")";
    } else {
      out.write(png.data(), static_cast<std::streamsize>(png.size()));
      out.close();
      if (!out) problem = "error writing " + temporary.string();
    }
  }
  if (problem.empty()) {
    std::error_code ec;
    std::filesystem::rename(temporary, path, ec);
    if (ec) problem = "cannot rename " + temporary.string() + " to it (" + ec.message() + ")";
  }
  if (!problem.empty()) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    fail("plot: cannot write '", path.string(), "': ", problem);
  }
}

// ---- drawing -------------------------------------------------------------------------------------

namespace {

// A rectangle of pixels, edges included.
struct Box {
  int left, top, right, bottom;
};

void set_colour(cairo_t* cr, Rgb c) { cairo_set_source_rgb(cr, c.r / 255.0, c.g / 255.0, c.b / 255.0); }

// Fills the pixels of `box` exactly: its edges lie on pixel boundaries, so nothing is blended.
void fill_box(cairo_t* cr, const Box& box, Rgb colour) {
  set_colour(cr, colour);
  cairo_rectangle(cr, box.left, box.top, box.right - box.left + 1, box.bottom - box.top + 1);
  cairo_fill(cr);
}

// A 1-pixel dotted line from (x0, y0) to (x1, y1), one pixel on and two off from its start: the grid.
void dotted_line(cairo_t* cr, double x0, double y0, double x1, double y1, Rgb colour) {
  static const double dots[] = {1, 2};
  set_colour(cr, colour);
  cairo_set_line_width(cr, 1);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_BUTT);
  cairo_set_dash(cr, dots, 2, 0);
  cairo_move_to(cr, x0, y0);
  cairo_line_to(cr, x1, y1);
  cairo_stroke(cr);
  cairo_set_dash(cr, nullptr, 0, 0);
}

// ---- text ----

constexpr double kTextSize = 12;   // pixels to the em: tick labels, axis labels, the legend
constexpr double kTitleSize = 13;  // panel titles, and (bold) the chart title

// The text cairo is given: printable ASCII, any other byte as '?'. (cairo's toy text API takes UTF-8 only,
// and a string that is not UTF-8 puts the context into an error state.)
std::string printable(const std::string& text) {
  std::string out = text;
  for (char& c : out)
    if (c < 32 || c > 126) c = '?';
  return out;
}

// A font and the metrics the layout needs, in pixels.
struct Font {
  double size = kTextSize;
  bool bold = false;
  double ascent = 0;  // from the top of a line to its baseline
  double line = 0;    // a line's height: ascent and descent
  double digit = 0;   // a digit's height: a tick label centres on its tick by it
};

void use(cairo_t* cr, const Font& font) {
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL,
                         font.bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, font.size);
}

Font measured(cairo_t* cr, double size, bool bold) {
  Font font;
  font.size = size, font.bold = bold;
  use(cr, font);
  cairo_font_extents_t e;
  cairo_font_extents(cr, &e);
  cairo_text_extents_t digit;
  cairo_text_extents(cr, "0", &digit);
  font.ascent = std::ceil(e.ascent), font.line = std::ceil(e.ascent + e.descent), font.digit = digit.height;
  return font;
}

double text_width(cairo_t* cr, const Font& font, const std::string& text) {
  use(cr, font);
  cairo_text_extents_t e;
  cairo_text_extents(cr, printable(text).c_str(), &e);
  return e.x_advance;
}

// Sets `text` with the top of its line at `top` and its left end at x (or its centre, or its right end).
enum class Align { left, centre, right };
void draw_text(cairo_t* cr, const Font& font, double x, double top, const std::string& text, Align align) {
  const double width = text_width(cr, font, text);
  const double left = align == Align::left ? x : align == Align::centre ? x - width / 2 : x - width;
  set_colour(cr, Rgb{});
  cairo_move_to(cr, left, top + font.ascent);
  cairo_show_text(cr, printable(text).c_str());
}

// Sets `text` turned a quarter counter-clockwise to read upwards (a y-axis label): the top of its line at
// column `left`, centred on row `middle`.
void draw_text_upwards(cairo_t* cr, const Font& font, double left, double middle, const std::string& text) {
  const double width = text_width(cr, font, text);
  cairo_save(cr);
  cairo_translate(cr, left + font.ascent, middle + width / 2);
  cairo_rotate(cr, -std::numbers::pi / 2);
  set_colour(cr, Rgb{});
  cairo_move_to(cr, 0, 0);
  cairo_show_text(cr, printable(text).c_str());
  cairo_restore(cr);
}

// ---- curves ----

// Sets up cairo to stroke series s: its colour, width and dash pattern (1-4: dashed, dotted, dash-dot,
// dash-dot-dot, as on and off lengths in pixels; 0: solid). Round joins keep a noisy curve's corners solid.
void use_pen(cairo_t* cr, const Series& s) {
  static const std::vector<double> patterns[5] = {{}, {12, 7}, {2, 5}, {12, 5, 2, 5}, {12, 4, 2, 4, 2, 4}};
  const std::vector<double>& dashes = patterns[s.dash];
  set_colour(cr, s.colour);
  cairo_set_line_width(cr, s.line_width);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_BUTT);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  cairo_set_dash(cr, dashes.data(), static_cast<int>(dashes.size()), 0);
}

// Liang-Barsky: shortens the segment to its part inside `box`; false if no part is.
bool clip_segment(double& x0, double& y0, double& x1, double& y1, const Box& box) {
  const double dx = x1 - x0, dy = y1 - y0;
  double t0 = 0, t1 = 1;
  // Each edge keeps the points with p * t <= q.
  auto edge = [&](double p, double q) {
    if (p == 0) return q >= 0;
    const double t = q / p;
    if (p < 0) t0 = std::max(t0, t);
    else t1 = std::min(t1, t);
    return t0 <= t1;
  };
  if (!edge(-dx, x0 - box.left) || !edge(dx, box.right - x0) || !edge(-dy, y0 - box.top) ||
      !edge(dy, box.bottom - y0))
    return false;
  x1 = x0 + t1 * dx, y1 = y0 + t1 * dy;
  x0 = x0 + t0 * dx, y0 = y0 + t0 * dy;
  return std::isfinite(x0) && std::isfinite(y0) && std::isfinite(x1) && std::isfinite(y1);
}

}  // namespace

// ---- axes ----------------------------------------------------------------------------------------

std::vector<double> nice_ticks(double lo, double hi) {
  check(std::isfinite(lo) && std::isfinite(hi) && lo < hi && std::isfinite(hi - lo),
        "plot: ticks need a finite range lo < hi, got [", lo, ", ", hi, "]");
  // Try steps from small to large; the first that needs at most 8 ticks needs at least 5: steps below a
  // tenth of the span need more than 8, and each step (1, 2, 2.5, 5, 10 x 10^k) at most doubles the last.
  const int magnitude = static_cast<int>(std::floor(std::log10(hi - lo)));
  for (int k = magnitude - 1; k <= magnitude + 1; ++k)
    for (double m : {1.0, 2.0, 2.5, 5.0}) {
      // Dividing by 10^-k (exact) instead of multiplying by 10^k (inexact for k < 0) makes 0.1 * 3 read 0.3.
      const double scale = std::pow(10.0, std::abs(k));
      auto tick = [&](double i) { return k >= 0 ? i * m * scale : i * m / scale; };
      const double step = tick(1);
      // A range end within rounding of a tick (a sum like 0.1 + 0.2) does not add a tick beyond it.
      const double first = std::floor(lo / step + 1e-9), last = std::ceil(hi / step - 1e-9);
      if (last - first > 7) continue;
      std::vector<double> ticks;
      for (int64_t i = 0; i <= static_cast<int64_t>(last - first); ++i) ticks.push_back(tick(first + i));
      return ticks;
    }
  return {lo, hi};  // not reached
}

namespace {

// One axis in the units it is drawn in (log2(y) on a log2 axis): the range the plot area spans, and the
// ticks inside it with their labels.
struct Axis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
  std::vector<std::string> labels;
  double fraction(double v) const { return (v - lo) / (hi - lo); }
};

// The fewest decimals that show a tick exactly, to a millionth of the step: "2", "2.5", "0.001".
std::string tick_label(double value, double step) {
  if (std::abs(value) < step * 1e-6) value = 0;  // a tick computed as 1e-17 reads "0", not "-0.00000"
  char text[64];
  if (std::abs(value) < 1e7 && step >= 1e-6) {
    for (int decimals = 0; decimals <= 8; ++decimals) {
      std::snprintf(text, sizeof text, "%.*f", decimals, value);
      if (std::abs(std::strtod(text, nullptr) - value) <= step * 1e-6) return text;
    }
  }
  for (int digits = 1; digits <= 17; ++digits) {  // beyond fixed notation's reach: 1.5e+07, 2.5e-08
    std::snprintf(text, sizeof text, "%.*g", digits, value);
    if (std::abs(std::strtod(text, nullptr) - value) <= step * 1e-6) break;
  }
  return text;
}

// The distance by which a single value (or an automatic end on the wrong side of a fixed one) is widened
// into a range: a tenth of its size, or 1 around zero.
double spread(double v) { return v == 0 ? 1 : std::abs(v) * 0.1; }

// A linear axis over the data's range [data_lo, data_hi] (data_lo > data_hi: no data) and the fixed ends.
Axis linear_axis(const std::string& what, std::optional<double> fixed_lo, std::optional<double> fixed_hi,
                 double data_lo, double data_hi) {
  const bool data = data_lo <= data_hi;
  double lo = fixed_lo.value_or(data ? data_lo : 0), hi = fixed_hi.value_or(data ? data_hi : 1);
  // Equal to within rounding counts as equal: ticks cannot resolve a range of a few ulps.
  if (!(fixed_lo && fixed_hi) && !(hi - lo > 1e-12 * std::max(std::abs(lo), std::abs(hi)))) {
    if (fixed_lo) hi = lo + spread(lo);
    else if (fixed_hi) lo = hi - spread(hi);
    else lo -= spread(lo), hi += spread(hi);
  }
  check(std::isfinite(hi - lo), "plot: ", what, " range [", lo, ", ", hi, "] is too wide to draw");
  Axis axis;
  const std::vector<double> ticks = nice_ticks(lo, hi);
  const double step = ticks.size() > 1 ? ticks[1] - ticks[0] : hi - lo;
  axis.lo = fixed_lo ? lo : std::min(lo, ticks.front());
  axis.hi = fixed_hi ? hi : std::max(hi, ticks.back());
  for (double t : ticks)
    if (t >= axis.lo - 1e-9 * step && t <= axis.hi + 1e-9 * step) {
      axis.ticks.push_back(t);
      axis.labels.push_back(tick_label(t, step));
    }
  return axis;
}

// A log2 axis, in log2 units: whole powers of two around the data, ticks at multiples of 1, 2, 5, 10, ...
Axis log2_axis(std::optional<double> fixed_lo, std::optional<double> fixed_hi, double data_lo,
               double data_hi) {
  const bool data = data_lo <= data_hi;
  Axis axis;
  axis.lo = fixed_lo ? *fixed_lo : data ? std::floor(data_lo) : 0;
  axis.hi = fixed_hi ? *fixed_hi : data ? std::ceil(data_hi) : 1;
  if (!(axis.lo < axis.hi) && !(fixed_lo && fixed_hi)) {
    if (fixed_lo) axis.hi = std::floor(axis.lo) + 1;
    else if (fixed_hi) axis.lo = std::ceil(axis.hi) - 1;
    else axis.lo -= 1, axis.hi += 1;
  }
  // The smallest step with at most 8 ticks; doubles' exponents (-1074 to 1023) bound the search.
  for (double scale = 1;; scale *= 10)
    for (double m : {1, 2, 5}) {
      const double step = m * scale, first = std::ceil(axis.lo / step), last = std::floor(axis.hi / step);
      if (last - first > 7) continue;
      for (double i = first; i <= last; ++i) {
        axis.ticks.push_back(i * step);
        axis.labels.push_back("2^" + std::to_string(static_cast<long>(i * step)));
      }
      return axis;
    }
}

}  // namespace

// ---- the chart -----------------------------------------------------------------------------------

namespace {

constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrid{200, 200, 200};
constexpr int kEdge = 8;           // the blank border around everything
constexpr int kTickLength = 5;     // tick marks point into the plot area, as in gnuplot
constexpr int kLegendSample = 28;  // the length of a legend entry's line sample
constexpr int kLegendGap = 4;      // between one legend entry's line and the next

struct Fonts {
  Font text, title, chart_title;
};
// Names for messages: a panel by its title, else its number; a series by its label, else its place.
std::string panel_name(const Panel& panel, size_t index) {
  return panel.title.empty() ? std::to_string(index + 1) : "'" + panel.title + "'";
}
std::string series_name(const Series& series, size_t index, const std::string& panel) {
  return series.label.empty() ? std::to_string(index + 1) + " of panel " + panel : "'" + series.label + "'";
}

void check_axis(const std::string& panel, char axis, std::optional<double> lo, std::optional<double> hi,
                bool log2) {
  for (const auto& [end, name] : {std::pair{lo, "_min"}, std::pair{hi, "_max"}}) {
    if (!end) continue;
    check(std::isfinite(*end), "plot: panel ", panel, " has ", axis, name, " ", *end,
          "; a fixed axis end must be finite");
    check(!log2 || *end > 0, "plot: panel ", panel, " has ", axis, name, " ", *end,
          "; a log2 axis needs positive values");
  }
  check(!lo || !hi || *lo < *hi, "plot: panel ", panel, " has the empty ", axis, " range [", lo.value_or(0),
        ", ", hi.value_or(0), "]");
}

void validate(const Chart& chart) {
  check(chart.width >= 200 && chart.width <= 8000 && chart.height >= 200 && chart.height <= 8000,
        "plot: the chart is ", chart.width, "x", chart.height, " pixels; each side must be 200-8000");
  check(!chart.panels.empty(), "plot: the chart has no panels");
  for (size_t p = 0; p < chart.panels.size(); ++p) {
    const Panel& panel = chart.panels[p];
    const std::string name = panel_name(panel, p);
    check_axis(name, 'x', panel.x_min, panel.x_max, false);
    check_axis(name, 'y', panel.y_min, panel.y_max, panel.log2_y);
    for (size_t i = 0; i < panel.series.size(); ++i) {
      const Series& s = panel.series[i];
      const std::string series = series_name(s, i, name);
      check(s.x.size() == s.y.size(), "plot: series ", series, " has ", s.x.size(), " x values but ",
            s.y.size(), " y values");
      check(s.dash >= 0 && s.dash <= 4, "plot: series ", series, " has dash ", s.dash,
            "; it must be 0 (solid) to 4");
      check(s.line_width >= 0 && s.line_width <= 4, "plot: series ", series, " has line width ",
            s.line_width, "; it must be 0 (no line) to 4");
      check(s.line_width > 0 || s.points, "plot: series ", series,
            " draws nothing: line width 0 and no points");
    }
  }
}

// Point i of a series in axis units (log2(y) on a log2 axis), or nothing where the line breaks.
std::optional<std::pair<double, double>> point(const Series& s, size_t i, bool log2_y) {
  const double x = s.x[i], y = s.y[i];
  if (!std::isfinite(x) || !std::isfinite(y) || (log2_y && y <= 0)) return std::nullopt;
  return std::pair{x, log2_y ? std::log2(y) : y};
}

struct Axes {
  Axis x, y;
};

Axes make_axes(const Panel& panel, const std::string& name) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double x_lo = kInf, x_hi = -kInf, y_lo = kInf, y_hi = -kInf;
  for (const Series& s : panel.series)
    for (size_t i = 0; i < s.x.size(); ++i)
      if (const auto p = point(s, i, panel.log2_y)) {
        x_lo = std::min(x_lo, p->first), x_hi = std::max(x_hi, p->first);
        y_lo = std::min(y_lo, p->second), y_hi = std::max(y_hi, p->second);
      }
  Axes axes;
  axes.x = linear_axis("panel " + name + " x", panel.x_min, panel.x_max, x_lo, x_hi);
  if (panel.log2_y) {
    auto log2_of = [](std::optional<double> v) { return v ? std::optional(std::log2(*v)) : std::nullopt; };
    axes.y = log2_axis(log2_of(panel.y_min), log2_of(panel.y_max), y_lo, y_hi);
  } else {
    axes.y = linear_axis("panel " + name + " y", panel.y_min, panel.y_max, y_lo, y_hi);
  }
  return axes;
}

// Pixel positions of values in axis units. A curve's point lies on its pixel's centre, so that a value at an
// axis end is drawn along the frame; ticks and the grid keep to whole pixels.
double column_of(const Box& frame, const Axis& x, double v) {
  return frame.left + 0.5 + x.fraction(v) * (frame.right - frame.left);
}
double row_of(const Box& frame, const Axis& y, double v) {
  return frame.bottom + 0.5 - y.fraction(v) * (frame.bottom - frame.top);
}

// The series' pixel positions: polylines through its points, broken at the points that cannot be drawn.
// A point between two breaks has no segment to show it: it goes to `lone`.
void trace_series(cairo_t* cr, const Box& frame, const Axes& axes, const Series& s, bool log2_y,
                  std::vector<std::pair<double, double>>& points,
                  std::vector<std::pair<double, double>>& lone) {
  // Segments are cut to a margin around the frame before cairo sees them: its fixed-point coordinates cannot
  // hold data far outside a fixed range.
  const Box reach{frame.left - 8, frame.top - 8, frame.right + 9, frame.bottom + 9};
  std::optional<std::pair<double, double>> last;  // the previous point; none after a break
  bool joined = false;                            // the path's current point is `last`
  int run = 0;                                    // points since the last break
  auto end_run = [&] {
    if (run == 1 && last->first > reach.left && last->first < reach.right && last->second > reach.top &&
        last->second < reach.bottom)
      lone.push_back(*last);
    last.reset(), joined = false, run = 0;
  };
  for (size_t i = 0; i < s.x.size(); ++i) {
    const auto p = point(s, i, log2_y);
    const double x = p ? column_of(frame, axes.x, p->first) : NAN;
    const double y = p ? row_of(frame, axes.y, p->second) : NAN;
    if (!std::isfinite(x) || !std::isfinite(y)) {
      end_run();
      continue;
    }
    if (last) {
      double x0 = last->first, y0 = last->second, x1 = x, y1 = y;
      if (clip_segment(x0, y0, x1, y1, reach)) {
        if (!joined || x0 != last->first || y0 != last->second) cairo_move_to(cr, x0, y0);
        cairo_line_to(cr, x1, y1);
        joined = x1 == x && y1 == y;
      } else {
        joined = false;
      }
    }
    last = {x, y};
    ++run;
    points.push_back(*last);
  }
  end_run();
}

// The series' line and markers, inside the frame (edges included) only. Curves go over the frame: a curve
// along an axis end (a loss scale of 1 at 2^0) stays visible.
void draw_series(cairo_t* cr, const Box& frame, const Axes& axes, const Series& s, bool log2_y) {
  cairo_save(cr);
  cairo_rectangle(cr, frame.left, frame.top, frame.right - frame.left + 1, frame.bottom - frame.top + 1);
  cairo_clip(cr);
  std::vector<std::pair<double, double>> points, lone;
  trace_series(cr, frame, axes, s, log2_y, points, lone);
  if (s.line_width > 0) {
    use_pen(cr, s);
    cairo_stroke(cr);
    const double half = s.line_width / 2.0;
    for (const auto& [x, y] : lone) cairo_rectangle(cr, x - half, y - half, s.line_width, s.line_width);
    cairo_fill(cr);
  }
  cairo_new_path(cr);
  if (s.points)  // a 5x5 square on whole pixels around each point's pixel
    for (const auto& [x, y] : points)
      if (x >= frame.left - 2 && x < frame.right + 3 && y >= frame.top - 2 && y < frame.bottom + 3) {
        const int cx = static_cast<int>(std::floor(x)), cy = static_cast<int>(std::floor(y));
        fill_box(cr, {cx - 2, cy - 2, cx + 2, cy + 2}, s.colour);
      }
  cairo_restore(cr);
}

// Labels every `stride`-th tick, so that labels `size` pixels long (plus a gap) never touch: on a narrow plot
// area the grid keeps every tick, the labels only as many as fit.
int label_stride(const std::vector<double>& ticks, const Axis& axis, int length, double size) {
  if (ticks.size() < 2) return 1;
  const double spacing = std::abs(axis.fraction(ticks[1]) - axis.fraction(ticks[0])) * length;
  return spacing >= size + 6 ? 1 : static_cast<int>(std::ceil((size + 6) / std::max(spacing, 1.0)));
}

// The dotted grid (light, so the curves stand out over it), the tick marks, the tick labels and the frame.
void draw_axes(cairo_t* cr, const Font& font, const Box& f, const Axes& axes) {
  double widest = 0;
  for (const std::string& label : axes.x.labels) widest = std::max(widest, text_width(cr, font, label));
  const int x_stride = label_stride(axes.x.ticks, axes.x, f.right - f.left, widest);
  const int y_stride = label_stride(axes.y.ticks, axes.y, f.bottom - f.top, font.line);
  for (size_t i = 0; i < axes.x.ticks.size(); ++i) {
    const int x = static_cast<int>(std::floor(column_of(f, axes.x, axes.x.ticks[i])));
    if (x > f.left && x < f.right) dotted_line(cr, x + 0.5, f.top + 3, x + 0.5, f.bottom, kGrid);
    fill_box(cr, {x, f.bottom - kTickLength + 1, x, f.bottom}, kBlack);
    fill_box(cr, {x, f.top, x, f.top + kTickLength - 1}, kBlack);
    if (i % x_stride == 0) draw_text(cr, font, x + 0.5, f.bottom + 7, axes.x.labels[i], Align::centre);
  }
  for (size_t i = 0; i < axes.y.ticks.size(); ++i) {
    const int y = static_cast<int>(std::floor(row_of(f, axes.y, axes.y.ticks[i])));
    if (y > f.top && y < f.bottom) dotted_line(cr, f.left + 3, y + 0.5, f.right, y + 0.5, kGrid);
    fill_box(cr, {f.left, y, f.left + kTickLength - 1, y}, kBlack);
    fill_box(cr, {f.right - kTickLength + 1, y, f.right, y}, kBlack);
    const double label_top =
        std::round(y + 0.5 + font.digit / 2) - font.ascent;  // digits centred on the tick
    if (i % y_stride == 0) draw_text(cr, font, f.left - 6, label_top, axes.y.labels[i], Align::right);
  }
  for (const Box& side : {Box{f.left, f.top, f.right, f.top}, Box{f.left, f.bottom, f.right, f.bottom},
                          Box{f.left, f.top, f.left, f.bottom}, Box{f.right, f.top, f.right, f.bottom}})
    fill_box(cr, side, kBlack);
}

// One row per labelled series from `top` down, a line sample then the label, as many as fit above `bottom`.
void draw_legend(cairo_t* cr, const Font& font, const Panel& panel, int left, int top, int bottom) {
  int y = top + 2;
  for (const Series& s : panel.series) {
    if (s.label.empty()) continue;
    if (y + font.line > bottom) break;
    // The sample's middle row is the middle of the label's digits; an odd width centres on that row's middle.
    const int middle = static_cast<int>(std::floor(y + font.ascent - font.digit / 2));
    if (s.line_width > 0) {
      const double centre = middle + (s.line_width % 2 ? 0.5 : 0.0);
      use_pen(cr, s);
      cairo_move_to(cr, left, centre);
      cairo_line_to(cr, left + kLegendSample, centre);
      cairo_stroke(cr);
    }
    const int dot = left + kLegendSample / 2;
    if (s.points) fill_box(cr, {dot - 2, middle - 2, dot + 2, middle + 2}, s.colour);
    draw_text(cr, font, left + kLegendSample + 6, y, s.label, Align::left);
    y += static_cast<int>(font.line) + kLegendGap;
  }
}

// One panel in the band of rows [band_top, band_bottom], its plot area spanning columns [left, right].
void draw_panel(cairo_t* cr, const Fonts& fonts, const Panel& panel, const Axes& axes, int left, int right,
                int band_top, int band_bottom) {
  const Font& text = fonts.text;
  const int top = band_top + (panel.title.empty() ? 6 : static_cast<int>(fonts.title.line) + 8);
  // Below the frame: the tick labels, the x label, a gap to the next panel.
  const int below = 7 + static_cast<int>(text.line) + (panel.x_label.empty() ? 0 : 6 + int(text.line)) + 12;
  const int bottom = std::max(top + 20, band_bottom - below);
  const Box frame{left, top, right, bottom};
  const double centre = (left + right + 1) / 2.0;
  if (!panel.title.empty()) draw_text(cr, fonts.title, centre, band_top, panel.title, Align::centre);
  draw_axes(cr, text, frame, axes);
  if (!panel.x_label.empty())
    draw_text(cr, text, centre, bottom + 7 + text.line + 6, panel.x_label, Align::centre);
  if (!panel.y_label.empty()) draw_text_upwards(cr, text, kEdge, (top + bottom + 1) / 2.0, panel.y_label);
  for (const Series& s : panel.series) draw_series(cr, frame, axes, s, panel.log2_y);
  draw_legend(cr, text, panel, right + 14, top, band_bottom);
}

// The chart's fonts, set up in cr: unhinted metrics, so that a text's width is proportional to its size. A
// chart title wider than the chart (precision_study's names every flag) is set smaller, to fit.
Fonts chart_fonts(cairo_t* cr, const Chart& chart) {
  const FontOptions options(cairo_font_options_create(), cairo_font_options_destroy);
  cairo_font_options_set_hint_metrics(options.get(), CAIRO_HINT_METRICS_OFF);
  cairo_set_font_options(cr, options.get());
  Fonts fonts{measured(cr, kTextSize, false), measured(cr, kTitleSize, false),
              measured(cr, kTitleSize, true)};
  const double title_width = text_width(cr, fonts.chart_title, chart.title), room = chart.width - 2 * kEdge;
  if (title_width > room) fonts.chart_title = measured(cr, kTitleSize * room / title_width, true);
  return fonts;
}

}  // namespace

Image render(const Chart& chart) {
  validate(chart);
  std::vector<Axes> axes;
  for (size_t p = 0; p < chart.panels.size(); ++p)
    axes.push_back(make_axes(chart.panels[p], panel_name(chart.panels[p], p)));
  const Surface surface = rgb_surface(chart.width, chart.height);
  const Context context(cairo_create(surface.get()), cairo_destroy);
  cairo_t* cr = context.get();
  const Fonts fonts = chart_fonts(cr, chart);

  // Margins shared by all panels, so that their plot areas line up: the left one fits the widest y tick
  // label and the turned y label, the right one the longest legend label (or half an x tick label).
  double widest_tick = 0, widest_legend = -1;
  bool y_label = false;
  for (size_t p = 0; p < chart.panels.size(); ++p) {
    for (const std::string& label : axes[p].y.labels)
      widest_tick = std::max(widest_tick, text_width(cr, fonts.text, label));
    for (const Series& s : chart.panels[p].series)
      if (!s.label.empty()) widest_legend = std::max(widest_legend, text_width(cr, fonts.text, s.label));
    y_label = y_label || !chart.panels[p].y_label.empty();
  }
  const int left = kEdge + (y_label ? static_cast<int>(fonts.text.line) + 8 : 0) +
                   static_cast<int>(std::ceil(widest_tick)) + 6;
  const int right_margin =
      widest_legend < 0 ? 24 : 14 + kLegendSample + 6 + static_cast<int>(std::ceil(widest_legend)) + kEdge;
  const int right = std::max(left + 20, chart.width - 1 - right_margin);

  set_colour(cr, kWhite);
  cairo_paint(cr);
  int top = kEdge;
  if (!chart.title.empty()) {
    draw_text(cr, fonts.chart_title, chart.width / 2.0, top, chart.title, Align::centre);
    top += static_cast<int>(fonts.chart_title.line) + 10;
  }
  const int n = static_cast<int>(chart.panels.size());
  const int band = (chart.height - kEdge - top) / n;
  for (int p = 0; p < n; ++p)
    draw_panel(cr, fonts, chart.panels[p], axes[p], left, right, top + p * band, top + (p + 1) * band - 1);
  check_cairo(cairo_status(cr), "draw the chart");
  return image_of(surface.get());
}

}  // namespace mixtape::plot
