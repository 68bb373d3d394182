// terse's threads run under Linux's SCHED_BATCH policy: a woken thread does not preempt the one
// running on its core, it waits for that one to block or for the scheduler's tick.
//
// Why: Gloo's TCP pair sends under the pair's mutex, and the writev() that puts a message on
// loopback or a veth wakes the receiving side at once. Under the default policy the woken thread
// preempts the writer as the system call returns, with the mutex still held; the pair's event
// loop (which only try-locks that mutex and, its epoll being level-triggered, comes straight back)
// and every thread posting to the pair then wait until the writer is scheduled again, a whole
// time slice (about 4 ms here) later. On a host with more busy threads than cores (ranks sharing
// a machine, a training job's compute beside the engine) that happened on most small messages: 8
// partitions of 4 KiB took 2-17 ms on 2 ranks and 2 cores, and 1.0-1.3 ms under SCHED_BATCH.
// Where cores are idle a woken thread runs on one of them, so nothing changes.
//
// ProcessOptions::batch_scheduling false (TERSE_SCHED=normal at the edge) leaves every thread
// under the policy it was created with.
#pragma once

namespace terse::transport {

// Whether terse's threads use SCHED_BATCH (by default they do). Process-wide; threads already
// started keep the policy they took.
bool batch_scheduling();
void set_batch_scheduling(bool on);

// Puts the calling thread under SCHED_BATCH when batch_scheduling(); no effect elsewhere (the
// policy is an optimization: a refusal is ignored). Called first by every thread terse starts.
void enter_batch_scheduling();

// The calling thread under SCHED_BATCH for the scope, so that the threads it starts inherit the
// policy (Gloo's event loop, started by the device), then back under the policy it had.
class BatchScope {
 public:
  BatchScope();
  ~BatchScope();
  BatchScope(const BatchScope&) = delete;
  BatchScope& operator=(const BatchScope&) = delete;

 private:
  int policy_ = -1;  // the previous policy; -1: unchanged
  int priority_ = 0;
};

}  // namespace terse::transport
