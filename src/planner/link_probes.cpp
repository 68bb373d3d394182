// Link probes (exchange.h): every pair of ranks exchanges messages of growing sizes in a
// round-robin tournament; each pair's latency and time per byte, agreed by all ranks.
#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "planner/exchange.h"
#include "planner/measuring.h"
#include "terse/communicator.h"
#include "terse/error.h"
#include "transport/direct_read.h"
#include "transport/tags.h"

namespace terse::planner {

namespace {

// Partner of `rank` in round `round` of a round-robin tournament (circle method; with an odd
// number of ranks a virtual player makes the count even and its partner sits out: -1).
int partner(int rank, int round, int n) {
  const int m = n + n % 2;
  int p;
  if (rank == m - 1) {
    p = round;
  } else if (rank == round) {
    p = m - 1;
  } else {
    p = ((2 * round - rank) % (m - 1) + (m - 1)) % (m - 1);
  }
  return p >= n ? -1 : p;
}

// Both ranks of a pair send `bytes` to each other at once; returns the time until both the
// send and the receive completed.
double exchange(Communicator& comm, int peer, std::uint64_t tag, std::span<std::byte> out,
                std::span<std::byte> in) {
  const auto t0 = Clock::now();
  Request rx = comm.recv(peer, tag, in, "calibration");
  Request tx = comm.send(peer, tag, out, "calibration");
  rx.wait();
  tx.wait();
  return seconds_since(t0);
}

// The same by direct reads of each other's memory (transport/direct_read.h), as the
// collectives move bytes inside a host that reads directly: each rank says where its bytes
// are, reads the peer's, and says it has read them.
double exchange_direct(Communicator& comm, int peer, std::int64_t pid, std::uint64_t tag,
                       std::uint64_t done_tag, std::span<std::byte> out,
                       std::span<std::byte> in) {
  const auto t0 = Clock::now();
  std::array<std::uint64_t, 2> where = {reinterpret_cast<std::uint64_t>(out.data()), out.size()},
                               theirs{};
  std::uint64_t read = 1, their_read = 0;
  Request rx = comm.recv(peer, tag, std::as_writable_bytes(std::span(theirs)), "calibration");
  Request done_rx =
      comm.recv(peer, done_tag, std::as_writable_bytes(std::span(&their_read, 1)), "calibration");
  Request tx = comm.send(peer, tag, std::as_bytes(std::span(where)), "calibration");
  rx.wait();
  if (theirs[1] != in.size()) {
    throw Error(fmt::format("calibration: rank {} offers {} bytes where {} were expected", peer,
                            theirs[1], in.size()));
  }
  if (const std::string error = transport::read_process(pid, theirs[0], in); !error.empty()) {
    throw Error(fmt::format("calibration: cannot read rank {}'s bytes directly: {}", peer, error));
  }
  Request done_tx = comm.send(peer, done_tag, std::as_bytes(std::span(&read, 1)), "calibration");
  tx.wait();
  done_tx.wait();
  done_rx.wait();
  return seconds_since(t0);
}

struct PairLink {
  double alpha = 0, beta = 0;
};

// One pair's link: both ranks exchange `round`-tagged messages as the strategies make them
// (both ways at once, a receive posted before the send): 8 bytes, then growing sizes until one
// takes link_target_seconds. t = alpha + beta * bytes: alpha is the latency of a round as the
// engine sees it (wake-ups included, which a ping-pong of one message at a time would count
// twice), beta the time per byte.
PairLink measure_pair(Communicator& comm, int p, std::uint32_t round,
                      const CalibrationOptions& options, std::vector<std::byte>& out_buffer,
                      std::vector<std::byte>& in_buffer) {
  std::uint32_t index = 0;
  auto tag = [&] { return tags::reserved(tags::kPlannerSignature, round, index++); };
  // Both ranks of a pair take the same branch: both pids are known, or not.
  const int me = comm.rank();
  const bool direct = static_cast<int>(options.direct_pid.size()) == comm.size() &&
                      options.direct_pid[me] != 0 && options.direct_pid[p] != 0 &&
                      (options.host_of.size() != options.direct_pid.size() ||
                       options.host_of[me] == options.host_of[p]);
  auto swap = [&](std::uint64_t t, std::span<std::byte> o, std::span<std::byte> i) {
    if (!direct) return exchange(comm, p, t, o, i);
    const std::uint64_t done = tag();
    return exchange_direct(comm, p, options.direct_pid[p], t, done, o, i);
  };
  std::vector<double> sizes, times;
  for (std::size_t bytes = 8;; bytes = bytes < (16 << 10) ? (16 << 10) : bytes * 4) {
    if (out_buffer.size() < bytes) {
      out_buffer.assign(bytes, std::byte{1});
      in_buffer.assign(bytes, std::byte{0});
    }
    auto o = std::span(out_buffer).first(bytes);
    auto i = std::span(in_buffer).first(bytes);
    swap(tag(), o, i);  // warm-up: socket buffers grow to the size
    std::vector<double> t;
    for (int rep = 0; rep < (bytes < (16 << 10) ? 15 : 5); ++rep) {
      t.push_back(swap(tag(), o, i));
    }
    // Both ranks of the pair decide on the larger median, so they stop together.
    std::array<double, 1> mine = {median(t)}, theirs{};
    const std::uint64_t t_agree = tag();
    Request rx = comm.recv(p, t_agree, std::as_writable_bytes(std::span(theirs)), "calibration");
    comm.send(p, t_agree, std::as_bytes(std::span(mine)), "calibration").wait();
    rx.wait();
    const double agreed = std::max(mine[0], theirs[0]);
    sizes.push_back(static_cast<double>(bytes));
    times.push_back(agreed);
    if (sizes.size() >= 4 &&
        (agreed >= options.link_target_seconds || bytes * 4 > options.link_max_bytes)) {
      break;
    }
  }
  // beta from the two largest exchanges: a shaped link's burst (a token bucket) saves the same
  // time on every exchange longer than it, which cancels in their slope but bends a full fit.
  const LinearFit fit = fit_linear(sizes, times);
  const std::size_t last = sizes.size() - 1;
  const double slope = (times[last] - times[last - 1]) / (sizes[last] - sizes[last - 1]);
  return {fit.a, slope > 0 ? slope : fit.b};
}

// A pair whose time per byte is above this multiple of the median pair's is measured again.
constexpr double kSlowPair = 2.0;
// ... at most this many times; the fastest measurement stands.
constexpr int kPairRetries = 2;
// Tag rounds of the re-measurements (the tournament's rounds are below the world size).
constexpr std::uint32_t kRetryRounds = 0x8000;

}  // namespace

// Every pair is measured in a round-robin tournament (pairs of one round at once), and every
// rank learns every pair's figures, the larger of its two ranks' measurements. A link figure
// is the pace of the whole job's collectives (the slowest pair bounds a ring), so one
// disturbed measurement (outside load during its exchanges) would misprice every plan. A pair
// more than kSlowPair times slower than the median pair (of its class, where out.host_of gives
// the job's hosts) is measured again, alone, up to kPairRetries times, and keeps its fastest
// measurement: a link slow for real stays slow.
void measure_links(Communicator& comm, const CalibrationOptions& options, Calibration& out) {
  const int n = comm.size(), r = comm.rank();
  std::vector<double> alpha_row(n, 0.0), beta_row(n, 0.0);
  std::vector<std::byte> out_buffer, in_buffer;
  const int rounds = n + n % 2 - 1;
  for (int round = 0; n > 1 && round < rounds; ++round) {
    comm.barrier("calibration");  // pairs of one round only: rounds must not overlap
    const int p = partner(r, round, n);
    if (p < 0) continue;
    const PairLink link =
        measure_pair(comm, p, static_cast<std::uint32_t>(round), options, out_buffer, in_buffer);
    alpha_row[p] = link.alpha;
    beta_row[p] = link.beta;
  }
  // Every rank learns every row; a pair's value is the larger of its two measurements.
  std::vector<double> mine(alpha_row);
  mine.insert(mine.end(), beta_row.begin(), beta_row.end());
  const auto rows = gather(comm, mine);
  out.peer_alpha.assign(n, std::vector<double>(n, 0.0));
  out.peer_beta.assign(n, std::vector<double>(n, 0.0));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      out.peer_alpha[i][j] = std::max(rows[i][j], rows[j][i]);
      out.peer_beta[i][j] = std::max(rows[i][n + j], rows[j][n + i]);
    }
  }
  recheck_slow_pairs(comm, options, out);
}

void recheck_slow_pairs(Communicator& comm, const CalibrationOptions& options, Calibration& out) {
  const int n = comm.size(), r = comm.rank();
  std::vector<std::byte> out_buffer, in_buffer;
  // Where the job's hosts are known, a pair is judged against the median pair of its class
  // (inside a host, or across hosts): links inside a host are many times faster than across, so
  // a disturbed one would still look fast against a median pair across hosts, and be kept.
  const bool classes = static_cast<int>(out.host_of.size()) == n;
  auto class_of = [&](int i, int j) { return classes && out.host_of[i] == out.host_of[j]; };
  std::array<std::vector<double>, 2> pair_betas;
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) pair_betas[class_of(i, j)].push_back(out.peer_beta[i][j]);
  }
  // Every rank holds the same figures, so every rank finds the same slow pairs, in the same
  // order, and takes part in each one's round (a barrier; the pair exchanges; a gather).
  std::array<double, 2> typical_of{};
  for (int k = 0; k < 2; ++k) {
    typical_of[k] = pair_betas[k].empty() ? 0.0 : median(pair_betas[k]);
  }
  std::uint32_t retry_round = kRetryRounds;
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) {
      const double typical = typical_of[class_of(i, j)];
      for (int attempt = 0; attempt < kPairRetries && typical > 0 &&
                            out.peer_beta[i][j] > kSlowPair * typical;
           ++attempt) {
        comm.barrier("calibration");
        std::array<double, 2> again = {0.0, 0.0};
        if (r == i || r == j) {
          const PairLink link =
              measure_pair(comm, r == i ? j : i, retry_round, options, out_buffer, in_buffer);
          again = {link.alpha, link.beta};
        }
        ++retry_round;
        const auto all = gather(comm, again);
        const double alpha = std::max(all[i][0], all[j][0]);
        const double beta = std::max(all[i][1], all[j][1]);
        log_line(options.quiet, r,
                 fmt::format("link {}-{} measured at {:.2f} ns/B, {:.1f}x the median pair's{}; "
                             "measured again: {:.2f} ns/B",
                             i, j, out.peer_beta[i][j] * 1e9, out.peer_beta[i][j] / typical,
                             !classes              ? ""
                             : class_of(i, j)      ? " inside a host"
                                                   : " across hosts",
                             beta * 1e9));
        if (beta > 0 && beta < out.peer_beta[i][j]) {
          out.peer_beta[i][j] = out.peer_beta[j][i] = beta;
          out.peer_alpha[i][j] = out.peer_alpha[j][i] = alpha;
        }
      }
    }
  }
  out.alpha = out.beta = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      out.alpha = std::max(out.alpha, out.peer_alpha[i][j]);
      out.beta = std::max(out.beta, out.peer_beta[i][j]);
    }
  }
}

double probe_links(Communicator& comm, const Calibration& c, const CalibrationOptions& options) {
  const int n = comm.size(), r = comm.rank();
  if (n == 1) return 1.0;
  const double target = c.beta > 0 ? options.link_target_seconds / c.beta : 0;
  const std::size_t bytes = static_cast<std::size_t>(
      std::clamp(target, 64.0 * 1024, static_cast<double>(options.link_max_bytes)));
  std::vector<std::byte> out(bytes, std::byte{1}), in(bytes);
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<double> t;
  comm.barrier("calibration probe");
  for (int rep = 0; rep < 4; ++rep) {
    const std::uint64_t tag = tags::reserved(tags::kPlannerSignature, 0xffff, rep);
    const auto t0 = Clock::now();
    Request rx = comm.recv(prev, tag, in, "calibration probe");
    Request tx = comm.send(next, tag, out, "calibration probe");
    rx.wait();
    tx.wait();
    if (rep > 0) t.push_back(seconds_since(t0));
  }
  const double measured = agree_max(comm, {median(t)})[0];
  const double predicted = c.alpha + static_cast<double>(bytes) * c.beta;
  return predicted > 0 ? measured / predicted : 1.0;
}

}  // namespace terse::planner
