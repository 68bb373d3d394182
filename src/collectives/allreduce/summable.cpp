// summable: ring allreduce on compressed data, for codecs whose encodings add (fp16, bf16,
// random-k with a shared seed): Codec::combine merges two payloads without a full decode and
// re-encode. The schedule is the raw ring's (raw.cpp): at reduce-scatter step s rank r receives
// the partial payload of chunk c = (r - s - 1) mod N, combines its own encoding of c (state slot
// c) into it and passes it on; the owner of chunk r+1 ends with the complete payload and sends it
// to every rank, and every rank, the owner included, decodes it (and divides when averaging: the
// compressed sum cannot be scaled without decoding). Each rank sends 2(N-1)/N of the
// compressed partition.
//
// Multi-round codecs (PowerSGD) run their rounds' sums on rings (rounds.cpp).
//
// As a reduce-scatter, the owner of chunk c's complete payload (rank c - 1) sends it to rank c
// alone, which decodes it.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "collectives/collective.h"
#include "kit/basic.h"

namespace terse::collectives {

namespace {

// scatter: the reduce-scatter into `shard`; else the allreduce into output.
void summable(PartitionContext& ctx, const Chunks& split, std::span<const float> input,
              std::span<float> output, std::span<float> shard, bool scatter,
              std::uint32_t first_index) {
  const int n = ctx.size(), r = ctx.rank();
  auto mod = [n](int v) { return ((v % n) + n) % n; };
  const std::size_t cap = message_capacity(*ctx.codec, split.max_size());
  // Areas: 0-1 incoming partial payloads (alternating: the one received at step s is sent on at
  // step s+1), 2 our own encoding of the current chunk.
  kit::Buffer areas = ctx.pool->acquire(cap * 4);
  auto area = [&](int k) { return areas.bytes().subspan(cap * k, cap); };
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const std::uint32_t final_index = first_index + static_cast<std::uint32_t>(n - 1);
  std::optional<FinalExchange> finals;
  Request final_rx;
  if (!scatter) {
    finals.emplace(ctx, cap, final_index);
  } else if (n > 1) {
    final_rx = post_recv(ctx, prev, final_index, area(3));  // our own chunk's complete payload
  }
  std::span<const std::byte> outgoing =
      encode_or_fail(ctx, split.piece(input, r), split.begin(r), r, r, area(2));
  for (int s = 0; s < n - 1; ++s) {
    const int c = mod(r - s - 1);
    std::span<std::byte> in_area = area(s % 2);
    Request rx = post_recv(ctx, prev, first_index + s, in_area);
    Request tx = post_send(ctx, next, first_index + s, outgoing);
    wait(ctx, rx, false, prev, cap);
    wait(ctx, tx, true, next, outgoing.size());  // frees area 2 (step 0) or the other area
    std::span<const std::byte> partial = received_message(ctx, in_area, prev);
    const bool ok = accept_message(ctx, partial, prev);
    std::span<const std::byte> own =
        encode_or_fail(ctx, split.piece(input, c), split.begin(c), c, c, area(2));
    if (ok && !ctx.failure.any()) {
      Stage m(ctx, "merge", prev, split.size(c) * 4);
      try {
        // partial is the received bytes in our own area: combine in place.
        ctx.codec->combine(own, in_area.first(partial.size()));
      } catch (const Error& e) {
        Failure f{Failure::kBadPayload, ctx.comm->rank(), ctx.offset + split.begin(c), {}};
        f.detail = fmt::format("rank {}: {}: payload from peer {} cannot be combined: {}",
                               ctx.comm->rank(), ctx.label(), ctx.comm_rank(prev), e.what());
        ctx.failure.merge(f);
      }
    }
    outgoing = ctx.failure.any() ? failure_message(ctx, in_area) : partial;
  }
  // outgoing now holds the complete payload of our chunk r+1 (or our own chunk when n == 1).
  if (!scatter) {
    finals->finish(outgoing, [&](int j) { return split.piece(output, mod(j + 1)); });
    return;
  }
  hand_to_owners(ctx, outgoing, final_rx, area(3), cap, final_index, shard);
}

}  // namespace

void summable_ring(PartitionContext& ctx, std::span<const float> input, std::span<float> output,
                   std::uint32_t first_index) {
  summable(ctx, Chunks::even(input.size(), ctx.size()), input, output, {}, false, first_index);
}

void summable_reduce_scatter(PartitionContext& ctx, const Chunks& chunks,
                             std::span<float> shard) {
  summable(ctx, chunks, ctx.input, {}, shard, true, 0);
}

void summable_allreduce(PartitionContext& ctx) {
  if (ctx.rounds != nullptr) {
    rounds_allreduce(ctx, /*gather=*/false);
    return;
  }
  summable_ring(ctx, ctx.input, ctx.output, 0);
  if (!ctx.failure.any()) apply_divisor(ctx, ctx.output);
}

}  // namespace terse::collectives
