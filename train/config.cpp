#include "train/config.hpp"

#include <stdlib.h>

#include <toml++/toml.h>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <variant>

#include "core/error.hpp"
#include "core/read_file.hpp"
#include "ops/devices.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "parallel/pipeline/stage_split.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;

using Ptr = std::variant<int64_t*, double*, bool*, std::string*>;

// One configuration key: where its value lives in the struct and, for an enumerated string, the
// values it may take.
struct Key {
  const char* section;
  const char* name;
  Ptr ptr;
  std::vector<const char*> choices = {};
  bool accepts_int = false;  // a string key that may also be written as a TOML integer
};

// The table of every key, in the order to_toml writes them. It points into `c`.
std::vector<Key> keys_of(JobConfig& c) {
  return {
      {"job", "name", &c.job.name},
      {"job", "dump_dir", &c.job.dump_dir},
      {"job", "rank_logs", &c.job.rank_logs},
      {"job", "collective_timeout_s", &c.job.collective_timeout_s},
      {"model", "config", &c.model.config},
      {"model", "init_from", &c.model.init_from},
      {"model", "seed", &c.model.seed},
      {"moe", "capacity_factor", &c.moe.capacity_factor},
      {"moe", "bias_update_rate", &c.moe.bias_update_rate},
      {"moe", "load_warning", &c.moe.load_warning},
      {"data", "path", &c.data.path},
      {"data", "tokenizer", &c.data.tokenizer},
      {"data", "shuffle", &c.data.shuffle},
      {"training", "device", &c.training.device, {"cpu", "cuda", "auto"}},
      {"training", "allow_tf32", &c.training.allow_tf32},
      {"training", "steps", &c.training.steps},
      {"training", "local_batch_size", &c.training.local_batch_size},
      {"training", "seq_len", &c.training.seq_len},
      {"training", "grad_accum_steps", &c.training.grad_accum_steps},
      {"training", "max_norm", &c.training.max_norm},
      {"training",
       "mixed_precision_param",
       &c.training.mixed_precision_param,
       {"float32", "bfloat16", "auto"}},
      {"training",
       "mixed_precision_reduce",
       &c.training.mixed_precision_reduce,
       {"float32", "bfloat16"}},
      {"training", "enable_cpu_offload", &c.training.enable_cpu_offload},
      {"optimizer", "name", &c.optimizer.name, {"adamw"}},
      {"optimizer", "lr", &c.optimizer.lr},
      {"optimizer", "beta1", &c.optimizer.beta1},
      {"optimizer", "beta2", &c.optimizer.beta2},
      {"optimizer", "eps", &c.optimizer.eps},
      {"optimizer", "weight_decay", &c.optimizer.weight_decay},
      {"lr_scheduler", "warmup_steps", &c.lr_scheduler.warmup_steps},
      {"lr_scheduler",
       "decay_type",
       &c.lr_scheduler.decay_type,
       {"cosine", "linear", "wsd", "none"}},
      {"lr_scheduler", "min_lr_ratio", &c.lr_scheduler.min_lr_ratio},
      {"lr_scheduler", "decay_ratio", &c.lr_scheduler.decay_ratio},
      {"validation", "interval", &c.validation.interval},
      {"validation", "steps", &c.validation.steps},
      {"parallelism", "dp_replicate", &c.parallelism.dp_replicate},
      {"parallelism", "dp_shard", &c.parallelism.dp_shard},
      {"parallelism", "tp", &c.parallelism.tp},
      {"parallelism", "cp", &c.parallelism.cp},
      {"parallelism", "pp", &c.parallelism.pp},
      {"parallelism", "ep", &c.parallelism.ep},
      {"parallelism",
       "fsdp_reshard_after_forward",
       &c.parallelism.fsdp_reshard_after_forward,
       {"default", "always", "never"}},
      {"parallelism", "tp_sequence_parallel", &c.parallelism.tp_sequence_parallel},
      {"parallelism", "tp_recompute_allgather", &c.parallelism.tp_recompute_allgather},
      {"parallelism", "tp_async", &c.parallelism.tp_async},
      {"parallelism", "cp_rotate_method", &c.parallelism.cp_rotate_method, {"p2p", "allgather"}},
      {"parallelism",
       "pp_schedule",
       &c.parallelism.pp_schedule,
       {"gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv"}},
      {"parallelism", "pp_microbatches", &c.parallelism.pp_microbatches},
      {"parallelism", "pp_stages_per_rank", &c.parallelism.pp_stages_per_rank},
      {"parallelism", "pp_stage_layers", &c.parallelism.pp_stage_layers},
      {"parallelism", "pp_schedule_csv", &c.parallelism.pp_schedule_csv},
      {"parallelism", "pp_fsdp_gather", &c.parallelism.pp_fsdp_gather, {"microbatch", "step"}},
      {"activation_checkpoint",
       "mode",
       &c.activation_checkpoint.mode,
       {"none", "full", "selective"}},
      {"activation_checkpoint",
       "selective_option",
       &c.activation_checkpoint.selective_option,
       {},
       true},
      {"checkpoint", "dir", &c.checkpoint.dir},
      {"checkpoint", "interval", &c.checkpoint.interval},
      {"checkpoint", "keep", &c.checkpoint.keep},
      {"checkpoint", "resume", &c.checkpoint.resume},
      {"checkpoint", "allow_config_change", &c.checkpoint.allow_config_change},
      {"checkpoint", "last_save_in_hf", &c.checkpoint.last_save_in_hf},
      {"checkpoint", "async", &c.checkpoint.async},
      {"checkpoint", "verify", &c.checkpoint.verify},
      {"checkpoint", "fallback", &c.checkpoint.fallback},
      {"metrics", "jsonl", &c.metrics.jsonl},
      {"metrics", "log_every", &c.metrics.log_every},
      {"metrics", "overwrite", &c.metrics.overwrite},
      {"metrics", "tensorboard", &c.metrics.tensorboard},
      {"profiling", "trace", &c.profiling.trace},
      {"bench", "warmup_steps", &c.bench.warmup_steps},
      {"bench", "steps", &c.bench.steps},
      {"memory", "limit_gb", &c.memory.limit_gb},
  };
}

std::string key_path(const Key& k) {
  return str_cat(k.section, ".", k.name);
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

std::vector<std::string> section_names(const std::vector<Key>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys)
    if (out.empty() || out.back() != k.section) out.push_back(k.section);
  return out;
}

std::vector<std::string> key_names(const std::vector<Key>& keys, const std::string& section) {
  std::vector<std::string> out;
  for (const auto& k : keys)
    if (section == k.section) out.push_back(k.name);
  return out;
}

const char* type_word(const Ptr& p) {
  switch (p.index()) {
    case 0:
      return "an integer";
    case 1:
      return "a number";
    case 2:
      return "true or false";
    default:
      return "a string";
  }
}

// Where each key's value came from, for messages about values that are out of range.
using Origins = std::map<std::string, std::string>;

void set_from_toml(const Key& k, const toml::node& v, const std::string& where) {
  auto wrong = [&]() {
    std::ostringstream os;
    os << v.type();
    v.visit([&](auto&& x) {
      if constexpr (toml::is_value<decltype(x)>) os << " " << x;
    });
    fail(where, ": ", key_path(k), ": expected ", type_word(k.ptr), ", found ", os.str());
  };
  if (auto* p = std::get_if<int64_t*>(&k.ptr)) {
    if (!v.is_integer()) wrong();
    **p = v.as_integer()->get();
  } else if (auto* d = std::get_if<double*>(&k.ptr)) {
    if (v.is_integer())
      **d = double(v.as_integer()->get());
    else if (v.is_floating_point())
      **d = v.as_floating_point()->get();
    else
      wrong();
  } else if (auto* b = std::get_if<bool*>(&k.ptr)) {
    if (!v.is_boolean()) wrong();
    **b = v.as_boolean()->get();
  } else {
    auto* s = std::get<std::string*>(k.ptr);
    if (v.is_string())
      *s = v.as_string()->get();
    else if (k.accepts_int && v.is_integer())
      *s = std::to_string(v.as_integer()->get());
    else
      wrong();
  }
}

void set_from_text(const Key& k, std::string value, const std::string& where) {
  auto wrong = [&]() {
    fail(where, ": ", key_path(k), ": expected ", type_word(k.ptr), ", found '", value, "'");
  };
  if (auto* p = std::get_if<int64_t*>(&k.ptr)) {
    const char* b = value.data() + (value.size() > 1 && value[0] == '+');
    const char* e = value.data() + value.size();
    auto r = std::from_chars(b, e, **p);
    if (value.empty() || r.ec != std::errc() || r.ptr != e) wrong();
  } else if (auto* d = std::get_if<double*>(&k.ptr)) {
    const char* b = value.data() + (value.size() > 1 && value[0] == '+');
    const char* e = value.data() + value.size();
    auto r = std::from_chars(b, e, **d);
    if (value.empty() || r.ec != std::errc() || r.ptr != e) wrong();
  } else if (auto* bl = std::get_if<bool*>(&k.ptr)) {
    if (value == "true")
      **bl = true;
    else if (value == "false")
      **bl = false;
    else
      wrong();
  } else {
    if (value.size() >= 2 && (value[0] == '"' || value[0] == '\'') && value.back() == value[0])
      value = value.substr(1, value.size() - 2);
    *std::get<std::string*>(k.ptr) = value;
  }
}

const Key* find_key(const std::vector<Key>& keys, const std::string& section,
                    const std::string& name) {
  for (const auto& k : keys)
    if (section == k.section && name == k.name) return &k;
  return nullptr;
}

void check_known(const std::vector<Key>& keys, const std::string& section, const std::string& name,
                 const std::string& where) {
  auto secs = section_names(keys);
  if (std::find(secs.begin(), secs.end(), section) == secs.end())
    fail(where, ": unknown section [", section, "] (expected one of: ", join(secs, ", "), ")");
  if (!find_key(keys, section, name))
    fail(where, ": unknown key '", section, ".", name, "' (keys of [", section,
         "]: ", join(key_names(keys, section), ", "), ")");
}

std::string fmt_double(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that reads back exactly
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

// With pp > 1 the generated schedule's rules on (pp, stages per rank, micro-batches).
void pipeline_schedule_args(const JobConfig::Parallelism& p) {
  if (p.pp == 1) return;
  const pp::ScheduleKind kind = pp::parse_schedule_kind(p.pp_schedule);
  const int64_t v = p.pp_stages_per_rank ? p.pp_stages_per_rank : pp::default_stages_per_rank(kind);
  const int64_t m = p.pp_microbatches ? p.pp_microbatches : p.pp * v;
  pp::check_schedule_args(kind, int(p.pp), int(v), int(m));
}

void validate(const JobConfig& c, const std::vector<Key>& keys, const Origins& origin) {
  auto check = [&](bool ok, const char* key, const std::string& expected, const auto& value) {
    if (ok) return;
    auto it = origin.find(key);
    fail(it == origin.end() ? std::string("default") : it->second, ": ", key, ": expected ",
         expected, ", found ", value);
  };
  for (const auto& k : keys) {
    const std::string kp = key_path(k);
    if (auto* d = std::get_if<double*>(&k.ptr))
      check(std::isfinite(**d), kp.c_str(), "a finite number", **d);
    if (k.choices.empty()) continue;
    const std::string& v = *std::get<std::string*>(k.ptr);
    bool ok = false;
    std::vector<std::string> allowed;
    for (const char* ch : k.choices) {
      ok = ok || v == ch;
      allowed.push_back(str_cat("\"", ch, "\""));
    }
    check(ok, kp.c_str(), "one of " + join(allowed, ", "), str_cat("\"", v, "\""));
  }
  const auto& t = c.training;
  check(c.job.collective_timeout_s > 0, "job.collective_timeout_s", "a positive number",
        c.job.collective_timeout_s);
  check(c.model.seed >= 0, "model.seed", "a non-negative integer", c.model.seed);
  check(c.moe.capacity_factor >= 0, "moe.capacity_factor", "a number >= 0 (0: dropless)",
        c.moe.capacity_factor);
  check(c.moe.bias_update_rate >= 0, "moe.bias_update_rate", "a number >= 0 (0: off)",
        c.moe.bias_update_rate);
  check(c.moe.load_warning == 0 || c.moe.load_warning > 1, "moe.load_warning",
        "a load max/mean > 1, or 0 (the default, (1 + E/k) / 2)", c.moe.load_warning);
  check(t.steps > 0, "training.steps", "a positive integer", t.steps);
  check(t.local_batch_size > 0, "training.local_batch_size", "a positive integer",
        t.local_batch_size);
  check(t.seq_len > 0, "training.seq_len", "a positive integer", t.seq_len);
  check(t.grad_accum_steps > 0, "training.grad_accum_steps", "a positive integer",
        t.grad_accum_steps);
  check(t.max_norm > 0, "training.max_norm", "a positive number", t.max_norm);
  const auto& o = c.optimizer;
  check(o.lr >= 0, "optimizer.lr", "a non-negative number", o.lr);
  check(o.beta1 >= 0 && o.beta1 < 1, "optimizer.beta1", "a number in [0, 1)", o.beta1);
  check(o.beta2 >= 0 && o.beta2 < 1, "optimizer.beta2", "a number in [0, 1)", o.beta2);
  check(o.eps > 0, "optimizer.eps", "a positive number", o.eps);
  check(o.weight_decay >= 0, "optimizer.weight_decay", "a non-negative number", o.weight_decay);
  const auto& s = c.lr_scheduler;
  check(s.warmup_steps >= 0, "lr_scheduler.warmup_steps", "a non-negative integer", s.warmup_steps);
  check(s.min_lr_ratio >= 0 && s.min_lr_ratio <= 1, "lr_scheduler.min_lr_ratio",
        "a number in [0, 1]", s.min_lr_ratio);
  check(s.decay_ratio >= 0 && s.decay_ratio <= 1, "lr_scheduler.decay_ratio", "a number in [0, 1]",
        s.decay_ratio);
  check(c.validation.interval >= 0, "validation.interval", "a non-negative integer (0 = never)",
        c.validation.interval);
  check(c.validation.steps >= 1, "validation.steps", "a positive integer", c.validation.steps);
  const auto& p = c.parallelism;
  check(p.dp_replicate >= 1, "parallelism.dp_replicate", "a positive integer", p.dp_replicate);
  check(p.dp_shard == -1 || p.dp_shard >= 1, "parallelism.dp_shard",
        "-1 (the rest of the world) or a positive integer", p.dp_shard);
  check(p.tp >= 1, "parallelism.tp", "a positive integer", p.tp);
  check(p.cp >= 1, "parallelism.cp", "a positive integer", p.cp);
  check(p.pp >= 1, "parallelism.pp", "a positive integer", p.pp);
  check(p.ep >= 1, "parallelism.ep", "a positive integer (1: no expert parallelism)", p.ep);
  check(p.pp_microbatches >= 0, "parallelism.pp_microbatches",
        "a non-negative integer (0 = pp x pp_stages_per_rank)", p.pp_microbatches);
  check(p.pp_stages_per_rank >= 0, "parallelism.pp_stages_per_rank",
        "a non-negative integer (0 = the schedule's)", p.pp_stages_per_rank);
  // The schedule's rules on (pp, stages per rank, micro-batches), named by their keys.
  if (p.pp_schedule_csv.empty()) pipeline_schedule_args(p);
  if (!p.pp_stage_layers.empty()) pp::parse_stage_layers(p.pp_stage_layers);
  const std::string& so = c.activation_checkpoint.selective_option;
  int64_t every = 0;
  auto r = std::from_chars(so.data(), so.data() + so.size(), every);
  check(so == "op" ||
            (!so.empty() && r.ec == std::errc() && r.ptr == so.data() + so.size() && every >= 1),
        "activation_checkpoint.selective_option", "\"op\" or a positive integer N",
        str_cat("\"", so, "\""));
  check(c.checkpoint.interval >= 0, "checkpoint.interval", "a non-negative integer",
        c.checkpoint.interval);
  check(c.checkpoint.keep >= 0, "checkpoint.keep", "a non-negative integer (0 = keep all)",
        c.checkpoint.keep);
  // A corrupt checkpoint is found by verifying it.
  check(!c.checkpoint.fallback || c.checkpoint.verify, "checkpoint.fallback",
        "false when checkpoint.verify = false (a corrupt checkpoint is found by verifying it)",
        "true");
  check(c.metrics.log_every >= 1, "metrics.log_every", "a positive integer", c.metrics.log_every);
  {
    // A directory, made if missing; an existing file there would fail only at the end of training.
    std::error_code ec;
    const std::string& t = c.profiling.trace;
    check(t.empty() || !std::filesystem::exists(t, ec) || std::filesystem::is_directory(t, ec),
          "profiling.trace", "a directory (made if missing) for the per-rank trace files",
          str_cat("\"", t, "\" (an existing file)"));
  }
  {
    std::error_code ec;
    const std::string& tb = c.metrics.tensorboard;
    check(tb.empty() || !std::filesystem::exists(tb, ec) || std::filesystem::is_directory(tb, ec),
          "metrics.tensorboard",
          "a directory (made if missing) for TensorBoard's event files, or \"\"",
          str_cat("\"", tb, "\" (an existing file)"));
  }
  check(c.bench.warmup_steps >= 0, "bench.warmup_steps", "a non-negative integer",
        c.bench.warmup_steps);
  check(c.bench.steps >= 1, "bench.steps", "a positive integer", c.bench.steps);
  check(c.memory.limit_gb >= 0, "memory.limit_gb", "a non-negative number (0 = no limit)",
        c.memory.limit_gb);
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (ch < 0x20 || ch == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", ch);
          out += buf;
        } else {
          out += char(ch);
        }
    }
  }
  return out + "\"";
}

}  // namespace

bool JobConfig::operator==(const JobConfig& o) const {
  return job == o.job && model == o.model && moe == o.moe && data == o.data &&
         training == o.training && optimizer == o.optimizer && lr_scheduler == o.lr_scheduler &&
         validation == o.validation && parallelism == o.parallelism &&
         activation_checkpoint == o.activation_checkpoint && checkpoint == o.checkpoint &&
         metrics == o.metrics && profiling == o.profiling && bench == o.bench && memory == o.memory;
}

JobConfig parse_job_config(const std::string& toml_text, const std::string& source,
                           const std::vector<std::string>& overrides) {
  JobConfig c;
  const std::vector<Key> keys = keys_of(c);
  Origins origin;

  toml::table tbl;
  try {
    tbl = toml::parse(toml_text, source);
  } catch (const toml::parse_error& e) {
    fail(source, ":", e.source().begin.line, ":", e.source().begin.column,
         ": invalid TOML: ", e.description());
  }
  for (auto&& [sec, node] : tbl) {
    const std::string section(sec.str());
    const std::string at = str_cat(source, ":", node.source().begin.line);
    auto secs = section_names(keys);
    if (std::find(secs.begin(), secs.end(), section) == secs.end())
      fail(at, ": unknown section [", section, "] (expected one of: ", join(secs, ", "), ")");
    LOOM_CHECK(node.is_table(), at, ": '", section, "' must be a table [", section,
               "], not a value");
    for (auto&& [kname, v] : *node.as_table()) {
      const std::string name(kname.str());
      const std::string vat = str_cat(source, ":", v.source().begin.line);
      check_known(keys, section, name, vat);
      set_from_toml(*find_key(keys, section, name), v, vat);
      origin[section + "." + name] = vat;
    }
  }

  for (const std::string& ov : overrides) {
    const std::string where = "command line";
    const size_t eq = ov.find('=');
    LOOM_CHECK(ov.rfind("--", 0) == 0 && eq != std::string::npos, where, ": malformed override '",
               ov, "': expected --section.key=value");
    const std::string lhs = ov.substr(2, eq - 2);
    const size_t dot = lhs.find('.');
    LOOM_CHECK(dot != std::string::npos && dot > 0 && dot + 1 < lhs.size(), where,
               ": malformed override '", ov, "': expected --section.key=value (the key needs ",
               "its section, e.g. --training.steps=10)");
    const std::string section = lhs.substr(0, dot), name = lhs.substr(dot + 1);
    check_known(keys, section, name, where);
    set_from_text(*find_key(keys, section, name), ov.substr(eq + 1), where);
    origin[lhs] = where;
  }

  // Under the run's dump_dir unless given, wherever dump_dir was set.
  if (!origin.contains("metrics.tensorboard"))
    c.metrics.tensorboard = (fs::path(c.job.dump_dir) / "tensorboard").string();
  validate(c, keys, origin);
  resolve_auto_device(c);
  resolve_auto_precision(c);
  return c;
}

void resolve_auto_device(JobConfig& c) {
  std::string& d = c.training.device;
  if (d == "auto") {
    const ops::GpuAvailability g = ops::gpu_availability();
    d = g.usable ? "cuda" : "cpu";
    c.device_reason = g.usable ? str_cat("auto: GPU 0 ", g.name, g.count > 1 ? " and " : "",
                                         g.count > 1 ? std::to_string(g.count - 1) : "",
                                         g.count > 1 ? " more" : "")
                               : str_cat("auto: no GPU (", g.why_not, ")");
  }
  std::string& p = c.training.mixed_precision_param;
  if (d == "cuda" && p == "auto") {
    p = "bfloat16";
    c.precision_reason = "auto: bf16 GEMMs run on the GPU's tensor cores";
  }
}

void check_device_usable(const JobConfig& c) {
  if (c.training.device != "cuda") return;
  const ops::GpuAvailability g = ops::gpu_availability();
  LOOM_CHECK(g.usable, "training.device = \"cuda\", but ", g.built ? "no GPU is usable: " : "",
             g.why_not);
}

void resolve_auto_precision(JobConfig& c) {
  std::string& p = c.training.mixed_precision_param;
  if (p != "auto") return;
  const ops::CpuBf16Gemms g = ops::cpu_bf16_gemms();
  if (g.onednn_native && g.native) {
    p = "bfloat16";
    c.precision_reason = str_cat("auto: oneDNN ", g.onednn, " has native bf16 matmuls");
  } else {
    p = "float32";
    c.precision_reason =
        str_cat("auto: oneDNN ", g.onednn, " has no bf16 matmul instructions; bf16 GEMMs would be ",
                g.native ? "emulated" : "widened to f32", ", slower than float32");
  }
}

std::string describe_precision(const JobConfig& c) {
  const std::string& p = c.training.mixed_precision_param;
  std::string s = str_cat(p, " (", c.precision_reason.empty() ? "set" : c.precision_reason, ")");
  if (p == "bfloat16") s += str_cat("; bf16 GEMMs ", ops::cpu_bf16_gemms().path);
  return s;
}

JobConfig load_job_config(const std::string& toml_path, const std::vector<std::string>& overrides) {
  JobConfig c = parse_job_config(read_file(toml_path, "job config"), toml_path, overrides);
  const fs::path dir = fs::path(toml_path).parent_path();
  c.base_dir = dir.empty() ? "." : dir.string();
  return c;
}

namespace {

// A key's value as to_toml writes it.
std::string toml_value(const Ptr& ptr) {
  std::ostringstream os;
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>)
          os << *p;
        else if constexpr (std::is_same_v<T, double>)
          os << fmt_double(*p);
        else if constexpr (std::is_same_v<T, bool>)
          os << (*p ? "true" : "false");
        else
          os << quote(*p);
      },
      ptr);
  return os.str();
}

}  // namespace

std::vector<ConfigDifference> config_differences(const JobConfig& a, const JobConfig& b) {
  JobConfig ca = a, cb = b;
  const std::vector<Key> ka = keys_of(ca), kb = keys_of(cb);
  std::vector<ConfigDifference> out;
  for (size_t i = 0; i < ka.size(); ++i) {
    std::string va = toml_value(ka[i].ptr), vb = toml_value(kb[i].ptr);
    if (va != vb) out.push_back({key_path(ka[i]), std::move(va), std::move(vb)});
  }
  return out;
}

std::string to_toml(const JobConfig& c) {
  JobConfig copy = c;
  std::ostringstream os;
  const char* section = nullptr;
  for (const Key& k : keys_of(copy)) {
    if (!section || std::string(section) != k.section) {
      os << (section ? "\n" : "") << "[" << k.section << "]\n";
      section = k.section;
    }
    os << k.name << " = " << toml_value(k.ptr);
    if (k.ptr == Ptr(&copy.training.mixed_precision_param) && !c.precision_reason.empty())
      os << "  # " << c.precision_reason;
    if (k.ptr == Ptr(&copy.training.device) && !c.device_reason.empty())
      os << "  # " << c.device_reason;
    os << "\n";
  }
  return os.str();
}

std::string resolve_model_config(const std::string& value, const std::string& toml_dir) {
  LOOM_CHECK(!value.empty(), "model.config is empty: expected a path to a Hugging Face ",
             "config.json or a name from configs/ (e.g. \"debug\")");
  std::vector<fs::path> tried;
  const bool is_path = value.find('/') != std::string::npos ||
                       (value.size() > 5 && value.substr(value.size() - 5) == ".json");
  if (is_path) {
    const fs::path p(value);
    if (p.is_absolute()) {
      tried.push_back(p);
    } else {
      if (!toml_dir.empty()) tried.push_back(fs::path(toml_dir) / p);
      tried.push_back(p);
    }
  } else {
    return find_in_configs(value + ".json", toml_dir, "model config '" + value + "'");
  }
  return first_file(tried, "model config '" + value + "'");
}

std::string first_file(const std::vector<fs::path>& tried, const std::string& what) {
  std::vector<std::string> names;
  for (const fs::path& p : tried) {
    std::error_code ec;
    if (fs::is_regular_file(p, ec)) return fs::absolute(p, ec).lexically_normal().string();
    names.push_back(p.lexically_normal().string());
  }
  fail(what, " not found; looked for: ", join(names, ", "));
}

std::string find_in_configs(const std::string& file, const std::string& toml_dir,
                            const std::string& what) {
  std::vector<fs::path> tried;
  if (!toml_dir.empty()) tried.push_back(fs::path(toml_dir) / ".." / "configs" / file);
  tried.push_back(fs::path("configs") / file);
  if (const char* src = ::getenv("LOOM_SOURCE_DIR"); src && *src)
    tried.push_back(fs::path(src) / "configs" / file);
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    tried.push_back(exe.parent_path() / ".." / "configs" / file);
    tried.push_back(exe.parent_path() / ".." / "share" / "loom" / "configs" / file);
  }
  return first_file(tried, what);
}

}  // namespace loom
