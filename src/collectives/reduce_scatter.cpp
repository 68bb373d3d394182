// reduce-scatter: rank j ends with the sum over ranks of chunk j (its shard),
// divided when averaging. The compressed strategies are the reduce-scatter
// halves of the allreduce ones (allreduce/: sharded.cpp, ring.cpp, summable.cpp); raw sends
// each fp32 chunk once, straight to its owner, which sums the N of them in rank
// order, ((x_0 + x_1) + x_2) + ..., as the raw gather does: one message step,
// (N-1)/N of the partition sent per rank, the same result as the exact-order
// sum. A failure (NaN input, a bad payload) reaches only the ranks on its
// chunk's path, so every partition ends with the status round that tells every
// rank.
#include <fmt/format.h>

#include <vector>

#include "collectives/collective.h"
#include "kit/basic.h"

namespace terse::collectives {

void raw_reduce_scatter(PartitionContext& ctx, const Chunks& chunks, std::span<float> shard) {
  const int n = ctx.size(), r = ctx.rank();
  const std::size_t m = chunks.size(r);
  kit::Buffer inbox = ctx.pool->acquire(std::max<std::size_t>(m * n * sizeof(float), 1));
  auto area = [&](int i) { return inbox.as<float>(m * n).subspan(m * i, m); };
  std::vector<Request> rx(n), tx(n);
  for (int i = 0; i < n; ++i) {
    if (i != r) rx[i] = post_recv(ctx, i, 0, std::as_writable_bytes(area(i)));
  }
  for (int k = 1; k < n; ++k) {  // start with the next rank, so senders spread over receivers
    const int j = (r + k) % n;
    tx[j] = post_send(ctx, j, 0, std::as_bytes(chunks.piece(ctx.input, j)));
  }
  // The sum goes to scratch first: the shard may alias our own input.
  kit::Buffer scratch = ctx.pool->acquire(std::max<std::size_t>(m * sizeof(float), 1));
  std::span<float> acc = scratch.as<float>(m);
  for (int i = 0; i < n; ++i) {
    std::span<const float> term = i == r ? chunks.piece(ctx.input, r) : area(i);
    if (i != r) wait(ctx, rx[i], false, i, m * sizeof(float));
    Stage s(ctx, "merge", i, m * sizeof(float));
    if (!kit::store_or_add(term.data(), acc, i != 0) && !ctx.failure.any()) {
      ctx.failure.merge(
          {Failure::kInputNotFinite, ctx.comm_rank(i), ctx.offset + chunks.begin(r) + kit::find_non_finite(term), {}});
    }
  }
  if (!ctx.failure.any()) {
    apply_divisor(ctx, acc);
    std::copy(acc.begin(), acc.end(), shard.begin());
  }
  for (int j = 0; j < n; ++j) {
    if (j != r) wait(ctx, tx[j], true, j, chunks.size(j) * sizeof(float));
  }
}

void reduce_scatter(PartitionContext& ctx, Strategy strategy, const Chunks& chunks,
                    std::span<float> shard, const std::function<void()>& finish) {
  switch (strategy) {
    case Strategy::kRaw:
      raw_reduce_scatter(ctx, chunks, shard);
      break;
    case Strategy::kAllToAll:
      sharded_reduce_scatter(ctx, chunks, shard, false);
      break;
    case Strategy::kSharded:
      sharded_reduce_scatter(ctx, chunks, shard, true);
      break;
    case Strategy::kRing:
      ring_reduce_scatter(ctx, chunks, shard);
      break;
    case Strategy::kSummable:
      summable_reduce_scatter(ctx, chunks, shard);
      if (!ctx.failure.any()) apply_divisor(ctx, shard);
      break;
    default:
      throw InvalidArgument(
          fmt::format("reduce_scatter: strategy {} has no reduce-scatter", to_string(strategy)));
  }
  if (finish) finish();
  agree_on_failure(ctx, kStatusIndex);
}

}  // namespace terse::collectives
