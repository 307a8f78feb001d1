#include "tests/support/model_cost.hpp"

#include "core/error.hpp"

namespace loom::oracle {

namespace {

// The formula of m's family: `llama` or `gla` called with the model as its own type.
template <class Llama, class Gla>
auto by_family(const Model& m, Llama llama, Gla gla) {
  if (const auto* l = dynamic_cast<const LlamaModel*>(&m)) return llama(*l);
  if (const auto* g = dynamic_cast<const GlaModel*>(&m)) return gla(*g);
  fail("cost oracle: no formulas for model_type \"", m.model_type(), "\"");
}

}  // namespace

size_t saved_activation_bytes(const Model& m, int64_t B, int64_t T) {
  return by_family(
      m, [&](const LlamaModel& l) { return saved_activation_bytes(l, B, T); },
      [&](const GlaModel& g) { return saved_activation_bytes(g, B, T); });
}

size_t saved_at_head_bytes(const Model& m, int64_t B, int64_t T) {
  return by_family(
      m, [&](const LlamaModel& l) { return saved_at_head_bytes(l, B, T); },
      [&](const GlaModel& g) { return saved_activation_bytes(g, B, T); });
}

size_t backward_peak_bytes(const Model& m, int64_t B, int64_t T) {
  return by_family(
      m, [&](const LlamaModel& l) { return backward_peak_bytes(l, B, T); },
      [&](const GlaModel& g) { return saved_activation_bytes(g, B, T); });
}

size_t head_workspace_bytes(const Model& m, int64_t B, int64_t T) {
  return by_family(
      m, [&](const LlamaModel& l) { return head_workspace_bytes(l, B, T); },
      [&](const GlaModel& g) { return head_workspace_bytes(g, B, T); });
}

size_t tp_comm_buffer_bytes(const Model& m, int64_t B, int64_t T) {
  return by_family(
      m, [&](const LlamaModel& l) { return tp_comm_buffer_bytes(l, B, T); },
      [&](const GlaModel& g) { return tp_comm_buffer_bytes(g, B, T); });
}

uint64_t tp_bytes_per_micro_batch(const Model& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs) {
  return by_family(
      m, [&](const LlamaModel& l) { return tp_bytes_per_micro_batch(l, B, T, runs); },
      [&](const GlaModel& g) { return tp_bytes_per_micro_batch(g, B, T, runs); });
}

uint64_t cp_bytes_per_micro_batch(const Model& m, int64_t B, int64_t T,
                                  const std::vector<bool>& runs) {
  return by_family(
      m, [&](const LlamaModel& l) { return cp_bytes_per_micro_batch(l, B, T, runs); },
      [&](const GlaModel& g) { return cp_bytes_per_micro_batch(g, B, T, runs); });
}

size_t ring_working_bytes(const Model& m, int64_t B, int64_t T) {
  return by_family(
      m, [&](const LlamaModel& l) { return ring_working_bytes(l, B, T); },
      [&](const GlaModel& g) { return ring_working_bytes(g, B, T); });
}

UnitActivations unit_activation_bytes(const Model& m, size_t unit, int64_t B, int64_t T) {
  return by_family(
      m, [&](const LlamaModel& l) { return unit_activation_bytes(l, unit, B, T); },
      [&](const GlaModel& g) { return unit_activation_bytes(g, unit, B, T); });
}

RunBlocks run_blocks(const Model& m, const std::vector<bool>& runs) {
  LOOM_CHECK(runs.empty() || runs.size() == m.num_units(), "run_blocks: ", runs.size(),
             " flags for ", m.num_units(), " units");
  auto run = [&](size_t u) { return runs.empty() || runs[u]; };
  const ActivationCheckpoint& ac = m.activation_checkpoint();
  RunBlocks r;
  r.embed = run(0);
  r.head = run(m.num_units() - 1);
  for (size_t l = 0; l < m.num_blocks(); ++l)
    if (run(l + 1)) {
      ++r.blocks;
      r.recomputed += ac.block_mode(int64_t(l)) == ActivationCheckpoint::Mode::full;
    }
  return r;
}

size_t ring_kv_bytes(int64_t rows, int64_t kv_heads, int64_t hd) {
  return size_t(rows) * 2 * size_t(kv_heads) * size_t(hd) * 4;
}

uint64_t ring_bytes(const CpOptions& cp, size_t kv_bytes, int64_t layers, int64_t recomputed) {
  const int n = cp.size();
  if (n == 1) return 0;
  const uint64_t k = uint64_t(n - 1), kv = kv_bytes;
  // p2p: forward sends K/V n-1 times; backward the same plus n hops of the dK/dV accumulator.
  // allgather: the same K/V bytes by all-gather, and a reduce-scatter of n blocks of dK/dV.
  const uint64_t forward = k * kv, backward = cp.allgather ? 2 * k * kv : (2 * k + 1) * kv;
  return (forward + backward) * uint64_t(layers) + forward * uint64_t(recomputed);
}

size_t ring_working_bytes(const CpOptions& cp, size_t kv_bytes, int64_t rows, int64_t q_heads) {
  const int n = cp.size();
  if (n == 1) return 0;
  const size_t blocks = cp.allgather ? 2 * size_t(n) + 1 : 5;
  return blocks * kv_bytes + size_t(rows) * size_t(q_heads) * 4;
}

}  // namespace loom::oracle
