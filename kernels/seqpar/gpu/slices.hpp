// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// Slice lists in device memory. CUDA kernels read their `AttnSlice`s from the device and cannot
/// check them on the host at every call, so slices are checked once, where they reach the device:
/// here for a caller's own list, in the lowering for the executor's (runtime/lowered_program.hpp).
/// Slices without query rows are dropped (they do nothing), which bounds a call's slice count by its
/// query rows: the tile tables of the kernels are sized by that bound.

#include <span>
#include <vector>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/gpu/device_memory.hpp"

namespace seqpar::gpu {

/// A checked slice list on the device.
class DeviceSlices {
 public:
  DeviceSlices() = default;
  /// Checks `slices` against buffers of q_rows and k_rows tokens (validate_slices: bounds, masks,
  /// disjoint query ranges; std::invalid_argument naming the slice), drops those without query rows
  /// and uploads the rest.
  DeviceSlices(std::span<const AttnSlice> slices, std::int64_t q_rows, std::int64_t k_rows) {
    validate_slices(slices, q_rows, k_rows, "gpu::DeviceSlices");
    for (const AttnSlice& s : slices)
      if (!s.q_range.empty()) host_.push_back(s);
    device_ = DeviceArray<AttnSlice>(host_);
  }
  /// The slices in device memory, what `CudaFlash::forward/backward` take.
  [[nodiscard]] std::span<const AttnSlice> device() const noexcept { return {device_.data(), device_.size()}; }
  /// The same slices on the host.
  [[nodiscard]] std::span<const AttnSlice> host() const noexcept { return host_; }

 private:
  std::vector<AttnSlice> host_;
  DeviceArray<AttnSlice> device_;
};

}  // namespace seqpar::gpu
