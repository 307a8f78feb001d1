#include "plan/calibrate.hpp"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <ostream>
#include <set>
#include <sstream>
#include <thread>

#include "core/error.hpp"
#include "ops/ops.hpp"
#include "train/rank_plan.hpp"

namespace loom::plan {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The largest cache of the highest level cpu0 reports in sysfs (what lscpu shows), 32 MiB when
// none is readable. Not sysconf(_SC_LEVEL3_CACHE_SIZE): under a VM it may report the host's
// (384 MiB on this project's Zen 5 guests, 32 MiB in sysfs).
size_t last_level_cache_bytes() {
  int best_level = 0;
  size_t best = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    size_t size = 0;
    std::string unit;
    if (!(level_file >> level) || !(size_file >> size)) continue;
    size_file >> unit;  // "32768K"; the number stops at the unit
    size <<= unit == "M" ? 20 : unit == "K" ? 10 : 0;
    if (level > best_level || (level == best_level && size > best)) best_level = level, best = size;
  }
  return best ? best : size_t(32) << 20;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// A measured call: built on meta to count its work as the planner will, and on cpu to time it.
using Call = std::function<void()>;
using Build = std::function<Call(Device)>;

struct Rate {
  double flops = 0, bytes = 0;  // per second
  const char* op = "";
  double seconds = 0;  // of one call
};

class Bench {
 public:
  Bench(const CalibrateOptions& opt, dist::ProcessGroup* world, std::ostream* log,
        std::vector<std::string>& notes)
      : opt_(opt), world_(world), log_(log), notes_(notes) {}

  bool quick() const { return opt_.quick; }
  int ranks() const { return world_ ? world_->size() : 1; }
  bool lead() const { return !world_ || world_->rank() == 0; }
  dist::ProcessGroup* world() const { return world_; }

  // Random values (never zeros: a kernel may take shortcuts on them).
  Tensor random(const Shape& s, Device dev, float std = 1.0f) {
    Tensor t = Tensor::empty(s, DType::f32, dev);
    ops::philox_normal(t, key_++, 0, std);
    return t;
  }
  void barrier() {
    if (world_) world_->barrier()->wait();
  }
  // The fastest of repetitions filling a short budget, after a warm-up: other processes on the
  // machine only ever add time, so the fastest is the closest to the machine's own speed. Every
  // rank starts together: they share the machine's cores and memory as training does.
  // Collectives need `reps` given: every rank must make the same calls.
  double seconds(const Call& fn, int reps = 0, bool cold = false) {
    barrier();
    Clock::time_point t0 = Clock::now();
    fn();
    const double first = std::max(since(t0), 1e-9), budget = quick() ? 0.02 : 0.08;
    if (reps <= 0) reps = std::clamp(int(budget / first), 2, 25);
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      if (cold) evict();
      t0 = Clock::now();
      fn();
      t.push_back(since(t0));
    }
    return *std::min_element(t.begin(), t.end());
  }
  Rate measure(const Build& build) {
    ops::KernelWork sum;
    {
      const Call call = build(Device::meta);  // built before recording: its setup is no work
      ops::RecordWork record([&](const ops::KernelWork& w) {
        sum.flops += w.flops;
        sum.bytes += w.bytes;
        sum.op = w.op;
      });
      call();
    }
    const double s = seconds(build(Device::cpu), 0, true);
    return {sum.flops / s, sum.bytes / s, sum.op, s};
  }
  // A kernel of a step reads operands last touched many kernels before (a weight, a saved
  // activation): out of the caches. Writing a buffer the size of the last-level cache evicts
  // the repetition's operands, which a loop would otherwise find hot.
  void evict() {
    if (flush_.empty()) {
      flush_.assign(last_level_cache_bytes(), 0);
      note("kernels timed on cold operands: " + num(double(flush_.size()) / (1 << 20)) +
           " MiB (the last-level cache) written before each repetition");
    }
    for (size_t i = 0; i < flush_.size(); i += 64) flush_[i] = char(flush_[i] + 1);
  }
  void note(const std::string& line) {
    if (log_ && lead()) *log_ << "  " << line << "\n" << std::flush;
    notes_.push_back(line);
  }

 private:
  const CalibrateOptions& opt_;
  dist::ProcessGroup* world_;
  std::ostream* log_;
  std::vector<std::string>& notes_;
  uint64_t key_ = 1;
  std::vector<char> flush_;
};

Call call(std::function<void()> f) {
  return f;
}

// ---- GEMMs: y = x w^T on a grid of shapes spanning the models' (M tokens, N and K widths) ----

GemmPoint measure_gemm(Bench& b, DType dt, int64_t m, int64_t n, int64_t k) {
  const Rate r = b.measure([&b, dt, m, n, k](Device dev) {
    Tensor x = ops::to_compute(b.random({m, k}, dev), dt);
    Tensor w = ops::to_compute(b.random({n, k}, dev), dt);
    Tensor y = Tensor::empty({m, n}, DType::f32, dev);
    return call([x, w, y]() mutable { ops::linear(x, w, y); });
  });
  return {m, n, k, r.flops};
}

std::vector<GemmPoint> gemm_table(Bench& b, DType dt, const CalibrateOptions& opt) {
  // Powers of 4 from 64 to 4096 in each dimension; the largest products are left out (their
  // rate is the plateau of the ones measured, and they would take seconds each).
  const std::vector<int64_t> full{64, 256, 1024, 4096}, quick{128, 1024};
  const std::vector<int64_t>& sizes = b.quick() ? quick : full;
  const double max_product = b.quick() ? 1.5e8 : 4.3e9;
  std::vector<GemmPoint> points;
  for (int64_t m : sizes)
    for (int64_t n : sizes)
      for (int64_t k : sizes) {
        if (double(m) * double(n) * double(k) > max_product) continue;
        points.push_back(measure_gemm(b, dt, m, n, k));
      }
  if (dt == opt.gemm_shapes_dtype)
    for (const GemmPoint& s : opt.gemm_shapes) points.push_back(measure_gemm(b, dt, s.m, s.n, s.k));
  if (!opt.gemm_shapes.empty() && dt == opt.gemm_shapes_dtype)
    b.note(std::to_string(opt.gemm_shapes.size()) + " " + std::string(dtype_name(dt)) +
           " GEMM shapes of the model's step measured besides the grid");
  return points;
}

double peak_of(const std::vector<GemmPoint>& points) {
  double best = 0;
  for (const GemmPoint& p : points) best = std::max(best, p.flops_per_s);
  return best;
}

// ---- attention (f32 flash kernels), forward and backward --------------------------------------

// In bf16 (loom's bf16 kernels) q, k, v and the backward's out are bf16, as the model saves them.
Build attention(Bench& b, int64_t T, int64_t D, bool backward, DType dt = DType::f32) {
  return [&b, T, D, backward, dt](Device dev) {
    const int64_t B = 1, Hq = 4, Hkv = 2;  // a tp rank's heads at most: small GQA groups
    Tensor q = ops::to_compute(b.random({B * T, Hq * D}, dev), dt),
           k = ops::to_compute(b.random({B * T, Hkv * D}, dev), dt),
           v = ops::to_compute(b.random({B * T, Hkv * D}, dev), dt);
    Tensor out = Tensor::empty({B * T, Hq * D}, DType::f32, dev),
           lse = Tensor::empty({B, Hq, T}, DType::f32, dev);
    if (!backward)
      return call([=]() mutable { ops::attention_forward(q, k, v, B, Hq, Hkv, out, lse); });
    ops::attention_forward(q, k, v, B, Hq, Hkv, out, lse);
    out = ops::to_compute(out, dt);
    Tensor dout = b.random({B * T, Hq * D}, dev), dq = Tensor::empty(q.shape(), DType::f32, dev),
           dk = Tensor::empty(k.shape(), DType::f32, dev),
           dv = Tensor::empty(v.shape(), DType::f32, dev);
    return call([=]() mutable {
      ops::attention_backward(q, k, v, out, lse, dout, B, Hq, Hkv, dq, dk, dv);
    });
  };
}

// Ring attention's block pair (cp 2's shapes): this rank's T/2 queries at positions [T/2, T)
// against T/2 keys either before them (a whole block) or at the same positions (the causal
// diagonal), as attention_block_forward/backward run them.
Build attention_block(Bench& b, int64_t T, int64_t D, bool diagonal, bool backward) {
  return [&b, T, D, diagonal, backward](Device dev) {
    const int64_t B = 1, Hq = 4, Hkv = 2, n = T / 2;
    auto q_pos = std::make_shared<std::vector<int64_t>>(size_t(n));
    auto k_pos = std::make_shared<std::vector<int64_t>>(size_t(n));
    for (int64_t i = 0; i < n; ++i) {
      (*q_pos)[size_t(i)] = n + i;
      (*k_pos)[size_t(i)] = diagonal ? n + i : i;
    }
    Tensor q = b.random({B * n, Hq * D}, dev), k = b.random({B * n, Hkv * D}, dev),
           v = b.random({B * n, Hkv * D}, dev);
    Tensor out = Tensor::empty({B * n, Hq * D}, DType::f32, dev),
           lse = Tensor::empty({B, Hq, n}, DType::f32, dev);
    auto q_dev = std::make_shared<Tensor>(ops::index_tensor(*q_pos, dev, "position"));
    auto k_dev = std::make_shared<Tensor>(ops::index_tensor(*k_pos, dev, "position"));
    const auto shape = [=] {
      return ops::AttentionBlock{B, Hq, Hkv, q_pos.get(), k_pos.get(), q_dev.get(), k_dev.get()};
    };
    if (!backward)
      return call([=]() mutable { ops::attention_block_forward(shape(), q, k, v, out, lse); });
    ops::attention_block_forward(shape(), q, k, v, out, lse);
    Tensor dout = b.random({B * n, Hq * D}, dev),
           delta = Tensor::empty({B, Hq, n}, DType::f32, dev);
    ops::attention_delta(B, Hq, out, dout, delta);
    Tensor dq = Tensor::empty(q.shape(), DType::f32, dev),
           dk = Tensor::empty(k.shape(), DType::f32, dev),
           dv = Tensor::empty(v.shape(), DType::f32, dev);
    return call([=]() mutable {
      ops::attention_block_backward(shape(), q, k, v, lse, delta, dout, dq, dk, dv);
    });
  };
}

// c1 and c2 of t = c1 x1 + c2 x2 minimizing the relative error over points {x1, x2, t} (least
// squares on 1 = c1 x1 / t + c2 x2 / t). Noise can leave either non-positive: the caller decides.
std::array<double, 2> fit_two(const std::vector<std::array<double, 3>>& pts) {
  double a11 = 0, a12 = 0, a22 = 0, b1 = 0, b2 = 0;
  for (const auto& [x1, x2, t] : pts) {
    const double x = x1 / t, y = x2 / t;
    a11 += x * x, a12 += x * y, a22 += y * y, b1 += x, b2 += y;
  }
  const double det = a11 * a22 - a12 * a12;
  if (!(det > 0)) return {0, 0};
  return {(b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det};
}

// One attention kernel's FLOPs, bytes and seconds at one shape, and the fit of
// seconds = flops / rate + bytes / bandwidth over several (least squares on the relative error;
// bandwidth 0 when noise leaves no positive byte term: the mean rate alone).
struct Sample {
  double flops, bytes, seconds;
};
struct Fit {
  double rate = 0, bandwidth = 0;
  double worst = 0;  // the largest relative error of a sample
};
Fit fit_flops_bytes(const std::vector<Sample>& pts) {
  std::vector<std::array<double, 3>> xs;
  for (const Sample& p : pts) xs.push_back({p.flops, p.bytes, p.seconds});
  const auto [per_flop, per_byte] = fit_two(xs);
  Fit f;
  if (per_flop > 0 && per_byte > 0) {
    f.rate = 1 / per_flop;
    f.bandwidth = 1 / per_byte;
  } else {
    double flops = 0, seconds = 0;
    for (const Sample& p : pts) flops += p.flops, seconds += p.seconds;
    f.rate = flops / seconds;
  }
  for (const Sample& p : pts) {
    const double t = p.flops / f.rate + (f.bandwidth > 0 ? p.bytes / f.bandwidth : 0);
    f.worst = std::max(f.worst, std::fabs(t / p.seconds - 1));
  }
  return f;
}

// ---- memory-bound ops -------------------------------------------------------------------------

std::vector<Build> memory_ops(Bench& b) {
  const int64_t rows = b.quick() ? 1024 : 4096, d = 1024, F = 1024, H = 8, V = 8192;
  auto tokens = std::make_shared<std::vector<int32_t>>(size_t(rows));
  for (size_t i = 0; i < tokens->size(); ++i) (*tokens)[i] = int32_t((i * 2654435761u) % V);
  auto positions = std::make_shared<std::vector<int32_t>>(size_t(rows));
  for (size_t i = 0; i < positions->size(); ++i) (*positions)[i] = int32_t(i);
  // The index arrays and the rotary table on the build's device.
  const auto indices = [](const std::vector<int32_t>& v, Device dev) {
    return ops::index_tensor(v, dev, "index");
  };
  const auto table = [=](Device dev) {
    return std::make_shared<ops::Rope>(ops::rope_table(d / H, rows, 10000.0, RopeScaling{}, dev));
  };
  const auto empty = [](const Shape& s, Device dev, DType dt = DType::f32) {
    return Tensor::empty(s, dt, dev);
  };
  std::vector<Build> builds;
  builds.push_back([=, &b](Device dev) {
    Tensor x = b.random({rows, d}, dev), w = b.random({d}, dev), y = empty({rows, d}, dev),
           rstd = empty({rows}, dev);
    return call([=]() mutable { ops::rmsnorm_forward(x, w, 1e-5f, y, rstd); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor x = b.random({rows, d}, dev), w = b.random({d}, dev), y = empty({rows, d}, dev),
           rstd = empty({rows}, dev), dy = b.random({rows, d}, dev), dx = empty({rows, d}, dev),
           dw = b.random({d}, dev);
    ops::rmsnorm_forward(x, w, 1e-5f, y, rstd);
    return call([=]() mutable { ops::rmsnorm_backward(dy, x, w, rstd, dx, dw); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor gu = b.random({rows, 2 * F}, dev), act = empty({rows, F}, dev);
    return call([=]() mutable { ops::swiglu_forward(gu, act); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor gu = b.random({rows, 2 * F}, dev), dact = b.random({rows, F}, dev),
           dgu = empty({rows, 2 * F}, dev);
    return call([=]() mutable { ops::swiglu_backward(dact, gu, dgu); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor x = b.random({rows, d}, dev), p = indices(*positions, dev);
    return call([=, t = table(dev)]() mutable { ops::rope_forward(x, 1, H, p, *t); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor x = b.random({rows, d}, dev), p = indices(*positions, dev);
    return call([=, t = table(dev)]() mutable { ops::rope_backward(x, 1, H, p, *t); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor x = b.random({rows, d}, dev), y = empty({rows, d}, dev, DType::bf16);
    return call([=]() mutable { ops::cast(x, y); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor t = b.random({V, d}, dev), out = empty({rows, d}, dev), ids = indices(*tokens, dev);
    return call([=]() mutable { ops::embedding_forward(ids, t, out); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor dt = b.random({V, d}, dev), dout = b.random({rows, d}, dev), ids = indices(*tokens, dev);
    return call([=]() mutable { ops::embedding_backward(ids, dout, dt); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor logits = b.random({rows, V}, dev), lse = empty({rows}, dev), target = empty({rows}, dev),
           ids = indices(*tokens, dev);
    return call([=]() mutable { ops::vocab_shard_lse(logits, V, ids, 0, lse, target); });
  });
  builds.push_back([=, &b](Device dev) {
    Tensor logits = b.random({rows, V}, dev), glse = b.random({rows}, dev),
           ids = indices(*tokens, dev);
    return call([=]() mutable { ops::vocab_shard_dlogits(logits, V, ids, 0, glse, 1.0f); });
  });
  return builds;
}

// The fused loss's softmax passes cannot be timed apart from its GEMMs: they get the time the
// whole op takes beyond its GEMMs at the measured GEMM rates (at least a tenth of it).
double cross_entropy_bandwidth(Bench& b, const Hardware& hw) {
  const int64_t N = b.quick() ? 512 : 2048, D = 512, V = 8192;
  auto targets = std::make_shared<std::vector<int32_t>>(size_t(N));
  for (size_t i = 0; i < targets->size(); ++i) (*targets)[i] = int32_t((i * 2654435761u) % V);
  const auto args = [&b, targets, N, D, V](Device dev) {
    ops::LinearCrossEntropy a;
    // Logits of a model's scale (std about 1, as after initialization), not of unit inputs and
    // weights (std sqrt(D), about 23): with those most exponentials of the softmax are subnormal,
    // which some CPUs (Intel's, measured: a Xeon with AMX, 7 s for what takes 0.1 s) compute
    // through microcode assists, so the pass measured a slow path training never takes.
    a.x = b.random({N, D}, dev);
    a.w = b.random({V, D}, dev, 1.0f / std::sqrt(float(D)));
    a.dx = Tensor::empty({N, D}, DType::f32, dev);
    a.dw = Tensor::empty({V, D}, DType::f32, dev);
    a.targets = ops::index_tensor(*targets, dev, "target");
    a.V = V;
    a.grad_scale = 1.0f / float(N);
    return a;
  };
  double gemm_seconds = 0, softmax_bytes = 0;
  {
    const ops::LinearCrossEntropy a = args(Device::meta);
    ops::RecordWork record([&](const ops::KernelWork& w) {
      if (w.m > 0)
        gemm_seconds += kernel_seconds(w, hw);
      else
        softmax_bytes += w.bytes;
    });
    ops::linear_cross_entropy(a);
  }
  const ops::LinearCrossEntropy a = args(Device::cpu);
  const double total = b.seconds([&] { ops::linear_cross_entropy(a); });
  b.note("linear_cross_entropy N " + std::to_string(N) + " D " + std::to_string(D) + " V " +
         std::to_string(V) + ": " + num(total * 1e3) + " ms, its GEMMs " + num(gemm_seconds * 1e3) +
         " ms at the measured rates");
  return softmax_bytes / std::max(total - gemm_seconds, total / 10);
}

// y += x over arrays well past the caches: the streaming bandwidth.
Build stream(Bench& b) {
  const int64_t n = b.quick() ? (int64_t(1) << 21) : (int64_t(1) << 23);
  return [&b, n](Device dev) {
    Tensor x = b.random({n}, dev), y = b.random({n}, dev);
    return call([=]() mutable { ops::add_inplace(y, x); });
  };
}

// AdamW over f32 master weights: param, m and v read and written, the gradient read.
double adamw_bandwidth(Bench& b) {
  const int64_t n = b.quick() ? (int64_t(1) << 20) : (int64_t(1) << 22);
  Tensor p = b.random({n}, Device::cpu), g = b.random({n}, Device::cpu),
         m = b.random({n}, Device::cpu), v = b.random({n}, Device::cpu);
  float* vp = v.data<float>();
  for (int64_t i = 0; i < n; ++i) vp[i] *= vp[i];  // a second moment is not negative
  ops::AdamWStep a;
  a.lr = 1e-4f;
  a.weight_decay = 0.1f;
  const double s = b.seconds([&] {
    ops::adamw_step(a, p, g, m, v);
    ++a.step;
  });
  return 28.0 * double(n) / s;
}

// ---- collectives (under mpirun) ---------------------------------------------------------------

struct CommPoint {
  double bytes_sent, steps, seconds;  // time = bytes_sent / beta + steps * alpha
};

// alpha and beta minimizing the relative error of time = bytes / beta + steps * alpha.
Link fit(const std::vector<CommPoint>& pts) {
  std::vector<std::array<double, 3>> xs;
  for (const CommPoint& p : pts) xs.push_back({p.bytes_sent, p.steps, p.seconds});
  auto [inv_beta, alpha] = fit_two(xs);
  if (!(inv_beta > 0) || !(alpha > 0)) {
    // Noise made one negative: alpha from the smallest message, beta from the largest.
    auto [lo, hi] = std::minmax_element(
        pts.begin(), pts.end(), [](auto& x, auto& y) { return x.bytes_sent < y.bytes_sent; });
    alpha = lo->seconds / std::max(lo->steps, 1.0);
    inv_beta = std::max(hi->seconds - hi->steps * alpha, hi->seconds / 2) / hi->bytes_sent;
  }
  return {1.0 / inv_beta, alpha};
}

Link collectives(Bench& b, Hardware& hw) {
  dist::ProcessGroup& g = *b.world();
  const int n = g.size(), me = g.rank();
  const std::vector<int64_t> full{8, 1 << 10, 64 << 10, 1 << 20, 16 << 20},
      quick{8, 64 << 10, 1 << 20};
  std::vector<CommPoint> all, by_kind[4];
  const char* kinds[4] = {"all_gather", "reduce_scatter", "all_reduce", "send"};
  for (int64_t bytes : b.quick() ? quick : full) {
    const int64_t e = std::max<int64_t>(bytes / 4, 1);
    Tensor in = b.random({e}, Device::cpu), out = b.random({e * n}, Device::cpu);
    Tensor big = b.random({e * n}, Device::cpu);
    const double per = double(e) * 4.0;
    const int reps = bytes <= (64 << 10) ? 20 : 5;
    const double ag = b.seconds([&] { g.all_gather(in, out)->wait(); }, reps);
    const double rs =
        b.seconds([&] { g.reduce_scatter(big, in, dist::ReduceOp::sum)->wait(); }, reps);
    const double ar = b.seconds([&] { g.all_reduce(in, dist::ReduceOp::sum)->wait(); }, reps);
    // Ping-pong between ranks 0 and 1: half a round trip is one message.
    const double rt = b.seconds(
        [&] {
          if (me == 0) {
            g.send(in, 1, 7)->wait();
            g.recv(in, 1, 8)->wait();
          } else if (me == 1) {
            g.recv(in, 0, 7)->wait();
            g.send(in, 0, 8)->wait();
          }
        },
        reps);
    const std::vector<CommPoint> pts{{(n - 1) * per, double(n - 1), ag},
                                     {(n - 1) * per, double(n - 1), rs},
                                     {2.0 * (n - 1) * per / n, 2.0 * (n - 1), ar},
                                     {per, 1, rt / 2}};
    all.insert(all.end(), pts.begin(), pts.end());
    for (size_t i = 0; i < pts.size(); ++i) by_kind[i].push_back(pts[i]);
    b.note("collectives of " + std::to_string(int64_t(per)) + " B per rank: all_gather " +
           num(ag * 1e6) + " us, reduce_scatter " + num(rs * 1e6) + " us, all_reduce " +
           num(ar * 1e6) + " us, send " + num(rt / 2 * 1e6) + " us");
  }
  for (int i = 0; i < 4; ++i) {
    const Link l = fit(by_kind[i]);
    b.note(std::string(kinds[i]) + " alone: beta " + num(l.bandwidth / 1e9) + " GB/s, alpha " +
           num(l.latency * 1e6) + " us");
    const CollectiveKind kind[4] = {CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                                    CollectiveKind::all_reduce, CollectiveKind::send};
    hw.intra_by_kind[kind[i]] = l;
    // A receive is the other side of the same transfer.
    if (kind[i] == CollectiveKind::send) hw.intra_by_kind[CollectiveKind::recv] = l;
  }
  return fit(all);
}

// Ranks that run the same kernels between two collectives still reach it at different times
// (the machine's other work, the OS, shared caches and memory slow one rank now and another
// then), and a blocking collective waits for the last of them. Measured as a step meets it:
// segments of GEMMs, each followed by a one-float all-reduce, against the same segments without
// it, every rank running both ways at once (sharing the machine as training does), less the
// all-reduce's own latency. Segments of 1, 4 and 16 ms (a step's kernels between two of its
// collectives: a tp GEMM to an FSDP unit), three times each; returns the median wait as a
// fraction of the segment.
double sync_wait(Bench& b) {
  dist::ProcessGroup& g = *b.world();
  Tensor x = b.random({128, 256}, Device::cpu), w = b.random({256, 256}, Device::cpu);
  Tensor y = Tensor::empty({128, 256}, DType::f32, Device::cpu), one = b.random({1}, Device::cpu);
  const auto gemms = [&](int n) {
    for (int i = 0; i < n; ++i) ops::linear(x, w, y);
  };
  // The same number of GEMMs per segment on every rank: rank 0's count, shared.
  Tensor per_ms = Tensor::zeros({1}, DType::f32, Device::cpu);
  const double one_call = b.seconds([&] { gemms(1); }, 20);
  if (g.rank() == 0) per_ms.data<float>()[0] = float(1e-3 / one_call);
  g.all_reduce(per_ms, dist::ReduceOp::sum)->wait();
  const double budget = b.quick() ? 0.1 : 0.5;  // seconds per way, length and repetition
  // The mean over ranks of each rank's time for `iters` iterations of `body`.
  const auto mean_time = [&](int iters, const std::function<void()>& body) {
    b.barrier();
    const Clock::time_point t0 = Clock::now();
    for (int i = 0; i < iters; ++i) body();
    Tensor t = Tensor::empty({1}, DType::f32, Device::cpu);
    t.data<float>()[0] = float(since(t0));
    g.all_reduce(t, dist::ReduceOp::sum)->wait();
    return double(t.data<float>()[0]) / g.size();
  };
  const double latency =
      mean_time(2000, [&] { g.all_reduce(one, dist::ReduceOp::sum)->wait(); }) / 2000;
  std::vector<double> all;
  for (double ms : {1.0, 4.0, 16.0}) {
    const int n = std::max(1, int(std::lround(ms * per_ms.data<float>()[0])));
    // Both ways in alternating blocks, so that a change in the machine's other load meets both.
    const int blocks = 10, per_block = std::max(1, int(budget / (ms * 1e-3)) / blocks);
    std::vector<double> fractions;
    for (int rep = 0; rep < 3; ++rep) {
      double alone = 0, synced = 0;
      for (int k = 0; k < blocks; ++k) {
        alone += mean_time(per_block, [&] { gemms(n); });
        synced += mean_time(per_block, [&] {
          gemms(n);
          g.all_reduce(one, dist::ReduceOp::sum)->wait();
        });
      }
      fractions.push_back(std::max(0.0, synced - alone - blocks * per_block * latency) / alone);
    }
    all.insert(all.end(), fractions.begin(), fractions.end());
    std::sort(fractions.begin(), fractions.end());
    b.note("waits at a collective after " + num(ms) + " ms of GEMMs: " + num(100 * fractions[0]) +
           ", " + num(100 * fractions[1]) + ", " + num(100 * fractions[2]) + "% of them");
  }
  std::sort(all.begin(), all.end());
  const double median = all[all.size() / 2];
  b.note("sync_wait (the median): " + num(100 * median) + "% of the compute between collectives" +
         " (all_reduce latency " + num(latency * 1e6) + " us left out)" +
         (median > 0.25
              ? "; so much means other work shared the cores: calibrate on an idle machine"
              : ""));
  return median;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      std::string name = line.substr(line.find(':') + 2);
      name.erase(
          std::remove_if(name.begin(), name.end(), [](char c) { return c == '"' || c == '\\'; }),
          name.end());
      return name;
    }
  return "unknown";
}

}  // namespace

Calibration calibrate(const CalibrateOptions& opt, dist::ProcessGroup* world, std::ostream* log) {
  const Clock::time_point t0 = Clock::now();
  Calibration c;
  Bench b(opt, world, log, c.notes);
  Hardware& hw = c.hw;
  hw.name = opt.name;
  hw.threads = omp_get_max_threads();
  c.ranks = b.ranks();
  c.cpu = cpu_model();
  if (log && b.lead())
    *log << "calibrating " << c.cpu << ": " << c.ranks << " rank(s) x " << hw.threads
         << " OpenMP thread(s)" << (opt.quick ? " (quick)" : "") << "\n";

  hw.gemm_f32 = gemm_table(b, DType::f32, opt);
  hw.gemm_bf16 = gemm_table(b, DType::bf16, opt);
  hw.peak_f32 = peak_of(hw.gemm_f32);
  hw.peak_bf16 = peak_of(hw.gemm_bf16);
  hw.gemm_efficiency = 1;  // the tables are measured rates
  b.note("GEMM peak: f32 " + num(hw.peak_f32 / 1e9) + " GFLOP/s, bf16 " + num(hw.peak_bf16 / 1e9) +
         " GFLOP/s (" + std::to_string(hw.gemm_f32.size()) + " shapes each)");

  // Attention: time = FLOPs / rate + bytes / bandwidth, fitted over sequence lengths from a
  // short one up (the per-row work weighs on short sequences and small ring blocks); the rate as
  // a fraction of the f32 GEMM peak (the kernels compute in f32).
  const std::vector<std::pair<int64_t, int64_t>> shapes =
      opt.quick ? std::vector<std::pair<int64_t, int64_t>>{{128, 64}, {512, 64}}
                : std::vector<std::pair<int64_t, int64_t>>{{128, 64},  {256, 64},  {512, 64},
                                                           {2048, 64}, {256, 128}, {1024, 128}};
  // forward, backward, block forward, block backward, bf16 forward, bf16 backward
  std::array<std::vector<Sample>, 6> samples;
  for (auto [T, D] : shapes) {
    const Rate f = b.measure(attention(b, T, D, false)), g = b.measure(attention(b, T, D, true));
    samples[0].push_back({f.flops * f.seconds, f.bytes * f.seconds, f.seconds});
    samples[1].push_back({g.flops * g.seconds, g.bytes * g.seconds, g.seconds});
    b.note("attention T " + std::to_string(T) + " D " + std::to_string(D) + ": forward " +
           num(f.flops / 1e9) + " GFLOP/s, backward " + num(g.flops / 1e9) + " GFLOP/s");
    const Rate hf = b.measure(attention(b, T, D, false, DType::bf16)),
               hg = b.measure(attention(b, T, D, true, DType::bf16));
    samples[4].push_back({hf.flops * hf.seconds, hf.bytes * hf.seconds, hf.seconds});
    samples[5].push_back({hg.flops * hg.seconds, hg.bytes * hg.seconds, hg.seconds});
    b.note("attention bf16 T " + std::to_string(T) + " D " + std::to_string(D) + ": forward " +
           num(hf.flops / 1e9) + " GFLOP/s, backward " + num(hg.flops / 1e9) + " GFLOP/s");
    // Ring attention's block pairs: a whole block and a diagonal one (cp 2's pair of chunks).
    for (bool diagonal : {false, true}) {
      const Rate bf = b.measure(attention_block(b, T, D, diagonal, false)),
                 bg = b.measure(attention_block(b, T, D, diagonal, true));
      samples[2].push_back({bf.flops * bf.seconds, bf.bytes * bf.seconds, bf.seconds});
      samples[3].push_back({bg.flops * bg.seconds, bg.bytes * bg.seconds, bg.seconds});
      b.note("attention block T " + std::to_string(T) + " D " + std::to_string(D) +
             (diagonal ? " diagonal" : " whole") + ": forward " + num(bf.flops / 1e9) +
             " GFLOP/s, backward " + num(bg.flops / 1e9) + " GFLOP/s");
    }
  }
  double* efficiency[6] = {&hw.attention_efficiency,       &hw.attention_backward_efficiency,
                           &hw.attention_block_efficiency, &hw.attention_block_backward_efficiency,
                           &hw.attention_bf16_efficiency,  &hw.attention_bf16_backward_efficiency};
  double* bandwidth[6] = {&hw.attention_bandwidth[0],      &hw.attention_bandwidth[1],
                          &hw.attention_bandwidth[2],      &hw.attention_bandwidth[3],
                          &hw.attention_bf16_bandwidth[0], &hw.attention_bf16_bandwidth[1]};
  const char* kernel[6] = {"attention forward",       "attention backward",
                           "attention block forward", "attention block backward",
                           "attention bf16 forward",  "attention bf16 backward"};
  for (size_t i = 0; i < 6; ++i) {
    const Fit f = fit_flops_bytes(samples[i]);
    *efficiency[i] = f.rate / (i < 4 ? hw.peak_f32 : hw.peak_bf16);
    *bandwidth[i] = f.bandwidth;
    b.note(std::string(kernel[i]) + ": " + num(f.rate / 1e9) + " GFLOP/s + " +
           (f.bandwidth > 0 ? num(f.bandwidth / 1e9) + " GB/s" : std::string("no byte term")) +
           ", worst shape off by " + num(100 * f.worst) + "%");
  }

  const Rate s = b.measure(stream(b));
  hw.memory_bandwidth = s.bytes;
  hw.op_bandwidth[s.op] = s.bytes;
  b.note("stream (y += x): " + num(s.bytes / 1e9) + " GB/s");
  for (const Build& build : memory_ops(b)) {
    const Rate r = b.measure(build);
    hw.op_bandwidth[r.op] = r.bytes;
    b.note(std::string(r.op) + ": " + num(r.bytes / 1e9) + " GB/s");
  }
  hw.op_bandwidth["linear_cross_entropy"] = cross_entropy_bandwidth(b, hw);
  b.note("linear_cross_entropy (its softmax passes): " +
         num(hw.op_bandwidth["linear_cross_entropy"] / 1e9) + " GB/s");
  hw.optimizer_bandwidth = adamw_bandwidth(b);
  b.note("adamw: " + num(hw.optimizer_bandwidth / 1e9) + " GB/s");

  if (c.ranks > 1) {
    hw.intra_node = collectives(b, hw);
    hw.sync_wait = sync_wait(b);
    b.note("intra_node fit over all collectives: beta " + num(hw.intra_node.bandwidth / 1e9) +
           " GB/s, alpha " + num(hw.intra_node.latency * 1e6) + " us");
  } else {
    // Not measured: a shared-memory transport copies through memory (read and write) after
    // about a microsecond of handshake. Run under mpirun -np 2 to measure.
    hw.intra_node = {hw.memory_bandwidth / 2, 1e-6};
    b.note("links not measured (one rank): intra_node estimated from the memory bandwidth");
  }
  hw.inter_node = hw.intra_node;  // one machine: no second level to measure

  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  hw.ranks_per_node = int(std::max<int64_t>(c.ranks, cores / std::max(hw.threads, 1)));
  hw.capacity =
      double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE)) / double(hw.ranks_per_node);
  c.seconds = since(t0);
  return c;
}

std::vector<GemmPoint> step_gemm_shapes(const PlanJob& j) {
  std::set<std::array<int64_t, 3>> seen;
  for (const PlannedKernel& k : plan_rank(j, 0).kernels) {
    const ops::KernelWork& w = k.work;
    if (w.m <= 0) continue;
    for (int64_t dm : {1, 2, 4})
      for (int64_t dn : {1, 2})
        for (int64_t dk : {1, 2})
          if (w.m % dm == 0 && w.n % dn == 0 && w.k % dk == 0)
            seen.insert({w.m / dm, w.n / dn, w.k / dk});
  }
  std::vector<GemmPoint> out;
  for (const auto& s : seen) out.push_back({s[0], s[1], s[2], 0});
  return out;
}

std::string hardware_toml(const Calibration& c) {
  const Hardware& hw = c.hw;
  std::ostringstream os;
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  os << "# Measured by `loom plan calibrate` with loom's cpu kernels on " << c.cpu << ", "
     << c.ranks << " rank(s) x " << hw.threads << " OpenMP thread(s) each, all ranks at once.\n"
     << "# This machine's figures, not a datasheet's: re-run it on the machine a plan is for,\n"
     << "# with the OMP_NUM_THREADS training will use.\n"
     << "name = \"" << hw.name << "\"\n"
     << "# ranks of `threads` threads that fit the cores; capacity = memory / ranks_per_node\n"
     << "ranks_per_node = " << hw.ranks_per_node << "\n"
     << "capacity = " << num(hw.capacity) << "\n"
     << "memory_bandwidth = " << num(hw.memory_bandwidth) << "  # y += x streaming, bytes/s\n\n"
     << "[peak]  # the fastest GEMM measured, FLOP/s\n"
     << "f32 = " << num(hw.peak_f32) << "\nbf16 = " << num(hw.peak_bf16) << "\n\n"
     << "[gemm]\n"
     << "# Measured rates, [M, N, K, FLOP/s] of y [M, N] = x [M, K] w^T; a GEMM takes the rate of\n"
     << "# the nearest shape (log scale), so efficiency applies to none of them.\n"
     << "efficiency = 1.0\n";
  for (const auto& [key, table] : {std::pair{"f32", &hw.gemm_f32}, {"bf16", &hw.gemm_bf16}}) {
    os << key << " = [\n";
    for (const GemmPoint& p : *table)
      os << "  [" << p.m << ", " << p.n << ", " << p.k << ", " << num(p.flops_per_s) << "],\n";
    os << "]\n";
  }
  os << "\n[attention]  # f32 flash kernels: measured FLOP/s over peak.f32\n"
     << "efficiency = " << num(hw.attention_efficiency) << "\n"
     << "backward_efficiency = " << num(hw.attention_backward_efficiency) << "\n"
     << "block_efficiency = " << num(hw.attention_block_efficiency) << "  # ring attention's\n"
     << "block_backward_efficiency = " << num(hw.attention_block_backward_efficiency) << "\n";
  const char* bandwidths[4] = {"bandwidth", "backward_bandwidth", "block_bandwidth",
                               "block_backward_bandwidth"};
  for (size_t i = 0; i < 4; ++i)
    if (hw.attention_bandwidth[i] > 0)
      os << bandwidths[i] << " = " << num(hw.attention_bandwidth[i])
         << (i == 0 ? "  # bytes/s paid on top of the FLOPs (a fit over sequence lengths)" : "")
         << "\n";
  if (hw.attention_bf16_efficiency > 0) {
    os << "bf16_efficiency = " << num(hw.attention_bf16_efficiency)
       << "  # loom's bf16 kernels: measured FLOP/s over peak.bf16\n"
       << "bf16_backward_efficiency = " << num(hw.attention_bf16_backward_efficiency) << "\n";
    if (hw.attention_bf16_bandwidth[0] > 0)
      os << "bf16_bandwidth = " << num(hw.attention_bf16_bandwidth[0]) << "\n";
    if (hw.attention_bf16_bandwidth[1] > 0)
      os << "bf16_backward_bandwidth = " << num(hw.attention_bf16_bandwidth[1]) << "\n";
  }
  os << "\n"
     << "[memory_ops]  # bytes/s read and written, as ops report them on meta\n";
  for (const auto& [op, bw] : hw.op_bandwidth) os << op << " = " << num(bw) << "\n";
  os << "\n[optimizer]  # AdamW, 28 bytes per f32 parameter (param, m, v in and out, grad in)\n"
     << "bandwidth = " << num(hw.optimizer_bandwidth) << "\n\n"
     << "[links]\n"
     << "transfers_on_core = true  # MPI over shared memory: the rank's core copies, no overlap\n"
     << (hw.sync_wait > 0 ? "sync_wait = " + num(hw.sync_wait) +
                                "  # a blocking collective's wait for its last rank, per second "
                                "of compute since the previous one\n"
                          : std::string())
     << "[links.intra_node]\nbandwidth = " << num(hw.intra_node.bandwidth)
     << "\nlatency = " << num(hw.intra_node.latency) << "\n"
     << "[links.inter_node]  # one machine: the same as intra_node\nbandwidth = "
     << num(hw.inter_node.bandwidth) << "\nlatency = " << num(hw.inter_node.latency) << "\n\n";
  for (const auto& [kind, l] : hw.intra_by_kind)
    os << "[collectives." << collective_name(kind) << "]  # measured alone within the node\n"
       << "bandwidth = " << num(l.bandwidth) << "\nlatency = " << num(l.latency) << "\n";
  os << "\n[calibration]\nthreads = " << hw.threads << "\nranks = " << c.ranks << "\ncpu = \""
     << c.cpu << "\"\ndate = \"" << date << "\"\nseconds = " << num(std::max(c.seconds, 0.01))
     << "\n\n# The measurements:\n";
  for (const std::string& n : c.notes) os << "#   " << n << "\n";
  return os.str();
}

}  // namespace loom::plan
