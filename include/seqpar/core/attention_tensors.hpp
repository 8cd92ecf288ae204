// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `AttentionTensors<T>`: the owning buffers of one attention forward and backward over n tokens
/// (inputs Q, K, V, dO; outputs O, LSE, dQ, dK, dV), dense THD (q, k, dq, dk of shape.qk_dim(); v, o, dout, dv
/// of shape.v_dim()) and (heads, tokens) LSE. For tests,
/// examples and trainers that hold a whole batch or one rank's rows; the library itself takes views.

#include <cstdint>

#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar {

template <class T>
struct AttentionTensors {
  ThdTensor<T> q, k, v, dout, o, dq, dk, dv;
  LseTensor<T> lse;

  AttentionTensors(std::int64_t n, const AttentionShape& s)
      : q(n, s.heads_q, s.qk_dim()),
        k(n, s.heads_kv, s.qk_dim()),
        v(n, s.heads_kv, s.v_dim()),
        dout(n, s.heads_q, s.v_dim()),
        o(n, s.heads_q, s.v_dim()),
        dq(n, s.heads_q, s.qk_dim()),
        dk(n, s.heads_kv, s.qk_dim()),
        dv(n, s.heads_kv, s.v_dim()),
        lse(s.heads_q, n) {}
};

}  // namespace seqpar
