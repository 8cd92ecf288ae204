// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL backend: the error category, deadline polling, RAII for CUDA streams and
// events, the staging arena for host buffers, and the order in which posted point-to-point operations
// are issued.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"

namespace seqpar::backend::nccl {

namespace detail {

class NcclCategory final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "nccl"; }
  [[nodiscard]] std::string message(int code) const override {
    return ncclGetErrorString(static_cast<ncclResult_t>(code));
  }
};

}  // namespace detail

/// The error category of NCCL results: `Error::code().message()` is ncclGetErrorString.
[[nodiscard]] inline const std::error_category& nccl_category() noexcept {
  static const detail::NcclCategory category;
  return category;
}

namespace detail {

/// Calls `test()` (true when the awaited thing happened) until it does or `deadline` passes; false on
/// timeout. Spins briefly, then yields, then sleeps with exponential backoff up to 1 ms, so that ranks
/// waiting on an oversubscribed node leave the cores to NCCL's proxy threads (as mpi's poll_until).
template <class Test>
[[nodiscard]] bool poll_until(std::chrono::steady_clock::time_point deadline, Test&& test) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto nap = std::chrono::microseconds(5);
  for (;;) {
    if (test()) return true;
    const auto now = clock::now();
    if (now >= deadline) return test();
    const auto waited = now - start;
    if (waited < std::chrono::microseconds(50)) continue;
    if (waited < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
}

/// "<call> failed: <cudaGetErrorName> (<cudaGetErrorString>)", after clearing a non-sticky error.
[[nodiscard]] inline std::string cuda_failure(cudaError_t status, std::string_view call) {
  (void)cudaGetLastError();
  return std::string(call) + " failed: " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")";
}

/// A CUDA event without timing (what host waits and stream orderings use). Move-only.
class Event {
 public:
  Event() = default;
  explicit Event(std::string_view where) {
    if (const cudaError_t rc = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming); rc != cudaSuccess) {
      event_ = nullptr;
      throw Error(Errc::kTransport, std::string(where) + ": " + cuda_failure(rc, "cudaEventCreateWithFlags"));
    }
  }
  Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    if (this != &o) {
      reset();
      event_ = std::exchange(o.event_, nullptr);
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { reset(); }
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }

 private:
  void reset() noexcept {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

/// A non-blocking stream of this object's own. Move-only.
class Stream {
 public:
  Stream() = default;
  explicit Stream(std::string_view where) {
    if (const cudaError_t rc = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); rc != cudaSuccess) {
      stream_ = nullptr;
      throw Error(Errc::kTransport, std::string(where) + ": " + cuda_failure(rc, "cudaStreamCreateWithFlags"));
    }
  }
  Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  Stream& operator=(Stream&& o) noexcept {
    if (this != &o) {
      reset();
      stream_ = std::exchange(o.stream_, nullptr);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { reset(); }
  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }

 private:
  void reset() noexcept {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);  // does not wait: CUDA frees it once idle
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

/// Where host buffers pass through on their way to NCCL, which moves device memory only: blocks of
/// pinned host memory and device memory at the same offsets (a copy between them never blocks the
/// host, whatever the stream is waiting for). `take` hands out 256-byte aligned blocks until `reset`;
/// when a chunk is full a larger one is added, and earlier blocks stay valid. Chunks are given back
/// only by `release`: the device halves stream-ordered (cudaMallocAsync / cudaFreeAsync, so that no
/// host thread waits for the whole device, a transfer hung on a dead peer included), the pinned
/// halves only when the owner says nothing can still use them (else they are left allocated: a
/// broken transport leaks its staging rather than hang its destructor).
class StagingArena {
 public:
  struct Block {
    std::byte* host = nullptr;    ///< pinned
    std::byte* device = nullptr;  ///< on the transport's device
  };

  StagingArena() = default;
  StagingArena(const StagingArena&) = delete;
  StagingArena& operator=(const StagingArena&) = delete;
  ~StagingArena() = default;  // the owner calls release(): only it knows whether anything is in flight

  /// A block of `bytes` (at least 1) valid until reset(), usable on every stream. `memory` is a
  /// stream that holds allocations only (so waiting for it cannot hang): a new chunk is allocated on
  /// it and waited for.
  [[nodiscard]] Block take(std::size_t bytes, std::string_view where, cudaStream_t memory) {
    const std::size_t need = round_up(std::max<std::size_t>(bytes, 1));
    for (; current_ < chunks_.size(); ++current_, offset_ = 0) {
      Chunk& c = chunks_[current_];
      if (c.size - offset_ >= need) {
        const Block b{c.host + offset_, c.device + offset_};
        offset_ += need;
        return b;
      }
    }
    const std::size_t last = chunks_.empty() ? 0 : chunks_.back().size;
    Chunk c;
    c.size = std::max({need, 2 * last, std::size_t{1} << 20});
    void* h = nullptr;
    void* d = nullptr;
    if (const cudaError_t rc = cudaMallocHost(&h, c.size); rc != cudaSuccess)
      throw Error(Errc::kTransport,
                  std::string(where) + ": staging a host buffer: " + cuda_failure(rc, "cudaMallocHost"));
    cudaError_t rc = cudaMallocAsync(&d, c.size, memory);
    if (rc == cudaSuccess) rc = cudaStreamSynchronize(memory);
    if (rc != cudaSuccess) {
      if (d != nullptr) (void)cudaFreeAsync(d, memory);
      (void)cudaFreeHost(h);
      throw Error(Errc::kTransport,
                  std::string(where) + ": staging a host buffer: " + cuda_failure(rc, "cudaMallocAsync"));
    }
    c.host = static_cast<std::byte*>(h);
    c.device = static_cast<std::byte*>(d);
    chunks_.push_back(c);
    current_ = chunks_.size() - 1;
    offset_ = need;
    return {c.host, c.device};
  }
  /// Nothing taken is in use any more (the caller waited for the copies and transfers that used it).
  void reset() noexcept { current_ = 0, offset_ = 0; }
  [[nodiscard]] std::size_t capacity() const noexcept {
    std::size_t total = 0;
    for (const Chunk& c : chunks_) total += c.size;
    return total;
  }

 private:
  struct Chunk {
    std::byte* host = nullptr;
    std::byte* device = nullptr;
    std::size_t size = 0;
  };
  static constexpr std::size_t round_up(std::size_t n) noexcept { return (n + 255) / 256 * 256; }

 public:
  /// Gives the chunks back when `quiet` (no operation can still read or write them): device halves
  /// freed on `stream` (the allocations' stream) in stream order, pinned halves freed (cudaFreeHost is not
  /// stream-ordered, so only a quiet owner calls it). Not quiet: everything stays allocated (leaked), never waited for.
  void release(cudaStream_t stream, bool quiet) noexcept {
    if (quiet) {
      for (Chunk& c : chunks_) {
        (void)cudaFreeAsync(c.device, stream);
        (void)cudaFreeHost(c.host);
      }
    }
    chunks_.clear();
    current_ = offset_ = 0;
  }

 private:
  std::vector<Chunk> chunks_;
  std::size_t current_ = 0, offset_ = 0;
};

/// A point-to-point operation posted with isend/irecv and issued at the next flush.
struct PostedOp {
  bool send = false;
  int peer = 0;
  int tag = 0;
  std::uint32_t post = 0;     ///< position among the batch's posts
  std::byte* data = nullptr;  ///< device memory NCCL reads or writes (the caller's, or a staging block)
  std::size_t bytes = 0;
  std::byte* host_out = nullptr;  ///< a staged receive: the caller's host buffer (null: none, or cancelled)
  std::byte* pinned = nullptr;    ///< its pinned staging block
};

/// The order a flush issues a batch in: NCCL has no tags and matches the messages between two ranks
/// in the order they are issued, so every rank issues its batch sorted by (tag, post order). A
/// sender's and a receiver's batches holding the same messages then issue them in the same order,
/// whatever order each side posted its tags in. Sorts in place (std::sort on a unique key: no
/// allocation, unlike std::stable_sort).
inline void order_for_issue(std::span<PostedOp> ops) noexcept {
  std::sort(ops.begin(), ops.end(),
            [](const PostedOp& a, const PostedOp& b) { return a.tag != b.tag ? a.tag < b.tag : a.post < b.post; });
}

}  // namespace detail
}  // namespace seqpar::backend::nccl
