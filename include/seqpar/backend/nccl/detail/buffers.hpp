// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL transport: a call's buffers. Their checks (counts, overlap, which device), and
// where a collective runs: the caller's device buffers in place on the queue, host buffers staged through
// pinned and device memory (the call then completes on the host).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <string_view>

#include "seqpar/backend/nccl/detail/failure.hpp"
#include "seqpar/backend/nccl/detail/progress.hpp"
#include "seqpar/backend/nccl/detail/state.hpp"
#include "seqpar/core/detail/transport_checks.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::backend::nccl::detail {

/// Host memory (staged) or device memory of this transport's device (used in place).
[[nodiscard]] inline bool is_host(const State& st, const void* p, std::string_view where, std::string_view argument) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;  // memory CUDA does not know: host memory
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) return true;
  seqpar::detail::require(
      a.device == st.device, where, argument, "<device buffer>",
      "is memory of device " + std::to_string(a.device) + ", this transport's device is " + std::to_string(st.device));
  return false;
}

// The argument checks every transport shares (core/detail/transport_checks.hpp).
using seqpar::detail::require_counts;
using seqpar::detail::require_disjoint;

/// Where a collective runs: the caller's device buffers in place on the queue; host buffers through
/// staging blocks. A call with host buffers only runs on the transport's own stream (the caller's
/// queue may be gone: the engine's agreement outlives the contexts that set it); any host buffer
/// makes the call complete on the host.
struct Placement {
  const std::byte* in = nullptr;    // what NCCL reads
  std::byte* out = nullptr;         // what NCCL writes
  std::byte* pinned_out = nullptr;  // a staged output: where it lands before the caller's buffer
  cudaStream_t stream = nullptr;
  bool host = false;  // a buffer was staged: the call completes on the host
};

/// Places a collective's buffers (a staged input is copied to the device now) on the stream it runs on,
/// after this transport's previous operation.
inline Placement place(State& st, std::string_view where, std::span<const std::byte> s, std::span<std::byte> r) {
  const bool s_host = !s.empty() && is_host(st, s.data(), where, "s");
  const bool r_host = !r.empty() && is_host(st, r.data(), where, "r");
  const bool device = (!s.empty() && !s_host) || (!r.empty() && !r_host);
  Placement p{s.data(), r.data(), nullptr, device ? st.queue : st.own.get(), s_host || r_host};
  follow_tail(st, p.stream, where.data());
  if (s_host) {
    const auto block = st.staging.take(s.size(), where, st.memory.get());
    std::memcpy(block.host, s.data(), s.size());
    cuda_check(st, cudaMemcpyAsync(block.device, block.host, s.size(), cudaMemcpyHostToDevice, p.stream),
               "cudaMemcpyAsync", "staging s");
    p.in = block.device;
  }
  if (r_host) {
    const auto block = st.staging.take(r.size(), where, st.memory.get());
    p.out = block.device;
    p.pinned_out = block.host;
  }
  return p;
}

/// After the operation: a staged output is copied back; a staged call completes on the host.
template <class What>
void finish(State& st, const Placement& p, std::span<std::byte> r, What&& what) {
  if (!p.host) return;
  if (p.pinned_out != nullptr)
    cuda_check(st, cudaMemcpyAsync(p.pinned_out, p.out, r.size(), cudaMemcpyDeviceToHost, p.stream), "cudaMemcpyAsync",
               "staging r");
  host_wait(st, p.stream, what);
  if (p.pinned_out != nullptr) std::memcpy(r.data(), p.pinned_out, r.size());
  st.staging.reset();
}

}  // namespace seqpar::backend::nccl::detail
