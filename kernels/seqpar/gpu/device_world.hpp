// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// One GPU, many ranks: the in-process world (backend/inproc) with device memory, so that ranks that
/// are host threads sharing one GPU, each with its own streams (its kernel's `CudaExec`), send each
/// other device buffers. Every strategy then runs end to end on 1-8 ranks of a single GPU, which is
/// how the CUDA tests check them against the fp64 reference and how the benchmarks measure the
/// runtime's overhead on a GPU.
///
/// Semantics: those of `inproc::Transport` (eager sends, collectives that meet in shared memory,
/// failure and timeout handling), with every payload copy made by the CUDA runtime:
///  - copies are `cudaMemcpyAsync(cudaMemcpyDefault)` on the calling thread's per-thread default
///    stream, completed (`cudaStreamSynchronize`) before the transport call hands the data on. Under
///    unified addressing a payload may be device or host memory; a copy between two host buffers (the
///    engine's own agreement messages travel on the same world) is a std::memcpy;
///  - host-ordered: a transport call reads its send buffer and fills its receive buffer while it
///    runs, on the host's order, not on a stream's. Work that writes a send buffer must have finished
///    before the call, which the executor guarantees by synchronizing its context (`CudaExec`, which
///    is not host-synchronous) before every transfer; data received is in place when `recv`, `wait`
///    or the collective returns. A stream-ordered transport (transfers enqueued on the comm stream
///    behind events, no host wait) is the NCCL backend's;
///  - mailbox buffers (what an eager send holds until it is received) are device memory
///    (`cudaMalloc` on the sending thread's current device), sized and recycled as the in-process
///    world does: a message is copied device to device twice (into the mailbox, out of it), a
///    collective's block once;
///  - cost per transfer call: one `cudaStreamSynchronize` (a few microseconds) besides the copies.
///
/// @code
/// seqpar::gpu::device_world(8).run([&](seqpar::backend::inproc::Transport& t) {
///   SEQPAR_CUDA_CHECK(cudaSetDevice(0), "rank");
///   seqpar::DistributedAttention<Strategy, seqpar::attention::CudaFlash<__nv_bfloat16>> attn(t, shape);
///   attn.forward(batch, q, k, v, o, lse);  // device views of this rank's rows
///   attn.exec().synchronize();
/// });
/// @endcode

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>

#include "seqpar/backend/inproc/memory.hpp"
#include "seqpar/backend/inproc/world.hpp"
#include "seqpar/gpu/check.hpp"

namespace seqpar::gpu {

/// Whether `p` is device (or managed) memory; pageable and pinned host memory are not.
[[nodiscard]] inline bool is_device_pointer(const void* p) noexcept {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // memory the runtime does not know: host memory
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

/// The in-process world's memory on CUDA: copies by the CUDA runtime (std::memcpy between two host
/// buffers), mailbox buffers in device memory.
[[nodiscard]] inline backend::inproc::Memory device_payloads() noexcept {
  backend::inproc::Memory m;
  m.copy = [](std::byte* to, const std::byte* from, std::size_t bytes) {
    if (!is_device_pointer(to) && !is_device_pointer(from)) {
      std::memcpy(to, from, bytes);  // the engine's agreement messages: a few words on the host
      return;
    }
    SEQPAR_CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, cudaStreamPerThread),
                      "gpu::device_world: payload copy");
  };
  m.fence = [] { SEQPAR_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread), "gpu::device_world: payload copy"); };
  m.allocate = [](std::size_t bytes) -> void* {
    void* p = nullptr;
    SEQPAR_CUDA_CHECK(cudaMalloc(&p, bytes), "gpu::device_world: mailbox buffer");
    return p;
  };
  m.release = [](void* p) noexcept { (void)cudaFree(p); };
  return m;
}

/// `options` with the device memory of device_payloads().
[[nodiscard]] inline backend::inproc::World::Options device_world_options(
    backend::inproc::World::Options options = {}) {
  options.memory = device_payloads();
  return options;
}

/// An in-process world of `ranks` host threads that send device buffers (see the file comment).
[[nodiscard]] inline backend::inproc::World device_world(int ranks, backend::inproc::World::Options options = {}) {
  return backend::inproc::World(ranks, device_world_options(options));
}

}  // namespace seqpar::gpu
