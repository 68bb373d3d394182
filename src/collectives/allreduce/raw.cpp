// raw: bandwidth-optimal fp32 ring allreduce, the uncompressed baseline.
//
// The partition is split into N chunks. Reduce-scatter: at step s (0 .. N-2) rank r sends chunk
// (r - s) mod N to r+1 and receives chunk (r - s - 1) mod N from r-1, adding its own input to it.
// Chunk c thus starts at rank c and is summed in ring order, ((x_c + x_c+1) + x_c+2) + ...,
// ending complete at rank c-1, its owner, which divides it when averaging. Allgather: N-1 more
// steps pass the owners' results on unchanged. Each rank sends and receives 2(N-1)/N of the partition; results are bit-identical
// because every chunk's sum is computed once.
//
// Small messages, where a ring's 2(N-1) message steps cost more than its bytes, are gathered
// instead (raw_gather; the engine decides, EngineOptions::gather_bytes): every rank sends its
// whole fp32 partition to every other rank and every rank sums the N of them in rank order,
// ((x_0 + x_1) + x_2) + ..., then divides: one message step, the same operations on the same
// values everywhere, (N-1) partitions sent per rank.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collective.h"
#include "kit/basic.h"

namespace terse::collectives {

void raw_ring(PartitionContext& ctx, std::span<const float> input, std::span<float> output,
              std::uint32_t first_index, int divisor) {
  const int n = ctx.size(), r = ctx.rank();
  if (n == 1) {
    if (!input.empty() && input.data() != output.data()) {
      std::memcpy(output.data(), input.data(), input.size_bytes());
    }
    return;
  }
  const Split split(input.size(), n);
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto chunk = [&](auto s, int c) { return split.piece(s, static_cast<std::size_t>(c)); };
  auto mod = [n](int v) { return ((v % n) + n) % n; };

  kit::Buffer inbox = ctx.pool->acquire(split.max_size() * sizeof(float));
  for (int s = 0; s < n - 1; ++s) {
    const int send_c = mod(r - s), recv_c = mod(r - s - 1);
    std::span<const float> out = s == 0 ? chunk(input, send_c)
                                        : std::span<const float>(chunk(output, send_c));
    std::span<float> in = inbox.as<float>(split.size(recv_c));
    Request rx = post_recv(ctx, prev, first_index + s, std::as_writable_bytes(in));
    Request tx = post_send(ctx, next, first_index + s, std::as_bytes(out));
    wait(ctx, rx, false, prev, in.size_bytes());
    {
      Stage m(ctx, "merge", prev, in.size_bytes());
      kit::add_to(chunk(input, recv_c), in, chunk(output, recv_c));
    }
    wait(ctx, tx, true, next, out.size_bytes());
  }
  if (divisor > 1) {
    Stage m(ctx, "merge", -1, split.size(mod(r + 1)) * sizeof(float));
    std::span<float> mine = chunk(output, mod(r + 1));
    kit::divide_to(mine, static_cast<float>(divisor), mine);
  }
  for (int s = 0; s < n - 1; ++s) {
    const int send_c = mod(r + 1 - s), recv_c = mod(r - s);
    std::span<float> in = chunk(output, recv_c);
    Request rx = post_recv(ctx, prev, first_index + n - 1 + s, std::as_writable_bytes(in));
    Request tx = post_send(ctx, next, first_index + n - 1 + s,
                           std::as_bytes(std::span<const float>(chunk(output, send_c))));
    wait(ctx, rx, false, prev, in.size_bytes());
    wait(ctx, tx, true, next, split.size(send_c) * sizeof(float));
  }
}

void raw_gather(PartitionContext& ctx, std::span<const float> input, std::span<float> output,
                std::uint32_t index, int divisor) {
  const int n = ctx.size(), r = ctx.rank();
  const std::size_t bytes = input.size_bytes();
  kit::Buffer all = ctx.pool->acquire(std::max<std::size_t>(bytes * n, 1));
  auto area = [&](int i) { return all.bytes().subspan(bytes * i, bytes); };
  std::vector<Request> rx(n), tx(n);
  for (int i = 0; i < n; ++i) {
    if (i != r) rx[i] = post_recv(ctx, i, index, area(i));
  }
  // Our own input is kept: output may alias it.
  if (bytes > 0) std::memcpy(area(r).data(), input.data(), bytes);
  for (int k = 1; k < n; ++k) {  // start with the next rank, so senders spread over receivers
    const int i = (r + k) % n;
    tx[i] = post_send(ctx, i, index, area(r));
  }
  auto values = [&](int i) { return all.as<float>(input.size() * n).subspan(input.size() * i,
                                                                            input.size()); };
  for (int i = 0; i < n; ++i) {
    if (i != r) wait(ctx, rx[i], false, i, bytes);
    if (i == 0) {
      std::span<const float> first = values(0);
      std::copy(first.begin(), first.end(), output.begin());
    } else {
      Stage m(ctx, "merge", i, bytes);
      kit::add_to(values(i), output, output);
    }
  }
  if (divisor > 1) {
    Stage m(ctx, "merge", -1, bytes);
    kit::divide_to(output, static_cast<float>(divisor), output);
  }
  for (int i = 0; i < n; ++i) {
    if (i != r) wait(ctx, tx[i], true, i, bytes);
  }
}

void raw_allreduce(PartitionContext& ctx) {
  raw_ring(ctx, ctx.input, ctx.output, 0, ctx.divisor);
}

}  // namespace terse::collectives
