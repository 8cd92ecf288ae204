// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The element type as a number two ranks can compare: every call's agreement (runtime/engine.hpp) holds
/// it, so a rank running another storage type than its peers is refused by name instead of exchanging
/// rows of another width or encoding. Sizes alone cannot tell float16 from bfloat16 (both 2 bytes), so the
/// code holds the significand's bits too (numeric_limits<T>::digits: float16 11, bfloat16 8, float 24,
/// double 53).

#include <cstdint>
#include <limits>

namespace seqpar {

/// The significand bits of T (the implicit bit included). Types without a numeric_limits specialization
/// (CUDA's __half and __nv_bfloat16, seqpar's CPU bf16) specialize this trait where they are defined:
/// attention/detail/bf16.hpp, kernels/seqpar/gpu/detail/element.hpp. 0: unknown (the code then holds the
/// sizes only).
template <class T>
struct element_significand_bits {
  static constexpr int value = std::numeric_limits<T>::is_specialized ? std::numeric_limits<T>::digits : 0;
};

/// BBSSAA in decimal: the value type's bytes (BB), its significand bits (SS) and the accumulation type's
/// bytes (AA). float/float 42404, double/double 85308, bfloat16/float 20804, float16/float 21104.
template <class Value, class Accum>
[[nodiscard]] constexpr std::int64_t element_code() noexcept {
  return static_cast<std::int64_t>(sizeof(Value)) * 10000 + element_significand_bits<Value>::value * 100 +
         static_cast<std::int64_t>(sizeof(Accum));
}

}  // namespace seqpar
