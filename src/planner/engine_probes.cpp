// Engine probes (measuring.h, exchange.h): allreduces run through the engine, timed, to learn
// what a bare exchange does not show: the round latency with the engine's wake-ups, its fixed
// costs per task and per allreduce, its CPU per message, its own cost per byte, and how well
// ranks sharing the cores keep them busy.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "kit/cpu_time.h"
#include "planner/cost_model.h"
#include "planner/exchange.h"
#include "planner/measuring.h"
#include "terse/codec.h"
#include "terse/communicator.h"

namespace terse::planner {

namespace {

constexpr int kProbePartitions = 8;

// An engine round latency above this multiple of the links' exchange latency (plus 1 ms) is
// taken for a disturbance and measured again (calibrate()).
constexpr double kImplausibleAlpha = 4;
// The small raw probe's cost per byte at or above this share of the bulk's is a disturbance.
constexpr double kImplausibleSmallShare = 0.8;

// The largest wall / (share x CPU) ratio of the host probe believed (measure_host_efficiency):
// above it the cores idled most of the probe, a link set its pace.
constexpr double kMaxHostEfficiency = 2;
// The range of the host probe's process CPU over the model's CPU for it that is believed.
constexpr double kMinCpuRatio = 0.5, kMaxCpuRatio = 2;
// A raw allreduce paced by the links moves a byte in a little less than the time the links'
// exchange probe measured (its slowest pair); below this fraction the links' probe was
// disturbed.
constexpr double kDisturbedLinks = 0.8;
// ... and never slower than the links; above this multiple the allreduce was disturbed.
constexpr double kDisturbedEngine = 1.25;

// The engine probe's tensor: a raw allreduce on one partition sized for about 30 ms on the
// measured links (a ring step's chunks then past a shaped link's burst), at most 4 Mi floats.
std::size_t probe_elements(int n, double beta) {
  const double per_float = 8.0 * (n - 1) / n;  // bytes each rank sends per element
  const std::size_t unit = 64 * static_cast<std::size_t>(n);
  const double wanted = 0.03 / (beta * per_float);
  return std::clamp<std::size_t>(static_cast<std::size_t>(wanted) / unit * unit,
                                 std::size_t{1} << 14, std::size_t{1} << 22);
}

// The host probe's configuration (measure_host_efficiency): the first calibrated codec that
// sends a payload, sharded on two partitions. Null where none was calibrated.
const CodecCosts* host_probe_codec(const Calibration& c) {
  const auto it = std::find_if(c.codecs.begin(), c.codecs.end(),
                               [](const CodecCosts& k) { return !k.multi_round; });
  return it == c.codecs.end() ? nullptr : &*it;
}
constexpr int kHostProbePartitions = 2;

// This rank's wall and process CPU seconds per run of an allreduce.
struct Runs {
  std::vector<double> wall, cpu;
};

// `reps` runs of one allreduce of x back to back, as a tensor's allreduces come, after `warm`
// untimed ones, appended to `r`. A size's first warm-up is the first use (the cross-rank
// check, buffers); then one run per worker thread, whose scratch memory is touched on its
// first task of a size (page faults, which count as CPU and which later allreduces do not pay).
void time_runs(Communicator& comm, AllreduceProbe& probe, Runs& r, const char* name,
               std::span<float> x, const TensorPlan& plan, int warm, int reps) {
  for (int rep = -warm; rep < reps; ++rep) {
    comm.barrier("calibration");
    const double cpu0 = kit::process_cpu_seconds();
    const auto t0 = Clock::now();
    probe.allreduce(name, x, plan);
    if (rep < 0) continue;
    r.wall.push_back(seconds_since(t0));
    r.cpu.push_back(kit::process_cpu_seconds() - cpu0);
  }
}

// The raw probe at two sizes: the bulk (`elements`) and `small`, its sixteenth.
struct RawProbe {
  double wall = 0, small_wall = 0;  // the median of the slowest rank's runs
  double cpu = 0, small_cpu = 0;    // each rank's median run, then the median over ranks
};

// Three series, each the small size's runs and then the bulk's, and every figure the median
// of all its runs: a spell of load from outside the job that lasts one series moves none of
// them. Each size's runs stay back to back (the bulk's copies would evict the small one's from
// the cache between runs), after their own warm-up. In the later series the bulk's workers have
// touched their memory: one warm-up run. The small's runs take a millisecond or less where the
// cores pace the links, so it gets more of them.
RawProbe run_raw_probe(Communicator& comm, AllreduceProbe& probe, std::span<float> x,
                       std::size_t small) {
  TensorPlan raw;
  raw.partitions = 1;
  constexpr int kSeries = 3, kReps = 3, kSmallReps = 5;
  Runs small_runs, bulk;
  for (int series = 0; series < kSeries; ++series) {
    time_runs(comm, probe, small_runs, "calibration-small", x.first(small), raw,
              1 + probe.threads(), kSmallReps);
    time_runs(comm, probe, bulk, "calibration-bulk", x, raw,
              series == 0 ? 1 + probe.threads() : 1, kReps);
  }
  RawProbe out;
  out.wall = median(agree_max(comm, bulk.wall));
  out.small_wall = median(agree_max(comm, small_runs.wall));
  const std::vector<double> run_cpu =
      agree_median(comm, {median(std::move(bulk.cpu)), median(std::move(small_runs.cpu))});
  out.cpu = run_cpu[0];
  out.small_cpu = run_cpu[1];
  return out;
}

// How much longer than the model's CPU work over the cores a compressed allreduce takes
// (Calibration::host_efficiency), measured on the first calibrated codec that sends a payload,
// sharded on two partitions, the same elements as the raw probe: the raw probe's ratio is not
// a compressed allreduce's (there the codec's work fills the cores while the ranks wait on each
// other's sends), and the planner's choices are between compressed configurations.
// `links_paced_raw`: a link set the raw probe's pace.
void measure_host_efficiency(Communicator& comm, Calibration& c, AllreduceProbe& probe,
                             std::span<float> x, const CodecCosts& codec, bool links_paced_raw) {
  const int n = comm.size();
  const double share = c.host_share();
  TensorPlan compressed;
  compressed.codec = codec.spec;
  compressed.strategy = Strategy::kSharded;
  compressed.partitions = kHostProbePartitions;
  // The bound multiplies the model's CPU, not the process's: the factor is the probe's wall
  // time over the model's CPU for the same allreduce (times the share), so that the bound
  // prices the probe at what it took. Where ranks outnumber the cores they evict each other's
  // caches and the model's fits (each operation timed alone, in the cache) count less than
  // the process's CPU; the ratio of the two is believed between kMinCpuRatio and kMaxCpuRatio
  // (beyond, the fits are off by more than one factor should stand for). With a core to each
  // rank the ranks do not evict each other's caches: there it is left out (1).
  CostModel model_now(c);
  model_now.set_gather_bytes(0);
  const double model_cpu = model_now
                               .predict(x.size(), codec.spec, Strategy::kSharded,
                                        kHostProbePartitions, n, probe.threads())
                               .host_cpu;
  // Two series of runs, the lesser factor kept: a burst of work from outside the job during
  // one raises its wall time and not the job's CPU.
  constexpr int kCompressedReps = 7, kHostSeries = 2;
  c.host_efficiency = 0;
  for (int series = 0; series < kHostSeries; ++series) {
    Runs host;
    time_runs(comm, probe, host, "calibration-host", x, compressed, 1 + probe.threads(),
              kCompressedReps);
    const double wall = median(agree_max(comm, host.wall));
    const double cpu = agree_median(comm, {median(std::move(host.cpu))})[0];
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
}

}  // namespace

// What a message round and the engine's own hand-offs cost inside the engine, which no formula
// knows: the engine runs three tiny allreduces, alternating rep by rep so that they share the
// machine's load: raw on 1 partition (2(N-1) message rounds), allgather of fp32 ("none", one
// round) and raw on 8 partitions. The probe engine does not gather small raw messages
// (gather_bytes 0: gathered in one step, raw1 - allgather, and so alpha, would be about 0).
// Links and the CPU cost next to nothing at this size, so
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
  const auto slowest = agree_max(comm, mine);
  // CPU per message: raw8 sends 7 more partitions' 2(N-1) messages than raw1 (and receives as
  // many); their elements cost next to nothing. The median over reps of each rank's
  // difference, then the median over ranks: the host bound adds up every rank's CPU, and the
  // kernel charges the network's soft interrupts to whichever thread they interrupt, so one
  // rank's figure can carry another's.
  std::vector<double> extra;
  for (int rep = 0; rep < kReps; ++rep) extra.push_back(cpu[rep * 3 + 2] - cpu[rep * 3]);
  const double per_message = agree_median(comm, {median(extra)})[0];
  c.cpu_per_message = comm.size() > 1 ? std::max(0.0, per_message) /
                                            ((kProbePartitions - 1) * 2.0 * (comm.size() - 1))
                                      : 0.0;
  std::vector<double> m(3);
  for (int i = 0; i < 3; ++i) {
    std::vector<double> t;
    for (int rep = 0; rep < kReps; ++rep) t.push_back(slowest[rep * 3 + i]);
    m[i] = median(std::move(t));
  }
  const double n = comm.size();
  c.task_overhead = c.job_overhead = 0;
  if (n > 1) c.alpha = std::max(0.0, (m[0] - m[1]) / (2 * n - 3));
  c.job_overhead =
      std::max(0.0, m[1] - c.alpha - (n - 1) * (kPiece * 4.0 + Codec::kHeaderBytes) * c.beta);
  auto predict = [&](std::size_t elements, int partitions) {
    CostModel model(c);
    model.set_gather_bytes(0);  // the probe's raw partitions travel on the ring
    return model.predict(elements, "none", Strategy::kRaw, partitions, comm.size(), threads)
        .seconds;
  };
  c.task_overhead = std::max(
      0.0, (m[2] - predict(kProbePartitions * kPiece, kProbePartitions)) / (kProbePartitions - 1));
  return measure_engine_beta(comm, c, probe);
}

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
  const RawProbe raw = run_raw_probe(comm, probe, x, small);
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
  const double bulk_link = std::max(0.0, raw.wall - other.seconds);  // the bulk's link time
  c.engine_beta = bulk_link / bytes;
  // What the adds, the division and the messages do not explain is the transport's: the copies
  // into and out of the kernel on both ends.
  const double messages = 2.0 * (n - 1) * c.cpu_per_message;
  const double small_bytes = per_float * static_cast<double>(small);
  const double small_cpu = std::max(0.0, raw.small_cpu - predict(small).cpu - messages);
  const double bulk_cpu = std::max(0.0, raw.cpu - other.cpu - messages);
  LinearFit& t = c.transport_cpu;
  t.b = small_cpu / small_bytes;
  // The small probe's residual is a fraction of a millisecond and can come out below the
  // model's CPU for it, which would price the transport's bytes in the cache at nothing. They
  // cost CPU there too: at most what they cost out of it, so such a probe takes the bulk's rate.
  if (t.b <= 0 && bytes > 0) t.b = bulk_cpu / bytes;
  if (bytes > small_bytes) {
    t.knee = small_bytes;
    t.b2 = std::max(0.0, bulk_cpu - t.b * small_bytes) / (bytes - small_bytes);
  }
  t.xs = {small_bytes, bytes};
  t.ys = {small_cpu, bulk_cpu};
  t.points = 2;
  // Where the ranks share the cores, the probe's wall time over its CPU work spread on the
  // cores is how well the ranks keep the cores busy while they wait on each other's sends. A
  // ratio above kMaxHostEfficiency means the cores idled most of the probe: a link set its
  // pace, not the cores, and the bound has nothing to learn from it. The bare exchange's beta
  // cannot tell the two apart: on loopback it is the cores' copies too.
  const double share = c.host_share();
  const double ratio = raw.cpu > 0 ? raw.wall / (share * raw.cpu) : 0;
  // Paced by the links: the cores (this rank's share of them) idled most of the probe.
  const bool paced = raw.cpu > 0 && raw.wall > kMaxHostEfficiency * std::max(1.0, share) * raw.cpu;
  // Not paced by the links: the engine's own byte at both sizes (engine_link). The small
  // probe's copies stay in the cache and cost less a byte than the bulk's or the bare
  // exchange's.
  const double small_link = std::max(0.0, raw.small_wall - predict(small).seconds);
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
  const bool links_paced_raw = ratio > kMaxHostEfficiency;
  // With a core to each rank and a link setting the pace, the factor is 1 whatever the
  // compressed probe measures: not run.
  if (links_paced_raw && share <= 1) return paced;
  const CodecCosts* codec = host_probe_codec(c);
  if (codec == nullptr) {  // the raw probe's ratio stands
    if (!links_paced_raw) c.host_efficiency = std::max(1.0, ratio);
    return paced;
  }
  measure_host_efficiency(comm, c, probe, x, *codec, links_paced_raw);
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

}  // namespace terse::planner

namespace terse {

double engine_probe_disturbance(const Calibration& c, double link_latency) {
  double worst = 0;
  if (link_latency > 0) worst = c.alpha / (planner::kImplausibleAlpha * link_latency + 1e-3);
  const bool own_cores = c.ranks_on_host <= c.cores;  // the most ranks, the fewest cores
  if (own_cores && c.engine_link.points >= 2 && c.engine_beta > 0) {
    worst = std::max(worst, c.engine_link.b / (planner::kImplausibleSmallShare * c.engine_beta));
  }
  return worst;
}

}  // namespace terse
