// The bias and gate ops of Qwen2-MoE (ops/ops.hpp "biases and gates"): on cpu the bits of
// kernels/cpu/bias_gate, the biases on column slices of a fused qkv buffer; clear errors for wrong
// arguments; on meta the work reported and nothing computed.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "kernels/cpu/bias_gate.hpp"
#include "ops/ops.hpp"
#include "tests/test_util.hpp"

using namespace loom;
using loom::test::same_bits;

namespace {

Tensor random(const Shape& s, uint64_t seed, float scale = 1.0f) {
  Tensor t = Tensor::empty(s, DType::f32);
  const auto v = test::randn(size_t(t.numel()), seed, scale);
  std::memcpy(t.raw(), v.data(), t.nbytes());
  return t;
}

template <class T = float>
std::vector<T> values(const Tensor& t) {
  const T* p = t.data<T>();
  return std::vector<T>(p, p + t.numel());
}

Tensor meta(const Shape& s, DType dt = DType::f32) {
  return Tensor::empty(s, dt, Device::meta);
}

}  // namespace

// q, k and v biases added to their column slices of one fused [M, Nq + 2 Nkv] output, and their
// gradients summed from slices of the fused gradient: the kernels' bits on the same strides.
TEST(BiasGateOps, BiasesOnAFusedBufferEqualTheKernels) {
  const int64_t M = 19, Nq = 24, Nkv = 8, W = Nq + 2 * Nkv;
  Tensor qkv = random({M, W}, 1);
  std::vector<float> ref = values(qkv);
  const int64_t widths[3] = {Nq, Nkv, Nkv};
  int64_t c0 = 0;
  for (int i = 0; i < 3; ++i) {
    const Tensor b = random({widths[i]}, 2 + uint64_t(i));
    Tensor slice = qkv.narrow(1, c0, widths[i]);
    ASSERT_FALSE(slice.is_contiguous());
    ops::add_bias(slice, b);
    cpu::add_bias(ref.data() + c0, M, widths[i], W, b.data<float>());
    c0 += widths[i];
  }
  EXPECT_TRUE(same_bits(values(qkv), ref));

  const Tensor dqkv = random({M, W}, 5);
  c0 = 0;
  for (int i = 0; i < 3; ++i) {
    Tensor db = random({widths[i]}, 6 + uint64_t(i));
    std::vector<float> kdb = values(db);
    ops::bias_grad(dqkv.narrow(1, c0, widths[i]), db);
    cpu::bias_grad(dqkv.data<float>() + c0, M, widths[i], W, kdb.data());
    EXPECT_TRUE(same_bits(values(db), kdb)) << "slice " << i;
    c0 += widths[i];
  }
  // A contiguous y and dy too.
  Tensor y = random({M, Nq}, 9), db = random({Nq}, 10);
  const Tensor b = random({Nq}, 11);
  std::vector<float> ky = values(y), kdb = values(db);
  ops::add_bias(y, b);
  cpu::add_bias(ky.data(), M, Nq, Nq, b.data<float>());
  EXPECT_TRUE(same_bits(values(y), ky));
  ops::bias_grad(y, db);
  cpu::bias_grad(ky.data(), M, Nq, Nq, kdb.data());
  EXPECT_TRUE(same_bits(values(db), kdb));
}

// The shared expert's gate, forward and backward, every dtype combination: the kernels' bits.
TEST(BiasGateOps, GateEqualsTheKernels) {
  const int64_t M = 21, d = 17;
  const Tensor z = random({M, 1}, 20, 3.0f), dy = random({M, d}, 21);
  for (DType yt : {DType::f32, DType::bf16}) {
    const Tensor ys = ops::to_compute(random({M, d}, 22), yt);
    SCOPED_TRACE(dtype_name(yt));
    Tensor y = random({M, d}, 23);
    std::vector<float> ky = values(y);
    ops::sigmoid_gate_forward(z, ys, y);
    if (yt == DType::bf16)
      cpu::sigmoid_gate_forward(z.data<float>(), ys.data<bf16>(), M, d, ky.data());
    else
      cpu::sigmoid_gate_forward(z.data<float>(), ys.data<float>(), M, d, ky.data());
    EXPECT_TRUE(same_bits(values(y), ky));

    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(dtype_name(dt));
      Tensor dys = Tensor::empty({M, d}, dt), dz = random({M, 1}, 24);
      ops::sigmoid_gate_backward(dy, z, ys, dys, dz);
      std::vector<float> kdz(static_cast<size_t>(M)), kdys(size_t(M * d));
      std::vector<bf16> kdys16(size_t(M * d));
      const float *g = dy.data<float>(), *zp = z.data<float>();
      if (yt == DType::bf16 && dt == DType::bf16)
        cpu::sigmoid_gate_backward(g, zp, ys.data<bf16>(), M, d, kdys16.data(), kdz.data());
      else if (yt == DType::bf16)
        cpu::sigmoid_gate_backward(g, zp, ys.data<bf16>(), M, d, kdys.data(), kdz.data());
      else if (dt == DType::bf16)
        cpu::sigmoid_gate_backward(g, zp, ys.data<float>(), M, d, kdys16.data(), kdz.data());
      else
        cpu::sigmoid_gate_backward(g, zp, ys.data<float>(), M, d, kdys.data(), kdz.data());
      if (dt == DType::bf16)
        EXPECT_TRUE(same_bits(values<bf16>(dys), kdys16));
      else
        EXPECT_TRUE(same_bits(values(dys), kdys));
      EXPECT_TRUE(same_bits(values(dz), kdz));
    }
  }
}

TEST(BiasGateOps, ChecksTheirArguments) {
  const int64_t M = 4, N = 6, d = 5;
  Tensor y = random({M, N}, 30), y16 = Tensor::empty({M, N}, DType::bf16), flat = random({N}, 31);
  const Tensor b = random({N}, 32), short_b = random({N - 1}, 33);
  test::expect_error([&] { ops::add_bias(y, short_b); }, {"add_bias", "b", "[6]", "[5]"});
  test::expect_error([&] { ops::add_bias(y16, b); }, {"add_bias", "y", "float32", "bfloat16"});
  test::expect_error([&] { ops::add_bias(flat, b); }, {"add_bias", "y", "2-d", "[6]"});
  Tensor b16 = Tensor::empty({N}, DType::bf16);
  test::expect_error([&] { ops::add_bias(y, b16); }, {"add_bias", "b", "float32", "bfloat16"});
  // A bias that is itself a strided slice (a column of a matrix) must be contiguous.
  const Tensor bias_col = random({N, 2}, 34).narrow(1, 0, 1);
  test::expect_error([&] { ops::add_bias(y, bias_col); }, {"add_bias", "b", "contiguous"});
  Tensor on_meta = meta({N});
  test::expect_error([&] { ops::add_bias(y, on_meta); }, {"add_bias", "cpu", "meta"});
  Tensor db = Tensor::zeros({N + 1}, DType::f32);
  test::expect_error([&] { ops::bias_grad(y, db); }, {"bias_grad", "db", "[6]", "[7]"});
  Tensor db_ok = Tensor::zeros({N}, DType::f32);
  test::expect_error([&] { ops::bias_grad(y16, db_ok); }, {"bias_grad", "dy", "float32"});

  const Tensor z = random({M, 1}, 35), ys = random({M, d}, 36), z_flat = random({M}, 37);
  Tensor out = random({M, d}, 38), out16 = Tensor::empty({M, d}, DType::bf16);
  test::expect_error([&] { ops::sigmoid_gate_forward(z_flat, ys, out); },
                     {"sigmoid_gate_forward", "z", "[4, 1]", "[4]"});
  test::expect_error(
      [&] {
        ops::sigmoid_gate_forward(z, random({M, d + 1}, 39), out);
      },
      {"sigmoid_gate_forward", "ys", "[4, 5]", "[4, 6]"});
  test::expect_error([&] { ops::sigmoid_gate_forward(z, ys, out16); },
                     {"sigmoid_gate_forward", "y", "float32"});
  Tensor wide = random({M, 2 * d}, 40);
  Tensor y_slice = wide.narrow(1, 0, d);
  test::expect_error([&] { ops::sigmoid_gate_forward(z, ys, y_slice); },
                     {"sigmoid_gate_forward", "y", "contiguous", "strided"});
  Tensor dys = Tensor::empty({M, d}, DType::f32), dz = Tensor::empty({M, 1}, DType::f32);
  Tensor dys_i32 = Tensor::empty({M, d}, DType::i32), dz_wide = Tensor::empty({M, 2}, DType::f32);
  test::expect_error([&] { ops::sigmoid_gate_backward(ys, z, ys, dys_i32, dz); },
                     {"sigmoid_gate_backward", "dys", "float32 or bfloat16", "int32"});
  test::expect_error([&] { ops::sigmoid_gate_backward(ys, z, ys, dys, dz_wide); },
                     {"sigmoid_gate_backward", "dz", "[4, 1]", "[4, 2]"});
  Tensor dz_meta = meta({M, 1});
  test::expect_error([&] { ops::sigmoid_gate_backward(ys, z, ys, dys, dz_meta); },
                     {"sigmoid_gate_backward", "cpu", "meta"});
}

// On meta every op reports its work (memory-bound: the bytes its tensors hold, read and written,
// and the flops per element) and computes nothing (the meta pointers are never dereferenced: a
// kernel call would crash).
TEST(BiasGateOps, MetaReportsWorkAndComputesNothing) {
  const int64_t M = 10, N = 12, W = 3 * N, d = 8;
  std::vector<ops::KernelWork> works;
  {
    ops::RecordWork record([&](const ops::KernelWork& w) { works.push_back(w); });
    Tensor fused = meta({M, W}), b = meta({N});
    Tensor slice = fused.narrow(1, N, N);
    ops::add_bias(slice, b);
    ops::bias_grad(slice, b);
    Tensor z = meta({M, 1}), ys = meta({M, d}, DType::bf16), y = meta({M, d});
    ops::sigmoid_gate_forward(z, ys, y);
    Tensor dys = meta({M, d}, DType::bf16);
    Tensor dz = meta({M, 1});
    ops::sigmoid_gate_backward(y, z, ys, dys, dz);
  }
  ASSERT_EQ(works.size(), 4u);
  const std::vector<std::string> want = {"add_bias", "bias_grad", "sigmoid_gate_forward",
                                         "sigmoid_gate_backward"};
  for (size_t i = 0; i < works.size(); ++i) {
    EXPECT_EQ(std::string(works[i].op), want[i]);
    EXPECT_EQ(works[i].dtype, DType::f32) << want[i];
    EXPECT_EQ(works[i].m, 0) << want[i];  // not a GEMM
  }
  const double f = 4, h = 2;  // bytes of f32 and bf16
  EXPECT_EQ(works[0].bytes, 2 * M * N * f + N * f);
  EXPECT_EQ(works[0].flops, double(M * N));
  EXPECT_EQ(works[1].bytes, M * N * f + 2 * N * f);
  EXPECT_EQ(works[1].flops, double(M * N));
  EXPECT_EQ(works[2].bytes, M * f + M * d * h + 2 * M * d * f);
  EXPECT_EQ(works[2].flops, 2.0 * double(M * d));
  EXPECT_EQ(works[3].bytes, M * d * f + M * f + M * d * h + M * d * h + M * f);
  EXPECT_EQ(works[3].flops, 3.0 * double(M * d));

  // On cpu nothing is reported.
  works.clear();
  {
    ops::RecordWork record([&](const ops::KernelWork& w) { works.push_back(w); });
    Tensor y = random({M, N}, 50);
    ops::add_bias(y, random({N}, 51));
  }
  EXPECT_TRUE(works.empty());
}
