// The `loom` command line: dispatches to the subcommands of DESIGN.md.
#include <cstdio>
#include <exception>
#include <string>

#include "apps/commands.hpp"
#include "core/error.hpp"

namespace {

const char* kUsage =
    "usage: loom <command> [args]\n"
    "commands:\n"
    "  train --config FILE [--section.key=value ...] [--print-config]\n"
    "      train a model on token shards (checkpoints, resume, validation, JSONL metrics)\n"
    "  bench step --config FILE [--json] [--section.key=value ...]\n"
    "      time forward+backward+optimizer steps: tokens/s, TFLOP/s, MFU, peak memory\n"
    "  tokenize --input FILE... --output DIR (--tokenizer FILE | --train-vocab N\n"
    "           --save-tokenizer FILE) [--val-fraction F] [--shard-tokens N]\n"
    "      text or JSONL -> token shards, tokenizer.json and meta.json in DIR\n"
    "  generate --checkpoint DIR --prompt TEXT [--max-tokens N] [--temperature T] [--top-p P]\n"
    "           [--seed S] [--tokenizer FILE]\n"
    "      sample text from a checkpoint (KV cache)\n"
    "  plot METRICS.jsonl [MORE.jsonl ...] --output FILE.(svg|png) [--title T] [--log-y]\n"
    "      loss curves of one or several runs, train and validation\n"
    "  info [--json] [--peak-seconds S]\n"
    "      version, CPU and ISA tiers, bf16 GEMM path, MPI, threads, measured GEMM peaks\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  loom::Args args(argv + 2, argv + argc);
  try {
    if (cmd == "bench") return loom::bench_command(args);
    if (cmd == "train") return loom::train_command(args);
    if (cmd == "tokenize") return loom::tokenize_command(args);
    if (cmd == "generate") return loom::generate_command(args);
    if (cmd == "plot") return loom::plot_command(args);
    if (cmd == "info") return loom::info_command(args);
    std::fprintf(stderr, "loom: unknown command '%s'\n%s", cmd.c_str(), kUsage);
    return 2;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "loom %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom %s: internal error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
