// The `loom` command line: dispatches to the subcommands of docs/design.md "The command line".
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "apps/commands.hpp"
#include "core/error.hpp"
#include "distributed/mpi_process_group.hpp"

namespace {

const char* kUsage =
    "usage: loom <command> [args]\n"
    "commands:\n"
    "  train --config FILE [--section.key=value ...] [--print-config] [--peak-seconds S]\n"
    "      train a model on token shards (checkpoints, resume, validation, JSONL metrics)\n"
    "  bench step --config FILE [--json] [--section.key=value ...]\n"
    "      time forward+backward+optimizer steps: tokens/s, TFLOP/s, MFU, peak memory\n"
    "  bench attention [--device auto|cpu|cuda] [--dims 64,128] [--seq 2048,4096,8192] [--json]\n"
    "      the device's attention kernels alone: forward and backward ms and TFLOP/s\n"
    "  tokenize --input PATH... --output DIR (--tokenizer FILE | --train-vocab N\n"
    "           --save-tokenizer FILE) [--val-fraction F] [--shard-tokens N]\n"
    "      text or JSONL (files, directories, globs; .gz, .zst) -> token shards,\n"
    "      tokenizer.json and meta.json in DIR\n"
    "  generate --checkpoint DIR --prompt TEXT [--max-tokens N] [--temperature T] [--top-p P]\n"
    "           [--seed S] [--tokenizer FILE]\n"
    "      sample text from a checkpoint (KV cache)\n"
    "  convert SRC DST [--dtype bfloat16|float32]\n"
    "      a loom checkpoint to a Hugging Face directory, or the other way\n"
    "  plot METRICS.jsonl [MORE.jsonl ...] --output FILE.(png|svg|pdf) [--title T]\n"
    "       [--panels loss,throughput,mfu,memory] [--log-y]\n"
    "      one or several runs' loss (train and validation), tokens/s, MFU and peak memory\n"
    "  plan --config FILE --world N [--ranks all|R,R...] [--hardware NAME|FILE] [--json]\n"
    "       [--section.key=value ...]\n"
    "      one rank's real step on the meta device: per-rank memory, bytes per group, time\n"
    "  plan calibrate [--output FILE] [--quick]\n"
    "      measure this machine (GEMMs, kernels, memory, MPI) into a hardware model file\n"
    "  info [--json] [--peak-seconds S] | info --tiers\n"
    "      version, CPU and ISA tiers, bf16 GEMM path, MPI, threads, measured GEMM peaks\n"
    "  help [COMMAND]\n"
    "      this text, or COMMAND's own (its --help)\n"
    "exit codes: 0 done, 1 error, 2 usage, 3 a training run stopped by a signal (and saved)\n";

// Prints the error that ends this process (with its world rank when there are several) and,
// when it is one rank of several, ends the whole job at once: its peers may be waiting for it in
// a collective, and would wait there until the collective timeout. Returns 1 otherwise.
int end_with_error(const std::string& cmd, const char* kind, const char* what) {
  const loom::dist::WorldPlace world = loom::dist::mpi_world();
  const std::string rank = world.size > 1 ? loom::str_cat("rank ", world.rank, ": ") : "";
  std::fprintf(stderr, "%sloom %s: %s: %s\n", rank.c_str(), cmd.c_str(), kind, what);
  std::fflush(stderr);  // the line must be out before MPI_Abort ends the process
  loom::dist::abort_world_if_shared(1);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  loom::Args args(argv + 2, argv + argc);
  // `loom help COMMAND` is `loom COMMAND --help`, as installed tools are asked.
  if (cmd == "help") {
    if (args.empty()) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    cmd = args[0];
    args = {"--help"};
  }
  // The commands that can run on several ranks start MPI here rather than inside the command, so
  // that it outlives the command: an error thrown on one rank then unwinds the command without
  // reaching MPI_Finalize (which waits for every rank) and arrives below with MPI still up, to
  // end the job. start_distributed() finds MPI initialized and leaves finalizing to this one.
  std::optional<loom::dist::MpiRuntime> mpi;
  try {
    if ((cmd == "train" || cmd == "bench" || cmd == "plan") && loom::dist::launched_under_mpi())
      mpi.emplace();
    if (cmd == "bench") return loom::bench_command(args);
    if (cmd == "train") return loom::train_command(args);
    if (cmd == "tokenize") return loom::tokenize_command(args);
    if (cmd == "generate") return loom::generate_command(args);
    if (cmd == "plot") return loom::plot_command(args);
    if (cmd == "convert") return loom::convert_command(args);
    if (cmd == "info") return loom::info_command(args);
    if (cmd == "plan") return loom::plan_command(args);
    std::fprintf(stderr, "loom: unknown command '%s'\n%s", cmd.c_str(), kUsage);
    return 2;
  } catch (const loom::Error& e) {
    return end_with_error(cmd, "error", e.what());
  } catch (const std::exception& e) {
    return end_with_error(cmd, "internal error", e.what());
  }
}
