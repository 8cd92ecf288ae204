// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL transport: how it fails. Every error names this rank, the communicator (the
// level) and the operation; a failure of the communicator aborts it (once, remembering why) before
// seqpar::Error is thrown.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <system_error>

#include "seqpar/backend/nccl/detail/nccl_support.hpp"
#include "seqpar/backend/nccl/detail/state.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::backend::nccl::detail {

/// "rank 1 of world/0 (world rank 3)": the rank, the communicator (the level) and the world rank.
[[nodiscard]] inline std::string who(const State& s) {
  std::string w = "rank " + std::to_string(s.rank) + " of " + s.name;
  if (s.world_rank != s.rank) w += " (world rank " + std::to_string(s.world_rank) + ")";
  return w;
}

/// " with rank 2 (tag 7)", or "" without a peer.
[[nodiscard]] inline std::string with_peer(int peer, int tag) {
  if (peer < 0) return "";
  std::string s = " with rank " + std::to_string(peer);
  if (tag >= 0) s += " (tag " + std::to_string(tag) + ")";
  return s;
}

/// ncclGetErrorString, and NCCL's last error on the communicator when it has one.
[[nodiscard]] inline std::string nccl_text(const State& s, ncclResult_t rc) {
  std::string t = ncclGetErrorString(rc);
  const char* last = ncclGetLastError(s.comm);
  if (last != nullptr && *last != '\0') t += std::string(" (") + last + ")";
  return t;
}

/// Aborts the communicator once; remembers why.
inline void abort_comm(State& s, const std::string& why) noexcept {
  if (s.comm != nullptr) (void)ncclCommAbort(s.comm);
  s.comm = nullptr;
  s.watching = false;
  s.batch.clear();
  ++s.batch_id;
  s.batch_host = s.batch_device = false;
  if (s.aborted.empty()) {
    try {
      s.aborted = why;
    } catch (...) {
    }
    if (s.aborted.empty()) s.aborted.assign(1, '?');
  }
}

/// An NCCL call failed: abort, then throw its result.
[[noreturn]] inline void fail_nccl(State& s, ncclResult_t rc, const std::string& op, int peer, int tag) {
  const std::string why = who(s) + ": " + op + with_peer(peer, tag) + ": " + nccl_text(s, rc);
  abort_comm(s, why);
  throw Error(std::error_code(rc, nccl_category()), why + "; the communicator was aborted");
}

/// An asynchronous NCCL error (a failed peer, a network error): abort, then throw its result.
[[noreturn]] inline void fail_async(State& s, ncclResult_t async, const char* op) {
  const std::string why = who(s) + ": " + op + ": NCCL reported " + nccl_text(s, async) +
                          (async == ncclRemoteError ? " (a peer failed or left)" : "");
  abort_comm(s, why);
  throw Error(std::error_code(async, nccl_category()), why + "; the communicator was aborted");
}

/// A CUDA failure while operations of the communicator may be in flight: abort, then throw.
[[noreturn]] inline void fail_cuda(State& s, cudaError_t rc, const char* call, const char* op) {
  const std::string why = who(s) + ": " + op + ": " + cuda_failure(rc, call);
  abort_comm(s, why);
  throw Error(Errc::kTransport, why + "; the communicator was aborted");
}

/// A failed CUDA call around the communicator's operations: Errc::kTransport, without aborting it.
inline void cuda_check(const State& s, cudaError_t rc, const char* call, const char* op) {
  if (rc != cudaSuccess) throw Error(Errc::kTransport, who(s) + ": " + op + ": " + cuda_failure(rc, call));
}

/// A blocking NCCL query (ncclCommUserRank, ncclCommCount).
inline void check_call(State& s, ncclResult_t rc, const char* call) {
  if (rc != ncclSuccess) fail_nccl(s, rc, call, -1, -1);
}

}  // namespace seqpar::backend::nccl::detail
