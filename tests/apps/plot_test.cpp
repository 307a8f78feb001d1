// `loom plot`: the renderer directly (ticks; PNG read back with cairo, pixel by pixel; SVG and PDF
// structure), then the command through the loom binary: the formats, the panels and the errors.
#include <cairo.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "apps/plot_render.hpp"
#include "apps/plot_ticks.hpp"

namespace fs = std::filesystem;
using namespace loom::plot;

namespace {

constexpr uint32_t kBlue = 0x1f77b4, kOrange = 0xff7f0e;  // the first two runs' colours

struct SurfaceDeleter {
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
};

// A PNG decoded by cairo (libpng underneath): its size and 0xRRGGBB pixels.
struct Image {
  int width = 0, height = 0;
  std::vector<uint32_t> px;  // [height][width]
  uint32_t at(int x, int y) const { return px[size_t(y) * size_t(width) + size_t(x)]; }
};

Image decode_png(const std::string& bytes) {
  struct Reader {
    const std::string* s;
    size_t pos = 0;
  } reader{&bytes};
  auto read = [](void* closure, unsigned char* data, unsigned int n) {
    auto* r = static_cast<Reader*>(closure);
    if (r->pos + n > r->s->size()) return CAIRO_STATUS_READ_ERROR;
    std::copy_n(r->s->data() + r->pos, n, data);
    r->pos += n;
    return CAIRO_STATUS_SUCCESS;
  };
  std::unique_ptr<cairo_surface_t, SurfaceDeleter> s(
      cairo_image_surface_create_from_png_stream(read, &reader));
  Image img;
  EXPECT_EQ(cairo_surface_status(s.get()), CAIRO_STATUS_SUCCESS)
      << cairo_status_to_string(cairo_surface_status(s.get()));
  if (cairo_surface_status(s.get()) != CAIRO_STATUS_SUCCESS) return img;
  cairo_surface_flush(s.get());
  img.width = cairo_image_surface_get_width(s.get());
  img.height = cairo_image_surface_get_height(s.get());
  const int stride = cairo_image_surface_get_stride(s.get());
  const unsigned char* data = cairo_image_surface_get_data(s.get());
  for (int y = 0; y < img.height; ++y)
    for (int x = 0; x < img.width; ++x) {
      uint32_t v;
      std::memcpy(&v, data + size_t(y) * size_t(stride) + size_t(x) * 4, 4);
      img.px.push_back(v & 0xffffff);  // opaque: the figure is painted white first
    }
  return img;
}

// Pixels within a small distance of `rgb` in [x0, x1) x [y0, y1): a line's core, which
// antialiasing leaves at its colour, and not the blends at its edges.
size_t count_near(const Image& img, uint32_t rgb, int x0, int y0, int x1, int y1) {
  size_t n = 0;
  for (int y = y0; y < y1; ++y)
    for (int x = x0; x < x1; ++x) {
      const uint32_t p = img.at(x, y);
      int d = 0;
      for (int sh : {0, 8, 16}) d += std::abs(int((p >> sh) & 255) - int((rgb >> sh) & 255));
      n += d <= 24;
    }
  return n;
}
size_t count_near(const Image& img, uint32_t rgb) {
  return count_near(img, rgb, 0, 0, img.width, img.height);
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = 0; (at = s.find(what, at)) != std::string::npos; at += what.size()) ++n;
  return n;
}

// The path data ("M x y L x y ...") of the first line cairo's SVG strokes in `rgb` (as cairo
// writes colours: "12.156863%,46.666667%,70.588235%"), or "" when there is none.
constexpr const char* kBlueSvg = "12.156863%,46.666667%,70.588235%";
constexpr const char* kOrangeSvg = "100%,49.803922%,5.490196%";
std::string stroke_path(const std::string& svg, const std::string& rgb) {
  const size_t at = svg.find("stroke:rgb(" + rgb + ")");
  if (at == std::string::npos) return "";
  const size_t d = svg.find(" d=\"", at), end = svg.find('"', d + 4);
  return svg.substr(d + 4, end - d - 4);
}

// Two runs: run a falls, run b is flat; a validation curve for run a.
Figure two_runs(size_t panels) {
  Figure f;
  f.runs = {"a", "b"};
  for (size_t i = 0; i < panels; ++i) {
    Panel p{"panel " + std::to_string(i), "y", false, {}};
    p.curves.push_back({0, false, {{0, 3}, {50, 1.6}, {100, 1}}});
    p.curves.push_back({1, false, {{0, 2}, {100, 2}}});
    if (i == 0) p.curves.push_back({0, true, {{50, 2.5}, {100, 1.5}}});
    f.panels.push_back(p);
  }
  return f;
}

std::string loom_bin() {
  const char* b = std::getenv("LOOM_BIN");
  return b ? b : "";
}

struct Result {
  int rc;
  std::string err;
};

Result run_loom(const std::string& args, const fs::path& dir) {
  const fs::path err = dir / "stderr.txt";
  const std::string cmd =
      loom_bin() + " " + args + " > " + (dir / "stdout.txt").string() + " 2> " + err.string();
  const int rc = std::system(cmd.c_str());
  std::ifstream in(err);
  return {rc, std::string(std::istreambuf_iterator<char>(in), {})};
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class PlotCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    if (loom_bin().empty()) GTEST_SKIP() << "LOOM_BIN is not set (run through ctest)";
    dir_ = fs::temp_directory_path() /
           ("loom_plot_test_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // Two runs: a falling training loss every step, validation every 25 steps (the second run
    // has one extra key and a row without loss, which are ignored). Only the loss: one panel.
    for (int r = 0; r < 2; ++r) {
      std::ofstream f(dir_ / (r ? "run-b.jsonl" : "run-a.jsonl"));
      if (r) f << "{\"event\": \"start\", \"config\": \"x\"}\n";
      for (int s = 1; s <= 200; ++s) {
        const double loss = 2.0 + (8.0 - 0.7 * r) / (1.0 + 0.05 * s) + 0.05 * ((s * 37) % 7);
        f << "{\"step\": " << s << ", \"loss\": " << loss << ", \"lr\": 0.001}\n";
        if (s % 25 == 0) f << "{\"step\": " << s << ", \"val_loss\": " << loss + 0.2 << "}\n";
      }
    }
    // The rows `loom train` writes (train/metrics.cpp), MFU measured in run c only.
    for (int r = 0; r < 2; ++r) {
      std::ofstream f(dir_ / (r ? "run-d.jsonl" : "run-c.jsonl"));
      for (int s = 1; s <= 50; ++s)
        f << "{\"step\": " << s << ", \"loss\": " << 5.0 + 0.3 * r - 0.04 * s << ", \"lr\": 0.001"
          << ", \"grad_norm\": 1.5, \"tokens_per_s\": " << 5000 + 300 * r + 10 * (s % 5)
          << ", \"mfu\": " << (r ? 0.0 : 0.4 + 0.001 * s)
          << ", \"peak_allocated_bytes\": " << (200 + 20 * r) * (1 << 20) + s * 4096
          << ", \"step_s\": 0.2, \"tokens\": " << 1024 * s << "}\n";
    }
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string path(const char* name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

}  // namespace

TEST(PlotRender, Ticks) {
  auto near = [](const std::vector<double>& got, const std::vector<double>& want) {
    if (got.size() != want.size()) return false;
    for (size_t i = 0; i < got.size(); ++i)
      if (std::abs(got[i] - want[i]) > 1e-9 * std::max(1.0, std::abs(want[i]))) return false;
    return true;
  };
  EXPECT_TRUE(near(linear_ticks(0, 1000, 5), {0, 200, 400, 600, 800, 1000}));
  EXPECT_TRUE(near(linear_ticks(2.13, 2.87, 4), {2.2, 2.4, 2.6, 2.8}));
  EXPECT_TRUE(near(linear_ticks(-0.3, 0.3, 6), {-0.3, -0.2, -0.1, 0, 0.1, 0.2, 0.3}));
  EXPECT_TRUE(near(log_ticks(0.5, 2000), {1, 10, 100, 1000}));
  EXPECT_TRUE(near(log_ticks(2.5, 9), {3, 4, 5, 6, 7, 8, 9}));
  EXPECT_TRUE(near(log_ticks(1.5, 60), {2, 5, 10, 20, 50}));
  EXPECT_EQ(tick_label(2.4000000000000004, 0.2), "2.4");
  EXPECT_EQ(tick_label(1500, 500), "1500");
  EXPECT_EQ(tick_label(0.05, 0.01), "0.05");
  EXPECT_EQ(tick_label(0, 0.5), "0");
}

TEST(PlotRender, FormatFromTheExtension) {
  EXPECT_EQ(format_of("a/b.png"), Format::png);
  EXPECT_EQ(format_of("b.SVG"), Format::svg);
  EXPECT_EQ(format_of("b.pdf"), Format::pdf);
  for (const char* bad : {"loss.jpg", "loss", "png"}) {
    try {
      format_of(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(".png, .svg or .pdf"), std::string::npos) << e.what();
    }
  }
}

TEST(PlotRender, PngShowsEachRunInItsColourAntialiased) {
  Figure f = two_runs(1);
  f.title = "t";
  const Image img = decode_png(render(f, Format::png));
  ASSERT_EQ(img.width, 1000);
  ASSERT_EQ(img.height, 640);
  // Both runs drawn (a line across the plot is hundreds of pixels), text in black, mostly white.
  EXPECT_GT(count_near(img, kBlue), 800u);
  EXPECT_GT(count_near(img, kOrange), 800u);
  EXPECT_GT(count_near(img, 0x000000), 500u);
  EXPECT_GT(count_near(img, 0xffffff), img.px.size() / 2);
  // Antialiased: the falling line's edges and the text blend into the white, so there are far
  // more colours than the handful drawn.
  std::set<uint32_t> colours(img.px.begin(), img.px.end());
  EXPECT_GT(colours.size(), 200u);
  // Run b is flat: its line's core is one horizontal band of rows, left of the legend.
  std::set<int> rows;
  for (int y = 0; y < img.height; ++y)
    if (count_near(img, kOrange, 0, y, img.width - 300, y + 1) > 100) rows.insert(y);
  EXPECT_GE(rows.size(), 1u);
  EXPECT_LE(rows.size(), 3u);
}

TEST(PlotRender, FourPanelsTwoByTwo) {
  const Figure f = two_runs(4);
  const Image img = decode_png(render(f, Format::png));
  ASSERT_EQ(img.width, figure_size(4).width);
  ASSERT_EQ(img.height, figure_size(4).height);
  EXPECT_EQ(img.width, 1400);
  EXPECT_EQ(img.height, 1000);
  // Every quadrant holds a panel with both runs.
  for (int q = 0; q < 4; ++q) {
    const int x0 = (q % 2) * img.width / 2, y0 = (q / 2) * img.height / 2;
    EXPECT_GT(count_near(img, kBlue, x0, y0, x0 + img.width / 2, y0 + img.height / 2), 300u)
        << "quadrant " << q;
    EXPECT_GT(count_near(img, kOrange, x0, y0, x0 + img.width / 2, y0 + img.height / 2), 300u)
        << "quadrant " << q;
  }
  // Three panels: 2 x 2 with the bottom right cell empty.
  const Image three = decode_png(render(two_runs(3), Format::png));
  ASSERT_EQ(three.width, 1400);
  EXPECT_EQ(count_near(three, kBlue, 700, 500, 1400, 1000), 0u);
  EXPECT_GT(count_near(three, kBlue, 0, 500, 700, 1000), 300u);
  EXPECT_EQ(figure_size(2).width, 1400);
  EXPECT_EQ(figure_size(2).height, 560);
}

TEST(PlotRender, SvgIsVectorWithTheTextAsGlyphs) {
  Figure f = two_runs(1);
  const std::string plain = render(f, Format::svg);
  EXPECT_EQ(plain.rfind("<?xml", 0), 0u);
  EXPECT_NE(plain.find("width=\"1000px\""), std::string::npos);
  EXPECT_NE(plain.find("</svg>"), std::string::npos);
  EXPECT_EQ(plain.find("<image"), std::string::npos) << "a raster fallback";
  // cairo writes text as glyph outlines (one <use> per character, spaces included), so a title
  // of 13 characters adds 13.
  f.title = "Loss of run 7";
  const std::string titled = render(f, Format::svg);
  const std::string glyph = "<use xlink:href=\"#glyph";
  EXPECT_GT(count(plain, glyph), 50u);
  EXPECT_EQ(count(titled, glyph), count(plain, glyph) + 13);
  // Each curve is one path: run a's three points are a move and two lines in its colour.
  const std::string path = stroke_path(plain, kBlueSvg);
  EXPECT_EQ(count(path, "M "), 1u) << path;
  EXPECT_EQ(count(path, "L "), 2u) << path;
}

TEST(PlotRender, Pdf) {
  Figure f = two_runs(2);
  f.title = "My runs";
  const std::string pdf = render(f, Format::pdf);
  EXPECT_EQ(pdf.rfind("%PDF-", 0), 0u);
  EXPECT_NE(pdf.find("%%EOF"), std::string::npos);
  EXPECT_NE(pdf.find("/Title (My runs)"), std::string::npos);
  // The page is the PNG's size at 100 pixels to the inch: 1400 x 560 px, 1008 x 403.2 pt.
  EXPECT_NE(pdf.find("/MediaBox [ 0 0 1008 403.2 ]"), std::string::npos);
}

TEST(PlotRender, RefusesWhatItCannotDraw) {
  Figure f = two_runs(1);
  f.panels[0].log_y = true;
  f.panels[0].curves[0].points[2].y = 0;
  EXPECT_THROW(render(f, Format::png), std::invalid_argument);
  EXPECT_THROW(render(Figure{}, Format::png), std::invalid_argument);
  EXPECT_THROW(render(two_runs(7), Format::svg), std::invalid_argument);
  Figure empty = two_runs(1);
  for (auto& c : empty.panels[0].curves) c.points = {{1, NAN}};
  EXPECT_THROW(render(empty, Format::pdf), std::invalid_argument);
}

TEST_F(PlotCommand, WritesSvgPngAndPdfOfTheLoss) {
  const std::string runs = path("run-a.jsonl") + " " + path("run-b.jsonl");
  auto r =
      run_loom("plot " + runs + " --output " + path("loss.svg") + " --title 'My <runs>'", dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("2 run(s), 1 panel(s), 416 points"), std::string::npos) << r.err;
  // Well-formed XML, as an independent parser reads it.
  EXPECT_EQ(std::system(("python3 -c 'import sys, xml.dom.minidom; "
                         "xml.dom.minidom.parse(sys.argv[1])' " +
                         path("loss.svg"))
                            .c_str()),
            0);
  const std::string svg = read_file(dir_ / "loss.svg");
  // The training curves: one path each in its run's colour, through 200 points (fewer segments
  // where cairo merges collinear ones).
  for (const char* colour : {kBlueSvg, kOrangeSvg}) {
    const std::string path = stroke_path(svg, colour);
    EXPECT_EQ(count(path, "M "), 1u) << colour;
    EXPECT_GE(count(path, "L "), 150u) << colour;
    EXPECT_LE(count(path, "L "), 199u) << colour;
  }
  EXPECT_EQ(count(svg, "stroke-dasharray"), 3u);  // two validation curves + the legend's sample

  r = run_loom("plot " + runs + " --output " + path("loss.png") + " --log-y", dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  const Image img = decode_png(read_file(dir_ / "loss.png"));
  EXPECT_EQ(img.width, 1000);
  EXPECT_EQ(img.height, 640);
  EXPECT_GT(count_near(img, kBlue), 800u);
  EXPECT_GT(count_near(img, kOrange), 800u);

  r = run_loom("plot " + runs + " --output " + path("loss.PDF"), dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(read_file(dir_ / "loss.PDF").rfind("%PDF-", 0), 0u);
}

TEST_F(PlotCommand, PanelsForTheMetricsTrainWrites) {
  const std::string runs = path("run-c.jsonl") + " " + path("run-d.jsonl");
  auto r = run_loom("plot " + runs + " --output " + path("all.png"), dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("4 panel(s)"), std::string::npos) << r.err;
  Image img = decode_png(read_file(dir_ / "all.png"));
  ASSERT_EQ(img.width, 1400);
  ASSERT_EQ(img.height, 1000);
  // Loss, throughput, memory: both runs; MFU (bottom left, measured in run c only): run c alone.
  for (int q = 0; q < 4; ++q) {
    const int x0 = (q % 2) * 700, y0 = (q / 2) * 500;
    EXPECT_GT(count_near(img, kBlue, x0, y0, x0 + 700, y0 + 500), 300u) << "quadrant " << q;
    if (q == 2)
      EXPECT_EQ(count_near(img, kOrange, x0, y0, x0 + 700, y0 + 500), 0u);
    else
      EXPECT_GT(count_near(img, kOrange, x0, y0, x0 + 700, y0 + 500), 300u) << "quadrant " << q;
  }

  // Run d alone has no MFU: three panels, 2 x 2 with the last cell empty.
  r = run_loom("plot " + path("run-d.jsonl") + " --output " + path("d.png"), dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("3 panel(s)"), std::string::npos) << r.err;
  // A loss-only file has one panel.
  r = run_loom("plot " + path("run-a.jsonl") + " --output " + path("a.png"), dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("1 panel(s)"), std::string::npos) << r.err;

  // --panels picks and orders them: two side by side.
  r = run_loom("plot " + runs + " --panels memory,throughput --output " + path("two.png"), dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("2 panel(s), 200 points"), std::string::npos) << r.err;
  img = decode_png(read_file(dir_ / "two.png"));
  EXPECT_EQ(img.width, 1400);
  EXPECT_EQ(img.height, 560);
}

TEST_F(PlotCommand, MixtureOfExpertsPanels) {
  // A mixture of experts' metrics.jsonl (model/moe.hpp take_step_metrics) adds the auxiliary loss
  // and the expert load to the default panels; the dropped share only when asked for.
  {
    std::ofstream f(dir_ / "moe.jsonl");
    for (int s = 1; s <= 30; ++s)
      f << "{\"step\": " << s << ", \"loss\": " << 6.0 - 0.05 * s
        << ", \"tokens_per_s\": " << 1000 + s
        << ", \"mfu\": 0, \"peak_allocated_bytes\": " << (8 << 20)
        << ", \"aux_loss\": " << 2.0 + 0.01 * (s % 3) << ", \"expert_load\": " << 1.5 + 0.02 * s
        << ", \"dropped\": 0}\n";
  }
  auto r = run_loom("plot " + path("moe.jsonl") + " --output " + path("moe.png"), dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("5 panel(s), 150 points"), std::string::npos) << r.err;  // no MFU
  const Image img = decode_png(read_file(dir_ / "moe.png"));
  EXPECT_EQ(img.width, 1400);
  EXPECT_EQ(img.height, 1440);  // three rows of two
  r = run_loom(
      "plot " + path("moe.jsonl") + " --panels aux,load,dropped --output " + path("moe3.svg"),
      dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("3 panel(s), 90 points"), std::string::npos) << r.err;
  // A dense run has no auxiliary loss to draw.
  r = run_loom("plot " + path("run-a.jsonl") + " --panels aux --output " + path("x.png"), dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--panels: no input has \"aux_loss\""), std::string::npos) << r.err;
}

TEST_F(PlotCommand, NullBreaksTheLine) {
  // train/metrics.cpp writes a non-finite loss as null: the line stops there and starts again.
  std::ofstream(dir_ / "null.jsonl")
      << "{\"step\": 1, \"loss\": 3}\n{\"step\": 2, \"loss\": 2.5}\n"
      << "{\"step\": 3, \"loss\": null}\n{\"step\": 4, \"loss\": 2}\n"
      << "{\"step\": 5, \"loss\": 1.5}\n";
  const auto r =
      run_loom("plot " + path("null.jsonl") + " --log-y --output " + path("n.svg"), dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string svg = read_file(dir_ / "n.svg");
  const std::string path = stroke_path(svg, kBlueSvg);
  EXPECT_EQ(count(path, "M "), 2u) << path;
  EXPECT_EQ(count(path, "L "), 2u) << path;
}

TEST_F(PlotCommand, Errors) {
  const std::string a = path("run-a.jsonl");
  auto r = run_loom("plot " + path("missing.jsonl") + " --output x.svg", dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("missing.jsonl"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;

  std::ofstream(dir_ / "bad.jsonl") << "{\"step\": 1, \"loss\": 2}\n\n{\"step\": 2, \"loss\": \n";
  r = run_loom("plot " + path("bad.jsonl") + " --output " + path("x.svg"), dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("bad.jsonl:3"), std::string::npos) << r.err;

  std::ofstream(dir_ / "noloss.jsonl") << "{\"step\": 1, \"lr\": 2}\n{\"step\": 2}\n";
  r = run_loom("plot " + path("noloss.jsonl") + " --output " + path("x.svg"), dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("noloss.jsonl: no rows"), std::string::npos) << r.err;

  r = run_loom("plot " + a + " --output " + path("x.jpg"), dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("x.jpg: unknown image format '.jpg'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(".png, .svg or .pdf"), std::string::npos) << r.err;

  r = run_loom("plot " + a, dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--output"), std::string::npos) << r.err;

  // A directory that does not exist, and a "directory" that is a file: the path and the reason.
  for (const auto& [out, why] :
       {std::pair<std::string, std::string>{path("no/such/dir/x.png"), "No such file"},
        {a + "/x.pdf", "Not a directory"}}) {
    r = run_loom("plot " + a + " --output " + out, dir_);
    EXPECT_NE(r.rc, 0);
    EXPECT_NE(r.err.find("cannot write " + out + ": " + why), std::string::npos) << r.err;
  }

  std::ofstream(dir_ / "neg.jsonl") << "{\"step\": 1, \"loss\": -0.5}\n";
  r = run_loom("plot " + path("neg.jsonl") + " --log-y --output " + path("x.svg"), dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("losses > 0"), std::string::npos) << r.err;

  r = run_loom("plot " + a + " --panels loss,speed --output " + path("x.png"), dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--panels: unknown panel 'speed'"), std::string::npos) << r.err;
  r = run_loom("plot " + a + " --panels loss,mfu --output " + path("x.png"), dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--panels: no input has \"mfu\""), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "x.png"));
}
