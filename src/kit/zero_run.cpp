// Byte scans and the zero-run coding of bytes in pack.h (3LC's), with Highway dynamic dispatch
// of the scans: this file is compiled once per target instruction set by foreach_target.h; the
// HWY_ONCE section holds the plain C++ API.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kit/zero_run.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstring>

#include "kit/pack.h"

HWY_BEFORE_NAMESPACE();
namespace terse::kit {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ---- byte scans ----------------------------------------------------------------------------

// Index of the first byte of p[0, n) for which (p[i] == v) == want_equal, or n.
size_t FindByte(const uint8_t* HWY_RESTRICT p, size_t n, uint8_t v, bool want_equal) {
  const hn::ScalableTag<uint8_t> d;
  const size_t N = hn::Lanes(d);
  const auto vv = hn::Set(d, v);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    auto eq = hn::Eq(hn::LoadU(d, p + i), vv);
    intptr_t k = hn::FindFirstTrue(d, want_equal ? eq : hn::Not(eq));
    if (k >= 0) return i + static_cast<size_t>(k);
  }
  for (; i < n; ++i) {
    if ((p[i] == v) == want_equal) return i;
  }
  return n;
}

// Index of the first byte >= v, or n.
size_t FindAtLeast(const uint8_t* HWY_RESTRICT p, size_t n, uint8_t v) {
  const hn::ScalableTag<uint8_t> d;
  const size_t N = hn::Lanes(d);
  const auto vv = hn::Set(d, v);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    intptr_t k = hn::FindFirstTrue(d, hn::Eq(hn::Max(hn::LoadU(d, p + i), vv), hn::LoadU(d, p + i)));
    if (k >= 0) return i + static_cast<size_t>(k);
  }
  for (; i < n; ++i) {
    if (p[i] >= v) return i;
  }
  return n;
}


}  // namespace HWY_NAMESPACE
}  // namespace terse::kit
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace terse::kit {

HWY_EXPORT(FindByte);
HWY_EXPORT(FindAtLeast);

bool all_bytes_equal(const std::uint8_t* p, std::size_t n, std::uint8_t v) {
  return HWY_DYNAMIC_DISPATCH(FindByte)(p, n, v, false) == n;
}

// ---- zero runs -----------------------------------------------------------------------------

void ZeroRunEncoder::flush_run() {
  if (run_ == 0) return;
  std::size_t full = run_ / max_run_, rest = run_ % max_run_;
  std::memset(out_ + pos_, static_cast<int>(first_ + max_run_ - 2), full);
  pos_ += full;
  if (rest >= 2) {
    out_[pos_++] = static_cast<std::uint8_t>(first_ + rest - 2);
  } else if (rest == 1) {
    out_[pos_++] = zero_;
  }
  run_ = 0;
}

void ZeroRunEncoder::add(const std::uint8_t* in, std::size_t n) {
  std::size_t i = 0;
  while (i < n) {
    std::size_t j = i + HWY_DYNAMIC_DISPATCH(FindByte)(in + i, n - i, zero_, false);
    run_ += j - i;  // zero bytes in [i, j)
    if (j == n) break;
    flush_run();
    std::size_t k = j + HWY_DYNAMIC_DISPATCH(FindByte)(in + j, n - j, zero_, true);
    std::memcpy(out_ + pos_, in + j, k - j);
    pos_ += k - j;
    i = k;
  }
}

void ZeroRunEncoder::add_zeros(std::size_t n) { run_ += n; }

std::size_t ZeroRunEncoder::finish() {
  flush_run();
  return pos_;
}

bool ZeroRunDecoder::next(std::uint8_t* out, std::size_t n, bool* all_zero,
                          bool skip_zero_output) {
  bool zero_so_far = true;
  std::size_t k = 0;
  while (k < n) {
    if (run_ > 0) {
      std::size_t t = run_ < n - k ? run_ : n - k;
      if (!(skip_zero_output && zero_so_far)) std::memset(out + k, zero_, t);
      run_ -= t;
      k += t;
      continue;
    }
    if (pos_ == in_.size()) return false;
    if (in_[pos_] >= first_) {
      run_ = in_[pos_++] - first_ + 2u;
      continue;
    }
    // A span of literals, up to the next run code.
    std::size_t avail = in_.size() - pos_ < n - k ? in_.size() - pos_ : n - k;
    std::size_t len = HWY_DYNAMIC_DISPATCH(FindAtLeast)(in_.data() + pos_, avail, first_);
    const std::uint8_t* lit = in_.data() + pos_;
    if (zero_so_far && !all_bytes_equal(lit, len, zero_)) {
      if (skip_zero_output) std::memset(out, zero_, k);
      zero_so_far = false;
    }
    if (!(skip_zero_output && zero_so_far)) std::memcpy(out + k, lit, len);
    pos_ += len;
    k += len;
  }
  *all_zero = zero_so_far;
  return true;
}

}  // namespace terse::kit
#endif  // HWY_ONCE
