// `loom train --config FILE [--section.key=value ...] [--print-config]`: trains on one process,
// or on every rank of `mpirun -np N loom train ...` (or srun) with the mesh of [parallelism].
// SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 finish the current step, save a checkpoint (when
// checkpoint.dir is set) and exit kExitInterrupted (3); a second one ends the process at once,
// except a repeated SIGTERM (Slurm delivers its SIGTERM twice, see on_stop_signal), which is
// ignored until the process exits once a stop was asked for.
// SIGPIPE is ignored: a closed stdout (`| head`, a `| tee` ended by Ctrl-C) must not kill a run.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "apps/peak_seconds.hpp"
#include "core/error.hpp"
#include "train/config.hpp"
#include "train/launch.hpp"
#include "train/trainer.hpp"

namespace loom {

namespace {

const char* kTrainUsage =
    "usage: loom train --config FILE [--section.key=value ...] [--print-config]\n"
    "                  [--peak-seconds S]\n"
    "  trains the model of [model] on the token shards of [data] path (from `loom tokenize`);\n"
    "  --print-config prints the resolved configuration (TOML) and exits\n"
    "  --peak-seconds S: seconds measuring the device's GEMM peak for the MFU (default 0.2;\n"
    "  0: not measured, MFU 0)\n"
    "  SIGINT (Ctrl-C), SIGTERM, SIGUSR1 or SIGUSR2 finish the step, save a checkpoint and\n"
    "  exit 3; a second signal ends the run at once, except SIGTERM (Slurm sends it twice,\n"
    "  then SIGKILL after KillWait). Under mpirun, `kill -USR1 <mpirun pid>`: mpirun\n"
    "  forwards SIGUSR1/SIGUSR2 to the ranks (its own Ctrl-C/SIGTERM kill them). Under\n"
    "  srun (--mpi=pmix), the ranks are Slurm's tasks: scancel and time limits reach them.\n"
    "  A closed stdout (`| head`) does not end the run: the steps go on in the log files.\n"
    "  exit codes: 0 finished, 1 error, 3 stopped by a signal (saved)\n";

// A signal handler can only reach the trainer through a static: the one piece of global mutable
// state of the command, written by the handler and read by the training loop.
std::atomic<bool> g_stop{false};
static_assert(std::atomic<bool>::is_always_lock_free, "the stop flag is set in a signal handler");

// The first stop signal asks for the agreed stop; a second one means the run does not stop by
// itself (stuck in a collective, a save that hangs): that signal's default action ends the process
// at once. Except SIGTERM: at a time limit or scancel Slurm's step daemon sends each task SIGTERM
// and srun, which gets one too, has the step sent another (SIGCONT, SIGTERM) 0.01-0.2 s later
// (measured, Slurm 22.05); ending the run on that second one lost the save to the time limit.
// Whoever sends SIGTERM sends SIGKILL after a grace (Slurm's KillWait, mpirun's second).
extern "C" void on_stop_signal(int sig) {
  if (g_stop.exchange(true, std::memory_order_relaxed) && sig != SIGTERM) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);  // blocked until this handler returns, then delivered with the default action
  }
}

// The signals that stop a run: SIGINT from a terminal, SIGTERM from kill and schedulers, SIGUSR1
// and SIGUSR2 because mpirun forwards them to the ranks (its own SIGINT/SIGTERM kill the ranks
// about a second later instead) and Slurm's --signal sends them ahead of a time limit.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

// Installs the handlers for the lifetime of the object.
class StopSignals {
 public:
  StopSignals() {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kStopSignals); ++i) sigaction(kStopSignals[i], &sa, &old_[i]);
  }
  ~StopSignals() {
    for (size_t i = 0; i < std::size(kStopSignals); ++i)
      sigaction(kStopSignals[i], &old_[i], nullptr);
    // A stopped run is on its way out, saved, and MPI_Finalize still waits for every rank: Slurm
    // sends more SIGTERMs until its SIGKILL (the job's end signals the step again), and one
    // arriving now turned the exit 3 of a saved run into a death by SIGTERM (measured).
    if (g_stop.load(std::memory_order_relaxed)) ::signal(SIGTERM, SIG_IGN);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_[std::size(kStopSignals)]{};
};

}  // namespace

int train_command(const Args& args) {
  std::string config_path;
  bool print_config = false;
  double peak_seconds = TrainerOptions{}.gemm_peak_seconds;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kTrainUsage, stdout);
      return 0;
    } else if (a == "--print-config") {
      print_config = true;
    } else if (a == "--config") {
      LOOM_CHECK(i + 1 < args.size(), "--config needs a file\n", kTrainUsage);
      config_path = args[++i];
    } else if (a.rfind("--config=", 0) == 0) {
      config_path = a.substr(9);
    } else if (parse_peak_seconds(args, i, peak_seconds, kTrainUsage)) {
      // read into peak_seconds
    } else if (a.rfind("--", 0) == 0) {
      overrides.push_back(a);
    } else {
      fail("unexpected argument '", a, "'\n", kTrainUsage);
    }
  }
  LOOM_CHECK(!config_path.empty(), "missing --config FILE\n", kTrainUsage);
  // For the rest of the process, not just the run: a write to a closed pipe then fails with EPIPE
  // (the progress printer notes it once and stops printing) instead of killing the run before its
  // save, and the exit's flush of what stdout still buffers cannot kill it after the save.
  ::signal(SIGPIPE, SIG_IGN);
  const JobConfig job = load_job_config(config_path, overrides);
  if (print_config) {
    std::fputs(to_toml(job).c_str(), stdout);
    return 0;
  }

  // Before the mesh's groups: MPI is finalized after every group is gone.
  const DistRuntime dist = start_distributed(job, "train");
  g_stop.store(false);
  StopSignals signals;
  TrainerOptions opt;
  opt.out = stdout;
  opt.gemm_peak_seconds = peak_seconds;
  // Open MPI gives each rank a pseudo-terminal for stdout whatever mpirun's own output is (a log
  // file, a pipe), so under a launcher isatty() says nothing: plain lines there.
  opt.tty = ::isatty(STDOUT_FILENO) == 1 && !dist::launched_under_mpi();
  opt.stop = &g_stop;
  opt.mesh = dist.mesh.get();
  std::unique_ptr<FILE, int (*)(FILE*)> rank_log(nullptr, &std::fclose);
  if (job.job.rank_logs) {
    const int rank = dist.mesh ? dist.mesh->world_rank() : 0;
    const std::filesystem::path dir = std::filesystem::path(job.job.dump_dir) / "logs";
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::string path = (dir / ("rank-" + std::to_string(rank) + ".log")).string();
    rank_log.reset(std::fopen(path.c_str(), "w"));
    LOOM_CHECK(rank_log != nullptr, "job.rank_logs: cannot write '", path, "' (job.dump_dir = '",
               job.job.dump_dir, "')", ec ? ": " + ec.message() : "");
    std::setvbuf(rank_log.get(), nullptr, _IOLBF, 0);
    opt.rank_log = rank_log.get();
  }
  try {
    Trainer trainer(job, opt);
    const TrainResult r = trainer.run();
    if (r.interrupted) {
      if (!dist.mesh || dist.mesh->world_rank() == 0)
        std::fprintf(stdout, "stopped by signal at step %lld (exit code %d)\n",
                     (long long)r.final_step, kExitInterrupted);
      std::fflush(stdout);  // before a SIGKILL can lose it (stdout to a file is fully buffered)
      if (rank_log)
        std::fprintf(rank_log.get(), "stopped by signal at step %lld (exit code %d)\n",
                     (long long)r.final_step, kExitInterrupted);
      return kExitInterrupted;
    }
  } catch (const Error& e) {
    // main() prints it to stderr; the rank's own log keeps it too.
    if (rank_log) std::fprintf(rank_log.get(), "error: %s\n", e.what());
    throw;
  }
  return 0;
}

}  // namespace loom
