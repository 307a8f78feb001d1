#pragma once
// The model a Hugging Face config.json describes, chosen by its model_type: "gla" is a GLA model
// (model/gla_config.hpp), "qwen3_moe" and "mixtral" a mixture of experts (model/moe_config.hpp),
// anything else is read as a Llama (model/llama_config.hpp, which names what it does not
// support). make_model builds the Model of any.
#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "model/gla_config.hpp"
#include "model/llama_config.hpp"
#include "model/model.hpp"
#include "model/moe_config.hpp"

namespace loom {

class ModelConfig {
 public:
  ModelConfig(const LlamaConfig& c) : c_(c) {}  // NOLINT: a Llama config is a model config
  ModelConfig(const GlaConfig& c) : c_(c) {}    // NOLINT
  ModelConfig(const MoeConfig& c) : c_(c) {}    // NOLINT
  // Throws loom::Error naming `source` (the path) and the field, as the family's reader does.
  static ModelConfig from_json(const std::string& text, const std::string& source);
  static ModelConfig from_file(const std::string& path);

  bool is_gla() const { return std::holds_alternative<GlaConfig>(c_); }
  bool is_moe() const { return std::holds_alternative<MoeConfig>(c_); }
  const char* model_type() const;
  // The family's config; loom::Error naming `what` (the caller) for another family.
  const LlamaConfig& llama(const char* what) const;
  const GlaConfig& gla(const char* what) const;
  const MoeConfig& moe(const char* what) const;
  // A mixture of experts' config to set loom's options on (the job's [moe]); nullptr for another
  // family.
  MoeConfig* moe_or_null() { return std::get_if<MoeConfig>(&c_); }

  void validate(const std::string& source) const;
  std::string to_json() const;
  int64_t vocab_size() const;
  int64_t hidden_size() const;
  int64_t num_hidden_layers() const;
  // The model's blocks (units) of each layer, in order: one, or a mixture of experts' sparse
  // layer's two (its attention block, then its experts block). A pipeline splits the layers, so
  // that the two halves of a layer stay on one stage.
  std::vector<int> blocks_per_layer() const;
  int64_t max_position_embeddings() const;
  bool tie_word_embeddings() const;
  int64_t num_params() const;
  double flops_per_token(int64_t T) const;

 private:
  std::variant<LlamaConfig, GlaConfig, MoeConfig> c_;
};

// The model of `config` (LlamaModel, GlaModel or MoeModel), its units allocated on `device`,
// sharded by `shard`, split by `tp`, its micro-batches split by `cp`.
// `ep`: expert parallelism (a mixture of experts only).
std::unique_ptr<Model> make_model(const ModelConfig& config, DType compute,
                                  Device device = Device::cpu, ShardLayout shard = {},
                                  TpOptions tp = {}, CpOptions cp = {}, std::vector<bool> used = {},
                                  EpOptions ep = {});

}  // namespace loom
