// Helpers for tests of codecs, in terse's tree or outside it: gradient-like inputs, and encode
// and decode with the state and context a codec needs. Needs only the C++ standard library and
// the public API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "terse/codec.h"
#include "terse/testing/gradient.h"

namespace terse::testing {

// Normal values with scale `sigma` and every 97th element 50x larger, like a gradient
// (terse/testing/gradient.h).
inline std::vector<float> gradient(std::size_t n, std::uint64_t seed = 1, float sigma = 1e-2f) {
  GradientShape shape;
  shape.sigma = sigma;
  shape.outlier_every = 97;
  return synthetic_gradient(n, seed, shape);
}

// An encoding: header and payload.
struct Encoded {
  std::vector<std::byte> bytes;
  std::span<const std::byte> span() const { return bytes; }
};

// Encodes x with the given context (and its state, if the codec is stateful).
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

// Encodes x at `step` with a fresh state if the codec needs one.
inline Encoded encode(const Codec& codec, std::span<const float> x, std::uint64_t step = 0) {
  auto state = codec.make_state(x.size());
  EncodeContext ctx = context(step);
  ctx.state = state.get();
  return encode(codec, x, ctx);
}

// Decodes n elements (into a vector first filled with -7, so unwritten elements show).
inline std::vector<float> decode(const Codec& codec, std::span<const std::byte> bytes,
                                 std::size_t n) {
  std::vector<float> y(n, -7.0f);
  codec.decode(bytes, y);
  return y;
}

}  // namespace terse::testing
