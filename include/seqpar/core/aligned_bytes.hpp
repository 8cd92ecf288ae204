// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <span>

namespace seqpar::detail {

/// An owned, uninitialised, 64-byte aligned byte buffer (cache line and zmm register aligned):
/// the workspace behind the executor and kernels.
class AlignedBytes {
 public:
  static constexpr std::size_t kAlignment = 64;
  AlignedBytes() = default;
  explicit AlignedBytes(std::size_t n)
      : data_(static_cast<std::byte*>(::operator new (n == 0 ? 1 : n, std::align_val_t{kAlignment}))), size_(n) {}
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<std::byte> span() noexcept { return {data_.get(), size_}; }

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept { ::operator delete (p, std::align_val_t{kAlignment}); }
  };
  std::unique_ptr<std::byte[], Free> data_;
  std::size_t size_ = 0;
};

}  // namespace seqpar::detail
