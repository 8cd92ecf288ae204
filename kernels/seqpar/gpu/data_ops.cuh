// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The definitions of `runtime::DataOps<gpu::CudaExec>` (data_ops.hpp: the class as host code sees it;
/// nvcc only here): the executor's own work on a GPU, the members of `DataOps<HostExec>`
/// (runtime/data_ops.hpp) as kernels on `exec.stream()`. Nothing waits on the
/// host and nothing allocates per call; the lowered tables are uploaded once per cached program.
///
/// - pack / unpack: one launch moves every piece of a table slice. Threads take 16-byte windows of
///   the message region and find their piece by binary search on the pieces' offsets (a slice's
///   pieces lie back to back in increasing offsets, which `upload` checks); a window inside one
///   THD piece with 16-byte aligned rows is one vector load and store, the rest (LSE pieces, piece
///   boundaries, misaligned rows) go element by element. Unpack with `PieceCopy::accumulate` adds in
///   fp32 and rounds once; pieces that add to rows an earlier piece of the slice also writes (several
///   peers' gradients of the same rows) run in a later launch, in table order, so sums are formed in
///   the order of the host's and are deterministic.
/// - merge: the fp32 (O, LSE) merge of attention/merge.hpp on the query rows of the slices, a group
///   of lanes per (row, head). `upload` sorts every merge's slices by first query row (their device
///   copy: the kernels see the same set, in that order) so that a row finds its slice by binary search.
/// - zero / fill_empty: cudaMemsetAsync on contiguous views, a fill kernel on strided ones.
/// T: float, __half or __nv_bfloat16; A (LSE): float. Views and regions are device memory.
///
/// Traffic: pack and unpack read and write each byte once (accumulate reads the destination too),
/// merge reads O, O_part and both LSEs and writes O and LSE once.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/data_ops.hpp"
#include "seqpar/gpu/detail/element.hpp"  // kIsStorageType
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/runtime/data_ops.hpp"
#include "seqpar/runtime/lowered_program.hpp"

namespace seqpar::gpu::detail::data_ops {

using runtime::BufferId;
using runtime::kNumBuffers;
using runtime::PieceCopy;

inline constexpr int kThreads = 256;
inline constexpr int kVecBytes = 16;
using Vec = uint4;  // one 16-byte access
static_assert(sizeof(Vec) == kVecBytes);
static_assert(kNumBuffers <= 64, "data_ops::Buffers: buffer flags no longer fit 64 bits");

/// The executor's buffer table as a kernel argument (fields only: views' members are host code).
template <class T, class A>
struct Buffers {
  struct Thd {
    T* data;
    std::int64_t token_stride;
    std::int64_t head_stride;
    int head_dim;  // values per head of this buffer's rows (comm::HeadWidths::of)
  };
  struct Lse {
    A* data;
    std::int64_t head_stride;
  };
  Thd thd[kNumBuffers];
  Lse lse[kNumBuffers];
  std::uint64_t is_lse;      // bit b: buffer b holds LSE values
  std::uint64_t vectorized;  // bit b: buffer b's head_dim runs start 16-byte aligned and are 16-byte multiples
};

/// Whether every head_dim run of `v` starts 16-byte aligned and spans whole 16-byte words.
template <class T>
[[nodiscard]] bool vector_rows(const ThdView<T>& v, int head_dim) noexcept {
  const auto bytes = [](std::int64_t elements) { return elements * static_cast<std::int64_t>(sizeof(T)); };
  return reinterpret_cast<std::uintptr_t>(v.data) % kVecBytes == 0 && bytes(v.token_stride) % kVecBytes == 0 &&
         bytes(v.head_stride) % kVecBytes == 0 && bytes(head_dim) % kVecBytes == 0;
}

template <class T, class A>
[[nodiscard]] Buffers<T, A> buffers_of(const runtime::BufferTable<T, A>& b, comm::HeadWidths widths) noexcept {
  Buffers<T, A> out{};
  for (int i = 0; i < kNumBuffers; ++i) {
    const auto id = static_cast<BufferId>(i);
    const ThdView<T>& v = b[id];
    const LseView<A>& l = b.lse_of(id);
    const int head_dim = widths.of(id);
    out.thd[i] = {v.data, v.token_stride, v.head_stride, head_dim};
    out.lse[i] = {l.data, l.head_stride};
    if (comm::is_lse(id)) out.is_lse |= std::uint64_t{1} << i;
    if (vector_rows(v, head_dim)) out.vectorized |= std::uint64_t{1} << i;
  }
  return out;
}

/// Pieces [0, count) of one launch, back to back in `region` from offset `begin` to `end`; the
/// launch's threads take the 16-byte windows from `first_window` (an address) on.
struct PieceRun {
  const PieceCopy* pieces;
  int count;
  std::byte* region;
  std::int64_t begin, end;
  std::uintptr_t first_window;
  std::uint64_t windows;
};

// Conversions of the storage types, on either side (the per-item functions below are host-device,
// so that their index arithmetic can be checked on a machine without a GPU).

// Sums formed in fp32 and rounded once, as the host's `+=` on the storage type does.
template <class E>
__host__ __device__ __forceinline__ E add(E a, E b) {
  return from_float<E>(to_float(a) + to_float(b));
}

template <class T>
__host__ __device__ __forceinline__ Vec add_vec(Vec a, Vec b) {
  constexpr int n = kVecBytes / static_cast<int>(sizeof(T));
  T x[n], y[n];
  ::memcpy(x, &a, kVecBytes);
  ::memcpy(y, &b, kVecBytes);
  for (int i = 0; i < n; ++i) x[i] = add(x[i], y[i]);
  ::memcpy(&a, x, kVecBytes);
  return a;
}

// One element between its buffer and the message (whose bytes may be unaligned for E).
template <bool kUnpack, class E>
__host__ __device__ __forceinline__ void move_element(E* element, std::byte* message, bool accumulate) {
  if constexpr (!kUnpack) {
    const E x = *element;
    ::memcpy(message, &x, sizeof(E));
  } else {
    E x;
    ::memcpy(&x, message, sizeof(E));
    *element = accumulate ? add(*element, x) : x;
  }
}

// a / b and a % b, in 32 bits when both fit (a 64-bit division costs several times more).
__host__ __device__ __forceinline__ void divmod(std::uint64_t a, std::uint64_t b, std::uint64_t& q, std::uint64_t& r) {
  if (a <= 0xffffffffu && b <= 0xffffffffu) {
    const auto a32 = static_cast<std::uint32_t>(a), b32 = static_cast<std::uint32_t>(b);
    q = a32 / b32;
    r = a32 - static_cast<std::uint32_t>(q) * b32;
  } else {
    q = a / b;
    r = a - q * b;
  }
}

template <class T, class A>
__host__ __device__ __forceinline__ std::int64_t piece_bytes(const PieceCopy& c, bool lse, int d) {
  const std::int64_t n = (c.rows.end - c.rows.begin) * (c.heads.end - c.heads.begin);
  return lse ? n * static_cast<std::int64_t>(sizeof(A)) : n * d * static_cast<std::int64_t>(sizeof(T));
}

// THD pieces: rows outer, heads inner, head_dim contiguous; LSE pieces: heads outer, rows inner.
template <class T, class A>
__host__ __device__ __forceinline__ T* thd_element(const Buffers<T, A>& b, const PieceCopy& c, std::uint64_t e, int d) {
  std::uint64_t line, x, r, h;
  divmod(e, static_cast<std::uint64_t>(d), line, x);
  divmod(line, static_cast<std::uint64_t>(c.heads.end - c.heads.begin), r, h);
  const auto& v = b.thd[static_cast<int>(c.buffer)];
  return v.data + (c.rows.begin + static_cast<std::int64_t>(r)) * v.token_stride +
         (c.heads.begin + static_cast<std::int64_t>(h)) * v.head_stride + static_cast<std::int64_t>(x);
}
template <class T, class A>
__host__ __device__ __forceinline__ A* lse_element(const Buffers<T, A>& b, const PieceCopy& c, std::uint64_t e) {
  std::uint64_t h, r;
  divmod(e, static_cast<std::uint64_t>(c.rows.end - c.rows.begin), h, r);
  const auto& v = b.lse[static_cast<int>(c.buffer)];
  return v.data + (c.heads.begin + static_cast<std::int64_t>(h)) * v.head_stride + c.rows.begin +
         static_cast<std::int64_t>(r);
}

/// Moves the bytes of window `w` of `run` (pack: message <- buffers; unpack: buffers <- message).
/// `hint` is a piece at or before the window's (a thread's windows ascend); returns the window's.
template <bool kUnpack, class T, class A>
__host__ __device__ __forceinline__ int move_window(const Buffers<T, A>& b, const PieceRun& run, std::uint64_t w,
                                                    int hint) {
  const auto region = reinterpret_cast<std::uintptr_t>(run.region);
  // The window is [lo, lo + 16) in region offsets; its part in the run is [from, to).
  const std::int64_t lo =
      static_cast<std::int64_t>(run.first_window + w * kVecBytes) - static_cast<std::int64_t>(region);
  const std::int64_t from = lo > run.begin ? lo : run.begin;
  const std::int64_t to = lo + kVecBytes < run.end ? lo + kVecBytes : run.end;
  // The last piece starting at or before `from`: pieces before it end at or before its offset.
  int i = hint, last = run.count - 1;
  while (i < last) {
    const int mid = (i + last + 1) / 2;
    if (static_cast<std::int64_t>(run.pieces[mid].offset) <= from) {
      i = mid;
    } else {
      last = mid - 1;
    }
  }
  {
    const PieceCopy& c = run.pieces[i];
    const int id = static_cast<int>(c.buffer);
    const auto start = static_cast<std::int64_t>(c.offset);
    const bool lse = (b.is_lse >> id) & 1u;
    const int d = b.thd[id].head_dim;
    if (!lse && lo >= start && lo + kVecBytes <= start + piece_bytes<T, A>(c, false, d) &&
        ((b.vectorized >> id) & 1u) && (region + static_cast<std::uintptr_t>(start)) % kVecBytes == 0) {
      // 16 bytes of one head_dim run of the buffer, aligned on both sides.
      constexpr int per_vec = kVecBytes / static_cast<int>(sizeof(T));
      std::uint64_t run_index, vec, r, h;
      divmod(static_cast<std::uint64_t>(lo - start) / kVecBytes, static_cast<std::uint64_t>(d / per_vec), run_index,
             vec);
      divmod(run_index, static_cast<std::uint64_t>(c.heads.end - c.heads.begin), r, h);
      const auto& v = b.thd[id];
      T* p = v.data + (c.rows.begin + static_cast<std::int64_t>(r)) * v.token_stride +
             (c.heads.begin + static_cast<std::int64_t>(h)) * v.head_stride + static_cast<std::int64_t>(vec) * per_vec;
      Vec* m = reinterpret_cast<Vec*>(run.region + lo);
      if constexpr (!kUnpack) {
        *m = *reinterpret_cast<const Vec*>(p);
      } else if (!c.accumulate) {
        *reinterpret_cast<Vec*>(p) = *m;
      } else {
        *reinterpret_cast<Vec*>(p) = add_vec<T>(*reinterpret_cast<const Vec*>(p), *m);
      }
      return i;
    }
  }
  // Element by element: every element whose first byte lies in [from, to), in each piece there.
  for (int j = i; j < run.count; ++j) {
    const PieceCopy& c = run.pieces[j];
    const auto start = static_cast<std::int64_t>(c.offset);
    if (start >= to) break;
    const bool lse = (b.is_lse >> static_cast<int>(c.buffer)) & 1u;
    const int d = b.thd[static_cast<int>(c.buffer)].head_dim;
    const std::int64_t stop = start + piece_bytes<T, A>(c, lse, d);
    const std::int64_t first = from > start ? from : start, end = to < stop ? to : stop;
    if (first >= end) continue;
    const std::int64_t size = lse ? static_cast<std::int64_t>(sizeof(A)) : static_cast<std::int64_t>(sizeof(T));
    for (std::int64_t e = (first - start + size - 1) / size; start + e * size < end; ++e) {
      std::byte* m = run.region + start + e * size;
      if (lse) {
        move_element<kUnpack>(lse_element(b, c, static_cast<std::uint64_t>(e)), m, c.accumulate);
      } else {
        move_element<kUnpack>(thd_element(b, c, static_cast<std::uint64_t>(e), d), m, c.accumulate);
      }
    }
  }
  return i;
}

template <bool kUnpack, class T, class A>
__global__ void __launch_bounds__(kThreads) move_pieces_kernel(const Buffers<T, A> b, const PieceRun run) {
  int hint = 0;
  for (std::uint64_t w = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; w < run.windows;
       w += std::uint64_t{gridDim.x} * blockDim.x)
    hint = move_window<kUnpack>(b, run, w, hint);
}

/// Item `i` of a zero fill of a strided THD view: a 16-byte word (vectorized) or an element.
template <class T>
__host__ __device__ __forceinline__ void zero_item(T* data, std::int64_t token_stride, std::int64_t head_stride,
                                                   int heads, int head_dim, std::uint64_t i, bool vectorized) {
  const std::uint64_t per_run =
      vectorized ? static_cast<std::uint64_t>(head_dim) * sizeof(T) / kVecBytes : static_cast<std::uint64_t>(head_dim);
  std::uint64_t run, x, t, h;
  divmod(i, per_run, run, x);
  divmod(run, static_cast<std::uint64_t>(heads), t, h);
  T* row = data + static_cast<std::int64_t>(t) * token_stride + static_cast<std::int64_t>(h) * head_stride;
  if (vectorized) {
    reinterpret_cast<Vec*>(row)[x] = Vec{0, 0, 0, 0};
  } else {
    row[x] = from_float<T>(0.f);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    zero_thd_kernel(T* data, std::int64_t token_stride, std::int64_t head_stride, int heads, int head_dim,
                    std::uint64_t items, bool vectorized) {
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < items;
       i += std::uint64_t{gridDim.x} * blockDim.x)
    zero_item(data, token_stride, head_stride, heads, head_dim, i, vectorized);
}

/// Sets every element of a (heads, tokens) view to `value`.
template <class A>
__global__ void __launch_bounds__(kThreads)
    fill_lse_kernel(A* data, std::int64_t head_stride, std::int64_t tokens, std::uint64_t items, A value) {
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < items;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    std::uint64_t h, t;
    divmod(i, static_cast<std::uint64_t>(tokens), h, t);
    data[static_cast<std::int64_t>(h) * head_stride + static_cast<std::int64_t>(t)] = value;
  }
}

/// What one merge launch reads: (row, head) lines of rows [row0, row0 + lines / heads), each in the
/// slice it belongs to (slices sorted by first query row) or skipped.
template <class T>
struct MergeParams {
  T* o;
  std::int64_t o_token_stride, o_head_stride;
  const T* part;
  std::int64_t part_token_stride, part_head_stride;
  float* lse;
  std::int64_t lse_head_stride;
  const float* lse_part;
  std::int64_t lse_part_head_stride;
  const AttnSlice* slices;
  int count;
  std::int64_t row0;
  std::uint64_t lines;
  int heads;
  int per_line;     // 16-byte words (vectorized) or elements per line
  int group_shift;  // a line is handled by 2^group_shift lanes of one warp
  bool vectorized;
};

/// One (row, head) line of a merge: where it is and how its two parts combine.
struct MergeLine {
  bool active = false;  // in a slice, and the part adds something
  bool copy = false;    // the output is empty so far: O = O_part, LSE = LSE_part
  std::int64_t row = 0, head = 0;
  float merged = 0, w1 = 0, w2 = 0;
};

template <class T>
__host__ __device__ __forceinline__ MergeLine merge_line(const MergeParams<T>& p, std::uint64_t line) {
  const float ninf = -INFINITY;
  MergeLine m;
  if (line >= p.lines) return m;
  std::uint64_t r, h;
  divmod(line, static_cast<std::uint64_t>(p.heads), r, h);
  m.row = p.row0 + static_cast<std::int64_t>(r);
  m.head = static_cast<std::int64_t>(h);
  int i = 0, last = p.count - 1;
  while (i < last) {
    const int mid = (i + last + 1) / 2;
    if (p.slices[mid].q_range.begin <= m.row) {
      i = mid;
    } else {
      last = mid - 1;
    }
  }
  if (m.row < p.slices[i].q_range.begin || m.row >= p.slices[i].q_range.end) return m;  // in no slice
  const float l2 = p.lse_part[m.head * p.lse_part_head_stride + m.row];
  if (l2 == ninf) return m;  // the part adds nothing
  const float l1 = p.lse[m.head * p.lse_head_stride + m.row];
  m.active = true;
  m.copy = l1 == ninf;
  m.merged = l2;
  if (!m.copy) {
    const float mx = fmaxf(l1, l2);
    m.merged = mx + log1pf(expf(-fabsf(l1 - l2)));
    m.w1 = expf(l1 - m.merged);
    m.w2 = expf(l2 - m.merged);
  }
  return m;
}

template <class T>
__host__ __device__ __forceinline__ T merged_value(T old, T part, float w1, float w2) {
  // Rounded as the host's merge_into rounds (no fused multiply-add), then once to T.
#ifdef __CUDA_ARCH__
  return from_float<T>(__fadd_rn(__fmul_rn(to_float(old), w1), __fmul_rn(to_float(part), w2)));
#else
  const float a = to_float(old) * w1, b = to_float(part) * w2;
  return from_float<T>(a + b);
#endif
}

/// Lane `sub` of the `lanes` lanes of line `m`: its 16-byte words or elements of O.
template <class T>
__host__ __device__ __forceinline__ void merge_values(const MergeParams<T>& p, const MergeLine& m, int sub, int lanes) {
  T* dst = p.o + m.row * p.o_token_stride + m.head * p.o_head_stride;
  const T* src = p.part + m.row * p.part_token_stride + m.head * p.part_head_stride;
  for (int v = sub; v < p.per_line; v += lanes) {
    if (p.vectorized) {
      constexpr int n = kVecBytes / static_cast<int>(sizeof(T));
      Vec* d = reinterpret_cast<Vec*>(dst) + v;
      const Vec s = reinterpret_cast<const Vec*>(src)[v];
      if (m.copy) {
        *d = s;
      } else {
        T x[n], y[n];
        const Vec old = *d;
        ::memcpy(x, &old, kVecBytes);
        ::memcpy(y, &s, kVecBytes);
        for (int k = 0; k < n; ++k) x[k] = merged_value(x[k], y[k], m.w1, m.w2);
        Vec out;
        ::memcpy(&out, x, kVecBytes);
        *d = out;
      }
    } else {
      dst[v] = m.copy ? src[v] : merged_value(dst[v], src[v], m.w1, m.w2);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) merge_kernel(const MergeParams<T> p) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int lanes = 1 << p.group_shift;
  const int group = lane >> p.group_shift, sub = lane & (lanes - 1);
  const std::uint64_t groups_per_warp = 32u >> p.group_shift;
  const std::uint64_t warp = (std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  const std::uint64_t warps = std::uint64_t{gridDim.x} * blockDim.x / 32;
  // Warp-uniform loop: every lane reaches the __syncwarp below in every iteration.
  for (std::uint64_t base = warp * groups_per_warp; base < p.lines; base += warps * groups_per_warp) {
    const MergeLine m = merge_line(p, base + static_cast<std::uint64_t>(group));
    if (m.active) merge_values(p, m, sub, lanes);
    __syncwarp();  // every lane of the line has read the old LSE
    if (m.active && sub == 0) p.lse[m.head * p.lse_head_stride + m.row] = m.merged;
  }
}

// ---- launch geometry (host) ----------------------------------------------------------------------------

/// The launch of pieces [first, last) of `copies` into or out of `region`: pieces and offsets, and the
/// 16-byte windows that cover their bytes (windows == 0: nothing to move).
template <class T, class A>
[[nodiscard]] PieceRun piece_run(runtime::TableSlice<PieceCopy> copies, std::size_t first, std::size_t last,
                                 std::byte* region, comm::HeadWidths widths) noexcept {
  PieceRun run{};
  if (last <= first) return run;
  const PieceCopy& tail = copies.host[last - 1];
  const std::int64_t n = tail.rows.size() * tail.heads.size();
  const std::int64_t tail_bytes = comm::is_lse(tail.buffer)
                                      ? n * static_cast<std::int64_t>(sizeof(A))
                                      : n * widths.of(tail.buffer) * static_cast<std::int64_t>(sizeof(T));
  run.pieces = copies.mirror + first;
  run.count = static_cast<int>(last - first);
  run.region = region;
  run.begin = static_cast<std::int64_t>(copies.host[first].offset);
  run.end = static_cast<std::int64_t>(tail.offset) + tail_bytes;
  if (run.end <= run.begin) return run;
  constexpr std::uintptr_t align = kVecBytes;
  const auto base = reinterpret_cast<std::uintptr_t>(region);
  run.first_window = (base + static_cast<std::uintptr_t>(run.begin)) / align * align;
  const std::uintptr_t end_window = (base + static_cast<std::uintptr_t>(run.end) + align - 1) / align * align;
  run.windows = (end_window - run.first_window) / align;
  return run;
}

/// Splits the pieces of an unpack into launches `launch(first, last)` that can each run in any order
/// inside: an accumulating piece that meets an earlier piece of the launch (the bounding box of that
/// buffer's pieces so far) starts the next launch, so that sums are formed in the table's order.
/// (Pieces that only assign write disjoint elements, as the lowering's do.)
template <class Launch>
void for_each_launch(std::span<const PieceCopy> pieces, Launch&& launch) {
  struct Box {
    Range rows, heads;
    bool used = false;
  };
  std::array<Box, kNumBuffers> seen{};
  std::size_t first = 0;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const PieceCopy& c = pieces[i];
    Box& box = seen[static_cast<std::size_t>(c.buffer)];
    if (c.accumulate && box.used && c.rows.begin < box.rows.end && box.rows.begin < c.rows.end &&
        c.heads.begin < box.heads.end && box.heads.begin < c.heads.end) {
      launch(first, i);
      first = i;
      seen.fill(Box{});
    }
    if (!box.used) {
      box = {c.rows, c.heads, true};
    } else {
      box.rows = {std::min(box.rows.begin, c.rows.begin), std::max(box.rows.end, c.rows.end)};
      box.heads = {std::min(box.heads.begin, c.heads.begin), std::max(box.heads.end, c.heads.end)};
    }
  }
  if (first < pieces.size()) launch(first, pieces.size());
}

/// The merge of (o_part, lse_part) into (o, lse) on the query rows of `slices` (lines == 0: nothing).
template <class T>
[[nodiscard]] MergeParams<T> merge_params(ThdView<T> o, LseView<float> lse, ThdView<T> o_part, LseView<float> lse_part,
                                          runtime::TableSlice<AttnSlice> slices) noexcept {
  MergeParams<T> p{};
  if (slices.host.empty() || o.heads == 0 || o.head_dim == 0) return p;
  std::int64_t row0 = std::numeric_limits<std::int64_t>::max(), row1 = std::numeric_limits<std::int64_t>::min();
  for (const AttnSlice& s : slices.host) {
    row0 = std::min(row0, s.q_range.begin);
    row1 = std::max(row1, s.q_range.end);
  }
  if (row1 <= row0) return p;
  const int d = o.head_dim;
  p.o = o.data, p.o_token_stride = o.token_stride, p.o_head_stride = o.head_stride;
  p.part = o_part.data, p.part_token_stride = o_part.token_stride, p.part_head_stride = o_part.head_stride;
  p.lse = lse.data, p.lse_head_stride = lse.head_stride;
  p.lse_part = lse_part.data, p.lse_part_head_stride = lse_part.head_stride;
  p.slices = slices.mirror;
  p.count = static_cast<int>(slices.host.size());
  p.row0 = row0;
  p.lines = static_cast<std::uint64_t>(row1 - row0) * static_cast<std::uint64_t>(o.heads);
  p.heads = o.heads;
  p.vectorized = vector_rows(o, d) && vector_rows(o_part, d);
  p.per_line = p.vectorized ? d * static_cast<int>(sizeof(T)) / kVecBytes : d;
  p.group_shift = 0;  // the largest power of two <= per_line lanes, at most a warp
  while (p.group_shift < 5 && (2 << p.group_shift) <= p.per_line) ++p.group_shift;
  return p;
}

/// Whether a THD view is one contiguous run of tokens * heads * head_dim elements.
template <class T>
[[nodiscard]] bool contiguous(const ThdView<T>& v) noexcept {
  return (v.heads == 1 || v.head_stride == v.head_dim) &&
         (v.tokens == 1 || v.token_stride == std::int64_t{v.heads} * v.head_dim);
}

// ---- launches (host) -----------------------------------------------------------------------------------

template <class T, class A>
constexpr void check_types() {
  static_assert(kIsStorageType<T>, "DataOps<CudaExec>: T must be float, __half or __nv_bfloat16");
  static_assert(std::is_same_v<A, float>, "DataOps<CudaExec>: the LSE type A must be float");
}

// Grid-stride launches: enough blocks to fill the device several times over, no more.
// Attention sinks (attention/sinks.hpp), one thread per (row, head): O *= e^{LSE - LSE'}, LSE = LSE'.
template <class T>
__global__ void apply_sinks_kernel(ThdView<T> o, LseView<float> lse, const float* sinks) {
  const std::uint64_t items = static_cast<std::uint64_t>(o.tokens) * static_cast<std::uint64_t>(o.heads);
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < items;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    const auto t = static_cast<std::int64_t>(i / static_cast<std::uint64_t>(o.heads));
    const int h = static_cast<int>(i % static_cast<std::uint64_t>(o.heads));
    const float s = sinks[h];
    if (s == -INFINITY) continue;
    float& l_out = lse.data[h * lse.head_stride + t];
    const float l = l_out;
    const float m = fmaxf(l, s);
    const float with_sink = m + log1pf(expf(-fabsf(l - s)));
    const float keep = l == -INFINITY ? 0.f : expf(l - with_sink);
    T* row = o.data + t * o.token_stride + h * o.head_stride;  // (the views' accessors are host functions)
    for (int x = 0; x < o.head_dim; ++x) row[x] = from_float<T>(to_float(row[x]) * keep);
    l_out = with_sink;
  }
}

// One block per head: grad[h] = -sum_t e^{s_h - LSE'(h, t)} dO(t, h) . O'(t, h), a fixed-order tree
// reduction over the block's strided partial sums.
template <class T>
__global__ void sink_gradient_kernel(ThdView<const T> dout, ThdView<const T> o, LseView<const float> lse,
                                     const float* sinks, float* grad) {
  __shared__ float part[kThreads];
  const int h = static_cast<int>(blockIdx.x);
  const float s = sinks[h];
  float sum = 0.f;
  if (s != -INFINITY)
    for (std::int64_t t = threadIdx.x; t < o.tokens; t += blockDim.x) {
      const T* g = dout.data + t * dout.token_stride + h * dout.head_stride;
      const T* y = o.data + t * o.token_stride + h * o.head_stride;
      float dot = 0.f;
      for (int x = 0; x < o.head_dim; ++x) dot += to_float(g[x]) * to_float(y[x]);
      sum += expf(s - lse.data[h * lse.head_stride + t]) * dot;
    }
  part[threadIdx.x] = sum;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) part[threadIdx.x] += part[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) grad[h] = -part[0];
}

__global__ inline void sum_parts_kernel(const float* in, int parts, std::size_t n, float* out) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    float sum = 0.f;
    for (int r = 0; r < parts; ++r) sum += in[static_cast<std::size_t>(r) * n + i];
    out[i] = sum;
  }
}

inline unsigned blocks(const CudaExec& exec, std::uint64_t threads) {
  const std::uint64_t want = (threads + kThreads - 1) / kThreads;
  const std::uint64_t cap = static_cast<std::uint64_t>(std::max(exec.multiprocessors(), 1)) * 16;
  return static_cast<unsigned>(std::clamp<std::uint64_t>(want, 1, cap));
}

template <bool kUnpack, class T, class A>
void launch_pieces(const CudaExec& exec, const Buffers<T, A>& b, const PieceRun& run, const char* where) {
  if (run.windows == 0) return;
  (void)cudaGetLastError();
  move_pieces_kernel<kUnpack, T, A><<<blocks(exec, run.windows), kThreads, 0, exec.stream()>>>(b, run);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
}

template <class T>
void zero_thd(const CudaExec& exec, const ThdView<T>& v, const char* where) {
  if (v.tokens == 0 || v.heads == 0 || v.head_dim == 0) return;
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  const std::uint64_t elements = static_cast<std::uint64_t>(v.tokens) * static_cast<std::uint64_t>(v.heads) *
                                 static_cast<std::uint64_t>(v.head_dim);
  if (contiguous(v)) {
    SEQPAR_CUDA_CHECK(cudaMemsetAsync(v.data, 0, elements * sizeof(T), exec.stream()), where);
    return;
  }
  const bool vectorized = vector_rows(v, v.head_dim);
  const std::uint64_t items = vectorized ? elements * sizeof(T) / kVecBytes : elements;
  (void)cudaGetLastError();
  zero_thd_kernel<T><<<blocks(exec, items), kThreads, 0, exec.stream()>>>(v.data, v.token_stride, v.head_stride,
                                                                          v.heads, v.head_dim, items, vectorized);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
}

template <class A>
void fill_lse(const CudaExec& exec, const LseView<A>& v, A value, const char* where) {
  if (v.tokens == 0 || v.heads == 0) return;
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  const std::uint64_t items = static_cast<std::uint64_t>(v.heads) * static_cast<std::uint64_t>(v.tokens);
  if (value == A(0) && (v.heads == 1 || v.head_stride == v.tokens)) {
    SEQPAR_CUDA_CHECK(cudaMemsetAsync(v.data, 0, items * sizeof(A), exec.stream()), where);
    return;
  }
  (void)cudaGetLastError();
  fill_lse_kernel<A>
      <<<blocks(exec, items), kThreads, 0, exec.stream()>>>(v.data, v.head_stride, v.tokens, items, value);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
}

}  // namespace seqpar::gpu::detail::data_ops

namespace seqpar::runtime {

template <class T, class A>
void DataOps<gpu::CudaExec>::pack(const gpu::CudaExec& exec, const BufferTable<T, A>& b, TableSlice<PieceCopy> copies,
                                  std::byte* region, comm::HeadWidths widths) {
  namespace ops = gpu::detail::data_ops;
  ops::check_types<T, A>();
  if (copies.host.empty()) return;
  constexpr const char* where = "DataOps<CudaExec>::pack";
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  ops::launch_pieces<false>(exec, ops::buffers_of(b, widths),
                            ops::piece_run<T, A>(copies, 0, copies.host.size(), region, widths), where);
}

template <class T, class A>
void DataOps<gpu::CudaExec>::unpack(const gpu::CudaExec& exec, const BufferTable<T, A>& b, TableSlice<PieceCopy> copies,
                                    const std::byte* region, comm::HeadWidths widths) {
  namespace ops = gpu::detail::data_ops;
  ops::check_types<T, A>();
  if (copies.host.empty()) return;
  constexpr const char* where = "DataOps<CudaExec>::unpack";
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  const auto buffers = ops::buffers_of(b, widths);
  auto* message = const_cast<std::byte*>(region);  // only read: the kernel is pack's too
  ops::for_each_launch(copies.host, [&](std::size_t first, std::size_t last) {
    ops::launch_pieces<true>(exec, buffers, ops::piece_run<T, A>(copies, first, last, message, widths), where);
  });
}

template <class T, class A>
void DataOps<gpu::CudaExec>::zero(const gpu::CudaExec& exec, const BufferTable<T, A>& b,
                                  std::span<const BufferId> buffers) {
  namespace ops = gpu::detail::data_ops;
  ops::check_types<T, A>();
  constexpr const char* where = "DataOps<CudaExec>::zero";
  for (BufferId id : buffers) {
    if (comm::is_lse(id)) {
      ops::fill_lse(exec, b.lse_of(id), A(0), where);
    } else {
      ops::zero_thd(exec, b[id], where);
    }
  }
}

template <class T, class A>
void DataOps<gpu::CudaExec>::fill_empty(const gpu::CudaExec& exec, ThdView<T> o, LseView<A> lse) {
  namespace ops = gpu::detail::data_ops;
  ops::check_types<T, A>();
  constexpr const char* where = "DataOps<CudaExec>::fill_empty";
  ops::zero_thd(exec, o, where);
  ops::fill_lse(exec, lse, -std::numeric_limits<A>::infinity(), where);
}

template <class T, class A>
void DataOps<gpu::CudaExec>::merge(const gpu::CudaExec& exec, ThdView<T> o, LseView<A> lse, ThdView<T> o_part,
                                   LseView<A> lse_part, TableSlice<AttnSlice> slices) {
  namespace ops = gpu::detail::data_ops;
  ops::check_types<T, A>();
  constexpr const char* where = "DataOps<CudaExec>::merge";
  const auto p = ops::merge_params(o, lse, o_part, lse_part, slices);
  if (p.lines == 0) return;
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  (void)cudaGetLastError();
  ops::merge_kernel<T><<<ops::blocks(exec, p.lines << p.group_shift), ops::kThreads, 0, exec.stream()>>>(p);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
}

template <class T, class A>
void DataOps<gpu::CudaExec>::apply_sinks(const gpu::CudaExec& exec, ThdView<T> o, LseView<A> lse, const A* sinks) {
  namespace ops = gpu::detail::data_ops;
  ops::check_types<T, A>();
  constexpr const char* where = "DataOps<CudaExec>::apply_sinks";
  const std::uint64_t items = static_cast<std::uint64_t>(o.tokens) * static_cast<std::uint64_t>(o.heads);
  if (items == 0) return;
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  (void)cudaGetLastError();
  ops::apply_sinks_kernel<T><<<ops::blocks(exec, items), ops::kThreads, 0, exec.stream()>>>(o, lse, sinks);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
}

template <class T, class A>
void DataOps<gpu::CudaExec>::sink_gradient(const gpu::CudaExec& exec, ThdView<const T> dout, ThdView<const T> o,
                                           LseView<const A> lse, const A* sinks, A* grad) {
  namespace ops = gpu::detail::data_ops;
  ops::check_types<T, A>();
  constexpr const char* where = "DataOps<CudaExec>::sink_gradient";
  if (o.heads == 0) return;
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  (void)cudaGetLastError();
  ops::sink_gradient_kernel<T>
      <<<static_cast<unsigned>(o.heads), ops::kThreads, 0, exec.stream()>>>(dout, o, lse, sinks, grad);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
}

template <class A>
void DataOps<gpu::CudaExec>::sum_parts(const gpu::CudaExec& exec, const A* in, int parts, std::size_t n, A* out) {
  static_assert(std::is_same_v<A, float>, "DataOps<CudaExec>::sum_parts: the LSE / accumulation type is float");
  constexpr const char* where = "DataOps<CudaExec>::sum_parts";
  if (n == 0) return;
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  (void)cudaGetLastError();
  gpu::detail::data_ops::
      sum_parts_kernel<<<gpu::detail::data_ops::blocks(exec, n), gpu::detail::data_ops::kThreads, 0, exec.stream()>>>(
          in, parts, n, out);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
}

}  // namespace seqpar::runtime
