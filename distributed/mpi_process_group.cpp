#include "distributed/mpi_process_group.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

namespace loom::dist {

namespace {

const char* getenv_lookup(const char* name) {
  return std::getenv(name);
}

// Open MPI joins the tasks that srun starts through PMIx alone (Debian's 4.1.4 has the ext3x pmix
// component and neither s1 nor s2, the PMI-1/PMI-2 ones); MPICH speaks srun's PMI-2 too.
constexpr bool kPmixOnly =
#ifdef OPEN_MPI
    true;
#else
    false;
#endif

}  // namespace

int srun_step_tasks(const EnvLookup& env) {
  // mpirun's ranks inside an allocation inherit SLURM_* (mpirun starts its daemons with srun),
  // but their world is mpirun's.
  if (!env("SLURM_STEP_ID") || env("OMPI_COMM_WORLD_SIZE")) return 0;
  const char* n = env("SLURM_STEP_NUM_TASKS");
  if (!n) n = env("SLURM_NTASKS");
  return n ? std::max(0, std::atoi(n)) : 0;
}

std::string srun_launch_problem(const EnvLookup& env, bool pmix_only) {
  const int tasks = srun_step_tasks(env);
  if (tasks == 0 || env("PMIX_RANK")) return "";
  const bool pmi2 = env("PMI_RANK") != nullptr;
  if (pmi2 && !pmix_only) return "";
  if (!pmi2 && tasks == 1) return "";  // one task: a process of its own, no MPI needed
  const char* type = env("SLURM_MPI_TYPE");
  const std::string plugin = type ? type : pmi2 ? "pmi2" : "none";
  return str_cat(
      "srun started this step's ", tasks, " task(s) without PMIx (srun's MPI plugin: ", plugin, ")",
      pmix_only ? ", and this loom's MPI library (Open MPI) finds the other tasks through PMIx only"
                : "",
      ": each task would be an MPI world of its own. Launch with `srun --mpi=pmix loom ...` "
      "(`srun --mpi=list` lists this Slurm's plugins; MpiDefault=pmix in slurm.conf makes it the "
      "default), or with `mpirun loom ...` inside the allocation (salloc/sbatch)");
}

bool launched_under_mpi() {
  // Open MPI's mpirun; PMIx launchers (prterun, srun --mpi=pmix); PMI-1/2 (MPICH's hydra,
  // srun --mpi=pmi2); MPICH's hydra.
  for (const char* v :
       {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(v)) return true;
  }
  // srun without an MPI plugin sets only SLURM_*. Several tasks start MPI, so that MpiRuntime
  // says how to launch instead.
  return srun_step_tasks(getenv_lookup) > 1;
}

MpiRuntime::MpiRuntime() : MpiRuntime(nullptr, nullptr) {}

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  // Read before MPI_Init, which may add to the environment.
  const int srun_tasks = initialized ? 0 : srun_step_tasks(getenv_lookup);
  if (!initialized) {
    // Before MPI_Init: Open MPI's own message for a task started without PMIx asks to rebuild
    // Open MPI or Slurm, which is rarely the remedy.
    if (std::string problem = srun_launch_problem(getenv_lookup, kPmixOnly); !problem.empty())
      fail(problem);
    int provided = 0;
    // SERIALIZED: OpenMP threads never call MPI, but a communication thread may one day.
    MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided);
    owns_ = true;
    LOOM_CHECK(provided >= MPI_THREAD_FUNNELED, "the MPI library provides thread level ", provided,
               ", loom needs at least MPI_THREAD_FUNNELED");
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
  // A PMIx or PMI that did not join the tasks (each a singleton, or a world of another size)
  // would train the wrong layout or wait for peers that never come.
  if (srun_tasks > 0 && world_size_ != srun_tasks) {
    if (world_size_ == 1) {  // nobody to wait for: finalize, as the destructor will not run
      MPI_Finalize();
      owns_ = false;
    }
    fail("srun started ", srun_tasks, " tasks but MPI_COMM_WORLD has ", world_size_,
         " rank(s): the MPI library did not join them through srun's MPI plugin (",
         std::getenv("SLURM_MPI_TYPE") ? std::getenv("SLURM_MPI_TYPE") : "none",
         "). Launch with `srun --mpi=pmix loom ...`, or with `mpirun loom ...` inside the "
         "allocation");
  }
}

MpiRuntime::~MpiRuntime() {
  if (!owns_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

WorldPlace mpi_world() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);  // both may be called before MPI_Init and after MPI_Finalize
  WorldPlace w;
  if (initialized && !finalized) {
    MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &w.size);
  }
  return w;
}

void abort_world_if_shared(int code) {
  if (mpi_world().size > 1) MPI_Abort(MPI_COMM_WORLD, code);
}

namespace detail {

void bf16_sum_into(const bf16* in, bf16* inout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    inout[i] = float_to_bf16(bf16_to_float(in[i]) + bf16_to_float(inout[i]));
  }
}

}  // namespace detail

namespace {

void bf16_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
  detail::bf16_sum_into(static_cast<const bf16*>(in), static_cast<bf16*>(inout), *len);
}

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::bf16:
      return MPI_UINT16_T;  // moved as raw bits; reduced by the bf16 op
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::f64:
      return MPI_DOUBLE;
  }
  fail("no MPI datatype for ", dtype_name(d));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// acc[i] = x[i] + acc[i], as MPI_SUM and the bf16 op add (the order of the two does not change
// the result: IEEE addition is commutative). Integers wrap around, as MPI's do.
void add_into(DType d, const void* x, void* acc, int64_t n) {
  switch (d) {
    case DType::f32:
      for (int64_t i = 0; i < n; ++i) {
        static_cast<float*>(acc)[i] += static_cast<const float*>(x)[i];
      }
      break;
    case DType::bf16:
      detail::bf16_sum_into(static_cast<const bf16*>(x), static_cast<bf16*>(acc), n);
      break;
    case DType::i32:
      for (int64_t i = 0; i < n; ++i) {
        static_cast<uint32_t*>(acc)[i] += static_cast<const uint32_t*>(x)[i];
      }
      break;
    case DType::i64:
      for (int64_t i = 0; i < n; ++i) {
        static_cast<uint64_t*>(acc)[i] += static_cast<const uint64_t*>(x)[i];
      }
      break;
    case DType::f64:
      for (int64_t i = 0; i < n; ++i) {
        static_cast<double*>(acc)[i] += static_cast<const double*>(x)[i];
      }
      break;
  }
}

// Sums part[0..p) into one of them in the binomial-tree order of Open MPI's
// MPI_Ireduce_scatter_block (4.1's libnbc: (0+1)+(2+3), ...), so that results are bit for bit
// those of the MPI call it replaces (checked on 2 to 8 ranks). part[readonly] is the caller's
// input: a sum is never written there. Returns where the total is.
char* tree_sum(DType d, std::vector<char*>& part, int readonly, int64_t n) {
  const int p = static_cast<int>(part.size());
  const char* const input = part[readonly];
  for (int s = 1; s < p; s *= 2) {
    for (int i = 0; i + s < p; i += 2 * s) {
      if (part[i] == input) std::swap(part[i], part[i + s]);
      add_into(d, part[i + s], part[i], n);
    }
  }
  return part[0];
}

class MpiProcessGroup;

// One outstanding nonblocking operation: one or more MPI requests. Holds its tensors so that their
// storage outlives the operation even if the caller drops them.
class MpiWork final : public Work {
 public:
  MpiWork(MpiProcessGroup& g, const char* op, int peer, size_t bytes, Tensor a, Tensor b)
      : g_(g), op_(op), peer_(peer), bytes_(bytes), a_(std::move(a)), b_(std::move(b)) {}
  ~MpiWork() override {
    // MPI may still write into the buffers: never let them go before it is done.
    if (!done_) wait();
  }

  // A slot for one more request; the Work completes when all of them have.
  MPI_Request* new_request() { return &reqs_.emplace_back(MPI_REQUEST_NULL); }
  // Runs once every request has completed, before the avg division.
  void on_arrival(std::function<void()> f) { on_arrival_ = std::move(f); }
  // Scratch memory that lives until the Work completes.
  char* staging(size_t bytes);
  // Integer arguments that MPI reads until the operation completes (all_to_all_v's counts and
  // displacements): n of them, zeroed.
  int* int_arguments(size_t n) {
    int_args_.assign(n, 0);
    return int_args_.data();
  }
  // For avg: divide this tensor by the group size once the sum has arrived.
  void divide_on_completion(Tensor t) { avg_ = std::move(t); }

  void wait() override;
  bool test() override;

 private:
  bool arrived();
  void finish();
  [[noreturn]] void abort_on_timeout(double waited) const;

  MpiProcessGroup& g_;
  const char* op_;
  int peer_;  // group rank of the peer for send/recv, -1 for collectives
  size_t bytes_;
  Tensor a_, b_, avg_;
  std::vector<MPI_Request> reqs_;
  std::function<void()> on_arrival_;
  std::vector<std::byte> staging_;
  std::vector<int> int_args_;
  bool done_ = false;
};

class MpiProcessGroup final : public ProcessGroup {
 public:
  // Takes ownership of comm.
  MpiProcessGroup(MPI_Comm comm, std::string name)
      : ProcessGroup(std::move(name), comm_rank(comm), world_ranks_of(comm)), comm_(comm) {
    MPI_Op_create(&bf16_sum_op, /*commute=*/1, &bf16_sum_);
    // reduce_scatter's messages: their own communicator, so that no tag of send/recv matches them.
    MPI_Comm_dup(comm_, &rs_comm_);
  }
  ~MpiProcessGroup() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // too late to free anything; the process is ending
    MPI_Op_free(&bf16_sum_);
    MPI_Comm_free(&rs_comm_);
    MPI_Comm_free(&comm_);
  }

  std::string_view backend() const override { return "mpi"; }

  std::unique_ptr<ProcessGroup> split(int color, int key, std::string name) override {
    LOOM_CHECK(color >= 0, "split of ", describe(), ": color ", color, " must be non-negative");
    MPI_Comm sub;
    MPI_Comm_split(comm_, color, key, &sub);
    return std::make_unique<MpiProcessGroup>(sub, std::move(name));
  }

  void record_wait(double s) { add_wait_seconds(s); }

  // Staging buffers are reused: fresh pages cost ~4 ms per MB to fault in on some VMs. Takes the
  // smallest spare that holds `bytes`, else the largest, grown.
  std::vector<std::byte> take_staging(size_t bytes) {
    auto better = [bytes](const auto& a, const auto& b) {
      const bool fa = a.size() >= bytes, fb = b.size() >= bytes;
      return fa != fb ? fa : fa ? a.size() < b.size() : a.size() > b.size();
    };
    std::vector<std::byte> b;
    if (auto it = std::min_element(spare_.begin(), spare_.end(), better); it != spare_.end()) {
      b = std::move(*it);
      spare_.erase(it);
    }
    if (b.size() < bytes) b.resize(bytes);
    return b;
  }
  void give_back_staging(std::vector<std::byte> b) {
    if (!b.empty()) spare_.push_back(std::move(b));
  }

 protected:
  std::unique_ptr<Work> do_all_gather(const Tensor& in, const Tensor& out) override {
    const int n = count_of("all_gather", in, out);
    auto w = make_work("all_gather", -1, in.nbytes(), in, out);
    const void* src =
        in.nbytes() && in.raw() == block_of(out, in.nbytes()) ? MPI_IN_PLACE : in.raw();
    MPI_Iallgather(src, n, mpi_type(in.dtype()), out.raw(), n, mpi_type(out.dtype()), comm_,
                   w->new_request());
    return w;
  }

  // Not MPI_Ireduce_scatter_block: Open MPI's (libnbc) mallocs 2 * in.nbytes of scratch per call,
  // which glibc maps fresh from 32 MB up; faulting it in made 8 MB per rank on 2 ranks take ~140 ms
  // instead of ~6 (docs/decisions/distributed-runtime.md). Here each rank sends every peer its
  // block and sums what it receives (into `out` and reused staging), in the same order as that
  // call.
  std::unique_ptr<Work> do_reduce_scatter(const Tensor& in, const Tensor& out,
                                          ReduceOp op) override {
    const int n = count_of("reduce_scatter", out, in);
    auto w = make_work("reduce_scatter", -1, in.nbytes(), in, out);
    const int p = size(), r = rank();
    const size_t block = out.nbytes();
    char* const src = static_cast<char*>(in.raw());
    // Each rank's contribution to this rank's block: its own is read in place; the tree's total
    // lands in the buffer of part 0 (part 1 when this is rank 0), which is `out`.
    std::vector<char*> part(p);
    char* stage = w->staging(size_t(std::max(p - 2, 0)) * block);
    for (int q = 0; q < p; ++q) {
      part[q] = q == r                  ? src + r * block
                : q == (r == 0 ? 1 : 0) ? static_cast<char*>(out.raw())
                                        : std::exchange(stage, stage + block);
    }
    const MPI_Datatype type = mpi_type(in.dtype());
    for (int q = 0; q < p; ++q) {
      if (q == r) continue;
      MPI_Irecv(part[q], n, type, q, 0, rs_comm_, w->new_request());
      MPI_Isend(src + q * block, n, type, q, 0, rs_comm_, w->new_request());
    }
    w->on_arrival([d = in.dtype(), part = std::move(part), r, n, out, block]() mutable {
      char* total = tree_sum(d, part, r, n);
      if (total != out.raw()) std::memcpy(out.raw(), total, block);  // a group of one
    });
    if (op == ReduceOp::avg) w->divide_on_completion(out);
    return w;
  }

  std::unique_ptr<Work> do_all_reduce(const Tensor& t, ReduceOp op) override {
    const int n = count_of("all_reduce", t, t);
    auto w = make_work("all_reduce", -1, t.nbytes(), t, Tensor());
    MPI_Iallreduce(MPI_IN_PLACE, t.raw(), n, mpi_type(t.dtype()), sum_op(t.dtype()), comm_,
                   w->new_request());
    if (op == ReduceOp::avg) w->divide_on_completion(t);
    return w;
  }

  std::unique_ptr<Work> do_broadcast(const Tensor& t, int root) override {
    const int n = count_of("broadcast", t, t);
    auto w = make_work("broadcast", -1, t.nbytes(), t, Tensor());
    MPI_Ibcast(t.raw(), n, mpi_type(t.dtype()), root, comm_, w->new_request());
    return w;
  }

  std::unique_ptr<Work> do_send(const Tensor& t, int peer, int tag) override {
    const int n = count_of("send", t, t);
    auto w = make_work("send", peer, t.nbytes(), t, Tensor());
    MPI_Isend(t.raw(), n, mpi_type(t.dtype()), peer, tag, comm_, w->new_request());
    return w;
  }

  std::unique_ptr<Work> do_recv(const Tensor& t, int peer, int tag) override {
    const int n = count_of("recv", t, t);
    auto w = make_work("recv", peer, t.nbytes(), t, Tensor());
    MPI_Irecv(t.raw(), n, mpi_type(t.dtype()), peer, tag, comm_, w->new_request());
    return w;
  }

  std::unique_ptr<Work> do_all_to_all(const Tensor& in, const Tensor& out) override {
    const int n = count_of("all_to_all", in, out) / size();
    auto w = make_work("all_to_all", -1, in.nbytes(), in, out);
    MPI_Ialltoall(in.raw(), n, mpi_type(in.dtype()), out.raw(), n, mpi_type(out.dtype()), comm_,
                  w->new_request());
    return w;
  }

  // Counts and displacements in elements, which MPI takes as int: both tensors' element counts
  // (the last displacement plus its count) must fit, as count_of checks.
  std::unique_ptr<Work> do_all_to_all_v(const Tensor& in, std::span<const int64_t> send_rows,
                                        const Tensor& out, std::span<const int64_t> recv_rows,
                                        int64_t row_elements) override {
    count_of("all_to_all_v", in, out);
    count_of("all_to_all_v", out, in);
    auto w = make_work("all_to_all_v", -1, in.nbytes(), in, out);
    const size_t p = size_t(size());
    int* args = w->int_arguments(4 * p);
    int *send_counts = args, *send_displs = args + p, *recv_counts = args + 2 * p,
        *recv_displs = args + 3 * p;
    int64_t send_at = 0, recv_at = 0;
    for (size_t q = 0; q < p; ++q) {
      send_counts[q] = static_cast<int>(send_rows[q] * row_elements);
      send_displs[q] = static_cast<int>(send_at);
      send_at += send_rows[q] * row_elements;
      recv_counts[q] = static_cast<int>(recv_rows[q] * row_elements);
      recv_displs[q] = static_cast<int>(recv_at);
      recv_at += recv_rows[q] * row_elements;
    }
    MPI_Ialltoallv(in.raw(), send_counts, send_displs, mpi_type(in.dtype()), out.raw(), recv_counts,
                   recv_displs, mpi_type(out.dtype()), comm_, w->new_request());
    return w;
  }

  std::unique_ptr<Work> do_barrier() override {
    auto w = make_work("barrier", -1, 0, Tensor(), Tensor());
    MPI_Ibarrier(comm_, w->new_request());
    return w;
  }

 private:
  static int comm_rank(MPI_Comm comm) {
    int r = 0;
    MPI_Comm_rank(comm, &r);
    return r;
  }

  static std::vector<int> world_ranks_of(MPI_Comm comm) {
    MPI_Group group, world;
    MPI_Comm_group(comm, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int n = 0;
    MPI_Group_size(group, &n);
    std::vector<int> ranks(n), out(n);
    for (int i = 0; i < n; ++i) ranks[i] = i;
    MPI_Group_translate_ranks(group, n, ranks.data(), world, out.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    return out;
  }

  std::unique_ptr<MpiWork> make_work(const char* op, int peer, size_t bytes, const Tensor& a,
                                     const Tensor& b) {
    return std::make_unique<MpiWork>(*this, op, peer, bytes, a, b);
  }

  // The MPI count of t; `other` is the collective's other tensor, checked for its device.
  int count_of(const char* op, const Tensor& t, const Tensor& other) const {
    LOOM_CHECK(t.numel() <= INT_MAX, op, " on ", describe(), ": ", t.numel(),
               " elements exceed the MPI count limit of ", INT_MAX, " per call");
    for (const Tensor* x : {&t, &other}) {
      LOOM_CHECK(x->device() == Device::cpu, op, " on ", describe(), ": a tensor is on ",
                 device_name(x->device()), ", the MPI backend needs cpu tensors");
    }
    return static_cast<int>(t.numel());
  }

  const void* block_of(const Tensor& out, size_t block_bytes) const {
    return static_cast<const char*>(out.raw()) + rank() * block_bytes;
  }

  MPI_Op sum_op(DType d) const { return d == DType::bf16 ? bf16_sum_ : MPI_SUM; }

  MPI_Comm comm_, rs_comm_ = MPI_COMM_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL;
  std::vector<std::vector<std::byte>> spare_;  // staging buffers of completed reduce_scatters
};

char* MpiWork::staging(size_t bytes) {
  if (bytes == 0) return nullptr;
  staging_ = g_.take_staging(bytes);
  return reinterpret_cast<char*>(staging_.data());
}

bool MpiWork::arrived() {
  int flag = 0;
  MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE);
  if (flag && on_arrival_) std::exchange(on_arrival_, nullptr)();
  return flag;
}

void MpiWork::finish() {
  done_ = true;
  if (avg_.defined()) divide_inplace(avg_, g_.size());
  a_ = b_ = avg_ = Tensor();
  g_.give_back_staging(std::move(staging_));
}

bool MpiWork::test() {
  if (done_) return true;
  if (arrived()) finish();
  return done_;
}

void MpiWork::wait() {
  if (done_) return;
  const auto t0 = std::chrono::steady_clock::now();
  // Collectives advance only inside MPI calls, so poll often at first (yielding the core to the
  // other ranks on an oversubscribed node), then back off to sleeps growing to 1 ms so that a
  // long wait costs no CPU.
  constexpr double kYieldPhase = 1e-3;
  auto sleep = std::chrono::microseconds(2);
  const double limit = g_.timeout_seconds();
  for (;;) {
    if (arrived()) break;
    const double waited = seconds_since(t0);
    if (waited > limit) abort_on_timeout(waited);
    if (waited < kYieldPhase) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
    }
  }
  g_.record_wait(seconds_since(t0));
  finish();
}

void MpiWork::abort_on_timeout(double waited) const {
  std::string peers;
  if (peer_ >= 0) {
    peers = str_cat(g_.world_ranks()[peer_]);
  } else {
    for (int i = 0; i < g_.size(); ++i) {
      if (i == g_.rank()) continue;
      peers += str_cat(peers.empty() ? "" : ", ", g_.world_ranks()[i]);
    }
  }
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.2f", waited);
  const std::string line = str_cat(
      "loom: TIMEOUT in ", op_, " on ", g_.describe(), ": world rank ", g_.world_rank(), " waited ",
      secs, " s (limit ", g_.timeout_seconds(), " s) for peers [", peers, "] (world ranks), ",
      bytes_, " bytes", context().empty() ? std::string() : str_cat(" (", context(), ")"),
      "; aborting the job");
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return; this only tells the compiler so
}

}  // namespace

std::unique_ptr<ProcessGroup> make_mpi_world_group(std::string name) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  LOOM_CHECK(initialized, "make_mpi_world_group: MPI is not initialized (create an MpiRuntime)");
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  return std::make_unique<MpiProcessGroup>(comm, std::move(name));
}

}  // namespace loom::dist
