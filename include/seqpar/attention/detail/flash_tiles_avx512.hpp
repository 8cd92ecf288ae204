// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// CpuFlash's AVX-512 tile primitives (namespace detail::avx512), compiled for AVX-512 F/BW/DQ/VL by a target
// region whatever the build's -march, and the policy `Avx512Tiles` CpuFlash runs them through when the CPU
// (and its OS) support AVX-512 (cpu_isa.hpp). The row primitives are the AVX2 ones (AVX-512 CPUs have AVX2).
#pragma once

#include "seqpar/attention/cpu_isa.hpp"
#include "seqpar/attention/detail/flash_tiles.hpp"
#include "seqpar/attention/detail/flash_tiles_avx2.hpp"

#if SEQPAR_CPU_DISPATCH

#include "seqpar/attention/detail/simd_intrinsics.hpp"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
// GCC 12 reports -Wmaybe-uninitialized inside the AVX-512 intrinsics once they are inlined here (their
// _mm512_undefined_ps(), GCC PR105593, fixed in GCC 13). simd_intrinsics.hpp silences it at the header when it
// includes it first; when the user's code included <immintrin.h> before, only this region can.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace seqpar::attention::detail::avx512 {

/// Columns per B panel of the micro-kernel (6 rows x 64 columns in 24 zmm accumulators).
inline constexpr int kPanel = 64;

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
      // Column ranges at 16-column (one vector) granularity within the 64-column panel: along a mask edge a row
      // block's visible keys rarely fill the panel (a document's rows start anywhere in it, and each of its key tiles
      // and its diagonal has such an edge). Counted for the forward of bench/attention_cpu's 4K document mix (11
      // documents, 38 to 934 tokens): S = Q K^T computed 1.21x the visible scores at panel granularity, 1.07x at
      // vector granularity (issue 41).
      int v0 = 0, v1 = nv;
      if (rg.col_lo != nullptr) {
        const int lo = std::max(rg.col_lo[rb] - j0, 0), hi = std::min(rg.col_hi[rb] - j0, w);
        if (lo >= hi) continue;
        v0 = lo / 16;
        v1 = (hi + 15) / 16;
      }
      const int k0 = rg.k_lo != nullptr ? rg.k_lo[rb] : 0;
      const int kn = rg.k_lo != nullptr ? rg.k_hi[rb] - k0 : kdim;
      const float* ab = a + i0 * ai + k0 * ak;
      const float* bb = bj + k0 * ldb + 16 * v0;
      float* cb = c + i0 * ldc + j0 + 16 * v0;
      const __mmask16 last = v1 == nv ? tail : __mmask16(0xFFFF);  // the mask of the block's last vector
      const int r = std::min(kRowBlock, m - i0);
      if (v1 - v0 == 4 && r == kRowBlock && last == 0xFFFF) {  // the hot case, inlined
        gemm_block<6, 4>(kn, ab, ai, ak, bb, ldb, cb, ldc, last, accumulate);
        continue;
      }
      GemmBlockFn fn = nullptr;
      switch (r) {
        case 1:
          fn = gemm_block_for<1>(v1 - v0);
          break;
        case 2:
          fn = gemm_block_for<2>(v1 - v0);
          break;
        case 3:
          fn = gemm_block_for<3>(v1 - v0);
          break;
        case 4:
          fn = gemm_block_for<4>(v1 - v0);
          break;
        case 5:
          fn = gemm_block_for<5>(v1 - v0);
          break;
        default:
          fn = gemm_block_for<6>(v1 - v0);
          break;
      }
      fn(kn, ab, ai, ak, bb, ldb, cb, ldc, last, accumulate);
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

/// The tile primitives CpuFlash's loops call (see PortableTiles in flash_tiles.hpp for the contract).
struct Avx512Tiles : avx2::Avx2Rows {
  static constexpr CpuIsa kIsa = CpuIsa::kAvx512;
  static constexpr int kPanel = avx512::kPanel;
  static void gemm(int m, int n, int kdim, const float* a, std::int64_t ai, std::int64_t ak, const float* b,
                   std::int64_t ldb, std::int64_t panel, float* c, std::int64_t ldc, bool accumulate,
                   const BlockRanges& rg = {}) noexcept {
    avx512::gemm(m, n, kdim, a, ai, ak, b, ldb, panel, c, ldc, accumulate, rg);
  }
  static float softmax_row(float* s, int lo, int hi, float& m, float& l) noexcept {
    return avx512::softmax_row(s, lo, hi, m, l);
  }
  static void backward_row(float* s, float* dp, int lo, int hi, float lse2, float delta) noexcept {
    avx512::backward_row(s, dp, lo, hi, lse2, delta);
  }
};

}  // namespace seqpar::attention::detail::avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#endif  // SEQPAR_CPU_DISPATCH
