// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `CudaExec`: the stream-ordered execution context of the CUDA path (core/exec.hpp): a compute
/// stream and a comm stream on one device, with events to order one after the other. Work issued on
/// it is enqueued and returns at once; `synchronize()` waits for both streams. Copies share the
/// streams (the state is reference counted), so a kernel, an engine and its executor hold the same
/// context. Streams are created non-blocking (no implicit ordering with the legacy default stream),
/// or borrowed from the caller (a trainer's current stream) and then never destroyed here.

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "seqpar/core/error.hpp"
#include "seqpar/core/exec.hpp"
#include "seqpar/gpu/check.hpp"

namespace seqpar::gpu {

class CudaExec {
 public:
  using exec_category = exec_tag;
  static constexpr bool kHostSynchronous = false;

  /// Streams of its own on `device` (-1: the calling thread's current device).
  explicit CudaExec(int device = -1) : state_(std::make_shared<State>(device, nullptr, nullptr, /*owns=*/true)) {}

  /// Borrows the caller's streams (not destroyed here); `comm` null: communicate on `compute`. A null
  /// `compute` is the legacy default stream (handle 0, PyTorch's default current stream), borrowed as
  /// `cudaStreamLegacy`, so that the work stays ordered with the caller's on it.
  [[nodiscard]] static CudaExec on_streams(cudaStream_t compute, cudaStream_t comm = nullptr, int device = -1) {
    if (compute == nullptr) compute = cudaStreamLegacy;
    return CudaExec(std::make_shared<State>(device, compute, comm == nullptr ? compute : comm, /*owns=*/false));
  }

  [[nodiscard]] int device() const noexcept { return state_->device; }
  /// Where kernels, packs, merges run.
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_->compute; }
  /// Where a stream-ordered transport enqueues its transfers.
  [[nodiscard]] cudaStream_t comm_stream() const noexcept { return state_->comm; }
  /// Largest dynamic shared memory per block the kernels may use on this device.
  [[nodiscard]] int max_shared_bytes() const noexcept { return state_->max_shared; }
  [[nodiscard]] int multiprocessors() const noexcept { return state_->sms; }
  /// The device's compute capability as major x 10 + minor (80: sm_80, 90: sm_90).
  [[nodiscard]] int compute_capability() const noexcept { return state_->compute_capability; }

  /// The comm stream as the opaque queue a stream-ordered transport enqueues on (StreamOrderedExec).
  [[nodiscard]] void* comm_queue() const noexcept { return state_->comm; }

  /// The comm stream waits for what the compute stream has issued so far (no host wait).
  void comm_after_compute() const { order(state_->compute, state_->comm, state_->compute_done); }
  /// The compute stream waits for what the comm stream has issued so far (no host wait).
  void compute_after_comm() const { order(state_->comm, state_->compute, state_->comm_done); }

  /// Waits on the host for everything issued on both streams.
  void synchronize() const {
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(state_->compute), "CudaExec::synchronize");
    if (state_->comm != state_->compute)
      SEQPAR_CUDA_CHECK(cudaStreamSynchronize(state_->comm), "CudaExec::synchronize");
  }

  /// Same streams (copies of one context compare equal).
  friend bool operator==(const CudaExec& a, const CudaExec& b) noexcept { return a.state_ == b.state_; }

 private:
  struct State {
    // `owns` is its own flag, never inferred from a null stream: null is a stream a caller may lend.
    State(int dev, cudaStream_t compute_, cudaStream_t comm_, bool owns_) : owns(owns_) {
      constexpr const char* where = "CudaExec";
      if (dev < 0) SEQPAR_CUDA_CHECK(cudaGetDevice(&dev), where);
      device = dev;
      SEQPAR_CUDA_CHECK(cudaSetDevice(device), where);
      SEQPAR_CUDA_CHECK(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), where);
      SEQPAR_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), where);
      int major = 0, minor = 0;
      SEQPAR_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), where);
      SEQPAR_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), where);
      compute_capability = 10 * major + minor;
      if (owns) {
        SEQPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), where);
        SEQPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking), where);
      } else {
        compute = compute_;
        comm = comm_;
      }
      SEQPAR_CUDA_CHECK(cudaEventCreateWithFlags(&compute_done, cudaEventDisableTiming), where);
      SEQPAR_CUDA_CHECK(cudaEventCreateWithFlags(&comm_done, cudaEventDisableTiming), where);
    }
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    ~State() {
      // Destruction does not wait: CUDA releases a stream's resources once its work completes.
      (void)cudaEventDestroy(compute_done);
      (void)cudaEventDestroy(comm_done);
      if (owns) {
        (void)cudaStreamDestroy(compute);
        (void)cudaStreamDestroy(comm);
      }
    }
    bool owns;
    int device = 0;
    int max_shared = 0;
    int sms = 0;
    int compute_capability = 0;
    cudaStream_t compute = nullptr;
    cudaStream_t comm = nullptr;
    cudaEvent_t compute_done = nullptr;
    cudaEvent_t comm_done = nullptr;
  };

  explicit CudaExec(std::shared_ptr<State> s) : state_(std::move(s)) {}

  static void order(cudaStream_t from, cudaStream_t to, cudaEvent_t event) {
    if (from == to) return;
    SEQPAR_CUDA_CHECK(cudaEventRecord(event, from), "CudaExec: ordering the streams");
    SEQPAR_CUDA_CHECK(cudaStreamWaitEvent(to, event, 0), "CudaExec: ordering the streams");
  }

  std::shared_ptr<State> state_;
};

static_assert(StreamOrderedExec<CudaExec>);

}  // namespace seqpar::gpu
