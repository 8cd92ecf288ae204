// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Tile primitives of CpuFlash: a broadcast-FMA GEMM on packed buffers, the online-softmax row
// update of the forward pass and the P / dS row step of the backward pass; the constants every instruction
// set shares and the portable versions for any floating type (`PortableTiles`). The AVX2 and AVX-512 versions
// for float live in flash_tiles_avx2.hpp and flash_tiles_avx512.hpp; CpuFlash picks one policy at run time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "seqpar/attention/cpu_isa.hpp"
#include "seqpar/attention/detail/bf16.hpp"

// Full unrolling of the loops over a micro-kernel's register block. GCC unrolls them at -O3 but not at -O2,
// and then keeps the accumulator array on the stack (a load and a store around every FMA: 2.5x slower);
// with the loops unrolled the array is indexed by constants and lives in registers at any -O level.
// Clang honours the GCC spelling too.
#define SEQPAR_UNROLL _Pragma("GCC unroll 16")

namespace seqpar::attention::detail {

/// Keys per KV tile: one score row of a tile is eight 16-float vectors. 128 rather than 64 halves what the
/// backward streams per key (its packed Q, dO and the lane's dQ rows are read, and dQ written, once per key
/// tile: at 64 keys the causal backward ran 12-25% slower in interleaved runs) and the load/store of the accumulators
/// around each k = kKeyTile product (P V, dQ += dS K). Rows touch only the vectors their visible keys occupy
/// (softmax_row, backward_row, BlockRanges), so short documents do not pay for the wider tile.
inline constexpr int kKeyTile = 128;
/// Rows per register block of the micro-kernels.
inline constexpr int kRowBlock = 6;
/// Lazy rescaling (as in FlashAttention-4): a row's reference max m moves only when a tile's max exceeds it by
/// more than this many powers of two, so most tiles skip the alpha = exp2(m_old - m_new) rescale of the output
/// row. Exact, not an approximation: P = exp2(s - m) <= 2^8 and the sum l use the same m, and O = acc / l,
/// LSE = m + log2(l) do not depend on which m was used (fp32 holds the up to 256x larger values easily).
inline constexpr float kLazyRescale = 8.0f;

/// 2^f ~ sum_i kExp2Poly[i] f^i on [-1/2, 1/2]: degree 5, fitted for least maximum relative error (Lawson-weighted
/// least squares on Chebyshev nodes; max relative error 7.5e-8 in exact arithmetic, below the 1.2e-7 of the
/// degree-6 Taylor polynomial it replaces, with one FMA less).
inline constexpr float kExp2Poly[6] = {1.0000000716534356f,   0.6931469670261563f,    0.24022119727884833f,
                                       0.055507133365563045f, 0.0096755411719727253f, 0.0013276451606117855f};

/// The new reference max of a row with reference max m after a tile whose visible max is mx (NaN keeps m,
/// as max(m, NaN) did; the first tile, m = -inf, always moves it).
template <class V>
inline V lazy_max(V m, V mx) noexcept {
  return mx > m + V(kLazyRescale) ? mx : m;
}

/// Columns per B panel of the portable micro-kernel.
inline constexpr int kPortablePanel = 16;
/// The widest panel of any policy (AVX-512's): CpuFlash sizes its workspace for it, so that the workspace does
/// not depend on which instruction set runs.
inline constexpr int kMaxPanel = 64;

/// Work that differs per register block of kRowBlock rows (block rb holds rows [kRowBlock * rb, ...)): along a
/// mask edge each block computes only what its own rows see, at 6-row x 16-key granularity instead of a whole
/// score block's (a 48 x 128 block on a causal diagonal is mostly hidden; short documents are mostly edge). Block rb
/// computes at least columns [col_lo[rb], col_hi[rb]) (multiples of 16, or n), at the policy's granularity: whole
/// 16-column vectors (AVX-512's 64-column panels are entered at the vector that holds col_lo); its other columns of C
/// may be left as they were and sums only over k in [k_lo[rb], k_hi[rb]) (A is zero elsewhere). Null: all columns / all
/// k. Panels stay the outer loop, so each B panel is still read from L1 by all row blocks.
struct BlockRanges {
  const int* col_lo = nullptr;
  const int* col_hi = nullptr;
  const int* k_lo = nullptr;
  const int* k_hi = nullptr;
};

/// C[i][j] (+)= sum_k A(i, k) * B(k, j) for i < m, j < n, k < kdim, where A(i, k) = a[i * ai + k * ak] (so A
/// may be row-major or transposed) and B(k, j) = b[(j / kPortablePanel) * panel + k * ldb + j % kPortablePanel]: B is
/// stored as column panels of kPortablePanel columns, `panel` elements apart. Row-major B is the case panel =
/// kPortablePanel; packed panels (ldb = kPortablePanel) are contiguous, so the micro-kernel streams each one instead of
/// reading one cache line per row at a row stride that maps to a few L1 sets (a 64 x 128 V tile at 512-byte stride: 76%
/// of the packed form's speed). Portable version: the j loop vectorises.
template <class V>
inline void gemm_portable(int m, int n, int kdim, const V* a, std::int64_t ai, std::int64_t ak, const V* b,
                          std::int64_t ldb, std::int64_t panel, V* c, std::int64_t ldc, bool accumulate,
                          const BlockRanges& rg = {}) noexcept {
  if (rg.col_lo != nullptr || rg.k_lo != nullptr) {
    for (int i0 = 0, rb = 0; i0 < m; i0 += kRowBlock, ++rb) {
      const int j0 = rg.col_lo != nullptr ? rg.col_lo[rb] : 0;
      const int j1 = rg.col_lo != nullptr ? std::min(n, rg.col_hi[rb]) : n;
      const int k0 = rg.k_lo != nullptr ? rg.k_lo[rb] : 0;
      const int k1 = rg.k_lo != nullptr ? rg.k_hi[rb] : kdim;
      if (j0 < j1)
        gemm_portable(std::min(kRowBlock, m - i0), j1 - j0, k1 - k0, a + i0 * ai + k0 * ak, ai, ak,
                      b + (j0 / kPortablePanel) * panel + k0 * ldb, ldb, panel, c + i0 * ldc + j0, ldc, accumulate);
    }
    return;
  }
  for (int i = 0; i < m; ++i) {
    V* ci = c + i * ldc;
    if (!accumulate)
      for (int j = 0; j < n; ++j) ci[j] = V(0);
    for (int j0 = 0; j0 < n; j0 += kPortablePanel) {
      const int w = std::min(kPortablePanel, n - j0);
      const V* bp = b + (j0 / kPortablePanel) * panel;
      V* cj = ci + j0;
      for (int k = 0; k < kdim; ++k) {
        const V aik = a[i * ai + k * ak];
        const V* bk = bp + k * ldb;
        for (int j = 0; j < w; ++j) cj[j] += aik * bk[j];
      }
    }
  }
}

/// Online-softmax update of one row of raw log2-domain scores s[0, kKeyTile) of which [lo, hi) are
/// visible (lo < hi): s becomes P = exp2(s - m_new) (0 outside), the reference max m (lazy_max) and the sum l
/// are updated; returns the factor alpha = exp2(m_old - m_new) by which the row's accumulated output must be
/// rescaled (1 when m did not move).
template <class V>
inline V softmax_row_portable(V* s, int lo, int hi, V& m, V& l) noexcept {
  V mx = -std::numeric_limits<V>::infinity();
  for (int j = lo; j < hi; ++j) mx = std::max(mx, s[j]);
  const V m_new = lazy_max(m, mx);
  V sum = 0;
  for (int j = 0; j < kKeyTile; ++j) {
    const V p = (j >= lo && j < hi) ? std::exp2(s[j] - m_new) : V(0);
    s[j] = p;
    sum += p;
  }
  const V alpha = m == m_new ? V(1) : m == -std::numeric_limits<V>::infinity() ? V(0) : std::exp2(m - m_new);
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

/// Backward row step: s (log2-domain scores) becomes P = exp2(s - lse2) on [lo, hi), 0 elsewhere;
/// dp (dO . V^T) becomes dS = P * (dp - delta) on [lo, hi), 0 elsewhere. Masked lanes are set to 0 by
/// selection (bitwise AND / masked move), never by a product with 0: their S or dP may be NaN or infinite
/// (another document's keys share the tile), and 0 * NaN would carry it into this row's gradients.
template <class V>
inline void backward_row_portable(V* s, V* dp, int lo, int hi, V lse2, V delta) noexcept {
  for (int j = 0; j < kKeyTile; ++j) {
    const bool visible = j >= lo && j < hi;
    const V p = visible ? std::exp2(s[j] - lse2) : V(0);
    s[j] = p;
    dp[j] = visible ? p * (dp[j] - delta) : V(0);  // selected, not multiplied: a masked dP may be NaN
  }
}

/// dst[x] = A(src[x]) * scale for x < n (packing a row into the accumulation type).
template <class T, class V>
inline void load_scaled(const T* src, V* dst, int n, V scale) noexcept {
  for (int x = 0; x < n; ++x) dst[x] = V(src[x]) * scale;
}
/// dst[x * ldd + r] = A(rows[r][x]) for r < 8, x < n (eight key rows into K^T layout).
template <class T, class V>
inline void transpose_rows8(const T* const* rows, int n, V* dst, std::int64_t ldd) noexcept {
  for (int x = 0; x < n; ++x)
    for (int r = 0; r < 8; ++r) dst[x * ldd + r] = V(rows[r][x]);
}
/// x[i] *= a for i < n.
template <class V>
inline void scale_row(V* x, int n, V a) noexcept {
  for (int i = 0; i < n; ++i) x[i] *= a;
}
/// out[x] = T(A(out[x]) + acc[x] * s) for x < n (adding a finished tile row into a gradient).
template <class T, class V>
inline void add_scaled_store(T* out, const V* acc, int n, V s) noexcept {
  for (int x = 0; x < n; ++x) out[x] = T(V(out[x]) + acc[x] * s);
}
/// out[x] = T(acc[x] * s) for x < n.
template <class T, class V>
inline void store_scaled(T* out, const V* acc, int n, V s) noexcept {
  for (int x = 0; x < n; ++x) out[x] = T(acc[x] * s);
}
/// sum_x A(a[x]) * A(b[x]).
template <class V, class T>
inline V dot(const T* a, const T* b, int n) noexcept {
  V sum = 0;
  for (int x = 0; x < n; ++x) sum += V(a[x]) * V(b[x]);
  return sum;
}
/// True when every one of the n values is finite (no NaN, no infinity).
template <class V>
inline bool all_finite(const V* x, std::int64_t n) noexcept {
  bool ok = true;
  for (std::int64_t i = 0; i < n; ++i) ok &= std::isfinite(x[i]);
  return ok;
}

/// The policy CpuFlash's loops run their tiles through: a panel width and the tile and row primitives above.
/// Every policy (Avx2Tiles, Avx512Tiles) has the same members for float storage and bf16 storage with float
/// accumulation; this one also serves double. V is the accumulation type.
template <class V>
struct PortableTiles {
  static constexpr CpuIsa kIsa = CpuIsa::kPortable;
  static constexpr int kPanel = kPortablePanel;
  static void gemm(int m, int n, int kdim, const V* a, std::int64_t ai, std::int64_t ak, const V* b, std::int64_t ldb,
                   std::int64_t panel, V* c, std::int64_t ldc, bool accumulate, const BlockRanges& rg = {}) noexcept {
    gemm_portable(m, n, kdim, a, ai, ak, b, ldb, panel, c, ldc, accumulate, rg);
  }
  static V softmax_row(V* s, int lo, int hi, V& m, V& l) noexcept { return softmax_row_portable(s, lo, hi, m, l); }
  static void backward_row(V* s, V* dp, int lo, int hi, V lse2, V delta) noexcept {
    backward_row_portable(s, dp, lo, hi, lse2, delta);
  }
  template <class T>
  static void load_scaled(const T* src, V* dst, int n, V scale) noexcept {
    detail::load_scaled(src, dst, n, scale);
  }
  template <class T>
  static void transpose_rows8(const T* const* rows, int n, V* dst, std::int64_t ldd) noexcept {
    detail::transpose_rows8(rows, n, dst, ldd);
  }
  static void scale_row(V* x, int n, V a) noexcept { detail::scale_row(x, n, a); }
  template <class T>
  static void add_scaled_store(T* out, const V* acc, int n, V s) noexcept {
    detail::add_scaled_store(out, acc, n, s);
  }
  template <class T>
  static void store_scaled(T* out, const V* acc, int n, V s) noexcept {
    detail::store_scaled(out, acc, n, s);
  }
  template <class T>
  static V dot(const T* a, const T* b, int n) noexcept {
    return detail::dot<V>(a, b, n);
  }
  static bool all_finite(const V* x, std::int64_t n) noexcept { return detail::all_finite(x, n); }
};

}  // namespace seqpar::attention::detail
