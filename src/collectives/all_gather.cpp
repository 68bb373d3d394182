// all-gather: every rank's piece to every rank. Compressed, each owner encodes
// its piece once (state slot 0) and every rank, the owner included, decodes the
// same bytes the same way: every rank's output is bit-identical, with a lossy
// codec too. Raw, the bytes travel as they are. Each rank sends its piece N - 1
// times, straight to each peer (one message step).
//
// In two levels (hierarchical_all_gather), a piece crosses the network once per other host, to
// its carrier there (collective.h), and is handed on inside each host as it arrived: compressed
// payloads travel on unchanged, so every rank still decodes the owner's own bytes.
#include <cstring>
#include <utility>
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
  if (!ctx.direct_pids.empty()) {  // every rank reads the others' bytes itself
    direct_exchange(
        ctx, 0, ctx.offset, [&](int) { return mine; }, out,
        [&](int j) {
          std::span<std::byte> own = out(r);
          if (j == r && !mine.empty() && own.data() != mine.data()) {
            std::memcpy(own.data(), mine.data(), mine.size());
          }
        });
    return;
  }
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

namespace {

// Moves every rank's message to every rank in two levels: owner o's (`mine` on o) to its carrier
// on every other host (message 0), and each rank's own and those it carries to the other ranks of
// its host (message 1 + o). Owner o's arrives in area(o) (this rank's own stays in `mine`);
// message(o) is the received message as it is handed on; ready(o) runs once for every owner:
// for this rank once its own is on its way, for the others once theirs arrived and was handed
// on.
void relay(PartitionContext& ctx, const transport::Topology& t, std::span<const std::byte> mine,
           const std::function<std::span<std::byte>(int)>& area,
           const std::function<std::span<const std::byte>(int)>& message,
           const std::function<void(int)>& ready) {
  const int me = ctx.comm->rank(), h = t.host_of[me], n = t.size();
  const std::vector<int>& host = t.hosts[h];
  // Owner o's message comes from o itself where o is on this host or this rank carries it
  // (o's on another host), else from the rank of this host that carries it.
  auto carried_here = [&](int o) { return t.host_of[o] != h && carrier(t, h, o) == me; };
  auto sender = [&](int o) { return t.host_of[o] == h || carried_here(o) ? o : carrier(t, h, o); };
  std::vector<Request> rx(n);
  std::vector<int> carried;  // owners on other hosts whose messages this rank hands on
  for (int o = 0; o < n; ++o) {
    if (o == me) continue;
    if (carried_here(o)) carried.push_back(o);
    rx[o] = post_recv(ctx, sender(o), carried_here(o) ? 0 : 1 + o, area(o));
  }
  std::vector<std::pair<Request, std::pair<int, std::size_t>>> tx;
  auto send = [&](int to, std::uint32_t index, std::span<const std::byte> m) {
    tx.emplace_back(post_send(ctx, to, index, m), std::make_pair(to, m.size()));
  };
  for (std::size_t g = 0; g < t.hosts.size(); ++g) {
    if (static_cast<int>(g) != h) send(carrier(t, static_cast<int>(g), me), 0, mine);
  }
  for (int x : host) {
    if (x != me) send(x, 1 + me, mine);
  }
  ready(me);
  for (int o : carried) {
    wait(ctx, rx[o], false, o, area(o).size());
    const std::span<const std::byte> m = message(o);
    for (int x : host) {
      if (x != me) send(x, 1 + o, m);
    }
    ready(o);
  }
  for (int o = 0; o < n; ++o) {
    if (o == me || carried_here(o)) continue;
    wait(ctx, rx[o], false, sender(o), area(o).size());
    ready(o);
  }
  for (auto& [request, to] : tx) wait(ctx, request, true, to.first, to.second);
}

}  // namespace

void hierarchical_all_gather(PartitionContext& ctx, const transport::Topology& t,
                             const Chunks& chunks, std::span<float> output) {
  const int me = ctx.comm->rank();
  const std::size_t cap = message_capacity(*ctx.codec, chunks.max_size());
  kit::Buffer areas = ctx.pool->acquire(cap * static_cast<std::size_t>(t.size()));
  auto area = [&](int o) { return areas.bytes().subspan(cap * o, cap); };
  const std::span<const std::byte> mine = encode_or_fail(ctx, ctx.input, 0, 0, 0, area(me));
  relay(
      ctx, t, mine, area, [&](int o) { return received_message(ctx, area(o), o); },
      [&](int o) {
        const auto m = o == me ? mine : received_message(ctx, area(o), o);
        decode_or_record(ctx, m, chunks.piece(output, o), DecodeMode::kOverwrite, o);
      });
}

void hierarchical_all_gather_bytes(PartitionContext& ctx, const transport::Topology& t,
                                   std::span<const std::byte> mine,
                                   const std::function<std::span<std::byte>(int)>& out) {
  const std::span<std::byte> own = out(ctx.comm->rank());
  if (!mine.empty() && own.data() != mine.data()) std::memcpy(own.data(), mine.data(), mine.size());
  relay(
      ctx, t, mine, out, [&](int o) { return std::span<const std::byte>(out(o)); }, [](int) {});
}

}  // namespace terse::collectives
