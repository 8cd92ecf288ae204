// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "seqpar/backend/inproc/detail/comm_state.hpp"
#include "seqpar/core/detail/transport_checks.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::backend::inproc {

class World;
class Transport;

/// A point-to-point operation started by `Transport::isend` / `Transport::irecv`, completed by
/// `Transport::wait`. Move-only. A send request is complete when returned (sends copy eagerly);
/// a receive request holds its place in the (source, tag) order from the moment it was posted
/// and fills its buffer in `wait`. A default-constructed, moved-from or completed request is
/// empty and `wait` on it returns at once. Destroying a pending receive without waiting leaves
/// its message undelivered (the message it would have matched is never given to another receive).
class Request {
 public:
  Request() noexcept = default;
  Request(Request&& other) noexcept { take(other); }
  Request& operator=(Request&& other) noexcept {
    if (this != &other) take(other);
    return *this;
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() = default;

  /// True while a receive still has to be completed by wait().
  [[nodiscard]] bool pending() const noexcept { return kind_ == Kind::kRecv; }

 private:
  friend class Transport;
  enum class Kind : std::uint8_t { kNone, kSend, kRecv };

  void take(Request& other) noexcept {
    kind_ = std::exchange(other.kind_, Kind::kNone);
    comm_ = std::exchange(other.comm_, nullptr);
    buffer_ = std::exchange(other.buffer_, {});
    peer_ = other.peer_;
    tag_ = other.tag_;
    ticket_ = other.ticket_;
  }

  Kind kind_ = Kind::kNone;
  const detail::CommState* comm_ = nullptr;
  std::span<std::byte> buffer_;
  int peer_ = -1;
  int tag_ = -1;
  std::uint64_t ticket_ = 0;
};

/// One rank's endpoint of an in-process thread world (see `World`), satisfying
/// `seqpar::Transport`. Used by tests and on a laptop to run any strategy on N threads.
///
/// Semantics (beyond the concept's):
///  - send/isend copy the payload into the destination's (source, tag) mailbox and return at
///    once (eager; no rendezvous with the receiver, so send-send-recv-recv patterns cannot
///    deadlock). recv/wait block until the message they were matched to (in post order) arrives
///    and throw `Errc::kProtocol` if its size differs from the buffer's. Tags must be >= 0.
///  - Collectives meet in shared memory: each rank publishes a view of its send buffer and
///    copies its blocks straight out of its peers' buffers (one copy per byte, no staging, no
///    allocation), then waits until every peer has finished reading its buffer. Send and receive
///    buffers must not overlap. Ranks that call different collectives, or disagree on sizes
///    (a peer's send count differs from this rank's receive count), get `Errc::kProtocol`.
///  - split(color, key): MPI_Comm_split with color >= 0 (no MPI_UNDEFINED); the result has its
///    own mailboxes and rendezvous and shares the world's failure state and timeout.
///  - Failure: once any rank of the world has thrown out of `World::run`'s function, every
///    operation (blocked or new) throws `Errc::kPeerFailed` "rank R failed: <what>" with R the
///    world rank. A wait longer than `World::Options::timeout` throws `Errc::kTimeout` naming this
///    rank, the operation and the peer(s) it waited for.
///  - Counters: bytes and messages to other ranks of this object (self-traffic is free): every
///    send to another rank is a message; a collective counts one message per non-empty block to
///    another rank. barrier and split move no payload and count nothing.
///  - Memory: every payload byte is copied with the world's `Memory::copy` (std::memcpy by default)
///    and mailbox buffers come from its `Memory::allocate` (World::Options::memory); a world whose
///    ranks share a GPU copies with the CUDA runtime (kernels/seqpar/gpu/device_world.hpp).
///  - Cost: a message is copied twice (into the mailbox, out of it) and, once warm, allocates
///    nothing (mailbox nodes and buffers are recycled); a
///    collective copies each byte once and synchronizes twice. Not thread-safe: one thread per
///    Transport object.
///
/// @code
/// seqpar::backend::inproc::World(4).run([](seqpar::backend::inproc::Transport& t) {
///   std::vector<float> s(4 * 16, float(t.rank())), r(s.size());
///   t.all_to_all(seqpar::as_bytes_of(std::span(s)), seqpar::as_writable_bytes_of(std::span(r)));
///   auto row = t.split(t.rank() % 2, t.rank());   // ranks {0, 2} and {1, 3}
///   row.barrier();
/// });
/// @endcode
class Transport {
 public:
  using Request = inproc::Request;

  Transport(Transport&&) noexcept = default;
  Transport& operator=(Transport&&) noexcept = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  ~Transport() = default;

  /// This rank in this communicator, in [0, size()).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Ranks in this communicator.
  [[nodiscard]] int size() const noexcept { return comm_->size(); }
  /// This rank's number in the World (differs from rank() after split).
  [[nodiscard]] int world_rank() const noexcept { return comm_->world_rank(rank_); }

  /// Copies `data` to `peer`'s mailbox for `tag` and returns (eager).
  void send(std::span<const std::byte> data, int peer, int tag) {
    check_peer_tag("inproc::Transport::send", peer, tag);
    comm_->world().throw_if_failed();
    comm_->inbox(peer).deliver(rank_, tag, data);
    count_message(peer, data.size());
  }

  /// Receives the next message from `peer` with `tag` into `data` (sizes must match).
  void recv(std::span<std::byte> data, int peer, int tag) {
    check_peer_tag("inproc::Transport::recv", peer, tag);
    comm_->world().throw_if_failed();
    const std::uint64_t ticket = comm_->inbox(rank_).post(peer, tag);
    complete_recv(data, peer, tag, ticket, "recv");
  }

  /// send() returning an already completed Request.
  [[nodiscard]] Request isend(std::span<const std::byte> data, int peer, int tag) {
    send(data, peer, tag);
    Request req;
    req.kind_ = Request::Kind::kSend;
    req.comm_ = comm_.get();
    req.peer_ = peer;
    req.tag_ = tag;
    return req;
  }

  /// Posts a receive (its place in the (peer, tag) order is fixed now); wait() fills `data`.
  [[nodiscard]] Request irecv(std::span<std::byte> data, int peer, int tag) {
    check_peer_tag("inproc::Transport::irecv", peer, tag);
    comm_->world().throw_if_failed();
    Request req;
    req.ticket_ = comm_->inbox(rank_).post(peer, tag);
    req.kind_ = Request::Kind::kRecv;
    req.comm_ = comm_.get();
    req.buffer_ = data;
    req.peer_ = peer;
    req.tag_ = tag;
    return req;
  }

  /// Completes `req` (a no-op for sends and empty requests); `req` is empty afterwards.
  void wait(Request& req) {
    if (req.kind_ == Request::Kind::kNone) return;
    seqpar::detail::require(req.comm_ == comm_.get(), "inproc::Transport::wait", "req", "<request>",
                            "was started on another transport");
    Request done = std::move(req);
    if (done.kind_ == Request::Kind::kRecv)
      complete_recv(done.buffer_, done.peer_, done.tag_, done.ticket_, "wait(irecv)");
  }

  /// Equal blocks: block i of `s` (s.size() / size() bytes) goes to rank i; block i of `r` comes
  /// from rank i. Requires s.size() == r.size(), a multiple of size().
  void all_to_all(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "inproc::Transport::all_to_all";
    const auto n = static_cast<std::size_t>(size());
    seqpar::detail::require_equal_blocks(where, s.size(), r.size(), size());
    require_disjoint(where, s, r);
    const std::size_t block = s.size() / n;
    auto& rv = comm_->rendezvous();
    auto& slot = rv.slot(rank_);
    slot.op = detail::CollectiveOp::kAllToAll;
    slot.send = s.data();
    slot.send_size = s.size();
    slot.block = block;
    collective(slot.op, [&](std::uint64_t) {
      for (int src = 0; src < size(); ++src) {
        if (rv.peer(src).block != block)
          throw protocol_error("all_to_all", src, rv.peer(src).block, "-byte blocks, this rank", block);
      }
      for (int i = 0; i < size(); ++i) {  // start at self so ranks read different peers at a time
        const int src = (rank_ + i) % size();
        copy_bytes(rv.peer(src).send + static_cast<std::size_t>(rank_) * block, block,
                   r.data() + static_cast<std::size_t>(src) * block);
      }
    });
    for (int dst = 0; dst < size(); ++dst) count_block(dst, block);
  }

  /// Variable blocks: send_counts[i] bytes (contiguous, in rank order in `s`) go to rank i;
  /// recv_counts[i] bytes (contiguous, in rank order in `r`) come from rank i. Rank j's
  /// send_counts[i] must equal rank i's recv_counts[j] (else Errc::kProtocol).
  void all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> send_counts, std::span<std::byte> r,
                    std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "inproc::Transport::all_to_all_v";
    require_counts(where, "send_counts", send_counts, "s.size()", s.size());
    require_counts(where, "recv_counts", recv_counts, "r.size()", r.size());
    require_disjoint(where, s, r);
    auto& rv = comm_->rendezvous();
    auto& slot = rv.slot(rank_);
    slot.op = detail::CollectiveOp::kAllToAllV;
    slot.send = s.data();
    slot.send_size = s.size();
    slot.send_counts = send_counts;
    slot.send_displs.resize(send_counts.size());
    std::exclusive_scan(send_counts.begin(), send_counts.end(), slot.send_displs.begin(), std::size_t{0});
    collective(slot.op, [&](std::uint64_t) {
      const auto me = static_cast<std::size_t>(rank_);
      for (int src = 0; src < size(); ++src) {
        const std::size_t incoming = rv.peer(src).send_counts[me];
        const std::size_t expected = recv_counts[static_cast<std::size_t>(src)];
        if (incoming != expected) throw protocol_error("all_to_all_v", src, incoming, " bytes, recv_counts", expected);
      }
      std::size_t offset = 0;
      for (int src = 0; src < size(); ++src) {
        const auto& p = rv.peer(src);
        copy_bytes(p.send + p.send_displs[me], p.send_counts[me], r.data() + offset);
        offset += p.send_counts[me];
      }
    });
    for (int dst = 0; dst < size(); ++dst) count_block(dst, send_counts[static_cast<std::size_t>(dst)]);
  }

  /// Every rank contributes s.size() bytes (equal on all ranks); `r` (size() * s.size() bytes)
  /// receives them in rank order.
  void all_gather(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "inproc::Transport::all_gather";
    const auto n = static_cast<std::size_t>(size());
    if (r.size() != n * s.size())
      seqpar::detail::throw_invalid(where, "r.size()", r.size(),
                                    "must equal size() * s.size() = " + std::to_string(n * s.size()));
    require_disjoint(where, s, r);
    auto& rv = comm_->rendezvous();
    auto& slot = rv.slot(rank_);
    slot.op = detail::CollectiveOp::kAllGather;
    slot.send = s.data();
    slot.send_size = s.size();
    collective(slot.op, [&](std::uint64_t) {
      for (int src = 0; src < size(); ++src) {
        if (rv.peer(src).send_size != s.size())
          throw protocol_error("all_gather", src, rv.peer(src).send_size, " bytes, this rank", s.size());
      }
      for (int src = 0; src < size(); ++src)
        copy_bytes(rv.peer(src).send, s.size(), r.data() + static_cast<std::size_t>(src) * s.size());
    });
    for (int dst = 0; dst < size(); ++dst) count_block(dst, s.size());
  }

  /// Rank i contributes recv_counts[i] bytes; `r` receives them contiguously in rank order.
  /// Requires recv_counts[rank()] == s.size() and sum(recv_counts) == r.size().
  void all_gather_v(std::span<const std::byte> s, std::span<std::byte> r, std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "inproc::Transport::all_gather_v";
    require_counts(where, "recv_counts", recv_counts, "r.size()", r.size());
    if (recv_counts[static_cast<std::size_t>(rank_)] != s.size())
      seqpar::detail::throw_invalid(where, "recv_counts[" + std::to_string(rank_) + "]",
                                    recv_counts[static_cast<std::size_t>(rank_)],
                                    "must equal this rank's s.size() = " + std::to_string(s.size()));
    require_disjoint(where, s, r);
    auto& rv = comm_->rendezvous();
    auto& slot = rv.slot(rank_);
    slot.op = detail::CollectiveOp::kAllGatherV;
    slot.send = s.data();
    slot.send_size = s.size();
    collective(slot.op, [&](std::uint64_t) {
      for (int src = 0; src < size(); ++src) {
        const std::size_t expected = recv_counts[static_cast<std::size_t>(src)];
        if (rv.peer(src).send_size != expected)
          throw protocol_error("all_gather_v", src, rv.peer(src).send_size, " bytes, recv_counts", expected);
      }
      std::size_t offset = 0;
      for (int src = 0; src < size(); ++src) {
        copy_bytes(rv.peer(src).send, rv.peer(src).send_size, r.data() + offset);
        offset += rv.peer(src).send_size;
      }
    });
    for (int dst = 0; dst < size(); ++dst) count_block(dst, s.size());
  }

  /// Returns once every rank of this communicator has entered barrier().
  void barrier() {
    auto& slot = comm_->rendezvous().slot(rank_);
    slot.op = detail::CollectiveOp::kBarrier;
    collective(slot.op, [](std::uint64_t) {});
  }

  /// Collective: the ranks with the same `color` (>= 0) form a new communicator, ordered by
  /// `key`, then by rank() (MPI_Comm_split). Every rank of this communicator must call it.
  [[nodiscard]] Transport split(int color, int key) {
    seqpar::detail::require(color >= 0, "inproc::Transport::split", "color", color, "must be >= 0");
    auto& rv = comm_->rendezvous();
    auto& slot = rv.slot(rank_);
    slot.op = detail::CollectiveOp::kSplit;
    slot.color = color;
    slot.key = key;
    std::shared_ptr<detail::CommState> sub;
    int sub_rank = -1;
    collective(slot.op, [&](std::uint64_t sequence) {
      std::vector<int> members;
      for (int r = 0; r < size(); ++r)
        if (rv.peer(r).color == color) members.push_back(r);
      std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return rv.peer(a).key < rv.peer(b).key; });
      std::vector<int> world_ranks;
      world_ranks.reserve(members.size());
      for (std::size_t i = 0; i < members.size(); ++i) {
        if (members[i] == rank_) sub_rank = static_cast<int>(i);
        world_ranks.push_back(comm_->world_rank(members[i]));
      }
      sub = comm_->take_split(sequence, color, std::move(world_ranks));
    });
    return Transport(std::move(sub), sub_rank);
  }

  /// Makes room in this rank's mailbox for `messages` messages of up to `bytes` bytes in flight at
  /// once (what one run of a program receives), so that receiving them allocates nothing.
  void reserve_receives(std::size_t messages, std::size_t bytes) { comm_->inbox(rank_).reserve(messages, bytes); }

  /// Bytes and messages this object sent to other ranks since construction or reset_counters().
  [[nodiscard]] const TrafficCounters& counters() const noexcept { return counters_; }
  void reset_counters() noexcept { counters_.reset(); }

 private:
  friend class World;

  Transport(std::shared_ptr<detail::CommState> comm, int rank) : comm_(std::move(comm)), rank_(rank) {
    counters_.bytes_to_peer.assign(static_cast<std::size_t>(comm_->size()), 0);
  }

  // "rank 2", or "rank 1 (world rank 3)" in a sub-communicator.
  [[nodiscard]] std::string who() const {
    std::string s = "rank " + std::to_string(rank_);
    if (world_rank() != rank_) s += " (world rank " + std::to_string(world_rank()) + ")";
    return s;
  }
  [[nodiscard]] std::string after_timeout() const {
    return " timed out after " + std::to_string(comm_->world().timeout().count()) + " ms";
  }

  void check_peer_tag(std::string_view where, int peer, int tag) const {
    if (peer < 0 || peer >= size())
      seqpar::detail::throw_invalid(where, "peer", peer,
                                    "must be in [0, size()) = [0, " + std::to_string(size()) + ")");
    seqpar::detail::require(tag >= 0, where, "tag", tag, "must be >= 0");
  }

  void require_counts(std::string_view where, std::string_view name, std::span<const std::size_t> counts,
                      std::string_view buffer, std::size_t buffer_size) const {
    seqpar::detail::require_counts(where, name, counts, buffer, buffer_size, size());
  }

  static void require_disjoint(std::string_view where, std::span<const std::byte> s, std::span<std::byte> r) {
    seqpar::detail::require_disjoint(where, s, r);
  }

  // Every payload byte moves through the world's copy function (std::memcpy unless the world says
  // otherwise); a collective's copies are completed by finish_copies() before its ranks depart.
  void copy_bytes(const std::byte* from, std::size_t bytes, std::byte* to) const {
    if (bytes != 0) comm_->world().memory().copy(to, from, bytes);
  }
  void finish_copies() const { comm_->world().memory().finish(); }

  [[nodiscard]] Error protocol_error(std::string_view op, int src, std::size_t theirs, std::string_view what,
                                     std::size_t ours) const {
    return Error(Errc::kProtocol, who() + ": " + std::string(op) + ": rank " + std::to_string(src) + " sends " +
                                      std::to_string(theirs) + std::string(what) + " expects " + std::to_string(ours));
  }

  void complete_recv(std::span<std::byte> data, int peer, int tag, std::uint64_t ticket, std::string_view op) {
    auto& world = comm_->world();
    const std::size_t size = comm_->inbox(rank_).take(peer, tag, ticket, data, world, world.deadline(), [&] {
      return Error(Errc::kTimeout, who() + ": " + std::string(op) + " from rank " + std::to_string(peer) + " (tag " +
                                       std::to_string(tag) + ")" + after_timeout());
    });
    if (size != data.size())
      throw Error(Errc::kProtocol, who() + ": " + std::string(op) + " from rank " + std::to_string(peer) + " (tag " +
                                       std::to_string(tag) + "): message of " + std::to_string(size) +
                                       " bytes, buffer of " + std::to_string(data.size()) + " bytes");
  }

  // Runs one collective whose Slot the caller has filled: meet, check everyone called the same
  // operation, read (copy out of the peers' buffers), then wait until every peer is done reading.
  template <class Read>
  void collective(detail::CollectiveOp op, Read&& read) {
    auto& world = comm_->world();
    world.throw_if_failed();
    auto& rv = comm_->rendezvous();
    const std::uint64_t sequence = rv.arrive(rank_, world, world.deadline(), [&](const std::string& missing) {
      return Error(Errc::kTimeout, who() + ": " + detail::op_name(op) + after_timeout() + " waiting for rank(s) " +
                                       missing + " to enter it");
    });
    const detail::Departure departure(rv);
    for (int r = 0; r < size(); ++r) {
      if (rv.peer(r).op != op)
        throw Error(Errc::kProtocol, who() + " called " + detail::op_name(op) + " while rank " + std::to_string(r) +
                                         " called " + detail::op_name(rv.peer(r).op));
    }
    // Peers reuse their buffers once every rank has departed: this rank's copies out of them end first.
    try {
      read(sequence);
    } catch (...) {
      try {
        finish_copies();
      } catch (...) {  // the first error is the one to report
      }
      throw;
    }
    finish_copies();
  }

  void count_message(int peer, std::size_t bytes) noexcept {
    if (peer == rank_) return;
    counters_.bytes_sent += bytes;
    counters_.messages_sent += 1;
    counters_.bytes_to_peer[static_cast<std::size_t>(peer)] += bytes;
  }
  void count_block(int peer, std::size_t bytes) noexcept {
    if (bytes != 0) count_message(peer, bytes);
  }

  std::shared_ptr<detail::CommState> comm_;
  int rank_ = 0;
  TrafficCounters counters_;
};

static_assert(seqpar::Transport<Transport>);

}  // namespace seqpar::backend::inproc
