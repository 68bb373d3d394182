// What a codec needs besides codec.h, for codecs written in terse's tree or outside it against an
// installed terse (docs/writing-a-codec.md walks through one). A codec is a Codec subclass made
// from a SpecReader, registered by a static registrar:
//
//   const bool registered = terse::register_codec(
//       {"mycodec", 200, "one line for `terse codecs`",
//        [](terse::SpecReader& r) { return std::make_unique<MyCodec>(r); }});
//
// Its payload follows the Codec::kHeaderBytes-byte header; its encoder rejects NaN and Inf
// (find_non_finite, throw_non_finite) and its decoder validates every byte (wire::Reader, and a
// DecodeError for anything its encoder cannot produce).
//
// The primitives below are the vectorized kit the in-tree codecs use (Highway, dispatched at run
// time to the machine's best instruction set); each gives the same bits on every instruction
// set. Bit streams are little-endian and LSB-first: element i of a 1-bit stream is bit i % 8 of
// byte i / 8. Functions returning bool return false when their float input held NaN or Inf (the
// check is fused into their pass); their outputs are then unspecified. None keeps state: all
// are safe to call from many threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "terse/codec.h"
#include "terse/dtype.h"
#include "terse/error.h"
#include "terse/export.h"
#include "terse/spec.h"

namespace terse {

// ---- Payload bytes ----------------------------------------------------------------------

namespace wire {

// Sequential writer into a span; writing past its end is a programming error and throws
// InvalidArgument.
class Writer {
 public:
  explicit Writer(std::span<std::byte> out) : out_(out) {}
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    std::memcpy(out_.data() + pos_, &v, sizeof(T));
    pos_ += sizeof(T);
  }
  // Reserves n bytes for the caller to fill in place.
  std::span<std::byte> take(std::size_t n) {
    need(n);
    auto s = out_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::size_t size() const { return pos_; }

 private:
  void need(std::size_t n) const {
    if (n > out_.size() - pos_) overflow(n);
  }
  [[noreturn]] TERSE_API void overflow(std::size_t n) const;
  std::span<std::byte> out_;
  std::size_t pos_ = 0;
};

// Sequential reader over an untrusted payload; reading past its end throws DecodeError naming
// `what` (e.g. the codec's spec).
class Reader {
 public:
  Reader(std::span<const std::byte> in, const char* what) : in_(in), what_(what) {}
  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::span<const std::byte> take(std::size_t n) {
    need(n);
    auto s = in_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::size_t remaining() const { return in_.size() - pos_; }
  // Throws DecodeError unless every byte was consumed.
  TERSE_API void expect_end() const;

 private:
  TERSE_API void need(std::size_t n) const;
  std::span<const std::byte> in_;
  const char* what_;
  std::size_t pos_ = 0;
};

}  // namespace wire

// ---- Kit primitives ---------------------------------------------------------------------

namespace codec_kit {

// Index of the first NaN or +-Inf in x, or x.size() if every element is finite.
TERSE_API std::size_t find_non_finite(std::span<const float> x);
// Throws the encoder's InvalidArgument for an input holding NaN or Inf, naming `what` (the
// codec's spec) and the first offending index. Call it after a fused check returned false.
[[noreturn]] TERSE_API void throw_non_finite(std::span<const float> x, std::string_view what);

// *m = max |x_i| (0 for an empty span).
TERSE_API bool abs_max_finite(std::span<const float> x, float* m);
// (*lo, *hi) = (min, max) of x ((0, 0) for an empty span).
TERSE_API bool min_max_finite(std::span<const float> x, float* lo, float* hi);
// Decoders' last step: y = x (accumulate false) or y += x; false if x held NaN or Inf.
TERSE_API bool store_or_add(const float* x, std::span<float> y, bool accumulate);

// 16-bit floats (dtype kFloat16 or kBFloat16) and fp32. widen() writes every value exactly, NaN
// and Inf included (y = in, or y += in), and returns false if one was not finite; narrow()
// rounds to nearest even, saturating finite values beyond the format's range.
TERSE_API bool widen(DType dtype, const std::uint16_t* in, std::span<float> y, bool accumulate);
TERSE_API bool narrow(DType dtype, std::span<const float> x, std::uint16_t* out);

// Bit i of `bits` is 1 iff x_i < 0 (+0, -0 and positives give 0); writes ceil(n/8) bytes, the
// last byte's padding bits 0. *abs_sum, if given, receives sum |x_i| (accumulated in double).
TERSE_API bool sign_pack(std::span<const float> x, std::uint8_t* bits, double* abs_sum = nullptr);
// y_i = bit i ? -scale : +scale (or y_i += that).
TERSE_API void sign_unpack(const std::uint8_t* bits, float scale, std::span<float> y,
                           bool accumulate);

// Scaled quantization to `levels` + 1 codes (levels in [1, 255]) of values x_i in [lo, hi]
// (lo <= hi, both finite): code_i = round_half_even((x_i - lo) / step), step = (hi - lo) /
// levels; exact for a range wider than the float range. Error at most step / 2 per element.
TERSE_API void quantize_range(std::span<const float> x, float lo, float hi, unsigned levels,
                              std::uint8_t* codes);
// y_i = lo + code_i * step clamped to [lo, hi] (or y_i += that); codes above `levels` clamp
// too, so a decoder that must reject them checks first.
TERSE_API void dequantize_range(const std::uint8_t* codes, float lo, float hi, unsigned levels,
                                std::span<float> y, bool accumulate);
// Packs n codes of `bits` bits (1..8; each code < 2^bits) into packed_bytes(n, bits) bytes.
TERSE_API void pack_bits(const std::uint8_t* codes, std::size_t n, unsigned bits,
                         std::uint8_t* out);
// The inverse: reads packed_bytes(n, bits) bytes, writes n codes.
TERSE_API void unpack_bits(const std::uint8_t* in, std::size_t n, unsigned bits,
                           std::uint8_t* codes);
constexpr std::size_t packed_bytes(std::size_t n, unsigned bits) { return (n * bits + 7) / 8; }

// The idx.size() = k (<= n) elements of largest |x|, ties broken towards the lower index, in
// increasing index order: indices to idx, values to val (k entries each). Exact for every
// input. Scratch comes from workspace slots [first_slot, first_slot + 3).
TERSE_API bool top_k(std::span<const float> x, std::span<std::uint32_t> idx, std::span<float> val,
                     Workspace& workspace, std::size_t first_slot = 0);

// Counter-based random numbers: a pure function of (key, index), so every value can be
// recomputed anywhere, in any order. Keys come from EncodeContext::shared_key() (the same on
// every rank) or rank_key() (this rank's own stream).
TERSE_API std::uint32_t random_bits(std::uint64_t key, std::uint64_t index);
// out_i = uniform in [0, 1) for index first_index + i, 24 random bits: (random_bits >> 8) * 2^-24.
TERSE_API void uniform(std::uint64_t key, std::uint64_t first_index, std::span<float> out);

}  // namespace codec_kit

// ---- The sparse list payload ------------------------------------------------------------
//
//   u32 count | count x u32 index (strictly increasing, < n) | count x fp32 value (finite)
//
// all little-endian, after the header; topk, threshold and dgc send it. Indices are 32-bit, so
// these codecs take tensors of fewer than 2^32 elements (the engine partitions larger ones).

namespace sparse {

// Largest tensor a 32-bit index addresses.
inline constexpr std::size_t kMaxElements = 0xffffffffu;

// Elements kept at density `ratio` of n: round(ratio * n), at least 1 when n > 0, at most n.
TERSE_API std::size_t count_for(double ratio, std::size_t n);
// Reads a density in (0, 1] (SpecError for 0 or anything outside).
TERSE_API double read_ratio(SpecReader& r, std::string_view key, double def);
// Throws InvalidArgument if n is beyond 32-bit indices.
TERSE_API void check_encodable(std::size_t n, const std::string& spec);

constexpr std::size_t payload_bytes(std::size_t count) { return 4 + 8 * count; }
// Writes the payload of `count` entries into out; returns its size.
TERSE_API std::size_t write(std::span<std::byte> out, const std::uint32_t* idx, const float* val,
                            std::size_t count);

// What a codec's encoder can produce, which its decoder enforces.
struct Rules {
  std::size_t max_count = 0;
  bool exact_count = false;   // the count must equal max_count
  std::uint32_t min_key = 0;  // every |value| has the fp32 bits (sign cleared) >= min_key
};
// Checks everything (length, count, order and range of indices, values) before writing y, then
// decodes: y[index] = value and zeros elsewhere (overwrite), or y[index] += value (accumulate).
TERSE_API void decode(std::span<const std::byte> in, std::span<float> y, DecodeMode mode,
                      const Rules& rules, const std::string& spec);

// Base of the codecs that send this payload: the size bound and the decoder follow from the
// rules for n, so a codec only states them and writes its encoder.
class ListCodec : public Codec {
 public:
  CodecTraits traits() const override {  // deterministic and stateless unless overridden
    CodecTraits t;
    t.sparse = true;
    return t;
  }

 protected:
  using Codec::Codec;
  virtual Rules rules(std::size_t n) const = 0;

  std::size_t max_payload_bytes(std::size_t n) const final {
    return payload_bytes(rules(n).max_count);
  }
  void decode_payload(std::span<const std::byte> in, std::span<float> y,
                      DecodeMode mode) const final {
    sparse::decode(in, y, mode, rules(y.size()), spec());
  }
};

}  // namespace sparse
}  // namespace terse
