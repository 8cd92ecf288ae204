// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// CUDA runtime errors as seqpar errors: every call the CUDA path makes is checked, and a failure
/// names the call, where it was made and the runtime's message.

#include <cuda_runtime_api.h>

#include <string>

#include "seqpar/core/error.hpp"

namespace seqpar::gpu {

/// Throws `seqpar::Error(Errc::kStepFailed)` "<where>: <call> failed: <cudaGetErrorString>" unless ok.
inline void check(cudaError_t status, const char* call, const char* where) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // a sticky error stays; a non-sticky one must not leak into the next check
  throw Error(Errc::kStepFailed, std::string(where) + ": " + call + " failed: " + cudaGetErrorName(status) + " (" +
                                     cudaGetErrorString(status) + ")");
}

/// Number of CUDA devices this process can use; 0 (not an error) without a driver or a device.
[[nodiscard]] inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace seqpar::gpu

/// Checks one CUDA runtime call: SEQPAR_CUDA_CHECK(cudaMemsetAsync(...), "CudaFlash::forward").
#define SEQPAR_CUDA_CHECK(call, where) ::seqpar::gpu::check((call), #call, (where))
