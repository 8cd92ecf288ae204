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
/// - Graphs are built once per (pass, mask, window, items, bucketed S_q and S_kv, heads, head dim,
///   scale, strides) and cached (at most `kMaxGraphs`, least recently used evicted); S_max is rounded
///   up to a power of two so that a training run's changing document mixes reuse a few graphs. The
///   executor's preparation hook (`prepare`, once per cached program) plans the runs on the host and
///   uploads their tables; a direct call plans on each call (it copies the slice table to the host).
/// - cuDNN's own workspace and handle are the kernel's, one per stream (a context is one stream);
///   `workspace_bytes` covers the statistics and the gradient scratch.
/// - Requirements (`can_implement`): cuDNN 9 at run time, head dims multiples of 8 up to 256 (the
///   fused kernels' range), one head size for q/k and v (head_dim_v unequal is refused), any GQA ratio, a finite
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

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
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

  /// A well-formed shape, head dim a multiple of 8 up to 256 (cuDNN's fused kernels).
  [[nodiscard]] Status can_implement(const AttentionShape& shape) const;

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
