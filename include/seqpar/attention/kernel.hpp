// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numbers>
#include <span>
#include <string>
#include <type_traits>

#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/exec.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::attention {

/// Opt-in tag of attention kernels.
struct kernel_tag {};

/// An attention kernel computes, for a list of slices with disjoint query ranges:
///   forward:  O, LSE of every query row (rows in no slice get O = 0, LSE = -inf);
///   backward: dQ, dK, dV *accumulated* (+=) from dO, given the final O and LSE, so that partial
///             results over several key blocks (ring steps, GQA groups) add up without extra buffers.
/// Work is issued on an execution context of the kernel's `exec_type` (a thread pool on the host, a
/// CUDA stream on a GPU); views, slices and workspace live in that context's memory. `exec()` is the
/// kernel's own context, used when the caller gives none.
/// Scratch memory comes from the caller: `workspace_bytes` sizes it, the calls never allocate.
///
/// The protocol every layer answers (as a CUTLASS kernel does): `can_implement(shape) -> Status` says,
/// without touching memory or a device, whether the kernel can run `shape` with its own configuration
/// and context (a head dim it was not built for, a softmax scale its accumulation type cannot hold):
/// DistributedAttention asks it for every head group of a program with its other local checks, so
/// that a refusal reaches every rank before any message. The calls still refuse the same shapes
/// themselves (std::invalid_argument), from the same predicate. A kernel whose refusal depends on
/// the context may also answer `can_implement(exec, shape)` (see `attention::can_implement`).
template <class K>
concept AttentionKernel = std::derived_from<typename K::kernel_category, kernel_tag> &&
    ExecutionContext<typename K::exec_type> &&
    requires(K& k, const K& ck, const typename K::exec_type& exec, const AttentionShape& shape,
             ThdView<const typename K::value_type> in, ThdView<typename K::value_type> out,
             LseView<typename K::accum_type> lse, LseView<const typename K::accum_type> lse_in,
             std::span<const AttnSlice> slices, std::span<std::byte> workspace, std::int64_t rows) {
  { ck.exec() } -> std::convertible_to<typename K::exec_type>;
  { ck.can_implement(shape) } -> std::same_as<Status>;
  { k.workspace_bytes(shape, rows, rows) } -> std::convertible_to<std::size_t>;
  k.forward(exec, shape, in, in, in, slices, out, lse, workspace);
  k.backward(exec, shape, in, in, in, in, lse_in, in, slices, out, out, out, workspace);
};

/// `kernel.can_implement(exec, shape)` when the kernel answers for a given context (CpuFlash: a
/// context with more threads than its workspace is sized for), else `kernel.can_implement(shape)`.
template <AttentionKernel K>
[[nodiscard]] Status can_implement(const K& kernel, const typename K::exec_type& exec, const AttentionShape& shape) {
  if constexpr (requires {
                  { kernel.can_implement(exec, shape) } -> std::same_as<Status>;
                })
    return kernel.can_implement(exec, shape);
  else
    return kernel.can_implement(shape);
}

/// The largest |softmax_scale| a kernel accumulating in A runs at head size `head_dim`:
/// 1 / (log2(e) head_dim^2 epsilon(A)). For q and k entries of magnitude up to 1 a score, in the base-2
/// units of a flash kernel's softmax, is at most scale log2(e) head_dim, and two evaluations of one score
/// in A (the forward's, and the backward's recomputation of exp2(s - lse) against the forward's LSE) may
/// differ by head_dim epsilon(A) of it: at the limit by one unit, a factor of 2 on a probability. Past it
/// that difference grows without bound and a recomputed probability overflows (issue 40: CpuFlash<bf16>
/// at softmax_scale 1e10, head_dim 16, returned non-finite dQ and dK where the fp64 reference's are 0).
/// float: 22713 at head_dim 16, 355 at 128, 5.5 at 1024; double: 1.2e13 at 16, 1.9e11 at 128; the
/// default scale 1/sqrt(head_dim) is far below every one.
template <class A>
[[nodiscard]] constexpr double max_softmax_scale(int head_dim) noexcept {
  const double d = head_dim > 0 ? static_cast<double>(head_dim) : 1.0;
  return 1.0 / (std::numbers::log2e * d * d * static_cast<double>(std::numeric_limits<A>::epsilon()));
}

/// The softmax-scale check every kernel makes (can_implement, and the calls refuse the same): a well-formed
/// shape (AttentionShape::status) whose scale, multiplied by log2(e), is finite and nonzero in the
/// accumulation type A, and at most max_softmax_scale<A>(shape.qk_dim()) in magnitude. Refusals name
/// softmax_scale, its value and the limit.
template <class A>
[[nodiscard]] Status softmax_scale_status(const AttentionShape& shape, const char* where) {
  static_assert(std::is_floating_point_v<A>, "softmax_scale_status: A is the kernel's accumulation type");
  if (Status s = shape.status(where); !s) return s;
  const char* const type = std::is_same_v<A, float> ? "float" : std::is_same_v<A, double> ? "double" : "long double";
  const double sc = shape.scale();
  const A sa = A(sc);
  if (!std::isfinite(sa * A(std::numbers::log2e)) || (sc != 0.0 && sa == A(0)))
    return seqpar::detail::refuse_invalid(where, "softmax_scale", sc,
                                          std::string("is not representable in the accumulation type (") + type + ")");
  const double limit = max_softmax_scale<A>(shape.qk_dim());
  if (std::abs(sc) <= limit) return Status::success();
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", limit);
  return seqpar::detail::refuse_invalid(
      where, "softmax_scale", sc,
      std::string("exceeds ") + text + ", the largest the accumulation type (" + type + ") keeps exact at head_dim " +
          std::to_string(shape.qk_dim()) +
          " (1 / (log2(e) head_dim^2 epsilon)): past it a score's rounding overflows the softmax's exponential "
          "and gradients come back non-finite");
}

/// The pass a kernel call belongs to.
enum class Pass { kForward, kBackward };

/// A kernel with a preparation step (FlashAttention-3's scheduler metadata,
/// `mha_fwd_get_scheduler_metadata`, is the model): per-program parameters computed once, on the host,
/// when the executor lowers a program (`runtime::Executor::initialize`, once per cached batch shape),
/// from what the host knows of each kernel call: its shape, its slices (the HOST table, in the order
/// the context's copy holds them), the rows of its q and k buffers and its pass. The executor keeps
/// one `Params` per call and passes it to `forward` / `backward` after the context; the calls without
/// `Params` stay (a direct call prepares nothing). CudaFlash builds its tile table here.
///
/// @code
/// auto params = flash.prepare(exec, shape, host_slices, q_rows, k_rows, attention::Pass::kForward);
/// flash.forward(exec, params, shape, q, k, v, device_slices, o, lse, workspace);  // any number of times
/// @endcode
template <class K>
concept PreparingKernel = AttentionKernel<K> && std::movable<typename K::Params> &&
    requires(K& k, const K& ck, const typename K::exec_type& exec, const typename K::Params& params,
             const AttentionShape& shape, ThdView<const typename K::value_type> in, ThdView<typename K::value_type> out,
             LseView<typename K::accum_type> lse, LseView<const typename K::accum_type> lse_in,
             std::span<const AttnSlice> slices, std::span<std::byte> workspace, std::int64_t rows, Pass pass) {
  { ck.prepare(exec, shape, slices, rows, rows, pass) } -> std::same_as<typename K::Params>;
  k.forward(exec, params, shape, in, in, in, slices, out, lse, workspace);
  k.backward(exec, params, shape, in, in, in, in, lse_in, in, slices, out, out, out, workspace);
};

/// Whether K declares a preparation step (`Params`): it must then be a whole PreparingKernel.
template <class K>
inline constexpr bool kDeclaresParams = requires {
  typename K::Params;
};

/// The Params of a preparing kernel; an empty type for the others.
struct NoParams {};
template <class K>
struct ParamsOf {
  using type = NoParams;
};
template <class K>
requires PreparingKernel<K>
struct ParamsOf<K> {
  using type = typename K::Params;
};
template <class K>
using params_t = typename ParamsOf<K>::type;

}  // namespace seqpar::attention
