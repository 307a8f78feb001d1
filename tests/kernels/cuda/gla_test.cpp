// The CUDA GLA kernels (kernels/cuda/gla.hpp, gla_ops.hpp) against the CPU kernels
// (kernels/cpu/gla.hpp, gla_gate.hpp, gated_rmsnorm.hpp, short_conv.hpp) on random inputs (never
// zeros; gk = the CPU gate's logsigmoid(z) / normalizer, so negative as in a model), every output
// filled with NaN first so that an element a kernel missed fails, and the columns between the
// views of a fused buffer filled with a sentinel that must survive.
//
// The core: q, k, v and gk as strided views inside one fused [B*T, H*K + Hkv*K + Hkv*V + Hkv*K + 3]
// buffer, dq, dk, dv and dgk written into the same layout of a gradient buffer, o and dout with a
// row stride past H*V; odd T (1, 17, 67, 130, 200: no multiple of the chunk), chunk 64 / sub-chunk
// 16 and 32/8, 16/4, 100/10 (more than one 64-row group), H = Hkv and H = 2 Hkv, K and V of 16,
// 64, 128 and the heads of configs/gla-default (K 24, V 48), gla-340m (128, 256) and gla-1.3b
// (256, 512); with and without h0 and dht; fla's gate (normalizer 16, logits N(0, 3^2)) and an
// extreme decay (normalizer 0.1, logits N(0, 30^2): per-token decays to e^-300). f32 against the
// CPU's f32 within 1e-5 relative L2, the bound tests/kernels/gla_test.cpp sets for the CPU against
// fp64 (a CPU emulation of these kernels, each CUDA thread a coroutine, measured at most 1.1e-6
// against the CPU, dgk the largest); two runs bit for bit equal; T = 0 (ht = h0, dh0 = dht). The
// state-passing pieces, the gate (bias, clamp, in place), the gated RMSNorm (gate as a strided view
// or none, weight or none) and the short convolution (strided x, y, dx; T shorter than the kernel)
// against the CPU too.
#include "kernels/cuda/gla.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "kernels/cpu/gated_rmsnorm.hpp"
#include "kernels/cpu/gla.hpp"
#include "kernels/cpu/gla_gate.hpp"
#include "kernels/cpu/short_conv.hpp"
#include "kernels/cuda/gla_ops.hpp"
#include "kernels/cuda/runtime.hpp"
#include "tests/kernels/cuda/cuda_test_util.hpp"
#include "tests/test_util.hpp"

using namespace loom;

namespace {

class GlaCuda : public test::CudaTest {};

constexpr double kTol = 1e-5;  // f32 against the CPU's f32, relative L2
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kSentinel = 777.0f;  // columns no kernel may write
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- helpers -----------------------------------------------------------------------------------

// Columns [off, off + width) of every row of a [rows, ld] buffer.
std::vector<float> columns(const std::vector<float>& buf, int64_t rows, int64_t ld, int64_t off,
                           int64_t width) {
  std::vector<float> out;
  out.reserve(size_t(rows * width));
  for (int64_t r = 0; r < rows; ++r)
    out.insert(out.end(), buf.begin() + r * ld + off, buf.begin() + r * ld + off + width);
  return out;
}
void put_columns(const std::vector<float>& src, int64_t rows, int64_t ld, int64_t off,
                 int64_t width, std::vector<float>& buf) {
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(src.begin() + r * width, width, buf.begin() + r * ld + off);
}
// A [rows, ld] buffer of NaN in columns [0, width) and the sentinel past them.
std::vector<float> poisoned(int64_t rows, int64_t ld, int64_t width) {
  std::vector<float> v(size_t(rows * ld), kSentinel);
  for (int64_t r = 0; r < rows; ++r) std::fill_n(v.begin() + r * ld, width, kNaN);
  return v;
}
// Every element of columns [width, ld) still the sentinel.
void expect_untouched(const std::vector<float>& buf, int64_t rows, int64_t ld, int64_t width,
                      const std::string& what) {
  size_t bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = width; i < ld; ++i) bad += buf[size_t(r * ld + i)] != kSentinel;
  EXPECT_EQ(bad, 0u) << what << ": columns past the view written";
}
void expect_near(const std::vector<float>& got, const std::vector<float>& want, double tol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t nonfinite = 0;
  for (float x : got) nonfinite += !std::isfinite(x);
  EXPECT_EQ(nonfinite, 0u) << what << ": elements not written or not finite";
  if (nonfinite == 0) {
    EXPECT_LE(test::rel_l2(got, want), tol) << what;
  }
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
float* fp(const Tensor& t) {
  return t.defined() ? t.data<float>() : nullptr;
}

// logsigmoid(z) / normalizer of z ~ N(0, logit_std^2) through the CPU's gate kernel: the log-decay
// a model feeds the core (every value negative).
std::vector<float> make_gk(size_t n, float normalizer, float logit_std, uint64_t seed) {
  const std::vector<float> z = test::randn(n, seed, logit_std);
  std::vector<float> gk(n);
  cpu::gla_gate_forward(z.data(), nullptr, 1, int64_t(n), normalizer, -kInf, gk.data());
  return gk;
}

// ---- the core ----------------------------------------------------------------------------------

struct Case {
  int64_t B, T, H, Hkv, K, V, chunk, sub;
  bool h0, dht;
  float normalizer = 16.0f, logit_std = 3.0f;
};
std::string name(const Case& c) {
  return str_cat("B", c.B, " T", c.T, " H", c.H, " Hkv", c.Hkv, " K", c.K, " V", c.V, " chunk ",
                 c.chunk, "/", c.sub, c.h0 ? " h0" : "", c.dht ? " dht" : "", " normalizer ",
                 c.normalizer, " logits ", c.logit_std);
}

// The fused layout of one row: q | k | v | gk | 3 spare columns.
struct Layout {
  int64_t wq, wk, wv, ld, ldo;
  explicit Layout(const Case& c)
      : wq(c.H * c.K),
        wk(c.Hkv * c.K),
        wv(c.Hkv * c.V),
        ld(wq + wk + wv + wk + 3),
        ldo(c.H * c.V + 5) {}
  int64_t kof() const { return wq; }
  int64_t vof() const { return wq + wk; }
  int64_t gof() const { return wq + wk + wv; }
  int64_t used() const { return wq + wk + wv + wk; }
};

struct Inputs {
  std::vector<float> x;     // [M, ld]: q, k, v, gk
  std::vector<float> dout;  // [M, ldo]
  std::vector<float> h0, dht;
};
Inputs make_inputs(const Case& c, uint64_t seed) {
  const Layout L(c);
  const int64_t M = c.B * c.T;
  Inputs in;
  in.x = test::randn(size_t(M * L.ld), seed);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = L.used(); i < L.ld; ++i) in.x[size_t(r * L.ld + i)] = kSentinel;
  put_columns(make_gk(size_t(M * L.wk), c.normalizer, c.logit_std, seed + 1), M, L.ld, L.gof(),
              L.wk, in.x);
  in.dout = test::randn(size_t(M * L.ldo), seed + 2);
  const size_t state = size_t(c.B * c.H * c.K * c.V);
  if (c.h0) in.h0 = test::randn(state, seed + 3);
  if (c.dht) in.dht = test::randn(state, seed + 4);
  return in;
}

cpu::GlaCore core_args(const Case& c, const float* x, const float* h0) {
  const Layout L(c);
  cpu::GlaCore a;
  a.B = c.B, a.T = c.T, a.H = c.H, a.Hkv = c.Hkv, a.K = c.K, a.V = c.V;
  a.scale = 1.0f / std::sqrt(float(c.K));
  a.chunk = c.chunk, a.sub_chunk = c.sub;
  a.q = {x, L.ld}, a.k = {x + L.kof(), L.ld}, a.v = {x + L.vof(), L.ld};
  a.gk = {x + L.gof(), L.ld};
  a.h0 = h0;
  return a;
}

// Every output of a forward and backward: o [M, ldo], ht, the gradient buffer [M, ld], dh0.
struct Outputs {
  std::vector<float> o, ht, grad, dh0;
};

Outputs run_cpu(const Case& c, const Inputs& in) {
  const Layout L(c);
  const int64_t M = c.B * c.T;
  const size_t state = size_t(c.B * c.H * c.K * c.V);
  const cpu::GlaCore a = core_args(c, in.x.data(), c.h0 ? in.h0.data() : nullptr);
  Outputs out;
  out.o = poisoned(M, L.ldo, c.H * c.V);
  out.ht.assign(state, kNaN);
  out.grad = poisoned(M, L.ld, L.used());
  out.dh0.assign(state, kNaN);
  cpu::gla_forward(a, {out.o.data(), L.ldo}, out.ht.data());
  float* g = out.grad.data();
  cpu::gla_backward(
      a, {in.dout.data(), L.ldo}, c.dht ? in.dht.data() : nullptr,
      {{g, L.ld}, {g + L.kof(), L.ld}, {g + L.vof(), L.ld}, {g + L.gof(), L.ld}, out.dh0.data()});
  return out;
}

Outputs run_cuda(const Case& c, const Inputs& in) {
  const Layout L(c);
  const int64_t M = c.B * c.T;
  const int64_t state = c.B * c.H * c.K * c.V;
  const Tensor x = test::to_device(in.x), dout = test::to_device(in.dout);
  const Tensor h0 = c.h0 ? test::to_device(in.h0) : Tensor();
  const Tensor dht = c.dht ? test::to_device(in.dht) : Tensor();
  const Tensor o = test::to_device(poisoned(M, L.ldo, c.H * c.V)), ht = test::nan_device(state);
  const Tensor grad = test::to_device(poisoned(M, L.ld, L.used()));
  const Tensor dh0 = test::nan_device(state);
  const cpu::GlaCore a = core_args(c, fp(x), fp(h0));
  cuda::gla_forward(a, {fp(o), L.ldo}, fp(ht));
  float* g = fp(grad);
  cuda::gla_backward(
      a, {fp(dout), L.ldo}, fp(dht),
      {{g, L.ld}, {g + L.kof(), L.ld}, {g + L.vof(), L.ld}, {g + L.gof(), L.ld}, fp(dh0)});
  return {test::to_host(o), test::to_host(ht), test::to_host(grad), test::to_host(dh0)};
}

void expect_matches(const Case& c, const Outputs& got, const Outputs& want) {
  const Layout L(c);
  const int64_t M = c.B * c.T;
  const std::string what = name(c);
  expect_near(columns(got.o, M, L.ldo, 0, c.H * c.V), columns(want.o, M, L.ldo, 0, c.H * c.V), kTol,
              what + " o");
  expect_untouched(got.o, M, L.ldo, c.H * c.V, what + " o");
  expect_near(got.ht, want.ht, kTol, what + " ht");
  const struct {
    const char* n;
    int64_t off, width;
  } grads[] = {
      {"dq", 0, L.wq}, {"dk", L.kof(), L.wk}, {"dv", L.vof(), L.wv}, {"dgk", L.gof(), L.wk}};
  for (const auto& gr : grads)
    expect_near(columns(got.grad, M, L.ld, gr.off, gr.width),
                columns(want.grad, M, L.ld, gr.off, gr.width), kTol, what + " " + gr.n);
  expect_untouched(got.grad, M, L.ld, L.used(), what + " gradients");
  expect_near(got.dh0, want.dh0, kTol, what + " dh0");
}

// Odd T, both GQA forms, every chunk form, the configs' head dims, h0 and dht on and off.
const std::vector<Case> kCases = {
    {2, 1, 2, 2, 16, 16, 64, 16, true, true},       {2, 17, 4, 2, 64, 64, 64, 16, true, false},
    {2, 130, 2, 2, 128, 128, 64, 16, false, true},  {1, 130, 4, 2, 64, 128, 32, 8, true, true},
    {2, 130, 2, 1, 16, 64, 16, 4, false, false},    {2, 17, 2, 1, 128, 16, 32, 8, true, true},
    {1, 200, 2, 1, 48, 40, 100, 10, true, true},    {2, 67, 6, 6, 24, 48, 64, 16, true, true},
    {1, 130, 4, 4, 128, 256, 64, 16, false, false}, {1, 70, 2, 2, 256, 512, 64, 16, true, true},
};

TEST_F(GlaCuda, CoreMatchesCpu) {
  uint64_t seed = 1;
  for (const Case& c : kCases) {
    SCOPED_TRACE(name(c));
    const Inputs in = make_inputs(c, seed += 10);
    expect_matches(c, run_cuda(c, in), run_cpu(c, in));
  }
}

// Per-token decays down to e^-300 and chunk-local cumsums to -10^4: every decay below e^-87 is
// exactly 0 on both sides, and the element-wise decays stay accurate.
TEST_F(GlaCuda, CoreMatchesCpuUnderExtremeDecay) {
  uint64_t seed = 500;
  for (Case c : {Case{2, 130, 4, 2, 32, 48, 64, 16, true, true},
                 Case{1, 67, 2, 1, 128, 64, 32, 8, true, true}}) {
    c.normalizer = 0.1f, c.logit_std = 30.0f;
    SCOPED_TRACE(name(c));
    const Inputs in = make_inputs(c, seed += 10);
    expect_matches(c, run_cuda(c, in), run_cpu(c, in));
  }
}

// Every reduction in a fixed order: two runs give the same bits.
TEST_F(GlaCuda, CoreIsDeterministic) {
  const Case c{2, 130, 4, 2, 64, 96, 64, 16, true, true};
  const Inputs in = make_inputs(c, 900);
  const Outputs a = run_cuda(c, in), b = run_cuda(c, in);
  EXPECT_TRUE(same_bits(a.o, b.o));
  EXPECT_TRUE(same_bits(a.ht, b.ht));
  EXPECT_TRUE(same_bits(a.grad, b.grad));
  EXPECT_TRUE(same_bits(a.dh0, b.dh0));
}

// No tokens: ht = h0 (or 0) and dh0 = dht (or 0), as the CPU (no token pointer is read).
TEST_F(GlaCuda, CoreWithoutTokensPassesTheStates) {
  for (const bool with : {true, false}) {
    const int64_t B = 2, H = 2, K = 16, V = 24, state = B * H * K * V;
    cpu::GlaCore a;
    a.B = B, a.T = 0, a.H = H, a.Hkv = 1, a.K = K, a.V = V, a.scale = 0.25f;
    const auto h0 = test::randn(size_t(state), 41), dht = test::randn(size_t(state), 42);
    const Tensor dh0v = test::to_device(h0), ddht = test::to_device(dht);
    a.h0 = with ? fp(dh0v) : nullptr;
    const Tensor ht = test::nan_device(state), dh0 = test::nan_device(state);
    cuda::gla_forward(a, {nullptr, 0}, fp(ht));
    cuda::gla_backward(a, {nullptr, 0}, with ? fp(ddht) : nullptr,
                       {{nullptr, 0}, {nullptr, 0}, {nullptr, 0}, {nullptr, 0}, fp(dh0)});
    const std::vector<float> zero(size_t(state), 0.0f);
    EXPECT_TRUE(same_bits(test::to_host(ht), with ? h0 : zero));
    EXPECT_TRUE(same_bits(test::to_host(dh0), with ? dht : zero));
  }
}

TEST_F(GlaCuda, CoreRejectsWhatTheCpuRejects) {
  cpu::GlaCore a;
  a.B = 1, a.T = 4, a.H = 3, a.Hkv = 2, a.K = 8, a.V = 8, a.scale = 1;
  const Tensor buf = test::nan_device(64);
  float* x = fp(buf);
  a.q = {x, 0}, a.k = {x, 0}, a.v = {x, 0}, a.gk = {x, 0};
  test::expect_error(
      [&] {
        cuda::gla_forward(a, {x, 0}, nullptr);
      },
      {"gla_forward", "num_kv_heads", "3", "2"});
  a.H = 2, a.sub_chunk = 128;
  test::expect_error([&] { cuda::gla_forward(a, {x, 0}, nullptr); }, {"sub_chunk", "128"});
  a.sub_chunk = 16, a.q.ld = 4;
  test::expect_error([&] { cuda::gla_forward(a, {x, 0}, nullptr); }, {"row stride of q", "16"});
  a.q.ld = 0;
  test::expect_error(
      [&] {
        cuda::gla_backward(a, {x, 3}, nullptr, {{x, 0}, {x, 0}, {x, 0}, {x, 0}});
      },
      {"gla_backward", "row stride of dout", "16"});
}

// ---- state passing -----------------------------------------------------------------------------

// decay = the sum of gk over the tokens: the CPU's bits (one thread per output, token order);
// S <- e^decay S + E with each query head's kv head.
TEST_F(GlaCuda, DecayTotalAndStateFoldMatchCpu) {
  for (const auto& [B, T, H, Hkv, K, V] : std::vector<std::array<int64_t, 6>>{
           {2, 13, 4, 2, 24, 20}, {1, 130, 2, 2, 128, 256}, {3, 1, 6, 6, 16, 48}}) {
    SCOPED_TRACE(str_cat("B", B, " T", T, " H", H, " Hkv", Hkv, " K", K, " V", V));
    const auto gk = make_gk(size_t(B * T * Hkv * K), 4.0f, 3.0f, 31);
    std::vector<float> decay(size_t(B * Hkv * K));
    cpu::gla_decay_total(B, T, Hkv, K, gk.data(), decay.data());
    const Tensor dgk = test::to_device(gk), ddecay = test::nan_device(int64_t(decay.size()));
    cuda::gla_decay_total(B, T, Hkv, K, fp(dgk), fp(ddecay));
    const auto got = test::to_host(ddecay);
    EXPECT_TRUE(same_bits(got, decay));
    expect_near(got, decay, 1e-6, "decay");

    auto S = test::randn(size_t(B * H * K * V), 32);
    const auto E = test::randn(S.size(), 33);
    const Tensor dS = test::to_device(S), dE = test::to_device(E);
    cpu::gla_state_fold(B, H, Hkv, K, V, decay.data(), E.data(), S.data());
    cuda::gla_state_fold(B, H, Hkv, K, V, fp(ddecay), fp(dE), fp(dS));
    expect_near(test::to_host(dS), S, kTol, "folded state");
  }
}

// ---- the gate ----------------------------------------------------------------------------------

struct Gate {
  int64_t rows, width;
  float normalizer, clamp_min;
};
std::string name(const Gate& g) {
  return str_cat(g.rows, "x", g.width, " normalizer ", g.normalizer, " clamp_min ", g.clamp_min);
}
// One row; odd widths; 1100 rows (more than the 512 ranges of dbias: 3 rows each, the last
// short) and 5000 (10 rows a range: every one of a block's 8 row lanes sums rows); fla's gate
// without a clamp and with one that cuts a good share of the values.
const std::vector<Gate> kGates = {{1, 48, 16.0f, -kInf},     {67, 100, 16.0f, -kInf},
                                  {260, 64, 16.0f, -0.1f},   {1100, 48, 1.0f, -kInf},
                                  {1100, 33, 16.0f, -0.05f}, {5000, 40, 16.0f, -0.1f}};

TEST_F(GlaCuda, GateForwardMatchesCpu) {
  uint64_t seed = 60;
  for (const Gate& g : kGates)
    for (const bool with_bias : {true, false})
      for (const bool in_place : {false, true}) {
        SCOPED_TRACE(name(g) + (with_bias ? " bias" : "") + (in_place ? " in place" : ""));
        const auto z = test::randn(size_t(g.rows * g.width), seed++, 3.0f);
        const auto bias = test::randn(size_t(g.width), seed++, 0.5f);
        std::vector<float> want(z.size());
        cpu::gla_gate_forward(z.data(), with_bias ? bias.data() : nullptr, g.rows, g.width,
                              g.normalizer, g.clamp_min, want.data());
        const Tensor dz = test::to_device(z), db = test::to_device(bias);
        const Tensor gk = in_place ? dz : test::nan_device(int64_t(z.size()));
        cuda::gla_gate_forward(fp(dz), with_bias ? fp(db) : nullptr, g.rows, g.width, g.normalizer,
                               g.clamp_min, fp(gk));
        expect_near(test::to_host(gk), want, kTol, "gk");
      }
}

TEST_F(GlaCuda, GateBackwardMatchesCpu) {
  uint64_t seed = 80;
  for (const Gate& g : kGates)
    for (const bool with_bias : {true, false})
      for (const bool in_place : {false, true}) {
        SCOPED_TRACE(name(g) + (with_bias ? " bias" : "") + (in_place ? " in place" : ""));
        const size_t n = size_t(g.rows * g.width);
        const auto z = test::randn(n, seed++, 3.0f), dgk = test::randn(n, seed++);
        const auto bias = test::randn(size_t(g.width), seed++, 0.5f);
        const auto dbias0 = test::randn(size_t(g.width), seed++);  // accumulated into
        std::vector<float> dz(n), dbias = dbias0;
        cpu::gla_gate_backward(dgk.data(), z.data(), with_bias ? bias.data() : nullptr, g.rows,
                               g.width, g.normalizer, g.clamp_min, dz.data(),
                               with_bias ? dbias.data() : nullptr);
        const Tensor ddgk = test::to_device(dgk), dzin = test::to_device(z);
        const Tensor db = test::to_device(bias), ddb = test::to_device(dbias0);
        const Tensor ddz = in_place ? ddgk : test::nan_device(int64_t(n));
        cuda::gla_gate_backward(fp(ddgk), fp(dzin), with_bias ? fp(db) : nullptr, g.rows, g.width,
                                g.normalizer, g.clamp_min, fp(ddz), with_bias ? fp(ddb) : nullptr);
        expect_near(test::to_host(ddz), dz, kTol, "dz");
        expect_near(test::to_host(ddb), dbias, kTol, "dbias");
      }
}

// ---- the gated RMSNorm -------------------------------------------------------------------------

struct Norm {
  int64_t rows, heads, dim;
};
// One row; the configs' output heads (6 x 48, 4 x 256, 4 x 512); odd dims; 1100 rows (more than
// the 512 ranges of dw: 3 rows, 12 items a range, so every warp of a block takes one or two).
const std::vector<Norm> kNorms = {{1, 2, 16},  {67, 6, 48},   {37, 4, 256},
                                  {5, 4, 512}, {1100, 4, 40}, {130, 3, 33}};

TEST_F(GlaCuda, GatedRmsNormMatchesCpu) {
  uint64_t seed = 200;
  for (const Norm& nm : kNorms)
    for (const bool gate : {true, false})
      for (const bool weight : {true, false}) {
        SCOPED_TRACE(str_cat(nm.rows, " rows x ", nm.heads, " heads x ", nm.dim,
                             gate ? " gate" : "", weight ? " weight" : ""));
        const int64_t HD = nm.heads * nm.dim, M = nm.rows;
        const int64_t ldg = HD + 7;  // the gate: a view into a wider buffer
        const cpu::GatedRmsNorm s{M, nm.heads, nm.dim, 1e-6f};
        auto x = test::randn(size_t(M * HD), seed++);
        for (int64_t r = 0; r < M; r += 3)  // rows of very different scales
          for (int64_t i = 0; i < HD; ++i) x[size_t(r * HD + i)] *= 0.01f;
        auto gbuf = test::randn(size_t(M * ldg), seed++, 2.0f);
        for (int64_t r = 0; r < M; ++r)
          for (int64_t i = HD; i < ldg; ++i) gbuf[size_t(r * ldg + i)] = kSentinel;
        auto w = test::randn(size_t(nm.dim), seed++, 0.5f);
        for (float& v : w) v += 1.0f;
        const auto dy = test::randn(x.size(), seed++);
        const auto dw0 = test::randn(w.size(), seed++);
        const float* g = gate ? gbuf.data() : nullptr;
        const float* wp = weight ? w.data() : nullptr;

        std::vector<float> y(x.size()), rstd(size_t(M * nm.heads)), dx(x.size());
        std::vector<float> dg = poisoned(M, ldg, HD), dw = dw0;
        cpu::gated_rmsnorm_forward(s, x.data(), g, gate ? ldg : 0, wp, y.data(), rstd.data());
        cpu::gated_rmsnorm_backward(s, dy.data(), x.data(), g, gate ? ldg : 0, wp, rstd.data(),
                                    dx.data(), gate ? dg.data() : nullptr, gate ? ldg : 0,
                                    weight ? dw.data() : nullptr);

        const Tensor dX = test::to_device(x), dG = test::to_device(gbuf), dW = test::to_device(w);
        const Tensor dDY = test::to_device(dy), dDW = test::to_device(dw0);
        const Tensor dY = test::nan_device(int64_t(y.size()));
        const Tensor dR = test::nan_device(int64_t(rstd.size()));
        const Tensor dDX = test::nan_device(int64_t(dx.size()));
        const Tensor dDG = test::to_device(poisoned(M, ldg, HD));
        const float* gg = gate ? fp(dG) : nullptr;
        const float* gw = weight ? fp(dW) : nullptr;
        cuda::gated_rmsnorm_forward(s, fp(dX), gg, gate ? ldg : 0, gw, fp(dY), fp(dR));
        expect_near(test::to_host(dY), y, kTol, "y");
        expect_near(test::to_host(dR), rstd, kTol, "rstd");
        // The backward from the CPU's rstd (as a layer passes the forward's).
        const Tensor cpu_rstd = test::to_device(rstd);
        cuda::gated_rmsnorm_backward(s, fp(dDY), fp(dX), gg, gate ? ldg : 0, gw, fp(cpu_rstd),
                                     fp(dDX), gate ? fp(dDG) : nullptr, gate ? ldg : 0,
                                     weight ? fp(dDW) : nullptr);
        expect_near(test::to_host(dDX), dx, kTol, "dx");
        if (gate) {
          const auto got = test::to_host(dDG);
          expect_near(columns(got, M, ldg, 0, HD), columns(dg, M, ldg, 0, HD), kTol, "dg");
          expect_untouched(got, M, ldg, HD, "dg");
        }
        expect_near(test::to_host(dDW), dw, kTol, "dw");
      }
}

// ---- the short convolution ---------------------------------------------------------------------

struct Conv {
  int64_t B, T, C, W;
};

// T shorter than the kernel (1, 3), odd T and C, the default width 4 and others, 4200 rows (9
// rows a range of dw: every row lane of a block sums rows); x, y and dx as views into wider
// buffers (the fused projection's columns).
TEST_F(GlaCuda, ShortConvMatchesCpu) {
  uint64_t seed = 300;
  for (const Conv& c : std::vector<Conv>{{2, 1, 48, 4},
                                         {2, 3, 100, 4},
                                         {1, 17, 64, 4},
                                         {2, 130, 96, 4},
                                         {2, 2100, 40, 4},
                                         {3, 67, 33, 3},
                                         {1, 600, 40, 1},
                                         {2, 40, 24, 6}}) {
    SCOPED_TRACE(str_cat("B", c.B, " T", c.T, " C", c.C, " W", c.W));
    const int64_t M = c.B * c.T, ldx = c.C + 9, ldy = c.C + 4;
    const cpu::ShortConv s{c.B, c.T, c.C, c.W};
    const auto x = test::randn(size_t(M * ldx), seed++);
    const auto w = test::randn(size_t(c.C * c.W), seed++, 0.5f);
    const auto dy = test::randn(size_t(M * c.C), seed++);
    const auto dw0 = test::randn(w.size(), seed++);
    std::vector<float> y = poisoned(M, ldy, c.C), dx = poisoned(M, ldy, c.C), dw = dw0;
    cpu::short_conv_forward(s, x.data(), ldx, w.data(), y.data(), ldy);
    cpu::short_conv_backward(s, dy.data(), 0, x.data(), ldx, w.data(), dx.data(), ldy, dw.data());

    const Tensor dX = test::to_device(x), dW = test::to_device(w), dDY = test::to_device(dy);
    const Tensor dDW = test::to_device(dw0);
    const Tensor dY = test::to_device(poisoned(M, ldy, c.C));
    const Tensor dDX = test::to_device(poisoned(M, ldy, c.C));
    cuda::short_conv_forward(s, fp(dX), ldx, fp(dW), fp(dY), ldy);
    cuda::short_conv_backward(s, fp(dDY), 0, fp(dX), ldx, fp(dW), fp(dDX), ldy, fp(dDW));
    const auto gy = test::to_host(dY), gdx = test::to_host(dDX);
    expect_near(columns(gy, M, ldy, 0, c.C), columns(y, M, ldy, 0, c.C), kTol, "y");
    expect_untouched(gy, M, ldy, c.C, "y");
    expect_near(columns(gdx, M, ldy, 0, c.C), columns(dx, M, ldy, 0, c.C), kTol, "dx");
    expect_untouched(gdx, M, ldy, c.C, "dx");
    expect_near(test::to_host(dDW), dw, kTol, "dw");
  }
}

}  // namespace
