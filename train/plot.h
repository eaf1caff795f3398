#pragma once

// Line charts as PNG files, for the example programs (precision_study's loss curves and loss-scale trace,
// plot_loss's training curve), drawn with cairo. A chart is one or more panels stacked vertically, each with
// its axes, tick labels, grid, title and a legend to the right of the plot area. Curves are antialiased; the
// frame, ticks, grid and point markers cover whole pixels in their exact colours. Text is cairo's "sans-serif"
// face (fontconfig's choice, e.g. DejaVu Sans) in printable ASCII; any other byte draws as '?'. The PNG is
// 8-bit RGB, as cairo writes it.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace mixtape::plot {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};

// "#1f77b4" -> {0x1f, 0x77, 0xb4}; anything else is an Error naming the text.
Rgb parse_rgb(const std::string& hex);

// The ten colours precision_study gives its modes, in order (those of matplotlib's "tab10").
const std::vector<Rgb>& palette();

struct Series {
  std::string label = {};     // in the legend; empty: not in the legend
  std::vector<double> x = {}, y = {};  // equal lengths; a point whose x or y is not finite breaks the line there
  Rgb colour = {};
  int dash = 0;               // 0: solid; 1-4: four distinct dash patterns, so overlapping curves stay visible
  int line_width = 2;         // pixels, 1-4; 0: no line (points only)
  bool points = false;        // a filled 5x5 square marker at each finite point
};

struct Panel {
  std::string title = {};     // centred above the plot area
  std::string x_label = {}, y_label = {};
  std::vector<Series> series = {};
  bool log2_y = false;        // y on a log2 axis with ticks labelled 2^k; a non-positive y breaks the line
  // Axis ranges; unset: the data's range widened to "nice" tick values (1, 2, 2.5 or 5 x 10^k steps, about
  // 5-8 ticks; powers of two on a log2 axis). A panel without a finite point is drawn with empty axes
  // over [0, 1].
  std::optional<double> x_min = {}, x_max = {}, y_min = {}, y_max = {};
};

struct Chart {
  int width = 1000, height = 1000;  // pixels, 200-8000 each
  std::string title = {};           // centred at the top; empty: none
  std::vector<Panel> panels = {};   // at least one; stacked top to bottom in equal heights
};

// An 8-bit RGB image, row-major, top row first.
class Image {
 public:
  Image(int width, int height, Rgb background);
  int width() const { return width_; }
  int height() const { return height_; }
  Rgb at(int x, int y) const;              // Error outside the image
  void set(int x, int y, Rgb c);           // ignored outside the image (drawing clips)
  const std::vector<uint8_t>& rgb() const { return rgb_; }

 private:
  int width_, height_;
  std::vector<uint8_t> rgb_;
};

// Draws the chart. Errors (mixtape::Error, naming what is wrong): size out of range, no panels, a series
// whose x and y lengths differ, dash or line width out of range, a series that draws nothing (line width 0
// without points), a fixed axis range that is empty or not finite (or not positive on a log2 axis).
Image render(const Chart& chart);

// The PNG file's bytes for `image`.
std::string encode_png(const Image& image);

// render + encode_png, written to `path` complete or not at all (a temporary file beside it, then a rename).
void write_png(const Chart& chart, const std::filesystem::path& path);

// The "nice" tick values covering [lo, hi] on a linear axis (see Panel), lo < hi.
std::vector<double> nice_ticks(double lo, double hi);

}  // namespace mixtape::plot
