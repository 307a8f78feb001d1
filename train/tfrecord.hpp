#pragma once
// TFRecord framing, the container of TensorBoard's event files. Each record is
//   uint64 length, uint32 masked CRC-32C of those 8 bytes, the data, uint32 masked CRC-32C of the
//   data
// (integers little-endian). The CRC-32C (Castagnoli) is ISA-L's; the mask is TensorFlow's, which
// keeps the CRC of data that itself holds CRCs useful.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

uint32_t crc32c(std::string_view data);
// The CRC rotated right by 15 bits plus 0xa282ead8, as the framing stores it.
uint32_t masked_crc32c(std::string_view data);

// `data` framed as one record.
std::string tfrecord_frame(std::string_view data);

// The records of a file's bytes, in order, up to the first one that is cut short or whose CRCs do
// not match (a run killed while writing leaves a partial record at the end).
struct TFRecords {
  std::vector<std::string> records;
  size_t valid_bytes = 0;  // how many bytes the whole records take
  bool complete() const { return error.empty(); }
  std::string error;  // "" when every byte belongs to a whole record; else what was wrong where
};
TFRecords parse_tfrecords(std::string_view bytes);

}  // namespace loom
