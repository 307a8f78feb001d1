#include "parallel/layers/expert_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.hpp"
#include "distributed/process_group.hpp"
#include "ops/ops.hpp"

namespace loom {

int64_t ExpertExchange::rows() const {
  return std::accumulate(local_counts.begin(), local_counts.end(), int64_t(0));
}

namespace {

// The innermost PlannedExpertLoad's load on this thread (1: balanced).
thread_local double planned_load = 1;

// N rows (the sum of `counts`) re-spread for the planner: `load` x N / n of them over rank me's
// El experts, the rest evenly over the others' (each group's first experts one more).
std::vector<int64_t> loaded_counts(std::span<const int64_t> counts, int n, int me, double load) {
  const int64_t E = int64_t(counts.size()), El = E / n;
  const int64_t N = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  const int64_t hot = std::min(N, int64_t(std::llround(load * double(N) / n))), rest = N - hot;
  std::vector<int64_t> out(static_cast<size_t>(E));
  for (int64_t e = 0, o = 0; e < E; ++e) {
    const bool mine = e / El == me;
    const int64_t rows = mine ? hot : rest, over = mine ? El : E - El, i = mine ? e % El : o++;
    out[size_t(e)] = over > 0 ? rows / over + (i < rows % over ? 1 : 0) : 0;
  }
  return out;
}

}  // namespace

PlannedExpertLoad::PlannedExpertLoad(double load) : previous_(planned_load) {
  LOOM_CHECK(load >= 1, "planned expert load ", load, ": expected >= 1 (1: balanced)");
  planned_load = load;
}

PlannedExpertLoad::~PlannedExpertLoad() {
  planned_load = previous_;
}

ExpertExchange expert_exchange(dist::ProcessGroup& ep, std::span<const int64_t> counts,
                               Device device) {
  const int n = ep.size(), me = ep.rank();
  const int64_t E = int64_t(counts.size());
  LOOM_CHECK(E % n == 0, "expert parallelism: ", E, " experts do not split over ", ep.describe());
  const int64_t El = E / n;
  std::vector<int64_t> loaded;
  if (!ops::computes(device) && planned_load != 1) {
    loaded = loaded_counts(counts, n, me, planned_load);
    counts = loaded;
  }
  ExpertExchange x;
  Tensor send = Tensor::empty({E}, DType::i32), recv = Tensor::empty({E}, DType::i32);
  for (int64_t e = 0; e < E; ++e) send.data<int32_t>()[e] = int32_t(counts[size_t(e)]);
  ep.all_to_all(send, recv)->wait();
  // recv[src * El + e]: the rows rank src sends for local expert e.
  std::vector<int64_t> from(static_cast<size_t>(E));
  for (int64_t i = 0; i < E; ++i)
    from[size_t(i)] =
        ops::computes(device) ? recv.data<int32_t>()[i] : counts[size_t(me * El + i % El)];
  x.send_rows.assign(size_t(n), 0);
  x.recv_rows.assign(size_t(n), 0);
  x.local_counts.assign(size_t(El), 0);
  for (int j = 0; j < n; ++j)
    for (int64_t e = 0; e < El; ++e) {
      x.send_rows[size_t(j)] += counts[size_t(j * El + e)];
      x.recv_rows[size_t(j)] += from[size_t(j * El + e)];
      x.local_counts[size_t(e)] += from[size_t(j * El + e)];
    }
  const int64_t R = x.rows();
  x.to_local = Tensor::empty({R}, DType::i32, device);
  x.from_local = Tensor::empty({R}, DType::i32, device);
  if (!ops::computes(device)) return x;
  // Received rows: rank by rank, each rank's by local expert. Grouped: expert by expert, each
  // expert's rank by rank (so an expert's rows come in rank order: the order of one process's
  // sorted rows when the ranks' tokens are consecutive).
  std::vector<int64_t> start(
      static_cast<size_t>(E));  // where (src, e)'s rows begin among the received
  int64_t at = 0;
  for (int64_t i = 0; i < E; ++i) {
    start[size_t(i)] = at;
    at += from[size_t(i)];
  }
  // Built on the host (the CPU's tensors themselves), then moved where the rows are.
  const bool host = device == Device::cpu;
  Tensor to = host ? x.to_local : Tensor::empty({R}, DType::i32);
  Tensor back = host ? x.from_local : Tensor::empty({R}, DType::i32);
  int64_t g = 0;
  for (int64_t e = 0; e < El; ++e)
    for (int j = 0; j < n; ++j)
      for (int64_t r = 0; r < from[size_t(j * El + e)]; ++r, ++g) {
        const int64_t src = start[size_t(j * El + e)] + r;
        to.data<int32_t>()[g] = int32_t(src);
        back.data<int32_t>()[src] = int32_t(g);
      }
  if (!host) {
    ops::copy(to, x.to_local);
    ops::copy(back, x.from_local);
  }
  return x;
}

Tensor expert_dispatch(dist::ProcessGroup& ep, const ExpertExchange& x, const Tensor& rows) {
  const int64_t W = rows.size(1), R = x.rows();
  Tensor received = Tensor::empty({R, W}, rows.dtype(), rows.device());
  ep.all_to_all_v(rows, x.send_rows, received, x.recv_rows)->wait();
  Tensor grouped = Tensor::empty({R, W}, rows.dtype(), rows.device());
  ops::moe_dispatch(received, x.to_local, 1, grouped);
  return grouped;
}

Tensor expert_combine(dist::ProcessGroup& ep, const ExpertExchange& x, const Tensor& rows) {
  const int64_t W = rows.size(1), R = x.rows();
  int64_t N = 0;
  for (int64_t s : x.send_rows) N += s;
  Tensor by_rank = Tensor::empty({R, W}, rows.dtype(), rows.device());
  ops::moe_dispatch(rows, x.from_local, 1, by_rank);
  Tensor back = Tensor::empty({N, W}, rows.dtype(), rows.device());
  ep.all_to_all_v(by_rank, x.recv_rows, back, x.send_rows)->wait();
  return back;
}

ops::MoePermutation tp_expert_slice(const ops::MoePermutation& perm, int ep, int tp, int tp_rank) {
  const int64_t E = int64_t(perm.counts.size());
  LOOM_CHECK(E % (int64_t(ep) * tp) == 0, "tensor parallelism in a sparse layer: ", E,
             " experts do not split over ep ", ep, " x tp ", tp);
  const int64_t block = E / ep, El = block / tp;
  std::vector<int64_t> start(static_cast<size_t>(E) + 1, 0);  // each expert's first sorted row
  for (int64_t e = 0; e < E; ++e) start[size_t(e + 1)] = start[size_t(e)] + perm.counts[size_t(e)];
  ops::MoePermutation out;
  out.dropped = perm.dropped;
  // Sorted row ranges [begin, end) of this rank's experts, ep block by ep block.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int j = 0; j < ep; ++j) {
    const int64_t first = j * block + int64_t(tp_rank) * El;
    for (int64_t e = first; e < first + El; ++e) out.counts.push_back(perm.counts[size_t(e)]);
    ranges.push_back({start[size_t(first)], start[size_t(first + El)]});
  }
  const Device dev = perm.order.device();
  const int64_t N = out.rows(), choices = perm.pos.numel();
  out.order = Tensor::empty({N}, DType::i32, dev);
  out.pos = Tensor::empty({choices}, DType::i32, dev);
  if (!ops::computes(dev)) return out;
  // Built on the host, then moved where the rows are.
  const Tensor order = perm.order.on_host(), pos = perm.pos.on_host();
  Tensor o = Tensor::empty({N}, DType::i32), p = Tensor::empty({choices}, DType::i32);
  std::vector<int32_t> renumber(static_cast<size_t>(perm.rows()), -1);  // sorted row -> mine
  int32_t at = 0;
  for (auto [begin, end] : ranges)
    for (int64_t i = begin; i < end; ++i, ++at) {
      o.data<int32_t>()[at] = order.data<int32_t>()[i];
      renumber[size_t(i)] = at;
    }
  for (int64_t c = 0; c < choices; ++c) {
    const int32_t q = pos.data<int32_t>()[c];
    p.data<int32_t>()[c] = q < 0 ? -1 : renumber[size_t(q)];
  }
  ops::copy(o, out.order);
  ops::copy(p, out.pos);
  return out;
}

}  // namespace loom
