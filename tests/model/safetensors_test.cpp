#include "model/safetensors.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>

#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using namespace loom;

namespace {

// A fresh directory per test, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        fs::temp_directory_path() / ("loom_st_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

// A safetensors file from a header text and data bytes, with the header length as written
// (or `claimed_len` when given, to lie about it).
std::string craft(const std::string& header, const std::string& data, int64_t claimed_len = -1) {
  uint64_t n = claimed_len >= 0 ? uint64_t(claimed_len) : header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

using loom::test::expect_error;

Tensor f32_tensor(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32);
  auto v = loom::test::randn(size_t(t.numel()), seed);
  if (t.numel()) std::memcpy(t.raw(), v.data(), v.size() * 4);
  return t;
}

bool same_bytes(const void* a, const Tensor& t) {
  return t.nbytes() == 0 || std::memcmp(a, t.raw(), t.nbytes()) == 0;
}

std::vector<NamedTensor> sample_tensors() {
  Tensor i = Tensor::empty({2, 3, 4}, DType::i32);
  for (int64_t k = 0; k < i.numel(); ++k) i.data<int32_t>()[k] = int32_t(k * 7919 - 50000);
  return {
      {"model.embed_tokens.weight", f32_tensor({7, 5}, 1)},
      // 50 bytes: every later tensor starts at an offset that is not 4-byte aligned.
      {"model.layers.0.self_attn.q_proj.weight", f32_tensor({5, 5}, 2).to(DType::bf16)},
      {"positions", i},
      {"scalar", f32_tensor({}, 3)},
      {"empty", f32_tensor({0, 4}, 4)},
      {"a.bias", f32_tensor({3}, 5)},
      {"model.norm.weight", f32_tensor({5}, 6).to(DType::bf16)},
  };
}

}  // namespace

TEST_F(SafetensorsTest, RoundTripOfSeveralDtypesAndShapes) {
  const auto tensors = sample_tensors();
  const std::string p = path("m.safetensors");
  write_safetensors(p, tensors, {{"format", "pt"}, {"note", "hello \"world\""}});

  // Header length is a multiple of 8, so the data section is 8-byte aligned.
  std::ifstream f(p, std::ios::binary);
  uint64_t hlen = 0;
  f.read(reinterpret_cast<char*>(&hlen), 8);
  EXPECT_EQ(hlen % 8, 0u);
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << "temporary left";

  SafetensorsFile st(p);
  EXPECT_EQ(st.metadata().at("format"), "pt");
  EXPECT_EQ(st.metadata().at("note"), "hello \"world\"");
  ASSERT_EQ(st.entries().size(), tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    const auto& e = st.entries()[k];
    const Tensor& t = tensors[k].tensor;
    EXPECT_EQ(e.name, tensors[k].name) << "entries are in file order = the given order";
    EXPECT_EQ(e.shape, t.shape());
    EXPECT_EQ(e.dtype, t.dtype() == DType::f32 ? "F32" : t.dtype() == DType::bf16 ? "BF16" : "I32");
    EXPECT_EQ(e.end - e.begin, t.nbytes());
    EXPECT_TRUE(same_bytes(st.data(e.name), t)) << e.name;
    if (t.dtype() != DType::i32) {
      std::vector<float> out(size_t(t.numel()) + 1, -1.0f);
      st.read_f32(e.name, t.shape(), out.data());
      Tensor ref = t.dtype() == DType::f32 ? t : t.to(DType::f32);
      for (int64_t x = 0; x < t.numel(); ++x) EXPECT_EQ(out[x], ref.data<float>()[x]) << e.name;
      EXPECT_EQ(out.back(), -1.0f) << "wrote past the end";
    }
  }
  EXPECT_TRUE(st.has("scalar"));
  EXPECT_FALSE(st.has("nope"));
  expect_error([&] { st.entry("nope"); }, {p, "nope"});
  expect_error(
      [&] {
        float x;
        st.read_f32("positions", {2, 3, 4}, &x);
      },
      {p, "positions", "I32"});

  // Writing again replaces the file atomically.
  write_safetensors(p, {tensors[0]});
  SafetensorsFile st2(p);
  EXPECT_EQ(st2.entries().size(), 1u);
  EXPECT_TRUE(st2.metadata().empty());
}

TEST_F(SafetensorsTest, ReadsF16AndF64IntoF32) {
  // F16 bit patterns with exactly known values: normal, negative, largest, smallest subnormal,
  // a subnormal with several bits, -0 and +inf.
  const uint16_t h[] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x03FF, 0x8000, 0x7C00, 0x3555};
  const float hv[] = {1.0f,  -2.0f,    65504.0f,       0x1p-24f, 1023 * 0x1p-24f,
                      -0.0f, INFINITY, 0.333251953125f};
  const double d[] = {1.0 / 3.0, -1e-3, 123456.789, 1e-40};
  std::string data(reinterpret_cast<const char*>(h), sizeof h);
  data.append(reinterpret_cast<const char*>(d), sizeof d);
  const std::string header = R"({"h":{"dtype":"F16","shape":[2,4],"data_offsets":[0,16]},)"
                             R"("d":{"dtype":"F64","shape":[4],"data_offsets":[16,48]}})";
  const std::string p = path("hd.safetensors");
  write_bytes(p, craft(header, data));  // header length not a multiple of 8: readers accept it

  SafetensorsFile st(p);
  float out[8];
  st.read_f32("h", {2, 4}, out);
  for (int k = 0; k < 8; ++k) {
    EXPECT_EQ(out[k], hv[k]) << k;
    EXPECT_EQ(std::signbit(out[k]), std::signbit(hv[k])) << k;
  }
  st.read_f32("d", {4}, out);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(out[k], float(d[k])) << k;
  // Row slicing of F16: row 1 only.
  st.read_f32("h", {2, 4}, out, 1, 1);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(out[k], hv[4 + k]) << k;
}

TEST_F(SafetensorsTest, RowSlicingReadsOnlyTheRowsOfARank) {
  const int64_t R = 11, C = 6;
  Tensor w = f32_tensor({R, C}, 42);
  Tensor wb = w.to(DType::bf16);
  const std::string p = path("w.safetensors");
  write_safetensors(p, {{"w", w}, {"wb", wb}});
  SafetensorsFile st(p);
  Tensor wbf = wb.to(DType::f32);
  // The rows of rank r of 4 (11 rows: 3, 3, 3, 2).
  for (int64_t r = 0, begin = 0; r < 4; ++r) {
    const int64_t rows = R / 4 + (r < R % 4);
    std::vector<float> a(size_t(rows * C) + 1, -7.0f), b(size_t(rows * C) + 1, -7.0f);
    st.read_f32("w", {R, C}, a.data(), begin, rows);
    st.read_f32("wb", {R, C}, b.data(), begin, rows);
    for (int64_t k = 0; k < rows * C; ++k) {
      EXPECT_EQ(a[k], w.data<float>()[begin * C + k]);
      EXPECT_EQ(b[k], wbf.data<float>()[begin * C + k]);
    }
    EXPECT_EQ(a.back(), -7.0f);
    EXPECT_EQ(b.back(), -7.0f);
    begin += rows;
  }
  // rows = -1: from row_begin to the end.
  std::vector<float> tail(size_t(3 * C));
  st.read_f32("w", {R, C}, tail.data(), R - 3);
  for (int64_t k = 0; k < 3 * C; ++k) EXPECT_EQ(tail[k], w.data<float>()[(R - 3) * C + k]);

  float x[128];
  expect_error([&] { st.read_f32("w", {R, C}, x, 9, 3); }, {p, "'w'", "out of range"});
  expect_error([&] { st.read_f32("w", {R, C}, x, -1, 1); }, {p, "'w'", "out of range"});
  expect_error([&] { st.read_f32("w", {C, R}, x); }, {p, "'w'", "[6, 11]", "[11, 6]"});
}

TEST_F(SafetensorsTest, ShardedRoundTripLikeHuggingFace) {
  // 400, 400, 400 and 1000 bytes with a 1000-byte limit: [a, b], [c], [d] (a shard closes when the
  // next tensor would overflow it; a tensor as large as the limit fills one alone).
  std::vector<NamedTensor> t = {{"a", f32_tensor({10, 10}, 1)},
                                {"b", f32_tensor({100}, 2)},
                                {"c", f32_tensor({4, 5, 5}, 3)},
                                {"d", f32_tensor({500}, 4).to(DType::bf16)}};
  const std::string d = path("hf");
  write_safetensors_dir(d, t, 1000);
  const char* f1 = "model-00001-of-00003.safetensors";
  const char* f2 = "model-00002-of-00003.safetensors";
  const char* f3 = "model-00003-of-00003.safetensors";
  for (const char* f : {f1, f2, f3}) EXPECT_TRUE(fs::exists(fs::path(d) / f)) << f;
  EXPECT_FALSE(fs::exists(fs::path(d) / "model.safetensors"));

  std::ifstream in(fs::path(d) / "model.safetensors.index.json");
  nlohmann::json index = nlohmann::json::parse(in);
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), 2200);
  EXPECT_EQ(index["weight_map"].size(), 4u);
  EXPECT_EQ(index["weight_map"]["a"], f1);
  EXPECT_EQ(index["weight_map"]["b"], f1);
  EXPECT_EQ(index["weight_map"]["c"], f2);
  EXPECT_EQ(index["weight_map"]["d"], f3);
  EXPECT_EQ(SafetensorsFile((fs::path(d) / f1).string()).metadata().at("format"), "pt");

  SafetensorsDir sd(d);
  EXPECT_EQ(sd.names(), (std::vector<std::string>{"a", "b", "c", "d"}));
  for (const auto& nt : t) {
    EXPECT_TRUE(sd.has(nt.name));
    EXPECT_TRUE(same_bytes(sd.file_of(nt.name).data(nt.name), nt.tensor)) << nt.name;
  }
  std::vector<float> c(100);
  sd.read_f32("c", {4, 5, 5}, c.data());
  for (int k = 0; k < 100; ++k) EXPECT_EQ(c[k], t[2].tensor.data<float>()[k]);
  expect_error([&] { sd.file_of("zz"); }, {d, "zz"});

  // Saving the same directory as one file replaces the sharded layout entirely.
  write_safetensors_dir(d, t);
  EXPECT_TRUE(fs::exists(fs::path(d) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(d) / "model.safetensors.index.json"));
  for (const char* f : {f1, f2, f3}) EXPECT_FALSE(fs::exists(fs::path(d) / f)) << f;
  SafetensorsDir single(d);
  EXPECT_EQ(single.names().size(), 4u);
  sd.read_f32("c", {4, 5, 5}, c.data());  // the old mapping stays valid after its file is gone
  single.read_f32("c", {4, 5, 5}, c.data());
  for (int k = 0; k < 100; ++k) EXPECT_EQ(c[k], t[2].tensor.data<float>()[k]);
}

TEST_F(SafetensorsTest, DirectoryErrorsNameTheDirectory) {
  const std::string d = path("empty");
  fs::create_directories(d);
  expect_error([&] { SafetensorsDir x(d); }, {d, "model.safetensors"});

  // Index naming a missing shard.
  write_bytes(
      (fs::path(d) / "model.safetensors.index.json").string(),
      R"({"metadata":{"total_size":4},"weight_map":{"w":"model-00001-of-00002.safetensors"}})");
  expect_error([&] { SafetensorsDir x(d); }, {d, "model-00001-of-00002.safetensors", "'w'"});

  // Index naming a tensor its file does not hold.
  write_safetensors((fs::path(d) / "model-00001-of-00002.safetensors").string(),
                    {{"v", f32_tensor({1}, 1)}});
  expect_error([&] { SafetensorsDir x(d); }, {d, "model-00001-of-00002.safetensors", "'w'"});

  write_bytes((fs::path(d) / "model.safetensors.index.json").string(), R"({"weight_map": 3})");
  expect_error([&] { SafetensorsDir x(d); }, {"model.safetensors.index.json", "weight_map"});

  // An index that points outside the model directory, even at a real file holding the tensor.
  write_safetensors(path("outside.safetensors"), {{"w", f32_tensor({1}, 1)}});
  for (const std::string& file :
       {std::string("../outside.safetensors"), path("outside.safetensors")}) {
    write_bytes((fs::path(d) / "model.safetensors.index.json").string(),
                R"({"weight_map":{"w":")" + file + R"("}})");
    expect_error([&] { SafetensorsDir x(d); },
                 {"model.safetensors.index.json", file, "plain file name"});
  }

  expect_error([&] { write_safetensors(path("no/such/dir/x.safetensors"), {}); },
               {"no/such/dir/x.safetensors"});
}

// ---- corrupt files: each message names the file and, where there is one, the tensor ----

TEST_F(SafetensorsTest, CorruptShorterThanEightBytes) {
  const std::string p = path("short.safetensors");
  write_bytes(p, std::string("\x10\0\0\0\0", 5));
  expect_error([&] { SafetensorsFile x(p); }, {p, "5 bytes", "shorter"});
}

TEST_F(SafetensorsTest, CorruptHeaderLengthBeyondFile) {
  const std::string p = path("long.safetensors");
  write_bytes(p, craft("{}      ", "", 1000));
  expect_error([&] { SafetensorsFile x(p); }, {p, "1000", "beyond"});
}

TEST_F(SafetensorsTest, CorruptHeaderNotJson) {
  const std::string p = path("notjson.safetensors");
  write_bytes(p, craft(R"({"w": {"dtype": "F32",)", "abcd"));
  expect_error([&] { SafetensorsFile x(p); }, {p, "not valid JSON"});
}

TEST_F(SafetensorsTest, CorruptHeaderNotAnObject) {
  const std::string p = path("array.safetensors");
  write_bytes(p, craft("[1, 2, 3]", ""));
  expect_error([&] { SafetensorsFile x(p); }, {p, "object", "array"});
}

TEST_F(SafetensorsTest, CorruptEntryWithoutDtypeShapeOrOffsets) {
  const std::string p = path("missing.safetensors");
  const char* headers[] = {
      R"({"w": {"shape": [1], "data_offsets": [0, 4]}})",
      R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})",
      R"({"w": {"dtype": "F32", "shape": [1]}})",
  };
  const char* keys[] = {"dtype", "shape", "data_offsets"};
  for (int k = 0; k < 3; ++k) {
    write_bytes(p, craft(headers[k], "abcd"));
    expect_error([&] { SafetensorsFile x(p); }, {p, "'w'", keys[k]});
  }
}

TEST_F(SafetensorsTest, CorruptUnknownDtype) {
  const std::string p = path("dtype.safetensors");
  write_bytes(p, craft(R"({"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}})", "abcd"));
  expect_error([&] { SafetensorsFile x(p); }, {p, "'w'", "F33"});
}

TEST_F(SafetensorsTest, CorruptOffsetsOutOfOrder) {
  const std::string p = path("order.safetensors");
  write_bytes(p, craft(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})",
                       std::string(8, 'x')));
  expect_error([&] { SafetensorsFile x(p); }, {p, "'w'", "out of order"});
}

TEST_F(SafetensorsTest, CorruptOffsetsBeyondDataSection) {
  const std::string p = path("beyond.safetensors");
  write_bytes(p, craft(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                       std::string(8, 'x')));
  expect_error([&] { SafetensorsFile x(p); }, {p, "'w'", "beyond the data section", "8 bytes"});
}

TEST_F(SafetensorsTest, CorruptSizeDisagreesWithShape) {
  const std::string p = path("size.safetensors");
  write_bytes(p, craft(R"({"w": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, 8]}})",
                       std::string(12, 'x')));
  expect_error([&] { SafetensorsFile x(p); }, {p, "'w'", "8 bytes", "[3, 2]", "BF16"});
}

TEST_F(SafetensorsTest, CorruptOverlappingTensors) {
  const std::string p = path("overlap.safetensors");
  write_bytes(p, craft(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                       R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                       std::string(12, 'x')));
  expect_error([&] { SafetensorsFile x(p); }, {p, "'a'", "'b'", "overlaps"});
}

TEST_F(SafetensorsTest, CorruptMetadataNotStrings) {
  const std::string p = path("meta.safetensors");
  write_bytes(p, craft(R"({"__metadata__": {"format": 1}})", ""));
  expect_error([&] { SafetensorsFile x(p); }, {p, "__metadata__", "format"});
}

TEST_F(SafetensorsTest, CorruptNegativeShape) {
  const std::string p = path("neg.safetensors");
  write_bytes(p,
              craft(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", "abcd"));
  expect_error([&] { SafetensorsFile x(p); }, {p, "'w'", "non-negative"});
}

// ---- the data section must be covered exactly, as Hugging Face's reader requires ----

TEST_F(SafetensorsTest, CorruptHeaderLengthOneByteShort) {
  // The padded JSON still parses with one byte less, but every tensor would be read shifted by
  // one byte: the file has one trailing byte past the tensors.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})" + std::string(5, ' ');
  const std::string p = path("short_len.safetensors");
  write_bytes(p, craft(header, std::string(8, 'x'), int64_t(header.size()) - 1));
  expect_error([&] { SafetensorsFile x(p); }, {p, "trailing bytes", "header length"});

  // The same with a file written by loom: one less in the length is refused, whatever the
  // padding was.
  const std::string q = path("written.safetensors");
  write_safetensors(q, sample_tensors());
  std::string bytes;
  {
    std::ifstream f(q, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  --n;
  std::memcpy(bytes.data(), &n, 8);
  write_bytes(q, bytes);
  expect_error([&] { SafetensorsFile x(q); }, {q});
}

TEST_F(SafetensorsTest, CorruptTrailingBytesAfterTheTensors) {
  const std::string p = path("trailing.safetensors");
  write_bytes(p, craft(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                       std::string(5, 'x')));
  expect_error([&] { SafetensorsFile x(p); }, {p, "4 bytes", "5 bytes", "trailing bytes"});
}

TEST_F(SafetensorsTest, CorruptHoleBetweenTensors) {
  const std::string p = path("hole.safetensors");
  write_bytes(p, craft(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                       R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                       std::string(12, 'x')));
  expect_error([&] { SafetensorsFile x(p); }, {p, "'b'", "'a'", "starts at byte 8", "hole"});
}

TEST_F(SafetensorsTest, CorruptFirstTensorNotAtTheStart) {
  const std::string p = path("gap.safetensors");
  write_bytes(p, craft(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                       std::string(8, 'x')));
  expect_error([&] { SafetensorsFile x(p); }, {p, "'a'", "byte 0", "hole"});
}

TEST_F(SafetensorsTest, CorruptHeaderWithLeadingWhitespace) {
  const std::string p = path("lead.safetensors");
  write_bytes(p, craft(R"(  {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                       std::string(4, 'x')));
  expect_error([&] { SafetensorsFile x(p); }, {p, "start with '{'"});
}

TEST_F(SafetensorsTest, EmptyTensorsAndNoTensorsAreStillValid) {
  // Zero-byte tensors take no room, and a file of metadata only has an empty data section.
  const std::string p = path("zero.safetensors");
  write_bytes(p, craft(R"({"e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},)"
                       R"( "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                       std::string(4, 'x')));
  SafetensorsFile x(p);
  EXPECT_EQ(x.entries().size(), 2u);
  const std::string q = path("meta_only.safetensors");
  write_bytes(q, craft(R"({"__metadata__": {"format": "pt"}})", ""));
  SafetensorsFile y(q);
  EXPECT_TRUE(y.entries().empty());
}
