// Hashes: integer mixing that derives RNG keys and stream counters (counter-based: the value for
// (key, i) is a pure function, so every rank that knows the key draws the same numbers), and
// FNV-1a of strings.
#pragma once

#include <cstdint>
#include <string_view>

namespace terse::kit {

// SplitMix64's finalizer: a bijective 64-bit mix with full avalanche.
constexpr std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Combines values into one key; order matters.
constexpr std::uint64_t combine_keys(std::uint64_t a, std::uint64_t b) {
  return mix64(a ^ (mix64(b) + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2)));
}

// 64-bit FNV-1a of a string (terse::fnv1a64 in terse/spec.h is this one).
constexpr std::uint64_t fnv1a64(std::string_view text) {
  std::uint64_t h = 14695981039346656037ull;
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace terse::kit
