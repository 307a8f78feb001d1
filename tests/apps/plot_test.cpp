// `loom plot`: the renderer's building blocks directly (CRC-32, Adler-32, ticks, PNG structure),
// then the command through the loom binary: SVG and PNG outputs and the error messages.
#include "apps/plot_render.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace loom::plot;

namespace {

uint32_t be32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

struct Png {
  uint32_t width = 0, height = 0;
  std::vector<uint32_t> palette;
  std::vector<uint8_t> pixels;  // [height][width] palette indices
};

// Walks the chunks checking every CRC, and undoes the zlib stream (stored blocks: what the
// writer emits; anything else fails the test), checking its Adler-32 and the filter bytes.
Png decode_png(const std::vector<uint8_t>& f) {
  Png png;
  const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  EXPECT_GE(f.size(), 8u);
  EXPECT_TRUE(std::equal(sig, sig + 8, f.begin())) << "PNG signature";
  std::vector<uint8_t> z;
  std::vector<std::string> order;
  for (size_t pos = 8; pos + 12 <= f.size();) {
    const uint32_t len = be32(&f[pos]);
    EXPECT_LE(pos + 12 + len, f.size()) << "chunk past the end of the file";
    if (pos + 12 + len > f.size()) break;
    const std::string type(f.begin() + ptrdiff_t(pos + 4), f.begin() + ptrdiff_t(pos + 8));
    const uint8_t* data = &f[pos + 8];
    EXPECT_EQ(crc32(&f[pos + 4], len + 4), be32(data + len)) << "CRC of " << type;
    order.push_back(type);
    if (type == "IHDR") {
      png.width = be32(data);
      png.height = be32(data + 4);
      EXPECT_EQ(data[8], 8);   // bit depth
      EXPECT_EQ(data[9], 3);   // indexed colour
      EXPECT_EQ(data[12], 0);  // no interlace
    } else if (type == "PLTE") {
      for (uint32_t i = 0; i + 2 < len; i += 3)
        png.palette.push_back(uint32_t(data[i]) << 16 | uint32_t(data[i + 1]) << 8 | data[i + 2]);
    } else if (type == "IDAT") {
      z.insert(z.end(), data, data + len);
    }
    pos += 12 + len;
  }
  EXPECT_EQ(order.front(), "IHDR");
  EXPECT_EQ(order.back(), "IEND");
  EXPECT_GE(z.size(), 6u);
  EXPECT_EQ((z[0] * 256 + z[1]) % 31, 0) << "zlib header check";
  std::vector<uint8_t> raw;
  size_t p = 2;
  for (bool last = false; !last && p < z.size();) {
    last = z[p] & 1;
    EXPECT_EQ((z[p] >> 1) & 3, 0) << "not a stored block";
    const uint32_t len = z[p + 1] | uint32_t(z[p + 2]) << 8;
    const uint32_t nlen = z[p + 3] | uint32_t(z[p + 4]) << 8;
    EXPECT_EQ(len ^ 0xffffu, nlen);
    raw.insert(raw.end(), z.begin() + ptrdiff_t(p + 5), z.begin() + ptrdiff_t(p + 5 + len));
    p += 5 + len;
  }
  EXPECT_EQ(p + 4, z.size());
  if (p + 4 <= z.size()) {
    EXPECT_EQ(adler32(raw.data(), raw.size()), be32(&z[p]));
  }
  EXPECT_EQ(raw.size(), size_t(png.height) * (png.width + 1));
  for (uint32_t y = 0; y < png.height && raw.size() >= size_t(png.height) * (png.width + 1); ++y) {
    EXPECT_EQ(raw[y * (png.width + 1)], 0) << "filter byte of row " << y;
    png.pixels.insert(png.pixels.end(), raw.begin() + ptrdiff_t(y * (png.width + 1) + 1),
                      raw.begin() + ptrdiff_t((y + 1) * (png.width + 1)));
  }
  return png;
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

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
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
    // has one extra key and a row without loss, which are ignored).
    for (int r = 0; r < 2; ++r) {
      std::ofstream f(dir_ / (r ? "run-b.jsonl" : "run-a.jsonl"));
      if (r) f << "{\"event\": \"start\", \"config\": \"x\"}\n";
      for (int s = 1; s <= 200; ++s) {
        const double loss = 2.0 + (8.0 - 0.7 * r) / (1.0 + 0.05 * s) + 0.05 * ((s * 37) % 7);
        f << "{\"step\": " << s << ", \"loss\": " << loss << ", \"lr\": 0.001}\n";
        if (s % 25 == 0) f << "{\"step\": " << s << ", \"val_loss\": " << loss + 0.2 << "}\n";
      }
    }
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  fs::path dir_;
};

}  // namespace

TEST(PlotRender, Checksums) {
  const std::string s = "123456789";
  EXPECT_EQ(crc32(reinterpret_cast<const uint8_t*>(s.data()), s.size()), 0xcbf43926u);
  const std::string w = "Wikipedia";
  EXPECT_EQ(adler32(reinterpret_cast<const uint8_t*>(w.data()), w.size()), 0x11e60398u);
  EXPECT_EQ(crc32(nullptr, 0), 0u);
  EXPECT_EQ(adler32(nullptr, 0), 1u);
}

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

TEST(PlotRender, PngRoundTrip) {
  // A 300x250 image (more than one 64 KiB stored block) survives the writer and the reader.
  std::vector<uint8_t> px(300 * 250);
  for (size_t i = 0; i < px.size(); ++i) px[i] = uint8_t((i * 7 + i / 300) % 3);
  const auto png = decode_png(encode_png(px, 300, 250, {0xff0000, 0x00ff00, 0x0000ff}));
  EXPECT_EQ(png.width, 300u);
  EXPECT_EQ(png.height, 250u);
  EXPECT_EQ(png.palette, (std::vector<uint32_t>{0xff0000, 0x00ff00, 0x0000ff}));
  EXPECT_EQ(png.pixels, px);
}

TEST(PlotRender, PngShowsEachRunInItsColour) {
  Figure f;
  f.title = "t";
  f.series.push_back({"a", {{0, 3}, {100, 1}}, {{50, 2.5}, {100, 1.5}}});
  f.series.push_back({"b", {{0, 2}, {100, 2}}, {}});
  const Png png = decode_png(render_png(f));
  ASSERT_EQ(png.pixels.size(), size_t(f.width) * size_t(f.height));
  std::map<uint32_t, size_t> count;
  for (uint8_t i : png.pixels) {
    ASSERT_LT(i, png.palette.size());
    ++count[png.palette[i]];
  }
  // Both series colours drawn (a line across the plot is hundreds of pixels), text in black,
  // mostly white background.
  EXPECT_GT(count[0x1f77b4], 800u);
  EXPECT_GT(count[0xff7f0e], 800u);
  EXPECT_GT(count[0x000000], 500u);
  EXPECT_GT(count[0xffffff], png.pixels.size() / 2);
  // Run b is flat: its line is one horizontal band of rows in the plot.
  std::set<size_t> rows;
  for (size_t i = 0; i < png.pixels.size(); ++i)
    if (png.palette[png.pixels[i]] == 0xff7f0e && i % size_t(f.width) < size_t(f.width) - 300)
      rows.insert(i / size_t(f.width));
  EXPECT_LE(rows.size(), 3u);
}

TEST_F(PlotCommand, WritesSvgWithOnePolylinePerCurve) {
  const fs::path out = dir_ / "loss.svg";
  const auto r =
      run_loom("plot " + (dir_ / "run-a.jsonl").string() + " " + (dir_ / "run-b.jsonl").string() +
                   " --output " + out.string() + " --title 'My <runs>'",
               dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  std::ifstream in(out);
  const std::string svg(std::istreambuf_iterator<char>(in), {});
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("My &lt;runs&gt;"), std::string::npos);
  EXPECT_NE(svg.find(">run-a.jsonl<"), std::string::npos);
  EXPECT_NE(svg.find(">run-b.jsonl<"), std::string::npos);
  // The train curves: 200 points in one polyline in each run's colour; validation dashed.
  for (const char* colour : {"#1f77b4", "#ff7f0e"}) {
    const size_t at = svg.find("<polyline fill=\"none\" stroke=\"" + std::string(colour));
    ASSERT_NE(at, std::string::npos) << colour;
    const size_t pts = svg.find("points=\"", at), end = svg.find('"', pts + 8);
    const std::string p = svg.substr(pts + 8, end - pts - 8);
    EXPECT_EQ(std::count(p.begin(), p.end(), ','), 200) << colour;
  }
  size_t dashed = 0;
  for (size_t at = 0; (at = svg.find("stroke-dasharray", at)) != std::string::npos; ++at) ++dashed;
  EXPECT_EQ(dashed, 3u);  // two runs' validation + the legend's validation sample
  size_t circles = 0;
  for (size_t at = 0; (at = svg.find("<circle", at)) != std::string::npos; ++at) ++circles;
  EXPECT_EQ(circles, 2u * 8 + 1);
}

TEST_F(PlotCommand, WritesValidPng) {
  const fs::path out = dir_ / "loss.png";
  const auto r =
      run_loom("plot " + (dir_ / "run-a.jsonl").string() + " " + (dir_ / "run-b.jsonl").string() +
                   " --output " + out.string() + " --log-y",
               dir_);
  ASSERT_EQ(r.rc, 0) << r.err;
  const Png png = decode_png(read_bytes(out));
  EXPECT_EQ(png.width, 1000u);
  EXPECT_EQ(png.height, 640u);
  std::set<uint32_t> colours;
  for (uint8_t i : png.pixels) colours.insert(png.palette.at(i));
  EXPECT_TRUE(colours.count(0x1f77b4) && colours.count(0xff7f0e));
}

TEST_F(PlotCommand, Errors) {
  const std::string a = (dir_ / "run-a.jsonl").string();
  auto r = run_loom("plot " + (dir_ / "missing.jsonl").string() + " --output x.svg", dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("missing.jsonl"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;

  std::ofstream(dir_ / "bad.jsonl") << "{\"step\": 1, \"loss\": 2}\n\n{\"step\": 2, \"loss\": \n";
  r = run_loom("plot " + (dir_ / "bad.jsonl").string() + " --output " + (dir_ / "x.svg").string(),
               dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("bad.jsonl:3"), std::string::npos) << r.err;

  std::ofstream(dir_ / "noloss.jsonl") << "{\"step\": 1, \"lr\": 2}\n{\"step\": 2}\n";
  r = run_loom(
      "plot " + (dir_ / "noloss.jsonl").string() + " --output " + (dir_ / "x.svg").string(), dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("noloss.jsonl: no rows"), std::string::npos) << r.err;

  r = run_loom("plot " + a + " --output " + (dir_ / "x.jpg").string(), dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find(".svg or .png"), std::string::npos) << r.err;

  r = run_loom("plot " + a, dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--output"), std::string::npos) << r.err;

  std::ofstream(dir_ / "neg.jsonl") << "{\"step\": 1, \"loss\": -0.5}\n";
  r = run_loom(
      "plot " + (dir_ / "neg.jsonl").string() + " --log-y --output " + (dir_ / "x.svg").string(),
      dir_);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("losses > 0"), std::string::npos) << r.err;
}
