#include "kit/host.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <vector>

#include "terse/error.h"

namespace terse::kit {
namespace {

using Cpus = std::vector<int>;

TEST(Binding, RanksDividingTheCpusGetABlockEach) {
  EXPECT_EQ(binding(0, 2, {0, 1}), Cpus{0});
  EXPECT_EQ(binding(1, 2, {0, 1}), Cpus{1});
  EXPECT_EQ(binding(0, 2, {0, 1, 2, 3, 4, 5, 6, 7}), (Cpus{0, 1, 2, 3}));
  EXPECT_EQ(binding(1, 2, {0, 1, 2, 3, 4, 5, 6, 7}), (Cpus{4, 5, 6, 7}));
  EXPECT_EQ(binding(2, 3, {0, 1, 2, 3, 4, 5}), (Cpus{4, 5}));
  // The launcher's own mask, not CPU numbers from 0.
  EXPECT_EQ(binding(0, 2, {2, 5, 7, 9}), (Cpus{2, 5}));
  EXPECT_EQ(binding(1, 2, {2, 5, 7, 9}), (Cpus{7, 9}));
}

TEST(Binding, MoreRanksThanCpusStayUnbound) {
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(binding(r, 4, {0, 1}).empty()) << r;
  for (int r = 0; r < 6; ++r) EXPECT_TRUE(binding(r, 6, {3, 6}).empty()) << r;
}

TEST(Binding, UnevenCountsOneRankOrOneCpuStayUnbound) {
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(binding(r, 3, {0, 1}).empty()) << r;
    EXPECT_TRUE(binding(r, 3, {0, 1, 2, 3}).empty()) << r;
  }
  EXPECT_TRUE(binding(0, 1, {0, 1}).empty());
  EXPECT_TRUE(binding(0, 2, {0}).empty());
  EXPECT_TRUE(binding(1, 2, {}).empty());
  EXPECT_TRUE(binding(2, 2, {0, 1}).empty());  // no such rank
}

TEST(Host, AllowedCpusAreTheAffinityMask) {
  const Cpus cpus = allowed_cpus();
  ASSERT_FALSE(cpus.empty());
  EXPECT_EQ(static_cast<int>(cpus.size()), usable_cores());
  for (std::size_t i = 1; i < cpus.size(); ++i) EXPECT_LT(cpus[i - 1], cpus[i]);
  bind_to(cpus);  // binding to what it has changes nothing
  EXPECT_EQ(allowed_cpus(), cpus);
}

TEST(Host, BindingToNoSuchCpuIsAnError) {
  const Cpus before = allowed_cpus();
  EXPECT_THROW(bind_to({-1}), Error);
  EXPECT_THROW(bind_to({CPU_SETSIZE}), Error);
  EXPECT_THROW(bind_to({}), Error);  // an empty mask
  EXPECT_EQ(allowed_cpus(), before);
}

}  // namespace
}  // namespace terse::kit
