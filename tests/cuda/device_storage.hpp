// SPDX-License-Identifier: Apache-2.0
// The Storage of tests/support/distributed_check.hpp for CudaFlash: ranks of a device world sharing
// device 0 (one host thread, one CudaExec each), shards in device memory uploaded on the rank's stream,
// outputs poisoned with 0xff bytes (NaN in every storage type: what a call leaves unwritten shows).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "seqpar/cuda/check.hpp"
#include "seqpar/cuda/detail/element.hpp"
#include "seqpar/cuda/device_memory.hpp"
#include "seqpar/cuda/device_world.hpp"
#include "seqpar/cuda/exec.hpp"

namespace seqpar::test {

struct DeviceStorage {
  template <class U>
  using Buffer = cuda::DeviceArray<U>;

  template <class Body>
  static void run(int world, Body&& body) {
    cuda::device_world(world).run([&](backend::inproc::Transport& transport) {
      SEQPAR_CUDA_CHECK(cudaSetDevice(0), "rank");
      body(transport);
    });
  }
  /// A device copy of `host`, issued on `exec`'s stream and complete when this returns (`host` may go).
  template <class U>
  static Buffer<U> upload(const std::vector<U>& host, const cuda::CudaExec& exec) {
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
  static Buffer<U> poisoned(std::size_t n, const cuda::CudaExec& exec) {
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
    return cuda::detail::from_float<U>(static_cast<float>(x));
  }
  template <class U>
  static double to_double(U x) {
    return static_cast<double>(cuda::detail::to_float(x));
  }
};

}  // namespace seqpar::test
