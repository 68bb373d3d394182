// The planner on hosts of several ranks: link classes from the per-peer calibration, the cost
// model's two-level allreduce (docs/planner.md, "Two levels"), decisions between flat and two
// levels, the cache's topology, `terse plan --hosts`, and codec "auto" on 2 + 2 ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/allreduce_probe.h"
#include "planner/calibration.h"
#include "planner/cost_model.h"
#include "planner/planner_impl.h"
#include "planner/synthetic.h"
#include "process_testing.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/error.h"
#include "transport/topology.h"

namespace terse {
namespace {

using namespace std::chrono_literals;
using testing::synthetic;
using testing::synthetic_hosts;

const std::string kCli = TERSE_CLI;
const std::string kWorker = TERSE_WORKER;

// 2 hosts of 2 ranks: 100 Mbit/s and 100 us across hosts, 10 Gbit/s and 20 us inside them.
const transport::Topology k2x2 = transport::topology_from_spec("2x2", 4);
Calibration slow_across() { return synthetic_hosts(k2x2.host_of, 12.5e6, 100e-6, 1.25e9, 20e-6); }

PlannerOptions options() {
  PlannerOptions o;
  o.allowed = {"fp16", "onebit:ef=1"};
  o.heavy = {"none"};
  o.cache_path = "-";
  return o;
}

planner::Use use_on(std::size_t n, const transport::Topology& t,
                    Hierarchy h = Hierarchy::kAuto) {
  planner::Use u{n, 4};
  u.topology = &t;
  u.hierarchy = h;
  return u;
}

TEST(PlannerHosts, EachLinkClassIsItsSlowestPair) {
  Calibration c = slow_across();
  c.peer_beta[2][3] = 2 / 1.25e9;  // one intra-host pair at half the rate
  const LinkClasses l = link_classes(c, k2x2.host_of);
  EXPECT_EQ(l.intra.pairs, 2);
  EXPECT_EQ(l.cross.pairs, 4);
  EXPECT_DOUBLE_EQ(l.intra.pair_beta, 2 / 1.25e9);
  EXPECT_DOUBLE_EQ(l.cross.pair_beta, 1 / 12.5e6);
  // The slowest class keeps the engine's round latency; the other is sooner by as much as its
  // exchanges are. Bytes: each class's beta over the slowest pair's.
  EXPECT_DOUBLE_EQ(l.cross.alpha, c.alpha);
  EXPECT_NEAR(l.intra.alpha, 20e-6, 1e-12);
  EXPECT_DOUBLE_EQ(l.cross.scale, 1);
  EXPECT_NEAR(l.intra.scale, 2 * 12.5e6 / 1.25e9, 1e-12);
  // The engine's alpha above the slowest exchange (wake-ups) carries over to both classes.
  c.alpha = 150e-6;
  EXPECT_NEAR(link_classes(c, k2x2.host_of).intra.alpha, 70e-6, 1e-12);
  // One host: no cross-host pair, which stands in as the flat model's links; nor does either
  // class where the per-peer figures are of another job (or calibrate_local's, which has none).
  const LinkClasses one = link_classes(c, {0, 0, 0, 0});
  EXPECT_EQ(one.cross.pairs, 0);
  EXPECT_DOUBLE_EQ(one.cross.alpha, c.alpha);
  EXPECT_DOUBLE_EQ(one.cross.scale, 1);
  const LinkClasses other = link_classes(c, {0, 0, 1});
  EXPECT_EQ(other.intra.pairs + other.cross.pairs, 0);
  EXPECT_DOUBLE_EQ(other.intra.scale, 1);
}

// The host's CPU bound counts what the host's ranks do on average: with one slot a host
// (PowerSGD), one rank of each host runs the codec's rounds while the other waits, so where the
// ranks share the cores (6 ranks on 2) two levels bound the allreduce by about half the codec's
// CPU of a flat one, and are predicted faster (as measured on 3 x 2 ranks at 300 Mbit/s).
TEST(PlannerHosts, TheHostBoundCountsOnlyTheRanksThatCross) {
  const transport::Topology t = transport::topology_from_spec("3x2", 6);
  Calibration c = synthetic_hosts(t.host_of, 37.5e6, 100e-6, 1.25e9, 20e-6);
  testing::add_powersgd(c);
  c.ranks_on_host = 6;
  c.cores = 2;
  const CostModel model(c);
  const std::string psgd = make_codec("powersgd")->spec();
  const std::size_t n = 25'000'000;
  const Prediction flat = model.predict(n, psgd, Strategy::kSummable, 1, 6, 4);
  const Prediction two =
      model.predict_hosts(n, psgd, Strategy::kSummable, 1, planner::host_layout(c, t), 4);
  // The crossing rank's own CPU is at least the flat rank's (it also sums its host's inputs) ...
  EXPECT_GE(two.cpu, 0.9 * flat.cpu);
  // ... but its host's average is well below it, and the cores bound two levels lower.
  EXPECT_LT(two.host_cpu, 0.75 * flat.host_cpu) << two.host_cpu << " " << flat.host_cpu;
  EXPECT_LT(two.host_bound, flat.host_bound);
}

TEST(PlannerHosts, TwoLevelsFollowTheirPhases) {
  // Raw on 2 x 2 ranks, one partition of m floats, 2 slots of m/2:
  //   inside: 3 rounds (reduce-scatter, all-gather, status), 4 (m/2 + m/2) + 24 bytes, 1 add
  //   across: the raw ring on 2 ranks of m/2 (2 rounds, 2 * 4 * m/4 bytes, add and div of m/4),
  //           then the status round (1 round, 24 bytes).
  const Calibration c = slow_across();
  const CostModel model(c);
  const planner::HostLayout hosts = planner::host_layout(c, k2x2);
  const std::size_t n = std::size_t{1} << 20;
  const double m = static_cast<double>(n);
  const Prediction p = model.predict_hosts(n, "none", Strategy::kRaw, 1, hosts, 4);
  EXPECT_DOUBLE_EQ(p.bytes_sent, (4 * m + 24) + (2 * m + 24));
  const double latency = 3 * 20e-6 + 3 * 100e-6;
  const double link = (4 * m + 24) / 1.25e9 + (2 * m + 24) / 12.5e6;
  const double cpu = c.add(m / 2) + c.add(m / 4) + c.divide(m / 4);
  EXPECT_NEAR(p.one_partition, latency + link + cpu, 1e-9);
  EXPECT_NEAR(p.seconds, c.job_overhead + p.one_partition, 1e-9);
  // A multi-round codec crosses with one slot a host: its last rank gathers the host's whole
  // matrix, crosses with its rounds on 2 ranks (then a status round) and hands the result back.
  Calibration with_psgd = c;
  testing::add_powersgd(with_psgd);
  const CostModel psgd_model(with_psgd);
  const std::string psgd = make_codec("powersgd")->spec();
  const Prediction two =
      psgd_model.predict_hosts(n, psgd, Strategy::kSummable, 1, hosts, 4);
  const Prediction flat2 = psgd_model.predict(n, psgd, Strategy::kSummable, 1, 2, 4);
  EXPECT_DOUBLE_EQ(two.bytes_sent, flat2.bytes_sent + 24 + (4 * m + 24));
  // Uneven hosts (3 + 2): 3 slots; a rank of the host of 2 owns 2 slots and crosses twice.
  const transport::Topology uneven = transport::topology_from_spec("3,2", 5);
  const Calibration c5 = synthetic_hosts(uneven.host_of, 12.5e6, 100e-6, 1.25e9, 20e-6);
  const CostModel model5(c5);
  const std::size_t n5 = 3 * 64 * 1024;
  const Prediction p5 =
      model5.predict_hosts(n5, "none", Strategy::kRaw, 1, planner::host_layout(c5, uneven), 4);
  const double slot_bytes = 2 * 4 * (static_cast<double>(n5) / 3 / 2) + 24;
  // Inside, the busiest sender: the host of 3's (m - m/3 out, 2 m/3 back) or the host of 2's
  // rank of 2 slots (m/3 out, 2 m/3 back): 4 m/3 floats either way.
  EXPECT_DOUBLE_EQ(p5.bytes_sent, 4 * (4.0 * static_cast<double>(n5) / 3) + 2 * 24 +
                                      2 * slot_bytes);
}

TEST(PlannerHosts, TwoLevelsWinOnSlowCrossLinksForLargeTensorsAndLoseForTinyOnes) {
  const Calibration c = slow_across();
  const CostModel model(c);
  const planner::HostLayout hosts = planner::host_layout(c, k2x2);
  const std::size_t large = std::size_t{1} << 22;
  const std::string onebit = make_codec("onebit:ef=1")->spec();
  const std::string fp16 = make_codec("fp16")->spec();
  struct Config {
    std::string codec;
    Strategy strategy;
    int k;
  };
  for (const Config& x :
       {Config{"none", Strategy::kRaw, 1}, Config{"none", Strategy::kRaw, 4},
        Config{onebit, Strategy::kSharded, 1}, Config{fp16, Strategy::kSummable, 2},
        Config{onebit, Strategy::kAllgather, 1}}) {
    const double flat = model.predict(large, x.codec, x.strategy, x.k, 4, 4).seconds;
    const double two = model.predict_hosts(large, x.codec, x.strategy, x.k, hosts, 4).seconds;
    // Each host's link carries each byte once instead of once a rank.
    EXPECT_LT(two, 0.75 * flat) << x.codec << " " << to_string(x.strategy) << " K=" << x.k;
  }
  // 1 Gbit/s across, 10 Gbit/s inside: a tiny tensor's three more message steps cost more than
  // the bytes saved.
  const Calibration fast = synthetic_hosts(k2x2.host_of, 125e6, 50e-6, 1.25e9, 10e-6);
  const CostModel fast_model(fast);
  const planner::HostLayout fast_hosts = planner::host_layout(fast, k2x2);
  for (const std::size_t tiny : {std::size_t{64}, std::size_t{256}}) {
    EXPECT_LT(fast_model.predict(tiny, "none", Strategy::kRaw, 1, 4, 4).seconds,
              fast_model.predict_hosts(tiny, "none", Strategy::kRaw, 1, fast_hosts, 4).seconds)
        << tiny;
  }
}

TEST(PlannerHosts, DecisionsPriceBothLevelsWhereTheHostsHaveThem) {
  const auto owner = PlannerAccess::with_calibration(options(), slow_across());
  const Planner& p = *owner;
  const std::size_t large = std::size_t{1} << 22, tiny = 64;
  const PlanDecision big = planner::decide(p, use_on(large, k2x2), 4);
  EXPECT_TRUE(big.chosen.plan.hierarchical) << plan_key(big.chosen.plan);
  const auto two = std::count_if(big.ranked.begin(), big.ranked.end(),
                                 [](const PlanCandidate& c) { return c.plan.hierarchical; });
  EXPECT_EQ(2 * two, static_cast<long>(big.ranked.size()));  // every candidate at both levels
  EXPECT_NE(plan_key(big.chosen.plan).find("/hosts"), std::string::npos);
  EXPECT_FALSE(planner::decide(p, use_on(tiny, k2x2), 4).chosen.plan.hierarchical);
  // Restricted: one level only.
  for (const auto& c : planner::decide(p, use_on(large, k2x2, Hierarchy::kFlat), 4).ranked) {
    EXPECT_FALSE(c.plan.hierarchical);
  }
  for (const auto& c : planner::decide(p, use_on(tiny, k2x2, Hierarchy::kHosts), 4).ranked) {
    EXPECT_TRUE(c.plan.hierarchical);
  }
  // One host, or a rank a host: flat under hierarchy auto, as the engine's rule says; without a
  // topology (Planner::decide), flat.
  for (const char* spec : {"4", "flat"}) {
    const transport::Topology t = transport::topology_from_spec(spec, 4);
    for (const auto& c : planner::decide(p, use_on(large, t), 4).ranked) {
      EXPECT_FALSE(c.plan.hierarchical) << spec;
    }
  }
  EXPECT_FALSE(p.decide(large, 4, 4).chosen.plan.hierarchical);
  // A topology of another job size is refused by name; other operations stay flat.
  const transport::Topology three = transport::topology_from_spec("2,1", 3);
  EXPECT_THROW(planner::decide(p, use_on(large, three), 4), InvalidArgument);
  planner::Use rs = use_on(large, k2x2);
  rs.op = Operation::kReduceScatter;
  for (const auto& c : planner::decide(p, rs, 4).ranked) EXPECT_FALSE(c.plan.hierarchical);
}

TEST(PlannerHosts, EachLevelKeepsItsOwnDecisionAndMeasurements) {
  // One rank: the exchanges are local. A topology of one host of one rank has no two levels, so
  // hierarchy auto is flat; hierarchy hosts prices the degenerate two levels, apart.
  const std::string dir = testing::temp_dir();
  CommunicatorOptions co;
  co.timeout = 5s;
  auto comm = Communicator::create(0, 1, make_file_store(dir), co);
  PlannerOptions o = options();
  o.explore_seconds = 0;
  const auto owner = PlannerAccess::with_calibration(o, synthetic(12.5e6, 100e-6, 1));
  Planner& p = *owner;
  PlannerAccess::set_recheck_interval(p, 1);
  const transport::Topology one = transport::topology_from_spec("1", 1);
  const std::size_t n = std::size_t{1} << 20;
  const TensorPlan flat = planner::plan(p, *comm, use_on(n, one));
  const TensorPlan hosts = planner::plan(p, *comm, use_on(n, one, Hierarchy::kHosts));
  EXPECT_FALSE(flat.hierarchical);
  EXPECT_TRUE(hosts.hierarchical);
  EXPECT_NE(plan_key(flat), plan_key(hosts));
  planner::observe(p, n, hosts, 0.5);
  planner::before_submission(p, *comm);
  auto measured = [&](Hierarchy h, const TensorPlan& plan) -> std::optional<double> {
    for (const auto& c : planner::decide(p, use_on(n, one, h), 1).ranked) {
      if (plan_key(c.plan) == plan_key(plan)) return c.measured;
    }
    return std::nullopt;
  };
  EXPECT_EQ(measured(Hierarchy::kHosts, hosts), 0.5);
  TensorPlan same_flat = hosts;
  same_flat.hierarchical = false;
  EXPECT_EQ(measured(Hierarchy::kAuto, same_flat), std::nullopt);
  comm.reset();
  std::filesystem::remove_all(dir);
}

TEST(PlannerHosts, ACacheOfAnotherTopologyIsMeasuredAgain) {
  const std::string dir = testing::temp_dir();
  CommunicatorOptions co;
  co.timeout = 60s;
  auto comm = Communicator::create(0, 1, make_file_store(dir + "/store"), co);
  // A cache of this world size recorded under hosts {0}: a job of that topology takes it (its
  // host name says it is the file's); one of another (none known) measures again.
  Calibration cached = synthetic(12.5e6, 100e-6, 1);
  cached.host = "from-the-cache";
  cached.host_of = {0};
  const std::string path = dir + "/calibration.json";
  auto plan_with = [&](const transport::Topology* t) {
    std::ofstream(path) << cached.to_json();
    PlannerOptions o = options();
    o.cache_path = path;
    o.explore_seconds = 0;
    Planner p(o);
    PlannerAccess::set_allreduce_probe(p, allreduce_probes(2));
    planner::Use u{std::size_t{1} << 16, 4};
    u.topology = t;
    (void)planner::plan(p, *comm, u);
    return PlannerAccess::model(p).calibration();
  };
  const transport::Topology one = transport::topology_from_spec("1", 1);
  EXPECT_EQ(plan_with(&one).host, "from-the-cache");
  const Calibration measured = plan_with(nullptr);
  EXPECT_NE(measured.host, "from-the-cache");
  EXPECT_TRUE(measured.host_of.empty());
  comm.reset();
  std::filesystem::remove_all(dir);
}

TEST(PlannerHosts, PlanCommandPricesFlatAndTwoLevels) {
  const std::string dir = testing::temp_dir();
  auto sizes = testing::shell(
      fmt::format("printf '[{{\"name\": \"big\", \"elements\": 4194304}}, {{\"name\": \"bias\", "
                  "\"elements\": 10}}]' > {}/sizes.json",
                  dir));
  ASSERT_EQ(sizes.code, 0);
  auto plan = testing::shell(fmt::format(
      "{0} plan --sizes {1}/sizes.json --hosts 2x2 --bandwidth 100mbit --latency 100e-6 "
      "--codecs fp16 onebit:ef=1 --heavy none --json {1}/plan.json",
      kCli, dir));
  ASSERT_EQ(plan.code, 0) << plan.output;
  EXPECT_NE(plan.output.find("two levels over 2 hosts: 0-1 | 2-3 (4 ranks)"), std::string::npos)
      << plan.output;
  std::ifstream in(dir + "/plan.json");
  const nlohmann::json report = nlohmann::json::parse(in);
  const auto& hosts = report.at("hosts");
  const auto& big = hosts.at("tensors").at(0);
  EXPECT_EQ(big.at("name"), "big");
  EXPECT_NE(big.at("hosts").at("plan").get<std::string>().find("/hosts"), std::string::npos);
  EXPECT_EQ(big.at("flat").at("plan").get<std::string>().find("/hosts"), std::string::npos);
  EXPECT_LT(big.at("hosts").at("predicted_s").get<double>(),
            big.at("flat").at("predicted_s").get<double>());
  EXPECT_EQ(big.at("choice"), big.at("hosts").at("plan"));
  EXPECT_LE(hosts.at("auto_step_s").get<double>(), hosts.at("flat_step_s").get<double>());
  EXPECT_NEAR(hosts.at("intra").at("beta").get<double>(), 8 / 10e9, 1e-15);  // the default
  // A pair across hosts: its share of the host's link, which the host's 2 ranks share.
  EXPECT_NEAR(hosts.at("cross").at("beta").get<double>(), 2 * 8 / 100e6, 1e-15);
  // --ranks must agree with the layout; a bad layout is named.
  auto bad = testing::shell(
      fmt::format("{} plan --sizes {}/sizes.json --hosts 2x2 --ranks 5 --bandwidth 1gbit", kCli,
                  dir));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("places 4 ranks, but the job has 5"), std::string::npos)
      << bad.output;
  std::filesystem::remove_all(dir);
}

// ---- multi-process: 4 ranks as 2 hosts of 2 (TERSE_TOPOLOGY) ----------------------------------

TEST(PlannerHosts, AutoPlansOnTwoHostsAgreeOnEveryRankAndIncludeTheHierarchy) {
  auto r = testing::shell(fmt::format("TERSE_TOPOLOGY=2,2 {} run -n 4 --timeout 120 -- {} hosts",
                                      kCli, kWorker));
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(r.output.find(fmt::format("OK rank {} hosts", i)), std::string::npos) << r.output;
  }
  EXPECT_NE(r.output.find(fmt::format("{} ", std::size_t{1} << 20)), std::string::npos);
}

TEST(PlannerHosts, AutoCalibratesForItsTopologyAndExploresBothLevels) {
  const std::string cache = testing::temp_dir();
  auto run = [&](const std::string& topology) {
    return testing::shell(fmt::format(
        "XDG_CACHE_HOME={} TERSE_TOPOLOGY={} TERSE_PLAN_LOG=1 {} run -n 4 --timeout 180 -- {} "
        "hosts_auto",
        cache, topology, kCli, kWorker));
  };
  // Calibrated under 2 + 2, then taken from the cache by a job of the same hosts; a job of
  // another topology (one host), or of the same hosts moving bytes inside them by messages
  // instead of direct reads, measures again.
  const std::vector<std::pair<std::string, bool>> runs = {
      {"2,2", false}, {"2,2", true}, {"2,2 TERSE_INTRA_HOST=tcp", false}, {"4", false}};
  for (const auto& [topology, cached] : runs) {
    const auto r = run(topology);
    ASSERT_EQ(r.code, 0) << r.output;
    for (int i = 0; i < 4; ++i) {
      EXPECT_NE(r.output.find(fmt::format("OK rank {} hosts_auto", i)), std::string::npos)
          << r.output;
    }
    EXPECT_EQ(r.output.find("calibration from") != std::string::npos, cached)
        << topology << "\n"
        << r.output;
    EXPECT_EQ(r.output.find("measured on other hosts") != std::string::npos,
              topology != "2,2")
        << r.output;
    // Rank 0's log names both link classes where there are two levels.
    EXPECT_EQ(r.output.find("links inside hosts") != std::string::npos,
              topology.starts_with("2,2"))
        << r.output;
  }
  std::filesystem::remove_all(cache);
}

}  // namespace
}  // namespace terse
