// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// FlashAttention-2 backward (Dao 2023, Algorithm 2), in three deterministic kernels:
///  1. delta = rowsum(dO * O) per query row and head (fp32, in the workspace);
///  2. dQ over the tile table: one block per (query tile, head) walks the key tiles its rows see,
///     recomputes P = exp(scale * S - LSE), dS = P * (dO V^T - delta), and accumulates dQ += dS K;
///  3. dK, dV per key tile of the key buffer and kv head: the block walks every slice that reads its
///     keys, every query head of its GQA group and the query tiles that see the keys, accumulating
///     dV += P^T dO and dK += dS^T Q, with S^T = K Q^T computed directly (no transposes).
/// Every output element is owned by one block and summed in a fixed order: no atomics, the same bits
/// on every run. The price is recomputing S and P in kernels 2 and 3 (7 products where FA2's atomic
/// dQ needs 5). Results are added (+=) to dq, dk, dv, as the kernel concept says.
/// Head sizes, as in the host kernels: Q K^T (and K Q^T) contracts over the q/k size DK, and dQ = dS K,
/// dK = dS^T Q are DK wide; dO V^T (and V dO^T) and delta contract over the v size DV, and dV = P^T dO
/// is DV wide.

#include <cstdint>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/gpu/detail/flash_common.cuh"
#include "seqpar/gpu/detail/tile_table.cuh"
#include "seqpar/gpu/detail/warp_gemm.cuh"

namespace seqpar::gpu::detail {

template <class T>
struct BackwardParams {
  DeviceThd<const T> q, k, v, o, dout;
  DeviceThd<T> dq, dk, dv;
  DeviceLse<const float> lse;
  DeviceLse<float> delta;
  std::int64_t q_rows, k_rows;
  int heads_q, heads_kv, group;
  int head_dim_v;  ///< values per head of o and dout (what delta sums over)
  float scale;
  const AttnSlice* slices;
  int num_slices;
  TileTable table;  ///< query tiles, for the dQ kernel
};

/// delta(h, t) = sum_d dO(t, h, d) * O(t, h, d) over the v head size: one warp per (row, head).
template <class T>
__global__ void delta_kernel(BackwardParams<T> p) {
  const std::int64_t w = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (w >= p.q_rows * p.heads_q) return;
  const std::int64_t t = w / p.heads_q;
  const int h = static_cast<int>(w % p.heads_q);
  const T* o = p.o.row(t, h);
  const T* d = p.dout.row(t, h);
  float sum = 0.0f;
  for (int c = lane; c < p.head_dim_v; c += 32) sum += to_float(o[c]) * to_float(d[c]);
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) p.delta(h, t) = sum;
}

/// The dQ kernel's tiles and shared memory at q/k head size DK and v head size DV: Q, K and the dQ
/// accumulator DK wide, dO and V DV wide. 16-bit types take 64 keys per step up to DK 128 and 32 above,
/// so that DK 192 fits sm_80's 166912 bytes per block (64 keys: 180224). Bytes at 192/128: fp32
/// 119808, fp16/bf16 138240.
template <class T, int DK, int DV>
struct DqPlan {
  static constexpr bool kHalf = kIsHalfPrecision<T>;
  static constexpr int kRows = kHalf ? 64 : 32;
  static constexpr int kKeys = kHalf && DK <= 128 ? 64 : 32;
  static constexpr int kWarps = kRows / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLdQk = DK + (kHalf ? 8 : 1);  ///< Q and K tiles
  static constexpr int kLdV = DV + (kHalf ? 8 : 1);   ///< dO and V tiles
  static constexpr int kLdS = kKeys + (kHalf ? 4 : 1);
  static constexpr int kLdP = kKeys + (kHalf ? 8 : 1);
  static constexpr int kLdAcc = DK + (kHalf ? 4 : 1);
  static constexpr std::size_t align(std::size_t n) { return (n + 127) / 128 * 128; }
  static constexpr std::size_t kQ = 0;
  static constexpr std::size_t kDo = kQ + align(sizeof(T) * kRows * kLdQk);
  static constexpr std::size_t kK = kDo + align(sizeof(T) * kRows * kLdV);
  static constexpr std::size_t kV = kK + align(sizeof(T) * kKeys * kLdQk);
  static constexpr std::size_t kS = kV + align(sizeof(T) * kKeys * kLdV);
  static constexpr std::size_t kDp = kS + align(sizeof(float) * kRows * kLdS);
  static constexpr std::size_t kDs = kDp + align(sizeof(float) * kRows * kLdS);
  static constexpr std::size_t kAcc = kDs + align(sizeof(T) * kRows * kLdP);
  static constexpr std::size_t kBytes = kAcc + align(sizeof(float) * kRows * kLdAcc);
};

template <class T, int DK, int DV>
__global__ void __launch_bounds__(DqPlan<T, DK, DV>::kThreads) flash_dq_kernel(BackwardParams<T> p) {
  using Plan = DqPlan<T, DK, DV>;
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
  T* dos = reinterpret_cast<T*>(smem + Plan::kDo);
  T* ks = reinterpret_cast<T*>(smem + Plan::kK);
  T* vs = reinterpret_cast<T*>(smem + Plan::kV);
  float* ss = reinterpret_cast<float*>(smem + Plan::kS);
  float* dps = reinterpret_cast<float*>(smem + Plan::kDp);
  T* dss = reinterpret_cast<T*>(smem + Plan::kDs);
  float* acc = reinterpret_cast<float*>(smem + Plan::kAcc);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;

  load_rows<T, DK, Plan::kRows, Plan::kThreads>(qs, Plan::kLdQk, p.q, h, s.q_range.begin + r0, rows);
  load_rows<T, DV, Plan::kRows, Plan::kThreads>(dos, Plan::kLdV, p.dout, h, s.q_range.begin + r0, rows);
  for (int e = tid; e < Plan::kRows * DK; e += Plan::kThreads) acc[(e / DK) * Plan::kLdAcc + e % DK] = 0.0f;
  // Block-strided zeroing: a tile that sees no key reads acc after this barrier only (review B1).
  __syncthreads();

  const int row = warp * 16 + lane / 2, half = lane % 2;
  const bool row_ok = row < rows;
  const std::int64_t t = s.q_range.begin + r0 + row;
  const float lse = row_ok ? p.lse(h, t) : -INFINITY;
  const float delta = row_ok ? p.delta(h, t) : 0.0f;
  // A row with LSE = -inf saw no key in the forward: its probabilities are all zero.
  const KeySpan vis = row_ok && lse != -INFINITY ? visible_keys(s.mask, r0 + row, k_len) : KeySpan{0, 0};
  const KeySpan keys = keys_of_rows(s, r0, r0 + rows);
  for (std::int64_t kb = keys.begin; kb < keys.end; kb += Plan::kKeys) {
    const int valid = static_cast<int>(keys.end - kb < Plan::kKeys ? keys.end - kb : Plan::kKeys);
    __syncthreads();
    load_rows<T, DK, Plan::kKeys, Plan::kThreads>(ks, Plan::kLdQk, p.k, hk, s.k_range.begin + kb, valid);
    load_rows<T, DV, Plan::kKeys, Plan::kThreads>(vs, Plan::kLdV, p.v, hk, s.k_range.begin + kb, valid);
    __syncthreads();
    gemm_nt<T, Plan::kKeys, DK>(qs + warp * 16 * Plan::kLdQk, Plan::kLdQk, ks, Plan::kLdQk, ss + warp * 16 * Plan::kLdS,
                                Plan::kLdS);
    gemm_nt<T, Plan::kKeys, DV>(dos + warp * 16 * Plan::kLdV, Plan::kLdV, vs, Plan::kLdV, dps + warp * 16 * Plan::kLdS,
                                Plan::kLdS);
    constexpr int kHalfCols = Plan::kKeys / 2;
    for (int c = half * kHalfCols; c < (half + 1) * kHalfCols; ++c) {
      const std::int64_t kj = kb + c;
      const bool ok = kj >= vis.begin && kj < vis.end;
      const float pv = ok ? expf(ss[row * Plan::kLdS + c] * p.scale - lse) : 0.0f;
      dss[row * Plan::kLdP + c] = from_float<T>(ok ? pv * (dps[row * Plan::kLdS + c] - delta) : 0.0f);
    }
    __syncwarp();
    gemm_nn_acc<T, DK, Plan::kKeys>(dss + warp * 16 * Plan::kLdP, Plan::kLdP, ks, Plan::kLdQk,
                                    acc + warp * 16 * Plan::kLdAcc, Plan::kLdAcc);
  }
  __syncwarp();
  if (!row_ok) return;
  T* out = p.dq.row(t, h);
  for (int c = half * (DK / 2); c < (half + 1) * (DK / 2); ++c)
    out[c] = from_float<T>(to_float(out[c]) + p.scale * acc[row * Plan::kLdAcc + c]);
}

/// The dK/dV kernel's tiles and shared memory at q/k head size DK and v head size DV: K, Q and the dK
/// accumulator DK wide, V, dO and the dV accumulator DV wide. 16-bit types hold 64 keys per block up
/// to DK 128 and 32 above, so that DK 192 fits sm_80's 166912 bytes per block (64 keys: 177408). Bytes
/// at 192/128: fp32 140800, fp16/bf16 99584.
template <class T, int DK, int DV>
struct DkvPlan {
  static constexpr bool kHalf = kIsHalfPrecision<T>;
  static constexpr int kKeys = kHalf && DK <= 128 ? 64 : 32;  ///< key rows of a block, 16 per warp
  static constexpr int kRows = 32;                            ///< query rows per step
  static constexpr int kWarps = kKeys / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLdQk = DK + (kHalf ? 8 : 1);  ///< K and Q tiles
  static constexpr int kLdV = DV + (kHalf ? 8 : 1);   ///< V and dO tiles
  static constexpr int kLdS = kRows + (kHalf ? 4 : 1);
  static constexpr int kLdP = kRows + (kHalf ? 8 : 1);
  static constexpr int kLdDk = DK + (kHalf ? 4 : 1);
  static constexpr int kLdDv = DV + (kHalf ? 4 : 1);
  static constexpr std::size_t align(std::size_t n) { return (n + 127) / 128 * 128; }
  static constexpr std::size_t kK = 0;
  static constexpr std::size_t kV = kK + align(sizeof(T) * kKeys * kLdQk);
  static constexpr std::size_t kQ = kV + align(sizeof(T) * kKeys * kLdV);
  static constexpr std::size_t kDo = kQ + align(sizeof(T) * kRows * kLdQk);
  static constexpr std::size_t kSt = kDo + align(sizeof(T) * kRows * kLdV);
  static constexpr std::size_t kDpt = kSt + align(sizeof(float) * kKeys * kLdS);
  static constexpr std::size_t kPt = kDpt + align(sizeof(float) * kKeys * kLdS);
  static constexpr std::size_t kDst = kPt + align(sizeof(T) * kKeys * kLdP);
  static constexpr std::size_t kDk = kDst + align(sizeof(T) * kKeys * kLdP);
  static constexpr std::size_t kDv = kDk + align(sizeof(float) * kKeys * kLdDk);
  static constexpr std::size_t kLse = kDv + align(sizeof(float) * kKeys * kLdDv);
  static constexpr std::size_t kDelta = kLse + align(sizeof(float) * kRows);
  static constexpr std::size_t kBytes = kDelta + align(sizeof(float) * kRows);
};

/// Grid: (key tiles of the key buffer, kv heads).
template <class T, int DK, int DV>
__global__ void __launch_bounds__(DkvPlan<T, DK, DV>::kThreads) flash_dkv_kernel(BackwardParams<T> p) {
  using Plan = DkvPlan<T, DK, DV>;
  extern __shared__ __align__(128) unsigned char smem[];
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * Plan::kKeys;
  const int hk = static_cast<int>(blockIdx.y);
  const int valid_keys = static_cast<int>(p.k_rows - c0 < Plan::kKeys ? p.k_rows - c0 : Plan::kKeys);
  const std::int64_t c1 = c0 + valid_keys;

  T* ks = reinterpret_cast<T*>(smem + Plan::kK);
  T* vs = reinterpret_cast<T*>(smem + Plan::kV);
  T* qs = reinterpret_cast<T*>(smem + Plan::kQ);
  T* dos = reinterpret_cast<T*>(smem + Plan::kDo);
  float* st = reinterpret_cast<float*>(smem + Plan::kSt);
  float* dpt = reinterpret_cast<float*>(smem + Plan::kDpt);
  T* pt = reinterpret_cast<T*>(smem + Plan::kPt);
  T* dst = reinterpret_cast<T*>(smem + Plan::kDst);
  float* dk = reinterpret_cast<float*>(smem + Plan::kDk);
  float* dv = reinterpret_cast<float*>(smem + Plan::kDv);
  float* lse_s = reinterpret_cast<float*>(smem + Plan::kLse);
  float* delta_s = reinterpret_cast<float*>(smem + Plan::kDelta);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;

  load_rows<T, DK, Plan::kKeys, Plan::kThreads>(ks, Plan::kLdQk, p.k, hk, c0, valid_keys);
  load_rows<T, DV, Plan::kKeys, Plan::kThreads>(vs, Plan::kLdV, p.v, hk, c0, valid_keys);
  for (int e = tid; e < Plan::kKeys * DK; e += Plan::kThreads) dk[(e / DK) * Plan::kLdDk + e % DK] = 0.0f;
  for (int e = tid; e < Plan::kKeys * DV; e += Plan::kThreads) dv[(e / DV) * Plan::kLdDv + e % DV] = 0.0f;

  // Two lanes per key row of the warp's 16; each takes half of the query columns.
  const int key = warp * 16 + lane / 2, half = lane % 2;
  for (int si = 0; si < p.num_slices; ++si) {
    const AttnSlice s = p.slices[si];
    const std::int64_t lo = c0 > s.k_range.begin ? c0 : s.k_range.begin;
    const std::int64_t hi = c1 < s.k_range.end ? c1 : s.k_range.end;
    if (lo >= hi) continue;  // block-uniform: every thread reads the same slice
    const std::int64_t k_len = s.k_range.end - s.k_range.begin;
    const KeySpan rows = rows_of_keys(s, lo - s.k_range.begin, hi - s.k_range.begin);
    const std::int64_t kj = c0 + key - s.k_range.begin;  // this lane's key, slice-relative
    const bool key_ok = c0 + key >= lo && c0 + key < hi;
    // A key tile that straddles the slice's keys holds rows of another document, whose P and dS
    // here are zero; a NaN or Inf in this slice's q or dout times those zeros would reach that
    // document's dK/dV through the tensor-core product. Such a tile scans its q/dout rows and, when
    // one holds a non-finite value, its straddling warps accumulate by hand over the entries they
    // see (rare: the tensor cores do everything else; the kernel cases' non-finite isolation).
    const bool tile_straddles = lo > c0 || hi < c1;  // block-uniform
    const std::int64_t warp_lo = c0 + warp * 16, warp_hi = warp_lo + 16 < c1 ? warp_lo + 16 : c1;
    const bool warp_straddles = warp_lo < lo || warp_hi > hi;  // warp-uniform
    for (int g = 0; g < p.group; ++g) {
      const int h = hk * p.group + g;
      for (std::int64_t qb = rows.begin; qb < rows.end; qb += Plan::kRows) {
        const int valid = static_cast<int>(rows.end - qb < Plan::kRows ? rows.end - qb : Plan::kRows);
        __syncthreads();  // every warp is done with the previous query tile
        load_rows<T, DK, Plan::kRows, Plan::kThreads>(qs, Plan::kLdQk, p.q, h, s.q_range.begin + qb, valid);
        load_rows<T, DV, Plan::kRows, Plan::kThreads>(dos, Plan::kLdV, p.dout, h, s.q_range.begin + qb, valid);
        for (int r = tid; r < Plan::kRows; r += Plan::kThreads) {
          lse_s[r] = r < valid ? p.lse(h, s.q_range.begin + qb + r) : -INFINITY;
          delta_s[r] = r < valid ? p.delta(h, s.q_range.begin + qb + r) : 0.0f;
        }
        // This thread's share of the tiles (the elements load_rows gave it, so no barrier is needed
        // before reading them) is not finite.
        bool bad = false;
        if (tile_straddles) {
          for (int e = tid; e < valid * DK; e += Plan::kThreads)
            bad = bad || !isfinite(to_float(qs[(e / DK) * Plan::kLdQk + e % DK]));
          for (int e = tid; e < valid * DV; e += Plan::kThreads)
            bad = bad || !isfinite(to_float(dos[(e / DV) * Plan::kLdV + e % DV]));
        }
        const bool by_hand = __syncthreads_or(bad) != 0 && warp_straddles;  // warp-uniform
        gemm_nt<T, Plan::kRows, DK>(ks + warp * 16 * Plan::kLdQk, Plan::kLdQk, qs, Plan::kLdQk,
                                    st + warp * 16 * Plan::kLdS, Plan::kLdS);
        gemm_nt<T, Plan::kRows, DV>(vs + warp * 16 * Plan::kLdV, Plan::kLdV, dos, Plan::kLdV,
                                    dpt + warp * 16 * Plan::kLdS, Plan::kLdS);
        constexpr int kHalfCols = Plan::kRows / 2;
        static_assert(Plan::kRows <= 32, "seen_mask holds one bit per query row of the step");
        unsigned seen_mask = 0;  // the query rows this lane's key sees (its half of them)
        for (int j = half * kHalfCols; j < (half + 1) * kHalfCols; ++j) {
          const std::int64_t qi = qb + j;
          bool ok = key_ok && j < valid && lse_s[j] != -INFINITY;
          if (ok) {
            const KeySpan vis = visible_keys(s.mask, qi, k_len);
            ok = kj >= vis.begin && kj < vis.end;
          }
          const float pv = ok ? expf(st[key * Plan::kLdS + j] * p.scale - lse_s[j]) : 0.0f;
          pt[key * Plan::kLdP + j] = from_float<T>(pv);
          dst[key * Plan::kLdP + j] = from_float<T>(ok ? pv * (dpt[key * Plan::kLdS + j] - delta_s[j]) : 0.0f);
          seen_mask |= ok ? 1u << j : 0u;
        }
        __syncwarp();
        if (!by_hand) {
          gemm_nn_acc<T, DV, Plan::kRows>(pt + warp * 16 * Plan::kLdP, Plan::kLdP, dos, Plan::kLdV,
                                          dv + warp * 16 * Plan::kLdDv, Plan::kLdDv);
          gemm_nn_acc<T, DK, Plan::kRows>(dst + warp * 16 * Plan::kLdP, Plan::kLdP, qs, Plan::kLdQk,
                                          dk + warp * 16 * Plan::kLdDk, Plan::kLdDk);
        } else {
          // The same sums as the products above (P and dS rounded to T as they are), over the query
          // rows this lane's key sees only. Its key row is its own and its half of the columns.
          const int lane_pair = lane ^ 1;
          const unsigned seen = seen_mask | __shfl_sync(0xffffffffu, seen_mask, lane_pair);
          for (int c = half * (DV / 2); c < (half + 1) * (DV / 2); ++c) {
            float sv = 0.0f;
            for (int j = 0; j < Plan::kRows; ++j)
              if (seen >> j & 1u) sv += to_float(pt[key * Plan::kLdP + j]) * to_float(dos[j * Plan::kLdV + c]);
            dv[key * Plan::kLdDv + c] += sv;
          }
          for (int c = half * (DK / 2); c < (half + 1) * (DK / 2); ++c) {
            float sk = 0.0f;
            for (int j = 0; j < Plan::kRows; ++j)
              if (seen >> j & 1u) sk += to_float(dst[key * Plan::kLdP + j]) * to_float(qs[j * Plan::kLdQk + c]);
            dk[key * Plan::kLdDk + c] += sk;
          }
        }
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < valid_keys * DK; e += Plan::kThreads) {
    const int r = e / DK, c = e % DK;
    T* k_out = p.dk.row(c0 + r, hk);
    k_out[c] = from_float<T>(to_float(k_out[c]) + p.scale * dk[r * Plan::kLdDk + c]);
  }
  for (int e = tid; e < valid_keys * DV; e += Plan::kThreads) {
    const int r = e / DV, c = e % DV;
    T* v_out = p.dv.row(c0 + r, hk);
    v_out[c] = from_float<T>(to_float(v_out[c]) + dv[r * Plan::kLdDv + c]);
  }
}

}  // namespace seqpar::gpu::detail
