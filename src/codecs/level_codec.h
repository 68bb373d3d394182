// A codec that is kit::quantize_levels over buckets (QSGD, TernGrad): its wire format, after
// the header, is one fp32 norm per bucket, then the codes packed by kit::quantize_levels'
// layout. A codec built on it states its quantizer (norm, levels, code width, bucket; bucket 0:
// the whole tensor) and its traits, and names what a corrupt payload breaks.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "kit/basic.h"
#include "kit/random.h"
#include "terse/codec.h"
#include "terse/error.h"

namespace terse::codecs {

class LevelCodec : public Codec {
 protected:
  // `invalid`: what dequantize_levels rejected, for the DecodeError (e.g. "a scale is negative
  // or not finite, or a code is 3").
  LevelCodec(const SpecReader& r, kit::LevelQuantizer q, std::string invalid)
      : Codec(r), q_(q), invalid_(std::move(invalid)) {}

  const kit::LevelQuantizer& settings() const { return q_; }

  std::size_t max_payload_bytes(std::size_t n) const override {
    return buckets(n) * sizeof(float) + kit::packed_bucket_bytes(n, bucket(n), q_.width);
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    const std::size_t n = x.size();
    auto* codes = reinterpret_cast<std::uint8_t*>(out.data() + buckets(n) * sizeof(float));
    if (!kit::quantize_levels(quantizer(n), x, ctx.rank_key(), 0, out.data(), codes)) {
      kit::throw_non_finite(x, spec());
    }
    return max_payload_bytes(n);
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    const std::size_t n = y.size();
    expect_payload_bytes(in, n, max_payload_bytes(n));
    const auto* codes =
        reinterpret_cast<const std::uint8_t*>(in.data() + buckets(n) * sizeof(float));
    if (!kit::dequantize_levels(quantizer(n), codes, in.data(), y,
                                mode == DecodeMode::kAccumulate)) {
      throw DecodeError(fmt::format("terse: {}: invalid payload ({})", spec(), invalid_));
    }
  }

 private:
  // The quantizer for a tensor of n elements: bucket 0 stands for the whole tensor.
  kit::LevelQuantizer quantizer(std::size_t n) const {
    kit::LevelQuantizer q = q_;
    q.bucket = bucket(n);
    return q;
  }
  std::size_t bucket(std::size_t n) const { return q_.bucket == 0 ? (n == 0 ? 1 : n) : q_.bucket; }
  std::size_t buckets(std::size_t n) const { return (n + bucket(n) - 1) / bucket(n); }

  kit::LevelQuantizer q_;
  std::string invalid_;
};

}  // namespace terse::codecs
