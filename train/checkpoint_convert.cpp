#include "train/checkpoint_convert.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.hpp"
#include "core/read_file.hpp"
#include "model/model_config.hpp"
#include "model/safetensors.hpp"
#include "model/tensor_slice.hpp"
#include "train/checkpoint.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;

// Files of a Hugging Face directory that travel with the weights.
constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json",
                                           "special_tokens_map.json", "tokenizer.model",
                                           "generation_config.json"};

// The tensors of the model `src`'s config.json describes, global names and shapes, in Hugging
// Face's order (the embedding, the layers by number, the final norm, the head); each checked to
// be in `src` with that shape, and `src` to hold no other weights.
std::vector<std::pair<std::string, Shape>> model_tensors(const std::string& src,
                                                         const SafetensorsDir& reader) {
  const std::string config_path = (fs::path(src) / "config.json").string();
  LOOM_CHECK(fs::is_regular_file(config_path), src, ": no config.json (the model's shape)");
  const ModelConfig config = ModelConfig::from_file(config_path);
  // A model on the meta device: the parameters' names and shapes, no memory.
  const std::unique_ptr<Model> meta = make_model(config, DType::f32, Device::meta);
  std::vector<std::pair<std::string, Shape>> out;
  std::map<std::string, Shape> want;
  for (ParamUnit* u : meta->units())
    for (const Param& p : u->params()) {
      out.emplace_back(p.spec.name, p.spec.global_shape());
      want[p.spec.name] = p.spec.global_shape();
    }
  for (const auto& [name, shape] : out) {
    LOOM_CHECK(reader.has(name), src, ": tensor '", name, "' of the model in ", config_path,
               " is missing");
    const Shape got = reader.shape(name);
    LOOM_CHECK(got == shape, src, ": tensor '", name, "' (", reader.where(name), ") has shape ",
               shape_str(got), ", expected ", shape_str(shape), " for the model in ", config_path);
  }
  for (const std::string& n : reader.names()) {
    const bool moment = n.ends_with(".exp_avg") || n.ends_with(".exp_avg_sq");
    LOOM_CHECK(want.count(n) || (moment && reader.sharded()), src, ": tensor '", n, "' (",
               reader.where(n), ") is not a weight of the model in ", config_path);
  }
  return out;
}

// `dst` is written as a sibling DST.tmp.<pid> and renamed when complete; on any error the
// sibling goes and `dst` was never there.
template <class Fn>
void write_dir_atomically(const std::string& dst, Fn&& fill) {
  std::error_code ec;
  LOOM_CHECK(!fs::exists(dst, ec), "'", dst, "' exists; give a directory that does not exist");
  const fs::path final_dir = fs::absolute(dst);
  const fs::path tmp = final_dir.string() + ".tmp." + std::to_string(::getpid());
  fs::create_directories(final_dir.parent_path(), ec);
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  LOOM_CHECK(!ec, "cannot create '", tmp.string(), "': ", ec.message());
  try {
    fill(tmp);
    fs::rename(tmp, final_dir, ec);
    LOOM_CHECK(!ec, "cannot rename '", tmp.string(), "' to '", final_dir.string(),
               "': ", ec.message());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

// Returns each copied file's checksum, by name.
std::map<std::string, uint64_t> copy_tokenizer_files(const fs::path& src, const fs::path& dst) {
  std::map<std::string, uint64_t> sums;
  for (const char* f : kTokenizerFiles)
    if (fs::is_regular_file(src / f))
      sums[f] = write_text_atomic((dst / f).string(), read_file(src / f));
  return sums;
}

}  // namespace

std::string export_hugging_face(const std::string& src, const std::string& dst,
                                const ConvertOptions& opt) {
  LOOM_CHECK(opt.dtype == DType::f32 || opt.dtype == DType::bf16,
             "convert: --dtype must be float32 or bfloat16");
  // A loom checkpoint's files against their checksums before anything is read (a Hugging Face
  // source records none).
  const std::string note = opt.verify ? verify_checkpoint(src) : "";
  const SafetensorsDir reader(src);
  const auto tensors = model_tensors(src, reader);
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(read_file((fs::path(src) / "config.json").string()));
  config["torch_dtype"] = opt.dtype == DType::f32 ? "float32" : "bfloat16";

  // Hugging Face's split: tensors in order, a new file when the next tensor would overflow the
  // current one.
  std::vector<std::vector<size_t>> files;
  size_t total = 0, cur = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t nb = size_t(shape_numel(tensors[i].second)) * dtype_size(opt.dtype);
    if (files.empty() || (cur > 0 && cur + nb > opt.max_shard_bytes)) {
      files.emplace_back();
      cur = 0;
    }
    files.back().push_back(i);
    cur += nb;
    total += nb;
  }
  write_dir_atomically(dst, [&](const fs::path& tmp) {
    // Sorted keys, as transformers writes its index.
    nlohmann::json weight_map = nlohmann::json::object();
    std::vector<float> f32;  // one tensor, for bf16 output
    for (size_t k = 0; k < files.size(); ++k) {
      char name[64];
      if (files.size() == 1)
        std::snprintf(name, sizeof name, "model.safetensors");
      else
        std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, files.size());
      std::vector<TensorHeader> headers;
      for (size_t i : files[k]) {
        headers.push_back({tensors[i].first, opt.dtype, tensors[i].second});
        weight_map[tensors[i].first] = name;
      }
      write_safetensors_streamed((tmp / name).string(), headers, {{"format", "pt"}},
                                 [&](size_t j, Tensor& t) {
                                   const auto& [n, shape] = tensors[files[k][j]];
                                   if (opt.dtype == DType::f32)
                                     return reader.read_f32(n, shape, t.data<float>());
                                   f32.resize(size_t(t.numel()));
                                   reader.read_f32(n, shape, f32.data());
                                   bf16* o = t.data<bf16>();
                                   for (size_t e = 0; e < f32.size(); ++e)
                                     o[e] = float_to_bf16(f32[e]);
                                 });
    }
    if (files.size() > 1) {
      const nlohmann::json index = {{"metadata", {{"total_size", total}}},
                                    {"weight_map", weight_map}};
      write_text_atomic((tmp / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    }
    copy_tokenizer_files(src, tmp);
    // config.json last: a directory without it is no model to any reader.
    write_text_atomic((tmp / "config.json").string(), config.dump(2) + "\n");
  });
  return note;
}

std::string import_hugging_face(const std::string& src, const std::string& dst, bool verify) {
  const std::string note = verify ? verify_checkpoint(src) : "";
  const SafetensorsDir reader(src);
  const auto tensors = model_tensors(src, reader);
  const ModelConfig config = ModelConfig::from_file((fs::path(src) / "config.json").string());
  write_dir_atomically(dst, [&](const fs::path& tmp) {
    // One rank's file holding every tensor whole: each a slice that is the whole box.
    std::vector<TensorHeader> headers;
    nlohmann::ordered_json slices = nlohmann::ordered_json::object();
    for (const auto& [name, shape] : tensors) {
      TensorSlice s;
      s.offsets.assign(shape.size(), 0);
      s.lengths = shape;
      s.end = shape_numel(shape);
      nlohmann::ordered_json j = slice_to_json(s);
      j["shape"] = shape;
      slices[name] = j;
      headers.push_back({name, DType::f32, {s.end}});
    }
    std::map<std::string, uint64_t> sums = copy_tokenizer_files(src, tmp);
    sums[checkpoint_rank_file(0)] = write_safetensors_streamed(
        (tmp / checkpoint_rank_file(0)).string(), headers,
        {{"format", "loom-shard"}, {"step", "0"}, {"slices", slices.dump()}},
        [&](size_t i, Tensor& t) {
          reader.read_f32(tensors[i].first, tensors[i].second, t.data<float>());
        });
    sums["config.json"] =
        write_text_atomic((tmp / "config.json").string(), config.to_json() + "\n");
    // The index after every file it records the checksum of.
    const uint64_t index = write_checkpoint_index(tmp.string(), {0}, 0, false, sums);
    write_checkpoint_state(tmp.string(), TrainState{}, index);
  });
  return note;
}

}  // namespace loom
