// sharded: a co-located parameter server (CaSync-PS, BytePS). The partition is split into N
// shards and rank j owns shard j. Every rank encodes shard j (state slot j) and sends it to j;
// the owner sums, in rank order, the N contributions to its shard (its own as exact fp32, the
// others decoded), divides it when averaging, encodes it once (state slot N: server-side error
// feedback), and sends
// that final payload to every rank. Every rank, the owner included, decodes the final payloads,
// so all end with identical results. Each rank sends about 2(N-1)/N of the compressed
// partition, independent of N; the error is that of two encodes.
//
// Its first half is also a reduce-scatter: with the final encoding decoded by the owner alone
// (strategy sharded), or without it (strategy alltoall, ZeRO++'s qgZ: one quantization per
// contribution, the owner's own in fp32).
#include <algorithm>
#include <optional>
#include <vector>

#include "collectives/collective.h"
#include "kit/basic.h"

namespace terse::collectives {

namespace {

enum class End {
  kAllreduce,      // the final payload to every rank, decoded by all into ctx.output
  kReduceScatter,  // the final payload decoded by its owner alone into `shard`
  kSum,            // no final encoding: the owner's sum is its shard
};

void sharded(PartitionContext& ctx, const Chunks& chunks, std::span<float> shard, End end) {
  const int n = ctx.size(), r = ctx.rank();
  const std::size_t cap = message_capacity(*ctx.codec, chunks.max_size());
  // Areas: [0, n) outgoing (our payload for owner j at j, our final payload at r),
  // [n, 2n) contributions to our shard from rank i. Final payloads use message index 1.
  kit::Buffer areas = ctx.pool->acquire(cap * 2 * n);
  auto area = [&](int k) { return areas.bytes().subspan(cap * k, cap); };
  std::vector<Request> push_rx(n), push_tx(n);
  std::vector<std::span<const std::byte>> sent(n);

  for (int i = 0; i < n; ++i) {
    if (i != r) push_rx[i] = post_recv(ctx, i, 0, area(n + i));
  }
  std::optional<FinalExchange> finals;
  if (end == End::kAllreduce) finals.emplace(ctx, cap, 1);
  for (int k = 1; k < n; ++k) {  // owners r+1, r+2, ...: every rank starts on another owner
    const int j = (r + k) % n;
    sent[j] = encode_or_fail(ctx, chunks.piece(ctx.input, j), chunks.begin(j), j, j, area(j));
    push_tx[j] = post_send(ctx, j, 0, sent[j]);
  }

  // Our shard: the sum of all contributions in rank order, in scratch memory (the output may be
  // our input, whose shard r is one of the terms).
  kit::Buffer scratch = ctx.pool->acquire(chunks.size(r) * sizeof(float));
  std::span<float> acc = scratch.as<float>(chunks.size(r));
  for (int i = 0; i < n; ++i) {
    const DecodeMode mode = i == 0 ? DecodeMode::kOverwrite : DecodeMode::kAccumulate;
    if (i != r) {
      wait(ctx, push_rx[i], false, i, cap);
      decode_or_record(ctx, received_message(ctx, area(n + i), i), acc, mode, i);
      continue;
    }
    Stage m(ctx, "merge", -1, acc.size_bytes());
    add_input(ctx, chunks.begin(r), acc, mode == DecodeMode::kAccumulate);
  }
  if (!ctx.failure.any()) apply_divisor(ctx, acc);
  if (end == End::kSum) {
    if (!ctx.failure.any()) std::copy(acc.begin(), acc.end(), shard.begin());
  } else {
    std::span<const std::byte> final_payload =
        encode_or_fail(ctx, acc, chunks.begin(r), r, n, area(r), /*sum=*/true);
    if (end == End::kAllreduce) {
      finals->finish(final_payload, [&](int j) { return chunks.piece(ctx.output, j); });
    } else {
      decode_or_record(ctx, final_payload, shard, DecodeMode::kOverwrite, r);
    }
  }
  for (int j = 0; j < n; ++j) {
    if (j != r) wait(ctx, push_tx[j], true, j, sent[j].size());
  }
}

}  // namespace

void sharded_allreduce(PartitionContext& ctx) {
  sharded(ctx, Chunks::even(ctx.input.size(), ctx.size()), {}, End::kAllreduce);
}

void sharded_reduce_scatter(PartitionContext& ctx, const Chunks& chunks, std::span<float> shard,
                            bool final_encode) {
  sharded(ctx, chunks, shard, final_encode ? End::kReduceScatter : End::kSum);
}

}  // namespace terse::collectives
