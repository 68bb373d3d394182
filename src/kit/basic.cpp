// Highway dynamic dispatch: this file is compiled once per target instruction set by
// foreach_target.h; the HWY_ONCE section at the end exports the plain C++ API of basic.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kit/basic.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kit/basic.h"

HWY_BEFORE_NAMESPACE();
namespace terse::kit {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;

// Largest exponent field seen, as the integer bits & 0x7f800000: equals 0x7f800000 iff some
// element was NaN or Inf. One integer max per vector, so it fuses into any pass for free.
template <class V>
HWY_INLINE hn::Vec<DU> TrackExponent(hn::Vec<DU> acc, V v) {
  const DU du;
  return hn::Max(acc, hn::And(hn::BitCast(du, v), hn::Set(du, 0x7f800000u)));
}
HWY_INLINE bool ExponentAllFinite(hn::Vec<DU> acc) {
  const DU du;
  return hn::GetLane(hn::MaxOfLanes(du, acc)) != 0x7f800000u;
}

size_t FindNonFinite(const float* HWY_RESTRICT x, size_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    if (!hn::AllTrue(d, hn::IsFinite(hn::LoadU(d, x + i)))) break;
  }
  for (; i < n; ++i) {
    uint32_t b;
    __builtin_memcpy(&b, x + i, 4);
    if ((b & 0x7f800000u) == 0x7f800000u) return i;
  }
  return n;
}

float AbsMax(const float* HWY_RESTRICT x, size_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  auto m0 = hn::Zero(d), m1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    m0 = hn::Max(m0, hn::Abs(hn::LoadU(d, x + i)));
    m1 = hn::Max(m1, hn::Abs(hn::LoadU(d, x + i + N)));
  }
  float m = hn::GetLane(hn::MaxOfLanes(d, hn::Max(m0, m1)));
  for (; i < n; ++i) {
    float a = x[i] < 0 ? -x[i] : x[i];
    if (a > m || a != a) m = a;
  }
  return m;
}

void SumAndSquares(const float* HWY_RESTRICT x, size_t n, double* sum, double* sq) {
  const DF d;
  const size_t N = hn::Lanes(d);
  // Blocks of 4096 floats are summed in float lanes, then folded into double, so error stays
  // bounded for tensors of any size.
  double s = 0, q = 0;
  size_t i = 0;
  while (i + N <= n) {
    size_t end = i + 4096 < n ? i + 4096 : n;
    auto vs = hn::Zero(d), vq = hn::Zero(d);
    for (; i + N <= end; i += N) {
      auto v = hn::LoadU(d, x + i);
      vs = hn::Add(vs, v);
      vq = hn::MulAdd(v, v, vq);
    }
    s += hn::GetLane(hn::SumOfLanes(d, vs));
    q += hn::GetLane(hn::SumOfLanes(d, vq));
  }
  for (; i < n; ++i) {
    s += x[i];
    q += static_cast<double>(x[i]) * x[i];
  }
  *sum = s;
  *sq = q;
}

void MinMaxOf(const float* HWY_RESTRICT x, size_t n, float* mn, float* mx) {
  const DF d;
  const size_t N = hn::Lanes(d);
  float lo = x[0], hi = x[0];
  size_t i = 0;
  if (n >= N) {
    auto vlo = hn::LoadU(d, x), vhi = vlo;
    for (i = N; i + N <= n; i += N) {
      auto v = hn::LoadU(d, x + i);
      vlo = hn::Min(vlo, v);
      vhi = hn::Max(vhi, v);
    }
    lo = hn::GetLane(hn::MinOfLanes(d, vlo));
    hi = hn::GetLane(hn::MaxOfLanes(d, vhi));
  }
  for (; i < n; ++i) {
    lo = x[i] < lo ? x[i] : lo;
    hi = x[i] > hi ? x[i] : hi;
  }
  *mn = lo;
  *mx = hi;
}

// op: 0 add (y += x), 1 subtract (y -= x)
template <int kOp>
void AddSub(const float* HWY_RESTRICT x, float* HWY_RESTRICT y, size_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    auto a = hn::LoadU(d, y + i), b = hn::LoadU(d, x + i);
    hn::StoreU(kOp == 0 ? hn::Add(a, b) : hn::Sub(a, b), d, y + i);
  }
  for (; i < n; ++i) y[i] = kOp == 0 ? y[i] + x[i] : y[i] - x[i];
}
void Add(const float* HWY_RESTRICT x, float* HWY_RESTRICT y, size_t n) { AddSub<0>(x, y, n); }
void Subtract(const float* HWY_RESTRICT x, float* HWY_RESTRICT y, size_t n) {
  AddSub<1>(x, y, n);
}

void AddTo(const float* x, const float* y, float* out, size_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Add(hn::LoadU(d, x + i), hn::LoadU(d, y + i)), d, out + i);
  for (; i < n; ++i) out[i] = x[i] + y[i];
}

void Difference(const float* x, const float* y, float* out, size_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Sub(hn::LoadU(d, x + i), hn::LoadU(d, y + i)), d, out + i);
  for (; i < n; ++i) out[i] = x[i] - y[i];
}

void Scale(float* HWY_RESTRICT y, size_t n, float a) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const auto va = hn::Set(d, a);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, y + i), va), d, y + i);
  for (; i < n; ++i) y[i] *= a;
}

void ScaleAdd(const float* HWY_RESTRICT x, float* HWY_RESTRICT y, size_t n, float a) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const auto va = hn::Set(d, a);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::MulAdd(hn::LoadU(d, y + i), va, hn::LoadU(d, x + i)), d, y + i);
  }
  for (; i < n; ++i) y[i] = y[i] * a + x[i];
}

void ClearWhere(const float* HWY_RESTRICT mask, float* HWY_RESTRICT y, size_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const auto zero = hn::Zero(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto sent = hn::Ne(hn::LoadU(d, mask + i), zero);
    hn::StoreU(hn::IfThenZeroElse(sent, hn::LoadU(d, y + i)), d, y + i);
  }
  for (; i < n; ++i) y[i] = mask[i] != 0.0f ? 0.0f : y[i];
}

void DivideTo(const float* x, float divisor, float* out, size_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const auto vd = hn::Set(d, divisor);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Div(hn::LoadU(d, x + i), vd), d, out + i);
  for (; i < n; ++i) out[i] = x[i] / divisor;
}

bool CopyFinite(const float* HWY_RESTRICT x, float* HWY_RESTRICT out, size_t n) {
  const DF d;
  const DU du;
  const size_t N = hn::Lanes(d);
  auto e = hn::Zero(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    auto v = hn::LoadU(d, x + i);
    e = TrackExponent(e, v);
    hn::StoreU(v, d, out + i);
  }
  bool ok = ExponentAllFinite(e);
  for (; i < n; ++i) {
    ok &= (x[i] - x[i]) == 0.0f;
    out[i] = x[i];
  }
  return ok;
}

bool StoreOrAdd(const float* HWY_RESTRICT x, float* HWY_RESTRICT y, size_t n, bool accumulate) {
  const DF d;
  const DU du;
  const size_t N = hn::Lanes(d);
  auto e = hn::Zero(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    auto v = hn::LoadU(d, x + i);
    e = TrackExponent(e, v);
    hn::StoreU(accumulate ? hn::Add(v, hn::LoadU(d, y + i)) : v, d, y + i);
  }
  bool ok = ExponentAllFinite(e);
  for (; i < n; ++i) {
    ok &= (x[i] - x[i]) == 0.0f;
    y[i] = accumulate ? y[i] + x[i] : x[i];
  }
  return ok;
}

// ---- half precision ----

bool ToFp16(const float* HWY_RESTRICT x, uint16_t* HWY_RESTRICT out, size_t n) {
  const DF d;
  const DU du;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const size_t N = hn::Lanes(d);
  const auto lim = hn::Set(d, 65504.0f);
  auto e = hn::Zero(du);
  size_t i = 0;
  auto* o = reinterpret_cast<hwy::float16_t*>(out);
  for (; i + N <= n; i += N) {
    auto v = hn::LoadU(d, x + i);
    e = TrackExponent(e, v);
    hn::StoreU(hn::DemoteTo(dh, hn::Min(hn::Max(v, hn::Neg(lim)), lim)), dh, o + i);
  }
  bool ok = ExponentAllFinite(e);
  if (i < n) {
    // Tail through a padded vector so rounding is identical to the main loop.
    HWY_ALIGN float buf[hn::MaxLanes(d)] = {};
    HWY_ALIGN hwy::float16_t hb[hn::MaxLanes(d)];
    for (size_t j = i; j < n; ++j) {
      buf[j - i] = x[j];
      ok &= (x[j] - x[j]) == 0.0f;
    }
    auto v = hn::Load(d, buf);
    hn::Store(hn::DemoteTo(dh, hn::Min(hn::Max(v, hn::Neg(lim)), lim)), dh, hb);
    for (size_t j = i; j < n; ++j) o[j] = hb[j - i];
  }
  return ok;
}

bool FromFp16(const uint16_t* HWY_RESTRICT in, float* HWY_RESTRICT y, size_t n, bool accumulate) {
  const DF d;
  const DU du;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const size_t N = hn::Lanes(d);
  const auto* h = reinterpret_cast<const hwy::float16_t*>(in);
  auto e = hn::Zero(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    auto v = hn::PromoteTo(d, hn::LoadU(dh, h + i));
    e = TrackExponent(e, v);
    if (accumulate) v = hn::Add(v, hn::LoadU(d, y + i));
    hn::StoreU(v, d, y + i);
  }
  bool ok = ExponentAllFinite(e);
  if (i < n) {
    HWY_ALIGN hwy::float16_t hb[hn::MaxLanes(d)] = {};
    HWY_ALIGN float buf[hn::MaxLanes(d)];
    for (size_t j = i; j < n; ++j) hb[j - i] = h[j];
    hn::Store(hn::PromoteTo(d, hn::Load(dh, hb)), d, buf);
    for (size_t j = i; j < n; ++j) {
      ok &= (buf[j - i] - buf[j - i]) == 0.0f;
      y[j] = accumulate ? y[j] + buf[j - i] : buf[j - i];
    }
  }
  return ok;
}

// bfloat16 by integer arithmetic so rounding is round-to-nearest-even on every target.
HWY_INLINE hn::Vec<DU> Bf16Bits(hn::Vec<DF> v) {
  const DF d;
  const DU du;
  // Saturate to the largest finite bfloat16 (0x7f7f0000) so rounding cannot overflow to Inf.
  const auto lim = hn::BitCast(d, hn::Set(du, 0x7f7f0000u));
  v = hn::Min(hn::Max(v, hn::Neg(lim)), lim);
  auto u = hn::BitCast(du, v);
  auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
  return hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7fffu), lsb)));
}

bool ToBf16(const float* HWY_RESTRICT x, uint16_t* HWY_RESTRICT out, size_t n) {
  const DF d;
  const DU du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> d16;
  const size_t N = hn::Lanes(d);
  auto e = hn::Zero(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    auto v = hn::LoadU(d, x + i);
    e = TrackExponent(e, v);
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, Bf16Bits(v))), d16, out + i);
  }
  bool ok = ExponentAllFinite(e);
  if (i < n) {
    HWY_ALIGN float buf[hn::MaxLanes(d)] = {};
    HWY_ALIGN uint16_t hb[hn::MaxLanes(d)];
    for (size_t j = i; j < n; ++j) {
      buf[j - i] = x[j];
      ok &= (x[j] - x[j]) == 0.0f;
    }
    hn::Store(hn::DemoteTo(d16, hn::BitCast(di, Bf16Bits(hn::Load(d, buf)))), d16, hb);
    for (size_t j = i; j < n; ++j) out[j] = hb[j - i];
  }
  return ok;
}

bool FromBf16(const uint16_t* HWY_RESTRICT in, float* HWY_RESTRICT y, size_t n, bool accumulate) {
  const DF d;
  const DU du;
  const hn::Rebind<uint16_t, DF> d16;
  const size_t N = hn::Lanes(d);
  auto e = hn::Zero(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    auto v = hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, in + i))));
    e = TrackExponent(e, v);
    if (accumulate) v = hn::Add(v, hn::LoadU(d, y + i));
    hn::StoreU(v, d, y + i);
  }
  bool ok = ExponentAllFinite(e);
  for (; i < n; ++i) {
    uint32_t b = static_cast<uint32_t>(in[i]) << 16;
    ok &= (b & 0x7f800000u) != 0x7f800000u;
    float f;
    __builtin_memcpy(&f, &b, 4);
    y[i] = accumulate ? y[i] + f : f;
  }
  return ok;
}

}  // namespace HWY_NAMESPACE
}  // namespace terse::kit
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <fmt/format.h>

#include "terse/error.h"

namespace terse::kit {

HWY_EXPORT(FindNonFinite);
HWY_EXPORT(AbsMax);
HWY_EXPORT(SumAndSquares);
HWY_EXPORT(MinMaxOf);
HWY_EXPORT(Add);
HWY_EXPORT(Subtract);
HWY_EXPORT(AddTo);
HWY_EXPORT(Scale);
HWY_EXPORT(ScaleAdd);
HWY_EXPORT(ClearWhere);
HWY_EXPORT(Difference);
HWY_EXPORT(DivideTo);
HWY_EXPORT(CopyFinite);
HWY_EXPORT(StoreOrAdd);
HWY_EXPORT(ToFp16);
HWY_EXPORT(FromFp16);
HWY_EXPORT(ToBf16);
HWY_EXPORT(FromBf16);

std::size_t find_non_finite(std::span<const float> x) {
  return HWY_DYNAMIC_DISPATCH(FindNonFinite)(x.data(), x.size());
}

void throw_non_finite(std::span<const float> x, std::string_view what) {
  std::size_t i = find_non_finite(x);
  throw InvalidArgument(fmt::format("terse: {}: input element {} of {} is {} (NaN and Inf are "
                                    "rejected; check the loss scale or clip gradients)",
                                    what, i, x.size(), i < x.size() ? fmt::format("{}", x[i]) : "?"));
}

void check_finite(std::span<const float> x, std::string_view what) {
  if (find_non_finite(x) != x.size()) throw_non_finite(x, what);
}

float abs_max(std::span<const float> x) {
  return x.empty() ? 0.0f : HWY_DYNAMIC_DISPATCH(AbsMax)(x.data(), x.size());
}

double sum(std::span<const float> x) {
  double s = 0, q = 0;
  HWY_DYNAMIC_DISPATCH(SumAndSquares)(x.data(), x.size(), &s, &q);
  return s;
}

double sum_squares(std::span<const float> x) {
  double s = 0, q = 0;
  HWY_DYNAMIC_DISPATCH(SumAndSquares)(x.data(), x.size(), &s, &q);
  return q;
}

MinMax min_max(std::span<const float> x) {
  MinMax m;
  if (!x.empty()) HWY_DYNAMIC_DISPATCH(MinMaxOf)(x.data(), x.size(), &m.min, &m.max);
  return m;
}

void add(std::span<const float> x, std::span<float> y) {
  HWY_DYNAMIC_DISPATCH(Add)(x.data(), y.data(), y.size());
}
void subtract(std::span<const float> x, std::span<float> y) {
  HWY_DYNAMIC_DISPATCH(Subtract)(x.data(), y.data(), y.size());
}
void add_to(std::span<const float> x, std::span<const float> y, std::span<float> out) {
  HWY_DYNAMIC_DISPATCH(AddTo)(x.data(), y.data(), out.data(), out.size());
}
void difference(std::span<const float> x, std::span<const float> y, std::span<float> out) {
  HWY_DYNAMIC_DISPATCH(Difference)(x.data(), y.data(), out.data(), out.size());
}
void divide_to(std::span<const float> x, float divisor, std::span<float> out) {
  HWY_DYNAMIC_DISPATCH(DivideTo)(x.data(), divisor, out.data(), out.size());
}
void scale(std::span<float> y, float a) { HWY_DYNAMIC_DISPATCH(Scale)(y.data(), y.size(), a); }
void scale_add(std::span<const float> x, std::span<float> y, float a) {
  HWY_DYNAMIC_DISPATCH(ScaleAdd)(x.data(), y.data(), y.size(), a);
}
void clear_where(std::span<const float> mask, std::span<float> y) {
  HWY_DYNAMIC_DISPATCH(ClearWhere)(mask.data(), y.data(), y.size());
}
bool copy_finite(std::span<const float> x, float* out) {
  return HWY_DYNAMIC_DISPATCH(CopyFinite)(x.data(), out, x.size());
}
bool store_or_add(const float* x, std::span<float> y, bool accumulate) {
  return HWY_DYNAMIC_DISPATCH(StoreOrAdd)(x, y.data(), y.size(), accumulate);
}
bool to_fp16(std::span<const float> x, std::uint16_t* out) {
  return HWY_DYNAMIC_DISPATCH(ToFp16)(x.data(), out, x.size());
}
bool from_fp16(const std::uint16_t* in, std::span<float> y, bool accumulate) {
  return HWY_DYNAMIC_DISPATCH(FromFp16)(in, y.data(), y.size(), accumulate);
}
bool to_bf16(std::span<const float> x, std::uint16_t* out) {
  return HWY_DYNAMIC_DISPATCH(ToBf16)(x.data(), out, x.size());
}
bool from_bf16(const std::uint16_t* in, std::span<float> y, bool accumulate) {
  return HWY_DYNAMIC_DISPATCH(FromBf16)(in, y.data(), y.size(), accumulate);
}

}  // namespace terse::kit
#endif  // HWY_ONCE
