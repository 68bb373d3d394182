// Engine tests: single-process behaviour (plans, validation, state, tracing) on a one-rank
// communicator, then real multi-process runs of collectives_worker through `terse run` for
// N = 2, 3, 4 and over a shaped link through scripts/cluster.sh.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "process_testing.h"
#include "simulate.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/error.h"
#include "terse/trace.h"

namespace terse {
namespace {

using namespace std::chrono_literals;
using testing::shell;

class SingleRank : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::temp_dir();
    CommunicatorOptions o;
    o.timeout = 5s;
    comm_ = Communicator::create(0, 1, make_file_store(dir_), o);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
  std::shared_ptr<Communicator> comm_;
};

TEST_F(SingleRank, PlansFollowTheCodecsTraits) {
  Engine engine(comm_);
  AllreduceOptions o;
  EXPECT_EQ(engine.plan(1000, o).strategy, Strategy::kRaw);
  EXPECT_EQ(engine.plan(1000, o).codec, "none");
  o.codec = "fp16";
  EXPECT_EQ(engine.plan(1000, o).strategy, Strategy::kSummable);
  o.codec = "onebit";
  EXPECT_EQ(engine.plan(1000, o).strategy, Strategy::kSharded);
  EXPECT_EQ(engine.plan(1000, o).codec, make_codec("onebit")->spec());
  o.codec = "dgc";  // its own momentum state: encoded once per rank, gathered
  EXPECT_EQ(engine.plan(1000, o).strategy, Strategy::kAllgather);
  o.codec = "powersgd";
  EXPECT_EQ(engine.plan(1 << 20, o).strategy, Strategy::kSummable);
  EXPECT_EQ(engine.plan(1 << 20, o).partitions, 1);
  o.strategy = Strategy::kAllgather;  // its rounds' sums gathered instead of on rings
  EXPECT_EQ(engine.plan(1 << 20, o).strategy, Strategy::kAllgather);
  o.strategy = Strategy::kAuto;
  // Partitions: from the size by default, clamped so that none is empty.
  o.codec = "none";
  EXPECT_EQ(engine.plan(std::size_t{64} << 20, o).partitions, 32);  // 256 MB / 8 MB
  o.partitions = 8;
  EXPECT_EQ(engine.plan(100, o).partitions, 2);
  EXPECT_EQ(engine.plan(0, o).partitions, 1);
}

TEST_F(SingleRank, RejectsInvalidOptionsNamingWhatIsAllowed) {
  Engine engine(comm_);
  auto message = [&](AllreduceOptions o) -> std::string {
    try {
      engine.plan(1000, o);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  AllreduceOptions o;
  o.codec = "onebit";
  o.strategy = Strategy::kRaw;
  EXPECT_NE(message(o).find("cannot use codec"), std::string::npos);
  o.strategy = Strategy::kSummable;
  EXPECT_NE(message(o).find("not summable"), std::string::npos);
  o.codec = "powersgd";
  o.strategy = Strategy::kSharded;
  EXPECT_NE(message(o).find("use strategy summable"), std::string::npos);
  o = {};
  o.partitions = 1000;
  EXPECT_NE(message(o).find("partitions"), std::string::npos);
  o = {};
  o.codec = "nosuchcodec";
  EXPECT_THROW(engine.plan(10, o), SpecError);
  EXPECT_THROW(parse_strategy("fastest"), SpecError);
  EXPECT_EQ(parse_strategy("sharded"), Strategy::kSharded);
  EXPECT_EQ(to_string(Strategy::kRing), "ring");

  std::vector<float> x(10);
  EXPECT_THROW(engine.allreduce("", x), InvalidArgument);
  std::vector<TensorRef> twice = {{"a", x, {}}, {"a", x, {}}};
  EXPECT_THROW(engine.allreduce_group(twice), InvalidArgument);
}

TEST_F(SingleRank, ResultsMatchTheSimulationAndTheInputIsKeptOnError) {
  EngineOptions options;
  options.keep_input_on_error = true;
  Engine engine(comm_, options);
  testing::Simulator sim(1, 0);
  for (const char* spec : {"none", "fp16", "onebit:ef=1", "minmax8", "qsgd", "powersgd:rank=3"}) {
    for (std::size_t n : {0, 1, 100, 4097, 300000}) {
      AllreduceOptions o;
      o.codec = spec;
      const std::string name = fmt::format("{}/{}", spec, n);
      std::vector<float> x(n);
      for (std::size_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * i) * (1 + i % 7);
      const TensorPlan plan = engine.plan(n, o);
      auto codec = make_codec(spec);
      auto want = sim.run(name, 0, plan.strategy,
                          plan.strategy == Strategy::kRaw ? nullptr : codec.get(),
                          plan.partitions, {x});
      engine.allreduce(name, x, o).wait();
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(x[i], want[i]) << name << " at " << i;
    }
  }
  // Non-finite input: an error naming the element; the tensor is unchanged.
  for (const char* spec : {"none", "onebit"}) {
    std::vector<float> x(1000, 0.5f);
    x[777] = NAN;
    AllreduceOptions o;
    o.codec = spec;
    try {
      engine.allreduce(std::string("bad/") + spec, x, o).wait();
      FAIL() << "no error for NaN with " << spec;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("element 777"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("unchanged"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(std::isnan(x[777]));
    EXPECT_EQ(x[0], 0.5f);
  }
}

TEST_F(SingleRank, HandlesCompleteOnceAndRunCallbacks) {
  Engine engine(comm_);
  std::vector<float> x(100000, 1.0f);
  int calls = 0;
  std::exception_ptr seen = std::make_exception_ptr(std::runtime_error("unset"));
  Handle h = engine.allreduce("x", x);
  h.on_complete([&](std::exception_ptr e) {
    ++calls;
    seen = e;
  });
  // A name in flight cannot be submitted again.
  EXPECT_THROW(
      {
        if (!h.ready()) engine.allreduce("x", x).wait();
        throw InvalidArgument("was already done");
      },
      InvalidArgument);
  h.wait();
  h.wait();  // waiting twice is fine
  engine.synchronize();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, nullptr);
  int late = 0;
  h.on_complete([&](std::exception_ptr) { ++late; });  // already done: runs at once
  EXPECT_EQ(late, 1);
  EXPECT_TRUE(Handle().ready());
}

TEST_F(SingleRank, StateSavesRestoresAndRejectsGarbage) {
  Engine engine(comm_);
  AllreduceOptions o;
  o.codec = "onebit:ef=1";
  std::vector<float> x(5000);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.1f * i);
  const auto original = x;
  engine.allreduce("w", x, o).wait();
  const auto saved = engine.save_state();
  auto a = original;
  engine.allreduce("w", a, o).wait();
  engine.load_state(saved);
  auto b = original;
  engine.allreduce("w", b, o).wait();
  EXPECT_EQ(a, b);  // the residual and the step were restored
  auto corrupt = saved;
  corrupt[0] = std::byte{0};
  EXPECT_THROW(engine.load_state(corrupt), DecodeError);
  auto truncated = saved;
  truncated.resize(saved.size() - 3);
  EXPECT_THROW(engine.load_state(truncated), DecodeError);
  // A failed load changed nothing.
  auto c = original;
  engine.load_state(saved);
  engine.allreduce("w", c, o).wait();
  EXPECT_EQ(a, c);
}

// Two ranks in this process, each with its own engine: a state saved by rank 1 is refused by
// rank 0 and the other way round, as is one saved by a one-rank engine, each naming both ranks
// and world sizes; a refused load changes nothing, and each rank's own state still loads.
TEST_F(SingleRank, StateSavedByAnotherRankOrWorldSizeIsRefusedNamingBoth) {
  AllreduceOptions o;
  o.codec = "onebit:ef=1";
  std::vector<float> x(3000);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.3f * i);
  std::vector<std::byte> one_rank_state;
  {
    Engine single(comm_);
    auto y = x;
    single.allreduce("w", y, o).wait();
    one_rank_state = single.save_state();
  }
  const std::string dir = testing::temp_dir();
  std::vector<std::byte> saved[2];
  std::string refusals[2][2];  // [rank][0: the other rank's state, 1: the one-rank state]
  std::vector<float> after_refusal[2], own_result[2];
  std::barrier sync(2);
  auto rank_main = [&](int rank) {
    CommunicatorOptions co;
    co.timeout = 10s;
    auto comm =
        std::shared_ptr<Communicator>(Communicator::create(rank, 2, make_file_store(dir), co));
    Engine engine(comm);
    auto y = x;
    engine.allreduce("w", y, o).wait();
    saved[rank] = engine.save_state();
    sync.arrive_and_wait();
    const std::vector<std::byte>* foreign[2] = {&saved[1 - rank], &one_rank_state};
    for (int k = 0; k < 2; ++k) {
      try {
        engine.load_state(*foreign[k]);
      } catch (const MismatchError& e) {
        refusals[rank][k] = e.what();
      }
    }
    // Nothing changed: the next step continues from this rank's own state, which still loads.
    after_refusal[rank] = x;
    engine.allreduce("w", after_refusal[rank], o).wait();
    engine.load_state(saved[rank]);
    own_result[rank] = x;
    engine.allreduce("w", own_result[rank], o).wait();
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  std::filesystem::remove_all(dir);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string& from_other = refusals[rank][0];
    EXPECT_NE(from_other.find(fmt::format("saved by rank {} of 2 ranks", 1 - rank)),
              std::string::npos)
        << "rank " << rank << ": '" << from_other << "'";
    EXPECT_NE(from_other.find(fmt::format("this engine is rank {} of 2", rank)), std::string::npos)
        << from_other;
    const std::string& from_single = refusals[rank][1];
    EXPECT_NE(from_single.find("saved by rank 0 of 1 ranks"), std::string::npos)
        << "rank " << rank << ": '" << from_single << "'";
    EXPECT_NE(from_single.find(fmt::format("this engine is rank {} of 2", rank)), std::string::npos)
        << from_single;
    EXPECT_EQ(after_refusal[rank], own_result[rank]) << "rank " << rank;
  }
}

// The engine's worker and completion threads run under SCHED_BATCH (src/transport/scheduling.h).
TEST_F(SingleRank, WorkerThreadsRunUnderBatchScheduling) {
  const char* mode = std::getenv("TERSE_SCHED");
  if (mode != nullptr && std::string(mode) == "normal") GTEST_SKIP() << "TERSE_SCHED=normal";
  const auto before = testing::thread_policies();
  EngineOptions options;
  options.threads = 3;
  Engine engine(comm_, options);
  std::vector<float> x(1000, 1.0f);
  engine.allreduce("x", x).wait();
  // A thread sets its policy first thing, but may not have run yet.
  std::map<pid_t, int> started;
  for (int i = 0; i < 200; ++i) {
    started.clear();
    for (const auto& [tid, policy] : testing::thread_policies()) {
      if (before.count(tid) == 0) started[tid] = policy;
    }
    const auto batch = std::count_if(started.begin(), started.end(),
                                     [](const auto& t) { return t.second == SCHED_BATCH; });
    if (batch == options.threads + 1) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(started.size(), static_cast<std::size_t>(options.threads + 1));
  for (const auto& [tid, policy] : started) EXPECT_EQ(policy, SCHED_BATCH) << "thread " << tid;
}

TEST_F(SingleRank, TracesEveryStage) {
  auto recorder = std::make_shared<TraceRecorder>();
  EngineOptions options;
  options.tracer = recorder;
  Engine engine(comm_, options);
  std::vector<float> x(100000, 0.25f);
  AllreduceOptions o;
  o.codec = "onebit";
  o.partitions = 2;
  engine.allreduce("traced", x, o).wait();
  std::set<std::string> stages;
  for (const auto& e : recorder->events()) {
    EXPECT_EQ(e.tensor, "traced");
    EXPECT_GE(e.end_ns, e.begin_ns);
    stages.insert(e.stage);
  }
  EXPECT_TRUE(stages.count("encode")) << stages.size();
  EXPECT_TRUE(stages.count("decode"));
  const std::string path = dir_ + "/trace.json";
  recorder->write_chrome_json(path, 0);
  auto r = shell("python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); "
                 "print(len(d[\"traceEvents\"]))' " + path);
  EXPECT_EQ(r.code, 0) << r.output;
}

// ---- multi-process ----------------------------------------------------------------------------

const std::string kCli = TERSE_CLI;
const std::string kWorker = TERSE_WORKER;

std::string run(int n, const std::string& args, int timeout = 60) {
  return kCli + " run -n " + std::to_string(n) + " --timeout " + std::to_string(timeout) +
         " -- " + kWorker + " " + args;
}

void expect_all_ok(const testing::Result& r, int n, const std::string& what) {
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < n; ++i) {
    EXPECT_NE(r.output.find("OK rank " + std::to_string(i) + " " + what), std::string::npos)
        << r.output;
  }
}

class Ranks : public ::testing::TestWithParam<int> {};

TEST_P(Ranks, EveryCodecAndStrategyMatchesTheSimulationOnEveryRank) {
  const int n = GetParam();
  auto r = shell(run(n, "matrix", 600));
  expect_all_ok(r, n, "matrix");
}

TEST_P(Ranks, HalfTensorsMatchTheSimulationRoundedAndAreIdenticalOnEveryRank) {
  const int n = GetParam();
  expect_all_ok(shell(run(n, "half", 300)), n, "half");
}

TEST_P(Ranks, GroupsFuseSmallTensorsAndResumeFromSavedState) {
  const int n = GetParam();
  expect_all_ok(shell(run(n, "group")), n, "group");
}

TEST_P(Ranks, NonFiniteInputFailsEveryRankAndTheEngineKeepsWorking) {
  const int n = GetParam();
  expect_all_ok(shell(run(n, "nonfinite")), n, "nonfinite");
  expect_all_ok(shell(run(n, "nonfinite keep")), n, "nonfinite keep");
}

TEST_P(Ranks, MismatchedSubmissionsAreReportedOnFirstUse) {
  const int n = GetParam();
  for (const char* kind : {"size", "name", "codec"}) {
    expect_all_ok(shell(run(n, std::string("mismatch ") + kind)), n,
                  std::string("mismatch ") + kind);
  }
}

TEST_P(Ranks, KilledRankFailsTheOthersWithinTheTimeout) {
  const int n = GetParam();
  const int victim = n - 1;
  auto r = shell(kCli + " run -n " + std::to_string(n) + " --timeout 3 --grace 30 -- " + kWorker +
                 " die " + std::to_string(victim));
  EXPECT_NE(r.code, 0) << r.output;
  int survivors = 0;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    double seconds = -1;
    int rank = -1;
    if (std::sscanf(line.c_str(), "[rank %d] EXPECTED-FAILURE rank %*d after %lf s", &rank,
                    &seconds) == 2) {
      ++survivors;
      EXPECT_NE(rank, victim);
      EXPECT_LT(seconds, 6.0) << line;
      // Every survivor names the victim as the cause: its own connection to it closed, or a live
      // peer aborted because of it; none blames a live peer for closing.
      EXPECT_TRUE(line.find(fmt::format("peer {} closed the connection", victim)) !=
                      std::string::npos ||
                  line.find(fmt::format("because of rank {}", victim)) != std::string::npos)
          << line;
      for (int live = 0; live < n; ++live) {
        if (live == victim) continue;
        EXPECT_EQ(line.find(fmt::format("peer {} closed the connection", live)), std::string::npos)
            << "blames live rank " << live << ": " << line;
      }
    }
  }
  EXPECT_EQ(survivors, n - 1) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
}

TEST_P(Ranks, ManyConcurrentSubmissionsOnFewThreads) {
  const int n = GetParam();
  expect_all_ok(shell(run(n, "stress")), n, "stress");
}

TEST_P(Ranks, ChannelsCarryCompressedTensorsBothWays) {
  const int n = GetParam();
  expect_all_ok(shell(run(n, "channel")), n, "channel");
}

// A submission waiting in the first-use check for a slow peer holds up only later submissions:
// handles, save_state, plan and bytes_sent on other threads go on.
TEST_P(Ranks, ASubmissionWaitingForASlowPeerBlocksNoOtherCall) {
  const int n = GetParam();
  expect_all_ok(shell(run(n, "slowpeer")), n, "slowpeer");
}

// Ranks sharing a machine would each start a thread per core in OpenBLAS (PowerSGD's
// products): the engine gives each its share, leaves a count set in the environment alone, and
// restores the count it found once destroyed.
TEST_P(Ranks, OpenBlasGetsTheRanksShareOfTheCores) {
  const int n = GetParam();
  // Unbound, so that OpenBLAS starts with a thread per core of the machine, more than a share.
  const std::string unset = "OPENBLAS_NUM_THREADS= GOTO_NUM_THREADS= OMP_NUM_THREADS= "
                            "TERSE_BIND=none ";
  expect_all_ok(shell(unset + run(n, "blas")), n, "blas");
  expect_all_ok(shell("OPENBLAS_NUM_THREADS=2 " + run(n, "blas")), n, "blas");
}

INSTANTIATE_TEST_SUITE_P(Engine, Ranks, ::testing::Values(2, 3, 4), [](const auto& info) {
  std::string name = std::to_string(info.param);
  name.insert(name.begin(), 'N');
  return name;
});

// ---- two levels over hosts ------------------------------------------------------------------

// Every codec family and strategy across hosts of even and uneven size, and on a single host:
// bit-identical on every rank, close to the exact average, NaN named everywhere.
TEST(Hierarchy, EveryLayoutGivesIdenticalResultsCloseToTheSum) {
  const std::pair<const char*, int> layouts[] = {{"2,2", 4}, {"3,2", 5}, {"2,1,1", 4}, {"4", 4}};
  const char* shown[] = {"0-1|2-3", "0-2|3-4", "0-1|2|3", "0-3"};
  for (std::size_t i = 0; i < std::size(layouts); ++i) {
    const auto& [layout, n] = layouts[i];
    auto r = shell(std::string("TERSE_TOPOLOGY=") + layout + " " + run(n, "hierarchy", 300));
    expect_all_ok(r, n, "hierarchy");
    EXPECT_NE(r.output.find(std::string("on hosts ") + shown[i]), std::string::npos) << r.output;
  }
  // The phases inside a host by messages instead of direct reads: the same results.
  auto r = shell("TERSE_INTRA_HOST=tcp TERSE_TOPOLOGY=3,2 " + run(5, "hierarchy", 300));
  expect_all_ok(r, 5, "hierarchy");
  EXPECT_NE(r.output.find("on hosts 0-2|3-4 (messages inside the host)"), std::string::npos)
      << r.output;
}

// Reduce-scatter and all-gather in two levels on hosts of equal and unequal size, hosts of
// one rank, a single host and hosts of interleaved ranks: raw is the host-order sum of exact
// host sums bit for bit, all-gathers bit-identical on every rank, lossy codecs within bounds,
// the bytes on each host link the two-level amount; failures named on every rank.
TEST(Hierarchy, ReduceScatterAndAllGatherInTwoLevelsOnEveryLayout) {
  const std::pair<const char*, int> layouts[] = {{"2,2", 4}, {"3,2", 5}, {"2,1,1", 4}, {"4", 4}};
  const char* shown[] = {"0-1|2-3", "0-2|3-4", "0-1|2|3", "0-3"};
  for (std::size_t i = 0; i < std::size(layouts); ++i) {
    const auto& [layout, n] = layouts[i];
    auto r = shell(std::string("TERSE_TOPOLOGY=") + layout + " " +
                   run(n, "hierarchy_collectives", 300));
    expect_all_ok(r, n, "hierarchy_collectives");
    // Ranks of one machine read each other's memory inside a host (hosts of one rank have
    // nothing to read).
    EXPECT_NE(r.output.find(std::string("on hosts ") + shown[i] + " (reads inside the host)"),
              std::string::npos)
        << r.output;
  }
  // Hosts by name, ranks interleaved: {0, 2} and {1, 3}.
  auto r = shell(kCli + " run -n 4 --timeout 300 -- sh -c 'export TERSE_HOST=h$((RANK%2)) "
                 "LOCAL_WORLD_SIZE=2; exec " + kWorker + " hierarchy_collectives'");
  expect_all_ok(r, 4, "hierarchy_collectives");
  EXPECT_NE(r.output.find("on hosts 0-2|1-3"), std::string::npos) << r.output;
}

// Under topology auto, ranks with equal host names share a host; the launcher's count of the
// ranks on a host (LOCAL_WORLD_SIZE) must agree with it, or every rank fails naming both.
TEST(Hierarchy, HostsComeFromHostNamesAndTheLaunchersCountIsChecked) {
  auto ok = shell(kCli + " run -n 4 --timeout 60 -- sh -c 'export TERSE_HOST=h$((RANK/2)) "
                  "LOCAL_WORLD_SIZE=2; exec " + kWorker + " hierarchy'");
  expect_all_ok(ok, 4, "hierarchy");
  EXPECT_NE(ok.output.find("on hosts 0-1|2-3"), std::string::npos) << ok.output;
  // terse run says 4 ranks share the machine.
  auto bad = shell(kCli + " run -n 4 --timeout 60 -- sh -c 'export TERSE_HOST=h$((RANK/2)); exec " +
                   kWorker + " topology_error'");
  ASSERT_EQ(bad.code, 0) << bad.output;
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(bad.output.find(fmt::format("EXPECTED-FAILURE rank {}: rank {}: rank 0's launcher "
                                          "says its host has 4 ranks (LOCAL_WORLD_SIZE)",
                                          i, i)),
              std::string::npos)
        << bad.output;
  }
}

// A rank that gives another topology, or a layout that does not fit the job, fails every rank
// at the engine's construction with a message naming what is wrong.
TEST(Hierarchy, TopologiesThatDisagreeOrDoNotFitFailEveryRank) {
  auto r = shell(kCli + " run -n 4 --timeout 60 -- sh -c 'if [ $RANK = 1 ]; then export "
                 "TERSE_TOPOLOGY=flat; else export TERSE_TOPOLOGY=2,2; fi; exec " + kWorker +
                 " topology_error'");
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(r.output.find(fmt::format("EXPECTED-FAILURE rank {}: rank {}: the ranks disagree on "
                                        "the topology: rank 0 gives '2,2', rank 1 gives 'flat'",
                                        i, i)),
              std::string::npos)
        << r.output;
  }
  r = shell("TERSE_TOPOLOGY=2,3 " + run(4, "topology_error"));
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(r.output.find(fmt::format("EXPECTED-FAILURE rank {}: topology '2,3' places 5 ranks, "
                                        "but the job has 4", i)),
              std::string::npos)
        << r.output;
  }
  r = shell("TERSE_TOPOLOGY=2x " + run(2, "topology_error"));
  EXPECT_NE(r.output.find("TERSE_TOPOLOGY='2x' is not allowed"), std::string::npos) << r.output;
}

// Both ranks of host 1 die mid-allreduce: the ranks of host 0 fail within the timeout, naming
// the dead peer and its host.
TEST(Hierarchy, AHostWhoseRanksDieIsNamedByTheOthersWithinTheTimeout) {
  auto r = shell("TERSE_TOPOLOGY=2,2 " + kCli + " run -n 4 --timeout 3 --grace 30 -- sh -c 'if [ "
                 "$RANK = 2 ]; then exec " + kWorker + " die 2; else exec " + kWorker + " die 3; "
                 "fi'");
  EXPECT_NE(r.code, 0) << r.output;
  for (int rank : {0, 1}) {
    double seconds = -1;
    const auto at = r.output.find(fmt::format("[rank {}] EXPECTED-FAILURE rank {} after", rank, rank));
    ASSERT_NE(at, std::string::npos) << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    ASSERT_EQ(std::sscanf(line.c_str(), "[rank %*d] EXPECTED-FAILURE rank %*d after %lf s",
                          &seconds), 1) << line;
    EXPECT_LT(seconds, 6.0) << line;
    EXPECT_NE(line.find("is on host 1 of 2, with ranks 2,3"), std::string::npos) << line;
  }
  EXPECT_LT(r.seconds, 30) << r.output;
}

TEST(Cluster, HostsOfTwoRanksAreFoundFromTheirNetworkNamespaces) {
  if (!testing::can_emulate_cluster()) GTEST_SKIP() << "needs root and ip netns";
  auto r = shell(std::string("bash ") + TERSE_SOURCE_DIR +
                 "/scripts/cluster.sh -n 2 -l 2 -r 1gbit -- " + kWorker + " hierarchy");
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(r.output.find(fmt::format("rank {}] OK rank {} hierarchy", i, i)), std::string::npos)
        << r.output;
  }
  EXPECT_NE(r.output.find("on hosts 0-1|2-3"), std::string::npos) << r.output;
}

TEST(Cluster, CollectivesInTwoLevelsOverHostsOfTwoRanks) {
  if (!testing::can_emulate_cluster()) GTEST_SKIP() << "needs root and ip netns";
  auto r = shell(std::string("bash ") + TERSE_SOURCE_DIR +
                 "/scripts/cluster.sh -n 2 -l 2 -r 1gbit -- " + kWorker +
                 " hierarchy_collectives");
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(r.output.find(fmt::format("rank {}] OK rank {} hierarchy_collectives", i, i)),
              std::string::npos)
        << r.output;
  }
  EXPECT_NE(r.output.find("on hosts 0-1|2-3"), std::string::npos) << r.output;
}

TEST(Cluster, CompressedAllreduceOverAShapedLink) {
  if (!testing::can_emulate_cluster()) GTEST_SKIP() << "needs root and ip netns";
  auto r = shell(std::string("bash ") + TERSE_SOURCE_DIR + "/scripts/cluster.sh -n 3 -r 1gbit -- " +
                 kWorker + " group");
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < 3; ++i) {
    EXPECT_NE(r.output.find("[host " + std::to_string(i) + "] OK rank " + std::to_string(i)),
              std::string::npos)
        << r.output;
  }
}

}  // namespace
}  // namespace terse
