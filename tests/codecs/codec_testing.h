// Helpers shared by the codec tests, besides the public ones (terse/testing/codec_testing.h).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "terse/codec.h"
#include "terse/testing/codec_testing.h"

namespace terse::testing {

// The random key a stochastic codec draws from under encode() at `step`, for references.
inline std::uint64_t rank_key(std::uint64_t step = 0) { return context(step).rank_key(); }

inline std::vector<float> round_trip(const Codec& codec, std::span<const float> x,
                                     std::uint64_t step = 0) {
  return decode(codec, encode(codec, x, step).span(), x.size());
}

// The bytes after the header.
inline std::vector<std::uint8_t> payload(const Encoded& e) {
  std::vector<std::uint8_t> p(e.bytes.size() - Codec::kHeaderBytes);
  std::memcpy(p.data(), e.bytes.data() + Codec::kHeaderBytes, p.size());
  return p;
}

// Hex of the bytes after the header, for known-vector tests.
inline std::string payload_hex(const Encoded& e) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::size_t i = Codec::kHeaderBytes; i < e.bytes.size(); ++i) {
    auto b = static_cast<unsigned>(e.bytes[i]);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

}  // namespace terse::testing
