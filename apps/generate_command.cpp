// `loom generate`: loads a checkpoint (a loom checkpoint directory, the root of a run's
// checkpoints, or a Hugging Face model directory), encodes the prompt and samples a continuation
// with the KV-cache inference path, printing each token as it is drawn.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "data/tokenizer.hpp"
#include "model/gla.hpp"
#include "model/gla_inference.hpp"
#include "model/llama.hpp"
#include "model/llama_inference.hpp"
#include "model/model_config.hpp"
#include "model/moe.hpp"
#include "model/moe_inference.hpp"
#include "model/safetensors.hpp"
#include "ops/devices.hpp"
#include "train/checkpoint.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;

const char* kGenerateUsage =
    "usage: loom generate --checkpoint DIR --prompt TEXT [--max-tokens N (100)]\n"
    "         [--temperature T (0.8)] [--top-p P (0.95)] [--seed S] [--tokenizer FILE]\n"
    "         [--dtype float32|bfloat16] [--device auto|cpu|cuda] [--no-bos] [--no-verify]\n"
    "  DIR: a checkpoint (config.json + model.safetensors), a directory of step-* checkpoints\n"
    "  (the latest complete one is used), or a Hugging Face model directory.\n"
    "  The prompt is preceded by <|begin_of_text|>, or by the end-of-text token that separates\n"
    "  documents when the vocabulary has no begin token (--no-bos: neither). Without --seed the\n"
    "  seed is random (printed on stderr). --dtype bfloat16 runs the GEMMs in bf16.\n"
    "  --device auto (the default) runs on GPU 0 where this loom has the CUDA backend and a GPU\n"
    "  is usable, else on the CPU; the weights, the KV cache (GLA: the state) and the logits stay\n"
    "  on the device, and only the sampled token's logits come back.\n"
    "  A loom checkpoint's files are first checked against the checksums it recorded when\n"
    "  saved (--no-verify: not).\n";

struct GenerateOptions {
  std::string checkpoint, prompt, tokenizer, dtype = "float32", device = "auto";
  bool has_prompt = false, bos = true, has_seed = false, verify = true;
  int64_t max_tokens = 100;
  float temperature = 0.8f, top_p = 0.95f;
  uint64_t seed = 0;
};

int64_t parse_int(const std::string& flag, const std::string& v) {
  size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LOOM_CHECK(used == v.size() && !v.empty(), flag, " expects an integer, got '", v, "'");
  return int64_t(x);
}

float parse_float(const std::string& flag, const std::string& v) {
  size_t used = 0;
  float x = 0;
  try {
    x = std::stof(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LOOM_CHECK(used == v.size() && !v.empty(), flag, " expects a number, got '", v, "'");
  return x;
}

GenerateOptions parse_args(const Args& args) {
  GenerateOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], value;
    const size_t eq = flag.find('=');
    bool has_value = false;
    if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_value = true;
    }
    if (flag == "--no-bos") {
      o.bos = false;
      continue;
    }
    if (flag == "--no-verify") {
      o.verify = false;
      continue;
    }
    const bool known = flag == "--checkpoint" || flag == "--prompt" || flag == "--max-tokens" ||
                       flag == "--temperature" || flag == "--top-p" || flag == "--seed" ||
                       flag == "--tokenizer" || flag == "--dtype" || flag == "--device";
    LOOM_CHECK(known, "unknown argument '", args[i], "'\n", kGenerateUsage);
    if (!has_value) {
      LOOM_CHECK(i + 1 < args.size(), flag, " needs a value\n", kGenerateUsage);
      value = args[++i];
    }
    if (flag == "--checkpoint") o.checkpoint = value;
    if (flag == "--prompt") o.prompt = value, o.has_prompt = true;
    if (flag == "--tokenizer") o.tokenizer = value;
    if (flag == "--dtype") o.dtype = value;
    if (flag == "--device") {
      LOOM_CHECK(value == "auto" || value == "cpu" || value == "cuda",
                 "--device: expected auto, cpu or cuda, got '", value, "'");
      o.device = value;
    }
    if (flag == "--max-tokens") o.max_tokens = parse_int(flag, value);
    if (flag == "--temperature") o.temperature = parse_float(flag, value);
    if (flag == "--top-p") o.top_p = parse_float(flag, value);
    if (flag == "--seed") o.seed = uint64_t(parse_int(flag, value)), o.has_seed = true;
  }
  LOOM_CHECK(!o.checkpoint.empty(), "generate needs --checkpoint DIR\n", kGenerateUsage);
  LOOM_CHECK(o.has_prompt, "generate needs --prompt TEXT\n", kGenerateUsage);
  LOOM_CHECK(o.max_tokens >= 0, "--max-tokens must be >= 0, got ", o.max_tokens);
  return o;
}

bool is_model_dir(const fs::path& d) {
  // A loom checkpoint is complete once state.json is written.
  return fs::is_regular_file(d / "config.json") &&
         (fs::is_regular_file(d / "model.safetensors") ||
          fs::is_regular_file(d / "model.safetensors.index.json") ||
          (fs::is_regular_file(d / kShardedIndexName) && fs::is_regular_file(d / "state.json")));
}

// A step directory's number, or -1 for any other name (step-00000100.tmp is a checkpoint still
// being written).
int64_t step_number(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return -1;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(5));
}

// The directory holding the model: DIR itself, or its latest complete step-* checkpoint.
fs::path resolve_checkpoint(const fs::path& dir) {
  LOOM_CHECK(fs::is_directory(dir), "checkpoint directory ", dir.string(), " does not exist");
  if (is_model_dir(dir)) return dir;
  std::vector<std::pair<int64_t, fs::path>> steps;
  for (const auto& e : fs::directory_iterator(dir)) {
    const int64_t s = step_number(e.path().filename().string());
    if (s >= 0 && e.is_directory()) steps.push_back({s, e.path()});
  }
  std::sort(steps.rbegin(), steps.rend());
  for (const auto& [s, p] : steps)
    if (is_model_dir(p)) return p;
  fail("no model in ", dir.string(),
       ": expected config.json with model.safetensors (or model.safetensors.index.json, or a loom "
       "checkpoint's loom.index.json and state.json), or "
       "step-* checkpoint directories holding them",
       steps.empty() ? "" : " (the step-* directories found are incomplete)");
}

}  // namespace

int generate_command(const Args& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::fputs(kGenerateUsage, stdout);
      return 0;
    }
  const GenerateOptions o = parse_args(args);
  // Without --seed every run draws differently; the seed is printed so a run can be repeated.
  // The sampler checks its settings before anything is loaded.
  const uint64_t seed =
      o.has_seed ? o.seed
                 : (uint64_t(std::random_device{}()) << 32) ^ uint64_t(std::random_device{}());
  Sampler sampler(seed, o.temperature, o.top_p);
  const DType compute = dtype_from_name(o.dtype);
  const fs::path root(o.checkpoint);
  const fs::path dir = resolve_checkpoint(root);
  // A loom checkpoint's files (weights, config, tokenizer) against the checksums it recorded
  // when saved, before any is read; a Hugging Face directory records none.
  if (o.verify) {
    const std::string note = verify_checkpoint(dir.string());
    if (!note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  }

  fs::path tok_path = o.tokenizer;
  if (tok_path.empty()) {
    tok_path = dir / "tokenizer.json";
    if (!fs::exists(tok_path) && fs::exists(root / "tokenizer.json"))
      tok_path = root / "tokenizer.json";
    LOOM_CHECK(fs::exists(tok_path), "no tokenizer: ", (dir / "tokenizer.json").string(),
               " does not exist; pass --tokenizer FILE");
  }
  LOOM_CHECK(fs::exists(tok_path), "tokenizer file ", tok_path.string(), " does not exist");
  const Tokenizer tok = Tokenizer::load(tok_path.string());

  const ModelConfig config = ModelConfig::from_file((dir / "config.json").string());
  LOOM_CHECK(tok.vocab_size() <= config.vocab_size(), "the tokenizer ", tok_path.string(), " has ",
             tok.vocab_size(), " ids but the model's vocab_size is ", config.vocab_size());

  std::vector<int32_t> ids = tok.encode(o.prompt);
  LOOM_CHECK(!ids.empty(), "the prompt encodes to no tokens; give a non-empty --prompt");
  // A document starts after <|begin_of_text|> (Llama 3) or, for vocabularies without it, after
  // the separator the token shards put between documents.
  if (o.bos) {
    int32_t bos = tok.special_id("<|begin_of_text|>");
    if (bos < 0) bos = tok.eot_id();
    if (bos >= 0) ids.insert(ids.begin(), bos);
  }
  const int64_t n_prompt = int64_t(ids.size());
  // GLA has no positions (its recurrent state carries any length); Llama's RoPE is trained up to
  // max_position_embeddings.
  LOOM_CHECK(config.is_gla() || n_prompt + o.max_tokens <= config.max_position_embeddings(),
             "the prompt (", n_prompt, " tokens) plus --max-tokens ", o.max_tokens,
             " exceeds the model's ",
             "max_position_embeddings = ", config.max_position_embeddings());

  auto t_load = std::chrono::steady_clock::now();
  const Device device = ops::start_device(o.device);
  // Whole on this process: a checkpoint saved under any layout (expert parallelism's experts are
  // under their global names) loads into it.
  const std::unique_ptr<Model> model = make_model(config, compute, device);
  model->load_hf(SafetensorsDir(dir.string()));
  // Llama and the mixtures of experts: a KV cache; the last token drawn is never fed back, so the
  // cache needs one position less than it holds. GLA: the recurrent state.
  const int64_t cache_len = n_prompt + std::max<int64_t>(o.max_tokens - 1, 0);
  std::unique_ptr<KvCacheDecoder> cached;
  std::unique_ptr<GlaInference> gla;
  if (config.is_gla())
    gla = std::make_unique<GlaInference>(static_cast<GlaModel&>(*model));
  else if (config.is_moe())
    cached = std::make_unique<MoeInference>(static_cast<MoeModel&>(*model), cache_len);
  else
    cached = std::make_unique<LlamaInference>(static_cast<LlamaModel&>(*model), cache_len);
  auto feed = [&](const int32_t* tokens, int64_t n) {
    return gla ? gla->forward(tokens, n) : cached->forward(tokens, n);
  };
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

  std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
  std::fflush(stdout);
  const int64_t V = config.vocab_size(), V_tok = tok.vocab_size();
  const int32_t eot = tok.eot_id();
  auto t0 = std::chrono::steady_clock::now();
  // The sampler reads the logits on the host: copied there from a GPU once per token.
  Tensor host_logits = device == Device::cpu ? Tensor() : Tensor::empty({V}, DType::f32);
  auto on_host = [&](const Tensor& l) {
    if (device == Device::cpu) return l;
    host_logits.copy_from(l);
    return host_logits;
  };
  Tensor logits = on_host(feed(ids.data(), n_prompt));
  auto t1 = std::chrono::steady_clock::now();
  int64_t generated = 0;
  for (; generated < o.max_tokens; ++generated) {
    float* l = logits.data<float>();
    // Ids past the tokenizer's vocabulary (a padded embedding) cannot be decoded.
    std::fill(l + V_tok, l + V, -std::numeric_limits<float>::infinity());
    const int32_t next = sampler.sample(l, V);
    if (next == eot) break;
    const std::string piece = tok.decode({next});
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    if (generated + 1 < o.max_tokens) logits = on_host(feed(&next, 1));
  }
  auto t2 = std::chrono::steady_clock::now();
  std::fputc('\n', stdout);
  std::fflush(stdout);
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  std::fprintf(stderr,
               "loom generate: %s (%s on %s), seed %llu; loaded in %.2f s; prompt %ld tokens in "
               "%.1f ms (%.0f tokens/s); generated %ld tokens in %.2f s (%.1f tokens/s)\n",
               dir.string().c_str(), std::string(dtype_name(compute)).c_str(),
               device == Device::cpu ? "cpu" : "GPU 0", (unsigned long long)seed, load_s,
               long(n_prompt), prefill_s * 1e3, double(n_prompt) / prefill_s, long(generated),
               decode_s, generated > 0 ? double(generated) / decode_s : 0.0);
  return 0;
}

}  // namespace loom
