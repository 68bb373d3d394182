// Thin wrappers over the CBLAS interface of OpenBLAS, so that code outside the library (the
// `terse` tool's benchmarks) and codecs share one place that knows BLAS's integer types.
// All matrices are row-major. Dimensions must fit BLAS's 32-bit integers (checked).
#pragma once

#include <cstddef>

namespace terse::kit {

// Threads OpenBLAS uses for subsequent calls (process-wide; openblas_set_num_threads).
void blas_set_threads(int threads);
// Threads OpenBLAS would use now.
int blas_threads();

// Whether the user chose OpenBLAS's thread count (ProcessOptions::blas_threads_chosen: at the
// edge, OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS or OMP_NUM_THREADS set). Process-wide.
void set_blas_threads_chosen(bool chosen);

// Lowers OpenBLAS's threads to `threads` (at least 1) where it would use more, unless the user
// chose them (set_blas_threads_chosen). OpenBLAS starts one
// thread per core in every process, so ranks that share a machine oversubscribe its cores; the
// engine passes each rank's share (transport::MachineShare::cores_per_rank, the same on every rank:
// a product's last bits can depend on the thread count, and replicas must stay identical).
// Returns the threads OpenBLAS uses after.
int blas_limit_threads(int threads);

// c (m x n) = alpha * op(a) * op(b) + beta * c, where op(a) is m x k and op(b) is k x n.
// With beta == 0, c is not read (it may hold anything, NaN included).
void sgemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, float alpha,
           const float* a, std::size_t lda, const float* b, std::size_t ldb, float beta, float* c,
           std::size_t ldc);

// Orthonormalizes the k vectors v[0..k) of length len stored one after another (v + j * len),
// in order, by classical Gram-Schmidt applied twice ("twice is enough", Giraud et al. 2005),
// each vector pre-scaled to unit norm so that tiny or huge inputs neither underflow nor
// overflow. A vector that is zero, non-finite, or numerically inside the span of the earlier
// ones is set to zero and reported in `degenerate` (k flags, may be null). Requires k <= 64.
void orthonormalize(float* v, std::size_t k, std::size_t len, bool* degenerate);

}  // namespace terse::kit
