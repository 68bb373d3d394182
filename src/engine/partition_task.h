// Running one partition task on a worker: the partition's view of its tensor, the strategy
// (src/collectives/), and the outcome reported to its job. The task that runs a job's last
// partition hands the job to completion.
//
// Guards nothing of its own: what a task reports goes to its job under Job::mu.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>

#include "collectives/collective.h"
#include "kit/buffer_pool.h"
#include "engine/job.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/engine.h"

namespace terse::engine {

class PartitionTasks {
 public:
  // `finish` completes a job; it is called once per job, by the task that ran its last.
  PartitionTasks(Communicator& comm, const EngineOptions& options,
                 const transport::Topology& topology, BufferPool& buffers,
                 std::atomic<std::uint64_t>& bytes_sent,
                 std::function<void(const std::shared_ptr<Job>&)> finish);

  // Runs the task on worker `thread` with that worker's workspace. Never throws: errors go to
  // the job (and, for errors of this rank's own, to the communicator, which fails the peers).
  void run(Task& task, std::uint32_t thread, Workspace& workspace);

  // Bytes sent to ranks of other hosts (Engine::bytes_sent_across_hosts).
  std::uint64_t bytes_across() const { return bytes_across_.load(); }

 private:
  void run_fused(Task& task, collectives::PartitionContext& ctx);
  void run_allreduce(Task& task, collectives::PartitionContext& ctx);
  // The allreduce of ctx's input with `strategy` among ctx's ranks (all of them, or a group).
  void run_strategy(Strategy strategy, collectives::PartitionContext& ctx);
  void run_collective(Task& task, collectives::PartitionContext& ctx);
  void run_reduce_scatter(const Task& task, collectives::PartitionContext& ctx);
  void run_all_gather(const Task& task, collectives::PartitionContext& ctx);
  void run_all_to_all(const Task& task, collectives::PartitionContext& ctx);
  void raw_sum(collectives::PartitionContext& ctx);
  static void note_raw_sum(Job& job, int item, const collectives::PartitionContext& ctx);
  static void note_span(Job& job, int item, std::int64_t begin);
  static void record_error(Job& job, std::exception_ptr e);

  Communicator& comm_;
  const EngineOptions& options_;
  const transport::Topology& topology_;
  BufferPool& buffers_;
  std::atomic<std::uint64_t>& bytes_sent_;
  std::atomic<std::uint64_t> bytes_across_{0};
  std::function<void(const std::shared_ptr<Job>&)> finish_;
};

}  // namespace terse::engine
