// The cost model: predicted seconds of one allreduce for (n, codec, strategy, K, ranks), from a
// Calibration. Pure arithmetic: no communication, no clocks. Internal to the planner.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "collectives/collective.h"  // kMaxPartitions
#include "planner/calibration.h"
#include "transport/topology.h"
#include "terse/plan.h"
#include "terse/planner.h"  // Prediction

namespace terse {

class Codec;
class RoundCodec;

namespace planner {

using collectives::kMaxPartitions;

// K as the engine clamps it for n floats: at least one 64-element piece per partition, at most
// kMaxPartitions.
int clamp_partitions(int k, std::size_t n);

// Two levels over the job's hosts (TensorPlan::hierarchical), as the cost model prices them:
// each host's rank count and the two classes of links.
struct HostLayout {
  std::vector<int> ranks;  // per host, in host order
  LinkClasses links;
};

// The layout of `topology` with the links of calibration `c` split by it (link_classes).
HostLayout host_layout(const Calibration& c, const transport::Topology& topology);

}  // namespace planner

class CostModel {
 public:
  explicit CostModel(Calibration calibration);

  // Predicts an allreduce of n floats across `ranks` ranks (any count, for what-if
  // questions) with codec spec (canonical; "none" for raw), strategy (not kAuto) and K
  // partitions, run by an engine with `threads` worker threads. With op, a reduce-scatter of n
  // floats of input or an all-gather of n floats of output (n/ranks a shard, K partitions of
  // each shard). Throws InvalidArgument for a codec the calibration does not hold, a
  // strategy it cannot use for op, or op all_to_all (not priced: the planner does not plan it).
  Prediction predict(std::size_t n, std::string_view codec, Strategy strategy, int partitions,
                     int ranks, int threads, Operation op = Operation::kAllreduce) const;

  // The same allreduce in two levels over `hosts` (collectives/allreduce/hierarchical.cpp): an
  // fp32 reduce-scatter inside each host at its links, the strategy and codec across hosts on
  // each slot at theirs, an all-gather inside each host (docs/planner.md, "Two levels").
  // Throws InvalidArgument as predict() does.
  Prediction predict_hosts(std::size_t n, std::string_view codec, Strategy strategy,
                           int partitions, const planner::HostLayout& hosts, int threads) const;

  const Calibration& calibration() const { return calibration_; }

  // The EngineOptions::gather_bytes of the engine predicted for (default: the default):
  // raw partitions that small take one gathered message step instead of 2(N-1) ring steps.
  void set_gather_bytes(std::size_t bytes) { gather_bytes_ = bytes; }

 private:
  struct PartitionCost;
  // The costs of codec spec under strategy (null for raw); throws InvalidArgument for raw with a
  // codec, a codec with strategy raw, or a codec the calibration does not hold.
  const CodecCosts* codec_costs(std::string_view spec, Strategy strategy) const;
  // The same for an allreduce, checked as the engine checks it (summable, a multi-round codec's
  // strategies and one partition); *rounds gets a multi-round codec's RoundCodec, else null.
  const CodecCosts* allreduce_codec(std::string_view spec, Strategy strategy, int partitions,
                                    const RoundCodec** rounds) const;
  // One flat allreduce partition of m floats of a tensor of n on `ranks` ranks.
  PartitionCost flat_partition(const CodecCosts* k, const RoundCodec* rounds, Strategy strategy,
                               double m, std::size_t n, int ranks) const;
  // One partition of m floats in two levels, its slots `slot`'s cost each (flat_partition on
  // the hosts' owners of a slot), the status round after each where `status`.
  PartitionCost hosts_partition(const PartitionCost& slot, bool status, double m, int slots,
                                std::size_t n, const planner::HostLayout& hosts) const;
  // A reduce-scatter's or all-gather's partition (k: the codec's costs, null for raw).
  Prediction predict_collective(std::size_t n, const CodecCosts* k, Strategy strategy,
                                int partitions, int ranks, int threads, Operation op) const;
  // A multi-round codec's partition: its rounds' sums gathered (strategy allgather) or on
  // rings (summable).
  PartitionCost rounds_partition(const RoundCodec& rounds, const CodecCosts& k, bool gathered,
                                 std::size_t n, int ranks) const;
  // K partitions of cost p on `threads` workers, then the host's CPU bound.
  Prediction pipeline(const PartitionCost& p, int parts, int threads) const;

  Calibration calibration_;
  std::size_t gather_bytes_ = kDefaultGatherBytes;
  // The multi-round codecs of the calibration: their contributions' sizes per round.
  std::map<std::string, std::shared_ptr<const Codec>, std::less<>> rounds_;
};

}  // namespace terse
