// Packing primitives for quantizing codecs: sign bits, b-bit codes, 2-bit threshold codes,
// base-3^5 ternary bytes and zero-run coding of bytes. Vectorized with Google Highway and
// dispatched at run time (see basic.cpp for the pattern). Bit streams are little-endian and
// LSB-first: element i of a 1-bit stream is bit (i % 8) of byte i / 8, and so on.
//
// Functions that read floats and return bool return false when the input held NaN or Inf (the
// check is fused into their pass); their outputs are then unspecified.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace terse::kit {

// ---- fused reductions -------------------------------------------------------------------

// *m = max |x_i| (0 for an empty span). Returns false if x holds NaN or Inf.
bool abs_max_finite(std::span<const float> x, float* m);
// (*lo, *hi) = (min, max) of x ((0, 0) for an empty span). Returns false on NaN or Inf.
bool min_max_finite(std::span<const float> x, float* lo, float* hi);

// ---- sign bits --------------------------------------------------------------------------

struct SignStats {
  double abs_sum = 0;  // sum |x_i|, exact to double rounding per block of 4096 values
  float abs_max = 0;   // max |x_i|
};
// Bit i of `bits` is 1 iff x[i] < 0 (so +0, -0 and positives give 0). Writes ceil(n/8) bytes;
// the padding bits of the last byte are 0. Fills *stats in the same pass.
bool sign_pack(std::span<const float> x, std::uint8_t* bits, SignStats* stats);
// y[i] = bit i ? -scale : +scale; with accumulate, y[i] += that.
void sign_unpack(const std::uint8_t* bits, float scale, std::span<float> y, bool accumulate);

// ---- b-bit codes ------------------------------------------------------------------------

// Affine quantization of x (every x_i in [lo, hi], lo <= hi finite) to `levels` + 1 codes:
// codes[i] = round_half_even((x_i - lo) / step), step = (hi - lo) / levels, levels in [1, 255].
// Computed on halved values so that hi - lo may exceed the float range.
void quantize_range(std::span<const float> x, float lo, float hi, unsigned levels,
                    std::uint8_t* codes);
// y[i] = lo + codes[i] * step, clamped to [lo, hi] (or y += that). Codes above `levels` are
// clamped too; callers that must reject them check first.
void dequantize_range(const std::uint8_t* codes, float lo, float hi, unsigned levels,
                      std::span<float> y, bool accumulate);
// Packs n codes of `bits` bits each (1..8, values < 2^bits) into ceil(n * bits / 8) bytes.
void pack_bits(const std::uint8_t* codes, std::size_t n, unsigned bits, std::uint8_t* out);
// Inverse of pack_bits: reads ceil(n * bits / 8) bytes, writes n codes.
void unpack_bits(const std::uint8_t* in, std::size_t n, unsigned bits, std::uint8_t* codes);
// Bytes of a packed stream of n codes of `bits` bits.
constexpr std::size_t packed_bytes(std::size_t n, unsigned bits) { return (n * bits + 7) / 8; }

// ---- 2-bit threshold codes --------------------------------------------------------------

// Code of element i (bits 2*(i%4) .. 2*(i%4)+1 of byte i/4): 1 if x_i > tau, 2 if x_i < -tau,
// else 0 (tau >= 0). Writes ceil(n/4) bytes, padding codes 0.
bool threshold_pack2(std::span<const float> x, float tau, std::uint8_t* out);
// y[i] = {0, v1, v2}[code i] (or y += that). Returns false if any code is 3 (y is then
// partially written).
bool threshold_unpack2(const std::uint8_t* in, float v1, float v2, std::span<float> y,
                       bool accumulate);

// ---- ternary values, five per byte (base 3^5) -----------------------------------------------

// Ternary value of x_i: +1 if x_i >= h, -1 if x_i <= -h, else 0 (h > 0). Digits d = value + 1
// are packed five to a byte as d0*81 + d1*27 + d2*9 + d3*3 + d4, so a byte of five zeros is
// 121 and bytes 243..255 never occur.
//
// Layout (planar, so that it vectorizes): elements are taken in groups of kTernaryGroup = 320;
// byte j (0..63) of a full group holds elements j, j+64, j+128, j+192, j+256 of the group as
// d0..d4. A last group of m < 320 elements uses s = ceil(m/5) bytes, byte j holding elements
// j, j+s, .., j+4s of that group, positions >= m padded with zeros (digit 1). The output is
// always ceil(n/5) bytes, and a span of whole groups may be packed separately from the rest.
inline constexpr std::size_t kTernaryGroup = 320;
inline constexpr std::uint8_t kTernaryZeroByte = 121;
void ternary_pack243(std::span<const float> x, float h, std::uint8_t* out);
// y[i] = value_i * m (or y += that). Reads ceil(n/5) bytes. Returns false if a byte is above
// 242 or a padding position holds a nonzero value.
bool ternary_unpack243(const std::uint8_t* in, float m, std::span<float> y, bool accumulate);

// ---- zero-run coding of bytes -------------------------------------------------------------

// True iff all n bytes equal v.
bool all_bytes_equal(const std::uint8_t* p, std::size_t n, std::uint8_t v);

// Zero-run coding as in 3LC (Lim et al., SysML 2019): in a byte stream where byte values
// >= `first_code` never occur, a run of k copies of `zero` (2 <= k <= 256 - first_code + 2)
// is replaced by the single byte first_code + k - 2. Longer runs are split greedily into
// maximal runs; a remainder of one stays a literal. 3LC: zero = 121, first_code = 243 (runs of
// 2..14). The output is never longer than the input.
class ZeroRunEncoder {
 public:
  ZeroRunEncoder(std::uint8_t zero, std::uint8_t first_code, std::uint8_t* out)
      : zero_(zero), first_(first_code), max_run_(256u - first_code + 1), out_(out) {}
  // Appends n input bytes (none >= first_code) to the stream.
  void add(const std::uint8_t* in, std::size_t n);
  // Appends n zero bytes.
  void add_zeros(std::size_t n);
  // Flushes a pending run; returns the total bytes written.
  std::size_t finish();

 private:
  void flush_run();
  std::uint8_t zero_, first_;
  std::size_t max_run_;
  std::uint8_t* out_;
  std::size_t pos_ = 0;
  std::size_t run_ = 0;
};

// Decodes a stream written by ZeroRunEncoder. Every call checks its input: next() returns
// false (and the caller raises DecodeError) when the stream ends early; finished() tells
// whether all input was consumed.
class ZeroRunDecoder {
 public:
  ZeroRunDecoder(std::uint8_t zero, std::uint8_t first_code, std::span<const std::uint8_t> in)
      : zero_(zero), first_(first_code), in_(in) {}
  // Writes the next n decoded bytes to out. Sets *all_zero when all of them are the zero byte
  // (out is then left unwritten if skip_zero_output). Returns false if the input ran out.
  bool next(std::uint8_t* out, std::size_t n, bool* all_zero, bool skip_zero_output);
  // True iff every input byte was consumed and no run is pending.
  bool finished() const { return pos_ == in_.size() && run_ == 0; }

 private:
  std::uint8_t zero_, first_;
  std::span<const std::uint8_t> in_;
  std::size_t pos_ = 0;
  std::size_t run_ = 0;  // zero bytes still owed from the last run code
};

}  // namespace terse::kit
