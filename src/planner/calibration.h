// Calibration: what was measured on this machine and its links (per-peer link latency and time
// per byte; each codec's encode, decode, accumulate and combine time as A + B*n; CPU
// contention), the JSON cache file, and the measuring itself. Internal to the planner; the
// tools read it to print and replay calibrations.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "planner/fit.h"
#include "terse/plan.h"  // TensorPlan, Strategy

namespace terse {

class Communicator;
struct Calibration;

// How disturbed the engine probe of calibration `c` looks, as the largest of two ratios to
// their thresholds (above 1: measure it again; calibrate() keeps the least disturbed run):
// - its round latency (alpha) against 4x the links' exchange latency plus 1 ms (link_latency 0
//   leaves this one out);
// - on links the cores pace (engine_link measured) where no more ranks share a machine than it
//   has cores (ranks_on_host <= cores), the small raw allreduce's cost per byte against 0.8x the
//   bulk's (engine_beta): undisturbed, its bytes stay in the cache and cost well below the
//   bulk's. Where ranks outnumber the cores the two overlap undisturbed: there it is left out.
double engine_probe_disturbance(const Calibration& c, double link_latency);

// One codec's costs on this machine: seconds for n elements, and encoded bytes for n elements
// (measured on gradient-like data).
// A multi-round codec (PowerSGD, a RoundCodec) has no payload to decode or merge: `encode` is
// the CPU time of all its rounds and finish() on one rank (its sums cost what the raw ring's do,
// or the summable ring's on the codec's wire codec, RoundCodec::round_wire),
// decode and accumulate stay zero, and `bytes` is what its round contributions hold.
struct CodecCosts {
  std::string spec;  // canonical
  bool summable = false;
  bool multi_round = false;
  LinearFit encode;
  LinearFit decode;      // overwrite
  LinearFit accumulate;  // decode-accumulate: the merge of non-summable strategies
  LinearFit combine;     // compressed-domain sum (summable codecs only)
  LinearFit bytes;       // encoded size, header included
};

struct Calibration {
  // The cache's format and meaning: bumped whenever a field is added, removed or measured
  // differently. A cache of another version is measured again (with a one-line log message).
  static constexpr int kVersion = 4;

  std::string host;  // host name of the rank that wrote it
  int world_size = 1;
  // The host of each rank (transport::Topology::host_of) of the job whose links were measured;
  // empty: not known. The per-peer figures below split into intra-host and cross-host links by
  // it (link_classes), so a cache is only used by a job of the same topology.
  std::vector<int> host_of;
  // Per rank: 1 where its host's ranks read each other's memory directly (Topology::direct),
  // which is how its links inside the host were measured; empty where no rank does. A cache is
  // only used by a job that moves bytes inside its hosts the same way.
  std::vector<int> direct_reads;
  int ranks_on_host = 1;  // ranks of the job sharing this machine (same machine id)
  int cores = 1;          // CPUs this process may run on

  // Links, measured over Communicator send/recv while every rank exchanged with a partner
  // (all links busy, as in a ring): an exchange of b bytes both ways takes alpha + beta * b.
  // peer_alpha[i][j]: latency of an exchange round between ranks i and j in seconds;
  // peer_beta[i][j]: seconds per byte. Diagonals are 0.
  std::vector<std::vector<double>> peer_alpha;
  std::vector<std::vector<double>> peer_beta;
  // The model's values. beta: the slowest pair's (a ring runs at its slowest link). alpha: the
  // latency of a message round as the engine sees it (thread wake-ups included, which a bare
  // exchange does not show), measured by running the engine (see job_overhead). Both stay 0
  // for one rank, and calibrate_local() leaves them to the caller.
  double alpha = 0;
  double beta = 0;
  // Seconds per byte that a raw allreduce inside the engine achieved beyond what alpha, beta
  // and the CPU fits explain (0: not measured). Where the links are the kernel's copies
  // (loopback, ranks sharing cores) they compete with the engine's threads and a bare exchange
  // runs up to twice as fast as an allreduce does; on a shaped link the two agree. The model
  // prices a byte at the larger of the two (link_beta()).
  double engine_beta = 0;
  // Where the cores, not the links, set a raw allreduce's pace (loopback, or ranks sharing the
  // cores): the seconds that the engine's raw allreduce took for the bytes a rank sends in one
  // partition, beyond what alpha and the CPU fits explain, measured at the engine_beta probe's
  // two sizes: slope b up to the smaller (knee; the kernel's copies stay in the cache), b2
  // beyond. Empty (points 0) where the links paced the probe, or not measured: link_beta()
  // prices every byte then. See link_seconds().
  LinearFit engine_link;
  // Host CPU seconds (every thread of the process, the kernel's share included) that the
  // transport spends on a partition of which this rank sends x bytes (and receives as many),
  // beyond the strategy's own arithmetic and cpu_per_message: the copies into and out of the
  // kernel on both ends (all 0: not measured). Measured with the engine_beta probe at two sizes:
  // slope b up to the smaller (knee), b2 beyond (the copies leave the cache). It prices the
  // cores' share of the link in the host's CPU bound (CostModel::predict).
  LinearFit transport_cpu;
  // Host CPU seconds per message a rank sends (and one it receives) inside the engine: the
  // transport's calls, the thread hand-offs and wake-ups (0: not measured). Measured from the
  // CPU of the round-latency probes (measure_engine, engine_probes.cpp).
  double cpu_per_message = 0;
  // How much longer than the model's CPU work over the cores an allreduce takes where ranks
  // share the cores and the cores decide (>= 1; 1: not measured, or the cores are not shared,
  // or the links decide): ranks wait on each other's sends, so the cores idle part of the
  // time, and they run slower together than the fits' operations alone. The wall time of a
  // compressed allreduce (the first calibrated codec with a payload, sharded on two
  // partitions) over ranks_on_host / cores times the CPU the model counts for it, where its
  // wall over its median rank's CPU, and the engine_beta probe's raw ratio, are at most 2;
  // beyond, a link set the probe's pace and the cores' idling is unknown: then its median
  // rank's CPU over the model's (host_cpu_ratio) alone. Where each rank has a core, the
  // process's CPU in place of the model's. The raw ratio where no codec was calibrated. It
  // scales the host's CPU bound (CostModel::predict).
  double host_efficiency = 1;
  // That probe's median rank's process CPU over the model's CPU for it (1: not measured, or
  // outside 0.5-2). host_efficiency counts it only where ranks outnumber the cores; elsewhere
  // the process's CPU stands in for the model's there.
  double host_cpu_ratio = 1;

  // fp32 element-wise work of the raw strategy (sum of two arrays, division), and per-codec
  // costs, all measured with every rank of this host running at once (one thread each).
  LinearFit add;
  LinearFit divide;
  std::vector<CodecCosts> codecs;

  // cpu_slowdown[t-1]: how much longer CPU work takes when every rank runs t threads of it at
  // once, relative to one thread per rank (measured; 1 where the host has cores to spare).
  std::vector<double> cpu_slowdown = {1.0};

  // The engine's fixed costs beyond the links and the codecs (hand-offs between threads and the
  // transport, buffers), measured by running it: per partition task and per allreduce.
  double task_overhead = 0;
  double job_overhead = 0;

  double seconds = 0;  // how long measuring took

  const CodecCosts* find(std::string_view canonical_spec) const;
  double link_beta() const { return std::max(beta, engine_beta); }
  // Whether the cores pace the links (engine_link measured: loopback), not a wire.
  bool cores_pace_links() const { return engine_link.points > 0; }
  // Seconds the links take for `bytes` a rank sends in one partition: engine_link where it was
  // measured (the cores pace the links, and a bare exchange's slope, taken out of the cache,
  // is neither what the engine's copies cost in the cache nor steady), else
  // bytes * link_beta().
  double link_seconds(double bytes) const;
  // Slowdown with t busy threads per rank (t may be fractional: interpolated); beyond the
  // measured counts it grows linearly. Never below saturation(t): a measurement below it
  // was disturbed.
  double slowdown(double threads) const;
  // What the cores alone impose: ranks_on_host ranks of t compute-bound threads on `cores`
  // CPUs run at min(1, cores / (ranks * t)) of a CPU each, against min(1, cores / ranks) with
  // one thread each: max(1, ranks * t / cores) / max(1, ranks / cores).
  double saturation(double threads) const;
  // Ranks of this host per core: max(1, ranks_on_host) / max(1, cores).
  double host_share() const;

  std::string to_json() const;
  // Throws DecodeError for text that is not a calibration of this version (every field present).
  static Calibration from_json(std::string_view text);
};

// One class of links, as the cost model prices the hierarchical allreduce's phases: pairs of
// ranks on one host, or pairs on different hosts.
struct LinkClass {
  int pairs = 0;          // pairs of the class measured (0: none; the flat model's links stand in)
  double pair_alpha = 0;  // the slowest pair's exchange latency, seconds
  double pair_beta = 0;   // the slowest pair's seconds per byte
  // A message round's latency inside the engine: Calibration::alpha (measured on the slowest
  // links) less how much sooner this class's slowest exchange is than the slowest of all.
  double alpha = 0;
  // The class's link time over the flat model's (Calibration::link_seconds, which prices the
  // slowest pair): its pair_beta over the slowest pair's beta, at most 1.
  double scale = 1;
};
struct LinkClasses {
  LinkClass intra, cross;
};
// The links of calibration `c` split by `host_of` (a rank's host, as Topology::host_of): each
// class is its slowest pair, as the flat model takes the slowest pair of all. Where the per-peer
// figures do not cover host_of's ranks (a calibration of another size, or calibrate_local's,
// which has none), or a class has no pair, that class is the flat model's links (alpha, scale 1).
LinkClasses link_classes(const Calibration& c, const std::vector<int>& host_of);
// Calibration::direct_reads of CalibrationOptions::direct_pid for `size` ranks: 1 where a pid
// is given, else 0; empty where no rank reads directly.
std::vector<int> direct_reads_of(const std::vector<std::int64_t>& direct_pid, int size);

struct CalibrationOptions {
  // Codec specs to measure (canonicalized); "none" is implied.
  std::vector<std::string> codecs;
  // Largest tensor used for codec fits, in elements, and the time budget of a link exchange
  // size: link sizes grow until one exchange takes this long (or link_max_bytes), long enough
  // that a shaped link's burst is behind the two largest, whose slope gives beta.
  std::size_t codec_max_elements = std::size_t{1} << 22;
  double link_target_seconds = 0.03;
  std::size_t link_max_bytes = std::size_t{16} << 20;
  bool measure_links = true;  // false: keep the links of an earlier calibration unmeasured
  // The job's hosts (transport::Topology::host_of; empty: not known), recorded in the
  // calibration (Calibration::host_of); a pair's link is judged against its class's.
  std::vector<int> host_of;
  // Per rank: its process id where its host's ranks read each other's memory directly
  // (transport::Topology::pid where Topology::direct), else 0 (or empty): a pair of one host
  // whose ids are both known is measured by direct reads, as the collectives move bytes there.
  std::vector<std::int64_t> direct_pid;
  bool quiet = true;          // false: progress lines on stderr (rank 0)
};

// The one service calibration needs from the layer above the planner: running an allreduce
// through the engine (the round latency, the engine's own cost per byte and its CPU are what a
// bare exchange does not show). The engine provides it (src/engine/allreduce_probe.h); the
// planner never constructs an engine.
class AllreduceProbe {
 public:
  virtual ~AllreduceProbe() = default;
  // Reduces x in place across the communicator's ranks as tensor `name` with `plan`'s codec,
  // strategy and partitions, and returns when it is done. A collective. Raw partitions travel
  // on the ring (no gathered message step), whatever their size.
  virtual void allreduce(const std::string& name, std::span<float> x, const TensorPlan& plan) = 0;
  // The worker threads of the engine it runs on: calibration measures the CPU's contention and
  // prices the probes at that many.
  virtual int threads() const = 0;
};
// Makes a probe on a communicator (a collective where making an engine is one).
using MakeAllreduceProbe = std::function<std::unique_ptr<AllreduceProbe>(Communicator&)>;

// Measures this machine and the links to every peer, the engine's overheads through probes
// that `make_probe` makes. A collective: every rank calls it with the same options. The result
// is agreed: every rank returns the same numbers (for each quantity the largest over ranks,
// since a collective runs at its slowest rank).
Calibration calibrate(Communicator& comm, const CalibrationOptions& options,
                      const MakeAllreduceProbe& make_probe);

// Measures only the CPU side in this process (and the engine's fixed costs on a job of this
// one process): for `terse plan` on a machine that is not part of a job. ranks_on_host ranks
// are assumed to share the cores.
Calibration calibrate_local(const CalibrationOptions& options, int world_size, int ranks_on_host,
                            const MakeAllreduceProbe& make_probe);

// The cache file for this host and world size in `directory` (PlannerOptions::cache_directory;
// empty: /tmp/terse), named calibration-HOST-nWORLD.json.
std::string default_calibration_path(int world_size, const std::string& directory);

}  // namespace terse
