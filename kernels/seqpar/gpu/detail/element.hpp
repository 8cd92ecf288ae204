// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Storage types of the CUDA kernels (fp32, fp16, bf16) and their conversions (host and device, so
/// that tests and the data operations share them): values are stored in T and every sum is formed in fp32.
/// A .hpp: cuda_fp16.h and cuda_bf16.h are host headers too, so the C++ compiler parses it (host code
/// that names the storage types, e.g. tests converting their inputs).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "seqpar/core/element_code.hpp"

namespace seqpar::gpu::detail {

template <class T>
inline constexpr bool kIsHalfPrecision = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

template <class T>
inline constexpr bool kIsStorageType = std::is_same_v<T, float> || kIsHalfPrecision<T>;

template <class T>
__host__ __device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

template <class T>
__host__ __device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return __float2bfloat16_rn(x);
  }
}

}  // namespace seqpar::gpu::detail

/// The CUDA storage types' significand bits (no numeric_limits specialization in std): what tells a
/// float16 call from a bfloat16 one in the agreement (core/element_code.hpp).
template <>
struct seqpar::element_significand_bits<__half> {
  static constexpr int value = 11;
};
template <>
struct seqpar::element_significand_bits<__nv_bfloat16> {
  static constexpr int value = 8;
};
