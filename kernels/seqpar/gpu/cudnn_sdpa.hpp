// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `attention::CudnnSdpa<T>`: the `AttentionKernel` concept over cuDNN's fused attention (scaled dot
/// product attention, "SDPA", through cudnn-frontend's graph API), for T = __half or __nv_bfloat16.
/// The same library as torch's SDPA cuDNN backend; what seqpar adds is the mapping of its slice
/// tables onto cuDNN's ragged (THD) batches, so that every strategy runs on it unchanged. A kernel
/// type, not a flag: `DistributedAttention<Strategy, attention::CudnnSdpa<__nv_bfloat16>>`.
///
/// - Slices become ragged batch items (gpu/detail/sdpa_items.hpp): per item a query and a key range
///   (ragged offsets, sequence lengths, a padding mask), causal and sliding-window masks aligned to
///   the bottom-right corner so that each item's diagonal offset is its own; rows before the first
///   visible key stay empty; causal rows past the last key form a full item. A sliding-window slice
///   whose rows reach past its last key is refused by name (cuDNN's band has no right cut).
/// - Forward writes O and LSE on every query row (rows of no item: O = 0, LSE = -inf, as CudaFlash).
///   cuDNN's softmax statistics are the LSE; they pass through a padded scratch (items, heads, S_max).
/// - Backward adds (+=) into dQ, dK, dV, deterministically: cuDNN writes its gradients, so each run
///   writes a zeroed scratch that is then added; items that share keys run in separate waves
///   (key-disjoint within a wave), never into the same dK/dV rows at once.
/// - Graphs are built once per (pass, mask, window, items, bucketed S_q and S_kv, heads, head sizes,
///   scale, strides) and cached (at most `kMaxGraphs`, least recently used evicted); S_max is rounded
///   up to a power of two so that a training run's changing document mixes reuse a few graphs. The
///   executor's preparation hook (`prepare`, once per cached program) plans the runs on the host and
///   uploads their tables; a direct call plans on each call (it copies the slice table to the host).
/// - cuDNN's own workspace and handle are the kernel's, one per stream (a context is one stream);
///   `workspace_bytes` covers the statistics and the gradient scratch.
/// - Head sizes (q/k, v): equal, multiples of 8 up to 256 (the fused kernels' range), or MLA's 192/128
///   (kCudnnSdpaSplitHeadDims) on devices of compute capability 9.0 and newer, where cuDNN's support
///   matrix lists it for prefill and backward in fp16/bf16 (Ampere and Ada: backward d <= 128): q, k, dq,
///   dk of qk_dim values per head, v, o, dout, dv of v_dim; each tensor's graph dims and strides, and the
///   ragged offsets of V, O, dO, dV, use its own width. Another unequal pair, or 192/128 on an older
///   device, is refused naming shape.head_dim_v (cudnn_sdpa_shape_status). 192/128 is compiled (sm_80,
///   sm_90a) but has never run on a GPU: its cases in tests/cudnn await a device run.
/// - What cuDNN itself refuses when a graph is built (its validation, check_support, no engine: e.g. a
///   cuDNN release older than the support matrix, or the backward at d > 128 on sm_120, which
///   cudnn-frontend limits as it does Ampere) is thrown as std::invalid_argument naming the head sizes,
///   the pass, the mask and the device, with cuDNN's message; nothing is cached for it.
/// - Requirements (`can_implement`): cuDNN 9 at run time, the head sizes above, any GQA ratio, a finite
///   non-zero softmax scale; buffers of fewer than 2^31 elements (int32 ragged offsets).
///
/// @code
/// attention::CudnnSdpa<__nv_bfloat16> sdpa;                 // streams of its own on the current device
/// gpu::DeviceSlices slices(batch.document_causal_slices(), n, n);
/// gpu::DeviceBytes ws(sdpa.workspace_bytes(shape, n, n));
/// sdpa.forward(sdpa.exec(), shape, q, k, v, slices.device(), o, lse, ws.span());
/// @endcode
///
/// Built when cuDNN and cudnn-frontend are found (kernels/cudnn.cmake; cmake/install_cudnn_frontend.sh
/// installs the header-only frontend from PyPI into build/). The member functions are defined in
/// cudnn_sdpa_impl.hpp, which includes cudnn-frontend; kernels/instances_cudnn/ compiles them once.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/gpu/detail/element.hpp"
#include "seqpar/gpu/detail/sdpa_items.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/exec.hpp"

namespace seqpar::attention {

namespace detail {
struct CudnnSdpaState;  // handles, graph cache and cuDNN workspaces (cudnn_sdpa_impl.hpp)
}

/// Unequal (q/k, v) head sizes CudnnSdpa builds graphs for, and the least compute capability (major x 10 +
/// minor) cuDNN's support matrix lists them on for both passes (cudnn-frontend, Attention: Hopper prefill
/// and backward "d <= 256 (d_qk = 192, d_vo = 128)"; Ampere and Ada backward d <= 128).
struct CudnnSdpaSplitHeadDims {
  int qk = 0, v = 0;
  int min_compute_capability = 0;
};
inline constexpr CudnnSdpaSplitHeadDims kCudnnSdpaSplitHeadDims[] = {{192, 128, 90}};

/// What CudnnSdpa can run and its calls accept on a device of `compute_capability` (major x 10 + minor):
/// a well-formed shape; head_dim a multiple of 8 up to 256; head_dim_v equal to it (0), or a pair of
/// kCudnnSdpaSplitHeadDims on a device it lists; a softmax scale finite and non-zero in fp32, at most
/// attention::max_softmax_scale<float>(head_dim). An unequal
/// pair is refused as `shape.head_dim_v`, saying why (another pair, or the device).
[[nodiscard]] inline Status cudnn_sdpa_shape_status(const AttentionShape& shape, int compute_capability,
                                                    const char* where) {
  if (Status s = shape.status(where); !s) return s;
  if (shape.head_dim % 8 != 0 || shape.head_dim > 256)
    return seqpar::detail::refuse_invalid(where, "shape.head_dim", shape.head_dim,
                                          "cuDNN's fused attention takes head dims that are multiples of 8 up to 256");
  const auto scale = static_cast<float>(shape.scale());
  if (!(std::isfinite(scale) && scale != 0.0f))
    return seqpar::detail::refuse_invalid(where, "shape.softmax_scale", shape.softmax_scale,
                                          "is infinite or zero in fp32, cuDNN's scale type");
  if (Status s = attention::softmax_scale_status<float>(shape, where); !s) return s;  // what every kernel keeps exact
  if (!shape.split_dims()) return Status::success();
  for (const CudnnSdpaSplitHeadDims& d : kCudnnSdpaSplitHeadDims) {
    if (d.qk != shape.qk_dim() || d.v != shape.v_dim()) continue;
    if (compute_capability >= d.min_compute_capability) return Status::success();
    return seqpar::detail::refuse_invalid(
        where, "shape.head_dim_v", shape.head_dim_v,
        "head sizes " + std::to_string(d.qk) + "/" + std::to_string(d.v) +
            " run in cuDNN's fused attention (forward and backward) from compute capability " +
            std::to_string(d.min_compute_capability / 10) + "." + std::to_string(d.min_compute_capability % 10) +
            " on; this device has " + std::to_string(compute_capability / 10) + "." +
            std::to_string(compute_capability % 10) +
            " (cuDNN's backward takes d <= 128 there): use CudaFlash or CpuFlash");
  }
  std::string built = "CudnnSdpa takes head_dim_v = head_dim (0), or (head_dim, head_dim_v) =";
  for (const CudnnSdpaSplitHeadDims& d : kCudnnSdpaSplitHeadDims) {
    // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on " " + std::to_string(...).
    built += ' ';
    built += std::to_string(d.qk);
    built += '/';
    built += std::to_string(d.v);
    built += " from compute capability ";
    built += std::to_string(d.min_compute_capability / 10);
    built += '.';
    built += std::to_string(d.min_compute_capability % 10);
  }
  built += " (cuDNN's support matrix); CpuFlash runs any pair";
  return seqpar::detail::refuse_invalid(where, "shape.head_dim_v", shape.head_dim_v, built);
}

/// CudnnSdpa's per-program parameters of one call (`CudnnSdpa::prepare`): the runs planned on the
/// host and, in one block of device memory, each run's item tables (first tokens, lengths, and room
/// for the ragged offsets the call computes from its views' strides).
struct CudnnSdpaParams {
  struct Run {
    gpu::detail::SdpaMask mask = gpu::detail::SdpaMask::kFull;
    std::int64_t window = 0;
    int items = 0;
    std::int64_t max_q = 0, max_k = 0;  ///< bucketed (a power of two): the graph's S_q and S_kv
    std::int64_t* q_tokens = nullptr;   ///< device, items + 1: first query token of each item, then the end
    std::int64_t* k_tokens = nullptr;   ///< device, items + 1
    std::int32_t* q_lens = nullptr;     ///< device, items
    std::int32_t* k_lens = nullptr;     ///< device, items
    std::int32_t* ragged = nullptr;     ///< device, 8 x (items + 1): written by each call
  };
  Pass pass = Pass::kForward;
  std::int64_t q_rows = 0, k_rows = 0, num_slices = 0;
  std::vector<Run> runs;
  gpu::DeviceBytes storage;  ///< owns the tables above
};

template <class T>
class CudnnSdpa {
  static_assert(gpu::detail::kIsHalfPrecision<T>, "CudnnSdpa<T>: T must be __half or __nv_bfloat16");

 public:
  using kernel_category = kernel_tag;
  using value_type = T;
  using accum_type = float;
  using exec_type = gpu::CudaExec;
  using Params = CudnnSdpaParams;

  /// Graphs kept at most (least recently used evicted).
  static constexpr std::size_t kMaxGraphs = 64;

  /// Streams of its own on the calling thread's current device.
  CudnnSdpa();
  explicit CudnnSdpa(gpu::CudaExec exec);

  [[nodiscard]] const gpu::CudaExec& exec() const noexcept { return exec_; }

  /// cudnn_sdpa_shape_status on the kernel's own device: equal head sizes, multiples of 8 up to 256
  /// (cuDNN's fused kernels), or 192/128 from compute capability 9.0 on; the calls refuse the same shapes.
  [[nodiscard]] Status can_implement(const AttentionShape& shape) const { return can_implement(exec_, shape); }
  /// The same on `exec`'s device.
  [[nodiscard]] Status can_implement(const gpu::CudaExec& exec, const AttentionShape& shape) const {
    return cudnn_sdpa_shape_status(shape, exec.compute_capability(), "CudnnSdpa");
  }

  /// Runs of the call planned on the host from `host_slices` (checked against q_rows and k_rows), their
  /// tables uploaded on exec.stream() (waited for: once per cached program).
  [[nodiscard]] Params prepare(const gpu::CudaExec& exec, const AttentionShape& shape,
                               std::span<const AttnSlice> host_slices, std::int64_t q_rows, std::int64_t k_rows,
                               Pass pass) const;

  /// Device bytes of scratch for a call: padded statistics (4 x q_rows per query head, fp32) and the
  /// gradient scratch (dQ, dK, dV in T).
  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape& shape, std::int64_t q_rows,
                                            std::int64_t k_rows) const;

  void forward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
               ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o, LseView<float> lse,
               std::span<std::byte> workspace);
  void backward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
                ThdView<const T> v, ThdView<const T> o, LseView<const float> lse, ThdView<const T> dout,
                std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                std::span<std::byte> workspace);

  /// With the call's `Params` (from `prepare` for this shape, pass and slices).
  void forward(const gpu::CudaExec& exec, const Params& params, const AttentionShape& shape, ThdView<const T> q,
               ThdView<const T> k, ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o,
               LseView<float> lse, std::span<std::byte> workspace);
  void backward(const gpu::CudaExec& exec, const Params& params, const AttentionShape& shape, ThdView<const T> q,
                ThdView<const T> k, ThdView<const T> v, ThdView<const T> o, LseView<const float> lse,
                ThdView<const T> dout, std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                std::span<std::byte> workspace);

  /// On the kernel's own context.
  void forward(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
               std::span<const AttnSlice> slices, ThdView<T> o, LseView<float> lse, std::span<std::byte> workspace) {
    forward(exec_, shape, q, k, v, slices, o, lse, workspace);
  }
  void backward(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                ThdView<const T> o, LseView<const float> lse, ThdView<const T> dout, std::span<const AttnSlice> slices,
                ThdView<T> dq, ThdView<T> dk, ThdView<T> dv, std::span<std::byte> workspace) {
    backward(exec_, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
  }

 private:
  gpu::CudaExec exec_;
  std::shared_ptr<detail::CudnnSdpaState> state_;
};

static_assert(AttentionKernel<CudnnSdpa<__nv_bfloat16>>);
static_assert(PreparingKernel<CudnnSdpa<__nv_bfloat16>>);

}  // namespace seqpar::attention
