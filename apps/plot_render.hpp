#pragma once
// Loss curves drawn without any library: SVG as text, or PNG rasterized here (2-px lines, a 5x7
// bitmap font, an 8-bit palette) and written with zlib stored blocks. Depends on the standard
// library only, so the tests compile it directly.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace loom::plot {

struct Point {
  double x = 0, y = 0;
};

// One run: the training loss as a line, the validation loss as markers on a dashed line.
struct Series {
  std::string name;  // the legend entry
  std::vector<Point> train, val;
};

struct Figure {
  std::string title;
  std::string x_label = "step", y_label = "loss";
  bool log_y = false;  // every y must then be > 0
  int width = 1000, height = 640;
  std::vector<Series> series;  // at least one point in all
};

std::string render_svg(const Figure& f);
std::vector<uint8_t> render_png(const Figure& f);

// Tick positions: about `target` round values (1, 2 or 5 times a power of ten apart) in
// [lo, hi]; for a log axis, powers of ten (with 2 and 5, or 2..9, between them when the range
// is short).
std::vector<double> linear_ticks(double lo, double hi, int target);
std::vector<double> log_ticks(double lo, double hi);
// A tick label with as many decimals as the spacing of the ticks needs.
std::string tick_label(double v, double spacing);

// PNG building blocks (exposed for the tests).
uint32_t crc32(const uint8_t* data, size_t n);
uint32_t adler32(const uint8_t* data, size_t n);
// An 8-bit indexed-colour PNG: `pixels` [height][width] are indices into `palette` (0xRRGGBB).
std::vector<uint8_t> encode_png(const std::vector<uint8_t>& pixels, int width, int height,
                                const std::vector<uint32_t>& palette);

}  // namespace loom::plot
