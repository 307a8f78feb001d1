#pragma once
// Where a piece of a global tensor lives in a sharded checkpoint
// (docs/decisions/distributed-checkpoints.md). A rank's part of a parameter is a box of the global
// tensor (tensor parallelism keeps a block of rows or of columns; without it the box is the whole
// tensor) and, within the box's row-major elements, one contiguous range (an FSDP shard cuts the
// flat layout anywhere). The file stores the range as a 1-D tensor of end - begin elements.
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/tensor.hpp"
#include "model/param_unit.hpp"

namespace loom {

struct TensorSlice {
  Shape offsets;               // the box's first index in each dimension of the global tensor
  Shape lengths;               // the box's extent in each dimension
  int64_t begin = 0, end = 0;  // elements [begin, end) of the box, row-major

  int64_t numel() const { return end - begin; }
  int64_t box_numel() const { return shape_numel(lengths); }
};

// Elements [local_begin, local_begin + count) of this tp rank's part of `spec` as a slice of the
// global tensor. Padding rows of a padded vocabulary are outside the box, so the range is cut to
// the box: `count` of the result may be smaller, and zero when the elements are all padding.
TensorSlice param_slice(const ParamSpec& spec, int64_t local_begin, int64_t count);

nlohmann::json slice_to_json(const TensorSlice& s);
// Checks the slice lies inside a tensor of `shape` and splits only its first two dimensions
// (what the reader supports); errors start with `where`.
TensorSlice slice_from_json(const nlohmann::json& j, const Shape& shape, const std::string& where);

// The slice's elements that fall in rows [row_begin, row_begin + rows) of the global tensor
// `shape` (dimension 0; the others flattened into a row), as runs: fn(slice_offset, n,
// out_offset), slice_offset counted from the slice's first element, out_offset from the first
// element of row row_begin.
template <class Fn>
void for_slice_runs(const TensorSlice& s, const Shape& shape, int64_t row_begin, int64_t rows,
                    Fn&& fn) {
  const int64_t dim0 = shape.empty() ? 1 : shape[0];
  const int64_t row = dim0 == 0 ? 0 : shape_numel(shape) / dim0;
  if (s.numel() <= 0 || row == 0) return;
  // The box in the 2-D view [dim0, row]: rows [r0, r0 + br), columns [c0, c0 + bc).
  const int64_t inner = shape.size() > 2 ? row / shape[1] : 1;
  const int64_t r0 = shape.empty() ? 0 : s.offsets[0];
  const int64_t c0 = shape.size() > 1 ? s.offsets[1] * inner : 0;
  const int64_t bc = shape.size() > 1 ? s.lengths[1] * inner : 1;
  if (bc == row) {
    // Whole rows: the slice is one run of the global tensor.
    const int64_t g0 = r0 * row + s.begin, g1 = r0 * row + s.end;
    const int64_t lo = std::max(g0, row_begin * row), hi = std::min(g1, (row_begin + rows) * row);
    if (lo < hi) fn(lo - g0, hi - lo, lo - row_begin * row);
    return;
  }
  const int64_t first = std::max(s.begin / bc, row_begin - r0);
  const int64_t last = std::min((s.end - 1) / bc, row_begin + rows - 1 - r0);
  for (int64_t i = first; i <= last; ++i) {
    const int64_t lo = std::max(i * bc, s.begin), hi = std::min(i * bc + bc, s.end);
    if (lo < hi) fn(lo - s.begin, hi - lo, (r0 + i - row_begin) * row + c0 + (lo - i * bc));
  }
}

}  // namespace loom
