// The single-process backend, argument checks shared by all backends, and the bf16 reduction.
// (Multi-rank behaviour is tested under mpirun by distributed_mpi_test, tests/distributed/mpi/.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>

#include "distributed/mpi_process_group.hpp"
#include "distributed/process_group.hpp"
#include "distributed/sim_process_group.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using namespace loom::dist;

namespace {

Tensor iota_f32(int64_t n, float start) {
  Tensor t = Tensor::empty({n}, DType::f32);
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = start + 0.5f * i;
  return t;
}

std::vector<float> values(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

using loom::test::expect_error;

// Exact sum of two bf16 values (in double, where it is exact), rounded to the nearest bf16 with
// ties to even: an implementation independent of float_to_bf16.
uint16_t bf16_round_reference(double x) {
  if (x == 0) return std::signbit(x) ? 0x8000 : 0;
  int e;
  std::frexp(std::fabs(x), &e);               // |x| = f * 2^e, f in [0.5, 1)
  const double ulp = std::ldexp(1.0, e - 8);  // 8 significant bits
  double q = std::fabs(x) / ulp;
  double fl = std::floor(q);
  const double r = q - fl;
  if (r > 0.5 || (r == 0.5 && std::fmod(fl, 2.0) == 1.0)) fl += 1;
  const float f = static_cast<float>(std::copysign(fl * ulp, x));  // exact: fits 8 bits
  uint32_t u;
  std::memcpy(&u, &f, 4);
  EXPECT_EQ(u & 0xffffu, 0u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

TEST(SingleProcessGroup, CollectivesAreCopiesWithZeroBytes) {
  SingleProcessGroup g("dp_shard", 3);
  EXPECT_EQ(g.name(), "dp_shard");
  EXPECT_EQ(g.rank(), 0);
  EXPECT_EQ(g.size(), 1);
  EXPECT_EQ(g.world_rank(), 3);
  EXPECT_EQ(g.backend(), "single");
  EXPECT_EQ(g.describe(), "group 'dp_shard' (size 1, world ranks [3])");

  Tensor in = iota_f32(37, 1.25f), out = Tensor::zeros({37}, DType::f32);
  g.all_gather(in, out)->wait();
  EXPECT_EQ(values(out), values(in));

  Tensor rs = Tensor::zeros({37}, DType::f32);
  g.reduce_scatter(in, rs, ReduceOp::avg)->wait();
  EXPECT_EQ(values(rs), values(in));

  Tensor ar = iota_f32(5, -2.0f);
  auto before = values(ar);
  auto w = g.all_reduce(ar, ReduceOp::avg);
  EXPECT_TRUE(w->test());
  EXPECT_EQ(values(ar), before);

  g.broadcast(ar, 0)->wait();
  EXPECT_EQ(values(ar), before);

  Tensor a2a = Tensor::zeros({37}, DType::f32);
  g.all_to_all(in, a2a)->wait();
  EXPECT_EQ(values(a2a), values(in));
  g.barrier()->wait();

  EXPECT_EQ(g.counters().calls, 6u);
  EXPECT_EQ(g.counters().bytes_sent, 0u);
  g.reset_counters();
  EXPECT_EQ(g.counters().calls, 0u);
}

TEST(SingleProcessGroup, AllToAllVIsACopyOfTheRowsToItself) {
  SingleProcessGroup g("ep");
  for (DType d : {DType::f32, DType::bf16, DType::i32}) {
    Tensor in = Tensor::empty({5, 3}, d), out = Tensor::zeros({5, 3}, d);
    for (size_t i = 0; i < in.nbytes(); ++i) static_cast<uint8_t*>(in.raw())[i] = uint8_t(i * 7);
    const int64_t rows[] = {5};
    g.all_to_all_v(in, rows, out, rows)->wait();
    EXPECT_EQ(std::memcmp(in.raw(), out.raw(), in.nbytes()), 0) << dtype_name(d);
  }
  // No rows at all, 1-d tensors (rows of one element).
  const int64_t none[] = {0};
  g.all_to_all_v(Tensor::empty({0, 4}, DType::f32), none, Tensor::empty({0, 4}, DType::f32), none)
      ->wait();
  Tensor in = iota_f32(6, 2.0f), out = Tensor::zeros({6}, DType::f32);
  const int64_t six[] = {6};
  g.all_to_all_v(in, six, out, six)->wait();
  EXPECT_EQ(values(out), values(in));
  EXPECT_EQ(g.counters().calls, 5u);
  EXPECT_EQ(g.counters().bytes_sent, 0u);
}

TEST(SingleProcessGroup, InPlaceAllGather) {
  SingleProcessGroup g;
  Tensor out = iota_f32(4, 3.0f);
  auto before = values(out);
  g.all_gather(out, out)->wait();
  EXPECT_EQ(values(out), before);
}

TEST(SingleProcessGroup, SendRecvToSelfInEitherOrder) {
  SingleProcessGroup g;
  Tensor a = iota_f32(7, 1.0f), b = iota_f32(7, 100.0f);
  Tensor ra = Tensor::zeros({7}, DType::f32), rb = Tensor::zeros({7}, DType::f32);
  // Send first: the message is buffered, so later changes to `a` do not show.
  g.send(a, 0, 5)->wait();
  auto sent = values(a);
  a.data<float>()[0] = -1;
  // Receive first (tag 6), then the send completes it.
  auto wb = g.recv(rb, 0, 6);
  EXPECT_FALSE(wb->test());
  g.send(b, 0, 6)->wait();
  EXPECT_TRUE(wb->test());
  wb->wait();
  EXPECT_EQ(values(rb), values(b));
  g.recv(ra, 0, 5)->wait();
  EXPECT_EQ(values(ra), sent);
  EXPECT_EQ(g.counters().bytes_sent, 0u);
}

TEST(SingleProcessGroup, UnmatchedSelfRecvFailsInsteadOfHanging) {
  SingleProcessGroup g("cp");
  Tensor r = Tensor::zeros({3}, DType::f32);
  auto w = g.recv(r, 0, 9);
  expect_error([&] { w->wait(); }, {"recv (tag 9)", "group 'cp'", "no matching send"});
  Tensor wrong = Tensor::zeros({4}, DType::f32);
  expect_error([&] { g.send(wrong, 0, 9); }, {"send on group 'cp'", "expects float32[3]"});
}

TEST(ProcessGroupChecks, MismatchesNameTheCollectiveAndGroup) {
  SingleProcessGroup g("tp", 2);
  Tensor f3 = Tensor::zeros({3}, DType::f32), f4 = Tensor::zeros({4}, DType::f32);
  Tensor b3 = Tensor::zeros({3}, DType::bf16), i3 = Tensor::zeros({3}, DType::i32);
  expect_error([&] { g.all_gather(f3, f4); },
               {"all_gather on group 'tp' (size 1, world ranks [2])", "out float32[4]",
                "expected size * in.numel() = 1 * 3 = 3"});
  expect_error([&] { g.reduce_scatter(f4, f3, ReduceOp::sum); },
               {"reduce_scatter on group 'tp'", "in float32[4] has 4 elements"});
  expect_error([&] { g.all_gather(f3, b3); },
               {"all_gather on group 'tp'", "bfloat16[3]", "same dtype"});
  expect_error([&] { g.all_reduce(i3, ReduceOp::avg); },
               {"all_reduce on group 'tp'", "avg is not supported for int32"});
  expect_error([&] { g.reduce_scatter(i3, Tensor::zeros({3}, DType::i32), ReduceOp::avg); },
               {"reduce_scatter", "avg is not supported for int32"});
  expect_error([&] { g.broadcast(f3, 1); }, {"broadcast on group 'tp'", "root 1"});
  expect_error([&] { g.send(f3, 1, 0); }, {"send on group 'tp'", "peer 1"});
  expect_error([&] { g.recv(f3, -1, 0); }, {"recv on group 'tp'", "peer -1"});
  expect_error([&] { g.send(f3, 0, -2); }, {"send on group 'tp'", "tag -2"});
  expect_error([&] { g.all_to_all(f3, f4); }, {"all_to_all on group 'tp'", "same number"});
  expect_error([&] { g.all_reduce(Tensor(), ReduceOp::sum); },
               {"all_reduce on group 'tp'", "undefined"});
  Tensor m = Tensor::zeros({4, 6}, DType::f32);
  expect_error([&] { g.all_reduce(m.narrow(1, 0, 3), ReduceOp::sum); },
               {"all_reduce on group 'tp'", "not contiguous"});
  expect_error([&] { g.reduce_scatter(m.view({24}), m.narrow(0, 1, 1).view({6}), ReduceOp::sum); },
               {"reduce_scatter", "in float32[24] has 24 elements"});
  Tensor flat = Tensor::zeros({8}, DType::f32);
  expect_error([&] { g.all_to_all(flat, flat); }, {"all_to_all on group 'tp'", "overlap"});
  expect_error([&] { g.all_gather(flat.narrow(0, 1, 4), flat.narrow(0, 0, 4)); },
               {"all_gather on group 'tp'", "not this rank's block"});
  expect_error([&] { g.set_timeout_seconds(0); }, {"timeout", "group 'tp'", "positive"});
  // all_to_all_v: the counts (one per rank, none negative, summing to the rows), the rows' width,
  // the dtypes, and the tensors as every collective.
  {
    const char* a2av = "all_to_all_v on group 'tp' (size 1, world ranks [2])";
    Tensor in = Tensor::zeros({4, 3}, DType::f32), out = Tensor::zeros({4, 3}, DType::f32);
    const std::vector<int64_t> four{4}, two{2}, neg{-1}, many{2, 2};
    expect_error([&] { g.all_to_all_v(in, many, out, four); },
                 {a2av, "send_rows has 2 entries, expected one per rank (1)"});
    expect_error([&] { g.all_to_all_v(in, four, out, many); }, {a2av, "recv_rows has 2 entries"});
    expect_error([&] { g.all_to_all_v(in, neg, out, four); },
                 {a2av, "send_rows[0] = -1 is negative"});
    expect_error([&] { g.all_to_all_v(in, two, out, four); },
                 {a2av, "send_rows sum to 2 rows but in float32[4, 3] has 4"});
    expect_error(
        [&] {
          g.all_to_all_v(in, four, Tensor::zeros({2, 3}, DType::f32), two);
        },
        {a2av, "sends itself send_rows[0] = 4 rows but expects recv_rows[0] = 2"});
    expect_error(
        [&] {
          g.all_to_all_v(in, four, Tensor::zeros({4, 2}, DType::f32), four);
        },
        {a2av,
         "in float32[4, 3] has rows of 3 elements but out float32[4, 2] has rows "
         "of 2"});
    expect_error(
        [&] {
          g.all_to_all_v(in, four, Tensor::zeros({4, 3}, DType::bf16), four);
        },
        {a2av, "same dtype"});
    expect_error([&] { g.all_to_all_v(m.narrow(1, 0, 3), four, out, four); },
                 {a2av, "not contiguous"});
    expect_error([&] { g.all_to_all_v(Tensor::zeros(Shape{}, DType::f32), four, out, four); },
                 {a2av, "no dim 0"});
    expect_error([&] { g.all_to_all_v(in, four, in, four); }, {a2av, "overlap"});
  }
  // Checks come before counting: nothing above was issued.
  EXPECT_EQ(g.counters().calls, 0u);
}

// The planner's group: all_to_all_v moves nothing between ranks but records the bytes this rank
// sends to the others; on tensors with data it keeps the rows to itself and zeroes the rest.
TEST(SimProcessGroup, AllToAllVRecordsTheBytesToOtherRanks) {
  auto log = std::make_shared<SimLog>();
  SimProcessGroup g("ep", 1, {4, 5, 6, 7}, log);
  const std::vector<int64_t> send{3, 2, 0, 5}, recv{1, 2, 4, 0};
  for (Device dev : {Device::meta, Device::cpu}) {
    Tensor in = Tensor::empty({10, 8}, DType::bf16, dev);
    Tensor out = Tensor::empty({7, 8}, DType::bf16, dev);
    if (dev == Device::cpu) {
      for (int64_t i = 0; i < in.numel(); ++i) in.data<bf16>()[i] = float_to_bf16(float(i));
      for (int64_t i = 0; i < out.numel(); ++i) out.data<bf16>()[i] = float_to_bf16(-1.0f);
    }
    g.reset_counters();
    g.all_to_all_v(in, send, out, recv)->wait();
    EXPECT_EQ(g.counters().calls, 1u);
    EXPECT_EQ(g.counters().bytes_sent, (3 + 0 + 5) * 8 * 2u);  // not the 2 rows to itself
    ASSERT_FALSE(log->calls.empty());
    EXPECT_EQ(log->calls.back().op, "all_to_all_v");
    EXPECT_EQ(log->calls.back().bytes_sent, (3 + 0 + 5) * 8 * 2u);
    if (dev == Device::cpu) {
      // Rows 3, 4 of in (to rank 1) land at rows 1, 2 of out (after rank 0's one row).
      for (int64_t i = 0; i < out.numel(); ++i) {
        const int64_t row = i / 8;
        const float want = row == 1 || row == 2 ? float(i + (3 - 1) * 8) : 0.0f;
        ASSERT_EQ(bf16_to_float(out.data<bf16>()[i]), want) << i;
      }
    }
  }
}

TEST(ProcessGroupChecks, AvgDivisionInDtype) {
  Tensor f = Tensor::empty({3}, DType::f32);
  f.data<float>()[0] = 1.0f;
  f.data<float>()[1] = -7.0f;
  f.data<float>()[2] = 0.1f;
  divide_inplace(f, 3);
  EXPECT_EQ(f.data<float>()[0], 1.0f / 3.0f);
  EXPECT_EQ(f.data<float>()[1], -7.0f / 3.0f);
  EXPECT_EQ(f.data<float>()[2], 0.1f / 3.0f);
  Tensor b = Tensor::empty({2}, DType::bf16);
  b.data<bf16>()[0] = float_to_bf16(1.0f);
  b.data<bf16>()[1] = float_to_bf16(-6.0f);
  divide_inplace(b, 3);
  EXPECT_EQ(b.data<bf16>()[0].bits, bf16_round_reference(1.0 / 3.0));
  EXPECT_EQ(bf16_to_float(b.data<bf16>()[1]), -2.0f);
  EXPECT_THROW(divide_inplace(Tensor::zeros({2}, DType::i32), 2), Error);
}

// The MPI reduction of bf16: one rounding of the exact sum (the float sum of two bf16 values is
// exact, so rounding it once more to bf16 must equal rounding the exact sum), ties to even.
TEST(Bf16Sum, MatchesExactSumRoundedToNearestEven) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> exp(-12, 12), mant(0, 127), sign(0, 1);
  const int n = 20000;
  std::vector<bf16> a(n), b(n);
  auto random_bf16 = [&](int e) {
    return float_to_bf16((sign(rng) ? -1.0f : 1.0f) * std::ldexp(1.0f + mant(rng) / 128.0f, e));
  };
  for (int i = 0; i < n; ++i) {
    const int e = exp(rng);
    a[i] = random_bf16(e);
    // Mostly close exponents, where rounding decisions happen; sometimes far apart.
    b[i] = random_bf16(i % 5 == 0 ? exp(rng) : e - (i % 10));
  }
  // Exact ties: 1 + 2^-8 rounds down to even 1, (1 + 2^-7) + 2^-8 rounds up to 1 + 2^-6.
  a[0] = float_to_bf16(1.0f), b[0] = float_to_bf16(std::ldexp(1.0f, -8));
  a[1] = float_to_bf16(1.0f + std::ldexp(1.0f, -7)), b[1] = b[0];
  std::vector<bf16> out = b;
  detail::bf16_sum_into(a.data(), out.data(), n);
  int inexact = 0;
  for (int i = 0; i < n; ++i) {
    const double exact = double(bf16_to_float(a[i])) + double(bf16_to_float(b[i]));
    ASSERT_EQ(out[i].bits, bf16_round_reference(exact))
        << i << ": " << bf16_to_float(a[i]) << " + " << bf16_to_float(b[i]);
    const double rounded = bf16_to_float(out[i]);
    inexact += std::fabs(rounded - exact) > 0;
  }
  EXPECT_EQ(bf16_to_float(out[0]), 1.0f);
  EXPECT_EQ(bf16_to_float(out[1]), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_GT(inexact, n / 4);  // most sums really were rounded
}

TEST(MpiLaunch, DetectsLauncherEnvironment) {
  // Under ctest nothing sets these; the detection must not claim a launcher.
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK",
                        "MPI_LOCALNRANKS", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"}) {
    if (std::getenv(v)) GTEST_SKIP() << "running under a launcher (" << v << " is set)";
  }
  EXPECT_FALSE(launched_under_mpi());
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  EXPECT_TRUE(launched_under_mpi());
  unsetenv("OMPI_COMM_WORLD_SIZE");
  setenv("SLURM_NTASKS", "4", 1);
  EXPECT_FALSE(launched_under_mpi());  // an sbatch script, not an srun step
  setenv("SLURM_STEP_ID", "0", 1);
  EXPECT_TRUE(launched_under_mpi());  // an srun step of 4 tasks, even without PMIx (to say so)
  setenv("SLURM_NTASKS", "1", 1);
  EXPECT_FALSE(launched_under_mpi());  // srun --mpi=none of one task: a process of its own
  unsetenv("SLURM_STEP_ID");
  unsetenv("SLURM_NTASKS");
}

// srun's environments, as measured under Slurm 22.05 (tests/drill/slurm.sh runs the real ones).
namespace {
using Env = std::map<std::string, std::string>;
EnvLookup lookup(const Env& e) {
  return [&e](const char* k) {
    const auto it = e.find(k);
    return it == e.end() ? nullptr : it->second.c_str();
  };
}
}  // namespace

TEST(MpiLaunch, SrunWithoutPmixIsNamed) {
  const Env step = {{"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_NTASKS", "2"}};
  EXPECT_EQ(srun_step_tasks(lookup(step)), 2);
  // srun --mpi=none, 2 tasks: the message names the plugin and the launches that work.
  const std::string none = srun_launch_problem(lookup(step), true);
  for (const char* part : {"2 task(s) without PMIx", "plugin: none", "srun --mpi=pmix", "mpirun"})
    EXPECT_NE(none.find(part), std::string::npos) << part << " not in: " << none;
  EXPECT_NE(srun_launch_problem(lookup(step), false), "");  // MPICH needs a plugin too
  // srun --mpi=pmix: PMIx joins them.
  Env pmix = step;
  pmix["PMIX_RANK"] = "1";
  EXPECT_EQ(srun_launch_problem(lookup(pmix), true), "");
  // srun --mpi=pmi2: Open MPI cannot use it, MPICH can.
  Env pmi2 = step;
  pmi2["PMI_RANK"] = "0", pmi2["SLURM_MPI_TYPE"] = "pmi2";
  EXPECT_NE(srun_launch_problem(lookup(pmi2), true).find("plugin: pmi2"), std::string::npos);
  EXPECT_EQ(srun_launch_problem(lookup(pmi2), false), "");
  // One task without a plugin runs as a process of its own.
  const Env one = {{"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NUM_TASKS", "1"}};
  EXPECT_EQ(srun_launch_problem(lookup(one), true), "");
  // The batch script itself (no step) and mpirun's ranks inside an allocation are not srun tasks.
  const Env batch = {{"SLURM_NTASKS", "2"}};
  EXPECT_EQ(srun_step_tasks(lookup(batch)), 0);
  Env under_mpirun = step;
  under_mpirun["OMPI_COMM_WORLD_SIZE"] = "2";
  EXPECT_EQ(srun_step_tasks(lookup(under_mpirun)), 0);
  EXPECT_EQ(srun_launch_problem(lookup(under_mpirun), true), "");
}
