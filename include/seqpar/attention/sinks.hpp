// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Attention sinks: a learnable logit s_h per query head that joins every row's softmax as one more
/// term with no value (gpt-oss; the learnable form of StreamingLLM's sink token, Xiao et al. 2023):
///   O'_i = sum_j e^{S_ij} v_j / (e^{s_h} + sum_j e^{S_ij}),   LSE'_i = log(e^{s_h} + sum_j e^{S_ij}).
///
/// Why an epilogue and not a kernel change: the term has no value, so the row with a sink is the row
/// without it rescaled, O' = O e^{LSE - LSE'} with LSE' = logaddexp(LSE, s_h). Applied once to the
/// *merged* row (after every ring step, GQA group and head exchange has been folded in), the sink is
/// counted once per query row whatever the strategy split the row into; a per-partial sink would be
/// counted once per piece. The backward needs no kernel change either: every kernel's backward takes
/// the final O and LSE and computes P_ij = e^{S_ij - LSE'} and D_i = dO_i . O'_i, which with O', LSE'
/// are exactly the gradients with the sink (its dP is 0: it has no value). What is left is the sink's
/// own gradient,
///   ds_h = -sum_i e^{s_h - LSE'_i} D_i,
/// summed over the rows of every rank. So every kernel (Reference, CpuFlash, KokkosFlash, CudaFlash)
/// supports sinks through DistributedAttention, and a direct kernel call through these two functions.
///
/// s_h = -inf is a head without a sink (O and LSE unchanged, ds_h = 0). NaN and +inf are refused.
/// O(tokens * heads * head_dim), no allocation, single-threaded, on host memory (the engine calls
/// `runtime::DataOps<Exec>` for other contexts).
///
/// @code
/// kernel.forward(shape, q, k, v, slices, o, lse);            // o (T, Hq, D), lse (Hq, T)
/// attention::apply_sinks(o, lse, sinks);                     // sinks: Hq logits
/// kernel.backward(shape, q, k, v, o, lse, dout, slices, dq, dk, dv);   // with the sink's o and lse
/// attention::accumulate_sink_gradient(dout, o, lse, sinks, dsinks);   // dsinks += ds
/// @endcode

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "seqpar/core/error.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::attention {

/// Refuses sink logits that are not one per query head, or NaN / +inf (naming `sinks[h]`).
template <class A>
void check_sinks(const char* where, std::span<const A> sinks, int heads_q) {
  if (sinks.size() != static_cast<std::size_t>(heads_q))
    seqpar::detail::throw_invalid(where, "sinks.size()", sinks.size(),
                                  "must be heads_q = " + std::to_string(heads_q) + " (one sink logit per query head)");
  for (std::size_t h = 0; h < sinks.size(); ++h)
    if (std::isnan(sinks[h]) || sinks[h] == std::numeric_limits<A>::infinity())
      seqpar::detail::throw_invalid(where, ("sinks[" + std::to_string(h) + "]").c_str(), sinks[h],
                                    "must be finite, or -inf for a head without a sink");
}

namespace detail {
// log(e^a + e^b) without overflow; -inf when both are.
template <class A>
[[nodiscard]] A logaddexp(A a, A b) noexcept {
  const A m = a > b ? a : b;
  if (m == -std::numeric_limits<A>::infinity()) return m;
  return m + std::log1p(std::exp(-std::abs(a - b)));
}
}  // namespace detail

/// O <- O e^{LSE - LSE'}, LSE <- LSE' = logaddexp(LSE, sinks[h]) on every row: the sink of each query
/// head joins the softmax of every row of `o` (which must hold final, merged rows).
template <class T, class A>
void apply_sinks(ThdView<T> o, LseView<A> lse, std::type_identity_t<std::span<const A>> sinks) {
  constexpr const char* where = "attention::apply_sinks";
  seqpar::detail::check_view(lse, where, "lse", o.heads, o.tokens);
  check_sinks(where, sinks, o.heads);
  constexpr A ninf = -std::numeric_limits<A>::infinity();
  for (int h = 0; h < o.heads; ++h) {
    const A s = sinks[static_cast<std::size_t>(h)];
    if (s == ninf) continue;
    for (std::int64_t t = 0; t < o.tokens; ++t) {
      const A l = lse(h, t);
      const A with_sink = detail::logaddexp(l, s);
      const A keep = l == ninf ? A(0) : std::exp(l - with_sink);  // the rows' share of the softmax
      T* row = o.row(t, h);
      for (int x = 0; x < o.head_dim; ++x) row[x] = T(A(row[x]) * keep);
      lse(h, t) = with_sink;
    }
  }
}

/// dsinks[h] += -sum_t e^{sinks[h] - LSE'(h, t)} (dO(t, h) . O'(t, h)) over the rows given, from the
/// sink-applied O' and LSE' (what apply_sinks left). A distributed caller sums it over its ranks.
template <class T, class A>
void accumulate_sink_gradient(ThdView<const T> dout, ThdView<const T> o, LseView<const A> lse,
                              std::type_identity_t<std::span<const A>> sinks, std::span<A> dsinks) {
  constexpr const char* where = "attention::accumulate_sink_gradient";
  seqpar::detail::check_view(dout, where, "dout", o.tokens, o.heads, o.head_dim);
  seqpar::detail::check_view(lse, where, "lse", o.heads, o.tokens);
  check_sinks(where, sinks, o.heads);
  if (dsinks.size() != sinks.size())
    seqpar::detail::throw_invalid(where, "dsinks.size()", dsinks.size(),
                                  "must be heads_q = " + std::to_string(o.heads));
  constexpr A ninf = -std::numeric_limits<A>::infinity();
  for (int h = 0; h < o.heads; ++h) {
    const A s = sinks[static_cast<std::size_t>(h)];
    if (s == ninf) continue;
    A sum = 0;
    for (std::int64_t t = 0; t < o.tokens; ++t) {
      const T* g = dout.row(t, h);
      const T* y = o.row(t, h);
      A dot = 0;
      for (int x = 0; x < o.head_dim; ++x) dot += A(g[x]) * A(y[x]);
      sum += std::exp(s - lse(h, t)) * dot;
    }
    dsinks[static_cast<std::size_t>(h)] -= sum;
  }
}

}  // namespace seqpar::attention
