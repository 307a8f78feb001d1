// libFuzzer harness: a .gz or a .zst file (the first byte of the input picks which) read through
// CompressedReader by lines, then again whole. At most 16 MB of text is read per input, so a small
// input that decompresses to gigabytes (zstd's RLE blocks) does not stall the fuzzer.
#include <cstdint>
#include <string>

#include "data/compressed_reader.hpp"
#include "tests/fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  constexpr size_t kMaxText = size_t(16) << 20;
  const std::string path =
      loom::fuzz::write_file(data[0] & 1 ? "in.txt.zst" : "in.txt.gz",
                             {reinterpret_cast<const char*>(data + 1), size - 1});
  loom::fuzz::expect_loom_errors_only([&] {
    loom::CompressedReader r(path);
    std::string line;
    size_t text = 0;
    while (text < kMaxText && r.read_line(line)) text += line.size() + 1;
    if (r.compressed_offset() > r.file_bytes()) std::abort();  // consumed more than there is
  });
  loom::fuzz::expect_loom_errors_only([&] {
    loom::CompressedReader r(path);
    std::string buf(size_t(1) << 16, '\0');
    size_t text = 0;
    while (text < kMaxText) {
      const size_t n = r.read(buf.data(), buf.size());
      if (n == 0) break;
      text += n;
    }
  });
  return 0;
}
