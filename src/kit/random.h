// Counter-based random numbers and the stochastic quantizers built on them.
//
// The generator is a pure function of (64-bit key, 64-bit element index): every value can be
// recomputed anywhere, in any order, on any instruction set, so stochastic codecs are
// reproducible and need no generator state. The vector kernels (random.cpp) compute exactly the
// same bits as the scalar reference below, lane by lane.
//
// Quantizers draw their noise inside their own loop (no noise array is materialised): each
// element's uniform comes from its index within the tensor, so results do not depend on how the
// work is split.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kit/hash.h"

namespace terse::kit {

// ---- The generator -----------------------------------------------------------------------

// One round of a 32-bit integer hash (xorshift-multiply, "lowbias32" constants from Wellons'
// hash-prospector): a bijection on 32 bits with near-ideal avalanche.
constexpr std::uint32_t hash32_round(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

// The key that governs indices [2^32 * high, 2^32 * (high + 1)): the key itself for the first
// 2^32 elements, a derived key above.
constexpr std::uint64_t segment_key(std::uint64_t key, std::uint64_t high) {
  return high == 0 ? key : combine_keys(key, high);
}

// 32 random bits for (key, index): two hash rounds, the low key word mixed in before the first
// and the high word between them.
constexpr std::uint32_t random_bits(std::uint64_t key, std::uint64_t index) {
  std::uint64_t k = segment_key(key, index >> 32);
  std::uint32_t x = hash32_round(static_cast<std::uint32_t>(index) ^ static_cast<std::uint32_t>(k));
  return hash32_round(x + static_cast<std::uint32_t>(k >> 32));
}

// Uniform in [0, 1) with 24 random bits: (random_bits >> 8) * 2^-24, exact in fp32.
constexpr float uniform_at(std::uint64_t key, std::uint64_t index) {
  return static_cast<float>(random_bits(key, index) >> 8) * (1.0f / 16777216.0f);
}

// out[i] = uniform_at(key, first_index + i), vectorized.
void uniform(std::uint64_t key, std::uint64_t first_index, std::span<float> out);

// ---- Random-k index sets ------------------------------------------------------------------

// The k of n indices (1 <= k <= n < 2^32) that random-k keeps for `key`, in increasing order:
// stratified sampling on a randomly rotated circle. With q = n / k and r = n % k, block j
// (0 <= j < k) covers L_j = q + [j < r] positions from b_j = j q + min(j, r); it keeps
// position (c + b_j + o_j) mod n, where c = random_k_rotation(key, n) is uniform in [0, n) and
// o_j = (random_bits(random_k_block_key(key), j) * L_j) >> 32.
//
// Every index is kept with probability exactly k / n: as c runs over [0, n), each index falls
// once on every (block, offset) pair, and each block keeps exactly one offset. Indices are
// spread evenly (one per block), and the set depends only on (key, n, k), so every rank that
// shares the key regenerates it without it being sent. O(k) and vectorized.
void random_k_indices(std::uint64_t key, std::size_t n, std::size_t k, std::uint32_t* out);

constexpr std::uint64_t random_k_block_key(std::uint64_t key) {
  return combine_keys(key, 0x72616e646b626c6bull);  // "randkblk"
}
// Uniform in [0, n) by rejection: draws below 2^64 mod n are redrawn, so no residue is favoured.
constexpr std::uint64_t random_k_rotation(std::uint64_t key, std::uint64_t n) {
  const std::uint64_t stream = combine_keys(key, 0x72616e646b726f74ull);  // "randkrot"
  const std::uint64_t reject_below = (0 - n) % n;
  for (std::uint64_t i = 0;; ++i) {
    const std::uint64_t x = mix64(stream + i);
    if (x >= reject_below) return x % n;
  }
}

// ---- Stochastic rounding to integer levels (TernGrad, QSGD) ------------------------------

// How each bucket's scale is measured.
enum class BucketNorm {
  kMaxAbs,  // max |x_i|, optionally clipped to clip * (standard deviation of the bucket)
  kL2,      // sqrt(sum x_i^2), accumulated in double; clamped to the largest finite float
};

// Bytes of `n` codes of `width` bits packed by pack_levels' layout: ceil(n * width / 8).
constexpr std::size_t packed_bytes(std::size_t n, int width) {
  return (n * static_cast<std::size_t>(width) + 7) / 8;
}
// Bytes of all buckets' codes of a tensor of n elements (each bucket packed on its own).
constexpr std::size_t packed_bucket_bytes(std::size_t n, std::size_t bucket, int width) {
  if (n == 0) return 0;
  std::size_t full = n / bucket, rest = n % bucket;
  return full * packed_bytes(bucket, width) + packed_bytes(rest, width);
}
// The smallest width in {2, 4, 8, 16} bits that holds the 2 * levels + 1 codes.
constexpr int level_code_width(int levels) {
  return levels <= 1 ? 2 : levels <= 7 ? 4 : levels <= 127 ? 8 : 16;
}

// Quantizes x bucket by bucket (the last bucket may be shorter). For bucket b with scale
// norm_b (written by this call as little-endian fp32 at norms + 4b, any alignment), s = levels, element i becomes the signed level
//   l_i = sign(x_i) * (floor(a_i) + [u_i < a_i - floor(a_i)]),  a_i = min(|x_i| * s / norm, s)
// with u_i = uniform_at(key, first_index + i), so E[l_i * norm / s] = x_i (up to 2^-24 of a
// level step, the resolution of u). Code l_i + s (0 .. 2s) is packed in `width` bits per
// element: per bucket, blocks of 16 * 8/width elements form 16 bytes, byte j holding elements
// j, j+16, j+32, ... of the block in ascending bit fields; the bucket's last partial block is
// packed sequentially (element k in bits width*(k % (8/width)) of byte k / (8/width)). Width 16
// stores little-endian uint16 codes. Returns false (outputs unspecified) if x holds NaN or Inf.
struct LevelQuantizer {
  BucketNorm norm = BucketNorm::kMaxAbs;
  float clip = 0;  // kMaxAbs only: 0 = off
  int levels = 1;  // 1 .. 32767
  int width = 2;   // level_code_width(levels) or wider
  std::size_t bucket = 0;  // elements per bucket; 0 = the whole tensor
};
bool quantize_levels(const LevelQuantizer& q, std::span<const float> x, std::uint64_t key,
                     std::uint64_t first_index, std::byte* norms, std::uint8_t* codes);

// Decodes quantize_levels' output: y = (code - levels) * step_b per bucket (or y +=), where
// step_b = norm_b / levels, lowered by ulps if needed so that levels * step_b is finite.
// Returns false (y then partly written) if a norm is negative or not finite, or a code exceeds
// 2 * levels: the input is untrusted.
bool dequantize_levels(const LevelQuantizer& q, const std::uint8_t* codes, const std::byte* norms,
                       std::span<float> y, bool accumulate);

// ---- Natural compression (stochastic rounding to powers of two) --------------------------

// Biased exponent of the largest power of two that stochastic rounding of x can produce (0 for
// all zeros, at most 254), or -1 if x holds NaN or Inf.
int natural_top_exponent(std::span<const float> x);
// The window of biased exponents [low, low + 126] that codes 1..127 stand for.
constexpr int natural_low_exponent(int top) { return top - 126 < 1 ? 1 : top - 126; }

// One byte per element: bit 7 the sign, bits 0..6 the code c; c = 0 is zero, c >= 1 is
// 2^(low + c - 1 - 127). |x| inside the window, |x| = 2^e (1 + m), rounds up to 2^(e+1) with
// probability m (23-bit exact comparison), else down to 2^e. |x| below 2^(low-127) (tiny values
// and subnormals) rounds to 2^(low-127) with probability |x| / 2^(low-127), else to zero.
// Values above 2^127 always round down (2^128 is not finite). Zero encodes as 0x00.
void natural_encode(std::span<const float> x, int low, std::uint64_t key,
                    std::uint64_t first_index, std::uint8_t* out);
void natural_decode(const std::uint8_t* in, int low, std::span<float> y, bool accumulate);

}  // namespace terse::kit
