#pragma once
// `loom plot`'s figures: panels of curves against one shared x axis, one colour per run, drawn
// with cairo (antialiased lines and text) as PNG, SVG or PDF by the same drawing code. Depends on
// the standard library and cairo only, so the tests compile it directly.
#include <cstddef>
#include <string>
#include <vector>

namespace loom::plot {

struct Point {
  double x = 0, y = 0;
};

// One run's curve in a panel: a line, or for validation a dashed line with a marker per point.
struct Curve {
  size_t run = 0;  // index into Figure::runs: the curve's colour and legend entry
  bool validation = false;
  std::vector<Point> points;  // by x; a non-finite y breaks the line
};

struct Panel {
  std::string title;  // above the axes
  std::string y_label;
  bool log_y = false;  // every y must then be > 0
  std::vector<Curve> curves;
};

struct Figure {
  std::string title;  // above all panels; none when empty
  std::string x_label = "step";
  std::vector<std::string> runs;  // legend entries, in colour order
  std::vector<Panel> panels;      // one to six: alone, side by side, or two a row
};

enum class Format { png, svg, pdf };
// The format a file name's extension names (.png, .svg or .pdf, in any case); otherwise
// std::invalid_argument naming the file.
Format format_of(const std::string& path);

// The figure's size in pixels for `panels` panels (PNG and SVG); a PDF page has the same size at
// 100 pixels to the inch, as matplotlib's default figures do.
struct Size {
  int width = 0, height = 0;
};
Size figure_size(size_t panels);

// The file's bytes: std::invalid_argument for a figure that cannot be drawn (no panel, or more
// than four, a panel without a finite point, a log axis with a y <= 0), std::runtime_error when
// cairo fails.
std::string render(const Figure& f, Format format);

}  // namespace loom::plot
