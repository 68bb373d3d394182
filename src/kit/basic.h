// Basic vectorized primitives: finiteness checks, reductions, element-wise arithmetic and
// half-precision conversion. Implemented with Google Highway and dispatched at run time to the
// best instruction set of the machine (SSE4, AVX2 or AVX-512 on x86).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "terse/dtype.h"

namespace terse::kit {

// Index of the first NaN or +-Inf in x, or x.size() if every element is finite.
std::size_t find_non_finite(std::span<const float> x);
// Throws InvalidArgument naming `what` and the first offending index if x holds NaN or Inf.
void check_finite(std::span<const float> x, std::string_view what);
// Throws the same error for a known-bad span (used after a fused check failed).
[[noreturn]] void throw_non_finite(std::span<const float> x, std::string_view what);

// max |x_i|; returns NaN if x holds a NaN (callers check finiteness first or fuse it).
float abs_max(std::span<const float> x);
// Sum and sum of squares, accumulated in double across lanes for stability.
double sum(std::span<const float> x);
double sum_squares(std::span<const float> x);
// (min, max) of x; (0, 0) for an empty span.
struct MinMax {
  float min = 0, max = 0;
};
MinMax min_max(std::span<const float> x);

// y += x
void add(std::span<const float> x, std::span<float> y);
// y -= x
void subtract(std::span<const float> x, std::span<float> y);
// out = x + y (out may alias x or y)
void add_to(std::span<const float> x, std::span<const float> y, std::span<float> out);
// out = x - y (out may alias x or y)
void difference(std::span<const float> x, std::span<const float> y, std::span<float> out);
// out = x / divisor, a true IEEE division per element (out may alias x)
void divide_to(std::span<const float> x, float divisor, std::span<float> out);
// y *= a
void scale(std::span<float> y, float a);
// y = a * y + x (a momentum's update; fused where the target has FMA)
void scale_add(std::span<const float> x, std::span<float> y, float a);
// y[i] = 0 wherever mask[i] != 0 (what was sent: momentum factor masking)
void clear_where(std::span<const float> mask, std::span<float> y);
// out = x, returning false (out fully written regardless) if x held NaN or Inf.
bool copy_finite(std::span<const float> x, float* out);
// y = x (accumulate=false) or y += x (accumulate=true). Returns false if x held NaN or Inf
// (y is then fully written but unspecified).
bool store_or_add(const float* x, std::span<float> y, bool accumulate);

// fp32 -> IEEE binary16, round to nearest even, finite values beyond +-65504 saturate to it.
// Returns false if x held NaN or Inf (out is then unspecified).
bool to_fp16(std::span<const float> x, std::uint16_t* out);
// Decoders: return false if the input held NaN or Inf (y is then unspecified).
bool from_fp16(const std::uint16_t* in, std::span<float> y, bool accumulate);
// fp32 -> bfloat16, round to nearest even, finite values beyond the largest bfloat16 saturate.
bool to_bf16(std::span<const float> x, std::uint16_t* out);
bool from_bf16(const std::uint16_t* in, std::span<float> y, bool accumulate);

// The two by DType (kFloat16 or kBFloat16). widen() writes every value, NaN and Inf included,
// exactly (y = in, or y += in), and returns false if any was not finite; narrow() rounds to
// nearest even and returns false if x held NaN or Inf.
inline bool widen(DType dtype, const std::uint16_t* in, std::span<float> y, bool accumulate) {
  return dtype == DType::kFloat16 ? from_fp16(in, y, accumulate) : from_bf16(in, y, accumulate);
}
// Index of the first NaN or Inf among 16-bit values of dtype, or x.size() if all are finite.
inline std::size_t find_non_finite(std::span<const std::uint16_t> x, DType dtype) {
  const std::uint16_t exponent = dtype == DType::kFloat16 ? 0x7c00 : 0x7f80;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if ((x[i] & exponent) == exponent) return i;
  }
  return x.size();
}
inline bool narrow(DType dtype, std::span<const float> x, std::uint16_t* out) {
  return dtype == DType::kFloat16 ? to_fp16(x, out) : to_bf16(x, out);
}

}  // namespace terse::kit
