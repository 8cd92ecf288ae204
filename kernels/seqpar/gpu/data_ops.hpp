// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `runtime::DataOps<gpu::CudaExec>` as host code sees it: the executor's own work on a GPU (pack,
/// unpack, zero, fill_empty, merge; the members of `DataOps<HostExec>`, runtime/data_ops.hpp), with
/// the table upload and the workspace here and the kernel launches declared. Their definitions are
/// in data_ops.cuh (nvcc only; what they do is described there). A .cu that includes data_ops.cuh
/// instantiates what it uses; a C++ translation unit that runs an engine on `CudaExec` (any
/// `DistributedAttention<S, attention::CudaFlash<T>>`) includes this header and links a .cu that
/// instantiates the members for its T (kernels/instances/data_ops.cu: float, __half, __nv_bfloat16
/// with A = float), as flash.hpp explains for CudaFlash.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/runtime/data_ops.hpp"
#include "seqpar/runtime/lowered_program.hpp"

namespace seqpar::gpu::detail::data_ops {

/// The slice table as the device holds it, after checking what the kernels rely on: every run of
/// copies the executor packs or unpacks lies in increasing offsets, and every merge's slices have
/// disjoint query rows; each merge's slices are sorted by first query row (std::logic_error if not).
[[nodiscard]] inline std::vector<AttnSlice> device_slices(const runtime::LoweredProgram& lp, const char* where) {
  const auto ascending = [&](runtime::TableSpan s) {
    for (std::uint32_t i = s.first + 1; i < s.first + s.count; ++i)
      if (lp.copies[i].offset < lp.copies[i - 1].offset)
        throw std::logic_error(std::string(where) + ": copies " + std::to_string(i - 1) + " and " + std::to_string(i) +
                               " of a packed run are not in increasing offsets");
  };
  std::vector<AttnSlice> slices = lp.slices;
  for (const runtime::LoweredOp& op : lp.ops) {
    if (const auto* e = std::get_if<runtime::ExchangeOp>(&op.op)) {
      ascending(e->pack);
      ascending(e->unpack);
    } else if (const auto* p = std::get_if<runtime::PostOp>(&op.op)) {
      for (const runtime::TransferEntry& t : lp.view(lp.transfers, p->sends)) ascending(t.copies);
    } else if (const auto* w = std::get_if<runtime::WaitOp>(&op.op)) {
      ascending(w->unpack);
    } else if (const auto* m = std::get_if<runtime::MergeOp>(&op.op)) {
      const auto first = slices.begin() + m->slices.first;
      const auto last = first + m->slices.count;
      std::sort(first, last, [](const AttnSlice& a, const AttnSlice& b) { return a.q_range.begin < b.q_range.begin; });
      for (auto it = first; it != last && it + 1 != last; ++it)
        if (it->q_range.end > (it + 1)->q_range.begin)
          throw std::logic_error(std::string(where) + ": a merge's slices overlap in query rows");
    }
  }
  return slices;
}

}  // namespace seqpar::gpu::detail::data_ops

namespace seqpar::runtime {

/// Data movement on a GPU: `DataOps<HostExec>`'s members as kernels on `exec.stream()` (data_ops.cuh).
template <>
struct DataOps<gpu::CudaExec> {
  /// The lowered copy and slice tables in device memory (`copies`, `slices`: what the executor
  /// offsets into). Merges' slice runs are sorted by first query row here.
  struct Tables {
    const PieceCopy* copies = nullptr;
    const AttnSlice* slices = nullptr;
    gpu::DeviceArray<PieceCopy> copies_storage;  ///< owns `copies`
    gpu::DeviceArray<AttnSlice> slices_storage;  ///< owns `slices`
  };

  /// Checks what the kernels rely on (pieces in increasing offsets in every run the executor
  /// packs or unpacks; disjoint query rows in every merge), sorts each merge's slices by first query
  /// row, and uploads both tables on exec.stream() (waiting for the copies: once per cached program).
  [[nodiscard]] static Tables upload(const gpu::CudaExec& exec, const LoweredProgram& lp) {
    constexpr const char* where = "DataOps<CudaExec>::upload";
    const std::vector<AttnSlice> slices = gpu::detail::data_ops::device_slices(lp, where);
    SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), where);
    Tables t;
    t.copies_storage = gpu::DeviceArray<PieceCopy>(lp.copies.size());
    t.slices_storage = gpu::DeviceArray<AttnSlice>(slices.size());
    if (!lp.copies.empty())
      SEQPAR_CUDA_CHECK(cudaMemcpyAsync(t.copies_storage.data(), lp.copies.data(), lp.copies.size() * sizeof(PieceCopy),
                                        cudaMemcpyHostToDevice, exec.stream()),
                        where);
    if (!slices.empty())
      SEQPAR_CUDA_CHECK(cudaMemcpyAsync(t.slices_storage.data(), slices.data(), slices.size() * sizeof(AttnSlice),
                                        cudaMemcpyHostToDevice, exec.stream()),
                        where);
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), where);  // `slices` is freed on return
    t.copies = t.copies_storage.data();
    t.slices = t.slices_storage.data();
    return t;
  }

  using Workspace = gpu::DeviceBytes;
  [[nodiscard]] static Workspace allocate(const gpu::CudaExec& exec, std::size_t bytes) {
    SEQPAR_CUDA_CHECK(cudaSetDevice(exec.device()), "DataOps<CudaExec>::allocate");
    return Workspace(bytes);
  }

  // The launches (data_ops.cuh). T: float, __half or __nv_bfloat16; A (LSE): float; views and
  // regions in device memory.

  /// Copies the pieces of `copies` out of their buffers into `region` (device memory) at their offsets.
  template <class T, class A>
  static void pack(const gpu::CudaExec& exec, const BufferTable<T, A>& b, TableSlice<PieceCopy> copies,
                   std::byte* region, comm::HeadWidths widths);

  /// Copies (or, with PieceCopy::accumulate, adds) the pieces of `copies` from `region` into their
  /// buffers; accumulations into the same elements in table order (one launch per such layer).
  template <class T, class A>
  static void unpack(const gpu::CudaExec& exec, const BufferTable<T, A>& b, TableSlice<PieceCopy> copies,
                     const std::byte* region, comm::HeadWidths widths);

  template <class T, class A>
  static void zero(const gpu::CudaExec& exec, const BufferTable<T, A>& b, std::span<const BufferId> buffers);

  /// O = 0, LSE = -inf over whole views.
  template <class T, class A>
  static void fill_empty(const gpu::CudaExec& exec, ThdView<T> o, LseView<A> lse);

  /// Folds the partial (o_part, lse_part) into (o, lse) on the query rows of `slices`, whose device
  /// rows (`slices.mirror`) are sorted by first query row and disjoint (upload makes them so).
  template <class T, class A>
  static void merge(const gpu::CudaExec& exec, ThdView<T> o, LseView<A> lse, ThdView<T> o_part, LseView<A> lse_part,
                    TableSlice<AttnSlice> slices);

  /// Attention sinks on final rows (attention/sinks.hpp): O, LSE rescaled by the sink of each head;
  /// `sinks` (heads logits) in device memory, not checked for NaN / +inf (the host cannot see them
  /// without a synchronization; a NaN sink gives NaN rows of its head only).
  template <class T, class A>
  static void apply_sinks(const gpu::CudaExec& exec, ThdView<T> o, LseView<A> lse, const A* sinks);

  /// This rank's part of the sinks' gradient (overwritten, heads values in device memory): one block
  /// per head, rows summed in a fixed order (the same bits on every run).
  template <class T, class A>
  static void sink_gradient(const gpu::CudaExec& exec, ThdView<const T> dout, ThdView<const T> o, LseView<const A> lse,
                            const A* sinks, A* grad);

  /// out[i] = sum over r < parts of in[r * n + i], in rank order.
  template <class A>
  static void sum_parts(const gpu::CudaExec& exec, const A* in, int parts, std::size_t n, A* out);
};

}  // namespace seqpar::runtime
