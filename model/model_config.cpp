#include "model/model_config.hpp"

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/read_file.hpp"
#include "model/config_json.hpp"
#include "model/gla.hpp"
#include "model/llama.hpp"
#include "model/moe.hpp"

namespace loom {

ModelConfig ModelConfig::from_json(const std::string& text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(source, ": not valid JSON (", e.what(), ")");
  }
  if (j.is_object() && j.contains("model_type") && j["model_type"] == "gla")
    return GlaConfig::from_json(text, source);
  if (j.is_object() && j.contains("model_type") &&
      (j["model_type"] == "qwen3_moe" || j["model_type"] == "qwen2_moe" ||
       j["model_type"] == "mixtral"))
    return MoeConfig::from_json(text, source);
  return LlamaConfig::from_json(text, source);
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  return from_json(read_file(path, "model config"), path);
}

const char* ModelConfig::model_type() const {
  if (is_gla()) return "gla";
  if (is_moe()) return std::get<MoeConfig>(c_).model_type();
  return "llama";
}

const LlamaConfig& ModelConfig::llama(const char* what) const {
  LOOM_CHECK(std::holds_alternative<LlamaConfig>(c_), what,
             ": needs a Llama model, the config's model_type is \"", model_type(), "\"");
  return std::get<LlamaConfig>(c_);
}

const GlaConfig& ModelConfig::gla(const char* what) const {
  LOOM_CHECK(is_gla(), what,
             ": needs a GLA model (model_type \"gla\"), the config's model_type is \"",
             model_type(), "\"");
  return std::get<GlaConfig>(c_);
}

const MoeConfig& ModelConfig::moe(const char* what) const {
  LOOM_CHECK(is_moe(), what,
             ": needs a mixture-of-experts model (model_type \"qwen3_moe\" or \"mixtral\"), the "
             "config's model_type is \"",
             model_type(), "\"");
  return std::get<MoeConfig>(c_);
}

namespace {

// The fields every family has: a MoE config's are its base's.
const LlamaConfig& common(const MoeConfig& c) {
  return c.base;
}
template <class C>
const C& common(const C& c) {
  return c;
}

}  // namespace

void ModelConfig::validate(const std::string& source) const {
  std::visit([&](const auto& c) { c.validate(source); }, c_);
}
std::string ModelConfig::to_json() const {
  return std::visit([](const auto& c) { return c.to_json(); }, c_);
}
int64_t ModelConfig::vocab_size() const {
  return std::visit([](const auto& c) { return common(c).vocab_size; }, c_);
}
int64_t ModelConfig::hidden_size() const {
  return std::visit([](const auto& c) { return common(c).hidden_size; }, c_);
}
int64_t ModelConfig::num_hidden_layers() const {
  return std::visit([](const auto& c) { return common(c).num_hidden_layers; }, c_);
}
std::vector<int> ModelConfig::blocks_per_layer() const {
  std::vector<int> out(size_t(num_hidden_layers()), 1);
  if (is_moe())
    for (size_t l = 0; l < out.size(); ++l)
      out[l] += int(std::get<MoeConfig>(c_).sparse(int64_t(l)));
  return out;
}
int64_t ModelConfig::max_position_embeddings() const {
  return std::visit([](const auto& c) { return common(c).max_position_embeddings; }, c_);
}
bool ModelConfig::tie_word_embeddings() const {
  return std::visit([](const auto& c) { return common(c).tie_word_embeddings; }, c_);
}
int64_t ModelConfig::num_params() const {
  return std::visit([](const auto& c) { return c.num_params(); }, c_);
}
double ModelConfig::flops_per_token(int64_t T) const {
  return std::visit([T](const auto& c) { return c.flops_per_token(T); }, c_);
}

std::unique_ptr<Model> make_model(const ModelConfig& config, DType compute, Device device,
                                  ShardLayout shard, TpOptions tp, CpOptions cp,
                                  std::vector<bool> used, EpOptions ep) {
  if (config.is_moe())
    return std::make_unique<MoeModel>(config.moe("make_model"), compute, device, shard, tp, cp,
                                      std::move(used), ep);
  LOOM_CHECK(ep.size() <= 1, "parallelism.ep = ", ep.size(),
             ": expert parallelism splits a mixture of experts' experts; model_type \"",
             config.model_type(), "\" has none (expected parallelism.ep = 1)");
  if (config.is_gla())
    return std::make_unique<GlaModel>(config.gla("make_model"), compute, device, shard, tp, cp,
                                      std::move(used));
  return std::make_unique<LlamaModel>(config.llama("make_model"), compute, device, shard, tp, cp,
                                      std::move(used));
}

}  // namespace loom
