// The sparse kit against plain references: radix cut, threshold and exact top-k selection (on
// every path: exact, sampled bracket, fallback), DGC's fused update, random-k index sets and
// the payload list checks.
#include "kit/sparse.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kit/random.h"

namespace terse::kit {
namespace {

std::vector<float> normal(std::size_t n, std::uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> x(n);
  for (auto& v : x) v = d(gen);
  return x;
}

// Small integers: many exact ties in magnitude, both signs.
std::vector<float> ties(std::size_t n, std::uint64_t seed, int levels) {
  std::mt19937_64 gen(seed);
  std::vector<float> x(n);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(gen() % (2 * levels + 1)) - levels);
  return x;
}

// The k largest |x|, ties to the lower index, in index order.
std::vector<std::uint32_t> reference_top_k(const std::vector<float>& x, std::size_t k) {
  std::vector<std::uint32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](auto a, auto b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

struct TopK {
  std::vector<std::uint32_t> idx;
  std::vector<float> val;
  bool ok;
};
TopK run_top_k(const std::vector<float>& x, std::size_t k) {
  std::vector<std::uint32_t> scratch(top_k_scratch_words(x.size(), k));
  TopK r{std::vector<std::uint32_t>(k + kSelectSlack), std::vector<float>(k + kSelectSlack), false};
  r.ok = top_k(x, k, scratch, r.idx.data(), r.val.data());
  r.idx.resize(k);
  r.val.resize(k);
  return r;
}

void expect_top_k(const std::vector<float>& x, std::size_t k, const char* what) {
  auto r = run_top_k(x, k);
  ASSERT_TRUE(r.ok) << what;
  ASSERT_EQ(r.idx, reference_top_k(x, k)) << what << " n=" << x.size() << " k=" << k;
  for (std::size_t t = 0; t < k; ++t) ASSERT_EQ(r.val[t], x[r.idx[t]]) << what;
}

TEST(SparseKit, MagnitudeCutMatchesSorting) {
  std::mt19937_64 gen(1);
  for (int trial = 0; trial < 200; ++trial) {
    std::size_t n = 1 + gen() % 300;
    auto v = trial % 2 ? ties(n, trial, 3) : normal(n, trial);
    if (trial % 7 == 0) v[gen() % n] = -0.0f;
    std::size_t k = 1 + gen() % n;
    MagnitudeCut c = magnitude_cut(v, k);
    std::vector<std::uint32_t> keys(n);
    for (std::size_t i = 0; i < n; ++i) keys[i] = magnitude_key(v[i]);
    std::sort(keys.rbegin(), keys.rend());
    ASSERT_EQ(c.key, keys[k - 1]);
    ASSERT_EQ(c.ties, k - (std::find(keys.begin(), keys.end(), c.key) - keys.begin()));
  }
  std::vector<float> inf = {1.0f, INFINITY, 2.0f};
  EXPECT_EQ(magnitude_cut(inf, 1).key, kNonFiniteKey);  // non-finite orders above all
}

TEST(SparseKit, TopKExactOnSmallInputs) {
  for (std::size_t n : {1, 2, 3, 15, 16, 17, 100, 1000, 4097}) {
    for (std::size_t k : {std::size_t{1}, n / 3 + 1, n / 2, n - 1, n}) {
      if (k == 0 || k > n) continue;
      expect_top_k(normal(n, n + k), k, "normal");
      expect_top_k(ties(n, n * 3 + k, 2), k, "ties");
      expect_top_k(std::vector<float>(n, 0.0f), k, "zeros");
    }
  }
}

TEST(SparseKit, TopKExactOnLargeInputsEveryPath) {
  const std::size_t n = 300'001;  // above the exact limit: sampled bracket
  for (std::size_t k : {1, 2, 100, 3000, 30000, 150000, 299999}) {
    expect_top_k(normal(n, k), k, "normal");
  }
  expect_top_k(ties(n, 5, 40), 3000, "ties");
  // Mostly zeros (an embedding gradient): the bracket sits at zero, ties go to low indices.
  std::vector<float> sparse(n, 0.0f);
  for (std::size_t i = 17; i < n; i += 1013) sparse[i] = static_cast<float>(i % 7) - 3.0f;
  expect_top_k(sparse, 100, "sparse");
  expect_top_k(sparse, 1000, "sparse");
  // All equal: the bracket holds everything and overflows; the exact fallback takes over.
  expect_top_k(std::vector<float>(n, -2.5f), 777, "equal");
  // Sorted magnitudes and huge values.
  std::vector<float> ramp(n);
  for (std::size_t i = 0; i < n; ++i) ramp[i] = static_cast<float>(i) * (i % 2 ? 1e30f : -1e30f);
  expect_top_k(ramp, 5000, "ramp");
}

TEST(SparseKit, TopKRejectsNonFiniteOnEveryPath) {
  for (std::size_t n : {10, 300'001}) {
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      auto x = normal(n, 3);
      x[n - 1] = bad;
      EXPECT_FALSE(run_top_k(x, 1).ok) << n;
      EXPECT_FALSE(run_top_k(x, n / 2).ok) << n;
      auto same = std::vector<float>(n, 1.0f);
      same[n / 2] = bad;
      EXPECT_FALSE(run_top_k(same, 3).ok) << n;
    }
  }
}

TEST(SparseKit, SelectAboveKeepsExactlyTheLargerMagnitudes) {
  for (std::size_t n : {0, 1, 15, 16, 17, 1000, 100'003}) {
    auto x = normal(n, n);
    const float tau = 1.5f;
    std::vector<std::uint32_t> idx(n + kSelectSlack);
    std::vector<float> val(n + kSelectSlack);
    std::size_t c = select_above(x, magnitude_key(tau), n, idx.data(), val.data());
    std::vector<std::uint32_t> expect;
    for (std::size_t i = 0; i < n; ++i) {
      if (std::fabs(x[i]) > tau) expect.push_back(static_cast<std::uint32_t>(i));
    }
    ASSERT_EQ(c, expect.size());
    idx.resize(c);
    EXPECT_EQ(idx, expect);
    for (std::size_t t = 0; t < c; ++t) EXPECT_EQ(val[t], x[idx[t]]);
    if (expect.size() > 1) {  // over capacity: reports more than capacity
      EXPECT_GT(select_above(x, magnitude_key(tau), expect.size() - 1, idx.data(), val.data()),
                expect.size() - 1);
    }
  }
  std::vector<float> x(100, 0.0f);
  x[50] = NAN;
  std::vector<std::uint32_t> idx(200);
  std::vector<float> val(200);
  EXPECT_EQ(select_above(x, 0, 100, idx.data(), val.data()), kNotFinite);
  EXPECT_EQ(select_above(x, 0, 0, idx.data(), val.data()), 1u);  // overflow first
}

// ---- DGC ----

struct Dgc {
  std::vector<float> u, v;
  std::vector<std::uint32_t> idx;
  std::vector<float> cv, cu;
};

// The documented step for one element, as plain scalar code.
void dgc_reference(float m, float g, float& u, float& v) {
  float mu = m * u;
  u = std::clamp(mu + g, -FLT_MAX, FLT_MAX);
  v = std::clamp(v + u, -FLT_MAX, FLT_MAX);
}

TEST(SparseKit, DgcPassMatchesScalarReference) {
  for (std::size_t n : {1, 15, 16, 17, 1000, 4099}) {
    auto g = normal(n, n), u = normal(n, n + 1), v = normal(n, n + 2);
    g[0] = 3e38f;  // saturates
    v[0] = 3e38f;
    const float m = 0.9f;
    const std::uint32_t min_key = magnitude_key(1.2f);
    Dgc d{u, v, std::vector<std::uint32_t>(n + kSelectSlack), std::vector<float>(n + kSelectSlack),
          std::vector<float>(n + kSelectSlack)};
    DgcCandidates c{d.idx.data(), d.cv.data(), d.cu.data(), n, n};
    std::size_t count = dgc_accumulate_select(g, d.u, d.v, m, min_key, c);
    std::vector<float> preview(n);
    dgc_preview(g, u, v, m, preview.data());
    std::size_t t = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float ru = u[i], rv = v[i];
      dgc_reference(m, g[i], ru, rv);
      ASSERT_EQ(preview[i], rv) << i;
      if (magnitude_key(rv) >= min_key) {
        ASSERT_LT(t, count);
        ASSERT_EQ(d.idx[t], i);
        ASSERT_EQ(d.cv[t], rv);
        ASSERT_EQ(d.cu[t], ru);
        ++t;
        ru = rv = 0.0f;  // factor masking
      }
      ASSERT_EQ(d.u[i], ru) << i;
      ASSERT_EQ(d.v[i], rv) << i;
    }
    EXPECT_EQ(t, count);
  }
}

TEST(SparseKit, DgcFullListsKeepTheLargestAndRestoreTheRest) {
  const std::size_t n = 20000, keep = 50, limit = 100;
  auto g = normal(n, 7), u = normal(n, 8), v = normal(n, 9);
  Dgc d{u, v, std::vector<std::uint32_t>(limit + kSelectSlack),
        std::vector<float>(limit + kSelectSlack), std::vector<float>(limit + kSelectSlack)};
  DgcCandidates c{d.idx.data(), d.cv.data(), d.cu.data(), limit, keep};
  std::size_t count = dgc_accumulate_select(g, d.u, d.v, 0.5f, 1, c);  // everything qualifies
  ASSERT_LE(count, limit + kSelectSlack);
  count = dgc_cut(c, count, d.u, d.v);
  ASSERT_EQ(count, keep);
  // The kept entries are the `keep` largest updated |v| overall (continuous data: no ties);
  // every other element holds its updated u and v.
  std::vector<float> updated(n);
  dgc_preview(g, u, v, 0.5f, updated.data());
  auto expect = reference_top_k(updated, keep);
  d.idx.resize(count);
  EXPECT_EQ(d.idx, expect);
  std::size_t t = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float ru = u[i], rv = v[i];
    dgc_reference(0.5f, g[i], ru, rv);
    if (t < count && d.idx[t] == i) {
      EXPECT_EQ(d.cv[t], rv);
      EXPECT_EQ(d.cu[t++], ru);
      ru = rv = 0.0f;
    }
    ASSERT_EQ(d.u[i], ru) << i;
    ASSERT_EQ(d.v[i], rv) << i;
  }
}

TEST(SparseKit, DgcSampleReadsRunsOfTheUpdate) {
  const std::size_t n = 1000;
  auto g = normal(n, 1), u = normal(n, 2), v = normal(n, 3);
  std::vector<float> all(n), sample(16 * 5);
  dgc_preview(g, u, v, 0.9f, all.data());
  dgc_sample(g, u, v, 0.9f, 42, 5, sample.data());
  for (std::size_t j = 0; j < 5; ++j) {
    std::size_t start = (std::uint64_t{random_bits(42, j)} * (n - 15)) >> 32;
    for (std::size_t e = 0; e < 16; ++e) ASSERT_EQ(sample[16 * j + e], all[start + e]);
  }
}

// ---- random-k ----

std::vector<std::uint32_t> random_k(std::uint64_t key, std::size_t n, std::size_t k) {
  std::vector<std::uint32_t> out(k);
  random_k_indices(key, n, k, out.data());
  return out;
}

// random.h's formula, one block at a time, then sorted.
std::vector<std::uint32_t> reference_random_k(std::uint64_t key, std::size_t n, std::size_t k) {
  const std::uint64_t c = random_k_rotation(key, n), q = n / k, r = n % k;
  std::vector<std::uint32_t> out;
  for (std::uint64_t j = 0; j < k; ++j) {
    std::uint64_t b = j * q + std::min(j, r), len = q + (j < r);
    std::uint64_t o = (std::uint64_t{random_bits(random_k_block_key(key), j)} * len) >> 32;
    out.push_back(static_cast<std::uint32_t>((c + b + o) % n));
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(SparseKit, RandomKMatchesTheDocumentedFormula) {
  for (std::uint64_t key : {0ull, 1ull, 0xdeadbeefcafef00dull}) {
    for (std::size_t n : {1, 2, 7, 16, 17, 100, 1000, 65537}) {
      for (std::size_t k : {std::size_t{1}, std::size_t{2}, n / 10 + 1, n / 2 + 1, n - 1, n}) {
        if (k == 0 || k > n) continue;
        auto got = random_k(key, n, k);
        ASSERT_EQ(got, reference_random_k(key, n, k)) << key << " " << n << " " << k;
        for (std::size_t t = 1; t < k; ++t) ASSERT_LT(got[t - 1], got[t]);
      }
    }
  }
  auto all = random_k(5, 40, 40);
  for (std::uint32_t i = 0; i < 40; ++i) EXPECT_EQ(all[i], i);
}

TEST(SparseKit, RandomKSelectsEveryIndexWithProbabilityKOverN) {
  // n not a multiple of k: blocks of 3 and 4. Each index's count over T keys is
  // Binomial(T, k/n); the chi-square over indices stays near n.
  const std::size_t n = 103, k = 29, trials = 20000;
  std::vector<double> hits(n);
  for (std::uint64_t key = 0; key < trials; ++key) {
    for (auto i : random_k(key * 0x9e3779b97f4a7c15ull, n, k)) hits[i] += 1;
  }
  const double p = static_cast<double>(k) / n, mean = trials * p, var = trials * p * (1 - p);
  double chi2 = 0;
  for (double h : hits) {
    ASSERT_LT(std::fabs(h - mean), 6 * std::sqrt(var));
    chi2 += (h - mean) * (h - mean) / var;
  }
  EXPECT_LT(chi2, n + 6 * std::sqrt(2.0 * n));
  EXPECT_GT(chi2, n - 6 * std::sqrt(2.0 * n));
}

// ---- payload lists ----

std::vector<std::byte> bytes_of(const std::vector<std::uint32_t>& w) {
  std::vector<std::byte> b(w.size() * 4 + 1);  // +1: read from an odd offset below
  std::memcpy(b.data() + 1, w.data(), w.size() * 4);
  return b;
}

TEST(SparseKit, IndexAndValueChecks) {
  auto ok = bytes_of({0, 3, 4, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 99});
  EXPECT_TRUE(indices_valid(ok.data() + 1, 19, 100));
  EXPECT_FALSE(indices_valid(ok.data() + 1, 19, 99));  // 99 out of range
  EXPECT_TRUE(indices_valid(ok.data() + 1, 0, 0));
  EXPECT_FALSE(indices_valid(ok.data() + 1, 1, 0));
  for (std::size_t at : {1, 5, 17, 18}) {
    std::vector<std::uint32_t> w = {0,  3,  4,  9,  10, 11, 12, 13, 14, 15,
                                    16, 17, 18, 19, 20, 21, 22, 23, 99};
    w[at] = w[at - 1];  // duplicate
    auto b = bytes_of(w);
    EXPECT_FALSE(indices_valid(b.data() + 1, w.size(), 100)) << at;
    w[at] = w[at - 1] - 1;  // decreasing
    b = bytes_of(w);
    EXPECT_FALSE(indices_valid(b.data() + 1, w.size(), 100)) << at;
  }
  std::vector<float> v(33, 1.0f);
  auto vb = [&] {
    std::vector<std::byte> b(v.size() * 4 + 1);
    std::memcpy(b.data() + 1, v.data(), v.size() * 4);
    return b;
  };
  EXPECT_TRUE(values_valid(vb().data() + 1, v.size(), magnitude_key(1.0f)));
  EXPECT_FALSE(values_valid(vb().data() + 1, v.size(), magnitude_key(1.0f) + 1));
  for (std::size_t at : {0, 20, 32}) {
    for (float bad : {NAN, INFINITY, -INFINITY, 0.0f}) {
      v.assign(33, -1.0f);
      v[at] = bad;
      EXPECT_FALSE(values_valid(vb().data() + 1, v.size(), 1)) << at << " " << bad;
    }
  }
}

TEST(SparseKit, ScatterOverwritesOrAccumulates) {
  for (std::size_t n : {1, 100, 5000}) {
    std::vector<std::uint32_t> idx;
    std::vector<float> val;
    for (std::uint32_t i = 0; i < n; i += 1 + i % 37) {
      idx.push_back(i);
      val.push_back(static_cast<float>(i) + 0.5f);
    }
    std::vector<float> y(n, 7.0f), acc(n, 7.0f);
    scatter(reinterpret_cast<const std::byte*>(idx.data()),
            reinterpret_cast<const std::byte*>(val.data()), idx.size(), y, false);
    scatter(reinterpret_cast<const std::byte*>(idx.data()),
            reinterpret_cast<const std::byte*>(val.data()), idx.size(), acc, true);
    std::size_t t = 0;
    for (std::size_t i = 0; i < n; ++i) {
      bool hit = t < idx.size() && idx[t] == i;
      ASSERT_EQ(y[i], hit ? val[t] : 0.0f) << i;
      ASSERT_EQ(acc[i], hit ? 7.0f + val[t] : 7.0f) << i;
      t += hit;
    }
  }
}

TEST(SparseKit, GatherScalesAndSaturates) {
  std::vector<float> x = {1.0f, -2.0f, 3e38f, -3e38f, 4.0f};
  std::vector<std::uint32_t> idx = {0, 1, 2, 3, 4};
  std::vector<float> out(5);
  gather(x, idx.data(), 5, 10.0f, reinterpret_cast<std::byte*>(out.data()));
  EXPECT_EQ(out, (std::vector<float>{10.0f, -20.0f, FLT_MAX, -FLT_MAX, 40.0f}));
}

}  // namespace
}  // namespace terse::kit
