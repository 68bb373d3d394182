// The stc codec under terse's codec contract (terse/testing/codec_contract.h), with the error
// bound of its definition, and a known vector.
#include <gtest/gtest.h>
#include <terse/codec.h>
#include <terse/testing/codec_contract.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

namespace terse::testing {
namespace {

// ||decoded - x||^2 = ||x||^2 - k mu^2, mu the mean of the k = round(0.01 n) largest magnitudes.
double stc_error(std::span<const float> x) {
  std::vector<double> a(x.size());
  double norm2 = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    a[i] = std::fabs(x[i]);
    norm2 += a[i] * a[i];
  }
  const std::size_t k = sparse::count_for(0.01, x.size());
  std::partial_sort(a.begin(), a.begin() + k, a.end(), std::greater<>());
  double top = 0;
  for (std::size_t i = 0; i < k; ++i) top += a[i];
  return std::sqrt(std::max(0.0, norm2 - (k ? top * top / k : 0.0)));
}

const ErrorBound kStcBound{stc_error, {}};

INSTANTIATE_TEST_SUITE_P(Stc, CodecContract,
                         ::testing::Values(ContractCase{"stc", kStcBound},
                                           ContractCase{"stc:ef=1", kStcBound}),
                         contract_case_name);

TEST(Stc, EncodesTheKnownVector) {
  // k = 3 of 8: -4, 3 and -2 (indices 7, 3, 1) become +-mu, mu = 3.
  const std::vector<float> x = {0.5f, -2, 0.1f, 3, -0.2f, 0, 1, -4};
  auto codec = make_codec("stc:ratio=0.375");
  auto e = encode(*codec, x);
  const std::vector<std::uint8_t> payload(
      reinterpret_cast<const std::uint8_t*>(e.bytes.data()) + Codec::kHeaderBytes,
      reinterpret_cast<const std::uint8_t*>(e.bytes.data()) + e.bytes.size());
  const std::vector<std::uint8_t> expect = {3, 0, 0, 0, 0x00, 0x00, 0x40, 0x40,  // k, mu = 3
                                            1, 0, 0, 0, 3,    0,    0,    0,     // indices
                                            7, 0, 0, 0, 0x05};                   // signs -+-
  EXPECT_EQ(payload, expect);
  EXPECT_EQ(decode(*codec, e.span(), x.size()), (std::vector<float>{0, -3, 0, 3, 0, 0, 0, -3}));
}

TEST(Stc, IsListedWithTheIdOfItsRegistration) {
  auto codec = make_codec("stc");
  EXPECT_EQ(codec->id(), 200);
  EXPECT_EQ(codec->spec(), "stc:ratio=0.01");
  bool listed = false;
  for (const auto& info : registered_codecs()) listed |= info.name == "stc" && info.id == 200;
  EXPECT_TRUE(listed);
}

}  // namespace
}  // namespace terse::testing
