// Helpers shared by the codec tests.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "terse/codec.h"

namespace terse::testing {

// Normal values with scale `sigma` and a few outliers 50x larger, like a gradient.
inline std::vector<float> gradient(std::size_t n, std::uint64_t seed = 1, float sigma = 1e-2f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> x(n);
  for (auto& v : x) v = normal(gen);
  for (std::size_t i = 0; i < n; i += 97) x[i] *= 50.0f;
  return x;
}

// Encodes with a fresh state if the codec needs one (or the given context's state).
struct Encoded {
  std::vector<std::byte> bytes;
  std::span<const std::byte> span() const { return bytes; }
};

inline Encoded encode(const Codec& codec, std::span<const float> x, EncodeContext& ctx) {
  Encoded e;
  e.bytes.resize(codec.max_encoded_bytes(x.size()));
  e.bytes.resize(codec.encode(x, e.bytes, ctx));
  return e;
}

// The context encode() gives a codec at `step` (without state).
inline EncodeContext context(std::uint64_t step = 0) {
  EncodeContext ctx;
  ctx.seed = 1234;
  ctx.step = step;
  ctx.tensor = 99;
  return ctx;
}

// The random key a stochastic codec draws from under encode() at `step`, for references.
inline std::uint64_t rank_key(std::uint64_t step = 0) { return context(step).rank_key(); }

inline Encoded encode(const Codec& codec, std::span<const float> x, std::uint64_t step = 0) {
  auto state = codec.make_state(x.size());
  EncodeContext ctx = context(step);
  ctx.state = state.get();
  return encode(codec, x, ctx);
}

inline std::vector<float> decode(const Codec& codec, std::span<const std::byte> bytes,
                                 std::size_t n) {
  std::vector<float> y(n, -7.0f);
  codec.decode(bytes, y);
  return y;
}

inline std::vector<float> round_trip(const Codec& codec, std::span<const float> x,
                                     std::uint64_t step = 0) {
  return decode(codec, encode(codec, x, step).span(), x.size());
}

// The bytes after the 24-byte header.
inline std::vector<std::uint8_t> payload(const Encoded& e) {
  std::vector<std::uint8_t> p(e.bytes.size() - 24);
  std::memcpy(p.data(), e.bytes.data() + 24, p.size());
  return p;
}

// Hex of the bytes after the 24-byte header, for known-vector tests.
inline std::string payload_hex(const Encoded& e) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::size_t i = 24; i < e.bytes.size(); ++i) {
    auto b = static_cast<unsigned>(e.bytes[i]);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

}  // namespace terse::testing
