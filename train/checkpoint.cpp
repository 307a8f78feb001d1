#include "train/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "distributed/process_group.hpp"
#include "model/llama.hpp"
#include "model/safetensors.hpp"
#include "parallel/fsdp.hpp"
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

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f.good(), "cannot open '", path, "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  LOOM_CHECK(!f.bad(), "cannot read '", path, "'");
  return ss.str();
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

// The full flat f32 buffers of a unit: itself when unsharded, else gathered over `shard`.
Tensor full_flat(ParamUnit& u, const Tensor& shard_buffer, dist::ProcessGroup* shard) {
  if (!u.sharded()) return shard_buffer;
  LOOM_CHECK(shard != nullptr && shard->size() == u.shard_layout().count, "save_checkpoint: unit ",
             u.name(), " is sharded over ", u.shard_layout().count,
             " ranks but no matching shard group was given");
  return parallel::gather_full(*shard, shard_buffer);
}

// The global tensor of a parameter from every tp rank's local part (gathered over `tp`).
Tensor global_tensor(const ParamSpec& spec, const Tensor& local, dist::ProcessGroup* tp) {
  if (spec.split == TpSplit::none || spec.tp_count == 1) return local;
  LOOM_CHECK(tp != nullptr && tp->size() == spec.tp_count, "save_checkpoint: ", spec.name,
             " is split over ", spec.tp_count, " tp ranks but no matching tp group was given");
  const int64_t n = local.numel(), k = spec.tp_count;
  Tensor in = Tensor::empty({n}, DType::f32), all = Tensor::empty({k * n}, DType::f32);
  in.copy_from(local.view({n}));
  tp->all_gather(in, all)->wait();
  if (spec.split == TpSplit::rows) {
    // A padded vocabulary: the padding rows (after the real ones) are not saved.
    Shape padded = spec.shape;
    padded[0] *= k;
    return all.view(padded).narrow(0, 0, spec.global_shape()[0]);
  }
  // Columns: rank r's [R, C/tp] block goes to columns [r C/tp, (r + 1) C/tp) of each row.
  Tensor g = Tensor::empty(spec.global_shape(), DType::f32);
  const int64_t R = spec.shape[0], lc = spec.shape[1];
  const float* a = all.data<float>();
  float* o = g.data<float>();
  for (int64_t r = 0; r < k; ++r)
    for (int64_t i = 0; i < R; ++i) std::copy_n(a + r * n + i * lc, lc, o + i * lc * k + r * lc);
  return g;
}

// Weights and moments of each parameter as full tensors shaped like the parameter, in unit
// order (every rank gathers; the writer writes).
void full_tensors(LlamaModel& model, AdamW& opt, dist::ProcessGroup* shard, dist::ProcessGroup* tp,
                  std::vector<NamedTensor>& weights, std::vector<NamedTensor>& moments) {
  auto units = model.units();
  for (size_t i = 0; i < units.size(); ++i) {
    ParamUnit& u = *units[i];
    const Tensor w = full_flat(u, u.master_shard(), shard);
    const Tensor m = full_flat(u, opt.exp_avg()[i], shard);
    const Tensor v = full_flat(u, opt.exp_avg_sq()[i], shard);
    for (const Param& p : u.params()) {
      const int64_t n = shape_numel(p.spec.shape);
      auto part = [&](const Tensor& flat) {
        return global_tensor(p.spec, flat.narrow(0, p.offset, n).view(p.spec.shape), tp);
      };
      weights.push_back({p.spec.name, part(w)});
      moments.push_back({p.spec.name + ".exp_avg", part(m)});
      moments.push_back({p.spec.name + ".exp_avg_sq", part(v)});
    }
  }
}

// Reads this rank's part of a tensor stored whole: the rows that hold each slice.
void read_shard(const SafetensorsFile& f, const std::string& name, ParamUnit& u, size_t param,
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

namespace {

std::string write_checkpoint(const std::string& root, LlamaModel& model, AdamW& optimizer,
                             const TrainState& state, const std::string& tokenizer_json,
                             const std::vector<NamedTensor>& weights,
                             const std::vector<NamedTensor>& moments) {
  std::error_code ec;
  fs::create_directories(root, ec);
  LOOM_CHECK(!ec, "cannot create checkpoint directory '", root, "': ", ec.message());
  const fs::path final_dir = fs::path(root) / checkpoint_name(state.step);
  const fs::path tmp = fs::path(root) / (checkpoint_name(state.step) + ".tmp");
  fs::remove_all(tmp, ec);  // a save of this step that crashed
  LOOM_CHECK(!ec, "cannot remove stale '", tmp.string(), "': ", ec.message());
  fs::create_directory(tmp, ec);
  LOOM_CHECK(!ec, "cannot create '", tmp.string(), "': ", ec.message());

  write_safetensors_dir(tmp.string(), weights);
  write_file((tmp / "config.json").string(), model.config().to_json() + "\n");
  write_safetensors((tmp / "optimizer.safetensors").string(), moments,
                    {{"format", "loom-adamw"}, {"step", std::to_string(optimizer.steps_taken())}});
  if (!tokenizer_json.empty())
    write_file((tmp / "tokenizer.json").string(), read_file(tokenizer_json));
  nlohmann::ordered_json st;
  st["format"] = "loom-checkpoint";
  st["version"] = kStateVersion;
  st["step"] = state.step;
  st["data_step"] = state.data_step;
  st["lr"] = state.lr;
  st["loss"] = state.loss;
  st["config"] = state.config_toml;
  st["tokens_per_step"] = state.tokens_per_step;
  write_file((tmp / "state.json").string(), st.dump(2) + "\n");

  for (const auto& e : fs::directory_iterator(tmp)) fsync_path(e.path().string(), false);
  fsync_path(tmp.string(), true);
  // rename() cannot replace a non-empty directory: move an existing checkpoint of this step
  // aside first (its name is then no checkpoint name), and delete it once the new one is in place.
  const fs::path old = fs::path(root) / (checkpoint_name(state.step) + ".old");
  const bool replacing = fs::exists(final_dir, ec);
  if (replacing) {
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    LOOM_CHECK(!ec, "cannot move '", final_dir.string(), "' aside: ", ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  LOOM_CHECK(!ec, "cannot rename '", tmp.string(), "' to '", final_dir.string(),
             "': ", ec.message());
  fsync_path(root, true);
  if (replacing) fs::remove_all(old, ec);
  return final_dir.string();
}

}  // namespace

std::string save_checkpoint(const std::string& root, LlamaModel& model, AdamW& optimizer,
                            const TrainState& state, const std::string& tokenizer_json,
                            const CheckpointComm& comm) {
  LOOM_CHECK(!root.empty(), "save_checkpoint: empty checkpoint directory");
  LOOM_CHECK(optimizer.steps_taken() == state.step, "save_checkpoint: the optimizer has taken ",
             optimizer.steps_taken(), " steps but the state says step ", state.step);
  std::vector<NamedTensor> weights, moments;
  full_tensors(model, optimizer, comm.shard, comm.tp, weights, moments);
  const bool writer = !comm.world || comm.world->rank() == 0;
  std::string path = (fs::path(root) / checkpoint_name(state.step)).string(), error;
  if (writer) {
    try {
      path = write_checkpoint(root, model, optimizer, state, tokenizer_json, weights, moments);
    } catch (const Error& e) {
      if (!comm.world || comm.world->size() == 1) throw;
      error = e.what();
    }
  }
  if (comm.world && comm.world->size() > 1) {
    // Every rank learns whether the save succeeded, so none trains on after a failed save.
    Tensor ok = Tensor::empty({1}, DType::i32);
    ok.data<int32_t>()[0] = error.empty() ? 1 : 0;
    comm.world->broadcast(ok, 0)->wait();
    if (!error.empty()) fail(error);
    LOOM_CHECK(ok.data<int32_t>()[0] == 1, "saving checkpoint ", path,
               " failed on world rank 0 (its message names the cause)");
  }
  return path;
}

TrainState read_checkpoint_state(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  LOOM_CHECK(fs::is_directory(d, ec), "checkpoint '", dir, "' is not a directory");

  // state.json first: it is written last, so its absence means an incomplete directory.
  const std::string state_path = (d / "state.json").string();
  TrainState st;
  try {
    const auto j = nlohmann::json::parse(read_file(state_path));
    LOOM_CHECK(j.value("format", "") == "loom-checkpoint", state_path,
               ": not a loom checkpoint state (expected \"format\": \"loom-checkpoint\")");
    LOOM_CHECK(j.at("version").get<int>() == kStateVersion, state_path, ": version ",
               j.at("version").dump(), ", expected ", kStateVersion);
    st.step = j.at("step").get<int64_t>();
    st.data_step = j.at("data_step").get<int64_t>();
    st.lr = j.at("lr").get<double>();
    st.loss = j.at("loss").get<double>();
    st.config_toml = j.at("config").get<std::string>();
    st.tokens_per_step = j.value("tokens_per_step", int64_t(0));
  } catch (const nlohmann::json::exception& e) {
    fail(state_path, ": invalid checkpoint state: ", e.what());
  }
  LOOM_CHECK(st.step >= 0 && st.data_step >= 0, state_path, ": negative step");
  return st;
}

TrainState load_checkpoint(const std::string& dir, LlamaModel& model, AdamW& optimizer) {
  const fs::path d(dir);
  std::error_code ec;
  const TrainState st = read_checkpoint_state(dir);
  const std::string state_path = (d / "state.json").string();

  // Weights: every model tensor, shapes checked by read_f32; and nothing the model lacks (a
  // checkpoint of a deeper model would otherwise load silently).
  const SafetensorsDir weights(dir);
  std::set<std::string> names;
  for (ParamUnit* u : model.units())
    for (const Param& p : u->params()) names.insert(p.spec.name);
  for (const std::string& n : weights.names())
    LOOM_CHECK(names.count(n), dir, ": tensor '", n, "' (in ", weights.file_of(n).path(),
               ") is not a parameter of the model being trained (a model of another shape?)");
  model.load_hf(weights);
  auto units = model.units();

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
  std::set<std::string> mnames;
  for (size_t i = 0; i < units.size(); ++i)
    for (size_t k = 0; k < units[i]->params().size(); ++k) {
      const std::string& n = units[i]->params()[k].spec.name;
      mnames.insert(n + ".exp_avg");
      mnames.insert(n + ".exp_avg_sq");
      read_shard(opt, n + ".exp_avg", *units[i], k, optimizer.exp_avg()[i].data<float>());
      read_shard(opt, n + ".exp_avg_sq", *units[i], k, optimizer.exp_avg_sq()[i].data<float>());
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
