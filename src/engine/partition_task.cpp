#include "engine/partition_task.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "engine/plans.h"
#include "kit/basic.h"
#include "kit/hash.h"
#include "terse/error.h"
#include "terse/trace.h"

namespace terse::engine {

using collectives::Chunks;
using collectives::Failure;
using collectives::PartitionContext;

namespace {

std::span<std::byte> bytes_of(const TensorView& v) {
  return std::span<std::byte>(static_cast<std::byte*>(v.data), v.bytes());
}

// The first non-finite value of x (fp32 or half values of `dtype`), or x's size in elements.
std::size_t non_finite(std::span<const std::byte> x, DType dtype) {
  if (dtype == DType::kFloat32) {
    return kit::find_non_finite(std::span<const float>(reinterpret_cast<const float*>(x.data()),
                                                       x.size() / sizeof(float)));
  }
  return kit::find_non_finite(
      std::span<const std::uint16_t>(reinterpret_cast<const std::uint16_t*>(x.data()),
                                     x.size() / 2),
      dtype);
}

// A half tensor's partition staged in fp32, in one buffer from the pool: `in` floats that its
// values are widened into (exactly, NaN and Inf included), then `out` floats that the
// strategy writes and that are rounded once into the half result. Every half path of a
// partition task goes through it, so that all of them widen and round alike.
class HalfStaging {
 public:
  HalfStaging(BufferPool& pool, DType dtype, std::size_t in, std::size_t out)
      : dtype_(dtype),
        buffer_(pool.acquire(std::max<std::size_t>((in + out) * sizeof(float), 1))),
        in_(in),
        out_(out) {}
  std::span<float> input() const { return buffer_.as<float>(in_ + out_).first(in_); }
  std::span<float> output() const { return buffer_.as<float>(in_ + out_).subspan(in_, out_); }
  // Widens to.size() half values from `from` into `to` (a part of this staging). Returns the
  // index of the first that is NaN or Inf, or to.size() if all are finite.
  std::size_t widen(const std::uint16_t* from, std::span<float> to) const {
    if (kit::widen(dtype_, from, to, false)) return to.size();
    return kit::find_non_finite(std::span<const std::uint16_t>(from, to.size()), dtype_);
  }
  // Rounds `from` (a part of this staging) into `to`; false if a value is not finite there.
  bool narrow(std::span<const float> from, std::uint16_t* to) const {
    return kit::narrow(dtype_, from, to);
  }

 private:
  DType dtype_;
  Buffer buffer_;
  std::size_t in_, out_;
};

}  // namespace

PartitionTasks::PartitionTasks(Communicator& comm, const EngineOptions& options,
                               const transport::Topology& topology, BufferPool& buffers,
                               std::atomic<std::uint64_t>& bytes_sent,
                               std::function<void(const std::shared_ptr<Job>&)> finish)
    : comm_(comm),
      options_(options),
      topology_(topology),
      buffers_(buffers),
      bytes_sent_(bytes_sent),
      finish_(std::move(finish)) {}

void PartitionTasks::run(Task& task, std::uint32_t thread, Workspace& workspace) {
  Job& job = *task.job;
  const std::int64_t begin = trace_now_ns();
  PartitionContext ctx;
  ctx.comm = &comm_;
  ctx.partition = task.partition;
  ctx.partitions = task.partitions;
  ctx.tag_base = task.tag_base;
  ctx.pool = &buffers_;
  ctx.workspace = &workspace;
  ctx.tracer = options_.tracer.get();
  ctx.thread = thread;
  ctx.bytes_sent = &bytes_sent_;
  ctx.host_of = topology_.host_of;
  ctx.bytes_across = &bytes_across_;
  try {
    if (task.item < 0) {
      ctx.tensor = fmt::format("fused group of {} tensors", job.fused.size());
      run_fused(task, ctx);
    } else if (job.items[task.item].op != Operation::kAllreduce) {
      run_collective(task, ctx);
    } else {
      run_allreduce(task, ctx);
    }
    if (ctx.failure.any()) {
      std::lock_guard lock(job.mu);
      if (job.failure_item < 0 || ctx.failure.kind < job.failure.kind ||
          (ctx.failure.kind == job.failure.kind && task.item < job.failure_item)) {
        job.failure = ctx.failure;
        job.failure_item = task.item;
      }
    }
  } catch (const TimeoutError& e) {
    record_error(job, std::make_exception_ptr(TimeoutError(fmt::format(
                          "{} (if the peer is alive, ranks may have submitted different "
                          "tensors at this point)",
                          e.what()))));
  } catch (const TransportError&) {
    record_error(job, std::current_exception());
  } catch (const std::exception& e) {
    // This rank cannot finish its part: fail the communicator so that peers waiting on this
    // task learn it now rather than at their timeout.
    comm_.abort(fmt::format("{}: {}", ctx.label(), e.what()));
    record_error(job, std::current_exception());
  }
  note_span(job, task.item, begin);
  if (job.remaining.fetch_sub(1) == 1) finish_(task.job);
}

// An allreduce's partition: piece p of Split(tensor, K), through its strategy.
void PartitionTasks::run_allreduce(Task& task, PartitionContext& ctx) {
  Job& job = *task.job;
  const Item& it = job.items[task.item];
  const collectives::Split split(it.ref.tensor.elements, task.partitions);
  ctx.tensor = it.ref.name;
  ctx.offset = split.begin(task.partition);
  const DType dtype = it.ref.tensor.dtype;
  std::optional<HalfStaging> wide;  // a half tensor's partition in fp32: sums, decoded results
  if (dtype == DType::kFloat32) {
    ctx.input = split.piece(std::span<const float>(it.floats), task.partition);
    ctx.output = split.piece(result(job, task.item), task.partition);
  } else {
    const auto half =
        split.piece(std::span<const std::uint16_t>(it.ref.tensor.half()), task.partition);
    wide.emplace(buffers_, dtype, 0, half.size());
    ctx.output = wide->output();
    ctx.input = ctx.output;
    if (it.rounds != nullptr || it.plan.hierarchical) {
      // Round codecs and the hierarchical reduce-scatter read their input as fp32 arrays:
      // widen it (NaN and Inf included, which the codec or the sum then reports).
      wide->widen(half.data(), ctx.output);
    } else {
      ctx.half_input = half;
      ctx.dtype = dtype;
    }
  }
  ctx.divisor = it.ref.options.average ? comm_.size() : 1;
  ctx.codec = it.codec;
  ctx.rounds = it.rounds;
  ctx.states = &it.record->partitions[task.partition];
  ctx.encode.seed = options_.seed;
  ctx.encode.step = it.step;
  ctx.encode.tensor = kit::combine_keys(fnv1a64(it.ref.name), task.partition);
  ctx.encode.rank = static_cast<std::uint64_t>(comm_.rank());
  const Strategy strategy = it.plan.strategy;
  if (it.plan.hierarchical) {
    // A multi-round codec compresses the whole partition as one matrix: one rank a host (its
    // last) reduces it and crosses; the others only give their input and take the result.
    const int slots = it.rounds != nullptr ? 1 : topology_.most_ranks_on_a_host();
    collectives::hierarchical_allreduce(
        ctx, topology_, slots, strategy == Strategy::kRaw || it.rounds != nullptr,
        [&](PartitionContext& across) { run_strategy(strategy, across); });
  } else {
    run_strategy(strategy, ctx);
  }
  if (strategy == Strategy::kRaw) note_raw_sum(job, task.item, ctx);
  if (wide && !ctx.failure.any()) {
    // Every rank rounds the same fp32 result the same way.
    auto out = split.piece(half_result(job, task.item), task.partition);
    if (!wide->narrow(ctx.output, out.data())) {
      throw InvalidArgument(fmt::format("engine: {}: decoded result is not finite", ctx.label()));
    }
  }
}

// A reduce_scatter's, all_gather's or all_to_all's partition: partition p of a shard (or of each
// block) is Split(shard, K)'s piece p, so that every rank's pieces line up.
void PartitionTasks::run_collective(Task& task, PartitionContext& ctx) {
  const Job& job = *task.job;
  const Item& it = job.items[task.item];
  const int p = task.partition;
  ctx.tensor = fmt::format("{} of {}", to_string(it.op), it.ref.name);
  ctx.divisor = it.ref.options.average ? comm_.size() : 1;
  ctx.codec = it.codec;
  ctx.states = &it.record->partitions[p];
  ctx.encode.seed = options_.seed;
  ctx.encode.step = it.step;
  ctx.encode.tensor = kit::combine_keys(fnv1a64(it.ref.name), p);
  ctx.encode.rank = static_cast<std::uint64_t>(comm_.rank());
  switch (it.op) {
    case Operation::kReduceScatter: run_reduce_scatter(task, ctx); break;
    case Operation::kAllGather: run_all_gather(task, ctx); break;
    case Operation::kAllToAll: run_all_to_all(task, ctx); break;
    case Operation::kAllreduce: break;
  }
}

void PartitionTasks::run_reduce_scatter(const Task& task, PartitionContext& ctx) {
  const Item& it = task.job->items[task.item];
  const int n = comm_.size(), r = comm_.rank(), p = task.partition;
  const DType dtype = it.ref.tensor.dtype;
  const std::size_t shard = it.output.elements;
  const collectives::Split split(shard, static_cast<std::size_t>(task.partitions));
  auto reduce = [&](const Chunks& chunks, std::span<float> out,
                    const std::function<void()>& finish) {
    if (it.plan.hierarchical) {
      collectives::hierarchical_reduce_scatter(ctx, topology_, it.plan.strategy, chunks, out,
                                               finish);
    } else {
      collectives::reduce_scatter(ctx, it.plan.strategy, chunks, out, finish);
    }
  };
  if (dtype == DType::kFloat32) {
    ctx.input = std::span<const float>(it.floats);  // failures name input elements
    reduce(Chunks::strided(shard, split.begin(p), split.size(p), n),
           split.piece(it.output.floats(), p), {});
    return;
  }
  // A half tensor: the partition's N pieces widened into the staging's input, the shard reduced
  // into its output and rounded once into the result.
  const std::size_t m = split.size(p);
  HalfStaging wide(buffers_, dtype, n * m, m);
  const auto half = std::span<const std::uint16_t>(it.ref.tensor.half());
  for (int j = 0; j < n; ++j) {
    wide.widen(half.data() + j * shard + split.begin(p), wide.input().subspan(j * m, m));
  }
  ctx.input = wide.input();
  std::uint16_t* to = it.output.half().data() + split.begin(p);
  auto round = [&] {
    if (ctx.failure.any() || wide.narrow(wide.output(), to)) return;
    // A sum beyond the format's range; every rank learns it in the status round.
    const std::size_t bad = kit::find_non_finite(std::span<const std::uint16_t>(to, m), dtype);
    ctx.failure.merge({Failure::kSumNotFinite, r, r * m + bad, {}});
  };
  reduce(Chunks::strided(m, 0, m, n), wide.output(), round);
  if (m > 0 && (ctx.failure.kind == Failure::kInputNotFinite ||
                ctx.failure.kind == Failure::kSumNotFinite)) {
    // Failure indices are the staging's (piece j at j * m): every rank maps them back to the
    // tensor's the same way.
    const std::uint64_t at = ctx.failure.index;
    ctx.failure.index = at / m * shard + split.begin(p) + at % m;
  }
}

void PartitionTasks::run_all_gather(const Task& task, PartitionContext& ctx) {
  const Item& it = task.job->items[task.item];
  const int n = comm_.size(), p = task.partition;
  const DType dtype = it.ref.tensor.dtype;
  const std::size_t eb = element_bytes(dtype);
  const std::size_t shard = it.ref.tensor.elements;
  const collectives::Split split(shard, static_cast<std::size_t>(task.partitions));
  const Chunks chunks = Chunks::strided(shard, split.begin(p), split.size(p), n);
  ctx.offset = split.begin(p);  // failures name shard elements
  if (it.plan.strategy == Strategy::kRaw) {
    const auto in = bytes_of(it.ref.tensor).subspan(split.begin(p) * eb, split.size(p) * eb);
    const auto out = bytes_of(it.output);
    auto piece = [&](int j) { return out.subspan(chunks.begin(j) * eb, chunks.size(j) * eb); };
    if (it.plan.hierarchical) {
      collectives::hierarchical_all_gather_bytes(ctx, topology_, in, piece);
    } else {
      collectives::all_gather_bytes(ctx, in, piece);
    }
    // Every rank scans the same bytes: all fail or none.
    for (int j = 0; j < n; ++j) {
      const std::size_t bad = non_finite(piece(j), dtype);
      if (bad < chunks.size(j)) {
        ctx.failure.merge({Failure::kInputNotFinite, j, split.begin(p) + bad, {}});
      }
    }
    return;
  }
  auto gather = [&](const Chunks& pieces, std::span<float> out) {
    if (it.plan.hierarchical) {
      collectives::hierarchical_all_gather(ctx, topology_, pieces, out);
    } else {
      collectives::all_gather(ctx, pieces, out);
    }
  };
  if (dtype == DType::kFloat32) {
    ctx.input = split.piece(std::span<const float>(it.floats), p);
    gather(chunks, it.output.floats());
    return;
  }
  // A half shard is encoded from its own values; every rank decodes into the staging's output
  // and rounds each value once.
  const std::size_t size = split.size(p);
  HalfStaging wide(buffers_, dtype, 0, size * n);
  ctx.input = wide.output().first(size);  // its size only: the codec reads half_input
  ctx.half_input = split.piece(std::span<const std::uint16_t>(it.ref.tensor.half()), p);
  ctx.dtype = dtype;
  const Chunks local = Chunks::strided(size, 0, size, n);
  gather(local, wide.output());
  if (ctx.failure.any()) return;
  for (int j = 0; j < n; ++j) {
    if (!wide.narrow(local.piece(wide.output(), j), it.output.half().data() + chunks.begin(j))) {
      throw InvalidArgument(fmt::format("engine: {}: decoded result is not finite", ctx.label()));
    }
  }
}

void PartitionTasks::run_all_to_all(const Task& task, PartitionContext& ctx) {
  const Item& it = task.job->items[task.item];
  const int n = comm_.size(), r = comm_.rank(), p = task.partition;
  const std::size_t k = static_cast<std::size_t>(task.partitions);
  const DType dtype = it.ref.tensor.dtype;
  const std::size_t eb = element_bytes(dtype);
  collectives::AllToAllBlocks b;
  std::size_t send_at = 0, recv_at = 0;
  for (int q = 0; q < n; ++q) {
    const collectives::Split s(it.send_counts[q], k), t(it.recv_counts[q], k);
    b.send_begin.push_back(send_at + s.begin(p));
    b.send_size.push_back(s.size(p));
    b.recv_begin.push_back(recv_at + t.begin(p));
    b.recv_size.push_back(t.size(p));
    send_at += it.send_counts[q];
    recv_at += it.recv_counts[q];
  }
  if (it.plan.strategy == Strategy::kRaw) {
    const auto in = bytes_of(it.ref.tensor);
    for (int q = 0; q < n; ++q) {  // our own input's values (the peers scan theirs)
      const std::size_t bad =
          non_finite(in.subspan(b.send_begin[q] * eb, b.send_size[q] * eb), dtype);
      if (bad < b.send_size[q]) {
        ctx.failure.merge({Failure::kInputNotFinite, r, b.send_begin[q] + bad, {}});
      }
    }
    collectives::all_to_all_bytes(ctx, b, in, bytes_of(it.output), eb);
    return;
  }
  if (dtype == DType::kFloat32) {
    ctx.input = std::span<const float>(it.floats);
    collectives::all_to_all(ctx, b, it.output.floats());
    return;
  }
  // Half blocks: this partition's widened into the staging's input, the received ones decoded
  // into its output and rounded once. Non-finite input is found in the tensor's own values
  // first, so that the error names the tensor's element (the encoder then sends failures).
  collectives::AllToAllBlocks local = b;
  std::size_t sends = 0, recvs = 0;
  for (int q = 0; q < n; ++q) {
    local.send_begin[q] = sends;
    local.recv_begin[q] = recvs;
    sends += b.send_size[q];
    recvs += b.recv_size[q];
  }
  HalfStaging wide(buffers_, dtype, sends, recvs);
  const std::uint16_t* from = it.ref.tensor.half().data();
  for (int q = 0; q < n; ++q) {
    const std::size_t bad = wide.widen(from + b.send_begin[q],
                                       wide.input().subspan(local.send_begin[q], b.send_size[q]));
    if (bad < b.send_size[q]) {
      ctx.failure.merge({Failure::kInputNotFinite, r, b.send_begin[q] + bad, {}});
    }
  }
  ctx.input = wide.input();
  collectives::all_to_all(ctx, local, wide.output());
  if (ctx.failure.any()) return;
  std::uint16_t* to = it.output.half().data();
  for (int q = 0; q < n; ++q) {
    if (!wide.narrow(wide.output().subspan(local.recv_begin[q], b.recv_size[q]),
                     to + b.recv_begin[q])) {
      throw InvalidArgument(fmt::format("engine: {}: a decoded block from rank {} is not "
                                        "finite in {}",
                                        ctx.label(), q, to_string(dtype)));
    }
  }
}

// The fused raw message: the inputs of small raw tensors gathered into one buffer, reduced as
// one ring. The first partition's task gathers them; partitions only read their own range.
void PartitionTasks::run_fused(Task& task, PartitionContext& ctx) {
  Job& job = *task.job;
  {
    std::lock_guard lock(job.mu);
    if (!job.fused_gathered) {
      job.fused_gathered = true;
      auto dst = job.staging.as<float>(job.fused_elements);
      std::size_t at = 0;
      for (int i : job.fused) {
        const auto& src = job.items[i].floats;
        if (!src.empty()) std::memcpy(dst.data() + at, src.data(), src.size_bytes());
        at += src.size();
      }
    }
  }
  const collectives::Split split(job.fused_elements, task.partitions);
  std::span<float> out = job.staging.as<float>(job.fused_elements);  // reduced in place
  ctx.offset = split.begin(task.partition);
  ctx.input = split.piece(std::span<const float>(out), task.partition);
  ctx.output = split.piece(out, task.partition);
  ctx.divisor = comm_.size();  // only averaging tensors are fused
  raw_sum(ctx);
}

void PartitionTasks::run_strategy(Strategy strategy, PartitionContext& ctx) {
  switch (strategy) {
    case Strategy::kRaw: raw_sum(ctx); break;
    case Strategy::kAllgather: collectives::allgather_allreduce(ctx); break;
    case Strategy::kSharded: collectives::sharded_allreduce(ctx); break;
    case Strategy::kRing: collectives::ring_allreduce(ctx); break;
    case Strategy::kSummable: collectives::summable_allreduce(ctx); break;
    case Strategy::kAuto:
    case Strategy::kAllToAll: throw InvalidArgument("engine: not an allreduce strategy");
  }
}

// fp32 partitions: small ones gathered (one message step), others on the ring.
void PartitionTasks::raw_sum(PartitionContext& ctx) {
  if (collectives::gathers(ctx.input.size(), ctx.size(), options_.gather_bytes)) {
    collectives::raw_gather(ctx, ctx.input, ctx.output, 0, ctx.divisor);
  } else {
    collectives::raw_allreduce(ctx);
  }
}

// A raw partition's sum is checked for NaN and Inf by its own task, right after it is computed:
// on that task's worker, while the workers still have other partitions to run, and inside the
// time the planner measures. Scanned after the last task instead, a 256 MiB sum takes one core
// 25-65 ms that no measured span counts.
void PartitionTasks::note_raw_sum(Job& job, int item, const PartitionContext& ctx) {
  if (item < 0) return;  // the fused message: completion scans its items
  const std::size_t bad = kit::find_non_finite(ctx.output);
  if (bad == ctx.output.size()) return;
  std::lock_guard lock(job.mu);
  auto& first = job.items[static_cast<std::size_t>(item)].not_finite;
  first = std::min(first, ctx.offset + bad);
}

void PartitionTasks::note_span(Job& job, int item, std::int64_t begin) {
  if (job.spans.empty() || item < 0) return;
  const std::int64_t end = trace_now_ns();
  std::lock_guard lock(job.mu);
  auto& span = job.spans[item];
  span.first = std::min(span.first, begin);
  span.second = std::max(span.second, end);
}

void PartitionTasks::record_error(Job& job, std::exception_ptr e) {
  std::lock_guard lock(job.mu);
  if (!job.error) job.error = e;
}

}  // namespace terse::engine
