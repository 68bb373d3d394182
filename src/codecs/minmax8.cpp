// Min-max linear quantization per chunk (ByteGrad-style b-bit quantization, as in BytePS and
// "ZipML"/"8-bit approximations" lines of work): codes = round((x - min) / step), b bits each.
// Wire format: header, ceil(n/chunk) pairs of fp32 (min, max), then ceil(n*bits/8) bytes of
// b-bit codes packed LSB-first (element i at bit i*bits of the stream; padding bits 0).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/pack.h"
#include "terse/codec.h"

namespace terse {
namespace {

struct MinMaxParams {
  unsigned bits = 8;
  std::size_t chunk = 4096;
};

MinMaxParams read_params(SpecReader& r) {
  MinMaxParams p;
  p.bits = static_cast<unsigned>(r.integer("bits", 8, 1, 8));
  auto chunk = r.integer("chunk", 4096, 8, std::int64_t{1} << 30);
  if (chunk % 8 != 0) {
    throw SpecError(
        fmt::format("terse: codec 'minmax8': chunk={} must be a multiple of 8", chunk));
  }
  p.chunk = static_cast<std::size_t>(chunk);
  return p;
}

// Codes of sub-blocks go through a stack buffer (sized to stay in L1) when bits < 8.
constexpr std::size_t kBlock = 4096;

class MinMaxCodec final : public Codec {
 public:
  explicit MinMaxCodec(SpecReader& r) : MinMaxCodec(read_params(r), r) {}

  CodecTraits traits() const override { return {}; }  // deterministic rounding: biased

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override {
    return 8 * chunks(n) + kit::packed_bytes(n, p_.bits);
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext&) const override {
    for (std::size_t c = 0; c < chunks(x.size()); ++c) {
      const std::size_t start = c * p_.chunk;
      if (!encode_chunk(x.subspan(start, std::min(p_.chunk, x.size() - start)), c, x.size(), out)) {
        kit::throw_non_finite(x, spec());
      }
    }
    return max_payload_bytes(x.size());
  }

  bool reads_directly(DType) const override { return true; }

  // Each chunk is widened into a chunk of scratch (in cache at the default chunk size) and
  // encoded from there: the same bytes as the fp32 path, without an fp32 copy of the input.
  std::size_t encode_half_payload(std::span<const std::uint16_t> x, DType dtype,
                                  std::span<std::byte> out, EncodeContext& ctx) const override {
    const std::size_t n = x.size();
    std::span<float> wide =
        ctx.scratch().get<float>(Workspace::kInputSlot, std::min(p_.chunk, n));
    for (std::size_t c = 0; c < chunks(n); ++c) {
      const std::size_t start = c * p_.chunk;
      std::span<float> xs = wide.first(std::min(p_.chunk, n - start));
      if (!kit::widen(dtype, x.data() + start, xs, false) || !encode_chunk(xs, c, n, out)) {
        return Codec::encode_half_payload(x, dtype, out, ctx);  // throws, naming the index
      }
    }
    return max_payload_bytes(n);
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    const std::size_t n = y.size(), nc = chunks(n);
    expect_payload_bytes(in, n, max_payload_bytes(n));
    const auto* codes = reinterpret_cast<const std::uint8_t*>(in.data() + 8 * nc);
    const std::size_t total_bits = n * p_.bits;
    if (total_bits % 8 != 0 && (codes[total_bits / 8] >> (total_bits % 8)) != 0) {
      throw DecodeError(fmt::format("terse: {}: nonzero padding bits", spec()));
    }
    for (std::size_t c = 0; c < nc; ++c) {  // validate every range before writing anything
      float lo, hi;
      std::memcpy(&lo, in.data() + 8 * c, 4);
      std::memcpy(&hi, in.data() + 8 * c + 4, 4);
      if (!std::isfinite(lo) || !std::isfinite(hi) || !(lo <= hi)) {
        throw DecodeError(
            fmt::format("terse: {}: chunk {} has invalid range [{}, {}]", spec(), c, lo, hi));
      }
    }
    const unsigned levels = (1u << p_.bits) - 1;
    const bool acc = mode == DecodeMode::kAccumulate;
    for (std::size_t c = 0; c < nc; ++c) {
      float lo, hi;
      std::memcpy(&lo, in.data() + 8 * c, 4);
      std::memcpy(&hi, in.data() + 8 * c + 4, 4);
      const std::size_t start = c * p_.chunk;
      auto ys = y.subspan(start, std::min(p_.chunk, n - start));
      if (p_.bits == 8) {
        kit::dequantize_range(codes + start, lo, hi, levels, ys, acc);
        continue;
      }
      alignas(64) std::uint8_t buf[kBlock];
      for (std::size_t b = 0; b < ys.size(); b += kBlock) {
        auto yb = ys.subspan(b, std::min(kBlock, ys.size() - b));
        kit::unpack_bits(codes + (start + b) / 8 * p_.bits, yb.size(), p_.bits, buf);
        kit::dequantize_range(buf, lo, hi, levels, yb, acc);
      }
    }
  }

 private:
  // Chunk c (values xs) of a tensor of n elements into its range and codes; false if xs holds
  // NaN or Inf.
  bool encode_chunk(std::span<const float> xs, std::size_t c, std::size_t n,
                    std::span<std::byte> out) const {
    auto* ranges = out.data();
    auto* codes = reinterpret_cast<std::uint8_t*>(out.data() + 8 * chunks(n));
    const unsigned levels = (1u << p_.bits) - 1;
    const std::size_t start = c * p_.chunk;
    float lo, hi;
    if (!kit::min_max_finite(xs, &lo, &hi)) return false;
    std::memcpy(ranges + 8 * c, &lo, 4);
    std::memcpy(ranges + 8 * c + 4, &hi, 4);
    if (p_.bits == 8) {
      kit::quantize_range(xs, lo, hi, levels, codes + start);
      return true;
    }
    alignas(64) std::uint8_t buf[kBlock];
    for (std::size_t b = 0; b < xs.size(); b += kBlock) {
      auto xb = xs.subspan(b, std::min(kBlock, xs.size() - b));
      kit::quantize_range(xb, lo, hi, levels, buf);
      kit::pack_bits(buf, xb.size(), p_.bits, codes + (start + b) / 8 * p_.bits);
    }
    return true;
  }

  MinMaxCodec(MinMaxParams p, SpecReader& r) : Codec(r), p_(p) {}

  std::size_t chunks(std::size_t n) const { return (n + p_.chunk - 1) / p_.chunk; }

  MinMaxParams p_;
};

const bool registered = register_codec(
    {"minmax8", 7, "per-chunk min-max linear quantization to b bits (default 8), round to nearest",
     [](SpecReader& r) { return std::make_unique<MinMaxCodec>(r); }});

}  // namespace
}  // namespace terse
