// What the engine's parts pass between them: a submission (Job) of tensors (Items), split into
// partition tasks (Task). The submission part builds them, the workers run the tasks, the
// completion part finishes the job once its last task has run.
#pragma once

#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "collectives/collective.h"
#include "kit/buffer_pool.h"
#include "terse/codec.h"
#include "terse/engine.h"

namespace terse::engine {

using kit::Buffer;
using kit::BufferPool;

using collectives::kMaxPartitions;

struct TensorRecord;

// The operation of a submission: terse::Operation (terse/plan.h), all_to_all included.

struct Item {
  Operation op = Operation::kAllreduce;
  TensorRef ref;  // reduce_scatter, all_gather, all_to_all: ref.tensor is the input
  // ref.tensor's values when it is fp32 (empty otherwise): the view the fp32 paths read and
  // write, set once at submission.
  std::span<float> floats;
  // reduce_scatter, all_gather, all_to_all: the output, and the counts of an all_to_all.
  TensorView output;
  std::vector<std::size_t> send_counts, recv_counts;
  TensorPlan plan;
  const Codec* codec = nullptr;  // null for raw
  const RoundCodec* rounds = nullptr;
  TensorRecord* record = nullptr;  // its state; only this job's tasks touch it while in flight
  std::uint64_t step = 0;
  std::size_t staging = 0;  // offset of its result in the job's staging buffer, if staged
  bool staged = false;      // result goes to staging first (fused, or keep_input_on_error)
  // Raw, unfused: the first element of its sum that is NaN or Inf, as its partitions' tasks
  // found it (under the job's mu; SIZE_MAX: none). A fused item's sum is scanned at completion.
  std::size_t not_finite = SIZE_MAX;
};

struct Job {
  std::vector<Item> items;
  std::vector<int> fused;  // indices of items travelling in the fused message
  std::size_t fused_elements = 0;
  // Results that are not written in place: the fused message (gathered inputs, reduced in
  // place) first, then, with keep_input_on_error, every other item.
  Buffer staging;
  std::atomic<int> remaining{0};  // tasks not yet run

  // Guards what the job's tasks report: fused_gathered, error, failure, failure_item, spans and
  // the items' not_finite. A leaf: nothing else is locked while it is held.
  std::mutex mu;
  bool fused_gathered = false;
  std::exception_ptr error;
  collectives::Failure failure;
  int failure_item = -1;
  // Per item: first task start and last task end (trace_now_ns), for the planner; empty when no
  // item was planned by it.
  std::vector<std::pair<std::int64_t, std::int64_t>> spans;

  std::shared_ptr<Handle::State> handle;
  std::int64_t submitted_ns = 0;  // for the "allreduce" trace event
};

struct Task {
  std::shared_ptr<Job> job;
  int item = -1;  // -1: the fused raw message
  int partition = 0;
  int partitions = 1;
  std::uint64_t tag_base = 0;
};

// A view's values when it is fp32; empty otherwise.
inline std::span<float> floats_of(const TensorView& t) {
  return t.dtype == DType::kFloat32 ? t.floats() : std::span<float>{};
}

// The description of a tensor's configuration: it is checked across ranks on first use, names
// saved state and is hashed into message tags, so a change resets the tensor's state.
std::string config_of(const TensorRef& t, const TensorPlan& p);
// The same for any item (a reduce_scatter's, all_gather's or all_to_all's names its operation).
std::string config_of(const Item& it);

// The key of an item's record: its name, qualified by its operation unless an allreduce.
std::string record_key(const Item& it);

// Small raw tensors that average (DDP's case) travel together in one message.
bool fusable(const Item& it, const EngineOptions& options);

// Floats of staging an item's result takes.
inline std::size_t staged_floats(const Item& it) {
  return (it.ref.tensor.bytes() + sizeof(float) - 1) / sizeof(float);
}

// Where item i's result is written: its own tensor, or the staging buffer.
inline std::span<float> result(const Job& job, int i) {
  const Item& it = job.items[i];
  if (!it.staged) return it.floats;
  return job.staging.as<float>(it.staging + it.floats.size()).subspan(it.staging);
}

// The same for a half tensor: its 16-bit values.
inline std::span<std::uint16_t> half_result(const Job& job, int i) {
  const Item& it = job.items[i];
  if (!it.staged) return it.ref.tensor.half();
  auto area = job.staging.as<float>(it.staging + staged_floats(it)).subspan(it.staging);
  return {reinterpret_cast<std::uint16_t*>(area.data()), it.ref.tensor.elements};
}

}  // namespace terse::engine
