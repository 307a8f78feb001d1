// `loom convert SRC DST [--dtype bfloat16|float32] [--max-shard-bytes N] [--no-verify]`: a loom
// checkpoint to a
// Hugging Face directory, or a Hugging Face directory to a loom checkpoint (the direction is read
// from SRC), streaming one tensor at a time.
#include <cstdio>
#include <filesystem>
#include <string>

#include "apps/commands.hpp"
#include "core/error.hpp"
#include "model/safetensors.hpp"
#include "train/checkpoint.hpp"
#include "train/checkpoint_convert.hpp"

namespace loom {

namespace {

namespace fs = std::filesystem;

const char* kConvertUsage =
    "usage: loom convert SRC DST [--dtype bfloat16|float32] [--max-shard-bytes N] [--no-verify]\n"
    "  SRC a loom checkpoint (a step-N directory, or a checkpoint.dir: its latest) -> DST a\n"
    "      Hugging Face directory (config.json, model.safetensors or model-0000i-of-0000n +\n"
    "      index, tokenizer files), tensors in --dtype (float32), files split beyond\n"
    "      --max-shard-bytes (5 GiB); its files are first checked against the checksums it\n"
    "      recorded when saved (--no-verify: not)\n"
    "  SRC a Hugging Face directory -> DST a loom checkpoint (f32 weights, no optimizer state)\n"
    "  DST must not exist; it appears only complete.\n";

}  // namespace

int convert_command(const Args& args) {
  std::vector<std::string> pos;
  ConvertOptions opt;
  bool has_dtype = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], value;
    if (flag == "--help" || flag == "-h") {
      std::fputs(kConvertUsage, stdout);
      return 0;
    }
    if (flag.rfind("--", 0) != 0) {
      pos.push_back(flag);
      continue;
    }
    if (flag == "--no-verify") {
      opt.verify = false;
      continue;
    }
    const size_t eq = flag.find('=');
    if (eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else {
      LOOM_CHECK(i + 1 < args.size(), flag, " needs a value\n", kConvertUsage);
      value = args[++i];
    }
    if (flag == "--dtype") {
      opt.dtype = dtype_from_name(value);
      LOOM_CHECK(opt.dtype != DType::i32, "--dtype ", value, ": expected bfloat16 or float32\n",
                 kConvertUsage);
      has_dtype = true;
    } else if (flag == "--max-shard-bytes") {
      size_t used = 0;
      long long n = 0;
      try {
        n = std::stoll(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      LOOM_CHECK(used == value.size() && n > 0,
                 "--max-shard-bytes expects a positive integer, got '", value, "'");
      opt.max_shard_bytes = size_t(n);
    } else {
      fail("unknown argument '", args[i], "'\n", kConvertUsage);
    }
  }
  LOOM_CHECK(pos.size() == 2, "convert needs SRC and DST\n", kConvertUsage);
  std::string src = pos[0];
  const std::string& dst = pos[1];
  LOOM_CHECK(fs::is_directory(src), "convert: '", src, "' is not a directory");
  // A checkpoint.dir: its latest complete checkpoint.
  if (!fs::exists(fs::path(src) / kShardedIndexName) &&
      !fs::exists(fs::path(src) / "config.json")) {
    const std::string latest = latest_checkpoint(src);
    LOOM_CHECK(!latest.empty(), "convert: '", src,
               "' is neither a model directory (config.json) nor a checkpoint.dir holding a "
               "complete step-N checkpoint");
    src = latest;
  }
  if (fs::exists(fs::path(src) / kShardedIndexName)) {
    LOOM_CHECK(fs::exists(fs::path(src) / "state.json"), "convert: '", src,
               "' has no state.json: an incomplete checkpoint (a save that was interrupted)");
    const std::string note = export_hugging_face(src, dst, opt);
    if (!note.empty()) std::printf("%s\n", note.c_str());
    std::printf("wrote Hugging Face directory %s from checkpoint %s\n", dst.c_str(), src.c_str());
  } else {
    LOOM_CHECK(!has_dtype,
               "convert: --dtype applies to checkpoint -> Hugging Face only (a loom "
               "checkpoint holds f32 weights)");
    const std::string note = import_hugging_face(src, dst, opt.verify);
    if (!note.empty()) std::printf("%s\n", note.c_str());
    std::printf("wrote loom checkpoint %s from Hugging Face directory %s\n", dst.c_str(),
                src.c_str());
  }
  return 0;
}

}  // namespace loom
