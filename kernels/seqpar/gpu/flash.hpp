// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `attention::CudaFlash<T>` as host code sees it: the class, with `workspace_bytes`, `forward` and
/// `backward` declared. Their definitions (the kernels and their launches) are in flash.cuh, which
/// only nvcc compiles. So:
///  - a .cu translation unit includes flash.cuh and instantiates what it uses (header-only);
///  - a C++ translation unit (g++, clang) includes this header and links a .cu that instantiates
///    `CudaFlash<T>` explicitly, e.g. `template class seqpar::attention::CudaFlash<__nv_bfloat16>;`
///    after `#include <seqpar/gpu/flash.cuh>` (the project's tests, benchmarks and examples link
///    seqpar_cuda_instances, kernels/instances/, which instantiates float, __half and __nv_bfloat16).
/// The second keeps host-heavy code (a strategy, its engine and transport) out of nvcc, which runs
/// its front end once per GPU architecture, and compiles the kernels once per program.
///
/// - T: float (tests: exact fp32 FMAs), __half or __nv_bfloat16 (tensor cores through WMMA); fp32
///   accumulation, fp32 LSE. GQA reads each kv head in place (no copies).
/// - Head sizes (q/k, v): 64/64, 128/128 and MLA's 192/128 (kCudaFlashHeadDims), with the host kernels'
///   semantics: Q K^T over qk_dim; P V, dP = dO V^T and the row sums rowsum(dO * O) over v_dim; q, k, dq,
///   dk of qk_dim values per head, v, o, dout, dv of v_dim. 192/128 is compiled (sm_80, sm_90a) but has
///   never run on a GPU: its conformance cases (tests/cuda/test_cuda_kernel_cases.cpp) await a device run.
/// - Slices: the same `AttnSlice` semantics as CpuFlash (full, causal with explicit alignment,
///   sliding window; disjoint query ranges per call), in device memory: checked once where they reach
///   the device (`gpu::DeviceSlices`, or the executor's lowering), not at every call.
/// - Work: a tile table of (slice, query tile), longest tiles first; blocks are (tile, head). Under
///   the executor it is built once per cached program, on the host from the host slice table
///   (`prepare`, the kernel's per-program `Params`, uploaded with a copy of the call's slices); a
///   direct call without `Params` builds it on the device each call (CUB scan + radix sort,
///   detail/tile_table.cuh). Both are the same table.
/// - `can_implement(shape)`: the pairs above (what the kernels are instantiated for; another is refused
///   naming shape.head_dim or shape.head_dim_v) and the shared memory their kernels need on the device;
///   the calls refuse what it refuses, with the same message.
/// - Forward writes O and LSE on every query row (rows in no slice: O = 0, LSE = -inf). Backward
///   adds (+=) into dQ, dK, dV, deterministically (detail/flash_backward.cuh).
/// - Everything is enqueued on `exec.stream()`; nothing waits on the host; the workspace
///   (`workspace_bytes`, device memory) holds the tile table and the backward's row sums.
///
/// @code
/// attention::CudaFlash<__nv_bfloat16> flash;                  // streams of its own on the current device
/// gpu::DeviceSlices slices(batch.document_causal_slices(), n, n);
/// gpu::DeviceBytes ws(flash.workspace_bytes(shape, n, n));
/// flash.forward(flash.exec(), shape, q, k, v, slices.device(), o, lse, ws.span());
/// flash.exec().synchronize();
/// @endcode

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/gpu/detail/element.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/exec.hpp"

namespace seqpar::attention {

/// A (q/k, v) head-size pair the kernels are instantiated for.
struct CudaFlashHeadDims {
  int qk;  ///< q, k, dq, dk: AttentionShape::qk_dim()
  int v;   ///< v, o, dout, dv: AttentionShape::v_dim()
};

/// Every pair CudaFlash runs: equal 64 and 128, and MLA's 192/128 (DeepSeek-V2/V3: 128 + 64 rotary
/// q/k values, 128 values of v). Each pair is a set of kernels of its own (flash.cuh dispatches on it).
inline constexpr CudaFlashHeadDims kCudaFlashHeadDims[] = {{64, 64}, {128, 128}, {192, 128}};

/// What CudaFlash can run and its calls accept: a well-formed shape whose (qk_dim, v_dim) is one of
/// kCudaFlashHeadDims. A head_dim no pair has is refused as `shape.head_dim`, one of them with another
/// value size as `shape.head_dim_v`.
[[nodiscard]] inline Status cuda_flash_shape_status(const AttentionShape& shape, const char* where) {
  if (Status s = attention::softmax_scale_status<float>(shape, where); !s) return s;  // fp32 accumulation
  bool qk_built = false;
  for (const CudaFlashHeadDims& d : kCudaFlashHeadDims) {
    if (d.qk == shape.qk_dim() && d.v == shape.v_dim()) return Status::success();
    qk_built = qk_built || d.qk == shape.qk_dim();
  }
  std::string built = "the CUDA kernels are built for (head_dim, head_dim_v) =";
  for (const CudaFlashHeadDims& d : kCudaFlashHeadDims) {
    // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on " " + std::to_string(...).
    built += ' ';
    built += std::to_string(d.qk);
    built += '/';
    built += std::to_string(d.v);
  }
  built += " (head_dim_v 0 = head_dim)";
  if (!qk_built) return seqpar::detail::refuse_invalid(where, "shape.head_dim", shape.head_dim, built);
  return seqpar::detail::refuse_invalid(where, "shape.head_dim_v", shape.head_dim_v, built);
}

/// Whether `exec`'s device gives a block the `bytes` of dynamic shared memory CudaFlash's kernels need
/// at head sizes head_dim/head_dim_v (what can_implement(exec, shape) answers and a launch refuses).
[[nodiscard]] inline Status cuda_flash_shared_status(const gpu::CudaExec& exec, std::size_t bytes, int head_dim,
                                                     int head_dim_v, const char* where) {
  if (bytes <= static_cast<std::size_t>(exec.max_shared_bytes())) return Status::success();
  return seqpar::detail::refuse_invalid(where, "shape.head_dim", head_dim,
                                        "at head sizes " + std::to_string(head_dim) + "/" + std::to_string(head_dim_v) +
                                            " the kernels need " + std::to_string(bytes) +
                                            " bytes of shared memory per block, the device allows " +
                                            std::to_string(exec.max_shared_bytes()));
}

/// CudaFlash's per-program parameters of one call (`CudaFlash::prepare`): the call's slices and its
/// tile table, longest tiles first, in one block of device memory, built on the host once per cached
/// program. The kernels read the slices of this copy (the tile entries index it), so a context's
/// mirror of the slices may hold them in another order (the executor sorts merges' slices there).
struct CudaFlashParams {
  Pass pass = Pass::kForward;
  int head_dim = 0;
  int head_dim_v = 0;                    ///< the shape's v_dim() (0 resolved to head_dim)
  int rows_per_tile = 0;                 ///< query rows per tile of the pass's kernel (forward or dQ)
  std::int64_t q_rows = 0;               ///< rows of the call's q buffer
  std::int64_t num_slices = 0;           ///< slices of the call (what forward/backward are passed)
  std::int64_t num_tiles = 0;            ///< entries of the tile table
  const AttnSlice* slices = nullptr;     ///< device: the call's slices
  const std::uint64_t* tiles = nullptr;  ///< device: the tile table (gpu::detail::pack_tile entries)
  const unsigned* length = nullptr;      ///< device: num_tiles, as the kernels read it
  gpu::DeviceBytes storage;              ///< owns the three above
};

template <class T>
class CudaFlash {
  static_assert(gpu::detail::kIsStorageType<T>, "CudaFlash<T>: T must be float, __half or __nv_bfloat16");

 public:
  using kernel_category = kernel_tag;
  using value_type = T;
  using accum_type = float;
  using exec_type = gpu::CudaExec;

  /// Streams of its own on the calling thread's current device.
  CudaFlash() : CudaFlash(gpu::CudaExec{}) {}
  explicit CudaFlash(gpu::CudaExec exec) : exec_(std::move(exec)) {}

  [[nodiscard]] const gpu::CudaExec& exec() const noexcept { return exec_; }

  using Params = CudaFlashParams;

  /// The head-size pairs of kCudaFlashHeadDims (cuda_flash_shape_status), with the shared memory their
  /// kernels need on the kernel's own device; the calls refuse the same shapes.
  [[nodiscard]] Status can_implement(const AttentionShape& shape) const { return can_implement(exec_, shape); }
  /// The same on `exec`'s device.
  [[nodiscard]] Status can_implement(const gpu::CudaExec& exec, const AttentionShape& shape) const {
    if (Status s = cuda_flash_shape_status(shape, "CudaFlash"); !s) return s;
    return cuda_flash_shared_status(exec, shared_bytes(shape.qk_dim(), shape.v_dim()), shape.qk_dim(), shape.v_dim(),
                                    "CudaFlash");
  }
  /// Dynamic shared memory per block of the largest of the kernels (forward, dQ, dK/dV) at a pair of
  /// kCudaFlashHeadDims (head_dim_v 0 = head_dim); another pair throws std::invalid_argument.
  [[nodiscard]] static std::size_t shared_bytes(int head_dim, int head_dim_v = 0);

  /// The call's tile table, built on the host from `host_slices` (checked against q_rows and k_rows)
  /// and uploaded with a copy of them on exec.stream() (waited for: once per cached program). What
  /// `runtime::Executor::initialize` calls for every kernel call of a program.
  [[nodiscard]] Params prepare(const gpu::CudaExec& exec, const AttentionShape& shape,
                               std::span<const AttnSlice> host_slices, std::int64_t q_rows, std::int64_t k_rows,
                               Pass pass) const;

  /// Device bytes of scratch for a call over q_rows query rows (forward or backward).
  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape& shape, std::int64_t q_rows,
                                            std::int64_t k_rows) const;

  void forward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
               ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o, LseView<float> lse,
               std::span<std::byte> workspace);

  void backward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
                ThdView<const T> v, ThdView<const T> o, LseView<const float> lse, ThdView<const T> dout,
                std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                std::span<std::byte> workspace);

  /// With the call's `Params` (from `prepare` for this shape, pass and slices): no tile table is
  /// built; `slices` must be the prepared call's (their count is checked).
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
  // Both calls of a pass, with the prepared call's Params or (null) building the tile table now.
  void run_forward(const gpu::CudaExec& exec, const Params* params, const AttentionShape& shape, ThdView<const T> q,
                   ThdView<const T> k, ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o,
                   LseView<float> lse, std::span<std::byte> workspace);
  void run_backward(const gpu::CudaExec& exec, const Params* params, const AttentionShape& shape, ThdView<const T> q,
                    ThdView<const T> k, ThdView<const T> v, ThdView<const T> o, LseView<const float> lse,
                    ThdView<const T> dout, std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk,
                    ThdView<T> dv, std::span<std::byte> workspace);

  gpu::CudaExec exec_;
};

static_assert(AttentionKernel<CudaFlash<float>>);
static_assert(PreparingKernel<CudaFlash<float>>);

}  // namespace seqpar::attention
