// Integer mixing used to derive RNG keys and stream counters. Counter-based: the value for
// (key, i) is a pure function, so every rank that knows the key draws the same numbers.
#pragma once

#include <cstdint>

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

}  // namespace terse::kit
