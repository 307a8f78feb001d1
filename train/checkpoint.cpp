#include "train/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <thread>

#include "core/error.hpp"
#include "core/read_file.hpp"
#include "distributed/process_group.hpp"
#include "model/checksum.hpp"
#include "model/config_json.hpp"
#include "model/model.hpp"
#include "model/safetensors.hpp"
#include "model/tensor_slice.hpp"
#include "train/optimizer.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;

constexpr int kStateVersion = 1;

std::string sys_error(const std::string& what, const std::string& path) {
  return str_cat(what, " '", path, "': ", std::strerror(errno));
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

void fsync_path(const std::string& path, bool dir) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | (dir ? O_DIRECTORY : 0)));
  if (f.get() < 0 || ::fsync(f.get()) != 0) fail(sys_error("cannot fsync", path));
}

// The file is fsynced by the final pass over the directory, so a plain write suffices here.
void write_file(const std::string& path, const std::string& content) {
  Fd f(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (f.get() < 0) fail(sys_error("cannot create", path));
  const char* p = content.data();
  size_t n = content.size();
  while (n > 0) {
    const ssize_t w = ::write(f.get(), p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(sys_error("cannot write", path));
    }
    p += w;
    n -= size_t(w);
  }
}

// "step-<digits>" -> the step; -1 for any other name.
int64_t parse_step_name(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step-") != 0 || name.size() > 5 + 18) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

// Whether `units` (ascending; empty: every unit) holds unit i.
bool holds(const std::vector<size_t>& units, size_t i) {
  return units.empty() || std::binary_search(units.begin(), units.end(), i);
}

bool tp_split(const ParamSpec& spec) {
  return spec.split != TpSplit::none && spec.tp_count > 1;
}

// This rank's slices of every parameter: the weights and both moments of each (global names,
// views of the shard buffers: nothing is copied), and their place in the global tensors.
struct RankSlices {
  std::vector<NamedTensor> tensors;
  std::vector<Tensor> host;  // the host copies of a GPU's buffers that `tensors` view
  nlohmann::ordered_json slices = nlohmann::ordered_json::object();
};

// `split`, `unsplit`: whether this rank writes the parameters tensor parallelism splits, and the
// others (content_keys).
// `held`: the units this rank writes (empty: all).
RankSlices rank_slices(Model& model, AdamW& opt, bool split, bool unsplit,
                       const std::vector<size_t>& held) {
  RankSlices out;
  auto units = model.units();
  for (size_t i = 0; i < units.size(); ++i) {
    if (!holds(held, i)) continue;
    ParamUnit& u = *units[i];
    // A GPU's buffers are copied to the host first (the writes read host memory).
    for (const Tensor* t : {&u.master_shard(), &opt.exp_avg()[i], &opt.exp_avg_sq()[i]}) {
      LOOM_CHECK(holds_data(t->device()) && t->dtype() == DType::f32, "save_checkpoint: unit ",
                 u.name(), ": expected f32 shards in memory");
      out.host.push_back(t->on_host());
    }
    const Tensor* buffers[3] = {&out.host[out.host.size() - 3], &out.host[out.host.size() - 2],
                                &out.host.back()};
    for (size_t k = 0; k < u.params().size(); ++k) {
      const Param& p = u.params()[k];
      if (!(tp_split(p.spec) ? split : unsplit)) continue;
      // (local begin, count, offset in the shard buffers) of each run this rank holds.
      std::vector<std::array<int64_t, 3>> runs;
      if (!u.sharded()) runs.push_back({0, shape_numel(p.spec.shape), p.offset});
      for (const ShardSlice& s : u.sharded() ? u.shard_slices() : std::vector<ShardSlice>{})
        if (s.param == k) runs.push_back({s.begin, s.count, s.shard_offset});
      for (const auto& [begin, count, offset] : runs) {
        const TensorSlice sl = param_slice(p.spec, begin, count);
        if (sl.numel() == 0) continue;  // padding rows only
        const char* suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
        for (int b = 0; b < 3; ++b) {
          const std::string name = p.spec.name + suffix[b];
          out.tensors.push_back({name, buffers[b]->narrow(0, offset, sl.numel())});
          nlohmann::ordered_json j = slice_to_json(sl);
          j["shape"] = p.spec.global_shape();
          out.slices[name] = j;
        }
      }
    }
  }
  return out;
}

// What a rank holds is fixed by its place in the layout: the shard of each unit and, for the
// parameters tensor parallelism splits, its tp rank. Ranks that hold the same (DDP and HSDP
// replicas, the ranks of a cp group, the tp ranks for the parameters TP does not split) write it
// once: the first of them. Two keys, [0] for the split parameters and [1] for the others, each a
// hash of what the rank holds of them.
// Under pp only the units of the rank's stages count: the pp ranks hold different ones.
std::array<int32_t, 4> content_keys(Model& model, const std::vector<size_t>& held) {
  std::array<uint64_t, 2> h = {1469598103934665603ull, 1469598103934665603ull};
  auto mix = [](uint64_t& x, const std::string& s) {
    for (unsigned char c : s) x = (x ^ c) * 1099511628211ull;
    x = (x ^ 0xff) * 1099511628211ull;
  };
  const auto units = model.units();
  for (size_t i = 0; i < units.size(); ++i) {
    if (!holds(held, i)) continue;
    ParamUnit* u = units[i];
    const std::string unit =
        str_cat(u->name(), "@", u->shard_layout().rank, "/", u->shard_layout().count);
    mix(h[0], unit);
    mix(h[1], unit);
    for (const Param& p : u->params()) {
      if (tp_split(p.spec))
        mix(h[0], str_cat(p.spec.name, "@", p.spec.tp_rank, "/", p.spec.tp_count));
      else
        mix(h[1], p.spec.name);
    }
  }
  return {int32_t(h[0] & 0x7fffffff), int32_t(h[0] >> 33), int32_t(h[1] & 0x7fffffff),
          int32_t(h[1] >> 33)};
}

// Every rank's error message ("" where it succeeded), gathered to every rank.
std::vector<std::string> gather_errors(dist::ProcessGroup* world, const std::string& error) {
  if (!world || world->size() == 1) return {error};
  const int n = world->size();
  Tensor len = Tensor::empty({1}, DType::i32), lens = Tensor::empty({n}, DType::i32);
  len.data<int32_t>()[0] = int32_t(std::min<size_t>(error.size(), 4000));
  world->all_gather(len, lens)->wait();
  int32_t longest = 0;
  for (int r = 0; r < n; ++r) longest = std::max(longest, lens.data<int32_t>()[r]);
  if (longest == 0) return std::vector<std::string>(size_t(n));
  const int64_t words = (longest + 3) / 4;
  Tensor mine = Tensor::zeros({words}, DType::i32), all = Tensor::empty({n * words}, DType::i32);
  std::memcpy(mine.data<int32_t>(), error.data(), size_t(len.data<int32_t>()[0]));
  world->all_gather(mine, all)->wait();
  std::vector<std::string> out(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    out[size_t(r)].assign(reinterpret_cast<const char*>(all.data<int32_t>() + r * words),
                          size_t(lens.data<int32_t>()[r]));
  return out;
}

// Every rank's 64-bit value (a file's checksum; 0 from a rank that wrote none), gathered to every
// rank as two 32-bit words, since the process groups move i32 and f32.
std::vector<uint64_t> gather_checksums(dist::ProcessGroup* world, uint64_t mine) {
  if (!world || world->size() == 1) return {mine};
  const int n = world->size();
  Tensor word = Tensor::empty({2}, DType::i32), all = Tensor::empty({2 * n}, DType::i32);
  std::memcpy(word.data<int32_t>(), &mine, sizeof mine);
  world->all_gather(word, all)->wait();
  std::vector<uint64_t> out(static_cast<size_t>(n));
  std::memcpy(out.data(), all.data<int32_t>(), out.size() * sizeof(uint64_t));
  return out;
}

// After each phase of a save: every rank learns every failure, so none goes on (or marks the
// checkpoint complete) after a rank failed. `cleanup` runs (on every rank) before the error.
void agree(dist::ProcessGroup* world, const std::string& error, const std::string& what,
           const std::function<void()>& cleanup) {
  const std::vector<std::string> errors = gather_errors(world, error);
  std::string msg;
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty())
      msg += str_cat(msg.empty() ? "" : "\n", errors.size() > 1 ? str_cat("rank ", r, ": ") : "",
                     errors[r]);
  if (msg.empty()) return;
  cleanup();
  fail(what, " failed: ", msg);
}

template <class Fn>
std::string catch_error(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Runs `read(float* memory)` on a unit's shard buffer: its own memory on the CPU, a host copy of
// a GPU's, copied back after.
template <class Fn>
void read_into(Tensor& buffer, Fn&& read) {
  Tensor h = buffer.on_host();
  read(h.data<float>());
  if (buffer.device() != Device::cpu) buffer.copy_from(h);
}

// Reads this rank's part of a parameter (or a moment shaped like it) from a reader of global
// tensors: only the rows that hold each slice.
template <class Reader>
void read_shard(const Reader& f, const std::string& name, ParamUnit& u, size_t param,
                float* shard_buffer) {
  const ParamSpec& spec = u.params()[param].spec;
  if (!u.sharded()) {
    read_param_slice(f, name, spec, 0, shape_numel(spec.shape),
                     shard_buffer + u.params()[param].offset);
    return;
  }
  for (const ShardSlice& s : u.shard_slices())
    if (s.param == param)
      read_param_slice(f, name, spec, s.begin, s.count, shard_buffer + s.shard_offset);
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", (long long)step);
  return buf;
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (root.empty() || !fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t s = parse_step_name(e.path().filename().string());
    // state.json is written last: a directory without it is not a checkpoint (a prune that was
    // interrupted half-way through deleting it, or a copy in progress).
    std::error_code ec2;
    if (s >= 0 && e.is_directory(ec) && fs::is_regular_file(e.path() / "state.json", ec2))
      out.emplace_back(s, e.path().string());
  }
  LOOM_CHECK(!ec, "cannot list checkpoint directory '", root, "': ", ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

std::string latest_checkpoint(const std::string& root) {
  auto all = list_checkpoints(root);
  return all.empty() ? std::string() : all.back().second;
}

// The index from the rank files' own records of their slices (so the index can only describe
// files that were completely written), checked by opening it as the loader will.
uint64_t write_checkpoint_index(const std::string& dir, const std::vector<int>& writers,
                                int64_t step, bool moments,
                                const std::map<std::string, uint64_t>& checksums) {
  const fs::path tmp(dir);
  nlohmann::ordered_json tensors = nlohmann::ordered_json::object(),
                         files = nlohmann::json::array();
  for (int r : writers) {
    const std::string file = checkpoint_rank_file(r);
    const SafetensorsFile f((tmp / file).string());
    const auto it = f.metadata().find("slices");
    LOOM_CHECK(it != f.metadata().end(), f.path(), ": no \"slices\" in the metadata");
    const auto slices = nlohmann::ordered_json::parse(it->second);
    for (const auto& [name, sl] : slices.items()) {
      auto& t = tensors[name];
      if (t.is_null())
        t = {{"dtype", f.entry(name).dtype},
             {"shape", sl.at("shape")},
             {"slices", nlohmann::json::array()}};
      LOOM_CHECK(t["shape"] == sl.at("shape"), f.path(), ": tensor '", name, "' has global shape ",
                 sl.at("shape").dump(), ", another rank's file says ", t["shape"].dump());
      nlohmann::ordered_json piece = {{"file", file}};
      for (const char* k : {"offsets", "lengths", "range"}) piece[k] = sl.at(k);
      t["slices"].push_back(piece);
    }
    files.push_back(file);
    LOOM_CHECK(checksums.count(file), "write_checkpoint_index: no checksum given for '", file,
               "' in ", dir, " (every rank file's is needed)");
  }
  nlohmann::ordered_json sums = nlohmann::ordered_json::object();
  for (const auto& [file, sum] : checksums) {
    std::error_code ec;
    LOOM_CHECK(fs::is_regular_file(tmp / file, ec),
               "write_checkpoint_index: a checksum is given for '", file, "', which ", dir,
               " does not hold");
    sums[file] = checksum_text(sum);
  }
  nlohmann::ordered_json index;
  index["format"] = "loom-sharded";
  index["version"] = 1;
  index["metadata"] = {{"step", std::to_string(step)}, {"optimizer", moments ? "adamw" : "none"}};
  index["files"] = files;
  // A key of its own rather than objects in "files": a reader that predates checksums still
  // reads the index.
  index["checksums"] = sums;
  index["tensors"] = tensors;
  const std::string text = index.dump(1) + "\n";
  write_file((tmp / kShardedIndexName).string(), text);
  // Opening it checks every slice against its file and that the slices add up to each tensor.
  const SafetensorsDir check(tmp.string());
  return checksum_of(text);
}

void write_checkpoint_state(const std::string& dir, const TrainState& state,
                            uint64_t index_checksum) {
  nlohmann::ordered_json st;
  st["format"] = "loom-checkpoint";
  st["version"] = kStateVersion;
  st["step"] = state.step;
  st["data_step"] = state.data_step;
  st["lr"] = state.lr;
  st["loss"] = state.loss;
  st["config"] = state.config_toml;
  st["tokens_per_step"] = state.tokens_per_step;
  st["index_checksum"] = checksum_text(index_checksum);
  // state.json is written after the index, so nothing else can hold its checksum: it holds its
  // own, of its fields as dump(2) writes them (read_state checks it).
  st["checksum"] = checksum_text(checksum_of(st.dump(2)));
  const std::string path = (fs::path(dir) / "state.json").string();
  write_file(path, st.dump(2) + "\n");
  fsync_path(path, false);
  fsync_path(dir, true);
}

std::string checkpoint_rank_file(int rank) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank-%05d.safetensors", rank);
  return buf;
}

namespace {

// World rank 0, once every rank's file is written: the index, the config, the tokenizer and
// state.json (the completion marker) last, then the directory takes its name.
// `checksums`: each writer's rank file's, by world rank.
std::string finish_checkpoint(const fs::path& root, const fs::path& tmp, const std::string& config,
                              const TrainState& state, const std::string& tokenizer_json,
                              const std::vector<int>& writers,
                              const std::vector<uint64_t>& checksums) {
  std::map<std::string, uint64_t> sums;
  for (int r : writers) sums[checkpoint_rank_file(r)] = checksums.at(size_t(r));
  write_file((tmp / "config.json").string(), config);
  sums["config.json"] = checksum_of(config);
  if (!tokenizer_json.empty()) {
    const std::string tokenizer = read_file(tokenizer_json);
    write_file((tmp / "tokenizer.json").string(), tokenizer);
    sums["tokenizer.json"] = checksum_of(tokenizer);
  }
  const uint64_t index = write_checkpoint_index(tmp.string(), writers, state.step, true, sums);
  for (const auto& e : fs::directory_iterator(tmp)) fsync_path(e.path().string(), false);
  write_checkpoint_state(tmp.string(), state, index);

  const fs::path final_dir = root / checkpoint_name(state.step);
  // rename() cannot replace a non-empty directory: move an existing checkpoint of this step
  // aside first (its name is then no checkpoint name), and delete it once the new one is in place.
  std::error_code ec;
  const fs::path old = root / (checkpoint_name(state.step) + ".old");
  const bool replacing = fs::exists(final_dir, ec);
  if (replacing) {
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    LOOM_CHECK(!ec, "cannot move '", final_dir.string(), "' aside: ", ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  LOOM_CHECK(!ec, "cannot rename '", tmp.string(), "' to '", final_dir.string(),
             "': ", ec.message());
  fsync_path(root.string(), true);
  if (replacing) fs::remove_all(old, ec);
  return final_dir.string();
}

}  // namespace

namespace {

// What every rank knows once a save has begun: who writes what, and where.
struct SavePlan {
  dist::ProcessGroup* world = nullptr;  // nullptr: one process
  int rank = 0;
  bool write[2] = {false, false};  // this rank writes the TP-split / the other parameters
  std::vector<size_t> units;       // the units it writes (CheckpointComm::units)
  std::vector<int> writers;        // the ranks that write a file
  fs::path root, tmp, final_dir;
  std::string what;  // "saving checkpoint DIR", for errors
  bool writer() const { return write[0] || write[1]; }
  // Whatever fails, the half-written directory goes: it is never loaded, but it holds disk.
  std::function<void()> cleanup() const {
    return [r = rank, t = tmp] {
      if (r != 0) return;
      std::error_code ec;
      fs::remove_all(t, ec);
    };
  }
};

// The collective start of a save: the writers agreed, world rank 0 has made the .tmp directory.
SavePlan begin_save(const std::string& root, Model& model, AdamW& optimizer,
                    const TrainState& state, const CheckpointComm& comm) {
  LOOM_CHECK(!root.empty(), "save_checkpoint: empty checkpoint directory");
  LOOM_CHECK(optimizer.steps_taken() == state.step, "save_checkpoint: the optimizer has taken ",
             optimizer.steps_taken(), " steps but the state says step ", state.step);
  SavePlan plan;
  plan.world = comm.world && comm.world->size() > 1 ? comm.world : nullptr;
  plan.rank = plan.world ? plan.world->rank() : 0;
  const int size = plan.world ? plan.world->size() : 1;

  // Which ranks write what: the first of each set of ranks holding the same slices.
  plan.units = comm.units;
  LOOM_CHECK(std::is_sorted(plan.units.begin(), plan.units.end()) &&
                 (plan.units.empty() || plan.units.back() < model.units().size()),
             "save_checkpoint: CheckpointComm::units must be ascending unit indices");
  const std::array<int32_t, 4> key = content_keys(model, plan.units);
  Tensor mine = Tensor::empty({4}, DType::i32), keys = Tensor::empty({4 * size}, DType::i32);
  std::copy(key.begin(), key.end(), mine.data<int32_t>());
  if (plan.world)
    plan.world->all_gather(mine, keys)->wait();
  else
    keys.copy_from(mine);
  const int32_t* kk = keys.data<int32_t>();
  for (int r = 0; r < size; ++r) {
    bool first[2] = {true, true};
    for (int c = 0; c < 2; ++c)
      for (int q = 0; q < r && first[c]; ++q)
        first[c] = !(kk[4 * q + 2 * c] == kk[4 * r + 2 * c] &&
                     kk[4 * q + 2 * c + 1] == kk[4 * r + 2 * c + 1]);
    if (first[0] || first[1]) plan.writers.push_back(r);
    if (r == plan.rank) plan.write[0] = first[0], plan.write[1] = first[1];
  }

  plan.root = root;
  plan.tmp = plan.root / (checkpoint_name(state.step) + ".tmp");
  plan.final_dir = plan.root / checkpoint_name(state.step);
  plan.what = str_cat("saving checkpoint ", plan.final_dir.string());
  agree(plan.world, catch_error([&] {
          if (plan.rank != 0) return;
          std::error_code ec;
          fs::create_directories(root, ec);
          LOOM_CHECK(!ec, "cannot create checkpoint directory '", root, "': ", ec.message());
          fs::remove_all(plan.tmp, ec);  // a save of this step that crashed
          LOOM_CHECK(!ec, "cannot remove stale '", plan.tmp.string(), "': ", ec.message());
          fs::create_directory(plan.tmp, ec);
          LOOM_CHECK(!ec, "cannot create '", plan.tmp.string(), "': ", ec.message());
        }),
        plan.what, plan.cleanup());
  return plan;
}

uint64_t write_rank_file(const SavePlan& plan, const RankSlices& mine, int64_t step) {
  return write_safetensors(
      (plan.tmp / checkpoint_rank_file(plan.rank)).string(), mine.tensors,
      {{"format", "loom-shard"}, {"step", std::to_string(step)}, {"slices", mine.slices.dump()}});
}

}  // namespace

std::string save_checkpoint(const std::string& root, Model& model, AdamW& optimizer,
                            const TrainState& state, const std::string& tokenizer_json,
                            const CheckpointComm& comm) {
  const SavePlan plan = begin_save(root, model, optimizer, state, comm);
  uint64_t checksum = 0;
  agree(plan.world, catch_error([&] {
          if (plan.writer())
            checksum = write_rank_file(
                plan, rank_slices(model, optimizer, plan.write[0], plan.write[1], plan.units),
                state.step);
        }),
        plan.what, plan.cleanup());
  // World rank 0 writes every file's checksum into the index.
  const std::vector<uint64_t> checksums = gather_checksums(plan.world, checksum);
  std::string path = plan.final_dir.string();
  const std::string config = model.config_json() + "\n";
  agree(plan.world, catch_error([&] {
          if (plan.rank == 0)
            path = finish_checkpoint(plan.root, plan.tmp, config, state, tokenizer_json,
                                     plan.writers, checksums);
        }),
        plan.what, plan.cleanup());
  return path;
}

AsyncSaveTesting& async_save_testing() {
  static AsyncSaveTesting t;
  return t;
}

// The background half of an async save. The writer thread of each writing rank writes its
// file from the live shards, piece by piece, until before_modify() has copied what it has not
// written yet into staging: from then on it writes from there. On world rank 0 it then waits for
// every writer's file (or its error) and completes the checkpoint, so that it becomes a
// checkpoint without waiting for the next save.
// The ranks share checkpoint.dir, and no collective runs off the main thread: a rank says that
// its file is complete (its directory entry fsynced) or failed with rank-R.done / rank-R.error;
// rank-R.done holds the file's checksum, for the index.
struct PendingSave::Impl {
  SavePlan plan;
  std::string path;
  std::string write_error;            // this rank's file
  std::string finish_error;           // world rank 0: completing the checkpoint
  uint64_t checksum = 0;              // this rank's file's, once `written`
  std::vector<uint64_t> checksums;    // every rank's, by world rank, once `peers_ok`
  std::atomic<bool> written{false};   // this rank's file is written (or failed)
  std::atomic<bool> peers_ok{false};  // every rank said so through wait()'s collective
  std::atomic<bool> cancel{false};
  std::thread thread;

  // The deferred copy, under `mu`.
  RankSlices slices;  // views of the live shards
  Tensor staging;     // the caller's buffer (undefined or too small: before_modify allocates)
  std::mutex mu;
  std::condition_variable cv;
  size_t done_tensor = 0;      // the tensors before it are written,
  int64_t done_elem = 0;       // and this many elements of it
  bool copied = false;         // before_modify ran: the rest comes from `staged`
  bool reading_live = false;   // a piece is being written from the shards, outside the lock
  std::vector<Tensor> staged;  // per tensor: its elements from staged_from[i] on
  std::vector<int64_t> staged_from;

  uint64_t write_file(int64_t step);
};

uint64_t PendingSave::Impl::write_file(int64_t step) {
  std::vector<TensorHeader> headers;
  for (const NamedTensor& t : slices.tensors)
    headers.push_back({t.name, t.tensor.dtype(), t.tensor.shape()});
  const AsyncSaveTesting& hooks = async_save_testing();
  // Pieces bound how long before_modify waits for the one being written from the shards.
  const int64_t piece = std::max<int64_t>(
      1, int64_t(hooks.piece_bytes ? hooks.piece_bytes : size_t(4) << 20) / int64_t(sizeof(float)));
  int64_t pieces = 0;
  return write_safetensors_pieces(
      (plan.tmp / checkpoint_rank_file(plan.rank)).string(), headers,
      {{"format", "loom-shard"}, {"step", std::to_string(step)}, {"slices", slices.slices.dump()}},
      [&](size_t i, const std::function<void(const void*, size_t)>& put) {
        const Tensor& live = slices.tensors[i].tensor;
        const int64_t n = live.numel();
        for (int64_t at = 0; at < n; at += piece) {
          const int64_t len = std::min(piece, n - at);
          if (hooks.before_piece) hooks.before_piece(pieces);
          ++pieces;
          const float* src = nullptr;
          {
            std::lock_guard lock(mu);
            if (copied && i < staged.size() && staged[i].defined()) {
              LOOM_CHECK(at >= staged_from[i], "async save: tensor '", slices.tensors[i].name,
                         "' element ", at, " was written neither before nor after the copy");
              src = staged[i].data<float>() + (at - staged_from[i]);
            } else {
              src = live.data<float>() + at;
              reading_live = true;
            }
          }
          // Also when put() throws: before_modify must not wait for a piece that is no more.
          struct Done {
            Impl* p;
            size_t i;
            int64_t end, n;
            bool ok = false;
            ~Done() {
              {
                std::lock_guard lock(p->mu);
                p->reading_live = false;
                if (ok) {
                  p->done_tensor = end == n ? i + 1 : i;
                  p->done_elem = end == n ? 0 : end;
                }
              }
              p->cv.notify_all();
            }
          } done{this, i, at + len, n};
          put(src, size_t(len) * sizeof(float));
          done.ok = true;
        }
      });
}

PendingSave::PendingSave(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PendingSave::~PendingSave() {
  if (impl_ && impl_->thread.joinable()) {
    impl_->cancel = true;
    impl_->thread.join();
  }
}

const std::string& PendingSave::path() const {
  return impl_->path;
}

size_t PendingSave::before_modify() {
  Impl& p = *impl_;
  std::unique_lock lock(p.mu);
  if (p.copied || p.written || !p.plan.writer()) return 0;
  const std::vector<NamedTensor>& tensors = p.slices.tensors;
  int64_t total = 0;
  for (size_t i = p.done_tensor; i < tensors.size(); ++i)
    total += tensors[i].tensor.numel() - (i == p.done_tensor ? p.done_elem : 0);
  size_t bytes = 0;
  if (!async_save_testing().skip_copy && total > 0) {
    const bool given = p.staging.defined() && p.staging.dtype() == DType::f32 &&
                       p.staging.is_contiguous() && p.staging.numel() >= total;
    const Tensor buffer = given ? p.staging.view({p.staging.numel()}).narrow(0, 0, total)
                                : Tensor::empty({total}, DType::f32);
    p.staged.assign(tensors.size(), Tensor());
    p.staged_from.assign(tensors.size(), 0);
    int64_t at = 0;
    for (size_t i = p.done_tensor; i < tensors.size(); ++i) {
      const int64_t from = i == p.done_tensor ? p.done_elem : 0;
      const int64_t len = tensors[i].tensor.numel() - from;
      p.staged[i] = buffer.narrow(0, at, len);
      p.staged[i].copy_from(tensors[i].tensor.narrow(0, from, len));
      p.staged_from[i] = from;
      at += len;
    }
    bytes = size_t(total) * sizeof(float);
  }
  // Set last, so that the thread never reads a copy not yet made; the piece it may be writing
  // from the shards now was copied too, but the shards must not change until it is written.
  p.copied = true;
  p.cv.wait(lock, [&] { return !p.reading_live; });
  return bytes;
}

std::string PendingSave::wait() {
  LOOM_CHECK(impl_ && impl_->thread.joinable(), "PendingSave::wait: called twice");
  Impl& p = *impl_;
  // Every rank's own file first, agreed collectively: then world rank 0 knows every file is
  // there even if a rank's marker never appeared, and a failure stops its waiting.
  p.written.wait(false);
  try {
    agree(p.plan.world, p.write_error, p.plan.what, [] {});
  } catch (...) {
    p.cancel = true;
    p.thread.join();
    p.plan.cleanup()();
    throw;
  }
  // After the agreement every file is written: rank 0's thread takes the checksums from here
  // rather than from markers it may not have seen.
  p.checksums = gather_checksums(p.plan.world, p.checksum);
  p.peers_ok = true;
  p.thread.join();
  agree(p.plan.world, p.finish_error, p.plan.what, p.plan.cleanup());
  return p.path;
}

std::unique_ptr<PendingSave> save_checkpoint_async(const std::string& root, Model& model,
                                                   AdamW& optimizer, const TrainState& state,
                                                   const std::string& tokenizer_json,
                                                   const CheckpointComm& comm,
                                                   std::function<void()> after_complete,
                                                   const Tensor& staging) {
  auto impl = std::make_unique<PendingSave::Impl>();
  impl->plan = begin_save(root, model, optimizer, state, comm);
  impl->path = impl->plan.final_dir.string();
  // Nothing is copied here: the thread writes from views of the shards until before_modify.
  if (impl->plan.writer())
    impl->slices =
        rank_slices(model, optimizer, impl->plan.write[0], impl->plan.write[1], impl->plan.units);
  impl->staging = staging;
  const std::string config = model.config_json() + "\n";
  PendingSave::Impl* p = impl.get();
  impl->thread = std::thread([p, config, state, tokenizer_json, after = std::move(after_complete)] {
    const SavePlan& plan = p->plan;
    p->write_error = catch_error([&] {
      if (!plan.writer()) return;
      p->checksum = p->write_file(state.step);
      // Renamed into place, so that rank 0 never reads a marker without its checksum.
      const fs::path done = plan.tmp / str_cat("rank-", plan.rank, ".done");
      write_file(done.string() + ".tmp", checksum_text(p->checksum));
      fs::rename(done.string() + ".tmp", done);
    });
    if (!p->write_error.empty())
      std::ofstream((plan.tmp / str_cat("rank-", plan.rank, ".error")).string()) << p->write_error;
    {
      // Under the lock: before_modify, which reads `written` under it, then copies nothing.
      std::lock_guard lock(p->mu);
      p->written = true;
    }
    p->written.notify_all();
    if (plan.rank != 0 || !p->write_error.empty()) return;
    p->finish_error = catch_error([&] {
      std::vector<uint64_t> checksums(size_t(plan.world ? plan.world->size() : 1), 0);
      for (int r : plan.writers) {
        const fs::path done = plan.tmp / str_cat("rank-", r, ".done");
        const fs::path e = plan.tmp / str_cat("rank-", r, ".error");
        std::error_code ec;
        while (!p->peers_ok && !fs::exists(done, ec) && !fs::exists(e, ec)) {
          if (p->cancel) fail("cancelled while waiting for rank ", r, "'s file");
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        LOOM_CHECK(!fs::exists(e, ec), "rank ", r,
                   " failed to write its file (its message names the cause)");
        if (p->peers_ok) {
          checksums[size_t(r)] = p->checksums.at(size_t(r));
        } else {
          const std::string text = read_file(done.string());
          const std::optional<uint64_t> sum = parse_checksum(text);
          LOOM_CHECK(sum.has_value(), done.string(), ": expected rank ", r,
                     "'s file's checksum (xxh3-64:<16 hex digits>), found '", text, "'");
          checksums[size_t(r)] = *sum;
        }
      }
      for (int r : plan.writers) {
        std::error_code ec;
        fs::remove(plan.tmp / str_cat("rank-", r, ".done"), ec);
      }
      finish_checkpoint(plan.root, plan.tmp, config, state, tokenizer_json, plan.writers,
                        checksums);
      if (after) after();
    });
  });
  return std::make_unique<PendingSave>(std::move(impl));
}

namespace {

// What state.json records of checksums, as written ("" where absent: saved before checksums).
struct StateChecksums {
  std::string own;    // of its fields (write_checkpoint_state)
  std::string index;  // of loom.index.json
};

// read_checkpoint_state, and what state.json records of checksums into `sums` (when given).
// `verify`: its own checksum is checked, after the fields (so that a field of the wrong type is
// named as such).
TrainState read_state(const std::string& dir, bool verify, StateChecksums* sums) {
  const fs::path d(dir);
  std::error_code ec;
  LOOM_CHECK(fs::is_directory(d, ec), "checkpoint '", dir, "' is not a directory");

  // state.json first: it is written last, so its absence means an incomplete directory.
  const std::string state_path = (d / "state.json").string();
  TrainState st;
  try {
    const std::string text = read_file(state_path);
    const auto j = nlohmann::json::parse(text);
    LOOM_CHECK(j.value("format", "") == "loom-checkpoint", state_path,
               ": not a loom checkpoint state (expected \"format\": \"loom-checkpoint\")");
    // Typed reads that check the JSON type and range first: nlohmann's get<int64_t>() of a
    // float (or of an integer too large for it) is an undefined conversion, not an error.
    using config_json::get_int;
    using config_json::get_number;
    LOOM_CHECK(get_int(j, "version", state_path, "version") == kStateVersion, state_path,
               ": version ", j.at("version").dump(), ", expected ", kStateVersion);
    st.step = get_int(j, "step", state_path, "step");
    st.data_step = get_int(j, "data_step", state_path, "data_step");
    st.lr = get_number(j, "lr", state_path, "lr");
    st.loss = get_number(j, "loss", state_path, "loss");
    st.config_toml = j.at("config").get<std::string>();
    st.tokens_per_step = j.contains("tokens_per_step")
                             ? get_int(j, "tokens_per_step", state_path, "tokens_per_step")
                             : 0;
    for (const char* key : {"checksum", "index_checksum"})
      LOOM_CHECK(!j.contains(key) || j[key].is_string(), state_path, ": \"", key,
                 "\" must be a string (xxh3-64:<16 hex digits>), found ", j[key].dump());
    const std::string own = j.value("checksum", ""), index = j.value("index_checksum", "");
    if (sums) *sums = {own, index};
    if (verify && !own.empty()) {
      // The fields in their order, less the checksum, as write_checkpoint_state dumped them:
      // dump() writes every number in its shortest round-trip form, so a parsed and re-dumped
      // state is the bytes that were hashed.
      auto fields = nlohmann::ordered_json::parse(text);
      fields.erase("checksum");
      const std::string found = checksum_text(checksum_of(fields.dump(2)));
      LOOM_CHECK(found == own, state_path, ": checksum mismatch: expected ", own,
                 " (recorded in it), found ", found,
                 " (of its fields: the file changed after it was saved)");
    }
  } catch (const nlohmann::json::exception& e) {
    fail(state_path, ": invalid checkpoint state: ", e.what());
  }
  LOOM_CHECK(st.step >= 0 && st.data_step >= 0, state_path, ": negative step");
  return st;
}

// The complete checkpoint before `dir` in its checkpoint.dir ("" if none): where a resume can
// go back to when `dir` is corrupt.
std::string previous_checkpoint(const std::string& dir) {
  const fs::path d = fs::path(dir).lexically_normal();
  const fs::path name = d.has_filename() ? d.filename() : d.parent_path().filename();
  const int64_t step = parse_step_name(name.string());
  if (step < 0) return "";
  std::string prev;
  for (const auto& [s, path] :
       list_checkpoints((d.has_filename() ? d : d.parent_path()).parent_path().string()))
    if (s < step) prev = path;
  return prev;
}

// check_checkpoint's findings after a colon: on the same line when there is one (so that the
// line a log shows for an error names the file), else one indented line each.
std::string findings(const std::string& found, const char* indent) {
  if (found.find('\n') == std::string::npos) return ": " + found;
  std::string out = ":";
  for (size_t at = 0; at <= found.size();) {
    const size_t end = std::min(found.find('\n', at), found.size());
    out += str_cat("\n", indent, found.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

// The error for a corrupt checkpoint: what check_checkpoint found, and where to go instead.
std::string corrupt_message(const std::string& dir, const std::string& found) {
  const std::string prev = previous_checkpoint(dir);
  const bool one = found.find('\n') == std::string::npos;
  return str_cat("checkpoint ", dir, " is corrupt", findings(found, "  "), one ? "; " : "\n",
                 prev.empty()
                     ? std::string("there is no earlier complete checkpoint beside it")
                     : str_cat("the previous complete checkpoint is ", prev,
                               ": resume from it with --checkpoint.fallback=true (which verifies "
                               "it first), or move ",
                               dir, " out of the checkpoint.dir"));
}

std::string no_checksums_note(const std::string& dir) {
  return str_cat("note: checkpoint ", dir,
                 " records no checksums (saved before loom wrote them): its files are read "
                 "unverified");
}

}  // namespace

TrainState read_checkpoint_state(const std::string& dir, bool verify) {
  return read_state(dir, verify, nullptr);
}

CheckpointCheck check_checkpoint(const std::string& dir, dist::ProcessGroup* world) {
  if (world && world->size() == 1) world = nullptr;
  const int rank = world ? world->rank() : 0, size = world ? world->size() : 1;
  const fs::path d(dir);
  CheckpointCheck out;
  // Every error in rank order, each once (the ranks that check the same thing find the same).
  auto agreed = [&](const std::string& mine) {
    std::vector<std::string> lines;
    for (const std::string& e : gather_errors(world, mine))
      for (size_t at = 0; at < e.size();) {
        const size_t end = std::min(e.find('\n', at), e.size());
        const std::string line = e.substr(at, end - at);
        if (!line.empty() && std::find(lines.begin(), lines.end(), line) == lines.end())
          lines.push_back(line);
        at = end + 1;
      }
    std::string all;
    for (const std::string& l : lines) all += (all.empty() ? "" : "\n") + l;
    return all;
  };

  // The structure, on every rank (small files only): state.json and its own checksum, the
  // index and every file it lists with their headers (the loader's own checks, so that a torn
  // index or a missing file reads as it always has), the index against state.json's checksum.
  std::vector<std::pair<std::string, uint64_t>> files;  // to hash: name, recorded checksum
  StateChecksums recorded;  // set before state.json's own checksum is checked
  out.error = agreed(catch_error([&] {
    read_state(dir, true, &recorded);
    const SafetensorsDir structure(dir);
    const std::string index_path = (d / kShardedIndexName).string();
    std::string index_text;
    nlohmann::json index;
    if (structure.sharded()) {
      index_text = read_file(index_path);
      index = nlohmann::json::parse(index_text);  // SafetensorsDir parsed it already
    }
    const bool index_sums = structure.sharded() && index.contains("checksums");
    // A flipped byte can hide one of the three records, never all of them.
    out.checksums = !recorded.own.empty() || !recorded.index.empty() || index_sums;
    if (!out.checksums) return;
    LOOM_CHECK(!recorded.own.empty() && !recorded.index.empty(), (d / "state.json").string(),
               ": records ", recorded.own.empty() ? "no checksum of its own (\"checksum\")" : "",
               recorded.own.empty() && recorded.index.empty() ? " and " : "",
               recorded.index.empty() ? "no checksum of the index (\"index_checksum\")" : "",
               ", but the checkpoint records others: expected both");
    LOOM_CHECK(structure.sharded(), dir, ": state.json records the checksum of ", kShardedIndexName,
               ", which is missing");
    const std::string found = checksum_text(checksum_of(index_text));
    LOOM_CHECK(found == recorded.index, index_path, ": checksum mismatch: expected ",
               recorded.index, " (recorded in state.json), found ", found);
    LOOM_CHECK(index_sums && index["checksums"].is_object(), index_path,
               ": records no file checksums (expected a \"checksums\" object of file -> "
               "xxh3-64:<16 hex digits>, since state.json records checksums)");
    const nlohmann::json& sums = index["checksums"];
    for (const auto& f : index.at("files"))
      LOOM_CHECK(sums.contains(f.get<std::string>()), index_path, ": records no checksum of '",
                 f.get<std::string>(), "'");
    for (const auto& [file, v] : sums.items()) {
      LOOM_CHECK(!file.empty() && fs::path(file).filename() == file && file != "." &&
                     file != ".." && file != kShardedIndexName && file != "state.json",
                 index_path, ": a checksum of '", file,
                 "'; expected plain names of the checkpoint's other files");
      const std::optional<uint64_t> sum =
          v.is_string() ? parse_checksum(v.get<std::string>()) : std::nullopt;
      LOOM_CHECK(sum.has_value(), index_path, ": checksum of '", file, "' is ", v.dump(),
                 "; expected \"xxh3-64:<16 hex digits>\"");
      files.emplace_back(file, *sum);
    }
  }));
  out.checksums = out.checksums || !recorded.own.empty() || !recorded.index.empty();
  if (!out.error.empty() || files.empty()) return out;

  // The files' bytes, each read by one rank: the largest first, each to the rank with the fewest
  // bytes so far, so that a resume reads the checkpoint once over all ranks.
  std::vector<uintmax_t> bytes(files.size(), 0);
  for (size_t i = 0; i < files.size(); ++i) {
    std::error_code ec;
    const uintmax_t n = fs::file_size(d / files[i].first, ec);
    bytes[i] = ec ? 0 : n;
  }
  std::vector<size_t> order(files.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  std::vector<uintmax_t> load(size_t(size), 0);
  std::string mine;
  for (size_t i : order) {
    const size_t owner = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    load[owner] += bytes[i];
    if (int(owner) != rank) continue;
    const std::string path = (d / files[i].first).string();
    const std::string error = catch_error([&] {
      const std::string found = checksum_text(checksum_file(path));
      const std::string expected = checksum_text(files[i].second);
      LOOM_CHECK(found == expected, path, ": checksum mismatch: expected ", expected,
                 " (recorded in ", kShardedIndexName, "), found ", found);
    });
    if (!error.empty()) mine += (mine.empty() ? "" : "\n") + error;
  }
  out.error = agreed(mine);
  return out;
}

std::string verify_checkpoint(const std::string& dir, dist::ProcessGroup* world) {
  std::error_code ec;
  const fs::path d(dir);
  // A Hugging Face directory records no checksums and is no loom checkpoint.
  if (!fs::exists(d / "state.json", ec) && !fs::exists(d / kShardedIndexName, ec)) return "";
  const CheckpointCheck c = check_checkpoint(dir, world);
  if (!c.error.empty()) fail(corrupt_message(dir, c.error));
  return c.checksums ? "" : no_checksums_note(dir);
}

ResumeChoice choose_resume_checkpoint(const std::string& root, bool verify, bool fallback,
                                      dist::ProcessGroup* world) {
  const auto all = list_checkpoints(root);
  ResumeChoice out;
  if (all.empty()) return out;
  if (!verify) {
    out.dir = all.back().second;
    return out;
  }
  std::string skipped;
  for (size_t i = all.size(); i-- > 0;) {
    const std::string& dir = all[i].second;
    const CheckpointCheck c = check_checkpoint(dir, world);
    if (c.error.empty()) {
      out.dir = dir;
      if (!c.checksums) out.notes.push_back(no_checksums_note(dir));
      return out;
    }
    if (!fallback) fail(corrupt_message(dir, c.error));
    out.notes.push_back(str_cat("note: skipping checkpoint ", dir,
                                " (checkpoint.fallback = true): it is corrupt",
                                findings(c.error, "    ")));
    skipped += str_cat("\n  ", dir, findings(c.error, "    "));
  }
  fail("checkpoint.fallback = true, but every checkpoint in '", root, "' is corrupt:", skipped);
}

TrainState load_checkpoint(const std::string& dir, Model& model, AdamW& optimizer,
                           const std::vector<size_t>& held, bool verify) {
  const fs::path d(dir);
  std::error_code ec;
  if (verify) verify_checkpoint(dir);
  const TrainState st = read_checkpoint_state(dir, verify);
  const std::string state_path = (d / "state.json").string();

  // Every tensor must be a parameter or a moment of one: a checkpoint of a deeper model would
  // otherwise load silently.
  const SafetensorsDir ckpt(dir);
  auto units = model.units();
  std::set<std::string> names, mnames;
  for (ParamUnit* u : units)
    for (const Param& p : u->params()) {
      names.insert(p.spec.name);
      mnames.insert(p.spec.name + ".exp_avg");
      mnames.insert(p.spec.name + ".exp_avg_sq");
    }
  for (const std::string& n : model.held_elsewhere()) {
    names.insert(n);
    mnames.insert(n + ".exp_avg");
    mnames.insert(n + ".exp_avg_sq");
  }
  for (const std::string& n : ckpt.names())
    LOOM_CHECK(names.count(n) || (ckpt.sharded() && mnames.count(n)), dir, ": tensor '", n, "' (",
               ckpt.where(n),
               ") is not a parameter of the model being trained (a model of another shape?)");
  LOOM_CHECK(
      std::is_sorted(held.begin(), held.end()) && (held.empty() || held.back() < units.size()),
      "load_checkpoint: the units to read must be ascending unit indices");
  if (held.empty()) {
    model.load_hf(ckpt);
  } else {
    // Under pp: the rank's own units only (Model::load_hf per unit); the others are zeroed,
    // so that what the rank never uses is at least not left uninitialized (units it does not
    // use hold no memory: nothing to zero).
    for (size_t i = 0; i < units.size(); ++i) {
      ParamUnit& u = *units[i];
      if (!model.uses(i)) continue;
      if (!holds(held, i)) {
        for (Tensor* t : {&u.master_shard(), &optimizer.exp_avg()[i], &optimizer.exp_avg_sq()[i]})
          t->zero_();
      } else {
        read_into(u.master_shard(), [&](float* b) {
          for (size_t k = 0; k < u.params().size(); ++k)
            read_shard(ckpt, u.params()[k].spec.name, u, k, b);
        });
      }
      if (!u.sharded()) u.refresh_bf16();
    }
  }

  if (ckpt.sharded()) {
    const auto it = ckpt.metadata().find("step");
    LOOM_CHECK(it != ckpt.metadata().end() && it->second == std::to_string(st.step), dir, "/",
               kShardedIndexName, ": step ",
               it == ckpt.metadata().end() ? std::string("missing") : it->second, " but ",
               state_path, " says step ", st.step, " (a torn or mismatched checkpoint)");
    if (ckpt.metadata().count("optimizer") && ckpt.metadata().at("optimizer") == "none") {
      // Converted from Hugging Face: AdamW starts afresh.
      LOOM_CHECK(st.step == 0, dir, ": has no optimizer moments but is at step ", st.step);
      for (auto* moments : {&optimizer.exp_avg(), &optimizer.exp_avg_sq()})
        for (size_t i = 0; i < moments->size(); ++i)
          if (model.uses(i)) (*moments)[i].zero_();
    } else {
      for (size_t i = 0; i < units.size(); ++i) {
        if (!holds(held, i)) continue;
        for (const char* moment : {".exp_avg", ".exp_avg_sq"}) {
          Tensor& buffer = std::string_view(moment) == ".exp_avg_sq" ? optimizer.exp_avg_sq()[i]
                                                                     : optimizer.exp_avg()[i];
          read_into(buffer, [&](float* b) {
            for (size_t k = 0; k < units[i]->params().size(); ++k)
              read_shard(ckpt, units[i]->params()[k].spec.name + moment, *units[i], k, b);
          });
        }
      }
    }
    optimizer.set_steps_taken(st.step);
    return st;
  }

  // A checkpoint of the earlier format: model.safetensors beside optimizer.safetensors.
  const std::string opt_path = (d / "optimizer.safetensors").string();
  LOOM_CHECK(fs::is_regular_file(opt_path, ec), "checkpoint '", dir,
             "' has no optimizer.safetensors");
  const SafetensorsFile opt(opt_path);
  const auto it = opt.metadata().find("step");
  LOOM_CHECK(it != opt.metadata().end(), opt_path, ": no \"step\" in the metadata");
  int64_t opt_step = -1;
  try {
    opt_step = std::stoll(it->second);
  } catch (const std::exception&) {
    fail(opt_path, ": metadata step '", it->second, "' is not an integer");
  }
  LOOM_CHECK(opt_step == st.step, opt_path, ": optimizer step ", opt_step, " but ", state_path,
             " says step ", st.step);
  for (size_t i = 0; i < units.size(); ++i) {
    if (!model.uses(i)) continue;
    for (const char* moment : {".exp_avg", ".exp_avg_sq"}) {
      Tensor& buffer = std::string_view(moment) == ".exp_avg_sq" ? optimizer.exp_avg_sq()[i]
                                                                 : optimizer.exp_avg()[i];
      read_into(buffer, [&](float* b) {
        for (size_t k = 0; k < units[i]->params().size(); ++k)
          read_shard(opt, units[i]->params()[k].spec.name + moment, *units[i], k, b);
      });
    }
  }
  for (const auto& e : opt.entries())
    LOOM_CHECK(mnames.count(e.name), opt_path, ": tensor '", e.name,
               "' is not a moment of the model being trained (a model of another shape?)");
  optimizer.set_steps_taken(opt_step);
  return st;
}

void prune_checkpoints(const std::string& root, int64_t keep) {
  if (keep <= 0) return;
  auto all = list_checkpoints(root);
  for (size_t i = 0; i + size_t(keep) < all.size(); ++i) {
    // Renamed first (atomic), so that a prune cut short leaves a name that is no checkpoint
    // name, which clean_checkpoint_dir removes, rather than a half-deleted step-N.
    std::error_code ec;
    const std::string doomed = all[i].second + ".deleting";
    fs::rename(all[i].second, doomed, ec);
    LOOM_CHECK(!ec, "cannot delete old checkpoint '", all[i].second, "': ", ec.message());
    fs::remove_all(doomed, ec);
    LOOM_CHECK(!ec, "cannot delete old checkpoint '", doomed, "': ", ec.message());
  }
}

std::vector<std::string> clean_checkpoint_dir(const std::string& root) {
  std::vector<std::string> done;
  std::error_code ec;
  if (root.empty() || !fs::is_directory(root, ec)) return done;
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(root, ec)) entries.push_back(e.path());
  LOOM_CHECK(!ec, "cannot list checkpoint directory '", root, "': ", ec.message());
  std::sort(entries.begin(), entries.end());
  auto complete = [](const fs::path& d) {
    std::error_code e2;
    return fs::is_regular_file(d / "state.json", e2);
  };
  auto remove = [&](const fs::path& p, const char* why) {
    std::error_code e2;
    fs::remove_all(p, e2);
    LOOM_CHECK(!e2, "cannot remove '", p.string(), "' (", why, "): ", e2.message());
    done.push_back(str_cat("removed ", p.string(), " (", why, ")"));
  };
  for (const fs::path& p : entries) {
    const std::string name = p.filename().string();
    const size_t dot = name.rfind('.');
    const std::string base = dot == std::string::npos ? name : name.substr(0, dot);
    const std::string suffix = dot == std::string::npos ? "" : name.substr(dot);
    std::error_code e2;
    if (parse_step_name(base) < 0 || !fs::is_directory(p, e2)) continue;
    if (suffix == ".tmp") {
      remove(p, "a save that was interrupted");
    } else if (suffix == ".deleting") {
      remove(p, "a prune that was interrupted");
    } else if (suffix == ".old") {
      // A save that replaced this step moved the old one aside; if it died before the new one
      // took its name, the old one is the checkpoint: put it back.
      const fs::path target = p.parent_path() / base;
      if (!fs::exists(target, e2) && complete(p)) {
        fs::rename(p, target, e2);
        LOOM_CHECK(!e2, "cannot restore '", p.string(), "': ", e2.message());
        done.push_back(str_cat("restored ", target.string(), " from ", name,
                               " (a save that replaced it was interrupted)"));
      } else {
        remove(p, "the previous copy of a replaced checkpoint");
      }
    } else if (suffix.empty() && !complete(p)) {
      remove(p, "no state.json: an interrupted prune or copy");
    }
  }
  return done;
}

}  // namespace loom
