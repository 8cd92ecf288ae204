// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// What the forward and backward kernels share: kernel parameters (views flattened into pointers and
/// element strides, since the views' member functions are host code), tile loads into shared memory,
/// and the fill of rows no slice covers.

#include <cstdint>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/gpu/detail/element.hpp"
#include "seqpar/gpu/detail/tile_math.hpp"

namespace seqpar::gpu::detail {

/// A THD view on the device: element (t, h, d) at data[t * token_stride + h * head_stride + d].
template <class T>
struct DeviceThd {
  T* data;
  std::int64_t token_stride;
  std::int64_t head_stride;
  __device__ T* row(std::int64_t t, int h) const { return data + t * token_stride + h * head_stride; }
};

/// An LSE view on the device: element (h, t) at data[h * head_stride + t].
template <class T>
struct DeviceLse {
  T* data;
  std::int64_t head_stride;
  __device__ T& operator()(int h, std::int64_t t) const { return data[h * head_stride + t]; }
};

/// max(a, b) that keeps a NaN (fmaxf drops it): a NaN score must reach its row's O and LSE, not pass
/// for a masked key (the kernel cases' non-finite isolation: "not hidden").
__device__ __forceinline__ float max_keep_nan(float a, float b) {
  return (a != a || b != b) ? a + b : fmaxf(a, b);
}

/// Rows [first, first + valid) of one head of `src` into a ROWS x D tile (leading dimension ld);
/// rows past `valid` are zero, so that masked products never read another document's values.
template <class T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_rows(T* dst, int ld, DeviceThd<const T> src, int head, std::int64_t first,
                                          int valid) {
  for (int e = static_cast<int>(threadIdx.x); e < ROWS * D; e += THREADS) {
    const int r = e / D, c = e % D;
    dst[r * ld + c] = r < valid ? src.row(first + r, head)[c] : from_float<T>(0.0f);
  }
}

/// O = 0 and LSE = -inf on every row (forward: rows no slice covers keep them).
template <class T>
__global__ void fill_empty_kernel(DeviceThd<T> o, DeviceLse<float> lse, std::int64_t tokens, int heads, int head_dim) {
  const std::int64_t n = tokens * heads;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n * head_dim;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / head_dim;
    const int d = static_cast<int>(i % head_dim);
    const std::int64_t t = row / heads;
    const int h = static_cast<int>(row % heads);
    o.row(t, h)[d] = from_float<T>(0.0f);
    if (d == 0) lse(h, t) = -INFINITY;
  }
}

}  // namespace seqpar::gpu::detail
