// Highway dynamic dispatch of the sparse primitives in sparse.h: this file is compiled once per
// target instruction set by foreach_target.h; the HWY_ONCE section exports the plain C++ API.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kit/sparse.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cfloat>
#include <cmath>
#include <cstring>

#include "kit/random.h"
#include "kit/sparse.h"

// Target-independent pieces, compiled once although foreach_target.h includes this file again
// for every target.
#ifndef TERSE_KIT_SPARSE_SHARED
#define TERSE_KIT_SPARSE_SHARED
namespace terse::kit::detail {

// Inputs up to this size are cut exactly with no sample: three passes over data in cache.
constexpr std::size_t kExactLimit = std::size_t{1} << 17;
constexpr std::uint64_t kSampleKey = 0x746f706b73616d70ull;  // fixed: only speed depends on it

// Sample size and the sample ranks bracketing the k-th largest key. With p = k/n, the number of
// sample keys at or above the true k-th key is Binomial(S, p): mean mu, sd <= sqrt(mu). Ranks
// mu +- (4 sd + 8) miss it with probability below 1e-4; a miss costs time, never exactness.
struct Plan {
  std::size_t samples = 0, rank_low = 0, rank_high = 0, capacity = 0;
};
inline Plan plan_for(std::size_t n, std::size_t k) {
  Plan p;
  p.samples = n / 8 < 65536 ? n / 8 : 65536;
  const double mu =
      static_cast<double>(k) * static_cast<double>(p.samples) / static_cast<double>(n);
  const double margin = 4 * std::sqrt(mu) + 8;
  const double low = std::ceil(mu + margin), high = std::floor(mu - margin);
  p.rank_low = low >= static_cast<double>(p.samples) ? p.samples : static_cast<std::size_t>(low);
  p.rank_high = high < 1 ? 0 : static_cast<std::size_t>(high);
  // Keys expected inside the bracket, twice over, plus room for small samples' noise.
  const double inside = static_cast<double>(p.rank_low - p.rank_high + 1) * static_cast<double>(n) /
                        static_cast<double>(p.samples);
  const double cap = 2 * inside + 4096;
  p.capacity = cap >= static_cast<double>(n) ? n : static_cast<std::size_t>(cap);
  return p;
}

}  // namespace terse::kit::detail
#endif  // TERSE_KIT_SPARSE_SHARED

HWY_BEFORE_NAMESPACE();
namespace terse::kit {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using VF = hn::Vec<DF>;
using VU = hn::Vec<DU>;

constexpr uint32_t kAbsMask = 0x7fffffffu;

HWY_INLINE uint32_t KeyOf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b & kAbsMask;
}
HWY_INLINE VU Keys(VF v) { return hn::And(hn::BitCast(DU(), v), hn::Set(DU(), kAbsMask)); }
// Lane indices i .. i+N-1 (n <= 2^32, so they fit).
HWY_INLINE VU IndexVec(size_t i) {
  const DU du;
  return hn::Add(hn::Iota(du, 0), hn::Set(du, static_cast<uint32_t>(i)));
}

// Appends the mask's lanes of v at p; returns how many. Compresses in a register and stores the
// whole vector (so up to N lanes past the count are written: the callers' kSelectSlack), as the
// memory form of vpcompress is microcoded and very slow on AMD Zen 4.
template <class D, class M>
HWY_INLINE size_t Append(D d, hn::Vec<D> v, M m, hn::TFromD<D>* HWY_RESTRICT p) {
  hn::StoreU(hn::Compress(v, m), d, p);
  return hn::CountTrue(d, m);
}

// ---- radix select ------------------------------------------------------------------------

// The cut keeping the k largest of n 31-bit keys (1 <= k <= n): digits of 11, 11 and 9 bits
// from the top, one counting pass each over the keys that share the digits found so far. Four
// interleaved histograms keep runs of equal digits from serialising on one counter.
template <class KeyAt>
MagnitudeCut CutKeys(size_t n, size_t k, const KeyAt& key_at) {
  static constexpr int kShift[3] = {20, 9, 0};
  static constexpr int kWidth[3] = {11, 11, 9};
  uint32_t prefix = 0;  // digits found so far
  size_t need = k;      // entries still to take from the keys starting with `prefix`
  uint32_t hist[4][2048];
  for (int level = 0; level < 3; ++level) {
    const int shift = kShift[level], high = shift + kWidth[level];
    const uint32_t bins = 1u << kWidth[level], mask = bins - 1;
    for (auto& h : hist) std::memset(h, 0, bins * sizeof(uint32_t));
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
      for (size_t j = 0; j < 4; ++j) {
        uint32_t key = key_at(i + j);
        if ((key >> high) == prefix) ++hist[j][(key >> shift) & mask];
      }
    }
    for (; i < n; ++i) {
      uint32_t key = key_at(i);
      if ((key >> high) == prefix) ++hist[0][(key >> shift) & mask];
    }
    size_t above = 0;
    uint32_t b = bins;
    while (b-- > 0) {
      size_t h = size_t{hist[0][b]} + hist[1][b] + hist[2][b] + hist[3][b];
      if (above + h >= need) break;
      above += h;
    }
    need -= above;
    prefix = (prefix << kWidth[level]) | b;
  }
  return {prefix, need};
}

MagnitudeCut MagnitudeCutOf(const float* HWY_RESTRICT v, size_t n, size_t k) {
  return CutKeys(n, k, [v](size_t i) { return KeyOf(v[i]); });
}

// ---- threshold selection -----------------------------------------------------------------

size_t SelectAbove(const float* HWY_RESTRICT x, size_t n, uint32_t key, size_t capacity,
                   uint32_t* HWY_RESTRICT idx, float* HWY_RESTRICT val) {
  const DF df;
  const DU du;
  const size_t N = hn::Lanes(df);
  const auto vkey = hn::Set(du, key);
  auto max_key = hn::Zero(du);
  size_t count = 0, i = 0;
  for (; i + N <= n; i += N) {
    const auto v = hn::LoadU(df, x + i);
    const auto k = Keys(v);
    max_key = hn::Max(max_key, k);
    const auto m = hn::Gt(k, vkey);
    if (HWY_UNLIKELY(!hn::AllFalse(du, m))) {
      const size_t c = hn::CountTrue(du, m);
      if (count + c > capacity) return count + c;
      Append(du, IndexVec(i), m, idx + count);
      Append(df, v, hn::RebindMask(df, m), val + count);
      count += c;
    }
  }
  uint32_t worst = hn::GetLane(hn::MaxOfLanes(du, max_key));
  for (; i < n; ++i) {
    const uint32_t k = KeyOf(x[i]);
    worst = k > worst ? k : worst;
    if (k > key) {
      if (count + 1 > capacity) return count + 1;
      idx[count] = static_cast<uint32_t>(i);
      val[count++] = x[i];
    }
  }
  return worst >= kNonFiniteKey ? kNotFinite : count;
}

// ---- exact top-k -------------------------------------------------------------------------

struct Bracket {
  size_t above = 0;   // keys > high
  size_t inside = 0;  // keys in [low, high]; only the first `capacity` are stored
  uint32_t max_key = 0;
};

// One pass: counts keys above `high` and collects the keys in [low, high].
Bracket BracketPass(const float* HWY_RESTRICT x, size_t n, uint32_t low, uint32_t high,
                    uint32_t* HWY_RESTRICT keys, size_t capacity) {
  const DF df;
  const DU du;
  const size_t N = hn::Lanes(df);
  const auto vlow = hn::Set(du, low), vhigh = hn::Set(du, high);
  auto max_key = hn::Zero(du), above = hn::Zero(du);
  Bracket b;
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto k = Keys(hn::LoadU(df, x + i));
    max_key = hn::Max(max_key, k);
    const auto gt = hn::Gt(k, vhigh);
    above = hn::Sub(above, hn::VecFromMask(du, gt));  // per-lane counts: +1 where true
    const auto in = hn::Not(hn::Or(hn::Lt(k, vlow), gt));
    if (HWY_UNLIKELY(!hn::AllFalse(du, in))) {
      const size_t c = hn::CountTrue(du, in);
      if (b.inside + c <= capacity) Append(du, k, in, keys + b.inside);
      b.inside += c;
    }
  }
  HWY_ALIGN uint32_t lanes[hn::MaxLanes(du)];
  hn::Store(above, du, lanes);
  for (size_t j = 0; j < N; ++j) b.above += lanes[j];
  b.max_key = hn::GetLane(hn::MaxOfLanes(du, max_key));
  for (; i < n; ++i) {
    const uint32_t k = KeyOf(x[i]);
    b.max_key = k > b.max_key ? k : b.max_key;
    if (k > high) {
      ++b.above;
    } else if (k >= low) {
      if (b.inside < capacity) keys[b.inside] = k;
      ++b.inside;
    }
  }
  return b;
}

// Writes the elements the cut keeps, in index order; returns the largest key seen.
uint32_t Emit(const float* HWY_RESTRICT x, size_t n, MagnitudeCut cut, uint32_t* HWY_RESTRICT idx,
              float* HWY_RESTRICT val) {
  const DF df;
  const DU du;
  const size_t N = hn::Lanes(df);
  const auto vkey = hn::Set(du, cut.key);
  auto max_key = hn::Zero(du);
  size_t ties = cut.ties, m = 0, i = 0;
  auto keep_scalar = [&](size_t at) {
    const uint32_t k = KeyOf(x[at]);
    if (k > cut.key || (k == cut.key && ties > 0)) {
      if (k == cut.key) --ties;
      idx[m] = static_cast<uint32_t>(at);
      val[m++] = x[at];
    }
    return k;
  };
  for (; i + N <= n; i += N) {
    const auto v = hn::LoadU(df, x + i);
    const auto k = Keys(v);
    max_key = hn::Max(max_key, k);
    if (HWY_UNLIKELY(ties > 0 && !hn::AllFalse(du, hn::Eq(k, vkey)))) {
      for (size_t j = 0; j < N; ++j) keep_scalar(i + j);  // ties go to the lowest indices
      continue;
    }
    const auto gt = hn::Gt(k, vkey);
    if (!hn::AllFalse(du, gt)) {
      Append(du, IndexVec(i), gt, idx + m);
      m += Append(df, v, hn::RebindMask(df, gt), val + m);
    }
  }
  uint32_t worst = hn::GetLane(hn::MaxOfLanes(du, max_key));
  for (; i < n; ++i) {
    const uint32_t k = keep_scalar(i);
    worst = k > worst ? k : worst;
  }
  return worst;
}

bool TopK(const float* HWY_RESTRICT x, size_t n, size_t k, uint32_t* HWY_RESTRICT scratch,
          uint32_t* HWY_RESTRICT idx, float* HWY_RESTRICT val, MagnitudeCut* cut_out) {
  auto key_of_x = [x](size_t i) { return KeyOf(x[i]); };
  MagnitudeCut cut;
  if (k == n) {
    cut = {0, n};  // everything
  } else if (n <= detail::kExactLimit) {
    cut = CutKeys(n, k, key_of_x);
  } else {
    const detail::Plan p = detail::plan_for(n, k);
    uint32_t* sample = scratch;
    for (size_t j = 0; j < p.samples; ++j) {
      sample[j] = KeyOf(x[(uint64_t{random_bits(detail::kSampleKey, j)} * n) >> 32]);
    }
    auto key_of_sample = [sample](size_t i) { return sample[i]; };
    const uint32_t low = CutKeys(p.samples, p.rank_low, key_of_sample).key;
    const uint32_t high =
        p.rank_high == 0 ? kAbsMask : CutKeys(p.samples, p.rank_high, key_of_sample).key;
    uint32_t* keys = scratch + p.samples;
    const Bracket b = BracketPass(x, n, low, high, keys, p.capacity);
    if (b.max_key >= kNonFiniteKey) return false;
    if (b.inside <= p.capacity && b.above < k && k - b.above <= b.inside) {
      cut = CutKeys(b.inside, k - b.above, [keys](size_t i) { return keys[i]; });
    } else {
      cut = CutKeys(n, k, key_of_x);  // the sample misled: exact over everything
    }
  }
  if (cut_out != nullptr) *cut_out = cut;
  return Emit(x, n, cut, idx, val) < kNonFiniteKey;
}

// ---- DGC ---------------------------------------------------------------------------------

// Separate multiply and add (no FMA) so vector, scalar and sampled values agree bit for bit.
HWY_INLINE float Saturate(float a) { return a > FLT_MAX ? FLT_MAX : (a < -FLT_MAX ? -FLT_MAX : a); }
HWY_INLINE void DgcScalar(float m, float g, float u, float v, float* u2, float* v2) {
  const float mu = m * u;
  *u2 = Saturate(mu + g);
  *v2 = Saturate(v + *u2);
}
HWY_INLINE VF SaturateVec(VF a) {
  const DF df;
  return hn::Min(hn::Max(a, hn::Set(df, -FLT_MAX)), hn::Set(df, FLT_MAX));
}

// Keeps the c.keep largest |v| of the lists (ties to the lower index) and returns the new
// count; *cut_key receives the smallest kept key. Dropped entries go back into u and v.
size_t CutCandidates(const DgcCandidates& c, size_t count, float* HWY_RESTRICT u,
                     float* HWY_RESTRICT v, uint32_t* cut_key) {
  const MagnitudeCut cut = MagnitudeCutOf(c.v, count, c.keep);
  *cut_key = cut.key;
  size_t ties = cut.ties, m = 0;
  for (size_t t = 0; t < count; ++t) {
    const uint32_t k = KeyOf(c.v[t]);
    if (k > cut.key || (k == cut.key && ties > 0)) {
      if (k == cut.key) --ties;
      c.idx[m] = c.idx[t];
      c.v[m] = c.v[t];
      c.u[m++] = c.u[t];
    } else {  // not sent after all: back into the accumulators
      u[c.idx[t]] = c.u[t];
      v[c.idx[t]] = c.v[t];
    }
  }
  return m;
}

size_t DgcCut(const DgcCandidates& c, size_t count, float* HWY_RESTRICT u, float* HWY_RESTRICT v) {
  uint32_t cut_key;
  return count <= c.keep ? count : CutCandidates(c, count, u, v, &cut_key);
}

size_t DgcAccumulateSelect(const float* HWY_RESTRICT g, float* HWY_RESTRICT u,
                           float* HWY_RESTRICT v, size_t n, float momentum, uint32_t min_key,
                           const DgcCandidates& c) {
  const DF df;
  const DU du;
  const size_t N = hn::Lanes(df);
  const auto vm = hn::Set(df, momentum);
  auto vmin = hn::Set(du, min_key);
  size_t count = 0, i = 0;
  for (; i + N <= n; i += N) {
    // Five streams (three read, two written back) outrun the hardware prefetcher: asking 2 KiB
    // ahead measured ~15% faster here. Prefetches past the end are harmless hints.
    __builtin_prefetch(g + i + 512);
    __builtin_prefetch(u + i + 512);
    __builtin_prefetch(v + i + 512);
    auto u2 = SaturateVec(hn::Add(hn::Mul(vm, hn::LoadU(df, u + i)), hn::LoadU(df, g + i)));
    auto v2 = SaturateVec(hn::Add(hn::LoadU(df, v + i), u2));
    auto sel = hn::Not(hn::Lt(Keys(v2), vmin));
    if (HWY_UNLIKELY(!hn::AllFalse(du, sel))) {
      size_t cnt = hn::CountTrue(du, sel);
      if (count + cnt > c.limit) {
        // Lists full: keep the largest, and from here on take only what beats all of them.
        count = CutCandidates(c, count, u, v, &min_key);
        vmin = hn::Set(du, ++min_key);
        sel = hn::Not(hn::Lt(Keys(v2), vmin));
        cnt = hn::CountTrue(du, sel);
      }
      if (cnt > 0) {
        const auto fsel = hn::RebindMask(df, sel);
        Append(du, IndexVec(i), sel, c.idx + count);
        Append(df, v2, fsel, c.v + count);
        Append(df, u2, fsel, c.u + count);
        count += cnt;
        u2 = hn::IfThenZeroElse(fsel, u2);
        v2 = hn::IfThenZeroElse(fsel, v2);
      }
    }
    hn::StoreU(u2, df, u + i);
    hn::StoreU(v2, df, v + i);
  }
  for (; i < n; ++i) {
    float u2, v2;
    DgcScalar(momentum, g[i], u[i], v[i], &u2, &v2);
    if (KeyOf(v2) >= min_key) {
      if (count + 1 > c.limit) {
        count = CutCandidates(c, count, u, v, &min_key);
        ++min_key;
      }
      if (KeyOf(v2) >= min_key) {
        c.idx[count] = static_cast<uint32_t>(i);
        c.v[count] = v2;
        c.u[count++] = u2;
        u2 = v2 = 0.0f;
      }
    }
    u[i] = u2;
    v[i] = v2;
  }
  return count;
}

void DgcSample(const float* HWY_RESTRICT g, const float* HWY_RESTRICT u,
               const float* HWY_RESTRICT v, size_t n, float momentum, uint64_t key, size_t runs,
               float* HWY_RESTRICT out) {
  for (size_t j = 0; j < runs; ++j) {
    const size_t start = (uint64_t{random_bits(key, j)} * (n - 15)) >> 32;
    for (size_t e = 0; e < 16; ++e) {
      float u2;
      DgcScalar(momentum, g[start + e], u[start + e], v[start + e], &u2, &out[16 * j + e]);
    }
  }
}

void DgcPreview(const float* HWY_RESTRICT g, const float* HWY_RESTRICT u,
                const float* HWY_RESTRICT v, size_t n, float momentum, float* HWY_RESTRICT out) {
  for (size_t i = 0; i < n; ++i) {
    float u2;
    DgcScalar(momentum, g[i], u[i], v[i], &u2, &out[i]);
  }
}

// ---- payload lists -----------------------------------------------------------------------

bool IndicesValid(const uint8_t* HWY_RESTRICT p, size_t count, size_t n) {
  if (count == 0) return true;
  if (n == 0) return false;
  const DU du;
  const size_t N = hn::Lanes(du);
  const uint32_t last = n - 1 > 0xffffffffu ? 0xffffffffu : static_cast<uint32_t>(n - 1);
  const auto vlast = hn::Set(du, last);
  const auto* w = reinterpret_cast<const uint32_t*>(p);  // read with LoadU only
  uint32_t first;
  std::memcpy(&first, p, 4);
  bool ok = first <= last;
  auto bad = hn::Zero(du);
  size_t t = 1;
  for (; t + N <= count; t += N) {
    const auto cur = hn::LoadU(du, w + t), prev = hn::LoadU(du, w + t - 1);
    bad = hn::Or(bad, hn::VecFromMask(du, hn::Or(hn::Not(hn::Gt(cur, prev)), hn::Gt(cur, vlast))));
  }
  ok &= hn::AllTrue(du, hn::Eq(bad, hn::Zero(du)));
  for (; t < count; ++t) {
    uint32_t cur, prev;
    std::memcpy(&cur, p + 4 * t, 4);
    std::memcpy(&prev, p + 4 * (t - 1), 4);
    ok &= cur > prev && cur <= last;
  }
  return ok;
}

bool ValuesValid(const uint8_t* HWY_RESTRICT p, size_t count, uint32_t min_key) {
  const DU du;
  const size_t N = hn::Lanes(du);
  const auto* w = reinterpret_cast<const uint32_t*>(p);  // read with LoadU only
  const auto vmin = hn::Set(du, min_key), vinf = hn::Set(du, kNonFiniteKey);
  auto bad = hn::Zero(du);
  size_t t = 0;
  for (; t + N <= count; t += N) {
    const auto k = hn::And(hn::LoadU(du, w + t), hn::Set(du, kAbsMask));
    bad = hn::Or(bad, hn::VecFromMask(du, hn::Or(hn::Lt(k, vmin), hn::Not(hn::Lt(k, vinf)))));
  }
  bool ok = hn::AllTrue(du, hn::Eq(bad, hn::Zero(du)));
  for (; t < count; ++t) {
    uint32_t k;
    std::memcpy(&k, p + 4 * t, 4);
    k &= kAbsMask;
    ok &= k >= min_key && k < kNonFiniteKey;
  }
  return ok;
}

void Scatter(const uint8_t* HWY_RESTRICT idx, const uint8_t* HWY_RESTRICT val, size_t count,
             float* HWY_RESTRICT y, size_t n, bool accumulate) {
  auto entry = [idx, val](size_t t, uint32_t* i, float* v) {
    std::memcpy(i, idx + 4 * t, 4);
    std::memcpy(v, val + 4 * t, 4);
  };
  uint32_t i;
  float v;
  if (accumulate) {
    for (size_t t = 0; t < count; ++t) {
      entry(t, &i, &v);
      y[i] += v;
    }
    return;
  }
  // One pass over y in blocks that fit L1: zero a block, then drop its entries in while hot.
  constexpr size_t kBlock = 2048;
  size_t t = 0;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = n - b < kBlock ? n : b + kBlock;
    std::memset(y + b, 0, (e - b) * sizeof(float));
    for (; t < count; ++t) {
      entry(t, &i, &v);
      if (i >= e) break;
      y[i] = v;
    }
  }
}

void Gather(const float* HWY_RESTRICT x, const uint32_t* HWY_RESTRICT idx, size_t count,
            float scale, uint8_t* HWY_RESTRICT out) {
  for (size_t t = 0; t < count; ++t) {
    const float v = Saturate(x[idx[t]] * scale);
    std::memcpy(out + 4 * t, &v, 4);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace terse::kit
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <stdexcept>

#include "kit/basic.h"

namespace terse::kit {

HWY_EXPORT(MagnitudeCutOf);
HWY_EXPORT(SelectAbove);
HWY_EXPORT(TopK);
HWY_EXPORT(DgcCut);
HWY_EXPORT(DgcAccumulateSelect);
HWY_EXPORT(DgcSample);
HWY_EXPORT(DgcPreview);
HWY_EXPORT(IndicesValid);
HWY_EXPORT(ValuesValid);
HWY_EXPORT(Scatter);
HWY_EXPORT(Gather);

MagnitudeCut magnitude_cut(std::span<const float> v, std::size_t k) {
  return HWY_DYNAMIC_DISPATCH(MagnitudeCutOf)(v.data(), v.size(), k);
}

std::size_t select_above(std::span<const float> x, std::uint32_t key, std::size_t capacity,
                         std::uint32_t* idx, float* val) {
  return HWY_DYNAMIC_DISPATCH(SelectAbove)(x.data(), x.size(), key, capacity, idx, val);
}

std::size_t top_k_scratch_words(std::size_t n, std::size_t k) {
  if (k == n || n <= detail::kExactLimit) return 0;
  const detail::Plan p = detail::plan_for(n, k);
  return p.samples + p.capacity + kSelectSlack;
}

bool top_k(std::span<const float> x, std::size_t k, std::span<std::uint32_t> scratch,
           std::uint32_t* idx, float* val, MagnitudeCut* cut) {
  if (k > x.size() || scratch.size() < top_k_scratch_words(x.size(), k)) {
    throw std::logic_error("terse: kit::top_k: k > n or scratch too small");
  }
  if (k == 0) return find_non_finite(x) == x.size();
  return HWY_DYNAMIC_DISPATCH(TopK)(x.data(), x.size(), k, scratch.data(), idx, val, cut);
}

std::size_t dgc_accumulate_select(std::span<const float> g, std::span<float> u, std::span<float> v,
                                  float momentum, std::uint32_t min_key, const DgcCandidates& c) {
  return HWY_DYNAMIC_DISPATCH(DgcAccumulateSelect)(g.data(), u.data(), v.data(), g.size(), momentum,
                                                   min_key, c);
}

std::size_t dgc_cut(const DgcCandidates& c, std::size_t count, std::span<float> u,
                    std::span<float> v) {
  return HWY_DYNAMIC_DISPATCH(DgcCut)(c, count, u.data(), v.data());
}

void dgc_sample(std::span<const float> g, std::span<const float> u, std::span<const float> v,
                float momentum, std::uint64_t key, std::size_t runs, float* out) {
  HWY_DYNAMIC_DISPATCH(DgcSample)(g.data(), u.data(), v.data(), g.size(), momentum, key, runs, out);
}

void dgc_preview(std::span<const float> g, std::span<const float> u, std::span<const float> v,
                 float momentum, float* out) {
  HWY_DYNAMIC_DISPATCH(DgcPreview)(g.data(), u.data(), v.data(), g.size(), momentum, out);
}

bool indices_valid(const std::byte* p, std::size_t count, std::size_t n) {
  return HWY_DYNAMIC_DISPATCH(IndicesValid)(reinterpret_cast<const std::uint8_t*>(p), count, n);
}

bool values_valid(const std::byte* p, std::size_t count, std::uint32_t min_key) {
  return HWY_DYNAMIC_DISPATCH(ValuesValid)(reinterpret_cast<const std::uint8_t*>(p), count,
                                           min_key);
}

void scatter(const std::byte* idx, const std::byte* val, std::size_t count, std::span<float> y,
             bool accumulate) {
  const auto* i = reinterpret_cast<const std::uint8_t*>(idx);
  const auto* v = reinterpret_cast<const std::uint8_t*>(val);
  HWY_DYNAMIC_DISPATCH(Scatter)(i, v, count, y.data(), y.size(), accumulate);
}

void gather(std::span<const float> x, const std::uint32_t* idx, std::size_t count, float scale,
            std::byte* out) {
  HWY_DYNAMIC_DISPATCH(Gather)(x.data(), idx, count, scale, reinterpret_cast<std::uint8_t*>(out));
}

}  // namespace terse::kit
#endif  // HWY_ONCE
