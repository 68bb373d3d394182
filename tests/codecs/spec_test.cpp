// Spec tests: what a codec says it accepts is what it accepts. Every registered codec lists its
// parameters with their ranges when given an unknown key; each range's ends, and the values
// just outside them, must behave as the interval printed there says, and a rejection must
// print the same interval. Non-finite and malformed numbers are named for what they are.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <charconv>
#include <cmath>
#include <limits>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "terse/codec.h"
#include "terse/error.h"

namespace terse {
namespace {

struct Range {
  std::string key;
  bool integer = false;
  bool left_open = false, right_open = false;
  std::string lo_text, hi_text;
  std::string interval;  // as printed: "(0, 1]"
};

// The parameters a codec lists when it meets a key it does not have.
std::vector<Range> listed_ranges(const std::string& codec) {
  std::string help;
  try {
    make_codec(codec + ":no_such_key=1");
  } catch (const SpecError& e) {
    help = e.what();
  }
  EXPECT_NE(help.find("it accepts: "), std::string::npos) << codec << ": " << help;
  static const std::regex entry(
      R"((\w+) \((number|integer) in (([\[(])([^,\s]+), ([^\])\s]+)([\])])), default [^)]+\))");
  std::vector<Range> out;
  for (std::sregex_iterator it(help.begin(), help.end(), entry), end; it != end; ++it) {
    const std::smatch& m = *it;
    Range r;
    r.key = m[1];
    r.integer = m[2] == "integer";
    r.interval = m[3];
    r.left_open = m[4] == "(";
    r.lo_text = m[5];
    r.hi_text = m[6];
    r.right_open = m[7] == ")";
    out.push_back(r);
  }
  return out;
}

std::string shortest(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  EXPECT_EQ(ec, std::errc());
  return std::string(buf, end);
}

double parse_double(const std::string& s) {
  double v = std::numeric_limits<double>::quiet_NaN();
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

// The SpecError message for codec:key=value, or nothing if the codec was made.
std::optional<std::string> rejection(const std::string& codec, const std::string& key,
                                     const std::string& value) {
  try {
    make_codec(fmt::format("{}:{}={}", codec, key, value));
    return std::nullopt;
  } catch (const SpecError& e) {
    return std::string(e.what());
  }
}

void expect_accepted(const std::string& codec, const Range& r, const std::string& value) {
  const auto error = rejection(codec, r.key, value);
  EXPECT_FALSE(error) << codec << ":" << r.key << "=" << value << " lies in " << r.interval
                      << " as listed, but was rejected: " << *error;
}

void expect_outside(const std::string& codec, const Range& r, const std::string& value) {
  const auto error = rejection(codec, r.key, value);
  ASSERT_TRUE(error) << codec << ":" << r.key << "=" << value << " lies outside " << r.interval
                     << " as listed, but was accepted";
  EXPECT_NE(error->find("is outside " + r.interval), std::string::npos)
      << codec << ":" << r.key << "=" << value << ": the rejection does not print the listed "
      << r.interval << ": " << *error;
}

TEST(Spec, EveryCodecsRangedParametersBehaveAsTheirListedIntervalsSay) {
  int ranges = 0;
  for (const auto& info : registered_codecs()) {
    for (const Range& r : listed_ranges(info.name)) {
      ++ranges;
      SCOPED_TRACE(fmt::format("{}:{} in {}", info.name, r.key, r.interval));
      if (r.integer) {
        const std::int64_t lo = std::stoll(r.lo_text), hi = std::stoll(r.hi_text);
        expect_accepted(info.name, r, std::to_string(lo));
        expect_accepted(info.name, r, std::to_string(hi));
        if (lo > std::numeric_limits<std::int64_t>::min()) {
          expect_outside(info.name, r, std::to_string(lo - 1));
        }
        if (hi < std::numeric_limits<std::int64_t>::max()) {
          expect_outside(info.name, r, std::to_string(hi + 1));
        }
        continue;
      }
      const double lo = parse_double(r.lo_text), hi = parse_double(r.hi_text);
      ASSERT_TRUE(std::isfinite(lo) && std::isfinite(hi) && lo < hi);
      // Each end: in the range when closed, outside when open (then the nearest double inside
      // is accepted); the nearest double beyond either end is outside.
      if (r.left_open) {
        expect_outside(info.name, r, r.lo_text);
        expect_accepted(info.name, r, shortest(std::nextafter(lo, hi)));
      } else {
        expect_accepted(info.name, r, r.lo_text);
      }
      if (r.right_open) {
        expect_outside(info.name, r, r.hi_text);
        expect_accepted(info.name, r, shortest(std::nextafter(hi, lo)));
      } else {
        expect_accepted(info.name, r, r.hi_text);
      }
      expect_outside(info.name, r, shortest(std::nextafter(lo, -HUGE_VAL)));
      expect_outside(info.name, r, shortest(std::nextafter(hi, HUGE_VAL)));
      // Not numbers, and numbers that are not finite, whatever the range.
      for (const std::string v : {"inf", "-inf", "infinity", "1e999"}) {
        const auto error = rejection(info.name, r.key, v);
        ASSERT_TRUE(error) << v;
        EXPECT_NE(error->find(r.key + "=" + v + " is not finite"), std::string::npos) << *error;
        EXPECT_NE(error->find("allowed: a number in " + r.interval), std::string::npos) << *error;
      }
      for (const std::string v : {"nan", "abc", "0.5x", "--1"}) {
        const auto error = rejection(info.name, r.key, v);
        ASSERT_TRUE(error) << v;
        EXPECT_NE(error->find(r.key + "=" + v + " is not a number"), std::string::npos) << *error;
        EXPECT_NE(error->find("allowed: a number in " + r.interval), std::string::npos) << *error;
      }
    }
  }
  // topk's ratio, dgc's momentum, threelc's sparsity and qsgd's levels at least.
  EXPECT_GE(ranges, 10);
}

// The cases the issue named, spelled out: the density 0 is outside (0, 1], as listed.
TEST(Spec, TopkRatioZeroIsOutsideTheHalfOpenIntervalItLists) {
  const auto error = rejection("topk", "ratio", "0");
  ASSERT_TRUE(error);
  EXPECT_NE(error->find("ratio=0 is outside (0, 1]"), std::string::npos) << *error;
  const auto ranges = listed_ranges("topk");
  ASSERT_EQ(ranges.size(), 1u);
  EXPECT_EQ(ranges[0].interval, "(0, 1]");
  EXPECT_FALSE(rejection("topk", "ratio", "1"));
}

// A value that is not finite says what is allowed, as an out-of-range one does.
TEST(Spec, TopkRatioInfNamesTheIntervalAllowed) {
  for (const std::string v : {"inf", "1e999"}) {
    const auto error = rejection("topk", "ratio", v);
    ASSERT_TRUE(error) << v;
    EXPECT_NE(error->find("ratio=" + v + " is not finite; allowed: a number in (0, 1]"),
              std::string::npos)
        << *error;
  }
  const auto error = rejection("qsgd", "levels", "many");
  ASSERT_TRUE(error);
  EXPECT_NE(error->find("levels=many is not an integer; allowed: an integer in [1, 255]"),
            std::string::npos)
      << *error;
}

}  // namespace
}  // namespace terse
