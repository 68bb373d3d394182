// Helpers for the tests of topk, threshold and dgc: surgery on their shared payload
// (u32 count, count u32 indices, count fp32 values) and the corruptions every decoder refuses.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "codec_testing.h"

namespace terse::testing {

struct SparseList {
  std::vector<std::uint32_t> idx;
  std::vector<float> val;
};

inline SparseList parse_sparse(const Encoded& e) {
  SparseList s;
  std::uint32_t count;
  std::memcpy(&count, e.bytes.data() + 24, 4);
  s.idx.resize(count);
  s.val.resize(count);
  if (count == 0) return s;  // no memcpy from or to null
  std::memcpy(s.idx.data(), e.bytes.data() + 28, 4 * count);
  std::memcpy(s.val.data(), e.bytes.data() + 28 + 4 * count, 4 * count);
  return s;
}

// The header of `like` (length fixed up) followed by the payload of `s`, whose count field
// says `count` (default: its real size).
inline Encoded build_sparse(const Encoded& like, const SparseList& s, long count = -1) {
  const std::uint32_t c = count < 0 ? static_cast<std::uint32_t>(s.idx.size())
                                    : static_cast<std::uint32_t>(count);
  Encoded e;
  e.bytes.assign(like.bytes.begin(), like.bytes.begin() + 24);
  const std::uint64_t len = 4 + 8 * s.idx.size();
  std::memcpy(e.bytes.data() + 16, &len, 8);
  e.bytes.resize(24 + len);
  std::memcpy(e.bytes.data() + 24, &c, 4);
  if (s.idx.empty()) return e;
  std::memcpy(e.bytes.data() + 28, s.idx.data(), 4 * s.idx.size());
  std::memcpy(e.bytes.data() + 28 + 4 * s.idx.size(), s.val.data(), 4 * s.val.size());
  return e;
}

// Every corruption of a valid payload (of >= 2 entries, n elements) that no encoder produces.
inline void expect_rejects_sparse_corruptions(const Codec& c, const Encoded& valid, std::size_t n) {
  const SparseList ok = parse_sparse(valid);
  ASSERT_GE(ok.idx.size(), 2u);
  std::vector<std::pair<std::string, Encoded>> bad;
  auto variant = [&](const std::string& what, auto&& change, long count = -1) {
    SparseList s = ok;
    change(s);
    bad.emplace_back(what, build_sparse(valid, s, count));
  };
  variant("duplicate index", [](SparseList& s) { s.idx[1] = s.idx[0]; });
  variant("decreasing indices", [](SparseList& s) { std::swap(s.idx[0], s.idx[1]); });
  variant("index == n", [&](SparseList& s) { s.idx.back() = static_cast<std::uint32_t>(n); });
  variant("index far out", [](SparseList& s) { s.idx.back() = 0xffffffffu; });
  variant("NaN value", [](SparseList& s) { s.val[0] = NAN; });
  variant("Inf value", [](SparseList& s) { s.val.back() = -INFINITY; });
  variant("count above the entries", [](SparseList&) {}, static_cast<long>(ok.idx.size()) + 1);
  variant("count below the entries", [](SparseList&) {}, static_cast<long>(ok.idx.size()) - 1);
  variant("count huge", [](SparseList&) {}, 0x7fffffffL);
  variant("more entries than allowed", [&](SparseList& s) {
    s.idx.resize(n + 1);
    s.val.assign(n + 1, 1.0f);
    for (std::size_t i = 0; i <= n; ++i) s.idx[i] = static_cast<std::uint32_t>(i);
  });
  for (const auto& [what, e] : bad) {
    std::vector<float> y(n, 3.0f);
    EXPECT_THROW(c.decode(e.span(), y), DecodeError) << what;
    EXPECT_THROW(c.decode(e.span(), y, DecodeMode::kAccumulate), DecodeError) << what;
  }
  // The unmodified rebuild still decodes: the surgery itself is sound.
  std::vector<float> y(n);
  EXPECT_NO_THROW(c.decode(build_sparse(valid, ok).span(), y));
}

// Decodes overwrite the destination everywhere and accumulate adds only the entries.
inline void expect_sparse_decode(const Codec& c, const Encoded& e, std::size_t n) {
  const SparseList s = parse_sparse(e);
  std::vector<float> y(n, 5.0f), acc(n, 5.0f);
  c.decode(e.span(), y);
  c.decode(e.span(), acc, DecodeMode::kAccumulate);
  std::size_t t = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const bool hit = t < s.idx.size() && s.idx[t] == i;
    ASSERT_EQ(y[i], hit ? s.val[t] : 0.0f) << i;
    ASSERT_EQ(acc[i], hit ? 5.0f + s.val[t] : 5.0f) << i;
    t += hit;
  }
  EXPECT_EQ(t, s.idx.size());
}

}  // namespace terse::testing
