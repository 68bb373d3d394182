// A fixed pool of worker threads that run tasks in the order they were queued (FIFO), each
// worker with its own Workspace. The engine runs its partition tasks on one; a Channel runs its
// message completions on another instance of the same type.
//
// Guards: mu_ guards the queue, stopping_ and the scratch marks (marks_, generation_). No other
// lock is taken while mu_ is held, and tasks run with no lock held.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "terse/codec.h"

namespace terse::engine {

class WorkerPool {
 public:
  // A task gets the number of the worker that runs it (0 .. threads-1) and its workspace.
  using Task = std::function<void(std::uint32_t worker, Workspace& workspace)>;

  // Starts `threads` workers, each under batch scheduling (transport/scheduling.h).
  explicit WorkerPool(int threads);
  // stop().
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues tasks behind every task queued before. Wakes as many idle workers as there are tasks.
  void submit(std::vector<Task> tasks);
  void submit(Task task);

  // Runs every queued task, then joins the workers. Tasks submitted after this never run.
  void stop();

  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void work(std::uint32_t id);
  void publish_scratch(const Workspace& w);
  void catch_up_scratch(Workspace& w);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  // The most scratch any worker has needed, per workspace slot. A task runs on whichever worker
  // is free, so each worker's workspace would grow to it in a run of its own, page faults and
  // all (a 256 MiB tensor in one partition: 128 MiB of error-feedback scratch per worker, a few
  // hundred ms); an idle worker grows its own instead (catch_up_scratch). Workers already
  // waiting when a mark rises are woken for it (generation_ counts the rises).
  std::vector<std::size_t> marks_;
  std::uint64_t generation_ = 0;
  std::vector<std::thread> threads_;
};

}  // namespace terse::engine
