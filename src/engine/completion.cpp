#include "engine/completion.h"

#include <fmt/format.h>

#include <cstring>

#include "engine/handle_access.h"
#include "kit/basic.h"
#include "terse/error.h"
#include "terse/trace.h"
#include "transport/scheduling.h"

namespace terse {

// ---- handles --------------------------------------------------------------------------------

void Handle::State::complete(std::exception_ptr e) {
  std::vector<std::function<void(std::exception_ptr)>> run;
  {
    std::lock_guard lock(mu);
    done = true;
    error = e;
    run.swap(callbacks);
  }
  cv.notify_all();
  for (auto& f : run) f(e);
}

void Handle::wait() const {
  if (!state_) return;
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Handle::ready() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

void Handle::on_complete(std::function<void(std::exception_ptr)> f) const {
  if (!state_) {
    f(nullptr);
    return;
  }
  std::unique_lock lock(state_->mu);
  if (!state_->done) {
    state_->callbacks.push_back(std::move(f));
    return;
  }
  auto e = state_->error;
  lock.unlock();
  f(e);
}

std::pair<Handle, std::function<void(std::exception_ptr)>> HandleAccess::make() {
  auto state = std::make_shared<Handle::State>();
  return {Handle(state), [state](std::exception_ptr e) { state->complete(e); }};
}

Handle HandleAccess::of(std::shared_ptr<Handle::State> state) { return Handle(std::move(state)); }

// ---- completion -----------------------------------------------------------------------------

namespace engine {

using collectives::Failure;

Completion::Completion(Communicator& comm, const EngineOptions& options,
                       std::function<void(const Job&, bool)> release)
    : comm_(comm), options_(options), release_(std::move(release)) {
  thread_ = std::thread([this] {
    transport::enter_batch_scheduling();
    run();
  });
}

Completion::~Completion() { stop(); }

void Completion::begin() {
  std::lock_guard lock(mu_);
  ++outstanding_;
}

void Completion::wait_idle() {
  std::unique_lock lock(mu_);
  idle_cv_.wait(lock, [&] { return outstanding_ == 0; });
}

void Completion::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  completion_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Completion::finish(const std::shared_ptr<Job>& job_ptr) {
  Job& job = *job_ptr;
  std::exception_ptr error = job.error;
  if (!error && job.failure.any()) error = failure_error(job);
  if (!error) {
    try {
      check_raw_sums(job);
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (!error) copy_back(job);
  release_(job, !error);
  job.staging = Buffer();
  if (options_.tracer) {
    TraceEvent e;
    e.stage = "allreduce";
    e.tensor = job.items.size() == 1 ? job.items[0].ref.name
                                     : fmt::format("group of {}", job.items.size());
    for (const auto& it : job.items) e.bytes += it.ref.tensor.bytes();
    e.begin_ns = job.submitted_ns;
    e.end_ns = trace_now_ns();
    e.thread = 1000;  // a track of its own
    options_.tracer->record(std::move(e));
  }
  // Callbacks run on the completion thread, so that one which blocks (a Python callback
  // waiting for the GIL) cannot hold up a worker that other partitions need.
  {
    std::lock_guard lock(mu_);
    completions_.emplace_back(job.handle, error);
  }
  completion_cv_.notify_one();
}

void Completion::run() {
  for (;;) {
    std::pair<std::shared_ptr<Handle::State>, std::exception_ptr> done;
    {
      std::unique_lock lock(mu_);
      completion_cv_.wait(
          lock, [&] { return !completions_.empty() || (stopping_ && outstanding_ == 0); });
      if (completions_.empty()) return;
      done = std::move(completions_.front());
      completions_.pop_front();
    }
    done.first->complete(done.second);
    {
      std::lock_guard lock(mu_);
      --outstanding_;
    }
    idle_cv_.notify_all();
  }
}

// What an error did to the user's tensors.
std::string Completion::outcome() const {
  return options_.keep_input_on_error ? " and left the tensors unchanged"
                                      : " (the tensors may hold partial results)";
}

std::exception_ptr Completion::failure_error(const Job& job) const {
  const Failure& f = job.failure;
  const std::string what =
      job.failure_item < 0 ? std::string("the fused group")
                           : fmt::format("tensor '{}'", job.items[job.failure_item].ref.name);
  std::string cause;
  switch (f.kind) {
    case Failure::kInputNotFinite:
      cause = fmt::format("rank {}'s input holds NaN or Inf at element {}", f.origin, f.index);
      break;
    case Failure::kSumNotFinite:
      cause = f.origin >= 0
                  ? fmt::format("the partial sum at rank {} overflowed to Inf at element {}",
                                f.origin, f.index)
                  : std::string("a sum across ranks holds NaN or Inf (some rank's input was "
                                "not finite, or the sum overflowed)");
      break;
    case Failure::kCountMismatch:
      cause = f.detail.empty()
                  ? fmt::format("rank {} expected a block of another size from rank {} (its "
                                "recv_counts disagree with that rank's send_counts)",
                                f.origin, f.index)
                  : f.detail;
      break;
    default:
      cause = f.detail.empty()
                  ? fmt::format("rank {} received a payload it could not decode", f.origin)
                  : f.detail;
  }
  const Operation op =
      job.failure_item < 0 ? Operation::kAllreduce : job.items[job.failure_item].op;
  const std::string msg = fmt::format(
      "rank {}: {} of {} failed on every rank{}: {}", comm_.rank(), to_string(op), what,
      op == Operation::kAllreduce ? outcome() : " (the output may hold partial results)", cause);
  if (f.kind == Failure::kBadPayload) return std::make_exception_ptr(DecodeError(msg));
  if (f.kind == Failure::kCountMismatch) return std::make_exception_ptr(MismatchError(msg));
  return std::make_exception_ptr(InvalidArgument(msg));
}

// Raw sums are identical on every rank, so this check fails on all of them or on none.
void Completion::check_raw_sums(const Job& job) const {
  for (std::size_t i = 0; i < job.items.size(); ++i) {
    const Item& it = job.items[i];
    if (it.plan.strategy != Strategy::kRaw || it.op != Operation::kAllreduce) continue;
    std::span<float> sum = result(job, static_cast<int>(i));
    const std::size_t bad = it.plan.fused ? kit::find_non_finite(sum) : it.not_finite;
    if (bad >= sum.size()) continue;
    // The input survives only when the result was staged.
    const std::size_t own = it.staged ? kit::find_non_finite(it.floats) : it.floats.size();
    throw InvalidArgument(fmt::format(
        "rank {}: allreduce of tensor '{}' failed on every rank{}: the sum holds NaN or Inf at "
        "element {} ({})",
        comm_.rank(), it.ref.name, outcome(), bad,
        own < it.floats.size()
            ? fmt::format("this rank's input holds NaN or Inf at element {}", own)
            : std::string("some rank's input was not finite, or the sum overflowed")));
  }
}

void Completion::copy_back(const Job& job) {
  for (std::size_t i = 0; i < job.items.size(); ++i) {
    const Item& it = job.items[i];
    if (!it.staged || it.ref.tensor.elements == 0) continue;
    const void* from = it.ref.tensor.dtype == DType::kFloat32
                           ? static_cast<const void*>(result(job, static_cast<int>(i)).data())
                           : half_result(job, static_cast<int>(i)).data();
    std::memcpy(it.ref.tensor.data, from, it.ref.tensor.bytes());
  }
}

}  // namespace engine
}  // namespace terse
