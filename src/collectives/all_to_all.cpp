// all-to-all: block q of every rank's input goes to rank q. Each rank first
// tells each peer the size of the block it sends (message 0), so that a
// receiver whose counts disagree drains a block of the announced size and
// reports the mismatch instead of misreading it. Then the blocks travel
// (message 1): raw as they are, or encoded once by their sender (state slot q,
// piece q) and decoded once by their receiver; a rank's own block is copied
// exactly. A status round ends the partition (a failure reaches only the
// block's receiver).
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "collectives/collective.h"
#include "kit/basic.h"

namespace terse::collectives {

namespace {

// Message 0: block sizes. Returns what each peer announced (our own for
// ourselves).
std::vector<std::uint64_t> exchange_sizes(PartitionContext &ctx, const AllToAllBlocks &b) {
  const int n = ctx.size(), r = ctx.rank();
  std::vector<std::uint64_t> mine(b.send_size.begin(), b.send_size.end());
  std::vector<std::uint64_t> theirs(n);
  theirs[r] = mine[r];
  std::vector<Request> rx(n), tx(n);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    rx[q] = post_recv(ctx, q, 0, std::as_writable_bytes(std::span(&theirs[q], 1)));
    tx[q] = post_send(ctx, q, 0, std::as_bytes(std::span(&mine[q], 1)));
  }
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    wait(ctx, rx[q], false, q, 8);
    wait(ctx, tx[q], true, q, 8);
    if (theirs[q] != b.recv_size[q]) {
      Failure f{Failure::kCountMismatch, r, static_cast<std::uint64_t>(q), {}};
      f.detail = fmt::format(
          "rank {}: {}: rank {} expected a block of {} elements from rank {}, "
          "which sends {}: "
          "rank q's send_counts[r] must equal rank r's recv_counts[q]",
          r, ctx.label(), r, b.recv_size[q], q, theirs[q]);
      ctx.failure.merge(f);
    }
  }
  return theirs;
}

}  // namespace

void all_to_all(PartitionContext &ctx, const AllToAllBlocks &b, std::span<float> output) {
  const int n = ctx.size(), r = ctx.rank();
  const std::vector<std::uint64_t> announced = exchange_sizes(ctx, b);
  std::vector<std::size_t> cap(n), send_cap(n), at(n + 1, 0), send_at(n + 1, 0);
  for (int q = 0; q < n; ++q) {
    cap[q] = q == r ? 0 : message_capacity(*ctx.codec, announced[q]);
    send_cap[q] = q == r ? 0 : message_capacity(*ctx.codec, b.send_size[q]);
    at[q + 1] = at[q] + cap[q];
    send_at[q + 1] = send_at[q] + send_cap[q];
  }
  kit::Buffer in = ctx.pool->acquire(std::max<std::size_t>(at[n], 1));
  kit::Buffer out = ctx.pool->acquire(std::max<std::size_t>(send_at[n], 1));
  auto in_area = [&](int q) { return in.bytes().subspan(at[q], cap[q]); };
  std::vector<Request> rx(n), tx(n);
  std::vector<std::size_t> sent(n);
  for (int q = 0; q < n; ++q) {
    if (q != r) rx[q] = post_recv(ctx, q, 1, in_area(q));
  }
  for (int k = 1; k < n; ++k) {
    const int q = (r + k) % n;
    auto payload =
        encode_or_fail(ctx, ctx.input.subspan(b.send_begin[q], b.send_size[q]), b.send_begin[q], q,
                       q, out.bytes().subspan(send_at[q], send_cap[q]));
    sent[q] = payload.size();
    tx[q] = post_send(ctx, q, 1, payload);
  }
  if (b.send_size[r] == b.recv_size[r] && b.send_size[r] > 0) {
    Stage s(ctx, "merge", -1, b.send_size[r] * 4);
    add_input(ctx, b.send_begin[r], output.subspan(b.recv_begin[r], b.recv_size[r]), false);
  }
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    wait(ctx, rx[q], false, q, cap[q]);
    if (announced[q] != b.recv_size[q]) continue;  // drained; the mismatch is recorded
    decode_or_record(ctx, received_message(ctx, in_area(q), q),
                     output.subspan(b.recv_begin[q], b.recv_size[q]), DecodeMode::kOverwrite, q);
  }
  for (int q = 0; q < n; ++q) {
    if (q != r) wait(ctx, tx[q], true, q, sent[q]);
  }
  agree_on_failure(ctx, kStatusIndex);
}

void all_to_all_bytes(PartitionContext &ctx, const AllToAllBlocks &b,
                      std::span<const std::byte> input, std::span<std::byte> output,
                      std::size_t element_bytes) {
  const int n = ctx.size(), r = ctx.rank();
  const std::vector<std::uint64_t> announced = exchange_sizes(ctx, b);
  // Blocks of a size we do not expect are drained into scratch.
  std::size_t drain = 0;
  for (int q = 0; q < n; ++q) {
    if (q != r && announced[q] != b.recv_size[q])
      drain = std::max<std::size_t>(drain, announced[q]);
  }
  kit::Buffer scratch = ctx.pool->acquire(std::max<std::size_t>(drain * element_bytes, 1));
  std::vector<Request> rx(n), tx(n);
  auto block = [&](auto s, std::size_t begin, std::size_t size) {
    return s.subspan(begin * element_bytes, size * element_bytes);
  };
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    std::span<std::byte> area = announced[q] == b.recv_size[q]
                                    ? block(output, b.recv_begin[q], b.recv_size[q])
                                    : scratch.bytes().first(announced[q] * element_bytes);
    rx[q] = post_recv(ctx, q, 1, area);
  }
  for (int k = 1; k < n; ++k) {
    const int q = (r + k) % n;
    tx[q] = post_send(ctx, q, 1, block(input, b.send_begin[q], b.send_size[q]));
  }
  if (b.send_size[r] == b.recv_size[r] && b.send_size[r] > 0) {
    std::memcpy(block(output, b.recv_begin[r], b.recv_size[r]).data(),
                block(input, b.send_begin[r], b.send_size[r]).data(),
                b.send_size[r] * element_bytes);
  }
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    wait(ctx, rx[q], false, q, announced[q] * element_bytes);
    wait(ctx, tx[q], true, q, b.send_size[q] * element_bytes);
  }
  agree_on_failure(ctx, kStatusIndex);
}

}  // namespace terse::collectives
