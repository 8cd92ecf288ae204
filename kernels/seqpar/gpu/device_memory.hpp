// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Owning device memory: `DeviceBytes` (raw, 256-byte aligned as cudaMalloc gives it) and
/// `DeviceArray<T>` (typed, trivially copyable T), with stream-ordered upload and download.
/// For program tables, workspaces, tests and benchmarks; the kernels themselves never allocate.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/gpu/check.hpp"

namespace seqpar::gpu {

class DeviceBytes {
 public:
  DeviceBytes() noexcept = default;
  explicit DeviceBytes(std::size_t bytes) : size_(bytes) {
    if (bytes != 0) SEQPAR_CUDA_CHECK(cudaMalloc(&data_, bytes), "gpu::DeviceBytes");
  }
  DeviceBytes(DeviceBytes&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBytes& operator=(DeviceBytes&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { release(); }

  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(data_); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<std::byte> span() const noexcept { return {data(), size_}; }

 private:
  void release() noexcept {
    if (data_ != nullptr) (void)cudaFree(data_);  // cudaFree synchronizes the device: no pending use remains
    data_ = nullptr;
  }
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

template <class T>
class DeviceArray {
  static_assert(std::is_trivially_copyable_v<T>, "DeviceArray<T>: T must be trivially copyable");

 public:
  DeviceArray() noexcept = default;
  explicit DeviceArray(std::size_t n) : bytes_(n * sizeof(T)), size_(n) {}
  /// A device copy of `host`, complete when this returns. (cudaMemcpy from pageable memory may return
  /// before the DMA lands, and kernels on non-blocking streams do not wait for the legacy stream it
  /// runs on: the device is synchronized. For setup and tests, not for a hot path.)
  explicit DeviceArray(std::span<const T> host) : DeviceArray(host.size()) {
    if (host.empty()) return;
    SEQPAR_CUDA_CHECK(cudaMemcpy(data(), host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "gpu::DeviceArray");
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), "gpu::DeviceArray");
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(std::span<const T>(host)) {}

  [[nodiscard]] T* data() const noexcept { return reinterpret_cast<T*>(bytes_.data()); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<T> span() const noexcept { return {data(), size_}; }

  /// Copies the array back to the host, after everything issued on the device (synchronous).
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(size_);
    if (size_ == 0) return out;
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), "gpu::DeviceArray::to_host");
    SEQPAR_CUDA_CHECK(cudaMemcpy(out.data(), data(), size_ * sizeof(T), cudaMemcpyDeviceToHost),
                      "gpu::DeviceArray::to_host");
    return out;
  }

 private:
  DeviceBytes bytes_;
  std::size_t size_ = 0;
};

}  // namespace seqpar::gpu
