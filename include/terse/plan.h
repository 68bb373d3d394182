// What is done with one tensor in a collective: the strategy that reduces its partitions and the
// plan the engine (or the planner, for codec "auto") settles on. Included by terse/engine.h; the
// planner, below the engine, uses these types without the engine.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "terse/export.h"

namespace terse {

// How a tensor's partitions are reduced (see src/collectives/; docs/design.md has the costs).
enum class Strategy {
  kAuto,       // raw for codec "none", else the engine's default for the codec's traits
  kRaw,        // fp32 ring allreduce (reduce-scatter + allgather); the uncompressed baseline
  kAllgather,  // each rank encodes once; all payloads are gathered, decoded and summed
               // (RoundCodecs: each round's contributions gathered, one message step a round)
  kSharded,    // co-located parameter server: owners sum their shard, re-encode once, allgather
  kRing,       // compressed ring: decode-merge-re-encode at every hop, then allgather
  kSummable,   // ring on compressed data (codecs whose encodings add); RoundCodecs' rounds
               // on rings
  kAllToAll,   // reduce-scatter and all-to-all only: every rank encodes each destination's
               // block once, one all-to-all, the destination decodes (and sums in fp32)
};
// "auto", "raw", "allgather", "sharded", "ring", "summable", "alltoall".
TERSE_API std::string_view to_string(Strategy s);
// Throws SpecError listing the allowed names.
TERSE_API Strategy parse_strategy(std::string_view name);

// Whether an allreduce, reduce_scatter or all_gather runs flat (one strategy among every rank)
// or in two levels over the job's hosts (EngineOptions::topology). An allreduce: an exact fp32
// reduce-scatter inside each host, the strategy and codec across hosts on each host's shard, an
// all-gather inside each host; a reduce-scatter: the first two; an all-gather: each shard
// across hosts, then inside each host (CollectiveOptions::hierarchy). For reduce_scatter and
// all_gather, auto measures the piece of a shard per partition instead of the partition.
enum class Hierarchy {
  kAuto,   // hosts where the job spans several hosts and some host holds several ranks, and
           // the partition is larger than what the engine gathers raw (EngineOptions::
           // gather_bytes / (N - 1)); flat otherwise. Codec "auto": the planner's choice,
           // each plan priced at both levels
  kFlat,   // one level: every rank alike
  kHosts,  // two levels (on a single host: the reduce-scatter and all-gather inside it)
};
// "auto", "flat", "hosts".
TERSE_API std::string_view to_string(Hierarchy h);
// Throws SpecError listing the allowed names.
TERSE_API Hierarchy parse_hierarchy(std::string_view name);

// The collective a plan is for: the planner prices and decides each one separately (an
// allreduce and a reduce-scatter of the same size never share a decision). A plan's n is the
// larger of input and output: an allreduce's tensor, a reduce-scatter's input (N shards), an
// all-gather's output (N shards).
enum class Operation {
  kAllreduce,      // strategies raw, allgather, sharded, ring, summable
  kReduceScatter,  // raw, alltoall, sharded, ring, summable
  kAllGather,      // raw, allgather
  kAllToAll,       // raw, alltoall; not planned: the cost model and the planner refuse it
};
// "allreduce", "reduce_scatter", "all_gather", "all_to_all".
TERSE_API std::string_view to_string(Operation op);

// The engine's default for EngineOptions::gather_bytes (engine.h says what it does); the
// planner's cost model assumes it unless told otherwise.
inline constexpr std::size_t kDefaultGatherBytes = std::size_t{16} << 10;

// The plan for one tensor: what the engine will do with it.
struct TensorPlan {
  std::string codec = "none";  // canonical codec spec ("none" = raw fp32)
  Strategy strategy = Strategy::kRaw;
  int partitions = 1;
  bool fused = false;  // travels in the group's fused raw message
  bool hierarchical = false;  // two levels over the hosts: the strategy and codec run across them
};

}  // namespace terse
