// Highway dynamic dispatch (see basic.cpp): compiled once per target instruction set; the
// HWY_ONCE section exports the plain C++ API of random.h. Every kernel computes bit-identical
// results on every target: the hash is integer arithmetic, each float result is one IEEE
// operation, sums run in a fixed order over a fixed number of double lanes, and tails go
// through the same vector code on a padded block.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kit/random.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cfloat>
#include <cmath>

#include "kit/random.h"

HWY_BEFORE_NAMESPACE();
namespace terse::kit {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// At most 16 lanes, so a lane count always divides the 16-byte groups of the packed layout.
using DF = hn::CappedTag<float, 16>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using VU = hn::Vec<DU>;
using VI = hn::Vec<DI>;
constexpr std::size_t kMaxLanes = 16;

HWY_INLINE VU HashRound(VU x) {
  const DU du;
  x = hn::Xor(x, hn::ShiftRight<16>(x));
  x = x * hn::Set(du, 0x21f0aaadu);
  x = hn::Xor(x, hn::ShiftRight<15>(x));
  x = x * hn::Set(du, 0x735a2d97u);
  return hn::Xor(x, hn::ShiftRight<15>(x));
}

// Random bits for consecutive indices, one vector at a time; caches the key of the current
// 2^32-element segment.
class Stream {
 public:
  explicit Stream(std::uint64_t key) : key_(key) { SetHigh(0); }

  // random_bits(key, index + lane) for each lane.
  HWY_INLINE VU Bits(std::uint64_t index) {
    const DU du;
    const std::size_t N = hn::Lanes(du);
    const std::uint32_t lo = static_cast<std::uint32_t>(index);
    if (HWY_UNLIKELY(lo > 0xffffffffu - (N - 1))) return Straddling(index);
    if (HWY_UNLIKELY((index >> 32) != high_)) SetHigh(index >> 32);
    auto idx = hn::Add(hn::Iota(du, 0), hn::Set(du, lo));
    return HashRound(hn::Add(HashRound(hn::Xor(idx, k0_)), k1_));
  }

  // Uniform in [0, 1) with 24 bits, as uniform_at().
  static HWY_INLINE VF Uniform(VU bits) {
    const DF df;
    const DI di;
    return hn::Mul(hn::ConvertTo(df, hn::BitCast(di, hn::ShiftRight<8>(bits))),
                   hn::Set(df, 1.0f / 16777216.0f));
  }

 private:
  void SetHigh(std::uint64_t high) {
    const DU du;
    high_ = high;
    std::uint64_t k = segment_key(key_, high);
    k0_ = hn::Set(du, static_cast<std::uint32_t>(k));
    k1_ = hn::Set(du, static_cast<std::uint32_t>(k >> 32));
  }
  // A vector whose lanes cross a 2^32 boundary: computed lane by lane.
  HWY_NOINLINE VU Straddling(std::uint64_t index) {
    const DU du;
    HWY_ALIGN std::uint32_t buf[kMaxLanes];
    for (std::size_t j = 0; j < hn::Lanes(du); ++j) buf[j] = random_bits(key_, index + j);
    return hn::Load(du, buf);
  }

  std::uint64_t key_;
  std::uint64_t high_ = 0;
  VU k0_, k1_;
};

void Uniform(std::uint64_t key, std::uint64_t first, float* HWY_RESTRICT out, std::size_t n) {
  const DF df;
  const std::size_t N = hn::Lanes(df);
  Stream s(key);
  std::size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(Stream::Uniform(s.Bits(first + i)), df, out + i);
  if (i < n) {
    HWY_ALIGN float buf[kMaxLanes];
    hn::Store(Stream::Uniform(s.Bits(first + i)), df, buf);
    for (std::size_t j = i; j < n; ++j) out[j] = buf[j - i];
  }
}

// ---- Random-k ----

// (a * b) >> 32 in every lane.
HWY_INLINE VU MulHigh32(VU a, VU b) {
  const DU du;
#if HWY_TARGET == HWY_SCALAR
  const std::uint64_t product = std::uint64_t{hn::GetLane(a)} * hn::GetLane(b);
  return hn::Set(du, static_cast<std::uint32_t>(product >> 32));
#else
  // The even lanes' 64-bit products keep their high halves in the low half of each 64-bit lane;
  // the odd lanes' (moved down first) in the high half.
  const hn::Repartition<std::uint64_t, DU> d64;
  const auto even = hn::ShiftRight<32>(hn::MulEven(a, b));
  const auto odd = hn::MulEven(hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(d64, a))),
                               hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(d64, b))));
  return hn::Or(hn::BitCast(du, even),
                hn::BitCast(du, hn::And(odd, hn::Set(d64, 0xffffffff00000000ull))));
#endif
}

// b_j + o_j (see random.h) for the lanes j0 .. j0 + N - 1.
HWY_INLINE VU RandomKPositions(Stream& s, std::uint32_t j0, VU q, VU r) {
  const DU du;
  const auto j = hn::Add(hn::Iota(du, 0), hn::Set(du, j0));
  const auto start = hn::Add(j * q, hn::Min(j, r));
  const auto len = hn::Sub(q, hn::VecFromMask(du, hn::Lt(j, r)));  // q + 1 where j < r
  return hn::Add(start, MulHigh32(s.Bits(j0), len));
}

// Writes b_j + o_j + shift (mod 2^32) for j in [j0, j1) to out[0 .. j1 - j0).
void RandomKRange(Stream& s, std::uint32_t j0, std::uint32_t j1, std::uint32_t q,
                  std::uint32_t r, std::uint32_t shift, std::uint32_t* HWY_RESTRICT out) {
  const DU du;
  const std::size_t N = hn::Lanes(du);
  const auto vq = hn::Set(du, q), vr = hn::Set(du, r), vs = hn::Set(du, shift);
  std::size_t i = 0;
  const std::size_t count = j1 - j0;
  for (; i + N <= count; i += N) {
    hn::StoreU(hn::Add(RandomKPositions(s, static_cast<std::uint32_t>(j0 + i), vq, vr), vs), du,
               out + i);
  }
  if (i < count) {
    HWY_ALIGN std::uint32_t buf[kMaxLanes];
    const auto last = RandomKPositions(s, static_cast<std::uint32_t>(j0 + i), vq, vr);
    hn::Store(hn::Add(last, vs), du, buf);
    for (std::size_t t = i; t < count; ++t) out[t] = buf[t - i];
  }
}

void RandomKIndices(std::uint64_t key, std::size_t n, std::size_t k,
                    std::uint32_t* HWY_RESTRICT out) {
  const std::uint64_t c = random_k_rotation(key, n);
  const std::uint64_t t = n - c;  // rotated positions >= t wrap around to the front
  const std::uint64_t q = n / k, r = n % k;
  const std::uint64_t block_key = random_k_block_key(key);
  // w = the blocks whose position does not wrap: all below the block holding t, plus that
  // block if its offset lands before t.
  std::uint64_t w = k;
  if (t < n) {
    const std::uint64_t j = t < r * (q + 1) ? t / (q + 1) : r + (t - r * (q + 1)) / q;
    const std::uint64_t b = j * q + (j < r ? j : r), len = q + (j < r ? 1 : 0);
    const std::uint64_t o = (std::uint64_t{random_bits(block_key, j)} * len) >> 32;
    w = j + (b + o < t ? 1 : 0);
  }
  Stream s(block_key);
  const auto q32 = static_cast<std::uint32_t>(q), r32 = static_cast<std::uint32_t>(r);
  RandomKRange(s, static_cast<std::uint32_t>(w), static_cast<std::uint32_t>(k), q32, r32,
               static_cast<std::uint32_t>(0 - t), out);
  RandomKRange(s, 0, static_cast<std::uint32_t>(w), q32, r32, static_cast<std::uint32_t>(c),
               out + (k - w));
}

// ---- Levels ----

struct LevelParams {
  VF pre, mult, sf;
  VI si;
};

// The signed level of each lane, offset by s: 0 .. 2s.
HWY_INLINE VI LevelCode(VF x, const LevelParams& p, VU bits) {
  const DF df;
  const DI di;
  auto u = Stream::Uniform(bits);
  auto a = hn::Min(hn::Mul(hn::Mul(hn::Abs(x), p.pre), p.mult), p.sf);
  auto fl = hn::Floor(a);
  auto up = hn::Lt(u, hn::Sub(a, fl));
  auto l = hn::Sub(hn::ConvertTo(di, fl), hn::VecFromMask(di, hn::RebindMask(di, up)));
  auto neg = hn::Lt(hn::BitCast(di, x), hn::Zero(di));
  (void)df;
  return hn::IfThenElse(neg, hn::Sub(p.si, l), hn::Add(p.si, l));
}

struct BucketStats {
  std::uint32_t max_bits = 0;  // max of |x| as integer bits; >= 0x7f800000 iff non-finite
  double sum = 0, sum_squares = 0;
};

// Sums in double over 8 fixed lanes (four 2-lane vectors) so every target adds in the same
// order; squares of floats are exact in double, so only the additions round.
template <bool kSums>
BucketStats Stats(const float* HWY_RESTRICT x, std::size_t n) {
  const DF df;
  const DU du;
  const std::size_t N = hn::Lanes(df);
  BucketStats st;
  auto mx = hn::Zero(du);
  const auto abs_mask = hn::Set(du, 0x7fffffffu);
  std::size_t i = 0;
  for (; i + N <= n; i += N) mx = hn::Max(mx, hn::And(hn::BitCast(du, hn::LoadU(df, x + i)), abs_mask));
  std::uint32_t m = hn::GetLane(hn::MaxOfLanes(du, mx));
  for (; i < n; ++i) {
    std::uint32_t b;
    __builtin_memcpy(&b, x + i, 4);
    b &= 0x7fffffffu;
    m = b > m ? b : m;
  }
  st.max_bits = m;
  if constexpr (kSums) {
    if (m >= 0x7f800000u) return st;
    const hn::CappedTag<double, 2> dd;
    const hn::Rebind<float, decltype(dd)> df2;
    auto q0 = hn::Zero(dd), q1 = q0, q2 = q0, q3 = q0;
    auto s0 = q0, s1 = q0, s2 = q0, s3 = q0;
    std::size_t j = 0;
    if (hn::Lanes(dd) == 2) {
      for (; j + 8 <= n; j += 8) {
        auto v0 = hn::PromoteTo(dd, hn::LoadU(df2, x + j));
        auto v1 = hn::PromoteTo(dd, hn::LoadU(df2, x + j + 2));
        auto v2 = hn::PromoteTo(dd, hn::LoadU(df2, x + j + 4));
        auto v3 = hn::PromoteTo(dd, hn::LoadU(df2, x + j + 6));
        q0 = hn::Add(q0, hn::Mul(v0, v0));
        q1 = hn::Add(q1, hn::Mul(v1, v1));
        q2 = hn::Add(q2, hn::Mul(v2, v2));
        q3 = hn::Add(q3, hn::Mul(v3, v3));
        s0 = hn::Add(s0, v0);
        s1 = hn::Add(s1, v1);
        s2 = hn::Add(s2, v2);
        s3 = hn::Add(s3, v3);
      }
    }
    HWY_ALIGN double lq[8], ls[8];
    hn::Store(q0, dd, lq), hn::Store(q1, dd, lq + 2), hn::Store(q2, dd, lq + 4),
        hn::Store(q3, dd, lq + 6);
    hn::Store(s0, dd, ls), hn::Store(s1, dd, ls + 2), hn::Store(s2, dd, ls + 4),
        hn::Store(s3, dd, ls + 6);
    double q = 0, s = 0;
    for (int k = 0; k < 8; ++k) q += lq[k], s += ls[k];
    for (; j < n; ++j) {
      double v = x[j];
      q += v * v;
      s += v;
    }
    st.sum = s;
    st.sum_squares = q;
  }
  return st;
}

HWY_INLINE float AsFloat(std::uint32_t bits) {
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Quantizes one bucket of n elements with the given scale into its packed codes.
void QuantizeBucket(const float* HWY_RESTRICT x, std::size_t n, float norm, int levels,
                    int width, Stream& stream, std::uint64_t first, std::uint8_t* HWY_RESTRICT out) {
  const DF df;
  const DI di;
  const std::size_t N = hn::Lanes(df);
  LevelParams p;
  float pre = 1.0f, mult = 0.0f;
  if (norm > 0) {
    // Scale tiny norms up first so s / norm stays finite; powers of two scale exactly.
    if (norm < 0x1p-100f) pre = 0x1p100f;
    mult = static_cast<float>(static_cast<double>(levels) / (static_cast<double>(norm) * pre));
  }
  p.pre = hn::Set(df, pre);
  p.mult = hn::Set(df, mult);
  p.sf = hn::Set(df, static_cast<float>(levels));
  p.si = hn::Set(di, levels);

  const std::size_t per = width < 16 ? static_cast<std::size_t>(8 / width) : 1;
  const std::size_t block = 16 * per;
  std::size_t b0 = 0;
  if (width == 16) {
    const hn::Rebind<std::uint16_t, DI> d16;
    auto* o = reinterpret_cast<std::uint16_t*>(out);
    for (; b0 + N <= n; b0 += N) {
      auto c = LevelCode(hn::LoadU(df, x + b0), p, stream.Bits(first + b0));
      hn::StoreU(hn::DemoteTo(d16, c), d16, o + b0);
    }
  } else {
    const hn::Rebind<std::uint8_t, DI> d8;
    for (; b0 + block <= n; b0 += block) {
      std::uint8_t* ob = out + (b0 / block) * 16;
      for (std::size_t j = 0; j < 16; j += N) {
        auto acc = LevelCode(hn::LoadU(df, x + b0 + j), p, stream.Bits(first + b0 + j));
        for (std::size_t m = 1; m < per; ++m) {
          std::size_t at = b0 + j + 16 * m;
          auto c = LevelCode(hn::LoadU(df, x + at), p, stream.Bits(first + at));
          acc = hn::Or(acc, hn::ShiftLeftSame(c, static_cast<int>(width * m)));
        }
        hn::StoreU(hn::DemoteTo(d8, acc), d8, ob + j);
      }
    }
  }
  if (b0 == n) return;
  // Partial block: the same vector code on a zero-padded copy, then packed sequentially.
  const std::size_t r = n - b0;
  HWY_ALIGN float buf[128] = {};
  HWY_ALIGN std::int32_t codes[128];
  for (std::size_t k = 0; k < r; ++k) buf[k] = x[b0 + k];
  for (std::size_t k = 0; k < r; k += N) {
    hn::Store(LevelCode(hn::Load(df, buf + k), p, stream.Bits(first + b0 + k)), di, codes + k);
  }
  if (width == 16) {
    for (std::size_t k = 0; k < r; ++k) {
      std::uint16_t c = static_cast<std::uint16_t>(codes[k]);
      __builtin_memcpy(out + 2 * (b0 + k), &c, 2);
    }
    return;
  }
  std::uint8_t* ob = out + (b0 / block) * 16;
  for (std::size_t k = 0; k < (r + per - 1) / per; ++k) ob[k] = 0;
  for (std::size_t k = 0; k < r; ++k) {
    ob[k / per] = static_cast<std::uint8_t>(ob[k / per] | codes[k] << (width * (k % per)));
  }
}

bool QuantizeLevels(const LevelQuantizer& q, const float* HWY_RESTRICT x, std::size_t n,
                    std::uint64_t key, std::uint64_t first, std::uint8_t* HWY_RESTRICT norms,
                    std::uint8_t* HWY_RESTRICT codes) {
  const std::size_t bucket = q.bucket == 0 ? (n == 0 ? 1 : n) : q.bucket;
  Stream stream(key);
  std::size_t b = 0;
  for (std::size_t start = 0; start < n; start += bucket, ++b) {
    const std::size_t len = n - start < bucket ? n - start : bucket;
    const float* xb = x + start;
    float norm;
    if (q.norm == BucketNorm::kL2) {
      auto st = Stats<true>(xb, len);
      if (st.max_bits >= 0x7f800000u) return false;
      double r = std::sqrt(st.sum_squares);
      norm = r > FLT_MAX ? FLT_MAX : static_cast<float>(r);
      // The rounded norm may fall below max |x|; levels are clamped to s then.
    } else if (q.clip > 0) {
      auto st = Stats<true>(xb, len);
      if (st.max_bits >= 0x7f800000u) return false;
      double mean = st.sum / static_cast<double>(len);
      double var = st.sum_squares / static_cast<double>(len) - mean * mean;
      double limit = q.clip * std::sqrt(var > 0 ? var : 0.0);
      norm = AsFloat(st.max_bits);
      if (limit < norm) norm = static_cast<float>(limit);
    } else {
      auto st = Stats<false>(xb, len);
      if (st.max_bits >= 0x7f800000u) return false;
      norm = AsFloat(st.max_bits);
    }
    __builtin_memcpy(norms + 4 * b, &norm, 4);
    QuantizeBucket(xb, len, norm, q.levels, q.width, stream, first + start, codes);
    codes += packed_bytes(len, q.width);
  }
  return true;
}

// Largest step such that levels * step stays finite.
HWY_INLINE float LevelStep(float norm, int levels) {
  float step = norm / static_cast<float>(levels);
  while (static_cast<double>(step) * levels > FLT_MAX) step = std::nextafter(step, 0.0f);
  return step;
}

bool DequantizeLevels(const LevelQuantizer& q, const std::uint8_t* HWY_RESTRICT codes,
                      const std::uint8_t* HWY_RESTRICT norms, float* HWY_RESTRICT y, std::size_t n,
                      bool accumulate) {
  const DF df;
  const DI di;
  const std::size_t N = hn::Lanes(df);
  const std::size_t bucket = q.bucket == 0 ? (n == 0 ? 1 : n) : q.bucket;
  const int width = q.width;
  const std::size_t per = width < 16 ? static_cast<std::size_t>(8 / width) : 1;
  const std::size_t block = 16 * per;
  const std::int32_t max_code = 2 * q.levels;
  const std::int32_t mask = width == 16 ? 0xffff : (1 << width) - 1;
  const auto si = hn::Set(di, q.levels);
  const auto vmask = hn::Set(di, mask);
  auto worst = hn::Zero(di);
  std::int32_t worst_tail = 0;
  std::size_t b = 0;
  for (std::size_t start = 0; start < n; start += bucket, ++b) {
    const std::size_t len = n - start < bucket ? n - start : bucket;
    float* yb = y + start;
    float norm;
    __builtin_memcpy(&norm, norms + 4 * b, 4);
    if (!(norm >= 0.0f && norm <= FLT_MAX)) return false;
    const float step = LevelStep(norm, q.levels);
    const auto vstep = hn::Set(df, step);
    auto emit = [&](VI code, float* dst) HWY_ATTR {
      worst = hn::Max(worst, code);
      auto v = hn::Mul(hn::ConvertTo(df, hn::Sub(code, si)), vstep);
      if (accumulate) v = hn::Add(v, hn::LoadU(df, dst));
      hn::StoreU(v, df, dst);
    };
    std::size_t b0 = 0;
    if (width == 16) {
      const hn::Rebind<std::uint16_t, DI> d16;
      const auto* c16 = reinterpret_cast<const std::uint16_t*>(codes);
      for (; b0 + N <= len; b0 += N) emit(hn::PromoteTo(di, hn::LoadU(d16, c16 + b0)), yb + b0);
    } else {
      const hn::Rebind<std::uint8_t, DI> d8;
      for (; b0 + block <= len; b0 += block) {
        const std::uint8_t* cb = codes + (b0 / block) * 16;
        for (std::size_t j = 0; j < 16; j += N) {
          auto packed = hn::PromoteTo(di, hn::LoadU(d8, cb + j));
          for (std::size_t m = 0; m < per; ++m) {
            auto c = hn::And(hn::ShiftRightSame(packed, static_cast<int>(width * m)), vmask);
            emit(c, yb + b0 + j + 16 * m);
          }
        }
      }
    }
    for (std::size_t k = b0; k < len; ++k) {
      std::int32_t c;
      if (width == 16) {
        std::uint16_t v;
        __builtin_memcpy(&v, codes + 2 * k, 2);
        c = v;
      } else {
        c = (codes[k / per] >> (width * (k % per))) & mask;
      }
      worst_tail = c > worst_tail ? c : worst_tail;
      float v = static_cast<float>(c - q.levels) * step;
      yb[k] = accumulate ? yb[k] + v : v;
    }
    codes += packed_bytes(len, width);
  }
  std::int32_t w = hn::GetLane(hn::MaxOfLanes(di, worst));
  return w <= max_code && worst_tail <= max_code;
}

// ---- Natural compression ----

int NaturalTop(const float* HWY_RESTRICT x, std::size_t n) {
  std::uint32_t m = Stats<false>(x, n).max_bits;
  if (m >= 0x7f800000u) return -1;
  std::uint32_t top = (m + 0x7fffffu) >> 23;
  return top > 254 ? 254 : static_cast<int>(top);
}

HWY_INLINE VI NaturalCode(VF x, VU bits, VI low, VI low_minus_1, VF below_scale) {
  const DU du;
  const DI di;
  auto b = hn::BitCast(du, x);
  auto a = hn::And(b, hn::Set(du, 0x7fffffffu));
  auto e = hn::BitCast(di, hn::ShiftRight<23>(a));
  auto m = hn::BitCast(di, hn::And(a, hn::Set(du, 0x7fffffu)));
  // Inside the window: up with probability mantissa / 2^23, compared exactly on 23 bits.
  auto up = hn::Lt(hn::BitCast(di, hn::ShiftRight<9>(bits)), m);
  auto e2 = hn::Min(hn::Sub(e, hn::VecFromMask(di, up)), hn::Set(di, 254));
  auto c_in = hn::Sub(e2, low_minus_1);
  // Below it: 2^(low-127) with probability |x| / 2^(low-127).
  auto p = hn::Mul(hn::BitCast(DF(), a), below_scale);
  auto c_low = hn::IfThenElseZero(hn::RebindMask(di, hn::Lt(Stream::Uniform(bits), p)),
                                  hn::Set(di, 1));
  auto c = hn::IfThenElse(hn::Lt(e, low), c_low, c_in);
  auto sign = hn::BitCast(di, hn::ShiftLeft<7>(hn::ShiftRight<31>(b)));
  return hn::IfThenZeroElse(hn::Eq(c, hn::Zero(di)), hn::Or(c, sign));
}

void NaturalEncode(const float* HWY_RESTRICT x, std::size_t n, int low, std::uint64_t key,
                   std::uint64_t first, std::uint8_t* HWY_RESTRICT out) {
  const DF df;
  const DI di;
  const hn::Rebind<std::uint8_t, DI> d8;
  const std::size_t N = hn::Lanes(df);
  Stream s(key);
  const auto vlow = hn::Set(di, low), vlow1 = hn::Set(di, low - 1);
  const auto below = hn::Set(df, AsFloat(static_cast<std::uint32_t>(254 - low) << 23));
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    auto c = NaturalCode(hn::LoadU(df, x + i), s.Bits(first + i), vlow, vlow1, below);
    hn::StoreU(hn::DemoteTo(d8, c), d8, out + i);
  }
  if (i < n) {
    HWY_ALIGN float buf[kMaxLanes] = {};
    HWY_ALIGN std::uint8_t ob[kMaxLanes];
    for (std::size_t j = i; j < n; ++j) buf[j - i] = x[j];
    auto c = NaturalCode(hn::Load(df, buf), s.Bits(first + i), vlow, vlow1, below);
    hn::StoreU(hn::DemoteTo(d8, c), d8, ob);
    for (std::size_t j = i; j < n; ++j) out[j] = ob[j - i];
  }
}

HWY_INLINE VF NaturalValue(VI v, VI low_minus_1) {
  const DF df;
  const DI di;
  const DU du;
  auto c = hn::And(v, hn::Set(di, 127));
  auto sign = hn::ShiftLeft<24>(hn::BitCast(du, hn::And(v, hn::Set(di, 128))));  // bit 7 -> 31
  auto bits = hn::Or(sign, hn::ShiftLeft<23>(hn::BitCast(du, hn::Add(c, low_minus_1))));
  return hn::BitCast(df, hn::IfThenZeroElse(hn::RebindMask(du, hn::Eq(c, hn::Zero(di))), bits));
}

void NaturalDecode(const std::uint8_t* HWY_RESTRICT in, int low, float* HWY_RESTRICT y,
                   std::size_t n, bool accumulate) {
  const DF df;
  const DI di;
  const hn::Rebind<std::uint8_t, DI> d8;
  const std::size_t N = hn::Lanes(df);
  const auto vlow1 = hn::Set(di, low - 1);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    auto v = NaturalValue(hn::PromoteTo(di, hn::LoadU(d8, in + i)), vlow1);
    if (accumulate) v = hn::Add(v, hn::LoadU(df, y + i));
    hn::StoreU(v, df, y + i);
  }
  for (; i < n; ++i) {
    std::uint32_t c = in[i] & 127u;
    float v = 0.0f;
    if (c != 0) {
      v = AsFloat((static_cast<std::uint32_t>(in[i] & 128u) << 24) |
                  (static_cast<std::uint32_t>(c + static_cast<std::uint32_t>(low - 1)) << 23));
    }
    y[i] = accumulate ? y[i] + v : v;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace terse::kit
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace terse::kit {

HWY_EXPORT(Uniform);
HWY_EXPORT(RandomKIndices);
HWY_EXPORT(QuantizeLevels);
HWY_EXPORT(DequantizeLevels);
HWY_EXPORT(NaturalTop);
HWY_EXPORT(NaturalEncode);
HWY_EXPORT(NaturalDecode);

void uniform(std::uint64_t key, std::uint64_t first_index, std::span<float> out) {
  HWY_DYNAMIC_DISPATCH(Uniform)(key, first_index, out.data(), out.size());
}

void random_k_indices(std::uint64_t key, std::size_t n, std::size_t k, std::uint32_t* out) {
  if (k == 0) return;
  HWY_DYNAMIC_DISPATCH(RandomKIndices)(key, n, k, out);
}

bool quantize_levels(const LevelQuantizer& q, std::span<const float> x, std::uint64_t key,
                     std::uint64_t first_index, std::byte* norms, std::uint8_t* codes) {
  return HWY_DYNAMIC_DISPATCH(QuantizeLevels)(q, x.data(), x.size(), key, first_index,
                                              reinterpret_cast<std::uint8_t*>(norms), codes);
}

bool dequantize_levels(const LevelQuantizer& q, const std::uint8_t* codes, const std::byte* norms,
                       std::span<float> y, bool accumulate) {
  return HWY_DYNAMIC_DISPATCH(DequantizeLevels)(
      q, codes, reinterpret_cast<const std::uint8_t*>(norms), y.data(), y.size(), accumulate);
}

int natural_top_exponent(std::span<const float> x) {
  return x.empty() ? 0 : HWY_DYNAMIC_DISPATCH(NaturalTop)(x.data(), x.size());
}

void natural_encode(std::span<const float> x, int low, std::uint64_t key,
                    std::uint64_t first_index, std::uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(NaturalEncode)(x.data(), x.size(), low, key, first_index, out);
}

void natural_decode(const std::uint8_t* in, int low, std::span<float> y, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(NaturalDecode)(in, low, y.data(), y.size(), accumulate);
}

}  // namespace terse::kit
#endif  // HWY_ONCE
