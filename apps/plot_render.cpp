#include "apps/plot_render.hpp"

#include <cairo-pdf.h>
#include <cairo-svg.h>
#include <cairo.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <numbers>
#include <stdexcept>

#include "apps/plot_ticks.hpp"

namespace loom::plot {

namespace {

struct SurfaceDeleter {
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
};
struct ContextDeleter {
  void operator()(cairo_t* c) const { cairo_destroy(c); }
};
struct FontOptionsDeleter {
  void operator()(cairo_font_options_t* o) const { cairo_font_options_destroy(o); }
};
using Surface = std::unique_ptr<cairo_surface_t, SurfaceDeleter>;
using Context = std::unique_ptr<cairo_t, ContextDeleter>;
using FontOptions = std::unique_ptr<cairo_font_options_t, FontOptionsDeleter>;

void check(cairo_status_t status, const char* what) {
  if (status != CAIRO_STATUS_SUCCESS)
    throw std::runtime_error(std::string("plot: cairo failed ") + what + ": " +
                             cairo_status_to_string(status));
}

// cairo's write callback: the file's bytes go to a string, and the command writes the file, so
// that a path that cannot be written gets the command's own message.
cairo_status_t append(void* closure, const unsigned char* data, unsigned int n) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), n);
  return CAIRO_STATUS_SUCCESS;
}

// ---- the look: matplotlib's defaults at 100 dpi, with a light grid ---------------------------
// matplotlib's colour cycle (tab10) without its grey and olive, which read as the legend's
// train/validation samples and as the grid.
constexpr uint32_t kRunColors[] = {0x1f77b4, 0xff7f0e, 0x2ca02c, 0xd62728,
                                   0x9467bd, 0x8c564b, 0xe377c2, 0x17becf};
constexpr uint32_t kText = 0x000000, kSpine = 0x000000, kGrid = 0xdddddd, kStyleSample = 0x444444;
constexpr uint32_t kLegendFrame = 0xcccccc;
constexpr const char* kFont = "DejaVu Sans";  // matplotlib's default face
constexpr double kTickFont = 12, kLabelFont = 13, kPanelTitleFont = 14, kTitleFont = 17;
constexpr double kLegendFont = 12;
constexpr double kLineWidth = 1.8, kGridWidth = 0.8, kSpineWidth = 1, kTickLen = 4;
constexpr double kMarkerRadius = 3.2, kDash[] = {6.5, 3};
constexpr double kPdfPointsPerPixel = 72.0 / 100;
constexpr double kTitleBand = 40;  // above the panels, when the figure has a title

uint32_t run_color(size_t run) {
  return kRunColors[run % std::size(kRunColors)];
}

void set_color(cairo_t* cr, uint32_t rgb, double alpha = 1) {
  cairo_set_source_rgba(cr, double((rgb >> 16) & 255) / 255, double((rgb >> 8) & 255) / 255,
                        double(rgb & 255) / 255, alpha);
}

// ---- text --------------------------------------------------------------------------------------
enum class Align { start, middle, end };

void set_font(cairo_t* cr, double size) {
  cairo_select_font_face(cr, kFont, CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
}

double text_width(cairo_t* cr, const std::string& s, double size) {
  set_font(cr, size);
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  return e.x_advance;
}

// The height of the digits and capitals: text is placed by their middle, so labels with and
// without descenders line up.
double cap_height(cairo_t* cr, double size) {
  set_font(cr, size);
  cairo_text_extents_t e;
  cairo_text_extents(cr, "0", &e);
  return -e.y_bearing;
}

// `s` with the middle of its capitals at y (at x when `vertical`, reading bottom to top).
void text(cairo_t* cr, double x, double y, const std::string& s, double size, Align align,
          bool vertical = false) {
  const double w = text_width(cr, s, size), cap = cap_height(cr, size);
  cairo_save(cr);
  cairo_translate(cr, x, y);
  if (vertical) cairo_rotate(cr, -std::numbers::pi / 2);
  const double u = align == Align::start ? 0 : align == Align::middle ? -w / 2 : -w;
  set_color(cr, kText);
  cairo_move_to(cr, u, cap / 2);
  cairo_show_text(cr, s.c_str());
  cairo_restore(cr);
}

// ---- axes ------------------------------------------------------------------------------------
struct Axis {
  double lo = 0, hi = 1;  // the range shown, in data units
  bool log = false;
  double map(double v) const { return log ? std::log10(v) : v; }
  double frac(double v) const { return (map(v) - map(lo)) / (map(hi) - map(lo)); }
};

// The data's range with matplotlib's margins (5% of it on each side, in log space for a log
// axis), so no curve runs along the frame.
Axis padded(double lo, double hi, bool log) {
  Axis a{lo, hi, log};
  if (a.hi == a.lo) {
    const double d = a.lo != 0 ? std::abs(a.lo) * 0.1 : 1;
    a.lo = log ? a.lo / 1.5 : a.lo - d;
    a.hi = log ? a.hi * 1.5 : a.hi + d;
  }
  const double l = a.map(a.lo), h = a.map(a.hi), m = 0.05 * (h - l);
  a.lo = log ? std::pow(10.0, l - m) : l - m;
  a.hi = log ? std::pow(10.0, h + m) : h + m;
  return a;
}

template <typename F>
void for_each_point(const Panel& p, F&& f) {
  for (const Curve& c : p.curves)
    for (const Point& pt : c.points)
      if (std::isfinite(pt.x) && std::isfinite(pt.y)) f(pt);
}

struct Ticks {
  std::vector<double> at;
  std::vector<std::string> labels;
  double widest = 0;
};

// Round tick values, fewer of them while their labels would crowd the axis (`room` pixels).
Ticks make_ticks(cairo_t* cr, const Axis& a, double room, double px_per_tick, bool horizontal) {
  Ticks t;
  for (int target = std::clamp(int(room / px_per_tick), 3, 9); target >= 2; --target) {
    t = {};
    t.at = a.log ? log_ticks(a.lo, a.hi) : linear_ticks(a.lo, a.hi, target);
    double total = 0;
    for (size_t i = 0; i < t.at.size(); ++i) {
      double spacing = t.at.size() > 1 ? t.at[1] - t.at[0] : 1;
      // On a log axis each label needs the decimals of its own magnitude.
      if (a.log)
        spacing = std::min(
            t.at[i], i + 1 < t.at.size() ? t.at[i + 1] - t.at[i] : t.at[i] - (i ? t.at[i - 1] : 0));
      t.labels.push_back(tick_label(t.at[i], spacing));
      const double w = text_width(cr, t.labels.back(), kTickFont);
      t.widest = std::max(t.widest, w);
      total += horizontal ? w + 12 : kTickFont * 1.6;
    }
    if (a.log || total <= room) break;
  }
  return t;
}

struct Rect {
  double x = 0, y = 0, w = 0, h = 0;
};

// A one-pixel line on the pixel grid rather than across two half-covered rows.
double crisp(double v) {
  return std::floor(v) + 0.5;
}

void stroke_curve(cairo_t* cr, const Curve& c, const Rect& box, const Axis& ax, const Axis& ay) {
  auto X = [&](double v) { return box.x + ax.frac(v) * box.w; };
  auto Y = [&](double v) { return box.y + box.h - ay.frac(v) * box.h; };
  set_color(cr, run_color(c.run));
  cairo_set_line_width(cr, kLineWidth);
  cairo_set_dash(cr, kDash, c.validation ? int(std::size(kDash)) : 0, 0);
  bool open = false;
  size_t drawn = 0;
  for (const Point& p : c.points) {
    if (!std::isfinite(p.x) || !std::isfinite(p.y)) {
      open = false;
      continue;
    }
    (open ? cairo_line_to : cairo_move_to)(cr, X(p.x), Y(p.y));
    open = true;
    ++drawn;
  }
  cairo_stroke(cr);
  cairo_set_dash(cr, nullptr, 0, 0);
  // Markers for validation points, and for a training curve of one point, which has no line.
  if (c.validation || drawn == 1)
    for (const Point& p : c.points)
      if (std::isfinite(p.x) && std::isfinite(p.y)) {
        cairo_new_sub_path(cr);
        cairo_arc(cr, X(p.x), Y(p.y), kMarkerRadius, 0, 2 * std::numbers::pi);
      }
  cairo_fill(cr);
}

// The runs' colours, then (when a panel shows validation) the line styles of train and
// validation, in a box in the top right corner of the axes, where falling losses leave room.
void draw_legend(cairo_t* cr, const Figure& f, const Rect& box) {
  bool any_validation = false;
  for (const Panel& p : f.panels)
    for (const Curve& c : p.curves) any_validation = any_validation || c.validation;
  struct Entry {
    std::string name;
    uint32_t color;
    bool dashed;
  };
  std::vector<Entry> entries;
  for (size_t i = 0; i < f.runs.size(); ++i) entries.push_back({f.runs[i], run_color(i), false});
  if (any_validation) {
    entries.push_back({"train", kStyleSample, false});
    entries.push_back({"validation", kStyleSample, true});
  }
  double name_w = 0;
  for (const Entry& e : entries) name_w = std::max(name_w, text_width(cr, e.name, kLegendFont));
  const double row = kLegendFont * 1.6, sample = 28, pad = 8;
  const double w = pad + sample + 8 + name_w + pad, h = pad + row * double(entries.size()) + 2;
  const double x = box.x + box.w - 10 - w, y = box.y + 10;
  cairo_new_path(cr);
  const double r = 3;
  cairo_arc(cr, x + w - r, y + r, r, -std::numbers::pi / 2, 0);
  cairo_arc(cr, x + w - r, y + h - r, r, 0, std::numbers::pi / 2);
  cairo_arc(cr, x + r, y + h - r, r, std::numbers::pi / 2, std::numbers::pi);
  cairo_arc(cr, x + r, y + r, r, std::numbers::pi, 3 * std::numbers::pi / 2);
  cairo_close_path(cr);
  set_color(cr, 0xffffff, 0.85);
  cairo_fill_preserve(cr);
  set_color(cr, kLegendFrame);
  cairo_set_line_width(cr, 1);
  cairo_stroke(cr);
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const double yy = y + pad / 2 + row * (double(i) + 0.5) + 1, x0 = x + pad;
    set_color(cr, e.color);
    cairo_set_line_width(cr, kLineWidth);
    cairo_set_dash(cr, kDash, e.dashed ? int(std::size(kDash)) : 0, 0);
    cairo_move_to(cr, x0, yy);
    cairo_line_to(cr, x0 + sample, yy);
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
    if (e.dashed) {
      cairo_arc(cr, x0 + sample / 2, yy, kMarkerRadius, 0, 2 * std::numbers::pi);
      cairo_fill(cr);
    }
    text(cr, x0 + sample + 8, yy, e.name, kLegendFont, Align::start);
  }
}

// The room a panel's cell keeps around its axes' box: on the left for the y label (and the tick
// labels, whose width is known later), below for the x tick labels and label, above for the title.
constexpr double kCellLeft = 12 + kLabelFont + 10, kCellRight = 20;
constexpr double kCellTop = 14 + kPanelTitleFont + 10;
constexpr double kCellBottom = kTickLen + 6 + kTickFont + 10 + kLabelFont + 12;

struct YAxis {
  Axis axis;
  Ticks ticks;
};

YAxis y_axis(cairo_t* cr, const Panel& p, double box_height) {
  double lo = INFINITY, hi = -INFINITY;
  for_each_point(p, [&](const Point& pt) {
    lo = std::min(lo, pt.y);
    hi = std::max(hi, pt.y);
  });
  if (!(lo <= hi)) throw std::invalid_argument("plot: panel '" + p.title + "' has no points");
  if (p.log_y && lo <= 0)
    throw std::invalid_argument("plot: panel '" + p.title + "': a log axis needs values > 0");
  YAxis y{padded(lo, hi, p.log_y), {}};
  y.ticks = make_ticks(cr, y.axis, box_height, 60, false);
  return y;
}

// The left edge of a cell's axes box. `tick_room`: the width of the widest y tick label in the
// panel's column, so that the boxes of the panels above one another line up.
double box_left(const Rect& cell, double tick_room) {
  return cell.x + kCellLeft + tick_room + 6 + kTickLen;
}

// `xt`: the x ticks of every panel, so the grids of panels side by side match.
void draw_panel(cairo_t* cr, const Figure& f, const Panel& p, const Axis& ax, const Ticks& xt,
                const YAxis& y, const Rect& cell, double tick_room, bool legend) {
  const Axis& ay = y.axis;
  const Ticks& yt = y.ticks;
  const double top = cell.y + kCellTop, bottom = cell.y + cell.h - kCellBottom;
  const double left = box_left(cell, tick_room);
  const double right = cell.x + cell.w - kCellRight;
  if (right - left < 60 || bottom - top < 60)
    throw std::invalid_argument("plot: the figure is too small for panel '" + p.title + "'");
  const Rect box{left, top, right - left, bottom - top};
  auto X = [&](double v) { return box.x + ax.frac(v) * box.w; };
  auto Y = [&](double v) { return box.y + box.h - ay.frac(v) * box.h; };

  cairo_set_line_width(cr, kGridWidth);
  set_color(cr, kGrid);
  for (double v : xt.at) {
    cairo_move_to(cr, crisp(X(v)), box.y);
    cairo_line_to(cr, crisp(X(v)), box.y + box.h);
  }
  for (double v : yt.at) {
    cairo_move_to(cr, box.x, crisp(Y(v)));
    cairo_line_to(cr, box.x + box.w, crisp(Y(v)));
  }
  cairo_stroke(cr);

  cairo_save(cr);
  cairo_rectangle(cr, box.x, box.y, box.w, box.h);
  cairo_clip(cr);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  for (const Curve& c : p.curves) stroke_curve(cr, c, box, ax, ay);
  cairo_restore(cr);

  set_color(cr, kSpine);
  cairo_set_line_width(cr, kSpineWidth);
  cairo_rectangle(cr, crisp(box.x), crisp(box.y), std::round(box.w), std::round(box.h));
  for (double v : xt.at) {
    cairo_move_to(cr, crisp(X(v)), crisp(box.y + box.h));
    cairo_rel_line_to(cr, 0, kTickLen);
  }
  for (double v : yt.at) {
    cairo_move_to(cr, crisp(box.x), crisp(Y(v)));
    cairo_rel_line_to(cr, -kTickLen, 0);
  }
  cairo_stroke(cr);
  const double xlab_y = box.y + box.h + kTickLen + 6 + kTickFont / 2;
  for (size_t i = 0; i < xt.at.size(); ++i)
    text(cr, X(xt.at[i]), xlab_y, xt.labels[i], kTickFont, Align::middle);
  for (size_t i = 0; i < yt.at.size(); ++i)
    text(cr, box.x - kTickLen - 5, Y(yt.at[i]), yt.labels[i], kTickFont, Align::end);
  text(cr, box.x + box.w / 2, xlab_y + kTickFont / 2 + 10 + kLabelFont / 2, f.x_label, kLabelFont,
       Align::middle);
  text(cr, cell.x + kCellLeft - 10 - kLabelFont / 2, box.y + box.h / 2,
       p.y_label + (p.log_y ? " (log scale)" : ""), kLabelFont, Align::middle, true);
  text(cr, box.x + box.w / 2, cell.y + 14 + kPanelTitleFont / 2, p.title, kPanelTitleFont,
       Align::middle);
  if (legend) draw_legend(cr, f, box);
}

void draw(cairo_t* cr, const Figure& f, Size size) {
  // The same glyph advances on every surface, so the three formats share one layout.
  FontOptions fo(cairo_font_options_create());
  cairo_font_options_set_hint_metrics(fo.get(), CAIRO_HINT_METRICS_OFF);
  cairo_font_options_set_hint_style(fo.get(), CAIRO_HINT_STYLE_SLIGHT);
  cairo_set_font_options(cr, fo.get());

  set_color(cr, 0xffffff);
  cairo_paint(cr);

  // One x range for every panel, so a step is at the same place in each.
  double lo = INFINITY, hi = -INFINITY;
  for (const Panel& p : f.panels)
    for_each_point(p, [&](const Point& pt) {
      lo = std::min(lo, pt.x);
      hi = std::max(hi, pt.x);
    });
  if (!(lo <= hi)) throw std::invalid_argument("plot: no finite points to draw");
  const Axis ax = padded(lo, hi, false);

  const double top = f.title.empty() ? 0 : kTitleBand;
  if (!f.title.empty()) text(cr, size.width / 2.0, 22, f.title, kTitleFont, Align::middle);
  const size_t cols = f.panels.size() == 1 ? 1 : 2, rows = (f.panels.size() + cols - 1) / cols;
  const double cw = double(size.width) / double(cols);
  const double ch = (double(size.height) - top) / double(rows);
  std::vector<YAxis> ys;
  std::vector<double> tick_room(cols, 0);
  for (size_t i = 0; i < f.panels.size(); ++i) {
    ys.push_back(y_axis(cr, f.panels[i], ch - kCellTop - kCellBottom));
    tick_room[i % cols] = std::max(tick_room[i % cols], ys.back().ticks.widest);
  }
  double narrowest = INFINITY;
  for (size_t c = 0; c < cols; ++c)
    narrowest = std::min(narrowest, cw * double(c + 1) - kCellRight -
                                        box_left({cw * double(c), top, cw, ch}, tick_room[c]));
  const Ticks xt = make_ticks(cr, ax, narrowest, 100, true);
  for (size_t i = 0; i < f.panels.size(); ++i) {
    const Rect cell{cw * double(i % cols), top + ch * double(i / cols), cw, ch};
    draw_panel(cr, f, f.panels[i], ax, xt, ys[i], cell, tick_room[i % cols], i == 0);
  }
}

}  // namespace

Format format_of(const std::string& path) {
  std::string ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  if (ext == ".png") return Format::png;
  if (ext == ".svg") return Format::svg;
  if (ext == ".pdf") return Format::pdf;
  throw std::invalid_argument(path + ": unknown image format " +
                              (ext.empty() ? std::string("(no extension)") : "'" + ext + "'") +
                              "; the file name must end in .png, .svg or .pdf");
}

Size figure_size(size_t panels) {
  if (panels <= 1) return {1000, 640};
  if (panels == 2) return {1400, 560};
  if (panels <= 4) return {1400, 1000};
  return {1400, 1440};  // three rows (a mixture of experts' auxiliary loss and load)
}

std::string render(const Figure& f, Format format) {
  if (f.panels.empty() || f.panels.size() > 6)
    throw std::invalid_argument("plot: a figure has one to six panels, not " +
                                std::to_string(f.panels.size()));
  const Size size = figure_size(f.panels.size());
  std::string out;  // outlives the surface, which writes to it until it is finished
  Surface surface;
  switch (format) {
    case Format::png:
      surface.reset(cairo_image_surface_create(CAIRO_FORMAT_RGB24, size.width, size.height));
      break;
    case Format::svg:
      surface.reset(cairo_svg_surface_create_for_stream(append, &out, size.width, size.height));
      cairo_svg_surface_set_document_unit(surface.get(), CAIRO_SVG_UNIT_PX);
      break;
    case Format::pdf:
      surface.reset(cairo_pdf_surface_create_for_stream(
          append, &out, size.width * kPdfPointsPerPixel, size.height * kPdfPointsPerPixel));
      if (!f.title.empty())
        cairo_pdf_surface_set_metadata(surface.get(), CAIRO_PDF_METADATA_TITLE, f.title.c_str());
      cairo_pdf_surface_set_metadata(surface.get(), CAIRO_PDF_METADATA_CREATOR, "loom plot");
      break;
  }
  check(cairo_surface_status(surface.get()), "to create the surface");
  {
    Context cr(cairo_create(surface.get()));
    if (format == Format::pdf) cairo_scale(cr.get(), kPdfPointsPerPixel, kPdfPointsPerPixel);
    draw(cr.get(), f, size);
    check(cairo_status(cr.get()), "to draw");
  }
  if (format == Format::png)
    check(cairo_surface_write_to_png_stream(surface.get(), append, &out), "to encode the PNG");
  cairo_surface_finish(surface.get());
  check(cairo_surface_status(surface.get()), "to finish the file");
  return out;
}

}  // namespace loom::plot
