#pragma once
// A pipeline schedule as data (docs/design.md decision 7): per pp rank, the ordered list of compute
// actions it runs in one step, each the forward (F), full backward (B), input-gradient (I) or
// weight-gradient (W) of one stage and one micro-batch, and the map from stage to rank (a loop
// for gpipe/1f1b/interleaved/zb1p, a V for zbv). Generators are pure functions of (p, v, m);
// `validate` checks what one rank's list alone must satisfy; the cross-rank dependencies are
// checked by running the lowered lists through the simulator (pipeline/simulate.hpp), which
// reports a deadlock. No MPI here: tests, the executor and the planner share these lists.
#include <cstdint>
#include <string>
#include <vector>

namespace loom::pp {

enum class Op : uint8_t { F, B, I, W };  // B = I + W in one action

struct Action {
  int stage = 0;
  Op op = Op::F;
  int mb = 0;
  bool operator==(const Action&) const = default;
};
// torchtitan's spelling: stage, op letter, micro-batch ("0F3", "5I0").
std::string to_string(const Action& a);

enum class ScheduleKind { gpipe, one_f_one_b, interleaved_1f1b, zb1p, zbv };
// The `[parallelism] pp_schedule` names; parse fails naming the key and the accepted values.
ScheduleKind parse_schedule_kind(const std::string& name);
const char* schedule_name(ScheduleKind kind);

struct Schedule {
  std::string name;  // the pp_schedule value, or the CSV file it was read from
  int ranks = 0, stages = 0, microbatches = 0;
  std::vector<int> stage_rank;              // stage -> pp rank
  std::vector<std::vector<Action>> orders;  // per pp rank, in execution order

  int stages_per_rank() const { return ranks > 0 ? stages / ranks : 0; }
  std::vector<int> stages_of(int rank) const;  // ascending
  bool split_backward() const;                 // any I/W action (zero-bubble schedules)
};

// pp_stages_per_rank = 0 means this: 2 for interleaved_1f1b and zbv, 1 otherwise.
int default_stages_per_rank(ScheduleKind kind);

// The rules of each generator, checked before anything is generated; the message names the
// [parallelism] keys (pp, pp_microbatches, pp_stages_per_rank) and the rule broken.
void check_schedule_args(ScheduleKind kind, int p, int v, int m);
// p pp ranks, v stages per rank (1 except interleaved_1f1b; zbv always 2), m micro-batches.
Schedule make_schedule(ScheduleKind kind, int p, int v, int m);

// What a list must satisfy on its own (throws loom::Error naming the schedule, rank, position and
// action): every stage on exactly one rank and every action on its stage's rank; per (stage,
// micro-batch) exactly one F and either one B or one I and one W; on a rank, F before its I/B and
// I before its W, a stage's F, B/I and W each in micro-batch order (gradients then accumulate in
// the order of grad_accum_steps, so pp keeps every bit), and between two stages of one rank the
// forward goes up the stages and the backward down.
void validate(const Schedule& s);

}  // namespace loom::pp
