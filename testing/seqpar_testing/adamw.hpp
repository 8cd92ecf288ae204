// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "seqpar/core/error.hpp"

namespace seqpar::testing {

/// AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019): Adam moments with
/// bias correction, and weight decay applied to the parameters directly (not through the gradient):
///   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
///   p -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * p).
/// Elementwise and deterministic: ranks that hold the same parameters and the same (all-reduced)
/// gradients stay bit-identical.
template <class T>
class AdamW {
 public:
  struct Arguments {
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.01;
  };

  AdamW(std::size_t params, Arguments args) : args_(args), m_(params, T{0}), v_(params, T{0}) {
    constexpr const char* where = "testing::AdamW";
    seqpar::detail::require(args.lr > 0 && std::isfinite(args.lr), where, "lr", args.lr, "must be finite and > 0");
    seqpar::detail::require(args.beta1 >= 0 && args.beta1 < 1, where, "beta1", args.beta1, "must be in [0, 1)");
    seqpar::detail::require(args.beta2 >= 0 && args.beta2 < 1, where, "beta2", args.beta2, "must be in [0, 1)");
    seqpar::detail::require(args.eps > 0, where, "eps", args.eps, "must be > 0");
    seqpar::detail::require(args.weight_decay >= 0, where, "weight_decay", args.weight_decay, "must be >= 0");
  }

  /// One update of `params` from `grads` (both the size given at construction).
  void step(std::span<T> params, std::span<const T> grads) {
    constexpr const char* where = "testing::AdamW::step";
    seqpar::detail::require(params.size() == m_.size(), where, "params.size()", params.size(),
                            "expected " + std::to_string(m_.size()));
    seqpar::detail::require(grads.size() == m_.size(), where, "grads.size()", grads.size(),
                            "expected " + std::to_string(m_.size()));
    ++t_;
    const double c1 = 1.0 - std::pow(args_.beta1, static_cast<double>(t_));
    const double c2 = 1.0 - std::pow(args_.beta2, static_cast<double>(t_));
    const T b1 = static_cast<T>(args_.beta1), b2 = static_cast<T>(args_.beta2);
    for (std::size_t i = 0; i < params.size(); ++i) {
      const T g = grads[i];
      m_[i] = b1 * m_[i] + (T{1} - b1) * g;
      v_[i] = b2 * v_[i] + (T{1} - b2) * g * g;
      const double update =
          (static_cast<double>(m_[i]) / c1) / (std::sqrt(static_cast<double>(v_[i]) / c2) + args_.eps);
      params[i] = static_cast<T>(static_cast<double>(params[i]) -
                                 args_.lr * (update + args_.weight_decay * static_cast<double>(params[i])));
    }
  }

  [[nodiscard]] std::int64_t steps() const noexcept { return t_; }

 private:
  Arguments args_;
  std::vector<T> m_, v_;
  std::int64_t t_ = 0;
};

}  // namespace seqpar::testing
