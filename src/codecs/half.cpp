// fp16 and bf16: casts to 16-bit floats with round-to-nearest-even (Micikevicius et al., "Mixed
// Precision Training", 2018; bfloat16 as in Kalamkar et al., 2019).
// Wire format: header, then n little-endian 16-bit values (IEEE binary16 or bfloat16).
// Finite inputs beyond the format's range saturate to its largest finite value.
#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "terse/codec.h"

namespace terse {
namespace {

struct Fp16Format {
  static constexpr DType kDType = DType::kFloat16;
  static bool to(std::span<const float> x, std::uint16_t* out) { return kit::to_fp16(x, out); }
  static bool from(const std::uint16_t* in, std::span<float> y, bool acc) {
    return kit::from_fp16(in, y, acc);
  }
};

struct Bf16Format {
  static constexpr DType kDType = DType::kBFloat16;
  static bool to(std::span<const float> x, std::uint16_t* out) { return kit::to_bf16(x, out); }
  static bool from(const std::uint16_t* in, std::span<float> y, bool acc) {
    return kit::from_bf16(in, y, acc);
  }
};

// Copies 16-bit values of `dtype`; false if any is NaN or Inf (all exponent bits set).
bool copy_finite(std::span<const std::uint16_t> x, DType dtype, std::uint16_t* out) {
  const std::uint16_t exponent = dtype == DType::kFloat16 ? 0x7c00 : 0x7f80;
  unsigned bad = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    out[i] = x[i];
    bad |= static_cast<unsigned>((x[i] & exponent) == exponent);
  }
  return bad == 0;
}

template <class Format>
class HalfCodec final : public Codec {
 public:
  explicit HalfCodec(const SpecReader& r) : Codec(r) {}

  CodecTraits traits() const override {
    CodecTraits t;
    t.summable = true;
    return t;
  }

  bool reads_directly(DType) const override { return true; }

  // Sums two encodings in fp32 and rounds once, block by block, so the result equals
  // encode(decode(acc) + decode(in)).
  void combine(std::span<const std::byte> in, std::span<std::byte> acc) const override {
    std::size_t n = peek(acc).elements;
    auto src = checked_payload(in, n);
    auto dst = checked_payload(acc, n);
    check_size(src.size(), n);
    check_size(dst.size(), n);
    const auto* a = reinterpret_cast<const std::uint16_t*>(src.data());
    auto* b = reinterpret_cast<std::uint16_t*>(const_cast<std::byte*>(dst.data()));
    std::array<float, 2048> buf;
    for (std::size_t i = 0; i < n; i += buf.size()) {
      std::size_t m = std::min(buf.size(), n - i);
      std::span<float> block(buf.data(), m);
      if (!Format::from(b + i, block, false) || !Format::from(a + i, block, true)) {
        throw_non_finite_payload();
      }
      Format::to(block, b + i);  // finite sums saturate; cannot fail
    }
  }

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override { return n * 2; }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext&) const override {
    if (!Format::to(x, reinterpret_cast<std::uint16_t*>(out.data()))) {
      kit::throw_non_finite(x, spec());
    }
    return x.size() * 2;
  }

  // Input in this format is copied; the other 16-bit format is widened a block at a time (exact)
  // and rounded, which is what encoding its fp32 widening does.
  std::size_t encode_half_payload(std::span<const std::uint16_t> x, DType dtype,
                                  std::span<std::byte> out, EncodeContext& ctx) const override {
    auto* dst = reinterpret_cast<std::uint16_t*>(out.data());
    bool finite = true;
    if (dtype == Format::kDType) {
      finite = copy_finite(x, dtype, dst);
    } else {
      std::array<float, 2048> buf;
      for (std::size_t i = 0; i < x.size() && finite; i += buf.size()) {
        std::span<float> block(buf.data(), std::min(buf.size(), x.size() - i));
        finite = kit::widen(dtype, x.data() + i, block, false) && Format::to(block, dst + i);
      }
    }
    if (!finite) return Codec::encode_half_payload(x, dtype, out, ctx);  // throws, naming the index
    return x.size() * 2;
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    check_size(in.size(), y.size());
    if (!Format::from(reinterpret_cast<const std::uint16_t*>(in.data()), y,
                      mode == DecodeMode::kAccumulate)) {
      throw_non_finite_payload();
    }
  }

 private:
  [[noreturn]] void throw_non_finite_payload() const {
    throw DecodeError(fmt::format("terse: {}: payload holds NaN or Inf, which the encoder never "
                                  "produces", spec()));
  }
  void check_size(std::size_t bytes, std::size_t n) const {
    if (bytes != n * 2) {
      throw DecodeError(
          fmt::format("terse: {}: payload of {} bytes for {} elements", spec(), bytes, n));
    }
  }
};

const bool registered_fp16 = register_codec(
    {"fp16", 1, "IEEE half precision, round to nearest even (2 bytes/element)",
     [](SpecReader& r) { return std::make_unique<HalfCodec<Fp16Format>>(r); }});
const bool registered_bf16 = register_codec(
    {"bf16", 2, "bfloat16, round to nearest even (2 bytes/element)",
     [](SpecReader& r) { return std::make_unique<HalfCodec<Bf16Format>>(r); }});

}  // namespace
}  // namespace terse
