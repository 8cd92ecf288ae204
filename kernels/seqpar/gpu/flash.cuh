// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The definitions of `attention::CudaFlash<T>` (flash.hpp: the class and what it computes): the
/// argument checks, the tile table and the kernel launches, FlashAttention-2's algorithm
/// (detail/flash_forward.cuh, detail/flash_backward.cuh). For nvcc only. A .cu that includes this
/// header instantiates the members it calls; `template class seqpar::attention::CudaFlash<T>;` after it
/// compiles every member once, for C++ translation units that include flash.hpp to link
/// (kernels/instances/).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "seqpar/attention/kernel.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/status.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/detail/flash_backward.cuh"
#include "seqpar/gpu/detail/flash_forward.cuh"
#include "seqpar/gpu/detail/tile_math.hpp"
#include "seqpar/gpu/detail/tile_table.cuh"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/gpu/flash.hpp"

namespace seqpar::attention {
namespace detail {

// An instantiated head-size pair as a type: q/k size kQk, v size kV.
template <int DK, int DV>
struct HeadDims {
  static constexpr int kQk = DK;
  static constexpr int kV = DV;
};

// f(HeadDims<qk, v>{}) for a pair of kCudaFlashHeadDims: the one place a runtime pair becomes the
// kernels' template arguments. Callers have checked the shape (cuda_flash_shape_status); another pair
// is refused all the same.
template <class F>
decltype(auto) with_head_dims(int qk, int v, const char* where, F&& f) {
  static_assert(std::size(kCudaFlashHeadDims) == 3, "with_head_dims dispatches every pair of kCudaFlashHeadDims");
  if (qk == 64 && v == 64) return f(HeadDims<64, 64>{});
  if (qk == 128 && v == 128) return f(HeadDims<128, 128>{});
  if (qk == 192 && v == 128) return f(HeadDims<192, 128>{});
  throw std::invalid_argument(std::string(where) + ": head sizes " + std::to_string(qk) + "/" + std::to_string(v) +
                              " are not among the CUDA kernels' (kCudaFlashHeadDims)");
}

// CudaFlash<T>'s checks and launches (static: the class holds only its context).
template <class T>
struct CudaFlashCalls {
  static constexpr std::size_t aligned(std::size_t n) noexcept { return (n + 255) / 256 * 256; }

  // The table is sized for q_rows slices and q_rows tiles: every tile and every slice (after
  // dropping those without rows) holds at least one of the call's disjoint query rows.
  static gpu::detail::TileTableLayout table_layout(std::int64_t q_rows, int num_tiles, const char* where) {
    const int n = static_cast<int>(q_rows);
    return gpu::detail::TileTableLayout(n, n, gpu::detail::TileTableLayout::cub_bytes(n, num_tiles, where));
  }

  static void check_inputs(const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                           std::span<const AttnSlice> slices, const char* where) {
    seqpar::detail::throw_if_refused(cuda_flash_shape_status(shape, where));
    seqpar::detail::require(q.tokens < std::numeric_limits<int>::max(), where, "q.tokens", q.tokens,
                            "must be below 2^31 (tile tables index rows with 32 bits)");
    seqpar::detail::check_view(q, where, "q", q.tokens, shape.heads_q, shape.qk_dim());
    seqpar::detail::check_view(k, where, "k", k.tokens, shape.heads_kv, shape.qk_dim());
    seqpar::detail::check_view(v, where, "v", k.tokens, shape.heads_kv, shape.v_dim());
    // The slices themselves are in device memory (checked where they were uploaded); their count
    // bounds the tile table.
    if (static_cast<std::int64_t>(slices.size()) > q.tokens)
      seqpar::detail::throw_invalid(where, "slices.size()", slices.size(),
                                    "exceeds q.tokens = " + std::to_string(q.tokens) +
                                        ": drop slices without query rows (gpu::DeviceSlices does)");
  }

  static std::size_t workspace_bytes(const AttentionShape& shape, std::int64_t q_rows) {
    if (q_rows <= 0) return 0;
    const std::size_t delta =
        aligned(sizeof(float) * static_cast<std::size_t>(shape.heads_q) * static_cast<std::size_t>(q_rows));
    return delta + table_layout(q_rows, static_cast<int>(q_rows), "CudaFlash::workspace_bytes").bytes;
  }

  static void check_workspace(const AttentionShape& shape, std::int64_t q_rows, std::span<std::byte> workspace,
                              const char* where) {
    const std::size_t need = workspace_bytes(shape, q_rows);
    if (workspace.size() < need)
      seqpar::detail::throw_invalid(where, "workspace.size()", workspace.size(),
                                    "needs workspace_bytes() = " + std::to_string(need));
  }

  static gpu::detail::DeviceThd<const T> device(ThdView<const T> v) { return {v.data, v.token_stride, v.head_stride}; }
  static gpu::detail::DeviceThd<T> device(ThdView<T> v) { return {v.data, v.token_stride, v.head_stride}; }

  static void fill_empty(ThdView<T> o, LseView<float> lse, const AttentionShape& shape, cudaStream_t stream,
                         const char* where) {
    const std::int64_t n = o.tokens * shape.heads_q * shape.v_dim();
    const int blocks = static_cast<int>(std::min<std::int64_t>((n + 255) / 256, 4096));
    gpu::detail::fill_empty_kernel<T>
        <<<blocks, 256, 0, stream>>>(device(o), {lse.data, lse.head_stride}, o.tokens, shape.heads_q, shape.v_dim());
    SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
  }

  // What a launch reads: the slices, the tile table over them and the grid's tile count (blocks past
  // the table's length exit).
  struct CallTables {
    const AttnSlice* slices = nullptr;
    int num_slices = 0;
    gpu::detail::TileTable table;
    std::int64_t tiles = 0;
  };

  // Builds the tile table of `slices` for tiles of `rows` query rows in the workspace after `skip`
  // bytes, on the device (a direct call without Params).
  static CallTables tile_table(std::span<const AttnSlice> slices, std::int64_t q_rows, int rows,
                               std::span<std::byte> workspace, std::size_t skip, cudaStream_t stream,
                               const char* where) {
    const std::int64_t tiles = gpu::detail::max_tiles(q_rows, static_cast<std::int64_t>(slices.size()), rows);
    const auto layout = table_layout(q_rows, static_cast<int>(tiles), where);
    const auto table =
        gpu::detail::build_tile_table(slices.data(), static_cast<int>(slices.size()), rows, static_cast<int>(tiles),
                                      layout, workspace.data() + skip, stream, where);
    return {slices.data(), static_cast<int>(slices.size()), table, tiles};
  }

  // The prepared call's tables (CudaFlash::prepare).
  static CallTables tables(const CudaFlashParams& p) {
    return {p.slices, static_cast<int>(p.num_slices), {p.tiles, p.length}, p.num_tiles};
  }

  // Rows per tile of the pass's tiled kernel (the forward's, or the dQ kernel's) at the shape's head sizes.
  static int rows_per_tile(const AttentionShape& shape, Pass pass, const char* where) {
    return with_head_dims(shape.qk_dim(), shape.v_dim(), where, [pass](auto dims) {
      using D = decltype(dims);
      return pass == Pass::kForward ? gpu::detail::ForwardPlan<T, D::kQk, D::kV>::kRows
                                    : gpu::detail::DqPlan<T, D::kQk, D::kV>::kRows;
    });
  }

  // Params are the prepared call's: same pass, head sizes, q rows and slice count.
  static void check_params(const CudaFlashParams& p, Pass pass, const AttentionShape& shape, std::int64_t q_rows,
                           std::span<const AttnSlice> slices, const char* where) {
    const auto mismatch = [&](const char* what, auto have, auto want) {
      seqpar::detail::throw_invalid(where, std::string("params.") + what, have,
                                    "the call has " + std::to_string(want) + ": pass the Params prepare() made for it");
    };
    if (p.pass != pass) mismatch("pass", static_cast<int>(p.pass), static_cast<int>(pass));
    if (p.head_dim != shape.head_dim) mismatch("head_dim", p.head_dim, shape.head_dim);
    if (p.head_dim_v != shape.v_dim()) mismatch("head_dim_v", p.head_dim_v, shape.v_dim());
    if (p.q_rows != q_rows) mismatch("q_rows", p.q_rows, q_rows);
    if (p.num_slices != static_cast<std::int64_t>(slices.size()))
      mismatch("num_slices", p.num_slices, static_cast<std::int64_t>(slices.size()));
    if (const int rows = rows_per_tile(shape, pass, where); p.rows_per_tile != rows)
      mismatch("rows_per_tile", p.rows_per_tile, rows);
  }

  template <class Kernel>
  static void allow_shared(Kernel kernel, std::size_t bytes, int head_dim, int head_dim_v, const gpu::CudaExec& exec,
                           const char* where) {
    if (Status s = cuda_flash_shared_status(exec, bytes, head_dim, head_dim_v, where); !s)
      throw Error(Errc::kStepFailed, s.reason);
    SEQPAR_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), where);
  }

  static unsigned grid_of(std::int64_t blocks, const char* where) {
    if (blocks > std::numeric_limits<int>::max())
      throw std::invalid_argument(std::string(where) + ": " + std::to_string(blocks) +
                                  " blocks exceed the grid's limit (2^31 - 1)");
    return static_cast<unsigned>(blocks);
  }

  // The forward on `prepared` tables, or (null) on a tile table built in the workspace now.
  template <int DK, int DV>
  static void launch_forward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q,
                             ThdView<const T> k, ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o,
                             LseView<float> lse, std::span<std::byte> workspace, const CudaFlashParams* prepared,
                             const char* where) {
    using Plan = gpu::detail::ForwardPlan<T, DK, DV>;
    const cudaStream_t stream = exec.stream();
    const CallTables t = prepared != nullptr ? tables(*prepared)
                                             : tile_table(slices, q.tokens, Plan::kRows, workspace, 0, stream, where);
    if (t.tiles == 0) return;
    gpu::detail::ForwardParams<T> p{device(q),
                                    device(k),
                                    device(v),
                                    device(o),
                                    {lse.data, lse.head_stride},
                                    shape.heads_q,
                                    shape.group_size(),
                                    static_cast<float>(shape.scale()),
                                    t.slices,
                                    t.table};
    const auto kernel = gpu::detail::flash_forward_kernel<T, DK, DV>;
    allow_shared(kernel, Plan::kBytes, DK, DV, exec, where);
    kernel<<<grid_of(t.tiles * shape.heads_q, where), Plan::kThreads, Plan::kBytes, stream>>>(p);
    SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
  }

  template <int DK, int DV>
  static void launch_backward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q,
                              ThdView<const T> k, ThdView<const T> v, ThdView<const T> o, LseView<const float> lse,
                              ThdView<const T> dout, std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk,
                              ThdView<T> dv, std::span<std::byte> workspace, const CudaFlashParams* prepared,
                              const char* where) {
    using DqPlan = gpu::detail::DqPlan<T, DK, DV>;
    using DkvPlan = gpu::detail::DkvPlan<T, DK, DV>;
    const cudaStream_t stream = exec.stream();
    auto* delta = reinterpret_cast<float*>(workspace.data());
    const std::size_t delta_bytes =
        aligned(sizeof(float) * static_cast<std::size_t>(shape.heads_q) * static_cast<std::size_t>(q.tokens));
    const CallTables t = prepared != nullptr
                             ? tables(*prepared)
                             : tile_table(slices, q.tokens, DqPlan::kRows, workspace, delta_bytes, stream, where);
    if (t.tiles == 0) return;  // no query rows: nothing to add
    gpu::detail::BackwardParams<T> p{device(q),
                                     device(k),
                                     device(v),
                                     device(o),
                                     device(dout),
                                     device(dq),
                                     device(dk),
                                     device(dv),
                                     {lse.data, lse.head_stride},
                                     {delta, q.tokens},
                                     q.tokens,
                                     k.tokens,
                                     shape.heads_q,
                                     shape.heads_kv,
                                     shape.group_size(),
                                     DV,
                                     static_cast<float>(shape.scale()),
                                     t.slices,
                                     t.num_slices,
                                     t.table};
    const std::int64_t warps = q.tokens * shape.heads_q;
    gpu::detail::delta_kernel<T><<<grid_of((warps + 7) / 8, where), 256, 0, stream>>>(p);
    SEQPAR_CUDA_CHECK(cudaGetLastError(), where);

    const auto dq_kernel = gpu::detail::flash_dq_kernel<T, DK, DV>;
    allow_shared(dq_kernel, DqPlan::kBytes, DK, DV, exec, where);
    dq_kernel<<<grid_of(t.tiles * shape.heads_q, where), DqPlan::kThreads, DqPlan::kBytes, stream>>>(p);
    SEQPAR_CUDA_CHECK(cudaGetLastError(), where);

    const auto dkv_kernel = gpu::detail::flash_dkv_kernel<T, DK, DV>;
    allow_shared(dkv_kernel, DkvPlan::kBytes, DK, DV, exec, where);
    const dim3 grid(grid_of((k.tokens + DkvPlan::kKeys - 1) / DkvPlan::kKeys, where),
                    static_cast<unsigned>(shape.heads_kv));
    dkv_kernel<<<grid, DkvPlan::kThreads, DkvPlan::kBytes, stream>>>(p);
    SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
  }
};

}  // namespace detail

template <class T>
std::size_t CudaFlash<T>::workspace_bytes(const AttentionShape& shape, std::int64_t q_rows,
                                          std::int64_t /*k_rows*/) const {
  return detail::CudaFlashCalls<T>::workspace_bytes(shape, q_rows);
}

template <class T>
std::size_t CudaFlash<T>::shared_bytes(int head_dim, int head_dim_v) {
  const int v = head_dim_v != 0 ? head_dim_v : head_dim;
  return detail::with_head_dims(head_dim, v, "CudaFlash::shared_bytes", [](auto dims) {
    using D = decltype(dims);
    return std::max({gpu::detail::ForwardPlan<T, D::kQk, D::kV>::kBytes, gpu::detail::DqPlan<T, D::kQk, D::kV>::kBytes,
                     gpu::detail::DkvPlan<T, D::kQk, D::kV>::kBytes});
  });
}

template <class T>
CudaFlashParams CudaFlash<T>::prepare(const gpu::CudaExec& exec, const AttentionShape& shape,
                                      std::span<const AttnSlice> host_slices, std::int64_t q_rows, std::int64_t k_rows,
                                      Pass pass) const {
  using Calls = detail::CudaFlashCalls<T>;
  constexpr const char* where = "CudaFlash::prepare";
  seqpar::detail::throw_if_refused(cuda_flash_shape_status(shape, where));
  seqpar::detail::require(q_rows < std::numeric_limits<int>::max(), where, "q_rows", q_rows,
                          "must be below 2^31 (tile tables index rows with 32 bits)");
  validate_slices(host_slices, q_rows, k_rows, where);
  Params p;
  p.pass = pass;
  p.head_dim = shape.head_dim;
  p.head_dim_v = shape.v_dim();
  p.rows_per_tile = Calls::rows_per_tile(shape, pass, where);
  p.q_rows = q_rows;
  p.num_slices = static_cast<std::int64_t>(host_slices.size());
  const gpu::detail::PreparedBlock block = gpu::detail::prepared_block(host_slices, p.rows_per_tile);
  const gpu::detail::PreparedLayout layout(host_slices.size(), block.num_tiles);
  p.num_tiles = static_cast<std::int64_t>(block.num_tiles);
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  p.storage = gpu::DeviceBytes(layout.bytes);
  SEQPAR_CUDA_CHECK(
      cudaMemcpyAsync(p.storage.data(), block.bytes.data(), block.bytes.size(), cudaMemcpyHostToDevice, exec.stream()),
      where);
  SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), where);  // `block` is freed on return
  p.slices = reinterpret_cast<const AttnSlice*>(p.storage.data() + layout.slices);
  p.tiles = reinterpret_cast<const std::uint64_t*>(p.storage.data() + layout.tiles);
  p.length = reinterpret_cast<const unsigned*>(p.storage.data() + layout.length);
  return p;
}

template <class T>
void CudaFlash<T>::forward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q,
                           ThdView<const T> k, ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o,
                           LseView<float> lse, std::span<std::byte> workspace) {
  run_forward(exec, nullptr, shape, q, k, v, slices, o, lse, workspace);
}

template <class T>
void CudaFlash<T>::forward(const gpu::CudaExec& exec, const Params& params, const AttentionShape& shape,
                           ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                           std::span<const AttnSlice> slices, ThdView<T> o, LseView<float> lse,
                           std::span<std::byte> workspace) {
  run_forward(exec, &params, shape, q, k, v, slices, o, lse, workspace);
}

template <class T>
void CudaFlash<T>::backward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q,
                            ThdView<const T> k, ThdView<const T> v, ThdView<const T> o, LseView<const float> lse,
                            ThdView<const T> dout, std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk,
                            ThdView<T> dv, std::span<std::byte> workspace) {
  run_backward(exec, nullptr, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
}

template <class T>
void CudaFlash<T>::backward(const gpu::CudaExec& exec, const Params& params, const AttentionShape& shape,
                            ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                            LseView<const float> lse, ThdView<const T> dout, std::span<const AttnSlice> slices,
                            ThdView<T> dq, ThdView<T> dk, ThdView<T> dv, std::span<std::byte> workspace) {
  run_backward(exec, &params, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
}

template <class T>
void CudaFlash<T>::run_forward(const gpu::CudaExec& exec, const Params* params, const AttentionShape& shape,
                               ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                               std::span<const AttnSlice> slices, ThdView<T> o, LseView<float> lse,
                               std::span<std::byte> workspace) {
  using Calls = detail::CudaFlashCalls<T>;
  constexpr const char* where = "CudaFlash::forward";
  Calls::check_inputs(shape, q, k, v, slices, where);
  if (params != nullptr) Calls::check_params(*params, Pass::kForward, shape, q.tokens, slices, where);
  seqpar::detail::check_view(o, where, "o", q.tokens, shape.heads_q, shape.v_dim());
  seqpar::detail::check_view(lse, where, "lse", shape.heads_q, q.tokens);
  Calls::check_workspace(shape, q.tokens, workspace, where);
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  const cudaStream_t stream = exec.stream();
  if (q.tokens == 0) return;
  Calls::fill_empty(o, lse, shape, stream, where);
  if (slices.empty()) return;
  detail::with_head_dims(shape.qk_dim(), shape.v_dim(), where, [&](auto dims) {
    using D = decltype(dims);
    Calls::template launch_forward<D::kQk, D::kV>(exec, shape, q, k, v, slices, o, lse, workspace, params, where);
  });
}

template <class T>
void CudaFlash<T>::run_backward(const gpu::CudaExec& exec, const Params* params, const AttentionShape& shape,
                                ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                                LseView<const float> lse, ThdView<const T> dout, std::span<const AttnSlice> slices,
                                ThdView<T> dq, ThdView<T> dk, ThdView<T> dv, std::span<std::byte> workspace) {
  using Calls = detail::CudaFlashCalls<T>;
  constexpr const char* where = "CudaFlash::backward";
  Calls::check_inputs(shape, q, k, v, slices, where);
  if (params != nullptr) Calls::check_params(*params, Pass::kBackward, shape, q.tokens, slices, where);
  seqpar::detail::check_view(o, where, "o", q.tokens, shape.heads_q, shape.v_dim());
  seqpar::detail::check_view(lse, where, "lse", shape.heads_q, q.tokens);
  seqpar::detail::check_view(dout, where, "dout", q.tokens, shape.heads_q, shape.v_dim());
  seqpar::detail::check_view(dq, where, "dq", q.tokens, shape.heads_q, shape.qk_dim());
  seqpar::detail::check_view(dk, where, "dk", k.tokens, shape.heads_kv, shape.qk_dim());
  seqpar::detail::check_view(dv, where, "dv", k.tokens, shape.heads_kv, shape.v_dim());
  Calls::check_workspace(shape, q.tokens, workspace, where);
  SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
  if (q.tokens == 0 || k.tokens == 0 || slices.empty()) return;
  detail::with_head_dims(shape.qk_dim(), shape.v_dim(), where, [&](auto dims) {
    using D = decltype(dims);
    Calls::template launch_backward<D::kQk, D::kV>(exec, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace,
                                                   params, where);
  });
}

}  // namespace seqpar::attention
