// Every collective of the MPI backend against a reference that each rank computes locally (every
// rank knows every rank's input: it is a function of the rank). Run under mpirun with 2..8 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "distributed/group_sum.hpp"
#include "distributed/mpi_process_group.hpp"

using namespace loom;
using namespace loom::dist;

namespace {

constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::i32};
constexpr int64_t kSizes[] = {0, 1, 37};

// Element i of rank r's input. f32/bf16: multiples of 1/4 in [-3.75, 3.75], so every partial sum
// over <= 8 ranks (|sum| <= 30, 120 quarter steps, 7 significant bits) is exact in both dtypes,
// whatever order MPI reduces in: results can be compared bit for bit. i32: wide integers.
double value(DType d, int r, int64_t i) {
  if (d == DType::i32) return double((r * 1000003LL + i * 7919LL) % 20011 - 10000);
  return double((r * 7 + i * 13) % 31 - 15) * 0.25;
}

double get(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::f32:
      return t.data<float>()[i];
    case DType::bf16:
      return bf16_to_float(t.data<bf16>()[i]);
    case DType::i32:
      return t.data<int32_t>()[i];
    case DType::i64:
      return double(t.data<int64_t>()[i]);
    case DType::f64:
      return t.data<double>()[i];
  }
  return NAN;
}

void set(const Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::f32:
      t.data<float>()[i] = static_cast<float>(v);
      break;
    case DType::bf16:
      t.data<bf16>()[i] = float_to_bf16(static_cast<float>(v));
      break;
    case DType::i32:
      t.data<int32_t>()[i] = static_cast<int32_t>(v);
      break;
    case DType::i64:
      t.data<int64_t>()[i] = static_cast<int64_t>(v);
      break;
    case DType::f64:
      t.data<double>()[i] = v;
      break;
  }
}

template <class F>
Tensor make(DType d, int64_t n, F&& f) {
  Tensor t = Tensor::empty({n}, d);
  for (int64_t i = 0; i < n; ++i) set(t, i, f(i));
  return t;
}

// Something that no result equals, so that an element MPI never wrote is caught.
Tensor sentinel(DType d, int64_t n) {
  return make(d, n, [](int64_t) { return -12345.0; });
}

// The result of an exact sum over ranks after ReduceOp: avg divides in the dtype, as the backend.
double reduced(DType d, double sum, ReduceOp op, int n) {
  if (op == ReduceOp::sum) return sum;
  const float q = static_cast<float>(sum) / static_cast<float>(n);
  return d == DType::bf16 ? bf16_to_float(float_to_bf16(q)) : q;
}

std::vector<ReduceOp> ops_for(DType d) {
  if (d == DType::i32) return {ReduceOp::sum};
  return {ReduceOp::sum, ReduceOp::avg};
}

std::string trace(DType d, int64_t n, ReduceOp op = ReduceOp::sum) {
  return str_cat(dtype_name(d), " n=", n, " ", reduce_op_name(op));
}

class Mpi : public testing::Test {
 protected:
  void SetUp() override {
    world_ = make_mpi_world_group();
    // A test bug that desynchronizes the ranks aborts in seconds instead of hanging.
    world_->set_timeout_seconds(20);
    r_ = world_->rank();
    n_ = world_->size();
  }
  std::unique_ptr<ProcessGroup> world_;
  int r_ = 0, n_ = 1;
};

}  // namespace

TEST_F(Mpi, WorldGroup) {
  EXPECT_EQ(world_->backend(), "mpi");
  EXPECT_GE(n_, 2) << "run under mpirun -np >= 2";
  std::vector<int> all(n_);
  for (int i = 0; i < n_; ++i) all[i] = i;
  EXPECT_EQ(world_->world_ranks(), all);
  EXPECT_EQ(world_->world_rank(), r_);
}

TEST_F(Mpi, AllGather) {
  for (DType d : kDtypes) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(trace(d, n));
      Tensor in = make(d, n, [&](int64_t i) { return value(d, r_, i); });
      Tensor out = sentinel(d, n_ * n);
      world_->reset_counters();
      world_->all_gather(in, out)->wait();
      for (int q = 0; q < n_; ++q) {
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(get(out, q * n + i), value(d, q, i)) << q;
      }
      EXPECT_EQ(world_->counters().calls, 1u);
      EXPECT_EQ(world_->counters().bytes_sent, (n_ - 1) * in.nbytes());

      // In place: this rank's block of out is the input.
      Tensor io = sentinel(d, n_ * n);
      io.narrow(0, r_ * n, n).copy_from(in);
      world_->all_gather(io.narrow(0, r_ * n, n), io)->wait();
      for (int q = 0; q < n_; ++q) {
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(get(io, q * n + i), value(d, q, i)) << q;
      }
    }
  }
}

TEST_F(Mpi, ReduceScatter) {
  for (DType d : kDtypes) {
    for (ReduceOp op : ops_for(d)) {
      for (int64_t n : kSizes) {
        SCOPED_TRACE(trace(d, n, op));
        Tensor in = make(d, n_ * n, [&](int64_t i) { return value(d, r_, i); });
        Tensor out = sentinel(d, n);
        world_->reset_counters();
        world_->reduce_scatter(in, out, op)->wait();
        for (int64_t i = 0; i < n; ++i) {
          double sum = 0;
          for (int q = 0; q < n_; ++q) sum += value(d, q, r_ * n + i);
          ASSERT_EQ(get(out, i), reduced(d, sum, op, n_)) << i;
        }
        EXPECT_EQ(world_->counters().bytes_sent, (n_ - 1) * out.nbytes());
      }
    }
  }
}

// Random non-zero values in 4 MB blocks (where Open MPI's MPI_Ireduce_scatter_block collapsed on
// 4 ranks; an odd count, so that no power-of-two boundary hides an offset error), against the sum
// computed here in the documented order, bit for bit: pairs of ranks (0+1)+(2+3)...
// (mpi_process_group.hpp). With 2 ranks, where any order gives the same sum, also against
// MPI_Reduce_scatter_block. Sum and avg run at once and are waited for in reverse order.
TEST_F(Mpi, ReduceScatterLargeRandomBitForBit) {
  const int64_t n = (1 << 20) + 4099;
  auto rnd = [](DType d, int q, int64_t i) {
    uint64_t z = (uint64_t(q) << 40) + uint64_t(i) + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    const float x = (float((z ^ (z >> 31)) >> 40) + 0.5f) * 0x1p-23f - 1.0f;  // never 0
    return d == DType::bf16 ? bf16_to_float(float_to_bf16(x)) : x;
  };
  // What the dtype holds after adding a and b.
  auto add = [](DType d, float a, float b) {
    return d == DType::bf16 ? bf16_to_float(float_to_bf16(a + b)) : a + b;
  };
  for (DType d : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(d));
    Tensor in = make(d, n_ * n, [&](int64_t i) { return rnd(d, r_, i); });
    Tensor sum = sentinel(d, n), avg = sentinel(d, n);
    world_->reset_counters();
    auto ws = world_->reduce_scatter(in, sum, ReduceOp::sum);
    auto wa = world_->reduce_scatter(in, avg, ReduceOp::avg);
    wa->wait();
    ws->wait();
    EXPECT_EQ(world_->counters().calls, 2u);
    EXPECT_EQ(world_->counters().bytes_sent, 2 * (n_ - 1) * sum.nbytes());
    std::vector<float> part(n_);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      for (int q = 0; q < n_; ++q) part[q] = rnd(d, q, r_ * n + i);
      for (int s = 1; s < n_; s *= 2) {
        for (int q = 0; q + s < n_; q += 2 * s) part[q] = add(d, part[q], part[q + s]);
      }
      bad += get(sum, i) != part[0] || get(avg, i) != reduced(d, part[0], ReduceOp::avg, n_);
    }
    EXPECT_EQ(bad, 0);
    if (n_ == 2) {
      Tensor mpi = sentinel(d, n);
      MPI_Op op = MPI_SUM;
      if (d == DType::bf16) {
        MPI_Op_create(
            [](void* a, void* b, int* len, MPI_Datatype*) {
              detail::bf16_sum_into(static_cast<const bf16*>(a), static_cast<bf16*>(b), *len);
            },
            1, &op);
      }
      MPI_Reduce_scatter_block(in.raw(), mpi.raw(), int(n),
                               d == DType::bf16 ? MPI_UINT16_T : MPI_FLOAT, op, MPI_COMM_WORLD);
      if (d == DType::bf16) MPI_Op_free(&op);
      EXPECT_EQ(std::memcmp(mpi.raw(), sum.raw(), sum.nbytes()), 0);
    }
  }
}

// reduce_scatter's messages never match a receive of send/recv posted on the same group.
TEST_F(Mpi, ReduceScatterLeavesPendingReceivesAlone) {
  const int next = (r_ + 1) % n_, prev = (r_ + n_ - 1) % n_;
  Tensor got = sentinel(DType::f32, 3);
  auto recv = world_->recv(got, prev, 0);
  Tensor in = make(DType::f32, n_ * 5, [&](int64_t i) { return value(DType::f32, r_, i); });
  Tensor out = sentinel(DType::f32, 5);
  world_->reduce_scatter(in, out, ReduceOp::sum)->wait();
  Tensor mine = make(DType::f32, 3, [&](int64_t i) { return value(DType::f32, r_, i); });
  world_->send(mine, next, 0)->wait();
  recv->wait();
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(get(got, i), value(DType::f32, prev, i));
  for (int64_t i = 0; i < 5; ++i) {
    double sum = 0;
    for (int q = 0; q < n_; ++q) sum += value(DType::f32, q, r_ * 5 + i);
    EXPECT_EQ(get(out, i), sum);
  }
}

TEST_F(Mpi, AllReduce) {
  for (DType d : kDtypes) {
    for (ReduceOp op : ops_for(d)) {
      for (int64_t n : kSizes) {
        SCOPED_TRACE(trace(d, n, op));
        Tensor t = make(d, n, [&](int64_t i) { return value(d, r_, i); });
        world_->reset_counters();
        world_->all_reduce(t, op)->wait();
        for (int64_t i = 0; i < n; ++i) {
          double sum = 0;
          for (int q = 0; q < n_; ++q) sum += value(d, q, i);
          ASSERT_EQ(get(t, i), reduced(d, sum, op, n_)) << i;
        }
        EXPECT_EQ(world_->counters().bytes_sent, 2 * (n_ - 1) * t.nbytes() / n_);
      }
    }
  }
}

// Random values, large enough for MPI to segment or pick another algorithm: the sum is then
// order-dependent, so compare with the fp64 sum. bf16 rounds once per addition: |error| <=
// (n-1) * 2^-8 * max|partial sum| <= (n-1) * 2^-8 * sum|x|; f32 the same with 2^-24.
TEST_F(Mpi, AllReduceRandomAgainstFp64) {
  const int64_t n = 70001;
  for (DType d : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(d));
    auto rank_values = [&](int q) {
      std::mt19937_64 rng(1000 + q);
      std::normal_distribution<float> dist(0.0f, 1.0f);
      std::vector<double> v(n);
      for (auto& x : v) x = d == DType::bf16 ? bf16_to_float(float_to_bf16(dist(rng))) : dist(rng);
      return v;
    };
    std::vector<double> sum(n, 0.0), abs_sum(n, 0.0);
    for (int q = 0; q < n_; ++q) {
      auto v = rank_values(q);
      for (int64_t i = 0; i < n; ++i) sum[i] += v[i], abs_sum[i] += std::fabs(v[i]);
    }
    auto mine = rank_values(r_);
    Tensor t = make(d, n, [&](int64_t i) { return mine[i]; });
    world_->all_reduce(t, ReduceOp::sum)->wait();
    const double eps = d == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      // n rather than n - 1 additions: a margin.
      const double tol = n_ * eps * abs_sum[i];
      bad += std::fabs(get(t, i) - sum[i]) > tol;
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST_F(Mpi, Broadcast) {
  for (DType d : kDtypes) {
    for (int64_t n : kSizes) {
      for (int root : {0, n_ - 1}) {
        SCOPED_TRACE(trace(d, n) + str_cat(" root=", root));
        Tensor t = make(d, n, [&](int64_t i) { return value(d, r_, i); });
        world_->reset_counters();
        world_->broadcast(t, root)->wait();
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(get(t, i), value(d, root, i));
        EXPECT_EQ(world_->counters().bytes_sent, r_ == root ? t.nbytes() : 0u);
      }
    }
  }
}

TEST_F(Mpi, SendRecvRingBothWays) {
  const int next = (r_ + 1) % n_, prev = (r_ + n_ - 1) % n_;
  for (DType d : kDtypes) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(trace(d, n));
      Tensor from_prev = sentinel(d, n), from_next = sentinel(d, n);
      Tensor mine = make(d, n, [&](int64_t i) { return value(d, r_, i); });
      Tensor mine2 = make(d, n, [&](int64_t i) { return value(d, r_ + 50, i); });
      world_->reset_counters();
      // Receives posted before the sends; tags keep the two directions apart (with 2 ranks
      // prev == next).
      auto r1 = world_->recv(from_prev, prev, 1);
      auto r2 = world_->recv(from_next, next, 2);
      auto s1 = world_->send(mine, next, 1);
      auto s2 = world_->send(mine2, prev, 2);
      s2->wait();
      r2->wait();
      r1->wait();
      s1->wait();
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(get(from_prev, i), value(d, prev, i));
        ASSERT_EQ(get(from_next, i), value(d, next + 50, i));
      }
      EXPECT_EQ(world_->counters().calls, 4u);
      EXPECT_EQ(world_->counters().bytes_sent, 2 * mine.nbytes());
    }
  }
}

TEST_F(Mpi, AllToAll) {
  for (DType d : kDtypes) {
    for (int64_t n : kSizes) {  // n elements per block
      SCOPED_TRACE(trace(d, n));
      Tensor in = make(d, n_ * n, [&](int64_t i) { return value(d, r_, i); });
      Tensor out = sentinel(d, n_ * n);
      world_->reset_counters();
      world_->all_to_all(in, out)->wait();
      for (int q = 0; q < n_; ++q) {
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(get(out, q * n + i), value(d, q, r_ * n + i));
      }
      EXPECT_EQ(world_->counters().bytes_sent, (n_ - 1) * in.nbytes() / n_);
    }
  }
}

// Element e of row i of the rows that rank `from` sends rank `to`: distinct per (from, to, i, e)
// and exact in every dtype (integers below 256 in bf16).
double a2av_value(int from, int to, int64_t i, int64_t e) {
  return double((from * 61 + to * 17 + i * 5 + e * 3) % 251 - 125);
}

// The counts as expert parallelism gets them: each rank draws its own send_rows, all_to_all of one
// int32 per rank tells every rank its recv_rows. Random per rank and trial, with zeros: in trial 1
// rank 0 sends nothing and nobody sends the last rank anything.
TEST_F(Mpi, AllToAllV) {
  for (DType d : kDtypes) {
    for (int64_t width : {int64_t(1), int64_t(37)}) {
      for (int trial = 0; trial < 3; ++trial) {
        SCOPED_TRACE(str_cat(dtype_name(d), " width ", width, " trial ", trial));
        std::mt19937 rng(uint32_t(1000 * trial + r_));
        std::uniform_int_distribution<int> draw(-3, trial == 2 ? 700 : 6);
        Tensor counts = Tensor::empty({n_}, DType::i32), got = sentinel(DType::i32, n_);
        for (int q = 0; q < n_; ++q) {
          const bool none = trial == 1 && (r_ == 0 || q == n_ - 1);
          counts.data<int32_t>()[q] = none ? 0 : std::max(0, draw(rng));
        }
        world_->all_to_all(counts, got)->wait();
        std::vector<int64_t> send(n_), recv(n_);
        int64_t in_rows = 0, out_rows = 0;
        for (int q = 0; q < n_; ++q) {
          send[q] = counts.data<int32_t>()[q], recv[q] = got.data<int32_t>()[q];
          in_rows += send[q], out_rows += recv[q];
        }
        Tensor in = Tensor::empty({in_rows, width}, d);
        for (int64_t k = 0, q = 0; q < n_; ++q) {
          for (int64_t i = 0; i < send[q]; ++i) {
            for (int64_t e = 0; e < width; ++e) set(in, k++, a2av_value(r_, int(q), i, e));
          }
        }
        Tensor out = sentinel(d, out_rows * width).view({out_rows, width});
        world_->reset_counters();
        world_->all_to_all_v(in, send, out, recv)->wait();
        for (int64_t k = 0, q = 0; q < n_; ++q) {
          for (int64_t i = 0; i < recv[q]; ++i) {
            for (int64_t e = 0; e < width; ++e, ++k) {
              ASSERT_EQ(get(out, k), a2av_value(int(q), r_, i, e)) << "from " << q << " row " << i;
            }
          }
        }
        int64_t to_others = 0;
        for (int q = 0; q < n_; ++q) to_others += q == r_ ? 0 : send[q];
        EXPECT_EQ(world_->counters().calls, 1u);
        EXPECT_EQ(world_->counters().bytes_sent, uint64_t(to_others * width) * dtype_size(d));
      }
    }
  }
}

// The counts are read at the call: the caller's vectors may be gone before the wait, and another
// collective issued after it completes first.
TEST_F(Mpi, AllToAllVKeepsItsCountsUntilItCompletes) {
  const DType d = DType::f32;
  const int64_t width = 5;
  auto rows = [&](int from, int to) { return int64_t((from + 2 * to) % 3); };  // 0, 1 or 2
  int64_t in_rows = 0, out_rows = 0;
  for (int q = 0; q < n_; ++q) in_rows += rows(r_, q), out_rows += rows(q, r_);
  Tensor in = Tensor::empty({in_rows, width}, d), out = sentinel(d, out_rows * width);
  for (int64_t k = 0, q = 0; q < n_; ++q) {
    for (int64_t i = 0; i < rows(r_, int(q)); ++i) {
      for (int64_t e = 0; e < width; ++e) set(in, k++, a2av_value(r_, int(q), i, e));
    }
  }
  std::unique_ptr<Work> w;
  {
    std::vector<int64_t> send(n_), recv(n_);
    for (int q = 0; q < n_; ++q) send[q] = rows(r_, q), recv[q] = rows(q, r_);
    w = world_->all_to_all_v(in, send, out.view({out_rows, width}), recv);
    std::fill(send.begin(), send.end(), -1);  // then freed
    std::fill(recv.begin(), recv.end(), -1);
  }
  Tensor t = make(DType::i32, 1, [&](int64_t) { return 1; });
  world_->all_reduce(t, ReduceOp::sum)->wait();
  w->wait();
  EXPECT_EQ(get(t, 0), n_);
  for (int64_t k = 0, q = 0; q < n_; ++q) {
    for (int64_t i = 0; i < rows(int(q), r_); ++i) {
      for (int64_t e = 0; e < width; ++e, ++k) {
        ASSERT_EQ(get(out, k), a2av_value(int(q), r_, i, e)) << "from " << q << " row " << i;
      }
    }
  }
}

TEST_F(Mpi, BarrierCountsTheTimeWaited) {
  world_->reset_counters();
  if (r_ == 0) std::this_thread::sleep_for(std::chrono::milliseconds(150));
  world_->barrier()->wait();
  EXPECT_EQ(world_->counters().calls, 1u);
  EXPECT_EQ(world_->counters().bytes_sent, 0u);
  if (r_ != 0) {
    EXPECT_GT(world_->counters().wait_seconds, 0.1);
    EXPECT_LT(world_->counters().wait_seconds, 10.0);
  }
}

TEST_F(Mpi, AsyncWaitInReverseOrderAndPolling) {
  const DType d = DType::f32;
  const int64_t n = 37;
  Tensor a = make(d, n, [&](int64_t i) { return value(d, r_, i); });
  Tensor b_in = make(d, n, [&](int64_t i) { return value(d, r_, i + 3); });
  Tensor b_out = sentinel(d, n_ * n);
  Tensor c = make(d, n, [&](int64_t i) { return value(d, r_, i + 5); });
  world_->reset_counters();
  auto wa = world_->all_reduce(a, ReduceOp::avg);
  auto wb = world_->all_gather(b_in, b_out);
  auto wc = world_->broadcast(c, n_ - 1);
  auto wd = world_->barrier();
  while (!wd->test()) std::this_thread::yield();
  EXPECT_TRUE(wd->test());
  wc->wait();
  wb->wait();
  wa->wait();
  wa->wait();  // waiting again is harmless
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int q = 0; q < n_; ++q) sum += value(d, q, i);
    ASSERT_EQ(get(a, i), reduced(d, sum, ReduceOp::avg, n_));
    ASSERT_EQ(get(c, i), value(d, n_ - 1, i + 5));
    for (int q = 0; q < n_; ++q) ASSERT_EQ(get(b_out, q * n + i), value(d, q, i + 3));
  }
  EXPECT_EQ(world_->counters().calls, 4u);
  const uint64_t bytes =
      2 * (n_ - 1) * a.nbytes() / n_ + (n_ - 1) * b_in.nbytes() + (r_ == n_ - 1 ? c.nbytes() : 0);
  EXPECT_EQ(world_->counters().bytes_sent, bytes);
}

TEST_F(Mpi, DroppedWorkCompletesInItsDestructor) {
  Tensor result;
  {
    // Never waited for: the destructor must wait, or MPI would write into freed memory.
    Tensor t = make(DType::i32, 5, [&](int64_t i) { return r_ + i; });
    result = t;
    auto w = world_->all_reduce(t, ReduceOp::sum);
  }
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(get(result, i), n_ * (n_ - 1) / 2 + n_ * i);
}

TEST_F(Mpi, ErrorsNameTheCollectiveAndGroupOnEveryRank) {
  Tensor in = Tensor::zeros({3}, DType::f32), out = Tensor::zeros({3 * n_ + 1}, DType::f32);
  try {
    world_->all_gather(in, out);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(str_cat("all_gather on group 'world' (size ", n_, ", world ranks [0, 1")),
              std::string::npos)
        << m;
  }
  Tensor i = Tensor::zeros({4}, DType::i32);
  EXPECT_THROW(world_->all_reduce(i, ReduceOp::avg), Error);
  EXPECT_EQ(world_->counters().calls, 0u);
  // The group still works after the errors.
  Tensor t = make(DType::i32, 1, [&](int64_t) { return 1; });
  world_->all_reduce(t, ReduceOp::sum)->wait();
  EXPECT_EQ(get(t, 0), n_);
}

TEST_F(Mpi, SplitByParity) {
  auto g = world_->split(r_ % 2, -r_, "parity");  // key -r: reversed order
  std::vector<int> expected;
  for (int q = n_ - 1; q >= 0; --q) {
    if (q % 2 == r_ % 2) expected.push_back(q);
  }
  EXPECT_EQ(g->name(), "parity");
  EXPECT_EQ(g->world_ranks(), expected);
  EXPECT_EQ(g->world_ranks()[g->rank()], r_);
  Tensor me = make(DType::i32, 1, [&](int64_t) { return r_; });
  Tensor all = sentinel(DType::i32, g->size());
  g->all_gather(me, all)->wait();
  for (int k = 0; k < g->size(); ++k) EXPECT_EQ(get(all, k), expected[k]);
}

TEST_F(Mpi, GroupSumKeepsEveryBitAndAddsInRankOrder) {
  // A double no float pair holds (53 significant bits): held by the last rank alone, it comes
  // back unchanged on every rank (the hi+lo transport kept about 48 bits).
  const double x = 1.0 / 3.0 + 0x1p-50;
  const double got = loom::group_sum(world_.get(), r_ == n_ - 1 ? x : 0.0);
  EXPECT_EQ(std::memcmp(&got, &x, sizeof x), 0) << got << " vs " << x;
  // Element-wise, in rank order: the sum of 0.1 * (rank + 1) added as a loop over ranks would.
  std::vector<double> mine{0.1 * (r_ + 1), -double(r_), 0.0};
  const std::vector<double> sums = loom::group_sum_each(world_.get(), mine);
  double want = 0;
  for (int r = 0; r < n_; ++r) want += 0.1 * (r + 1);
  ASSERT_EQ(sums.size(), 3u);
  EXPECT_EQ(sums[0], want);
  EXPECT_EQ(sums[1], -double(n_ * (n_ - 1) / 2));
  EXPECT_EQ(sums[2], 0.0);
}
