// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Warp-level products over shared memory, the two shapes FlashAttention's forward and backward are
/// made of. One warp computes a 16-row strip:
///   gemm_nt:     C[16][N]  = A[16][K] * B[N][K]^T   (S = Q K^T, dP = dO V^T, S^T = K Q^T, ...)
///   gemm_nn_acc: C[16][N] += A[16][K] * B[K][N]     (O += P V, dQ += dS K, dV += P^T dO, ...)
/// A and B are row-major tiles of the storage type T, C is fp32. For fp16/bf16 the products run on
/// tensor cores through WMMA 16x16x16 (fp32 accumulation); for fp32 they are exact fp32 FMAs on the
/// CUDA cores (TF32 tensor cores would miss the 1e-4 bound the fp32 path is tested to).
/// Layout rules (WMMA): tile base pointers 32-byte aligned, leading dimensions a multiple of 8
/// elements for 16-bit T and of 4 for fp32 C; the kernels' shared-memory plans keep them.

#include <mma.h>

#include "seqpar/gpu/detail/element.hpp"

namespace seqpar::gpu::detail {

template <class T, int N, int K>
__device__ __forceinline__ void gemm_nt(const T* a, int lda, const T* b, int ldb, float* c, int ldc) {
  static_assert(N % 16 == 0 && K % 16 == 0);
  if constexpr (kIsHalfPrecision<T>) {
    using namespace nvcuda;
#pragma unroll
    for (int n0 = 0; n0 < N; n0 += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int k0 = 0; k0 < K; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;  // B^T: B's rows are its columns
        wmma::load_matrix_sync(fa, a + k0, static_cast<unsigned>(lda));
        wmma::load_matrix_sync(fb, b + n0 * ldb + k0, static_cast<unsigned>(ldb));
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(c + n0, acc, static_cast<unsigned>(ldc), wmma::mem_row_major);
    }
  } else {
    // Lane l owns columns l, l + 32, ...: B is read row by row (lanes on different rows; the fp32
    // tiles are padded to an odd leading dimension, so no bank conflicts), A is a broadcast.
    constexpr int kCols = N / 32 > 0 ? N / 32 : 1;
    const int lane = static_cast<int>(threadIdx.x % 32);
    float acc[16][kCols];
#pragma unroll
    for (int r = 0; r < 16; ++r)
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[r][j] = 0.0f;
    for (int k = 0; k < K; ++k) {
      float bv[kCols];
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int n = lane + 32 * j;
        bv[j] = n < N ? b[n * ldb + k] : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const float av = a[r * lda + k];
#pragma unroll
        for (int j = 0; j < kCols; ++j) acc[r][j] = fmaf(av, bv[j], acc[r][j]);
      }
    }
#pragma unroll
    for (int r = 0; r < 16; ++r)
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int n = lane + 32 * j;
        if (n < N) c[r * ldc + n] = acc[r][j];
      }
  }
  __syncwarp();
}

template <class T, int N, int K>
__device__ __forceinline__ void gemm_nn_acc(const T* a, int lda, const T* b, int ldb, float* c, int ldc) {
  static_assert(N % 16 == 0 && K % 16 == 0);
  if constexpr (kIsHalfPrecision<T>) {
    using namespace nvcuda;
#pragma unroll
    for (int n0 = 0; n0 < N; n0 += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, c + n0, static_cast<unsigned>(ldc), wmma::mem_row_major);
#pragma unroll
      for (int k0 = 0; k0 < K; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, a + k0, static_cast<unsigned>(lda));
        wmma::load_matrix_sync(fb, b + k0 * ldb + n0, static_cast<unsigned>(ldb));
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(c + n0, acc, static_cast<unsigned>(ldc), wmma::mem_row_major);
    }
  } else {
    // Lane l owns columns l, l + 32, ... of C; B's row k is read by consecutive lanes.
    constexpr int kCols = N / 32 > 0 ? N / 32 : 1;
    const int lane = static_cast<int>(threadIdx.x % 32);
    float acc[16][kCols];
#pragma unroll
    for (int r = 0; r < 16; ++r)
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int n = lane + 32 * j;
        acc[r][j] = n < N ? c[r * ldc + n] : 0.0f;
      }
    for (int k = 0; k < K; ++k) {
      float bv[kCols];
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int n = lane + 32 * j;
        bv[j] = n < N ? b[k * ldb + n] : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const float av = a[r * lda + k];
#pragma unroll
        for (int j = 0; j < kCols; ++j) acc[r][j] = fmaf(av, bv[j], acc[r][j]);
      }
    }
#pragma unroll
    for (int r = 0; r < 16; ++r)
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int n = lane + 32 * j;
        if (n < N) c[r * ldc + n] = acc[r][j];
      }
  }
  __syncwarp();
}

}  // namespace seqpar::gpu::detail
