// Workers wait on one condition variable and are woken one per queued task (all of them for a
// batch as large as the pool): on cores shared by several ranks, every needless wake-up is a
// context switch taken from the training.
#include "engine/worker_pool.h"

#include <new>
#include <utility>

#include "transport/scheduling.h"

namespace terse::engine {

WorkerPool::WorkerPool(int threads) {
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this, i] {
      transport::enter_batch_scheduling();
      work(static_cast<std::uint32_t>(i));
    });
  }
}

WorkerPool::~WorkerPool() { stop(); }

void WorkerPool::submit(std::vector<Task> tasks) {
  const std::size_t n = tasks.size();
  {
    std::lock_guard lock(mu_);
    for (auto& t : tasks) queue_.push_back(std::move(t));
  }
  if (n >= threads_.size()) {
    cv_.notify_all();
  } else {
    for (std::size_t i = 0; i < n; ++i) cv_.notify_one();
  }
}

void WorkerPool::submit(Task task) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void WorkerPool::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void WorkerPool::work(std::uint32_t id) {
  Workspace workspace;
  std::uint64_t published = 0;  // workspace.growths() at its last publish_scratch
  std::uint64_t seen = 0;       // generation_ at its last catch_up_scratch
  for (;;) {
    Task task;
    {
      std::unique_lock lock(mu_);
      while (queue_.empty() && !stopping_ && seen != generation_) {
        seen = generation_;
        lock.unlock();
        catch_up_scratch(workspace);
        published = workspace.growths();
        lock.lock();
      }
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || seen != generation_; });
      if (stopping_ && queue_.empty()) return;
      if (queue_.empty()) continue;  // woken to catch up
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task(id, workspace);
    if (workspace.growths() != published) {
      publish_scratch(workspace);
      published = workspace.growths();
    }
  }
}

// Raises the marks to this workspace's slots; wakes the idle workers if any rose.
void WorkerPool::publish_scratch(const Workspace& w) {
  bool rose = false;
  {
    std::lock_guard lock(mu_);
    if (marks_.size() < w.slots()) marks_.resize(w.slots());
    for (std::size_t slot = 0; slot < w.slots(); ++slot) {
      if (w.slot_bytes(slot) <= marks_[slot]) continue;
      marks_[slot] = w.slot_bytes(slot);
      rose = true;
    }
    if (rose) ++generation_;
  }
  if (rose) cv_.notify_all();
}

// Grows an idle worker's workspace to the marks (nothing queued: off every run's path).
void WorkerPool::catch_up_scratch(Workspace& w) {
  std::vector<std::size_t> marks;
  {
    std::lock_guard lock(mu_);
    marks = marks_;
  }
  for (std::size_t slot = 0; slot < marks.size(); ++slot) {
    if (w.slot_bytes(slot) >= marks[slot]) continue;
    try {
      w.reserve(slot, marks[slot]);
    } catch (const std::bad_alloc&) {  // it grows in a run, as it would have anyway
      return;
    }
  }
}

}  // namespace terse::engine
