#include "apps/plot_render.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace loom::plot {

namespace {

// ---- colours: palette indices, shared by both back ends -----------------------------------
enum : int { kWhite, kBlack, kGrid, kFrame, kLegendText, kFirstSeries };
constexpr uint32_t kBaseColors[kFirstSeries] = {0xffffff, 0x000000, 0xe4e4e4, 0x606060, 0x303030};
// Distinct hues for the runs (the usual categorical cycle).
constexpr uint32_t kSeriesColors[] = {0x1f77b4, 0xff7f0e, 0x2ca02c, 0xd62728,
                                      0x9467bd, 0x8c564b, 0xe377c2, 0x17becf};
constexpr int kNumSeriesColors = int(sizeof(kSeriesColors) / sizeof(kSeriesColors[0]));

std::vector<uint32_t> palette() {
  std::vector<uint32_t> p(kBaseColors, kBaseColors + kFirstSeries);
  p.insert(p.end(), kSeriesColors, kSeriesColors + kNumSeriesColors);
  return p;
}
int series_color(size_t i) {
  return kFirstSeries + int(i % kNumSeriesColors);
}

// ---- 5x7 font (g, j, p, q, y descend two more rows): ASCII 32..126, one byte per row, bit 4
// the leftmost column ---------------------------------------------------------------------------
constexpr uint8_t kFont[95][9] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // space
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04, 0x00, 0x00},  // !
    {0x0a, 0x0a, 0x0a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // "
    {0x0a, 0x0a, 0x1f, 0x0a, 0x1f, 0x0a, 0x0a, 0x00, 0x00},  // #
    {0x04, 0x0f, 0x14, 0x0e, 0x05, 0x1e, 0x04, 0x00, 0x00},  // $
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03, 0x00, 0x00},  // %
    {0x0c, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0d, 0x00, 0x00},  // &
    {0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // '
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02, 0x00, 0x00},  // (
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08, 0x00, 0x00},  // )
    {0x00, 0x04, 0x15, 0x0e, 0x15, 0x04, 0x00, 0x00, 0x00},  // *
    {0x00, 0x04, 0x04, 0x1f, 0x04, 0x04, 0x00, 0x00, 0x00},  // +
    {0x00, 0x00, 0x00, 0x00, 0x0c, 0x04, 0x08, 0x00, 0x00},  // ,
    {0x00, 0x00, 0x00, 0x1f, 0x00, 0x00, 0x00, 0x00, 0x00},  // -
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0c, 0x0c, 0x00, 0x00},  // .
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00, 0x00, 0x00},  // /
    {0x0e, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0e, 0x00, 0x00},  // 0
    {0x04, 0x0c, 0x04, 0x04, 0x04, 0x04, 0x0e, 0x00, 0x00},  // 1
    {0x0e, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1f, 0x00, 0x00},  // 2
    {0x1f, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0e, 0x00, 0x00},  // 3
    {0x02, 0x06, 0x0a, 0x12, 0x1f, 0x02, 0x02, 0x00, 0x00},  // 4
    {0x1f, 0x10, 0x1e, 0x01, 0x01, 0x11, 0x0e, 0x00, 0x00},  // 5
    {0x06, 0x08, 0x10, 0x1e, 0x11, 0x11, 0x0e, 0x00, 0x00},  // 6
    {0x1f, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08, 0x00, 0x00},  // 7
    {0x0e, 0x11, 0x11, 0x0e, 0x11, 0x11, 0x0e, 0x00, 0x00},  // 8
    {0x0e, 0x11, 0x11, 0x0f, 0x01, 0x02, 0x0c, 0x00, 0x00},  // 9
    {0x00, 0x0c, 0x0c, 0x00, 0x0c, 0x0c, 0x00, 0x00, 0x00},  // :
    {0x00, 0x0c, 0x0c, 0x00, 0x0c, 0x04, 0x08, 0x00, 0x00},  // ;
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02, 0x00, 0x00},  // <
    {0x00, 0x00, 0x1f, 0x00, 0x1f, 0x00, 0x00, 0x00, 0x00},  // =
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08, 0x00, 0x00},  // >
    {0x0e, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04, 0x00, 0x00},  // ?
    {0x0e, 0x11, 0x01, 0x0d, 0x15, 0x15, 0x0e, 0x00, 0x00},  // @
    {0x0e, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11, 0x00, 0x00},  // A
    {0x1e, 0x11, 0x11, 0x1e, 0x11, 0x11, 0x1e, 0x00, 0x00},  // B
    {0x0e, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0e, 0x00, 0x00},  // C
    {0x1c, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1c, 0x00, 0x00},  // D
    {0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x1f, 0x00, 0x00},  // E
    {0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x10, 0x00, 0x00},  // F
    {0x0e, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0f, 0x00, 0x00},  // G
    {0x11, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11, 0x00, 0x00},  // H
    {0x0e, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0e, 0x00, 0x00},  // I
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0c, 0x00, 0x00},  // J
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11, 0x00, 0x00},  // K
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1f, 0x00, 0x00},  // L
    {0x11, 0x1b, 0x15, 0x15, 0x11, 0x11, 0x11, 0x00, 0x00},  // M
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11, 0x00, 0x00},  // N
    {0x0e, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e, 0x00, 0x00},  // O
    {0x1e, 0x11, 0x11, 0x1e, 0x10, 0x10, 0x10, 0x00, 0x00},  // P
    {0x0e, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0d, 0x00, 0x00},  // Q
    {0x1e, 0x11, 0x11, 0x1e, 0x14, 0x12, 0x11, 0x00, 0x00},  // R
    {0x0f, 0x10, 0x10, 0x0e, 0x01, 0x01, 0x1e, 0x00, 0x00},  // S
    {0x1f, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00},  // T
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e, 0x00, 0x00},  // U
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0a, 0x04, 0x00, 0x00},  // V
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0a, 0x00, 0x00},  // W
    {0x11, 0x11, 0x0a, 0x04, 0x0a, 0x11, 0x11, 0x00, 0x00},  // X
    {0x11, 0x11, 0x0a, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00},  // Y
    {0x1f, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1f, 0x00, 0x00},  // Z
    {0x0e, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0e, 0x00, 0x00},  // [
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00, 0x00, 0x00},  // backslash
    {0x0e, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0e, 0x00, 0x00},  // ]
    {0x04, 0x0a, 0x11, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // ^
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1f, 0x00, 0x00},  // _
    {0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // `
    {0x00, 0x00, 0x0e, 0x01, 0x0f, 0x11, 0x0f, 0x00, 0x00},  // a
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1e, 0x00, 0x00},  // b
    {0x00, 0x00, 0x0e, 0x10, 0x10, 0x11, 0x0e, 0x00, 0x00},  // c
    {0x01, 0x01, 0x0d, 0x13, 0x11, 0x11, 0x0f, 0x00, 0x00},  // d
    {0x00, 0x00, 0x0e, 0x11, 0x1f, 0x10, 0x0e, 0x00, 0x00},  // e
    {0x06, 0x09, 0x08, 0x1c, 0x08, 0x08, 0x08, 0x00, 0x00},  // f
    {0x00, 0x00, 0x0f, 0x11, 0x11, 0x11, 0x0f, 0x01, 0x0e},  // g
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00, 0x00},  // h
    {0x04, 0x00, 0x0c, 0x04, 0x04, 0x04, 0x0e, 0x00, 0x00},  // i
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0c},  // j
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12, 0x00, 0x00},  // k
    {0x0c, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0e, 0x00, 0x00},  // l
    {0x00, 0x00, 0x1a, 0x15, 0x15, 0x11, 0x11, 0x00, 0x00},  // m
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00, 0x00},  // n
    {0x00, 0x00, 0x0e, 0x11, 0x11, 0x11, 0x0e, 0x00, 0x00},  // o
    {0x00, 0x00, 0x1e, 0x11, 0x11, 0x11, 0x1e, 0x10, 0x10},  // p
    {0x00, 0x00, 0x0f, 0x11, 0x11, 0x11, 0x0f, 0x01, 0x01},  // q
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10, 0x00, 0x00},  // r
    {0x00, 0x00, 0x0e, 0x10, 0x0e, 0x01, 0x1e, 0x00, 0x00},  // s
    {0x08, 0x08, 0x1c, 0x08, 0x08, 0x09, 0x06, 0x00, 0x00},  // t
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0d, 0x00, 0x00},  // u
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0a, 0x04, 0x00, 0x00},  // v
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0a, 0x00, 0x00},  // w
    {0x00, 0x00, 0x11, 0x0a, 0x04, 0x0a, 0x11, 0x00, 0x00},  // x
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x11, 0x0f, 0x01, 0x0e},  // y
    {0x00, 0x00, 0x1f, 0x02, 0x04, 0x08, 0x1f, 0x00, 0x00},  // z
    {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02, 0x00, 0x00},  // {
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00},  // |
    {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08, 0x00, 0x00},  // }
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00, 0x00, 0x00},  // ~
};
constexpr int kGlyphW = 5, kGlyphH = 7, kGlyphRows = 9, kAdvance = 6;

enum class Anchor { start, middle, end };

// What the layout draws with; coordinates in pixels, y down.
class Canvas {
 public:
  virtual ~Canvas() = default;
  virtual void rect(double x, double y, double w, double h, int fill, int stroke) = 0;
  virtual void polyline(const std::vector<Point>& pts, int color, int width, bool dashed) = 0;
  virtual void marker(double x, double y, int color) = 0;
  // (x, y) is the anchor point on the text's horizontal centre line; vertical text reads
  // bottom to top, centred on (x, y).
  virtual void text(double x, double y, const std::string& s, int scale, Anchor a, bool vertical,
                    int color) = 0;
  // Both back ends lay text out on the font's cell grid: 6*scale pixels per character.
  static double text_width(const std::string& s, int scale) {
    return s.empty() ? 0 : double(s.size() * kAdvance - 1) * scale;
  }
};

constexpr int kLineWidth = 2;
constexpr double kDashOn = 8, kDashPeriod = 14;

// ---- the layout ------------------------------------------------------------------------------
struct Axis {
  double lo = 0, hi = 1;  // the range shown, in data units
  bool log = false;
  double map(double v) const { return log ? std::log10(v) : v; }
};

void data_range(const Figure& f, bool want_x, double& lo, double& hi) {
  lo = INFINITY;
  hi = -INFINITY;
  for (const Series& s : f.series)
    for (const auto* pts : {&s.train, &s.val})
      for (const Point& p : *pts) {
        const double v = want_x ? p.x : p.y;
        if (!std::isfinite(v)) continue;
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
  if (!(lo <= hi)) throw std::invalid_argument("plot: no finite points to draw");
}

void draw(const Figure& f, Canvas& c) {
  const double W = f.width, H = f.height;
  c.rect(0, 0, W, H, kWhite, -1);

  Axis ax, ay;
  data_range(f, true, ax.lo, ax.hi);
  data_range(f, false, ay.lo, ay.hi);
  ay.log = f.log_y;
  if (ay.log && ay.lo <= 0) throw std::invalid_argument("plot: a log y axis needs losses > 0");
  if (ax.hi == ax.lo) ax.lo -= 1, ax.hi += 1;
  if (ay.hi == ay.lo) {
    const double d = ay.lo != 0 ? std::abs(ay.lo) * 0.1 : 1;
    ay.lo = ay.log ? ay.lo / 1.5 : ay.lo - d;
    ay.hi = ay.log ? ay.hi * 1.5 : ay.hi + d;
  }
  // A margin of 4% of the range above and below, so no curve runs along the frame.
  {
    const double a = ay.map(ay.lo), b = ay.map(ay.hi), m = 0.04 * (b - a);
    ay.lo = ay.log ? std::pow(10.0, a - m) : a - m;
    ay.hi = ay.log ? std::pow(10.0, b + m) : b + m;
  }
  const std::vector<double> xt = linear_ticks(ax.lo, ax.hi, 8);
  const std::vector<double> yt = ay.log ? log_ticks(ay.lo, ay.hi) : linear_ticks(ay.lo, ay.hi, 7);
  const double xs = xt.size() > 1 ? xt[1] - xt[0] : 1;
  double ys = yt.size() > 1 ? yt[1] - yt[0] : 1;
  std::vector<std::string> ylab;
  double ylab_w = 0;
  for (size_t i = 0; i < yt.size(); ++i) {
    // On a log axis each label needs the decimals of its own magnitude.
    if (ay.log) ys = i + 1 < yt.size() ? yt[i + 1] - yt[i] : yt[i] - (i ? yt[i - 1] : 0);
    ylab.push_back(tick_label(yt[i], ay.log ? std::min(ys, yt[i]) : ys));
    ylab_w = std::max(ylab_w, Canvas::text_width(ylab.back(), 2));
  }

  const double top = f.title.empty() ? 24 : 64, bottom = H - 64, right = W - 28;
  const double left = 24 + 14 + 16 + ylab_w + 10;
  const double pw = right - left, ph = bottom - top;
  if (pw < 50 || ph < 50) throw std::invalid_argument("plot: the image is too small");
  auto X = [&](double v) { return left + (v - ax.lo) / (ax.hi - ax.lo) * pw; };
  auto Y = [&](double v) {
    return bottom - (ay.map(v) - ay.map(ay.lo)) / (ay.map(ay.hi) - ay.map(ay.lo)) * ph;
  };

  // Grid, frame, ticks and their labels.
  for (double v : xt) c.polyline({{X(v), top}, {X(v), bottom}}, kGrid, 1, false);
  for (double v : yt) c.polyline({{left, Y(v)}, {right, Y(v)}}, kGrid, 1, false);
  c.rect(left, top, pw, ph, -1, kFrame);
  for (double v : xt) {
    c.polyline({{X(v), bottom}, {X(v), bottom + 6}}, kBlack, 1, false);
    c.text(X(v), bottom + 18, tick_label(v, xs), 2, Anchor::middle, false, kBlack);
  }
  for (size_t i = 0; i < yt.size(); ++i) {
    c.polyline({{left - 6, Y(yt[i])}, {left, Y(yt[i])}}, kBlack, 1, false);
    c.text(left - 10, Y(yt[i]), ylab[i], 2, Anchor::end, false, kBlack);
  }
  c.text(left + pw / 2, H - 18, f.x_label, 2, Anchor::middle, false, kBlack);
  c.text(24, top + ph / 2, f.y_label + (ay.log ? " (log)" : ""), 2, Anchor::middle, true, kBlack);
  if (!f.title.empty()) c.text(W / 2, 30, f.title, 3, Anchor::middle, false, kBlack);

  // The runs.
  bool any_val = false;
  for (size_t i = 0; i < f.series.size(); ++i) {
    const Series& s = f.series[i];
    const int col = series_color(i);
    std::vector<Point> pts;
    for (const Point& p : s.train) pts.push_back({X(p.x), Y(p.y)});
    if (pts.size() == 1) c.marker(pts[0].x, pts[0].y, col);
    if (!pts.empty()) c.polyline(pts, col, kLineWidth, false);
    pts.clear();
    for (const Point& p : s.val) pts.push_back({X(p.x), Y(p.y)});
    if (!pts.empty()) c.polyline(pts, col, kLineWidth, true);
    for (const Point& p : pts) c.marker(p.x, p.y, col);
    any_val = any_val || !s.val.empty();
  }

  // Legend, in the top right corner of the plot (loss curves fall, so it is usually empty).
  std::vector<std::string> names;
  double name_w = 0;
  for (const Series& s : f.series) names.push_back(s.name);
  if (any_val) names.push_back("train"), names.push_back("validation");
  for (const auto& n : names) name_w = std::max(name_w, Canvas::text_width(n, 2));
  const double row = 22, sw = 32, lw = 12 + sw + 8 + name_w + 12;
  const double lh = 8 + row * double(names.size());
  const double lx = right - 10 - lw, ly = top + 10;
  c.rect(lx, ly, lw, lh, kWhite, kFrame);
  for (size_t i = 0; i < names.size(); ++i) {
    const double yy = ly + 4 + row * (double(i) + 0.5), x0 = lx + 12;
    const bool style_row = i >= f.series.size();
    const int col = style_row ? kLegendText : series_color(i);
    const bool dashed = style_row && i == f.series.size() + 1;
    c.polyline({{x0, yy}, {x0 + sw, yy}}, col, kLineWidth, dashed);
    if (dashed) c.marker(x0 + sw / 2, yy, col);
    c.text(x0 + sw + 8, yy, names[i], 2, Anchor::start, false, style_row ? kLegendText : kBlack);
  }
}

// ---- SVG ---------------------------------------------------------------------------------------
std::string hex(uint32_t rgb) {
  char b[8];
  std::snprintf(b, sizeof b, "#%06x", unsigned(rgb));
  return b;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    switch (ch) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&apos;";
        break;
      default:
        o += ch;
    }
  }
  return o;
}

class SvgCanvas : public Canvas {
 public:
  SvgCanvas(int w, int h) : pal_(palette()) {
    out_ = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(w) +
           "\" height=\"" + std::to_string(h) + "\" viewBox=\"0 0 " + std::to_string(w) + " " +
           std::to_string(h) + "\">\n";
  }
  std::string finish() { return out_ + "</svg>\n"; }

  void rect(double x, double y, double w, double h, int fill, int stroke) override {
    out_ += "<rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" + num(w) + "\" height=\"" +
            num(h) + "\" fill=\"" + (fill < 0 ? "none" : hex(pal_[size_t(fill)])) + "\"";
    if (stroke >= 0) out_ += " stroke=\"" + hex(pal_[size_t(stroke)]) + "\" stroke-width=\"1\"";
    out_ += "/>\n";
  }
  void polyline(const std::vector<Point>& pts, int color, int width, bool dashed) override {
    out_ += "<polyline fill=\"none\" stroke=\"" + hex(pal_[size_t(color)]) + "\" stroke-width=\"" +
            std::to_string(width) + "\" stroke-linejoin=\"round\"";
    if (dashed) out_ += " stroke-dasharray=\"8 6\"";
    out_ += " points=\"";
    for (size_t i = 0; i < pts.size(); ++i) {
      if (i) out_ += ' ';
      out_ += num(pts[i].x);
      out_ += ',';
      out_ += num(pts[i].y);
    }
    out_ += "\"/>\n";
  }
  void marker(double x, double y, int color) override {
    out_ += "<circle cx=\"" + num(x) + "\" cy=\"" + num(y) + "\" r=\"3.5\" fill=\"" +
            hex(pal_[size_t(color)]) + "\"/>\n";
  }
  void text(double x, double y, const std::string& s, int scale, Anchor a, bool vertical,
            int color) override {
    const char* anchor = a == Anchor::start ? "start" : a == Anchor::middle ? "middle" : "end";
    // Monospace at 10 px per unit of scale is 6 px per character, the raster font's advance,
    // so the layout's widths hold for both.
    out_ += "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\" font-family=\"monospace\" " +
            "font-size=\"" + std::to_string(10 * scale) + "\" text-anchor=\"" + anchor +
            "\" dominant-baseline=\"middle\" fill=\"" + hex(pal_[size_t(color)]) + "\"";
    if (vertical) out_ += " transform=\"rotate(-90 " + num(x) + " " + num(y) + ")\"";
    out_ += '>';
    out_ += xml_escape(s);
    out_ += "</text>\n";
  }

 private:
  std::vector<uint32_t> pal_;
  std::string out_;
};

// ---- raster
// --------------------------------------------------------------------------------------
class RasterCanvas : public Canvas {
 public:
  RasterCanvas(int w, int h) : w_(w), h_(h), px_(size_t(w) * size_t(h), kWhite) {}
  const std::vector<uint8_t>& pixels() const { return px_; }

  void rect(double x, double y, double w, double h, int fill, int stroke) override {
    const int x0 = int(std::lround(x)), y0 = int(std::lround(y));
    const int x1 = int(std::lround(x + w)), y1 = int(std::lround(y + h));
    if (fill >= 0)
      for (int yy = y0; yy < y1; ++yy)
        for (int xx = x0; xx < x1; ++xx) set(xx, yy, fill);
    if (stroke >= 0) {
      for (int xx = x0; xx <= x1; ++xx) set(xx, y0, stroke), set(xx, y1, stroke);
      for (int yy = y0; yy <= y1; ++yy) set(x0, yy, stroke), set(x1, yy, stroke);
    }
  }
  // A width x width stamp at every unit step along each segment; dashes follow the distance walked
  // along the whole polyline, so they continue across vertices.
  void polyline(const std::vector<Point>& pts, int color, int width, bool dashed) override {
    double walked = 0;
    for (size_t i = 0; i + 1 < pts.size(); ++i) {
      const Point a = pts[i], b = pts[i + 1];
      const double dx = b.x - a.x, dy = b.y - a.y, len = std::hypot(dx, dy);
      const int n = std::max(1, int(std::ceil(std::max(std::abs(dx), std::abs(dy)))));
      for (int k = 0; k <= n; ++k) {
        const double t = double(k) / n;
        if (dashed && std::fmod(walked + t * len, kDashPeriod) >= kDashOn) continue;
        stamp(a.x + t * dx, a.y + t * dy, width, color);
      }
      walked += len;
    }
  }
  void marker(double x, double y, int color) override {
    const int cx = int(std::floor(x)), cy = int(std::floor(y));
    for (int dy = -4; dy <= 4; ++dy)
      for (int dx = -4; dx <= 4; ++dx)
        if ((dx + 0.5) * (dx + 0.5) + (dy + 0.5) * (dy + 0.5) <= 14) set(cx + dx, cy + dy, color);
  }
  void text(double x, double y, const std::string& s, int scale, Anchor a, bool vertical,
            int color) override {
    const double tw = text_width(s, scale), th = double(kGlyphH * scale);
    const double u0 = a == Anchor::start ? 0 : a == Anchor::middle ? -tw / 2 : -tw;
    for (size_t i = 0; i < s.size(); ++i) {
      const unsigned char ch = static_cast<unsigned char>(s[i]);
      const uint8_t* g = kFont[(ch >= 32 && ch < 127 ? ch : '?') - 32];
      for (int gy = 0; gy < kGlyphRows; ++gy)
        for (int gx = 0; gx < kGlyphW; ++gx) {
          if (!((g[gy] >> (kGlyphW - 1 - gx)) & 1)) continue;
          for (int sy = 0; sy < scale; ++sy)
            for (int sx = 0; sx < scale; ++sx) {
              // (u, v): position along the text and down the line, from the anchor.
              const double u = u0 + double((int(i) * kAdvance + gx) * scale + sx);
              const double v = double(gy * scale + sy) - th / 2;
              if (vertical)
                set(int(std::floor(x + v)), int(std::floor(y - u - 1)), color);
              else
                set(int(std::floor(x + u)), int(std::floor(y + v)), color);
            }
        }
    }
  }

 private:
  void set(int x, int y, int c) {
    if (x >= 0 && y >= 0 && x < w_ && y < h_) px_[size_t(y) * size_t(w_) + size_t(x)] = uint8_t(c);
  }
  void stamp(double x, double y, int width, int c) {
    const int x0 = int(std::floor(x - width / 2.0 + 0.5));
    const int y0 = int(std::floor(y - width / 2.0 + 0.5));
    for (int dy = 0; dy < width; ++dy)
      for (int dx = 0; dx < width; ++dx) set(x0 + dx, y0 + dy, c);
  }

  int w_, h_;
  std::vector<uint8_t> px_;
};

// ---- PNG
// -----------------------------------------------------------------------------------------
constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
    t[n] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrcTable = make_crc_table();

void put_be32(std::vector<uint8_t>& o, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) o.push_back(uint8_t(v >> s));
}

void put_chunk(std::vector<uint8_t>& o, const char* type, const std::vector<uint8_t>& data) {
  put_be32(o, uint32_t(data.size()));
  const size_t start = o.size();
  o.insert(o.end(), type, type + 4);
  o.insert(o.end(), data.begin(), data.end());
  put_be32(o, crc32(o.data() + start, o.size() - start));
}

}  // namespace

uint32_t crc32(const uint8_t* data, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) c = kCrcTable[(c ^ data[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t adler32(const uint8_t* data, size_t n) {
  uint32_t a = 1, b = 0;
  for (size_t i = 0; i < n; ++i) {
    a = (a + data[i]) % 65521;
    b = (b + a) % 65521;
  }
  return (b << 16) | a;
}

std::vector<uint8_t> encode_png(const std::vector<uint8_t>& pixels, int width, int height,
                                const std::vector<uint32_t>& pal) {
  if (width <= 0 || height <= 0 || pixels.size() != size_t(width) * size_t(height) || pal.empty() ||
      pal.size() > 256)
    throw std::invalid_argument("encode_png: inconsistent image size or palette");
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  std::vector<uint8_t> ihdr;
  put_be32(ihdr, uint32_t(width));
  put_be32(ihdr, uint32_t(height));
  ihdr.insert(ihdr.end(), {8, 3, 0, 0, 0});  // 8 bits, indexed colour, deflate, no interlace
  put_chunk(png, "IHDR", ihdr);
  std::vector<uint8_t> plte;
  for (uint32_t c : pal) plte.insert(plte.end(), {uint8_t(c >> 16), uint8_t(c >> 8), uint8_t(c)});
  put_chunk(png, "PLTE", plte);
  // Scanlines, each behind filter type 0 (none).
  std::vector<uint8_t> raw;
  raw.reserve(size_t(height) * (size_t(width) + 1));
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);
    raw.insert(raw.end(), pixels.begin() + ptrdiff_t(size_t(y) * size_t(width)),
               pixels.begin() + ptrdiff_t(size_t(y + 1) * size_t(width)));
  }
  // zlib: deflate in stored (uncompressed) blocks of at most 65535 bytes, then Adler-32.
  std::vector<uint8_t> z = {0x78, 0x01};
  for (size_t pos = 0; pos < raw.size() || pos == 0;) {
    const size_t len = std::min<size_t>(65535, raw.size() - pos);
    const bool last = pos + len == raw.size();
    z.push_back(last ? 1 : 0);
    z.insert(z.end(), {uint8_t(len), uint8_t(len >> 8), uint8_t(~len), uint8_t(~len >> 8)});
    z.insert(z.end(), raw.begin() + ptrdiff_t(pos), raw.begin() + ptrdiff_t(pos + len));
    pos += len;
    if (last) break;
  }
  put_be32(z, adler32(raw.data(), raw.size()));
  put_chunk(png, "IDAT", z);
  put_chunk(png, "IEND", {});
  return png;
}

std::vector<double> linear_ticks(double lo, double hi, int target) {
  if (!(hi > lo) || target < 1) return {lo};
  // The spacing among 1, 2, 5 and 10 times a power of ten whose tick count is nearest the target.
  const double mag = std::pow(10.0, std::floor(std::log10((hi - lo) / target)));
  double step = mag, best = INFINITY;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    const double count = std::floor(hi / (m * mag)) - std::ceil(lo / (m * mag)) + 1;
    if (std::abs(count - target) < best) best = std::abs(count - target), step = m * mag;
  }
  std::vector<double> t;
  for (double k = std::ceil(lo / step - 1e-9); k * step <= hi + 1e-9 * step; k += 1)
    t.push_back(k * step == 0 ? 0.0 : k * step);  // no "-0"
  return t;
}

std::vector<double> log_ticks(double lo, double hi) {
  const int k0 = int(std::floor(std::log10(lo))), k1 = int(std::ceil(std::log10(hi)));
  const std::vector<std::vector<double>> sets = {{1}, {1, 2, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}};
  for (const auto& mults : sets) {
    std::vector<double> t;
    // Over many decades, every n-th power of ten, so the labels do not collide.
    const int stride = mults.size() == 1 ? std::max(1, (k1 - k0) / 8) : 1;
    for (int k = k0; k <= k1; ++k) {
      if (mults.size() == 1 && k % stride) continue;
      for (double m : mults) {
        const double v = m * std::pow(10.0, k);
        if (v >= lo * (1 - 1e-12) && v <= hi * (1 + 1e-12)) t.push_back(v);
      }
    }
    if (t.size() >= 3) return t;
  }
  return linear_ticks(lo, hi, 5);  // a range shorter than a factor of about 2
}

std::string tick_label(double v, double spacing) {
  if (v == 0) return "0";
  const double a = std::abs(v);
  char b[48];
  if (a >= 1e6 || a < 1e-4) {
    std::snprintf(b, sizeof b, "%.3g", v);
    return b;
  }
  int decimals = 0;
  if (spacing > 0 && spacing < 1) decimals = int(std::ceil(-std::log10(spacing) - 1e-9));
  std::snprintf(b, sizeof b, "%.*f", std::min(decimals, 6), v);
  return b;
}

std::string render_svg(const Figure& f) {
  SvgCanvas c(f.width, f.height);
  draw(f, c);
  return c.finish();
}

std::vector<uint8_t> render_png(const Figure& f) {
  RasterCanvas c(f.width, f.height);
  draw(f, c);
  return encode_png(c.pixels(), f.width, f.height, palette());
}

}  // namespace loom::plot
