// The cost model: predicted time of one allreduce per strategy, from the calibration.
// docs/planner.md derives these formulas from each strategy's message schedule (the header
// comments of src/collectives/allreduce/*.cpp) and the engine's pipeline.
//
// One partition of m floats, N ranks, chunks or shards of s = m/N floats, e(x) encoded bytes:
//   raw        L = 2(N-1)  W = 2(N-1)*4s        C = (N-1)*add(s) + div(s)
//   allgather  L = 1       W = (N-1)*e(m)       C = enc(m) + dec(m) + (N-1)*acc(m) + div(m)
//   sharded    L = 2       W = 2(N-1)*e(s)      C = N*enc(s) + (N-1)*acc(s) + add(s) + div(s)
//                                                   + N*dec(s)
//   ring       L = N       W = 2(N-1)*e(s)      C = N*enc(s) + (N-1)*(dec(s) + add(s)) + div(s)
//                                                   + N*dec(s)
//   summable   L = N       W = 2(N-1)*e(s)      C = N*enc(s) + (N-1)*cmb(s) + N*dec(s) + div(m)
//   rounds     L = R*2(N-1)  W = sum_r 2(N-1)*4*c_r/N
//                                               C = enc(m) + sum_r (N-1)*add(c_r/N) + div(m)
// (rounds: a multi-round codec such as PowerSGD, always one partition; round r's contribution
// of c_r floats is summed by the raw ring, and enc() is the CPU of all its rounds and finish().)
// Each operation on a piece of x elements of the tensor costs its fit's rate over the whole
// tensor, f.a + (f(n) - f.a) * x / n: its data are in the cache if the tensor is.
// (L: message rounds on the critical path; W: bytes this rank sends, all of which cross its
// link; C: CPU seconds on the critical path; W*beta stands for Calibration::link_seconds(W):
// W * max(beta, engine_beta), or the engine's measured link where the cores pace it.) One
// partition alone takes
//   t1 = L*alpha + W*beta + C
// and K partitions on c = min(K, threads) workers, whose CPU work is slowed by sigma, the
// measured slowdown at the c * C / t1 threads that compute at once (the others wait on links):
//   T = o_job + t1 + (K-1) * (max(W*beta, C*sigma/c, (L*alpha + W*beta + C*sigma)/c) + o_task)
// the first partition's latency, then one partition per bottleneck interval: the link, the CPU,
// or c partitions' latency chains in flight at once. o_job (per allreduce) and o_task (per
// further partition: hand-offs between threads, which do not overlap on busy cores) are the
// engine's own costs, measured by running it (see Calibration). Last, the host's CPU bound:
// every rank of the host does its partitions' CPU work, messages and transport copies at
// about the same time, and its cores cannot do more than their number of seconds a second:
//   T = max(T, ranks_on_host / cores * u * K * (C + X(W) + M * cpu_per_message))
// (M: messages this rank sends per partition, 2(N-1), or N-1 for allgather and gathered raw;
// X: the transport's measured CPU for W bytes sent; u >= 1: host_efficiency, measured on a
// compressed allreduce: how much longer it took than this model's CPU for it over the cores,
// the cores' idling while ranks wait on each other and the CPU the fits do not see). On a wire
// (a link the cores do not pace: engine_link not measured) the last partition's bytes cross
// while nothing is left to compute, and at K = 1 the ranks compute, then wait on the wire:
//   T = max(T, host bound + W*beta - X(W))
// (one partition's W: without it, sharded onebit at 1 Gbit/s and 16 MiB is predicted fast at
// small K and slow at large K, and the model prefers K = 1 where it is not the best).
// Two levels over hosts (predict_hosts, hosts_partition below) price one partition's three
// phases with the same L, W, C terms, each at its class of links, and go through the same
// pipeline and host bound, whose C is then the host's ranks' average (only a slot's owner
// crosses with it).
#include "planner/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "collectives/collective.h"
#include "terse/codec.h"
#include "terse/error.h"
#include "terse/plan.h"
#include "terse/planner.h"

namespace terse {

namespace {

// Elements of the largest of `parts` pieces of n (boundaries on multiples of 64, as Split).
double largest_piece(double n, double parts) {
  if (parts <= 1) return n;
  return std::min(n, std::ceil(n / parts / 64) * 64);
}

// A fit's cost for a piece of x elements of a tensor of `whole`: its rate over the whole tensor
// (whether the piece's data are in the cache depends on the tensor, not on the piece).
double piece_cost(const LinearFit& f, double x, double whole) {
  if (x >= whole) return f(x);
  return f.a + (f(whole) - f.a) * x / whole;
}

// Bytes of a reduce-scatter's status round per peer (agree_on_failure: a Failure record).
constexpr double kStatusBytes = 24;

}  // namespace

struct CostModel::PartitionCost {
  double rounds = 0;    // L
  double messages = 0;  // messages this rank sends (and as many it receives)
  double bytes = 0;     // W
  double cpu = 0;       // C
  // Where the partition's message steps run on links of two classes (two levels): their
  // latency and link seconds, priced per class. Negative: L * alpha and link_seconds(W).
  double latency = -1;
  double link = -1;
  // The CPU seconds a rank of the busiest host does on average, where its ranks' work differs
  // (two levels: only a slot's owner runs the strategy across hosts), for the host's CPU bound.
  // Negative: cpu (every rank does the same).
  double host_cpu = -1;
};

int planner::clamp_partitions(int k, std::size_t n) {
  // The engine's clamp: no empty partitions (64-element boundaries), at most kMaxPartitions.
  return static_cast<int>(std::clamp<std::size_t>(
      static_cast<std::size_t>(std::max(k, 1)), 1,
      std::min<std::size_t>(kMaxPartitions, std::max<std::size_t>(1, (n + 63) / 64))));
}

CostModel::CostModel(Calibration calibration) : calibration_(std::move(calibration)) {
  for (const auto& k : calibration_.codecs) {
    if (k.multi_round) rounds_.emplace(k.spec, make_codec(k.spec));
  }
}

Prediction CostModel::pipeline(const PartitionCost& p, int parts, int threads) const {
  const Calibration& c = calibration_;
  const double K = parts;
  const int concurrent = std::min(parts, threads);
  const double link = p.link >= 0 ? p.link : c.link_seconds(p.bytes);
  const double latency = p.latency >= 0 ? p.latency : p.rounds * c.alpha;
  // Partitions in flight spend part of their time waiting on the link: only the share that
  // computes contends for the cores.
  const double computing = concurrent * p.cpu / std::max(latency + link + p.cpu, 1e-12);
  const double sigma = c.slowdown(std::max(1.0, computing));
  Prediction out;
  out.one_partition = latency + link + p.cpu;
  const double loaded = latency + link + p.cpu * sigma;
  const double interval = std::max({link, p.cpu * sigma / concurrent, loaded / concurrent});
  out.seconds = c.job_overhead + out.one_partition + (K - 1) * (interval + c.task_overhead);
  // The host's CPU bound: its ranks run the same work at once, so an allreduce takes at least
  // all of it over the host's cores. Where the links are the kernel's copies and the ranks
  // share the cores (loopback, or emulated links on one host), link and CPU do not overlap
  // and this bound is what decides.
  const double transport = c.transport_cpu(p.bytes);
  out.host_cpu = K * ((p.host_cpu >= 0 ? p.host_cpu : p.cpu) + transport +
                      p.messages * c.cpu_per_message);
  out.host_bound = c.host_share() * c.host_efficiency * out.host_cpu;
  // The wire's own time (the link beyond the transport's CPU for it: a shaped link's queue) of
  // the last partition does not overlap the host's CPU work: nothing is left to compute while
  // its bytes cross, and the CPU work of the first partitions ran before any were sent.
  const double wire = c.cores_pace_links() ? 0.0 : std::max(0.0, link - transport);
  out.seconds = std::max(out.seconds, out.host_bound + wire);
  out.network = K * link;
  out.cpu = K * p.cpu * sigma;
  out.bytes_sent = K * p.bytes;
  return out;
}

// A multi-round codec's one partition (the whole tensor): its encode() fit (all rounds and
// finish()) and the division, then each round's sum, gathered or on a ring.
CostModel::PartitionCost CostModel::rounds_partition(const RoundCodec& rounds, const CodecCosts& k,
                                                     bool gathered, std::size_t n,
                                                     int ranks) const {
  const Calibration& c = calibration_;
  const double N = ranks;
  const double whole = static_cast<double>(n);
  PartitionCost p;
  p.cpu = piece_cost(k.encode, whole, whole) + piece_cost(c.divide, whole, whole);
  for (int r = 0; r < rounds.rounds() && ranks > 1; ++r) {
    if (gathered) {
      // Each round's whole contribution to every other rank, as the wire codec's payload or
      // exact fp32 (4 bytes an element and a header); every rank decodes and adds N of them.
      const std::size_t cr = rounds.round_elements(r, n);
      const Codec* wire = rounds.round_wire(r, n);
      const CodecCosts* w = wire != nullptr ? c.find(wire->spec()) : nullptr;
      p.rounds += 1;
      p.messages += N - 1;
      static const std::unique_ptr<Codec> exact = make_codec("none");
      p.bytes += (N - 1) * static_cast<double>((wire != nullptr ? wire : exact.get())
                                                   ->max_encoded_bytes(cr));
      p.cpu += w != nullptr ? w->encode(cr) + w->decode(cr) + (N - 1) * w->accumulate(cr)
                            : (N - 1) * c.add(static_cast<double>(cr));
      continue;
    }
    const double chunk = largest_piece(static_cast<double>(rounds.round_elements(r, n)), N);
    if (const Codec* wire = rounds.round_wire(r, n); wire != nullptr) {
      // The summable ring on the wire codec: N - 1 steps and the final exchange. Its CPU is the
      // wire codec's calibrated cost, or the raw ring's adds where it has none.
      p.rounds += N;
      p.messages += 2 * (N - 1);
      p.bytes += 2 * (N - 1) *
                 static_cast<double>(wire->max_encoded_bytes(static_cast<std::size_t>(chunk)));
      const CodecCosts* w = c.find(wire->spec());
      p.cpu += w != nullptr
                   ? N * w->encode(chunk) + (N - 1) * w->combine(chunk) + N * w->decode(chunk)
                   : (N - 1) * c.add(chunk);
      continue;
    }
    p.rounds += 2 * (N - 1);
    p.messages += 2 * (N - 1);
    p.bytes += 2 * (N - 1) * 4 * chunk;
    p.cpu += (N - 1) * c.add(chunk);
  }
  return p;
}

const CodecCosts* CostModel::codec_costs(std::string_view codec_spec, Strategy strategy) const {
  const bool raw = codec_spec == "none";
  if (raw != (strategy == Strategy::kRaw)) {
    throw InvalidArgument(
        fmt::format("cost model: strategy {} with codec {}", to_string(strategy), codec_spec));
  }
  const CodecCosts* k = raw ? nullptr : calibration_.find(codec_spec);
  if (!raw && k == nullptr) {
    throw InvalidArgument(fmt::format("cost model: codec {} was not calibrated", codec_spec));
  }
  return k;
}

const CodecCosts* CostModel::allreduce_codec(std::string_view codec_spec, Strategy strategy,
                                             int partitions, const RoundCodec** rounds) const {
  const CodecCosts* k = codec_costs(codec_spec, strategy);
  *rounds = nullptr;
  if (strategy == Strategy::kSummable && !k->summable && !k->multi_round) {
    throw InvalidArgument(fmt::format("cost model: {} is not summable", codec_spec));
  }
  if (k != nullptr && k->multi_round) {
    auto it = rounds_.find(codec_spec);
    *rounds = it == rounds_.end() ? nullptr : dynamic_cast<const RoundCodec*>(it->second.get());
    if (*rounds == nullptr ||
        (strategy != Strategy::kSummable && strategy != Strategy::kAllgather) || partitions > 1) {
      throw InvalidArgument(fmt::format(
          "cost model: {} runs rounds of sums: strategy summable or allgather, one partition",
          codec_spec));
    }
  }
  return k;
}

Prediction CostModel::predict(std::size_t n, std::string_view codec_spec, Strategy strategy,
                              int partitions, int ranks, int threads, Operation op) const {
  if (ranks < 1 || threads < 1) {
    throw InvalidArgument(fmt::format("cost model: {} ranks, {} threads", ranks, threads));
  }
  if (op == Operation::kAllToAll) {
    throw InvalidArgument(
        "cost model: all_to_all is not priced (allreduce, reduce_scatter and all_gather are)");
  }
  if (op != Operation::kAllreduce) {
    return predict_collective(n, codec_costs(codec_spec, strategy), strategy, partitions, ranks,
                              threads, op);
  }
  const RoundCodec* rounds = nullptr;
  const CodecCosts* k = allreduce_codec(codec_spec, strategy, partitions, &rounds);
  const int parts = planner::clamp_partitions(partitions, n);
  const double m = largest_piece(static_cast<double>(n), parts);
  return pipeline(flat_partition(k, rounds, strategy, m, n, ranks), parts, threads);
}

CostModel::PartitionCost CostModel::flat_partition(const CodecCosts* k, const RoundCodec* rounds,
                                                   Strategy strategy, double m, std::size_t n,
                                                   int ranks) const {
  const Calibration& c = calibration_;
  const double N = ranks;
  const double s = largest_piece(m, N);
  PartitionCost p;
  // An operation on a piece of the tensor costs its rate over the whole tensor: whether its data
  // are in the cache depends on the tensor (a 16 MiB tensor's 1 MiB partition came from
  // memory), not on the piece.
  const double whole = static_cast<double>(n);
  auto rate = [&](const LinearFit& f, double x) { return piece_cost(f, x, whole); };
  auto enc = [&](double x) { return rate(k->encode, x); };
  auto dec = [&](double x) { return rate(k->decode, x); };
  auto acc = [&](double x) { return rate(k->accumulate, x); };
  auto cmb = [&](double x) { return rate(k->combine, x); };
  auto add = [&](double x) { return rate(c.add, x); };
  auto div = [&](double x) { return rate(c.divide, x); };
  auto e = [&](double x) { return k->bytes(x); };
  switch (strategy) {
    case Strategy::kRaw:
      if (collectives::gathers(static_cast<std::size_t>(m), ranks, gather_bytes_)) {
        // Small: gathered (one message step, every rank's whole partition to every other).
        p.rounds = 1;
        p.messages = N - 1;
        p.bytes = (N - 1) * 4 * m;
        p.cpu = (N - 1) * add(m) + div(m);
      } else if (ranks > 1) {
        p.rounds = p.messages = 2 * (N - 1);
        p.bytes = 2 * (N - 1) * 4 * s;
        p.cpu = (N - 1) * add(s) + div(s);
      }
      break;
    case Strategy::kAllgather:
      if (rounds != nullptr) return rounds_partition(*rounds, *k, true, n, ranks);
      p.rounds = ranks > 1 ? 1 : 0;
      p.messages = N - 1;
      p.bytes = (N - 1) * e(m);
      p.cpu = enc(m) + dec(m) + (N - 1) * acc(m) + div(m);
      break;
    case Strategy::kSharded:
      p.rounds = ranks > 1 ? 2 : 0;
      p.messages = 2 * (N - 1);
      p.bytes = 2 * (N - 1) * e(s);
      p.cpu = N * enc(s) + (N - 1) * acc(s) + add(s) + div(s) + N * dec(s);
      break;
    case Strategy::kRing:
      p.rounds = ranks > 1 ? N : 0;
      p.messages = 2 * (N - 1);
      p.bytes = 2 * (N - 1) * e(s);
      p.cpu = N * enc(s) + (N - 1) * (dec(s) + add(s)) + div(s) + N * dec(s);
      break;
    case Strategy::kSummable:
      if (rounds != nullptr) return rounds_partition(*rounds, *k, false, n, ranks);
      p.rounds = ranks > 1 ? N : 0;
      p.messages = 2 * (N - 1);
      p.bytes = 2 * (N - 1) * e(s);
      p.cpu = N * enc(s) + (N - 1) * cmb(s) + N * dec(s) + div(m);
      break;
    case Strategy::kAuto:
      throw InvalidArgument("cost model: strategy auto has no cost; resolve it first");
    case Strategy::kAllToAll:
      throw InvalidArgument("cost model: strategy alltoall is not an allreduce strategy");
  }
  return p;
}

planner::HostLayout planner::host_layout(const Calibration& c, const transport::Topology& t) {
  HostLayout out;
  for (const auto& h : t.hosts) out.ranks.push_back(static_cast<int>(h.size()));
  out.links = link_classes(c, t.host_of);
  return out;
}

// Two levels (collectives/allreduce/hierarchical.cpp): one partition of m floats on hosts of R
// ranks, cut into L slots (the most ranks on a host; 1 for a multi-round codec). Rank i of a
// host of R owns k_i = floor((i+1) L/R) - floor(i L/R) slots, own_i = k_i m/L floats:
//   1. inside (R > 1): it sends each other rank of its host that rank's slots (m - own_i floats
//      in all) and sums the host's R contributions to its own: one message step, R - 1
//      messages, C = (R-1) add(own_i) (and the division where there is one host);
//   2. across (H > 1): for each of its k_i slots in turn, the strategy's flat partition of
//      m/L floats among the slot's owners, one a host (raw and multi-round codecs: then a status
//      round, one step of H - 1 messages);
//   3. inside: it sends its slots' results to the others ((R-1) own_i floats, one step), then
//      the status round (one step, R - 1 messages).
// Each term is the busiest rank's: inside, 3 rounds at the intra-host class's alpha and
// W_in = max_i 4 (m - own_i + (R-1) own_i) bytes at its links; across, max_i k_i times the
// slot's rounds, bytes and CPU at the cross-host class's.
CostModel::PartitionCost CostModel::hosts_partition(const PartitionCost& slot, bool status,
                                                    double m, int slots, std::size_t n,
                                                    const planner::HostLayout& hosts) const {
  const Calibration& c = calibration_;
  const double whole = static_cast<double>(n);
  const double piece = largest_piece(m, slots);
  const double H = static_cast<double>(hosts.ranks.size());
  double in_rounds = 0, in_messages = 0, in_bytes = 0, in_cpu = 0;
  int most = 0;  // slots of the busiest rank
  // Per host: its ranks' average CPU inside the host.
  std::vector<double> host_in_average;
  for (const int R : hosts.ranks) {
    double host_in = 0;
    for (int i = 0; i < R; ++i) {
      const int k = collectives::first_slot(i + 1, R, slots) - collectives::first_slot(i, R, slots);
      most = std::max(most, k);
      if (R == 1) continue;
      const double own = std::min(m, k * piece), others = R - 1;
      in_rounds = 3;
      in_messages = std::max(in_messages, 3 * others);
      in_bytes = std::max(in_bytes, 4 * (m - own + others * own) + others * kStatusBytes);
      const double cpu_i = others * piece_cost(c.add, own, whole) +
                           (H == 1 ? piece_cost(c.divide, own, whole) : 0.0);
      in_cpu = std::max(in_cpu, cpu_i);
      host_in += cpu_i;
    }
    host_in_average.push_back(host_in / R);
  }
  PartitionCost across;
  if (H > 1) {
    across.rounds = most * (slot.rounds + (status ? 1 : 0));
    across.messages = most * (slot.messages + (status ? H - 1 : 0));
    across.bytes = most * (slot.bytes + (status ? (H - 1) * kStatusBytes : 0));
    across.cpu = most * slot.cpu;
  }
  const LinkClasses& l = hosts.links;
  auto link = [&](double bytes, const LinkClass& k) {
    return bytes > 0 ? c.link_seconds(bytes) * k.scale : 0.0;
  };
  PartitionCost p;
  p.rounds = in_rounds + across.rounds;
  p.messages = in_messages + across.messages;
  p.bytes = in_bytes + across.bytes;
  p.cpu = in_cpu + across.cpu;
  // A host's L slots cross once each, whichever of its R ranks own them: with fewer slots than
  // ranks (one, for a multi-round codec) the others idle while they cross.
  p.host_cpu = 0;
  for (std::size_t g = 0; g < host_in_average.size(); ++g) {
    const double crossing = H > 1 ? slots * slot.cpu / hosts.ranks[g] : 0.0;
    p.host_cpu = std::max(p.host_cpu, host_in_average[g] + crossing);
  }
  p.latency = in_rounds * l.intra.alpha + across.rounds * l.cross.alpha;
  p.link = link(in_bytes, l.intra) + link(across.bytes, l.cross);
  return p;
}

Prediction CostModel::predict_hosts(std::size_t n, std::string_view codec_spec, Strategy strategy,
                                    int partitions, const planner::HostLayout& hosts,
                                    int threads) const {
  int most = 0;
  for (const int r : hosts.ranks) {
    if (r < 1) throw InvalidArgument("cost model: a host of no ranks");
    most = std::max(most, r);
  }
  if (most == 0 || threads < 1) {
    throw InvalidArgument(
        fmt::format("cost model: {} hosts, {} threads", hosts.ranks.size(), threads));
  }
  const RoundCodec* rounds = nullptr;
  const CodecCosts* k = allreduce_codec(codec_spec, strategy, partitions, &rounds);
  const int parts = planner::clamp_partitions(partitions, n);
  const double m = largest_piece(static_cast<double>(n), parts);
  // A multi-round codec compresses the whole partition as one matrix: one slot a host.
  const int slots = rounds != nullptr ? 1 : most;
  const PartitionCost slot = flat_partition(k, rounds, strategy, largest_piece(m, slots), n,
                                            static_cast<int>(hosts.ranks.size()));
  const bool status = strategy == Strategy::kRaw || rounds != nullptr;
  return pipeline(hosts_partition(slot, status, m, slots, n, hosts), parts, threads);
}

// A reduce-scatter of n floats of input (N shards of n/N) or an all-gather of n floats of
// output, each shard split into K pieces: partition p holds piece p of every rank's shard, s
// floats each (src/engine/partition_task.cpp). Per partition (reduce-scatter, then the status
// round every reduce-scatter partition ends with: one message step, N-1 messages of 24 bytes):
//   raw        L = 1  W = (N-1)*4s     C = (N-1)*add(s) + div(s)
//   alltoall   L = 1  W = (N-1)*e(s)   C = (N-1)*enc(s) + (N-1)*acc(s) + add(s) + div(s)
//   sharded    L = 1  W = (N-1)*e(s)   C = N*enc(s) + (N-1)*acc(s) + add(s) + div(s) + dec(s)
//   ring       L = N  W = N*e(s)       C = N*enc(s) + (N-1)*(dec(s) + add(s)) + div(s) + dec(s)
//   summable   L = N  W = N*e(s)       C = N*enc(s) + (N-1)*cmb(s) + dec(s) + div(s)
// all-gather (no status round: every rank decodes every payload):
//   raw        L = 1  W = (N-1)*4s     C = div(N*s)  (the scan of the result, an fp32 pass)
//   allgather  L = 1  W = (N-1)*e(s)   C = enc(s) + N*dec(s)
// The pipeline and the host bound are the allreduce's.
Prediction CostModel::predict_collective(std::size_t n, const CodecCosts* k, Strategy strategy,
                                         int partitions, int ranks, int threads,
                                         Operation op) const {
  const Calibration& c = calibration_;
  const bool scatter = op == Operation::kReduceScatter;
  const std::string_view spec = k != nullptr ? std::string_view(k->spec) : "none";
  if (k != nullptr && k->multi_round) {
    throw InvalidArgument(
        fmt::format("cost model: {} compresses a whole matrix over rounds of sums; no {} of it",
                    spec, to_string(op)));
  }
  const bool valid = scatter ? strategy != Strategy::kAllgather && strategy != Strategy::kAuto &&
                                   (strategy != Strategy::kSummable || k->summable)
                             : strategy == Strategy::kRaw || strategy == Strategy::kAllgather;
  if (!valid) {
    throw InvalidArgument(fmt::format("cost model: {} has no strategy {} for codec {}",
                                      to_string(op), to_string(strategy), spec));
  }
  const double N = ranks;
  const std::size_t shard = n / static_cast<std::size_t>(ranks);
  const int parts = planner::clamp_partitions(partitions, shard);
  const double s = largest_piece(static_cast<double>(shard), parts);
  const double whole = static_cast<double>(n);
  auto enc = [&](double x) { return piece_cost(k->encode, x, whole); };
  auto dec = [&](double x) { return piece_cost(k->decode, x, whole); };
  auto acc = [&](double x) { return piece_cost(k->accumulate, x, whole); };
  auto cmb = [&](double x) { return piece_cost(k->combine, x, whole); };
  auto add = [&](double x) { return piece_cost(c.add, x, whole); };
  auto div = [&](double x) { return piece_cost(c.divide, x, whole); };
  auto e = [&](double x) { return k->bytes(x); };

  PartitionCost p;
  const double steps = ranks > 1 ? 1 : 0;  // one message step, where there are peers
  switch (strategy) {
    case Strategy::kRaw:
      p.rounds = steps;
      p.messages = N - 1;
      p.bytes = (N - 1) * 4 * s;
      p.cpu = scatter ? (N - 1) * add(s) + div(s) : div(N * s);
      break;
    case Strategy::kAllToAll:
      p.rounds = steps;
      p.messages = N - 1;
      p.bytes = (N - 1) * e(s);
      p.cpu = (N - 1) * enc(s) + (N - 1) * acc(s) + add(s) + div(s);
      break;
    case Strategy::kSharded:
      p.rounds = steps;
      p.messages = N - 1;
      p.bytes = (N - 1) * e(s);
      p.cpu = N * enc(s) + (N - 1) * acc(s) + add(s) + div(s) + dec(s);
      break;
    case Strategy::kRing:
      p.rounds = ranks > 1 ? N : 0;
      p.messages = ranks > 1 ? N : 0;
      p.bytes = ranks > 1 ? N * e(s) : 0;
      p.cpu = N * enc(s) + (N - 1) * (dec(s) + add(s)) + div(s) + dec(s);
      break;
    case Strategy::kSummable:
      p.rounds = ranks > 1 ? N : 0;
      p.messages = ranks > 1 ? N : 0;
      p.bytes = ranks > 1 ? N * e(s) : 0;
      p.cpu = N * enc(s) + (N - 1) * cmb(s) + dec(s) + div(s);
      break;
    case Strategy::kAllgather:
      p.rounds = steps;
      p.messages = N - 1;
      p.bytes = (N - 1) * e(s);
      p.cpu = enc(s) + N * dec(s);
      break;
    case Strategy::kAuto: break;  // refused above
  }
  if (scatter && ranks > 1) {
    p.rounds += 1;
    p.messages += N - 1;
    p.bytes += (N - 1) * kStatusBytes;
  }
  return pipeline(p, parts, threads);
}

}  // namespace terse
