// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL transport: what one Transport owns (its communicator, streams and events, the
// posted point-to-point batch, the staging arena, the counters), and the counting of messages.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "seqpar/backend/nccl/detail/nccl_support.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::backend::nccl::detail {

using Clock = std::chrono::steady_clock;

/// Everything a Transport owns, on the heap so that moving a Transport keeps its requests valid.
struct State {
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    // Local, never waits for peers: see Transport's "Lifetime". Nor for the device: cudaFree waits
    // for all of it, a kernel of another communicator hung on a dead peer included (a hierarchical
    // or BASP run unwinding after one level failed). So device memory goes back stream-ordered on
    // the allocations' stream, and only when this transport is quiet (not aborted on an error, nothing of it
    // still in flight); a broken transport leaks its word and staging instead (bounded: once).
    if (comm != nullptr) (void)ncclCommAbort(comm);
    const bool quiet = aborted.empty() && cudaStreamQuery(own.get()) == cudaSuccess &&
                       (tail_on == nullptr || cudaEventQuery(tail.get()) == cudaSuccess);
    (void)cudaGetLastError();  // a query's cudaErrorNotReady must not reach the caller's next check
    staging.release(memory.get(), quiet);
    if (word != nullptr && quiet) (void)cudaFreeAsync(word, memory.get());
  }

  ncclComm_t comm = nullptr;
  int rank = 0, size = 0, world_rank = 0, device = 0;
  std::chrono::milliseconds timeout{0};
  std::string name = "world";
  Stream own;                      // the queue until set_queue names another
  Stream memory;                   // allocations only (never other work): waiting for it cannot hang
  cudaStream_t queue = nullptr;    // where operations are enqueued now
  Event done;                      // host waits
  Event tail;                      // after the last operation enqueued, recorded on tail_on: the next
  cudaStream_t tail_on = nullptr;  // operation on another stream waits for it (one order per transport)
  Event watch;                     // the oldest operation not yet seen complete (progress check)
  bool watching = false;
  Clock::time_point watch_since{};
  const char* watch_op = "";
  int watch_peer = -1;          // its peer, when it has one
  std::vector<PostedOp> batch;  // isend/irecv posted since the last flush
  std::uint64_t batch_id = 1;   // the batch being posted; flushed batches have smaller ids
  bool batch_host = false;      // it holds a host buffer (staged)
  bool batch_device = false;    // it holds a device buffer
  StagingArena staging;
  std::uint32_t* word = nullptr;  // a device word for barrier()
  std::string aborted;            // why the communicator was aborted (empty: it was not)
  TrafficCounters counters;
  std::vector<std::size_t> counts;  // all_to_all's equal counts (kept: no allocation per call)
};

/// Counts a message to `peer` (self-traffic is free).
inline void count_message(State& s, int peer, std::size_t bytes) noexcept {
  if (peer == s.rank) return;
  s.counters.bytes_sent += bytes;
  s.counters.messages_sent += 1;
  s.counters.bytes_to_peer[static_cast<std::size_t>(peer)] += bytes;
}

/// Counts a collective's block to `peer`: a non-empty block to another rank is one message.
inline void count_block(State& s, int peer, std::size_t bytes) noexcept {
  if (bytes != 0) count_message(s, peer, bytes);
}

}  // namespace seqpar::backend::nccl::detail
