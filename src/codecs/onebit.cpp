// 1-bit SGD (Seide et al., "1-Bit Stochastic Gradient Descent ...", Interspeech 2014) and
// EF-signSGD (Bernstein et al., "signSGD", ICML 2018; Karimireddy et al., ICML 2019).
// Wire format: header, ceil(n/chunk) fp32 scales (one per chunk), then ceil(n/8) bytes of
// sign bits (bit i%8 of byte i/8 set iff x_i < 0; padding bits 0).
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/pack.h"
#include "terse/codec.h"

namespace terse {
namespace {

struct OneBitParams {
  std::size_t chunk = 1024;  // elements per scale; 0: one scale for the whole tensor
  bool use_max = false;      // scale = max |x| of the chunk instead of mean |x|
};

OneBitParams read_params(SpecReader& r) {
  OneBitParams p;
  auto chunk = r.integer("chunk", 1024, 0, std::int64_t{1} << 30);
  if (chunk % 8 != 0) {
    throw SpecError(fmt::format("terse: codec 'onebit': chunk={} must be 0 (whole tensor) or a "
                                "multiple of 8",
                                chunk));
  }
  p.chunk = static_cast<std::size_t>(chunk);
  p.use_max = r.choice("scale", "mean", {"mean", "max"}) == "max";
  return p;
}

class OneBitCodec final : public Codec {
 public:
  explicit OneBitCodec(SpecReader& r) : OneBitCodec(read_params(r), r) {}

  CodecTraits traits() const override { return {}; }  // biased, not summable, stateless

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override {
    return 4 * chunks(n) + (n + 7) / 8;
  }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext&) const override {
    const std::size_t n = x.size(), len = chunk_len(n);
    for (std::size_t c = 0; c < chunks(n); ++c) {
      const std::size_t start = c * len;
      if (!encode_chunk(x.subspan(start, std::min(len, n - start)), c, n, out)) {
        kit::throw_non_finite(x, spec());
      }
    }
    return max_payload_bytes(n);
  }

  // Per-chunk scales: each chunk is widened into a chunk of scratch (in cache at the default
  // chunk size) and encoded from there. One scale for the whole tensor (chunk=0) needs the
  // whole tensor widened, which the default does.
  bool reads_directly(DType) const override { return p_.chunk != 0; }

  std::size_t encode_half_payload(std::span<const std::uint16_t> x, DType dtype,
                                  std::span<std::byte> out, EncodeContext& ctx) const override {
    const std::size_t n = x.size(), len = chunk_len(n);
    if (p_.chunk == 0) return Codec::encode_half_payload(x, dtype, out, ctx);
    std::span<float> wide = ctx.scratch().get<float>(Workspace::kInputSlot, std::min(len, n));
    for (std::size_t c = 0; c < chunks(n); ++c) {
      const std::size_t start = c * len;
      std::span<float> xs = wide.first(std::min(len, n - start));
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
    const auto* bits = reinterpret_cast<const std::uint8_t*>(in.data() + 4 * nc);
    if (n % 8 != 0 && (bits[n / 8] >> (n % 8)) != 0) {
      throw DecodeError(fmt::format("terse: {}: nonzero padding bits", spec()));
    }
    const std::size_t len = chunk_len(n);
    for (std::size_t c = 0; c < nc; ++c) {  // validate every scale before writing anything
      float scale;
      std::memcpy(&scale, in.data() + 4 * c, 4);
      if (!std::isfinite(scale) || std::signbit(scale)) {
        throw DecodeError(fmt::format("terse: {}: chunk {} has invalid scale {}", spec(), c, scale));
      }
    }
    for (std::size_t c = 0; c < nc; ++c) {
      float scale;
      std::memcpy(&scale, in.data() + 4 * c, 4);
      const std::size_t start = c * len;
      kit::sign_unpack(bits + start / 8, scale, y.subspan(start, std::min(len, n - start)),
                       mode == DecodeMode::kAccumulate);
    }
  }

 private:
  // Chunk c (values xs) of a tensor of n elements into its scale and sign bits; false if xs
  // holds NaN or Inf.
  bool encode_chunk(std::span<const float> xs, std::size_t c, std::size_t n,
                    std::span<std::byte> out) const {
    auto* bits = reinterpret_cast<std::uint8_t*>(out.data() + 4 * chunks(n));
    kit::SignStats st;
    if (!kit::sign_pack(xs, bits + c * chunk_len(n) / 8, &st)) return false;
    // mean |x| minimises the L2 error of +-scale given the signs; a zero chunk gets scale 0.
    float scale = p_.use_max ? st.abs_max
                             : static_cast<float>(st.abs_sum / static_cast<double>(xs.size()));
    std::memcpy(out.data() + 4 * c, &scale, 4);
    return true;
  }

  OneBitCodec(OneBitParams p, SpecReader& r) : Codec(r), p_(p) {}

  std::size_t chunk_len(std::size_t n) const { return p_.chunk == 0 ? n : p_.chunk; }
  std::size_t chunks(std::size_t n) const {
    if (n == 0) return 0;
    return p_.chunk == 0 ? 1 : (n + p_.chunk - 1) / p_.chunk;
  }

  OneBitParams p_;
};

const bool registered = register_codec(
    {"onebit", 3, "sign bits with a per-chunk scale, mean or max |x| (1 bit/element)",
     [](SpecReader& r) { return std::make_unique<OneBitCodec>(r); }});

}  // namespace
}  // namespace terse
