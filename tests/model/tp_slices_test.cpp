// Tensor-parallel slices of parameters: every tp rank's local part, initialized on its own (and
// sharded over dp on top), reassembles bit for bit into the tensor one process initializes, for
// row and column splits; the runs of global indices cover each element exactly once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/param_unit.hpp"
#include "model/tensor_slice.hpp"

namespace loom {
namespace {

std::vector<ParamSpec> specs(int rank, int tp) {
  // Shapes that tp divides (2 and 4): rows 8 x 12, cols 6 x 16, a replicated vector of 10.
  ParamSpec rows{"w.rows", {8 / tp, 12}, Init::normal, 0.02f, true, false, TpSplit::rows, rank, tp};
  ParamSpec cols{"w.cols", {6, 16 / tp}, Init::normal, 0.5f, true, false, TpSplit::cols, rank, tp};
  ParamSpec norm{"w.norm", {10}, Init::ones, 0, false, true, TpSplit::none, rank, tp};
  ParamSpec rep{"w.rep", {3, 5}, Init::normal, 1.0f, true, false, TpSplit::none, rank, tp};
  return {rows, cols, norm, rep};
}

TEST(TpSlices, GlobalRunsCoverEachElementOnce) {
  for (int tp : {1, 2, 4}) {
    for (size_t p = 0; p < 2; ++p) {
      std::vector<int> hits;
      for (int r = 0; r < tp; ++r) {
        const ParamSpec s = specs(r, tp)[p];
        const int64_t n = shape_numel(s.shape);
        hits.resize(size_t(n * tp), 0);
        // In two pieces, the second starting mid-row, as FSDP shard boundaries fall.
        const int64_t cut = n / 2 + 1;
        int64_t seen = 0;
        for (auto [b, c] : {std::pair<int64_t, int64_t>{0, cut}, {cut, n - cut}})
          s.for_global_runs(b, c, [&](int64_t g, int64_t k, int64_t local) {
            EXPECT_EQ(local, seen) << s.name;  // runs come in local order, without gaps
            seen += k;
            for (int64_t i = 0; i < k; ++i) ++hits.at(size_t(g + i));
          });
        EXPECT_EQ(seen, n);
      }
      for (int h : hits) EXPECT_EQ(h, 1) << "tp " << tp << " param " << p;
    }
  }
}

// The global tensors of all tp ranks' (dp-sharded) units, assembled from their local parts.
std::vector<std::vector<float>> assemble(int tp, int dp) {
  const std::vector<ParamSpec> global = specs(0, 1);
  std::vector<std::vector<float>> out;
  for (const ParamSpec& g : global) out.emplace_back(size_t(shape_numel(g.shape)), -1.0f);
  for (int r = 0; r < tp; ++r) {
    // dp ranks of one tp rank: each initializes its shard; concatenated they are the flat buffer.
    std::vector<float> flat;
    std::vector<Param> params;
    for (int s = 0; s < dp; ++s) {
      ParamUnit u("u", specs(r, tp), false, Device::cpu, ShardLayout{s, dp});
      u.init_weights(7);
      const float* m = u.master_shard().data<float>();
      flat.insert(flat.end(), m, m + u.shard_numel());
      params = u.params();
    }
    // Placed by the Megatron layout written out here (not by for_global_runs, which init also
    // uses: placing by it would make the comparison a tautology).
    for (size_t p = 0; p < params.size(); ++p) {
      const ParamSpec& s = params[p].spec;
      const float* v = flat.data() + params[p].offset;
      const int64_t n = shape_numel(s.shape);
      for (int64_t i = 0; i < n; ++i) {
        int64_t g = i;
        if (s.split == TpSplit::rows) g = r * n + i;
        if (s.split == TpSplit::cols) {
          const int64_t lc = s.shape[1];
          g = (i / lc) * lc * tp + r * lc + i % lc;
        }
        out[p][size_t(g)] = v[i];
      }
    }
  }
  return out;
}

TEST(TpSlices, EveryLayoutInitializesTheSameGlobalWeights) {
  const auto ref = assemble(1, 1);
  // Bitwise: a mapping that covers each index once but puts a value in the wrong place (say,
  // a column slice taken as a row slice) fails here.
  for (auto [tp, dp] : {std::pair{2, 1}, {4, 1}, {2, 3}, {4, 2}}) {
    const auto got = assemble(tp, dp);
    for (size_t p = 0; p < ref.size(); ++p) {
      ASSERT_EQ(got[p].size(), ref[p].size());
      EXPECT_EQ(std::memcmp(got[p].data(), ref[p].data(), ref[p].size() * 4), 0)
          << "tp " << tp << " dp " << dp << " parameter " << p;
    }
  }
}

TEST(TpSlices, GlobalShape) {
  const auto s = specs(1, 4);
  EXPECT_EQ(s[0].global_shape(), (Shape{8, 12}));
  EXPECT_EQ(s[1].global_shape(), (Shape{6, 16}));
  EXPECT_EQ(s[2].global_shape(), (Shape{10}));
}

// A vocabulary of 10 rows on 4 tp ranks is padded to 12 (3 rows each): the real rows are the
// unpadded tensor's, bit for bit, on any dp sharding; the 2 padding rows of rank 3 are zero;
// the global shape (the checkpoint's) is the real one; reading from a file of 10 rows fills the
// padding with zeros.
TEST(TpSlices, PaddedVocabularyRowsAreZeroAndInvisible) {
  const int64_t V = 10, d = 4, tp = 4, Vl = 3;
  ParamSpec whole{"emb", {V, d}, Init::normal, 0.02f, true, true, TpSplit::rows, 0, 1};
  ParamUnit ref("u", {whole}, false, Device::cpu, ShardLayout{0, 1});
  ref.init_weights(7);
  const float* want = ref.master_shard().data<float>();
  std::vector<float> file(want, want + V * d);
  for (int r = 0; r < tp; ++r) {
    ParamSpec part{"emb", {Vl, d}, Init::normal, 0.02f, true, true, TpSplit::rows, r, int(tp), V};
    EXPECT_EQ(part.global_shape(), (Shape{V, d}));
    for (int dp : {1, 2}) {
      std::vector<float> local;
      for (int sh = 0; sh < dp; ++sh) {
        ParamUnit u("u", {part}, false, Device::cpu, ShardLayout{sh, dp});
        u.init_weights(7);
        const float* m = u.master_shard().data<float>();
        local.insert(local.end(), m, m + u.shard_numel());
      }
      local.resize(size_t(Vl * d));
      for (int64_t i = 0; i < Vl * d; ++i) {
        const int64_t g = r * Vl * d + i;
        EXPECT_EQ(local[size_t(i)], g < V * d ? want[g] : 0.0f) << "rank " << r << " i " << i;
      }
    }
    // Reading the rank's rows from the real tensor: the padding comes back zero.
    struct Reader {
      const std::vector<float>& data;
      void read_f32(const std::string&, const Shape& shape, float* out, int64_t row0,
                    int64_t rows) const {
        EXPECT_EQ(shape, (Shape{10, 4}));
        EXPECT_LE(row0 + rows, 10);
        std::copy_n(data.data() + row0 * 4, rows * 4, out);
      }
    } reader{file};
    std::vector<float> got(size_t(Vl * d), -1.0f);
    read_param_slice(reader, "emb", part, 0, Vl * d, got.data());
    for (int64_t i = 0; i < Vl * d; ++i) {
      const int64_t g = r * Vl * d + i;
      EXPECT_EQ(got[size_t(i)], g < V * d ? want[g] : 0.0f) << "rank " << r << " i " << i;
    }
  }
}

}  // namespace
// A checkpoint index's slice (loom.index.json, untrusted input) round-trips; a number that is not
// an int64 there (a float, one past its range, a string) is an error naming the entry, where
// nlohmann's conversion of a float to int64 would be undefined.
TEST(TensorSliceJson, RoundTripsAndRejectsNonIntegers) {
  TensorSlice s;
  s.offsets = {2, 0};
  s.lengths = {3, 4};
  s.begin = 1;
  s.end = 11;
  const Shape shape{8, 4};
  const TensorSlice back = slice_from_json(slice_to_json(s), shape, "w");
  EXPECT_EQ(back.offsets, s.offsets);
  EXPECT_EQ(back.lengths, s.lengths);
  EXPECT_EQ(back.begin, s.begin);
  EXPECT_EQ(back.end, s.end);
  for (const char* bad :
       {R"({"offsets": [2.5, 0], "lengths": [3, 4], "range": [1, 11]})",
        R"({"offsets": [2, 0], "lengths": [3, 4e70], "range": [1, 11]})",
        R"({"offsets": [2, 0], "lengths": [3, 4], "range": [1, 1.0e300]})",
        R"({"offsets": [2, 0], "lengths": [3, 4], "range": [18446744073709551615, 11]})",
        R"({"offsets": 2, "lengths": [3, 4], "range": [1, 11]})",
        R"({"offsets": [2, 0], "lengths": [3, 4], "range": [1]})"}) {
    try {
      slice_from_json(nlohmann::json::parse(bad), shape, "entry w");
      ADD_FAILURE() << "no error for " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("entry w"), std::string::npos) << e.what();
    }
  }
}

}  // namespace loom
