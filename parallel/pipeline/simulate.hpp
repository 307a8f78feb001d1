#pragma once
// A schedule lowered to what one rank does (post a receive one action ahead, wait for it, compute,
// post the send, and wait for every send at the end of the step), and the simulator that runs the
// lowered lists of all ranks with rendezvous semantics: a transfer starts only once both its send
// and its receive are posted, the worst case of MPI beyond the eager limit. A list whose waits can
// never be met is a deadlock, reported with what each blocked rank waits for. Given per-action
// costs it gives the makespan, each rank's busy and idle time, and the peak number of
// stage-micro-batches each rank holds (forward run, backward or W not yet): the one source of
// bubble and in-flight figures for the tests, the benchmark and the planner. Given what a
// stage-micro-batch holds in bytes (stages differ: the head's, the embedding's, uneven splits),
// it also gives each rank's peak bytes over the step, messages' buffers included: the peak is a
// maximum over time of a sum over the rank's stages, which no count times one size gives.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "parallel/pipeline/schedule.hpp"

namespace loom::pp {

// An activation into `stage` from stage - 1 (forward), or the gradient of stage's output from
// stage + 1 (backward), of micro-batch `mb`.
struct Message {
  bool backward = false;
  int stage = 0;
  int mb = 0;
  bool operator==(const Message&) const = default;
};
// The MPI tag: unique per (direction, stage, micro-batch) so that out-of-order messages between the
// same two ranks (interleaved with p = 2) cannot be matched to the wrong receive.
int message_tag(const Message& msg, int stages, int microbatches);

enum class Step : uint8_t { post_recv, wait_recv, compute, post_send, wait_sends };
struct LoweredOp {
  Step step = Step::compute;
  Action action;  // compute: the action; otherwise the action the message belongs to
  Message msg;    // post/wait_recv, post_send
  int peer = -1;  // the other pp rank of a message
};
// Messages between two stages of one rank (the V's turn) are handed over without any.
std::vector<std::vector<LoweredOp>> lower(const Schedule& s);
// The messages an action needs before it runs / sends when it is done (none across a rank's own
// stages).
std::vector<Message> inputs_of(const Schedule& s, const Action& a);
std::vector<Message> outputs_of(const Schedule& s, const Action& a);
int sender_of(const Schedule& s, const Message& m);    // the pp rank that sends it
int receiver_of(const Schedule& s, const Message& m);  // the pp rank that receives it

// Cost of one action on its rank (any unit); B is charged as one action.
using ActionCost = std::function<double(const Action&)>;
ActionCost unit_costs(double f, double b, double i, double w);

// What one stage-micro-batch holds on its rank, in bytes (any unit).
struct StageBytes {
  double saved = 0;     // from its F to its B or I (its input included; not its output)
  double deferred = 0;  // from its I to its W: the weight gradients' operands
  double backward = 0;  // working buffers during its B, beyond what the rank holds
  double input = 0;     // working buffers during its I
  double forward = 0;   // working buffers at the end of its F (checkpointing drops them then)
};
// The memory of a step (PipelineExecutor's lifetimes): per stage its StageBytes, and `message`,
// one activation or gradient between stages. A receive buffer is allocated when its receive is
// posted (one action ahead) and becomes the action's input; a forward's output is a new buffer
// (the last stage's is its head's saved input); a gradient flows through a stage's backward in
// place, made by the last stage's and dropped by the first's. A send's buffer is freed at the
// first test after its transfer completed: the executor tests after every action, so a buffer
// lives at least until the end of the sender's next action.
struct MemoryModel {
  std::vector<StageBytes> stages;
  double message = 0;
};

struct SimResult {
  bool deadlock = false;
  std::string blocked;  // on a deadlock: each blocked rank, its position and what it waits for
  double makespan = 0;
  std::vector<double> busy, idle;  // per rank
  std::vector<int> peak_held;      // per rank, stage-micro-batches (divide by v for whole ranks)
  std::vector<int> sends;          // per rank, messages sent in the step
  std::vector<double> peak_bytes;  // per rank, given a MemoryModel (empty otherwise)
  // Per rank, each message it sends: how many tests the executor makes of its send (one after
  // each action, from the action that posts it on) until the test that finds it complete and
  // frees its buffer; 0: none does, the step's final wait for the sends frees it. The planner's
  // simulated sends complete on the same test.
  std::vector<std::vector<std::pair<Message, int>>> send_tests;
  double bubble() const;  // idle / (ranks x makespan)
};
// `comm`: the time of one transfer once both sides are posted. With `memory`, peak_bytes too.
SimResult simulate(const Schedule& s, const ActionCost& cost, double comm = 0,
                   const MemoryModel* memory = nullptr);

}  // namespace loom::pp
