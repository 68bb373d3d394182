// reduce_scatter, all_gather and all_to_all: arguments refused at once on a
// one-rank communicator, then real multi-process runs of collectives_worker on
// 2, 3 and 4 ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "process_testing.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/error.h"

namespace terse {
namespace {

using namespace std::chrono_literals;
using testing::shell;

class CollectiveOps : public ::testing::Test {
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

// The message of the InvalidArgument f throws, or "" if it throws none.
template <typename F>
std::string invalid(F &&f) {
  try {
    f();
  } catch (const InvalidArgument &e) {
    return e.what();
  }
  return "";
}

TEST_F(CollectiveOps, BadSizesAndOptionsAreRefusedAtOnceNamingTheOperation) {
  Engine engine(comm_);
  std::vector<float> a(10), b(9), c(10);
  std::vector<std::uint16_t> h(10);
  const TensorView ten{std::span(a)}, nine{std::span(b)}, other{std::span(c)};
  const TensorView half(h.data(), h.size(), DType::kBFloat16);
  auto has = [](const std::string &msg, const std::string &what) {
    return msg.find(what) != std::string::npos;
  };
  // input is not world_size * n (one rank: the same size).
  std::string m = invalid([&] { engine.reduce_scatter("w", ten, nine); });
  EXPECT_TRUE(has(m, "reduce_scatter of tensor 'w'") && has(m, "input must hold")) << m;
  m = invalid([&] { engine.all_gather("w", nine, ten); });
  EXPECT_TRUE(has(m, "all_gather of tensor 'w'") && has(m, "output must hold")) << m;
  // Counts that do not sum to the tensors, or not one per rank.
  const std::vector<std::size_t> nine_count{9}, ten_count{10}, two{5, 5};
  m = invalid([&] { engine.all_to_all("t", ten, nine_count, other, nine_count); });
  EXPECT_TRUE(has(m, "all_to_all of tensor 't'") && has(m, "must sum")) << m;
  m = invalid([&] { engine.all_to_all("t", ten, two, other, two); });
  EXPECT_TRUE(has(m, "one per rank")) << m;
  // Types: input and output differ; reduce_scatter of a half tensor; codecs on
  // half blocks.
  m = invalid([&] { engine.all_gather("w", ten, half); });
  EXPECT_TRUE(has(m, "one type")) << m;
  CollectiveOptions o;
  // Options: codec auto for all_to_all (reduce_scatter and all_gather plan it), a strategy
  // auto's search cannot have, a multi-round codec, a strategy the operation has not.
  o.codec = "auto";
  m = invalid([&] { engine.all_to_all("t", ten, ten_count, other, ten_count, o); });
  EXPECT_TRUE(has(m, "all_to_all of tensor 't'") && has(m, "codec auto")) << m;
  o.strategy = Strategy::kAllgather;
  m = invalid([&] { engine.reduce_scatter("w", ten, other, o); });
  EXPECT_TRUE(has(m, "reduce_scatter of tensor 'w'") && has(m, "no reduce-scatter")) << m;
  o.strategy = Strategy::kRing;
  m = invalid([&] { engine.all_gather("w", ten, other, o); });
  EXPECT_TRUE(has(m, "all_gather of tensor 'w'") && has(m, "does not apply")) << m;
  o.strategy = Strategy::kAuto;
  o.codec = "powersgd";
  m = invalid([&] { engine.all_gather("w", ten, other, o); });
  EXPECT_TRUE(has(m, "powersgd")) << m;
  o.codec = "onebit";
  o.strategy = Strategy::kAllgather;
  m = invalid([&] { engine.reduce_scatter("w", ten, other, o); });
  EXPECT_TRUE(has(m, "no reduce-scatter")) << m;
  o.strategy = Strategy::kSharded;
  m = invalid([&] { engine.all_gather("w", ten, other, o); });
  EXPECT_TRUE(has(m, "does not apply")) << m;
  o.strategy = Strategy::kRaw;
  m = invalid([&] { engine.all_to_all("t", ten, ten_count, other, ten_count, o); });
  EXPECT_TRUE(has(m, "cannot use codec")) << m;
  // alltoall is no allreduce strategy.
  AllreduceOptions ar;
  ar.codec = "onebit";
  ar.strategy = Strategy::kAllToAll;
  m = invalid([&] { engine.allreduce("w", std::span(a), ar); });
  EXPECT_TRUE(has(m, "alltoall")) << m;
  // Nothing was submitted: the same names work now, and one rank's result is
  // its input.
  std::iota(a.begin(), a.end(), 1.0f);
  engine.reduce_scatter("w", ten, other).wait();
  EXPECT_EQ(c, a);
  engine.all_gather("w", ten, other).wait();
  EXPECT_EQ(c, a);
  engine.all_to_all("t", ten, ten_count, other, ten_count).wait();
  EXPECT_EQ(c, a);
}

TEST_F(CollectiveOps, HalfReduceScatterOnOneRankIsItsInputExactly) {
  Engine engine(comm_);
  std::vector<std::uint16_t> in(1000), out(1000, 0);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::uint16_t>(0x3f00 + i % 200);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    engine
        .reduce_scatter(std::string(to_string(dtype)), TensorView(in.data(), in.size(), dtype),
                        TensorView(out.data(), out.size(), dtype))
        .wait();
    EXPECT_EQ(out, in) << to_string(dtype);
  }
}

TEST_F(CollectiveOps, ZeroLengthShardsAndBlocksComplete) {
  Engine engine(comm_);
  std::vector<float> none;
  const TensorView empty(std::span<float>{});
  const std::vector<std::size_t> zero{0};
  for (const char *codec : {"none", "minmax8"}) {
    CollectiveOptions o;
    o.codec = codec;
    engine.reduce_scatter("z", empty, empty, o).wait();
    engine.all_gather("z", empty, empty, o).wait();
    engine.all_to_all("z", empty, zero, empty, zero, o).wait();
  }
}

TEST_F(CollectiveOps, ErrorFeedbackOfEveryShardIsSavedAndRestored) {
  Engine engine(comm_);
  std::vector<float> x(4096), y(4096);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.1f * static_cast<float>(i));
  CollectiveOptions o;
  o.codec = "onebit:ef=1";
  // On one rank only the owner's final encoding is lossy (its own contribution
  // is exact).
  o.strategy = Strategy::kSharded;
  engine.reduce_scatter("g", TensorView(std::span(x)), TensorView(std::span(y)), o).wait();
  const auto state = engine.save_state();
  engine.reduce_scatter("g", TensorView(std::span(x)), TensorView(std::span(y)), o).wait();
  const std::vector<float> second = y;
  engine.load_state(state);
  engine.reduce_scatter("g", TensorView(std::span(x)), TensorView(std::span(y)), o).wait();
  EXPECT_EQ(y, second);
  // Another engine without the state gives another result (the residual
  // matters).
  Engine fresh(comm_);
  fresh.reduce_scatter("g", TensorView(std::span(x)), TensorView(std::span(y)), o).wait();
  EXPECT_NE(y, second);
}

// ---- multi-process
// ----------------------------------------------------------------------------

const std::string kCli = TERSE_CLI;
const std::string kWorker = TERSE_WORKER;

std::string run(int n, const std::string &args, int timeout = 60) {
  return kCli + " run -n " + std::to_string(n) + " --timeout " + std::to_string(timeout) + " -- " +
         kWorker + " " + args;
}

void expect_all_ok(const testing::Result &r, int n, const std::string &what) {
  ASSERT_EQ(r.code, 0) << r.output;
  for (int i = 0; i < n; ++i) {
    EXPECT_NE(r.output.find("OK rank " + std::to_string(i) + " " + what), std::string::npos)
        << r.output;
  }
}

class CollectiveRanks : public ::testing::TestWithParam<int> {};

TEST_P(CollectiveRanks, ReduceScatterOfEveryCodecAndStrategyIsTheSumOrTheAllreducesSlice) {
  expect_all_ok(shell(run(GetParam(), "reduce_scatter", 300)), GetParam(), "reduce_scatter");
}

TEST_P(CollectiveRanks, AllGatherIsBitIdenticalOnEveryRankWithLossyCodecsToo) {
  expect_all_ok(shell(run(GetParam(), "all_gather", 300)), GetParam(), "all_gather");
}

TEST_P(CollectiveRanks, AllToAllOfEvenAndUnevenSplitsDeliversEveryBlock) {
  expect_all_ok(shell(run(GetParam(), "all_to_all", 300)), GetParam(), "all_to_all");
}

TEST_P(CollectiveRanks, NonFiniteShardsMismatchesAndBadCountsFailEveryRank) {
  expect_all_ok(shell(run(GetParam(), "collective_errors")), GetParam(), "collective errors");
}

TEST_P(CollectiveRanks, AllToAllCountMismatchAndNaNBlockFailEveryRankNamingTheOperation) {
  expect_all_ok(shell(run(GetParam(), "all_to_all_errors")), GetParam(), "all_to_all errors");
}

TEST_P(CollectiveRanks, KilledRankFailsTheOthersNamingTheOperation) {
  const int n = GetParam();
  const int victim = n - 1;
  auto r = shell(kCli + " run -n " + std::to_string(n) + " --timeout 3 --grace 30 -- " + kWorker +
                 " die_collective " + std::to_string(victim));
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
      EXPECT_NE(line.find("reduce_scatter"), std::string::npos) << line;
    }
  }
  EXPECT_EQ(survivors, n - 1) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Engine, CollectiveRanks, ::testing::Values(2, 3, 4),
                         [](const auto &info) { return fmt::format("{}Ranks", info.param); });

}  // namespace
}  // namespace terse
