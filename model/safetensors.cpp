#include "model/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.hpp"
#include "model/checksum.hpp"
#include "model/config_json.hpp"

namespace loom {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; loom reads it in place");

namespace {

namespace fs = std::filesystem;

// Element sizes of every dtype the safetensors format defines: a file holding, say, I64 buffers
// still opens; only reading it as f32 is refused.
size_t st_dtype_size(const std::string& d) {
  static const std::pair<const char*, size_t> kSizes[] = {
      {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2},    {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U64", 8},     {"U32", 4},
      {"U16", 2}, {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (const auto& [name, size] : kSizes)
    if (d == name) return size;
  return 0;
}

const char* st_dtype_of(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::f64:
      return "F64";
  }
  return "?";
}

// IEEE half to float, exact for every input (subnormals, inf, NaN).
inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else {
    // Zero or subnormal: mant * 2^-24 is exact in float.
    float f = float(mant) * 0x1p-24f;
    uint32_t m;
    std::memcpy(&m, &f, 4);
    u = sign | m;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::string sys_error(const std::string& what, const std::string& path) {
  return str_cat(what, " '", path, "': ", std::strerror(errno));
}

// Owns a file descriptor so that every error path closes it.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

void write_all(int fd, const void* p, size_t n, const std::string& path) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, std::min(n, size_t(1) << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(sys_error("cannot write", path));
    }
    c += w;
    n -= size_t(w);
  }
}

// Hashes the bytes as they are written, so that a file's checksum costs no second read of it.
void write_hashed(int fd, const void* p, size_t n, const std::string& path, Checksum& sum) {
  sum.update(p, n);
  write_all(fd, p, n, path);
}

// Writes `path` atomically: the content goes to path.tmp.<pid>, is flushed to disk, then renamed
// over `path`, and the directory entry is flushed too, so a crash leaves the old file or the new
// one, never a torn one.
template <class Writer>
void atomic_write(const std::string& path, Writer&& writer) {
  std::string tmp = str_cat(path, ".tmp.", ::getpid());
  {
    Fd f(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (f.fd < 0) fail(sys_error("cannot create", tmp));
    try {
      writer(f.fd, tmp);
      if (::fsync(f.fd) != 0) fail(sys_error("cannot fsync", tmp));
    } catch (...) {
      ::unlink(tmp.c_str());
      throw;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string msg = sys_error(str_cat("cannot rename '", tmp, "' to"), path);
    ::unlink(tmp.c_str());
    fail(msg);
  }
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  Fd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd < 0 || ::fsync(d.fd) != 0) fail(sys_error("cannot fsync directory", dir.string()));
}

// model-DDDDD-of-DDDDD.safetensors
bool is_shard_name(const std::string& f) {
  static constexpr std::string_view pat = "model-#####-of-#####.safetensors";
  if (f.size() != pat.size()) return false;
  for (size_t i = 0; i < f.size(); ++i)
    if (pat[i] == '#' ? !(f[i] >= '0' && f[i] <= '9') : f[i] != pat[i]) return false;
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

namespace {

// Validates the header of the mapped file and returns where the data section starts.
size_t parse_header(const std::string& path, const uint8_t* map, size_t size,
                    std::vector<SafetensorsEntry>& entries,
                    std::map<std::string, std::string>& metadata) {
  uint64_t header_len;
  std::memcpy(&header_len, map, 8);
  LOOM_CHECK(header_len <= size - 8, path, ": header length ", header_len,
             " extends beyond the end of the file (", size, " bytes)");
  const size_t data_start = 8 + size_t(header_len);
  const size_t data_size = size - data_start;

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(map + 8, map + data_start);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": header is not valid JSON: ", e.what());
  }
  LOOM_CHECK(header.is_object(), path, ": header must be a JSON object, found ",
             header.type_name());
  // Hugging Face's reader also wants the object to start right after the length (no leading
  // whitespace), which a damaged length could otherwise hide.
  LOOM_CHECK(map[8] == '{', path, ": header must start with '{' right after the 8-byte length");

  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      LOOM_CHECK(v.is_object(), path, ": __metadata__ must be an object of strings, found ",
                 v.type_name());
      for (const auto& [k, s] : v.items()) {
        LOOM_CHECK(s.is_string(), path, ": __metadata__ value of '", k,
                   "' must be a string, found ", s.type_name());
        metadata[k] = s.get<std::string>();
      }
      continue;
    }
    const std::string where = str_cat(path, ": tensor '", name, "'");
    LOOM_CHECK(v.is_object(), where, ": entry must be an object, found ", v.type_name());
    for (const char* key : {"dtype", "shape", "data_offsets"})
      LOOM_CHECK(v.contains(key), where, ": entry has no '", key, "'");
    SafetensorsEntry e;
    e.name = name;
    const auto& dt = v["dtype"];
    LOOM_CHECK(dt.is_string(), where, ": dtype must be a string, found ", dt.type_name());
    e.dtype = dt.get<std::string>();
    size_t esize = st_dtype_size(e.dtype);
    LOOM_CHECK(esize != 0, where, ": unknown dtype '", e.dtype,
               "' (expected F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL, "
               "F8_E4M3 or F8_E5M2)");
    const auto& sh = v["shape"];
    LOOM_CHECK(sh.is_array(), where, ": shape must be an array, found ", sh.type_name());
    uint64_t numel = 1;
    for (const auto& d : sh) {
      LOOM_CHECK(d.is_number_unsigned(), where, ": shape must hold non-negative integers, found ",
                 d.dump());
      uint64_t n = d.get<uint64_t>();
      LOOM_CHECK(n <= uint64_t(INT64_MAX) && !__builtin_mul_overflow(numel, n, &numel), where,
                 ": shape ", sh.dump(), " overflows");
      e.shape.push_back(int64_t(n));
    }
    const auto& off = v["data_offsets"];
    LOOM_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                   off[1].is_number_unsigned(),
               where, ": data_offsets must be [begin, end] with non-negative integers, found ",
               off.dump());
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    LOOM_CHECK(b <= en, where, ": data_offsets [", b, ", ", en, "] are out of order");
    LOOM_CHECK(en <= data_size, where, ": data_offsets [", b, ", ", en,
               "] extend beyond the data section (", data_size, " bytes)");
    uint64_t nbytes;
    LOOM_CHECK(!__builtin_mul_overflow(numel, uint64_t(esize), &nbytes) && en - b == nbytes, where,
               ": data_offsets [", b, ", ", en, "] span ", en - b, " bytes but shape ",
               shape_str(e.shape), " x ", e.dtype, " needs ", numel, " x ", esize, " bytes");
    e.begin = size_t(b);
    e.end = size_t(en);
    entries.push_back(std::move(e));
  }

  // File order: by offset. Like Hugging Face's reader, the tensors must cover the data section
  // exactly: each starts where the previous one ends and the last ends at the end of the file. A
  // hole or trailing bytes mean a wrong header length or a damaged file, and reading such a file
  // would load every weight shifted, so it is refused rather than trusted.
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  size_t covered = 0;  // the data section's bytes [0, covered) belong to the tensors so far
  const SafetensorsEntry* prev = nullptr;
  for (const auto& c : entries) {
    if (prev) {
      LOOM_CHECK(c.begin >= prev->end, path, ": tensor '", c.name, "' (bytes ", c.begin, "..",
                 c.end, ") overlaps tensor '", prev->name, "' (bytes ", prev->begin, "..",
                 prev->end, ")");
    }
    LOOM_CHECK(c.begin == covered, path, ": tensor '", c.name, "' starts at byte ", c.begin,
               " of the data section, but ",
               prev ? str_cat("the previous tensor '", prev->name, "' ends at byte ", covered)
                    : std::string("the first tensor must start at byte 0"),
               " (a hole in the data section: the header length or the offsets are wrong)");
    covered = c.end;
    prev = &c;
  }
  LOOM_CHECK(covered == data_size, path, ": the tensors cover ", covered,
             " bytes but the data section holds ", data_size, " bytes (header length ", header_len,
             "); the file has ", data_size > covered ? "trailing bytes" : "missing bytes",
             ", so the header length or the offsets are wrong");
  return data_start;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) fail(sys_error("cannot open safetensors file", path));
  struct stat st;
  if (::fstat(f.fd, &st) != 0) fail(sys_error("cannot stat", path));
  size_ = size_t(st.st_size);
  LOOM_CHECK(size_ >= 8, path, ": file is ", size_,
             " bytes, shorter than the 8-byte header length of a safetensors file");
  void* m = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, f.fd, 0);
  if (m == MAP_FAILED) fail(sys_error("cannot mmap", path));
  map_ = static_cast<const uint8_t*>(m);
  // The mapping keeps the file alive; the descriptor is not needed any more (a sharded 405B
  // checkpoint has hundreds of files).
  try {
    data_start_ = parse_header(path_, map_, size_, entries_, metadata_);
    for (size_t i = 0; i < entries_.size(); ++i) index_[entries_[i].name] = i;
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(map_), size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
  if (fd_ >= 0) ::close(fd_);
}

bool SafetensorsFile::has(const std::string& name) const {
  return index_.count(name) != 0;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = index_.find(name);
  LOOM_CHECK(it != index_.end(), path_, ": no tensor named '", name, "'");
  return entries_[it->second];
}

const void* SafetensorsFile::data(const std::string& name) const {
  return map_ + data_start_ + entry(name).begin;
}

void SafetensorsFile::read_f32(const std::string& name, const Shape& expected, float* out,
                               int64_t row_begin, int64_t rows) const {
  const SafetensorsEntry& e = entry(name);
  const std::string where = str_cat(path_, ": tensor '", name, "'");
  LOOM_CHECK(e.shape == expected, where, ": expected shape ", shape_str(expected), ", found ",
             shape_str(e.shape));
  // A scalar is one row of one element.
  const int64_t dim0 = e.shape.empty() ? 1 : e.shape[0];
  if (rows < 0) rows = dim0 - row_begin;
  LOOM_CHECK(row_begin >= 0 && rows >= 0 && row_begin + rows <= dim0, where, ": rows [", row_begin,
             ", ", row_begin + rows, ") out of range for dimension 0 of size ", dim0);
  const int64_t row_elems = dim0 == 0 ? 0 : shape_numel(e.shape) / dim0;
  const int64_t n = rows * row_elems;
  const size_t esize = st_dtype_size(e.dtype);
  const uint8_t* src = map_ + data_start_ + e.begin + size_t(row_begin * row_elems) * esize;

  // Parallel so that the page faults of a large mapped tensor are taken on every core.
  const bool par = n >= (int64_t(1) << 18);
  if (e.dtype == "F32") {
#pragma omp parallel for schedule(static) if (par)
    for (int64_t c = 0; c < n; c += 65536)
      std::memcpy(out + c, src + c * 4, size_t(std::min<int64_t>(65536, n - c)) * 4);
  } else if (e.dtype == "BF16") {
#pragma omp parallel for schedule(static) if (par)
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = bf16_to_float(bf16{h});
    }
  } else if (e.dtype == "F16") {
#pragma omp parallel for schedule(static) if (par)
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = half_to_float(h);
    }
  } else if (e.dtype == "F64") {
#pragma omp parallel for schedule(static) if (par)
    for (int64_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, src + 8 * i, 8);
      out[i] = float(d);
    }
  } else {
    fail(where, ": dtype ", e.dtype, " cannot be read as float32 (expected F32, BF16, F16 or F64)");
  }
}

// ---------------------------------------------------------------------------------------------
// SafetensorsDir

namespace {

std::string read_text(const std::string& path) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) fail(sys_error("cannot open", path));
  std::string text;
  char buf[1 << 16];
  for (;;) {
    ssize_t r = ::read(f.fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail(sys_error("cannot read", path));
    if (r == 0) break;
    text.append(buf, size_t(r));
  }
  return text;
}

nlohmann::json read_json(const std::string& path) {
  try {
    return nlohmann::json::parse(read_text(path));
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
}

// Index entries name files of the directory; a path could read anything.
void check_plain_name(const std::string& file, const std::string& where) {
  LOOM_CHECK(!file.empty() && fs::path(file).filename() == file && file != "." && file != "..",
             where, " is '", file, "'; expected a plain file name in the model directory");
}

}  // namespace

SafetensorsDir::SafetensorsDir(const std::string& dir) : dir_(dir) {
  const fs::path d(dir);
  const fs::path index_path = d / "model.safetensors.index.json";
  const fs::path single = d / "model.safetensors";
  std::error_code ec;
  if (fs::is_regular_file(d / kShardedIndexName, ec)) {
    open_sharded((d / kShardedIndexName).string());
  } else if (fs::is_regular_file(index_path, ec)) {
    const std::string ip = index_path.string();
    const nlohmann::json index = read_json(ip);
    LOOM_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               ip, ": expected an object with a \"weight_map\" object of tensor name -> file");
    std::map<std::string, size_t> file_idx;
    for (const auto& [name, fv] : index["weight_map"].items()) {
      LOOM_CHECK(fv.is_string(), ip, ": weight_map entry of '", name,
                 "' must be a file name string, found ", fv.dump());
      const std::string file = fv.get<std::string>();
      check_plain_name(file, str_cat(ip, ": weight_map entry of '", name, "'"));
      auto it = file_idx.find(file);
      if (it == file_idx.end()) {
        const fs::path fp = d / file;
        LOOM_CHECK(fs::is_regular_file(fp, ec), dir, ": index maps tensor '", name, "' to '", file,
                   "', which does not exist");
        files_.push_back(std::make_unique<SafetensorsFile>(fp.string()));
        it = file_idx.emplace(file, files_.size() - 1).first;
      }
      LOOM_CHECK(files_[it->second]->has(name), dir, ": index maps tensor '", name, "' to '", file,
                 "', which does not contain it");
      where_[name] = it->second;
    }
  } else if (fs::is_regular_file(single, ec)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
    for (const auto& e : files_[0]->entries()) where_[e.name] = 0;
  } else {
    fail(dir,
         ": not a Hugging Face model directory or loom checkpoint (found none of "
         "model.safetensors, model.safetensors.index.json and ",
         kShardedIndexName, ")");
  }
}

void SafetensorsDir::open_sharded(const std::string& ip) {
  sharded_ = true;
  const fs::path d(dir_);
  const nlohmann::json index = read_json(ip);
  try {
    LOOM_CHECK(index.is_object() && index.value("format", "") == "loom-sharded", ip,
               ": not a loom sharded checkpoint index (expected \"format\": \"loom-sharded\")");
    LOOM_CHECK(config_json::get_int(index, "version", ip, "version") == 1, ip, ": version ",
               index.at("version").dump(), ", expected 1");
    const nlohmann::json meta = index.value("metadata", nlohmann::json::object());
    for (const auto& [k, v] : meta.items()) metadata_[k] = v.get<std::string>();
    std::map<std::string, size_t> file_idx;
    std::vector<nlohmann::json> file_slices;  // each file's own record of its slices
    for (const auto& fv : index.at("files")) {
      const std::string file = fv.get<std::string>();
      check_plain_name(file, str_cat(ip, ": file entry"));
      const fs::path fp = d / file;
      std::error_code ec;
      LOOM_CHECK(fs::is_regular_file(fp, ec), ip, ": lists '", file,
                 "', which does not exist (a rank's file of this checkpoint is missing)");
      files_.push_back(std::make_unique<SafetensorsFile>(fp.string()));
      file_idx[file] = files_.size() - 1;
      // A file of another save (another step, or another rank's file under this name) must not
      // be read as this one: the file records its step and its slices, which must be the
      // index's.
      const auto& fm = files_.back()->metadata();
      const auto step = fm.find("step");
      LOOM_CHECK(step == fm.end() || !metadata_.count("step") || step->second == metadata_["step"],
                 fp.string(), ": a file of step ", step == fm.end() ? "" : step->second,
                 " but the index ", ip, " is of step ", metadata_["step"],
                 " (a file of another save)");
      const auto sl = fm.find("slices");
      file_slices.push_back(sl == fm.end() ? nlohmann::json() : nlohmann::json::parse(sl->second));
    }
    for (const auto& [name, t] : index.at("tensors").items()) {
      const std::string where = str_cat(ip, ": tensor '", name, "'");
      auto& [shape, pieces] = pieces_[name];
      shape = t.at("shape").get<Shape>();
      int64_t covered = 0;
      for (const auto& sj : t.at("slices")) {
        const std::string file = sj.at("file").get<std::string>();
        const auto it = file_idx.find(file);
        LOOM_CHECK(it != file_idx.end(), where, ": a slice is in '", file,
                   "', which is not in the index's \"files\"");
        Piece p{it->second, slice_from_json(sj, shape, str_cat(where, " in '", file, "'"))};
        const SafetensorsFile& f = *files_[p.file];
        LOOM_CHECK(f.has(name), where, ": the index puts a slice in '", f.path(),
                   "', which does not contain it");
        LOOM_CHECK(f.entry(name).shape == Shape{p.slice.numel()}, where, ": the slice in '",
                   f.path(), "' holds ", p.slice.numel(),
                   " elements but the file's tensor has shape ", shape_str(f.entry(name).shape),
                   " (a torn or mismatched index)");
        const nlohmann::json& own = file_slices[p.file];
        if (!own.is_null()) {
          LOOM_CHECK(own.contains(name), where, ": '", f.path(),
                     "' does not record a slice of it (a file of another save)");
          const TensorSlice o =
              slice_from_json(own[name], shape, str_cat(f.path(), ": '", name, "'"));
          LOOM_CHECK(o.offsets == p.slice.offsets && o.lengths == p.slice.lengths &&
                         o.begin == p.slice.begin && o.end == p.slice.end,
                     where, ": the index's slice in '", f.path(), "' is not the one the file holds",
                     " (a file of another rank or save, or a mismatched index)");
        }
        covered += p.slice.numel();
        pieces.push_back(std::move(p));
      }
      LOOM_CHECK(covered == shape_numel(shape), where, ": the slices hold ", covered,
                 " elements, the tensor ", shape_str(shape), " has ", shape_numel(shape),
                 " (a torn or mismatched index)");
    }
  } catch (const nlohmann::json::exception& e) {
    fail(ip, ": invalid loom checkpoint index: ", e.what());
  }
}

bool SafetensorsDir::has(const std::string& name) const {
  return sharded_ ? pieces_.count(name) != 0 : where_.count(name) != 0;
}

const SafetensorsFile& SafetensorsDir::file_of(const std::string& name) const {
  LOOM_CHECK(!sharded_, dir_, ": tensor '", name,
             "' is stored in slices over several files (a sharded checkpoint), not in one file");
  auto it = where_.find(name);
  LOOM_CHECK(it != where_.end(), dir_, ": no tensor named '", name, "'");
  return *files_[it->second];
}

Shape SafetensorsDir::shape(const std::string& name) const {
  if (!sharded_) return file_of(name).entry(name).shape;
  const auto it = pieces_.find(name);
  LOOM_CHECK(it != pieces_.end(), dir_, ": no tensor named '", name, "'");
  return it->second.first;
}

std::string SafetensorsDir::where(const std::string& name) const {
  if (!sharded_) return file_of(name).path();
  std::string files;
  for (const Piece& p : pieces_.at(name).second)
    files += str_cat(files.empty() ? "" : ", ", files_[p.file]->path());
  return str_cat("slices in ", files);
}

void SafetensorsDir::read_f32(const std::string& name, const Shape& expected, float* out,
                              int64_t row_begin, int64_t rows) const {
  if (!sharded_) return file_of(name).read_f32(name, expected, out, row_begin, rows);
  const auto it = pieces_.find(name);
  LOOM_CHECK(it != pieces_.end(), dir_, ": no tensor named '", name, "'");
  const auto& [shape, pieces] = it->second;
  const std::string what = str_cat(dir_, ": tensor '", name, "'");
  LOOM_CHECK(shape == expected, what, ": expected shape ", shape_str(expected), ", found ",
             shape_str(shape));
  const int64_t dim0 = shape.empty() ? 1 : shape[0];
  if (rows < 0) rows = dim0 - row_begin;
  LOOM_CHECK(row_begin >= 0 && rows >= 0 && row_begin + rows <= dim0, what, ": rows [", row_begin,
             ", ", row_begin + rows, ") out of range for dimension 0 of size ", dim0);
  const int64_t n = rows * (dim0 == 0 ? 0 : shape_numel(shape) / dim0);
  // Every element from exactly one slice: an index whose slices overlap or leave a hole is
  // refused rather than read as zeros or twice. Checked on the runs (not per element, which would
  // cost a byte of heap per element read) before anything is read.
  struct Run {
    int64_t to, len, at;
    const Piece* piece;
  };
  std::vector<Run> runs;
  for (const Piece& p : pieces)
    for_slice_runs(p.slice, shape, row_begin, rows, [&](int64_t at, int64_t len, int64_t to) {
      runs.push_back({to, len, at, &p});
    });
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.to < b.to; });
  int64_t covered = 0, missing = 0;
  for (const Run& r : runs) {
    LOOM_CHECK(r.to >= covered, what, ": an element of rows [", row_begin, ", ", row_begin + rows,
               ") is in two slices (", files_[r.piece->file]->path(),
               " and another): a torn or mismatched index");
    missing += r.to - covered;
    covered = r.to + r.len;
  }
  missing += n - covered;
  LOOM_CHECK(missing == 0, what, ": ", missing, " elements of rows [", row_begin, ", ",
             row_begin + rows, ") are in no slice (a missing file or a torn index)");
  for (const Run& r : runs)
    files_[r.piece->file]->read_f32(name, {r.piece->slice.numel()}, out + r.to, r.at, r.len);
}

std::vector<std::string> SafetensorsDir::names() const {
  std::vector<std::string> n;
  if (sharded_) {
    for (const auto& [name, _] : pieces_) n.push_back(name);
    return n;
  }
  n.reserve(where_.size());
  for (const auto& [name, _] : where_) n.push_back(name);
  return n;
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

// The header of a file holding `tensors` in order, padded to a multiple of 8 bytes.
std::string encode_header(const std::string& path, const std::vector<TensorHeader>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  // Header keys in the given order, so the data section follows the same order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> seen;
  size_t offset = 0;
  for (const auto& t : tensors) {
    LOOM_CHECK(!t.name.empty() && t.name != "__metadata__", path, ": invalid tensor name '", t.name,
               "'");
    LOOM_CHECK(seen.insert(t.name).second, path, ": tensor '", t.name, "': name given twice");
    const size_t nbytes = size_t(shape_numel(t.shape)) * dtype_size(t.dtype);
    header[t.name] = {{"dtype", st_dtype_of(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string h;
  try {
    h = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": cannot encode the header (tensor names must be UTF-8): ", e.what());
  }
  h.append((8 - h.size() % 8) % 8, ' ');
  return h;
}

}  // namespace

uint64_t write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  std::vector<TensorHeader> headers;
  for (const auto& nt : tensors) {
    const Tensor& t = nt.tensor;
    const std::string where = str_cat(path, ": tensor '", nt.name, "'");
    LOOM_CHECK(t.defined(), where, ": undefined tensor");
    LOOM_CHECK(t.device() == Device::cpu, where, ": expected a cpu tensor, found ",
               device_name(t.device()));
    LOOM_CHECK(t.is_contiguous(), where, ": expected a contiguous tensor");
    headers.push_back({nt.name, t.dtype(), t.shape()});
  }
  const std::string h = encode_header(path, headers, metadata);
  const uint64_t hlen = h.size();
  Checksum sum;
  atomic_write(path, [&](int fd, const std::string& tmp) {
    write_hashed(fd, &hlen, 8, tmp, sum);
    write_hashed(fd, h.data(), h.size(), tmp, sum);
    for (const auto& nt : tensors)
      if (nt.tensor.nbytes() > 0) write_hashed(fd, nt.tensor.raw(), nt.tensor.nbytes(), tmp, sum);
  });
  return sum.digest();
}

uint64_t write_safetensors_streamed(const std::string& path,
                                    const std::vector<TensorHeader>& tensors,
                                    const std::map<std::string, std::string>& metadata,
                                    const std::function<void(size_t, Tensor&)>& fill) {
  const std::string h = encode_header(path, tensors, metadata);
  const uint64_t hlen = h.size();
  Checksum sum;
  atomic_write(path, [&](int fd, const std::string& tmp) {
    write_hashed(fd, &hlen, 8, tmp, sum);
    write_hashed(fd, h.data(), h.size(), tmp, sum);
    for (size_t i = 0; i < tensors.size(); ++i) {
      Tensor t = Tensor::empty(tensors[i].shape, tensors[i].dtype);
      fill(i, t);
      if (t.nbytes() > 0) write_hashed(fd, t.raw(), t.nbytes(), tmp, sum);
    }
  });
  return sum.digest();
}

uint64_t write_safetensors_pieces(
    const std::string& path, const std::vector<TensorHeader>& tensors,
    const std::map<std::string, std::string>& metadata,
    const std::function<void(size_t, const std::function<void(const void*, size_t)>&)>& emit) {
  const std::string h = encode_header(path, tensors, metadata);
  const uint64_t hlen = h.size();
  Checksum sum;
  atomic_write(path, [&](int fd, const std::string& tmp) {
    write_hashed(fd, &hlen, 8, tmp, sum);
    write_hashed(fd, h.data(), h.size(), tmp, sum);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t want = size_t(shape_numel(tensors[i].shape)) * dtype_size(tensors[i].dtype);
      size_t put = 0;
      emit(i, [&](const void* p, size_t n) {
        write_hashed(fd, p, n, tmp, sum);
        put += n;
      });
      // A short tensor would shift every later one: the header would lie about the file.
      LOOM_CHECK(put == want, tmp, ": tensor '", tensors[i].name, "': ", put, " bytes written, ",
                 want, " expected");
    }
  });
  return sum.digest();
}

uint64_t write_text_atomic(const std::string& path, const std::string& content) {
  atomic_write(path, [&](int fd, const std::string& tmp) {
    write_all(fd, content.data(), content.size(), tmp);
  });
  return checksum_of(content);
}

void write_safetensors_dir(const std::string& dir, const std::vector<NamedTensor>& tensors,
                           size_t max_shard_bytes) {
  const fs::path d(dir);
  std::error_code ec;
  fs::create_directories(d, ec);
  LOOM_CHECK(!ec && fs::is_directory(d), "cannot create directory '", dir, "': ", ec.message());
  // transformers refuses safetensors files whose metadata lacks a known format.
  const std::map<std::string, std::string> meta = {{"format", "pt"}};

  size_t total = 0;
  for (const auto& nt : tensors) total += nt.tensor.nbytes();

  // Hugging Face's split: tensors in order, a new shard when the next tensor would overflow the
  // current one (a tensor larger than the limit gets a shard of its own).
  std::vector<std::vector<const NamedTensor*>> shards;
  if (total <= max_shard_bytes) {
    shards.emplace_back();
    for (const auto& nt : tensors) shards.back().push_back(&nt);
  } else {
    size_t cur = 0;
    for (const auto& nt : tensors) {
      const size_t nb = nt.tensor.nbytes();
      if (shards.empty() || (cur > 0 && cur + nb > max_shard_bytes)) {
        shards.emplace_back();
        cur = 0;
      }
      shards.back().push_back(&nt);
      cur += nb;
    }
  }

  std::set<std::string> written;
  if (shards.size() == 1) {
    std::vector<NamedTensor> all(tensors.begin(), tensors.end());
    write_safetensors((d / "model.safetensors").string(), all, meta);
    written.insert("model.safetensors");
  } else {
    nlohmann::json weight_map = nlohmann::json::object();
    const size_t n = shards.size();
    for (size_t i = 0; i < n; ++i) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
      std::vector<NamedTensor> part;
      for (const NamedTensor* nt : shards[i]) {
        part.push_back(*nt);
        weight_map[nt->name] = name;
      }
      write_safetensors((d / name).string(), part, meta);
      written.insert(name);
    }
    // The index goes last: until it exists a reader sees the previous checkpoint, if any.
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string text = index.dump(2) + "\n";
    atomic_write(
        (d / "model.safetensors.index.json").string(),
        [&](int fd, const std::string& tmp) { write_all(fd, text.data(), text.size(), tmp); });
    written.insert("model.safetensors.index.json");
  }

  // Remove files of an earlier save in the other layout or with another shard count, which a
  // reader would otherwise pick up.
  // The stale index goes first, so that a reader never follows it to a removed shard.
  if (!written.count("model.safetensors.index.json"))
    fs::remove(d / "model.safetensors.index.json", ec);
  for (const auto& de : fs::directory_iterator(d, ec)) {
    const std::string f = de.path().filename().string();
    if (!written.count(f) && (f == "model.safetensors" || is_shard_name(f)))
      fs::remove(de.path(), ec);
  }
}

}  // namespace loom
