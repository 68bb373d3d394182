// all-gather: every rank's piece to every rank. Compressed, each owner encodes
// its piece once (state slot 0) and every rank, the owner included, decodes the
// same bytes the same way: every rank's output is bit-identical, with a lossy
// codec too. Raw, the bytes travel as they are. Each rank sends its piece N - 1
// times, straight to each peer (one message step).
#include <cstring>
#include <vector>

#include "collectives/collective.h"

namespace terse::collectives {

void all_gather(PartitionContext &ctx, const Chunks &chunks, std::span<float> output) {
  const std::size_t cap = message_capacity(*ctx.codec, chunks.max_size());
  FinalExchange exchange(ctx, cap, 0);
  kit::Buffer mine = ctx.pool->acquire(cap);
  std::span<const std::byte> payload = encode_or_fail(ctx, ctx.input, 0, 0, 0, mine.bytes());
  exchange.finish(payload, [&](int j) { return chunks.piece(output, j); });
}

void all_gather_bytes(PartitionContext &ctx, std::span<const std::byte> mine,
                      const std::function<std::span<std::byte>(int)> &out) {
  const int n = ctx.size(), r = ctx.rank();
  std::vector<Request> rx(n), tx(n);
  for (int j = 0; j < n; ++j) {
    if (j != r) rx[j] = post_recv(ctx, j, 0, out(j));
  }
  for (int k = 1; k < n; ++k) {
    const int j = (r + k) % n;
    tx[j] = post_send(ctx, j, 0, mine);
  }
  std::span<std::byte> own = out(r);
  if (!mine.empty() && own.data() != mine.data()) std::memcpy(own.data(), mine.data(), mine.size());
  for (int j = 0; j < n; ++j) {
    if (j != r) wait(ctx, rx[j], false, j, out(j).size());
  }
  for (int j = 0; j < n; ++j) {
    if (j != r) wait(ctx, tx[j], true, j, mine.size());
  }
}

}  // namespace terse::collectives
