// 3LC (Lim, Andersen and Kaminsky, "3LC: Lightweight and Effective Traffic Compression for
// Distributed Machine Learning", SysML 2019): 3-value quantization with sparsity multiplication,
// base-3^5 packing (five values per byte) and zero-run encoding of the packed bytes.
// Wire format: header, fp32 M, then the zero-run coded stream (kit::ZeroRunEncoder, zero byte
// 121, codes 243..255 = runs of 2..14) of ceil(n/5) bytes from kit::ternary_pack243.
#include <fmt/format.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/pack.h"
#include "terse/codec.h"

namespace terse {
namespace {

constexpr std::uint8_t kZero = kit::kTernaryZeroByte;  // five zeros
constexpr std::uint8_t kFirstRunCode = 243;
// Elements per block: 16 ternary groups, 1024 packed bytes. Blocks whose max |x| is below the
// rounding threshold are all zeros and skip packing; blocks decoded as all zeros skip unpacking.
constexpr std::size_t kBlock = 16 * kit::kTernaryGroup;

double read_sparsity(SpecReader& r) {
  return r.number("sparsity", 1.0, 1.0, 2.0, SpecReader::Ends::kRightOpen);
}

class ThreeLcCodec final : public Codec {
 public:
  explicit ThreeLcCodec(SpecReader& r) : ThreeLcCodec(read_sparsity(r), r) {}

  CodecTraits traits() const override { return {}; }  // biased; use with ef=1

 protected:
  std::size_t max_payload_bytes(std::size_t n) const override { return 4 + (n + 4) / 5; }

  std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                             EncodeContext& ctx) const override {
    const std::size_t n = x.size(), nb = (n + kBlock - 1) / kBlock;
    // Pass 1: max |x| per block (and the finite check).
    std::span<float> block_max = ctx.scratch().get<float>(0, nb);
    float amax = 0;
    for (std::size_t b = 0; b < nb; ++b) {
      auto xs = x.subspan(b * kBlock, std::min(kBlock, n - b * kBlock));
      if (!kit::abs_max_finite(xs, &block_max[b])) kit::throw_non_finite(x, spec());
      amax = std::max(amax, block_max[b]);
    }
    const float m = static_cast<float>(std::min<double>(amax * sparsity_, FLT_MAX));
    // round(x / M) is +-1 iff |x| >= M / 2 (ties away from zero).
    const float h = m == 0 ? std::numeric_limits<float>::infinity()
                           : std::max(m * 0.5f, std::numeric_limits<float>::denorm_min());
    std::memcpy(out.data(), &m, 4);
    // Pass 2: pack the blocks holding nonzero values, zero-run code everything.
    kit::ZeroRunEncoder enc(kZero, kFirstRunCode, reinterpret_cast<std::uint8_t*>(out.data() + 4));
    alignas(64) std::uint8_t buf[kBlock / 5];
    for (std::size_t b = 0; b < nb; ++b) {
      auto xs = x.subspan(b * kBlock, std::min(kBlock, n - b * kBlock));
      const std::size_t bytes = (xs.size() + 4) / 5;
      if (block_max[b] < h) {
        enc.add_zeros(bytes);
      } else {
        kit::ternary_pack243(xs, h, buf);
        enc.add(buf, bytes);
      }
    }
    return 4 + enc.finish();
  }

  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const override {
    wire::Reader r(in, "threelc payload");
    const float m = r.get<float>();
    if (!std::isfinite(m) || std::signbit(m)) {
      throw DecodeError(fmt::format("terse: {}: invalid scale M = {}", spec(), m));
    }
    auto rest = r.take(r.remaining());
    kit::ZeroRunDecoder dec(
        kZero, kFirstRunCode,
        {reinterpret_cast<const std::uint8_t*>(rest.data()), rest.size()});
    const std::size_t n = y.size();
    const bool acc = mode == DecodeMode::kAccumulate;
    alignas(64) std::uint8_t buf[kBlock / 5];
    for (std::size_t start = 0; start < n; start += kBlock) {
      auto ys = y.subspan(start, std::min(kBlock, n - start));
      const std::size_t bytes = (ys.size() + 4) / 5;
      bool all_zero = false;
      if (!dec.next(buf, bytes, &all_zero, true)) {
        throw DecodeError(fmt::format("terse: {}: zero-run stream ends before element {} of {}",
                                      spec(), start, n));
      }
      if (all_zero) {
        if (!acc) std::fill(ys.begin(), ys.end(), 0.0f);
      } else if (!kit::ternary_unpack243(buf, m, ys, acc)) {
        throw DecodeError(fmt::format("terse: {}: invalid packed byte or padding near element {}",
                                      spec(), start));
      }
    }
    if (!dec.finished()) {
      throw DecodeError(fmt::format("terse: {}: zero-run stream longer than {} elements",
                                    spec(), n));
    }
  }

 private:
  ThreeLcCodec(double s, SpecReader& r) : Codec(r), sparsity_(s) {}
  double sparsity_;
};

const bool registered = register_codec(
    {"threelc", 12, "3LC: ternary values x max|x|*s, 5 per byte, zero-run coded",
     [](SpecReader& r) { return std::make_unique<ThreeLcCodec>(r); }});

}  // namespace
}  // namespace terse
