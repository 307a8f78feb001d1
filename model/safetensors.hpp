#pragma once
// Hugging Face safetensors: an 8-byte little-endian header length, a JSON header mapping tensor
// names to {dtype, shape, data_offsets}, then the raw data. Files are memory-mapped for reading;
// every inconsistency (truncated file, offsets outside the data, sizes that disagree with
// shape x dtype, overlapping tensors) is an error naming the file and tensor.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"

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

// A Hugging Face model directory: model.safetensors, or model-0000x-of-0000y.safetensors with
// model.safetensors.index.json. Finds the file holding each tensor.
class SafetensorsDir {
 public:
  explicit SafetensorsDir(const std::string& dir);
  bool has(const std::string& name) const;
  const SafetensorsFile& file_of(const std::string& name) const;  // error names dir and tensor
  void read_f32(const std::string& name, const Shape& expected, float* out, int64_t row_begin = 0,
                int64_t rows = -1) const;
  std::vector<std::string> names() const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
};

struct NamedTensor {
  std::string name;
  Tensor tensor;  // contiguous, f32/bf16/i32, cpu
};

// Writes one file atomically (write to a temporary name, fsync, rename).
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Writes a model directory: one model.safetensors if the total is <= max_shard_bytes, else
// model-0000i-of-0000n.safetensors files plus model.safetensors.index.json.
void write_safetensors_dir(const std::string& dir, const std::vector<NamedTensor>& tensors,
                           size_t max_shard_bytes = size_t(5) << 30);

}  // namespace loom
