// SPDX-License-Identifier: Apache-2.0
// The CPU side of the torch-flash kernel (python/src/torch_flash.hpp, issue 38): an fp64 stand-in of
// FlashAttention-2's varlen call as torch exposes it (aten::_flash_attention_forward / _backward), written
// from the call's documented semantics and independent of the mapping, and VarlenStandin, a host kernel
// on seqpar's kernel protocol that runs a slice table through the mapping
// (attention/detail/varlen_calls.hpp) and the stand-in, the way the GPU kernel runs it through torch's
// ops. Through it every strategy's slice tables reach the mapping on the CPU
// (tests/strategy/test_varlen_strategies.cpp), against the fp64 reference.
//
// What the stand-in models (FlashAttention 2 >= 2.1: flash_attn_interface.py's docstrings; torch's vendored
// flash_api.cpp, mha_varlen_fwd / mha_varlen_bwd):
//  - packed q (total_q, heads_q, d), k / v (total_k, heads_kv, d / dv); item b's rows [cu_q[b], cu_q[b+1]),
//    keys [cu_k[b], cu_k[b+1]); heads_q % heads_kv == 0 and query head h reads kv head h / group;
//  - `is_causal` forces right = 0; a bound >= max_k becomes no bound (FA's clamp); item row t sees item key u
//    iff (left < 0 or u >= t + sk - sq - left) and (right < 0 or u <= t + sk - sq + right): bottom-right;
//  - out (total_q, heads_q, dv); LSE float (heads_q, total_q) holding log sum exp(scale s); a row that sees
//    no key: O = 0, LSE = +inf (FA2's softmax.h);
//  - backward: dq, dk, dv freshly written (dk / dv summed over the query heads of a group), from the given
//    out and LSE (P = exp(scale s - LSE), D = rowsum(dO * O)).
#pragma once

#include <seqpar/attention/detail/call_checks.hpp>
#include <seqpar/attention/detail/varlen_calls.hpp>
#include <seqpar/attention/kernel.hpp>
#include <seqpar/core/host_exec.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace seqpar::test {

/// The varlen call's arguments besides the tensors (torch's names).
struct VarlenArgs {
  std::vector<std::int32_t> cu_seq_q, cu_seq_k;
  std::int64_t max_q = 0, max_k = 0;
  bool is_causal = false;
  double scale = 1.0;
  std::int64_t window_size_left = -1, window_size_right = -1;
  int heads_q = 1, heads_kv = 1, head_dim = 1, head_dim_v = 1;
};

/// FA's mask predicate for item row t, item key u (sq rows, sk keys), after FA's own normalisation.
inline bool varlen_sees(const VarlenArgs& a, std::int64_t t, std::int64_t u, std::int64_t sq, std::int64_t sk) {
  std::int64_t left = a.window_size_left, right = a.is_causal ? 0 : a.window_size_right;
  if (left >= a.max_k) left = -1;
  if (right >= a.max_k) right = -1;
  const std::int64_t diag = t + sk - sq;  // bottom-right: the last row's diagonal is the last key
  return (left < 0 || u >= diag - left) && (right < 0 || u <= diag + right);
}

namespace standin_detail {
inline void require_args(const VarlenArgs& a, std::size_t q_size, std::size_t k_size) {
  // The checks mha_varlen_fwd makes (by kind): malformed calls would be errors there too.
  if (a.cu_seq_q.size() != a.cu_seq_k.size() || a.cu_seq_q.size() < 2 || a.cu_seq_q.front() != 0 ||
      a.cu_seq_k.front() != 0)
    throw std::invalid_argument("varlen stand-in: cu_seq_q / cu_seq_k must have batch + 1 >= 2 entries from 0");
  if (a.heads_kv <= 0 || a.heads_q % a.heads_kv != 0)
    throw std::invalid_argument("varlen stand-in: heads_q must be a multiple of heads_kv");
  for (std::size_t b = 0; b + 1 < a.cu_seq_q.size(); ++b) {
    const std::int64_t sq = a.cu_seq_q[b + 1] - a.cu_seq_q[b], sk = a.cu_seq_k[b + 1] - a.cu_seq_k[b];
    if (sq < 0 || sk < 0 || sq > a.max_q || sk > a.max_k)
      throw std::invalid_argument("varlen stand-in: item " + std::to_string(b) + " lengths out of [0, max]");
  }
  const auto total_q = static_cast<std::size_t>(a.cu_seq_q.back()),
             total_k = static_cast<std::size_t>(a.cu_seq_k.back());
  if (q_size != total_q * static_cast<std::size_t>(a.heads_q * a.head_dim) ||
      k_size != total_k * static_cast<std::size_t>(a.heads_kv * a.head_dim))
    throw std::invalid_argument("varlen stand-in: packed q / k sizes disagree with cu_seq_q / cu_seq_k");
}
}  // namespace standin_detail

struct VarlenForward {
  std::vector<double> out;  ///< (total_q, heads_q, dv)
  std::vector<float> lse;   ///< (heads_q, total_q), FA's float LSE
};

/// at::_flash_attention_forward(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, is_causal, false, scale,
/// window_size_left, window_size_right) in fp64 (LSE rounded to float, as FA returns it).
inline VarlenForward varlen_forward(const VarlenArgs& a, const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<double>& v) {
  standin_detail::require_args(a, q.size(), k.size());
  const std::int64_t total_q = a.cu_seq_q.back();
  const int hq = a.heads_q, hk = a.heads_kv, d = a.head_dim, dv = a.head_dim_v, group = hq / hk;
  VarlenForward r{std::vector<double>(static_cast<std::size_t>(total_q * hq * dv), 0.0),
                  std::vector<float>(static_cast<std::size_t>(total_q * hq), 0.0f)};
  std::vector<double> s;
  for (std::size_t b = 0; b + 1 < a.cu_seq_q.size(); ++b) {
    const std::int64_t q0 = a.cu_seq_q[b], k0 = a.cu_seq_k[b];
    const std::int64_t sq = a.cu_seq_q[b + 1] - q0, sk = a.cu_seq_k[b + 1] - k0;
    for (int h = 0; h < hq; ++h)
      for (std::int64_t t = 0; t < sq; ++t) {
        const std::int64_t row = q0 + t;
        s.assign(static_cast<std::size_t>(sk), -std::numeric_limits<double>::infinity());
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t u = 0; u < sk; ++u) {
          if (!varlen_sees(a, t, u, sq, sk)) continue;
          double dot = 0;
          for (int x = 0; x < d; ++x)
            dot += q[static_cast<std::size_t>((row * hq + h) * d + x)] *
                   k[static_cast<std::size_t>(((k0 + u) * hk + h / group) * d + x)];
          s[static_cast<std::size_t>(u)] = dot * a.scale;
          m = std::max(m, dot * a.scale);
        }
        float& lse = r.lse[static_cast<std::size_t>(h * total_q + row)];
        if (m == -std::numeric_limits<double>::infinity()) {  // no key: O stays 0, LSE = +inf (FA2)
          lse = std::numeric_limits<float>::infinity();
          continue;
        }
        double sum = 0;
        for (std::int64_t u = 0; u < sk; ++u) {
          const double p = std::exp(s[static_cast<std::size_t>(u)] - m);
          if (p == 0) continue;
          sum += p;
          for (int x = 0; x < dv; ++x)
            r.out[static_cast<std::size_t>((row * hq + h) * dv + x)] +=
                p * v[static_cast<std::size_t>(((k0 + u) * hk + h / group) * dv + x)];
        }
        for (int x = 0; x < dv; ++x) r.out[static_cast<std::size_t>((row * hq + h) * dv + x)] /= sum;
        lse = static_cast<float>(m + std::log(sum));
      }
  }
  return r;
}

struct VarlenBackward {
  std::vector<double> dq, dk, dv;  ///< shaped as q, k, v; written, not accumulated
};

/// at::_flash_attention_backward(dout, q, k, v, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, is_causal,
/// rng_state, unused, scale, window_size_left, window_size_right) in fp64. `lse` (heads_q, total_q) in the
/// caller's precision: seqpar passes the merged LSE of the whole row, not this call's.
inline VarlenBackward varlen_backward(const VarlenArgs& a, const std::vector<double>& dout,
                                      const std::vector<double>& q, const std::vector<double>& k,
                                      const std::vector<double>& v, const std::vector<double>& out,
                                      const std::vector<double>& lse) {
  standin_detail::require_args(a, q.size(), k.size());
  const std::int64_t total_q = a.cu_seq_q.back();
  const int hq = a.heads_q, hk = a.heads_kv, d = a.head_dim, dvd = a.head_dim_v, group = hq / hk;
  VarlenBackward r{std::vector<double>(q.size(), 0.0), std::vector<double>(k.size(), 0.0),
                   std::vector<double>(v.size(), 0.0)};
  for (std::size_t b = 0; b + 1 < a.cu_seq_q.size(); ++b) {
    const std::int64_t q0 = a.cu_seq_q[b], k0 = a.cu_seq_k[b];
    const std::int64_t sq = a.cu_seq_q[b + 1] - q0, sk = a.cu_seq_k[b + 1] - k0;
    for (int h = 0; h < hq; ++h)
      for (std::int64_t t = 0; t < sq; ++t) {
        const std::int64_t row = q0 + t;
        const auto qi = [&](int x) { return static_cast<std::size_t>((row * hq + h) * d + x); };
        const auto oi = [&](int x) { return static_cast<std::size_t>((row * hq + h) * dvd + x); };
        double delta = 0;
        for (int x = 0; x < dvd; ++x) delta += dout[oi(x)] * out[oi(x)];
        const double l = lse[static_cast<std::size_t>(h * total_q + row)];
        for (std::int64_t u = 0; u < sk; ++u) {
          if (!varlen_sees(a, t, u, sq, sk)) continue;
          const auto ki = [&](int x) { return static_cast<std::size_t>(((k0 + u) * hk + h / group) * d + x); };
          const auto vi = [&](int x) { return static_cast<std::size_t>(((k0 + u) * hk + h / group) * dvd + x); };
          double dot = 0, dp = 0;
          for (int x = 0; x < d; ++x) dot += q[qi(x)] * k[ki(x)];
          for (int x = 0; x < dvd; ++x) dp += dout[oi(x)] * v[vi(x)];
          const double p = std::exp(dot * a.scale - l);
          const double ds = p * (dp - delta) * a.scale;
          for (int x = 0; x < dvd; ++x) r.dv[vi(x)] += p * dout[oi(x)];
          for (int x = 0; x < d; ++x) {
            r.dk[ki(x)] += ds * q[qi(x)];
            r.dq[qi(x)] += ds * k[ki(x)];
          }
        }
      }
  }
  return r;
}

/// A host kernel on seqpar's protocol (value and accumulation type double) that runs each call's slices
/// as the varlen calls of attention::detail::varlen_calls through the stand-in: gather the packed rows
/// (the GPU kernel takes a view where a call's rows are one segment), run, scatter O and LSE; the backward
/// adds dQ per row and dK / dV through an accumulator per call list (the GPU kernel's fp32 buffers) into
/// the caller's gradients.
class VarlenStandin {
 public:
  using kernel_category = attention::kernel_tag;
  using value_type = double;
  using accum_type = double;
  using exec_type = HostExec;

  [[nodiscard]] HostExec exec() const { return HostExec(1); }
  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape&, std::int64_t, std::int64_t) const noexcept {
    return 0;
  }
  [[nodiscard]] Status can_implement(const AttentionShape& shape) const {
    return attention::softmax_scale_status<accum_type>(shape, "VarlenStandin");
  }

  void forward(const HostExec&, const AttentionShape& shape, ThdView<const double> q, ThdView<const double> k,
               ThdView<const double> v, std::span<const AttnSlice> slices, ThdView<double> o, LseView<double> lse,
               std::span<std::byte> workspace) const {
    constexpr const char* where = "VarlenStandin::forward";
    check(shape, q, k, v, slices, where);
    attention::detail::check_forward_outputs(where, shape, q, k, v, o, lse, workspace);
    for (int h = 0; h < shape.heads_q; ++h)
      for (std::int64_t t = 0; t < q.tokens; ++t) {
        lse(h, t) = -std::numeric_limits<double>::infinity();
        for (int x = 0; x < shape.v_dim(); ++x) o(t, h, x) = 0.0;
      }
    for (const attention::detail::VarlenCall& call :
         attention::detail::varlen_calls(slices, attention::Pass::kForward, where)) {
      const VarlenArgs a = args(shape, call);
      const VarlenForward r = varlen_forward(a, gather(q, call.q_rows), gather(k, call.k_rows), gather(v, call.k_rows));
      const std::int64_t total_q = call.total_q();
      std::int64_t p = 0;
      for (const attention::detail::RowSegment& seg : call.q_rows)
        for (std::int64_t t = seg.begin; t < seg.begin + seg.rows; ++t, ++p)
          for (int h = 0; h < shape.heads_q; ++h) {
            for (int x = 0; x < shape.v_dim(); ++x)
              o(t, h, x) = r.out[static_cast<std::size_t>((p * shape.heads_q + h) * shape.v_dim() + x)];
            lse(h, t) = r.lse[static_cast<std::size_t>(h * total_q + p)];
          }
    }
  }

  void backward(const HostExec&, const AttentionShape& shape, ThdView<const double> q, ThdView<const double> k,
                ThdView<const double> v, ThdView<const double> o, LseView<const double> lse, ThdView<const double> dout,
                std::span<const AttnSlice> slices, ThdView<double> dq, ThdView<double> dk, ThdView<double> dv,
                std::span<std::byte> workspace) const {
    constexpr const char* where = "VarlenStandin::backward";
    check(shape, q, k, v, slices, where);
    attention::detail::check_backward_views(where, shape, q, k, v, o, lse, dout, dq, dk, dv, workspace);
    // dK / dV of every call and wave summed in accumulators, added to the caller's gradients once.
    const std::size_t kd = static_cast<std::size_t>(shape.heads_kv * shape.qk_dim()),
                      vd = static_cast<std::size_t>(shape.heads_kv * shape.v_dim());
    std::vector<double> dk_acc(static_cast<std::size_t>(k.tokens) * kd, 0.0),
        dv_acc(static_cast<std::size_t>(k.tokens) * vd, 0.0);
    for (const attention::detail::VarlenCall& call :
         attention::detail::varlen_calls(slices, attention::Pass::kBackward, where)) {
      const VarlenArgs a = args(shape, call);
      const std::int64_t total_q = call.total_q();
      std::vector<double> packed_lse(static_cast<std::size_t>(total_q * shape.heads_q));
      std::int64_t p = 0;
      for (const attention::detail::RowSegment& seg : call.q_rows)
        for (std::int64_t t = seg.begin; t < seg.begin + seg.rows; ++t, ++p)
          for (int h = 0; h < shape.heads_q; ++h) packed_lse[static_cast<std::size_t>(h * total_q + p)] = lse(h, t);
      const VarlenBackward r =
          varlen_backward(a, gather(dout, call.q_rows), gather(q, call.q_rows), gather(k, call.k_rows),
                          gather(v, call.k_rows), gather(o, call.q_rows), packed_lse);
      scatter_add(r.dq, call.q_rows, dq);
      // A wave's key rows are disjoint: each accumulator row receives at most one add per call.
      std::int64_t pk = 0;
      for (const attention::detail::RowSegment& seg : call.k_rows)
        for (std::int64_t t = seg.begin; t < seg.begin + seg.rows; ++t, ++pk) {
          for (std::size_t x = 0; x < kd; ++x)
            dk_acc[static_cast<std::size_t>(t) * kd + x] += r.dk[static_cast<std::size_t>(pk) * kd + x];
          for (std::size_t x = 0; x < vd; ++x)
            dv_acc[static_cast<std::size_t>(t) * vd + x] += r.dv[static_cast<std::size_t>(pk) * vd + x];
        }
    }
    for (std::int64_t t = 0; t < k.tokens; ++t)
      for (int h = 0; h < shape.heads_kv; ++h) {
        for (int x = 0; x < shape.qk_dim(); ++x)
          dk(t, h, x) += dk_acc[static_cast<std::size_t>(t) * kd + static_cast<std::size_t>(h * shape.qk_dim() + x)];
        for (int x = 0; x < shape.v_dim(); ++x)
          dv(t, h, x) += dv_acc[static_cast<std::size_t>(t) * vd + static_cast<std::size_t>(h * shape.v_dim() + x)];
      }
  }

 private:
  static void check(const AttentionShape& shape, ThdView<const double> q, ThdView<const double> k,
                    ThdView<const double> v, std::span<const AttnSlice> slices, const char* where) {
    seqpar::detail::throw_if_refused(attention::softmax_scale_status<accum_type>(shape, where));
    seqpar::detail::check_view(q, where, "q", q.tokens, shape.heads_q, shape.qk_dim());
    seqpar::detail::check_view(k, where, "k", k.tokens, shape.heads_kv, shape.qk_dim());
    seqpar::detail::check_view(v, where, "v", k.tokens, shape.heads_kv, shape.v_dim());
    validate_slices(slices, q.tokens, k.tokens, where);
  }
  static VarlenArgs args(const AttentionShape& shape, const attention::detail::VarlenCall& call) {
    return {call.cu_seqlens_q,
            call.cu_seqlens_k,
            call.max_q,
            call.max_k,
            call.mask.is_causal(),
            shape.scale(),
            call.mask.is_causal() ? -1 : call.mask.left,
            call.mask.is_causal() ? -1 : call.mask.right,
            shape.heads_q,
            shape.heads_kv,
            shape.qk_dim(),
            shape.v_dim()};
  }
  // The packed (rows, heads, dim) copy of the view's rows `segs`, in order.
  static std::vector<double> gather(ThdView<const double> x, const std::vector<attention::detail::RowSegment>& segs) {
    std::vector<double> out;
    for (const attention::detail::RowSegment& seg : segs)
      for (std::int64_t t = seg.begin; t < seg.begin + seg.rows; ++t)
        for (int h = 0; h < x.heads; ++h)
          for (int e = 0; e < x.head_dim; ++e) out.push_back(x(t, h, e));
    return out;
  }
  static void scatter_add(const std::vector<double>& packed, const std::vector<attention::detail::RowSegment>& segs,
                          ThdView<double> x) {
    std::size_t i = 0;
    for (const attention::detail::RowSegment& seg : segs)
      for (std::int64_t t = seg.begin; t < seg.begin + seg.rows; ++t)
        for (int h = 0; h < x.heads; ++h)
          for (int e = 0; e < x.head_dim; ++e) x(t, h, e) += packed[i++];
  }
};

static_assert(attention::AttentionKernel<VarlenStandin>);

}  // namespace seqpar::test
