// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL transport: how a communicator comes to be. A unique id made on rank 0 and
// carried to the others (through an IdStore such as FileStore, or an all_gather of a host transport such
// as MPI's: Transport::bootstrap), the state of a transport (its device, streams, events), and the
// non-blocking creation (ncclCommInitRankConfig) or split (ncclCommSplit), polled against the deadline.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "seqpar/backend/nccl/detail/failure.hpp"
#include "seqpar/backend/nccl/detail/nccl_support.hpp"
#include "seqpar/backend/nccl/detail/progress.hpp"
#include "seqpar/backend/nccl/detail/state.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::backend::nccl::detail {

/// A fresh unique id (ncclGetUniqueId).
[[nodiscard]] inline ncclUniqueId make_unique_id() {
  ncclUniqueId id{};
  if (const ncclResult_t rc = ncclGetUniqueId(&id); rc != ncclSuccess)
    throw Error(std::error_code(rc, nccl_category()), std::string("nccl::unique_id: ncclGetUniqueId: ") +
                                                          ncclGetErrorString(rc) + ": " + ncclGetLastError(nullptr));
  return id;
}

/// The unique id through `store`: rank 0 makes and publishes it, the others fetch it.
template <class Store>
[[nodiscard]] ncclUniqueId share_unique_id(Store& store, int rank) {
  ncclUniqueId id{};
  const auto bytes = std::as_writable_bytes(std::span<ncclUniqueId>(&id, 1));
  if (rank == 0) {
    id = make_unique_id();
    store.publish(bytes);
  } else {
    store.fetch(bytes);
  }
  return id;
}

/// The unique id through an all_gather of the host transport `host` (rank 0 makes it).
template <class Host>
[[nodiscard]] ncclUniqueId gather_unique_id(Host& host) {
  ncclUniqueId mine{};
  if (host.rank() == 0) mine = make_unique_id();
  std::vector<ncclUniqueId> all(static_cast<std::size_t>(host.size()));
  host.all_gather(std::as_bytes(std::span<const ncclUniqueId>(&mine, 1)), std::as_writable_bytes(std::span(all)));
  return all[0];
}

/// The state of a transport on `device` (-1: the calling thread's current one), before it has a
/// communicator: its own stream, its events and the barrier's device word.
[[nodiscard]] inline std::shared_ptr<State> make_state(std::string_view where, std::chrono::milliseconds timeout,
                                                       int device) {
  auto s = std::make_shared<State>();
  s->timeout = timeout;
  const auto check = [&](cudaError_t rc, const char* call) {
    if (rc != cudaSuccess) throw Error(Errc::kTransport, std::string(where) + ": " + cuda_failure(rc, call));
  };
  if (device < 0) check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaSetDevice(device), "cudaSetDevice");
  s->device = device;
  s->own = Stream(where);
  s->queue = s->own.get();
  s->memory = Stream(where);
  s->done = Event(where);
  s->tail = Event(where);
  s->watch = Event(where);
  void* word = nullptr;
  // Stream-ordered, so that ~State can give it back without waiting for the device.
  check(cudaMallocAsync(&word, sizeof(std::uint32_t), s->memory.get()), "cudaMallocAsync");
  check(cudaStreamSynchronize(s->memory.get()), "cudaStreamSynchronize");
  s->word = static_cast<std::uint32_t*>(word);
  check(cudaMemsetAsync(word, 0, sizeof(std::uint32_t), s->queue), "cudaMemsetAsync");
  check(cudaStreamSynchronize(s->queue), "cudaStreamSynchronize");  // a fresh stream: nothing can hang
  return s;
}

[[nodiscard]] inline ncclConfig_t non_blocking() noexcept {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; readiness is polled against the deadline
  return config;
}

/// Polls a communicator being created (or split) until it is ready; aborts it on timeout or error.
inline void settle_creation(State& s, ncclComm_t comm, ncclResult_t rc, const std::string& op) {
  if (rc != ncclSuccess && rc != ncclInProgress) {
    abort_comm(s, op + " failed");
    throw Error(std::error_code(rc, nccl_category()), who(s) + ": " + op + ": " + nccl_text(s, rc));
  }
  ncclResult_t state = rc;
  const bool ready = comm != nullptr && poll_until(Clock::now() + s.timeout, [&] {
                       if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
                       return state != ncclInProgress;
                     });
  if (!ready && comm != nullptr) {
    const std::string why = who(s) + ": " + op + " timed out after " + std::to_string(s.timeout.count()) +
                            " ms: a rank of the " + std::to_string(s.size) +
                            " did not join (NCCL cannot tell which; is every rank running, with the same unique id?)";
    abort_comm(s, why);
    throw Error(Errc::kTimeout, why + "; the communicator was aborted");
  }
  if (state != ncclSuccess) {
    const std::string text = nccl_text(s, state);
    abort_comm(s, op + " failed");
    throw Error(std::error_code(state, nccl_category()), who(s) + ": " + op + ": " + text);
  }
}

/// Joins the communicator named `id` as `rank` of `size` (arguments already checked).
[[nodiscard]] inline std::shared_ptr<State> join(std::string_view where, const ncclUniqueId& id, int rank, int size,
                                                 std::chrono::milliseconds timeout, int device) {
  std::shared_ptr<State> s = make_state(where, timeout, device);
  s->rank = rank, s->size = size, s->world_rank = rank;
  ncclConfig_t config = non_blocking();
  ncclComm_t comm = nullptr;
  const ncclResult_t rc = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  s->comm = comm;
  settle_creation(*s, comm, rc, "creating the communicator (ncclCommInitRankConfig)");
  s->counters.bytes_to_peer.assign(static_cast<std::size_t>(size), 0);
  return s;
}

/// The communicator of the ranks of `parent` with the same `color`, ordered by `key` (ncclCommSplit;
/// the caller ran a barrier first). Named "<parent>/<color>".
[[nodiscard]] inline std::shared_ptr<State> split(State& parent, int color, int key) {
  std::shared_ptr<State> child = make_state("nccl::Transport::split", parent.timeout, parent.device);
  child->name = parent.name + "/" + std::to_string(color);
  child->world_rank = parent.world_rank;
  ncclConfig_t config = non_blocking();
  ncclComm_t comm = nullptr;
  const ncclResult_t rc = ncclCommSplit(parent.comm, color, key, &comm, &config);
  child->rank = parent.rank;  // names this rank in the child's errors until NCCL says
  child->size = parent.size;
  // Non-blocking, NCCL writes the child's handle only when the split has run, which the parent's
  // state reports: the handle was still null after ncclInProgress on the first GPU run (H200, NCCL
  // 2.28, 2026-12-04), and every later call on the child then failed with "comm argument is NULL".
  // So the parent settles first (under the deadline; a failure aborts it), then the child.
  settle(parent, rc, [&] { return "split (ncclCommSplit) of " + parent.name; });
  if (comm == nullptr) {
    const std::string why =
        who(*child) + ": split (ncclCommSplit) of " + parent.name + " completed without a communicator for this rank";
    throw Error(Errc::kTransport, why);
  }
  child->comm = comm;
  settle_creation(*child, comm, ncclInProgress, "split (ncclCommSplit) of " + parent.name);
  int rank = 0, size = 0;
  check_call(*child, ncclCommUserRank(comm, &rank), "ncclCommUserRank");
  check_call(*child, ncclCommCount(comm, &size), "ncclCommCount");
  child->rank = rank, child->size = size;
  child->counters.bytes_to_peer.assign(static_cast<std::size_t>(size), 0);
  return child;
}

}  // namespace seqpar::backend::nccl::detail
