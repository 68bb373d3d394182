// The element-wise kit primitives error feedback's momentum correction is made of: every size
// (vector bodies and scalar tails) against a scalar reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <vector>

#include "kit/basic.h"

namespace terse::kit {
namespace {

std::vector<float> ramp(std::size_t n, float a, float b) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = a * std::sin(b * static_cast<float>(i) + 0.3f);
  return v;
}

TEST(Basic, ScaleAddIsAMomentumUpdate) {
  for (std::size_t n : {0u, 1u, 3u, 7u, 8u, 15u, 16u, 17u, 100u, 1027u}) {
    const auto x = ramp(n, 2.0f, 0.7f);
    auto y = ramp(n, -1.5f, 0.31f);
    const auto before = y;
    scale_add(x, y, 0.9f);
    for (std::size_t i = 0; i < n; ++i) {
      const float want = 0.9f * before[i] + x[i];
      ASSERT_NEAR(y[i], want, 1e-6f * (std::fabs(0.9f * before[i]) + std::fabs(x[i])))
          << "n=" << n << " i=" << i;
    }
  }
}

TEST(Basic, ClearWhereZeroesWhatTheMaskSent) {
  for (std::size_t n : {0u, 1u, 5u, 16u, 33u, 1000u}) {
    std::vector<float> mask(n, 0.0f);
    for (std::size_t i = 0; i < n; i += 3) mask[i] = (i % 2 != 0) ? -0.5f : 2.0f;
    if (n > 4) mask[4] = -0.0f;  // a signed zero sent nothing
    auto y = ramp(n, 1.0f, 0.5f);
    const auto before = y;
    clear_where(mask, y);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(y[i], mask[i] != 0.0f ? 0.0f : before[i]) << "n=" << n << " i=" << i;
    }
  }
}

}  // namespace
}  // namespace terse::kit
