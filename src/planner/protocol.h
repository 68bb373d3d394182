// The engine's side of the planner: what to do now with a size, what it took, the exchanges at
// submissions, and whether a size is still being explored. Called by the engine (and the tests
// and benchmarks that stand in for it), never by users, who call Planner::decide and set
// PlannerOptions (terse/planner.h). The collectives and thread rules are planner.h's.
#pragma once

#include <cstddef>
#include <span>

#include "terse/options.h"
#include "terse/plan.h"
#include "terse/planner.h"

namespace terse {

class Communicator;

namespace transport {
struct Topology;
}

namespace planner {

// One planned tensor of a submission: plan()'s arguments.
struct Use {
  std::size_t n = 0;
  int threads = 0;
  Strategy strategy = Strategy::kAuto;
  int partitions = 0;
  Tier tier = Tier::kLight;
  Operation op = Operation::kAllreduce;
  // The engine's EngineOptions::partition_bytes: raw is also tried at the engine's own
  // partitioning, one partition per this many bytes, so the settled raw plan is never worse
  // than the raw plan the job would run without the planner. 0: not tried. Part of what a
  // decision is kept under, so engines of different partitionings sharing a planner each get
  // their own.
  std::size_t raw_partition_bytes = kDefaultPartitionBytes;
  // The job's hosts (the engine's agreed topology; null: unknown, flat plans only) and the
  // tensor's AllreduceOptions::hierarchy. An allreduce under kAuto on a two-level topology has
  // every candidate priced flat and in two levels; kFlat and kHosts restrict it to one (kHosts
  // on any topology given). Other operations are flat. The topology is the calibrated job's:
  // its first plan records it with the calibration (a cache of another topology is measured
  // again), and link_classes splits the links by it. Decisions are kept per levels priced and
  // topology.
  const transport::Topology* topology = nullptr;
  Hierarchy hierarchy = Hierarchy::kAuto;
};

// Which levels a use prices: flat, two levels over its topology's hosts, or both.
struct Levels {
  bool flat = true;
  bool hosts = false;
};
Levels levels_of(const Use& use);

// Planner::decide for a use (the engine's partitioning included).
PlanDecision decide(const Planner& planner, const Use& use, int ranks);

// What the engine does with a use's n floats now (while a size is explored, its current
// contender). Collective on the first call (calibration, or agreement on a cached one). Each
// tier decides and explores a size apart from the other.
TensorPlan plan(Planner& planner, Communicator& comm, const Use& use);

// The engine reports the wall time of a planned collective of n floats (first task start to
// last task end on this rank). Local and cheap.
void observe(Planner& planner, std::size_t n, const TensorPlan& plan, double seconds,
             Operation op = Operation::kAllreduce);

// Called by the engine before each submission that has planned tensors (at the same points on
// every rank), with the uses of its planned tensors. Where an explored size has finished a
// round, and at a periodic re-check, it exchanges the observations (a collective) and agrees on
// measured times; explorations move on or settle, and decisions whose measured time is far off
// their expectation are dropped, to be decided again. Then each explored size that this
// submission uses moves on to its next contender. Returns the number of sizes whose plan
// changed.
int before_submission(Planner& planner, Communicator& comm, std::span<const Use> uses = {});

// Whether a use's plan is still being explored (local, the same on every rank). While it is,
// the engine keeps each contender's codec state; once settled, it drops the losers'.
bool exploring(const Planner& planner, const Use& use);

}  // namespace planner
}  // namespace terse
