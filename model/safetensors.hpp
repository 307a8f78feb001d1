#pragma once
// Hugging Face safetensors: an 8-byte little-endian header length, a JSON header mapping tensor
// names to {dtype, shape, data_offsets}, then the raw data. Files are memory-mapped for reading;
// every inconsistency (truncated file, offsets outside the data, sizes that disagree with
// shape x dtype, overlapping tensors) is an error naming the file and tensor.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "model/tensor_slice.hpp"

namespace loom {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // as written in the file: "F32", "BF16", "F16", "I32", ...
  Shape shape;
  size_t begin = 0, end = 0;  // byte offsets in the data section
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // maps and validates
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool has(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;  // error if missing
  const void* data(const std::string& name) const;               // pointer into the mapping

  // Reads rows [row_begin, row_begin + rows) of dimension 0 (the whole tensor by default) into
  // f32, converting from F32/BF16/F16. Checks the tensor's shape equals `expected` (error names
  // file, tensor, expected and found shapes).
  void read_f32(const std::string& name, const Shape& expected, float* out, int64_t row_begin = 0,
                int64_t rows = -1) const;

 private:
  std::string path_;
  int fd_ = -1;
  const uint8_t* map_ = nullptr;
  size_t size_ = 0;
  size_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// The one slice reader of model directories: Hugging Face (model.safetensors, or
// model-0000x-of-0000y.safetensors with model.safetensors.index.json), each tensor whole in one
// file, and loom's sharded checkpoints (loom.index.json: each tensor in slices spread over the
// ranks' files, docs/decisions/distributed-checkpoints.md). Reading rows of a tensor reads only
// the slices that hold them.
class SafetensorsDir {
 public:
  explicit SafetensorsDir(const std::string& dir);
  bool has(const std::string& name) const;
  // The file holding a whole tensor; error names dir and tensor, and for a sharded checkpoint
  // (where tensors are in slices) says so.
  const SafetensorsFile& file_of(const std::string& name) const;
  Shape shape(const std::string& name) const;
  // Rows [row_begin, row_begin + rows) of dimension 0 into f32. Sharded: every element must come
  // from exactly one slice (error names the tensor and the files otherwise).
  void read_f32(const std::string& name, const Shape& expected, float* out, int64_t row_begin = 0,
                int64_t rows = -1) const;
  std::vector<std::string> names() const;
  const std::string& dir() const { return dir_; }
  bool sharded() const { return sharded_; }
  // A sharded checkpoint's index "metadata" (strings); empty for Hugging Face.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Where a tensor is, for messages: its file, or "slices in FILE, FILE, ...".
  std::string where(const std::string& name) const;

 private:
  struct Piece {
    size_t file = 0;
    TensorSlice slice;
  };
  void open_sharded(const std::string& index_path);

  std::string dir_;
  bool sharded_ = false;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
  std::map<std::string, std::pair<Shape, std::vector<Piece>>> pieces_;  // sharded
  std::map<std::string, std::string> metadata_;
};

// The index of a sharded checkpoint directory.
inline constexpr const char* kShardedIndexName = "loom.index.json";

struct NamedTensor {
  std::string name;
  Tensor tensor;  // contiguous, f32/bf16/i32, cpu
};

// The writers below return the written file's checksum (model/checksum.hpp), hashed from the
// bytes as they are written.
// Writes one file atomically (write to a temporary name, fsync, rename).
uint64_t write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                           const std::map<std::string, std::string>& metadata = {});
// Writes one file atomically with the tensors' bytes produced one at a time: `fill(i, t)` fills
// tensor i (allocated by the writer with its dtype and shape), so memory holds one tensor.
struct TensorHeader {
  std::string name;
  DType dtype;
  Shape shape;
};
uint64_t write_safetensors_streamed(const std::string& path,
                                    const std::vector<TensorHeader>& tensors,
                                    const std::map<std::string, std::string>& metadata,
                                    const std::function<void(size_t, Tensor&)>& fill);
// Writes one file atomically with each tensor's bytes handed over in pieces: `emit(i, put)` is
// called for tensor i, in order, and calls put(bytes, n) with its bytes, in order, n summing to
// its size; so the caller decides, piece by piece, where the bytes come from (an async save:
// the live shards or their staged copy).
uint64_t write_safetensors_pieces(
    const std::string& path, const std::vector<TensorHeader>& tensors,
    const std::map<std::string, std::string>& metadata,
    const std::function<void(size_t, const std::function<void(const void*, size_t)>&)>& emit);
// A small file (an index, a config) written atomically: a temporary name, fsync, rename.
uint64_t write_text_atomic(const std::string& path, const std::string& content);
// Writes a model directory: one model.safetensors if the total is <= max_shard_bytes, else
// model-0000i-of-0000n.safetensors files plus model.safetensors.index.json.
void write_safetensors_dir(const std::string& dir, const std::vector<NamedTensor>& tensors,
                           size_t max_shard_bytes = size_t(5) << 30);

}  // namespace loom
