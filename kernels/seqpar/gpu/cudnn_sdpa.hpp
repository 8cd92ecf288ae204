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
/// - Backward adds (+=) into dQ, dK, dV: cuDNN writes its gradients, so each run writes a scratch whose
///   rows of the run's items are zeroed first and then added (only those rows); items that share keys run
///   in separate waves (key-disjoint within a wave), never into the same dK/dV rows at once. seqpar's own
///   order of summation is fixed; cuDNN's is not unless `Arguments::deterministic` is set: by default
///   cuDNN's Hopper backward sums dQ over key tiles with atomics and its low bits change from run to run
///   (cudnn-frontend's `is_deterministic_algorithm` defaults to false). `deterministic` asks for
///   cuDNN's deterministic backward (Hopper; Blackwell from cuDNN 9.18; not on sm_8x/sm_12x, where
///   cuDNN has none for ragged batches: can_implement refuses it there), at a cost in speed and in
///   cuDNN workspace that grows with the sequence length.
/// - Graphs are built once per (device, pass, mask, window, bucketed items, bucketed S_q and S_kv, heads,
///   head sizes, scale, strides, determinism; the backward also the bucketed buffer rows) and cached (at
///   most `kMaxGraphs`, least recently used evicted): S_max and the item count are rounded up to powers of
///   two (items padded with zero-length items) so that a training run's changing document mixes reuse a
///   few graphs. The executor's preparation hook (`prepare`, once per cached program) plans the runs,
///   uploads their tables and builds their graphs for dense views (a call with other strides, Ulysses's
///   head slices, builds its own once, on first use); a direct call plans on each call (it copies the
///   slice table to the host).
/// - A graph cuDNN will not build (a version or device it does not support for this mask, no engine, no
///   plan) makes that call run on CudaFlash instead (`Arguments::fallback`, on by default, for the head
///   sizes CudaFlash runs), said once per kernel and reason on stderr: never an exception in the middle
///   of a training step. Without it, or where CudaFlash cannot run the shape, it is the
///   std::invalid_argument below.
/// - Non-finite values (issue 38, A1; contract (a) of the 2026-12-06 static review): a NaN or infinity in
///   q, k, v or dout stays non-finite in its own document's outputs (it is never hidden), and may also
///   reach the outputs of a document that shares one of cuDNN's tiles with it (the rows it loads from an
///   item's first row on, up to 256 stated here: 64 to 176 in FlashAttention-3-like kernels, cuDNN's are
///   closed; they run into the next document, and P = 0 times NaN is NaN inside the MMA). CudaFlash and the CPU kernels
///   keep it inside its document. A redo on CudaFlash after a device-side scan would keep that promise too, at a host
///   synchronization per call; a non-finite input already ruins the training step, so CudnnSdpa does not pay for it.
/// - Buffers past the views (issue 38, A4, possible): cuDNN's tiles may read up to a tile of rows past the
///   last item of a buffer. Views whose buffers hold finite rows there (or end at an allocation whose tail
///   is readable) are safe; bench/device/run.sh checks a NaN-poisoned tail on the GPU. The buffers
///   CudnnSdpa owns that a graph reads (the padded statistics, the item tables) are zeroed past their items.
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
/// - Requirements (`can_implement`): the head sizes above, any GQA ratio, a finite non-zero softmax
///   scale; buffers of fewer than 2^31 elements (int32 ragged offsets); the cuDNN found at run time
///   (cudnnGetVersion) and the cudnn-frontend compiled in, gated by `cudnn_sdpa_version_status` (cuDNN 9.6
///   for ragged batches with GQA or a bottom-right mask, 9.18.1 for ragged batches before Hopper, 9.10.2
///   for sliding windows on Hopper, 9.11 for 192/128 on Blackwell, never 9.10.0/9.10.1), each refusal
///   naming what is missing. The mask-dependent gates are checked when `prepare` sees the masks (and then
///   fall back to CudaFlash, as above).
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
#include "seqpar/gpu/flash.hpp"

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

/// The cuDNN and cudnn-frontend versions, each as its header encodes it (major x 10000 + minor x 100 +
/// patch: cuDNN 9.10.2 = 91002, cudnn-frontend 1.32.0 = 13200).
struct CudnnVersions {
  std::int64_t cudnn = 0;
  std::int64_t frontend = 0;
};

/// What a CudnnSdpa graph asks of cuDNN beyond the shape: a bottom-right causal mask (causal and window
/// runs), a left band bound (window runs), cuDNN's deterministic backward.
struct CudnnSdpaFeatures {
  bool bottom_right = false;
  bool window = false;
  bool deterministic = false;
};

/// Whether cuDNN `versions.cudnn` with cudnn-frontend `versions.frontend`, on a device of
/// `compute_capability` (major x 10 + minor), runs CudnnSdpa's ragged (THD, padding-mask) graphs of
/// `shape` with `features`. A pure function (tested on the CPU); each refusal names what is missing.
/// The numbers, from cudnn-frontend 1.32's checks (node/sdpa_support_surface.h, "support surface", and
/// node/scaled_dot_product_flash_attention.h, "sdpa node"; line numbers of 1.32.0) and TransformerEngine's
/// support gates (fused_attn.cpp, via research/anchors-2026-12-06.md section 2), which agree:
///  - cudnn-frontend 1.9.0: ragged batches with bottom-right causal and sliding-window masks (its release
///    notes); cuDNN 9.
///  - never cuDNN 9.10.0 or 9.10.1: "SDPA FP16/BF16 forward is not supported ... due to known bugs"
///    (support surface :290; TransformerEngine excludes them too).
///  - before Hopper (compute capability < 9.0): ragged offsets from 9.18.1 ("THD (ragged offset) is only
///    supported in Hopper and above", support surface :435-438).
///  - GQA (heads_q != heads_kv) over ragged batches: 9.6.0 (sdpa node :1597, the backward's check).
///  - bottom-right causal: 9.6.0 (support surface :190-193: before it only at s_q, s_kv multiples of 64, which
///    CudnnSdpa's buckets would meet while TransformerEngine's matrix asks 9.6 for THD).
///  - a sliding window on Hopper: 9.10.2 (support surface :325-338, sdpa node :1515-1517: up to 9.9 the band with
///    bottom-right alignment is refused whenever s_q == s_kv, nearly every bucketed run; 9.10.0/9.10.1
///    are excluded above).
///  - 192/128 on Blackwell (10.x): 9.11.0 (sdpa node :1403: the backward's 192/128 case starts there).
///  - deterministic backward: none for ragged batches on sm_8x and sm_12x ("Deterministic algorithm is not
///    supported for bprop thd on SM8X and SM12X GPUs", sdpa node :1560-1563, from 9.18.1; before it ragged
///    batches do not run there at all); on Blackwell from 9.18.0 (sdpa node :1547-1550).
[[nodiscard]] inline Status cudnn_sdpa_version_status(const CudnnVersions& versions, int compute_capability,
                                                      const AttentionShape& shape, const CudnnSdpaFeatures& features,
                                                      const char* where) {
  const auto dotted = [](std::int64_t v) {
    return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
  };
  const std::string device =
      "compute capability " + std::to_string(compute_capability / 10) + "." + std::to_string(compute_capability % 10);
  const auto needs = [&](const char* argument, std::int64_t have, std::int64_t want, const std::string& what) {
    return seqpar::detail::refuse_invalid(where, argument, dotted(have),
                                          what + " needs " + dotted(want) + " or newer; this process has " +
                                              dotted(have) + " (use CudaFlash, or a newer release)");
  };
  const std::int64_t v = versions.cudnn;
  if (versions.frontend < 10900)
    return needs("cudnn_frontend version", versions.frontend, 10900,
                 "CudnnSdpa's ragged batches with bottom-right causal and sliding-window masks");
  if (v < 90000) return needs("cuDNN version", v, 90000, "CudnnSdpa (cuDNN's fused attention over ragged batches)");
  if (v == 91000 || v == 91001)
    return seqpar::detail::refuse_invalid(where, "cuDNN version", dotted(v),
                                          "cuDNN's fp16/bf16 fused attention has known bugs in 9.10.0 and 9.10.1 "
                                          "(cudnn-frontend refuses them): use 9.10.2 or newer");
  if (compute_capability < 90 && v < 91801)
    return needs("cuDNN version", v, 91801, "ragged (THD) batches on " + device + " (before Hopper)");
  if (shape.heads_q != shape.heads_kv && v < 90600)
    return needs("cuDNN version", v, 90600,
                 "grouped KV heads (shape.heads_q " + std::to_string(shape.heads_q) + " != shape.heads_kv " +
                     std::to_string(shape.heads_kv) + ") over ragged batches");
  if (features.bottom_right && v < 90600)
    return needs("cuDNN version", v, 90600, "a bottom-right causal mask over ragged batches");
  if (features.window && compute_capability / 10 == 9 && v < 91002)
    return needs("cuDNN version", v, 91002, "a sliding window (bottom-right band) on Hopper");
  if (shape.split_dims() && compute_capability / 10 == 10 && v < 91100)
    return needs("cuDNN version", v, 91100, "head sizes 192/128 on Blackwell");
  if (features.deterministic) {
    const int major = compute_capability / 10;
    if (major == 8 || major == 12)
      return seqpar::detail::refuse_invalid(
          where, "arguments.deterministic", "true",
          "cuDNN has no deterministic backward over ragged batches on " + device +
              " (cudnn-frontend: \"not supported for bprop thd on SM8X and SM12X GPUs\"): leave it off, or use "
              "CudaFlash, whose backward is deterministic");
    if (major == 10 && v < 91800)
      return needs("cuDNN version", v, 91800, "cuDNN's deterministic backward on Blackwell");
  }
  return Status::success();
}

/// How a CudnnSdpa runs (`CudnnSdpa(exec, arguments)`); the defaults are the training defaults.
struct CudnnSdpaArguments {
  /// cuDNN's deterministic backward (set_deterministic_algorithm(true)): bitwise-repeatable dQ at a cost
  /// in speed and workspace; refused by can_implement where cuDNN has none (sm_8x, sm_12x). The tests
  /// turn it on where it exists.
  bool deterministic = false;
  /// A call whose graphs cuDNN will not build runs on CudaFlash (said once on stderr), where CudaFlash
  /// runs the shape; off: the std::invalid_argument with cuDNN's reason.
  bool fallback = true;
  /// Item counts padded to powers of two with zero-length items, so that graphs are reused across
  /// document mixes; off: exact counts (a graph per count), should a device run show cuDNN mishandling
  /// zero-length items.
  bool pad_items = true;
};

/// What a CudnnSdpa's graph cache has done (bench/device: graphs built per training step).
struct CudnnSdpaCacheStats {
  std::size_t graphs_built = 0;     ///< graphs cuDNN built (cache misses that succeeded)
  std::size_t graphs_cached = 0;    ///< graphs held now (at most kMaxGraphs)
  std::size_t fallbacks = 0;        ///< calls (or prepared programs) run on CudaFlash
  double build_seconds = 0.0;       ///< host time spent building graphs
  std::size_t cudnn_workspace = 0;  ///< the largest cuDNN workspace of any stream, bytes
};

/// CudnnSdpa's per-program parameters of one call (`CudnnSdpa::prepare`): the runs planned on the
/// host and, in one block of device memory, each run's item tables (first tokens, lengths, and room
/// for the ragged offsets the call computes from its views' strides).
struct CudnnSdpaParams {
  struct Run {
    gpu::detail::SdpaMask mask = gpu::detail::SdpaMask::kFull;
    std::int64_t window = 0;
    int items = 0;                        ///< the graph's batch: real items, then zero-length padding items
    std::int64_t max_q = 0, max_k = 0;    ///< bucketed (a power of two): the graph's S_q and S_kv
    std::int64_t rows_q = 0, rows_k = 0;  ///< query and key rows of the real items
    std::int64_t* q_tokens = nullptr;     ///< device, items + 1: first query token of each item, then the end
    std::int64_t* k_tokens = nullptr;     ///< device, items + 1
    std::int32_t* q_lens = nullptr;       ///< device, items
    std::int32_t* k_lens = nullptr;       ///< device, items
    std::int64_t* q_prefix = nullptr;     ///< device, items + 1: prefix sums of q_lens (the backward's rows)
    std::int64_t* k_prefix = nullptr;     ///< device, items + 1
    std::int32_t* ragged = nullptr;       ///< device, 8 x (items + 1): written by each call
  };
  Pass pass = Pass::kForward;
  std::int64_t q_rows = 0, k_rows = 0, num_slices = 0;
  std::vector<Run> runs;
  gpu::DeviceBytes storage;  ///< owns the tables above
  /// The call runs on CudaFlash (a graph cuDNN would not build, Arguments::fallback): its Params.
  bool on_cuda_flash = false;
  CudaFlashParams cuda_flash;
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

  using Arguments = CudnnSdpaArguments;

  /// Streams of its own on the calling thread's current device.
  CudnnSdpa();
  explicit CudnnSdpa(gpu::CudaExec exec, Arguments arguments = {});

  [[nodiscard]] const gpu::CudaExec& exec() const noexcept { return exec_; }
  [[nodiscard]] const Arguments& arguments() const noexcept { return arguments_; }

  /// The cuDNN loaded at run time (cudnnGetVersion) and the cudnn-frontend compiled in.
  [[nodiscard]] static CudnnVersions versions();

  /// cudnn_sdpa_shape_status on the kernel's own device (equal head sizes, multiples of 8 up to 256, or
  /// 192/128 from compute capability 9.0 on), then cudnn_sdpa_version_status for what every graph of the
  /// shape needs (no mask yet; `Arguments::deterministic`); the calls refuse the same shapes.
  [[nodiscard]] Status can_implement(const AttentionShape& shape) const { return can_implement(exec_, shape); }
  /// The same on `exec`'s device.
  [[nodiscard]] Status can_implement(const gpu::CudaExec& exec, const AttentionShape& shape) const;

  /// What the graph cache has done so far (all streams, all devices).
  [[nodiscard]] CudnnSdpaCacheStats cache_stats() const;

  /// Runs of the call planned on the host from `host_slices` (checked against q_rows and k_rows), their
  /// tables uploaded on exec.stream() (waited for: once per cached program).
  [[nodiscard]] Params prepare(const gpu::CudaExec& exec, const AttentionShape& shape,
                               std::span<const AttnSlice> host_slices, std::int64_t q_rows, std::int64_t k_rows,
                               Pass pass) const;

  /// Device bytes of scratch for a call: padded statistics (sdpa_graph_stats_rows_bound(q_rows) per query
  /// head, fp32) and the gradient scratch (dQ, dK, dV in T); at least CudaFlash's where it may fall back.
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
  Arguments arguments_;
  CudaFlash<T> cuda_flash_;  // the fallback (Arguments::fallback)
  std::shared_ptr<detail::CudnnSdpaState> state_;
};

static_assert(AttentionKernel<CudnnSdpa<__nv_bfloat16>>);
static_assert(PreparingKernel<CudnnSdpa<__nv_bfloat16>>);

}  // namespace seqpar::attention
