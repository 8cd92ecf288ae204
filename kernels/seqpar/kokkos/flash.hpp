// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `attention::KokkosFlash<ExecSpace, T>`: the attention kernel on any Kokkos execution space.
///
/// **What.** Forward (O, LSE) and backward (dQ, dK, dV accumulated) over a slice list (disjoint query
/// ranges; masks full / causal with offset / sliding window), GQA without copying KV, any pair of head
/// sizes (MLA: q, k, dq, dk of `shape.qk_dim()`, v, o, dout, dv of `shape.v_dim()`): the same
/// contract as `attention::Reference` and `CpuFlash` (`AttentionKernel`), on the execution context
/// `kokkos::KokkosExec<ExecSpace>`, so every strategy runs on it (`DistributedAttention<S, KokkosFlash<...>>`).
///
/// **Algorithm** (FlashAttention-2, Dao 2023), as Kokkos team kernels (detail/flash_kernels.hpp):
/// the slices are cut into query tiles of `q_tile` rows by a parallel_scan into the workspace; the
/// forward is a TeamPolicy over (query tile, query head): the scaled Q tile and an accumulator stay in
/// team scratch while the key tiles the rows see (`k_tile` keys, K^T and V in team scratch) stream
/// past, with an online softmax (running max and sum, rescaled accumulator). Backward recomputes
/// P = exp(S - LSE) with D = rowsum(dO * O) (over v_dim), dS = P * (dP - D), deterministically and
/// without atomics: one TeamPolicy over (key tile of the buffer, KV head) accumulates dV += P^T dO and dK += dS^T Q
/// over every query head of the group and every slice reading the tile; one over (query tile, query head) accumulates
/// dQ += dS K. S = Q K^T contracts over qk_dim, dP = dO V^T over v_dim; each team-scratch tile is as wide as the tensor
/// it holds, so a 576/512 head costs the scratch of its two widths.
///
/// **Memory.** The calls never allocate: the caller's workspace (in the space's memory,
/// `workspace_bytes`) holds the tile table and D; tiles live in Kokkos team scratch (level 0 when
/// they fit, else level 1, which Kokkos keeps between launches). Views live in the space's memory;
/// for a host-accessible space the slices are validated on the host (a seqpar::Error naming the
/// argument), for a device space they are trusted as given.
///
/// **Requirements.** Kokkos 3.4 or later (Debian's Trilinos 13.2 ships 3.4.01, Serial only), valid for
/// Kokkos 4. Kokkos must be initialized while a KokkosFlash or KokkosExec exists. Calls on one
/// execution space are serialised by a process-wide lock (kokkos::launch_mutex): Kokkos 3.4 shares
/// team scratch between launches on one space instance, and in-process worlds call from many threads.
///
/// @code
/// Kokkos::ScopeGuard guard(argc, argv);
/// attention::KokkosFlash<Kokkos::Serial, double> flash;
/// // shape {.heads_q = 16, .heads_kv = 16, .head_dim = 192, .head_dim_v = 128} (MLA): q, k 192 wide, v, o 128
/// std::vector<std::byte> ws(flash.workspace_bytes(shape, q.tokens, k.tokens));
/// flash.forward(shape, q, k, v, slices, o, lse, ws);   // or kokkos::as_thd(view) for Kokkos::Views
/// @endcode

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "seqpar/attention/detail/call_checks.hpp"
#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/kokkos/detail/flash_kernels.hpp"
#include "seqpar/kokkos/exec.hpp"

namespace seqpar::attention {

/// Tunables of KokkosFlash.
struct KokkosFlashArguments {
  int q_tile = 64;        ///< query rows per team (forward, dQ) and per dK/dV query block
  int k_tile = 64;        ///< keys per team-scratch K/V tile (and per dK/dV team)
  int vector_length = 1;  ///< TeamPolicy vector length (lanes along keys / head_dim); team size is AUTO
};

template <class ExecSpace, class T>
class KokkosFlash {
  static_assert(std::is_floating_point_v<T>, "KokkosFlash<ExecSpace, T>: T must be float or double");

 public:
  using kernel_category = kernel_tag;
  using value_type = T;
  using accum_type = std::conditional_t<std::is_same_v<T, double>, double, float>;
  using exec_type = kokkos::KokkosExec<ExecSpace>;
  using Arguments = KokkosFlashArguments;

  KokkosFlash() : KokkosFlash(Arguments{}) {}
  explicit KokkosFlash(Arguments args, exec_type exec = exec_type()) : args_(args), exec_(std::move(exec)) {
    constexpr const char* where = "KokkosFlash";
    seqpar::detail::require(args.q_tile >= 1 && args.q_tile <= 4096, where, "args.q_tile", args.q_tile,
                            "must be in [1, 4096]");
    seqpar::detail::require(args.k_tile >= 1 && args.k_tile <= 4096, where, "args.k_tile", args.k_tile,
                            "must be in [1, 4096]");
    seqpar::detail::require(args.vector_length >= 1 && args.vector_length <= 1024, where, "args.vector_length",
                            args.vector_length, "must be in [1, 1024]");
  }

  [[nodiscard]] const Arguments& arguments() const noexcept { return args_; }
  [[nodiscard]] const exec_type& exec() const noexcept { return exec_; }

  /// Tile table (one entry per query tile, at most q_rows) and D (heads_q x q_rows), 64-byte aligned.
  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape& shape, std::int64_t q_rows,
                                            std::int64_t /*k_rows*/) const noexcept {
    const auto rows = static_cast<std::size_t>(q_rows > 0 ? q_rows : 0);
    const auto heads = static_cast<std::size_t>(shape.heads_q > 0 ? shape.heads_q : 0);
    return 64 + align64(rows * sizeof(kokkos::detail::QTile)) + heads * rows * sizeof(accum_type);
  }

  /// Whether the kernel runs `shape`: a well-formed shape (each head size in [1, 1024]) whose softmax
  /// scale stays finite and nonzero in accum_type and whose tiles (args.q_tile x args.k_tile, Q/K tiles
  /// at qk_dim and V/O tiles at v_dim) fit the space's team scratch in every pass. The calls refuse the same.
  [[nodiscard]] Status can_implement(const AttentionShape& shape) const {
    return implementable(shape, "KokkosFlash", true, true);
  }

  void forward(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
               std::span<const AttnSlice> slices, ThdView<T> o, LseView<accum_type> lse,
               std::span<std::byte> workspace) const {
    forward(exec_, shape, q, k, v, slices, o, lse, workspace);
  }

  void forward(const exec_type& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
               ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o, LseView<accum_type> lse,
               std::span<std::byte> workspace) const {
    constexpr const char* where = "KokkosFlash::forward";
    check(shape, q, k, v, slices, workspace, where, true);
    attention::detail::check_forward_outputs(where, shape, q, k, v, o, lse, workspace);
    const std::lock_guard lock(kokkos::launch_mutex<ExecSpace>());
    const ExecSpace& space = exec.space();
    using Range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
    const std::int64_t cells = q.tokens * shape.heads_q;
    if (cells > 0)
      Kokkos::parallel_for("seqpar::KokkosFlash::prefill", Range(space, 0, cells),
                           kokkos::detail::Prefill<T, A>{rows(o), lse_rows(lse), shape.heads_q, shape.v_dim(),
                                                         -std::numeric_limits<A>::infinity()});
    const Work w = carve(shape, q.tokens, workspace);
    const std::int64_t n_tiles = query_tiles(space, slices, w.tiles);
    if (n_tiles > 0) {
      kokkos::detail::ForwardKernel<ExecSpace, T, A> f;
      base(f, shape);
      f.q = rows(q), f.k = rows(k), f.v = rows(v), f.o = rows(o), f.lse = lse_rows(lse);
      f.slices = slices.data(), f.tiles = w.tiles, f.heads_q = shape.heads_q, f.group = shape.group_size();
      launch("seqpar::KokkosFlash::forward", space, f, n_tiles * shape.heads_q, where);
    }
    space.fence();
  }

  void backward(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                ThdView<const T> o, LseView<const accum_type> lse, ThdView<const T> dout,
                std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                std::span<std::byte> workspace) const {
    backward(exec_, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
  }

  void backward(const exec_type& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
                ThdView<const T> v, ThdView<const T> o, LseView<const accum_type> lse, ThdView<const T> dout,
                std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                std::span<std::byte> workspace) const {
    constexpr const char* where = "KokkosFlash::backward";
    check(shape, q, k, v, slices, workspace, where, false);
    attention::detail::check_backward_views(where, shape, q, k, v, o, lse, dout, dq, dk, dv, workspace);
    const std::lock_guard lock(kokkos::launch_mutex<ExecSpace>());
    const ExecSpace& space = exec.space();
    const Work w = carve(shape, q.tokens, workspace);
    using Range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
    const std::int64_t cells = q.tokens * shape.heads_q;
    if (cells > 0)
      Kokkos::parallel_for(
          "seqpar::KokkosFlash::delta", Range(space, 0, cells),
          kokkos::detail::RowDot<T, A>{rows(dout), rows(o), w.delta, q.tokens, shape.heads_q, shape.v_dim()});
    const std::int64_t n_tiles = query_tiles(space, slices, w.tiles);
    const std::int64_t key_tiles = (k.tokens + args_.k_tile - 1) / args_.k_tile;
    if (n_tiles > 0 && key_tiles > 0) {
      kokkos::detail::BackwardKVKernel<ExecSpace, T, A> kv;
      backward_inputs(kv, shape, q, k, v, lse, dout, slices, w);
      kv.dk = rows(dk), kv.dv = rows(dv);
      kv.n_slices = static_cast<std::int64_t>(slices.size()), kv.k_tokens = k.tokens, kv.heads_kv = shape.heads_kv;
      launch("seqpar::KokkosFlash::backward_kv", space, kv, key_tiles * shape.heads_kv, where);

      kokkos::detail::BackwardQKernel<ExecSpace, T, A> dqk;
      backward_inputs(dqk, shape, q, k, v, lse, dout, slices, w);
      dqk.dq = rows(dq), dqk.tiles = w.tiles;
      launch("seqpar::KokkosFlash::backward_q", space, dqk, n_tiles * shape.heads_q, where);
    }
    space.fence();
  }

 private:
  using A = accum_type;

  struct Work {
    kokkos::detail::QTile* tiles;
    A* delta;
  };

  static constexpr std::size_t align64(std::size_t n) noexcept { return (n + 63) / 64 * 64; }

  [[nodiscard]] Work carve(const AttentionShape& shape, std::int64_t q_rows, std::span<std::byte> workspace) const {
    (void)shape;
    const auto addr = reinterpret_cast<std::uintptr_t>(workspace.data());
    std::byte* base = workspace.data() + ((64 - addr % 64) % 64);
    const auto rows_ = static_cast<std::size_t>(q_rows);
    return {reinterpret_cast<kokkos::detail::QTile*>(base),
            reinterpret_cast<A*>(base + align64(rows_ * sizeof(kokkos::detail::QTile)))};
  }

  template <class U>
  static kokkos::detail::Rows<U> rows(ThdView<U> v) noexcept {
    return {v.data, v.token_stride, v.head_stride};
  }
  template <class U>
  static kokkos::detail::LseRows<U> lse_rows(LseView<U> v) noexcept {
    return {v.data, v.head_stride};
  }

  template <class K>
  void base(K& f, const AttentionShape& shape) const {
    f.set_tiles(shape.qk_dim(), shape.v_dim(), args_.q_tile, args_.k_tile), f.scale = A(shape.scale());
  }

  template <class K>
  void backward_inputs(K& f, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                       LseView<const A> lse, ThdView<const T> dout, std::span<const AttnSlice> slices,
                       const Work& w) const {
    base(f, shape);
    f.q = rows(q), f.k = rows(k), f.v = rows(v), f.dout = rows(dout), f.lse = lse_rows(lse);
    f.delta = w.delta, f.q_tokens = q.tokens, f.slices = slices.data();
    f.heads_q = shape.heads_q, f.group = shape.group_size();
  }

  /// The query tiles of every slice, into `tiles` (in the space's memory); returns their number.
  [[nodiscard]] std::int64_t query_tiles(const ExecSpace& space, std::span<const AttnSlice> slices,
                                         kokkos::detail::QTile* tiles) const {
    std::int64_t total = 0;
    if (slices.empty()) return 0;
    Kokkos::parallel_scan("seqpar::KokkosFlash::tiles",
                          Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(
                              space, 0, static_cast<std::int64_t>(slices.size())),
                          kokkos::detail::TileScan{slices.data(), tiles, args_.q_tile}, total);
    return total;
  }

  /// A TeamPolicy over `league` teams with the kernel's scratch (level 0 when it fits).
  template <class K>
  void launch(const char* label, const ExecSpace& space, K& f, std::int64_t league, const char* where) const {
    using Policy = Kokkos::TeamPolicy<ExecSpace>;
    if (league > std::numeric_limits<int>::max())
      seqpar::detail::throw_invalid(where, "work items", league, "exceed a Kokkos league of INT_MAX teams");
    const std::size_t bytes = f.scratch_bytes();
    f.level = bytes <= static_cast<std::size_t>(Policy::scratch_size_max(0)) ? 0 : 1;
    seqpar::detail::throw_if_refused(scratch_status(bytes, where));
    Policy policy(space, static_cast<int>(league), Kokkos::AUTO, args_.vector_length);
    Kokkos::parallel_for(label, policy.set_scratch_size(f.level, Kokkos::PerTeam(bytes)), f);
  }

  // Team scratch of `bytes` per team: within the space's level-1 maximum.
  [[nodiscard]] Status scratch_status(std::size_t bytes, const char* where) const {
    using Policy = Kokkos::TeamPolicy<ExecSpace>;
    if (bytes <= static_cast<std::size_t>(Policy::scratch_size_max(1))) return Status::success();
    return seqpar::detail::refuse_invalid(
        where, "args.q_tile/k_tile", std::to_string(args_.q_tile) + "/" + std::to_string(args_.k_tile),
        "team scratch of " + std::to_string(bytes) + " bytes exceeds the space's level-1 maximum " +
            std::to_string(Policy::scratch_size_max(1)) + ": use smaller tiles");
  }

  // What can_implement answers (both passes) and a call refuses (its pass): the shape, then the team
  // scratch of the pass's kernels at these head sizes (launch checks each kernel with scratch_status too).
  [[nodiscard]] Status implementable(const AttentionShape& shape, const char* where, bool forward,
                                     bool backward) const {
    // The shape, and a scale the accumulation type keeps exact (Q is loaded pre-scaled): the check every kernel makes.
    if (Status s = attention::softmax_scale_status<A>(shape, where); !s) return s;
    std::size_t bytes = 0;
    if (forward) {
      kokkos::detail::ForwardKernel<ExecSpace, T, A> f;
      base(f, shape);
      bytes = f.scratch_bytes();
    }
    if (backward) {
      kokkos::detail::BackwardKVKernel<ExecSpace, T, A> kv;
      kokkos::detail::BackwardQKernel<ExecSpace, T, A> dq;
      base(kv, shape);
      base(dq, shape);
      bytes = std::max({bytes, kv.scratch_bytes(), dq.scratch_bytes()});
    }
    return scratch_status(bytes, where);
  }

  void check(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
             std::span<const AttnSlice> slices, std::span<std::byte> workspace, const char* where, bool forward) const {
    seqpar::detail::throw_if_refused(implementable(shape, where, forward, !forward));
    seqpar::detail::check_view(q, where, "q", q.tokens, shape.heads_q, shape.qk_dim());
    seqpar::detail::check_view(k, where, "k", k.tokens, shape.heads_kv, shape.qk_dim());
    seqpar::detail::check_view(v, where, "v", k.tokens, shape.heads_kv, shape.v_dim());
    if constexpr (kokkos::kHostAccessible<ExecSpace>) validate_slices(slices, q.tokens, k.tokens, where);
    const std::size_t need = workspace_bytes(shape, q.tokens, k.tokens);
    if (workspace.size() < need)
      seqpar::detail::throw_invalid(where, "workspace.size()", workspace.size(),
                                    "needs workspace_bytes() = " + std::to_string(need));
  }

  Arguments args_;
  exec_type exec_;
};

static_assert(AttentionKernel<KokkosFlash<Kokkos::DefaultHostExecutionSpace, float>>);
static_assert(AttentionKernel<KokkosFlash<Kokkos::DefaultHostExecutionSpace, double>>);

}  // namespace seqpar::attention
