// ring: compressed ring allreduce with decode-merge-re-encode at every hop. The partition is
// split into N chunks with the raw ring's schedule (raw.cpp): at reduce-scatter step s rank r
// sends chunk (r - s) mod N to r+1 and receives chunk (r - s - 1) mod N from r-1, decodes it, adds
// its own input and re-encodes the partial sum for the next hop. Rank r thus encodes each chunk
// c exactly once per step (state slot c): its own input for c = r, a partial sum at a middle
// hop, and the complete sum of the chunk it owns, c = r+1, which it divides when averaging and
// sends to every rank. Partial sums live in scratch memory (the output may be the input). Every
// rank, the owner included, decodes the owners' final payloads. Each rank sends 2(N-1)/N of the
// compressed partition; the error grows with the N-1 re-encodings of partial sums.
//
// As a reduce-scatter, the owner of chunk c (rank c - 1) sends its final payload to rank c
// alone, which decodes it: one message of 1/N instead of the allgather's N - 1.
#include <optional>
#include <vector>

#include "collectives/collective.h"
#include "kit/basic.h"

namespace terse::collectives {

namespace {

// scatter: the reduce-scatter into this rank's shard; else the allreduce into ctx.output.
void ring(PartitionContext& ctx, const Chunks& chunks, std::span<float> shard, bool scatter) {
  const int n = ctx.size(), r = ctx.rank();
  auto mod = [n](int v) { return ((v % n) + n) % n; };
  const std::size_t cap = message_capacity(*ctx.codec, chunks.max_size());
  // Areas: 0-1 outgoing (alternating by step), 2 incoming, 3 our final payload, 4 the final
  // payload of our own chunk (reduce-scatter).
  kit::Buffer areas = ctx.pool->acquire(cap * 5);
  auto area = [&](int k) { return areas.bytes().subspan(cap * k, cap); };
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const std::uint32_t final_index = static_cast<std::uint32_t>(n - 1);
  std::optional<FinalExchange> finals;
  Request final_rx;
  if (!scatter) {
    finals.emplace(ctx, cap, final_index);
  } else if (n > 1) {
    final_rx = post_recv(ctx, prev, final_index, area(4));
  }
  kit::Buffer scratch = ctx.pool->acquire(chunks.max_size() * sizeof(float));
  // Step 0 sends our own input's chunk r.
  std::span<const std::byte> outgoing =
      encode_or_fail(ctx, chunks.piece(ctx.input, r), chunks.begin(r), r, r, area(0));
  std::span<const std::byte> final_payload;
  for (int s = 0; s < n - 1; ++s) {
    const int c = mod(r - s - 1);
    Request rx = post_recv(ctx, prev, s, area(2));
    Request tx = post_send(ctx, next, s, outgoing);
    wait(ctx, rx, false, prev, cap);
    std::span<float> acc = scratch.as<float>(chunks.size(c));
    decode_or_record(ctx, received_message(ctx, area(2), prev), acc, DecodeMode::kOverwrite,
                     prev);
    if (!ctx.failure.any()) {
      Stage m(ctx, "merge", -1, acc.size_bytes());
      add_input(ctx, chunks.begin(c), acc, true);
    }
    const bool last = s == n - 2;
    if (last && !ctx.failure.any()) apply_divisor(ctx, acc);
    std::span<const std::byte> encoded =
        encode_or_fail(ctx, acc, chunks.begin(c), c, c, area(last ? 3 : (s + 1) % 2),
                       /*sum=*/true);
    wait(ctx, tx, true, next, outgoing.size());
    if (last) {
      final_payload = encoded;
    } else {
      outgoing = encoded;
    }
  }
  if (n == 1) {
    final_payload = outgoing;  // a single rank: its input chunk is the whole sum (divisor 1)
  }
  if (!scatter) {
    // Allgather of the owners' sums: owner j holds chunk j+1.
    finals->finish(final_payload, [&](int j) { return chunks.piece(ctx.output, mod(j + 1)); });
    return;
  }
  hand_to_owners(ctx, final_payload, final_rx, area(4), cap, final_index, shard);
}

}  // namespace

void ring_allreduce(PartitionContext& ctx) {
  ring(ctx, Chunks::even(ctx.input.size(), ctx.size()), {}, false);
}

void ring_reduce_scatter(PartitionContext& ctx, const Chunks& chunks, std::span<float> shard) {
  ring(ctx, chunks, shard, true);
}

}  // namespace terse::collectives
