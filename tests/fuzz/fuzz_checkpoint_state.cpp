// libFuzzer harness: a checkpoint's state.json (format, version, step, data_step, lr, loss, the
// job config) in an otherwise valid checkpoint of a tiny model, loaded by load_checkpoint; and
// the same bytes as the name of a directory under a checkpoint root (list_checkpoints and
// latest_checkpoint read step numbers from the names).
#include <cstdint>
#include <filesystem>

#include "model/llama.hpp"
#include "model/llama_config.hpp"
#include "tests/fuzz/fuzz_util.hpp"
#include "train/checkpoint.hpp"
#include "train/optimizer.hpp"

namespace {

namespace fs = std::filesystem;

loom::LlamaConfig tiny() {
  loom::LlamaConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.vocab_size = 20;
  return c;
}

struct Fixture {
  loom::LlamaModel model{tiny(), loom::DType::f32};
  loom::AdamW opt{model.units(), loom::AdamWConfig{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f}};
  std::string root = loom::fuzz::scratch_dir() + "/ckpt";
  std::string dir;
  Fixture() {
    model.init_weights(7);
    loom::TrainState st;
    st.step = 0;
    st.config_toml = "[job]\nname = \"fuzz\"\n";
    dir = loom::save_checkpoint(root, model, opt, st);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture fx;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  {
    std::ofstream f(fx.dir + "/state.json", std::ios::binary | std::ios::trunc);
    f.write(in.data(), std::streamsize(in.size()));
  }
  loom::fuzz::expect_loom_errors_only(
      [&] { (void)loom::load_checkpoint(fx.dir, fx.model, fx.opt); });
  // A directory named by the input's first line (when it is a plain name), listed and removed.
  const std::string name(loom::fuzz::split_at(in, "\n").first.substr(0, 64));
  if (!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
      name.find('\0') == std::string::npos) {
    std::error_code ec;
    const fs::path extra = fs::path(fx.root) / name;
    if (fs::create_directory(extra, ec)) {
      loom::fuzz::expect_loom_errors_only([&] {
        (void)loom::list_checkpoints(fx.root);
        (void)loom::latest_checkpoint(fx.root);
      });
      fs::remove_all(extra, ec);
    }
  }
  return 0;
}
