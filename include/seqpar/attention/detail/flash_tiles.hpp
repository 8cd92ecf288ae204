// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Tile primitives of CpuFlash: a broadcast-FMA GEMM on packed buffers, the online-softmax row
// update of the forward pass and the P / dS row step of the backward pass. Portable versions for
// any floating type; AVX-512 (else AVX2+FMA) versions for float when the target has them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "seqpar/attention/detail/bf16.hpp"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// GCC 12 reports -Wmaybe-uninitialized inside the AVX-512 intrinsics (their _mm512_undefined_ps(),
// GCC PR105593, fixed in GCC 13); the diagnostic is located in the intrinsic headers, so silence it there.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

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

/// Columns per B panel: the micro-kernel's column block (64 floats on AVX-512, 16 on AVX2 and portable).
#if defined(__AVX512F__)
inline constexpr int kPanel = 64;
#else
inline constexpr int kPanel = 16;
#endif

/// Work that differs per register block of kRowBlock rows (block rb holds rows [kRowBlock * rb, ...)): along a
/// mask edge each block computes only what its own rows see, at 6-row x 16-key granularity instead of a whole
/// score block's (a 48 x 128 block on a causal diagonal is mostly hidden; short documents are mostly edge). Block rb
/// computes only columns [col_lo[rb], col_hi[rb]) (multiples of kPanel, or n; its other columns of C are left as
/// they were) and sums only over k in [k_lo[rb], k_hi[rb]) (A is zero elsewhere). Null: all columns / all k.
/// Panels stay the outer loop, so each B panel is still read from L1 by all row blocks.
struct BlockRanges {
  const int* col_lo = nullptr;
  const int* col_hi = nullptr;
  const int* k_lo = nullptr;
  const int* k_hi = nullptr;
};

/// C[i][j] (+)= sum_k A(i, k) * B(k, j) for i < m, j < n, k < kdim, where A(i, k) = a[i * ai + k * ak] (so A
/// may be row-major or transposed) and B(k, j) = b[(j / kPanel) * panel + k * ldb + j % kPanel]: B is stored as
/// column panels of kPanel columns, `panel` elements apart. Row-major B is the case panel = kPanel; packed
/// panels (ldb = kPanel) are contiguous, so the micro-kernel streams each one instead of reading one cache
/// line per row at a row stride that maps to a few L1 sets (a 64 x 128 V tile at 512-byte stride: 76% of the
/// packed form's speed). Portable version: the j loop vectorises.
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
                      b + (j0 / kPanel) * panel + k0 * ldb, ldb, panel, c + i0 * ldc + j0, ldc, accumulate);
    }
    return;
  }
  for (int i = 0; i < m; ++i) {
    V* ci = c + i * ldc;
    if (!accumulate)
      for (int j = 0; j < n; ++j) ci[j] = V(0);
    for (int j0 = 0; j0 < n; j0 += kPanel) {
      const int w = std::min(kPanel, n - j0);
      const V* bp = b + (j0 / kPanel) * panel;
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

#if defined(__AVX512F__)

#define SEQPAR_ALWAYS_INLINE inline __attribute__((always_inline))

/// exp2 on 16 lanes: round-to-nearest split x = n + f, |f| <= 1/2, kExp2Poly(f) ~ 2^f, then vscalefps by n. Inputs
/// below -150 (including -inf) give 0; NaN gives NaN.
SEQPAR_ALWAYS_INLINE __m512 exp2_ps(__m512 x) noexcept {
  x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);  // max(c, NaN) is NaN (the second operand): NaN stays NaN
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[5]);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[4]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[3]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[2]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[1]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[0]));
  return _mm512_scalef_ps(p, n);
}

/// Lanes of 16-lane vector v (keys 16v .. 16v+15) inside [lo, hi).
SEQPAR_ALWAYS_INLINE __mmask16 key_mask16(int v, int lo, int hi) noexcept {
  const int a = std::clamp(lo - 16 * v, 0, 16), b = std::clamp(hi - 16 * v, 0, 16);
  return static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
}

template <int R, int NV>
SEQPAR_ALWAYS_INLINE void gemm_block(int kdim, const float* a, std::int64_t ai, std::int64_t ak, const float* b,
                                     std::int64_t ldb, float* c, std::int64_t ldc, __mmask16 tail,
                                     bool accumulate) noexcept {
  __m512 acc[R][NV];
  SEQPAR_UNROLL
  for (int i = 0; i < R; ++i) {
    SEQPAR_UNROLL
    for (int v = 0; v < NV; ++v) {
      if (!accumulate)
        acc[i][v] = _mm512_setzero_ps();
      else if (v + 1 < NV)
        acc[i][v] = _mm512_loadu_ps(c + i * ldc + 16 * v);
      else
        acc[i][v] = _mm512_maskz_loadu_ps(tail, c + i * ldc + 16 * v);
    }
  }
  for (int k = 0; k < kdim; ++k) {
    const float* bk = b + k * ldb;
    __m512 bv[NV];
    SEQPAR_UNROLL
    for (int v = 0; v < NV; ++v)
      bv[v] = v + 1 < NV ? _mm512_loadu_ps(bk + 16 * v) : _mm512_maskz_loadu_ps(tail, bk + 16 * v);
    const float* ak_ptr = a + k * ak;
    SEQPAR_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m512 x = _mm512_set1_ps(ak_ptr[i * ai]);
      SEQPAR_UNROLL
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(x, bv[v], acc[i][v]);
    }
  }
  SEQPAR_UNROLL
  for (int i = 0; i < R; ++i) {
    SEQPAR_UNROLL
    for (int v = 0; v < NV; ++v) {
      if (v + 1 < NV)
        _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
      else
        _mm512_mask_storeu_ps(c + i * ldc + 16 * v, tail, acc[i][v]);
    }
  }
}

using GemmBlockFn = void (*)(int, const float*, std::int64_t, std::int64_t, const float*, std::int64_t, float*,
                             std::int64_t, __mmask16, bool) noexcept;

template <int R>
inline GemmBlockFn gemm_block_for(int nv) noexcept {
  switch (nv) {
    case 1:
      return &gemm_block<R, 1>;
    case 2:
      return &gemm_block<R, 2>;
    case 3:
      return &gemm_block<R, 3>;
    default:
      return &gemm_block<R, 4>;
  }
}

inline void gemm(int m, int n, int kdim, const float* a, std::int64_t ai, std::int64_t ak, const float* b,
                 std::int64_t ldb, std::int64_t panel, float* c, std::int64_t ldc, bool accumulate,
                 const BlockRanges& rg = {}) noexcept {
  for (int j0 = 0; j0 < n; j0 += 64) {
    const int w = std::min(64, n - j0);
    const float* bj = b + (j0 / 64) * panel;
    const int nv = (w + 15) / 16;
    const __mmask16 tail = (w % 16) != 0 ? static_cast<__mmask16>((1u << (w % 16)) - 1u) : __mmask16(0xFFFF);
    for (int i0 = 0, rb = 0; i0 < m; i0 += kRowBlock, ++rb) {
      if (rg.col_lo != nullptr && (j0 < rg.col_lo[rb] || j0 >= rg.col_hi[rb])) continue;
      const int k0 = rg.k_lo != nullptr ? rg.k_lo[rb] : 0;
      const int kn = rg.k_lo != nullptr ? rg.k_hi[rb] - k0 : kdim;
      const float* ab = a + i0 * ai + k0 * ak;
      const float* bb = bj + k0 * ldb;
      const int r = std::min(kRowBlock, m - i0);
      GemmBlockFn fn = nullptr;
      switch (r) {
        case 1:
          fn = gemm_block_for<1>(nv);
          break;
        case 2:
          fn = gemm_block_for<2>(nv);
          break;
        case 3:
          fn = gemm_block_for<3>(nv);
          break;
        case 4:
          fn = gemm_block_for<4>(nv);
          break;
        case 5:
          fn = gemm_block_for<5>(nv);
          break;
        default:
          fn = gemm_block_for<6>(nv);
          break;
      }
      if (nv == 4 && r == kRowBlock && w == 64) {  // the hot case, inlined
        gemm_block<6, 4>(kn, ab, ai, ak, bb, ldb, c + i0 * ldc + j0, ldc, tail, accumulate);
      } else {
        fn(kn, ab, ai, ak, bb, ldb, c + i0 * ldc + j0, ldc, tail, accumulate);
      }
    }
  }
}

// Row steps over the vectors that hold [lo, hi) only (two passes: max, then exp; the second reloads from L1);
// the row's other vectors are stored as 0, since a register block's products may reach past this row's keys.
inline float softmax_row(float* s, int lo, int hi, float& m, float& l) noexcept {
  constexpr int kV = kKeyTile / 16;
  const int v0 = lo / 16, v1 = (hi + 15) / 16;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = ninf;
  for (int v = v0; v < v1; ++v) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, key_mask16(v, lo, hi), s + 16 * v));
  const bool moves = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(m + kLazyRescale), _CMP_GT_OQ) != 0;  // NaN: no
  const float m_new = moves ? lazy_max(m, _mm512_reduce_max_ps(mx)) : m;
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < v0; ++v) _mm512_storeu_ps(s + 16 * v, _mm512_setzero_ps());
  for (int v = v0; v < v1; ++v) {
    const __m512 p =
        _mm512_maskz_mov_ps(key_mask16(v, lo, hi), exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * v), mv)));
    _mm512_storeu_ps(s + 16 * v, p);
    sum = _mm512_add_ps(sum, p);
  }
  for (int v = v1; v < kV; ++v) _mm512_storeu_ps(s + 16 * v, _mm512_setzero_ps());
  const float alpha = m == m_new ? 1.0f : m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp2(m - m_new);
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}

inline void backward_row(float* s, float* dp, int lo, int hi, float lse2, float delta) noexcept {
  constexpr int kV = kKeyTile / 16;
  const int v0 = lo / 16, v1 = (hi + 15) / 16;
  const __m512 lv = _mm512_set1_ps(lse2);
  const __m512 dv = _mm512_set1_ps(delta);
  for (int v = 0; v < kV; ++v) {
    if (v < v0 || v >= v1) {
      _mm512_storeu_ps(s + 16 * v, _mm512_setzero_ps());
      _mm512_storeu_ps(dp + 16 * v, _mm512_setzero_ps());
      continue;
    }
    const __mmask16 km = key_mask16(v, lo, hi);
    const __m512 p = _mm512_maskz_mov_ps(km, exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * v), lv)));
    _mm512_storeu_ps(s + 16 * v, p);
    _mm512_storeu_ps(dp + 16 * v, _mm512_maskz_mul_ps(km, p, _mm512_sub_ps(_mm512_loadu_ps(dp + 16 * v), dv)));
  }
}

#elif defined(__AVX2__) && defined(__FMA__)

#define SEQPAR_ALWAYS_INLINE inline __attribute__((always_inline))

/// exp2 on 8 lanes: x raised to at least -126, split x = n + f with |f| <= 1/2, kExp2Poly(f) ~ 2^f, times 2^n
/// built in the exponent field. No upper clamp: callers pass x = s - m <= 2^8 (m a row's reference max or its
/// LSE) on the lanes they keep; an x of +inf or NaN gives NaN, and masked lanes are zeroed by callers.
SEQPAR_ALWAYS_INLINE __m256 exp2_ps(__m256 x) noexcept {
  // The constant goes first: max returns the second operand when one is NaN, so a NaN score stays NaN
  // (clamped, it would become a tiny finite weight and hide the NaN from the output).
  x = _mm256_max_ps(_mm256_set1_ps(-126.0f), x);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[5]);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[4]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[3]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[2]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[1]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[0]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/// Lane mask (all-ones lanes) for lanes [0, w) of an 8-lane vector.
SEQPAR_ALWAYS_INLINE __m256i tail_mask8(int w) noexcept {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/// Lanes of vector v (keys 8v .. 8v+7) inside [lo, hi), as a float blend mask.
SEQPAR_ALWAYS_INLINE __m256 key_mask8(int v, int lo, int hi) noexcept {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(8 * v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i ge = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(lo - 1));
  const __m256i lt = _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), idx);
  return _mm256_castsi256_ps(_mm256_and_si256(ge, lt));
}

/// `Tail`: the last of the NV vectors is partial (masked loads and stores); false for full 8 NV columns.
template <int R, int NV, bool Tail = true>
SEQPAR_ALWAYS_INLINE void gemm_block(int kdim, const float* a, std::int64_t ai, std::int64_t ak, const float* b,
                                     std::int64_t ldb, float* c, std::int64_t ldc, __m256i tail,
                                     bool accumulate) noexcept {
  __m256 acc[R][NV];
  SEQPAR_UNROLL
  for (int i = 0; i < R; ++i) {
    SEQPAR_UNROLL
    for (int v = 0; v < NV; ++v) {
      if (!accumulate)
        acc[i][v] = _mm256_setzero_ps();
      else if (v + 1 < NV || !Tail)
        acc[i][v] = _mm256_loadu_ps(c + i * ldc + 8 * v);
      else
        acc[i][v] = _mm256_maskload_ps(c + i * ldc + 8 * v, tail);
    }
  }
  for (int k = 0; k < kdim; ++k) {
    const float* bk = b + k * ldb;
    __m256 bv[NV];
    SEQPAR_UNROLL
    for (int v = 0; v < NV; ++v)
      bv[v] = v + 1 < NV || !Tail ? _mm256_loadu_ps(bk + 8 * v) : _mm256_maskload_ps(bk + 8 * v, tail);
    const float* ak_ptr = a + k * ak;
    SEQPAR_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m256 x = _mm256_broadcast_ss(ak_ptr + i * ai);
      SEQPAR_UNROLL
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(x, bv[v], acc[i][v]);
    }
  }
  SEQPAR_UNROLL
  for (int i = 0; i < R; ++i) {
    SEQPAR_UNROLL
    for (int v = 0; v < NV; ++v) {
      if (v + 1 < NV || !Tail)
        _mm256_storeu_ps(c + i * ldc + 8 * v, acc[i][v]);
      else
        _mm256_maskstore_ps(c + i * ldc + 8 * v, tail, acc[i][v]);
    }
  }
}

using GemmBlockFn = void (*)(int, const float*, std::int64_t, std::int64_t, const float*, std::int64_t, float*,
                             std::int64_t, __m256i, bool) noexcept;

/// `full`: 16 columns (no masked loads or stores).
template <int R>
inline GemmBlockFn gemm_block_for(int nv, bool full) noexcept {
  return full ? &gemm_block<R, 2, false> : nv == 1 ? &gemm_block<R, 1> : &gemm_block<R, 2>;
}

inline void gemm(int m, int n, int kdim, const float* a, std::int64_t ai, std::int64_t ak, const float* b,
                 std::int64_t ldb, std::int64_t panel, float* c, std::int64_t ldc, bool accumulate,
                 const BlockRanges& rg = {}) noexcept {
  for (int j0 = 0; j0 < n; j0 += 16) {
    const int w = std::min(16, n - j0);
    const float* bj = b + (j0 / 16) * panel;
    const int nv = (w + 7) / 8;
    const __m256i tail = tail_mask8(w - 8 * (nv - 1));
    for (int i0 = 0, rb = 0; i0 < m; i0 += kRowBlock, ++rb) {
      if (rg.col_lo != nullptr && (j0 < rg.col_lo[rb] || j0 >= rg.col_hi[rb])) continue;
      const int k0 = rg.k_lo != nullptr ? rg.k_lo[rb] : 0;
      const int kn = rg.k_lo != nullptr ? rg.k_hi[rb] - k0 : kdim;
      const float* ab = a + i0 * ai + k0 * ak;
      const float* bb = bj + k0 * ldb;
      const int r = std::min(kRowBlock, m - i0);
      if (nv == 2 && r == kRowBlock && w == 16) {  // the hot case, inlined
        gemm_block<6, 2, false>(kn, ab, ai, ak, bb, ldb, c + i0 * ldc + j0, ldc, tail, accumulate);
        continue;
      }
      GemmBlockFn fn = nullptr;
      switch (r) {
        case 1:
          fn = gemm_block_for<1>(nv, w == 16);
          break;
        case 2:
          fn = gemm_block_for<2>(nv, w == 16);
          break;
        case 3:
          fn = gemm_block_for<3>(nv, w == 16);
          break;
        case 4:
          fn = gemm_block_for<4>(nv, w == 16);
          break;
        case 5:
          fn = gemm_block_for<5>(nv, w == 16);
          break;
        default:
          fn = gemm_block_for<6>(nv, w == 16);
          break;
      }
      fn(kn, ab, ai, ak, bb, ldb, c + i0 * ldc + j0, ldc, tail, accumulate);
    }
  }
}

SEQPAR_ALWAYS_INLINE float hmax8(__m256 v) noexcept {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
SEQPAR_ALWAYS_INLINE float hsum8(__m256 v) noexcept {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// Row steps over the vectors that hold [lo, hi) only (two passes: max, then exp; the second reloads from L1);
// the row's other vectors are stored as 0, since a register block's products may reach past this row's keys.
SEQPAR_ALWAYS_INLINE float softmax_row(float* s, int lo, int hi, float& m, float& l) noexcept {
  constexpr int kV = kKeyTile / 8;
  const int v0 = lo / 8, v1 = (hi + 7) / 8;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx = ninf, mx2 = ninf;  // two chains: max has a 3-cycle latency
  int v = v0;
  for (; v + 1 < v1; v += 2) {
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + 8 * v), key_mask8(v, lo, hi)));
    mx2 = _mm256_max_ps(mx2, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + 8 * v + 8), key_mask8(v + 1, lo, hi)));
  }
  if (v < v1) mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + 8 * v), key_mask8(v, lo, hi)));
  mx = _mm256_max_ps(mx, mx2);
  // The common case, no lane above m + 2^8: m stays, with no horizontal reduction on the critical path.
  const bool moves =
      _mm256_movemask_ps(_mm256_cmp_ps(mx, _mm256_set1_ps(m + kLazyRescale), _CMP_GT_OQ)) != 0;  // NaN: no
  const float m_new = moves ? lazy_max(m, hmax8(mx)) : m;
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (v = 0; v < v0; ++v) _mm256_storeu_ps(s + 8 * v, _mm256_setzero_ps());
  for (; v < v1; ++v) {
    const __m256 p = _mm256_and_ps(key_mask8(v, lo, hi), exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * v), mv)));
    _mm256_storeu_ps(s + 8 * v, p);
    sum = _mm256_add_ps(sum, p);
  }
  for (; v < kV; ++v) _mm256_storeu_ps(s + 8 * v, _mm256_setzero_ps());
  const float alpha = m == m_new ? 1.0f : m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp2(m - m_new);
  l = l * alpha + hsum8(sum);
  m = m_new;
  return alpha;
}

inline void backward_row(float* s, float* dp, int lo, int hi, float lse2, float delta) noexcept {
  constexpr int kV = kKeyTile / 8;
  const int v0 = lo / 8, v1 = (hi + 7) / 8;
  const __m256 lv = _mm256_set1_ps(lse2);
  const __m256 dv = _mm256_set1_ps(delta);
  int v = 0;
  for (; v < v0; ++v) {
    _mm256_storeu_ps(s + 8 * v, _mm256_setzero_ps());
    _mm256_storeu_ps(dp + 8 * v, _mm256_setzero_ps());
  }
  for (; v < v1; ++v) {
    const __m256 km = key_mask8(v, lo, hi);
    const __m256 p = _mm256_and_ps(km, exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * v), lv)));
    _mm256_storeu_ps(s + 8 * v, p);
    _mm256_storeu_ps(dp + 8 * v, _mm256_and_ps(km, _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dp + 8 * v), dv))));
  }
  for (; v < kV; ++v) {
    _mm256_storeu_ps(s + 8 * v, _mm256_setzero_ps());
    _mm256_storeu_ps(dp + 8 * v, _mm256_setzero_ps());
  }
}

#endif  // __AVX512F__ / __AVX2__

// ---- float row helpers (AVX2; AVX-512 targets have AVX2): GCC 12 leaves the portable loops scalar at -O2 ----
#if defined(__AVX2__) && defined(__FMA__)
inline void load_scaled(const float* src, float* dst, int n, float scale) noexcept {
  const __m256 sv = _mm256_set1_ps(scale);
  int x = 0;
  for (; x + 8 <= n; x += 8) _mm256_storeu_ps(dst + x, _mm256_mul_ps(_mm256_loadu_ps(src + x), sv));
  for (; x < n; ++x) dst[x] = src[x] * scale;
}
inline void scale_row(float* v, int n, float a) noexcept {
  const __m256 av = _mm256_set1_ps(a);
  int x = 0;
  for (; x + 8 <= n; x += 8) _mm256_storeu_ps(v + x, _mm256_mul_ps(_mm256_loadu_ps(v + x), av));
  for (; x < n; ++x) v[x] *= a;
}
inline void add_scaled_store(float* out, const float* acc, int n, float s) noexcept {
  const __m256 sv = _mm256_set1_ps(s);
  int x = 0;
  for (; x + 8 <= n; x += 8)
    _mm256_storeu_ps(out + x, _mm256_fmadd_ps(_mm256_loadu_ps(acc + x), sv, _mm256_loadu_ps(out + x)));
  for (; x < n; ++x) out[x] = out[x] + acc[x] * s;
}
inline void store_scaled(float* out, const float* acc, int n, float s) noexcept {
  load_scaled(acc, out, n, s);
}
template <>
inline float dot<float, float>(const float* a, const float* b, int n) noexcept {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int x = 0;
  for (; x + 16 <= n; x += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + x), _mm256_loadu_ps(b + x), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + x + 8), _mm256_loadu_ps(b + x + 8), s1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(s0, s1));
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; x < n; ++x) sum += a[x] * b[x];
  return sum;
}
template <>
inline bool all_finite<float>(const float* v, std::int64_t n) noexcept {
  // x - x is 0 for finite x and NaN for NaN or infinity; the sum of those stays 0 only if all are finite.
  __m256 acc = _mm256_setzero_ps();
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    acc = _mm256_add_ps(acc, _mm256_sub_ps(x, x));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  bool ok = true;
  for (float l : lanes) ok &= (l == 0.0f);
  for (; i < n; ++i) ok &= std::isfinite(v[i]);
  return ok;
}

// bf16 rows: 8 values widen to floats by a 16-bit shift; floats narrow with round-to-nearest-even (the bias
// 0x7FFF plus the lowest kept bit), NaN lanes kept quiet NaNs.
SEQPAR_ALWAYS_INLINE __m256 load_bf16x8(const bf16* p) noexcept {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
SEQPAR_ALWAYS_INLINE void store_bf16x8(bf16* p, __m256 x) noexcept {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
  r = _mm256_blendv_epi8(r, qnan, nan);
  // 8 x u32 (each < 65536) -> 8 x u16: pack within 128-bit lanes, then gather the two low quadwords
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
SEQPAR_ALWAYS_INLINE __m256 load8(const float* p) noexcept {
  return _mm256_loadu_ps(p);
}
SEQPAR_ALWAYS_INLINE __m256 load8(const bf16* p) noexcept {
  return load_bf16x8(p);
}
/// 8 x 8 blocks by unpack / shuffle / 128-bit permute (the scalar loop costs ~8% of the forward at d 128).
template <class T>
SEQPAR_ALWAYS_INLINE void transpose_rows8_avx2(const T* const* rows, int n, float* dst, std::int64_t ldd) noexcept {
  int x = 0;
  for (; x + 8 <= n; x += 8) {
    __m256 t[8], u[8];
    SEQPAR_UNROLL
    for (int r = 0; r < 8; r += 2) {
      const __m256 a = load8(rows[r] + x), b = load8(rows[r + 1] + x);
      t[r] = _mm256_unpacklo_ps(a, b);      // a0 b0 a1 b1 | a4 b4 a5 b5
      t[r + 1] = _mm256_unpackhi_ps(a, b);  // a2 b2 a3 b3 | a6 b6 a7 b7
    }
    SEQPAR_UNROLL
    for (int h = 0; h < 8; h += 4) {  // rows h..h+3: columns 0|4, 1|5, 2|6, 3|7
      u[h] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    float* o = dst + x * ldd;
    SEQPAR_UNROLL
    for (int c = 0; c < 4; ++c) {
      _mm256_storeu_ps(o + c * ldd, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
      _mm256_storeu_ps(o + (c + 4) * ldd, _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
    }
  }
  for (; x < n; ++x)
    for (int r = 0; r < 8; ++r) dst[x * ldd + r] = float(rows[r][x]);
}
inline void transpose_rows8(const float* const* rows, int n, float* dst, std::int64_t ldd) noexcept {
  transpose_rows8_avx2(rows, n, dst, ldd);
}
inline void transpose_rows8(const bf16* const* rows, int n, float* dst, std::int64_t ldd) noexcept {
  transpose_rows8_avx2(rows, n, dst, ldd);
}
inline void load_scaled(const bf16* src, float* dst, int n, float scale) noexcept {
  const __m256 sv = _mm256_set1_ps(scale);
  int x = 0;
  for (; x + 8 <= n; x += 8) _mm256_storeu_ps(dst + x, _mm256_mul_ps(load_bf16x8(src + x), sv));
  for (; x < n; ++x) dst[x] = float(src[x]) * scale;
}
inline void add_scaled_store(bf16* out, const float* acc, int n, float s) noexcept {
  const __m256 sv = _mm256_set1_ps(s);
  int x = 0;
  for (; x + 8 <= n; x += 8) store_bf16x8(out + x, _mm256_fmadd_ps(_mm256_loadu_ps(acc + x), sv, load_bf16x8(out + x)));
  for (; x < n; ++x) out[x] = bf16(float(out[x]) + acc[x] * s);
}
inline void store_scaled(bf16* out, const float* acc, int n, float s) noexcept {
  const __m256 sv = _mm256_set1_ps(s);
  int x = 0;
  for (; x + 8 <= n; x += 8) store_bf16x8(out + x, _mm256_mul_ps(_mm256_loadu_ps(acc + x), sv));
  for (; x < n; ++x) out[x] = bf16(acc[x] * s);
}
template <>
inline float dot<float, bf16>(const bf16* a, const bf16* b, int n) noexcept {
  __m256 s0 = _mm256_setzero_ps();
  int x = 0;
  for (; x + 8 <= n; x += 8) s0 = _mm256_fmadd_ps(load_bf16x8(a + x), load_bf16x8(b + x), s0);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s0);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; x < n; ++x) sum += float(a[x]) * float(b[x]);
  return sum;
}
#endif

template <class V>
inline void gemm(int m, int n, int kdim, const V* a, std::int64_t ai, std::int64_t ak, const V* b, std::int64_t ldb,
                 std::int64_t panel, V* c, std::int64_t ldc, bool accumulate, const BlockRanges& rg = {}) noexcept {
  gemm_portable(m, n, kdim, a, ai, ak, b, ldb, panel, c, ldc, accumulate, rg);
}
/// Row-major B (B(k, j) = b[k * ldb + j]).
template <class V>
inline void gemm(int m, int n, int kdim, const V* a, std::int64_t ai, std::int64_t ak, const V* b, std::int64_t ldb,
                 V* c, std::int64_t ldc, bool accumulate) noexcept {
  gemm(m, n, kdim, a, ai, ak, b, ldb, std::int64_t{kPanel}, c, ldc, accumulate);
}

template <class V>
inline V softmax_row(V* s, int lo, int hi, V& m, V& l) noexcept {
  return softmax_row_portable(s, lo, hi, m, l);
}
template <class V>
inline void backward_row(V* s, V* dp, int lo, int hi, V lse2, V delta) noexcept {
  backward_row_portable(s, dp, lo, hi, lse2, delta);
}

}  // namespace seqpar::attention::detail
