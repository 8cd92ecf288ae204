// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// FlashAttention-2 forward over a tile table (Dao, "FlashAttention-2", 2023, Algorithm 1): one block
/// per (query tile, head), the tile's queries stay in shared memory while the block walks the key
/// tiles its rows can see, keeping the running row maximum m and sum l (online softmax) and the
/// unnormalized output in fp32; O = acc / l and LSE = m + log(l) at the end. A warp owns 16 query
/// rows from scores to output, so only the key/value loads need the whole block.

#include <cstdint>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/gpu/detail/flash_common.cuh"
#include "seqpar/gpu/detail/tile_table.cuh"
#include "seqpar/gpu/detail/warp_gemm.cuh"

namespace seqpar::gpu::detail {

/// Tile shapes and the shared-memory plan of the forward kernel at q/k head size DK and v head size DV
/// (Q and K tiles DK wide, V and the O accumulator DV wide). 16-bit types pad rows by 8 elements (WMMA
/// alignment, fewer bank conflicts); fp32 tiles by 1 (conflict-free scalar reads). Bytes at 192/128:
/// fp32 140544, fp16/bf16 129024 (sm_80 allows 166912 per block, sm_90 232448).
template <class T, int DK, int DV>
struct ForwardPlan {
  static constexpr bool kHalf = kIsHalfPrecision<T>;
  static constexpr int kRows = 64;
  static constexpr int kKeys = kHalf ? 64 : 32;
  static constexpr int kWarps = kRows / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLdQk = DK + (kHalf ? 8 : 1);  ///< Q and K tiles
  static constexpr int kLdV = DV + (kHalf ? 8 : 1);
  static constexpr int kLdS = kKeys + (kHalf ? 4 : 1);
  static constexpr int kLdP = kKeys + (kHalf ? 8 : 1);
  static constexpr int kLdO = DV + (kHalf ? 4 : 1);
  static constexpr std::size_t align(std::size_t n) { return (n + 127) / 128 * 128; }
  static constexpr std::size_t kQ = 0;
  static constexpr std::size_t kK = kQ + align(sizeof(T) * kRows * kLdQk);
  static constexpr std::size_t kV = kK + align(sizeof(T) * kKeys * kLdQk);
  static constexpr std::size_t kS = kV + align(sizeof(T) * kKeys * kLdV);
  static constexpr std::size_t kP = kS + align(sizeof(float) * kRows * kLdS);
  static constexpr std::size_t kO = kP + align(sizeof(T) * kRows * kLdP);
  static constexpr std::size_t kBytes = kO + align(sizeof(float) * kRows * kLdO);
};

template <class T>
struct ForwardParams {
  DeviceThd<const T> q, k, v;
  DeviceThd<T> o;
  DeviceLse<float> lse;
  int heads_q;
  int group;  ///< query heads per kv head
  float scale;
  const AttnSlice* slices;
  TileTable table;
};

template <class T, int DK, int DV>
__global__ void __launch_bounds__(ForwardPlan<T, DK, DV>::kThreads) flash_forward_kernel(ForwardParams<T> p) {
  using Plan = ForwardPlan<T, DK, DV>;
  extern __shared__ __align__(128) unsigned char smem[];
  const std::int64_t tile = blockIdx.x / p.heads_q;
  if (tile >= static_cast<std::int64_t>(*p.table.length)) return;
  const int h = static_cast<int>(blockIdx.x % p.heads_q), hk = h / p.group;
  const std::uint64_t entry = p.table.tiles[tile];
  const AttnSlice s = p.slices[tile_slice(entry)];
  const std::int64_t q_len = s.q_range.end - s.q_range.begin, k_len = s.k_range.end - s.k_range.begin;
  const std::int64_t r0 = tile_index(entry) * Plan::kRows;
  const int rows = static_cast<int>(q_len - r0 < Plan::kRows ? q_len - r0 : Plan::kRows);

  T* qs = reinterpret_cast<T*>(smem + Plan::kQ);
  T* ks = reinterpret_cast<T*>(smem + Plan::kK);
  T* vs = reinterpret_cast<T*>(smem + Plan::kV);
  float* ss = reinterpret_cast<float*>(smem + Plan::kS);
  T* ps = reinterpret_cast<T*>(smem + Plan::kP);
  float* os = reinterpret_cast<float*>(smem + Plan::kO);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;

  load_rows<T, DK, Plan::kRows, Plan::kThreads>(qs, Plan::kLdQk, p.q, h, s.q_range.begin + r0, rows);
  for (int e = tid; e < Plan::kRows * DV; e += Plan::kThreads) os[(e / DV) * Plan::kLdO + e % DV] = 0.0f;
  // The zeroing is block-strided (another warp zeroes some of this warp's rows): without this barrier a
  // tile that sees no key (an empty key range, a causal offset or window ending before the keys) would
  // write O from shared memory nothing ordered it after (review 2026-12-04, B1).
  __syncthreads();

  // Two lanes per query row: lane / 2 is the row within the warp's 16, lane % 2 the half of the columns.
  const int row = warp * 16 + lane / 2, half = lane % 2;
  const bool row_ok = row < rows;
  const KeySpan vis = row_ok ? visible_keys(s.mask, r0 + row, k_len) : KeySpan{0, 0};
  float m = -INFINITY, l = 0.0f;
  const KeySpan keys = keys_of_rows(s, r0, r0 + rows);
  for (std::int64_t kb = keys.begin; kb < keys.end; kb += Plan::kKeys) {
    const int valid = static_cast<int>(keys.end - kb < Plan::kKeys ? keys.end - kb : Plan::kKeys);
    __syncthreads();  // every warp is done with the previous key tile
    load_rows<T, DK, Plan::kKeys, Plan::kThreads>(ks, Plan::kLdQk, p.k, hk, s.k_range.begin + kb, valid);
    load_rows<T, DV, Plan::kKeys, Plan::kThreads>(vs, Plan::kLdV, p.v, hk, s.k_range.begin + kb, valid);
    __syncthreads();
    gemm_nt<T, Plan::kKeys, DK>(qs + warp * 16 * Plan::kLdQk, Plan::kLdQk, ks, Plan::kLdQk, ss + warp * 16 * Plan::kLdS,
                                Plan::kLdS);
    // Online softmax on this lane's half row. Masked scores are -inf, never the product: a masked
    // key may belong to another document and hold anything.
    float* sr = ss + row * Plan::kLdS;
    T* pr = ps + row * Plan::kLdP;
    constexpr int kHalfCols = Plan::kKeys / 2;
    const int c0 = half * kHalfCols;
    float mx = -INFINITY;
    for (int c = c0; c < c0 + kHalfCols; ++c) {
      const std::int64_t kj = kb + c;
      const float x = (kj >= vis.begin && kj < vis.end) ? sr[c] * p.scale : -INFINITY;
      sr[c] = x;
      mx = max_keep_nan(mx, x);
    }
    mx = max_keep_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = max_keep_nan(m, mx);
    const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
    for (int c = c0; c < c0 + kHalfCols; ++c) {
      const float pv = m_new == -INFINITY ? 0.0f : expf(sr[c] - m_new);
      pr[c] = from_float<T>(pv);
      sum += pv;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    if (alpha != 1.0f) {
      float* orow = os + row * Plan::kLdO;
      for (int c = half * (DV / 2); c < (half + 1) * (DV / 2); ++c) orow[c] *= alpha;
    }
    __syncwarp();
    gemm_nn_acc<T, DV, Plan::kKeys>(ps + warp * 16 * Plan::kLdP, Plan::kLdP, vs, Plan::kLdV,
                                    os + warp * 16 * Plan::kLdO, Plan::kLdO);
  }
  __syncwarp();
  if (!row_ok) return;
  const std::int64_t t = s.q_range.begin + r0 + row;
  T* out = p.o.row(t, h);
  // l == 0: the row saw no key (O = 0, LSE = -inf); a NaN l (a NaN score) stays NaN in both.
  const float inv = l == 0.0f ? 0.0f : 1.0f / l;
  for (int c = half * (DV / 2); c < (half + 1) * (DV / 2); ++c) out[c] = from_float<T>(os[row * Plan::kLdO + c] * inv);
  if (half == 0) p.lse(h, t) = l == 0.0f ? -INFINITY : m + logf(l);
}

}  // namespace seqpar::gpu::detail
