// Planner tests: the fits, the cost model's formulas and limits, decisions and re-checks on
// synthetic calibrations, the cache's format; then real multi-process runs of codec "auto"
// (tests/planner/worker) for N = 2, 3, 4.
#include "terse/planner.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "planner/exchange.h"
#include "planner/synthetic.h"
#include "process_testing.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/error.h"

namespace terse {
namespace {

using namespace std::chrono_literals;

// ---- fitting --------------------------------------------------------------------------------

TEST(Fit, RecoversAnExactLine) {
  std::vector<double> x = {1e3, 4e3, 16e3, 64e3, 256e3}, y;
  for (double v : x) y.push_back(2e-6 + 3e-10 * v);
  const LinearFit f = fit_linear(x, y);
  EXPECT_NEAR(f.a, 2e-6, 1e-12);
  EXPECT_NEAR(f.b, 3e-10, 1e-16);
  EXPECT_LT(f.rms_relative_error, 1e-9);
  EXPECT_EQ(f.points, 5);
  EXPECT_EQ(f.outliers, 0);
  EXPECT_EQ(f.xs, x);
}

TEST(Fit, NoisyPointsGiveAnErrorNearTheNoise) {
  std::mt19937_64 gen(3);
  std::normal_distribution<double> noise(1.0, 0.05);
  std::vector<double> x, y;
  for (double v = 1024; v <= (1 << 22); v *= 2) {
    x.push_back(v);
    y.push_back((5e-6 + 2e-10 * v) * noise(gen));
  }
  const LinearFit f = fit_linear(x, y);
  EXPECT_NEAR(f.b, 2e-10, 2e-11);
  EXPECT_GT(f.rms_relative_error, 0.01);
  EXPECT_LT(f.rms_relative_error, 0.1);
}

TEST(Fit, LeavesOutADisturbedPointAndClampsNegativeCosts) {
  std::vector<double> x = {1, 2, 3, 4, 5, 6}, y = {1, 2, 3, 40, 5, 6};
  const LinearFit f = fit_linear(x, y);
  EXPECT_EQ(f.outliers, 1);
  EXPECT_NEAR(f.b, 1.0, 1e-9);
  EXPECT_NEAR(f.a, 0.0, 1e-9);
  // A decreasing series is noise around a constant, never a negative cost.
  const LinearFit c = fit_linear(std::vector<double>{1, 2, 3}, std::vector<double>{3, 2, 1});
  EXPECT_EQ(c.b, 0);
  EXPECT_GT(c.a, 0);
  EXPECT_THROW(fit_linear(std::vector<double>{1}, std::vector<double>{1}), InvalidArgument);
  EXPECT_THROW(fit_linear(std::vector<double>{1, 2}, std::vector<double>{1, 0}), InvalidArgument);
}

TEST(Fit, FindsTheKneeWhereDataLeavesTheCache) {
  std::vector<double> x, y;
  for (double v = 1024; v <= (1 << 22); v *= 4) {
    x.push_back(v);
    y.push_back(v <= 262144 ? 1e-6 + 0.2e-9 * v : 1e-6 + 0.2e-9 * 262144 + 2e-9 * (v - 262144));
  }
  const LinearFit line = fit_linear(x, y);
  const LinearFit f = fit_cost(x, y);
  EXPECT_EQ(f.knee, 262144);
  EXPECT_NEAR(f.b, 0.2e-9, 1e-12);
  EXPECT_NEAR(f.b2, 2e-9, 1e-11);
  EXPECT_LT(f.rms_relative_error, 1e-6);
  EXPECT_GT(line.rms_relative_error, 0.1);
  EXPECT_NEAR(f(1 << 22), y.back(), 1e-12);
  // A straight series keeps a straight fit.
  std::vector<double> straight;
  for (double v : x) straight.push_back(1e-6 + 0.5e-9 * v);
  EXPECT_EQ(fit_cost(x, straight).knee, 0);
}

TEST(Fit, FlagsAStepInCostPerElementNoCacheExplains) {
  const std::vector<double> x = {1024, 8192, 65536, 524288, 4194304};
  auto times = [&](std::vector<double> ns_per_element) {
    std::vector<double> y;
    for (std::size_t i = 0; i < x.size(); ++i) y.push_back(x[i] * ns_per_element[i] * 1e-9);
    return y;
  };
  // Measured series: per-call costs at the smallest size, 3.6x when the data leave the cache.
  EXPECT_TRUE(implausible_steps(x, times({0.26, 0.15, 0.13, 0.18, 0.34}), 5).empty());
  EXPECT_TRUE(implausible_steps(x, times({0.33, 0.31, 0.37, 0.10, 0.36}), 5).empty());
  EXPECT_TRUE(implausible_steps(x, times({7.5, 3.8, 3.2, 4.2, 4.4}), 5).empty());
  // Disturbed points: fp16's decode at 4 Mi floats (s48), onebit's encode (s49), one in the
  // middle, and the smallest size.
  EXPECT_EQ(implausible_steps(x, times({0.26, 0.13, 0.17, 0.19, 17.5}), 5),
            std::vector<std::size_t>{4});
  EXPECT_EQ(implausible_steps(x, times({0.73, 0.70, 0.88, 0.98, 6.0}), 5),
            std::vector<std::size_t>{4});
  EXPECT_EQ(implausible_steps(x, times({0.3, 0.3, 2.0, 0.3, 0.4}), 5), std::vector<std::size_t>{2});
  EXPECT_EQ(implausible_steps(x, times({2.0, 0.3, 0.3, 0.3, 0.4}), 5), std::vector<std::size_t>{0});
  EXPECT_THROW(implausible_steps(x, std::vector<double>{1.0}, 5), InvalidArgument);
}

using testing::line;
using testing::synthetic;

TEST(Calibration, AnEngineProbeWhoseSmallAllreduceCostsTheBulksBytesIsDisturbed) {
  // Unshaped, 2 ranks (ns a byte, us): the small probe's byte against the bulk's, and alpha.
  auto probe = [](double small_b, double bulk_b, double alpha_us, int ranks_on_host = 2) {
    Calibration c = synthetic(1e9, alpha_us * 1e-6, 2);
    c.ranks_on_host = ranks_on_host;
    c.cores = 2;
    c.engine_beta = bulk_b * 1e-9;
    c.engine_link.b = small_b * 1e-9;
    c.engine_link.b2 = bulk_b * 1e-9;
    c.engine_link.points = 2;
    return c;
  };
  const double latency = 30e-6;
  // s47-s51's probes on 2 ranks: 0.19-0.52x.
  for (const auto& [small, bulk] : std::vector<std::pair<double, double>>{
           {0.44, 0.92}, {0.22, 0.71}, {0.17, 0.89}, {0.46, 0.89}, {0.25, 0.61}}) {
    EXPECT_LT(engine_probe_disturbance(probe(small, bulk, 100), latency), 1) << small;
  }
  // s52 and s44: the small probe's byte at 1.1-1.3x the bulk's.
  EXPECT_GT(engine_probe_disturbance(probe(1.68, 1.51, 90), latency), 1);
  EXPECT_GT(engine_probe_disturbance(probe(1.90, 1.46, 488), latency), 1);
  // 4 ranks on 2 cores: undisturbed probes reach 1.71x (s46), so the small probe is not judged.
  EXPECT_LT(engine_probe_disturbance(probe(1.45, 1.25, 110, 4), latency), 1);
  // An implausible round latency alone (2.5 ms against links of 30 us) is one too.
  EXPECT_GT(engine_probe_disturbance(probe(0.2, 0.9, 2500, 4), latency), 1);
  // On a paced link (no small probe) only alpha counts, and no link latency leaves it out too.
  Calibration paced = probe(1.68, 1.51, 90);
  paced.engine_link = LinearFit{};
  EXPECT_LT(engine_probe_disturbance(paced, latency), 1);
  EXPECT_NEAR(engine_probe_disturbance(probe(0.2, 0.9, 2500), 0), 0.2 / (0.8 * 0.9), 1e-12);
}

TEST(CostModel, RawRingFollowsItsFormula) {
  const Calibration c = synthetic(125e6, 50e-6);
  const CostModel model(c);
  const std::size_t n = 1 << 20;
  const double N = 4, s = n / N;
  const Prediction p = model.predict(n, "none", Strategy::kRaw, 1, 4, 4);
  const double want =
      c.job_overhead + 2 * (N - 1) * (c.alpha + 4 * s * c.beta) + (N - 1) * c.add(s) + c.divide(s);
  EXPECT_NEAR(p.seconds, want, want * 1e-12);
  EXPECT_NEAR(p.bytes_sent, 2 * (N - 1) * 4 * s, 1);
  // One rank: nothing to send.
  EXPECT_EQ(model.predict(n, "none", Strategy::kRaw, 1, 1, 4).bytes_sent, 0);
}

TEST(CostModel, BytesCostWhatTheSlowerOfTheLinkAndTheEngineMeasured) {
  Calibration c = synthetic(125e6, 50e-6);
  const std::size_t n = std::size_t{1} << 22;
  const Prediction link = CostModel(c).predict(n, "none", Strategy::kRaw, 1, 4, 4);
  c.engine_beta = c.beta / 2;  // faster in the engine than on the link: the link decides
  EXPECT_EQ(CostModel(c).predict(n, "none", Strategy::kRaw, 1, 4, 4).network, link.network);
  c.engine_beta = c.beta * 2;  // an allreduce moved bytes at half the exchange's rate
  const Prediction engine = CostModel(c).predict(n, "none", Strategy::kRaw, 1, 4, 4);
  EXPECT_DOUBLE_EQ(engine.network, 2 * link.network);
  EXPECT_GT(engine.seconds, link.seconds + 0.9 * link.network);
}

// Where the cores pace the links (engine_link measured), a partition's bytes cost what the
// engine's raw allreduce took for them: the in-cache rate up to the knee, the bulk rate beyond,
// in place of link_beta() (the bare exchange's slope can be the slower one there).
TEST(CostModel, BytesCostTheEnginesLinkWhereTheCoresPaceIt) {
  Calibration c = synthetic(1e9, 50e-6);
  c.engine_beta = 0.8e-9;  // the bulk probe's byte; beta (1 ns) is the larger
  const std::size_t small = std::size_t{1} << 16, large = std::size_t{1} << 22;
  const Prediction small_before = CostModel(c).predict(small, "none", Strategy::kRaw, 1, 4, 4);
  const Prediction large_before = CostModel(c).predict(large, "none", Strategy::kRaw, 1, 4, 4);
  EXPECT_DOUBLE_EQ(small_before.network, small_before.bytes_sent * c.beta);
  c.engine_link = testing::line(0, 0.3e-9);
  c.engine_link.knee = 1 << 20;
  c.engine_link.b2 = 0.9e-9;
  c.engine_link.points = 2;
  const CostModel model(c);
  // 64 Ki floats on 4 ranks: 384 KiB sent, under the knee.
  const Prediction small_p = model.predict(small, "none", Strategy::kRaw, 1, 4, 4);
  EXPECT_DOUBLE_EQ(small_p.network, small_p.bytes_sent * 0.3e-9);
  EXPECT_NEAR(small_before.seconds - small_p.seconds, small_p.bytes_sent * (1e-9 - 0.3e-9),
              1e-12);
  // 4 Mi floats: 24 MiB sent, most of them beyond the knee.
  const Prediction large_p = model.predict(large, "none", Strategy::kRaw, 1, 4, 4);
  const double W = large_p.bytes_sent;
  EXPECT_DOUBLE_EQ(large_p.network, (1 << 20) * 0.3e-9 + (W - (1 << 20)) * 0.9e-9);
  EXPECT_LT(large_p.seconds, large_before.seconds);
  // Per partition: 8 partitions of the large tensor send 3 MiB each.
  const Prediction parts = model.predict(large, "none", Strategy::kRaw, 8, 4, 4);
  EXPECT_NEAR(parts.network, 8 * c.engine_link(parts.bytes_sent / 8), 1e-12);
  // A compressed configuration's payload is priced the same way.
  const Prediction fp16 = model.predict(small, "fp16", Strategy::kAllgather, 1, 4, 4);
  EXPECT_DOUBLE_EQ(fp16.network, fp16.bytes_sent * 0.3e-9);
}

TEST(CostModel, SmallRawMessagesAreGathered) {
  const Calibration c = synthetic(125e6, 1e-3);
  const CostModel model(c);
  const std::size_t n = 1000;  // 3 peers x 4,000 bytes <= EngineOptions::gather_bytes
  const Prediction p = model.predict(n, "none", Strategy::kRaw, 1, 4, 4);
  EXPECT_NEAR(p.bytes_sent, 3 * 4.0 * n, 1e-9);
  const double want = c.job_overhead + c.alpha + 3 * 4.0 * n * c.beta + 3 * c.add(n) + c.divide(n);
  EXPECT_NEAR(p.seconds, want, want * 1e-12);
  // Past the bound: the ring's 2(N-1) steps again.
  const std::size_t big = EngineOptions{}.gather_bytes;
  EXPECT_NEAR(model.predict(big, "none", Strategy::kRaw, 1, 4, 4).bytes_sent,
              2 * 3 * 4.0 * std::ceil(big / 4.0 / 64) * 64, 1e-6);
  // An engine that does not gather (gather_bytes 0, as calibration's probe engine): the ring,
  // 2(N-1) message steps, even for the small tensor.
  CostModel ring(c);
  ring.set_gather_bytes(0);
  const Prediction r = ring.predict(n, "none", Strategy::kRaw, 1, 4, 4);
  EXPECT_NEAR(r.bytes_sent, 2 * 3 * 4.0 * std::ceil(n / 4.0 / 64) * 64, 1e-6);
  EXPECT_GT(r.seconds, p.seconds + 4 * c.alpha);  // 6 steps instead of 1
}

TEST(CostModel, PartitionsPipelineTheSlowestResource) {
  const Calibration c = synthetic(125e6, 50e-6);
  const CostModel model(c);
  const std::string onebit = make_codec("onebit:ef=1")->spec();
  const std::size_t n = std::size_t{16} << 20;
  const Prediction one = model.predict(n, onebit, Strategy::kSharded, 1, 4, 4);
  const Prediction four = model.predict(n, onebit, Strategy::kSharded, 4, 4, 4);
  // Same bytes either way; with 4 partitions CPU work overlaps the link, so it is faster, but
  // never faster than the link alone or the CPU alone.
  EXPECT_NEAR(one.bytes_sent, four.bytes_sent, one.bytes_sent * 0.01);
  EXPECT_LT(four.seconds, one.seconds);
  EXPECT_GE(four.seconds, four.network);
  EXPECT_GE(four.seconds, four.cpu / 4);
  // Where the CPU is the bottleneck (a fast link), a CPU contended 4x (four busy threads on one
  // core) gains nothing from more workers.
  const Calibration fast = synthetic(10e9, 50e-6);
  Calibration slow = fast;
  slow.cpu_slowdown = {1.0, 2.0, 3.0, 4.0};
  const double free_cores = CostModel(fast).predict(n, onebit, Strategy::kSharded, 4, 4, 4).seconds;
  const double contended = CostModel(slow).predict(n, onebit, Strategy::kSharded, 4, 4, 4).seconds;
  const double single = CostModel(slow).predict(n, onebit, Strategy::kSharded, 1, 4, 4).seconds;
  EXPECT_GT(contended, free_cores * 1.5);
  EXPECT_GT(contended, single * 0.8);
}

TEST(CostModel, NeverBelowWhatTheHostsCoresCanDo) {
  // A link fast enough that the CPU decides.
  Calibration c = synthetic(10e9, 50e-6);
  const std::string onebit = make_codec("onebit:ef=1")->spec();
  const std::size_t n = std::size_t{16} << 20;
  const Prediction alone = CostModel(c).predict(n, onebit, Strategy::kSharded, 4, 4, 4);
  // One rank on 8 cores: the host bound is an eighth of its CPU, far below the model's time.
  EXPECT_GT(alone.seconds, 2 * alone.host_cpu / 8);
  EXPECT_GT(alone.host_cpu, 0);
  // Four ranks on two cores, with the transport's CPU measured: every rank's CPU work and
  // copies, twice over, since each rank has half a core.
  c.ranks_on_host = 4;
  c.cores = 2;
  c.cpu_per_message = 80e-6;
  c.transport_cpu = testing::line(0, 0.7e-9);
  c.transport_cpu.knee = 1 << 20;
  c.transport_cpu.b2 = 0.5e-9;
  const Prediction shared = CostModel(c).predict(n, onebit, Strategy::kSharded, 4, 4, 4);
  const double W = shared.bytes_sent / 4;  // per partition
  EXPECT_NEAR(shared.host_cpu - alone.host_cpu, 4 * (c.transport_cpu(W) + 6 * c.cpu_per_message),
              1e-12);
  EXPECT_DOUBLE_EQ(shared.seconds, 2 * shared.host_cpu);
  // Ranks that wait on each other leave the cores idle part of the time: the measured factor
  // stretches the bound, and nothing else.
  c.host_efficiency = 1.25;
  const Prediction idle = CostModel(c).predict(n, onebit, Strategy::kSharded, 4, 4, 4);
  EXPECT_DOUBLE_EQ(idle.host_cpu, shared.host_cpu);
  EXPECT_DOUBLE_EQ(idle.seconds, 2 * 1.25 * shared.host_cpu);
  c.host_efficiency = 1;
  // Allgather sends N - 1 messages a partition, not 2(N - 1).
  c.transport_cpu = LinearFit{};
  const Prediction gather = CostModel(c).predict(n, onebit, Strategy::kAllgather, 1, 4, 4);
  c.cpu_per_message = 0;
  EXPECT_NEAR(
      gather.host_cpu - CostModel(c).predict(n, onebit, Strategy::kAllgather, 1, 4, 4).host_cpu,
      3 * 80e-6, 1e-12);
}

TEST(CostModel, AWiresTimeDoesNotOverlapTheHostsCPUWork) {
  // Three ranks on two cores behind 1 Gbit/s wires (a shaped link: the cores do not pace it).
  Calibration c = synthetic(125e6, 50e-6, 3);
  c.ranks_on_host = 3;
  c.cores = 2;
  c.transport_cpu = testing::line(0, 0.1e-9);
  const std::string onebit = make_codec("onebit:ef=1")->spec();
  const std::size_t n = std::size_t{4} << 20;
  // One partition: the ranks compute together, then their bytes cross while none computes.
  const Prediction one = CostModel(c).predict(n, onebit, Strategy::kSharded, 1, 3, 4);
  const double W = one.bytes_sent;
  ASSERT_GT(one.host_bound, c.link_seconds(W));
  EXPECT_DOUBLE_EQ(one.seconds, one.host_bound + c.link_seconds(W) - c.transport_cpu(W));
  // Eight: only the last partition's bytes are left to cross once the cores are done.
  const Prediction eight = CostModel(c).predict(n, onebit, Strategy::kSharded, 8, 3, 4);
  const double w = eight.bytes_sent / 8;
  EXPECT_DOUBLE_EQ(eight.seconds, eight.host_bound + c.link_seconds(w) - c.transport_cpu(w));
  EXPECT_LT(eight.seconds, one.seconds);
  // Where the cores pace the links (loopback), the link is their work and runs beside theirs:
  // the same link costs less than the host's CPU and the wire in turn.
  c.engine_link = testing::line(0, c.beta);
  c.engine_link.points = 2;
  const Prediction paced = CostModel(c).predict(n, onebit, Strategy::kSharded, 1, 3, 4);
  EXPECT_DOUBLE_EQ(paced.host_bound, one.host_bound);
  EXPECT_LT(paced.seconds, paced.host_bound + c.link_seconds(W) - c.transport_cpu(W));
}

TEST(CostModel, APiecesWorkCostsItsRateOverTheWholeTensor) {
  // onebit's encode costs 3x as much per element once its data leave the cache (512 Ki floats).
  Calibration c = synthetic(10e9, 50e-6);
  const std::string onebit = make_codec("onebit:ef=1")->spec();
  const auto codec = std::find_if(c.codecs.begin(), c.codecs.end(),
                                  [&](const CodecCosts& k) { return k.spec == onebit; });
  ASSERT_NE(codec, c.codecs.end());
  LinearFit& encode = codec->encode;
  encode.knee = 1 << 19;
  encode.b2 = 3 * encode.b;
  const CostModel tensor(c);
  CostModel pieces(c);
  pieces.set_tensor_rates(false);
  EXPECT_TRUE(tensor.tensor_rates());
  EXPECT_FALSE(pieces.tensor_rates());
  // A 16 Mi-float tensor on 4 ranks in 8 partitions: each rank encodes 4 shards of 512 Ki
  // floats a partition, all of them out of the cache, since the tensor is.
  const std::size_t n = std::size_t{16} << 20;
  const double s = 512 << 10;
  const double at_rate = encode.a + (encode(double(n)) - encode.a) * s / double(n);
  EXPECT_GT(at_rate, 1.9 * encode(s));
  const Prediction t = tensor.predict(n, onebit, Strategy::kSharded, 8, 4, 4);
  const Prediction p = pieces.predict(n, onebit, Strategy::kSharded, 8, 4, 4);
  EXPECT_NEAR(t.host_cpu - p.host_cpu, 8 * 4 * (at_rate - encode(s)), 1e-12);
  EXPECT_GT(t.seconds, p.seconds);
  EXPECT_EQ(t.bytes_sent, p.bytes_sent);
  // One partition of the whole tensor, or a tensor that fits in the cache: the same either way.
  EXPECT_EQ(tensor.predict(n, onebit, Strategy::kAllgather, 1, 4, 4).seconds,
            pieces.predict(n, onebit, Strategy::kAllgather, 1, 4, 4).seconds);
  const std::size_t small = 256 << 10;
  EXPECT_EQ(tensor.predict(small, onebit, Strategy::kSharded, 8, 4, 4).seconds,
            pieces.predict(small, onebit, Strategy::kSharded, 8, 4, 4).seconds);
}

TEST(Calibration, HostFactorRebasesOntoTheModelsPricing) {
  // Four ranks on two cores, measured against the model that priced pieces at their own rate:
  // the host probe's process CPU was 1.2x that model's CPU for it, its wall time 1.25x.
  Calibration c = synthetic(125e6, 50e-6);
  c.ranks_on_host = 4;
  c.cores = 2;
  for (auto& k : c.codecs) {
    for (LinearFit* f : {&k.encode, &k.decode, &k.accumulate}) {
      f->knee = 1 << 14;
      f->b2 = 3 * f->b;
    }
  }
  c.host_cpu_ratio = 1.2;
  c.host_efficiency = 1.25 * 1.2;
  c.tensor_rates = false;
  // The tensor's rate counts more of that CPU in the model: less of it is left unexplained.
  const Calibration rebased = rebase_host_factor(c, true);
  EXPECT_TRUE(rebased.tensor_rates);
  EXPECT_LT(rebased.host_cpu_ratio, c.host_cpu_ratio);
  EXPECT_NEAR(rebased.host_efficiency / rebased.host_cpu_ratio, 1.25, 1e-12);
  const Calibration back = rebase_host_factor(rebased, false);
  EXPECT_FALSE(back.tensor_rates);
  EXPECT_NEAR(back.host_cpu_ratio, 1.2, 1e-12);
  EXPECT_NEAR(back.host_efficiency, 1.5, 1e-12);
  // Already on that pricing: unchanged.
  EXPECT_EQ(rebase_host_factor(rebased, true).to_json(), rebased.to_json());
  // A core to each rank: the ratio is not counted (the process's CPU stands in), nothing to
  // rebase but the flag.
  c.cores = 4;
  const Calibration own_cores = rebase_host_factor(c, true);
  EXPECT_TRUE(own_cores.tensor_rates);
  EXPECT_EQ(own_cores.host_efficiency, c.host_efficiency);
  EXPECT_EQ(own_cores.host_cpu_ratio, c.host_cpu_ratio);
}

TEST(Calibration, SlowdownIsNeverBelowWhatTheCoresImpose) {
  Calibration c = synthetic(125e6, 50e-6);
  c.cpu_slowdown = {1.0, 1.0, 1.0, 1.14};  // a disturbed measurement
  c.ranks_on_host = 2;
  c.cores = 2;  // 2 ranks of t threads on 2 cores: t times slower than 1 thread each
  EXPECT_DOUBLE_EQ(c.slowdown(2), 2.0);
  EXPECT_DOUBLE_EQ(c.slowdown(3.5), 3.5);
  EXPECT_DOUBLE_EQ(c.slowdown(8), 8.0);
  c.ranks_on_host = 4;  // 4 ranks: already 2 a core with one thread each
  EXPECT_DOUBLE_EQ(c.slowdown(2), 2.0);
  c.cpu_slowdown = {1.0, 2.5, 3.5, 4.5};  // measured above the bound: the measurement stands
  EXPECT_DOUBLE_EQ(c.slowdown(2), 2.5);
  c.ranks_on_host = 2;
  c.cores = 16;  // cores to spare: the measurement alone
  c.cpu_slowdown = {1.0, 1.0, 1.1, 1.2};
  EXPECT_DOUBLE_EQ(c.slowdown(2), 1.0);
  EXPECT_DOUBLE_EQ(c.slowdown(4), 1.2);
  EXPECT_DOUBLE_EQ(c.saturation(16), 2.0);
}

TEST(CostModel, StrategiesScaleAsTheirSchedulesSay) {
  const Calibration c = synthetic(1.25e9, 20e-6, 1024);
  const CostModel model(c);
  const std::string onebit = make_codec("onebit:ef=1")->spec();
  const std::size_t n = std::size_t{25} << 20;
  // Allgather's bytes grow with N; sharded's and the ring's do not.
  const double ag8 = model.predict(n, onebit, Strategy::kAllgather, 1, 8, 4).bytes_sent;
  const double ag64 = model.predict(n, onebit, Strategy::kAllgather, 1, 64, 4).bytes_sent;
  EXPECT_NEAR(ag64 / ag8, 63.0 / 7.0, 0.01);
  const double sh8 = model.predict(n, onebit, Strategy::kSharded, 1, 8, 4).bytes_sent;
  const double sh1024 = model.predict(n, onebit, Strategy::kSharded, 1, 1024, 4).bytes_sent;
  EXPECT_LT(sh1024 / sh8, 1.2);
  // The ring's latency term grows linearly with N, the sharded one's does not.
  const std::size_t small = 1 << 16;
  const double ring = model.predict(small, onebit, Strategy::kRing, 1, 1024, 4).seconds;
  const double sharded = model.predict(small, onebit, Strategy::kSharded, 1, 1024, 4).seconds;
  EXPECT_GT(ring, 1024 * c.alpha);
  EXPECT_LT(sharded, ring);
}

TEST(CostModel, RejectsWhatTheEngineWouldReject) {
  const CostModel model(synthetic(125e6, 50e-6));
  EXPECT_THROW(model.predict(1000, "none", Strategy::kSharded, 1, 4, 4), InvalidArgument);
  EXPECT_THROW(model.predict(1000, make_codec("fp16")->spec(), Strategy::kRaw, 1, 4, 4),
               InvalidArgument);
  EXPECT_THROW(model.predict(1000, make_codec("onebit:ef=1")->spec(), Strategy::kSummable, 1, 4, 4),
               InvalidArgument);
  EXPECT_THROW(model.predict(1000, "topk-that-was-not-calibrated", Strategy::kSharded, 1, 4, 4),
               InvalidArgument);
  EXPECT_THROW(model.predict(1000, "none", Strategy::kAuto, 1, 4, 4), InvalidArgument);
}

// ---- decisions ------------------------------------------------------------------------------

PlannerOptions options() {
  PlannerOptions o;
  o.allowed = {"fp16", "onebit:ef=1"};
  o.cache_path = "-";
  return o;
}

TEST(Planner, TinyTensorsGoRawAndSlowLinksCompress) {
  Planner slow_link(options(), synthetic(12.5e6, 100e-6));  // 100 Mbit/s
  EXPECT_EQ(slow_link.decide(100, 4, 4).chosen.plan.strategy, Strategy::kRaw);
  EXPECT_EQ(slow_link.decide(1000, 4, 4).chosen.plan.codec, "none");
  const PlanDecision big = slow_link.decide(std::size_t{16} << 20, 4, 4);
  EXPECT_NE(big.chosen.plan.codec, "none");
  EXPECT_LT(big.chosen.predicted.seconds, big.raw_seconds / 4);
  // Candidates are ranked by expected time; every one has a prediction.
  for (std::size_t i = 1; i < big.ranked.size(); ++i) {
    EXPECT_LE(PlanDecision::expected(big.ranked[i - 1]), PlanDecision::expected(big.ranked[i]));
  }
}

TEST(Planner, RawWhenCompressionDoesNotPay) {
  // A link faster than any codec: every compressed plan loses, so raw is chosen at every size.
  Calibration fast = synthetic(1e12, 10e-6);
  for (auto& k : fast.codecs) k.encode = line(2e-6, 5e-9);
  Planner planner(options(), fast);
  for (std::size_t n : {std::size_t{1} << 14, std::size_t{1} << 20, std::size_t{1} << 26}) {
    EXPECT_EQ(planner.decide(n, 4, 4).chosen.plan.strategy, Strategy::kRaw) << n;
  }
}

TEST(Planner, MarginKeepsRawWhenCompressionBarelyWins) {
  Calibration c = synthetic(125e6, 50e-6);
  PlannerOptions o = options();
  Planner base(o, c);
  const std::size_t n = std::size_t{4} << 20;
  const PlanDecision d = base.decide(n, 4, 4);
  ASSERT_NE(d.chosen.plan.codec, "none");
  const double gain = 1 - d.chosen.predicted.seconds / d.raw_seconds;
  o.min_gain = gain + 0.01;
  Planner cautious(o, c);
  EXPECT_EQ(cautious.decide(n, 4, 4).chosen.plan.codec, "none");
}

TEST(Planner, RestrictionsAndValidation) {
  Planner planner(options(), synthetic(12.5e6, 100e-6));
  const std::size_t n = std::size_t{1} << 22;
  EXPECT_EQ(planner.decide(n, 4, 4, Strategy::kSummable).chosen.plan.codec,
            make_codec("fp16")->spec());
  EXPECT_EQ(planner.decide(n, 4, 4, Strategy::kAuto, 3).chosen.plan.partitions, 3);
  EXPECT_EQ(planner.decide(n, 4, 4, Strategy::kRaw).chosen.plan.codec, "none");
  PlannerOptions bad = options();
  bad.allowed = {"nosuchcodec"};
  EXPECT_THROW(Planner{bad}, SpecError);
  PlannerOptions missing = options();
  missing.allowed = {"bf16"};
  EXPECT_THROW(Planner(missing, synthetic(12.5e6, 100e-6)), InvalidArgument);
  Planner uncalibrated(options());
  EXPECT_FALSE(uncalibrated.calibrated());
  EXPECT_THROW(uncalibrated.decide(n, 4, 4), InvalidArgument);
}

TEST(CostModel, MultiRoundCodecSumsEachRoundOnTheRawRing) {
  Calibration c = synthetic(12.5e6, 100e-6);
  testing::add_powersgd(c);
  const CostModel model(c);
  auto codec = make_codec("powersgd");
  const auto& rounds = dynamic_cast<const RoundCodec&>(*codec);
  const std::size_t n = std::size_t{1} << 20;  // viewed as 1024 x 1024
  const double N = 4;
  double want = c.job_overhead + c.codecs.back().encode(n) + c.divide(n);
  double bytes = 0;
  for (int r = 0; r < rounds.rounds(); ++r) {
    const double chunk = std::ceil(rounds.round_elements(r, n) / N / 64) * 64;
    want += 2 * (N - 1) * (c.alpha + 4 * chunk * c.beta) + (N - 1) * c.add(chunk);
    bytes += 2 * (N - 1) * 4 * chunk;
  }
  const Prediction p = model.predict(n, codec->spec(), Strategy::kSummable, 1, 4, 4);
  EXPECT_NEAR(p.seconds, want, want * 1e-12);
  EXPECT_NEAR(p.bytes_sent, bytes, 1);
  // 4 x (1024 + 1024) floats per rank and round trip: about 1.5% of raw's bytes.
  EXPECT_LT(p.bytes_sent, 0.02 * model.predict(n, "none", Strategy::kRaw, 1, 4, 4).bytes_sent);
  // Its rounds need the sums of whole matrices: one partition, on the ring.
  EXPECT_THROW(model.predict(n, codec->spec(), Strategy::kSummable, 4, 4, 4), InvalidArgument);
  EXPECT_THROW(model.predict(n, codec->spec(), Strategy::kSharded, 1, 4, 4), InvalidArgument);
}
TEST(CostModel, MultiRoundCodecWithAWireCodecSumsOnTheSummableRing) {
  Calibration c = synthetic(12.5e6, 100e-6);
  testing::add_powersgd(c, "powersgd:wire=fp16");
  const CostModel model(c);
  auto codec = make_codec("powersgd:wire=fp16");
  const auto& rounds = dynamic_cast<const RoundCodec&>(*codec);
  const std::size_t n = std::size_t{1} << 20;
  const double N = 4;
  double want = c.job_overhead + c.codecs.back().encode(n) + c.divide(n);
  double bytes = 0;
  const CodecCosts& fp16 = *c.find(make_codec("fp16")->spec());  // synthetic() calibrates it
  for (int r = 0; r < rounds.rounds(); ++r) {
    const double chunk = std::ceil(rounds.round_elements(r, n) / N / 64) * 64;
    const double message = 24 + 2 * chunk;  // header and 16-bit values
    want += N * c.alpha + 2 * (N - 1) * message * c.beta + N * fp16.encode(chunk) +
            (N - 1) * fp16.combine(chunk) + N * fp16.decode(chunk);
    bytes += 2 * (N - 1) * message;
  }
  const Prediction p = model.predict(n, codec->spec(), Strategy::kSummable, 1, 4, 4);
  EXPECT_NEAR(p.seconds, want, want * 1e-12);
  EXPECT_NEAR(p.bytes_sent, bytes, 1);
  // Half the bytes of the fp32 round sums, and fewer message steps.
  testing::add_powersgd(c);
  const CostModel both(c);
  const Prediction exact = both.predict(n, make_codec("powersgd")->spec(), Strategy::kSummable, 1,
                                        4, 4);
  EXPECT_LT(p.bytes_sent, 0.51 * exact.bytes_sent);
  EXPECT_LT(p.seconds, exact.seconds);
}

TEST(Planner, ChoosesPowerSgdWhereItsRoundsPay) {
  Calibration c = synthetic(12.5e6, 100e-6);  // 100 Mbit/s
  testing::add_powersgd(c);
  PlannerOptions o = options();
  o.allowed = {"fp16", "onebit:ef=1", "powersgd"};
  Planner planner(o, c);
  const std::string powersgd = make_codec("powersgd")->spec();
  const PlanDecision big = planner.decide(std::size_t{1} << 22, 4, 4);
  EXPECT_EQ(big.chosen.plan.codec, powersgd);
  EXPECT_EQ(big.chosen.plan.strategy, Strategy::kSummable);
  EXPECT_EQ(big.chosen.plan.partitions, 1);
  // Only ever one partition among the candidates.
  for (const auto& cand : big.ranked) {
    if (cand.plan.codec == powersgd) {
      EXPECT_EQ(cand.plan.partitions, 1);
    }
  }
  // Restrictions it cannot meet leave it out.
  EXPECT_NE(planner.decide(std::size_t{1} << 22, 4, 4, Strategy::kAuto, 4).chosen.plan.codec,
            powersgd);
  EXPECT_NE(planner.decide(std::size_t{1} << 22, 4, 4, Strategy::kSharded).chosen.plan.codec,
            powersgd);
  // A fast link: its fixed CPU cost and four extra ring passes are not worth it.
  Calibration fast = synthetic(10e9, 10e-6);
  testing::add_powersgd(fast);
  Planner quick(o, fast);
  EXPECT_NE(quick.decide(std::size_t{1} << 16, 4, 4).chosen.plan.codec, powersgd);
}

TEST(Planner, GathersPowerSgdRoundsWhereLatencyDominates) {
  // 1 Gbit/s with the 2 ms message latency measured inside training jobs on this machine.
  Calibration c = synthetic(125e6, 2e-3);
  testing::add_powersgd(c);
  const CostModel model(c);
  const std::string powersgd = make_codec("powersgd")->spec();
  const auto codec = make_codec("powersgd");
  const auto& rounds = dynamic_cast<const RoundCodec&>(*codec);
  const std::size_t n = 128 * 3136;  // a CNN's fully connected layer
  const Prediction gathered = model.predict(n, powersgd, Strategy::kAllgather, 1, 4, 4);
  const Prediction ring = model.predict(n, powersgd, Strategy::kSummable, 1, 4, 4);
  double bytes = 0;  // every contribution, exact fp32 with a header, to each of 3 peers
  for (int r = 0; r < rounds.rounds(); ++r) bytes += 3 * (24 + 4.0 * rounds.round_elements(r, n));
  EXPECT_NEAR(gathered.bytes_sent, bytes, 1e-6);
  EXPECT_GT(gathered.bytes_sent, ring.bytes_sent);  // more bytes ...
  EXPECT_LT(gathered.seconds, ring.seconds);        // ... but 2 message steps, not 12
  PlannerOptions o = options();
  o.allowed = {"powersgd"};
  const PlanDecision d = Planner(o, c).decide(n, 4, 4);
  EXPECT_EQ(d.chosen.plan.codec, powersgd);
  EXPECT_EQ(d.chosen.plan.strategy, Strategy::kAllgather);
  // At 100 Mbit/s and 100 us the bytes decide: rings.
  Calibration slow = synthetic(12.5e6, 100e-6);
  testing::add_powersgd(slow);
  EXPECT_EQ(Planner(o, slow).decide(n, 4, 4).chosen.plan.strategy, Strategy::kSummable);
}

TEST(Calibration, MeasuresMultiRoundCodecs) {
  CalibrationOptions co;
  co.codecs = {"fp16", "powersgd"};
  co.codec_max_elements = std::size_t{1} << 16;
  const Calibration c = calibrate_local(co, 4, 1);
  const CodecCosts* k = c.find(make_codec("powersgd")->spec());
  ASSERT_NE(k, nullptr);
  EXPECT_TRUE(k->multi_round);
  EXPECT_GT(k->encode(1 << 16), 0);
  EXPECT_EQ(k->decode(1 << 16), 0);  // no payload to decode
  // Contributions of a rank-4 factorization: 4 x (rows + cols) floats, far fewer than n.
  ASSERT_FALSE(k->bytes.ys.empty());
  EXPECT_LT(k->bytes.ys.back(), 0.1 * 4 * k->bytes.xs.back());
  EXPECT_FALSE(c.find(make_codec("fp16")->spec())->multi_round);
  const Calibration back = Calibration::from_json(c.to_json());
  EXPECT_TRUE(back.find(k->spec)->multi_round);
  EXPECT_EQ(back.to_json(), c.to_json());
}

TEST(Calibration, JsonRoundTripsAndRejectsOtherText) {
  Calibration c = synthetic(125e6, 50e-6);
  c.add.knee = 4096;
  c.add.b2 = 1e-9;
  c.add.xs = {1, 2};
  c.add.ys = {3, 4};
  c.engine_beta = 3 * c.beta;
  c.cpu_per_message = 70e-6;
  c.host_efficiency = 1.17;
  c.host_cpu_ratio = 1.4;
  c.transport_cpu = testing::line(0, 0.7e-9);
  c.transport_cpu.knee = 1 << 20;
  c.transport_cpu.b2 = 0.5e-9;
  c.engine_link = testing::line(0, 0.4e-9);
  c.engine_link.knee = 1 << 20;
  c.engine_link.b2 = 1.1e-9;
  c.engine_link.points = 2;
  c.tensor_rates = false;
  const Calibration back = Calibration::from_json(c.to_json());
  EXPECT_EQ(back.to_json(), c.to_json());
  EXPECT_FALSE(back.tensor_rates);
  // A calibration written before the field existed was measured against pieces' own rates.
  auto text = nlohmann::json::parse(synthetic(125e6, 50e-6).to_json());
  EXPECT_TRUE(Calibration::from_json(text.dump()).tensor_rates);
  text.erase("tensor_rates");
  EXPECT_FALSE(Calibration::from_json(text.dump()).tensor_rates);
  EXPECT_EQ(back.engine_beta, c.engine_beta);
  EXPECT_EQ(back.link_seconds(4 << 20), c.link_seconds(4 << 20));
  EXPECT_EQ(back.cpu_per_message, c.cpu_per_message);
  EXPECT_EQ(back.host_efficiency, c.host_efficiency);
  EXPECT_EQ(back.host_cpu_ratio, c.host_cpu_ratio);
  EXPECT_EQ(back.transport_cpu(4 << 20), c.transport_cpu(4 << 20));
  EXPECT_EQ(back.add(8192), c.add(8192));
  EXPECT_THROW(Calibration::from_json("{}"), DecodeError);
  EXPECT_THROW(Calibration::from_json("not json"), DecodeError);
  EXPECT_NE(default_calibration_path(3).find("-n3.json"), std::string::npos);
}

// ---- re-checks (one rank: the exchange is local) ---------------------------------------------

TEST(Planner, RecheckReplansWhenMeasuredTimesDisagree) {
  const std::string dir = testing::temp_dir();
  CommunicatorOptions co;
  co.timeout = 5s;
  auto comm = Communicator::create(0, 1, make_file_store(dir), co);
  PlannerOptions o = options();
  o.recheck_interval = 2;
  o.recheck_threshold = 0.25;
  o.explore_candidates = 1;  // re-checks alone
  // One rank: raw costs nothing but a task hand-off, so it is the first choice.
  Planner planner(o, synthetic(12.5e6, 100e-6, 1));
  const std::size_t n = std::size_t{1} << 22;
  const TensorPlan first = planner.plan(*comm, n, 4);
  ASSERT_EQ(first.strategy, Strategy::kRaw);
  const PlanDecision d = planner.decide(n, 1, 4);
  double compressed = 0;
  for (const auto& c : d.ranked) {
    if (c.plan.codec != "none" && compressed == 0) compressed = c.predicted.seconds;
  }
  // Measured as predicted: no re-plan.
  planner.observe(n, first, d.chosen.predicted.seconds * 1.1);
  EXPECT_EQ(planner.before_submission(*comm), 0);
  EXPECT_EQ(planner.before_submission(*comm), 0);
  // Measured far slower than expected (slower than a compressed plan is predicted to be): the
  // size is re-planned with the measurement in place of the prediction.
  planner.observe(n, first, compressed * 2);
  EXPECT_EQ(planner.before_submission(*comm), 0);  // not due yet
  EXPECT_EQ(planner.before_submission(*comm), 1);
  const PlanDecision again = planner.decide(n, 1, 4);
  bool seen = false;
  for (const auto& c : again.ranked) {
    if (plan_key(c.plan) != plan_key(first)) continue;
    ASSERT_TRUE(c.measured.has_value());
    EXPECT_NEAR(*c.measured, compressed * 2, 1e-12);
    seen = true;
  }
  EXPECT_TRUE(seen);
  EXPECT_NE(planner.plan(*comm, n, 4).codec, "none");
  comm.reset();
  std::filesystem::remove_all(dir);
}

// ---- exploration (one rank: the exchange is local) --------------------------------------------

// Whether the plan of key `key` is one of d's contenders.
bool listed(const PlanDecision& d, const std::string& key) {
  return std::any_of(d.contenders.begin(), d.contenders.end(),
                     [&](const PlanCandidate& c) { return plan_key(c.plan) == key; });
}

// A one-rank planner whose contenders for n are the best `count` candidates.
struct Explorer {
  // explore_seconds: 0 for exactly `runs` runs per contender. close: explore_close (0: one
  // round).
  // neighbours: explore_neighbours (off here but in its own test, so that the second rounds
  // of the others hold the close contenders alone; explore_family_seconds is off likewise).
  // shuffle: explore_shuffle (off but in its own test, so that the others can check which
  // contender runs when).
  explicit Explorer(int count, int runs = 2, double explore_seconds = 0, double close = 0,
                    bool neighbours = false, bool shuffle = false) {
    dir = testing::temp_dir();
    CommunicatorOptions co;
    co.timeout = 5s;
    comm = Communicator::create(0, 1, make_file_store(dir), co);
    PlannerOptions o = options();
    o.recheck_interval = 0;
    o.explore_candidates = count;
    o.explore_within = 1e9;  // every candidate is a contender
    o.explore_codec_within = 0;  // and no other codec's best beyond the count
    o.explore_runs = runs;
    o.explore_seconds = explore_seconds;
    o.explore_again_seconds = explore_seconds;  // 0: later rounds run `runs` too
    o.explore_close = close;
    o.explore_neighbours = neighbours;
    o.explore_family_seconds = 0;  // off but in its own test, as explore_neighbours
    o.explore_shuffle = shuffle;
    with(o);
  }
  // A fresh planner with the options `o` (a test's changes to options()).
  void with(const PlannerOptions& o) {
    planner = std::make_unique<Planner>(o, synthetic(12.5e6, 100e-6, 1));
  }
  ~Explorer() {
    planner.reset();
    comm.reset();
    std::filesystem::remove_all(dir);
  }
  // One submission of n: before_submission, then plan; returns the plan it ran.
  TensorPlan submit(std::size_t n, int* changed = nullptr) {
    const Planner::Use use{n, 4, Strategy::kAuto, 0};
    const int c = planner->before_submission(*comm, std::span(&use, 1));
    if (changed != nullptr) *changed += c;
    return planner->plan(*comm, n, 4);
  }
  // Submits n until its exploration settles (at most `limit` runs), each run observed as
  // taking time_of(its plan's key); returns the keys that ran, in order, and the settled plan
  // (the next submission's) in `settled`.
  template <typename TimeOf>
  std::vector<std::string> explore(std::size_t n, const TimeOf& time_of, TensorPlan& settled,
                                   std::size_t limit = 40) {
    std::vector<std::string> ran;
    settled = submit(n);
    while (planner->exploring(n, 4) && ran.size() < limit) {
      ran.push_back(plan_key(settled));
      planner->observe(n, settled, time_of(plan_key(settled)));
      settled = submit(n);
    }
    return ran;
  }
  std::string dir;
  std::shared_ptr<Communicator> comm;
  std::unique_ptr<Planner> planner;
};

TEST(Planner, ExplorationTakesContendersInTurnThenKeepsTheFastestMeasured) {
  Explorer e(3, 2);
  const std::size_t n = std::size_t{1} << 22;
  const PlanDecision d = e.planner->decide(n, 1, 4);
  ASSERT_EQ(d.contenders.size(), 3u);
  EXPECT_EQ(plan_key(d.contenders[0].plan), plan_key(d.chosen.plan));
  // The contenders take turns, one submission each, until each has run explore_runs; the last
  // one measures fastest.
  const std::vector<double> times = {3e-3, 2e-3, 1e-3};
  int changed = 0;
  for (int run = 0; run < 2; ++run) {
    for (std::size_t i = 0; i < 3; ++i) {
      const TensorPlan p = e.submit(n, &changed);
      ASSERT_EQ(plan_key(p), plan_key(d.contenders[i].plan)) << "contender " << i << " run " << run;
      EXPECT_TRUE(e.planner->exploring(n, 4));
      e.planner->observe(n, p, times[i]);
    }
  }
  EXPECT_EQ(changed, 5);  // every submission after the first ran another contender
  const TensorPlan settled = e.submit(n, &changed);
  EXPECT_EQ(plan_key(settled), plan_key(d.contenders[2].plan));
  EXPECT_FALSE(e.planner->exploring(n, 4));
  EXPECT_EQ(changed, 5);  // settling on the third, which ran last, changes nothing
  // Settled for good: the plan stays.
  for (int run = 0; run < 5; ++run) EXPECT_EQ(plan_key(e.submit(n)), plan_key(settled));
}

TEST(Planner, ExplorationRunsEachPassInAFreshOrderTheSameOnEveryRank) {
  // Two planners with the same options stand for two ranks. Four contenders, five runs each,
  // one round: five passes, each running every contender once; the first starts with the
  // model's choice (it runs when the size is first planned). The third contender measures
  // fastest, by 20%.
  const std::size_t n = std::size_t{1} << 22;
  std::vector<std::string> in_turn;
  std::vector<std::string> ran[2];
  TensorPlan settled[2];
  for (int rank = 0; rank < 2; ++rank) {
    Explorer e(4, 5, 0, 0, false, true);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.contenders.size(), 4u);
    in_turn.clear();
    for (const auto& c : d.contenders) in_turn.push_back(plan_key(c.plan));
    auto time_of = [&](const std::string& key) { return key == in_turn[2] ? 0.8e-3 : 1e-3; };
    ran[rank] = e.explore(n, time_of, settled[rank]);
    EXPECT_FALSE(e.planner->exploring(n, 4));
  }
  EXPECT_EQ(ran[0], ran[1]);
  ASSERT_EQ(ran[0].size(), 20u);
  EXPECT_EQ(ran[0].front(), in_turn.front());
  std::vector<std::string> all = in_turn;
  std::sort(all.begin(), all.end());
  int shuffled = 0;
  for (std::size_t pass = 0; pass < 5; ++pass) {
    std::vector<std::string> order(ran[0].begin() + 4 * pass, ran[0].begin() + 4 * pass + 4);
    shuffled += order != in_turn;
    std::sort(order.begin(), order.end());
    EXPECT_EQ(order, all) << "pass " << pass << ": each contender once";
  }
  EXPECT_GE(shuffled, 3) << "passes in the contenders' own order";
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(plan_key(settled[rank]), in_turn[2]) << rank;
}

TEST(Planner, ExplorationRunsTheCloseContendersAgainAndKeepsTheBestOfBothRounds) {
  Explorer e(3, 2, 0, 0.1);
  const std::size_t n = std::size_t{1} << 22;
  const PlanDecision d = e.planner->decide(n, 1, 4);
  ASSERT_EQ(d.contenders.size(), 3u);
  auto key = [&](std::size_t i) { return plan_key(d.contenders[i].plan); };
  // First round: the first two measure within 10% of each other, the third twice as slow.
  const std::vector<double> first = {1.00e-3, 1.05e-3, 2e-3};
  for (int run = 0; run < 2; ++run) {
    for (std::size_t i = 0; i < 3; ++i) {
      const TensorPlan p = e.submit(n);
      ASSERT_EQ(plan_key(p), key(i)) << "first round, contender " << i << " run " << run;
      e.planner->observe(n, p, first[i]);
    }
  }
  // Second round: the two close ones alone, in turn, the first one first; the third sits it
  // out. The second is faster now: over both rounds, with round 2's conditions taken out
  // (planner::fit_rounds), 1.059 ms against 0.991 ms (7% apart: no near tie, explore_tie).
  const std::vector<double> second = {1.2e-3, 1.0e-3};
  for (int run = 0; run < 2; ++run) {
    for (std::size_t i = 0; i < 2; ++i) {
      const TensorPlan p = e.submit(n);
      ASSERT_EQ(plan_key(p), key(i)) << "second round, contender " << i << " run " << run;
      EXPECT_TRUE(e.planner->exploring(n, 4));
      e.planner->observe(n, p, second[i]);
    }
  }
  const TensorPlan settled = e.submit(n);
  EXPECT_FALSE(e.planner->exploring(n, 4));
  EXPECT_EQ(plan_key(settled), key(1));
  for (int run = 0; run < 3; ++run) EXPECT_EQ(plan_key(e.submit(n)), key(1));

  // Where only one contender is within 10% of the fastest, there is no second round.
  Explorer f(3, 1, 0, 0.1);
  const std::vector<double> apart = {1e-3, 1.2e-3, 2e-3};
  for (std::size_t i = 0; i < 3; ++i) {
    const TensorPlan p = f.submit(n);
    ASSERT_EQ(plan_key(p), key(i));
    f.planner->observe(n, p, apart[i]);
  }
  EXPECT_EQ(plan_key(f.submit(n)), key(0));
  EXPECT_FALSE(f.planner->exploring(n, 4));
}

TEST(Planner, RoundsAreSetOnRoundOnesFootingBeforeContendersAreCompared) {
  // Round 1: A 1 ms, B 1.04 ms. Round 2 runs 20% faster (fewer contenders share the cores):
  // B 0.832 ms and D, new, 0.8 ms. Under round 1's conditions D takes 1 ms: no faster than A,
  // which sat round 2 out. (A mean of rounds would put B at 0.936 ms and D at 0.8 ms, both
  // ahead of A.) C never ran.
  const std::vector<double> t =
      planner::fit_rounds({{1e-3, 1.04e-3, 0, 0}, {0, 0.832e-3, 0, 0.8e-3}}, 4);
  ASSERT_EQ(t.size(), 4u);
  EXPECT_NEAR(t[0], 1e-3, 1e-9);
  EXPECT_NEAR(t[1], 1.04e-3, 1e-9);
  EXPECT_EQ(t[2], 0.0);
  EXPECT_NEAR(t[3], 1e-3, 1e-9);
  // Where the rounds disagree on a pair's gap, the fit splits the difference (least squares in
  // logs): A and B 10% apart in round 1, equal in round 2.
  const std::vector<double> u = planner::fit_rounds({{1e-3, 1.1e-3}, {0.9e-3, 0.9e-3}}, 2);
  EXPECT_NEAR(u[1] / u[0], std::sqrt(1.1), 1e-9);
}

TEST(Planner, TheFastestContendersNeighboursInKJoinTheSecondRound) {
  // Where the fastest contender of the first round has a neighbour in K (the next smaller or
  // larger K of its codec and strategy) that is not a contender, that neighbour runs in the
  // second round with it, even where no other contender was close, and the size settles on the
  // fastest measured over both rounds. Off, there is no second round here.
  const std::size_t n = std::size_t{1} << 22;
  for (const bool on : {true, false}) {
    Explorer e(3, 2, 0, 0.1, on);
    PlannerOptions o = e.planner->options();
    o.explore_neighbour_rounds = 0;  // the second round alone (ExplorationClimbsKToTheBest)
    e.with(o);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.contenders.size(), 3u);
    // The fastest: a contender with a neighbour that is not one, and its neighbours.
    std::string fastest;
    std::vector<std::string> neighbours;
    for (const auto& c : d.contenders) {
      const PlanCandidate* below = nullptr;
      const PlanCandidate* above = nullptr;
      for (const auto& r : d.ranked) {
        if (r.plan.codec != c.plan.codec || r.plan.strategy != c.plan.strategy) continue;
        const int k = r.plan.partitions;
        if (k < c.plan.partitions && (!below || k > below->plan.partitions)) below = &r;
        if (k > c.plan.partitions && (!above || k < above->plan.partitions)) above = &r;
      }
      neighbours.clear();
      for (const PlanCandidate* x : {below, above}) {
        if (x != nullptr && !listed(d, plan_key(x->plan))) neighbours.push_back(plan_key(x->plan));
      }
      if (!neighbours.empty()) {
        fastest = plan_key(c.plan);
        break;
      }
    }
    ASSERT_FALSE(fastest.empty()) << "no contender with a neighbour in K outside the contenders";
    // The fastest runs 1 ms, the others 2 ms (none close); its neighbours 0.9 and 0.8 ms, the
    // last listed fastest.
    auto time_of = [&](const std::string& key) {
      if (key == fastest) return 1e-3;
      for (std::size_t i = 0; i < neighbours.size(); ++i) {
        if (key == neighbours[i]) return 0.9e-3 - 0.1e-3 * static_cast<double>(i);
      }
      return 2e-3;
    };
    TensorPlan p;
    const std::vector<std::string> ran = e.explore(n, time_of, p);
    ASSERT_FALSE(e.planner->exploring(n, 4)) << on;
    // Round 1: each contender twice, in turn.
    ASSERT_GE(ran.size(), 6u);
    for (std::size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(ran[i], plan_key(d.contenders[i % 3].plan)) << on << " run " << i;
    }
    if (!on) {
      EXPECT_EQ(ran.size(), 6u);
      EXPECT_EQ(plan_key(p), fastest);
      continue;
    }
    // Round 2: the fastest and its neighbours, in turn, twice each (no near tie after it).
    std::vector<std::string> second = {fastest};
    second.insert(second.end(), neighbours.begin(), neighbours.end());
    ASSERT_EQ(ran.size(), 6 + 2 * second.size());
    for (std::size_t i = 0; i < 2 * second.size(); ++i) {
      EXPECT_EQ(ran[6 + i], second[i % second.size()]) << "second round, run " << i;
    }
    EXPECT_EQ(plan_key(p), neighbours.back());
  }
}

TEST(Planner, RawIsAlsoACandidateAtTheEnginesOwnPartitioning) {
  // 256 MiB at 8 MiB a partition: raw K = 32, beyond the planner's K (1-16), is a candidate;
  // the codecs keep the planner's K. At 16 MiB the engine's K = 2 is among them already. Off
  // (raw_partition_bytes 0), raw has the planner's K alone.
  auto ks = [](std::size_t n, std::size_t bytes, const std::string& codec) {
    PlannerOptions o = options();
    o.raw_partition_bytes = bytes;
    Planner planner(o, synthetic(12.5e6, 100e-6, 1));
    std::set<int> k;
    for (const auto& c : planner.decide(n, 2, 4).ranked) {
      if (c.plan.codec == codec) k.insert(c.plan.partitions);
    }
    return k;
  };
  const std::size_t big = std::size_t{64} << 20, mid = std::size_t{4} << 20;
  EXPECT_EQ(ks(big, std::size_t{8} << 20, "none"), (std::set<int>{1, 2, 4, 8, 16, 32}));
  EXPECT_EQ(ks(big, std::size_t{8} << 20, "fp16"), (std::set<int>{1, 2, 4, 8, 16}));
  EXPECT_EQ(ks(big, 0, "none"), (std::set<int>{1, 2, 4, 8, 16}));
  EXPECT_EQ(ks(mid, std::size_t{8} << 20, "none"), (std::set<int>{1, 2, 4, 8, 16}));
}

TEST(Planner, TheCloseOnesOtherKJoinTheSecondRound) {
  // Where two contenders measured within explore_close of each other in the first round, the
  // other K of their codecs and strategies join the second round (the faster one's family
  // first, each family's K nearest its measured K first, at most explore_candidates of them),
  // and the size settles on one of those where it measures fastest. Off, the second round holds
  // the two close ones alone.
  const std::size_t n = std::size_t{1} << 22;
  for (const bool on : {true, false}) {
    Explorer e(3, 2, 0, 0.1);
    PlannerOptions o = e.planner->options();
    o.explore_family_seconds = on ? 1e9 : 0;
    e.with(o);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.contenders.size(), 3u);
    // The additions expected: contender 0's family, then contender 1's (where it differs), each
    // ordered by |log2(K / the contender's K)|, then K; the first three.
    std::vector<std::string> added;
    std::vector<TensorPlan> families = {d.contenders[0].plan};
    if (d.contenders[1].plan.codec != families[0].codec ||
        d.contenders[1].plan.strategy != families[0].strategy) {
      families.push_back(d.contenders[1].plan);
    }
    for (const TensorPlan& f : families) {
      std::vector<std::pair<std::pair<double, int>, std::string>> ks;
      for (const auto& r : d.ranked) {
        if (r.plan.codec != f.codec || r.plan.strategy != f.strategy ||
            listed(d, plan_key(r.plan))) {
          continue;
        }
        const double steps =
            std::abs(std::log2(static_cast<double>(r.plan.partitions) / f.partitions));
        ks.push_back({{steps, r.plan.partitions}, plan_key(r.plan)});
      }
      std::sort(ks.begin(), ks.end());
      for (const auto& k : ks) {
        if (added.size() < 3) added.push_back(k.second);
      }
    }
    ASSERT_FALSE(added.empty()) << "the close ones' families have no other K";
    // Round 1: 1 ms, 1.08 ms (close; no near tie), 2 ms. Round 2: the last addition runs 0.8 ms.
    auto time_of = [&](const std::string& key) {
      if (key == plan_key(d.contenders[0].plan)) return 1e-3;
      if (key == plan_key(d.contenders[1].plan)) return 1.08e-3;
      if (key == added.back()) return 0.8e-3;
      return 2e-3;
    };
    TensorPlan p;
    const std::vector<std::string> ran = e.explore(n, time_of, p);
    ASSERT_FALSE(e.planner->exploring(n, 4)) << on;
    std::vector<std::string> second = {plan_key(d.contenders[0].plan),
                                       plan_key(d.contenders[1].plan)};
    if (on) second.insert(second.end(), added.begin(), added.end());
    ASSERT_EQ(ran.size(), 6 + 2 * second.size()) << on;
    for (std::size_t i = 0; i < 2 * second.size(); ++i) {
      EXPECT_EQ(ran[6 + i], second[i % second.size()]) << on << ", second round, run " << i;
    }
    EXPECT_EQ(plan_key(p), on ? added.back() : plan_key(d.contenders[0].plan)) << on;
  }
}

TEST(Planner, ExplorationClimbsKToTheBest) {
  // The first contender's codec and strategy run fastest at a K two or more steps from every
  // contender of theirs, 20% slower a step away; everything else takes twice as long. After the
  // second round (which adds the fastest's neighbours), rounds of the fastest and its new
  // neighbours climb K to the best (explore_neighbour_rounds); without them, exploration stops
  // a step short.
  const std::size_t n = std::size_t{1} << 22;
  for (const int climbs : {3, 0}) {
    Explorer e(3, 2, 0, 0.1, true);
    PlannerOptions o = e.planner->options();
    o.explore_neighbour_rounds = climbs;
    e.with(o);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.contenders.size(), 3u);
    const TensorPlan f = d.contenders[0].plan;
    auto family = [&](const TensorPlan& p) {
      return p.codec == f.codec && p.strategy == f.strategy;
    };
    std::vector<int> ks;
    for (const auto& c : d.ranked) {
      if (family(c.plan)) ks.push_back(c.plan.partitions);
    }
    std::sort(ks.begin(), ks.end());
    auto step = [&](int k) {
      return static_cast<int>(std::find(ks.begin(), ks.end(), k) - ks.begin());
    };
    // The K farthest (in steps) from the family's contenders.
    int best = -1, farthest = -1;
    for (int i = 0; i < static_cast<int>(ks.size()); ++i) {
      int near = 1 << 20;
      for (const auto& c : d.contenders) {
        if (family(c.plan)) near = std::min(near, std::abs(step(c.plan.partitions) - i));
      }
      if (near > farthest) farthest = near, best = i;
    }
    ASSERT_GE(farthest, 2) << "every K of " << plan_key(f) << " is next to a contender";
    ASSERT_LE(farthest, 4);
    auto time_of = [&](const TensorPlan& p) {
      return family(p) ? 1e-3 * (1 + 0.2 * std::abs(step(p.partitions) - best)) : 2e-3;
    };
    TensorPlan p = e.submit(n);
    int runs = 0;
    while (e.planner->exploring(n, 4) && runs < 200) {
      e.planner->observe(n, p, time_of(p));
      p = e.submit(n);
      ++runs;
    }
    ASSERT_FALSE(e.planner->exploring(n, 4)) << climbs;
    EXPECT_TRUE(family(p)) << plan_key(p);
    if (climbs >= farthest - 1) {
      EXPECT_EQ(p.partitions, ks[best]) << plan_key(p) << " after " << runs << " runs";
    } else {
      EXPECT_NE(p.partitions, ks[best]) << plan_key(p);
    }
  }
}

TEST(Planner, ExplorationRunsTheTwoFastestAgainWhileTheyAreANearTie) {
  const std::size_t n = std::size_t{1} << 22;
  // Runs a round of the contenders `who` (of the decision d made before exploring), in turn,
  // twice each, each timed as `times` says, checking the order.
  auto run = [&](Explorer& e, const PlanDecision& d, const std::vector<int>& who,
                 const std::vector<double>& times, const std::string& what) {
    for (int r = 0; r < 2; ++r) {
      for (const int i : who) {
        const TensorPlan p = e.submit(n);
        ASSERT_EQ(plan_key(p), plan_key(d.contenders[i].plan)) << what << ", contender " << i;
        EXPECT_TRUE(e.planner->exploring(n, 4)) << what;
        e.planner->observe(n, p, times[i]);
      }
    }
  };
  {
    // Round 1: three contenders; the third is far behind. Round 2: the first two, 2% apart
    // (the third sits it out). Round 3: the same two again; the second is judged by its three
    // rounds, fitted on round 1's footing (0.973 ms), against the first's (1.048 ms), 7.7%
    // apart: it is kept.
    Explorer e(3, 2, 0, 0.1);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.contenders.size(), 3u);
    run(e, d, {0, 1, 2}, {1.00e-3, 1.02e-3, 2e-3}, "round 1");
    run(e, d, {0, 1}, {1.00e-3, 1.02e-3, 0}, "round 2");
    run(e, d, {0, 1}, {1.30e-3, 1.00e-3, 0}, "round 3");
    const TensorPlan settled = e.submit(n);
    EXPECT_FALSE(e.planner->exploring(n, 4));
    EXPECT_EQ(plan_key(settled), plan_key(d.contenders[1].plan));
  }
  for (const double displace : {0.0, 0.04}) {
    // A tie that stays one: explore_tie_rounds (2) more rounds, then the faster fitted time,
    // where it is faster than the model's choice (the first contender) by explore_displace;
    // 1% is not 4%: the model's choice stands.
    Explorer e(3, 2, 0, 0.1);
    PlannerOptions o = e.planner->options();
    o.explore_displace = displace;
    e.with(o);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    run(e, d, {0, 1, 2}, {1.01e-3, 1.00e-3, 2e-3}, "round 1");
    for (int round = 2; round <= 4; ++round) {
      run(e, d, {0, 1}, {1.01e-3, 1.00e-3, 0}, "round " + std::to_string(round));
    }
    const TensorPlan settled = e.submit(n);
    EXPECT_FALSE(e.planner->exploring(n, 4));
    EXPECT_EQ(plan_key(settled), plan_key(d.contenders[displace > 0 ? 0 : 1].plan)) << displace;
  }
  {
    // Where another round of the two would cost more than explore_tie_seconds (1 s by their
    // measured times: 2 runs of about 0.3 s each), the second round is the last.
    Explorer e(3, 2, 0, 0.1);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    run(e, d, {0, 1, 2}, {0.300, 0.306, 0.6}, "round 1");
    run(e, d, {0, 1}, {0.300, 0.306, 0}, "round 2");
    const TensorPlan settled = e.submit(n);
    EXPECT_FALSE(e.planner->exploring(n, 4));
    EXPECT_EQ(plan_key(settled), plan_key(d.contenders[0].plan));
  }
}

TEST(Planner, AContenderDisplacesTheModelsChoiceOnlyByExploreDisplace) {
  // One round of two contenders, no near-tie rounds: the second, measured 3% faster than the
  // model's choice (the first), does not displace it (explore_displace, 4%); 5% faster, it
  // does; and with explore_displace 0, 3% does too.
  const std::size_t n = std::size_t{1} << 22;
  for (const auto& [faster, displace, wins] :
       {std::tuple{0.03, 0.04, 0}, {0.05, 0.04, 1}, {0.03, 0.0, 1}}) {
    Explorer e(2, 2, 0, 0);
    PlannerOptions o = e.planner->options();
    o.explore_tie_rounds = 0;
    o.explore_displace = displace;
    e.with(o);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.contenders.size(), 2u);
    const std::vector<double> times = {1e-3, (1 - faster) * 1e-3};
    for (int r = 0; r < 2; ++r) {
      for (int i = 0; i < 2; ++i) {
        const TensorPlan p = e.submit(n);
        ASSERT_EQ(plan_key(p), plan_key(d.contenders[i].plan)) << faster << " " << displace;
        e.planner->observe(n, p, times[i]);
      }
    }
    const TensorPlan settled = e.submit(n);
    EXPECT_FALSE(e.planner->exploring(n, 4));
    EXPECT_EQ(plan_key(settled), plan_key(d.contenders[wins].plan)) << faster << " " << displace;
  }
}

TEST(Planner, AGapWithinTheRunsNoiseIsANearTieToo) {
  // Two contenders 8% apart (beyond explore_tie, 5%) in two rounds of 8 runs each. Where every
  // run of each takes the same time, the gap is a verdict: the second round is the last. Where
  // single runs spread by +-30% about the same medians (a standard error of about 8% each per
  // round), it is within explore_tie_noise (2) standard errors: the two run again, twice
  // (explore_tie_rounds), and the faster fitted time is kept.
  const std::size_t n = std::size_t{1} << 22;
  const std::vector<double> spread = {1.0, 0.7, 1.3, 0.8, 1.2, 0.9, 1.1, 1.0};  // median 1
  for (const bool noisy : {false, true}) {
    Explorer e(3, 8, 0, 0.1);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.contenders.size(), 3u);
    const std::vector<double> times = {1.00e-3, 1.08e-3, 2e-3};
    auto run = [&](const std::vector<int>& who, const std::string& what) {
      for (std::size_t r = 0; r < spread.size(); ++r) {
        for (const int i : who) {
          const TensorPlan p = e.submit(n);
          ASSERT_EQ(plan_key(p), plan_key(d.contenders[i].plan))
              << what << ", contender " << i << (noisy ? ", noisy" : "");
          EXPECT_TRUE(e.planner->exploring(n, 4)) << what;
          e.planner->observe(n, p, times[i] * (noisy ? spread[r] : 1.0));
        }
      }
    };
    run({0, 1, 2}, "round 1");
    run({0, 1}, "round 2");
    if (noisy) {
      run({0, 1}, "round 3 (a near tie within the noise)");
      run({0, 1}, "round 4 (the second near-tie round)");
    }
    const TensorPlan settled = e.submit(n);
    EXPECT_FALSE(e.planner->exploring(n, 4)) << noisy;
    EXPECT_EQ(plan_key(settled), plan_key(d.contenders[0].plan)) << noisy;
  }
}

TEST(Planner, ARawContenderThatSitsANearTieOutStillHoldsCompressionToMinGain) {
  // One rank: raw (a hand-off) is the choice. Every contender measures within 10% of the
  // fastest, so all run a second round; then the two fastest, both compressed and 3% faster
  // than raw, are a near tie and run again while raw sits out. 3% does not clear min_gain
  // (5%): raw is kept.
  Explorer e(40, 1, 0, 0.1);
  const std::size_t n = std::size_t{1} << 20;
  const PlanDecision d = e.planner->decide(n, 1, 4);
  ASSERT_EQ(d.chosen.plan.strategy, Strategy::kRaw);
  TensorPlan p = e.submit(n);
  std::size_t seen = 0, compressed = 0;
  while (e.planner->exploring(n, 4) && seen < 4 * d.contenders.size()) {
    compressed += p.strategy != Strategy::kRaw;
    e.planner->observe(n, p, p.strategy == Strategy::kRaw ? 1e-3 : 0.97e-3);
    p = e.submit(n);
    ++seen;
  }
  ASSERT_FALSE(e.planner->exploring(n, 4));
  // Two rounds of every contender, then two near-tie rounds of two compressed ones.
  EXPECT_EQ(seen, 2 * d.contenders.size() + 4);
  EXPECT_EQ(p.strategy, Strategy::kRaw) << plan_key(p);
}

TEST(Planner, ExplorationRunsFastContendersLonger) {
  // Contenders expected to take t seconds run ceil(explore_seconds / t) times, at least
  // explore_runs and at most explore_max_runs (25); in turn while both have runs left, then
  // the one with more runs alone.
  for (const std::size_t n : {std::size_t{1} << 14, std::size_t{1} << 18, std::size_t{1} << 24}) {
    Explorer e(2, 3, 0.05);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.contenders.size(), 2u);
    std::vector<int> want, ran(2, 0);
    for (const auto& c : d.contenders) {
      const double t = PlanDecision::expected(c);
      want.push_back(static_cast<int>(std::clamp(std::ceil(0.05 / t), 3.0, 25.0)));
    }
    std::string order;
    for (int run = 0; run < want[0] + want[1]; ++run) {
      ASSERT_TRUE(e.planner->exploring(n, 4) || run == 0) << n << " floats, run " << run;
      const TensorPlan p = e.submit(n);
      const std::size_t i = plan_key(p) == plan_key(d.contenders[0].plan) ? 0 : 1;
      ASSERT_EQ(plan_key(p), plan_key(d.contenders[i].plan)) << n << " floats, run " << run;
      const int other = static_cast<int>(1 - i);
      // In turn while the other has runs left.
      if (run > 0 && ran[other] < want[other]) {
        EXPECT_NE(order.back(), static_cast<char>('0' + i)) << n << " floats: " << order;
      }
      order += static_cast<char>('0' + i);
      ++ran[i];
      e.planner->observe(n, p, PlanDecision::expected(d.contenders[i]));
    }
    EXPECT_EQ(ran, want) << n << " floats: " << order;
    e.submit(n);
    EXPECT_FALSE(e.planner->exploring(n, 4)) << n;
  }
}

TEST(Planner, LaterRoundsRunAsManyAsTakeExploreAgainSecondsByTheMeasuredTime) {
  // Round 1: 2 runs each (explore_seconds 0). The two close ones then run
  // ceil(explore_again_seconds / measured) times each in round 2 (at most explore_max_runs),
  // by the times measured in round 1, not the model's.
  const std::size_t n = std::size_t{1} << 22;
  for (const double t : {0.020, 0.070, 0.001, 0.5}) {
    Explorer e(3, 2, 0, 0.1);
    PlannerOptions o = e.planner->options();
    ASSERT_EQ(o.explore_again_seconds, 0);  // the Explorer's, for exact counts
    o.explore_again_seconds = 0.3;
    o.explore_tie_rounds = 0;
    e.with(o);
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.contenders.size(), 3u);
    const std::vector<double> first = {t, 1.02 * t, 3 * t};
    for (int run = 0; run < 2; ++run) {
      for (std::size_t i = 0; i < 3; ++i) {
        const TensorPlan p = e.submit(n);
        ASSERT_EQ(plan_key(p), plan_key(d.contenders[i].plan));
        e.planner->observe(n, p, first[i]);
      }
    }
    std::vector<int> want(2);
    for (int i = 0; i < 2; ++i) {
      want[i] = static_cast<int>(std::clamp(std::ceil(0.3 / first[i]), 2.0, 25.0));
    }
    std::vector<int> ran(3, 0);
    for (int run = 0; run < want[0] + want[1]; ++run) {
      ASSERT_TRUE(e.planner->exploring(n, 4)) << t << " s, run " << run;
      const TensorPlan p = e.submit(n);
      for (std::size_t i = 0; i < 3; ++i) ran[i] += plan_key(p) == plan_key(d.contenders[i].plan);
      e.planner->observe(n, p, plan_key(p) == plan_key(d.contenders[0].plan) ? t : 1.02 * t);
    }
    EXPECT_EQ(ran, (std::vector<int>{want[0], want[1], 0})) << t << " s";
    e.submit(n);
    EXPECT_FALSE(e.planner->exploring(n, 4)) << t << " s";
  }
}

TEST(Planner, ExplorationKeepsRawUnlessCompressionClearlyWins) {
  // One rank: raw (a hand-off) is the choice; compressed contenders measured 2% faster than it
  // do not clear min_gain (5%), 10% faster do.
  for (double gain : {0.02, 0.10}) {
    Explorer e(40, 1);
    const std::size_t n = std::size_t{1} << 20;
    const PlanDecision d = e.planner->decide(n, 1, 4);
    ASSERT_EQ(d.chosen.plan.strategy, Strategy::kRaw);
    TensorPlan p = e.submit(n);
    std::size_t seen = 0;
    while (e.planner->exploring(n, 4) && seen < d.contenders.size() + 2) {
      e.planner->observe(n, p, p.strategy == Strategy::kRaw ? 1e-3 : 1e-3 * (1 - gain));
      p = e.submit(n);
      ++seen;
    }
    ASSERT_FALSE(e.planner->exploring(n, 4));
    EXPECT_EQ(p.strategy == Strategy::kRaw, gain < 0.05) << gain << ": " << plan_key(p);
  }
}

TEST(Planner, ExplorationSkipsAContenderThatIsNeverMeasured) {
  Explorer e(2, 1);
  const std::size_t n = std::size_t{1} << 22;
  const PlanDecision d = e.planner->decide(n, 1, 4);
  ASSERT_EQ(d.contenders.size(), 2u);
  e.planner->observe(n, e.submit(n), 1e-3);  // the first is measured
  EXPECT_EQ(plan_key(e.submit(n)), plan_key(d.contenders[1].plan));
  // The second never reports a time (a fused tensor, say): it runs once more, and at the
  // exchange after that it is given up and the measured first contender stands.
  EXPECT_EQ(plan_key(e.submit(n)), plan_key(d.contenders[1].plan));
  EXPECT_TRUE(e.planner->exploring(n, 4));
  const TensorPlan settled = e.submit(n);
  EXPECT_FALSE(e.planner->exploring(n, 4));
  EXPECT_EQ(plan_key(settled), plan_key(d.contenders[0].plan));
}

TEST(Planner, ACloseCompressedChoiceIsExploredAgainstRaw) {
  // Where compression is predicted to win by less than explore_raw_within (2x), the best raw
  // plan is explored last, after the explore_candidates others, so do-no-harm is decided on
  // measured times; where it wins by far more (a slow link), raw is not run.
  const std::size_t n = std::size_t{1} << 22;
  bool close_seen = false;
  // The far ends of K (EachExploredCodecIsMeasuredAtTheFarEndOfK) would add to the count.
  PlannerOptions o = options();
  o.explore_far_partitions = false;
  for (const double rate : {1.25e9, 2.5e9, 5e9, 10e9, 20e9, 40e9}) {
    Planner p(o, synthetic(rate, 50e-6));
    const PlanDecision d = p.decide(n, 4, 4);
    if (d.chosen.plan.strategy == Strategy::kRaw) continue;
    const bool close = d.raw_seconds <= 2.0 * PlanDecision::expected(d.chosen);
    if (!close) continue;
    close_seen = true;
    ASSERT_GE(d.contenders.size(), 2u) << rate;
    EXPECT_LE(d.contenders.size(), options().explore_candidates + 1u) << rate;
    EXPECT_EQ(d.contenders.back().plan.strategy, Strategy::kRaw) << rate;
    EXPECT_DOUBLE_EQ(PlanDecision::expected(d.contenders.back()), d.raw_seconds) << rate;
    for (std::size_t i = 0; i + 1 < d.contenders.size(); ++i) {
      EXPECT_NE(d.contenders[i].plan.strategy, Strategy::kRaw) << rate << " contender " << i;
    }
    PlannerOptions off = o;
    off.explore_raw_within = 0;
    Planner q(off, synthetic(rate, 50e-6));
    for (const auto& c : q.decide(n, 4, 4).contenders) {
      EXPECT_NE(c.plan.strategy, Strategy::kRaw) << rate;
    }
  }
  EXPECT_TRUE(close_seen) << "no link rate gave a compressed choice within 2x of raw";
  Planner slow(options(), synthetic(12.5e6, 50e-6));
  const PlanDecision d = slow.decide(n, 4, 4);
  ASSERT_NE(d.chosen.plan.strategy, Strategy::kRaw);
  ASSERT_GT(d.raw_seconds, 2.0 * PlanDecision::expected(d.chosen));
  for (const auto& c : d.contenders) EXPECT_NE(c.plan.strategy, Strategy::kRaw);
}

TEST(Planner, EachCodecsBestPlanIsExploredWhereThatIsCheap) {
  // The contenders within explore_within are all one codec's strategies and K here; another
  // allowed codec's best plan joins them when it is expected within explore_codec_within (4x)
  // of the choice and its runs cost at most explore_seconds more than the choice's: small sizes
  // yes, large ones no. Raw stays last.
  PlannerOptions o = options();
  o.explore_within = 1.0;  // the choice alone, and ties
  const double within = o.explore_codec_within;
  ASSERT_GT(within, 1.0);
  bool added = false, too_dear = false;
  for (const std::size_t n :
       {std::size_t{1} << 12, std::size_t{1} << 14, std::size_t{1} << 16, std::size_t{1} << 18,
        std::size_t{1} << 22, std::size_t{1} << 26, std::size_t{1} << 28}) {
    for (const double rate : {12.5e6, 125e6, 1.25e9, 2.5e9, 5e9}) {
      Planner p(o, synthetic(rate, 50e-6));
      const PlanDecision d = p.decide(n, 4, 4);
      if (d.chosen.plan.strategy == Strategy::kRaw) continue;
      const double chosen = PlanDecision::expected(d.chosen);
      // The other codec's best plan: the first of it in the ranking.
      const PlanCandidate* other = nullptr;
      for (const auto& c : d.ranked) {
        if (c.plan.strategy != Strategy::kRaw && c.plan.codec != d.chosen.plan.codec) {
          other = &c;
          break;
        }
      }
      ASSERT_NE(other, nullptr) << n << " at " << rate;
      const double t = PlanDecision::expected(*other);
      const double runs =
          std::clamp(std::ceil(o.explore_seconds / t), static_cast<double>(o.explore_runs),
                     static_cast<double>(o.explore_max_runs));
      const bool want = t <= within * chosen && runs * (t - chosen) <= o.explore_seconds;
      const bool listed = std::any_of(d.contenders.begin(), d.contenders.end(), [&](const auto& c) {
        return plan_key(c.plan) == plan_key(other->plan);
      });
      EXPECT_EQ(listed, want || t <= chosen)
          << n << " floats at " << rate << " B/s: " << t << " s against " << chosen;
      added |= want && t > chosen;
      too_dear |= t <= within * chosen && !want;
      for (std::size_t i = 0; i + 1 < d.contenders.size(); ++i) {
        EXPECT_NE(d.contenders[i].plan.strategy, Strategy::kRaw) << n << " at " << rate;
      }
      PlannerOptions off = o;
      off.explore_codec_within = 0;
      for (const auto& c : Planner(off, synthetic(rate, 50e-6)).decide(n, 4, 4).contenders) {
        if (c.plan.strategy == Strategy::kRaw) continue;
        EXPECT_LE(PlanDecision::expected(c), chosen) << n << " at " << rate;
      }
    }
  }
  EXPECT_TRUE(added) << "no size and rate where another codec's best was cheap to explore";
  EXPECT_TRUE(too_dear) << "no size and rate where another codec's best cost too much to explore";
}

TEST(Planner, EachExploredCodecIsMeasuredAtTheFarEndOfK) {
  // Beyond the other rules' contenders, each codec among them (its first listed plan) is
  // explored with the same strategy at the end of the K range farther from that plan's K, when
  // that plan is not listed already and is cheap by the codec-best test; before raw, which
  // stays last. Off, the list is the others' alone.
  const PlannerOptions o = options();
  ASSERT_TRUE(o.explore_far_partitions);
  const auto [lo, hi] = std::minmax_element(o.partitions.begin(), o.partitions.end());
  bool added = false, too_dear = false;
  for (const std::size_t n : {std::size_t{1} << 16, std::size_t{1} << 18, std::size_t{1} << 20,
                              std::size_t{1} << 22, std::size_t{1} << 24, std::size_t{1} << 26}) {
    for (const double rate : {12.5e6, 125e6, 1.25e9, 2.5e9, 5e9}) {
      const PlanDecision d = Planner(o, synthetic(rate, 50e-6)).decide(n, 4, 4);
      PlannerOptions off_options = o;
      off_options.explore_far_partitions = false;
      const PlanDecision off = Planner(off_options, synthetic(rate, 50e-6)).decide(n, 4, 4);
      const double chosen = PlanDecision::expected(d.chosen);
      auto is_raw = [](const PlanCandidate& c) { return c.plan.strategy == Strategy::kRaw; };
      std::vector<PlanCandidate> base = off.contenders;
      const bool raw_last = !base.empty() && is_raw(base.back()) && base.size() > 1;
      if (raw_last) base.pop_back();
      ASSERT_GE(d.contenders.size(), off.contenders.size()) << n << " at " << rate;
      for (std::size_t i = 0; i < base.size(); ++i) {
        EXPECT_EQ(plan_key(d.contenders[i].plan), plan_key(base[i].plan)) << n << " at " << rate;
      }
      if (raw_last) {
        EXPECT_EQ(plan_key(d.contenders.back().plan), plan_key(off.contenders.back().plan));
      }
      // What the rule should add: per codec of the base list, its first plan's far end.
      std::vector<std::string> want;
      std::set<std::string> codecs;
      for (const auto& b : base) {
        if (is_raw(b) || !codecs.insert(b.plan.codec).second) continue;
        const int k = b.plan.partitions;
        const int far = static_cast<double>(*hi) / k >= static_cast<double>(k) / *lo ? *hi : *lo;
        if (far == k || std::any_of(base.begin(), base.end(), [&](const PlanCandidate& c) {
              return c.plan.codec == b.plan.codec && c.plan.strategy == b.plan.strategy &&
                     c.plan.partitions == far;
            })) {
          continue;
        }
        for (const auto& c : d.ranked) {
          if (c.plan.codec != b.plan.codec || c.plan.strategy != b.plan.strategy ||
              c.plan.partitions != far) {
            continue;
          }
          const double t = PlanDecision::expected(c);
          const double runs =
              std::clamp(std::ceil(o.explore_seconds / t), static_cast<double>(o.explore_runs),
                         static_cast<double>(o.explore_max_runs));
          if (t <= o.explore_codec_within * chosen && runs * (t - chosen) <= o.explore_seconds) {
            want.push_back(plan_key(c.plan));
          } else {
            too_dear = true;
          }
          break;
        }
      }
      std::vector<std::string> got;
      for (std::size_t i = base.size(); i < d.contenders.size() - (raw_last ? 1 : 0); ++i) {
        EXPECT_FALSE(is_raw(d.contenders[i])) << n << " at " << rate;
        got.push_back(plan_key(d.contenders[i].plan));
      }
      EXPECT_EQ(got, want) << n << " floats at " << rate << " B/s";
      added |= !want.empty();
    }
  }
  EXPECT_TRUE(added) << "no size and rate where a codec's far K was cheap to explore";
  EXPECT_TRUE(too_dear) << "no size and rate where a codec's far K cost too much to explore";
}

TEST(Planner, SmallRawTensorsAndOneCandidateAreNotExplored) {
  Planner p(options(), synthetic(1.25e9, 50e-6));  // 10 Gbit/s: small tensors stay raw
  const PlanDecision small = p.decide(1000, 4, 4);
  ASSERT_EQ(small.chosen.plan.strategy, Strategy::kRaw);
  EXPECT_EQ(small.contenders.size(), 1u);
  PlannerOptions none = options();
  none.explore_within = 1.0;  // only exact ties
  none.explore_codec_within = 0;
  Planner q(none, synthetic(12.5e6, 100e-6));
  const PlanDecision big = q.decide(std::size_t{1} << 22, 4, 4);
  for (const auto& c : big.contenders) {
    EXPECT_LE(PlanDecision::expected(c), PlanDecision::expected(big.chosen));
  }
}

// ---- tools ------------------------------------------------------------------------------------

const std::string kCli = TERSE_CLI;
const std::string kWorker = TERSE_WORKER;

TEST(PlanCommand, BuiltInModelsMatchThePythonScript) {
  if (testing::shell("/usr/bin/python3 -c 'import torch'").code != 0) {
    GTEST_SKIP() << "needs /usr/bin/python3 with torch";
  }
  const std::string dir = testing::temp_dir();
  for (const char* model : {"mlp", "cnn", "vgg"}) {
    auto py =
        testing::shell(fmt::format("/usr/bin/python3 {}/python/terse/model_sizes.py {} "
                                   "--out {}/{}.py.json",
                                   TERSE_SOURCE_DIR, model, dir, model));
    ASSERT_EQ(py.code, 0) << py.output;
    // The plan itself: every tensor gets a line, and the step a prediction and a speedup.
    auto plan =
        testing::shell(fmt::format("{} plan --model {} --ranks 4 --bandwidth 1gbit "
                                   "--write-sizes {}/{}.cc.json --sizes-only",
                                   kCli, model, dir, model));
    ASSERT_EQ(plan.code, 0) << plan.output;
    auto same = testing::shell(
        fmt::format("python3 -c 'import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); "
                    "sys.exit(a!=b)' {0}/{1}.py.json {0}/{1}.cc.json",
                    dir, model));
    EXPECT_EQ(same.code, 0) << model;
  }
  std::filesystem::remove_all(dir);
}

TEST(PlanCommand, PredictsEveryTensorAndTheStep) {
  const std::string dir = testing::temp_dir();
  auto sizes = testing::shell(
      fmt::format("printf '[{{\"name\": \"big\", \"elements\": 4194304}}, {{\"name\": \"bias\", "
                  "\"elements\": 10}}]' > {}/sizes.json",
                  dir));
  ASSERT_EQ(sizes.code, 0);
  auto plan =
      testing::shell(fmt::format("{} plan --sizes {}/sizes.json --ranks 4 --bandwidth "
                                 "100mbit --scale 2 64 1024 --json {}/plan.json",
                                 kCli, dir, dir));
  ASSERT_EQ(plan.code, 0) << plan.output;
  EXPECT_NE(plan.output.find("big"), std::string::npos) << plan.output;
  EXPECT_NE(plan.output.find("fused: 1 small"), std::string::npos) << plan.output;
  EXPECT_NE(plan.output.find("speedup"), std::string::npos) << plan.output;
  EXPECT_NE(plan.output.find("1024"), std::string::npos) << plan.output;
  // A small tensor compressed on its own: its raw counterpart travels in the fused message, so
  // it has no raw time or speedup of its own (printed as 0.000 ms and 1.00x before).
  auto mid = testing::shell(
      fmt::format("printf '[{{\"name\": \"big\", \"elements\": 4194304}}, {{\"name\": "
                  "\"mid\", \"elements\": 73728}}]' > {0}/mid.json && {1} plan --sizes "
                  "{0}/mid.json --ranks 4 --bandwidth 1gbit --codecs onebit:ef=1 --json "
                  "{0}/mid-plan.json",
                  dir, kCli));
  ASSERT_EQ(mid.code, 0) << mid.output;
  auto fused = testing::shell(fmt::format(
      "python3 -c 'import json,sys; t={{x[\"name\"]: x for x in "
      "json.load(open(sys.argv[1]))[\"tensors\"]}}; m=t[\"mid\"]; "
      "sys.exit(not (m[\"raw_fused\"] and m[\"raw_s\"] is None and not t[\"big\"][\"raw_fused\"] "
      "and t[\"big\"][\"raw_s\"] > 0))' {}/mid-plan.json",
      dir));
  EXPECT_EQ(fused.code, 0) << mid.output;
  const auto line = mid.output.substr(mid.output.find("\nmid "));
  EXPECT_NE(line.substr(0, line.find('\n', 1)).find("(fused)"), std::string::npos) << mid.output;
  auto bad =
      testing::shell(fmt::format("{} plan --model nosuch --ranks 4 --bandwidth 1gbit", kCli));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("mlp, cnn, vgg"), std::string::npos) << bad.output;
  std::filesystem::remove_all(dir);
}

TEST(PlanCommand, ReplayPredictsARecordAgainWithItsOwnCalibrationOrAnothers) {
  const std::string dir = testing::temp_dir();
  const Calibration own = synthetic(125e6, 100e-6);   // 1 Gbit/s
  const Calibration other = synthetic(12.5e6, 1e-3);  // 100 Mbit/s
  const std::size_t n = std::size_t{1} << 20;
  struct Config {
    std::string codec;  // canonical, as the records hold it
    const char* strategy;
    Strategy s;
    int partitions;
  };
  const Config configs[] = {
      {"none", "raw", Strategy::kRaw, 1},
      {"fp16", "sharded", Strategy::kSharded, 4},
      {make_codec("onebit:ef=1")->spec(), "allgather", Strategy::kAllgather, 2}};
  auto predict = [&](const Calibration& c, const Config& k) {
    return CostModel(c).predict(n, k.codec, k.s, k.partitions, 4, 4).seconds;
  };
  // A record as `terse bench planner --json` writes it: each configuration measured at twice
  // its prediction from the record's own calibration.
  std::string record = fmt::format(
      R"({{"ranks": 4, "threads": 4, "calibration": {}, "sizes": [{{"elements": {}, "configs": [)",
      own.to_json(), n);
  for (const auto& k : configs) {
    record += fmt::format(
        R"({}{{"codec": "{}", "strategy": "{}", "partitions": {}, "predicted_s": {}, )"
        R"("median_s": {}}})",
        &k == configs ? "" : ", ", k.codec, k.strategy, k.partitions, 0.0, 2 * predict(own, k));
  }
  record += "]}]}";
  std::ofstream(dir + "/record.json") << record;
  std::ofstream(dir + "/other.json") << other.to_json();
  std::ofstream(dir + "/two-ranks.json") << synthetic(125e6, 100e-6, 2).to_json();
  auto replayed = [&](const std::string& json) {
    std::ifstream in(json);
    const auto j = nlohmann::json::parse(in);
    std::vector<double> out;
    for (const auto& c : j["sizes"][0]["configs"]) {
      out.push_back(c["predicted_s"].get<double>());
    }
    return out;
  };
  auto mine =
      testing::shell(fmt::format("{0} bench planner --replay {1}/record.json --json "
                                 "{1}/mine.json",
                                 kCli, dir));
  ASSERT_EQ(mine.code, 0) << mine.output;
  // Every prediction at half the measured time: 50% off, and 100% as recorded (predicted 0).
  EXPECT_NE(mine.output.find("3 configurations, median |error| 100.0% as recorded, 50.0% now\n"),
            std::string::npos)
      << mine.output;
  auto theirs =
      testing::shell(fmt::format("{0} bench planner --replay {1}/record.json --cache "
                                 "{1}/other.json --json {1}/theirs.json",
                                 kCli, dir));
  ASSERT_EQ(theirs.code, 0) << theirs.output;
  EXPECT_NE(theirs.output.find("(calibration of " + dir + "/other.json)"), std::string::npos)
      << theirs.output;
  const auto a = replayed(dir + "/mine.json"), b = replayed(dir + "/theirs.json");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(a[i], predict(own, configs[i]), 1e-12 + 1e-9 * a[i]) << configs[i].codec;
    EXPECT_NEAR(b[i], predict(other, configs[i]), 1e-12 + 1e-9 * b[i]) << configs[i].codec;
    EXPECT_GT(b[i], a[i]) << configs[i].codec;  // slower links, longer latency
  }
  // The pricing before stop 37 on request: the same here, where no fit has a knee.
  auto pieces = testing::shell(
      fmt::format("{0} bench planner --replay {1}/record.json --partition-rates", kCli, dir));
  EXPECT_EQ(pieces.code, 0) << pieces.output;
  EXPECT_NE(pieces.output.find("50.0% now"), std::string::npos) << pieces.output;
  // Another record's calibration is taken from its "calibration" field.
  auto from_record = testing::shell(
      fmt::format("{0} bench planner --replay {1}/record.json --cache {1}/record.json", kCli, dir));
  EXPECT_EQ(from_record.code, 0) << from_record.output;
  EXPECT_NE(from_record.output.find("50.0% now"), std::string::npos) << from_record.output;
  // A calibration of another world size cannot predict the record's configurations.
  auto mismatch = testing::shell(fmt::format(
      "{0} bench planner --replay {1}/record.json --cache {1}/two-ranks.json", kCli, dir));
  EXPECT_NE(mismatch.code, 0);
  EXPECT_NE(mismatch.output.find("a calibration of 2 ranks cannot predict"), std::string::npos)
      << mismatch.output;
  auto missing = testing::shell(
      fmt::format("{0} bench planner --replay {1}/record.json --cache {1}/nosuch.json", kCli, dir));
  EXPECT_NE(missing.code, 0);
  EXPECT_NE(missing.output.find("cannot read"), std::string::npos) << missing.output;
  std::filesystem::remove_all(dir);
}

// ---- multi-process ----------------------------------------------------------------------------

class Ranks : public ::testing::TestWithParam<int> {};

TEST_P(Ranks, AutoPlansAgreeOnEveryRankAndRun) {
  const int n = GetParam();
  const std::string cache = testing::temp_dir();
  // Calibration runs on first use and is cached (XDG_CACHE_HOME); the second run loads the cache
  // and still agrees. TERSE_PLAN_LOG prints the decisions.
  for (int run = 0; run < 2; ++run) {
    auto r =
        testing::shell(fmt::format("XDG_CACHE_HOME={} TERSE_PLAN_LOG=1 {} run -n {} --timeout "
                                   "120 -- {} auto",
                                   cache, kCli, n, kWorker));
    ASSERT_EQ(r.code, 0) << r.output;
    for (int i = 0; i < n; ++i) {
      EXPECT_NE(r.output.find(fmt::format("OK rank {} auto", i)), std::string::npos) << r.output;
    }
    EXPECT_NE(r.output.find("terse plan: plan"), std::string::npos) << r.output;
    if (run == 1) {
      EXPECT_NE(r.output.find("calibration from"), std::string::npos) << r.output;
    }
  }
  // The calibration measured the host's CPU for messages and for the transport's bytes: ranks
  // on one machine spend it on every message and byte they move.
  int calibrations = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(cache)) {
    if (e.path().extension() != ".json") continue;
    std::ifstream in(e.path());
    std::stringstream text;
    text << in.rdbuf();
    const Calibration c = Calibration::from_json(text.str());
    EXPECT_GT(c.cpu_per_message, 0) << e.path();
    EXPECT_GT(c.transport_cpu.b, 0) << e.path();
    EXPECT_EQ(c.transport_cpu.xs.size(), 2u) << e.path();
    // The idle-cores factor, measured on a compressed allreduce where ranks share the cores:
    // its wall over the process's CPU (at most 2: beyond, the links paced it), times the
    // process's CPU over the model's (believed between 0.5 and 2; counted where ranks outnumber
    // cores).
    EXPECT_GE(c.host_efficiency, 1) << e.path();
    EXPECT_GE(c.host_cpu_ratio, 0.5) << e.path();
    EXPECT_LE(c.host_cpu_ratio, 2) << e.path();
    EXPECT_LE(c.host_efficiency, 2 * std::max(1.0, c.host_cpu_ratio)) << e.path();
    // The engine's link at the two probe sizes, where the cores paced the probe (loopback:
    // unless a load from outside kept the cores idle for most of it).
    if (c.engine_link.points > 0) {
      EXPECT_GT(c.engine_link.b, 0) << e.path();
      EXPECT_GE(c.engine_link.b2, c.engine_link.b) << e.path();
      EXPECT_EQ(c.engine_link.knee, c.transport_cpu.knee) << e.path();
      EXPECT_DOUBLE_EQ(c.link_seconds(c.engine_link.knee), c.engine_link.ys[0]) << e.path();
    }
    ++calibrations;
  }
  EXPECT_EQ(calibrations, 1);
  std::filesystem::remove_all(cache);
}

// Runs the planner worker's `scenario` on n ranks; every rank must print "OK rank R scenario".
void expect_scenario_passes(int n, const std::string& scenario) {
  auto r =
      testing::shell(fmt::format("{} run -n {} --timeout 60 -- {} {}", kCli, n, kWorker, scenario));
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < n; ++i) {
    EXPECT_NE(r.output.find(fmt::format("OK rank {} {}", i, scenario)), std::string::npos)
        << r.output;
  }
}

TEST_P(Ranks, AutoStaysRawWhereCompressionLoses) { expect_scenario_passes(GetParam(), "loses"); }

TEST_P(Ranks, AutoRunsPowerSgdWhereItPays) { expect_scenario_passes(GetParam(), "powersgd"); }

TEST_P(Ranks, CalibrationMeasuresDisturbedLinksAgain) {
  expect_scenario_passes(GetParam(), "links");
}

TEST_P(Ranks, TraceMergeAlignsEveryRanksClock) {
  const int n = GetParam();
  const std::string dir = testing::temp_dir();
  auto r = testing::shell(
      fmt::format("TERSE_TRACE={} {} run -n {} --timeout 60 -- {} trace", dir, kCli, n, kWorker));
  ASSERT_EQ(r.code, 0) << r.output;
  auto m = testing::shell(fmt::format("{} trace merge {}", kCli, dir));
  ASSERT_EQ(m.code, 0) << m.output;
  EXPECT_NE(m.output.find(fmt::format("{} ranks", n)), std::string::npos) << m.output;
  EXPECT_NE(m.output.find("traced"), std::string::npos) << m.output;  // its straggler line
  // One timeline: events of every rank, starting at 0; the offsets of ranks sharing this
  // machine's clock are within a round trip of 0.
  auto check = testing::shell(fmt::format(
      "python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); "
      "ev=[e for e in d[\"traceEvents\"] if e[\"ph\"]==\"X\"]; "
      "assert len({{e[\"pid\"] for e in ev}})=={}, \"ranks\"; "
      "assert min(e[\"ts\"] for e in ev)==0, \"origin\"; "
      "assert all(abs(o)<5e6 for o in d[\"otherData\"][\"clock_offsets_ns\"]), \"offsets\"' "
      "{}/merged.json",
      n, dir));
  EXPECT_EQ(check.code, 0) << check.output;
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Planner, Ranks, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "N" + std::to_string(info.param); });

}  // namespace
}  // namespace terse
