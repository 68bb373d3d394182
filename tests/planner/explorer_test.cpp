// The explorer's rule (src/planner/explorer.h) on synthetic timings: it keeps the fastest,
// stops early where a paired bound separates the leader, stays within its budget, holds a
// compressed plan to min_gain against raw, and takes the same steps on every rank; then the
// planner's use of it through the exchange (one rank: the exchange is local).
#include "planner/explorer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "planner/planner_impl.h"
#include "planner/synthetic.h"
#include "process_testing.h"
#include "terse/communicator.h"
#include "terse/planner.h"

namespace terse {
namespace {

using namespace std::chrono_literals;
using planner::Explorer;

PlanCandidate candidate(const std::string& codec, Strategy s, int k, double predicted) {
  PlanCandidate c;
  c.plan.codec = codec;
  c.plan.strategy = s;
  c.plan.partitions = k;
  c.predicted.seconds = predicted;
  return c;
}

// Contenders as the planner lists them: compressed plans (the choice first), raw last; all
// predicted alike, so that only the measured times tell them apart.
std::vector<PlanCandidate> contenders(std::size_t compressed, double predicted) {
  std::vector<PlanCandidate> out;
  for (std::size_t i = 0; i < compressed; ++i) {
    out.push_back(candidate("fp16", Strategy::kSharded, 1 << i, predicted));
  }
  out.push_back(candidate("none", Strategy::kRaw, 1, predicted));
  return out;
}

struct Drive {
  std::vector<std::size_t> order;  // the contender of each submission
  double seconds = 0;              // what the runs took
};

// Drives an explorer to its settlement as the planner does: the first submission runs the
// choice; each submission runs next(); a finished round ends with the runs' times, `truth[i]`
// times a noise factor (lognormal with sigma `noise`, from `seed`).
Drive drive(Explorer& e, const std::vector<double>& truth, double noise, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<std::vector<double>> round(truth.size());
  Drive run;
  std::size_t i = e.next();
  for (int guard = 0; guard < 100000; ++guard) {
    const double t = truth[i] * std::exp(noise * normal(gen));
    round[i].push_back(t);
    run.order.push_back(i);
    run.seconds += t;
    if (e.round_done()) {
      e.end_round(round);
      round.assign(truth.size(), {});
      if (e.settled()) return run;
    }
    i = e.next();
  }
  ADD_FAILURE() << "the explorer did not settle";
  return run;
}

TEST(Explorer, KeepsTheFastestMeasuredWhateverTheModelExpected) {
  // Four compressed plans and raw, all predicted at 1 ms; the third runs 15% faster than the
  // next best. Runs vary by 10%.
  const std::vector<double> truth = {1.0e-3, 1.1e-3, 0.85e-3, 1.3e-3, 2.0e-3};
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    Explorer e(contenders(4, 1e-3), 2.0, 0.05);
    drive(e, truth, 0.1, seed);
    ASSERT_TRUE(e.settled());
    EXPECT_EQ(e.winner(), 2u) << "seed " << seed << ": " << e.why();
  }
}

TEST(Explorer, StopsAsSoonAsAPairedBoundSeparatesTheLeader) {
  // One contender twice as fast as the others, runs steady to 1%: the first round's pairs
  // separate it, and no second round runs.
  const std::vector<double> truth = {2e-3, 1e-3, 2.1e-3, 2.2e-3, 2.3e-3};
  Explorer e(contenders(4, 1e-3), 2.0, 0.05);
  drive(e, truth, 0.01, 7);
  EXPECT_EQ(e.winner(), 1u);
  EXPECT_EQ(e.why(), "confident");
  EXPECT_EQ(e.round(), 0);
  // Equal times never separate: halving goes on until one is left or the budget is spent.
  Explorer tie(contenders(3, 1e-3), 2.0, 0.05);
  drive(tie, {1e-3, 1e-3, 1e-3, 1e-3}, 0.05, 7);
  EXPECT_NE(tie.why(), "confident");
  EXPECT_GT(tie.round(), 0);
}

TEST(Explorer, StaysWithinItsBudget) {
  // Runs of 10 ms and a budget of 0.3 s: the rounds' shares buy a few runs each; the whole
  // exploration costs no more than the budget (every round's runs fit what is left of it).
  for (double budget : {0.3, 0.6, 1.2}) {
    Explorer e(contenders(3, 10e-3), budget, 0.05);
    const Drive run = drive(e, {10e-3, 10e-3, 10e-3, 10e-3}, 0.02, 3);
    EXPECT_LE(run.seconds, budget * 1.05) << budget;  // 1.05: the runs' noise
    EXPECT_LE(e.spent(), budget * 1.05) << budget;
    EXPECT_GT(run.seconds, budget * 0.5) << budget << ": the budget buys more runs";
  }
  // Where even the least runs (kMinRuns each) overrun it, one round runs and it settles.
  Explorer dear(contenders(3, 50e-3), 0.5, 0.05);
  const Drive run = drive(dear, {50e-3, 50e-3, 50e-3, 50e-3}, 0.02, 3);
  EXPECT_EQ(dear.why(), "budget");
  EXPECT_EQ(run.order.size(), 4u * planner::kMinRuns);
}

TEST(Explorer, AdmitsContendersWhileTheFirstRoundFitsTheBudget) {
  PlanDecision d;
  d.chosen = candidate("fp16", Strategy::kSharded, 1, 50e-3);
  d.ranked = {d.chosen, candidate("fp16", Strategy::kSharded, 2, 52e-3),
              candidate("fp16", Strategy::kRing, 1, 55e-3),
              candidate("none", Strategy::kRaw, 1, 60e-3),
              candidate("fp16", Strategy::kAllgather, 1, 90e-3)};
  // The choice and raw always take part (4 runs each: 0.44 s); within 0.5 s no other's 4 runs
  // fit, within 0.8 s one more's.
  auto keys = [](const std::vector<PlanCandidate>& v) {
    std::vector<std::string> out;
    for (const auto& c : v) out.push_back(plan_key(c.plan));
    return out;
  };
  EXPECT_EQ(keys(planner::pick_contenders(d, 0.5)),
            (std::vector<std::string>{"fp16/sharded/1", "none/raw/1"}));
  EXPECT_EQ(keys(planner::pick_contenders(d, 0.8)),
            (std::vector<std::string>{"fp16/sharded/1", "fp16/sharded/2", "none/raw/1"}));
  // A large budget: every plan within kWithin (1.5x) of the choice, raw last; allgather (1.8x)
  // is not one.
  EXPECT_EQ(
      keys(planner::pick_contenders(d, 100)),
      (std::vector<std::string>{"fp16/sharded/1", "fp16/sharded/2", "fp16/ring/1", "none/raw/1"}));
  EXPECT_EQ(planner::pick_contenders(d, 0).size(), 1u);  // no budget: the choice alone
}

TEST(Explorer, TakesAtMostEightContendersBesidesRaw) {
  PlanDecision d;
  d.chosen = candidate("onebit", Strategy::kSharded, 2, 10e-3);
  d.ranked = {d.chosen};
  for (int k : {1, 4, 8, 16}) {
    for (Strategy s : {Strategy::kSharded, Strategy::kRing}) {
      if (s == Strategy::kSharded && k == 2) continue;
      d.ranked.push_back(candidate("onebit", s, k, 10e-3 + 0.5e-3 * d.ranked.size()));
    }
  }
  d.ranked.push_back(candidate("none", Strategy::kRaw, 1, 14e-3));
  const auto picked = planner::pick_contenders(d, 100);
  ASSERT_EQ(picked.size(), static_cast<std::size_t>(planner::kMaxContenders) + 1);
  EXPECT_EQ(plan_key(picked.front().plan), "onebit/sharded/2");
  EXPECT_EQ(plan_key(picked.back().plan), "none/raw/1");
  // The fastest expected after the choice, in the model's order.
  for (std::size_t i = 1; i + 1 < picked.size(); ++i) {
    EXPECT_EQ(plan_key(picked[i].plan), plan_key(d.ranked[i].plan)) << i;
  }
}

TEST(Explorer, ACompressedPlanMustBeatRawByMinGain) {
  // The compressed plan measures 3% faster than raw: not the 5% min_gain asks, so raw.
  {
    Explorer e(contenders(1, 1e-3), 2.0, 0.05);
    drive(e, {0.97e-3, 1.0e-3}, 0.005, 5);
    EXPECT_EQ(e.contenders()[e.winner()].plan.strategy, Strategy::kRaw) << e.why();
  }
  // 10% faster: compressed.
  {
    Explorer e(contenders(1, 1e-3), 2.0, 0.05);
    drive(e, {0.90e-3, 1.0e-3}, 0.005, 5);
    EXPECT_EQ(e.winner(), 0u) << e.why();
  }
  // Raw eliminated in the first round still holds the winner to min_gain by its measured time.
  {
    Explorer e(contenders(3, 1e-3), 2.0, 0.05);
    drive(e, {0.98e-3, 1.2e-3, 1.3e-3, 1.0e-3}, 0.005, 5);
    EXPECT_EQ(e.contenders()[e.winner()].plan.strategy, Strategy::kRaw) << e.why();
  }
}

TEST(Explorer, EveryRankTakesTheSameStepsFromTheSameAgreedTimes) {
  // Two ranks' explorers fed the same agreed times run the same contender at every
  // submission and settle on the same plan at the same submission; the passes' order is
  // shuffled (not one fixed order every pass).
  const std::vector<double> truth = {1.0e-3, 1.05e-3, 0.95e-3, 1.1e-3, 1.02e-3};
  Explorer a(contenders(4, 1e-3), 2.0, 0.05), b(contenders(4, 1e-3), 2.0, 0.05);
  const Drive ra = drive(a, truth, 0.1, 11);
  const Drive rb = drive(b, truth, 0.1, 11);
  EXPECT_EQ(ra.order, rb.order);
  EXPECT_EQ(a.winner(), b.winner());
  EXPECT_EQ(ra.order.front(), 0u);  // the choice runs first
  std::set<std::vector<std::size_t>> passes;
  for (std::size_t at = 0; at + 5 <= 20; at += 5) {
    passes.insert(std::vector<std::size_t>(ra.order.begin() + at, ra.order.begin() + at + 5));
  }
  EXPECT_GT(passes.size(), 1u);
}

TEST(Explorer, AContenderNeverTimedDropsOut) {
  Explorer e(contenders(2, 1e-3), 2.0, 0.05);
  std::size_t i = e.next();
  std::vector<std::vector<double>> round(3);
  while (true) {
    if (i != 1) round[i].push_back(i == 0 ? 1.2e-3 : 1.0e-3);  // contender 1: never timed
    if (e.round_done()) break;
    i = e.next();
  }
  e.end_round(round);
  ASSERT_TRUE(e.settled());
  EXPECT_EQ(e.winner(), 2u);  // raw: faster than the choice, and the other one never ran
  EXPECT_FALSE(e.time(1).has_value());
}

// ---- through the planner ---------------------------------------------------------------------

TEST(Planner, ExplorationSettlesOnTheFastestMeasuredThroughTheExchange) {
  const std::string dir = testing::temp_dir();
  CommunicatorOptions co;
  co.timeout = 5s;
  auto comm = Communicator::create(0, 1, make_file_store(dir), co);
  PlannerOptions o;
  o.allowed = {"fp16", "onebit:ef=1"};
  o.heavy = {"none"};
  o.cache_path = "-";
  // 1 Gbit/s on 4 ranks modelled; one rank measured: the exchange is this rank's alone.
  const auto owner = PlannerAccess::with_calibration(o, testing::synthetic(125e6, 50e-6, 4));
  Planner& p = *owner;
  const std::size_t n = std::size_t{1} << 20;
  const PlanDecision d = p.decide(n, 1, 4);
  ASSERT_GT(d.contenders.size(), 1u);
  // The last contender listed runs fastest: 0.6 of the choice's predicted time.
  const std::string fastest = plan_key(d.contenders.back().plan);
  auto truth = [&](const TensorPlan& plan) {
    return plan_key(plan) == fastest ? 0.6 * PlanDecision::expected(d.chosen)
                                     : PlanDecision::expected(d.chosen);
  };
  const planner::Use use{n, 4, Strategy::kAuto, 0};
  int steps = 0;
  for (; steps < 1000; ++steps) {
    planner::before_submission(p, *comm, std::span(&use, 1));
    const TensorPlan plan = planner::plan(p, *comm, {n, 4});
    planner::observe(p, n, plan, truth(plan));
    if (steps > 0 && !planner::exploring(p, {n, 4})) break;
  }
  EXPECT_LT(steps, 1000);
  EXPECT_FALSE(planner::exploring(p, {n, 4}));
  EXPECT_EQ(plan_key(planner::plan(p, *comm, {n, 4})), fastest);
  comm.reset();
  std::filesystem::remove_all(dir);
}

TEST(Planner, SmallRawTensorsAndNoBudgetAreNotExplored) {
  PlannerOptions o;
  o.allowed = {"fp16", "onebit:ef=1"};
  o.heavy = {"none"};
  o.cache_path = "-";
  const auto with = PlannerAccess::with_calibration(o, testing::synthetic(125e6, 50e-6));
  EXPECT_EQ(with->decide(1000, 4, 4).contenders.size(), 1u);  // 4 KB: raw, for its precision
  EXPECT_GT(with->decide(std::size_t{1} << 20, 4, 4).contenders.size(), 1u);
  o.explore_seconds = 0;
  const auto without = PlannerAccess::with_calibration(o, testing::synthetic(125e6, 50e-6));
  EXPECT_EQ(without->decide(std::size_t{1} << 20, 4, 4).contenders.size(), 1u);
}

}  // namespace
}  // namespace terse
