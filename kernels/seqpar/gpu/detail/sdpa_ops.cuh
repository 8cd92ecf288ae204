// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Definitions of sdpa_ops.hpp (nvcc only; included by ONE translation unit, kernels/instances/
/// sdpa_ops.cu: the non-template functions are defined here, not inline). Grid-stride loops, 64-bit
/// indices.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/detail/element.hpp"
#include "seqpar/gpu/detail/sdpa_ops.hpp"

namespace seqpar::gpu::detail::sdpa_ops {

namespace kernels {

__global__ void ragged_offsets(const std::int64_t* q_tokens, const std::int64_t* k_tokens, int items,
                               RaggedStrides strides, std::int32_t* out) {
  const int n = items + 1;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < kTensors * n; i += gridDim.x * blockDim.x) {
    const int t = i / n, b = i % n;
    const bool q_side = t == kQ || t == kO || t == kDo || t == kDq;
    out[i] = static_cast<std::int32_t>((q_side ? q_tokens[b] : k_tokens[b]) * strides.token_stride[t]);
  }
}

// Views reach the kernels as pointers and strides (the host views' members are host functions).
__global__ void scatter_stats(const float* stats, const std::int64_t* q_tokens, const std::int32_t* q_lens, int items,
                              int heads, std::int64_t max_q, float* lse, std::int64_t lse_head_stride) {
  const std::int64_t n = std::int64_t{items} * heads * max_q;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t s = i % max_q, bh = i / max_q;
    const int h = static_cast<int>(bh % heads), b = static_cast<int>(bh / heads);
    if (s < q_lens[b]) lse[h * lse_head_stride + q_tokens[b] + s] = stats[i];
  }
}

__global__ void gather_stats(const float* lse, std::int64_t lse_head_stride, const std::int64_t* q_tokens,
                             const std::int32_t* q_lens, int items, int heads, std::int64_t max_q, float* stats) {
  const std::int64_t n = std::int64_t{items} * heads * max_q;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t s = i % max_q, bh = i / max_q;
    const int h = static_cast<int>(bh % heads), b = static_cast<int>(bh / heads);
    stats[i] = s < q_lens[b] ? lse[h * lse_head_stride + q_tokens[b] + s] : 0.0f;
  }
}

// The buffer row of a run's r-th row (r < ranges.rows): the item b with prefix[b] <= r < prefix[b + 1]
// (binary search; zero-length items share their prefix with the next and are skipped by it).
__device__ inline std::int64_t row_of(RowRanges ranges, std::int64_t r) {
  int lo = 0, hi = ranges.items;  // invariant: prefix[lo] <= r < prefix[hi]
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (ranges.prefix[mid] <= r)
      lo = mid;
    else
      hi = mid;
  }
  return ranges.tokens[lo] + (r - ranges.prefix[lo]);
}

template <class T>
__global__ void zero_rows(T* data, std::int64_t token_stride, std::int64_t head_stride, int heads, int head_dim,
                          RowRanges ranges) {
  const std::int64_t n = ranges.rows * heads * head_dim;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const int d = static_cast<int>(i % head_dim);
    const std::int64_t rh = i / head_dim;
    const int h = static_cast<int>(rh % heads);
    data[row_of(ranges, rh / heads) * token_stride + h * head_stride + d] = from_float<T>(0.0f);
  }
}

template <class T>
__global__ void accumulate_rows(T* dst, std::int64_t token_stride, std::int64_t head_stride, int heads, int head_dim,
                                const T* src, RowRanges ranges) {
  const std::int64_t n = ranges.rows * heads * head_dim;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const int d = static_cast<int>(i % head_dim);
    const std::int64_t rh = i / head_dim;
    const int h = static_cast<int>(rh % heads);
    const std::int64_t t = row_of(ranges, rh / heads);
    T& out = dst[t * token_stride + h * head_stride + d];
    out = from_float<T>(to_float(out) + to_float(src[(t * heads + h) * head_dim + d]));
  }
}

// Blocks for a grid-stride loop over n elements: enough to fill an H200 several times over.
inline unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + 255) / 256;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 4096 ? 4096 : b));
}

}  // namespace kernels

void ragged_offsets(cudaStream_t stream, const std::int64_t* q_tokens, const std::int64_t* k_tokens, int items,
                    RaggedStrides strides, std::int32_t* out) {
  kernels::ragged_offsets<<<kernels::blocks_for(std::int64_t{kTensors} * (items + 1)), 256, 0, stream>>>(
      q_tokens, k_tokens, items, strides, out);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), "CudnnSdpa: ragged offsets");
}

void scatter_stats(cudaStream_t stream, const float* stats, const std::int64_t* q_tokens, const std::int32_t* q_lens,
                   int items, int heads, std::int64_t max_q, LseView<float> lse) {
  kernels::scatter_stats<<<kernels::blocks_for(std::int64_t{items} * heads * max_q), 256, 0, stream>>>(
      stats, q_tokens, q_lens, items, heads, max_q, lse.data, lse.head_stride);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), "CudnnSdpa: statistics to LSE");
}

void gather_stats(cudaStream_t stream, LseView<const float> lse, const std::int64_t* q_tokens,
                  const std::int32_t* q_lens, int items, int heads, std::int64_t max_q, float* stats) {
  kernels::gather_stats<<<kernels::blocks_for(std::int64_t{items} * heads * max_q), 256, 0, stream>>>(
      lse.data, lse.head_stride, q_tokens, q_lens, items, heads, max_q, stats);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), "CudnnSdpa: LSE to statistics");
}

template <class T>
void zero_rows(cudaStream_t stream, ThdView<T> scratch, RowRanges ranges) {
  const std::int64_t n = ranges.rows * scratch.heads * scratch.head_dim;
  if (n == 0) return;
  kernels::zero_rows<T><<<kernels::blocks_for(n), 256, 0, stream>>>(
      scratch.data, scratch.token_stride, scratch.head_stride, scratch.heads, scratch.head_dim, ranges);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), "CudnnSdpa: zeroing a run's gradient rows");
}

template <class T>
void accumulate_rows(cudaStream_t stream, ThdView<T> dst, const T* src, RowRanges ranges) {
  const std::int64_t n = ranges.rows * dst.heads * dst.head_dim;
  if (n == 0) return;
  kernels::accumulate_rows<T><<<kernels::blocks_for(n), 256, 0, stream>>>(dst.data, dst.token_stride, dst.head_stride,
                                                                          dst.heads, dst.head_dim, src, ranges);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), "CudnnSdpa: adding a gradient");
}

}  // namespace seqpar::gpu::detail::sdpa_ops
