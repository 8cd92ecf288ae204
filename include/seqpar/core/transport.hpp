// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace seqpar {

/// Bytes and messages a transport sent to *other* ranks (self-copies are not traffic).
/// bytes_to_peer is indexed by the transport's own rank numbering.
struct TrafficCounters {
  std::uint64_t bytes_sent = 0;
  std::uint64_t messages_sent = 0;
  std::vector<std::uint64_t> bytes_to_peer;
  /// Zero, keeping one entry per peer (a transport's reset_counters()).
  void reset() noexcept {
    bytes_sent = 0;
    messages_sent = 0;
    std::fill(bytes_to_peer.begin(), bytes_to_peer.end(), std::uint64_t{0});
  }
};

/// The run-time object every communicator runs over (in-process threads, MPI, NCCL).
///  - send/recv are blocking; isend/irecv return a move-only Request completed by wait(Request&).
///    Messages between a pair of ranks with the same tag arrive in the order they were sent.
///  - all_to_all: equal blocks, s.size() == r.size() == size() * block, block i goes to rank i.
///  - all_to_all_v: byte counts per rank; blocks are contiguous in rank order in both buffers.
///  - all_gather: r.size() == size() * s.size(); all_gather_v: recv_counts per rank, contiguous.
///  - split(color, key): a sub-communicator of the ranks with the same color, ordered by key then
///    by rank (MPI_Comm_split semantics). Every rank of this transport must call it.
///  - Any failure (a peer that threw, a timeout, a transport error) raises seqpar::Error.
template <class T>
concept Transport = std::movable<T> &&
    requires(T& t, const T& ct, std::span<const std::byte> s, std::span<std::byte> r,
             std::span<const std::size_t> counts, int peer, int tag, typename T::Request& req) {
  { ct.rank() } -> std::same_as<int>;
  { ct.size() } -> std::same_as<int>;
  t.send(s, peer, tag);
  t.recv(r, peer, tag);
  { t.isend(s, peer, tag) } -> std::same_as<typename T::Request>;
  { t.irecv(r, peer, tag) } -> std::same_as<typename T::Request>;
  t.wait(req);
  t.all_to_all(s, r);
  t.all_to_all_v(s, counts, r, counts);
  t.all_gather(s, r);
  t.all_gather_v(s, r, counts);
  t.barrier();
  { t.split(peer, tag) } -> std::same_as<T>;
  { ct.counters() } -> std::same_as<const TrafficCounters&>;  // live counters, read without a copy
};

/// A stream-ordered transport (NCCL; not the one-GPU device world, which is host-ordered) enqueues its
/// transfers on a device queue instead of completing them on the calling thread. It declares
/// `static constexpr bool kStreamOrdered = true` and takes the queue before each operation with
/// `set_queue(void*)` (a cudaStream_t; opaque here, so that include/ names no vendor API). Its calls
/// return once the transfer is enqueued; `wait(request)` orders the queue after that transfer without
/// waiting on the host. Buffers must stay untouched until the queue has run the transfer. The executor
/// orders its execution context's compute work before and after (ExecutionContext's stream members).
template <class T>
concept StreamOrderedTransport = Transport<T> && T::kStreamOrdered && requires(T& t, void* queue) {
  t.set_queue(queue);
};

/// Views a span of trivially copyable values as bytes (the transports move bytes only).
template <class T>
[[nodiscard]] std::span<const std::byte> as_bytes_of(std::span<T> s) noexcept {
  return std::as_bytes(s);
}
template <class T>
requires(!std::is_const_v<T>) [[nodiscard]] std::span<std::byte> as_writable_bytes_of(std::span<T> s) noexcept {
  return std::as_writable_bytes(s);
}

}  // namespace seqpar
