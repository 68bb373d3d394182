// Plan resolution: what the engine does with each tensor (codec, strategy, partitions), from a
// fixed codec spec or, for codec "auto" or "auto:heavy", from the Planner; and the per-tensor
// records that carry a tensor's codec state, step and first-use check from one submission to
// the next. Every call into the Planner is made here.
//
// Guards:
// - codecs_mu_: the codec instances by spec. A leaf.
// - records_mu_: the records map and each record's fields but its codec state (config, step,
//   verified, parked, in_flight). A leaf. A record's codec state (`partitions`) belongs to the
//   tasks of the job that has it in flight and is touched by no one else meanwhile.
// - planner_: created on first use and used only under the engine's submission order (see
//   submission.h), except by release(), which reports to it from the completion thread for jobs
//   that were submitted after it was set.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/collective.h"
#include "engine/job.h"
#include "planner/protocol.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/planner.h"

namespace terse::engine {

// The strategy codec c gets under strategy auto: raw for codec none, rings for summable or
// multi-round codecs, a gather for codecs with feedback state of their own, sharded otherwise.
Strategy auto_strategy(const Codec& c);

// A tensor's state under one configuration.
struct ConfigState {
  std::uint64_t step = 0;
  bool verified = false;
  std::vector<collectives::StateSlots> partitions;
};

// What the engine remembers of a tensor between submissions: the state of its current
// configuration, and more.
struct TensorRecord : ConfigState {
  // elements, codec, strategy, partitions, average: a change resets state, except that a change
  // of the codec's spec alone hands over what the new state adopts (Plans::commit)
  std::string config;
  bool in_flight = false;
  // While the planner explores a planned tensor's size, its contenders take turns: each one's
  // state waits here, by config, for its next turn (its residuals, its step, its first-use
  // check). Dropped once the size is settled.
  std::map<std::string, ConfigState> parked;

  bool verified_for(const std::string& c) const;
  // Makes `c` the current configuration: its parked state if any, fresh otherwise. The state
  // left is parked if `keep`; without it, every parked state is dropped too.
  void use(const std::string& c, bool keep);
};

using TensorRecords = std::map<std::string, TensorRecord, std::less<>>;

class Plans {
 public:
  // `threads`: the engine's worker threads (the planner's model needs them). `drain` waits until
  // every submitted job has completed (calibration measures the links on quiet ones).
  Plans(Communicator& comm, const EngineOptions& options, const transport::Topology& topology,
        int threads, std::function<void()> drain);

  // The codec of a spec, made once per spec. Thread-safe.
  const Codec& codec(const std::string& spec) const;

  // The plan for n elements of dtype under o; *codec_out (if given) gets its codec. Throws
  // InvalidArgument or SpecError for invalid options. A fixed codec's plan is local and
  // thread-safe; codec "auto" asks the planner, a collective the first time (calibration): the
  // caller holds the submission order.
  TensorPlan plan(std::size_t n, const AllreduceOptions& o, const Codec** codec_out = nullptr,
                  DType dtype = DType::kFloat32) const;

  // The plan of a reduce_scatter, all_gather or all_to_all of tensor `name`: `shard` elements
  // per shard (all_to_all: unused) and `total` elements in the larger of input and output.
  // Throws InvalidArgument naming the rank, tensor and operation for options it cannot honour.
  // Codec "auto" (reduce_scatter and all_gather) asks the planner, as plan() does.
  TensorPlan plan_collective(Operation op, const std::string& name, std::size_t shard,
                             std::size_t total, const CollectiveOptions& o, const Codec** codec_out,
                             DType dtype) const;

  // Before a submission is planned: lets the planner re-check its decisions, a collective at
  // the same point on every rank (ranks submit the same sequence). Under the submission order.
  void before_submission(const std::vector<TensorRef>& tensors);
  // The same before a reduce_scatter or all_gather with codec "auto" of `total` elements.
  void before_collective(Operation op, std::size_t total, const CollectiveOptions& o);

  // ---- per-tensor records ----

  // Whether a tensor under configuration `config` needs the first-use check across ranks (it
  // never passed it under that configuration). Throws InvalidArgument if the tensor is in flight.
  bool needs_check(const std::string& name, const std::string& config) const;

  // Makes the job's items' records current, in flight and checked, and gives each item its
  // record and step. Under the submission order.
  void commit(Job& job);

  // The job's items are no longer in flight; if it succeeded, the planner learns the measured
  // times of its planned items. On the completion thread.
  void release(const Job& job, bool succeeded);

  // The records, for save_state and load_state; the caller holds lock_records().
  std::unique_lock<std::mutex> lock_records() const { return std::unique_lock(records_mu_); }
  TensorRecords& records() { return records_; }

 private:
  TensorPlan plan_auto(std::size_t n, const AllreduceOptions& o, Tier tier, const Codec** codec_out,
                       DType dtype) const;
  Planner& planner() const;
  // What the planner is asked about n elements of op under a restriction: this engine's
  // threads, partitioning and topology.
  planner::Use use(std::size_t n, Strategy strategy, int partitions, Tier tier, Operation op,
                   Hierarchy hierarchy = Hierarchy::kAuto) const;
  // The planner's plan for a use (calibrating first, after the submitted work has finished,
  // where it has not yet).
  TensorPlan decide_auto(const planner::Use& u) const;
  // What the planner is asked about an item (its size, restriction and operation).
  planner::Use use_of(const Item& it) const;
  // Whether a reduce_scatter or all_gather planned as p runs in two levels over the hosts
  // (hierarchy h; auto: as an allreduce decides); `refuse` makes the error for what h asks
  // that cannot be (an all_to_all across hosts, grouped strategies on uneven hosts).
  bool hierarchical_collective(
      Operation op, const TensorPlan& p, std::size_t shard, Hierarchy h,
      const std::function<InvalidArgument(const std::string&)>& refuse) const;

  Communicator& comm_;
  const EngineOptions& options_;
  const transport::Topology& topology_;
  const int threads_;
  std::function<void()> drain_;

  mutable std::mutex codecs_mu_;
  mutable std::map<std::string, std::unique_ptr<Codec>, std::less<>> codecs_;  // by spec as given

  mutable std::shared_ptr<Planner> planner_;  // options.planner, or created on first use

  mutable std::mutex records_mu_;
  TensorRecords records_;
};

}  // namespace terse::engine
