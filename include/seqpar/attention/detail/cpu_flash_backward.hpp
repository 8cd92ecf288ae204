// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// CpuFlash's backward pass (FlashAttention-2, Dao 2023): dQ, dK and dV accumulated (+=) from dO, O and LSE, with
/// tile policy `Tiles`. D = rowsum(dO * O) first; then per query head its c Q and dO rows are packed once for all of
/// its key tiles, the key tiles run (detail/cpu_flash_backward_tile.hpp) on lanes (detail/cpu_flash_work_list.hpp:
/// deterministic with no atomics), and the lanes' dQ buffers are summed into dq in lane order; dK and dV stay in fp32
/// across the query heads of a KV group and are added into dk / dv after its last head. Query heads run in turn.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <span>

#include "seqpar/attention/detail/cpu_flash_backward_tile.hpp"
#include "seqpar/attention/detail/cpu_flash_blocking.hpp"
#include "seqpar/attention/detail/cpu_flash_packing.hpp"
#include "seqpar/attention/detail/cpu_flash_work_list.hpp"
#include "seqpar/attention/detail/cpu_flash_workspace.hpp"
#include "seqpar/attention/detail/flash_tiles_avx512bf16.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/host_exec.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::attention::detail {

/// The backward pass on `exec` (checked by CpuFlash::backward): dq, dk, dv += the gradients of the slices.
template <class Tiles, class T, class A>
inline void cpu_flash_backward(const HostExec& exec, const FlashBlocking& blocking, const AttentionShape& shape,
                               ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                               LseView<const A> lse, ThdView<const T> dout, std::span<const AttnSlice> slices,
                               ThdView<T> dq, ThdView<T> dk, ThdView<T> dv, std::span<std::byte> workspace) {
  constexpr int kP = Tiles::kPanel;
  constexpr A kLog2e = std::numbers::log2e_v<A>;
  const WorkspaceRegions<A> w = carve_workspace<A>(blocking, shape, q.tokens, k.tokens, workspace);
  const int d = shape.qk_dim(), d_v = shape.v_dim();  // q, k, dq, dk rows; v, o, dout, dv rows
  {                                                   // D = rowsum(dO * O), per query head
    std::atomic<int> next{0};
    auto body = [&](int) {
      for (int h = next.fetch_add(1); h < shape.heads_q; h = next.fetch_add(1))
        for (std::int64_t t = 0; t < q.tokens; ++t) {
          if (t + kAhead < q.tokens) {
            prefetch_row(dout.row(t + kAhead, h), d_v);
            prefetch_row(o.row(t + kAhead, h), d_v);
          }
          const T* a = dout.row(t, h);
          const T* b = o.row(t, h);
          w.delta[h * q.tokens + t] = Tiles::dot(a, b, d_v);
        }
    };
    exec.parallel(body);
  }
  // One pass in 5 tile GEMMs (S, dP, dV += P^T dO, dK += dS^T Q, dQ += dS K), deterministic without atomics:
  // query heads run one after another; within a head, the key tiles are dealt to a fixed number of lanes
  // (contiguous runs of key tiles of about equal cost: a function of the slices and the lane count, not of the
  // thread count), each lane owns its tiles' dK/dV accumulators and its own dQ buffer, threads take whole lanes,
  // and the lanes' dQ buffers are summed in lane order. dK/dV stay in fp32 across the query heads of a group
  // and are added into dk/dv after its last head.
  const std::int64_t n_kt = key_tiles(slices, k.tokens, w.tiles);
  const std::int64_t n_qt = query_tiles(slices, blocking.q_tile_rows, w.qtiles);
  const int n_lanes = blocking.lanes;
  int lane_order[1024];
  deal_lanes(w.tiles, n_kt, n_lanes, lane_order);
  const std::size_t lane_stride = static_cast<std::size_t>(q.tokens) * static_cast<std::size_t>(d);
  Range reach[1024];  // per lane: the query rows its dQ buffer holds (zero elsewhere, never read there)
  lane_reach(slices, w.tiles, n_kt, n_lanes, reach);
  for (int lane = 0; lane < n_lanes; ++lane) {
    std::fill_n(w.dq_lanes + static_cast<std::size_t>(lane) * lane_stride + reach[lane].begin * d,
                reach[lane].size() * d, A(0));
  }
  const int group = shape.group_size();
  const A sc = A(shape.scale());
  const A c = sc * kLog2e;
  // The packed Q is c Q (dK = scale dS^T Q = dS^T (c Q) / log2(e)), or Q itself for the bf16 score products, whose
  // A operand is rounded to bf16 (Q exactly so; c Q would not be): S then gets its factor c in the product.
  const A q_scale = kBf16Scores<Tiles> ? A(1) : c;
  const A dk_scale = kBf16Scores<Tiles> ? sc : A(1) / kLog2e;
  for (int h = 0; h < shape.heads_q; ++h) {
    const int hk = h / group, hh = h % group;
    // The head's c Q and dO rows, packed once (every key tile reads them; packing per tile re-read the
    // strided rows from memory for each one); whether all are finite decides the tiles' product forms.
    std::atomic<bool> q_finite{true}, o_finite{true};
    {
      constexpr std::int64_t kChunk = 256;
      std::atomic<std::int64_t> next{0};
      auto body = [&](int) {
        for (std::int64_t r0 = next.fetch_add(kChunk, std::memory_order_relaxed); r0 < q.tokens;
             r0 = next.fetch_add(kChunk, std::memory_order_relaxed)) {
          const std::int64_t nr = std::min(kChunk, q.tokens - r0);
          A* qr = w.qp + r0 * d;
          A* orow = w.op + r0 * d_v;
          pack_rows<Tiles>(q, r0, nr, h, d, q_scale, qr);
          pack_rows<Tiles>(dout, r0, nr, h, d_v, A(1), orow);
          if constexpr (kBf16Scores<Tiles>) {
            // bf16 products: Q and dO as pairs of rows (row pairs 2j, 2j + 1 of the buffer; chunks start even), the
            // B operands of dK += dS^T Q and dV += P^T dO; they fill half of each panel
            for (std::int64_t r = r0; r < r0 + nr; r += 2) {
              const bool two = r + 1 < r0 + nr;
              Tiles::pack_row_pairs(q.row(r, h), two ? q.row(r + 1, h) : nullptr, d, key_pairs(w.qpp) + (r / 2) * kP,
                                    q.tokens * kP);
              Tiles::pack_row_pairs(dout.row(r, h), two ? dout.row(r + 1, h) : nullptr, d_v,
                                    key_pairs(w.opp) + (r / 2) * kP, q.tokens * kP);
            }
          } else {
            rows_to_panels<Tiles>(qr, nr, d, w.qpp + r0 * kP, q.tokens * kP);
            rows_to_panels<Tiles>(orow, nr, d_v, w.opp + r0 * kP, q.tokens * kP);
          }
          if (!Tiles::all_finite(qr, nr * d)) q_finite.store(false, std::memory_order_relaxed);
          if (!Tiles::all_finite(orow, nr * d_v)) o_finite.store(false, std::memory_order_relaxed);
        }
      };
      exec.parallel(body);
    }
    const PackedQueryRows<A> packed{w.qp, w.op, w.qpp, w.opp, q.tokens * kP, c, q_finite.load(), o_finite.load()};
    {
      std::atomic<int> next{0};
      auto body = [&](int thread) {
        A* ws = w.thread(thread);
        for (int at = next.fetch_add(1, std::memory_order_relaxed); at < n_lanes;
             at = next.fetch_add(1, std::memory_order_relaxed)) {
          const int lane = lane_order[at];
          for (std::int64_t t = 0; t < n_kt; ++t)
            if (w.tiles[t].slice == lane)
              cpu_flash_backward_tile<Tiles>(blocking, shape, q, k, v, lse, packed, slices, w.tiles[t], h, hh == 0,
                                             w.delta, w.dk_acc, w.dv_acc,
                                             w.dq_lanes + static_cast<std::size_t>(lane) * lane_stride, ws);
        }
      };
      exec.parallel(body);
    }
    {  // dq += scale * (lane 0 + lane 1 + ...), per query tile; then, after a group's last head, dk and dv
      const bool flush = hh == group - 1;
      const std::int64_t total = n_qt + (flush ? n_kt : 0);
      std::atomic<std::int64_t> next{0};
      auto body = [&](int) {
        for (std::int64_t idx = next.fetch_add(1, std::memory_order_relaxed); idx < total;
             idx = next.fetch_add(1, std::memory_order_relaxed)) {
          if (idx < n_qt) {
            const WorkTile& tile = w.qtiles[idx];
            const std::int64_t i0 = slices[static_cast<std::size_t>(tile.slice)].q_range.begin;
            for (std::int64_t i = i0 + tile.row0; i < i0 + tile.row1; ++i) {
              if (i + kAhead < i0 + tile.row1) prefetch_row(dq.row(i + kAhead, h), d, true);
              // the lanes that reach row i, summed in lane order (the first one holds the sum), then zeroed
              A* sum = nullptr;
              for (int lane = 0; lane < n_lanes; ++lane) {
                if (!reach[lane].contains(i)) continue;
                A* row = w.dq_lanes + static_cast<std::size_t>(lane) * lane_stride +
                         static_cast<std::size_t>(i) * static_cast<std::size_t>(d);
                if (sum == nullptr) {
                  sum = row;
                } else {
                  Tiles::add_scaled_store(sum, row, d, A(1));
                  std::fill_n(row, d, A(0));
                }
              }
              if (sum == nullptr) continue;
              Tiles::add_scaled_store(dq.row(i, h), sum, d, sc);
              std::fill_n(sum, d, A(0));
            }
          } else {
            const WorkTile& tile = w.tiles[idx - n_qt];
            for (std::int64_t j = tile.row0; j < tile.row1; ++j) {
              if (j + kAhead < tile.row1) {
                prefetch_row(dk.row(j + kAhead, hk), d, true);
                prefetch_row(dv.row(j + kAhead, hk), d_v, true);
              }
              const auto row = static_cast<std::size_t>(j);
              Tiles::add_scaled_store(dk.row(j, hk), w.dk_acc + row * static_cast<std::size_t>(d), d, dk_scale);
              Tiles::add_scaled_store(dv.row(j, hk), w.dv_acc + row * static_cast<std::size_t>(d_v), d_v, A(1));
            }
          }
        }
      };
      exec.parallel(body);
    }
  }
}

}  // namespace seqpar::attention::detail
