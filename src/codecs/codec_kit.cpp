// terse/codec_kit.h's primitives: exported entry points into the kit, which stays internal (its
// headers may change; these promises do not).
#include "terse/codec_kit.h"

#include <algorithm>

#include "kit/basic.h"
#include "kit/pack.h"
#include "kit/random.h"
#include "kit/sparse.h"

namespace terse::codec_kit {

std::size_t find_non_finite(std::span<const float> x) { return kit::find_non_finite(x); }

void throw_non_finite(std::span<const float> x, std::string_view what) {
  kit::throw_non_finite(x, what);
}

bool abs_max_finite(std::span<const float> x, float* m) { return kit::abs_max_finite(x, m); }

bool min_max_finite(std::span<const float> x, float* lo, float* hi) {
  return kit::min_max_finite(x, lo, hi);
}

bool store_or_add(const float* x, std::span<float> y, bool accumulate) {
  return kit::store_or_add(x, y, accumulate);
}

bool widen(DType dtype, const std::uint16_t* in, std::span<float> y, bool accumulate) {
  return kit::widen(dtype, in, y, accumulate);
}

bool narrow(DType dtype, std::span<const float> x, std::uint16_t* out) {
  return kit::narrow(dtype, x, out);
}

bool sign_pack(std::span<const float> x, std::uint8_t* bits, double* abs_sum) {
  kit::SignStats stats;
  const bool finite = kit::sign_pack(x, bits, &stats);
  if (abs_sum) *abs_sum = stats.abs_sum;
  return finite;
}

void sign_unpack(const std::uint8_t* bits, float scale, std::span<float> y, bool accumulate) {
  kit::sign_unpack(bits, scale, y, accumulate);
}

void quantize_range(std::span<const float> x, float lo, float hi, unsigned levels,
                    std::uint8_t* codes) {
  kit::quantize_range(x, lo, hi, levels, codes);
}

void dequantize_range(const std::uint8_t* codes, float lo, float hi, unsigned levels,
                      std::span<float> y, bool accumulate) {
  kit::dequantize_range(codes, lo, hi, levels, y, accumulate);
}

void pack_bits(const std::uint8_t* codes, std::size_t n, unsigned bits, std::uint8_t* out) {
  kit::pack_bits(codes, n, bits, out);
}

void unpack_bits(const std::uint8_t* in, std::size_t n, unsigned bits, std::uint8_t* codes) {
  kit::unpack_bits(in, n, bits, codes);
}

bool top_k(std::span<const float> x, std::span<std::uint32_t> idx, std::span<float> val,
           Workspace& workspace, std::size_t first_slot) {
  const std::size_t k = idx.size();
  if (val.size() != k || k > x.size()) {
    throw InvalidArgument("terse: top_k: " + std::to_string(idx.size()) + " indices and " +
                          std::to_string(val.size()) + " values for k of " +
                          std::to_string(x.size()) + " elements");
  }
  if (k == 0) return find_non_finite(x) == x.size();
  // The kit writes up to kSelectSlack entries past k: select into scratch, then copy k.
  auto scratch = workspace.get<std::uint32_t>(first_slot, kit::top_k_scratch_words(x.size(), k));
  auto i = workspace.get<std::uint32_t>(first_slot + 1, k + kit::kSelectSlack);
  auto v = workspace.get<float>(first_slot + 2, k + kit::kSelectSlack);
  if (!kit::top_k(x, k, scratch, i.data(), v.data())) return false;
  std::copy_n(i.data(), k, idx.data());
  std::copy_n(v.data(), k, val.data());
  return true;
}

std::uint32_t random_bits(std::uint64_t key, std::uint64_t index) {
  return kit::random_bits(key, index);
}

void uniform(std::uint64_t key, std::uint64_t first_index, std::span<float> out) {
  kit::uniform(key, first_index, out);
}

}  // namespace terse::codec_kit
