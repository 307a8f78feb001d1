#include "model/tensor_slice.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/config_json.hpp"

namespace loom {

TensorSlice param_slice(const ParamSpec& spec, int64_t local_begin, int64_t count) {
  TensorSlice s;
  const Shape g = spec.global_shape();
  s.offsets.assign(g.size(), 0);
  s.lengths = g;
  if (spec.split == TpSplit::rows && spec.tp_count > 1) {
    const int64_t L = spec.shape[0];
    s.offsets[0] = int64_t(spec.tp_rank) * L;
    s.lengths[0] = std::clamp<int64_t>(g[0] - s.offsets[0], 0, L);
  } else if (spec.split == TpSplit::cols && spec.tp_count > 1) {
    s.offsets[1] = int64_t(spec.tp_rank) * spec.shape[1];
    s.lengths[1] = spec.shape[1];
  }
  // The local tensor's row-major order is the box's, padding rows last.
  s.begin = std::min(local_begin, s.box_numel());
  s.end = std::min(local_begin + count, s.box_numel());
  return s;
}

nlohmann::json slice_to_json(const TensorSlice& s) {
  return {{"offsets", s.offsets}, {"lengths", s.lengths}, {"range", {s.begin, s.end}}};
}

TensorSlice slice_from_json(const nlohmann::json& j, const Shape& shape, const std::string& where) {
  TensorSlice s;
  try {
    const auto ints = [&](const char* key) {
      const nlohmann::json& a = j.at(key);
      LOOM_CHECK(a.is_array(), where, ": \"", key, "\" must be an array of integers, found ",
                 config_json::found(a));
      Shape out;
      for (const nlohmann::json& v : a) out.push_back(config_json::to_int(v, where, key));
      return out;
    };
    s.offsets = ints("offsets");
    s.lengths = ints("lengths");
    const Shape r = ints("range");
    LOOM_CHECK(r.size() == 2, where, ": \"range\" must be [begin, end], found ",
               j.at("range").dump());
    s.begin = r[0];
    s.end = r[1];
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": expected {\"offsets\": [...], \"lengths\": [...], \"range\": [begin, end]}: ",
         e.what());
  }
  LOOM_CHECK(s.offsets.size() == shape.size() && s.lengths.size() == shape.size(), where,
             ": offsets and lengths must have one entry per dimension of shape ", shape_str(shape));
  for (size_t d = 0; d < shape.size(); ++d) {
    LOOM_CHECK(s.offsets[d] >= 0 && s.lengths[d] >= 0 && s.offsets[d] + s.lengths[d] <= shape[d],
               where, ": box offsets ", shape_str(s.offsets), " lengths ", shape_str(s.lengths),
               " lies outside shape ", shape_str(shape));
    LOOM_CHECK(d < 2 || (s.offsets[d] == 0 && s.lengths[d] == shape[d]), where,
               ": the box splits dimension ", d, "; only the first two may be split");
  }
  LOOM_CHECK(0 <= s.begin && s.begin <= s.end && s.end <= s.box_numel(), where, ": range [",
             s.begin, ", ", s.end, ") is outside the box's ", s.box_numel(), " elements");
  return s;
}

}  // namespace loom
