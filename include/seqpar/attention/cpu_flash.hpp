// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `attention::CpuFlash<T>`: the fast CPU attention kernel (T = float, double, or bf16 storage with fp32
/// accumulation and LSE: values are converted on load and rounded to nearest even on store).
///
/// **What.** Forward (O, LSE) and backward (dQ, dK, dV accumulated) of softmax attention over a list of
/// slices (disjoint query ranges, any keys, masks full / causal with explicit offset / sliding window),
/// GQA without copying KV. Satisfies `AttentionKernel`, so it drops in wherever `Reference` does.
///
/// **Algorithm** (FlashAttention-2, Dao 2023). Forward, one KV head at a time: its K^T and V are packed once into
/// the micro-kernels' panels, then per work item (query head, query tile of `q_tile` rows) S = Q K^T per 128-key tile
/// by broadcast-FMA micro-kernels, an online softmax in base 2 and P V into an fp32 output tile; tiles and row blocks
/// that the mask hides are skipped, only blocks that a mask edge crosses are masked element-wise. Backward recomputes
/// P from LSE and dS = P * (dP - D) once per (query head, key tile, query block) and uses them for dV, dK and dQ (5
/// tile GEMMs), deterministic with no atomics: the bits depend on `Arguments` (and not on the thread count of the
/// executing context up to 4). Masked (query, key) pairs never enter a product, so a NaN or infinity stays in the rows
/// and keys that read it. Work items run largest-first (by visible area) on the execution context's thread pool
/// (`HostExec`; the kernel's own context has `threads` threads, 1 runs inline on the caller).
///
/// **Instruction sets.** For float and bf16 storage the micro-kernels are chosen at run time, whatever the
/// build's -march (cpu_isa.hpp): AVX-512 (6 x 64 blocks in 24 zmm) where the CPU and OS support it, else AVX2 +
/// FMA (6 x 16 in 12 ymm), else a portable path with the same blocking (also double's path; plain C++, which
/// GCC 12 leaves scalar at -O2 for float: ~30x slower than AVX2, bench/attention_cpu --isa portable).
/// `Arguments::isa` or the environment variable SEQPAR_CPU_ISA forces one; `isa()` says which runs. The paths
/// differ in the order of fp32 sums only (the exp2 polynomial is shared), not in what they compute, except
/// avx512bf16 (bf16 storage on CPUs with AVX512-BF16, its default there): all seven tile products by bf16 dot
/// products (vdpbf16ps) with fp32 accumulation; S = Q K^T and dP = dO V^T from the exact bf16 inputs, while P (in
/// O += P V, dV += P^T dO) and dS (in dK, dQ) are rounded to bf16 first, as FlashAttention does on GPUs: a relative
/// error of at most 2^-9 per weight, on the order of the bf16 rounding of the outputs themselves
/// (flash_tiles_avx512bf16.hpp).
///
/// **Memory.** No allocation in forward/backward: the caller passes `workspace_bytes(shape, q_rows, k_rows)` bytes
/// (per-thread tiles, the backward's fp32 dQ lanes and dK/dV accumulators, one head's packed Q and dO: e.g. 32 MiB at
/// 8K tokens, d 128, 1-4 threads; the regions: detail/cpu_flash_workspace.hpp).
///
/// **Head sizes.** Any pair: Q K^T runs over shape.qk_dim(), P V, dP = dO V^T and dV over shape.v_dim() (e.g.
/// 192/128 and 576/512 for MLA); the tiles take the width at run time.
///
/// **Requirements.** Views as `Reference` (head_dim contiguous, any token/head strides); q_ranges of one
/// call disjoint; precision: accumulation in `accum_type` (float for float, double for double); exp2 by a
/// polynomial with ~1e-7 relative error on the AVX2 and AVX-512 paths. Calls on one object are serialised.
///
/// **The pieces** (include/seqpar/attention/detail/; this header is the class and its checks):
///  - cpu_flash_forward.hpp        the forward pass, and its work item: a query tile against a KV head's packed tiles
///  - cpu_flash_backward.hpp       the backward pass: D, a head's packed Q and dO, the lanes, the dQ / dK / dV stores
///  - cpu_flash_backward_tile.hpp  its unit: one key tile against one query head (5 tile GEMMs; exact forms for NaN)
///  - cpu_flash_work_list.hpp      query and key tiles with their costs; dealing key tiles to the backward's lanes
///  - cpu_flash_visibility.hpp     which rows of a slice see which keys (rows_seeing, key_span, tile_columns)
///  - cpu_flash_packing.hpp        rows into the micro-kernels' panels and bf16 pairs; the row prefetch
///  - cpu_flash_workspace.hpp      the workspace's layout (workspace_bytes) and regions
///  - cpu_flash_blocking.hpp       block sizes, and those the Arguments fix (FlashBlocking)
///  - flash_tiles*.hpp, tile_dispatch.hpp: the micro-kernels of each instruction set, and the run-time choice of one
///
/// @code
/// attention::CpuFlash<float> flash({.threads = 2});
/// std::vector<std::byte> ws(flash.workspace_bytes(shape, q.tokens, k.tokens));
/// flash.forward(shape, q, k, v, slices, o, lse, ws);                          // o (T, Hq, D), lse (Hq, T)
/// flash.backward(shape, q, k, v, o, lse, dout, slices, dq, dk, dv, ws);       // dq, dk, dv +=
/// @endcode

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "seqpar/attention/cpu_isa.hpp"
#include "seqpar/attention/detail/bf16.hpp"
#include "seqpar/attention/detail/call_checks.hpp"
#include "seqpar/attention/detail/cpu_flash_backward.hpp"
#include "seqpar/attention/detail/cpu_flash_blocking.hpp"
#include "seqpar/attention/detail/cpu_flash_forward.hpp"
#include "seqpar/attention/detail/cpu_flash_workspace.hpp"
#include "seqpar/attention/detail/tile_dispatch.hpp"
#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/host_exec.hpp"

namespace seqpar::attention {

/// Tunables of CpuFlash (values, not types).
struct CpuFlashArguments {
  int threads = 1;             ///< worker threads including the caller; 1 runs inline
  int q_tile = 576;            ///< query rows per forward / dQ work item (K/V tiles stay in L1/L2 across it)
  int backward_q_block = 192;  ///< query rows per block of the backward (packed Q, dO, P, dS)
  /// The micro-kernels' instruction set: kAuto picks the best this CPU supports (or what the environment
  /// variable SEQPAR_CPU_ISA names); a named one this CPU lacks is refused. double has the portable path only.
  CpuIsa isa = CpuIsa::kAuto;
};

template <class T>
class CpuFlash {
  static_assert(std::is_floating_point_v<T> || std::is_same_v<T, bf16>, "CpuFlash<T>: T must be float, double or bf16");

 public:
  using kernel_category = kernel_tag;
  using value_type = T;
  using accum_type = std::conditional_t<std::is_same_v<T, double>, double, float>;  ///< float for bf16 too
  using Arguments = CpuFlashArguments;
  using exec_type = HostExec;
  /// Largest accepted q_tile / backward_q_block.
  static constexpr int kMaxTileRows = 1 << 16;

  CpuFlash() : CpuFlash(Arguments{}) {}
  explicit CpuFlash(Arguments args) : args_(args) {
    constexpr const char* where = "CpuFlash";
    seqpar::detail::require(args.threads >= 1 && args.threads <= 1024, where, "args.threads", args.threads,
                            "must be in [1, 1024]");
    // Bounded so that tile sizes, their rounding to row blocks and the workspace arithmetic cannot overflow
    // (and a typo does not ask for gigabytes per thread).
    seqpar::detail::require(args.q_tile >= 1 && args.q_tile <= kMaxTileRows, where, "args.q_tile", args.q_tile,
                            "must be in [1, " + std::to_string(kMaxTileRows) + "]");
    seqpar::detail::require(args.backward_q_block >= 1 && args.backward_q_block <= kMaxTileRows, where,
                            "args.backward_q_block", args.backward_q_block,
                            "must be in [1, " + std::to_string(kMaxTileRows) + "]");
    if constexpr (std::is_same_v<T, double>) {
      seqpar::detail::require(args.isa == CpuIsa::kAuto || args.isa == CpuIsa::kPortable, where, "args.isa",
                              to_string(args.isa), "CpuFlash<double> has the portable kernels only (use auto)");
      isa_ = CpuIsa::kPortable;
    } else {
      isa_ = resolve_cpu_isa(args.isa, where, cpu_features(), std::is_same_v<T, bf16>);
    }
    exec_ = HostExec(args.threads);
    blocking_ = detail::flash_blocking(args.threads, args.q_tile, args.backward_q_block);
  }

  // Copies would share one pool between ranks (serialising them); move, or build one per rank.
  CpuFlash(const CpuFlash&) = delete;
  CpuFlash& operator=(const CpuFlash&) = delete;
  CpuFlash(CpuFlash&&) noexcept = default;
  CpuFlash& operator=(CpuFlash&&) noexcept = default;
  ~CpuFlash() = default;

  [[nodiscard]] const Arguments& arguments() const noexcept { return args_; }
  /// The instruction set the micro-kernels run (never kAuto): chosen once, at construction.
  [[nodiscard]] CpuIsa isa() const noexcept { return isa_; }
  /// The kernel's own context (a pool of `args.threads` threads): used by the calls without one, and
  /// by DistributedAttention unless it is given another.
  [[nodiscard]] const HostExec& exec() const noexcept { return exec_; }

  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape& shape, std::int64_t q_rows,
                                            std::int64_t k_rows) const noexcept {
    return detail::workspace_layout<A>(blocking_, shape, q_rows, k_rows).total;
  }

  /// Whether the kernel runs `shape` on its own context: a well-formed shape whose softmax scale accum_type
  /// keeps exact (attention::softmax_scale_status: finite, nonzero, at most max_softmax_scale). The calls
  /// refuse the same.
  [[nodiscard]] Status can_implement(const AttentionShape& shape) const {
    return implementable(exec_, shape, "CpuFlash");
  }
  /// The same on `exec`, which may have at most args.threads threads (the workspace holds one tile
  /// set per thread).
  [[nodiscard]] Status can_implement(const HostExec& exec, const AttentionShape& shape) const {
    return implementable(exec, shape, "CpuFlash");
  }

  void forward(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
               std::span<const AttnSlice> slices, ThdView<T> o, LseView<accum_type> lse,
               std::span<std::byte> workspace) const {
    forward(exec_, shape, q, k, v, slices, o, lse, workspace);
  }

  /// Forward on `exec` (at most args.threads threads: the workspace is sized for them).
  void forward(const HostExec& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
               ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o, LseView<accum_type> lse,
               std::span<std::byte> workspace) const {
    constexpr const char* where = "CpuFlash::forward";
    check(exec, shape, q, k, v, slices, workspace, where);
    detail::check_forward_outputs(where, shape, q, k, v, o, lse, workspace);
    detail::with_tile_policy<A, T>(isa_, [&]<class Tiles>() {
      detail::cpu_flash_forward<Tiles>(exec, blocking_, shape, q, k, v, slices, o, lse, workspace);
    });
  }

  void backward(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                ThdView<const T> o, LseView<const accum_type> lse, ThdView<const T> dout,
                std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                std::span<std::byte> workspace) const {
    backward(exec_, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
  }

  /// Backward on `exec` (at most args.threads threads).
  void backward(const HostExec& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
                ThdView<const T> v, ThdView<const T> o, LseView<const accum_type> lse, ThdView<const T> dout,
                std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                std::span<std::byte> workspace) const {
    constexpr const char* where = "CpuFlash::backward";
    check(exec, shape, q, k, v, slices, workspace, where);
    detail::check_backward_views(where, shape, q, k, v, o, lse, dout, dq, dk, dv, workspace);
    detail::with_tile_policy<A, T>(isa_, [&]<class Tiles>() {
      detail::cpu_flash_backward<Tiles>(exec, blocking_, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
    });
  }

 private:
  using A = accum_type;

  // What can_implement answers and the calls refuse: one predicate, one message.
  [[nodiscard]] Status implementable(const HostExec& exec, const AttentionShape& shape, const char* where) const {
    if (exec.threads() > args_.threads)
      return seqpar::detail::refuse_invalid(
          where, "exec.threads()", exec.threads(),
          "exceeds args.threads = " + std::to_string(args_.threads) + " (the workspace holds one tile set per thread)");
    return softmax_scale_status<A>(shape, where);  // the shape, and a scale A keeps exact (kernel.hpp)
  }

  void check(const HostExec& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
             ThdView<const T> v, std::span<const AttnSlice> slices, std::span<std::byte> workspace,
             const char* where) const {
    seqpar::detail::throw_if_refused(implementable(exec, shape, where));
    seqpar::detail::check_view(q, where, "q", q.tokens, shape.heads_q, shape.qk_dim());
    seqpar::detail::check_view(k, where, "k", k.tokens, shape.heads_kv, shape.qk_dim());
    seqpar::detail::check_view(v, where, "v", k.tokens, shape.heads_kv, shape.v_dim());
    validate_slices(slices, q.tokens, k.tokens, where);
    const std::size_t need = workspace_bytes(shape, q.tokens, k.tokens);
    if (workspace.size() < need)
      seqpar::detail::throw_invalid(where, "workspace.size()", workspace.size(),
                                    "needs workspace_bytes() = " + std::to_string(need));
  }

  Arguments args_;
  CpuIsa isa_ = CpuIsa::kPortable;
  HostExec exec_;
  detail::FlashBlocking blocking_{};  // what args_ fixes for the passes and the workspace layout
};

static_assert(AttentionKernel<CpuFlash<float>>);
static_assert(AttentionKernel<CpuFlash<double>>);
static_assert(AttentionKernel<CpuFlash<bf16>>);

}  // namespace seqpar::attention
