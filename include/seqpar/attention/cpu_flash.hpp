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
/// **Algorithm** (FlashAttention-2, Dao 2023). Forward, one KV head at a time: its K^T and V are packed once
/// into the micro-kernel's B panels for every 128-key tile of the buffer (K^T by 8 x 8 transposes); then per work
/// item (query head of the group, query tile of `q_tile` rows) the Q tile is packed pre-scaled by
/// softmax_scale * log2(e), and for each 128-key tile the rows see and each score block of 48 query rows the
/// scores S = Q K^T come from a broadcast-FMA micro-kernel (6 rows x 64 keys in 24 zmm, 6 x 16 in 12 ymm on
/// AVX2; the 48 rows share each K^T panel from L1; only the 16-key vectors holding a register block's visible
/// keys), an online
/// softmax in base 2 updates the running max / sum (lazily: the output rows are rescaled only when a row's max
/// grows by more than 2^8) and P V accumulates into an fp32 output tile. Tiles and row blocks that the mask
/// hides are skipped; only blocks that a mask edge crosses are masked element-wise.
/// Backward recomputes P = exp2(S - LSE2) with D = rowsum(dO * O), dP = dO V^T, dS = P * (dP - D) once per
/// (query head, key tile, query block) and uses it three times: dV += P^T dO, dK += dS^T Q, dQ += dS K (5 tile
/// GEMMs); a head's c Q and dO rows are packed once for all of its key tiles. It is deterministic with no atomics:
/// query heads run in turn; a head's key tiles are dealt to `max(4, threads)` lanes (contiguous runs of about equal
/// cost), a lane owns its tiles' fp32 dK/dV and its own fp32 dQ buffer (over the query rows its tiles reach), threads
/// take whole lanes, and the lane buffers are summed in lane order, so the bits depend on `Arguments` (and not on the
/// thread count of the executing context up to 4). Masked (query, key) pairs never enter a product: scores and dS are
/// masked by selection, a slice touches only its own keys of a tile, and a tile whose V, K, Q or dO values hold a NaN
/// or infinity is multiplied over each row's exact visible keys, so a non-finite value stays in the rows and keys that
/// read it. Work items run largest-first (by visible area) on the execution context's thread pool (`HostExec`; the
/// kernel's own context has `threads` threads, 1 runs inline on the caller).
///
/// **Instruction sets.** For float and bf16 storage the micro-kernels are chosen at run time, whatever the
/// build's -march (cpu_isa.hpp): AVX-512 (6 x 64 blocks in 24 zmm) where the CPU and OS support it, else AVX2 +
/// FMA (6 x 16 in 12 ymm), else a portable path with the same blocking (also double's path; plain C++, which
/// GCC 12 leaves scalar at -O2 for float: ~30x slower than AVX2, bench/attention_cpu --isa portable).
/// /// `Arguments::isa` or the environment variable SEQPAR_CPU_ISA forces one; `isa()` says which runs. The paths
/// differ in the order of fp32 sums only (the exp2 polynomial is shared), not in what they compute, except
/// avx512bf16 (bf16 storage on CPUs with AVX512-BF16, its default there): all seven tile products by bf16 dot
/// products (vdpbf16ps) with fp32 accumulation; S = Q K^T and dP = dO V^T from the exact bf16 inputs, while P (in
/// O += P V, dV += P^T dO) and dS (in dK, dQ) are rounded to bf16 first, as FlashAttention does on GPUs: a relative
/// error of at most 2^-9 per weight, on the order of the bf16 rounding of the outputs themselves
/// (flash_tiles_avx512bf16.hpp).
///
/// **Memory.** No allocation in forward/backward: the caller passes `workspace_bytes(shape, q_rows,
/// k_rows)` bytes (per thread: two q_tile x head_dim fp32 tiles, ~0.6 MB at q_tile 576, d 128; plus
/// heads_q * q_rows accumulators for D, tile lists of O(q_rows) entries, and the backward's fp32
/// accumulators: lanes x q_rows x head_dim for dQ and 2 x k_rows x head_dim for dK/dV (the forward packs one
/// KV head's K^T and V there), and 2 x q_rows x head_dim for one head's packed Q and dO, e.g. 32 MiB at 8K
/// tokens, d 128, 1-4 threads). With unequal head sizes (head_dim_v != head_dim, MLA) every region is sized
/// for the larger of the two.
///
/// **Head sizes.** Any pair: Q K^T runs over shape.qk_dim(), P V, dP = dO V^T and dV over shape.v_dim() (e.g.
/// 192/128 and 576/512 for MLA); the tiles take the width at run time.
///
/// **Requirements.** Views as `Reference` (head_dim contiguous, any token/head strides); q_ranges of one
/// call disjoint; precision: accumulation in `accum_type` (float for float, double for double); exp2 by a
/// polynomial with ~1e-7 relative error on the AVX2 and AVX-512 paths. Calls on one object are serialised.
///
/// @code
/// attention::CpuFlash<float> flash({.threads = 2});
/// std::vector<std::byte> ws(flash.workspace_bytes(shape, q.tokens, k.tokens));
/// flash.forward(shape, q, k, v, slices, o, lse, ws);                          // o (T, Hq, D), lse (Hq, T)
/// flash.backward(shape, q, k, v, o, lse, dout, slices, dq, dk, dv, ws);       // dq, dk, dv +=
/// @endcode

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <numbers>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>

#include "seqpar/attention/cpu_isa.hpp"
#include "seqpar/attention/detail/bf16.hpp"
#include "seqpar/attention/detail/call_checks.hpp"
#include "seqpar/attention/detail/flash_tiles.hpp"
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
    return layout(shape, q_rows, k_rows).total;
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
    detail::with_tile_policy<A, T>(
        isa_, [&]<class Tiles>() { forward_with<Tiles>(exec, shape, q, k, v, slices, o, lse, workspace); });
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
      backward_with<Tiles>(exec, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
    });
  }

 private:
  using A = accum_type;

  template <class Tiles>
  void forward_with(const HostExec& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
                    ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o, LseView<accum_type> lse,
                    std::span<std::byte> workspace) const {
    constexpr int kP = Tiles::kPanel;

    const Work w = carve(shape, q.tokens, k.tokens, workspace);
    const std::int64_t n_tiles = query_tiles(slices, w.tiles);
    for (int h = 0; h < shape.heads_q; ++h)
      for (std::int64_t t = 0; t < q.tokens; ++t) lse(h, t) = -std::numeric_limits<accum_type>::infinity();
    // O = 0 only on the rows no work item writes (forward_tile writes every row of its tile, zeros for a row that sees
    // no key): zeroing all of O first wrote it twice, serially, heads * tokens * v_dim values per call (16 MiB at 4K,
    // 8 heads, d 128). The work items' rows, sorted by their first row (in the backward's query-tile list, unused
    // here), leave gaps: those rows are zeroed.
    {
      Tile* by_row = w.qtiles;
      for (std::int64_t i = 0; i < n_tiles; ++i) {
        const Tile& tile = w.tiles[i];
        const std::int64_t b = slices[static_cast<std::size_t>(tile.slice)].q_range.begin;
        by_row[i] = {0, b + tile.row0, b + tile.row1, tile.slice};
      }
      std::sort(by_row, by_row + n_tiles, [](const Tile& a, const Tile& b) { return a.row0 < b.row0; });
      std::int64_t at = 0;  // rows before `at` are written by an item or zeroed
      for (std::int64_t i = 0; i <= n_tiles; ++i) {
        const std::int64_t next = i < n_tiles ? by_row[i].row0 : q.tokens;
        for (std::int64_t t = at; t < next; ++t)
          for (int h = 0; h < shape.heads_q; ++h) std::fill_n(o.row(t, h), shape.v_dim(), T(0));
        if (i < n_tiles) at = std::max(at, by_row[i].row1);
      }
    }
    const std::int64_t n_kt = (k.tokens + kKT - 1) / kKT;
    const int group = shape.group_size();
    // One KV head at a time: its K^T and V are packed once into micro-kernel panels for every 128-key tile of
    // the buffer (packing them per query tile re-read the strided K/V rows from memory once per query tile:
    // ~8% of the forward at 4K, d 128), then the query tiles of the group's query heads read them.
    for (int hk = 0; hk < shape.heads_kv; ++hk) {
      {
        std::atomic<std::int64_t> next{0};
        auto body = [&](int) {
          for (std::int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < n_kt;
               t = next.fetch_add(1, std::memory_order_relaxed)) {
            const int nk = static_cast<int>(std::min<std::int64_t>(kKT, k.tokens - t * kKT));
            A* kt = w.k_pack + t * tile_elems<kP>(shape.qk_dim());
            A* vp = w.v_pack + t * tile_elems<kP>(shape.v_dim());
            pack_keys<Tiles>(k, t * kKT, nk, hk, shape.qk_dim(), kt, nullptr);
            pack_panels<Tiles>(v, t * kKT, nk, hk, shape.v_dim(), vp);
            w.v_finite[t] = panels_finite<Tiles>(vp, 0, nk, shape.v_dim()) ? 1 : 0;
            // bf16 products: V as pairs of key rows instead (P V by gemm_pairs)
            if constexpr (detail::kBf16Scores<Tiles>)
              pack_row_pairs<Tiles>(v, t * kKT, nk, hk, shape.v_dim(), key_pairs(vp));
          }
        };
        exec.parallel(body);
      }
      const std::int64_t total = n_tiles * group;
      std::atomic<std::int64_t> next{0};
      auto body = [&](int thread) {
        A* ws = w.thread(thread);
        for (std::int64_t idx = next.fetch_add(1, std::memory_order_relaxed); idx < total;
             idx = next.fetch_add(1, std::memory_order_relaxed)) {
          const Tile& tile = w.tiles[idx / group];
          forward_tile<Tiles>(shape, q, k.tokens, w, slices[static_cast<std::size_t>(tile.slice)], tile,
                              hk * group + static_cast<int>(idx % group), o, lse, ws);
        }
      };
      exec.parallel(body);
    }
  }

  template <class Tiles>
  void backward_with(const HostExec& exec, const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k,
                     ThdView<const T> v, ThdView<const T> o, LseView<const accum_type> lse, ThdView<const T> dout,
                     std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk, ThdView<T> dv,
                     std::span<std::byte> workspace) const {
    constexpr int kP = Tiles::kPanel;
    const Work w = carve(shape, q.tokens, k.tokens, workspace);
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
    // (contiguous runs of key tiles of about equal cost: a function of the slices and `lanes()`, not of the
    // thread count), each lane owns its tiles' dK/dV accumulators and its own dQ buffer, threads take whole lanes,
    // and the lanes' dQ buffers are summed in lane order. dK/dV stay in fp32 across the query heads of a group
    // and are added into dk/dv after its last head.
    const std::int64_t n_kt = key_tiles(slices, k.tokens, w.tiles);
    const std::int64_t n_qt = query_tiles(slices, w.qtiles);
    const int n_lanes = lanes();
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
    const A q_scale = detail::kBf16Scores<Tiles> ? A(1) : c;
    const A dk_scale = detail::kBf16Scores<Tiles> ? sc : A(1) / kLog2e;
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
            if constexpr (detail::kBf16Scores<Tiles>) {
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
      const Packed packed{w.qp, w.op, w.qpp, w.opp, q.tokens * kP, c, q_finite.load(), o_finite.load()};
      {
        std::atomic<int> next{0};
        auto body = [&](int thread) {
          A* ws = w.thread(thread);
          for (int at = next.fetch_add(1, std::memory_order_relaxed); at < n_lanes;
               at = next.fetch_add(1, std::memory_order_relaxed)) {
            const int lane = lane_order[at];
            for (std::int64_t t = 0; t < n_kt; ++t)
              if (w.tiles[t].slice == lane)
                backward_tile<Tiles>(shape, q, k, v, lse, packed, slices, w.tiles[t], h, hh == 0, w.delta, w.dk_acc,
                                     w.dv_acc, w.dq_lanes + static_cast<std::size_t>(lane) * lane_stride, ws);
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
              const Tile& tile = w.qtiles[idx];
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
              const Tile& tile = w.tiles[idx - n_qt];
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

  static constexpr int kKT = detail::kKeyTile;
  static constexpr int kRB = detail::kRowBlock;
  /// The column grain of a register block's score range (col_lo / col_hi): whole 16-float vectors, which every
  /// tile policy computes (detail/flash_tiles.hpp, BlockRanges); AVX-512's 64-key panels are entered at the
  /// vector holding col_lo instead of being computed whole (1.21x the visible scores on the 4K mix, 1.07x now).
  static constexpr int kColumnGrain = 16;
  /// Query rows per score block: S (and dP) are computed for this many rows at once, so that each 16-key
  /// panel of K^T (and V in P V) is read from L1 by its 8 register blocks instead of by one (a block of 6
  /// rows at a time streams all of K^T and V, 128 KiB at d 128, from L2 per 6 rows).
  static constexpr int kSB = 8 * kRB;
  static constexpr A kLog2e = std::numbers::log2e_v<A>;
  static constexpr A kLn2 = std::numbers::ln2_v<A>;

  /// A work unit: rows [row0, row1) of slice `slice` (slice-relative), or key rows [row0, row1) of the
  /// buffer when slice < 0 (backward; there `slice` then holds the lane). Query tiles are sorted by cost, largest
  /// first; key tiles stay in key order.
  struct Tile {
    std::int64_t cost;
    std::int64_t row0;
    std::int64_t row1;
    std::int64_t slice;
  };

  struct Layout {
    std::size_t tiles_off, tiles_count, qtiles_off, delta_off, dq_off, dk_off, dv_off, qp_off, op_off, qpp_off, opp_off,
        flags_off, threads_off, thread_bytes, total;
  };

  struct Work {
    Tile* tiles;   // key tiles (backward) or query tiles (forward)
    Tile* qtiles;  // query tiles (backward)
    A* delta;
    A* dq_lanes;              // lanes() x q_rows x d
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
    [[nodiscard]] A* thread(int t) const noexcept {
      return reinterpret_cast<A*>(threads + static_cast<std::size_t>(t) * thread_bytes);
    }
  };

  static constexpr std::size_t round16(std::int64_t n) noexcept { return static_cast<std::size_t>((n + 15) / 16 * 16); }
  static constexpr std::size_t align64(std::size_t n) noexcept { return (n + 63) / 64 * 64; }

  [[nodiscard]] int q_tile_rows() const noexcept { return (args_.q_tile + kRB - 1) / kRB * kRB; }
  [[nodiscard]] int q_block_rows() const noexcept { return (args_.backward_q_block + kRB - 1) / kRB * kRB; }
  /// Backward lanes: fixed for given Arguments (at least 4 so that 1..4 threads give the same bits).
  [[nodiscard]] int lanes() const noexcept { return std::max(4, args_.threads); }

  [[nodiscard]] Layout layout(const AttentionShape& shape, std::int64_t q_rows, std::int64_t k_rows) const noexcept {
    const std::int64_t d = std::max({shape.qk_dim(), shape.v_dim(), 1});  // every region fits either width
    const std::int64_t br = q_tile_rows();
    const std::int64_t rq = q_block_rows();
    const std::size_t fwd = 2 * round16(br * d) + round16(kSB * kKT) + 2 * round16(br);
    // + per register block of the query block: the key range of its dQ product (two ints each)
    const std::size_t bwd =
        3 * round16(tile_elems(static_cast<int>(d))) + 2 * round16(rq * kKT) + 2 * round16(rq / kRB + 1);
    const auto qn = static_cast<std::size_t>(std::max<std::int64_t>(q_rows, 0));
    const auto kn = static_cast<std::size_t>(std::max<std::int64_t>(k_rows, 0));
    const auto du = static_cast<std::size_t>(d);
    Layout l{};
    l.tiles_count = static_cast<std::size_t>(std::max(q_rows + q_rows / br, k_rows / kKT) + 2);
    l.tiles_off = 0;
    l.qtiles_off = align64(l.tiles_count * sizeof(Tile));
    l.delta_off = l.qtiles_off + align64(l.tiles_count * sizeof(Tile));
    l.dq_off = l.delta_off + align64(static_cast<std::size_t>(std::max(shape.heads_q, 0)) * qn * sizeof(A));
    l.dk_off = l.dq_off + align64(static_cast<std::size_t>(lanes()) * qn * du * sizeof(A));
    // dK / dV accumulators (backward), or the packed K^T / V tiles of one KV head (forward)
    const std::size_t n_kt = (kn + kKT - 1) / kKT;
    const std::size_t kv = std::max(kn * du, n_kt * static_cast<std::size_t>(tile_elems(static_cast<int>(d))));
    l.dv_off = l.dk_off + align64(kv * sizeof(A));
    l.qp_off = l.dv_off + align64(kv * sizeof(A));
    l.op_off = l.qp_off + align64(qn * du * sizeof(A));
    constexpr int kP = detail::kMaxPanel;
    const std::size_t dp = static_cast<std::size_t>((d + kP - 1) / kP * kP);
    l.qpp_off = l.op_off + align64(qn * du * sizeof(A));
    l.opp_off = l.qpp_off + align64(qn * dp * sizeof(A));
    l.flags_off = l.opp_off + align64(qn * dp * sizeof(A));
    l.threads_off = l.flags_off + align64(n_kt);
    l.thread_bytes = align64(std::max(fwd, bwd) * sizeof(A));
    l.total = 64 + l.threads_off + static_cast<std::size_t>(args_.threads) * l.thread_bytes;
    return l;
  }

  [[nodiscard]] Work carve(const AttentionShape& shape, std::int64_t q_rows, std::int64_t k_rows,
                           std::span<std::byte> workspace) const noexcept {
    const Layout l = layout(shape, q_rows, k_rows);
    const auto addr = reinterpret_cast<std::uintptr_t>(workspace.data());
    std::byte* base = workspace.data() + ((64 - addr % 64) % 64);
    return {reinterpret_cast<Tile*>(base + l.tiles_off),
            reinterpret_cast<Tile*>(base + l.qtiles_off),
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

  /// Deals key tiles (in key order) to lanes as contiguous runs of about equal cost: tile t goes to lane
  /// floor(lanes * (cost before t + half its own) / total), stored in the tile's `slice` field. Contiguous runs keep a
  /// lane's query rows together (a short document's rows meet one lane, and only those lanes' dQ rows are summed);
  /// the split is off from equal by at most half a tile's cost per lane.
  /// `order` receives the lanes by decreasing cost: threads take them in that order (largest first), which
  /// pairs a heavy lane with a light one when there are fewer threads than lanes (the bits do not depend on it).
  static void deal_lanes(Tile* tiles, std::int64_t n, int n_lanes, int* order) noexcept {
    double total = 0;
    for (std::int64_t t = 0; t < n; ++t) total += double(tiles[t].cost);
    double before = 0;
    double lane_cost[1024] = {};
    for (std::int64_t t = 0; t < n; ++t) {
      const double mid = before + 0.5 * double(tiles[t].cost);
      tiles[t].slice = std::clamp(static_cast<std::int64_t>(double(n_lanes) * mid / total), std::int64_t{0},
                                  std::int64_t{n_lanes - 1});
      before += double(tiles[t].cost);
      lane_cost[tiles[t].slice] += double(tiles[t].cost);
    }
    std::iota(order, order + n_lanes, 0);
    std::sort(order, order + n_lanes, [&](int a, int b) {  // not stable_sort: it allocates
      return lane_cost[a] != lane_cost[b] ? lane_cost[a] > lane_cost[b] : a < b;
    });
  }

  /// reach[lane] = the hull of the buffer's query rows that lane's key tiles reach (the rows its dQ buffer holds),
  /// for every lane in one pass over the tiles.
  static void lane_reach(std::span<const AttnSlice> slices, const Tile* tiles, std::int64_t n, int n_lanes,
                         Range* reach) noexcept {
    std::fill_n(reach, n_lanes, Range{0, 0});
    for (std::int64_t t = 0; t < n; ++t) {
      Range& r = reach[tiles[t].slice];
      for (const AttnSlice& sl : slices) {
        const Range kr = intersect(sl.k_range, {tiles[t].row0, tiles[t].row1});
        if (kr.empty()) continue;
        const Range rows = rows_seeing(sl, kr.begin - sl.k_range.begin, kr.end - sl.k_range.begin);
        if (rows.empty()) continue;
        const Range abs{sl.q_range.begin + rows.begin, sl.q_range.begin + rows.end};
        r = r.empty() ? abs : Range{std::min(r.begin, abs.begin), std::max(r.end, abs.end)};
      }
    }
  }

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

  static void sort_tiles(Tile* tiles, std::int64_t n) noexcept {
    std::sort(tiles, tiles + n, [](const Tile& a, const Tile& b) {
      if (a.cost != b.cost) return a.cost > b.cost;
      if (a.slice != b.slice) return a.slice < b.slice;
      return a.row0 < b.row0;
    });
  }

  /// Query tiles of every slice with their visible area; returns the count.
  std::int64_t query_tiles(std::span<const AttnSlice> slices, Tile* tiles) const noexcept {
    const std::int64_t br = q_tile_rows();
    std::int64_t n = 0;
    for (std::size_t s = 0; s < slices.size(); ++s) {
      const AttnSlice& sl = slices[s];
      const std::int64_t len = sl.q_range.size(), klen = sl.k_range.size();
      for (std::int64_t r0 = 0; r0 < len; r0 += br) {
        const std::int64_t r1 = std::min(len, r0 + br);
        std::int64_t cost = 0;
        for (std::int64_t r = r0; r < r1; ++r) cost += sl.mask.visible_keys(r, klen).size();
        if (cost > 0) tiles[n++] = {cost, r0, r1, static_cast<std::int64_t>(s)};
      }
    }
    sort_tiles(tiles, n);
    return n;
  }

  /// Slice-relative query rows that see at least one of the slice-relative keys [k0, k1) (k0 < k1).
  static Range rows_seeing(const AttnSlice& sl, std::int64_t k0, std::int64_t k1) noexcept {
    const std::int64_t len = sl.q_range.size();
    const Mask& m = sl.mask;
    if (m.kind == MaskKind::kFull) return {0, len};
    const std::int64_t lo = std::clamp<std::int64_t>(k0 - m.causal_offset, 0, len);
    const std::int64_t hi =
        m.kind == MaskKind::kSlidingWindow
            ? std::clamp<std::int64_t>(seqpar::detail::add_sat(k1 - 1 - m.causal_offset, m.window), lo, len)
            : len;
    return {lo, hi};
  }

  /// Key tiles of the KV buffer with the work of the slices that read them, in key order; returns the count.
  /// A tile's cost is its visible (query, key) pairs, summed per key (the bounding rectangle of the rows that see
  /// the tile counted a causal diagonal's masked half too, and lanes dealt by it ran up to 30% apart).
  static std::int64_t key_tiles(std::span<const AttnSlice> slices, std::int64_t k_rows, Tile* tiles) noexcept {
    std::int64_t n = 0;
    for (std::int64_t t0 = 0; t0 < k_rows; t0 += kKT) {
      const Range tile{t0, std::min(k_rows, t0 + kKT)};
      std::int64_t cost = 0;
      for (const AttnSlice& sl : slices) {
        const Range kr = intersect(sl.k_range, tile);
        for (std::int64_t j = kr.begin - sl.k_range.begin; j < kr.end - sl.k_range.begin; ++j)
          cost += rows_seeing(sl, j, j + 1).size();
      }
      if (cost > 0) tiles[n++] = {cost, tile.begin, tile.end, -1};
    }
    return n;
  }

  /// Elements of a key tile packed as B panels of the micro-kernel: K^T ([kKT / kP][d][kP], key panels) or
  /// natural rows ([ceil(d / kP)][kKT][kP], head-dim panels; columns past d are zero).
  /// P: the policy's panel width; the workspace is laid out for the widest (kMaxPanel), so that it holds a tile
  /// of every policy.
  template <int P = detail::kMaxPanel>
  static constexpr std::int64_t tile_elems(int d) noexcept {
    return std::int64_t{kKT} * ((std::int64_t{d} + P - 1) / P * P);
  }
  /// Distance between two panels of a natural-layout tile (kKT rows of P).
  template <int P>
  static constexpr std::int64_t kRowPanel = std::int64_t{kKT} * P;
  /// Distance (in 32-bit words) between two key panels of a bf16-pair K^T of head dim d (pack_keys): it fits in the
  /// tile_elems floats of the fp32 layout, so the workspace does not depend on the instruction set.
  template <int P>
  static constexpr std::int64_t pair_panel(int d) noexcept {
    return (std::int64_t{d} + 1) / 2 * P;
  }
  /// A packed K^T (or V^T) tile's memory as the bf16 pairs of the bf16 score products.
  static std::uint32_t* key_pairs(A* p) noexcept { return reinterpret_cast<std::uint32_t*>(p); }
  static const std::uint32_t* key_pairs(const A* p) noexcept { return reinterpret_cast<const std::uint32_t*>(p); }

  /// K^T of keys [j0, j0 + nk) of KV head hk into kt as key panels (column c of K^T, i.e. key c, at
  /// kt[(c / kP) * d * kP + x * kP + c % kP]; keys past nk are zero), optionally also the natural rows into
  /// nat as head-dim panels (pack_panels).
  /// With bf16 score products (detail::kBf16Scores) K^T is packed as bf16 pairs instead: word (x / 2, c) holding
  /// K[c][x], K[c][x + 1] at key_pairs(kt)[(c / kP) * pair_panel(d) + (x / 2) * kP + c % kP].
  template <class Tiles>
  static void pack_keys(ThdView<const T> src, std::int64_t j0, int nk, int hk, int d, A* kt, A* nat) noexcept {
    constexpr int kP = Tiles::kPanel;
    if constexpr (detail::kBf16Scores<Tiles>) {
      static_assert(std::is_same_v<T, bf16>, "the bf16 score products read bf16 storage");
      std::uint32_t* words = key_pairs(kt);
      for (int c = 0; c < kKT; ++c) {
        if (c + kAhead < nk) prefetch_row(src.row(j0 + c + kAhead, hk), d);
        Tiles::pack_key_pairs(c < nk ? src.row(j0 + c, hk) : nullptr, d, words + (c / kP) * pair_panel<kP>(d) + c % kP,
                              kP);
      }
      if (nat != nullptr) pack_panels<Tiles>(src, j0, nk, hk, d, nat);
      return;
    }
    const std::int64_t kt_panel = std::int64_t{d} * kP;
    int c = 0;
    for (; c + 8 <= nk; c += 8) {  // eight keys at a time (8 x 8 block transposes where vectorised)
      const T* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = src.row(j0 + c + r, hk);
      for (int r = c + 8; r < std::min(nk, c + 16); ++r) prefetch_row(src.row(j0 + r, hk), d);
      Tiles::transpose_rows8(rows, d, kt + (c / kP) * kt_panel + c % kP, kP);
    }
    for (; c < kKT; ++c) {
      A* col = kt + (c / kP) * kt_panel + c % kP;
      if (c < nk) {
        const T* row = src.row(j0 + c, hk);
        for (int x = 0; x < d; ++x) col[x * kP] = A(row[x]);
      } else {
        for (int x = 0; x < d; ++x) col[x * kP] = A(0);
      }
    }
    if (nat != nullptr) pack_panels<Tiles>(src, j0, nk, hk, d, nat);
  }

  /// Rows [j0, j0 + nk) of head hk as head-dim panels: element x of row c at
  /// dst[(x / kP) * kRowPanel<kP> + c * kP + x % kP], zero for x >= d (rows past nk are not written).
  template <class Tiles>
  static void pack_panels(ThdView<const T> src, std::int64_t j0, int nk, int hk, int d, A* dst) noexcept {
    constexpr int kP = Tiles::kPanel;
    const int full = d / kP * kP;
    for (int c = 0; c < nk; ++c) {
      if (c + kAhead < nk) prefetch_row(src.row(j0 + c + kAhead, hk), d);
      const T* row = src.row(j0 + c, hk);
      A* out = dst + c * kP;
      for (int x = 0; x < full; x += kP) Tiles::load_scaled(row + x, out + (x / kP) * kRowPanel<kP>, kP, A(1));
      if (full < d) {
        A* tail = out + (full / kP) * kRowPanel<kP>;
        Tiles::load_scaled(row + full, tail, d - full, A(1));
        std::fill(tail + (d - full), tail + kP, A(0));
      }
    }
  }

  /// Rows [j0, j0 + nk) of head hk as pairs of rows in head-dim panels (bf16 products): word (c / 2, x) holding
  /// rows c, c + 1 (even c) at words[(x / kP) * kRowPanel<kP> / 2 + (c / 2) * kP + x % kP], zero past nk up to
  /// the tile's kKT rows and past d up to whole panels. Fits in the fp32 layout's half.
  template <class Tiles>
  static void pack_row_pairs(ThdView<const T> src, std::int64_t j0, int nk, int hk, int d,
                             std::uint32_t* words) noexcept {
    constexpr int kP = Tiles::kPanel;
    for (int c = 0; c < kKT; c += 2)
      Tiles::pack_row_pairs(c < nk ? src.row(j0 + c, hk) : nullptr, c + 1 < nk ? src.row(j0 + c + 1, hk) : nullptr, d,
                            words + (c / 2) * kP, kRowPanel<kP> / 2);
  }

  /// Whether rows [c0, c1) of a head-dim-panel tile are all finite (the zero padding is).
  template <class Tiles>
  static bool panels_finite(const A* p, int c0, int c1, int d) noexcept {
    constexpr int kP = Tiles::kPanel;
    bool ok = true;
    for (int x = 0; x < d; x += kP)
      ok &= Tiles::all_finite(p + (x / kP) * kRowPanel<kP> + c0 * kP, std::int64_t{c1 - c0} * kP);
    return ok;
  }

  /// n packed rows of d values into head-dim panels: value x of row r at dst[(x / kP) * panel + r * kP + x % kP],
  /// zero for x >= d. As a GEMM's B operand a panel is contiguous (row-major rows at a 512-byte stride, d 128,
  /// fall on a few L1 sets: 62 vs 74 GFLOP/s for the dV product's shape).
  template <class Tiles>
  static void rows_to_panels(const A* rows, std::int64_t n, int d, A* dst, std::int64_t panel) noexcept {
    constexpr int kP = Tiles::kPanel;
    for (std::int64_t r = 0; r < n; ++r) {
      const A* row = rows + r * d;
      for (int x = 0; x < d; x += kP) {
        const int w = std::min(kP, d - x);
        A* out = dst + (x / kP) * panel + r * kP;
        std::copy_n(row + x, w, out);
        std::fill(out + w, out + kP, A(0));
      }
    }
  }

  template <class Tiles>
  static void pack_rows(ThdView<const T> src, std::int64_t i0, std::int64_t n, int h, int d, A scale, A* dst) noexcept {
    for (std::int64_t r = 0; r < n; ++r) {
      if (r + kAhead < n) prefetch_row(src.row(i0 + r + kAhead, h), d);
      Tiles::load_scaled(src.row(i0 + r, h), dst + r * d, d, scale);
    }
  }

  /// Rows ahead that the loops over one head's rows of a (tokens, heads, d) view prefetch.
  static constexpr int kAhead = 8;
  /// Prefetches the n values at p (one head's row of a view) into the caches, for reading or (write) for writing.
  /// Consecutive rows of one head are heads * d values apart (4 KiB at 8 heads, d 128, fp32): each is on another
  /// page, where the hardware prefetchers (which stay within a page) do not follow. Issue 41's profile of the 4K
  /// document mix (perf, 1 thread, fp32): packing one KV head's K^T and V took 10% of the forward; packing Q and dO,
  /// D = rowsum(dO O) and the dQ / dK / dV stores 16% of the backward. These cost the same per token at any document
  /// length, while a short document has few FLOPs per token (the mix: 304 visible keys per row against 2048 for one
  /// causal 4K sequence). Prefetching 8 rows ahead gained 4-6% on that mix (1 thread, interleaved runs).
  template <class U>
  static void prefetch_row(const U* p, int n, bool write = false) noexcept {
#if defined(__GNUC__) || defined(__clang__)
    const char* b = reinterpret_cast<const char*>(p);
    const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(U);
    for (std::size_t off = 0; off < bytes; off += 64) {
      if (write)
        __builtin_prefetch(b + off, 1);
      else
        __builtin_prefetch(b + off, 0);
    }
#else
    (void)p;
    (void)n;
    (void)write;
#endif
  }

  /// Visible tile columns [lo, hi) of rows first.. (slice-relative) for the slice-relative key tile
  /// [kt0, kt0 + nk) restricted to slice-relative keys [kmin, kmax). Returns false if all are empty.
  static bool tile_columns(const AttnSlice& sl, std::int64_t first, int rows, std::int64_t kt0, int nk,
                           std::int64_t kmin, std::int64_t kmax, int* lo, int* hi) noexcept {
    const std::int64_t klen = sl.k_range.size();
    // Masks are monotone in the row (both ends of the visible range never decrease), so when the first row
    // sees to the tile's end and the last row from its start, every row sees the whole tile: most blocks
    // of a long causal slice, decided in two mask evaluations instead of one per row.
    const std::int64_t t0 = std::max(kt0, kmin), t1 = std::min(kt0 + nk, kmax);
    if (t0 < t1 && sl.mask.visible_keys(first, klen).end >= t1 &&
        sl.mask.visible_keys(first + rows - 1, klen).begin <= t0) {
      std::fill_n(lo, rows, static_cast<int>(t0 - kt0));
      std::fill_n(hi, rows, static_cast<int>(t1 - kt0));
      return true;
    }
    bool any = false;
    for (int r = 0; r < rows; ++r) {
      const Range vis = intersect(sl.mask.visible_keys(first + r, klen), {kmin, kmax});
      lo[r] = static_cast<int>(std::clamp<std::int64_t>(vis.begin - kt0, 0, nk));
      hi[r] = static_cast<int>(std::clamp<std::int64_t>(vis.end - kt0, 0, nk));
      any |= lo[r] < hi[r];
    }
    return any;
  }

  /// Keys (slice-relative) visible to any of the rows [r0, r1): masks are monotone in the row.
  static Range key_span(const AttnSlice& sl, std::int64_t r0, std::int64_t r1) noexcept {
    const std::int64_t klen = sl.k_range.size();
    return {sl.mask.visible_keys(r0, klen).begin, sl.mask.visible_keys(r1 - 1, klen).end};
  }

  /// Query rows `tile` of slice `sl` for query head h, against the KV head's packed tiles in w (k_pack, v_pack,
  /// v_finite): the buffer's 128-key tiles that the rows see, each restricted to the slice's visible keys.
  template <class Tiles>
  void forward_tile(const AttentionShape& shape, ThdView<const T> q, std::int64_t k_rows, const Work& w,
                    const AttnSlice& sl, const Tile& tile, int h, ThdView<T> o, LseView<A> lse, A* ws) const noexcept {
    constexpr int kP = Tiles::kPanel;
    const int d = shape.qk_dim(), dv = shape.v_dim();  // Q K^T over d, P V over dv
    const int n = static_cast<int>(tile.row1 - tile.row0);
    const std::int64_t br = q_tile_rows();
    const std::int64_t dm = std::max(d, dv);  // the layout's width
    A* qs = ws;
    A* acc = qs + round16(br * dm);
    A* s = acc + round16(br * dm);
    A* m = s + round16(kSB * kKT);
    A* l = m + round16(br);
    const std::int64_t i0 = sl.q_range.begin + tile.row0;
    const A c = A(shape.scale()) * kLog2e;                                        // log2-domain scores: S = c Q K^T
    pack_rows<Tiles>(q, i0, n, h, d, detail::kBf16Scores<Tiles> ? A(1) : c, qs);  // c in the product (backward_with)
    std::fill_n(acc, static_cast<std::size_t>(n) * static_cast<std::size_t>(dv), A(0));
    std::fill_n(m, n, -std::numeric_limits<A>::infinity());
    std::fill_n(l, n, A(0));

    const Range keys = key_span(sl, tile.row0, tile.row1);  // slice-relative
    const std::int64_t ks = sl.k_range.begin;
    int lo[kSB], hi[kSB];
    for (std::int64_t t = (ks + keys.begin) / kKT; t * kKT < ks + keys.end; ++t) {
      const std::int64_t kt0 = t * kKT - ks;  // slice-relative key of tile column 0 (may be negative)
      const int nk = static_cast<int>(std::min<std::int64_t>(kKT, k_rows - t * kKT));
      const A* kt = w.k_pack + t * tile_elems<kP>(d);
      const A* vp = w.v_pack + t * tile_elems<kP>(dv);
      const bool v_finite = w.v_finite[t] != 0;
      for (int g0 = 0; g0 < n; g0 += kSB) {
        int rows = std::min(kSB, n - g0);
        if (!tile_columns(sl, tile.row0 + g0, rows, kt0, nk, keys.begin, keys.end, lo, hi)) continue;
        // Masks are monotone in the row: the rows that see a key of this tile are one run [ra, rb).
        int ra = 0;
        while (lo[ra] >= hi[ra]) ++ra;
        while (lo[rows - 1] >= hi[rows - 1]) --rows;
        const int nr = rows - ra;
        // Per register block of 6 rows, only the keys its rows see: S over the 16-key panels that hold them
        // (the other columns of s stay stale and are masked by selection in softmax_row), P V over exactly them.
        // Every row in [ra, rows) sees the tile and the visible ranges move right with the row, so a block's
        // keys run from its first row's lo to its last row's hi.
        int col_lo[kSB / kRB], col_hi[kSB / kRB], k_lo[kSB / kRB], k_hi[kSB / kRB];
        for (int i = 0, rb = 0; i < nr; i += kRB, ++rb) {
          k_lo[rb] = lo[ra + i];
          k_hi[rb] = hi[std::min(rows, ra + i + kRB) - 1];
          col_lo[rb] = k_lo[rb] / kColumnGrain * kColumnGrain;
          col_hi[rb] = std::min(kKT, (k_hi[rb] + kColumnGrain - 1) / kColumnGrain * kColumnGrain);
        }
        if constexpr (detail::kBf16Scores<Tiles>)
          Tiles::gemm_pairs(nr, kKT, d, qs + (g0 + ra) * d, d, 1, key_pairs(kt), pair_panel<kP>(d), s + ra * kKT, kKT,
                            false, c, {col_lo, col_hi, nullptr, nullptr});
        else
          Tiles::gemm(nr, kKT, d, qs + (g0 + ra) * d, d, 1, kt, kP, std::int64_t{d} * kP, s + ra * kKT, kKT, false,
                      {col_lo, col_hi, nullptr, nullptr});
        for (int r = ra; r < rows; ++r) {
          A* sr = s + r * kKT;
          if (lo[r] >= hi[r]) {
            std::fill_n(sr, kKT, A(0));
            continue;
          }
          const A alpha = Tiles::softmax_row(sr, lo[r], hi[r], m[g0 + r], l[g0 + r]);
          if (alpha != A(1)) Tiles::scale_row(acc + (g0 + r) * dv, dv, alpha);
        }
        if (v_finite) {
          // bf16 products: P rounded to bf16 (flash_tiles_avx512bf16.hpp); a block's key range widened to whole pairs
          // meets P = 0 (selected) and finite V, or the pack's zero rows past the tile's end
          if constexpr (detail::kBf16Scores<Tiles>)
            Tiles::gemm_pairs(nr, dv, kKT, s + ra * kKT, kKT, 1, key_pairs(vp), kRowPanel<kP> / 2, acc + (g0 + ra) * dv,
                              dv, true, A(1), {nullptr, nullptr, k_lo, k_hi});
          else
            Tiles::gemm(nr, dv, kKT, s + ra * kKT, kKT, 1, vp, kP, kRowPanel<kP>, acc + (g0 + ra) * dv, dv, true,
                        {nullptr, nullptr, k_lo, k_hi});
        } else {  // exact per-row key ranges: a masked P is 0, but 0 * (NaN or inf in V) is not
          for (int r = ra; r < rows; ++r) {
            if (lo[r] >= hi[r]) continue;
            if constexpr (detail::kBf16Scores<Tiles>)  // the same sums as the block form's, bit for bit
              Tiles::gemm_pairs(1, dv, kKT, s + r * kKT, kKT, 1, key_pairs(vp), kRowPanel<kP> / 2, acc + (g0 + r) * dv,
                                dv, true, A(1), {nullptr, nullptr, &lo[r], &hi[r]}, true);
            else
              Tiles::gemm(1, dv, hi[r] - lo[r], s + r * kKT + lo[r], kKT, 1, vp + lo[r] * kP, kP, kRowPanel<kP>,
                          acc + (g0 + r) * dv, dv, true);
          }
        }
      }
    }
    for (int r = 0; r < n; ++r) {
      if (r + kAhead < n) prefetch_row(o.row(i0 + r + kAhead, h), dv, true);
      if (l[r] == A(0)) {  // fully masked row: O = 0, LSE = -inf from the prefill
        std::fill_n(o.row(i0 + r, h), dv, T(0));
        continue;
      }
      Tiles::store_scaled(o.row(i0 + r, h), acc + r * dv, dv, A(1) / l[r]);
      lse(h, i0 + r) = (m[r] + std::log2(l[r])) * kLn2;
    }
  }

  /// acc[c] += sum over the block rows r that see key c of w[r][c] * x[r] (for tile columns c in [c0, c1)):
  /// the exact form of acc += W^T X, used when X holds a NaN or infinity, since a masked weight is 0 and
  /// 0 * NaN is NaN. `koff` is the slice-relative key of tile column 0, `b0` the block's first slice row.
  template <class Tiles>
  static void exact_key_update(const AttnSlice& sl, std::int64_t koff, std::int64_t b0, int nb, int c0, int c1,
                               const A* w, const A* x, int d, A* acc) noexcept {
    for (int c = c0; c < c1; ++c) {
      const Range rows = intersect(rows_seeing(sl, koff + c, koff + c + 1), {b0, b0 + nb});
      if (rows.empty()) continue;
      const int r0 = static_cast<int>(rows.begin - b0);
      Tiles::gemm(1, d, static_cast<int>(rows.size()), w + r0 * kKT + c, 1, kKT, x + r0 * d, d, Tiles::kPanel,
                  acc + c * d, d,
                  true);  // row-major B: panel = kPanel
    }
  }

  ///   /// exact_key_update for the bf16 products: x is the block's rows as pairs (gemm_pairs' B, its first pair row
  ///   holding
  /// the block's row -sh), the sums per key bit for bit those of the block form.
  template <class Tiles>
  static void exact_key_pairs(const AttnSlice& sl, std::int64_t koff, std::int64_t b0, int nb, int c0, int c1,
                              const A* w, const std::uint32_t* x, std::int64_t panel, int sh, int d, A* acc) noexcept {
    for (int c = c0; c < c1; ++c) {
      const Range rows = intersect(rows_seeing(sl, koff + c, koff + c + 1), {b0, b0 + nb});
      if (rows.empty()) continue;
      const int r0 = static_cast<int>(rows.begin - b0) + sh, r1 = static_cast<int>(rows.end - b0) + sh;
      Tiles::gemm_pairs(1, d, nb + sh, w + c, 1, kKT, x, panel, acc + c * d, d, true, A(1),
                        {nullptr, nullptr, &r0, &r1}, true, sh);
    }
  }

  /// The current head's packed query-side rows (all q rows, indexed by buffer row) and their finiteness.
  struct Packed {
    const A* q;          // c Q
    const A* o;          // dO
    const A* qp;         // c Q as head-dim panels (the B operand of dK += dS^T (c Q)); Q as row pairs (bf16 products)
    const A* op;         // dO as head-dim panels (the B operand of dV += P^T dO); as row pairs (bf16 products)
    std::int64_t panel;  // distance between the panels of qp / op
    A s_scale;           // S = s_scale * (q K^T): c where q holds Q (bf16 score products), else unused
    bool q_finite, o_finite;
  };

  /// All of key tile `tile` of KV head h / group for query head h: S and dP per block of query rows, then
  /// dV += P^T dO, dK += dS^T (c Q) into the tile's fp32 accumulators (zeroed when `first`) and
  /// dQ += dS K into the lane's dQ buffer (unscaled). Each slice touches only its own keys of the tile.
  template <class Tiles>
  void backward_tile(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                     LseView<const A> lse, const Packed& packed, std::span<const AttnSlice> slices, const Tile& tile,
                     int h, bool first, const A* delta, A* dk_acc, A* dv_acc, A* dq_lane, A* ws) const noexcept {
    constexpr int kP = Tiles::kPanel;
    const int d = shape.qk_dim(), d_v = shape.v_dim();  // S, dK, dQ over d; dP, dV over d_v
    const int hk = h / shape.group_size();
    const std::int64_t rq = q_block_rows();
    const int nk = static_cast<int>(tile.row1 - tile.row0);
    const std::size_t te = round16(tile_elems(std::max(d, d_v)));  // the layout's tile
    A* kt = ws;
    A* vt = kt + te;
    A* kn = vt + te;
    A* pb = kn + te;
    A* sb = pb + round16(rq * kKT);
    // Per register block of the query block: the keys (relative to the slice's first tile column c0) its dQ
    // product sums over.
    int* dq_lo = reinterpret_cast<int*>(sb + round16(rq * kKT));
    int* dq_hi = dq_lo + (rq / kRB + 1);
    A* dka = dk_acc + tile.row0 * d;
    A* dva = dv_acc + tile.row0 * d_v;
    pack_keys<Tiles>(k, tile.row0, nk, hk, d, kt, kn);
    // bf16 products: K's rows also as pairs (the B operand of dQ += dS K), after the pair K^T in kt's memory (both
    // fit: tile_elems(d) >= kKT ceil(d / 2) + (kKT / 2) ceil(d / kP) kP); kn keeps the fp32 rows for the finiteness
    // test
    std::uint32_t* k_pairs = key_pairs(kt) + std::int64_t{kKT} * ((d + 1) / 2);
    if constexpr (detail::kBf16Scores<Tiles>) pack_row_pairs<Tiles>(k, tile.row0, nk, hk, d, k_pairs);
    pack_keys<Tiles>(v, tile.row0, nk, hk, d_v, vt, nullptr);
    if (first) {
      std::fill_n(dka, static_cast<std::size_t>(nk) * static_cast<std::size_t>(d), A(0));
      std::fill_n(dva, static_cast<std::size_t>(nk) * static_cast<std::size_t>(d_v), A(0));
    }
    int lo[kSB], hi[kSB];
    int col_lo[kSB / kRB], col_hi[kSB / kRB];
    int kv_lo[kKT / kRB + 1], kv_hi[kKT / kRB + 1];
    for (const AttnSlice& sl : slices) {
      const Range kr = intersect(sl.k_range, {tile.row0, tile.row1});
      if (kr.empty()) continue;
      const std::int64_t ks = sl.k_range.begin;
      const std::int64_t koff = tile.row0 - ks;  // slice-relative key of tile column 0
      const Range rows_all = rows_seeing(sl, kr.begin - ks, kr.end - ks);
      // Only this slice's keys of the tile [c0, c1): the other documents' keys must not meet its rows.
      const int c0 = static_cast<int>(kr.begin - tile.row0), c1 = static_cast<int>(kr.end - tile.row0);
      const bool k_finite = panels_finite<Tiles>(kn, c0, c1, d);
      // dQ's key ranges count from c0, or from tile column 0 for the bf16 pairs (whose pairs start at even columns)
      const int dq_base = detail::kBf16Scores<Tiles> ? 0 : c0;
      for (std::int64_t b0 = rows_all.begin; b0 < rows_all.end; b0 += rq) {
        const int nb = static_cast<int>(std::min<std::int64_t>(rq, rows_all.end - b0));
        const std::int64_t i0 = sl.q_range.begin + b0;
        const A* qb = packed.q + i0 * d;
        const A* ob = packed.o + i0 * d_v;
        for (int g0 = 0; g0 < nb; g0 += kSB) {
          const int rows = std::min(kSB, nb - g0);
          A* p = pb + g0 * kKT;
          A* ds = sb + g0 * kKT;
          const bool any = tile_columns(sl, b0 + g0, rows, koff, nk, kr.begin - ks, kr.end - ks, lo, hi);
          // Per register block of 6 rows: the tile columns its rows see (S and dP over the 16-key panels that
          // hold them; dQ over exactly them). A block's rows may include rows that see none of the tile.
          for (int i = 0, rb = 0; i < rows; i += kRB, ++rb) {
            int kl = kKT, kh = 0;
            for (int r = i; r < std::min(rows, i + kRB); ++r)
              if (lo[r] < hi[r]) {
                kl = std::min(kl, lo[r]);
                kh = std::max(kh, hi[r]);
              }
            if (!any || kl >= kh) kl = kh = c0;
            col_lo[rb] = kl / kColumnGrain * kColumnGrain;
            col_hi[rb] = kl == kh ? col_lo[rb] : std::min(kKT, (kh + kColumnGrain - 1) / kColumnGrain * kColumnGrain);
            dq_lo[g0 / kRB + rb] = kl - dq_base;
            dq_hi[g0 / kRB + rb] = kh - dq_base;
          }
          if (!any) {
            std::fill_n(p, rows * kKT, A(0));
            std::fill_n(ds, rows * kKT, A(0));
            continue;
          }
          const detail::BlockRanges cols{col_lo, col_hi, nullptr, nullptr};
          if constexpr (detail::kBf16Scores<Tiles>) {
            Tiles::gemm_pairs(rows, kKT, d, qb + g0 * d, d, 1, key_pairs(kt), pair_panel<kP>(d), p, kKT, false,
                              packed.s_scale, cols);
            Tiles::gemm_pairs(rows, kKT, d_v, ob + g0 * d_v, d_v, 1, key_pairs(vt), pair_panel<kP>(d_v), ds, kKT, false,
                              A(1), cols);
          } else {
            Tiles::gemm(rows, kKT, d, qb + g0 * d, d, 1, kt, kP, std::int64_t{d} * kP, p, kKT, false, cols);
            Tiles::gemm(rows, kKT, d_v, ob + g0 * d_v, d_v, 1, vt, kP, std::int64_t{d_v} * kP, ds, kKT, false, cols);
          }
          for (int r = 0; r < rows; ++r) {
            const std::int64_t i = i0 + g0 + r;
            if (lo[r] >= hi[r]) {
              std::fill_n(p + r * kKT, kKT, A(0));
              std::fill_n(ds + r * kKT, kKT, A(0));
              continue;
            }
            Tiles::backward_row(p + r * kKT, ds + r * kKT, lo[r], hi[r], lse(h, i) * kLog2e, delta[h * q.tokens + i]);
          }
        }
        // Per register block of 6 keys (from c0): the block's query rows that see any of its keys. P and dS are
        // zero elsewhere, so dV and dK sum over those rows only.
        for (int j = c0, kb = 0; j < c1; j += kRB, ++kb) {
          const Range seen = intersect(rows_seeing(sl, koff + j, koff + std::min(c1, j + kRB)), {b0, b0 + nb});
          kv_lo[kb] = seen.empty() ? 0 : static_cast<int>(seen.begin - b0);
          kv_hi[kb] = seen.empty() ? 0 : static_cast<int>(seen.end - b0);
        }
        const detail::BlockRanges key_rows{nullptr, nullptr, kv_lo, kv_hi};
        if constexpr (detail::kBf16Scores<Tiles>) {
          // bf16 products, P and dS rounded to bf16: the pairs are the buffer's row pairs, so an odd first row i0 is
          // the second of its pair (a_shift 1: A's row before it reads as 0) and the ranges move by one; exact ends,
          // since the row beside an odd end belongs to another block, not checked finite
          const int sh = static_cast<int>(i0 % 2);
          int kv_lo_s[kKT / kRB + 1], kv_hi_s[kKT / kRB + 1];
          for (int j = c0, kb = 0; j < c1; j += kRB, ++kb) {
            kv_lo_s[kb] = kv_lo[kb] + sh;
            kv_hi_s[kb] = kv_hi[kb] + sh;
          }
          const detail::BlockRanges pair_rows{nullptr, nullptr, kv_lo_s, kv_hi_s};
          const std::uint32_t* op = key_pairs(packed.op) + (i0 - sh) / 2 * kP;
          const std::uint32_t* qp = key_pairs(packed.qp) + (i0 - sh) / 2 * kP;
          if (packed.o_finite || Tiles::all_finite(ob, std::int64_t{nb} * d_v))  // dV += P^T dO
            Tiles::gemm_pairs(c1 - c0, d_v, nb + sh, pb + c0, 1, kKT, op, packed.panel, dva + c0 * d_v, d_v, true, A(1),
                              pair_rows, true, sh);
          else
            exact_key_pairs<Tiles>(sl, koff, b0, nb, c0, c1, pb, op, packed.panel, sh, d_v, dva);
          if (packed.q_finite || Tiles::all_finite(qb, std::int64_t{nb} * d))  // dK += dS^T Q
            Tiles::gemm_pairs(c1 - c0, d, nb + sh, sb + c0, 1, kKT, qp, packed.panel, dka + c0 * d, d, true, A(1),
                              pair_rows, true, sh);
          else
            exact_key_pairs<Tiles>(sl, koff, b0, nb, c0, c1, sb, qp, packed.panel, sh, d, dka);
        } else {
          if (packed.o_finite || Tiles::all_finite(ob, std::int64_t{nb} * d_v))  // dV += P^T dO
            Tiles::gemm(c1 - c0, d_v, nb, pb + c0, 1, kKT, packed.op + i0 * kP, kP, packed.panel, dva + c0 * d_v, d_v,
                        true, key_rows);
          else
            exact_key_update<Tiles>(sl, koff, b0, nb, c0, c1, pb, ob, d_v, dva);
          if (packed.q_finite || Tiles::all_finite(qb, std::int64_t{nb} * d))  // dK += dS^T (c Q)
            Tiles::gemm(c1 - c0, d, nb, sb + c0, 1, kKT, packed.qp + i0 * kP, kP, packed.panel, dka + c0 * d, d, true,
                        key_rows);
          else
            exact_key_update<Tiles>(sl, koff, b0, nb, c0, c1, sb, qb, d, dka);
        }
        if (k_finite) {  // dQ += dS K
          // bf16 products: dS rounded to bf16 (flash_tiles_avx512bf16.hpp); exact ends, since the key beside a block's
          // odd end may be another document's, not checked finite
          if constexpr (detail::kBf16Scores<Tiles>)
            Tiles::gemm_pairs(nb, d, kKT, sb, kKT, 1, k_pairs, kRowPanel<kP> / 2, dq_lane + i0 * d, d, true, A(1),
                              {nullptr, nullptr, dq_lo, dq_hi}, true);
          else
            Tiles::gemm(nb, d, c1 - c0, sb + c0, kKT, 1, kn + c0 * kP, kP, kRowPanel<kP>, dq_lane + i0 * d, d, true,
                        {nullptr, nullptr, dq_lo, dq_hi});
        } else {  // exact per-row key ranges: a masked dS is 0, but 0 * (NaN or inf in K) is not
          const std::int64_t klen = sl.k_range.size();
          for (int r = 0; r < nb; ++r) {
            const Range vis = intersect(sl.mask.visible_keys(b0 + r, klen), {koff + c0, koff + c1});
            if (vis.empty()) continue;
            const int j0 = static_cast<int>(vis.begin - koff);
            if constexpr (detail::kBf16Scores<Tiles>) {  // the same sums as the block form's, bit for bit
              const int j1 = j0 + static_cast<int>(vis.size());
              Tiles::gemm_pairs(1, d, kKT, sb + r * kKT, kKT, 1, k_pairs, kRowPanel<kP> / 2, dq_lane + (i0 + r) * d, d,
                                true, A(1), {nullptr, nullptr, &j0, &j1}, true);
            } else {
              Tiles::gemm(1, d, static_cast<int>(vis.size()), sb + r * kKT + j0, kKT, 1, kn + j0 * kP, kP,
                          kRowPanel<kP>, dq_lane + (i0 + r) * d, d, true);
            }
          }
        }
      }
    }
  }

  Arguments args_;
  CpuIsa isa_ = CpuIsa::kPortable;
  HostExec exec_;
};

static_assert(AttentionKernel<CpuFlash<float>>);
static_assert(AttentionKernel<CpuFlash<double>>);
static_assert(AttentionKernel<CpuFlash<bf16>>);

}  // namespace seqpar::attention
