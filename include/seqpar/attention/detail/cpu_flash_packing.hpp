// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// How CpuFlash packs strided (tokens, heads, d) rows into the layouts its micro-kernels read
/// (detail/flash_tiles*.hpp): a key tile's K^T as key panels (by 8 x 8 transposes), natural rows as head-dim panels,
/// and, for the bf16 score products (detail::kBf16Scores), pairs of bf16 values in 32-bit words; with the panel sizes
/// and the row prefetch the packers share. A B operand's panel is contiguous, so the micro-kernel streams it instead of
/// reading one cache line per row at a row stride that maps to a few L1 sets.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "seqpar/attention/detail/bf16.hpp"
#include "seqpar/attention/detail/flash_tiles.hpp"
#include "seqpar/attention/detail/flash_tiles_avx512bf16.hpp"
#include "seqpar/core/tensor.hpp"

namespace seqpar::attention::detail {

/// Rows ahead that the loops over one head's rows of a (tokens, heads, d) view prefetch.
inline constexpr int kAhead = 8;
/// Prefetches the n values at p (one head's row of a view) into the caches, for reading or (write) for writing.
/// Consecutive rows of one head are heads * d values apart (4 KiB at 8 heads, d 128, fp32): each is on another
/// page, where the hardware prefetchers (which stay within a page) do not follow. Issue 41's profile of the 4K
/// document mix (perf, 1 thread, fp32): packing one KV head's K^T and V took 10% of the forward; packing Q and dO,
/// D = rowsum(dO O) and the dQ / dK / dV stores 16% of the backward. These cost the same per token at any document
/// length, while a short document has few FLOPs per token (the mix: 304 visible keys per row against 2048 for one
/// causal 4K sequence). Prefetching 8 rows ahead gained 4-6% on that mix (1 thread, interleaved runs).
template <class U>
inline void prefetch_row(const U* p, int n, bool write = false) noexcept {
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

/// Elements of a key tile packed as B panels of the micro-kernel: K^T ([kKeyTile / kP][d][kP], key panels) or
/// natural rows ([ceil(d / kP)][kKeyTile][kP], head-dim panels; columns past d are zero).
/// P: the policy's panel width; the workspace is laid out for the widest (kMaxPanel), so that it holds a tile
/// of every policy.
template <int P = kMaxPanel>
inline constexpr std::int64_t tile_elems(int d) noexcept {
  return std::int64_t{kKeyTile} * ((std::int64_t{d} + P - 1) / P * P);
}
/// Distance between two panels of a natural-layout tile (kKeyTile rows of P).
template <int P>
inline constexpr std::int64_t kRowPanel = std::int64_t{kKeyTile} * P;
/// Distance (in 32-bit words) between two key panels of a bf16-pair K^T of head dim d (pack_keys): it fits in the
/// tile_elems floats of the fp32 layout, so the workspace does not depend on the instruction set.
template <int P>
inline constexpr std::int64_t pair_panel(int d) noexcept {
  return (std::int64_t{d} + 1) / 2 * P;
}
/// A packed K^T (or V^T) tile's memory as the bf16 pairs of the bf16 score products.
template <class A>
inline std::uint32_t* key_pairs(A* p) noexcept {
  return reinterpret_cast<std::uint32_t*>(p);
}
template <class A>
inline const std::uint32_t* key_pairs(const A* p) noexcept {
  return reinterpret_cast<const std::uint32_t*>(p);
}

/// Rows [j0, j0 + nk) of head hk as head-dim panels: element x of row c at
/// dst[(x / kP) * kRowPanel<kP> + c * kP + x % kP], zero for x >= d (rows past nk are not written).
template <class Tiles, class T, class A>
inline void pack_panels(ThdView<const T> src, std::int64_t j0, int nk, int hk, int d, A* dst) noexcept {
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

/// K^T of keys [j0, j0 + nk) of KV head hk into kt as key panels (column c of K^T, i.e. key c, at
/// kt[(c / kP) * d * kP + x * kP + c % kP]; keys past nk are zero), optionally also the natural rows into
/// nat as head-dim panels (pack_panels).
/// With bf16 score products (detail::kBf16Scores) K^T is packed as bf16 pairs instead: word (x / 2, c) holding
/// K[c][x], K[c][x + 1] at key_pairs(kt)[(c / kP) * pair_panel(d) + (x / 2) * kP + c % kP].
template <class Tiles, class T, class A>
inline void pack_keys(ThdView<const T> src, std::int64_t j0, int nk, int hk, int d, A* kt,
                      std::type_identity_t<A>* nat) noexcept {  // nat: not deduced, may be nullptr
  constexpr int kP = Tiles::kPanel;
  if constexpr (kBf16Scores<Tiles>) {
    static_assert(std::is_same_v<T, bf16>, "the bf16 score products read bf16 storage");
    std::uint32_t* words = key_pairs(kt);
    for (int c = 0; c < kKeyTile; ++c) {
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
  for (; c < kKeyTile; ++c) {
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

/// Rows [j0, j0 + nk) of head hk as pairs of rows in head-dim panels (bf16 products): word (c / 2, x) holding
/// rows c, c + 1 (even c) at words[(x / kP) * kRowPanel<kP> / 2 + (c / 2) * kP + x % kP], zero past nk up to
/// the tile's kKeyTile rows and past d up to whole panels. Fits in the fp32 layout's half.
template <class Tiles, class T>
inline void pack_row_pairs(ThdView<const T> src, std::int64_t j0, int nk, int hk, int d,
                           std::uint32_t* words) noexcept {
  constexpr int kP = Tiles::kPanel;
  for (int c = 0; c < kKeyTile; c += 2)
    Tiles::pack_row_pairs(c < nk ? src.row(j0 + c, hk) : nullptr, c + 1 < nk ? src.row(j0 + c + 1, hk) : nullptr, d,
                          words + (c / 2) * kP, kRowPanel<kP> / 2);
}

/// Whether rows [c0, c1) of a head-dim-panel tile are all finite (the zero padding is).
template <class Tiles, class A>
inline bool panels_finite(const A* p, int c0, int c1, int d) noexcept {
  constexpr int kP = Tiles::kPanel;
  bool ok = true;
  for (int x = 0; x < d; x += kP)
    ok &= Tiles::all_finite(p + (x / kP) * kRowPanel<kP> + c0 * kP, std::int64_t{c1 - c0} * kP);
  return ok;
}

/// n packed rows of d values into head-dim panels: value x of row r at dst[(x / kP) * panel + r * kP + x % kP],
/// zero for x >= d. As a GEMM's B operand a panel is contiguous (row-major rows at a 512-byte stride, d 128,
/// fall on a few L1 sets: 62 vs 74 GFLOP/s for the dV product's shape).
template <class Tiles, class A>
inline void rows_to_panels(const A* rows, std::int64_t n, int d, A* dst, std::int64_t panel) noexcept {
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

/// Rows [i0, i0 + n) of head h, times `scale`, as n contiguous rows of d values in the accumulation type.
template <class Tiles, class T, class A>
inline void pack_rows(ThdView<const T> src, std::int64_t i0, std::int64_t n, int h, int d, A scale, A* dst) noexcept {
  for (std::int64_t r = 0; r < n; ++r) {
    if (r + kAhead < n) prefetch_row(src.row(i0 + r + kAhead, h), d);
    Tiles::load_scaled(src.row(i0 + r, h), dst + r * d, d, scale);
  }
}

}  // namespace seqpar::attention::detail
