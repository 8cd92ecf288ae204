// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cmath>

#include "seqpar/core/error.hpp"

namespace seqpar {

/// Head structure of one attention layer. GQA/MQA when heads_kv < heads_q: query head h reads
/// KV head h / (heads_q / heads_kv), without copying KV.
struct AttentionShape {
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  double softmax_scale = 0.0;  ///< 0 means 1 / sqrt(head_dim)

  [[nodiscard]] int group_size() const noexcept { return heads_q / heads_kv; }
  [[nodiscard]] double scale() const noexcept {
    return softmax_scale != 0.0 ? softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  }

  void validate(const char* where = "AttentionShape") const {
    if (heads_q > 0 && heads_kv > 0 && heads_q % heads_kv == 0 && head_dim > 0 && head_dim <= 1024 &&
        std::isfinite(softmax_scale) && softmax_scale >= 0.0)
      return;  // the hot path builds no message
    detail::require(heads_q > 0, where, "heads_q", heads_q, "must be positive");
    detail::require(heads_kv > 0, where, "heads_kv", heads_kv, "must be positive");
    detail::require(heads_q % heads_kv == 0, where, "heads_q", heads_q,
                    "must be a multiple of heads_kv = " + std::to_string(heads_kv));
    detail::require(head_dim > 0 && head_dim <= 1024, where, "head_dim", head_dim, "must be in [1, 1024]");
    detail::require(std::isfinite(softmax_scale) && softmax_scale >= 0.0, where, "softmax_scale", softmax_scale,
                    "must be finite and >= 0 (0 = 1/sqrt(head_dim))");
  }
  friend bool operator==(const AttentionShape&, const AttentionShape&) = default;
};

}  // namespace seqpar
