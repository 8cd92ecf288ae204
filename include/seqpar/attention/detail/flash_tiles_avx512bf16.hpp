// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// CpuFlash's bf16 dot-product tiles (namespace detail::avx512bf16), compiled for AVX-512 with AVX512-BF16 by a target
// region whatever the build's -march, and the policy `Avx512Bf16Tiles` CpuFlash<bf16> runs them through when the CPU
// has AVX512-BF16 (cpu_isa.hpp, CpuIsa::kAvx512Bf16).
//
// vdpbf16ps (Intel SDM, VDPBF16PS) adds to each fp32 lane the two products of a pair of bf16 values from each
// operand: C[j] += A(k) B(k, j) + A(k + 1) B(k + 1, j), two multiply-adds per fp32 lane per instruction against one
// for vfmadd. A bf16 x bf16 product is exact in fp32 (8-bit significands), and the instruction adds the two products
// into the lane one after the other with fp32 round-to-nearest-even (input and output denormals are flushed to zero),
// so a product of bf16 inputs is as accurate as the fp32 tiles' (sums in another order).
//
// Used for the score products S = Q K^T and dP = dO V^T, whose inputs are the caller's bf16 values (Q and dO unscaled:
// converted back to bf16 they are exact; the softmax scale is applied to the fp32 result, `alpha`), and for the
// forward's O += P V, with P (fp32, in [0, 2^8] under the lazy rescale) rounded to bf16 as FlashAttention does on GPUs:
// a relative error of at most 2^-9 per weight, while the row sum l is taken over the unrounded P (as FlashAttention
// // does too); and for the backward's dV += P^T dO, dK += dS^T Q and dQ += dS K, with P and dS rounded to bf16
// likewise (FlashAttention-2's backward rounds P and dS to the input type before these products). Accumulation stays
// fp32.
#pragma once

#include <cstdint>

#include "seqpar/attention/cpu_isa.hpp"
#include "seqpar/attention/detail/bf16.hpp"
#include "seqpar/attention/detail/flash_tiles.hpp"
#include "seqpar/attention/detail/flash_tiles_avx512.hpp"

#if SEQPAR_CPU_DISPATCH

#include "seqpar/attention/detail/simd_intrinsics.hpp"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma")
// GCC 12's PR105593 false positive inside the AVX-512 intrinsics (see flash_tiles_avx512.hpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace seqpar::attention::detail::avx512bf16 {

/// Columns per B panel, as the AVX-512 fp32 tiles (6 rows x 64 columns in 24 zmm accumulators).
inline constexpr int kPanel = avx512::kPanel;
/// Pairs of the reduction dimension per chunk of A converted to bf16 at once (256 values of a row).
inline constexpr int kChunkPairs = 128;
/// Rows of A converted at once: CpuFlash's score blocks (48 rows), so that each B panel is read from L1 by all of
/// them, as in the fp32 tiles.
inline constexpr int kGroupRows = 8 * kRowBlock;

// The bf16-pair vector type is `short` lanes in GCC 12 / Clang 14 and `__bf16` lanes later: a vector cast serves both.
SEQPAR_ALWAYS_INLINE __m512bh as_pairs(__m512i x) noexcept {
  return (__m512bh)x;
}

SEQPAR_ALWAYS_INLINE __mmask16 first_lanes(int count) noexcept {
  const int c = std::clamp(count, 0, 16);
  return static_cast<__mmask16>((1u << c) - 1u);
}

/// n floats of a row (exactly bf16 values when they came from bf16) into bf16 pairs: word x of out holds values 2x
/// (low half) and 2x + 1 (high half), rounded to nearest even; values past n are 0. Writes whole 16-word vectors:
/// out has room for (n + 31) / 32 * 16 words.
SEQPAR_ALWAYS_INLINE void row_to_pairs(const float* x, int n, std::uint32_t* out) noexcept {
  for (int v = 0; v < n; v += 32) {
    const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(n - v), x + v);
    const __m512 hi = _mm512_maskz_loadu_ps(first_lanes(n - v - 16), x + v + 16);
    // vcvtne2ps2bf16 puts its second operand's 16 values in the low half: lo then hi, in row order.
    _mm512_storeu_si512(out + v / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

/// /// acc[i] += the products of A's pair (i, k) (a[i * ai + k * ak]) with B's pair row bk (kMask: its bits ANDed with
/// keep).
template <int R, int kNV, bool kMask>
SEQPAR_ALWAYS_INLINE void pair_step(__m512 (&acc)[R][kNV], const std::uint32_t* a, int ai, int ak, int k,
                                    const std::uint32_t* bk, __m512i keep) noexcept {
  __m512i bv[kNV];
  SEQPAR_UNROLL
  for (int v = 0; v < kNV; ++v) {
    bv[v] = _mm512_loadu_si512(bk + 16 * v);  // panels are 64 wide (zero padded)
    if constexpr (kMask) bv[v] = _mm512_and_si512(bv[v], keep);
  }
  SEQPAR_UNROLL
  for (int i = 0; i < R; ++i) {
    const __m512i x = _mm512_set1_epi32(static_cast<int>(a[i * ai + k * ak]));
    SEQPAR_UNROLL
    for (int v = 0; v < kNV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], as_pairs(x), as_pairs(bv[v]));
  }
}

/// C block of R rows x 16 kNV columns (the first w of them stored) = (C if accumulate, else 0) + alpha * A B over kp
/// pairs: A's word (i, k) at a[i * ai + k * ak], B's pair row k at b[k * kPanel, + 16 kNV) (a panel's columns from
/// b on). B's first and last pair rows are ANDed with keep_first / keep_last (~0u: all of them), which drop the value
/// beside an exact range's odd end.
template <int R, int kNV>
SEQPAR_ALWAYS_INLINE void pair_block(int kp, const std::uint32_t* a, int ai, int ak, const std::uint32_t* b, float* c,
                                     std::int64_t ldc, int w, bool accumulate, float alpha, std::uint32_t keep_first,
                                     std::uint32_t keep_last) noexcept {
  __mmask16 lanes[kNV];
  SEQPAR_UNROLL
  for (int v = 0; v < kNV; ++v) lanes[v] = first_lanes(w - 16 * v);
  __m512 acc[R][kNV];
  SEQPAR_UNROLL
  for (int i = 0; i < R; ++i) {
    SEQPAR_UNROLL
    for (int v = 0; v < kNV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  int k = 0, k_end = kp;
  if (keep_first != ~0u && kp > 0)
    pair_step<R, kNV, true>(acc, a, ai, ak, k++, b, _mm512_set1_epi32(static_cast<int>(keep_first)));
  const bool peel_last = keep_last != ~0u && k_end > k;
  if (peel_last) --k_end;
  for (; k < k_end; ++k) pair_step<R, kNV, false>(acc, a, ai, ak, k, b + k * kPanel, _mm512_setzero_si512());
  if (peel_last)
    pair_step<R, kNV, true>(acc, a, ai, ak, k_end, b + k_end * kPanel, _mm512_set1_epi32(static_cast<int>(keep_last)));
  const __m512 scale = _mm512_set1_ps(alpha);
  SEQPAR_UNROLL
  for (int i = 0; i < R; ++i) {
    SEQPAR_UNROLL
    for (int v = 0; v < kNV; ++v) {
      float* cv = c + i * ldc + 16 * v;
      const __m512 r = accumulate ? _mm512_fmadd_ps(acc[i][v], scale, _mm512_maskz_loadu_ps(lanes[v], cv))
                                  : _mm512_mul_ps(acc[i][v], scale);
      _mm512_mask_storeu_ps(cv, lanes[v], r);
    }
  }
}

/// /// C[i][j] (+)= alpha * sum_k A(i, k) B(k, j) for i < m, j < n, k < kdim, with A(i, k) = a[i * ai + (k - a_shift) *
/// ak] (ak == 1: rows, a_shift 0; or ai == 1: columns, e.g. P^T; A(i, k) = 0 for k < a_shift; fp32 values rounded to
/// bf16: exact for values that came from bf16) and B as bf16 pairs: pair row k / 2 of column panel j / 64 at b[(j / 64)
/// * panel + (k / 2) * 64, + 64) (pack_key_pairs, pack_row_pairs), every panel 64 columns wide and ceil(kdim / 2) pair
/// rows deep. BlockRanges as the fp32 gemm's: col_lo / col_hi (multiples of 16), and k_lo / k_hi, which are widened to
/// whole pairs: A must be 0 and B finite at a widened end (a masked weight beside a visible one; a pack's zero
/// padding), unless `exact_ends`: then the value of B beside an odd end is dropped (B may hold a NaN there), and the
/// sums are bit for bit those of the widened range over a finite B.
inline void gemm_pairs(int m, int n, int kdim, const float* a, std::int64_t ai, std::int64_t ak, const std::uint32_t* b,
                       std::int64_t panel, float* c, std::int64_t ldc, bool accumulate, float alpha,
                       const BlockRanges& rg = {}, bool exact_ends = false, int a_shift = 0) noexcept {
  alignas(64) std::uint32_t ap[kGroupRows * kChunkPairs];
  const int kp_all = (kdim + 1) / 2;
  for (int g0 = 0; g0 < m; g0 += kGroupRows) {
    const int gm = std::min(kGroupRows, m - g0);
    for (int p0 = 0; p0 < kp_all; p0 += kChunkPairs) {
      const int kp = std::min(kChunkPairs, kp_all - p0);
      const bool first = p0 == 0;
      // the chunk of A as pairs: ap[i * pai + j * pak] holds A(g0 + i, 2 (p0 + j)) and A(g0 + i, 2 (p0 + j) + 1)
      int pai = kChunkPairs, pak = 1;
      if (ak == 1) {
        for (int i = 0; i < gm; ++i)
          row_to_pairs(a + (g0 + i) * ai + 2 * p0, std::min(kdim - 2 * p0, 2 * kChunkPairs), ap + i * kChunkPairs);
      } else {  // columns: two rows of A^T, 16 rows of A at a time, interleaved into pairs
        pai = 1;
        pak = kGroupRows;
        for (int j = 0; j < kp; ++j) {
          const int k0 = 2 * (p0 + j) - a_shift;  // A's k of the pair's first value
          for (int v = 0; v < kGroupRows / 16; ++v) {
            const __mmask16 rows = first_lanes(gm - 16 * v);
            const float* col = a + g0 + 16 * v;
            const __m512 x0 =
                k0 >= 0 && k0 < kdim - a_shift ? _mm512_maskz_loadu_ps(rows, col + k0 * ak) : _mm512_setzero_ps();
            const __m512 x1 =
                k0 + 1 < kdim - a_shift ? _mm512_maskz_loadu_ps(rows, col + (k0 + 1) * ak) : _mm512_setzero_ps();
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x0));
            const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x1));
            _mm512_storeu_si512(ap + j * kGroupRows + 16 * v, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
          }
        }
      }
      for (int j0 = 0; j0 < n; j0 += kPanel) {
        const int w = std::min(kPanel, n - j0);
        const std::uint32_t* bj = b + (j0 / kPanel) * panel + p0 * kPanel;
        for (int i0 = 0; i0 < gm; i0 += kRowBlock) {
          const int rb = (g0 + i0) / kRowBlock;
          // the block's columns of the panel, at 16-column granularity (as the fp32 gemm: a row block along a mask
          // edge sees a few vectors of the panel)
          int c_lo = 0, c_hi = w;
          if (rg.col_lo != nullptr) {
            c_lo = std::max(rg.col_lo[rb] - j0, 0) / 16 * 16;
            c_hi = std::min((rg.col_hi[rb] - j0 + 15) / 16 * 16, w);
            if (c_lo >= c_hi) continue;
          }
          const int wb = c_hi - c_lo;  // stored columns from c_lo (vectors ceil(wb / 16))
          // this block's pairs of the chunk (relative to p0)
          int pl = 0, ph = kp;
          std::uint32_t keep_first = ~0u, keep_last = ~0u;
          if (rg.k_lo != nullptr) {
            const int lo = rg.k_lo[rb], hi = rg.k_hi[rb];
            pl = std::clamp(lo / 2 - p0, 0, kp);
            ph = std::clamp((hi + 1) / 2 - p0, pl, kp);
            // an odd lo: keep the high (odd) value of its pair; an odd hi: the low value of the last pair
            if (exact_ends && lo % 2 != 0 && lo / 2 - p0 == pl && pl < ph) keep_first = 0xFFFF0000u;
            if (exact_ends && hi % 2 != 0 && (hi + 1) / 2 - p0 == ph && pl < ph) keep_last = 0x0000FFFFu;
          }
          const std::uint32_t* ab = ap + i0 * pai + pl * pak;
          const std::uint32_t* bb = bj + pl * kPanel + c_lo;
          float* cb = c + (g0 + i0) * ldc + j0 + c_lo;
          const bool add = accumulate || !first;  // a later chunk adds to the earlier chunks' sums
          const int nv = (wb + 15) / 16;
          const auto run = [&]<int R>() {
            switch (nv) {
              case 1:
                pair_block<R, 1>(ph - pl, ab, pai, pak, bb, cb, ldc, wb, add, alpha, keep_first, keep_last);
                break;
              case 2:
                pair_block<R, 2>(ph - pl, ab, pai, pak, bb, cb, ldc, wb, add, alpha, keep_first, keep_last);
                break;
              case 3:
                pair_block<R, 3>(ph - pl, ab, pai, pak, bb, cb, ldc, wb, add, alpha, keep_first, keep_last);
                break;
              default:
                pair_block<R, 4>(ph - pl, ab, pai, pak, bb, cb, ldc, wb, add, alpha, keep_first, keep_last);
                break;
            }
          };
          switch (std::min(kRowBlock, gm - i0)) {
            case 1:
              run.template operator()<1>();
              break;
            case 2:
              run.template operator()<2>();
              break;
            case 3:
              run.template operator()<3>();
              break;
            case 4:
              run.template operator()<4>();
              break;
            case 5:
              run.template operator()<5>();
              break;
            default:
              run.template operator()<6>();
              break;
          }
        }
      }
    }
  }
}

/// One key's row of d bf16 values as column c of a pair-packed K^T panel: word x (values 2x and 2x + 1, the second 0
/// past d) at col[x * ld]; row == nullptr writes zeros (keys past the tile's end).
inline void pack_key_pairs(const bf16* row, int d, std::uint32_t* col, std::int64_t ld) noexcept {
  const int pairs = (d + 1) / 2;
  if (row == nullptr) {
    for (int x = 0; x < pairs; ++x) col[x * ld] = 0;
    return;
  }
  for (int x = 0; x < d / 2; ++x)
    col[x * ld] = std::uint32_t{row[2 * x].bits} | (std::uint32_t{row[2 * x + 1].bits} << 16);
  if (d % 2 != 0) col[(d / 2) * ld] = row[d - 1].bits;
}

/// Two rows of d bf16 values (nullptr: zeros, past the tile's end) as one pair row of head-dim panels: word
/// (values r0[x], r1[x]) at dst[(x / 64) * panel + x % 64], zero for x in [d, whole panels).
inline void pack_row_pairs(const bf16* r0, const bf16* r1, int d, std::uint32_t* dst, std::int64_t panel) noexcept {
  const int width = (d + kPanel - 1) / kPanel * kPanel;
  for (int x = 0; x < width; ++x) {
    const std::uint32_t lo = x < d && r0 != nullptr ? r0[x].bits : 0u, hi = x < d && r1 != nullptr ? r1[x].bits : 0u;
    dst[(x / kPanel) * panel + x % kPanel] = lo | (hi << 16);
  }
}

/// The tile primitives CpuFlash<bf16>'s loops call: Avx512Tiles (see PortableTiles in flash_tiles.hpp for the
/// contract), plus the bf16 products. kBf16Scores tells CpuFlash to pack K^T and V^T by pack_key_pairs, to keep Q
/// /// unscaled and to compute S and dP by gemm_pairs, and the forward's V and the backward's K, Q and dO rows by
/// pack_row_pairs for P V, dQ, dK and dV.
struct Avx512Bf16Tiles : avx512::Avx512Tiles {
  static constexpr CpuIsa kIsa = CpuIsa::kAvx512Bf16;
  static constexpr bool kBf16Scores = true;
  static void gemm_pairs(int m, int n, int kdim, const float* a, std::int64_t ai, std::int64_t ak,
                         const std::uint32_t* b, std::int64_t panel, float* c, std::int64_t ldc, bool accumulate,
                         float alpha, const BlockRanges& rg = {}, bool exact_ends = false, int a_shift = 0) noexcept {
    avx512bf16::gemm_pairs(m, n, kdim, a, ai, ak, b, panel, c, ldc, accumulate, alpha, rg, exact_ends, a_shift);
  }
  static void pack_row_pairs(const bf16* r0, const bf16* r1, int d, std::uint32_t* dst, std::int64_t panel) noexcept {
    avx512bf16::pack_row_pairs(r0, r1, d, dst, panel);
  }
  static void pack_key_pairs(const bf16* row, int d, std::uint32_t* col, std::int64_t ld) noexcept {
    avx512bf16::pack_key_pairs(row, d, col, ld);
  }
};

}  // namespace seqpar::attention::detail::avx512bf16

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#endif  // SEQPAR_CPU_DISPATCH

namespace seqpar::attention::detail {
/// Whether tile policy Tiles computes the score products S and dP from bf16 pairs (Avx512Bf16Tiles).
template <class Tiles>
inline constexpr bool kBf16Scores = requires {
  requires Tiles::kBf16Scores;
};
}  // namespace seqpar::attention::detail
