// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The output-side checks every host kernel (Reference, CpuFlash, KokkosFlash) runs on a call (after its own
/// checks of q, k, v, the slices and the workspace size): each output's extents and layout, and that no output
/// shares memory with an input, another output or the workspace. Kernels zero or accumulate into their outputs
/// while still reading their inputs, so an alias is a wrong answer, not a slow one.

#include <cstddef>
#include <span>

#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/core/view_checks.hpp"

namespace seqpar::attention::detail {

template <class T, class A>
void check_forward_outputs(const char* where, const AttentionShape& shape, const ThdView<const T>& q,
                           const ThdView<const T>& k, const ThdView<const T>& v, const ThdView<T>& o,
                           const LseView<A>& lse, std::span<std::byte> workspace) {
  seqpar::detail::check_view(o, where, "o", q.tokens, shape.heads_q, shape.v_dim());
  seqpar::detail::check_view(lse, where, "lse", shape.heads_q, q.tokens);
  seqpar::detail::check_disjoint_from(where, "o", o, "q", q, "k", k, "v", v);
  seqpar::detail::check_disjoint_from(where, "lse", lse, "q", q, "k", k, "v", v, "o", o);
  seqpar::detail::check_disjoint_from(where, "workspace", workspace, "q", q, "k", k, "v", v, "o", o, "lse", lse);
}

template <class T, class A>
void check_backward_views(const char* where, const AttentionShape& shape, const ThdView<const T>& q,
                          const ThdView<const T>& k, const ThdView<const T>& v, const ThdView<const T>& o,
                          const LseView<const A>& lse, const ThdView<const T>& dout, const ThdView<T>& dq,
                          const ThdView<T>& dk, const ThdView<T>& dv, std::span<std::byte> workspace) {
  seqpar::detail::check_view(o, where, "o", q.tokens, shape.heads_q, shape.v_dim());
  seqpar::detail::check_view(dout, where, "dout", q.tokens, shape.heads_q, shape.v_dim());
  seqpar::detail::check_view(lse, where, "lse", shape.heads_q, q.tokens);
  seqpar::detail::check_view(dq, where, "dq", q.tokens, shape.heads_q, shape.qk_dim());
  seqpar::detail::check_view(dk, where, "dk", k.tokens, shape.heads_kv, shape.qk_dim());
  seqpar::detail::check_view(dv, where, "dv", k.tokens, shape.heads_kv, shape.v_dim());
  seqpar::detail::check_disjoint_from(where, "dq", dq, "q", q, "k", k, "v", v, "o", o, "lse", lse, "dout", dout);
  seqpar::detail::check_disjoint_from(where, "dk", dk, "q", q, "k", k, "v", v, "o", o, "lse", lse, "dout", dout, "dq",
                                      dq);
  seqpar::detail::check_disjoint_from(where, "dv", dv, "q", q, "k", k, "v", v, "o", o, "lse", lse, "dout", dout, "dq",
                                      dq, "dk", dk);
  seqpar::detail::check_disjoint_from(where, "workspace", workspace, "q", q, "k", k, "v", v, "o", o, "lse", lse, "dout",
                                      dout, "dq", dq, "dk", dk, "dv", dv);
}

}  // namespace seqpar::attention::detail
