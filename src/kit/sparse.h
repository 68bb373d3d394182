// Sparse primitives: exact top-k and threshold selection by magnitude, DGC's fused momentum
// update and selection, and validation and scatter of (index, value) lists. Vectorized with
// Google Highway and dispatched at run time (see basic.cpp for the pattern).
//
// Indices are 32-bit: every function here needs n <= 2^32 (callers check). Lists are in
// increasing index order. Output lists written by vector code may be written up to
// kSelectSlack entries past their count, so callers size them `capacity + kSelectSlack`.
// Payload bytes (any alignment) are read through memcpy-style loads, never as typed pointers.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

namespace terse::kit {

// Orders floats by magnitude: the bits of |x| as an unsigned integer. Every NaN and Inf has a
// key >= kNonFiniteKey; -0 and +0 have key 0.
constexpr std::uint32_t magnitude_key(float x) {
  return std::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
}
inline constexpr std::uint32_t kNonFiniteKey = 0x7f800000u;
inline constexpr std::size_t kSelectSlack = 64;

// ---- selection by magnitude ----------------------------------------------------------------

// Which entries the k largest magnitudes of a list are: every key above `key`, plus the first
// `ties` entries (in list order) whose key equals it.
struct MagnitudeCut {
  std::uint32_t key = 0;
  std::size_t ties = 0;
};
// The cut keeping exactly k (1 <= k <= v.size()) entries of v. Exact radix select on the keys:
// three passes with 11-bit digits, no scratch. Non-finite values order above every finite one.
MagnitudeCut magnitude_cut(std::span<const float> v, std::size_t k);

// Appends (i, x_i) for every x_i with magnitude_key(x_i) > key to idx/val, in index order, while
// at most `capacity` qualify. Returns how many qualified (> capacity means the lists hold only
// a prefix) or SIZE_MAX if x holds NaN or Inf (checked over all of x unless it overflowed).
inline constexpr std::size_t kNotFinite = SIZE_MAX;
std::size_t select_above(std::span<const float> x, std::uint32_t key, std::size_t capacity,
                         std::uint32_t* idx, float* val);

// Scratch (in 32-bit words) that top_k needs for n elements.
std::size_t top_k_scratch_words(std::size_t n, std::size_t k);
// The k (<= n) elements of largest |x|, ties broken towards the lower index, written in index
// order to idx/val (k + kSelectSlack entries). Exact for every input; returns false if x holds
// NaN or Inf (outputs unspecified). *cut, if given, receives the cut that was applied (k >= 1).
//
// Large inputs: a random sample brackets the k-th largest magnitude between two keys whose
// ranks hold it with overwhelming probability; one vector pass counts the elements above the
// bracket and collects the keys inside it, a radix select finds the exact k-th key among those,
// and a second vector pass writes the selection. If the sample misled (the bracket missed, or
// held too many keys to collect), an exact radix select over all of x takes over.
bool top_k(std::span<const float> x, std::size_t k, std::span<std::uint32_t> scratch,
           std::uint32_t* idx, float* val, MagnitudeCut* cut = nullptr);

// ---- Deep Gradient Compression (Lin et al., ICLR 2018) ---------------------------------------

// One step of momentum correction with factor masking, fused into one pass over g, u, v:
//   u = m * u + g;  v = v + u            (each saturated to +-FLT_MAX; g must be finite)
// and every v_i with magnitude_key(v_i) >= min_key (>= 1) is appended to the candidate lists
// and zeroed in u and v. If the lists would grow past `limit` entries, they are cut to the
// `keep` largest |v| (the others restored into u and v) and min_key rises above the cut, so
// the lists never exceed limit + kSelectSlack. Returns the final candidate count.
struct DgcCandidates {
  std::uint32_t* idx;  // limit + kSelectSlack entries each
  float* v;
  float* u;
  std::size_t limit;  // >= keep
  std::size_t keep;   // >= 1
};
std::size_t dgc_accumulate_select(std::span<const float> g, std::span<float> u, std::span<float> v,
                                  float momentum, std::uint32_t min_key, const DgcCandidates& c);
// Cuts DGC candidate lists of `count` entries to their `keep` largest |v| (ties to the lower
// index), restoring the dropped entries' u and v; returns the new count (keep).
std::size_t dgc_cut(const DgcCandidates& c, std::size_t count, std::span<float> u,
                    std::span<float> v);
// The v that dgc_accumulate_select would compute, at `count` sampled positions: runs of 16
// consecutive elements starting at random_bits(key, j)-chosen offsets (one cache line of each
// array per run), bit-identical to the pass. Writes 16 * runs values; needs n >= 16.
void dgc_sample(std::span<const float> g, std::span<const float> u, std::span<const float> v,
                float momentum, std::uint64_t key, std::size_t runs, float* out);
// The same for every element in order (small tensors: the exact threshold).
void dgc_preview(std::span<const float> g, std::span<const float> u, std::span<const float> v,
                 float momentum, float* out);

// ---- (index, value) lists from untrusted payloads ----------------------------------------

// True iff the `count` little-endian u32 indices at p are strictly increasing and below n.
bool indices_valid(const std::byte* p, std::size_t count, std::size_t n);
// True iff every one of the `count` little-endian fp32 values at p is finite with
// magnitude_key >= min_key.
bool values_valid(const std::byte* p, std::size_t count, std::uint32_t min_key);
// y[idx_t] = val_t with every other element zeroed (overwrite), or y[idx_t] += val_t
// (accumulate). Indices must be valid (indices_valid).
void scatter(const std::byte* idx, const std::byte* val, std::size_t count, std::span<float> y,
             bool accumulate);
// out_t = clamp(x[idx_t] * scale, +-FLT_MAX) as little-endian fp32 (any alignment).
void gather(std::span<const float> x, const std::uint32_t* idx, std::size_t count, float scale,
            std::byte* out);

}  // namespace terse::kit
