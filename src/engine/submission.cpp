#include "engine/submission.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <climits>
#include <set>

#include "engine/handle_access.h"
#include "transport/tags.h"
#include "kit/hash.h"
#include "terse/error.h"
#include "terse/trace.h"

namespace terse::engine {

std::string config_of(const TensorRef& t, const TensorPlan& p) {
  // fp32 tensors keep the description they always had (it names saved state and message tags).
  const std::string values =
      t.tensor.dtype == DType::kFloat32
          ? fmt::format("{} floats", t.tensor.elements)
          : fmt::format("{} {} values", t.tensor.elements, to_string(t.tensor.dtype));
  return fmt::format("{}, codec {}, strategy {}{}, {} partition{}, {}", values, p.codec,
                     to_string(p.strategy), p.hierarchical ? " across hosts" : "", p.partitions,
                     p.partitions == 1 ? "" : "s", t.options.average ? "average" : "sum");
}

std::string record_key(const Item& it) {
  if (it.op == Operation::kAllreduce) return it.ref.name;
  return fmt::format("{}:{}", to_string(it.op), it.ref.name);
}

// Rank-independent (it is compared across ranks): an all_to_all's counts are not part of it.
std::string config_of(const Item& it) {
  if (it.op == Operation::kAllreduce) return config_of(it.ref, it.plan);
  const DType d = it.ref.tensor.dtype;
  std::string values;
  switch (it.op) {
    case Operation::kReduceScatter:
      values = fmt::format("{} of {} {} values per shard", to_string(it.op), it.output.elements,
                           to_string(d));
      break;
    case Operation::kAllGather:
      values = fmt::format("{} of {} {} values per shard", to_string(it.op), it.ref.tensor.elements,
                           to_string(d));
      break;
    default: values = fmt::format("{} of {} blocks", to_string(it.op), to_string(d));
  }
  return fmt::format("{}, codec {}, strategy {}{}, {} partition{}{}", values, it.plan.codec,
                     to_string(it.plan.strategy), it.plan.hierarchical ? " across hosts" : "",
                     it.plan.partitions,
                     it.plan.partitions == 1 ? "" : "s",
                     it.op != Operation::kReduceScatter ? ""
                     : it.ref.options.average           ? ", average"
                                                        : ", sum");
}

bool fusable(const Item& it, const EngineOptions& options) {
  return it.op == Operation::kAllreduce && it.plan.strategy == Strategy::kRaw &&
         it.ref.options.average && it.ref.tensor.dtype == DType::kFloat32 &&
         it.floats.size_bytes() <= options.fuse_bytes;
}

namespace {

std::string indent(const std::string& text) {
  std::string out;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out += "    " + text.substr(start, end - start) + "\n";
    start = end + 1;
  }
  return out.empty() ? "    (nothing)\n" : out;
}

void check_view(const TensorRef& t) {
  if (t.tensor.data == nullptr && t.tensor.elements != 0) {
    throw InvalidArgument(fmt::format("allreduce: tensor '{}' has {} elements and no data",
                                      t.name, t.tensor.elements));
  }
}

}  // namespace

Submissions::Submissions(Communicator& comm, const EngineOptions& options, BufferPool& buffers,
                         Plans& plans, PartitionTasks& tasks, WorkerPool& workers,
                         Completion& completion)
    : comm_(comm),
      options_(options),
      buffers_(buffers),
      plans_(plans),
      tasks_(tasks),
      workers_(workers),
      completion_(completion) {}

Handle Submissions::submit(std::vector<TensorRef> tensors) {
  std::lock_guard order(order_mu_);
  plans_.before_submission(tensors);
  auto job = std::make_shared<Job>();
  job->handle = std::make_shared<Handle::State>();
  if (options_.tracer) job->submitted_ns = trace_now_ns();
  std::set<std::string> names;
  bool need_verify = false;
  for (auto& t : tensors) {
    if (t.name.empty()) throw InvalidArgument("allreduce: a tensor needs a name");
    if (!names.insert(t.name).second) {
      throw InvalidArgument(
          fmt::format("allreduce: tensor '{}' appears twice in one submission", t.name));
    }
    check_view(t);
    Item it;
    const Codec* codec = nullptr;
    try {
      it.plan = plans_.plan(t.tensor.elements, t.options, &codec, t.tensor.dtype);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          fmt::format("rank {}: allreduce of tensor '{}': {}", comm_.rank(), t.name, e.what()));
    }
    if (it.plan.strategy != Strategy::kRaw) {
      it.codec = codec;
      if (codec->traits().multi_round) it.rounds = dynamic_cast<const RoundCodec*>(codec);
    }
    if (plans_.needs_check(t.name, config_of(t, it.plan))) need_verify = true;
    it.floats = floats_of(t.tensor);
    it.ref = std::move(t);
    job->items.push_back(std::move(it));
  }
  if (job->items.empty()) {
    job->handle->complete(nullptr);
    return HandleAccess::of(job->handle);
  }
  if (need_verify) verify(job->items);  // throws MismatchError: nothing submitted

  plans_.commit(*job);
  lay_out(*job);
  return dispatch(job);
}

Handle Submissions::submit_collective(Operation op, std::string name, TensorView input,
                                      TensorView output, std::vector<std::size_t> send_counts,
                                      std::vector<std::size_t> recv_counts,
                                      const CollectiveOptions& options) {
  const std::string_view what = to_string(op);
  const int n = comm_.size(), r = comm_.rank();
  auto invalid = [&](const std::string& why) {
    return InvalidArgument(fmt::format("rank {}: {} of tensor '{}': {}", r, what, name, why));
  };
  if (name.empty()) throw InvalidArgument(fmt::format("rank {}: {}: a tensor needs a name", r, what));
  if ((input.data == nullptr && input.elements != 0) ||
      (output.data == nullptr && output.elements != 0)) {
    throw invalid("a tensor with elements and no data");
  }
  if (input.dtype != output.dtype) {
    throw invalid(fmt::format("input is {} and output {}; they must have one type",
                              to_string(input.dtype), to_string(output.dtype)));
  }
  std::size_t shard = 0, total = 0;
  switch (op) {
    case Operation::kReduceScatter:
      if (input.elements != static_cast<std::size_t>(n) * output.elements) {
        throw invalid(fmt::format("input has {} elements and output {}: input must hold {} ranks "
                                  "x the output's {} ({})",
                                  input.elements, output.elements, n, output.elements,
                                  static_cast<std::size_t>(n) * output.elements));
      }
      shard = output.elements;
      total = input.elements;
      break;
    case Operation::kAllGather:
      if (output.elements != static_cast<std::size_t>(n) * input.elements) {
        throw invalid(fmt::format("input has {} elements and output {}: output must hold {} "
                                  "ranks x the input's {} ({})",
                                  input.elements, output.elements, n, input.elements,
                                  static_cast<std::size_t>(n) * input.elements));
      }
      shard = input.elements;
      total = output.elements;
      break;
    case Operation::kAllToAll: {
      if (send_counts.size() != static_cast<std::size_t>(n) ||
          recv_counts.size() != static_cast<std::size_t>(n)) {
        throw invalid(fmt::format("{} send_counts and {} recv_counts for {} ranks; give one per "
                                  "rank",
                                  send_counts.size(), recv_counts.size(), n));
      }
      std::size_t sent = 0, received = 0;
      for (auto c : send_counts) sent += c;
      for (auto c : recv_counts) received += c;
      if (sent != input.elements || received != output.elements) {
        throw invalid(fmt::format("send_counts sum to {} for an input of {} elements and "
                                  "recv_counts to {} for an output of {}: each must sum to its "
                                  "tensor's size",
                                  sent, input.elements, received, output.elements));
      }
      if (send_counts[r] != recv_counts[r]) {
        throw invalid(fmt::format("send_counts[{}] = {} and recv_counts[{}] = {}: this rank's "
                                  "block to itself must be received whole",
                                  r, send_counts[r], r, recv_counts[r]));
      }
      total = std::max(input.elements, output.elements);
      break;
    }
    case Operation::kAllreduce: throw invalid("not a collective of its own");
  }

  std::lock_guard order(order_mu_);
  const bool planned = auto_tier(options.codec).has_value() && op != Operation::kAllToAll;
  if (planned) {
    // The planner's first plan and its exchanges are collectives: before any rank reaches one,
    // the ranks check that all of them asked for "auto" here (a rank that named a codec instead
    // fails every rank with a MismatchError rather than leaving them waiting in calibration).
    const std::string request =
        fmt::format("'{}': {} of {} {} values per shard, codec {}, strategy {}, partitions {}{}\n",
                    name, what, shard, to_string(input.dtype), options.codec,
                    to_string(options.strategy), options.partitions,
                    op != Operation::kReduceScatter ? ""
                    : options.average               ? ", average"
                                                    : ", sum");
    if (!auto_checked_.contains(request)) {
      verify(request,
             fmt::format("{} of '{}' (first-use check of codec {})", what, name, options.codec));
      auto_checked_.insert(request);
    }
  }
  plans_.before_collective(op, total, options);
  auto job = std::make_shared<Job>();
  job->handle = std::make_shared<Handle::State>();
  if (options_.tracer) job->submitted_ns = trace_now_ns();
  Item it;
  it.op = op;
  const Codec* codec = nullptr;
  it.plan = plans_.plan_collective(op, name, shard, total, options, &codec, input.dtype);
  if (it.plan.strategy != Strategy::kRaw) it.codec = codec;
  it.ref.name = std::move(name);
  it.ref.tensor = input;
  it.floats = floats_of(input);
  it.ref.options.codec = options.codec;
  it.ref.options.strategy = options.strategy;
  it.ref.options.partitions = options.partitions;
  it.ref.options.average = op == Operation::kReduceScatter && options.average;
  it.output = output;
  it.send_counts = std::move(send_counts);
  it.recv_counts = std::move(recv_counts);
  const bool need_verify = plans_.needs_check(record_key(it), config_of(it));
  job->items.push_back(std::move(it));
  if (need_verify) verify(job->items);  // throws MismatchError: nothing submitted
  if (planned) job->spans.assign(1, {INT64_MAX, INT64_MIN});  // its time, for the planner

  plans_.commit(*job);
  return dispatch(job);
}

// Splits a planned job into partition tasks and queues them on the worker pool.
Handle Submissions::dispatch(const std::shared_ptr<Job>& job) {
  std::vector<Task> tasks = split(job);
  job->remaining = static_cast<int>(tasks.size());
  std::vector<WorkerPool::Task> work;
  work.reserve(tasks.size());
  for (auto& t : tasks) {
    work.push_back([this, t = std::move(t)](std::uint32_t worker, Workspace& w) mutable {
      tasks_.run(t, worker, w);
    });
  }
  completion_.begin();
  workers_.submit(std::move(work));
  return HandleAccess::of(job->handle);
}

// Fusion and the staging buffer.
void Submissions::lay_out(Job& job) const {
  std::size_t fusable_items = 0;
  for (const auto& it : job.items) fusable_items += fusable(it, options_);
  if (fusable_items >= 2) {
    for (std::size_t i = 0; i < job.items.size(); ++i) {
      Item& it = job.items[i];
      if (fusable(it, options_)) {
        it.plan.fused = true;
        job.fused.push_back(static_cast<int>(i));
        job.fused_elements += it.ref.tensor.elements;
      }
    }
    // Fused tensors are laid out by name: an element's position in the fused ring decides the
    // order in which its sum is taken, which must not depend on the order of the group.
    std::sort(job.fused.begin(), job.fused.end(),
              [&](int a, int b) { return job.items[a].ref.name < job.items[b].ref.name; });
  }
  // Staging layout: the fused items' sums first, contiguous in fused order, then the others.
  std::size_t staging = 0;
  for (int i : job.fused) {
    job.items[i].staging = staging;
    job.items[i].staged = true;
    staging += job.items[i].ref.tensor.elements;
  }
  for (auto& it : job.items) {
    if (it.plan.fused || !options_.keep_input_on_error || it.op != Operation::kAllreduce) continue;
    it.staging = staging;
    it.staged = true;
    staging += staged_floats(it);
  }
  if (staging > 0) job.staging = buffers_.acquire(staging * sizeof(float));
  if (std::any_of(job.items.begin(), job.items.end(),
                  [](const Item& it) { return auto_tier(it.ref.options.codec).has_value(); })) {
    job.spans.assign(job.items.size(), {INT64_MAX, INT64_MIN});
  }
}

// The job's partition tasks, numbered in call order: the fused message's first, then each
// unfused item's. A task's tags carry a digest of what it reduces, so ranks that submitted
// different things cannot read each other's messages as data.
std::vector<Task> Submissions::split(const std::shared_ptr<Job>& job) {
  std::vector<Task> tasks;
  auto add_task = [&](int item, int partition, int partitions, const std::string& what) {
    Task t;
    t.job = job;
    t.item = item;
    t.partition = partition;
    t.partitions = partitions;
    std::uint64_t signature =
        fnv1a64(fmt::format("{}#{}/{}", what, partition, partitions)) & tags::kSignatureMask;
    if (signature >= tags::kFirstReservedSignature) signature = 0;
    t.tag_base = (signature << 32) | (static_cast<std::uint64_t>(task_seq_++ & 0xffff) << 16);
    tasks.push_back(std::move(t));
  };
  if (!job->fused.empty()) {
    std::string what = "fused";
    for (int i : job->fused) {
      what += '|';
      what += job->items[i].ref.name;
      what += config_of(job->items[i].ref, job->items[i].plan);
    }
    const std::size_t k = std::clamp<std::size_t>(
        (job->fused_elements * 4 + options_.partition_bytes - 1) / options_.partition_bytes, 1,
        kMaxPartitions);
    for (std::size_t p = 0; p < k; ++p) add_task(-1, p, k, what);
  }
  for (std::size_t i = 0; i < job->items.size(); ++i) {
    const Item& it = job->items[i];
    if (it.plan.fused) continue;
    const std::string what = fmt::format("{}|{}", record_key(it), config_of(it));
    for (int p = 0; p < it.plan.partitions; ++p) add_task(i, p, it.plan.partitions, what);
  }
  return tasks;
}

// ---- cross-rank check of a submission's description (first use) ----------------------------

void Submissions::verify(const std::vector<Item>& items) {
  std::string text;
  for (const auto& it : items) {
    text += fmt::format("'{}': {}\n", it.ref.name, config_of(it));
  }
  verify(text, items.size() == 1 ? fmt::format("{} of '{}' (first-use check)",
                                               to_string(items[0].op), items[0].ref.name)
                                 : fmt::format("'{}' and {} more (first-use check)",
                                               items[0].ref.name, items.size() - 1));
}

void Submissions::verify(const std::string& text, const std::string& label) {
  const int n = comm_.size(), r = comm_.rank();
  if (n == 1) return;
  const std::uint64_t base = (tags::kVerifySignature << 32) |
                             (static_cast<std::uint64_t>(verify_seq_++ & 0xffff) << 16);
  const std::uint64_t mine[2] = {fnv1a64(text), text.size()};
  std::vector<std::array<std::uint64_t, 2>> theirs(n);
  auto exchange = [&](std::uint32_t index, auto&& send_of, auto&& recv_of) {
    std::vector<Request> rx, tx;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      rx.push_back(comm_.recv(p, base | index, recv_of(p), label));
      tx.push_back(comm_.send(p, base | index, send_of(p), label));
    }
    for (auto& q : rx) q.wait();
    for (auto& q : tx) q.wait();
  };
  exchange(
      0, [&](int) { return std::as_bytes(std::span(mine)); },
      [&](int p) { return std::as_writable_bytes(std::span(theirs[p])); });
  theirs[r] = {mine[0], mine[1]};
  bool same = true;
  for (int p = 0; p < n; ++p) same &= theirs[p][0] == mine[0] && theirs[p][1] == mine[1];
  if (same) return;
  // Every rank saw the same digests, so every rank takes this path: exchange the texts.
  std::vector<std::string> texts(n);
  for (int p = 0; p < n; ++p) {
    if (theirs[p][1] > (std::uint64_t{16} << 20)) {
      throw MismatchError(fmt::format("rank {}: rank {} describes its submission in {} bytes", r,
                                      p, theirs[p][1]));
    }
    texts[p].resize(theirs[p][1]);
  }
  texts[r] = text;
  exchange(
      1, [&](int) { return std::as_bytes(std::span(text.data(), text.size())); },
      [&](int p) { return std::as_writable_bytes(std::span(texts[p].data(), texts[p].size())); });
  int other = 0;
  while (other < n && texts[other] == text) ++other;
  if (other == n) other = r == 0 ? 1 : 0;
  throw MismatchError(fmt::format(
      "rank {}: ranks submitted different tensors at the same point; every rank must submit "
      "the same tensors, sizes and options in the same order.\n  rank {} submitted:\n{}  rank "
      "{} submitted:\n{}",
      r, r, indent(text), other, indent(texts[other])));
}

}  // namespace terse::engine
