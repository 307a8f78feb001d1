#include "plan/hardware.hpp"

#include <stdlib.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "train/config.hpp"

namespace loom::plan {

namespace fs = std::filesystem;

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// Reads one file's tables, every error naming the file and the dotted key.
struct Reader {
  std::string source;

  std::string at(const toml::node& n) const { return str_cat(source, ":", n.source().begin.line); }

  // Every key of `t` must be one of `keys` (an empty list: any key).
  void only(const toml::table& t, const std::string& section,
            const std::vector<std::string>& keys) const {
    for (auto&& [k, v] : t) {
      const std::string name(k.str());
      if (std::find(keys.begin(), keys.end(), name) != keys.end()) continue;
      const std::string where = section.empty() ? "top level" : "[" + section + "]";
      fail(at(v), ": unknown key '", section.empty() ? "" : section + ".", name, "' (keys of ",
           where, ": ", join(keys), ")");
    }
  }
  const toml::table* table(const toml::table& t, const std::string& section, const std::string& key,
                           bool required) const {
    const toml::node* n = t.get(key);
    const std::string path = section.empty() ? key : section + "." + key;
    if (!n) {
      LOOM_CHECK(!required, source, ": missing table [", path, "]");
      return nullptr;
    }
    LOOM_CHECK(n->is_table(), at(*n), ": '", path, "' must be a table [", path, "]");
    return n->as_table();
  }
  // A positive number (integer or float); `fallback` when absent and not required.
  double number(const toml::table* t, const std::string& section, const std::string& key,
                bool required, double fallback = 0) const {
    const std::string path = section.empty() ? key : section + "." + key;
    const toml::node* n = t ? t->get(key) : nullptr;
    if (!n) {
      LOOM_CHECK(!required, source, ": missing key '", path, "'");
      return fallback;
    }
    const std::optional<double> v = n->value<double>();
    LOOM_CHECK(v && std::isfinite(*v) && *v > 0, at(*n), ": '", path,
               "' must be a positive number");
    return *v;
  }
  std::string text(const toml::table* t, const std::string& section, const std::string& key,
                   bool required) const {
    const std::string path = section.empty() ? key : section + "." + key;
    const toml::node* n = t ? t->get(key) : nullptr;
    if (!n) {
      LOOM_CHECK(!required, source, ": missing key '", path, "'");
      return "";
    }
    const std::optional<std::string> v = n->value<std::string>();
    LOOM_CHECK(v.has_value(), at(*n), ": '", path, "' must be a string");
    return *v;
  }
  Link link(const toml::table& links, const std::string& level) const {
    const toml::table* t = table(links, "links", level, true);
    const std::string section = "links." + level;
    only(*t, section, {"bandwidth", "latency"});
    return {number(t, section, "bandwidth", true), number(t, section, "latency", true)};
  }
  // Rows [M, N, K, FLOP/s].
  std::vector<GemmPoint> gemm_table(const toml::table& gemm, const std::string& key) const {
    std::vector<GemmPoint> points;
    const toml::node* n = gemm.get(key);
    if (!n) return points;
    const std::string path = "gemm." + key;
    LOOM_CHECK(n->is_array(), at(*n), ": '", path, "' must be an array of [M, N, K, FLOP/s]");
    for (const toml::node& row : *n->as_array()) {
      const toml::array* r = row.as_array();
      LOOM_CHECK(r && r->size() == 4, at(row), ": '", path,
                 "': each row must be [M, N, K, FLOP/s]");
      double x[4];
      for (size_t i = 0; i < 4; ++i) {
        const std::optional<double> v = (*r)[i].value<double>();
        LOOM_CHECK(v && std::isfinite(*v) && *v > 0, at(row), ": '", path,
                   "': [M, N, K, FLOP/s] must be positive numbers");
        x[i] = *v;
      }
      points.push_back({int64_t(x[0]), int64_t(x[1]), int64_t(x[2]), x[3]});
    }
    return points;
  }
};

// The memory-bound ops of ops/ops.hpp, the keys of [memory_ops].
const std::vector<std::string> kMemoryOps = {"cast",
                                             "add_inplace",
                                             "fill",
                                             "copy_rows",
                                             "philox_normal",
                                             "rmsnorm_forward",
                                             "rmsnorm_backward",
                                             "swiglu_forward",
                                             "swiglu_backward",
                                             "rope_forward",
                                             "rope_backward",
                                             "embedding_forward",
                                             "embedding_backward",
                                             "embedding_forward_range",
                                             "embedding_backward_range",
                                             "attention_merge",
                                             "attention_delta",
                                             "gla_decay_total",
                                             "gla_state_fold",
                                             "gla_gate_forward",
                                             "gla_gate_backward",
                                             "gated_rmsnorm_forward",
                                             "gated_rmsnorm_backward",
                                             "short_conv_forward",
                                             "short_conv_backward",
                                             "linear_cross_entropy",
                                             "vocab_shard_lse",
                                             "vocab_shard_combine",
                                             "vocab_shard_dlogits"};

bool is_path(const std::string& s) {
  return s.find('/') != std::string::npos ||
         (s.size() > 5 && s.compare(s.size() - 5, 5, ".toml") == 0);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  LOOM_CHECK(in.good(), "hardware file '", path, "' cannot be read");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// A bare name: configs/hardware/NAME.toml where model configs are looked for.
std::string resolve(const std::string& name) {
  if (is_path(name)) return name;
  return find_in_configs("hardware/" + name + ".toml", "", "hardware '" + name + "'");
}

bool attention_like(const std::string& op) {
  return op == "attention_forward" || op == "attention_backward" ||
         op == "attention_block_forward" || op == "attention_block_backward" ||
         op == "attention_decode" || op == "gla_forward" || op == "gla_backward";
}

double log_distance(const GemmPoint& p, int64_t m, int64_t n, int64_t k) {
  const auto d = [](int64_t a, int64_t b) {
    const double x = std::log(double(std::max<int64_t>(a, 1))) - std::log(double(b));
    return x * x;
  };
  return d(m, p.m) + d(n, p.n) + d(k, p.k);
}

}  // namespace

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::all_gather:
      return "all_gather";
    case CollectiveKind::reduce_scatter:
      return "reduce_scatter";
    case CollectiveKind::all_reduce:
      return "all_reduce";
    case CollectiveKind::broadcast:
      return "broadcast";
    case CollectiveKind::send:
      return "send";
    case CollectiveKind::recv:
      return "recv";
    case CollectiveKind::all_to_all:
      return "all_to_all";
    case CollectiveKind::all_to_all_v:
      return "all_to_all_v";
    case CollectiveKind::barrier:
      return "barrier";
  }
  return "?";
}

Hardware parse_hardware(const std::string& toml_text, const std::string& source) {
  toml::table top;
  try {
    top = toml::parse(toml_text, source);
  } catch (const toml::parse_error& e) {
    fail(source, ":", e.source().begin.line, ":", e.source().begin.column,
         ": invalid TOML: ", e.description());
  }
  const Reader r{source};
  r.only(top, "",
         {"name", "device", "ranks_per_node", "capacity", "memory_bandwidth", "peak", "gemm",
          "attention", "memory_ops", "optimizer", "host", "links", "collectives", "calibration"});
  Hardware hw;
  hw.source = source;
  hw.name = r.text(&top, "", "name", true);
  if (const std::string d = r.text(&top, "", "device", false); !d.empty()) hw.device = d;
  LOOM_CHECK(hw.device == "cpu" || hw.device == "cuda", source, ": device = \"", hw.device,
             "\": expected \"cpu\" or \"cuda\"");
  hw.ranks_per_node = int(r.number(&top, "", "ranks_per_node", true));
  hw.capacity = r.number(&top, "", "capacity", true);
  hw.memory_bandwidth = r.number(&top, "", "memory_bandwidth", true);

  const toml::table* peak = r.table(top, "", "peak", true);
  r.only(*peak, "peak", {"f32", "bf16"});
  hw.peak_f32 = r.number(peak, "peak", "f32", true);
  hw.peak_bf16 = r.number(peak, "peak", "bf16", true);

  if (const toml::table* gemm = r.table(top, "", "gemm", false)) {
    r.only(*gemm, "gemm", {"efficiency", "f32", "bf16"});
    hw.gemm_efficiency = r.number(gemm, "gemm", "efficiency", false, 1.0);
    hw.gemm_f32 = r.gemm_table(*gemm, "f32");
    hw.gemm_bf16 = r.gemm_table(*gemm, "bf16");
  }
  if (const toml::table* att = r.table(top, "", "attention", false)) {
    r.only(*att, "attention",
           {"efficiency", "backward_efficiency", "block_efficiency", "block_backward_efficiency",
            "dtype", "bandwidth", "backward_bandwidth", "block_bandwidth",
            "block_backward_bandwidth", "bf16_efficiency", "bf16_backward_efficiency",
            "bf16_bandwidth", "bf16_backward_bandwidth"});
    const char* bandwidths[4] = {"bandwidth", "backward_bandwidth", "block_bandwidth",
                                 "block_backward_bandwidth"};
    for (size_t i = 0; i < 4; ++i)
      hw.attention_bandwidth[i] = r.number(att, "attention", bandwidths[i], false, 0.0);
    hw.attention_efficiency = r.number(att, "attention", "efficiency", false, 1.0);
    hw.attention_backward_efficiency =
        r.number(att, "attention", "backward_efficiency", false, hw.attention_efficiency);
    hw.attention_block_efficiency =
        r.number(att, "attention", "block_efficiency", false, hw.attention_efficiency);
    hw.attention_block_backward_efficiency = r.number(att, "attention", "block_backward_efficiency",
                                                      false, hw.attention_backward_efficiency);
    hw.attention_bf16_efficiency = r.number(att, "attention", "bf16_efficiency", false, 0.0);
    hw.attention_bf16_backward_efficiency =
        r.number(att, "attention", "bf16_backward_efficiency", false, 0.0);
    hw.attention_bf16_bandwidth = {
        r.number(att, "attention", "bf16_bandwidth", false, 0.0),
        r.number(att, "attention", "bf16_backward_bandwidth", false, 0.0)};
    const std::string dt = r.text(att, "attention", "dtype", false);
    if (!dt.empty()) {
      LOOM_CHECK(dt == "f32" || dt == "bf16", source, ": 'attention.dtype' must be \"f32\" or ",
                 "\"bf16\", not \"", dt, "\"");
      hw.has_attention_dtype = true;
      hw.attention_dtype = dt == "bf16" ? DType::bf16 : DType::f32;
    }
  }
  if (const toml::table* mem = r.table(top, "", "memory_ops", false)) {
    r.only(*mem, "memory_ops", kMemoryOps);
    for (auto&& [k, v] : *mem) {
      const std::string op(k.str());
      hw.op_bandwidth[op] = r.number(mem, "memory_ops", op, true);
    }
  }
  if (const toml::table* opt = r.table(top, "", "optimizer", false)) {
    r.only(*opt, "optimizer", {"bandwidth"});
    hw.optimizer_bandwidth = r.number(opt, "optimizer", "bandwidth", false);
  }
  if (const toml::table* host = r.table(top, "", "host", false)) {
    r.only(*host, "host", {"link_bandwidth", "optimizer_bandwidth"});
    hw.host_link_bandwidth = r.number(host, "host", "link_bandwidth", false);
    hw.host_optimizer_bandwidth = r.number(host, "host", "optimizer_bandwidth", false);
  }
  const toml::table* links = r.table(top, "", "links", true);
  r.only(*links, "links", {"intra_node", "inter_node", "transfers_on_core", "sync_wait"});
  hw.intra_node = r.link(*links, "intra_node");
  hw.inter_node = r.link(*links, "inter_node");
  if (const toml::node* n = links->get("transfers_on_core")) {
    LOOM_CHECK(n->is_boolean(), r.at(*n), ": 'links.transfers_on_core' must be true or false");
    hw.transfers_on_core = **n->as_boolean();
  }
  if (const toml::node* n = links->get("sync_wait")) {
    const std::optional<double> v = n->value<double>();
    LOOM_CHECK(v && std::isfinite(*v) && *v >= 0, r.at(*n),
               ": 'links.sync_wait' must be a fraction (>= 0) of the compute between collectives");
    hw.sync_wait = *v;
  }
  if (const toml::table* by_kind = r.table(top, "", "collectives", false)) {
    std::vector<std::string> names;
    for (CollectiveKind k : kCollectiveKinds) names.push_back(collective_name(k));
    r.only(*by_kind, "collectives", names);
    for (CollectiveKind k : kCollectiveKinds) {
      const toml::table* t = r.table(*by_kind, "collectives", collective_name(k), false);
      if (!t) continue;
      const std::string section = std::string("collectives.") + collective_name(k);
      r.only(*t, section, {"bandwidth", "latency"});
      hw.intra_by_kind[k] = {r.number(t, section, "bandwidth", true),
                             r.number(t, section, "latency", true)};
    }
  }
  if (const toml::table* cal = r.table(top, "", "calibration", false)) {
    // Provenance of a measured file; only the thread count is used.
    r.only(*cal, "calibration", {"threads", "ranks", "cpu", "date", "seconds"});
    hw.threads = int(r.number(cal, "calibration", "threads", false));
  }
  return hw;
}

Hardware load_hardware(const std::string& name_or_path) {
  const std::string path = resolve(name_or_path);
  return parse_hardware(read_text(path), path);
}

double gemm_rate(const Hardware& hw, DType dt, int64_t m, int64_t n, int64_t k) {
  const std::vector<GemmPoint>& table = dt == DType::bf16 ? hw.gemm_bf16 : hw.gemm_f32;
  if (table.empty()) return hw.peak(dt) * hw.gemm_efficiency;
  const GemmPoint* best = &table[0];
  for (const GemmPoint& p : table)
    if (log_distance(p, m, n, k) < log_distance(*best, m, n, k)) best = &p;
  return best->flops_per_s;
}

double kernel_seconds(const ops::KernelWork& w, const Hardware& hw) {
  const std::string op = w.op;
  double rate = hw.peak(w.dtype), bandwidth = hw.memory_bandwidth;
  if (w.m > 0) {
    rate = gemm_rate(hw, w.dtype, w.m, w.n, w.k);
  } else if (attention_like(op)) {
    const bool backward = op.find("backward") != std::string::npos;
    const bool block = op.rfind("attention_block_", 0) == 0;
    double efficiency =
        block ? (backward ? hw.attention_block_backward_efficiency : hw.attention_block_efficiency)
              : (backward ? hw.attention_backward_efficiency : hw.attention_efficiency);
    const bool fused = op.rfind("attention_", 0) == 0 && op != "attention_decode";
    double per_byte = fused ? hw.attention_bandwidth[(block ? 2 : 0) + (backward ? 1 : 0)] : 0;
    // loom's own bf16 kernels, where measured.
    const double bf16 =
        backward ? hw.attention_bf16_backward_efficiency : hw.attention_bf16_efficiency;
    if (fused && !block && !hw.has_attention_dtype && w.dtype == DType::bf16 && bf16 > 0) {
      efficiency = bf16;
      per_byte = hw.attention_bf16_bandwidth[backward ? 1 : 0];
    }
    rate = hw.peak(hw.has_attention_dtype ? hw.attention_dtype : w.dtype) * efficiency;
    if (per_byte > 0) return w.flops / rate + w.bytes / per_byte;
  } else if (auto it = hw.op_bandwidth.find(op); it != hw.op_bandwidth.end()) {
    bandwidth = it->second;
  }
  const double link = hw.host_link_bandwidth > 0 ? w.link_bytes / hw.host_link_bandwidth : 0;
  return std::max({w.flops / rate, w.bytes / bandwidth, link});
}

double optimizer_seconds(double bytes, const Hardware& hw, bool on_host) {
  if (on_host && hw.host_optimizer_bandwidth > 0) return bytes / hw.host_optimizer_bandwidth;
  return bytes / (hw.optimizer_bandwidth > 0 ? hw.optimizer_bandwidth : hw.memory_bandwidth);
}

double collective_seconds(CollectiveKind kind, uint64_t bytes_sent, int group_size, int node_ranks,
                          const Hardware& hw) {
  const auto measured = hw.intra_by_kind.find(kind);
  const bool spans = node_ranks > 0;
  const Link& l = spans                                ? hw.inter_node
                  : measured != hw.intra_by_kind.end() ? measured->second
                                                       : hw.intra_node;
  const double alpha = l.latency;
  switch (kind) {
    case CollectiveKind::send:
    case CollectiveKind::recv:
      return alpha + double(bytes_sent) / l.bandwidth;
    default:
      break;
  }
  if (group_size <= 1) return 0;
  const double n = group_size;
  if (spans && (kind == CollectiveKind::all_to_all || kind == CollectiveKind::all_to_all_v)) {
    // Not a ring: each rank sends each peer its own share directly, so the shares for the other
    // nodes' ranks leave through the rank's own NIC while those for its node's ranks cross the
    // intra-node link at the same time (expert parallelism's exchange, its peers equally loaded).
    const double sent = double(bytes_sent), others = n - 1;
    const double out = sent * (n - node_ranks) / others / l.bandwidth;
    const double in = sent * (node_ranks - 1) / others / hw.intra_node.bandwidth;
    return std::max(out, in) + (n - 1) * alpha;
  }
  const double beta =
      spans ? std::min(l.bandwidth * double(node_ranks), hw.intra_node.bandwidth) : l.bandwidth;
  const double transfer = double(bytes_sent) / beta;
  switch (kind) {
    case CollectiveKind::all_gather:
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::all_to_all:
    case CollectiveKind::all_to_all_v:
    case CollectiveKind::broadcast:
      return transfer + (n - 1) * alpha;
    case CollectiveKind::all_reduce:
      return transfer + 2 * (n - 1) * alpha;
    case CollectiveKind::barrier:
      return std::ceil(std::log2(n)) * alpha;
    default:
      return 0;
  }
}

}  // namespace loom::plan
