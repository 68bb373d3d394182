#include "engine/partition_task.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "engine/plans.h"
#include "kit/basic.h"
#include "kit/hash.h"
#include "terse/error.h"
#include "terse/trace.h"

namespace terse::engine {

using collectives::PartitionContext;

PartitionTasks::PartitionTasks(Communicator& comm, const EngineOptions& options,
                               BufferPool& buffers, std::atomic<std::uint64_t>& bytes_sent,
                               std::function<void(const std::shared_ptr<Job>&)> finish)
    : comm_(comm),
      options_(options),
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
  try {
    if (task.item < 0) {
      ctx.tensor = fmt::format("fused group of {} tensors", job.fused.size());
      run_fused(task, ctx);
    } else if (job.items[task.item].op != Op::kAllreduce) {
      run_collective(task, ctx);
    } else {
      const Item& it = job.items[task.item];
      const collectives::Split split(it.ref.typed.elements, task.partitions);
      ctx.tensor = it.ref.name;
      ctx.offset = split.begin(task.partition);
      const DType dtype = it.ref.typed.dtype;
      Buffer wide;  // a half tensor's partition in fp32: sums and decoded results
      if (dtype == DType::kFloat32) {
        ctx.input = split.piece(std::span<const float>(it.ref.data), task.partition);
        ctx.output = split.piece(result(job, task.item), task.partition);
      } else {
        const auto half =
            split.piece(std::span<const std::uint16_t>(it.ref.typed.half()), task.partition);
        wide = buffers_.acquire(half.size() * sizeof(float));
        ctx.output = wide.as<float>(half.size());
        ctx.input = ctx.output;
        if (it.rounds != nullptr) {
          // Round codecs read their input as fp32 arrays: widen it (exactly; NaN and Inf
          // included, which the codec then reports).
          kit::widen(dtype, half.data(), ctx.output, false);
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
      switch (it.plan.strategy) {
        case Strategy::kRaw:
          raw_sum(ctx);
          note_raw_sum(job, task.item, ctx);
          break;
        case Strategy::kAllgather: collectives::allgather_allreduce(ctx); break;
        case Strategy::kSharded: collectives::sharded_allreduce(ctx); break;
        case Strategy::kRing: collectives::ring_allreduce(ctx); break;
        case Strategy::kSummable: collectives::summable_allreduce(ctx); break;
        case Strategy::kAuto:
        case Strategy::kAllToAll: throw InvalidArgument("engine: not an allreduce strategy");
      }
      if (dtype != DType::kFloat32 && !ctx.failure.any()) {
        // Every rank rounds the same fp32 result the same way.
        auto out = split.piece(half_result(job, task.item), task.partition);
        if (!kit::narrow(dtype, ctx.output, out.data())) {
          throw InvalidArgument(fmt::format("engine: {}: decoded result is not finite",
                                            ctx.label()));
        }
      }
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

// A reduce_scatter's, all_gather's or all_to_all's partition: partition p of a shard (or of each
// block) is Split(shard, K)'s piece p, so that every rank's pieces line up.
void PartitionTasks::run_collective(Task& task, PartitionContext& ctx) {
  using collectives::Chunks;
  using collectives::Failure;
  const Job& job = *task.job;
  const Item& it = job.items[task.item];
  const int n = comm_.size(), r = comm_.rank();
  const int p = task.partition;
  const std::size_t k = static_cast<std::size_t>(task.partitions);
  const DType dtype = it.ref.typed.dtype;
  const std::size_t eb = element_bytes(dtype);
  const bool raw = it.plan.strategy == Strategy::kRaw;
  ctx.tensor = fmt::format("{} of {}", op_name(it.op), it.ref.name);
  ctx.divisor = it.ref.options.average ? n : 1;
  ctx.codec = it.codec;
  ctx.states = &it.record->partitions[p];
  ctx.encode.seed = options_.seed;
  ctx.encode.step = it.step;
  ctx.encode.tensor = kit::combine_keys(fnv1a64(it.ref.name), p);
  ctx.encode.rank = static_cast<std::uint64_t>(r);
  auto bytes_of = [](const TensorView& v) {
    return std::span<std::byte>(static_cast<std::byte*>(v.data), v.bytes());
  };
  // The first non-finite value of x (fp32 or half values of `dtype`), or x's size.
  auto non_finite = [&](std::span<const std::byte> x) {
    if (dtype == DType::kFloat32) {
      return kit::find_non_finite(std::span<const float>(
          reinterpret_cast<const float*>(x.data()), x.size() / sizeof(float)));
    }
    return kit::find_non_finite(std::span<const std::uint16_t>(
                                    reinterpret_cast<const std::uint16_t*>(x.data()),
                                    x.size() / 2),
                                dtype);
  };
  switch (it.op) {
    case Op::kReduceScatter: {
      const std::size_t shard = it.output.elements;
      const collectives::Split split(shard, k);
      if (dtype == DType::kFloat32) {
        ctx.input = std::span<const float>(it.ref.data);  // failures name input elements
        collectives::reduce_scatter(ctx, it.plan.strategy,
                                    Chunks::strided(shard, split.begin(p), split.size(p), n),
                                    split.piece(it.output.floats(), p));
        break;
      }
      // A half tensor: the partition's N pieces widened (exactly, NaN and Inf included) into
      // fp32 scratch, the shard reduced there and rounded once into the output.
      const std::size_t m = split.size(p);
      Buffer wide = buffers_.acquire(std::max<std::size_t>((n + 1) * m * sizeof(float), 1));
      std::span<float> pieces = wide.as<float>((n + 1) * m).first(n * m);
      std::span<float> sum = wide.as<float>((n + 1) * m).subspan(n * m, m);
      const auto half = std::span<const std::uint16_t>(it.ref.typed.half());
      for (int j = 0; j < n; ++j) {
        kit::widen(dtype, half.data() + j * shard + split.begin(p), pieces.subspan(j * m, m),
                   false);
      }
      ctx.input = pieces;
      std::uint16_t* to = it.output.half().data() + split.begin(p);
      auto round = [&] {
        if (ctx.failure.any() || kit::narrow(dtype, sum, to)) return;
        // A sum beyond the format's range; every rank learns it in the status round.
        const std::size_t bad = kit::find_non_finite(std::span<const std::uint16_t>(to, m), dtype);
        ctx.failure.merge({Failure::kSumNotFinite, r, r * m + bad, {}});
      };
      collectives::reduce_scatter(ctx, it.plan.strategy, Chunks::strided(m, 0, m, n), sum,
                                  round);
      if (m > 0 && (ctx.failure.kind == Failure::kInputNotFinite ||
                    ctx.failure.kind == Failure::kSumNotFinite)) {
        // Failure indices are the scratch's (piece j at j * m): every rank maps them back to the
        // tensor's the same way.
        const std::uint64_t at = ctx.failure.index;
        ctx.failure.index = at / m * shard + split.begin(p) + at % m;
      }
      break;
    }
    case Op::kAllGather: {
      const std::size_t shard = it.ref.typed.elements;
      const collectives::Split split(shard, k);
      const Chunks chunks = Chunks::strided(shard, split.begin(p), split.size(p), n);
      ctx.offset = split.begin(p);  // failures name shard elements
      if (raw) {
        const auto in = bytes_of(it.ref.typed).subspan(split.begin(p) * eb, split.size(p) * eb);
        const auto out = bytes_of(it.output);
        auto piece = [&](int j) { return out.subspan(chunks.begin(j) * eb, chunks.size(j) * eb); };
        collectives::all_gather_bytes(ctx, in, piece);
        // Every rank scans the same bytes: all fail or none.
        for (int j = 0; j < n; ++j) {
          const std::size_t bad = non_finite(piece(j));
          if (bad < chunks.size(j)) {
            ctx.failure.merge({Failure::kInputNotFinite, j, split.begin(p) + bad, {}});
          }
        }
      } else if (dtype == DType::kFloat32) {
        ctx.input = split.piece(std::span<const float>(it.ref.data), p);
        collectives::all_gather(ctx, chunks, it.output.floats());
      } else {
        // A half shard is encoded from its own values; every rank decodes into fp32 scratch and
        // rounds each value once.
        const std::size_t size = split.size(p);
        Buffer wide = buffers_.acquire(std::max<std::size_t>(size * n * sizeof(float), 1));
        std::span<float> decoded = wide.as<float>(size * n);
        ctx.input = decoded.first(size);  // its size only: the codec reads half_input
        ctx.half_input =
            split.piece(std::span<const std::uint16_t>(it.ref.typed.half()), p);
        ctx.dtype = dtype;
        const Chunks local = Chunks::strided(size, 0, size, n);
        collectives::all_gather(ctx, local, decoded);
        if (!ctx.failure.any()) {
          for (int j = 0; j < n; ++j) {
            std::uint16_t* to = it.output.half().data() + chunks.begin(j);
            if (!kit::narrow(dtype, local.piece(decoded, j), to)) {
              throw InvalidArgument(fmt::format("engine: {}: decoded result is not finite",
                                                ctx.label()));
            }
          }
        }
      }
      break;
    }
    case Op::kAllToAll: {
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
      if (raw) {
        const auto in = bytes_of(it.ref.typed);
        for (int q = 0; q < n; ++q) {  // our own input's values (the peers scan theirs)
          const std::size_t bad = non_finite(in.subspan(b.send_begin[q] * eb, b.send_size[q] * eb));
          if (bad < b.send_size[q]) {
            ctx.failure.merge({Failure::kInputNotFinite, r, b.send_begin[q] + bad, {}});
          }
        }
        collectives::all_to_all_bytes(ctx, b, in, bytes_of(it.output), eb);
      } else if (dtype == DType::kFloat32) {
        ctx.input = std::span<const float>(it.ref.data);
        collectives::all_to_all(ctx, b, it.output.floats());
      } else {
        // Half blocks: this partition's widened into fp32 scratch, the received ones decoded into
        // fp32 scratch and rounded once. Non-finite input is found in the tensor's own values
        // first, so that the error names the tensor's element (the encoder then sends failures).
        collectives::AllToAllBlocks local = b;
        std::size_t sends = 0, recvs = 0;
        for (int q = 0; q < n; ++q) {
          local.send_begin[q] = sends;
          local.recv_begin[q] = recvs;
          sends += b.send_size[q];
          recvs += b.recv_size[q];
        }
        Buffer wide = buffers_.acquire(std::max<std::size_t>((sends + recvs) * sizeof(float), 1));
        std::span<float> in = wide.as<float>(sends + recvs).first(sends);
        std::span<float> out = wide.as<float>(sends + recvs).subspan(sends, recvs);
        const std::uint16_t* from = it.ref.typed.half().data();
        for (int q = 0; q < n; ++q) {
          const auto block = in.subspan(local.send_begin[q], b.send_size[q]);
          if (!kit::widen(dtype, from + b.send_begin[q], block, false)) {
            const std::size_t bad = kit::find_non_finite(
                std::span<const std::uint16_t>(from + b.send_begin[q], b.send_size[q]), dtype);
            ctx.failure.merge({Failure::kInputNotFinite, r, b.send_begin[q] + bad, {}});
          }
        }
        ctx.input = in;
        collectives::all_to_all(ctx, local, out);
        if (!ctx.failure.any()) {
          std::uint16_t* to = it.output.half().data();
          for (int q = 0; q < n; ++q) {
            if (!kit::narrow(dtype, out.subspan(local.recv_begin[q], b.recv_size[q]),
                             to + b.recv_begin[q])) {
              throw InvalidArgument(fmt::format("engine: {}: a decoded block from rank {} is not "
                                                "finite in {}",
                                                ctx.label(), q, to_string(dtype)));
            }
          }
        }
      }
      break;
    }
    case Op::kAllreduce: break;
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
        const auto& src = job.items[i].ref.data;
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

// fp32 partitions: small ones gathered (one message step), others on the ring.
void PartitionTasks::raw_sum(PartitionContext& ctx) {
  if (collectives::gathers(ctx.input.size(), comm_.size(), options_.gather_bytes)) {
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
