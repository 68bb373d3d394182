// raw: bandwidth-optimal fp32 ring allreduce, the uncompressed baseline.
//
// The partition is split into N chunks. Reduce-scatter: at step s (0 .. N-2) rank r sends chunk
// (r - s) mod N to r+1 and receives chunk (r - s - 1) mod N from r-1, adding its own input to it.
// Chunk c thus starts at rank c and is summed in ring order, ((x_c + x_c+1) + x_c+2) + ...,
// ending complete at rank c-1, its owner, which divides it when averaging. Allgather: N-1 more
// steps pass the owners' results on unchanged. Each rank sends and receives 2(N-1)/N of the partition; results are bit-identical
// because every chunk's sum is computed once.
#include <cstring>

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

  engine::Buffer inbox = ctx.pool->acquire(split.max_size() * sizeof(float));
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

void raw_allreduce(PartitionContext& ctx) {
  raw_ring(ctx, ctx.input, ctx.output, 0, ctx.divisor);
}

}  // namespace terse::collectives
