// Completion: turns a job whose tasks have all run into its outcome (the error every rank
// agrees on, or the results copied out of staging), releases its tensors, and completes its
// handle on the completion thread, one job at a time in the order they finished. Also counts
// the jobs not yet completed, for synchronize().
//
// Guards: mu_ guards the completions queue, outstanding_ and stopping_. A leaf: nothing else is
// locked while it is held; handles complete, and their callbacks run, with no lock held.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/job.h"
#include "terse/communicator.h"
#include "terse/engine.h"

namespace terse {

struct Handle::State {
  std::mutex mu;  // a leaf; callbacks run after it is released
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::vector<std::function<void(std::exception_ptr)>> callbacks;

  void complete(std::exception_ptr e);
};

namespace engine {

class Completion {
 public:
  // `release` is called once per job before its handle completes (succeeded: no error).
  Completion(Communicator& comm, const EngineOptions& options,
             std::function<void(const Job&, bool succeeded)> release);
  // stop().
  ~Completion();
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;

  // A job was submitted: wait_idle() now waits for it too. Called before its tasks are queued.
  void begin();
  // The job's tasks have all run: decide its outcome and queue its handle's completion.
  void finish(const std::shared_ptr<Job>& job);
  // Blocks until every job begun so far has completed (handle completed, callbacks run).
  void wait_idle();
  // Completes every queued handle, then joins the completion thread. Called after the workers
  // stopped, so that every begun job has finished.
  void stop();

 private:
  void run();
  std::exception_ptr failure_error(const Job& job) const;
  void check_raw_sums(const Job& job) const;
  static void copy_back(const Job& job);
  std::string outcome() const;

  Communicator& comm_;
  const EngineOptions& options_;
  std::function<void(const Job&, bool)> release_;

  std::mutex mu_;
  // The completion thread waits on completion_cv_, wait_idle() on idle_cv_: a wake-up reaches
  // only threads that can act on it.
  std::condition_variable completion_cv_, idle_cv_;
  std::deque<std::pair<std::shared_ptr<Handle::State>, std::exception_ptr>> completions_;
  int outstanding_ = 0;  // jobs begun and not yet completed
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace engine
}  // namespace terse
