// reduce-scatter: rank j ends with the sum over ranks of chunk j (its shard),
// divided when averaging. The compressed strategies are the reduce-scatter
// halves of the allreduce ones (allreduce/: sharded.cpp, ring.cpp, summable.cpp); raw sends
// each fp32 chunk once, straight to its owner, which sums the N of them in rank
// order, ((x_0 + x_1) + x_2) + ..., as the raw gather does: one message step,
// (N-1)/N of the partition sent per rank, the same result as the exact-order
// sum. A failure (NaN input, a bad payload) reaches only the ranks on its
// chunk's path, so every partition ends with the status round that tells every
// rank.
//
// In two levels (hierarchical_reduce_scatter), every rank first sums, exactly and inside its
// host, the host's contributions to the shards it carries across (collective.h, carrier), so
// that a host's link carries each of its host sums once instead of each rank's contribution.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "collectives/collective.h"
#include "kit/basic.h"
#include "kit/hash.h"

namespace terse::collectives {

namespace {

// Finite terms whose sum is not: recorded as an overflow at this rank (a sum of finite inputs
// at `at` of the input; the status round tells every rank).
void note_overflow(PartitionContext& ctx, std::span<const float> sum, std::size_t at) {
  if (ctx.failure.any()) return;
  const std::size_t bad = kit::find_non_finite(sum);
  if (bad < sum.size()) {
    ctx.failure.merge({Failure::kSumNotFinite, ctx.comm->rank(), ctx.element(at + bad), {}});
  }
}

}  // namespace

void raw_reduce_scatter(PartitionContext& ctx, const Chunks& chunks, std::span<float> shard) {
  const int n = ctx.size(), r = ctx.rank();
  const std::size_t m = chunks.size(r);
  kit::Buffer inbox = ctx.pool->acquire(std::max<std::size_t>(m * n * sizeof(float), 1));
  auto area = [&](int i) { return inbox.as<float>(m * n).subspan(m * i, m); };
  // The sum goes to scratch first: the shard may alias our own input.
  kit::Buffer scratch = ctx.pool->acquire(std::max<std::size_t>(m * sizeof(float), 1));
  std::span<float> acc = scratch.as<float>(m);
  auto add = [&](int i) {
    std::span<const float> term = i == r ? chunks.piece(ctx.input, r) : area(i);
    Stage s(ctx, "merge", i, m * sizeof(float));
    if (!kit::store_or_add(term.data(), acc, i != 0) && !ctx.failure.any()) {
      ctx.failure.merge({Failure::kInputNotFinite, ctx.comm_rank(i),
                         ctx.element(chunks.begin(r) + kit::find_non_finite(term)), {}});
    }
  };
  if (!ctx.direct_pids.empty()) {  // each owner reads its chunk of every input itself
    direct_exchange(
        ctx, 0, ctx.element(chunks.begin(r)),
        [&](int j) { return std::as_bytes(chunks.piece(ctx.input, j)); },
        [&](int i) { return std::as_writable_bytes(area(i)); }, add);
  } else {
    std::vector<Request> rx(n), tx(n);
    for (int i = 0; i < n; ++i) {
      if (i != r) rx[i] = post_recv(ctx, i, 0, std::as_writable_bytes(area(i)));
    }
    for (int k = 1; k < n; ++k) {  // start with the next rank, so senders spread over receivers
      const int j = (r + k) % n;
      tx[j] = post_send(ctx, j, 0, std::as_bytes(chunks.piece(ctx.input, j)));
    }
    for (int i = 0; i < n; ++i) {
      if (i != r) wait(ctx, rx[i], false, i, m * sizeof(float));
      add(i);
    }
    for (int j = 0; j < n; ++j) {
      if (j != r) wait(ctx, tx[j], true, j, chunks.size(j) * sizeof(float));
    }
  }
  note_overflow(ctx, acc, chunks.begin(r));
  if (!ctx.failure.any()) {
    apply_divisor(ctx, acc);
    std::copy(acc.begin(), acc.end(), shard.begin());
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

namespace {

// The crossing of a hierarchical reduce-scatter with raw or alltoall: each host sum this rank
// carries (piece i of `sums`: shard carried[i]) goes straight to the shard's owner, raw or encoded
// once (state slot = owner), and each owner adds the hosts' contributions in host order, its own
// host's exact, into `shard`. ctx spans every rank; its input is `sums`.
void to_owners(PartitionContext& ctx, const transport::Topology& t, bool raw,
               const std::vector<int>& carried, std::span<const float> sums, std::size_t m,
               std::span<float> shard) {
  const int me = ctx.comm->rank(), h = t.host_of[me];
  const int hosts = static_cast<int>(t.hosts.size());
  const std::size_t cap = raw ? m * sizeof(float) : message_capacity(*ctx.codec, m);
  // Areas: host g's contribution to our shard at g, our message for carried[i] at hosts + i.
  kit::Buffer areas = ctx.pool->acquire(std::max<std::size_t>(cap * (hosts + carried.size()), 1));
  auto area = [&](std::size_t k) { return areas.bytes().subspan(cap * k, cap); };
  std::vector<Request> rx(hosts), tx(carried.size());
  std::vector<std::size_t> sent(carried.size());
  for (int g = 0; g < hosts; ++g) {
    if (g != h) rx[g] = post_recv(ctx, carrier(t, g, me), 1, area(g));
  }
  std::size_t own = 0;
  for (std::size_t i = 0; i < carried.size(); ++i) {
    const int j = carried[i];
    if (j == me) {
      own = i;
      continue;
    }
    const std::span<const float> x = sums.subspan(i * m, m);
    const std::span<const std::byte> message =
        raw ? std::as_bytes(x) : encode_or_fail(ctx, x, i * m, j, j, area(hosts + i), true);
    tx[i] = post_send(ctx, j, 1, message);
    sent[i] = message.size();
  }
  kit::Buffer scratch = ctx.pool->acquire(std::max<std::size_t>(m * sizeof(float), 1));
  std::span<float> acc = scratch.as<float>(m);
  for (int g = 0; g < hosts; ++g) {
    const int from = g == h ? me : carrier(t, g, me);
    if (g != h) wait(ctx, rx[g], false, from, cap);
    if (!raw && g != h) {
      decode_or_record(ctx, received_message(ctx, area(g), from), acc,
                       g == 0 ? DecodeMode::kOverwrite : DecodeMode::kAccumulate, from);
      continue;
    }
    const std::span<const float> term =
        g == h ? sums.subspan(own * m, m)
               : std::span<const float>(reinterpret_cast<const float*>(area(g).data()), m);
    Stage s(ctx, "merge", from, m * sizeof(float));
    // Host sums are finite, or their carriers recorded why not (a failed one sends zeros).
    kit::store_or_add(term.data(), acc, g != 0);
  }
  note_overflow(ctx, acc, own * m);
  if (!ctx.failure.any()) {
    apply_divisor(ctx, acc);
    std::copy(acc.begin(), acc.end(), shard.begin());
  }
  for (std::size_t i = 0; i < carried.size(); ++i) {
    if (carried[i] != me) wait(ctx, tx[i], true, carried[i], sent[i]);
  }
}

// The phase inside a host (hosts > 1): `sums` (piece i: shard carried[local][i]) receives this
// host's exact fp32 sums of the pieces this rank carries, summed in local rank order; a host of
// one rank copies its own. Failures go to ctx (which spans every rank).
void host_sums(PartitionContext& ctx, const transport::Topology& t, const Chunks& chunks,
               const std::vector<std::vector<int>>& carried, std::span<float> sums) {
  const int me = ctx.comm->rank();
  const std::vector<int>& host = t.hosts[t.host_of[me]];
  const std::size_t m = chunks.size(me);
  const std::vector<int>& mine = carried[t.local_of[me]];
  if (host.size() == 1) {
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const auto piece = chunks.piece(ctx.input, mine[i]);
      std::copy(piece.begin(), piece.end(), sums.begin() + i * m);
    }
    if (const std::size_t bad = kit::find_non_finite(std::span<const float>(sums));
        bad < sums.size()) {
      ctx.failure.merge({Failure::kInputNotFinite, me,
                         ctx.element(chunks.begin(mine[bad / m]) + bad % m), {}});
    }
    return;
  }
  // Each host rank's carried pieces side by side, so that each rank's block is one chunk.
  std::vector<std::size_t> begin, size, from;
  const std::size_t n = static_cast<std::size_t>(t.size());
  kit::Buffer staged = ctx.pool->acquire(std::max<std::size_t>(n * m * sizeof(float), 1));
  const std::span<float> buf = staged.as<float>(n * m);
  for (const auto& c : carried) {
    begin.push_back(from.size() * m);
    size.push_back(c.size() * m);
    for (int j : c) {
      const auto piece = chunks.piece(ctx.input, j);
      std::copy(piece.begin(), piece.end(), buf.begin() + from.size() * m);
      from.push_back(ctx.element(chunks.begin(j)));
    }
  }
  PartitionContext inside = ctx;
  inside.group = host;
  inside.group_rank = t.local_of[me];
  inside.divisor = 1;
  inside.input = buf;
  inside.gathered_piece = m;
  inside.gathered_origins = from;
  if (t.reads_directly(t.host_of[me])) inside.direct_pids = t.pid;
  raw_reduce_scatter(inside, Chunks::ranges(std::move(begin), std::move(size)), sums);
  ctx.failure.merge(inside.failure);
}

// The crossing of a hierarchical reduce-scatter with sharded, ring or summable (hosts of equal
// size): local rank `local` of every host carries exactly the shards of local rank `local`, one
// per host in host order, and those ranks run the strategy's reduce-scatter as a group.
void in_groups(PartitionContext& across, const transport::Topology& t, Strategy strategy,
               std::size_t m, std::span<float> shard) {
  const int me = across.comm->rank(), local = t.local_of[me];
  std::vector<int> group;
  for (const auto& g : t.hosts) group.push_back(g[local]);
  across.group = group;
  across.group_rank = t.host_of[me];
  across.encode.tensor =
      kit::combine_keys(across.encode.tensor, static_cast<std::uint64_t>(local));
  const Chunks pieces = Chunks::strided(m, 0, m, static_cast<int>(t.hosts.size()));
  if (strategy == Strategy::kSharded) {
    sharded_reduce_scatter(across, pieces, shard, true);
  } else if (strategy == Strategy::kRing) {
    ring_reduce_scatter(across, pieces, shard);
  } else {
    summable_reduce_scatter(across, pieces, shard);
    if (!across.failure.any()) apply_divisor(across, shard);
  }
  across.group = {};  // `group` ends here
}

}  // namespace

void hierarchical_reduce_scatter(PartitionContext& ctx, const transport::Topology& t,
                                 Strategy strategy, const Chunks& chunks, std::span<float> shard,
                                 const std::function<void()>& finish) {
  const int me = ctx.comm->rank(), h = t.host_of[me];
  const std::vector<int>& host = t.hosts[h];
  const std::size_t m = chunks.size(me);
  const bool direct = strategy == Strategy::kRaw || strategy == Strategy::kAllToAll;
  if (!direct && strategy != Strategy::kSharded && strategy != Strategy::kRing &&
      strategy != Strategy::kSummable) {
    throw InvalidArgument(
        fmt::format("reduce_scatter: strategy {} has no reduce-scatter", to_string(strategy)));
  }
  if (!direct && !t.even()) {
    throw InvalidArgument(fmt::format("reduce_scatter: strategy {} across hosts needs hosts of "
                                      "equal size ({})",
                                      to_string(strategy), t.describe()));
  }
  if (t.hosts.size() == 1) {
    // One host: the exact reduce-scatter among its ranks is the result (its ranks are the
    // chunks' owners, in increasing order).
    PartitionContext inside = ctx;
    inside.group = host;
    inside.group_rank = t.local_of[me];
    if (t.reads_directly(h)) inside.direct_pids = t.pid;
    if (host.size() > 1) {
      raw_reduce_scatter(inside, chunks, shard);
    } else if (add_input(inside, chunks.begin(me), shard, false)) {
      apply_divisor(inside, shard);
    }
    ctx.failure.merge(inside.failure);
  } else {
    // The shards each rank of this host carries, in host order and local order within a host.
    std::vector<std::vector<int>> carried(host.size());
    for (const auto& g : t.hosts) {
      for (int j : g) carried[t.local_of[carrier(t, h, j)]].push_back(j);
    }
    const std::vector<int>& mine = carried[t.local_of[me]];
    kit::Buffer buffer = ctx.pool->acquire(std::max<std::size_t>(mine.size() * m * 4, 1));
    const std::span<float> sums = buffer.as<float>(mine.size() * m);
    host_sums(ctx, t, chunks, carried, sums);
    // A failed host sum does not cross: its carrier sends failure payloads (raw: zeros; the
    // status round tells every rank).
    if (ctx.failure.any()) std::fill(sums.begin(), sums.end(), 0.0f);
    std::vector<std::size_t> origins;  // the tensor element where each carried piece starts
    for (int j : mine) origins.push_back(ctx.element(chunks.begin(j)));
    PartitionContext across = ctx;  // its failure too: encoders then send failure payloads
    across.input = sums;
    across.gathered_piece = m;
    across.gathered_origins = origins;
    if (direct) {
      to_owners(across, t, strategy == Strategy::kRaw, mine, sums, m, shard);
    } else {
      in_groups(across, t, strategy, m, shard);
    }
    ctx.failure.merge(across.failure);
  }
  if (finish) finish();
  agree_on_failure(ctx, kStatusIndex);
}

}  // namespace terse::collectives
