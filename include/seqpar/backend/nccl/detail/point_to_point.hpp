// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the NCCL transport: the posted isend/irecv batch and its flush. A post stages a host
// buffer and joins the batch; a flush issues the whole batch as one group of ncclSend/ncclRecv, sorted
// by (tag, post order) (order_for_issue), so that a ring step's send and receive cannot deadlock.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "seqpar/backend/nccl/detail/buffers.hpp"
#include "seqpar/backend/nccl/detail/failure.hpp"
#include "seqpar/backend/nccl/detail/nccl_support.hpp"
#include "seqpar/backend/nccl/detail/progress.hpp"
#include "seqpar/backend/nccl/detail/state.hpp"

namespace seqpar::backend::nccl::detail {

/// Sending `data` to `peer` with `tag`, as the next post of the batch. A host buffer is copied to a
/// staging block now (the caller may reuse it at once); a device buffer is used in place.
[[nodiscard]] inline PostedOp posted_send(State& s, std::span<const std::byte> data, int peer, int tag) {
  constexpr std::string_view where = "nccl::Transport::isend";
  PostedOp op{.send = true,
              .peer = peer,
              .tag = tag,
              .post = static_cast<std::uint32_t>(s.batch.size()),
              .data = const_cast<std::byte*>(data.data()),
              .bytes = data.size()};
  if (!data.empty() && is_host(s, data.data(), where, "data")) {
    const auto block = s.staging.take(data.size(), where, s.memory.get());
    std::memcpy(block.host, data.data(), data.size());  // to the device at the flush
    op.data = block.device;
    op.pinned = block.host;
    s.batch_host = true;
  } else if (!data.empty()) {
    s.batch_device = true;
  }
  return op;
}

/// Receiving the next message from `peer` with `tag` into `data`, as the next post of the batch. A host
/// buffer receives through a staging block, copied to it when the flush completes.
[[nodiscard]] inline PostedOp posted_recv(State& s, std::span<std::byte> data, int peer, int tag) {
  constexpr std::string_view where = "nccl::Transport::irecv";
  PostedOp op{.send = false,
              .peer = peer,
              .tag = tag,
              .post = static_cast<std::uint32_t>(s.batch.size()),
              .data = data.data(),
              .bytes = data.size()};
  if (!data.empty() && is_host(s, data.data(), where, "data")) {
    const auto block = s.staging.take(data.size(), where, s.memory.get());
    op.data = block.device;
    op.pinned = block.host;
    op.host_out = data.data();
    s.batch_host = true;
  } else if (!data.empty()) {
    s.batch_device = true;
  }
  return op;
}

/// Adds `op` to the batch (a send is counted now).
inline void post(State& s, const PostedOp& op) {
  s.batch.push_back(op);
  if (op.send) count_message(s, op.peer, op.bytes);
}

/// The peer of every operation of the batch, or -1 when there are several.
[[nodiscard]] inline int single_peer(const State& s) noexcept {
  for (const PostedOp& op : s.batch)
    if (op.peer != s.batch.front().peer) return -1;
  return s.batch.empty() ? -1 : s.batch.front().peer;
}

/// " with rank(s) 1, 3" for the operations of the batch.
[[nodiscard]] inline std::string batch_peers(const State& s) {
  std::vector<int> peers;
  for (const PostedOp& op : s.batch) peers.push_back(op.peer);
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  std::string out = peers.size() == 1 ? " with rank " : " with ranks ";
  for (std::size_t i = 0; i < peers.size(); ++i) out += (i ? ", " : "") + std::to_string(peers[i]);
  return out;
}

/// Issues the posted isend/irecv now, as one group. A batch with a device buffer runs on the queue;
/// one of host buffers only on the transport's own stream, and completes on the host.
inline void flush(State& st) {
  State& s = usable(st, "flush");
  if (s.batch.empty()) return;
  const cudaStream_t stream = s.batch_device ? s.queue : s.own.get();
  follow_tail(s, stream, "flush");
  order_for_issue(s.batch);
  const auto what = [&] { return "isend/irecv" + batch_peers(s); };
  bool any = false;
  for (const PostedOp& op : s.batch) {
    any = any || op.bytes != 0;
    if (op.send && op.pinned != nullptr)
      cuda_check(s, cudaMemcpyAsync(op.data, op.pinned, op.bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync",
                 "isend");
  }
  if (any) {
    group_start(s, what);
    for (const PostedOp& op : s.batch) {
      if (op.bytes == 0) continue;  // the peer skips it too: both know the size
      const ncclResult_t rc = op.send ? ncclSend(op.data, op.bytes, ncclUint8, op.peer, s.comm, stream)
                                      : ncclRecv(op.data, op.bytes, ncclUint8, op.peer, s.comm, stream);
      if (rc != ncclSuccess && rc != ncclInProgress) {
        (void)ncclGroupEnd();
        fail_nccl(s, rc, op.send ? "isend" : "irecv", op.peer, op.tag);
      }
    }
    settle(s, ncclGroupEnd(), what);
    record_tail(s, stream, "flush");
    arm(s, stream, "isend/irecv", single_peer(s));
  }
  if (s.batch_host) {
    for (const PostedOp& op : s.batch)
      if (!op.send && op.pinned != nullptr)
        cuda_check(s, cudaMemcpyAsync(op.pinned, op.data, op.bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync",
                   "irecv");
    host_wait(s, stream, what);
    for (const PostedOp& op : s.batch)
      if (op.host_out != nullptr) std::memcpy(op.host_out, op.pinned, op.bytes);
    s.staging.reset();
  }
  s.batch.clear();
  s.batch_host = s.batch_device = false;
  ++s.batch_id;
}

}  // namespace seqpar::backend::nccl::detail
