// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// CpuFlash's workspace: where each region lies in the caller's bytes (`workspace_layout`, whose total is
/// CpuFlash::workspace_bytes) and the typed pointers the passes work through (`carve_workspace`).
///
/// No allocation in forward/backward: the caller passes `workspace_bytes(shape, q_rows, k_rows)` bytes (per
/// thread: two q_tile x head_dim fp32 tiles, ~0.6 MB at q_tile 576, d 128; plus heads_q * q_rows accumulators for
/// D, tile lists of O(q_rows) entries, and the backward's fp32 accumulators: lanes x q_rows x head_dim for dQ and
/// 2 x k_rows x head_dim for dK/dV (the forward packs one KV head's K^T and V there), and 2 x q_rows x head_dim for
/// one head's packed Q and dO, e.g. 32 MiB at 8K tokens, d 128, 1-4 threads). With unequal head sizes
/// (head_dim_v != head_dim, MLA) every region is sized for the larger of the two. The layout does not depend on the
/// instruction set: panels are sized for the widest policy (kMaxPanel).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "seqpar/attention/detail/cpu_flash_blocking.hpp"
#include "seqpar/attention/detail/cpu_flash_packing.hpp"
#include "seqpar/attention/detail/cpu_flash_work_list.hpp"
#include "seqpar/attention/detail/flash_tiles.hpp"
#include "seqpar/core/attention_shape.hpp"

namespace seqpar::attention::detail {

/// Byte offsets of the regions (from the workspace's first 64-byte boundary) and the total to ask for.
struct WorkspaceLayout {
  std::size_t tiles_off, tiles_count, qtiles_off, delta_off, dq_off, dk_off, dv_off, qp_off, op_off, qpp_off, opp_off,
      flags_off, threads_off, thread_bytes, total;
};

/// The regions as typed pointers (A: the accumulation type).
template <class A>
struct WorkspaceRegions {
  WorkTile* tiles;          // key tiles (backward) or query tiles (forward)
  WorkTile* qtiles;         // query tiles (backward)
  A* delta;                 // heads_q x q_rows: D = rowsum(dO * O) (backward)
  A* dq_lanes;              // lanes x q_rows x d
  A* dk_acc;                // k_rows x d (backward)
  A* dv_acc;                // k_rows x d (backward)
  A* k_pack;                // forward: the current KV head's K^T, tile t at t * tile_elems(d) (the dk_acc memory)
  A* v_pack;                // forward: its V in head-dim panels, likewise (the dv_acc memory)
  unsigned char* v_finite;  // forward: 1 when tile t of v_pack is all finite
  A* qp;                    // q_rows x d: the current head's Q pre-scaled by c (backward)
  A* op;                    // q_rows x d: the current head's dO (backward)
  A* qpp;                   // the same c Q as head-dim panels of q_rows x kP (backward; rows_to_panels)
  A* opp;                   // dO likewise
  std::byte* threads;
  std::size_t thread_bytes;
  /// Thread t's tile set (the forward's Q, output and score tiles; the backward's packed key tile and P, dS).
  [[nodiscard]] A* thread(int t) const noexcept {
    return reinterpret_cast<A*>(threads + static_cast<std::size_t>(t) * thread_bytes);
  }
};

inline constexpr std::size_t round16(std::int64_t n) noexcept {
  return static_cast<std::size_t>((n + 15) / 16 * 16);
}
inline constexpr std::size_t align64(std::size_t n) noexcept {
  return (n + 63) / 64 * 64;
}

template <class A>
[[nodiscard]] inline WorkspaceLayout workspace_layout(const FlashBlocking& blocking, const AttentionShape& shape,
                                                      std::int64_t q_rows, std::int64_t k_rows) noexcept {
  const std::int64_t d = std::max({shape.qk_dim(), shape.v_dim(), 1});  // every region fits either width
  const std::int64_t br = blocking.q_tile_rows;
  const std::int64_t rq = blocking.q_block_rows;
  const std::size_t fwd = 2 * round16(br * d) + round16(kScoreBlock * kKeyTile) + 2 * round16(br);
  // + per register block of the query block: the key range of its dQ product (two ints each)
  const std::size_t bwd =
      3 * round16(tile_elems(static_cast<int>(d))) + 2 * round16(rq * kKeyTile) + 2 * round16(rq / kRowBlock + 1);
  const auto qn = static_cast<std::size_t>(std::max<std::int64_t>(q_rows, 0));
  const auto kn = static_cast<std::size_t>(std::max<std::int64_t>(k_rows, 0));
  const auto du = static_cast<std::size_t>(d);
  WorkspaceLayout l{};
  l.tiles_count = static_cast<std::size_t>(std::max(q_rows + q_rows / br, k_rows / kKeyTile) + 2);
  l.tiles_off = 0;
  l.qtiles_off = align64(l.tiles_count * sizeof(WorkTile));
  l.delta_off = l.qtiles_off + align64(l.tiles_count * sizeof(WorkTile));
  l.dq_off = l.delta_off + align64(static_cast<std::size_t>(std::max(shape.heads_q, 0)) * qn * sizeof(A));
  l.dk_off = l.dq_off + align64(static_cast<std::size_t>(blocking.lanes) * qn * du * sizeof(A));
  // dK / dV accumulators (backward), or the packed K^T / V tiles of one KV head (forward)
  const std::size_t n_kt = (kn + kKeyTile - 1) / kKeyTile;
  const std::size_t kv = std::max(kn * du, n_kt * static_cast<std::size_t>(tile_elems(static_cast<int>(d))));
  l.dv_off = l.dk_off + align64(kv * sizeof(A));
  l.qp_off = l.dv_off + align64(kv * sizeof(A));
  l.op_off = l.qp_off + align64(qn * du * sizeof(A));
  constexpr int kP = kMaxPanel;
  const std::size_t dp = static_cast<std::size_t>((d + kP - 1) / kP * kP);
  l.qpp_off = l.op_off + align64(qn * du * sizeof(A));
  l.opp_off = l.qpp_off + align64(qn * dp * sizeof(A));
  l.flags_off = l.opp_off + align64(qn * dp * sizeof(A));
  l.threads_off = l.flags_off + align64(n_kt);
  l.thread_bytes = align64(std::max(fwd, bwd) * sizeof(A));
  l.total = 64 + l.threads_off + static_cast<std::size_t>(blocking.threads) * l.thread_bytes;
  return l;
}

/// The regions of `workspace` (at least workspace_layout(...).total bytes, any alignment: they start at its first
/// 64-byte boundary).
template <class A>
[[nodiscard]] inline WorkspaceRegions<A> carve_workspace(const FlashBlocking& blocking, const AttentionShape& shape,
                                                         std::int64_t q_rows, std::int64_t k_rows,
                                                         std::span<std::byte> workspace) noexcept {
  const WorkspaceLayout l = workspace_layout<A>(blocking, shape, q_rows, k_rows);
  const auto addr = reinterpret_cast<std::uintptr_t>(workspace.data());
  std::byte* base = workspace.data() + ((64 - addr % 64) % 64);
  return {reinterpret_cast<WorkTile*>(base + l.tiles_off),
          reinterpret_cast<WorkTile*>(base + l.qtiles_off),
          reinterpret_cast<A*>(base + l.delta_off),
          reinterpret_cast<A*>(base + l.dq_off),
          reinterpret_cast<A*>(base + l.dk_off),
          reinterpret_cast<A*>(base + l.dv_off),
          reinterpret_cast<A*>(base + l.dk_off),
          reinterpret_cast<A*>(base + l.dv_off),
          reinterpret_cast<unsigned char*>(base + l.flags_off),
          reinterpret_cast<A*>(base + l.qp_off),
          reinterpret_cast<A*>(base + l.op_off),
          reinterpret_cast<A*>(base + l.qpp_off),
          reinterpret_cast<A*>(base + l.opp_off),
          base + l.threads_off,
          l.thread_bytes};
}

}  // namespace seqpar::attention::detail
