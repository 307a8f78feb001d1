#include "train/tfrecord.hpp"

#include <isa-l/crc.h>

#include <climits>

#include "core/error.hpp"

namespace loom {

namespace {

constexpr size_t kHeaderBytes = 12;  // length + its CRC
constexpr size_t kTrailerBytes = 4;  // the data's CRC

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += char((v >> (8 * i)) & 0xff);
}

uint64_t get_le(std::string_view in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(in[at + size_t(i)])) << (8 * i);
  return v;
}

}  // namespace

uint32_t crc32c(std::string_view data) {
  // ISA-L's crc32_iscsi neither inverts its initial value nor its result: the standard CRC-32C
  // starts from and ends with an inversion. It takes an int length: large buffers go in parts.
  uint32_t crc = 0xffffffffu;
  auto* p = reinterpret_cast<unsigned char*>(const_cast<char*>(data.data()));
  size_t left = data.size();
  while (left > 0) {
    const int n = int(left < size_t(INT_MAX) ? left : size_t(INT_MAX));
    crc = crc32_iscsi(p, n, crc);
    p += n;
    left -= size_t(n);
  }
  return crc ^ 0xffffffffu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(std::string_view data) {
  std::string out;
  out.reserve(kHeaderBytes + data.size() + kTrailerBytes);
  put_le(out, data.size(), 8);
  put_le(out, masked_crc32c(out), 4);
  out += data;
  put_le(out, masked_crc32c(data), 4);
  return out;
}

TFRecords parse_tfrecords(std::string_view bytes) {
  TFRecords r;
  size_t at = 0;
  while (at < bytes.size()) {
    if (bytes.size() - at < kHeaderBytes) {
      r.error = str_cat("a record header cut short at byte ", at);
      break;
    }
    const uint64_t len = get_le(bytes, at, 8);
    if (uint32_t(get_le(bytes, at + 8, 4)) != masked_crc32c(bytes.substr(at, 8))) {
      r.error = str_cat("the length CRC of the record at byte ", at, " does not match");
      break;
    }
    const size_t rest = bytes.size() - at - kHeaderBytes;
    if (len > rest || rest - len < kTrailerBytes) {
      r.error = str_cat("the record at byte ", at, " (", len, " bytes) is cut short");
      break;
    }
    const std::string_view data = bytes.substr(at + kHeaderBytes, len);
    if (uint32_t(get_le(bytes, at + kHeaderBytes + len, 4)) != masked_crc32c(data)) {
      r.error = str_cat("the data CRC of the record at byte ", at, " does not match");
      break;
    }
    r.records.emplace_back(data);
    at += kHeaderBytes + len + kTrailerBytes;
    r.valid_bytes = at;
  }
  return r;
}

}  // namespace loom
