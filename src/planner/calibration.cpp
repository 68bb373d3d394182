// Calibration: measures the links to every peer and the CPU cost of every codec on this machine,
// fits A + B*n, agrees on the numbers across ranks, and reads and writes the cache file.
//
// Why everything is measured with every rank busy at once: ranks of one job may share a
// machine (the emulated cluster runs all of them on 2 cores), and a collective runs as fast as
// its slowest rank under that load. Measuring one rank alone would predict an idle machine.
#include "planner/calibration.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "kit/basic.h"
#include "kit/blas.h"
#include "kit/cpu_time.h"
#include "kit/hash.h"
#include "kit/host.h"
#include "kit/memory.h"
#include "planner/cost_model.h"
#include "planner/exchange.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/error.h"
#include "terse/planner.h"
#include "terse/trace.h"
#include "transport/machine_share.h"
#include "transport/tags.h"

namespace terse {

using Clock = std::chrono::steady_clock;

namespace {

void log_line(bool quiet, int rank, const std::string& line) {
  if (!quiet && rank == 0) std::fprintf(stderr, "terse calibrate: %s\n", line.c_str());
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
}  // namespace

// ---- fitting --------------------------------------------------------------------------------

namespace {

// Weighted least squares, w = 1/y (see the header), over the points in use; then the errors.
void solve(std::span<const double> x, std::span<const double> y, const std::vector<bool>& use,
           LinearFit& f) {
  double sw = 0, swx = 0, swxx = 0, swy = 0, swxy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!use[i]) continue;
    const double w = 1.0 / y[i];
    sw += w;
    swx += w * x[i];
    swxx += w * x[i] * x[i];
    swy += w * y[i];
    swxy += w * x[i] * y[i];
  }
  const double det = sw * swxx - swx * swx;
  f.a = f.b = 0;
  if (det > 0) {
    f.a = (swxx * swy - swx * swxy) / det;
    f.b = (sw * swxy - swx * swy) / det;
  }
  if (det <= 0 || f.b < 0) {  // all x equal, or a decreasing cost: a constant
    f.b = 0;
    f.a = swy / sw;
  } else if (f.a < 0) {  // refit through the origin
    f.a = 0;
    f.b = swxy / swxx;
  }
  double sq = 0;
  f.max_relative_error = 0;
  f.points = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!use[i]) continue;
    const double rel = f(x[i]) / y[i] - 1;
    sq += rel * rel;
    f.max_relative_error = std::max(f.max_relative_error, std::abs(rel));
    ++f.points;
  }
  f.rms_relative_error = std::sqrt(sq / f.points);
}

}  // namespace

LinearFit fit_linear(std::span<const double> x, std::span<const double> y) {
  if (x.size() != y.size() || x.size() < 2) {
    throw InvalidArgument(
        fmt::format("fit_linear: need two or more points ({} x, {} y)", x.size(), y.size()));
  }
  for (double v : y) {
    if (!(v > 0)) throw InvalidArgument("fit_linear: every y must be positive");
  }
  LinearFit f;
  std::vector<bool> use(x.size(), true);
  solve(x, y, use, f);
  // A point far off the line the others agree on is a disturbance (another process took the
  // core), not a cost: drop up to two such points, keeping at least four.
  for (int round = 0; round < 2 && f.points > 4; ++round) {
    std::size_t worst = 0;
    double worst_rel = -1, others = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (!use[i]) continue;
      const double rel = std::abs(f(x[i]) / y[i] - 1);
      others += rel * rel;
      if (rel > worst_rel) {
        worst_rel = rel;
        worst = i;
      }
    }
    others = std::sqrt((others - worst_rel * worst_rel) / (f.points - 1));
    if (worst_rel < 0.25 || worst_rel < 3 * others) break;
    use[worst] = false;
    ++f.outliers;
    solve(x, y, use, f);
  }
  f.xs.assign(x.begin(), x.end());
  f.ys.assign(y.begin(), y.end());
  return f;
}

std::vector<std::size_t> implausible_steps(std::span<const double> x, std::span<const double> y,
                                           double factor) {
  if (x.size() != y.size()) throw InvalidArgument("implausible_steps: x and y differ in size");
  std::vector<std::size_t> out;
  auto rate = [&](std::size_t i) { return y[i] / x[i]; };
  for (std::size_t i = 0; i < x.size() && x.size() > 1; ++i) {
    const std::size_t neighbour = i == 0 ? 1 : i - 1;
    if (rate(i) > factor * rate(neighbour)) out.push_back(i);
  }
  return out;
}

LinearFit fit_cost(std::span<const double> x, std::span<const double> y) {
  LinearFit best = fit_linear(x, y);
  LinearFit knee_best;
  double knee_rms = best.rms_relative_error;
  // Knees leave at least three points below (a line with an outlier test) and one above.
  for (std::size_t k = 2; k + 1 < x.size(); ++k) {
    LinearFit f = fit_linear(x.first(k + 1), y.first(k + 1));
    const double at = f(x[k]);
    double num = 0, den = 0;
    for (std::size_t i = k + 1; i < x.size(); ++i) {
      const double w = 1.0 / y[i], d = x[i] - x[k];
      num += w * d * (y[i] - at);
      den += w * d * d;
    }
    f.knee = x[k];
    f.b2 = std::max(f.b, num / den);  // past the cache, work never gets cheaper per element
    double sq = 0, worst = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double rel = std::abs(f(x[i]) / y[i] - 1);
      sq += rel * rel;
      worst = std::max(worst, rel);
    }
    f.rms_relative_error = std::sqrt(sq / x.size());
    f.max_relative_error = worst;
    f.points = static_cast<int>(x.size());
    f.outliers = 0;
    if (f.rms_relative_error < knee_rms) {
      knee_rms = f.rms_relative_error;
      knee_best = f;
    }
  }
  if (knee_best.knee > 0 && knee_rms < best.rms_relative_error / 2) {
    knee_best.xs.assign(x.begin(), x.end());
    knee_best.ys.assign(y.begin(), y.end());
    return knee_best;
  }
  return best;
}

// ---- the calibration record -----------------------------------------------------------------

const CodecCosts* Calibration::find(std::string_view spec) const {
  for (const auto& c : codecs) {
    if (c.spec == spec) return &c;
  }
  return nullptr;
}

double Calibration::link_seconds(double bytes) const {
  if (cores_pace_links()) return engine_link(bytes);
  return bytes * link_beta();
}

double Calibration::host_share() const {
  return double(std::max(1, ranks_on_host)) / std::max(1, cores);
}

double Calibration::saturation(double threads) const {
  const double share = host_share();
  return std::max(1.0, share * threads) / std::max(1.0, share);
}

double Calibration::slowdown(double threads) const {
  if (threads <= 1 || cpu_slowdown.empty()) return 1.0;
  const double measured = static_cast<double>(cpu_slowdown.size());
  double s;
  if (threads >= measured) {
    // Beyond the measured counts: as many times more work per core as threads were added.
    s = cpu_slowdown.back() * threads / measured;
  } else {
    const auto i = static_cast<std::size_t>(threads);  // 1 <= i < size
    const double f = threads - static_cast<double>(i);
    s = cpu_slowdown[i - 1] + f * (cpu_slowdown[i] - cpu_slowdown[i - 1]);
  }
  return std::max(s, saturation(threads));
}

// The cache's JSON: each field named once, in the order of the structs. Reading requires every
// field (a cache written by another version is measured again, never patched up).
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(LinearFit, a, b, knee, b2, rms_relative_error,
                                   max_relative_error, points, outliers, xs, ys)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CodecCosts, spec, summable, multi_round, encode, decode,
                                   accumulate, combine, bytes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Calibration, host, world_size, ranks_on_host, cores, peer_alpha,
                                   peer_beta, alpha, beta, engine_beta, engine_link, transport_cpu,
                                   cpu_per_message, host_efficiency, host_cpu_ratio, add, divide,
                                   codecs, cpu_slowdown, task_overhead, job_overhead, seconds)

std::string Calibration::to_json() const {
  nlohmann::json j = *this;
  j["version"] = kVersion;
  return j.dump(1);
}

Calibration Calibration::from_json(std::string_view text) {
  try {
    const auto j = nlohmann::json::parse(text);
    const int version = j.at("version").get<int>();
    if (version != kVersion) {
      throw DecodeError(
          fmt::format("calibration: version {} (this build reads {})", version, kVersion));
    }
    auto c = j.get<Calibration>();
    if (c.world_size < 1 || c.cpu_slowdown.empty()) throw DecodeError("calibration: bad values");
    return c;
  } catch (const nlohmann::json::exception& e) {
    throw DecodeError(fmt::format("calibration: {}", e.what()));
  }
}

std::string default_calibration_path(int world_size, const std::string& directory) {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown");
  return fmt::format("{}/calibration-{}-n{}.json", directory.empty() ? "/tmp/terse" : directory,
                     host, world_size);
}

// ---- agreement across ranks -----------------------------------------------------------------

namespace planner {

std::vector<std::vector<double>> gather(Communicator& comm, std::span<const double> mine) {
  const int n = comm.size();
  std::vector<double> all(mine.size() * n);
  std::vector<std::size_t> sizes(n, mine.size_bytes());
  comm.allgatherv(std::as_bytes(mine), std::as_writable_bytes(std::span(all)), sizes, "planner");
  std::vector<std::vector<double>> out(n);
  for (int i = 0; i < n; ++i) {
    out[i].assign(all.begin() + i * mine.size(), all.begin() + (i + 1) * mine.size());
  }
  return out;
}

std::vector<double> agree_median(Communicator& comm, std::vector<double> mine) {
  const auto all = gather(comm, mine);
  std::vector<double> column(all.size());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    for (std::size_t r = 0; r < all.size(); ++r) column[r] = all[r][i];
    std::sort(column.begin(), column.end());
    const std::size_t h = column.size() / 2;
    mine[i] = column.size() % 2 == 1 ? column[h] : (column[h - 1] + column[h]) / 2;
  }
  return mine;
}

std::vector<double> agree_max(Communicator& comm, std::vector<double> mine) {
  for (const auto& other : gather(comm, mine)) {
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = std::max(mine[i], other[i]);
  }
  return mine;
}

std::vector<std::string> gather_text(Communicator& comm, const std::string& mine) {
  const double length = static_cast<double>(mine.size());
  const auto lengths = gather(comm, std::span(&length, 1));
  std::vector<std::size_t> sizes;
  std::size_t total = 0;
  for (const auto& l : lengths) {
    sizes.push_back(static_cast<std::size_t>(l[0]));
    total += sizes.back();
  }
  std::string all(total, '\0');
  comm.allgatherv(std::as_bytes(std::span(mine.data(), mine.size())),
                  std::as_writable_bytes(std::span(all.data(), all.size())), sizes, "planner");
  std::vector<std::string> out;
  std::size_t at = 0;
  for (std::size_t s : sizes) {
    out.push_back(all.substr(at, s));
    at += s;
  }
  return out;
}

// ---- links ----------------------------------------------------------------------------------

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

}  // namespace

namespace {

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
  std::vector<double> sizes, times;
  for (std::size_t bytes = 8;; bytes = bytes < (16 << 10) ? (16 << 10) : bytes * 4) {
    if (out_buffer.size() < bytes) {
      out_buffer.assign(bytes, std::byte{1});
      in_buffer.assign(bytes, std::byte{0});
    }
    auto o = std::span(out_buffer).first(bytes);
    auto i = std::span(in_buffer).first(bytes);
    exchange(comm, p, tag(), o, i);  // warm-up: socket buffers grow to the size
    std::vector<double> t;
    for (int rep = 0; rep < (bytes < (16 << 10) ? 15 : 5); ++rep) {
      t.push_back(exchange(comm, p, tag(), o, i));
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
  // beta from the two largest exchanges: a shaped link lets a burst through at full speed
  // (tbf's bucket, 256 KiB in scripts/cluster.sh: 21 ms at 100 Mbit/s), which adds the same
  // saving to every exchange longer than the burst and so cancels in their slope, but bends
  // a fit through the small ones (100 Mbit/s measured as 163 Mbit/s).
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
// disturbed measurement (a burst of load from outside the job during its exchanges; seen as
// 871 ns/B on a 16 ns/B link) would misprice every plan. A pair more than kSlowPair times
// slower than the median pair is measured again, alone, up to kPairRetries times, and keeps its
// fastest measurement: a link that is slow for real measures slow again and stays so.
void measure_links(Communicator& comm, const CalibrationOptions& options, Calibration& out) {
  const int n = comm.size(), r = comm.rank();
  std::vector<double> alpha_row(n, 0.0), beta_row(n, 0.0);
  std::vector<std::byte> out_buffer, in_buffer;
  const int rounds = n + n % 2 - 1;
  for (int round = 0; n > 1 && round < rounds; ++round) {
    comm.barrier("calibration");  // pairs of one round only: rounds must not overlap
    const int p = partner(r, round, n);
    if (p < 0) continue;
    const PairLink link = measure_pair(comm, p, static_cast<std::uint32_t>(round), options,
                                       out_buffer, in_buffer);
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
  std::vector<double> pair_betas;
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) pair_betas.push_back(out.peer_beta[i][j]);
  }
  // Every rank holds the same figures, so every rank finds the same slow pairs, in the same
  // order, and takes part in each one's round (a barrier; the pair exchanges; a gather).
  const double typical = pair_betas.empty() ? 0.0 : median(pair_betas);
  std::uint32_t retry_round = kRetryRounds;
  for (int i = 0; i < n && typical > 0; ++i) {
    for (int j = i + 1; j < n; ++j) {
      for (int attempt = 0;
           attempt < kPairRetries && out.peer_beta[i][j] > kSlowPair * typical; ++attempt) {
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
                 fmt::format("link {}-{} measured at {:.2f} ns/B, {:.1f}x the median pair's; "
                             "measured again: {:.2f} ns/B",
                             i, j, out.peer_beta[i][j] * 1e9, out.peer_beta[i][j] / typical,
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

}  // namespace planner

// ---- CPU ------------------------------------------------------------------------------------

namespace {

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return "unknown";
  return host;
}

// A gradient-like input: normal values with rare large outliers (the benchmarks' input).
std::vector<float> gradient(std::size_t n) {
  std::vector<float> x(n);
  std::mt19937_64 gen(7);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  for (auto& v : x) v = normal(gen);
  for (std::size_t i = 0; i < n; i += 9973) x[i] *= 50.0f;
  return x;
}

// Median seconds of f over at least 5 runs and 3 ms (at most 60 runs), after one warm-up, each
// run after `prepare` (not timed); a run counts as the lesser of its wall time and its process's
// CPU time. Ranks sharing a core take turns on it: a run long enough to span the scheduler's turns
// (PowerSGD or onebit with error feedback at 4 Mi floats, 15-30 ms) counted the other ranks' turns
// too, about twice its work for 4 ranks on 2 cores, while a short one fits in one turn and counts
// its work alone; and the cost model's host bound adds up every rank's work over the cores itself.
// CPU time above the wall time is threads of this process working at once (OpenBLAS's), which the
// wall time counts right.
double time_op(const std::function<void()>& f, const std::function<void()>& prepare = {}) {
  if (prepare) prepare();
  f();
  std::vector<double> t;
  const auto start = Clock::now();
  while (t.size() < 60 && (t.size() < 5 || seconds_since(start) < 0.003)) {
    if (prepare) prepare();
    const double cpu0 = kit::process_cpu_seconds();
    const auto t0 = Clock::now();
    f();
    const double wall = seconds_since(t0);
    t.push_back(std::min(wall, kit::process_cpu_seconds() - cpu0));
  }
  return planner::median(std::move(t));
}

constexpr int kSlowdownThreads = 4;  // the engine's default worker count
constexpr int kProbePartitions = 8;

// Memory the size of several of the largest tensors measured, zeroed, as huge pages where the
// kernel offers them (first touches of 4 KiB pages would dominate otherwise; kit/memory.h).
using Arena = kit::PageArray<float>;

// A tensor reaches the engine just written (by the backward pass, by a benchmark's copy of its
// input): up to this size its partitions are still in the cache when the codec reads them.
// Measured in an allreduce on 2 ranks (fp16, allgather, 1 MiB, TERSE_TRACE): encode 0.17 ns an
// element against 0.33-0.40 from windows not in the cache, and the allreduce 0.47-0.60 ms
// where the model priced it at 0.72-0.86.
constexpr std::size_t kWrittenBytes = std::size_t{4} << 20;

// A codec's cost per element grows at most 3.6x from one measured size to the next (8x the
// elements) as its data leave the cache (onebit's decode from 512 Ki to 4 Mi
// floats); points above this factor were disturbed: 6.1x (onebit's encode at 4 Mi floats, 6.0 ns
// an element against 1.8-2.1 elsewhere), 13.8x, 29x and 92x in earlier calibrations here.
constexpr double kImplausibleStep = 5;

// Runs the CPU measurements in lockstep with the other ranks (a barrier before each series),
// so that every series is measured under the load of all ranks of the host. Each call reads
// and writes the next window of arenas four times the largest size, so that no run finds the
// one before it in the cache; a window up to kWrittenBytes is read before its run (not timed),
// as the application's writes leave a small tensor, and a larger one comes from memory.
class CpuMeter {
 public:
  CpuMeter(Communicator* comm, std::size_t max_elements)
      : comm_(comm),
        arena_elements_(4 * std::max<std::size_t>(max_elements, 4096)),
        x_(arena_elements_),
        y_(arena_elements_) {
    for (std::size_t n = 1024; n <= std::max<std::size_t>(max_elements, 8192); n *= 8) {
      sizes_.push_back(n);
    }
    const std::vector<float> g =
        gradient(std::size_t{1} << 16);  // tiled: only its statistics matter
    for (std::size_t at = 0; at < arena_elements_; at += g.size()) {
      std::copy_n(g.begin(), std::min(g.size(), arena_elements_ - at), x_.all().begin() + at);
    }
  }

  const std::vector<std::size_t>& sizes() const { return sizes_; }
  // How many windows of n elements the arenas hold.
  std::size_t windows(std::size_t n) const { return arena_elements_ / std::max<std::size_t>(n, 1); }
  // Moves every window on by n elements (wrapping at the arena's end).
  void advance(std::size_t n) {
    at_ += n;
    if (at_ + n > arena_elements_) at_ = 0;
  }
  std::span<const float> x(std::size_t n) const { return x_.all().subspan(at_, n); }
  std::span<float> y(std::size_t n) { return y_.all().subspan(at_, n); }
  // Reads the windows of n elements (not timed): brings them into the cache.
  void touch(std::size_t n) { sink_ = kit::sum(x(n)) + kit::sum(y(n)); }

  // One time per size: f(n) timed by time_op, agreed over the ranks (their median); `times`
  // collects them in order. A size whose cost per element is implausible against its
  // neighbour's (implausible_steps) is measured again, at most twice, and keeps the lesser
  // time. Every rank decides on the same agreed times, so they measure again together.
  void series(const std::function<void(std::size_t)>& f, std::vector<double>& times) {
    auto measure = [&](std::size_t n) {
      if (comm_ != nullptr) comm_->barrier("calibration");
      return time_op([&] { f(n); },
                     [&] {
                       advance(n);
                       if (n * sizeof(float) <= kWrittenBytes) touch(n);
                     });
    };
    auto agree = [&](std::vector<double> t) {
      return comm_ != nullptr ? planner::agree_median(*comm_, std::move(t)) : t;
    };
    std::vector<double> t;
    for (std::size_t n : sizes_) t.push_back(measure(n));
    t = agree(std::move(t));
    const std::vector<double> xs(sizes_.begin(), sizes_.end());
    for (int retry = 0; retry < 2; ++retry) {
      const std::vector<std::size_t> bad = implausible_steps(xs, t, kImplausibleStep);
      if (bad.empty()) break;
      std::vector<double> again;
      for (std::size_t i : bad) again.push_back(measure(sizes_[i]));
      again = agree(std::move(again));
      for (std::size_t j = 0; j < bad.size(); ++j) t[bad[j]] = std::min(t[bad[j]], again[j]);
      measured_again_ += static_cast<int>(bad.size());
    }
    times.insert(times.end(), t.begin(), t.end());
  }
  // Sizes measured again by series().
  int measured_again() const { return measured_again_; }

 private:
  Communicator* comm_;
  std::size_t arena_elements_;
  std::vector<std::size_t> sizes_;
  Arena x_, y_;
  std::size_t at_ = 0;
  volatile double sink_ = 0;
  int measured_again_ = 0;
};

// Wall time for `threads` threads of this rank to run `iterations` encode+decode passes over n
// elements each, all at once: on free cores as long as one thread's passes, on a saturated
// machine `threads` times as long.
double parallel_work_seconds(const Codec& codec, int threads, std::size_t n, int iterations) {
  std::barrier start(threads);
  std::vector<Clock::time_point> began(threads), ended(threads);
  auto body = [&](int t) {
    std::vector<float> x = gradient(n), y(n);
    std::vector<std::byte> payload(codec.max_encoded_bytes(n));
    Workspace ws;
    auto state = codec.make_state(n);
    EncodeContext ctx;
    ctx.state = state.get();
    ctx.workspace = &ws;
    auto once = [&] {
      const std::size_t b = codec.encode(x, payload, ctx);
      codec.decode(std::span(payload).first(b), y);
    };
    once();
    start.arrive_and_wait();
    began[t] = Clock::now();
    for (int i = 0; i < iterations; ++i) once();
    ended[t] = Clock::now();
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
  body(0);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(*std::max_element(ended.begin(), ended.end()) -
                                       *std::min_element(began.begin(), began.end()))
      .count();
}

// Measures everything on the CPU side. With a communicator, ranks measure in lockstep and the
// per-point times are agreed (largest over ranks) before fitting.
void measure_cpu(Communicator* comm, const CalibrationOptions& options, Calibration& out) {
  const auto start = Clock::now();
  const int rank = comm != nullptr ? comm->rank() : 0;
  CpuMeter meter(comm, options.codec_max_elements);
  log_line(options.quiet, rank, fmt::format("  memory set up in {:.2f} s", seconds_since(start)));
  const auto& sizes = meter.sizes();
  std::vector<double> times;  // every series, concatenated

  // The strategies' fp32 work: a received chunk added to one's own (in place), a division.
  meter.series([&](std::size_t n) { kit::add_to(meter.x(n), meter.y(n), meter.y(n)); }, times);
  meter.series([&](std::size_t n) { kit::divide_to(meter.x(n), 3.0f, meter.y(n)); }, times);

  std::vector<std::unique_ptr<Codec>> codecs;
  for (const auto& spec : options.codecs) {
    auto codec = make_codec(spec);
    if (codec->name() == "none") continue;
    codecs.push_back(std::move(codec));
  }
  std::vector<std::vector<double>> encoded_bytes(codecs.size());
  Workspace ws;
  for (std::size_t c = 0; c < codecs.size(); ++c) {
    const Codec& codec = *codecs[c];
    std::vector<std::byte> payload(codec.max_encoded_bytes(sizes.back()));
    std::vector<std::byte> other(payload.size());
    // Per-tensor state (error-feedback residuals) rotates through as many copies as the input
    // arena holds windows: in training, a tensor's state is cold when its step comes round.
    std::vector<std::unique_ptr<CodecState>> states;
    std::size_t state_n = 0, turn = 0;
    std::size_t length = 0;
    // A new state is used once before it is timed: in training a tensor's state was touched in
    // the step before, and first touches of fresh pages would add the kernel's page faults
    // (several ms for the residual of a 16 MB tensor) to a cost that training never pays again.
    std::function<void(std::size_t, CodecState*)> warm;
    auto next_state = [&](std::size_t n) {
      if (state_n != n) {
        states.clear();
        for (std::size_t i = 0; i < std::clamp<std::size_t>(meter.windows(n), 1, 16); ++i) {
          states.push_back(codec.make_state(n));
          warm(n, states.back().get());
        }
        state_n = n;
      }
      return states[turn++ % states.size()].get();
    };
    if (const auto* rounds = dynamic_cast<const RoundCodec*>(&codec);
        rounds != nullptr && codec.traits().multi_round) {
      // All rounds and finish() as one rank runs them (its sum is its own contribution): the
      // sums between rounds are raw rings, which the cost model prices from the links.
      auto contribution_elements = [&](std::size_t n) {
        std::size_t total = 0;
        for (int r = 0; r < rounds->rounds(); ++r) total += rounds->round_elements(r, n);
        return total;
      };
      std::vector<float> contribution(contribution_elements(sizes.back()));
      auto all_rounds = [&](std::size_t n, CodecState* state) {
        EncodeContext ctx;
        ctx.state = state;
        ctx.workspace = &ws;
        for (int r = 0; r < rounds->rounds(); ++r) {
          std::span<float> sum = std::span(contribution).first(rounds->round_elements(r, n));
          rounds->encode_round(r, meter.x(n), sum, ctx);
          rounds->absorb_round(r, sum, ctx);
        }
        rounds->finish(meter.y(n), ctx);
      };
      warm = all_rounds;
      meter.series([&](std::size_t n) { all_rounds(n, next_state(n)); }, times);
      for (std::size_t n : sizes) {  // what one rank's contributions take on the wire
        double bytes = 0;
        for (int r = 0; r < rounds->rounds(); ++r) {
          const std::size_t m = rounds->round_elements(r, n);
          const Codec* wire = rounds->round_wire(r, n);
          bytes += static_cast<double>(wire != nullptr ? wire->max_encoded_bytes(m) : m * 4);
        }
        encoded_bytes[c].push_back(bytes);
      }
      continue;
    }
    auto encode_with = [&](std::size_t n, CodecState* state) {
      EncodeContext ctx;
      ctx.state = state;
      ctx.workspace = &ws;
      length = codec.encode(meter.x(n), payload, ctx);
    };
    warm = encode_with;
    auto encode = [&](std::size_t n) { encode_with(n, next_state(n)); };
    meter.series(encode, times);
    for (std::size_t n : sizes) {
      encode(n);
      encoded_bytes[c].push_back(static_cast<double>(length));
    }
    // Decoders read a payload of the size being timed: encode it first (not timed).
    auto decode_with = [&](DecodeMode mode) {
      return [&, mode](std::size_t n) {
        if (Codec::peek(std::span(payload).first(length)).elements != n) encode(n);
        codec.decode(std::span(payload).first(length), meter.y(n), mode);
      };
    };
    meter.series(decode_with(DecodeMode::kOverwrite), times);
    meter.series(decode_with(DecodeMode::kAccumulate), times);
    if (codec.traits().summable) {
      meter.series(
          [&](std::size_t n) {
            if (Codec::peek(std::span(payload).first(length)).elements != n) {
              encode(n);
              std::copy(payload.begin(), payload.begin() + length, other.begin());
            }
            codec.combine(std::span(payload).first(length), std::span(other).first(length));
          },
          times);
    }
  }

  log_line(options.quiet, rank,
           fmt::format("  series measured at {:.2f} s ({} sizes measured again: implausible "
                       "steps)",
                       seconds_since(start), meter.measured_again()));
  // CPU contention: encode+decode with 1, 2, 4 threads per rank at once.
  // A codec with a payload: multi-round codecs have no encode+decode pass to run.
  auto first = std::find_if(codecs.begin(), codecs.end(),
                            [](const auto& codec) { return !codec->traits().multi_round; });
  const Codec* probe = first == codecs.end() ? nullptr : first->get();
  std::unique_ptr<Codec> fallback;
  if (probe == nullptr) {
    fallback = make_codec("fp16");
    probe = fallback.get();
  }
  // About 20 ms of one thread's work, so that threads sharing a core do interleave.
  constexpr std::size_t kProbeElements = std::size_t{1} << 18;
  const double pass = parallel_work_seconds(*probe, 1, kProbeElements, 3) / 3;
  const int iterations = static_cast<int>(std::clamp(0.02 / std::max(pass, 1e-6), 4.0, 200.0));
  // Three series over 1..4 threads, each count's median kept: a spell of outside load
  // lasting one series (a trial at 4 threads is about 0.1 s) moves no figure. With two trials
  // of a count back to back, one spell had both: a calibration of 2 ranks measured x6.13 at 4
  // threads where the others measure x4.3-4.5, and priced every K >= 4 compressed allreduce
  // at 256 MiB 30-45% slow.
  constexpr int kSlowdownSeries = 3;
  std::vector<std::vector<double>> trials(kSlowdownThreads);
  for (int series = 0; series < kSlowdownSeries; ++series) {
    for (int threads = 1; threads <= kSlowdownThreads; ++threads) {
      if (comm != nullptr) comm->barrier("calibration");
      trials[threads - 1].push_back(
          parallel_work_seconds(*probe, threads, kProbeElements, iterations));
    }
  }
  for (auto& t : trials) times.push_back(planner::median(std::move(t)));

  // The median over ranks: ranks of a host share its cores and see the same costs, so a rank
  // far from the others was disturbed by something outside the job.
  log_line(options.quiet, rank,
           fmt::format("  contention measured at {:.2f} s", seconds_since(start)));
  if (comm != nullptr) times = planner::agree_median(*comm, std::move(times));

  // Unpack in the order measured.
  std::size_t at = 0;
  std::vector<double> xs(sizes.begin(), sizes.end());
  auto next_fit = [&] {
    std::vector<double> ys(times.begin() + at, times.begin() + at + sizes.size());
    at += sizes.size();
    for (auto& v : ys) v = std::max(v, 1e-9);  // a clock tick: never zero
    return fit_cost(xs, ys);
  };
  out.add = next_fit();
  out.divide = next_fit();
  out.codecs.clear();
  for (std::size_t c = 0; c < codecs.size(); ++c) {
    CodecCosts k;
    k.spec = codecs[c]->spec();
    k.summable = codecs[c]->traits().summable;
    k.multi_round = codecs[c]->traits().multi_round;
    k.encode = next_fit();
    if (!k.multi_round) {
      k.decode = next_fit();
      k.accumulate = next_fit();
    }
    if (k.summable) k.combine = next_fit();
    k.bytes = fit_linear(xs, encoded_bytes[c]);
    out.codecs.push_back(std::move(k));
  }
  out.cpu_slowdown.clear();
  for (int t = 0; t < kSlowdownThreads; ++t) {
    out.cpu_slowdown.push_back(std::max(1.0, times[at + t] / times[at]));
  }
  at += kSlowdownThreads;
}

// An engine round latency above this multiple of the links' exchange latency (plus 1 ms) is
// taken for a disturbance and measured again (calibrate()).
constexpr double kImplausibleAlpha = 4;
// The small raw probe's cost per byte at or above this share of the bulk's is a disturbance.
constexpr double kImplausibleSmallShare = 0.8;

// What a message round and the engine's own hand-offs cost inside the engine, which no formula
// knows: the engine runs three tiny allreduces, alternating rep by rep so that they share the
// machine's load: raw on 1 partition (2(N-1) message rounds), allgather of fp32 ("none", one
// round) and raw on 8 partitions. The probe engine does not gather small raw messages
// (gather_bytes 0; the default would send these raw probes in one gathered step, which made
// raw1 - allgather, and so alpha, about 0). Links and the CPU cost next to nothing at this
// size, so
//   raw1 - allgather = (2N - 3) * alpha    (the latency of a round: wake-ups, the transport)
//   allgather        = job_overhead + alpha
//   raw8 - raw1      = the model's extra time for 7 more partitions + 7 * task_overhead.
// Each figure is the median over runs of the slowest rank's time. Returns what
// measure_engine_beta does: whether the links paced its raw allreduce.
bool measure_engine(Communicator& comm, Calibration& c, AllreduceProbe& probe) {
  const int threads = probe.threads();
  constexpr std::size_t kPiece = 1024;
  std::vector<float> x(kProbePartitions * kPiece, 1.0f);
  TensorPlan raw1, gather, raw8;
  raw1.partitions = 1;
  gather.strategy = Strategy::kAllgather;
  gather.partitions = 1;
  raw8.partitions = kProbePartitions;
  const std::pair<const TensorPlan*, std::size_t> probes[] = {
      {&raw1, kPiece}, {&gather, kPiece}, {&raw8, kProbePartitions * kPiece}};
  // Each run starts after a barrier and counts as its slowest rank's time, as a collective
  // after a training step's compute is seen (and as the benchmarks measure it).
  constexpr int kReps = 15;
  std::vector<double> mine;                 // rep-major: rep * 3 + probe
  std::vector<double> cpu;                  // this process's CPU seconds, as `mine`
  for (int rep = -1; rep < kReps; ++rep) {  // rep -1: first use (the cross-rank check), buffers
    for (int i = 0; i < 3; ++i) {
      comm.barrier("calibration");
      const double cpu0 = kit::process_cpu_seconds();
      const auto t0 = Clock::now();
      probe.allreduce(fmt::format("calibration-{}", i), std::span(x).first(probes[i].second),
                      *probes[i].first);
      if (rep >= 0) {
        mine.push_back(seconds_since(t0));
        cpu.push_back(kit::process_cpu_seconds() - cpu0);
      }
    }
  }
  const auto slowest = planner::agree_max(comm, mine);
  // CPU per message: raw8 sends 7 more partitions' 2(N-1) messages than raw1 (and receives as
  // many); their elements cost next to nothing. The median over reps of each rank's
  // difference, then the median over ranks: the host bound adds up every rank's CPU, and the
  // kernel charges the network's soft interrupts to whichever thread they interrupt, so one
  // rank's figure can carry another's (the busiest rank's figure, used first, came out at 236
  // us a message on a 1 Gbit/s pair against 60-100 us elsewhere).
  std::vector<double> extra;
  for (int rep = 0; rep < kReps; ++rep) extra.push_back(cpu[rep * 3 + 2] - cpu[rep * 3]);
  const double per_message = planner::agree_median(comm, {planner::median(extra)})[0];
  c.cpu_per_message = comm.size() > 1 ? std::max(0.0, per_message) /
                                            ((kProbePartitions - 1) * 2.0 * (comm.size() - 1))
                                      : 0.0;
  std::vector<double> m(3);
  for (int i = 0; i < 3; ++i) {
    std::vector<double> t;
    for (int rep = 0; rep < kReps; ++rep) t.push_back(slowest[rep * 3 + i]);
    m[i] = planner::median(std::move(t));
  }
  const double n = comm.size();
  c.task_overhead = c.job_overhead = 0;
  if (n > 1) c.alpha = std::max(0.0, (m[0] - m[1]) / (2 * n - 3));
  c.job_overhead = std::max(
      0.0, m[1] - c.alpha - (n - 1) * (kPiece * 4.0 + Codec::kHeaderBytes) * c.beta);
  auto predict = [&](std::size_t elements, int partitions) {
    CostModel model(c);
    model.set_gather_bytes(0);  // the probe's raw partitions travel on the ring
    return model.predict(elements, "none", Strategy::kRaw, partitions, comm.size(), threads)
        .seconds;
  };
  c.task_overhead = std::max(
      0.0, (m[2] - predict(kProbePartitions * kPiece, kProbePartitions)) / (kProbePartitions - 1));
  return planner::measure_engine_beta(comm, c, probe);
}

std::vector<std::string> with_canonical_specs(const std::vector<std::string>& specs) {
  std::vector<std::string> out;
  for (const auto& s : specs) {
    const std::string c = make_codec(s)->spec();
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  }
  return out;
}

}  // namespace

namespace planner {

// The largest wall / (share x CPU) ratio of the host probe believed (see the end of
// measure_engine_beta), and the range of its process CPU over the model's CPU for it.
constexpr double kMaxHostEfficiency = 2;
constexpr double kMinCpuRatio = 0.5, kMaxCpuRatio = 2;
// A raw allreduce paced by the links moves a byte in 0.81-0.99 of the time the links' exchange
// probe measured (its slowest pair; 46 shaped calibrations of the planner's grids); below
// this fraction the probe was disturbed (twice: 0.54 and 0.61 of it, the links measured 38-46%
// slow).
constexpr double kDisturbedLinks = 0.8;
// ... and never slower than the links (at most 0.99 of their time a byte in those 46); above
// this multiple the allreduce was disturbed (once: 1.62, 100 Mbit/s, 4 ranks).
constexpr double kDisturbedEngine = 1.25;

namespace {

// The engine probe's tensor: a raw allreduce on one partition sized for about 30 ms on the
// measured links (a ring step's chunks then past a shaped link's burst), at most 4 Mi floats.
std::size_t probe_elements(int n, double beta) {
  const double per_float = 8.0 * (n - 1) / n;  // bytes each rank sends per element
  const std::size_t unit = 64 * static_cast<std::size_t>(n);
  const double wanted = 0.03 / (beta * per_float);
  return std::clamp<std::size_t>(static_cast<std::size_t>(wanted) / unit * unit,
                                 std::size_t{1} << 14, std::size_t{1} << 22);
}

// The host probe's configuration (measure_engine_beta): the first calibrated codec that sends
// a payload, sharded on two partitions. Null where none was calibrated.
const CodecCosts* host_probe_codec(const Calibration& c) {
  const auto it = std::find_if(c.codecs.begin(), c.codecs.end(),
                               [](const CodecCosts& k) { return !k.multi_round; });
  return it == c.codecs.end() ? nullptr : &*it;
}
constexpr int kHostProbePartitions = 2;

}  // namespace

bool measure_engine_beta(Communicator& comm, Calibration& c, AllreduceProbe& probe) {
  c.engine_beta = 0;
  c.engine_link = LinearFit{};
  c.transport_cpu = LinearFit{};
  c.host_efficiency = 1;
  c.host_cpu_ratio = 1;
  const int n = comm.size();
  if (n == 1 || c.beta <= 0) return false;
  const double per_float = 8.0 * (n - 1) / n;  // bytes each rank sends per element
  const std::size_t unit = 64 * static_cast<std::size_t>(n);
  const std::size_t elements = probe_elements(n, c.beta);
  // A second size, a sixteenth, for the transport's CPU while its copies stay in the cache.
  const std::size_t small = std::max(unit, elements / 16 / unit * unit);
  std::vector<float> x(elements, 1.0f);
  // `reps` runs of one allreduce back to back, as a tensor's allreduces come, after `warm`
  // untimed ones: this rank's wall and process CPU seconds per run, appended to `r`. A size's
  // first warm-up is the first use (the cross-rank check, buffers); then one run per worker
  // thread, whose scratch memory is touched on its first task of a size (page faults, which
  // count as CPU and which later allreduces do not pay).
  struct Runs {
    std::vector<double> wall, cpu;
  };
  auto time_runs = [&](Runs& r, const char* name, std::size_t n_elements, const TensorPlan& o,
                       int warm, int reps) {
    for (int rep = -warm; rep < reps; ++rep) {
      comm.barrier("calibration");
      const double cpu0 = kit::process_cpu_seconds();
      const auto t0 = Clock::now();
      probe.allreduce(name, std::span(x).first(n_elements), o);
      if (rep < 0) continue;
      r.wall.push_back(seconds_since(t0));
      r.cpu.push_back(kit::process_cpu_seconds() - cpu0);
    }
  };
  TensorPlan raw;
  raw.partitions = 1;
  // Three series, each the small size's runs and then the bulk's, and every figure the median
  // of all its runs: a spell of load from outside the job that lasts one series moves none of
  // them. The bulk's runs once went back to back in one series of 5, and one spell could
  // carry the engine's byte with it: 4 ranks on loopback measured 3.03 ns/B in one grid's
  // calibration against 1.12 in the previous grid's (1.56-2.56 in three `terse calibrate`
  // runs of the idle machine), and the grid's 256 MiB allreduces came out predicted up to 64%
  // slow. Each size's runs stay back to back (the bulk's copies would evict the small one's
  // from the cache between runs), after their own warm-up: the small probe right after the
  // bulk's series, warmed up as the first, measured what it did first (2 and 4 ranks on
  // loopback: series medians within 0.8-1.2x of the first's outside a spell). In the later
  // series the bulk's workers have touched their memory: one warm-up run. The small's runs
  // take a millisecond or less where the cores pace the links, so it gets more of them.
  constexpr int kSeries = 3, kReps = 3, kSmallReps = 5;
  Runs small_runs, bulk;
  for (int series = 0; series < kSeries; ++series) {
    time_runs(small_runs, "calibration-small", small, raw, 1 + probe.threads(), kSmallReps);
    time_runs(bulk, "calibration-bulk", elements, raw, series == 0 ? 1 + probe.threads() : 1,
              kReps);
  }
  const double measured = planner::median(planner::agree_max(comm, bulk.wall));
  const double measured_small = planner::median(planner::agree_max(comm, small_runs.wall));
  // Each rank's median run, then the median over ranks (as cpu_per_message, measure_engine).
  const std::vector<double> run_cpu = planner::agree_median(
      comm, {planner::median(std::move(bulk.cpu)), planner::median(std::move(small_runs.cpu))});
  Calibration no_bytes = c;
  no_bytes.beta = 0;
  no_bytes.engine_beta = 0;
  no_bytes.transport_cpu = LinearFit{};
  CostModel model(no_bytes);
  model.set_gather_bytes(0);
  auto predict = [&](std::size_t n_elements) {
    return model.predict(n_elements, "none", Strategy::kRaw, 1, n, probe.threads());
  };
  const Prediction other = predict(elements);
  const double bytes = per_float * static_cast<double>(elements);
  const double bulk_link = std::max(0.0, measured - other.seconds);  // the bulk's link time
  c.engine_beta = bulk_link / bytes;
  // What the adds, the division and the messages do not explain is the transport's: the copies
  // into and out of the kernel on both ends (the small probe takes a millisecond or more of
  // CPU).
  const double messages = 2.0 * (n - 1) * c.cpu_per_message;
  const double small_bytes = per_float * static_cast<double>(small);
  const double small_cpu = std::max(0.0, run_cpu[1] - predict(small).cpu - messages);
  const double bulk_cpu = std::max(0.0, run_cpu[0] - other.cpu - messages);
  LinearFit& t = c.transport_cpu;
  t.b = small_cpu / small_bytes;
  // The small probe's residual is a fraction of a millisecond; on 4 ranks on 2 cores under
  // AddressSanitizer it once came out below the model's CPU for the probe, which
  // would price the transport's bytes in the cache at nothing. They cost CPU there too: at
  // most what they cost out of it, so such a probe takes the bulk's rate.
  if (t.b <= 0 && bytes > 0) t.b = bulk_cpu / bytes;
  if (bytes > small_bytes) {
    t.knee = small_bytes;
    t.b2 = std::max(0.0, bulk_cpu - t.b * small_bytes) / (bytes - small_bytes);
  }
  t.xs = {small_bytes, bytes};
  t.ys = {small_cpu, bulk_cpu};
  t.points = 2;
  // Where the ranks share the cores, the probe's wall time over its CPU work spread on the
  // cores is how well the ranks keep the cores busy while they wait on each other's sends:
  // 1.08-1.42 for 2 and 4 ranks on 2 cores on loopback here. A ratio above 2 means the cores
  // idled most of the probe: a link (shaped, or another machine's) set its pace, not the cores,
  // and the bound has nothing to learn from it (2 ranks: 7.6 at 1 Gbit/s, 42 at 100 Mbit/s).
  // The bare exchange's beta cannot tell the two apart: on loopback it is the cores' copies too.
  const double share = c.host_share();
  const double ratio = run_cpu[0] > 0 ? measured / (share * run_cpu[0]) : 0;
  // Paced by the links: the cores (this rank's share of them) idled most of the probe.
  const bool paced =
      run_cpu[0] > 0 && measured > kMaxHostEfficiency * std::max(1.0, share) * run_cpu[0];
  // Not paced by the links: the engine's own byte at both sizes (engine_link). The small
  // probe's copies stay in the cache: on 2 ranks bound to 2 cores a 1 MiB raw allreduce moved
  // its bytes at about 0.33 ns/B, while the bulk probe (16 MiB) and the bare exchange priced
  // them at 0.6-1.2, which over-predicted raw and fp16 there by 32-69%.
  const double small_link = std::max(0.0, measured_small - predict(small).seconds);
  if (!paced && bytes > small_bytes && small_link > 0) {
    LinearFit& l = c.engine_link;
    l.b = small_link / small_bytes;
    l.knee = small_bytes;
    // Out of the cache a byte costs at least what it did in it (the two probes' noise aside).
    l.b2 = std::max(l.b, (bulk_link - small_link) / (bytes - small_bytes));
    l.xs = {small_bytes, bytes};
    l.ys = {small_link, bulk_link};
    l.points = 2;
  }
  if (share < 1) return paced;
  // The raw probe's ratio is not a compressed allreduce's: there the codec's work fills the
  // cores while the ranks wait on each other's sends (2 and 4 ranks on 2 cores, 16 MiB:
  // 1.17-1.22 for raw, 0.92-1.15 for fp16 and onebit, sharded, allgather and ring, K = 1 and
  // 4), and the planner's choices are between compressed configurations. So the factor is
  // measured again on the first calibrated codec that sends a payload, sharded on two
  // partitions, the same elements (fewer bytes than the raw probe's on any link); the raw
  // probe's ratio stands where no codec was calibrated.
  const bool links_paced_raw = ratio > kMaxHostEfficiency;
  // With a core to each rank and a link setting the pace, the factor is 1 whatever the
  // compressed probe measures (below): not run.
  if (links_paced_raw && share <= 1) return paced;
  const CodecCosts* codec = host_probe_codec(c);
  if (codec == nullptr) {
    if (!links_paced_raw) c.host_efficiency = std::max(1.0, ratio);
    return paced;
  }
  TensorPlan compressed;
  compressed.codec = codec->spec;
  compressed.strategy = Strategy::kSharded;
  compressed.partitions = kHostProbePartitions;
  // The bound multiplies the model's CPU, not the process's: the factor is the probe's wall
  // time over the model's CPU for the same allreduce (times the share), so that the bound
  // prices the probe at what it took. On 2 ranks on 2 cores the two CPU figures nearly agree
  // (model / process 0.83-1.04); on 4 the model counted 0.58-0.88 of the process's CPU (its
  // fits time each operation on a 2 MiB shard in the cache, while 4 ranks on 2 cores, each
  // through a 16 MiB tensor, evict each other's), and unshaped 4-rank points ran a median
  // 20-32% slower than predicted at every size with the process's CPU. The ratio of the two is
  // believed between kMinCpuRatio and kMaxCpuRatio; beyond, the fits are off by more than one
  // factor should stand for, and the process's CPU is used as before. It is used only where
  // ranks outnumber the cores: with a core to each rank (2 ranks bound to 2 cores) the ranks
  // do not evict each other's caches, and there the ratio (1.23) made the predictions worse
  // (median error 15-23% -> 18-37%) where it made the 4-rank ones better (23-40% -> 13-18%).
  CostModel model_now(c);
  model_now.set_gather_bytes(0);
  const double model_cpu = model_now
                               .predict(elements, codec->spec, Strategy::kSharded,
                                        kHostProbePartitions, n, probe.threads())
                               .host_cpu;
  // Two series of runs, the lesser factor kept: a burst of work from outside the job during
  // one raises its wall time and not the job's CPU (2 ranks on loopback: the wall over
  // the process's CPU came out at 1.68, against 1.05-1.38 in every other calibration of the
  // idle machine, and the point was over-predicted by a median 36%).
  constexpr int kCompressedReps = 7, kHostSeries = 2;
  c.host_efficiency = 0;
  for (int series = 0; series < kHostSeries; ++series) {
    Runs host;
    time_runs(host, "calibration-host", elements, compressed, 1 + probe.threads(),
              kCompressedReps);
    const double wall = planner::median(planner::agree_max(comm, host.wall));
    const double cpu = planner::agree_median(comm, {planner::median(std::move(host.cpu))})[0];
    const double host_ratio = cpu > 0 ? wall / (share * cpu) : 0;
    const double cpu_ratio = model_cpu > 0 ? cpu / model_cpu : 0;
    const double believed =
        cpu_ratio >= kMinCpuRatio && cpu_ratio <= kMaxCpuRatio ? cpu_ratio : 1.0;
    const double used = share > 1 ? believed : 1.0;
    // Where a link set either probe's pace, the cores idled for it, and the wall time says
    // nothing about how busy ranks keep them: the bound is then the CPU alone, the process's.
    const bool idle_unknown = links_paced_raw || host_ratio > kMaxHostEfficiency;
    const double factor = std::max(1.0, (idle_unknown ? 1.0 : host_ratio) * used);
    if (series == 0 || factor < c.host_efficiency) {
      c.host_efficiency = factor;
      c.host_cpu_ratio = believed;
    }
  }
  return paced;
}

void check_link_probes(Communicator& comm, const CalibrationOptions& options, Calibration& c,
                       bool paced, AllreduceProbe& probe) {
  if (!paced || c.engine_beta <= 0) return;
  if (c.engine_beta > kDisturbedEngine * c.beta) {
    Calibration again = c;
    measure_engine_beta(comm, again, probe);
    log_line(options.quiet, comm.rank(),
             fmt::format("a raw allreduce moved {:.1f} MB/s over links measured at {:.1f} MB/s; "
                         "measured again: {:.1f} MB/s",
                         1e-6 / c.engine_beta, 1e-6 / c.beta,
                         again.engine_beta > 0 ? 1e-6 / again.engine_beta : 0.0));
    if (again.engine_beta > 0 && again.engine_beta < c.engine_beta) c = std::move(again);
    return;
  }
  if (c.engine_beta >= kDisturbedLinks * c.beta) return;
  Calibration again = c;
  measure_links(comm, options, again);
  log_line(options.quiet, comm.rank(),
           fmt::format("a raw allreduce moved {:.1f} MB/s over links measured at {:.1f} MB/s; "
                       "links measured again: {:.1f} MB/s",
                       1e-6 / c.engine_beta, 1e-6 / c.beta, 1e-6 / again.beta));
  if (again.beta >= c.beta) return;
  c.beta = again.beta;
  c.peer_beta = std::move(again.peer_beta);
  c.peer_alpha = std::move(again.peer_alpha);
  measure_engine_beta(comm, c, probe);
}

}  // namespace planner

double engine_probe_disturbance(const Calibration& c, double link_latency) {
  double worst = 0;
  if (link_latency > 0) worst = c.alpha / (kImplausibleAlpha * link_latency + 1e-3);
  const bool own_cores = c.ranks_on_host <= c.cores;  // the most ranks, the fewest cores
  if (own_cores && c.engine_link.points >= 2 && c.engine_beta > 0) {
    worst = std::max(worst, c.engine_link.b / (kImplausibleSmallShare * c.engine_beta));
  }
  return worst;
}

Calibration calibrate(Communicator& comm, const CalibrationOptions& options_in,
                      const MakeAllreduceProbe& make_probe) {
  CalibrationOptions options = options_in;
  options.codecs = with_canonical_specs(options.codecs);
  const auto start = Clock::now();
  Calibration c;
  c.host = host_name();
  c.world_size = comm.size();
  const transport::MachineShare share = transport::machine_share(comm);
  // The codecs are measured with OpenBLAS's threads as the engine will set them.
  kit::blas_limit_threads(share.cores_per_rank);
  c.ranks_on_host = share.most_ranks_on_host;
  c.cores = share.fewest_cores;
  if (options.measure_links) {
    planner::measure_links(comm, options, c);
    log_line(options.quiet, comm.rank(),
             fmt::format("links measured in {:.2f} s", seconds_since(start)));
  }
  const auto cpu_start = Clock::now();
  measure_cpu(&comm, options, c);
  log_line(options.quiet, comm.rank(),
           fmt::format("codecs measured in {:.2f} s", seconds_since(cpu_start)));
  const std::unique_ptr<AllreduceProbe> probe = make_probe(comm);
  bool paced = measure_engine(comm, c, *probe);
  // alpha is a difference of two medians of short runs, so a burst of load from outside the
  // job during the probe can inflate it tenfold (seen once in the planner's accuracy grid:
  // 2.5 ms against 0.2 ms in every other calibration of the same links), and every small
  // tensor's prediction with it. A round inside the engine costs the links' exchange latency
  // plus thread wake-ups; far above that, measure again (at most twice) and keep the run with
  // the least alpha. Every rank takes the same branch: alpha and peer_alpha are agreed.
  double link_latency = 0;
  for (const auto& row : c.peer_alpha) {
    for (double a : row) link_latency = std::max(link_latency, a);
  }
  // The same for the small raw probe's byte cost on links the cores pace, which such a burst
  // raises to the bulk's (engine_probe_disturbance). Both figures are agreed over the ranks,
  // and so are the machine share's counts it reads.
  auto disturbance = [&](const Calibration& x) {
    return engine_probe_disturbance(x, link_latency);
  };
  for (int retry = 0; retry < 2 && disturbance(c) > 1; ++retry) {
    Calibration again = c;
    const bool paced_again = measure_engine(comm, again, *probe);
    log_line(options.quiet, comm.rank(),
             fmt::format("engine probe looks disturbed (round latency {:.1f} us against the "
                         "links' {:.1f} us; small allreduce {:.3f} ns/B against the bulk's "
                         "{:.3f}); measured again: {:.1f} us, {:.3f} ns/B",
                         c.alpha * 1e6, link_latency * 1e6, c.engine_link.b * 1e9,
                         c.engine_beta * 1e9, again.alpha * 1e6, again.engine_link.b * 1e9));
    if (disturbance(again) < disturbance(c)) {
      c = again, paced = paced_again;
    }
  }
  if (options.measure_links) planner::check_link_probes(comm, options, c, paced, *probe);
  c.seconds = planner::agree_max(comm, {seconds_since(start)})[0];
  log_line(options.quiet, comm.rank(), fmt::format("done in {:.2f} s", c.seconds));
  return c;
}

Calibration calibrate_local(const CalibrationOptions& options_in, int world_size, int ranks_on_host,
                            const MakeAllreduceProbe& make_probe) {
  CalibrationOptions options = options_in;
  options.codecs = with_canonical_specs(options.codecs);
  const auto start = Clock::now();
  Calibration c;
  c.host = host_name();
  c.world_size = world_size;
  c.cores = kit::usable_cores();
  c.ranks_on_host = std::max(1, ranks_on_host);
  kit::blas_limit_threads(c.cores / c.ranks_on_host);  // as the job's engines will
  measure_cpu(nullptr, options, c);
  {
    // The engine's fixed costs, on a job of this one process.
    const auto dir = std::filesystem::temp_directory_path() /
                     fmt::format("terse-calibrate-{}-{}", ::getpid(), fnv1a64(c.host));
    auto comm = Communicator::create(0, 1, make_file_store(dir.string()));
    measure_engine(*comm, c, *make_probe(*comm));
    comm.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  // Alone, this process cannot feel the other ranks of its host: assume they share the cores
  // evenly (a measured calibration from `terse calibrate` under the real launcher is better).
  // The codec costs stay as measured: they are a rank's work, not its turns on shared cores
  // (time_op), and the cost model's host bound adds up the ranks' work over the cores.
  for (int t = 1; t <= static_cast<int>(c.cpu_slowdown.size()); ++t) {
    c.cpu_slowdown[t - 1] = c.saturation(t);
  }
  c.seconds = seconds_since(start);
  return c;
}

}  // namespace terse
