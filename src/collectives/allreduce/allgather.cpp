// allgather: every rank encodes its whole partition once (state slot 0) and sends the payload to
// every other rank; every rank decodes the N payloads, its own included, and sums them in rank
// order (y = d_0, y += d_1, ...), then divides when averaging (the same operations on the same
// bytes on every rank). Each rank sends (N-1) payloads, so traffic grows with N: the
// strategy suits small N and very sparse codecs, and needs no re-encoding (error is that of one
// encode). Works with every codec. Multi-round codecs (PowerSGD) gather each round's
// contribution the same way (rounds.cpp): one message step a round instead of a ring's.
#include <vector>

#include "collectives/collective.h"

namespace terse::collectives {

void gather_sum(PartitionContext& ctx, std::span<const float> input, std::span<float> output,
                std::uint32_t index) {
  const int n = ctx.size(), r = ctx.rank();
  const std::size_t cap = message_capacity(*ctx.codec, input.size());
  kit::Buffer mine = ctx.pool->acquire(cap);
  kit::Buffer theirs = ctx.pool->acquire(cap * n);
  auto area = [&](int i) { return theirs.bytes().subspan(cap * i, cap); };

  std::vector<Request> rx(n), tx(n);
  for (int i = 0; i < n; ++i) {
    if (i != r) rx[i] = post_recv(ctx, i, index, area(i));
  }
  std::span<const std::byte> payload = encode_or_fail(ctx, input, 0, 0, 0, mine.bytes());
  for (int k = 1; k < n; ++k) {  // start with the next rank, so senders spread over receivers
    const int i = (r + k) % n;
    tx[i] = post_send(ctx, i, index, payload);
  }
  for (int i = 0; i < n; ++i) {
    std::span<const std::byte> message = payload;
    if (i != r) {
      wait(ctx, rx[i], false, i, cap);
      message = received_message(ctx, area(i), i);
    }
    decode_or_record(ctx, message, output, i == 0 ? DecodeMode::kOverwrite
                                                  : DecodeMode::kAccumulate, i);
  }
  for (int i = 0; i < n; ++i) {
    if (i != r) wait(ctx, tx[i], true, i, payload.size());
  }
}

void allgather_allreduce(PartitionContext& ctx) {
  if (ctx.rounds != nullptr) {
    rounds_allreduce(ctx, /*gather=*/true);
    return;
  }
  gather_sum(ctx, ctx.input, ctx.output, 0);
  apply_divisor(ctx, ctx.output);
}

}  // namespace terse::collectives
