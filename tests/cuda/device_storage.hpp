// SPDX-License-Identifier: Apache-2.0
// The Storage of tests/support/distributed_check.hpp for CudaFlash: ranks of a device world sharing
// device 0 (one host thread, one CudaExec each), shards in device memory uploaded on the rank's stream,
// outputs poisoned with 0xff bytes (NaN in every storage type: what a call leaves unwritten shows).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/detail/element.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/device_world.hpp"
#include "seqpar/gpu/exec.hpp"

namespace seqpar::test {

struct DeviceStorage {
  template <class U>
  using Buffer = gpu::DeviceArray<U>;

  template <class Body>
  static void run(int world, Body&& body) {
    gpu::device_world(world).run([&](backend::inproc::Transport& transport) {
      SEQPAR_CUDA_CHECK(cudaSetDevice(0), "rank");
      body(transport);
    });
  }
  /// A device copy of `host`, issued on `exec`'s stream and complete when this returns (`host` may go).
  template <class U>
  static Buffer<U> upload(const std::vector<U>& host, const gpu::CudaExec& exec) {
    Buffer<U> d(host.size());
    if (!host.empty()) {
      SEQPAR_CUDA_CHECK(
          cudaMemcpyAsync(d.data(), host.data(), host.size() * sizeof(U), cudaMemcpyHostToDevice, exec.stream()),
          "test upload");
      exec.synchronize();
    }
    return d;
  }
  template <class U>
  static Buffer<U> poisoned(std::size_t n, const gpu::CudaExec& exec) {
    Buffer<U> d(n);
    if (n != 0) SEQPAR_CUDA_CHECK(cudaMemsetAsync(d.data(), 0xff, n * sizeof(U), exec.stream()), "test poison");
    return d;
  }
  template <class U>
  static U* data(Buffer<U>& b) {
    return b.data();
  }
  template <class U>
  static std::vector<U> download(const Buffer<U>& b) {
    return b.to_host();
  }
  template <class U>
  static U from_double(double x) {
    return gpu::detail::from_float<U>(static_cast<float>(x));
  }
  template <class U>
  static double to_double(U x) {
    return static_cast<double>(gpu::detail::to_float(x));
  }
};

}  // namespace seqpar::test
