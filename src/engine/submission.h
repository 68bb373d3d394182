// Submission building: checks a submission's tensors, plans them (plans.h), checks their
// description across ranks on first use, fuses small raw tensors into one message, lays out
// staging, numbers the partition tasks and queues them on the workers.
//
// The submission order (order_mu_) is held for the whole of a submission, its cross-rank
// exchanges included, and serializes submissions: that is inherent, not a lock of convenience.
// A submission's tasks must enter the queue after those of every submission called before it
// (their sequence numbers and tags follow call order on every rank), and its first-use check
// decides whether it enters at all; the planner's exchanges (calibration, re-checks) are
// collectives at the same point of the sequence on every rank. So a submission waits for the
// one before it to be checked, planned and queued. No other part takes the submission order:
// workers, completion, handles, synchronize(), bytes_sent() and save_state() make progress
// while a submission waits for a slow peer. Engine::plan with codec "auto" (a collective) and
// load_state (which replaces records that submissions read) take it too.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "engine/completion.h"
#include "engine/job.h"
#include "engine/partition_task.h"
#include "engine/plans.h"
#include "engine/worker_pool.h"
#include "terse/communicator.h"
#include "terse/engine.h"

namespace terse::engine {

class Submissions {
 public:
  Submissions(Communicator& comm, const EngineOptions& options, BufferPool& buffers, Plans& plans,
              PartitionTasks& tasks, WorkerPool& workers, Completion& completion);

  // Checks, plans and queues one submission. Throws (nothing submitted) for invalid tensors or
  // options, a tensor in flight, or a mismatch across ranks on first use (MismatchError).
  Handle submit(std::vector<TensorRef> tensors);

  // Checks, plans and queues a reduce_scatter, all_gather or all_to_all (Engine's promises).
  Handle submit_collective(Operation op, std::string name, TensorView input, TensorView output,
                           std::vector<std::size_t> send_counts,
                           std::vector<std::size_t> recv_counts, const CollectiveOptions& options);

  // Holds the submission order, for other calls that must be sequenced with submissions.
  std::unique_lock<std::mutex> order() { return std::unique_lock(order_mu_); }

 private:
  void verify(const std::vector<Item>& items);
  // Checks that every rank's `text` (one line per tensor) is the same; throws MismatchError
  // showing two that differ.
  void verify(const std::string& text, const std::string& label);
  void lay_out(Job& job) const;
  std::vector<Task> split(const std::shared_ptr<Job>& job);
  Handle dispatch(const std::shared_ptr<Job>& job);

  Communicator& comm_;
  const EngineOptions& options_;
  BufferPool& buffers_;
  Plans& plans_;
  PartitionTasks& tasks_;
  WorkerPool& workers_;
  Completion& completion_;

  std::mutex order_mu_;
  std::uint32_t task_seq_ = 0;    // under order_mu_
  std::uint32_t verify_seq_ = 0;  // under order_mu_
  // Collectives' codec "auto" requests checked across ranks (their descriptions), under
  // order_mu_.
  std::set<std::string> auto_checked_;
};

}  // namespace terse::engine
