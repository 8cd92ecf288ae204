// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// CpuFlash's AVX2 + FMA tile primitives (namespace detail::avx2), compiled for AVX2 by a target region whatever
// the build's -march, and the policy `Avx2Tiles` CpuFlash runs them through when the CPU has AVX2 and FMA
// (cpu_isa.hpp). Its functions are called, not inlined, from CpuFlash's loops (compiled for the build's
// target): every entry point does a row or a tile of work, so a call costs nothing that shows.
#pragma once

#include "seqpar/attention/cpu_isa.hpp"
#include "seqpar/attention/detail/flash_tiles.hpp"

#if SEQPAR_CPU_DISPATCH

#include "seqpar/attention/detail/simd_intrinsics.hpp"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace seqpar::attention::detail::avx2 {

/// Columns per B panel of the micro-kernel (6 rows x 16 columns in 12 ymm accumulators).
inline constexpr int kPanel = 16;

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

// ---- rows: GCC 12 leaves the portable loops scalar at -O2 ----
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
inline float dot(const float* a, const float* b, int n) noexcept {
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
inline bool all_finite(const float* v, std::int64_t n) noexcept {
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
inline float dot(const bf16* a, const bf16* b, int n) noexcept {
  __m256 s0 = _mm256_setzero_ps();
  int x = 0;
  for (; x + 8 <= n; x += 8) s0 = _mm256_fmadd_ps(load_bf16x8(a + x), load_bf16x8(b + x), s0);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s0);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; x < n; ++x) sum += float(a[x]) * float(b[x]);
  return sum;
}

/// The row primitives (packing, scaling, storing, dot products, finiteness) of the AVX2 and AVX-512 policies:
/// a row of up to a head's width per call, 8 lanes wide (the loads and stores dominate, not the lane count).
struct Avx2Rows {
  static void load_scaled(const float* src, float* dst, int n, float scale) noexcept {
    avx2::load_scaled(src, dst, n, scale);
  }
  static void load_scaled(const bf16* src, float* dst, int n, float scale) noexcept {
    avx2::load_scaled(src, dst, n, scale);
  }
  static void transpose_rows8(const float* const* rows, int n, float* dst, std::int64_t ldd) noexcept {
    avx2::transpose_rows8(rows, n, dst, ldd);
  }
  static void transpose_rows8(const bf16* const* rows, int n, float* dst, std::int64_t ldd) noexcept {
    avx2::transpose_rows8(rows, n, dst, ldd);
  }
  static void scale_row(float* x, int n, float a) noexcept { avx2::scale_row(x, n, a); }
  static void add_scaled_store(float* out, const float* acc, int n, float s) noexcept {
    avx2::add_scaled_store(out, acc, n, s);
  }
  static void add_scaled_store(bf16* out, const float* acc, int n, float s) noexcept {
    avx2::add_scaled_store(out, acc, n, s);
  }
  static void store_scaled(float* out, const float* acc, int n, float s) noexcept {
    avx2::store_scaled(out, acc, n, s);
  }
  static void store_scaled(bf16* out, const float* acc, int n, float s) noexcept { avx2::store_scaled(out, acc, n, s); }
  static float dot(const float* a, const float* b, int n) noexcept { return avx2::dot(a, b, n); }
  static float dot(const bf16* a, const bf16* b, int n) noexcept { return avx2::dot(a, b, n); }
  static bool all_finite(const float* x, std::int64_t n) noexcept { return avx2::all_finite(x, n); }
};

/// The tile primitives CpuFlash's loops call (see PortableTiles in flash_tiles.hpp for the contract).
struct Avx2Tiles : Avx2Rows {
  static constexpr CpuIsa kIsa = CpuIsa::kAvx2;
  static constexpr int kPanel = avx2::kPanel;
  static void gemm(int m, int n, int kdim, const float* a, std::int64_t ai, std::int64_t ak, const float* b,
                   std::int64_t ldb, std::int64_t panel, float* c, std::int64_t ldc, bool accumulate,
                   const BlockRanges& rg = {}) noexcept {
    avx2::gemm(m, n, kdim, a, ai, ak, b, ldb, panel, c, ldc, accumulate, rg);
  }
  static float softmax_row(float* s, int lo, int hi, float& m, float& l) noexcept {
    return avx2::softmax_row(s, lo, hi, m, l);
  }
  static void backward_row(float* s, float* dp, int lo, int hi, float lse2, float delta) noexcept {
    avx2::backward_row(s, dp, lo, hi, lse2, delta);
  }
};

}  // namespace seqpar::attention::detail::avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // SEQPAR_CPU_DISPATCH
