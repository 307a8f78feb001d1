// Times loom's tokenizer on the parity fixtures (tests/tokenizer/setup.sh DIR makes them):
//   tokenizer_bench DIR
// For r50k, cl100k, o200k and Llama 3: load time, encode MB/s on the Bible and on the Unicode
// text (median of 3), whether the ids equal the reference ids; then BPE training of a 4096
// vocabulary on the Bible. bench/tokenizer_bench.sh runs this and the Node references together.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "data/tokenizer.hpp"

namespace {

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f, "cannot open ", path, " (run tests/tokenizer/setup.sh DIR first)");
  return std::string(std::istreambuf_iterator<char>(f), {});
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
double median3(F&& f) {
  double t[3];
  for (double& x : t) {
    const double t0 = now();
    f();
    x = now() - t0;
  }
  std::sort(t, t + 3);
  return t[1];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FIXTURE_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  try {
    const auto meta = nlohmann::json::parse(read(dir + "/meta.json"));
    const std::string texts[2] = {read(dir + "/bible.txt"), read(dir + "/unicode.txt")};
    const char* text_names[2] = {"bible", "unicode"};
    struct V {
      const char* name;
      std::string file;
    };
    const V vocabs[] = {{"r50k", dir + "/r50k.tiktoken"},
                        {"gpt2", dir + "/gpt2/encoder.json"},
                        {"cl100k", dir + "/cl100k.tiktoken"},
                        {"o200k", dir + "/o200k.tiktoken"},
                        {"llama3", dir + "/llama3/tokenizer.json"}};
    std::printf("%-7s %-8s %9s %10s %9s %s\n", "vocab", "text", "load_s", "tokens", "MB/s",
                "ids==reference");
    bool all_ok = true;
    for (const V& v : vocabs) {
      const std::string ref_name = std::string(v.name) == "gpt2" ? "r50k" : v.name;
      std::unordered_map<std::string, int32_t> specials;
      if (meta["specials"].contains(ref_name) && std::string(v.name) != "gpt2") {
        specials = meta["specials"][ref_name].get<std::unordered_map<std::string, int32_t>>();
      }
      const std::string pattern =
          std::string(v.name) == "gpt2" ? "" : meta["patterns"][ref_name].get<std::string>();
      loom::Tokenizer tk;
      const double t0 = now();
      tk = loom::Tokenizer::load(v.file, pattern, specials);
      const double load_s = now() - t0;
      for (int ti = 0; ti < 2; ++ti) {
        std::vector<int32_t> ids;
        const double s = median3([&] { ids = tk.encode(texts[ti]); });
        const std::string ref = read(dir + "/ids/" + ref_name + "." + text_names[ti] + ".i32");
        const bool ok =
            ref.size() == ids.size() * 4 &&
            std::equal(ids.begin(), ids.end(), reinterpret_cast<const int32_t*>(ref.data()));
        all_ok = all_ok && ok;
        std::printf("%-7s %-8s %9.3f %10zu %9.2f %s\n", v.name, text_names[ti], load_s, ids.size(),
                    texts[ti].size() / 1e6 / s, ok ? "yes" : "NO");
      }
    }
    for (int64_t vs : {4096, 8192}) {
      loom::Tokenizer tr;
      const double s = median3([&] { tr = loom::Tokenizer::train(texts[0], vs); });
      const size_t n = tr.encode(texts[0]).size();
      std::printf(
          "train vocab %lld on the Bible (%.1f MB): %.3f s (median of 3); %.3f bytes/token\n",
          static_cast<long long>(vs), texts[0].size() / 1e6, s,
          double(texts[0].size()) / double(n));
    }
    return all_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenizer_bench: %s\n", e.what());
    return 1;
  }
}
