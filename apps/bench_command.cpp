// `loom bench step`: times whole training steps (forward, backward, clip, AdamW) after warm-up and
// prints throughput, MFU against the GEMM peak measured on this machine at start, and peak memory
// next to the analytic figure of the memory model.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "core/allocator.hpp"
#include "core/philox.hpp"
#include "kernels/cpu/gemm.hpp"
#include "model/llama.hpp"
#include "train/config.hpp"
#include "train/optimizer.hpp"

namespace loom {

namespace {

std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct MemoryModel {
  size_t params = 0, grads = 0, optimizer = 0, mirror = 0, activations = 0;
  size_t total() const { return params + grads + optimizer + mirror + activations; }
};

}  // namespace

int bench_command(const Args& args) {
  LOOM_CHECK(!args.empty() && args[0] == "step",
             "usage: loom bench step --config FILE [--json] [--section.key=value ...]");
  std::string config_path;
  bool json = false;
  std::vector<std::string> overrides;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--config" && i + 1 < args.size()) {
      config_path = args[++i];
    } else if (a.rfind("--config=", 0) == 0) {
      config_path = a.substr(9);
    } else {
      overrides.push_back(a);
    }
  }
  LOOM_CHECK(!config_path.empty(), "bench step needs --config FILE");
  const JobConfig job = load_job_config(config_path, overrides);
  const std::string toml_dir = std::filesystem::path(config_path).parent_path().string();
  const LlamaConfig mc = LlamaConfig::from_file(resolve_model_config(job.model.config, toml_dir));
  const DType compute = dtype_from_name(job.training.mixed_precision_param);
  const int64_t B = job.training.local_batch_size, T = job.training.seq_len;
  const int warmup = int(job.bench.warmup_steps), steps = int(job.bench.steps);

  const std::string load_before = load_average();
  const double peak_flops = cpu::measure_gemm_peak(compute);

  auto& alloc = Allocator::get(Device::cpu);
  LlamaModel model(mc, compute);
  model.init_weights(uint64_t(job.model.seed));
  AdamWConfig oc{float(job.optimizer.lr), float(job.optimizer.beta1), float(job.optimizer.beta2),
                 float(job.optimizer.eps), float(job.optimizer.weight_decay)};
  AdamW opt(model.units(), oc);

  // Random tokens: B rows of T + 1 (inputs are the first T, targets the last T).
  std::vector<float> u(size_t(B * (T + 1)));
  philox_uniform(philox_key(uint64_t(job.model.seed), "bench.tokens"), 0, int64_t(u.size()),
                 u.data());
  std::vector<int32_t> inputs(size_t(B * T)), targets(size_t(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      inputs[b * T + t] = int32_t(u[b * (T + 1) + t] * mc.vocab_size);
      targets[b * T + t] = int32_t(u[b * (T + 1) + t + 1] * mc.vocab_size);
    }

  std::vector<double> times, losses;
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) alloc.reset_peak();
    auto t0 = std::chrono::steady_clock::now();
    model.zero_grad();
    double loss = model.forward_backward(inputs.data(), targets.data(), B, T, 1.0f / float(B * T));
    clip_grad_norm(model.units(), job.training.max_norm);
    opt.step(float(job.optimizer.lr));
    auto t1 = std::chrono::steady_clock::now();
    if (s >= warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
    losses.push_back(loss / double(B * T));
  }
  const auto st = alloc.stats();
  const double step_s = median(times);
  const double tokens_per_s = double(B * T) / step_s;
  const double flops = mc.flops_per_token(T) * tokens_per_s;
  const double mfu = flops / peak_flops;

  MemoryModel mm;
  const size_t n = size_t(model.num_params());
  mm.params = 4 * n;
  mm.grads = 4 * n;
  mm.optimizer = opt.state_bytes();
  mm.mirror = compute == DType::bf16 ? 2 * n : 0;
  mm.activations = LlamaModel::saved_activation_bytes(mc, B, T, compute);
  const double mem_ratio = double(st.peak_allocated) / double(mm.total());
  const std::string load_after = load_average();

  if (json) {
    std::printf(
        "{\"config\": \"%s\", \"dtype\": \"%s\", \"batch\": %ld, \"seq_len\": %ld, "
        "\"params\": %zu, \"step_s\": %.6f, \"tokens_per_s\": %.1f, \"tflops\": %.4f, "
        "\"gemm_peak_tflops\": %.4f, \"mfu\": %.4f, \"peak_allocated_bytes\": %zu, "
        "\"peak_reserved_bytes\": %zu, \"expected_bytes\": %zu, \"param_bytes\": %zu, "
        "\"grad_bytes\": %zu, \"optimizer_bytes\": %zu, \"mirror_bytes\": %zu, "
        "\"activation_bytes\": %zu, \"loss_first\": %.5f, \"loss_last\": %.5f, "
        "\"load_before\": \"%s\", \"load_after\": \"%s\"}\n",
        config_path.c_str(), std::string(dtype_name(compute)).c_str(), long(B), long(T), n, step_s,
        tokens_per_s, flops / 1e12, peak_flops / 1e12, mfu, st.peak_allocated, st.peak_reserved,
        mm.total(), mm.params, mm.grads, mm.optimizer, mm.mirror, mm.activations, losses.front(),
        losses.back(), load_before.c_str(), load_after.c_str());
    return 0;
  }
  const double MiB = 1024.0 * 1024.0;
  std::printf("loom bench step: %s (%s), batch %ld x seq %ld, %zu parameters\n",
              config_path.c_str(), std::string(dtype_name(compute)).c_str(), long(B), long(T), n);
  std::printf("  load average        %s (before)  %s (after)\n", load_before.c_str(),
              load_after.c_str());
  std::printf("  step time (median)  %.2f ms over %d steps after %d warm-up\n", step_s * 1e3, steps,
              warmup);
  std::printf("  tokens/s            %.0f\n", tokens_per_s);
  std::printf("  achieved            %.1f GFLOP/s (%.1f MFLOP/token, 6N + 12LHQT)\n", flops / 1e9,
              mc.flops_per_token(T) / 1e6);
  std::printf("  GEMM peak measured  %.1f GFLOP/s (%s)\n", peak_flops / 1e9,
              std::string(dtype_name(compute)).c_str());
  std::printf("  MFU                 %.1f%% of the measured GEMM peak\n", 100 * mfu);
  std::printf("  peak allocated      %.1f MiB (reserved %.1f MiB)\n", st.peak_allocated / MiB,
              st.peak_reserved / MiB);
  std::printf(
      "  expected            %.1f MiB = params %.1f + grads %.1f + AdamW %.1f + bf16 %.1f"
      " + saved activations %.1f  (measured/expected %.3f)\n",
      mm.total() / MiB, mm.params / MiB, mm.grads / MiB, mm.optimizer / MiB, mm.mirror / MiB,
      mm.activations / MiB, mem_ratio);
  std::printf("  loss                %.4f -> %.4f\n", losses.front(), losses.back());
  return 0;
}

}  // namespace loom
