// Sharded checkpoints across layouts, the ranks as threads of one process: a checkpoint saved
// under FSDP, TP x FSDP (a padded vocabulary), and with replicas (DDP, HSDP, the ranks of a cp
// group) loads under every other layout, and reassembled on one process gives back every bit of
// the weights and both AdamW moments.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/allocator.hpp"
#include "core/philox.hpp"
#include "model/checksum.hpp"
#include "model/llama.hpp"
#include "model/safetensors.hpp"
#include "tests/test_util.hpp"
#include "tests/train/thread_group.hpp"
#include "train/checkpoint.hpp"
#include "train/optimizer.hpp"

namespace fs = std::filesystem;
using namespace loom;

namespace {

const AdamWConfig kAdam{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};

// Heads, kv heads and ffn divisible by 4; a vocabulary of 42 is padded to 44 under TP 4.
LlamaConfig config() {
  LlamaConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.vocab_size = 42;
  return c;
}

// The reference: one process, two AdamW steps on random tokens, so that weights and moments are
// all non-trivial.
struct Reference {
  LlamaModel model{config(), DType::f32};
  AdamW opt{model.units(), kAdam};
  Reference() {
    model.init_weights(3);
    const int64_t B = 2, T = 8;
    for (int s = 0; s < 2; ++s) {
      std::vector<float> u(size_t(B * T + 1));
      philox_uniform(philox_key(11, "tokens"), s * int64_t(u.size()), int64_t(u.size()), u.data());
      std::vector<int32_t> tok(u.size());
      for (size_t i = 0; i < u.size(); ++i) tok[i] = int32_t(u[i] * 42.0f);
      model.zero_grad();
      model.forward_backward(tok.data(), tok.data() + 1, B, T, 1.0f / float(B * T));
      opt.step(1e-2f);
    }
  }
};

std::vector<uint32_t> bits(LlamaModel& m, AdamW& o) {
  std::vector<uint32_t> out;
  auto add = [&](const Tensor& x) {
    const size_t at = out.size();
    out.resize(at + size_t(x.numel()));
    std::memcpy(out.data() + at, x.raw(), size_t(x.numel()) * 4);
  };
  for (ParamUnit* u : m.units()) add(u->flat());
  for (auto& t : o.exp_avg()) add(t);
  for (auto& t : o.exp_avg_sq()) add(t);
  return out;
}

TrainState state() {
  TrainState s;
  s.step = 2;
  s.data_step = 5;
  s.config_toml = "[training]\nsteps = 9\n";
  return s;
}

// rank = (replica * fsdp + shard) * tp + tp rank.
struct Layout {
  int fsdp = 1, tp = 1, replicas = 1;
  int size() const { return fsdp * tp * replicas; }
  std::string name() const { return str_cat("fsdp", fsdp, "_tp", tp, "_rep", replicas); }
};

// Every rank of `l` loads `from` and saves to `to`; returns the saved directory, or the first
// rank's error.
std::string load_and_save(const Layout& l, const std::string& from, const std::string& to,
                          std::string& error) {
  test::ThreadWorld world(l.size());
  std::vector<std::unique_ptr<test::ThreadWorld>> tp_worlds;
  for (int g = 0; g < l.size() / l.tp; ++g)
    tp_worlds.push_back(std::make_unique<test::ThreadWorld>(l.tp));
  std::vector<std::string> errors(size_t(l.size())), saved(size_t(l.size()));
  std::vector<std::thread> threads;
  for (int r = 0; r < l.size(); ++r)
    threads.emplace_back([&, r] {
      test::ThreadGroup wg(world, r), tg(*tp_worlds[size_t(r / l.tp)], r % l.tp);
      TpOptions tpo;
      if (l.tp > 1) tpo.group = &tg;
      LlamaModel m(config(), DType::f32, Device::cpu, ShardLayout{(r / l.tp) % l.fsdp, l.fsdp},
                   tpo);
      AdamW o(m.units(), kAdam);
      try {
        load_checkpoint(from, m, o);
      } catch (const Error& e) {
        errors[size_t(r)] = e.what();
      }
      // Saved even after a failed load, so that the other ranks' collectives complete.
      try {
        saved[size_t(r)] = save_checkpoint(to, m, o, state(), "", {nullptr, &wg, nullptr});
      } catch (const Error& e) {
        if (errors[size_t(r)].empty()) errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const std::string& e : errors)
    if (!e.empty() && error.empty()) error = e;
  return saved[0];
}

int rank_files(const std::string& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir))
    n += e.path().filename().string().starts_with("rank-");
  return n;
}

}  // namespace

TEST(CheckpointReshard, EveryLayoutLoadsEveryOtherBitExactly) {
  const fs::path root = fs::temp_directory_path() / ("loom_reshard_" + std::to_string(::getpid()));
  fs::remove_all(root);
  Reference ref;
  const std::vector<uint32_t> want = bits(ref.model, ref.opt);
  const std::string first = save_checkpoint((root / "ref").string(), ref.model, ref.opt, state());

  const std::vector<Layout> layouts = {{4, 1, 1}, {2, 2, 1}, {1, 4, 1}, {3, 1, 1},
                                       {1, 1, 2}, {2, 1, 2}, {2, 2, 2}};
  std::string from = first;
  // A chain through every layout: each loads the previous layout's checkpoint.
  for (const Layout& l : layouts) {
    std::string error;
    const std::string dir = load_and_save(l, from, (root / l.name()).string(), error);
    ASSERT_EQ(error, "") << l.name();
    // Replicas write nothing: one file per distinct set of slices.
    EXPECT_EQ(rank_files(dir), l.fsdp * l.tp) << l.name();
    LlamaModel m(config(), DType::f32);
    AdamW o(m.units(), kAdam);
    m.init_weights(77);
    load_checkpoint(dir, m, o);
    EXPECT_EQ(o.steps_taken(), 2);
    EXPECT_TRUE(bits(m, o) == want) << l.name() << " (loaded from " << from << ")";
    from = dir;
  }
  fs::remove_all(root);
}

// A checkpoint whose index or files disagree is refused with the file and tensor named, and a
// save that fails on one rank fails on every rank and leaves nothing behind.
TEST(CheckpointReshard, TornIndexAndMissingFilesAreNamed) {
  const fs::path root =
      fs::temp_directory_path() / ("loom_reshard_bad_" + std::to_string(::getpid()));
  fs::remove_all(root);
  Reference ref;
  const std::string first = save_checkpoint((root / "ref").string(), ref.model, ref.opt, state());
  std::string error;
  const std::string dir = load_and_save({2, 2, 1}, first, (root / "tp").string(), error);
  ASSERT_EQ(error, "");
  auto copy = [&](const std::string& name) {
    const fs::path d = root / name / "step-00000002";
    fs::create_directories(d.parent_path());
    fs::copy(dir, d, fs::copy_options::recursive);
    return d.string();
  };
  auto load = [](const std::string& d) {
    LlamaModel m(config(), DType::f32);
    AdamW o(m.units(), kAdam);
    load_checkpoint(d, m, o);
  };
  // The first slice of tensor `name` in the index, edited by `fn`.
  auto edit_slice = [](const std::string& d, const std::string& name,
                       const std::function<void(nlohmann::json&)>& fn) {
    const std::string p = d + "/loom.index.json";
    nlohmann::json j;
    std::ifstream(p) >> j;
    fn(j["tensors"][name]["slices"][0]);
    std::ofstream(p, std::ios::trunc) << j.dump(1);
  };

  std::string d = copy("missing");
  fs::remove(d + "/rank-00002.safetensors");
  test::expect_error([&] { load(d); }, {d + "/loom.index.json", "rank-00002.safetensors"});

  // A slice moved to another file (the index of another save).
  d = copy("moved");
  edit_slice(d, "model.norm.weight",
             [](nlohmann::json& s) { s["file"] = "rank-00003.safetensors"; });
  test::expect_error([&] { load(d); },
                     {"loom.index.json", "rank-00003.safetensors", "model.norm.weight"});

  // A range that does not match the file's tensor.
  d = copy("range");
  edit_slice(d, "model.layers.1.mlp.up_proj.weight.exp_avg",
             [](nlohmann::json& s) { s["range"][0] = s["range"][0].get<int64_t>() + 1; });
  test::expect_error([&] { load(d); },
                     {"loom.index.json", "model.layers.1.mlp.up_proj.weight.exp_avg", "torn"});

  // The slices of one tensor overlap and leave a hole: same element count, wrong places.
  d = copy("overlap");
  // (o_proj is split by columns under TP: the tp rank 1 slice moved onto tp rank 0's columns.)
  edit_slice(d, "model.layers.0.self_attn.o_proj.weight", [](nlohmann::json& s) {
    s["offsets"][1] = s["offsets"][1].get<int64_t>() == 0 ? 16 : 0;
  });
  // The files' own records of their slices catch it before a read would (which refuses an
  // element in two slices or in none).
  test::expect_error([&] { load(d); }, {d, "model.layers.0.self_attn.o_proj.weight", "rank-0000",
                                        "is not the one the file holds"});

  // A checkpoint of another model: named tensor, both shapes.
  {
    LlamaConfig c = config();
    c.hidden_size = 64;
    LlamaModel m(c, DType::f32);
    AdamW o(m.units(), kAdam);
    test::expect_error([&] { load_checkpoint(dir, m, o); },
                       {"model.embed_tokens.weight", "[42, 64]", "[42, 32]"});
  }

  // A save that cannot write one rank's file: every rank fails naming it, no step directory.
  {
    d = copy("ok");
    test::ThreadWorld world(2);
    // Once rank 0 made the .tmp directory, a directory where rank 1's file is written makes
    // that rank's write fail.
    const fs::path tmp = root / "blocked/step-00000002.tmp";
    world.during_gather = [&] {
      if (fs::exists(tmp))
        fs::create_directories(tmp / ("rank-00001.safetensors.tmp." + std::to_string(::getpid())));
    };
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        test::ThreadGroup wg(world, r);
        LlamaModel m(config(), DType::f32, Device::cpu, ShardLayout{r, 2});
        AdamW o(m.units(), kAdam);
        load_checkpoint(d, m, o);
        try {
          save_checkpoint((root / "blocked").string(), m, o, state(), "", {nullptr, &wg, nullptr});
        } catch (const Error& e) {
          errors[size_t(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[size_t(r)].find("rank 1: cannot create"), std::string::npos)
          << errors[size_t(r)];
      EXPECT_NE(errors[size_t(r)].find("rank-00001.safetensors"), std::string::npos);
    }
    EXPECT_TRUE(list_checkpoints((root / "blocked").string()).empty());
    EXPECT_FALSE(fs::exists(root / "blocked/step-00000002.tmp"));
  }
  fs::remove_all(root);
}

// No rank gathers: during a synchronous save the ranks allocate nothing beyond a few small
// buffers (each file is written from views of the shards); an asynchronous save allocates at
// most a staging copy of what it has not written when before_modify runs, and no more. (Tensor
// memory, counted by the allocator: all four ranks are threads of this process.)
TEST(CheckpointReshard, SavesHoldOnlyTheShardsPlusTheStagingCopy) {
  const fs::path root =
      fs::temp_directory_path() / ("loom_reshard_mem_" + std::to_string(::getpid()));
  fs::remove_all(root);
  Reference ref;
  const std::string first = save_checkpoint((root / "ref").string(), ref.model, ref.opt, state());
  int64_t model_numel = 0;
  for (ParamUnit* u : ref.model.units()) model_numel += u->numel();
  Allocator& alloc = Allocator::get(Device::cpu);
  for (bool async : {false, true}) {
    const int n = 4;
    test::ThreadWorld world(n);
    std::vector<int64_t> shard_numel(static_cast<size_t>(n), 0);
    size_t peak_increase = 0;
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        test::ThreadGroup wg(world, r);
        LlamaModel m(config(), DType::f32, Device::cpu, ShardLayout{r, n});
        AdamW o(m.units(), kAdam);
        try {
          load_checkpoint(first, m, o);
          for (ParamUnit* u : m.units()) shard_numel[size_t(r)] += u->shard_numel();
          wg.barrier()->wait();
          if (r == 0) alloc.reset_peak();
          const size_t before = alloc.stats().allocated;
          wg.barrier()->wait();
          const std::string dir = (root / (async ? "async" : "sync")).string();
          if (async) {
            auto pending = save_checkpoint_async(dir, m, o, state(), "", {nullptr, &wg, nullptr});
            pending->before_modify();
            pending->wait();
          } else
            save_checkpoint(dir, m, o, state(), "", {nullptr, &wg, nullptr});
          wg.barrier()->wait();
          if (r == 0) peak_increase = alloc.stats().peak_allocated - before;
        } catch (const Error& e) {
          errors[size_t(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (const std::string& e : errors) ASSERT_EQ(e, "");
    // Every rank's checksum reached the index (async: through its marker or wait()'s gather).
    const std::string saved =
        (root / (async ? "async" : "sync") / checkpoint_name(state().step)).string();
    const CheckpointCheck check = check_checkpoint(saved);
    EXPECT_EQ(check.error, "");
    EXPECT_TRUE(check.checksums);
    int64_t staging = 0;  // f32 weights + 2 moments of every rank's shards
    for (int64_t s : shard_numel) staging += 3 * s * 4;
    const size_t small = 16 << 10;  // seen: 8 KiB (the key and error all-gathers)
    if (async) {
      // No staging buffer is given: before_modify allocates one for what its writer has not
      // written yet (nothing when it is done), so at most all four whole copies.
      EXPECT_LE(peak_increase, size_t(staging) * 11 / 10 + small);
    } else {
      EXPECT_LE(peak_increase, small) << "the model is " << model_numel * 4 << " bytes";
    }
  }
  fs::remove_all(root);
}

// Pipeline parallelism: every pp rank holds every unit but keeps only its stages' up to date.
// Each writes only its own units (the others, stale, must not reach the checkpoint), the rank
// files hold disjoint units, and a load for some units reads those and zeroes the rest.
TEST(CheckpointReshard, PipelineRanksWriteAndReadOnlyTheirUnits) {
  const fs::path root =
      fs::temp_directory_path() / ("loom_reshard_pp_" + std::to_string(::getpid()));
  fs::remove_all(root);
  Reference ref;
  const std::vector<uint32_t> want = bits(ref.model, ref.opt);
  const std::string first = save_checkpoint((root / "ref").string(), ref.model, ref.opt, state());
  const size_t n_units = ref.model.units().size();
  ASSERT_GE(n_units, size_t(3));
  // pp rank 0: the first unit; pp rank 1: the rest.
  std::vector<std::vector<size_t>> owned = {{0}, {}};
  for (size_t i = 1; i < n_units; ++i) owned[1].push_back(i);
  test::ThreadWorld world(2);
  std::vector<std::string> errors(2), saved(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      test::ThreadGroup wg(world, r);
      LlamaModel m(config(), DType::f32);
      AdamW o(m.units(), kAdam);
      const std::vector<size_t>& mine = owned[size_t(r)];
      try {
        load_checkpoint(first, m, o, mine);
        // What the rank does not own is stale in training: made plainly wrong here.
        auto units = m.units();
        for (size_t i = 0; i < units.size(); ++i)
          if (std::find(mine.begin(), mine.end(), i) == mine.end())
            for (Tensor* t : {&units[i]->master_shard(), &o.exp_avg()[i], &o.exp_avg_sq()[i]}) {
              // The load zeroed them.
              EXPECT_EQ(std::count(t->data<float>(), t->data<float>() + t->numel(), 0.0f),
                        t->numel())
                  << "unit " << i << " on rank " << r;
              std::fill_n(t->data<float>(), t->numel(), 1e30f);
            }
        saved[size_t(r)] = save_checkpoint((root / "pp").string(), m, o, state(), "",
                                           {nullptr, &wg, nullptr, mine});
      } catch (const Error& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) ASSERT_EQ(e, "");
  ASSERT_EQ(rank_files(saved[0]), 2);
  // Disjoint: no tensor has slices in both files.
  const auto index = nlohmann::json::parse(std::ifstream(fs::path(saved[0]) / "loom.index.json"));
  std::set<std::string> files;
  for (const auto& [name, t] : index.at("tensors").items()) {
    std::set<std::string> of;
    for (const auto& s : t.at("slices")) of.insert(s.at("file").get<std::string>());
    EXPECT_EQ(of.size(), size_t(1)) << name;
    files.insert(of.begin(), of.end());
  }
  EXPECT_EQ(files.size(), size_t(2));
  LlamaModel m(config(), DType::f32);
  AdamW o(m.units(), kAdam);
  m.init_weights(77);
  load_checkpoint(saved[0], m, o);
  EXPECT_TRUE(bits(m, o) == want);
  fs::remove_all(root);
}

// A load holds nothing beyond the rank's shards: it reads straight into them (a shard that
// starts or ends inside a row goes through one row of scratch).
TEST(CheckpointReshard, LoadsHoldOnlyTheShards) {
  const fs::path root =
      fs::temp_directory_path() / ("loom_reshard_load_" + std::to_string(::getpid()));
  fs::remove_all(root);
  Reference ref;
  const std::string first = save_checkpoint((root / "ref").string(), ref.model, ref.opt, state());
  int64_t model_bytes = 0;
  for (ParamUnit* u : ref.model.units()) model_bytes += u->numel() * 4;
  Allocator& alloc = Allocator::get(Device::cpu);
  const int n = 3;  // shards cut rows anywhere
  test::ThreadWorld world(n);
  size_t peak_increase = 0;
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      test::ThreadGroup wg(world, r);
      LlamaModel m(config(), DType::f32, Device::cpu, ShardLayout{r, n});
      AdamW o(m.units(), kAdam);
      wg.barrier()->wait();
      if (r == 0) alloc.reset_peak();
      const size_t before = alloc.stats().allocated;
      wg.barrier()->wait();
      try {
        load_checkpoint(first, m, o);
      } catch (const Error& e) {
        errors[size_t(r)] = e.what();
      }
      wg.barrier()->wait();
      if (r == 0) peak_increase = alloc.stats().peak_allocated - before;
    });
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) ASSERT_EQ(e, "");
  // One row of scratch per rank at most (the widest row here is 48 floats).
  EXPECT_LE(peak_increase, size_t(n) * 4096) << "the model is " << model_bytes << " bytes";
  fs::remove_all(root);
}

// Corruption under several ranks: a byte flipped in one rank's file of an FSDP 4 checkpoint is
// found by the ranks together (each file read by one of them) with the same error on every rank;
// a resharded load (TP 2 x FSDP 2) names it too; and the ranks' resume choice is the same on
// every rank: an error, or with fallback the previous checkpoint.
TEST(CheckpointReshard, CorruptFilesAreCaughtByEveryRankAndLayout) {
  const fs::path root =
      fs::temp_directory_path() / ("loom_reshard_corrupt_" + std::to_string(::getpid()));
  fs::remove_all(root);
  Reference ref;
  const std::string first = save_checkpoint((root / "ref").string(), ref.model, ref.opt, state());
  std::string error;
  const std::string fsdp4 = load_and_save({4, 1, 1}, first, (root / "fsdp4").string(), error);
  ASSERT_EQ(error, "");
  ASSERT_EQ(rank_files(fsdp4), 4);
  // root/ck: step 1 a good copy, step 2 the FSDP 4 checkpoint with rank 2's file changed.
  const fs::path ck = root / "ck";
  fs::create_directories(ck);
  fs::copy(fsdp4, ck / "step-00000001");
  fs::copy(fsdp4, ck / "step-00000002");
  const std::string bad = (ck / "step-00000002").string();
  const std::string bad_file = bad + "/rank-00002.safetensors";
  {
    std::fstream f(bad_file, std::ios::binary | std::ios::in | std::ios::out);
    f.seekg(-4, std::ios::end);
    const char c = char(f.get());  // flipped: whatever it was, it changes
    f.seekp(-4, std::ios::end);
    f.put(char(~c));
  }
  for (int n : {1, 3, 4}) {
    SCOPED_TRACE(str_cat(n, " ranks"));
    test::ThreadWorld world(n);
    std::vector<CheckpointCheck> checks(static_cast<size_t>(n));
    std::vector<std::string> no_fallback(static_cast<size_t>(n));
    std::vector<ResumeChoice> fallback(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        test::ThreadGroup wg(world, r);
        checks[size_t(r)] = check_checkpoint(bad, &wg);
        try {
          choose_resume_checkpoint(ck.string(), true, false, &wg);
        } catch (const Error& e) {
          no_fallback[size_t(r)] = e.what();
        }
        fallback[size_t(r)] = choose_resume_checkpoint(ck.string(), true, true, &wg);
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(checks[size_t(r)].error, checks[0].error) << "rank " << r;
      EXPECT_EQ(no_fallback[size_t(r)], no_fallback[0]) << "rank " << r;
      EXPECT_EQ(fallback[size_t(r)].dir, (ck / "step-00000001").string()) << "rank " << r;
      EXPECT_EQ(fallback[size_t(r)].notes, fallback[0].notes) << "rank " << r;
    }
    // One finding, once, whichever rank read the file.
    EXPECT_EQ(checks[0].error.find('\n'), std::string::npos) << checks[0].error;
    for (const std::string& part : {bad_file, std::string("checksum mismatch"),
                                    "found " + checksum_text(checksum_file(bad_file))})
      EXPECT_NE(checks[0].error.find(part), std::string::npos) << part << " in " << checks[0].error;
    EXPECT_NE(no_fallback[0].find("the previous complete checkpoint is " +
                                  (ck / "step-00000001").string()),
              std::string::npos)
        << no_fallback[0];
    ASSERT_EQ(fallback[0].notes.size(), 1u);
    EXPECT_NE(fallback[0].notes[0].find(bad_file), std::string::npos) << fallback[0].notes[0];
  }
  // A resharded load of it (each rank verifying alone, as load_checkpoint does by default).
  error.clear();
  load_and_save({2, 2, 1}, bad, (root / "resharded").string(), error);
  EXPECT_NE(error.find(bad_file), std::string::npos) << error;
  EXPECT_NE(error.find("checksum mismatch"), std::string::npos) << error;
  fs::remove_all(root);
}
