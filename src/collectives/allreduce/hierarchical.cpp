// hierarchical: exact inside a host, compressed across hosts (Horovod's hierarchical allreduce,
// BytePS and Bagua's intra-node reduction first, ZeRO++'s split of the fast and the slow hop).
//
// With H hosts of at most L ranks, the partition is cut into L slots (Split). Rank i of a host of
// n ranks owns slots [i L / n, (i + 1) L / n): one slot each when every host holds L ranks.
//   1. Inside each host, an fp32 reduce-scatter (raw_reduce_scatter: every rank sends each owner
//      its chunk once, the owner sums the host's contributions in local rank order) leaves each
//      owner its slots summed over the host, exactly as the host's ranks gave them.
//   2. For each slot s, the owners of s on every host (one per host, in host order) run the
//      allreduce strategy on their host sums: raw fp32 or any codec and strategy, with error
//      feedback per slot, averaged over every rank of the job. A host's network link carries
//      each byte of its shards once, instead of once per rank as a flat collective does.
//   3. Inside each host, every owner sends its slots' results to the host's other ranks, and a
//      status round tells every rank of a failure seen on any slot.
// Each slot's result is computed once, by its group, which ends with identical bytes; step 3
// copies them, so every rank of the job ends with the same result. Rank r's state slots for its
// k-th slot start at k (H + 1), past those of its earlier slots.
#include <algorithm>
#include <vector>

#include "collectives/collective.h"
#include "kit/hash.h"

namespace terse::collectives {

void hierarchical_allreduce(PartitionContext& ctx, const transport::Topology& topology, int slots,
                            bool status_round,
                            const std::function<void(PartitionContext&)>& cross) {
  const int me = ctx.comm->rank();
  const int h = topology.host_of[me], local = topology.local_of[me];
  const std::vector<int>& host = topology.hosts[h];
  const int ranks = static_cast<int>(host.size());
  const int hosts = static_cast<int>(topology.hosts.size());
  const Split split(ctx.input.size(), static_cast<std::size_t>(slots));

  // This host's chunks: rank i's slots, consecutive.
  std::vector<std::size_t> begin, size;
  for (int i = 0; i < ranks; ++i) {
    const std::size_t b = split.begin(first_slot(i, ranks, slots));
    begin.push_back(b);
    size.push_back(split.begin(first_slot(i + 1, ranks, slots)) - b);
  }
  const Chunks chunks = Chunks::ranges(std::move(begin), std::move(size));

  PartitionContext inside = ctx;
  inside.group = host;
  inside.group_rank = local;
  inside.divisor = hosts == 1 ? ctx.divisor : 1;  // one host: its sum is the result
  if (topology.reads_directly(h)) inside.direct_pids = topology.pid;
  std::span<float> shard = chunks.piece(ctx.output, local);
  if (ranks > 1) {
    raw_reduce_scatter(inside, chunks, shard);
  } else if (add_input(inside, 0, shard, false)) {  // the whole partition is this rank's
    apply_divisor(inside, shard);
  }
  ctx.failure.merge(inside.failure);

  if (hosts > 1) {
    std::vector<int> group(static_cast<std::size_t>(hosts));
    const int first = first_slot(local, ranks, slots), end = first_slot(local + 1, ranks, slots);
    for (int s = first; s < end; ++s) {
      for (int g = 0; g < hosts; ++g) {  // the owner of slot s on host g
        const int n = static_cast<int>(topology.hosts[g].size());
        int i = 0;
        while (first_slot(i + 1, n, slots) <= s) ++i;
        group[g] = topology.hosts[g][i];
      }
      PartitionContext across = ctx;
      across.group = group;
      across.group_rank = h;
      across.offset = ctx.offset + split.begin(s);
      across.input = split.piece(std::span<const float>(ctx.output), s);
      across.output = split.piece(ctx.output, s);
      across.state_base = (s - first) * (hosts + 1);
      // Every owner of slot s derives the same keys (shared randomness agrees within the group).
      across.encode.tensor = kit::combine_keys(ctx.encode.tensor, static_cast<std::uint64_t>(s));
      cross(across);
      if (status_round) agree_on_failure(across, kStatusIndex);
      ctx.failure.merge(across.failure);
    }
  }

  if (ranks > 1) {
    inside.failure = ctx.failure;
    const auto out = std::as_writable_bytes(ctx.output);
    auto piece = [&](int j) {
      return out.subspan(chunks.begin(j) * sizeof(float), chunks.size(j) * sizeof(float));
    };
    all_gather_bytes(inside, piece(local), piece);
    agree_on_failure(inside, kStatusIndex);
    ctx.failure.merge(inside.failure);
  }
}

}  // namespace terse::collectives
