#pragma once
// What every model's blocks run under, shared by the model interface (model/model.hpp) and each
// family's blocks (model/llama_block.hpp, model/gla_block.hpp): the parallelism of the layers and
// what one micro-batch's forward/backward needs to know.
#include <cstdint>
#include <vector>

#include "core/dtype.hpp"
#include "distributed/process_group.hpp"
#include "model/param_unit.hpp"
#include "ops/ops.hpp"
#include "parallel/layers/context_parallel.hpp"
#include "parallel/layers/tensor_parallel.hpp"

namespace loom {

// Expert parallelism (a mixture of experts): the ranks its experts are split over (nullptr:
// none; each rank holds experts [rank E / ep, (rank + 1) E / ep)) and how its expert units are
// sharded (over the data-parallel ranks that hold the same experts).
struct EpOptions {
  dist::ProcessGroup* group = nullptr;
  ShardLayout shard;
  int size() const { return group ? group->size() : 1; }
  int rank() const { return group ? group->rank() : 0; }
};

// The parallelism a model's layers run under (null groups: none).
struct ParallelContext {
  TpRuntime tp;
  CpOptions cp;
  EpOptions ep;
};
// The context of a block built without one (every block shares it).
inline const ParallelContext& no_parallelism() {
  static const ParallelContext none;
  return none;
}

// What one forward/backward of a micro-batch needs to know.
struct StepContext {
  int64_t B = 0, T = 0;
  DType compute = DType::f32;      // what GEMMs read: f32, or bf16 (fp32 accumulation)
  std::vector<int32_t> positions;  // global position of each of the T tokens
  // With context parallelism: T is this rank's length (T_global / cp) and cp_pos[r] holds the
  // global positions of cp rank r's T tokens (positions is cp_pos[own rank]).
  std::vector<std::vector<int64_t>> cp_pos;
  // The same on the run's device, copied once per micro-batch (ops::index_tensor), for the ops:
  // positions int32 [T]; cp_pos_device[r] int64 [T] (with context parallelism only).
  Tensor positions_device;
  std::vector<Tensor> cp_pos_device;
  const ops::Rope* rope = nullptr;  // the positions' rotary table (models with RoPE)
  int64_t tokens() const { return B * T; }
};

}  // namespace loom
