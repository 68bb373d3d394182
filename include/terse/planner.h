// The planner: decides, per tensor, whether compression pays and how (codec, strategy,
// partitions), from a calibration of this machine and its links and a cost model of every
// strategy. docs/planner.md gives the formulas and the measured accuracy.
//
// Three layers, usable separately:
// - Calibration: what was measured (per-peer link latency and time per byte; each codec's
//   encode, decode, accumulate and combine time as A + B*n; CPU contention), saved to and loaded
//   from a JSON cache file.
// - CostModel: predicted seconds of one allreduce for (n, codec, strategy, K, ranks), from a
//   Calibration. Pure arithmetic: no communication, no clocks.
// - Planner: the choice with the least predicted time among raw and the allowed codecs, cached
//   per tensor size; used by the engine for AllreduceOptions::codec == "auto". It calibrates on
//   first use (a collective), and re-checks its predictions against the engine's measured
//   times, re-planning where they are off.
//
// Promises: decisions are a deterministic function of numbers every rank agrees on (exchanged
// through the communicator), so every rank makes the same plan. Every wait inside calibration
// and re-checks is bounded by the communicator's timeout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terse/engine.h"

namespace terse {

class Codec;
class Communicator;

// ---- fitting --------------------------------------------------------------------------------

// y = a + b*x, fitted by least squares with each point weighted by 1/y: a compromise between
// absolute residuals (large sizes, where the time goes, dominate) and relative ones (small sizes
// still predicted within a small factor).
struct LinearFit {
  double a = 0;  // seconds (or bytes) at x = 0
  double b = 0;  // per element (or per byte)
  // Beyond x = knee (when > 0) the slope is b2: the working set has left the cache. Only
  // fit_cost() sets it.
  double knee = 0;
  double b2 = 0;
  // Fit error on the points it was fitted to: root mean square and largest |predicted/y - 1|.
  double rms_relative_error = 0;
  double max_relative_error = 0;
  int points = 0;    // points fitted
  int outliers = 0;  // points left out: more than 25% and 3x the others' rms off the line
  // The measured points, for reports and plots.
  std::vector<double> xs, ys;

  double operator()(double x) const {
    return knee > 0 && x > knee ? a + b * knee + b2 * (x - knee) : a + b * x;
  }
};

// Throws InvalidArgument unless x and y have the same size >= 2 and y > 0. a and b are clamped
// at 0 (a negative intercept or slope is measurement noise, never a real cost). Up to two points
// far off the line through the others are left out (see LinearFit::outliers).
LinearFit fit_linear(std::span<const double> x, std::span<const double> y);

// A cost: fit_linear, or a line up to a knee at one of the measured x and another slope beyond
// it, when that halves the relative error (memory-bound work slows down once its data no longer
// fit in the cache). x must be sorted.
LinearFit fit_cost(std::span<const double> x, std::span<const double> y);

// Indices of the points of a cost series (x sorted, all > 0) whose cost per element is more than
// `factor` times its neighbour's: the point below it, or above it for the first. Leaving the
// cache raises the cost per element a few times at most; far more is a disturbance, which the
// calibration measures again.
std::vector<std::size_t> implausible_steps(std::span<const double> x, std::span<const double> y,
                                           double factor);

// ---- calibration ----------------------------------------------------------------------------

struct Calibration;

// How disturbed the engine probe of calibration `c` looks, as the largest of two ratios to
// their thresholds (above 1: measure it again; calibrate() keeps the least disturbed run):
// - its round latency (alpha) against 4x the links' exchange latency plus 1 ms (link_latency 0
//   leaves this one out);
// - on links the cores pace (engine_link measured) where no more ranks share a machine than it
//   has cores (ranks_on_host <= cores), the small raw allreduce's cost per byte against 0.8x the
//   bulk's (engine_beta): 2 ranks on 2 cores copy a 1 MiB allreduce's bytes in the cache at
//   0.19-0.57x the bulk's (s42-s53); the two probes that came out at 1.1x and 1.3x (s44 and s52)
//   ran everything about twice as slow, and their grids' unshaped N = 2 predictions were off by
//   128% and 39%. 4 ranks on 2 cores range 0.40-1.71x undisturbed: there it is left out.
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
  static constexpr int kVersion = 1;

  std::string host;  // host name of the rank that wrote it
  int world_size = 1;
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
  // CPU of the round-latency probes (measure_engine in calibration.cpp).
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
  // Whether the model that host_cpu_ratio was measured against priced operations at the
  // tensor's rate (CostModel::set_tensor_rates; false in calibrations before stop 37).
  bool tensor_rates = true;

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
  // is neither what the engine's copies cost in the cache nor steady: 0.37-1.2 ns/B against
  // the engine's 0.62-1.04 over 22 loopback calibrations), else bytes * link_beta().
  double link_seconds(double bytes) const;
  // Slowdown with t busy threads per rank (t may be fractional: interpolated); beyond the
  // measured counts it grows linearly. Never below saturation(t): a measurement below it
  // was disturbed (seen: 1.0, 1.0, 1.14 at 2-4 threads with 2 ranks on 2 cores).
  double slowdown(double threads) const;
  // What the cores alone impose: ranks_on_host ranks of t compute-bound threads on `cores`
  // CPUs run at min(1, cores / (ranks * t)) of a CPU each, against min(1, cores / ranks) with
  // one thread each: max(1, ranks * t / cores) / max(1, ranks / cores).
  double saturation(double threads) const;
  // Ranks of this host per core: max(1, ranks_on_host) / max(1, cores).
  double host_share() const;

  std::string to_json() const;
  // Throws DecodeError for text that is not a calibration of this version.
  static Calibration from_json(std::string_view text);
};

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
  bool quiet = true;          // false: progress lines on stderr (rank 0)
};

// Measures this machine and the links to every peer. A collective: every rank calls it with
// the same options. The result is agreed: every rank returns the same numbers (for each
// quantity the largest over ranks, since a collective runs at its slowest rank).
Calibration calibrate(Communicator& comm, const CalibrationOptions& options);

// Measures only the CPU side in this process (no communicator): for `terse plan` on a machine
// that is not part of a job. ranks_on_host ranks are assumed to share the cores.
Calibration calibrate_local(const CalibrationOptions& options, int world_size, int ranks_on_host);

// The calibration with its host_efficiency rebased onto a cost model that prices operations
// at the tensor's rate or not (CostModel::set_tensor_rates). Where ranks outnumber the cores,
// host_efficiency counts the host probe's process CPU over the model's CPU for the probe
// (host_cpu_ratio), and the model's CPU depends on that pricing. Unchanged where it was
// measured against that pricing, or where host_cpu_ratio does not count.
Calibration rebase_host_factor(Calibration c, bool tensor_rates);

// The cache file for this host and world size: $XDG_CACHE_HOME/terse, else ~/.cache/terse,
// named calibration-HOST-nWORLD.json.
std::string default_calibration_path(int world_size);

// ---- cost model -----------------------------------------------------------------------------

// The predicted time of one allreduce and where it goes (seconds, per rank).
struct Prediction {
  double seconds = 0;        // the prediction
  double one_partition = 0;  // critical path of one partition running alone
  double network = 0;        // link time of all partitions (bytes * beta)
  double cpu = 0;            // codec and fp32 work of all partitions, contended
  double host_cpu = 0;       // CPU seconds of all partitions, transport included, uncontended
  double host_bound = 0;     // the host's CPU bound on seconds (where equal, the cores decide)
  double bytes_sent = 0;     // bytes this rank sends
};

class CostModel {
 public:
  explicit CostModel(Calibration calibration);

  // Predicts an allreduce of n floats across `ranks` ranks (any count, for what-if
  // questions) with codec spec (canonical; "none" for raw), strategy (not kAuto) and K
  // partitions, run by an engine with `threads` worker threads. Throws InvalidArgument for a
  // codec the calibration does not hold or a strategy it cannot use.
  Prediction predict(std::size_t n, std::string_view codec, Strategy strategy, int partitions,
                     int ranks, int threads) const;

  const Calibration& calibration() const { return calibration_; }

  // The EngineOptions::gather_bytes of the engine predicted for (default: the default):
  // raw partitions that small take one gathered message step instead of 2(N-1) ring steps.
  void set_gather_bytes(std::size_t bytes) { gather_bytes_ = bytes; }
  // How an operation on a piece of a tensor (a partition, a shard) is priced: at its fit's
  // rate per element over the whole tensor (true, the default), or at the fit's value for
  // the piece (false: the model before stop 37). The fits' cost per element rises where the
  // data leave the cache, and whether a 16 MiB tensor's 1 MiB partition is in the cache
  // depends on the tensor: it came from memory (docs/planner.md, "Rates by the tensor").
  static constexpr bool kTensorRates = true;  // the default
  void set_tensor_rates(bool on) { tensor_rates_ = on; }
  bool tensor_rates() const { return tensor_rates_; }

 private:
  Calibration calibration_;
  std::size_t gather_bytes_ = EngineOptions{}.gather_bytes;
  bool tensor_rates_ = kTensorRates;
  // The multi-round codecs of the calibration: their contributions' sizes per round.
  std::map<std::string, std::shared_ptr<const Codec>, std::less<>> rounds_;
};

// ---- planner --------------------------------------------------------------------------------

struct PlannerOptions {
  // Codecs the planner may choose besides raw (specs; "ef=1" variants allowed). Lossy codecs
  // change what training computes, so this is the user's decision. Default: TERSE_PLAN_CODECS
  // (comma-separated), else fp16 and onebit with error feedback.
  std::vector<std::string> allowed;
  // Partition counts the planner tries.
  std::vector<int> partitions = {1, 2, 4, 8, 16};
  // Raw is also tried at the engine's own partitioning, a partition per this many bytes
  // (EngineOptions::partition_bytes; an engine that makes its planner sets it), so that the
  // raw plan the planner settles on is never one it did not compare with the raw plan the job
  // would run without it (unshaped N = 2, 256 MiB, grid s89: the planner settled on raw K = 16
  // at 1.08 times the engine's default raw K = 32, which was not a candidate). 0: not tried.
  std::size_t raw_partition_bytes = std::size_t{8} << 20;
  // A compressed plan must be predicted this much faster than raw to be chosen (do no harm:
  // predictions err, and raw is exact).
  double min_gain = 0.05;
  // Tensors of at most raw_below_bytes go raw: a small tensor's precision is not worth losing
  // for the message rounds a compressed strategy saves, and in a group the engine fuses small
  // raw tensors into one message, which saves them anyway. Two exceptions, where raw costs real
  // time even for small tensors: on slow links (raw's bytes alone take more than
  // small_tensor_slack seconds over the best plan), and on long rings (more than
  // small_tensor_max_ranks ranks: a ring has 2(N-1) rounds). Deterministic: neither depends on
  // the measured latency, which load from outside the job makes noisy.
  std::size_t raw_below_bytes = std::size_t{16} << 10;
  double small_tensor_slack = 1e-3;
  int small_tensor_max_ranks = 32;
  // Compare predictions with measured times every this many planned submissions; re-plan a
  // size whose measured time is off by more than the threshold (relative). 0 disables.
  int recheck_interval = 200;
  double recheck_threshold = 0.25;
  // Exploration: the model's error (docs/planner.md#accuracy) is larger than the gaps between
  // the best few candidates of a size, so a new decision first runs each candidate expected
  // within `explore_within` times the choice (at most `explore_candidates`, the choice first)
  // for at least `explore_runs` planned allreduces of that size (more for fast ones: as many as
  // take `explore_seconds` by its expected time, up to `explore_max_runs`; a few runs of a
  // millisecond vary by more than the gaps between contenders), then keeps the fastest
  // measured (a compressed plan still has to beat the raw ones measured by min_gain). The
  // contenders take turns, one submission each, so that a burst of load from outside the job
  // slows them alike. The measured times are exchanged as in a re-check: a collective at the
  // same submission on every rank. It costs each size some slower allreduces once (at most
  // about explore_candidates * max(explore_seconds, explore_runs runs), as much again for the
  // close ones of explore_close's second round, and explore_tie_seconds for each near-tie
  // round); the engine keeps each
  // contender's codec state (error-feedback residuals) while it explores, and drops all but
  // the settled one's after. explore_candidates <= 1 disables it; TERSE_PLAN_EXPLORE=K sets
  // explore_candidates (0 or 1: off).
  int explore_candidates = 8;
  double explore_within = 1.5;
  int explore_runs = 5;
  double explore_seconds = 0.2;
  int explore_max_runs = 25;
  // A second round: where two or more contenders measured within `explore_close` (relative)
  // of the fastest, those run their runs again, in turn, and each is judged by its two rounds'
  // agreed times (fitted on round 1's footing, planner::fit_rounds, since stop 50), so that the
  // gaps of a few percent that decide between them are not left to one round's noise (the rest were
  // not close: they sit it out, and stay in the verdict). 0 disables. (explore_seconds 0.2 and
  // explore_close 0.15 since stop 45: with 0.1 and 0.1, a first round of 5 runs at 16 MiB on 4
  // ranks sharing 2 cores left sharded onebit K = 4 out of the second round at 11% behind K = 1,
  // which it beat by 8% re-timed.)
  double explore_close = 0.15;
  // Each contender of the second round and of the near-tie rounds below runs as many runs as
  // take `explore_again_seconds` by its measured time (at least its first round's runs, at most
  // explore_max_runs): single runs of 10-30 ms on ranks that share cores vary by 10-15%,
  // so a median of a first round's five errs by about 6% and two such rounds can swap plans
  // 10% apart (unshaped N = 4, 16 MiB: sharded onebit K = 8 timed 10% slower than K = 4 in
  // exploration, 9% faster in 239 pairs). 0: the first round's runs again.
  double explore_again_seconds = 0.3;
  // The fastest contender's neighbours in K (the next smaller and larger K of its codec and
  // strategy), where no contender has them and they are expected within explore_within of its
  // measured time, join that second round (and start it, alone with the fastest if need be):
  // the model's slope over K is its least reliable part. false disables.
  bool explore_neighbours = true;
  // And after the second round or a later one, where the fastest so far (by its mean over
  // rounds) has such a neighbour not yet run, a round of the fastest and its new neighbours
  // (the others sit it out), so that exploration climbs K to the measured best; at most
  // `explore_neighbour_rounds` of these, before any near-tie round.
  int explore_neighbour_rounds = 3;
  // And every codec and strategy with a contender measured within explore_close of the
  // fastest: its other K (where no contender has them and they are expected within
  // explore_within of the fastest's measured time) join that second round too, the families
  // fastest measured first and each one's K nearest its fastest first, while their runs cost
  // at most `explore_family_seconds` in all by their expected times and they number at most
  // explore_candidates. A codec's time over K can dip away from both of the K its first round
  // measured, where a climb from the fastest does not go (unshaped, 16 MiB, 3 and 4 ranks on
  // 2 cores: sharded onebit K = 8 was the best configuration in each of five grids, 1.08-1.14
  // times faster than the choice in s88, where the first round measured K = 1, 2 and 16 and
  // the model expects time to rise with K). In practice sizes up to a few tens of MiB: at
  // 16 MiB a K costs about 0.3 s of runs, at 256 MiB over 1 s. 0 disables.
  double explore_family_seconds = 1.0;
  // Near ties: where, after the second round (or a later one), the two fastest contenders'
  // times are within `explore_tie` (relative) of each other, those two run another round,
  // and each is judged by all its rounds (fitted on round 1's footing); at most
  // `explore_tie_rounds` such rounds, and only while one costs them at most `explore_tie_seconds`
  // by their expected times (fast tensors: a median of a few dozen runs of a millisecond on a
  // loaded core errs by a few percent, which is the size of these gaps; long runs are steadier and
  // dear). The other contenders sit these rounds out but stay in the verdict (a compressed plan
  // must still beat the raw ones measured by min_gain). explore_tie_rounds 0 disables.
  double explore_tie = 0.05;
  // And they are a near tie too where their gap is within `explore_tie_noise` times its
  // standard error, the one the rounds' runs give (each median's from the spread of its agreed
  // runs, the interquartile range, and the means' from the medians'). Single runs of 64 KiB to
  // 1 MiB vary by about 20% (sigma, ranks sharing 2 cores, grids s88-s91), so a median of 25
  // of them errs by about 5% and two of them differ by about 7% from noise alone: a gap of 8%
  // (1 Gbit/s, 2 ranks, 64 KiB, s91: allgather fp16 over onebit, which ran 1.20 times faster
  // in pairs) is no verdict. 0: explore_tie alone.
  double explore_tie_noise = 2.0;
  int explore_tie_rounds = 2;
  double explore_tie_seconds = 1.0;
  // Beyond those, the best plan of each allowed codec not among them, when it is expected
  // within this many times the choice and its runs cost at most explore_seconds more than the
  // choice's would (in practice: small sizes, where the model errs most and runs are cheap).
  // 0 disables.
  double explore_codec_within = 4.0;
  // And each codec among those (its first listed plan) at the far end of `partitions` from that
  // plan's K, with the same strategy, under the same test (the model's slope over K is its
  // least reliable part: what of a partition stays in a core's cache). false disables.
  bool explore_far_partitions = true;
  // When the choice is compressed and the best raw plan is expected within this many times its
  // time, that raw plan is explored too (after the others, beyond explore_candidates), so the
  // settled plan beats raw by min_gain in measured time. 0 disables.
  double explore_raw_within = 2.0;
  // When exploration settles, the model's choice (the first contender) stands unless the
  // fastest contender measured at least this much (relative) faster than it. Exploration's
  // rotation and an alternating pair disagree by a few percent on the same two plans (stop 50:
  // re-timing pairs inside a full rotation moved verdicts by up to 9%), so a smaller measured gap
  // is not a verdict, while keeping a choice that is truly that much slower stays within the
  // choice target's 5%. Replayed on grids s90-s95 (180 points), 4% kept the model's choice at 19
  // points and put 169 within 5% of the best, against 165 with 0 (stop 51). 0: the fastest wins.
  double explore_displace = 0.04;
  // Each pass over the contenders (one submission each) runs them in a fresh order, the same on
  // every rank, so that what one run leaves behind for the next (a drained token bucket on a
  // shaped link, an evicted cache) does not always land on the same contender. In a fixed
  // order each follows the same one every pass: over grids s90-s102, the contender run right
  // after the model's choice timed 0.868 of its grid time (relative to its point's median) at
  // 100 Mbit/s, 1 MiB, and the last contender 1.086 unshaped at 1 MiB, where the others' was
  // 0.99-1.00. false: the contenders' order in every pass (the first with runs first).
  bool explore_shuffle = true;
  // Calibration cache: "" for default_calibration_path(); "-" for none.
  std::string cache_path;
  CalibrationOptions calibration;
  // Print calibration and decisions on rank 0 (TERSE_PLAN_LOG=1 sets it).
  bool log = false;
};

// One option the planner considered.
struct PlanCandidate {
  TensorPlan plan;
  Prediction predicted;
  std::optional<double> measured;  // agreed measured seconds, once re-checks saw it
  // Unmeasured candidates whose codec and strategy were measured at another K: the measured /
  // predicted ratio there (a model error of the strategy carries over to its other K).
  double correction = 1.0;
};

// A decision: the chosen plan, what it beat, and raw's time for reference.
struct PlanDecision {
  std::size_t elements = 0;
  PlanCandidate chosen;
  double raw_seconds = 0;             // the best raw plan's expected seconds
  std::vector<PlanCandidate> ranked;  // every candidate, fastest expected first
  // What exploration runs before settling (PlannerOptions::explore_*): the choice, then the
  // other candidates expected within explore_within of it, fastest expected first, then the
  // best raw plan if the choice is compressed and raw is expected within explore_raw_within of
  // it. Just the choice when there is nothing to explore (a small tensor kept raw).
  std::vector<PlanCandidate> contenders;

  // Measured time where known, else the (corrected) prediction.
  static double expected(const PlanCandidate& c) {
    return c.measured ? *c.measured : c.predicted.seconds * c.correction;
  }
};

class Planner {
 public:
  // A planner that calibrates (or loads the cache) on its first plan() through a communicator.
  explicit Planner(PlannerOptions options = {});
  // A planner with a given calibration (tests, `terse plan`).
  Planner(PlannerOptions options, Calibration calibration);
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;

  // What the engine does with n floats. Collective on the first call (calibration, or
  // agreement on a cached one) and whenever recheck() is due: every rank must call it at the
  // same points with the same arguments. strategy/partitions other than kAuto/0 restrict the
  // search to them. threads: the engine's worker threads.
  TensorPlan plan(Communicator& comm, std::size_t n, int threads,
                  Strategy strategy = Strategy::kAuto, int partitions = 0);

  // The same decision without communication, for a given world size (needs a calibration).
  PlanDecision decide(std::size_t n, int ranks, int threads, Strategy strategy = Strategy::kAuto,
                      int partitions = 0) const;

  // The engine reports the wall time of a planned allreduce of n floats (first task start to
  // last task end on this rank). Thread-safe, local, cheap.
  void observe(std::size_t n, const TensorPlan& plan, double seconds);

  // Called by the engine before each submission that has planned tensors (at the same points
  // on every rank), with the plan() arguments of the submission's planned tensors. Every
  // recheck_interval-th call, and any call at which a size being explored has run each of its
  // contenders its runs (explore_runs or more), exchanges the observations and agrees on
  // measured times (per run the largest over ranks, then the median). Then explored sizes settle
  // on the fastest measured, and the other decisions whose expected time was off by more than
  // the threshold are dropped, so that the next plan() re-decides with the measured times.
  // Last, sizes still explored that this submission uses move on to their next contender.
  // Returns the number of sizes whose plan changed.
  struct Use {
    std::size_t n = 0;
    int threads = 0;
    Strategy strategy = Strategy::kAuto;
    int partitions = 0;
  };
  int before_submission(Communicator& comm, std::span<const Use> uses = {});

  // Whether a size's plan is still being explored (local, cheap; the same on every rank).
  bool exploring(std::size_t n, int threads, Strategy strategy = Strategy::kAuto,
                 int partitions = 0) const;

  // Calibrates now, if not yet done (collective). Later calls return the same calibration.
  const Calibration& calibration(Communicator& comm);
  bool calibrated() const;
  const CostModel& model() const;  // throws InvalidArgument before calibration
  const PlannerOptions& options() const { return options_; }
  // Canonical specs of the allowed codecs.
  std::vector<std::string> allowed() const;

 private:
  struct Key {
    std::size_t n;
    int threads;
    Strategy strategy;
    int partitions;
    auto operator<=>(const Key&) const = default;
  };
  // A size being explored: its contenders, taken in passes of one submission each (so that
  // load from outside the job, which comes in bursts, slows them alike; explore_shuffle), how
  // many submissions each has had and gets, and the one of the latest submission.
  struct Exploration {
    std::vector<PlanCandidate> contenders;
    std::vector<int> uses;
    std::vector<int> runs;  // runs_for each contender (more where a time is still missing)
    std::size_t current = 0;
    // The pass under way: the contenders' order in it, the position of the next one, and how
    // many passes there were (which seeds each pass's shuffle alike on every rank).
    std::vector<std::size_t> order;
    std::size_t next = 0;
    std::uint64_t passes = 0;
    int unmeasured = 0;  // exchanges after the runs that left a contender without a time
    // Which round this is (1: all contenders; 2: the close ones, explore_close; later: a near
    // tie, explore_tie), per round each contender's agreed time (0: it sat the round out, with
    // runs 0), and per contender the number of rounds it ran.
    int round = 1;
    int climbs = 0;  // rounds of the fastest's new K neighbours (explore_neighbour_rounds)
    int ties = 0;    // near-tie rounds (explore_tie_rounds)
    std::vector<std::vector<double>> medians;
    std::vector<double> variance;  // the sum over its rounds of its median's squared error
    std::vector<int> rounds;
    // A further round in which each contender runs `again[i]` times (0: it sits the round out
    // but stays in the verdict), in passes.
    void start_round(std::vector<int> again) {
      runs = std::move(again);
      uses.assign(runs.size(), 0);
      order.clear();
      next = 0;
    }
    // Starts a pass: the contenders in their order, those after the first `kept` shuffled
    // where `shuffle`; the first `kept` count as run.
    void start_pass(bool shuffle, std::size_t kept);
    // The next contender of the pass with runs left (from a new pass where this one has none);
    // none where no contender has runs left.
    std::optional<std::size_t> next_with_runs(bool shuffle);
    // Whether a contender has the plan of key `key` (plan_key).
    bool has(const std::string& key) const;
    // `c` joins the round being set up in `again` (start_round's), with `runs` runs.
    void join(const PlanCandidate& c, int runs, std::vector<int>& again);
    bool done() const {
      for (std::size_t i = 0; i < uses.size(); ++i) {
        if (uses[i] < runs[i]) return false;
      }
      return true;
    }
  };
  // How many planned allreduces a contender runs while explored (deterministic: the same on
  // every rank).
  int runs_for(const PlanCandidate& c) const;
  // How many a contender runs in the second round and later ones (explore_again_seconds), by
  // `seconds` a run (its measured time; expected, for one not yet run).
  int runs_again(const PlanCandidate& c, double seconds) const;
  void ensure_calibrated(Communicator& comm);
  void log_decision(const PlanDecision& d, int rank, const char* why) const;
  // After an exchange: moves explored sizes on (mu_ held). Returns how many changed plan.
  int advance_explorations(int rank);
  // At the end of an exploration's first round: narrows it to the contenders measured within
  // explore_close of the fastest, adds the fastest's K neighbours (explore_neighbours, to `d`'s
  // contenders too) and the close ones' other K (explore_family_seconds) and starts their second
  // round; false (nothing changed) where fewer than two would run or the option is off.
  template <typename Measured>
  bool start_second_round(Exploration& e, PlanDecision& d, const Measured& measured, std::size_t n,
                          int rank) const;
  // After the second round or a later one: where the two fastest (by their fitted times)
  // are within explore_tie of each other or within explore_tie_noise standard errors, starts
  // another round of those two (the others sit it out); false where they are not, or no more such
  // rounds are allowed or affordable.
  template <typename Measured>
  bool start_tie_round(Exploration& e, const Measured& measured, std::size_t n, int rank) const;
  // Adds the K neighbours of contender `first` (measured at `fastest` s) that no contender has
  // and that are expected within explore_within of it, to `e` and `d`'s contenders, with their
  // runs in `again` and their names in `list`; returns how many.
  int add_k_neighbours(Exploration& e, PlanDecision& d, std::size_t first, double fastest,
                       std::vector<int>& again, std::string& list) const;
  // Adds the other K of each codec and strategy measured within explore_close of `fastest` s
  // (explore_family_seconds), as add_k_neighbours adds; returns how many.
  template <typename Measured>
  int add_close_families(Exploration& e, PlanDecision& d, const Measured& measured, double fastest,
                         std::vector<int>& again, std::string& list) const;
  // After the second round or a later one: where the fastest so far has K neighbours not yet
  // run (explore_neighbours), a round of it and them; false where none or no more such rounds
  // are allowed (explore_neighbour_rounds).
  template <typename Measured>
  bool start_neighbour_round(Exploration& e, PlanDecision& d, const Measured& measured,
                             std::size_t n, int rank) const;

  PlannerOptions options_;
  std::vector<std::string> allowed_;
  mutable std::mutex mu_;
  std::unique_ptr<CostModel> model_;
  std::map<Key, PlanDecision> decisions_;
  std::map<Key, Exploration> exploring_;
  // Observations since the last re-check, and agreed measured times, by (n, config).
  std::map<std::pair<std::size_t, std::string>, std::vector<double>> observed_;
  std::map<std::pair<std::size_t, std::string>, double> measured_;
  // The standard error of the latest exchange's median of each (measured_'s keys).
  std::map<std::pair<std::size_t, std::string>, double> measured_error_;
  std::uint64_t submissions_ = 0;
};

// A stable text for a plan's configuration: "codec/strategy/K".
std::string plan_key(const TensorPlan& plan);

}  // namespace terse
