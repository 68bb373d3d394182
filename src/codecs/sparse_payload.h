// The payload that topk, threshold and dgc share, and the helpers around it:
//   u32 count | count x u32 index (strictly increasing, < n) | count x fp32 value (finite)
// all little-endian, right after the 24-byte header. Indices are 32-bit, so these codecs take
// tensors of fewer than 2^32 elements (partition larger ones).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "terse/codec.h"

namespace terse::sparse {

// Largest tensor a 32-bit index addresses.
inline constexpr std::size_t kMaxElements = 0xffffffffu;

// Elements kept at density `ratio` of n: round(ratio * n), at least 1 when n > 0, at most n.
std::size_t count_for(double ratio, std::size_t n);
// Reads a density in (0, 1] (SpecError for 0 or anything outside).
double read_ratio(SpecReader& r, std::string_view key, double def);
// Throws InvalidArgument if n is beyond 32-bit indices.
void check_encodable(std::size_t n, const std::string& spec);

constexpr std::size_t payload_bytes(std::size_t count) { return 4 + 8 * count; }
// Writes the payload of `count` entries into out; returns its size.
std::size_t write(std::span<std::byte> out, const std::uint32_t* idx, const float* val,
                  std::size_t count);

// What a codec's encoder can produce, which its decoder enforces.
struct Rules {
  std::size_t max_count = 0;
  bool exact_count = false;   // the count must equal max_count
  std::uint32_t min_key = 0;  // every value has kit::magnitude_key(value) >= min_key
};
// Checks everything (length, count, order and range of indices, values) before writing y, then
// decodes: y[index] = value and zeros elsewhere (overwrite), or y[index] += value (accumulate).
void decode(std::span<const std::byte> in, std::span<float> y, DecodeMode mode, const Rules& rules,
            const std::string& spec);

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

}  // namespace terse::sparse
