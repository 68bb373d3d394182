// Why terse's threads run under SCHED_BATCH: see scheduling.h.
#include "transport/scheduling.h"

#include <sched.h>

#include <atomic>

namespace terse::transport {

namespace {

std::atomic<bool> batch{true};

// sched_setscheduler(0, ...) sets the policy of the calling thread only (Linux threads are
// scheduled one by one); an unprivileged thread may move between SCHED_OTHER and SCHED_BATCH.
bool set_policy(int policy, int priority) {
  sched_param p{};
  p.sched_priority = priority;
  return sched_setscheduler(0, policy, &p) == 0;
}

}  // namespace

bool batch_scheduling() { return batch.load(std::memory_order_relaxed); }

void set_batch_scheduling(bool on) { batch.store(on, std::memory_order_relaxed); }

void enter_batch_scheduling() {
  // Real-time threads (SCHED_FIFO, SCHED_RR) are the host's choice: leave them alone.
  if (batch_scheduling() && sched_getscheduler(0) == SCHED_OTHER) set_policy(SCHED_BATCH, 0);
}

BatchScope::BatchScope() {
  if (!batch_scheduling()) return;
  const int policy = sched_getscheduler(0);
  if (policy != SCHED_OTHER) return;  // as enter_batch_scheduling: real-time threads stay so
  sched_param p{};
  if (sched_getparam(0, &p) != 0) return;
  if (set_policy(SCHED_BATCH, 0)) {
    policy_ = policy;
    priority_ = p.sched_priority;
  }
}

BatchScope::~BatchScope() {
  if (policy_ >= 0) set_policy(policy_, priority_);
}

}  // namespace terse::transport
