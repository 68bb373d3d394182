// Calibration (calibration.h): the record's derived figures, and calibrate() and
// calibrate_local(), which run the measurements in order: the links (link_probes.cpp), the CPU
// (cpu_meter.cpp), the engine (engine_probes.cpp), each measured again where it looks disturbed.
// Fitting is fit.cpp's; agreement across ranks agreement.cpp's; the cache calibration_cache.cpp's.
#include "planner/calibration.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "kit/blas.h"
#include "kit/hash.h"
#include "kit/host.h"
#include "planner/exchange.h"
#include "planner/measuring.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "transport/machine_share.h"

namespace terse {

void planner::log_line(bool quiet, int rank, const std::string& line) {
  if (!quiet && rank == 0) std::fprintf(stderr, "terse calibrate: %s\n", line.c_str());
}

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

std::vector<int> direct_reads_of(const std::vector<std::int64_t>& direct_pid, int size) {
  std::vector<int> out(static_cast<std::size_t>(size), 0);
  bool any = false;
  for (std::size_t i = 0; i < out.size() && i < direct_pid.size(); ++i) {
    out[i] = direct_pid[i] != 0;
    any = any || out[i] != 0;
  }
  return any ? out : std::vector<int>{};
}

LinkClasses link_classes(const Calibration& c, const std::vector<int>& host_of) {
  const std::size_t n = host_of.size();
  double slowest_alpha = 0, slowest_beta = 0;
  const bool covered = n > 1 && c.peer_alpha.size() == n && c.peer_beta.size() == n;
  LinkClasses out;
  if (covered) {
    for (std::size_t i = 0; i < n; ++i) {
      if (c.peer_alpha[i].size() != n || c.peer_beta[i].size() != n) return link_classes(c, {});
      for (std::size_t j = i + 1; j < n; ++j) {
        // A link runs both ways at once in the probes; the slower direction is the pair's.
        const double a = std::max(c.peer_alpha[i][j], c.peer_alpha[j][i]);
        const double b = std::max(c.peer_beta[i][j], c.peer_beta[j][i]);
        slowest_alpha = std::max(slowest_alpha, a);
        slowest_beta = std::max(slowest_beta, b);
        LinkClass& k = host_of[i] == host_of[j] ? out.intra : out.cross;
        ++k.pairs;
        k.pair_alpha = std::max(k.pair_alpha, a);
        k.pair_beta = std::max(k.pair_beta, b);
      }
    }
  }
  // The engine's round latency (alpha) is measured on the job's slowest links; a class whose
  // slowest exchange is sooner has rounds that much sooner (what the engine adds, wake-ups and
  // hand-offs, is the same on every link). The slowest class keeps alpha itself, so that two
  // alike classes price as the flat model does.
  for (LinkClass* k : {&out.intra, &out.cross}) {
    if (k->pairs == 0) {
      k->alpha = c.alpha;
      k->scale = 1;
      continue;
    }
    k->alpha = std::max(0.0, c.alpha - (slowest_alpha - k->pair_alpha));
    k->scale = slowest_beta > 0 ? std::min(1.0, k->pair_beta / slowest_beta) : 1.0;
  }
  return out;
}

namespace {

using planner::Clock;
using planner::log_line;
using planner::seconds_since;

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return "unknown";
  return host;
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

Calibration calibrate(Communicator& comm, const CalibrationOptions& options_in,
                      const MakeAllreduceProbe& make_probe) {
  CalibrationOptions options = options_in;
  options.codecs = with_canonical_specs(options.codecs);
  const auto start = Clock::now();
  Calibration c;
  c.host = host_name();
  c.world_size = comm.size();
  if (static_cast<int>(options.host_of.size()) == comm.size()) c.host_of = options.host_of;
  c.direct_reads = direct_reads_of(options.direct_pid, comm.size());
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
  planner::measure_cpu(&comm, options, c);
  log_line(options.quiet, comm.rank(),
           fmt::format("codecs measured in {:.2f} s", seconds_since(cpu_start)));
  const std::unique_ptr<AllreduceProbe> probe = make_probe(comm);
  bool paced = planner::measure_engine(comm, c, *probe);
  // alpha is a difference of two medians of short runs, so a burst of load from outside the
  // job during the probe can inflate it tenfold, and every small tensor's prediction with it. A
  // round inside the engine costs the links' exchange latency plus thread wake-ups; far above that,
  // measure again (at most twice) and keep the run with the least alpha. Every rank takes the same
  // branch: alpha and peer_alpha are agreed.
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
    const bool paced_again = planner::measure_engine(comm, again, *probe);
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
  planner::measure_cpu(nullptr, options, c);
  {
    // The engine's fixed costs, on a job of this one process.
    const auto dir = std::filesystem::temp_directory_path() /
                     fmt::format("terse-calibrate-{}-{}", ::getpid(), fnv1a64(c.host));
    auto comm = Communicator::create(0, 1, make_file_store(dir.string()));
    planner::measure_engine(*comm, c, *make_probe(*comm));
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
