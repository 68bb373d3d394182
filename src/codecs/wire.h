// The payload header shared by every codec, and bounds-checked readers and writers for the
// bytes after it. All multi-byte fields are little-endian; terse only builds on little-endian
// hosts (checked at compile time).
//
//   offset size field
//   0      2    magic 0x5354 ("TS")
//   2      1    version (1)
//   3      1    codec id
//   4      4    parameter digest (FNV-1a of the canonical spec)
//   8      8    element count
//   16     8    payload length in bytes (what follows the header)
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>

#include "terse/error.h"

namespace terse::wire {

static_assert(std::endian::native == std::endian::little, "terse's wire format is little-endian");

inline constexpr std::uint16_t kMagic = 0x5354;
inline constexpr std::uint8_t kVersion = 1;
inline constexpr std::size_t kHeaderBytes = 24;

// Sequential writer into a span; overflow is a programming error and throws InvalidArgument.
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
    if (n > out_.size() - pos_) {
      throw InvalidArgument("terse: encode buffer too small (" + std::to_string(out_.size()) +
                            " bytes, need more than " + std::to_string(pos_ + n - 1) + ")");
    }
  }
  std::span<std::byte> out_;
  std::size_t pos_ = 0;
};

// Sequential reader over an untrusted payload; reading past the end throws DecodeError.
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
  // Throws unless every byte was consumed.
  void expect_end() const;

 private:
  void need(std::size_t n) const;
  std::span<const std::byte> in_;
  const char* what_;
  std::size_t pos_ = 0;
};

}  // namespace terse::wire
