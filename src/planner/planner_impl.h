// The planner's internals, and the door the engine, the tools and the tests use to reach them
// (PlannerAccess): a planner with a given calibration, its cost model, the allreduce probe that
// calibration times the engine with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "planner/calibration.h"
#include "planner/cost_model.h"
#include "planner/explorer.h"
#include "planner/protocol.h"
#include "terse/export.h"
#include "terse/planner.h"

namespace terse {

// Partition counts the planner tries (raw also at the engine's own: Use::raw_partition_bytes):
// powers of two up to where a partition's fixed costs outgrow what pipelining saves at the
// sizes models have.
inline const std::vector<int> kPartitionChoices = {1, 2, 4, 8, 16};

namespace planner {
// The key of a plan's measured times: plan_key, qualified by the operation unless an allreduce
// ("reduce_scatter:fp16/alltoall/1"), so that operations never share a measurement.
std::string run_key(Operation op, const TensorPlan& plan);
}  // namespace planner

struct Planner::Impl {
  struct Key {
    std::size_t n;
    int threads;
    Strategy strategy;
    int partitions;
    Tier tier;
    Operation op;
    std::size_t raw_partition_bytes;
    bool flat = true, hosts = false;  // the levels priced (planner::levels_of)
    std::uint64_t topology = 0;       // where hosts: a digest of the topology's host_of
    auto operator<=>(const Key&) const = default;
  };
  // Out of line and hidden: Impl is nested in an exported class, and this one is no API.
  TERSE_HIDDEN static Key key_of(const planner::Use& u);

  PlannerOptions options;
  std::vector<std::string> allowed;  // canonical specs of the light tier
  std::vector<std::string> heavy;    // canonical specs of the heavy tier, none of them light
  std::vector<int> partitions = kPartitionChoices;
  int recheck_interval;
  CalibrationOptions calibration_options;
  MakeAllreduceProbe make_probe;
  std::size_t gather_bytes = kDefaultGatherBytes;  // the engine's (PlannerAccess::set_gather_bytes)

  mutable std::mutex mu;
  std::unique_ptr<CostModel> model;
  std::map<Key, PlanDecision> decisions;
  std::map<Key, planner::Explorer> exploring;
  // Observations since the last exchange, and agreed measured times, by (n, run_key).
  std::map<std::pair<std::size_t, std::string>, std::vector<double>> observed;
  std::map<std::pair<std::size_t, std::string>, double> measured;
  std::uint64_t submissions = 0;

  // Calibrates, or takes the cache every rank agrees on, for the job of `host_of` (its
  // topology's; empty: unknown).
  // direct_pid: CalibrationOptions::direct_pid of that job.
  void ensure_calibrated(Communicator& comm, const std::vector<int>& host_of,
                         const std::vector<std::int64_t>& direct_pid);
  void log_decision(const PlanDecision& d, int rank, const char* why) const;
  // After an exchange (mu held): ends the rounds of explored sizes with the agreed runs, and
  // settles those that are done. Returns how many changed plan.
  int advance_explorations(
      const std::map<std::pair<std::size_t, std::string>, std::vector<double>>& runs, int rank);
};

struct PlannerAccess {
  // A planner with a given calibration (tests, `terse plan`, `terse bench planner --replay`).
  // Throws InvalidArgument where the calibration lacks a codec of either tier.
  static std::unique_ptr<Planner> with_calibration(PlannerOptions options, Calibration calibration);
  // The cost model (throws InvalidArgument before calibration).
  static const CostModel& model(const Planner& planner);
  // Calibrates now, if not yet done (a collective), for the job of `topology` (null: unknown),
  // and returns the calibration.
  static const Calibration& calibration(Planner& planner, Communicator& comm,
                                        const transport::Topology* topology = nullptr);
  // What calibration times the engine with; the engine sets it before its first plan().
  static void set_allreduce_probe(Planner& planner, MakeAllreduceProbe make_probe);
  // Partition counts tried (`--partitions` of the tools; default kPartitionChoices).
  static void set_partitions(Planner& planner, std::vector<int> partitions);
  // Planned submissions between re-checks (0: none).
  static void set_recheck_interval(Planner& planner, int interval);
  // The EngineOptions::gather_bytes of the engine that plans with it, which its cost model
  // prices raw partitions with (default kDefaultGatherBytes); the engine sets it before its
  // first plan().
  static void set_gather_bytes(Planner& planner, std::size_t bytes);
  static Planner::Impl& impl(Planner& planner) { return *planner.impl_; }
  static const Planner::Impl& impl(const Planner& planner) { return *planner.impl_; }
};

}  // namespace terse
