#include "model/gla_config.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/read_file.hpp"
#include "model/config_json.hpp"

namespace loom {

namespace {

using namespace config_json;

// fla options whose other values change the model in ways loom does not implement: refused by
// name rather than loaded as a different model.
void refuse_unless(bool ok, const std::string& source, const char* key, const json& v,
                   const std::string& expected) {
  LOOM_CHECK(ok, source, ": field '", key, "': loom's GLA supports only ", expected, ", found ",
             found(v));
}

}  // namespace

GlaConfig GlaConfig::from_json(const std::string& text, const std::string& source) {
  const json j = parse_object(text, source, "an fla config.json");
  if (j.contains("model_type")) {
    const json& v = j["model_type"];
    LOOM_CHECK(v.is_string() && v.get<std::string>() == "gla", source,
               ": field 'model_type': expected \"gla\", found ", found(v));
  }

  GlaConfig c;
  read(j, "hidden_size", source, c.hidden_size);
  read(j, "expand_k", source, c.expand_k);
  read(j, "expand_v", source, c.expand_v);
  read(j, "hidden_ratio", source, c.hidden_ratio);
  read(j, "num_hidden_layers", source, c.num_hidden_layers);
  read(j, "num_heads", source, c.num_heads);
  c.num_kv_heads = c.num_heads;
  read(j, "num_kv_heads", source, c.num_kv_heads);
  read(j, "use_short_conv", source, c.use_short_conv);
  read(j, "conv_size", source, c.conv_size);
  read(j, "use_output_gate", source, c.use_output_gate);
  if (present(j, "clamp_min")) {
    c.has_clamp_min = true;
    read(j, "clamp_min", source, c.clamp_min);
  }
  read(j, "elementwise_affine", source, c.elementwise_affine);
  read(j, "norm_eps", source, c.norm_eps);
  read(j, "fuse_norm", source, c.fuse_norm);
  read(j, "vocab_size", source, c.vocab_size);
  read(j, "max_position_embeddings", source, c.max_position_embeddings);
  read(j, "tie_word_embeddings", source, c.tie_word_embeddings);
  read(j, "initializer_range", source, c.initializer_range);
  read(j, "gate_logit_normalizer", source, c.gate_logit_normalizer);
  read(j, "gate_low_rank_dim", source, c.gate_low_rank_dim);
  // fla's MLP size when the file leaves it null: 2/3 of hidden_ratio * d, rounded up to 256.
  if (present(j, "intermediate_size")) {
    read(j, "intermediate_size", source, c.intermediate_size);
  } else {
    const auto f = int64_t(double(c.hidden_size) * c.hidden_ratio * 2.0 / 3.0);
    c.intermediate_size = 256 * ((f + 255) / 256);
  }

  if (present(j, "hidden_act")) {
    const json& v = j["hidden_act"];
    refuse_unless(v.is_string() && v.get<std::string>() == "swish", source, "hidden_act", v,
                  "\"swish\" (the output gate and the MLP)");
  }
  if (present(j, "attn_mode")) {  // every mode is the same math; loom has one kernel
    const json& v = j["attn_mode"];
    const bool ok = v.is_string() && (v == "chunk" || v == "fused_recurrent" || v == "fused_chunk");
    refuse_unless(ok, source, "attn_mode", v, "\"chunk\", \"fused_recurrent\" or \"fused_chunk\"");
  }
  for (const char* k : {"attn", "feature_map", "attnres_block_size", "prenorm_residual_strategy"})
    if (present(j, k))
      refuse_unless(false, source, k, j[k],
                    std::string(k) == "attn"
                        ? "null (hybrid softmax-attention layers are not implemented)"
                        : "null");
  for (const char* k : {"use_l2warp", "conv_bias", "use_gv"})
    if (present(j, k)) refuse_unless(j[k] == false, source, k, j[k], "false");
  if (present(j, "use_gk"))
    refuse_unless(j["use_gk"] == true, source, "use_gk", j["use_gk"], "true");

  c.validate(source);
  return c;
}

GlaConfig GlaConfig::from_file(const std::string& path) {
  return from_json(read_file(path, "model config"), path);
}

void GlaConfig::validate(const std::string& source) const {
  auto positive = [&](int64_t v, const char* field) {
    LOOM_CHECK(v > 0, source, ": field '", field, "': expected a positive integer, found ", v);
  };
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_heads, "num_heads");
  positive(num_kv_heads, "num_kv_heads");
  positive(vocab_size, "vocab_size");
  positive(max_position_embeddings, "max_position_embeddings");
  positive(gate_low_rank_dim, "gate_low_rank_dim");
  if (use_short_conv) positive(conv_size, "conv_size");
  LOOM_CHECK(norm_eps > 0, source, ": field 'norm_eps': expected a positive number, found ",
             norm_eps);
  LOOM_CHECK(gate_logit_normalizer > 0, source,
             ": field 'gate_logit_normalizer': expected a positive number, found ",
             gate_logit_normalizer);
  LOOM_CHECK(initializer_range > 0, source,
             ": field 'initializer_range': expected a positive number, found ", initializer_range);
  LOOM_CHECK(!has_clamp_min || clamp_min <= 0, source,
             ": field 'clamp_min': expected null or a log-decay <= 0, found ", clamp_min);
  LOOM_CHECK(key_dim() > 0 && key_dim() % num_heads == 0, source,
             ": fields 'expand_k' and 'num_heads': key_dim = int(hidden_size * expand_k) = ",
             key_dim(), " must be a positive multiple of num_heads ", num_heads);
  LOOM_CHECK(value_dim() > 0 && value_dim() % num_heads == 0, source,
             ": fields 'expand_v' and 'num_heads': value_dim = int(hidden_size * expand_v) = ",
             value_dim(), " must be a positive multiple of num_heads ", num_heads);
  LOOM_CHECK(num_heads % num_kv_heads == 0, source,
             ": field 'num_kv_heads': expected a divisor of num_heads ", num_heads, ", found ",
             num_kv_heads);
}

std::string GlaConfig::output_norm_name() const {
  return fuse_norm && use_output_gate ? "g_norm_swish_gate" : "g_norm";
}

std::string GlaConfig::to_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"GLAForCausalLM"};
  j["model_type"] = "gla";
  j["hidden_act"] = "swish";
  j["attn_mode"] = "chunk";
  j["torch_dtype"] = "float32";
  j["hidden_size"] = hidden_size;
  j["expand_k"] = expand_k;
  j["expand_v"] = expand_v;
  j["hidden_ratio"] = hidden_ratio;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_heads"] = num_heads;
  j["num_kv_heads"] = num_kv_heads;
  j["feature_map"] = nullptr;
  j["use_short_conv"] = use_short_conv;
  j["conv_size"] = conv_size;
  j["use_output_gate"] = use_output_gate;
  j["clamp_min"] = has_clamp_min ? json(clamp_min) : json(nullptr);
  j["elementwise_affine"] = elementwise_affine;
  j["norm_eps"] = norm_eps;
  j["fuse_norm"] = fuse_norm;
  j["attn"] = nullptr;
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = initializer_range;
  j["use_l2warp"] = false;
  // fla ignores these two; written so that a loom-made file says what loom trained.
  j["gate_logit_normalizer"] = gate_logit_normalizer;
  j["gate_low_rank_dim"] = gate_low_rank_dim;
  return j.dump(2) + "\n";
}

std::vector<GlaConfig::Param> GlaConfig::params() const {
  const int64_t d = hidden_size, Kd = key_dim(), Vd = value_dim(), G = kv_groups();
  const int64_t r = gate_low_rank_dim, W = conv_size;
  std::vector<Param> p;
  p.push_back({"model.embeddings.weight", {vocab_size, d}});
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    const std::string l = str_cat("model.layers.", i, ".");
    p.push_back({l + "attn_norm.weight", {d}});
    p.push_back({l + "attn.q_proj.weight", {Kd, d}});
    p.push_back({l + "attn.k_proj.weight", {Kd / G, d}});
    p.push_back({l + "attn.v_proj.weight", {Vd / G, d}});
    if (use_output_gate) p.push_back({l + "attn.g_proj.weight", {Vd, d}});
    p.push_back({l + "attn.gk_proj.0.weight", {r, d}});
    p.push_back({l + "attn.gk_proj.1.weight", {Kd / G, r}});
    p.push_back({l + "attn.gk_proj.1.bias", {Kd / G}});
    if (elementwise_affine)
      p.push_back({l + "attn." + output_norm_name() + ".weight", {head_v_dim()}});
    p.push_back({l + "attn.o_proj.weight", {d, Vd}});
    if (use_short_conv) {
      p.push_back({l + "attn.q_conv1d.weight", {Kd, 1, W}});
      p.push_back({l + "attn.k_conv1d.weight", {Kd / G, 1, W}});
      p.push_back({l + "attn.v_conv1d.weight", {Vd / G, 1, W}});
    }
    p.push_back({l + "mlp_norm.weight", {d}});
    p.push_back({l + "mlp.gate_proj.weight", {intermediate_size, d}});
    p.push_back({l + "mlp.up_proj.weight", {intermediate_size, d}});
    p.push_back({l + "mlp.down_proj.weight", {d, intermediate_size}});
  }
  p.push_back({"model.norm.weight", {d}});
  if (!tie_word_embeddings) p.push_back({"lm_head.weight", {vocab_size, d}});
  return p;
}

int64_t GlaConfig::num_params() const {
  int64_t n = 0;
  for (const Param& p : params()) {
    int64_t e = 1;
    for (int64_t s : p.shape) e *= s;
    n += e;
  }
  return n;
}

double GlaConfig::flops_per_token(int64_t) const {
  const int64_t V = vocab_size, d = hidden_size;
  const int64_t n = num_params() - V * d + (tie_word_embeddings ? V * d : 0);
  return 6.0 * double(n) + 12.0 * double(num_hidden_layers) * double(num_heads) *
                               double(head_k_dim()) * double(head_v_dim());
}

}  // namespace loom
