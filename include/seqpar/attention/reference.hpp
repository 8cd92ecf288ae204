// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "seqpar/attention/detail/call_checks.hpp"
#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/host_exec.hpp"

namespace seqpar::attention {

/// The oracle: naive attention in double precision, forward (O, LSE) and backward (dQ, dK, dV),
/// over a slice list. Every distributed strategy is checked against it on the unsharded batch.
/// O(rows * keys * d) time, allocates freely, single-threaded: tests only.
///
/// @code
/// attention::Reference<double> ref;
/// ref.forward(shape, q, k, v, batch.document_causal_slices(), o, lse, {});
/// @endcode
template <class T>
class Reference {
 public:
  using kernel_category = kernel_tag;
  using value_type = T;
  using accum_type = double;
  using exec_type = HostExec;

  /// The oracle runs on the calling thread whatever context it is given.
  [[nodiscard]] HostExec exec() const { return HostExec(1); }

  template <class... Args>
  void forward(const HostExec&, Args&&... args) const {
    forward(std::forward<Args>(args)...);
  }
  template <class... Args>
  void backward(const HostExec&, Args&&... args) const {
    backward(std::forward<Args>(args)...);
  }

  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape&, std::int64_t, std::int64_t) const noexcept {
    return 0;
  }

  /// Any well-formed shape whose softmax scale double keeps exact (softmax_scale_status); the calls refuse
  /// the same ones.
  [[nodiscard]] Status can_implement(const AttentionShape& shape) const {
    return softmax_scale_status<accum_type>(shape, "Reference");
  }

  void forward(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
               std::span<const AttnSlice> slices, ThdView<T> o, LseView<double> lse,
               std::span<std::byte> workspace = {}) const {
    check(shape, q, k, v, slices, "Reference::forward");
    // the flash kernels' output checks: o is written while v is still read, so an alias is a wrong answer here too
    detail::check_forward_outputs("Reference::forward", shape, q, k, v, o, lse, workspace);
    const int d = shape.qk_dim(), dv = shape.v_dim();
    const double scale = shape.scale();
    for (int h = 0; h < shape.heads_q; ++h)
      for (std::int64_t t = 0; t < q.tokens; ++t) {
        lse(h, t) = -std::numeric_limits<double>::infinity();
        for (int x = 0; x < dv; ++x) o(t, h, x) = T(0);
      }
    std::vector<double> s, acc(static_cast<std::size_t>(dv));
    for (const AttnSlice& sl : slices)
      for (int h = 0; h < shape.heads_q; ++h) {
        const int hk = h / shape.group_size();
        for (std::int64_t qi = 0; qi < sl.q_range.size(); ++qi) {
          const std::int64_t i = sl.q_range.begin + qi;
          const Range vis = sl.mask.visible_keys(qi, sl.k_range.size());
          if (vis.empty()) continue;
          s.assign(static_cast<std::size_t>(vis.size()), 0.0);
          double m = -std::numeric_limits<double>::infinity();
          for (std::int64_t kj = vis.begin; kj < vis.end; ++kj) {
            const std::int64_t j = sl.k_range.begin + kj;
            double dot = 0;
            for (int x = 0; x < d; ++x) dot += double(q(i, h, x)) * double(k(j, hk, x));
            s[static_cast<std::size_t>(kj - vis.begin)] = dot * scale;
            m = std::max(m, dot * scale);
          }
          double sum = 0;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (std::int64_t kj = vis.begin; kj < vis.end; ++kj) {
            const double p = std::exp(s[static_cast<std::size_t>(kj - vis.begin)] - m);
            sum += p;
            const std::int64_t j = sl.k_range.begin + kj;
            for (int x = 0; x < dv; ++x) acc[static_cast<std::size_t>(x)] += p * double(v(j, hk, x));
          }
          for (int x = 0; x < dv; ++x) o(i, h, x) = T(acc[static_cast<std::size_t>(x)] / sum);
          lse(h, i) = m + std::log(sum);
        }
      }
  }

  void backward(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                ThdView<const T> o, LseView<const double> lse, ThdView<const T> dout, std::span<const AttnSlice> slices,
                ThdView<T> dq, ThdView<T> dk, ThdView<T> dv, std::span<std::byte> workspace = {}) const {
    constexpr const char* where = "Reference::backward";
    check(shape, q, k, v, slices, where);
    detail::check_backward_views(where, shape, q, k, v, o, lse, dout, dq, dk, dv, workspace);
    const int d = shape.qk_dim(), d_v = shape.v_dim();
    const double scale = shape.scale();
    std::vector<double> dqi(static_cast<std::size_t>(d));
    for (const AttnSlice& sl : slices)
      for (int h = 0; h < shape.heads_q; ++h) {
        const int hk = h / shape.group_size();
        for (std::int64_t qi = 0; qi < sl.q_range.size(); ++qi) {
          const std::int64_t i = sl.q_range.begin + qi;
          const Range vis = sl.mask.visible_keys(qi, sl.k_range.size());
          if (vis.empty()) continue;
          double delta = 0;  // D_i = rowsum(dO * O)
          for (int x = 0; x < d_v; ++x) delta += double(dout(i, h, x)) * double(o(i, h, x));
          std::fill(dqi.begin(), dqi.end(), 0.0);
          for (std::int64_t kj = vis.begin; kj < vis.end; ++kj) {
            const std::int64_t j = sl.k_range.begin + kj;
            double dot = 0, dp = 0;
            for (int x = 0; x < d; ++x) dot += double(q(i, h, x)) * double(k(j, hk, x));
            for (int x = 0; x < d_v; ++x) dp += double(dout(i, h, x)) * double(v(j, hk, x));
            const double p = std::exp(dot * scale - lse(h, i));
            const double ds = p * (dp - delta) * scale;
            for (int x = 0; x < d_v; ++x) dv(j, hk, x) = T(double(dv(j, hk, x)) + p * double(dout(i, h, x)));
            for (int x = 0; x < d; ++x) {
              dk(j, hk, x) = T(double(dk(j, hk, x)) + ds * double(q(i, h, x)));
              dqi[static_cast<std::size_t>(x)] += ds * double(k(j, hk, x));
            }
          }
          for (int x = 0; x < d; ++x) dq(i, h, x) = T(double(dq(i, h, x)) + dqi[static_cast<std::size_t>(x)]);
        }
      }
  }

 private:
  static void check(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                    std::span<const AttnSlice> slices, const char* where) {
    seqpar::detail::throw_if_refused(softmax_scale_status<accum_type>(shape, where));
    seqpar::detail::check_view(q, where, "q", q.tokens, shape.heads_q, shape.qk_dim());
    seqpar::detail::check_view(k, where, "k", k.tokens, shape.heads_kv, shape.qk_dim());
    seqpar::detail::check_view(v, where, "v", k.tokens, shape.heads_kv, shape.v_dim());
    validate_slices(slices, q.tokens, k.tokens, where);
  }
};

static_assert(AttentionKernel<Reference<double>>);
static_assert(AttentionKernel<Reference<float>>);

}  // namespace seqpar::attention
