// Highway dynamic dispatch of the packing primitives in pack.h: this file is compiled once per
// target instruction set by foreach_target.h; the HWY_ONCE section exports the plain C++ API.
// The byte scans and the zero-run coding are zero_run.cpp's.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kit/pack.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cfloat>
#include <cstring>

#include "kit/pack.h"

HWY_BEFORE_NAMESPACE();
namespace terse::kit {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;
using D8 = hn::Rebind<uint8_t, DF>;  // one byte per float lane

constexpr uint32_t kExponent = 0x7f800000u;
constexpr uint32_t kAbsMask = 0x7fffffffu;

// Mask bits of one vector as the low Lanes(d) bits of a word (lane 0 = bit 0).
template <class D, class M>
HWY_INLINE uint64_t MaskWord(D d, M m) {
  uint8_t buf[8] = {};
  hn::StoreMaskBits(d, m, buf);
  uint64_t w;
  std::memcpy(&w, buf, 8);
  return w;
}
template <class D>
HWY_INLINE hn::Mask<D> MaskFromWord(D d, uint64_t w) {
  uint8_t buf[8];
  std::memcpy(buf, &w, 8);
  return hn::LoadMaskBits(d, buf);
}

// Bits 0..31 of v moved to the even bit positions 0, 2, .., 62.
HWY_INLINE uint64_t SpreadBits(uint32_t v) {
  uint64_t x = v;
  x = (x | (x << 16)) & 0x0000FFFF0000FFFFull;
  x = (x | (x << 8)) & 0x00FF00FF00FF00FFull;
  x = (x | (x << 4)) & 0x0F0F0F0F0F0F0F0Full;
  x = (x | (x << 2)) & 0x3333333333333333ull;
  x = (x | (x << 1)) & 0x5555555555555555ull;
  return x;
}

// ---- reductions --------------------------------------------------------------------------

bool AbsMaxFinite(const float* HWY_RESTRICT x, size_t n, float* m) {
  const DF d;
  const DU du;
  const size_t N = hn::Lanes(d);
  const auto abs_mask = hn::Set(du, kAbsMask);
  auto a0 = hn::Zero(du), a1 = hn::Zero(du);
  size_t i = 0;
  // |x| as integer bits orders like |x| and puts NaN and Inf above every finite value.
  for (; i + 2 * N <= n; i += 2 * N) {
    a0 = hn::Max(a0, hn::And(hn::BitCast(du, hn::LoadU(d, x + i)), abs_mask));
    a1 = hn::Max(a1, hn::And(hn::BitCast(du, hn::LoadU(d, x + i + N)), abs_mask));
  }
  uint32_t r = hn::GetLane(hn::MaxOfLanes(du, hn::Max(a0, a1)));
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    b &= kAbsMask;
    r = b > r ? b : r;
  }
  std::memcpy(m, &r, 4);
  return r < kExponent;
}

bool MinMaxFinite(const float* HWY_RESTRICT x, size_t n, float* mn, float* mx) {
  const DF d;
  const DU du;
  const size_t N = hn::Lanes(d);
  const auto exp_mask = hn::Set(du, kExponent);
  float lo = x[0], hi = x[0];
  uint32_t e = 0;
  size_t i = 0;
  if (n >= N) {
    auto vlo = hn::LoadU(d, x), vhi = vlo, vlo2 = vlo, vhi2 = vlo;
    auto ve = hn::And(hn::BitCast(du, vlo), exp_mask), ve2 = ve;
    // Two independent chains per reduction hide the latency of min/max.
    for (i = N; i + 2 * N <= n; i += 2 * N) {
      auto v = hn::LoadU(d, x + i), w = hn::LoadU(d, x + i + N);
      vlo = hn::Min(vlo, v);
      vhi = hn::Max(vhi, v);
      ve = hn::Max(ve, hn::And(hn::BitCast(du, v), exp_mask));
      vlo2 = hn::Min(vlo2, w);
      vhi2 = hn::Max(vhi2, w);
      ve2 = hn::Max(ve2, hn::And(hn::BitCast(du, w), exp_mask));
    }
    for (; i + N <= n; i += N) {
      auto v = hn::LoadU(d, x + i);
      vlo = hn::Min(vlo, v);
      vhi = hn::Max(vhi, v);
      ve = hn::Max(ve, hn::And(hn::BitCast(du, v), exp_mask));
    }
    lo = hn::GetLane(hn::MinOfLanes(d, hn::Min(vlo, vlo2)));
    hi = hn::GetLane(hn::MaxOfLanes(d, hn::Max(vhi, vhi2)));
    e = hn::GetLane(hn::MaxOfLanes(du, hn::Max(ve, ve2)));
  }
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    e = (b & kExponent) > e ? (b & kExponent) : e;
    lo = x[i] < lo ? x[i] : lo;
    hi = x[i] > hi ? x[i] : hi;
  }
  *mn = lo;
  *mx = hi;
  return e != kExponent;
}

// ---- sign bits ---------------------------------------------------------------------------

// 64 elements -> one word of sign bits; accumulates |x| in vs and max |x| bits in va.
HWY_INLINE uint64_t SignWord(const float* HWY_RESTRICT x, hn::Vec<DF>& vs, hn::Vec<DU>& va) {
  const DF d;
  const DU du;
  const size_t N = hn::Lanes(d);
  const auto zero = hn::Zero(d);
  uint64_t w = 0;
  for (size_t j = 0; j < 64; j += N) {
    auto v = hn::LoadU(d, x + j);
    auto a = hn::Abs(v);
    vs = hn::Add(vs, a);
    va = hn::Max(va, hn::BitCast(du, a));
    w |= MaskWord(d, hn::Lt(v, zero)) << j;
  }
  return w;
}

bool SignPack(const float* HWY_RESTRICT x, size_t n, uint8_t* HWY_RESTRICT bits, double* sum,
              float* amax) {
  const DF d;
  const DU du;
  static_assert(hn::MaxLanes(DF()) <= 64, "one word of sign bits per 64 elements");
  auto va = hn::Zero(du);
  double s = 0;
  size_t i = 0;
  while (i + 64 <= n) {
    // Blocks of 4096 are summed in float lanes, then folded into double.
    const size_t block = i;
    size_t end = n - i >= 4096 ? i + 4096 : n;
    auto vs = hn::Zero(d);
    for (; i + 64 <= end; i += 64) {
      uint64_t w = SignWord(x + i, vs, va);
      std::memcpy(bits + i / 8, &w, 8);
    }
    float bs = hn::GetLane(hn::SumOfLanes(d, vs));
    if (bs <= FLT_MAX) {
      s += bs;
    } else {  // huge values overflowed the float lanes (or NaN/Inf, rejected below)
      for (size_t j = block; j < i; ++j) s += x[j] < 0 ? -static_cast<double>(x[j]) : x[j];
    }
  }
  uint32_t a = hn::GetLane(hn::MaxOfLanes(du, va));
  if (i < n) {
    HWY_ALIGN float buf[64] = {};
    std::memcpy(buf, x + i, (n - i) * 4);
    auto vs = hn::Zero(d);
    auto vt = hn::Zero(du);
    uint64_t w = SignWord(buf, vs, vt);
    std::memcpy(bits + i / 8, &w, (n - i + 7) / 8);
    for (size_t j = i; j < n; ++j) s += x[j] < 0 ? -static_cast<double>(x[j]) : x[j];
    uint32_t t = hn::GetLane(hn::MaxOfLanes(du, vt));
    a = t > a ? t : a;
  }
  *sum = s;
  std::memcpy(amax, &a, 4);
  return a < kExponent;
}

void SignUnpack(const uint8_t* HWY_RESTRICT bits, float scale, float* HWY_RESTRICT y, size_t n,
                bool accumulate) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const auto pos = hn::Set(d, scale), neg = hn::Set(d, -scale);
  size_t i = 0;
  auto word = [&](float* HWY_RESTRICT out, uint64_t w) {
    for (size_t j = 0; j < 64; j += N) {
      auto v = hn::IfThenElse(MaskFromWord(d, w >> j), neg, pos);
      if (accumulate) v = hn::Add(v, hn::LoadU(d, out + j));
      hn::StoreU(v, d, out + j);
    }
  };
  for (; i + 64 <= n; i += 64) {
    uint64_t w;
    std::memcpy(&w, bits + i / 8, 8);
    word(y + i, w);
  }
  if (i < n) {
    HWY_ALIGN float buf[64] = {};
    uint64_t w = 0;
    std::memcpy(&w, bits + i / 8, (n - i + 7) / 8);
    if (accumulate) std::memcpy(buf, y + i, (n - i) * 4);
    word(buf, w);
    std::memcpy(y + i, buf, (n - i) * 4);
  }
}

// ---- affine b-bit codes --------------------------------------------------------------------

// x is scaled by a power of two `a` before subtracting lo, so that a * (hi - lo) is a normal,
// finite float whatever the range (huge ranges would overflow, tiny ones lose precision).
struct RangeParams {
  float a, inv_a, b, inv, step;  // t = (x*a - b) * inv; y = (c*step + b) * inv_a
};
HWY_INLINE RangeParams MakeRange(float lo, float hi, unsigned levels) {
  double range = static_cast<double>(hi) - lo;
  float a = range > 0x1p100 ? 0.5f : (range < 0x1p-60 ? 0x1p63f : 1.0f);
  RangeParams p;
  p.a = a;
  p.inv_a = 1.0f / a;
  p.b = lo * a;
  p.inv = range > 0 ? static_cast<float>(levels / (range * a)) : 0.0f;
  p.step = static_cast<float>(range * a / levels);
  return p;
}

void QuantizeRange(const float* HWY_RESTRICT x, size_t n, float lo, float hi, unsigned levels,
                   uint8_t* HWY_RESTRICT codes) {
  const DF d;
  const DI di;
  const D8 d8;
  const size_t N = hn::Lanes(d);
  const RangeParams p = MakeRange(lo, hi, levels);
  const auto va = hn::Set(d, p.a), vb = hn::Set(d, p.b), vinv = hn::Set(d, p.inv);
  const auto vmax = hn::Set(di, static_cast<int32_t>(levels));
  const auto zero = hn::Zero(di);
  auto one = [&](hn::Vec<DF> v) {
    auto q = hn::NearestInt(hn::Mul(hn::MulSub(v, va, vb), vinv));
    return hn::DemoteTo(d8, hn::Min(hn::Max(q, zero), vmax));
  };
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(one(hn::LoadU(d, x + i)), d8, codes + i);
  if (i < n) {
    HWY_ALIGN float buf[hn::MaxLanes(d)] = {};
    HWY_ALIGN uint8_t cb[hn::MaxLanes(d)];
    std::memcpy(buf, x + i, (n - i) * 4);
    hn::Store(one(hn::Load(d, buf)), d8, cb);
    std::memcpy(codes + i, cb, n - i);
  }
}

void DequantizeRange(const uint8_t* HWY_RESTRICT codes, size_t n, float lo, float hi,
                     unsigned levels, float* HWY_RESTRICT y, bool accumulate) {
  const DF d;
  const DI di;
  const D8 d8;
  const size_t N = hn::Lanes(d);
  const RangeParams p = MakeRange(lo, hi, levels);
  const auto vstep = hn::Set(d, p.step), vb = hn::Set(d, p.b), vinv_a = hn::Set(d, p.inv_a);
  const auto vlo = hn::Set(d, lo), vhi = hn::Set(d, hi);
  auto one = [&](hn::Vec<D8> c) {
    auto f = hn::ConvertTo(d, hn::PromoteTo(di, c));
    auto v = hn::Mul(hn::MulAdd(f, vstep, vb), vinv_a);
    return hn::Min(hn::Max(v, vlo), vhi);
  };
  size_t i = 0;
  for (; i + N <= n; i += N) {
    auto v = one(hn::LoadU(d8, codes + i));
    if (accumulate) v = hn::Add(v, hn::LoadU(d, y + i));
    hn::StoreU(v, d, y + i);
  }
  if (i < n) {
    HWY_ALIGN uint8_t cb[hn::MaxLanes(d)] = {};
    HWY_ALIGN float buf[hn::MaxLanes(d)];
    std::memcpy(cb, codes + i, n - i);
    hn::Store(one(hn::Load(d8, cb)), d, buf);
    for (size_t j = i; j < n; ++j) y[j] = accumulate ? y[j] + buf[j - i] : buf[j - i];
  }
}

// Eight codes of B bits <-> B bytes, through one 64-bit word.
template <unsigned B>
void PackBitsT(const uint8_t* HWY_RESTRICT c, size_t n, uint8_t* HWY_RESTRICT out) {
  constexpr uint64_t m = (1u << B) - 1;
  auto pack8 = [](uint64_t w) {
    uint64_t r = 0;
    for (unsigned j = 0; j < 8; ++j) r |= ((w >> (8 * j)) & m) << (B * j);
    return r;
  };
  size_t i = 0, o = 0;
  for (; i + 8 <= n; i += 8, o += B) {
    uint64_t w;
    std::memcpy(&w, c + i, 8);
    uint64_t r = pack8(w);
    std::memcpy(out + o, &r, B);
  }
  if (i < n) {
    uint64_t w = 0;
    std::memcpy(&w, c + i, n - i);
    uint64_t r = pack8(w);
    std::memcpy(out + o, &r, ((n - i) * B + 7) / 8);
  }
}

template <unsigned B>
void UnpackBitsT(const uint8_t* HWY_RESTRICT in, size_t n, uint8_t* HWY_RESTRICT c) {
  constexpr uint64_t m = (1u << B) - 1;
  auto unpack8 = [](uint64_t w) {
    uint64_t r = 0;
    for (unsigned j = 0; j < 8; ++j) r |= ((w >> (B * j)) & m) << (8 * j);
    return r;
  };
  size_t i = 0, o = 0;
  for (; i + 8 <= n; i += 8, o += B) {
    uint64_t w = 0;
    std::memcpy(&w, in + o, B);
    uint64_t r = unpack8(w);
    std::memcpy(c + i, &r, 8);
  }
  if (i < n) {
    uint64_t w = 0;
    std::memcpy(&w, in + o, ((n - i) * B + 7) / 8);
    uint64_t r = unpack8(w);
    std::memcpy(c + i, &r, n - i);
  }
}

void PackBits(const uint8_t* HWY_RESTRICT c, size_t n, unsigned bits, uint8_t* HWY_RESTRICT out) {
  switch (bits) {
    case 1: return PackBitsT<1>(c, n, out);
    case 2: return PackBitsT<2>(c, n, out);
    case 3: return PackBitsT<3>(c, n, out);
    case 4: return PackBitsT<4>(c, n, out);
    case 5: return PackBitsT<5>(c, n, out);
    case 6: return PackBitsT<6>(c, n, out);
    case 7: return PackBitsT<7>(c, n, out);
    default: std::memcpy(out, c, n);
  }
}

void UnpackBits(const uint8_t* HWY_RESTRICT in, size_t n, unsigned bits, uint8_t* HWY_RESTRICT c) {
  switch (bits) {
    case 1: return UnpackBitsT<1>(in, n, c);
    case 2: return UnpackBitsT<2>(in, n, c);
    case 3: return UnpackBitsT<3>(in, n, c);
    case 4: return UnpackBitsT<4>(in, n, c);
    case 5: return UnpackBitsT<5>(in, n, c);
    case 6: return UnpackBitsT<6>(in, n, c);
    case 7: return UnpackBitsT<7>(in, n, c);
    default: std::memcpy(c, in, n);
  }
}

// ---- 2-bit threshold codes -------------------------------------------------------------

// 64 elements -> 16 bytes of 2-bit codes; tracks the exponent bits for the finite check.
HWY_INLINE void ThresholdBlock(const float* HWY_RESTRICT x, float tau, uint8_t* out,
                               hn::Vec<DU>& ve) {
  const DF d;
  const DU du;
  const size_t N = hn::Lanes(d);
  const auto vpos = hn::Set(d, tau), vneg = hn::Set(d, -tau);
  const auto exp_mask = hn::Set(du, kExponent);
  uint64_t p = 0, q = 0;
  for (size_t j = 0; j < 64; j += N) {
    auto v = hn::LoadU(d, x + j);
    ve = hn::Max(ve, hn::And(hn::BitCast(du, v), exp_mask));
    p |= MaskWord(d, hn::Gt(v, vpos)) << j;
    q |= MaskWord(d, hn::Lt(v, vneg)) << j;
  }
  uint64_t w0 = SpreadBits(static_cast<uint32_t>(p)) | (SpreadBits(static_cast<uint32_t>(q)) << 1);
  uint64_t w1 = SpreadBits(static_cast<uint32_t>(p >> 32)) |
                (SpreadBits(static_cast<uint32_t>(q >> 32)) << 1);
  std::memcpy(out, &w0, 8);
  std::memcpy(out + 8, &w1, 8);
}

bool ThresholdPack2(const float* HWY_RESTRICT x, size_t n, float tau, uint8_t* HWY_RESTRICT out) {
  const DU du;
  auto ve = hn::Zero(du);
  size_t i = 0;
  for (; i + 64 <= n; i += 64) ThresholdBlock(x + i, tau, out + i / 4, ve);
  if (i < n) {
    HWY_ALIGN float buf[64] = {};
    uint8_t ob[16];
    std::memcpy(buf, x + i, (n - i) * 4);
    ThresholdBlock(buf, tau, ob, ve);
    std::memcpy(out + i / 4, ob, (n - i + 3) / 4);
  }
  return hn::GetLane(hn::MaxOfLanes(du, ve)) != kExponent;
}

bool ThresholdUnpack2(const uint8_t* HWY_RESTRICT in, size_t n, float v1, float v2,
                      float* HWY_RESTRICT y, bool accumulate) {
  const DF d;
  const DU du;
  const size_t N = hn::Lanes(d);
  static_assert(hn::MaxLanes(DF()) <= 32, "2-bit codes of one vector fit a word");
  const auto shifts = hn::ShiftLeft<1>(hn::Iota(du, 0));
  const auto three = hn::Set(du, 3u), one = hn::Set(du, 1u), two = hn::Set(du, 2u);
  const auto f1 = hn::Set(d, v1), f2 = hn::Set(d, v2);
  auto bad = hn::Zero(du);
  // 32 elements from one 64-bit word of codes.
  auto word = [&](float* HWY_RESTRICT out, uint64_t w) {
    for (size_t j = 0; j < 32; j += N) {
      auto c = hn::And(hn::Shr(hn::Set(du, static_cast<uint32_t>(w >> (2 * j))), shifts), three);
      bad = hn::Max(bad, c);
      auto v = hn::IfThenElseZero(hn::RebindMask(d, hn::Eq(c, one)), f1);
      v = hn::IfThenElse(hn::RebindMask(d, hn::Eq(c, two)), f2, v);
      if (accumulate) v = hn::Add(v, hn::LoadU(d, out + j));
      hn::StoreU(v, d, out + j);
    }
  };
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w;
    std::memcpy(&w, in + i / 4, 8);
    word(y + i, w);
  }
  bool ok = true;
  if (i < n) {
    HWY_ALIGN float buf[32] = {};
    uint64_t w = 0;
    std::memcpy(&w, in + i / 4, (n - i + 3) / 4);
    ok = (w >> (2 * (n - i))) == 0;  // padding codes are zero
    if (accumulate) std::memcpy(buf, y + i, (n - i) * 4);
    word(buf, w);
    std::memcpy(y + i, buf, (n - i) * 4);
  }
  return ok && hn::GetLane(hn::MaxOfLanes(du, bad)) < 3;
}

// ---- ternary, base 3^5 ------------------------------------------------------------------

// Bytes 0..s-1 of one group: byte j = sum_k digit(x[j + k*s]) * 3^(4-k). Not inlined (nor its
// inverse): inlined into the loops over groups, GCC 12 warns of an unbounded scalar tail
// (-Waggressive-loop-optimizations) that cannot happen, since s is at most kTernaryGroup / 5.
HWY_NOINLINE void TernaryGroup(const float* HWY_RESTRICT x, size_t s, float h,
                               uint8_t* HWY_RESTRICT out) {
  const DF d;
  const DI di;
  const D8 d8;
  const size_t N = hn::Lanes(d);
  const auto vh = hn::Set(d, h), vnh = hn::Set(d, -h);
  const auto one = hn::Set(d, 1.0f), three = hn::Set(d, 3.0f);
  size_t j = 0;
  for (; j + N <= s; j += N) {
    auto acc = hn::Zero(d);
    for (size_t k = 0; k < 5; ++k) {
      auto v = hn::LoadU(d, x + j + k * s);
      auto dig = hn::Sub(hn::Add(one, hn::IfThenElseZero(hn::Ge(v, vh), one)),
                         hn::IfThenElseZero(hn::Le(v, vnh), one));
      acc = hn::MulAdd(acc, three, dig);
    }
    hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, acc)), d8, out + j);
  }
  for (; j < s; ++j) {
    unsigned b = 0;
    for (size_t k = 0; k < 5; ++k) {
      float v = x[j + k * s];
      b = b * 3 + 1 + (v >= h ? 1 : 0) - (v <= -h ? 1 : 0);
    }
    out[j] = static_cast<uint8_t>(b);
  }
}

void TernaryPack243(const float* HWY_RESTRICT x, size_t n, float h, uint8_t* HWY_RESTRICT out) {
  constexpr size_t G = kTernaryGroup, S = G / 5;
  size_t g = 0;
  for (; g + G <= n; g += G) TernaryGroup(x + g, S, h, out + g / 5);
  if (g < n) {
    HWY_ALIGN float buf[G] = {};
    std::memcpy(buf, x + g, (n - g) * 4);
    TernaryGroup(buf, (n - g + 4) / 5, h, out + g / 5);
  }
}

// Inverse of TernaryGroup for s bytes into out[0 .. 5s); false if a byte exceeds 242.
HWY_NOINLINE bool UnpackTernaryGroup(const uint8_t* HWY_RESTRICT in, size_t s, float m,
                                     float* HWY_RESTRICT out, bool accumulate) {
  const DF d;
  const DI di;
  const D8 d8;
  const size_t N = hn::Lanes(d);
  const auto half = hn::Set(d, 0.5f), one = hn::Set(d, 1.0f), vm = hn::Set(d, m);
  const float w[4] = {81, 27, 9, 3};
  auto bad = hn::Zero(d);
  auto emit = [&](float* HWY_RESTRICT o, hn::Vec<DF> dig) {
    auto v = hn::Mul(hn::Sub(dig, one), vm);
    if (accumulate) v = hn::Add(v, hn::LoadU(d, o));
    hn::StoreU(v, d, o);
  };
  size_t j = 0;
  for (; j + N <= s; j += N) {
    auto r = hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, in + j)));
    bad = hn::Max(bad, r);
    for (size_t k = 0; k < 4; ++k) {
      auto dig = hn::Floor(hn::Mul(hn::Add(r, half), hn::Set(d, 1.0f / w[k])));
      r = hn::NegMulAdd(dig, hn::Set(d, w[k]), r);
      emit(out + j + k * s, dig);
    }
    emit(out + j + 4 * s, r);
  }
  bool ok = hn::GetLane(hn::MaxOfLanes(d, bad)) <= 242.0f;
  for (; j < s; ++j) {
    unsigned b = in[j];
    ok &= b <= 242;
    for (size_t k = 0; k < 5; ++k) {
      static constexpr unsigned kPow[5] = {81, 27, 9, 3, 1};
      float v = (static_cast<float>((b / kPow[k]) % 3) - 1.0f) * m;
      out[j + k * s] = accumulate ? out[j + k * s] + v : v;
    }
  }
  return ok;
}

bool TernaryUnpack243(const uint8_t* HWY_RESTRICT in, size_t n, float m, float* HWY_RESTRICT y,
                      bool accumulate) {
  constexpr size_t G = kTernaryGroup, S = G / 5;
  bool ok = true;
  size_t g = 0;
  for (; g + G <= n; g += G) ok &= UnpackTernaryGroup(in + g / 5, S, m, y + g, accumulate);
  if (g < n) {
    HWY_ALIGN float buf[G] = {};
    size_t s = (n - g + 4) / 5;
    ok &= UnpackTernaryGroup(in + g / 5, s, 1.0f, buf, false);
    for (size_t j = n - g; j < 5 * s; ++j) ok &= buf[j] == 0.0f;  // padding is zero
    for (size_t j = 0; j < n - g; ++j) {
      float v = buf[j] * m;
      y[g + j] = accumulate ? y[g + j] + v : v;
    }
  }
  return ok;
}

}  // namespace HWY_NAMESPACE
}  // namespace terse::kit
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace terse::kit {

HWY_EXPORT(AbsMaxFinite);
HWY_EXPORT(MinMaxFinite);
HWY_EXPORT(SignPack);
HWY_EXPORT(SignUnpack);
HWY_EXPORT(QuantizeRange);
HWY_EXPORT(DequantizeRange);
HWY_EXPORT(PackBits);
HWY_EXPORT(UnpackBits);
HWY_EXPORT(ThresholdPack2);
HWY_EXPORT(ThresholdUnpack2);
HWY_EXPORT(TernaryPack243);
HWY_EXPORT(TernaryUnpack243);

bool abs_max_finite(std::span<const float> x, float* m) {
  return HWY_DYNAMIC_DISPATCH(AbsMaxFinite)(x.data(), x.size(), m);
}
bool min_max_finite(std::span<const float> x, float* lo, float* hi) {
  if (x.empty()) {
    *lo = *hi = 0;
    return true;
  }
  return HWY_DYNAMIC_DISPATCH(MinMaxFinite)(x.data(), x.size(), lo, hi);
}
bool sign_pack(std::span<const float> x, std::uint8_t* bits, SignStats* stats) {
  return HWY_DYNAMIC_DISPATCH(SignPack)(x.data(), x.size(), bits, &stats->abs_sum,
                                        &stats->abs_max);
}
void sign_unpack(const std::uint8_t* bits, float scale, std::span<float> y, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(SignUnpack)(bits, scale, y.data(), y.size(), accumulate);
}
void quantize_range(std::span<const float> x, float lo, float hi, unsigned levels,
                    std::uint8_t* codes) {
  HWY_DYNAMIC_DISPATCH(QuantizeRange)(x.data(), x.size(), lo, hi, levels, codes);
}
void dequantize_range(const std::uint8_t* codes, float lo, float hi, unsigned levels,
                      std::span<float> y, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(DequantizeRange)(codes, y.size(), lo, hi, levels, y.data(), accumulate);
}
void pack_bits(const std::uint8_t* codes, std::size_t n, unsigned bits, std::uint8_t* out) {
  if (n == 0) return;
  HWY_DYNAMIC_DISPATCH(PackBits)(codes, n, bits, out);
}
void unpack_bits(const std::uint8_t* in, std::size_t n, unsigned bits, std::uint8_t* codes) {
  if (n == 0) return;
  HWY_DYNAMIC_DISPATCH(UnpackBits)(in, n, bits, codes);
}
bool threshold_pack2(std::span<const float> x, float tau, std::uint8_t* out) {
  return HWY_DYNAMIC_DISPATCH(ThresholdPack2)(x.data(), x.size(), tau, out);
}
bool threshold_unpack2(const std::uint8_t* in, float v1, float v2, std::span<float> y,
                       bool accumulate) {
  return HWY_DYNAMIC_DISPATCH(ThresholdUnpack2)(in, y.size(), v1, v2, y.data(), accumulate);
}
void ternary_pack243(std::span<const float> x, float h, std::uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(TernaryPack243)(x.data(), x.size(), h, out);
}
bool ternary_unpack243(const std::uint8_t* in, float m, std::span<float> y, bool accumulate) {
  return HWY_DYNAMIC_DISPATCH(TernaryUnpack243)(in, y.size(), m, y.data(), accumulate);
}

}  // namespace terse::kit
#endif  // HWY_ONCE
