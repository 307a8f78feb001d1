// `loom plan --config FILE --world N`: the step of `loom train` on N ranks, planned one rank at a
// time on the meta device (plan/planner.hpp): per rank its peak allocated and reserved memory,
// the bytes of each group it communicates on, and the FLOPs of its kernels. `--ranks all` plans
// every rank (the parity checks compare each with the real run); the default plans the
// representative ranks.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/commands.hpp"
#include "core/error.hpp"
#include "plan/planner.hpp"
#include "train/config.hpp"

namespace loom {

namespace {

std::vector<int> parse_ranks(const std::string& s, int world) {
  std::vector<int> out;
  if (s == "all") {
    for (int r = 0; r < world; ++r) out.push_back(r);
    return out;
  }
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, comma - pos);
    int r = -1;
    try {
      size_t used = 0;
      r = std::stoi(item, &used);
      if (used != item.size()) r = -1;
    } catch (const std::exception&) {
    }
    LOOM_CHECK(r >= 0 && r < world, "plan --ranks: '", item, "' is not a rank of the world of ",
               world, " (expected all or a comma list of ranks)");
    out.push_back(r);
    pos = comma + 1;
  }
  return out;
}

nlohmann::json rank_json(const plan::RankPlan& p) {
  nlohmann::json groups = nlohmann::json::object();
  for (const plan::GroupTraffic& g : p.groups) {
    nlohmann::json ops = nlohmann::json::object();
    for (const auto& o : g.ops) ops[o.op] = {{"calls", o.calls}, {"bytes", o.bytes}};
    groups[g.name] = {{"size", g.size}, {"calls", g.calls()}, {"bytes", g.bytes()}, {"ops", ops}};
  }
  return {{"rank", p.rank},
          {"coords", p.coords},
          {"role", p.role},
          {"peak_allocated_bytes", p.peak_allocated},
          {"peak_reserved_bytes", p.peak_reserved},
          {"state_bytes", p.states},
          {"optimizer_bytes", p.optimizer},
          {"params", p.num_params},
          {"tokens", p.tokens},
          {"flops", p.flops()},
          {"groups", groups}};
}

}  // namespace

int plan_command(const Args& args) {
  if (!args.empty() && args[0] == "calibrate")
    return plan_calibrate_command(Args(args.begin() + 1, args.end()));
  const char* usage =
      "usage: loom plan --config FILE --world N [--ranks all|R,R...] [--hardware NAME|FILE] "
      "[--json] [--section.key=value ...]";
  std::string config_path, ranks_arg;
  int world = 0;
  bool json = false;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const char* flag) -> std::string {
      const std::string f = flag;
      if (a.rfind(f + "=", 0) == 0) return a.substr(f.size() + 1);
      LOOM_CHECK(i + 1 < args.size(), flag, " needs a value; ", usage);
      return args[++i];
    };
    if (a == "--json") {
      json = true;
    } else if (a == "--config" || a.rfind("--config=", 0) == 0) {
      config_path = value("--config");
    } else if (a == "--world" || a.rfind("--world=", 0) == 0) {
      const std::string v = value("--world");
      try {
        world = std::stoi(v);
      } catch (const std::exception&) {
        world = 0;
      }
      LOOM_CHECK(world >= 1, "plan --world: '", v, "' is not a positive number of ranks");
    } else if (a == "--ranks" || a.rfind("--ranks=", 0) == 0) {
      ranks_arg = value("--ranks");
    } else {
      overrides.push_back(a);
    }
  }
  LOOM_CHECK(!config_path.empty() && world >= 1, usage);

  const JobConfig job = load_job_config(config_path, overrides);
  const std::string toml_dir = std::filesystem::path(config_path).parent_path().string();
  const plan::PlanJob j{
      job, ModelConfig::from_file(resolve_model_config(job.model.config, toml_dir)), world};
  const dist::MeshLayout layout = plan::plan_layout(j);
  const std::vector<int> ranks =
      ranks_arg.empty() ? plan::representative_ranks(layout) : parse_ranks(ranks_arg, world);

  std::vector<plan::RankPlan> plans;
  for (int r : ranks) plans.push_back(plan::plan_rank(j, r));

  if (json) {
    nlohmann::json out = {{"config", config_path},
                          {"world", world},
                          {"layout", layout.describe()},
                          {"micro_batches", plans.front().micro_batches},
                          {"ranks", nlohmann::json::array()}};
    for (const auto& p : plans) out["ranks"].push_back(rank_json(p));
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  const double MiB = 1024.0 * 1024.0;
  std::printf("loom plan: %s on %d ranks (%s), %lld micro-batches of %lld x %lld per step\n",
              config_path.c_str(), world, layout.describe().c_str(),
              (long long)plans.front().micro_batches, (long long)j.job.training.local_batch_size,
              (long long)j.job.training.seq_len);
  std::printf("  %5s  %-32s %12s %12s %12s %10s\n", "rank", "role", "peak MiB", "reserved",
              "states", "GFLOP");
  for (const auto& p : plans) {
    std::printf("  %5d  %-32s %12.2f %12.2f %12.2f %10.2f\n", p.rank, p.role.c_str(),
                p.peak_allocated / MiB, p.peak_reserved / MiB, p.states / MiB, p.flops() / 1e9);
    for (const auto& g : p.groups) {
      std::printf("         group %-14s (size %3d): %8llu calls %16llu bytes/step\n",
                  g.name.c_str(), g.size, (unsigned long long)g.calls(),
                  (unsigned long long)g.bytes());
    }
  }
  return 0;
}

}  // namespace loom
