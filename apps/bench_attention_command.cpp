// `loom bench attention`: the attention kernels of a device alone, forward and backward, at the
// shapes of published attention benchmarks (head dims 64 and 128, sequences 2k-8k, causal,
// grouped-query), each call timed by the device's own clock (the op profile: wall time on the CPU,
// CUDA events on a GPU), medians of several calls; TFLOP/s counted as FlashAttention's papers do
// (the causal half of the 2 forward and 5 backward products). bench/compare_attention_gpu.py runs
// PyTorch's SDPA on the same shapes beside it.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "apps/median.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "ops/devices.hpp"
#include "ops/ops.hpp"

namespace loom {
// Named as well as anonymous: the apps compile in unity batches, where another command's Options,
// Row or kUsage would meet these.
namespace bench_attention {
namespace {

const char* kUsage =
    "usage: loom bench attention [--device auto|cpu|cuda] [--dims 64,128] [--seq 2048,4096,8192]\n"
    "                            [--heads 32/8] [--tokens 16384] [--dtype bf16|f32] [--iters 10]\n"
    "                            [--json]\n"
    "  Times ops::attention_forward and attention_backward alone (causal, q/k/v as views of a\n"
    "  fused qkv buffer, as the models call them) at each head dim and sequence length, with\n"
    "  tokens / seq samples a call; medians of --iters calls after two warm-up calls.\n";

struct Options {
  std::string device = "auto";
  std::vector<int64_t> dims{64, 128}, seqs{2048, 4096, 8192};
  int64_t Hq = 32, Hkv = 8, tokens = 16384, iters = 10;
  DType dtype = DType::bf16;
  bool json = false;
};

std::vector<int64_t> int_list(const std::string& s, const char* key) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = std::min(s.find(',', at), s.size());
    const std::string item = s.substr(at, comma - at);
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    LOOM_CHECK(used == item.size() && !item.empty() && v > 0, key, ": expected positive integers ",
               "separated by commas, got '", s, "'");
    out.push_back(v);
    at = comma + 1;
  }
  return out;
}

Options parse(const Args& args) {
  Options o;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    const auto value = [&](const char* key) {
      LOOM_CHECK(i + 1 < args.size(), key, " needs a value\n", kUsage);
      return args[++i];
    };
    if (a == "--json") {
      o.json = true;
    } else if (a == "--device") {
      o.device = value("--device");
    } else if (a == "--dims") {
      o.dims = int_list(value("--dims"), "--dims");
    } else if (a == "--seq") {
      o.seqs = int_list(value("--seq"), "--seq");
    } else if (a == "--heads") {
      const std::string h = value("--heads");
      const size_t slash = h.find('/');
      LOOM_CHECK(slash != std::string::npos, "--heads: expected HQ/HKV, got '", h, "'");
      o.Hq = int_list(h.substr(0, slash), "--heads")[0];
      o.Hkv = int_list(h.substr(slash + 1), "--heads")[0];
      LOOM_CHECK(o.Hq % o.Hkv == 0, "--heads ", h, ": the query heads must be a multiple of the ",
                 "key/value heads");
    } else if (a == "--tokens") {
      o.tokens = int_list(value("--tokens"), "--tokens")[0];
    } else if (a == "--iters") {
      o.iters = int_list(value("--iters"), "--iters")[0];
    } else if (a == "--dtype") {
      const std::string d = value("--dtype");
      LOOM_CHECK(d == "bf16" || d == "f32", "--dtype: expected bf16 or f32, got '", d, "'");
      o.dtype = d == "bf16" ? DType::bf16 : DType::f32;
    } else {
      fail("bench attention: unknown argument '", a, "'\n", kUsage);
    }
  }
  return o;
}

// A tensor of N(0, 1) values on `dev` in `dt` (drawn as f32, then rounded).
Tensor random(const Shape& s, DType dt, Device dev, uint64_t key) {
  Tensor f = Tensor::empty(s, DType::f32, dev);
  ops::philox_normal(f, key, 0, 1.0f);
  if (dt == DType::f32) return f;
  Tensor r = Tensor::empty(s, dt, dev);
  ops::cast(f, r);
  return r;
}

struct Row {
  int64_t D = 0, T = 0, B = 0;
  double forward_s = 0, backward_s = 0, flops_forward = 0, flops_backward = 0;
};

Row run(const Options& o, Device dev, int64_t D, int64_t T) {
  Row r;
  r.D = D, r.T = T, r.B = std::max<int64_t>(1, o.tokens / T);
  const int64_t B = r.B, Hq = o.Hq, Hkv = o.Hkv, W = (Hq + 2 * Hkv) * D;
  Tensor qkv = random({B * T, W}, o.dtype, dev, 1);
  const Tensor q = qkv.narrow(1, 0, Hq * D), k = qkv.narrow(1, Hq * D, Hkv * D),
               v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D);
  Tensor out = Tensor::empty({B * T, Hq * D}, o.dtype, dev);
  Tensor lse = Tensor::empty({B, Hq, T}, DType::f32, dev);
  Tensor dout = random({B * T, Hq * D}, DType::f32, dev, 2);
  Tensor dqkv = Tensor::empty({B * T, W}, DType::f32, dev);
  Tensor dq = dqkv.narrow(1, 0, Hq * D), dk = dqkv.narrow(1, Hq * D, Hkv * D),
         dv = dqkv.narrow(1, (Hq + Hkv) * D, Hkv * D);
  std::vector<double> fwd, bwd;
  {
    // Each op's time on the device's clock.
    std::vector<double>* into = nullptr;
    const ops::ProfileOps profile(
        [&](const char*, const std::vector<ops::KernelWork>&, double s) { into->push_back(s); });
    for (int64_t i = 0; i < o.iters + 2; ++i) {
      into = &fwd;
      ops::attention_forward(q, k, v, B, Hq, Hkv, out, lse);
      into = &bwd;
      ops::attention_backward(q, k, v, out, lse, dout, B, Hq, Hkv, dq, dk, dv);
    }
  }
  fwd.erase(fwd.begin(), fwd.begin() + 2);
  bwd.erase(bwd.begin(), bwd.begin() + 2);
  r.forward_s = median(fwd), r.backward_s = median(bwd);
  // The causal half: T (T + 1) / 2 score entries per sample and head, 2 D FLOPs each product.
  const double product = 2.0 * double(B * Hq) * double(T) * double(T + 1) / 2 * double(D);
  r.flops_forward = 2 * product, r.flops_backward = 5 * product;
  return r;
}

}  // namespace
}  // namespace bench_attention

int bench_attention_command(const Args& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::fputs(bench_attention::kUsage, stdout);
      return 0;
    }
  const bench_attention::Options o = bench_attention::parse(args);
  const Device dev = ops::start_device(o.device);
  const ops::GpuAvailability g = ops::gpu_availability();
  const std::string on = dev == Device::cuda ? "GPU 0 " + g.name : std::string("the CPU");
  nlohmann::json rows = nlohmann::json::array();
  // The flash kernels' block sizes (LOOM_FLASH_WARPS) on a GPU.
  const std::string blocks = dev == Device::cuda ? g.flash_blocks : std::string();
  if (!o.json)
    std::printf(
        "attention on %s, %s, causal, %lld/%lld heads, %lld tokens a call%s%s\n"
        "%5s %6s %4s  %11s %9s  %11s %9s\n",
        on.c_str(), dtype_name(o.dtype).data(), (long long)o.Hq, (long long)o.Hkv,
        (long long)o.tokens, blocks.empty() ? "" : "\nflash blocks: ", blocks.c_str(), "D", "T",
        "B", "forward ms", "TFLOP/s", "backward ms", "TFLOP/s");
  for (int64_t D : o.dims)
    for (int64_t T : o.seqs) {
      const bench_attention::Row r = bench_attention::run(o, dev, D, T);
      const double tf = r.flops_forward / r.forward_s * 1e-12,
                   tb = r.flops_backward / r.backward_s * 1e-12;
      if (o.json)
        rows.push_back({{"D", r.D},
                        {"T", r.T},
                        {"B", r.B},
                        {"Hq", o.Hq},
                        {"Hkv", o.Hkv},
                        {"dtype", std::string(dtype_name(o.dtype))},
                        {"forward_ms", r.forward_s * 1e3},
                        {"backward_ms", r.backward_s * 1e3},
                        {"forward_tflops", tf},
                        {"backward_tflops", tb}});
      else
        std::printf("%5lld %6lld %4lld  %11.3f %9.3g  %11.3f %9.3g\n", (long long)r.D,
                    (long long)r.T, (long long)r.B, r.forward_s * 1e3, tf, r.backward_s * 1e3, tb);
    }
  if (o.json)
    std::printf(
        "%s\n",
        nlohmann::json{{"device", on}, {"flash_blocks", blocks}, {"rows", rows}}.dump(1).c_str());
  return 0;
}

}  // namespace loom
