// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cmath>
#include <string>

#include "seqpar/core/error.hpp"
#include "seqpar/core/status.hpp"

namespace seqpar {

/// Head structure of one attention layer. GQA/MQA when heads_kv < heads_q: query head h reads
/// KV head h / (heads_q / heads_kv), without copying KV.
///
/// Query/key and value head sizes may differ (MLA: 192 and 128, or 576 and 512 in its absorbed form):
/// q, k, dq and dk have `qk_dim()` = head_dim values per head, v, o, dout and dv have `v_dim()` =
/// head_dim_v (0: the same as head_dim, so a shape written before the field existed is unchanged).
///
///     AttentionShape mla{.heads_q = 16, .heads_kv = 16, .head_dim = 192, .head_dim_v = 128};
struct AttentionShape {
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  double softmax_scale = 0.0;  ///< 0 means 1 / sqrt(head_dim)
  int head_dim_v = 0;          ///< value (and output) head size; 0 means head_dim

  [[nodiscard]] int group_size() const noexcept { return heads_q / heads_kv; }
  /// Head size of q, k, dq, dk.
  [[nodiscard]] int qk_dim() const noexcept { return head_dim; }
  /// Head size of v, o, dout, dv.
  [[nodiscard]] int v_dim() const noexcept { return head_dim_v != 0 ? head_dim_v : head_dim; }
  /// Whether the value head size differs from the query/key one.
  [[nodiscard]] bool split_dims() const noexcept { return v_dim() != head_dim; }
  [[nodiscard]] double scale() const noexcept {
    return softmax_scale != 0.0 ? softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  }

  /// Whether the shape is well formed: heads and head_dim positive, heads_q a multiple of heads_kv,
  /// head_dim at most 1024, head_dim_v in [0, 1024], softmax_scale finite and >= 0 (the refusal names the
  /// field and its value).
  [[nodiscard]] Status status(const char* where = "AttentionShape") const {
    if (heads_q > 0 && heads_kv > 0 && heads_q % heads_kv == 0 && head_dim > 0 && head_dim <= 1024 && head_dim_v >= 0 &&
        head_dim_v <= 1024 && std::isfinite(softmax_scale) && softmax_scale >= 0.0)
      return Status::success();  // the hot path builds no message
    if (heads_q <= 0) return detail::refuse_invalid(where, "heads_q", heads_q, "must be positive");
    if (heads_kv <= 0) return detail::refuse_invalid(where, "heads_kv", heads_kv, "must be positive");
    if (heads_q % heads_kv != 0)
      return detail::refuse_invalid(where, "heads_q", heads_q,
                                    "must be a multiple of heads_kv = " + std::to_string(heads_kv));
    if (head_dim <= 0 || head_dim > 1024)
      return detail::refuse_invalid(where, "head_dim", head_dim, "must be in [1, 1024]");
    if (head_dim_v < 0 || head_dim_v > 1024)
      return detail::refuse_invalid(where, "head_dim_v", head_dim_v, "must be in [0, 1024] (0 = head_dim)");
    return detail::refuse_invalid(where, "softmax_scale", softmax_scale,
                                  "must be finite and >= 0 (0 = 1/sqrt(head_dim))");
  }
  /// Throws std::invalid_argument naming the field when `status` refuses the shape.
  void validate(const char* where = "AttentionShape") const { detail::throw_if_refused(status(where)); }
  friend bool operator==(const AttentionShape&, const AttentionShape&) = default;
};

}  // namespace seqpar
