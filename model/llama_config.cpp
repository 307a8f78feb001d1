#include "model/llama_config.hpp"

#include "core/error.hpp"
#include "core/read_file.hpp"
#include "model/config_json.hpp"

namespace loom {

namespace {

using namespace config_json;

}  // namespace

LlamaConfig LlamaConfig::from_json(const std::string& text, const std::string& source) {
  const json j = parse_object(text, source, "a Hugging Face config.json");

  // A GLA config (model/gla_config.hpp) lacks Llama's fields; say what it is instead.
  LOOM_CHECK(!(j.contains("model_type") && j["model_type"] == "gla"), source,
             ": field 'model_type': \"gla\" is a GLA model (model/gla_config.hpp), not a Llama");
  // A mixture of experts of another model_type would otherwise load as its dense skeleton.
  for (const char* k :
       {"num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"})
    LOOM_CHECK(!present(j, k), source, ": field '", k, "': a mixture of experts, but model_type ",
               j.contains("model_type") ? j["model_type"].dump() : std::string("(none)"),
               " is read as a Llama (the mixtures loom builds: \"qwen3_moe\", \"qwen2_moe\", ",
               "\"mixtral\")");
  LlamaConfig c;
  c.hidden_size = required_int(j, "hidden_size", source);
  c.intermediate_size = required_int(j, "intermediate_size", source);
  c.num_hidden_layers = required_int(j, "num_hidden_layers", source);
  c.num_attention_heads = required_int(j, "num_attention_heads", source);
  c.vocab_size = required_int(j, "vocab_size", source);
  // Absent optional fields take the defaults of transformers' LlamaConfig, so that a file means
  // the same model here as there.
  c.num_key_value_heads = present(j, "num_key_value_heads")
                              ? get_int(j, "num_key_value_heads", source, "num_key_value_heads")
                              : c.num_attention_heads;
  c.max_position_embeddings =
      present(j, "max_position_embeddings")
          ? get_int(j, "max_position_embeddings", source, "max_position_embeddings")
          : 2048;
  c.rms_norm_eps =
      present(j, "rms_norm_eps") ? get_number(j, "rms_norm_eps", source, "rms_norm_eps") : 1e-6;
  c.rope_theta =
      present(j, "rope_theta") ? get_number(j, "rope_theta", source, "rope_theta") : 10000.0;
  read(j, "tie_word_embeddings", source, c.tie_word_embeddings);

  if (present(j, "rope_scaling")) {
    const json& rs = j["rope_scaling"];
    LOOM_CHECK(rs.is_object(), source, ": field 'rope_scaling': expected null or an object, found ",
               found(rs));
    const char* type_key = rs.contains("rope_type") ? "rope_type" : "type";
    LOOM_CHECK(rs.contains(type_key) && rs[type_key].is_string(), source,
               ": field 'rope_scaling.rope_type': expected a string (\"llama3\")");
    const std::string type = rs[type_key].get<std::string>();
    if (type == "llama3") {
      c.rope_scaling.llama3 = true;
      for (const char* k :
           {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
        LOOM_CHECK(present(rs, k), source, ": missing required field 'rope_scaling.", k,
                   "' (expected a positive number for llama3 rope scaling)");
      c.rope_scaling.factor = get_number(rs, "factor", source, "rope_scaling.factor");
      c.rope_scaling.low_freq_factor =
          get_number(rs, "low_freq_factor", source, "rope_scaling.low_freq_factor");
      c.rope_scaling.high_freq_factor =
          get_number(rs, "high_freq_factor", source, "rope_scaling.high_freq_factor");
      c.rope_scaling.original_max_position =
          get_number(rs, "original_max_position_embeddings", source,
                     "rope_scaling.original_max_position_embeddings");
    } else if (type != "default") {  // "default" is plain RoPE, the same as null
      fail(source, ": field 'rope_scaling.", type_key, "': unsupported rope scaling '", type,
           "' (expected \"llama3\", \"default\" or rope_scaling null)");
    }
  }

  // Architecture variants loom does not implement would otherwise load silently and be wrong.
  if (present(j, "hidden_act")) {
    const json& v = j["hidden_act"];
    LOOM_CHECK(v.is_string() && v.get<std::string>() == "silu", source,
               ": field 'hidden_act': expected \"silu\", found ", found(v));
  }
  for (const char* k : {"attention_bias", "mlp_bias"}) {
    if (!present(j, k)) continue;
    const json& v = j[k];
    LOOM_CHECK(v.is_boolean() && !v.get<bool>(), source, ": field '", k,
               "': expected false (loom's Llama has no biases), found ", found(v));
  }

  c.validate(source);
  if (present(j, "head_dim")) {
    int64_t hd = get_int(j, "head_dim", source, "head_dim");
    LOOM_CHECK(hd == c.head_dim(), source, ": field 'head_dim': expected hidden_size / ",
               "num_attention_heads = ", c.head_dim(), ", found ", hd);
  }
  return c;
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  return from_json(read_file(path, "model config"), path);
}

void LlamaConfig::validate(const std::string& source) const {
  auto positive = [&](int64_t v, const char* field) {
    LOOM_CHECK(v > 0, source, ": field '", field, "': expected a positive integer, found ", v);
  };
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(vocab_size, "vocab_size");
  positive(max_position_embeddings, "max_position_embeddings");
  LOOM_CHECK(rms_norm_eps > 0, source, ": field 'rms_norm_eps': expected a positive number, found ",
             rms_norm_eps);
  LOOM_CHECK(rope_theta > 0, source, ": field 'rope_theta': expected a positive number, found ",
             rope_theta);
  LOOM_CHECK(hidden_size % num_attention_heads == 0, source,
             ": field 'num_attention_heads': expected a divisor of hidden_size ", hidden_size,
             ", found ", num_attention_heads);
  LOOM_CHECK(num_attention_heads % num_key_value_heads == 0, source,
             ": field 'num_key_value_heads': expected a divisor of num_attention_heads ",
             num_attention_heads, ", found ", num_key_value_heads);
  LOOM_CHECK(head_dim() % 2 == 0, source,
             ": head_dim = hidden_size / num_attention_heads must be even for RoPE, found ",
             hidden_size, " / ", num_attention_heads, " = ", head_dim());
  if (rope_scaling.llama3) {
    const auto& s = rope_scaling;
    LOOM_CHECK(s.factor > 0, source, ": field 'rope_scaling.factor': expected a positive number, ",
               "found ", s.factor);
    LOOM_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor, source,
               ": fields 'rope_scaling.low_freq_factor' and 'rope_scaling.high_freq_factor': ",
               "expected 0 < low < high, found ", s.low_freq_factor, " and ", s.high_freq_factor);
    LOOM_CHECK(s.original_max_position > 0, source,
               ": field 'rope_scaling.original_max_position_embeddings': expected a positive ",
               "number, found ", s.original_max_position);
  }
}

std::string LlamaConfig::to_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_act"] = "silu";
  j["torch_dtype"] = "float32";
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim();
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  if (rope_scaling.llama3) {
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", rope_scaling.factor},
        {"low_freq_factor", rope_scaling.low_freq_factor},
        {"high_freq_factor", rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", int64_t(rope_scaling.original_max_position)}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  return j.dump(2) + "\n";
}

int64_t LlamaConfig::num_params() const {
  const int64_t d = hidden_size, V = vocab_size, kvd = num_key_value_heads * head_dim();
  const int64_t per_layer = 2 * d * d                    // q, o
                            + 2 * d * kvd                // k, v
                            + 3 * d * intermediate_size  // gate, up, down
                            + 2 * d;                     // attention and MLP norms
  return V * d + num_hidden_layers * per_layer + d + (tie_word_embeddings ? 0 : V * d);
}

int64_t LlamaConfig::num_params_no_embedding() const {
  // The output projection does the work of a V x d GEMM whether or not its matrix is shared.
  const int64_t Vd = vocab_size * hidden_size;
  return num_params() - Vd + (tie_word_embeddings ? Vd : 0);
}

double LlamaConfig::flops_per_token(int64_t T) const {
  return 6.0 * double(num_params_no_embedding()) + 12.0 * double(num_hidden_layers) *
                                                       double(num_attention_heads) *
                                                       double(head_dim()) * double(T);
}

}  // namespace loom
