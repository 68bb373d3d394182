// The contract every registered codec keeps (terse/testing/codec_contract.h), run for every
// built-in codec with and without error feedback, each lossy one against the error bound its
// definition gives at its default parameters. Codec-specific properties (unbiasedness, known
// vectors, bounds at other parameters) are in each codec's own test file.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <map>

#include "terse/codec.h"
#include "terse/codec_kit.h"
#include "terse/testing/codec_contract.h"

namespace terse::testing {
namespace {

using Bounds = std::vector<double>;

double norm2(std::span<const float> x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return s;
}

// ||x|| without its m largest magnitudes: the error of the best m-sparse approximation.
double tail_norm(std::span<const float> x, std::size_t m) {
  std::vector<double> sq(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) sq[i] = static_cast<double>(x[i]) * x[i];
  m = std::min(m, sq.size());
  std::nth_element(sq.begin(), sq.begin() + m, sq.end(), std::greater<>());
  double s = 0;
  for (std::size_t i = m; i < sq.size(); ++i) s += sq[i];
  return std::sqrt(s);
}

// f(x_i) for every element.
template <typename F>
Bounds each(std::span<const float> x, F f) {
  Bounds b(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) b[i] = f(std::fabs(static_cast<double>(x[i])), i);
  return b;
}

// f(x_i, chunk of x_i) for chunks of `chunk` elements.
template <typename F>
Bounds per_chunk(std::span<const float> x, std::size_t chunk, F f) {
  Bounds b(x.size());
  for (std::size_t start = 0; start < x.size(); start += chunk) {
    auto xs = x.subspan(start, std::min(chunk, x.size() - start));
    for (std::size_t i = 0; i < xs.size(); ++i) b[start + i] = f(xs, std::fabs(xs[i]));
  }
  return b;
}

double abs_max(std::span<const float> x) {
  double m = 0;
  for (float v : x) m = std::max(m, std::fabs(static_cast<double>(v)));
  return m;
}

// |y_i - x_i| <= |x_i|: y_i is x_i or 0 (sparsifiers that send values unscaled).
Bounds kept_or_zero(std::span<const float> x) {
  return each(x, [](double a, std::size_t) { return a; });
}

// Each lossy codec's bound at its default parameters (the first step from a fresh state for
// stateful ones), from its definition; docs/codecs.md states the parameters.
const std::map<std::string, ErrorBound, std::less<>>& bounds() {
  static const std::map<std::string, ErrorBound, std::less<>> table = {
      // Round to nearest even: half an ulp, 2^-11 relative (2^-25 absolute among subnormals);
      // finite values beyond 65504 saturate.
      {"fp16",
       {{},
        [](std::span<const float> x) {
          return each(x, [](double a, std::size_t) {
            return a * 0x1p-11 + 0x1p-25 + std::max(0.0, a - 65504.0);
          });
        }}},
      {"bf16",
       {{},
        [](std::span<const float> x) {
          return each(x, [](double a, std::size_t) {
            return a * 0x1p-8 + 0x1p-134 + std::max(0.0, a - 0x1.fcp127);
          });
        }}},
      // +-s, s = mean |x| of each chunk of m = 1024: its error^2 is ||x||^2 - ||x||_1^2 / m.
      {"onebit",
       {[](std::span<const float> x) {
          double err = 0;
          for (std::size_t start = 0; start < x.size(); start += 1024) {
            auto xs = x.subspan(start, std::min<std::size_t>(1024, x.size() - start));
            double l1 = 0;
            for (float v : xs) l1 += std::fabs(v);
            err += norm2(xs) - l1 * l1 / static_cast<double>(xs.size());
          }
          return std::sqrt(std::max(0.0, err));
        },
        {}}},
      // Levels {-s, 0, s}, s = max |x| (one chunk, no clipping): off by at most s.
      {"terngrad",
       {{},
        [](std::span<const float> x) {
          const double s = abs_max(x);
          return each(x, [s](double, std::size_t) { return s; });
        }}},
      // 7 levels of each bucket's (512) L2 norm: off by at most one level, norm / 7.
      {"qsgd",
       {{},
        [](std::span<const float> x) {
          return per_chunk(
              x, 512, [](std::span<const float> xs, double) { return std::sqrt(norm2(xs)) / 7; });
        }}},
      // |x| in [2^e, 2^(e+1)) goes to one of the two: off by at most 2^e <= |x|. Below the
      // window of 127 exponents under the largest (at most 2 max|x|), to 0 or its floor.
      {"natural",
       {{},
        [](std::span<const float> x) {
          const double floor = std::max(0x1p-126, 2 * abs_max(x) * 0x1p-126);
          return each(x, [floor](double a, std::size_t) { return a + floor; });
        }}},
      // 255 steps between the chunk's (4096) min and max: half a step, plus the rounding of
      // lo + code * step.
      {"minmax8",
       {{},
        [](std::span<const float> x) {
          return per_chunk(x, 4096, [](std::span<const float> xs, double) {
            const auto [lo, hi] = std::minmax_element(xs.begin(), xs.end());
            return (static_cast<double>(*hi) - *lo) / 510 +
                   1e-6 * std::max(std::fabs(*lo), std::fabs(*hi));
          });
        }}},
      // The k = round(0.01 n) largest magnitudes, exactly: the best k-sparse approximation.
      {"topk",
       {[](std::span<const float> x) { return tail_norm(x, sparse::count_for(0.01, x.size())); },
        kept_or_zero}},
      // k values kept unscaled (scale=0) at random indices.
      {"randomk", {{}, kept_or_zero}},
      // Every |x| > 1e-3 unless more than round(0.1 n) are: then the largest round(0.1 n).
      {"threshold",
       {[](std::span<const float> x) {
          std::size_t above = 0;
          for (float v : x) above += std::fabs(v) > 1e-3f;
          return tail_norm(x, std::min(above, sparse::count_for(0.1, x.size())));
        },
        kept_or_zero}},
      // First step: the velocity is x, sent unscaled at a sampled threshold.
      {"dgc", {{}, kept_or_zero}},
      // Values {-M, 0, M}, M = max|x| (sparsity 1): |x| >= M/2 to +-M, else 0; off by <= M/2.
      {"threelc",
       {{},
        [](std::span<const float> x) {
          const double half = abs_max(x) / 2;
          return each(x, [half](double, std::size_t) { return half; });
        }}},
      // |x| > tau to +-tau, else 0; tau = 0.01 as fp32.
      {"tbq",
       {{},
        [](std::span<const float> x) {
          return each(x, [](double a, std::size_t) {
            const double tau = 0.01f;
            return a > tau ? a - tau : a;
          });
        }}},
      // Rank-4 projection of x's matrix view onto P's orthonormal columns: never longer than x.
      {"powersgd", {[](std::span<const float> x) { return std::sqrt(norm2(x)); }, {}}},
  };
  return table;
}

std::vector<ContractCase> all_cases() {
  std::vector<ContractCase> cases;
  for (const auto& info : registered_codecs()) {
    auto c = make_codec(info.name);
    const CodecTraits t = c->traits();
    auto it = bounds().find(info.name);
    const ErrorBound bound = it == bounds().end() ? ErrorBound{} : it->second;
    cases.push_back({info.name, bound});
    // Round codecs (PowerSGD) and DGC have error feedback built in and refuse ef=1.
    if (!t.lossless && !t.multi_round && !t.builtin_feedback) {
      cases.push_back({info.name + ":ef=1", bound});
    }
  }
  // Error feedback with DGC's momentum correction, around a sparsifier and a quantizer (the
  // first encoding of a fresh state is plain error feedback's, so the bounds hold).
  for (const char* name : {"randomk", "topk", "minmax8"}) {
    cases.push_back({std::string(name) + ":ef=1,momentum=0.9", bounds().at(name)});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllCodecs, CodecContract, ::testing::ValuesIn(all_cases()),
                         contract_case_name);

// A codec added without a bound would fail its round trips; this names what is missing.
TEST(CodecContractBounds, EveryLossyCodecHasABound) {
  for (const auto& info : registered_codecs()) {
    if (make_codec(info.name)->traits().lossless) continue;
    EXPECT_TRUE(bounds().count(info.name)) << info.name << " has no error bound in the suite";
  }
}

}  // namespace
}  // namespace terse::testing

namespace terse {
namespace {

TEST(CodecRegistry, UnknownNamesAndKeysListWhatIsAllowed) {
  try {
    make_codec("nosuchcodec");
    FAIL();
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("fp16"), std::string::npos) << e.what();
  }
  try {
    make_codec("fp16:ratio=0.1");
    FAIL();
  } catch (const SpecError& e) {
    EXPECT_NE(std::string(e.what()).find("ratio"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_codec("fp16:"), SpecError);
  EXPECT_THROW(make_codec("fp16:ef"), SpecError);
  EXPECT_THROW(make_codec("none:ef=1"), SpecError);
  EXPECT_THROW(make_codec("fp16:ef=1,ef=0"), SpecError);
}

TEST(ErrorFeedbackMomentum, IsErrorFeedbacksParameterCheckedAndCanonical) {
  const auto c = make_codec("topk:ratio=0.01,momentum=0.9,ef=1");
  EXPECT_EQ(c->spec(), make_codec("topk:ratio=0.01,ef=1")->spec() + ",momentum=0.9");
  EXPECT_EQ(make_codec(c->spec())->spec(), c->spec());  // the canonical spec reads back
  EXPECT_EQ(make_codec("topk:ef=1,momentum=0")->spec(), make_codec("topk:ef=1")->spec());
  // Its state holds what was not sent, momentum included: auto gathers the payloads.
  EXPECT_TRUE(c->traits().builtin_feedback);
  EXPECT_FALSE(make_codec("topk:ef=1")->traits().builtin_feedback);
  auto message = [](const std::string& spec) -> std::string {
    try {
      make_codec(spec);
    } catch (const SpecError& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_NE(message("topk:ef=1,momentum=1").find("momentum=1 is outside [0, 1)"),
            std::string::npos)
      << message("topk:ef=1,momentum=1");
  EXPECT_NE(message("topk:ef=1,momentum=x").find("not a number"), std::string::npos);
  // Without ef=1 the key is the codec's own: unknown to top-k (the list says what it takes).
  EXPECT_NE(message("topk:momentum=0.9").find("momentum"), std::string::npos);
  EXPECT_EQ(make_codec("dgc:momentum=0.5")->name(), "dgc");
  // A state with momentum does not load into one without, nor the reverse.
  auto with = c->make_state(100);
  auto without = make_codec("topk:ratio=0.01,ef=1")->make_state(100);
  std::vector<std::byte> a, b;
  with->save(a);
  without->save(b);
  EXPECT_THROW(without->load(a), DecodeError);
  EXPECT_THROW(with->load(b), DecodeError);
}

}  // namespace
}  // namespace terse
