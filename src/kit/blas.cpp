// CBLAS wrappers and the Gram-Schmidt orthonormalization used by PowerSGD.
#include "kit/blas.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "terse/error.h"

namespace terse::kit {
namespace {

blasint checked(std::size_t v) {
  if (v > static_cast<std::size_t>(INT_MAX)) {
    throw InvalidArgument(fmt::format("terse: BLAS dimension {} exceeds {}", v, INT_MAX));
  }
  return static_cast<blasint>(v);
}

}  // namespace

void blas_set_threads(int threads) { openblas_set_num_threads(threads); }

int blas_threads() { return openblas_get_num_threads(); }

namespace {
std::atomic<bool> threads_chosen{false};
}  // namespace

void set_blas_threads_chosen(bool chosen) { threads_chosen.store(chosen); }

int blas_limit_threads(int threads) {
  if (threads_chosen.load()) return blas_threads();
  threads = std::max(1, threads);
  if (threads < blas_threads()) blas_set_threads(threads);
  return blas_threads();
}

void sgemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, float alpha,
           const float* a, std::size_t lda, const float* b, std::size_t ldb, float beta, float* c,
           std::size_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // BLAS would scale c by beta; keep the documented "c not read when beta == 0".
    for (std::size_t i = 0; i < m; ++i) {
      float* row = c + i * ldc;
      if (beta == 0.0f) {
        std::memset(row, 0, n * sizeof(float));
      } else {
        for (std::size_t j = 0; j < n; ++j) row[j] *= beta;
      }
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, checked(m), checked(n), checked(k), alpha, a,
              checked(lda), b, checked(ldb), beta, c, checked(ldc));
}

void orthonormalize(float* v, std::size_t k, std::size_t len, bool* degenerate) {
  if (k > 64) throw InvalidArgument("terse: orthonormalize supports at most 64 vectors");
  const blasint n = checked(len);
  std::array<float, 64> coef;
  for (std::size_t j = 0; j < k; ++j) {
    float* x = v + j * len;
    bool bad = false;
    float norm = len == 0 ? 0.0f : cblas_snrm2(n, x, 1);
    // Bring the norm into a comfortable range first: snrm2 itself does not overflow, but
    // 1/norm does for subnormal norms.
    for (int guard = 0; guard < 4 && std::isfinite(norm) && norm > 0.0f &&
                        (norm < 0x1p-60f || norm > 0x1p60f);
         ++guard) {
      cblas_sscal(n, norm < 1.0f ? 0x1p64f : 0x1p-64f, x, 1);
      norm = cblas_snrm2(n, x, 1);
    }
    if (!(norm > 0.0f) || !std::isfinite(norm)) {
      bad = true;
    } else {
      cblas_sscal(n, 1.0f / norm, x, 1);
      if (j > 0) {
        const blasint m = static_cast<blasint>(j);
        float first = 1.0f;
        for (int pass = 0; pass < 2; ++pass) {
          // coef = V x; x -= V^T coef, V the j earlier (orthonormal or zero) vectors.
          cblas_sgemv(CblasRowMajor, CblasNoTrans, m, n, 1.0f, v, n, x, 1, 0.0f, coef.data(), 1);
          cblas_sgemv(CblasRowMajor, CblasTrans, m, n, -1.0f, v, n, coef.data(), 1, 1.0f, x, 1);
          norm = cblas_snrm2(n, x, 1);
          if (pass == 0) first = norm;
        }
        // A second pass that still removes much means x was (numerically) in the span.
        if (!(norm > 0.5f * first) || !(norm > 1e-30f) || !std::isfinite(norm)) {
          bad = true;
        } else {
          cblas_sscal(n, 1.0f / norm, x, 1);
        }
      }
    }
    if (bad && len > 0) std::memset(x, 0, len * sizeof(float));
    if (degenerate != nullptr) degenerate[j] = bad;
  }
}

}  // namespace terse::kit
