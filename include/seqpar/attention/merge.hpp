// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `attention::merge_into`: combines two partial attention results over disjoint key sets into the
/// result over their union (ring attention, split KV, several slices per query row).
///
/// For each row with partial (o1, l1) (already in the output) and (o2, l2):
///   lse = m + log(e^{l1-m} + e^{l2-m}), m = max(l1, l2)   (computed as m + log1p(e^{-|l1-l2|}))
///   o   = o1 e^{l1-lse} + o2 e^{l2-lse}
/// in the accumulation type A (float for float outputs); a side with LSE = -inf contributes nothing, so
/// rows with -inf on both sides stay O = 0, LSE = -inf. The merge is commutative up to rounding.
/// O(tokens * heads * head_dim), no allocation, single-threaded.
///
/// @code
/// attention::merge_into(o, lse, o_step, lse_step);   // o (T, H, D) and lse (H, T) hold the running result
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "seqpar/core/error.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::attention {

template <class T, class A>
void merge_into(ThdView<T> o, LseView<A> lse, std::type_identity_t<ThdView<const T>> o_part,
                std::type_identity_t<LseView<const A>> lse_part) {
  constexpr const char* where = "attention::merge_into";
  seqpar::detail::check_view(o, where, "o", o.tokens, o.heads, o.head_dim);
  seqpar::detail::check_view(o_part, where, "o_part", o.tokens, o.heads, o.head_dim);
  seqpar::detail::check_view(lse, where, "lse", o.heads, o.tokens);
  seqpar::detail::check_view(lse_part, where, "lse_part", o.heads, o.tokens);
  constexpr A ninf = -std::numeric_limits<A>::infinity();
  const int d = o.head_dim;
  for (int h = 0; h < o.heads; ++h)
    for (std::int64_t t = 0; t < o.tokens; ++t) {
      const A l2 = lse_part(h, t);
      if (l2 == ninf) continue;
      const A l1 = lse(h, t);
      T* dst = o.row(t, h);
      const T* src = o_part.row(t, h);
      if (l1 == ninf) {
        std::copy_n(src, d, dst);
        lse(h, t) = l2;
        continue;
      }
      const A m = std::max(l1, l2);
      const A merged = m + std::log1p(std::exp(-std::abs(l1 - l2)));
      const A w1 = std::exp(l1 - merged);
      const A w2 = std::exp(l2 - merged);
      for (int x = 0; x < d; ++x) dst[x] = T(A(dst[x]) * w1 + A(src[x]) * w2);
      lse(h, t) = merged;
    }
}

}  // namespace seqpar::attention
