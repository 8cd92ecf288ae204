// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The MPI transport. Needs <mpi.h>: link seqpar::mpi (include "seqpar/backend/mpi.hpp").
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "seqpar/backend/mpi/detail/mpi_support.hpp"
#include "seqpar/core/detail/transport_checks.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/timeout.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::backend::mpi {

class Transport;

/// A point-to-point operation started by `Transport::isend` / `Transport::irecv` (an MPI_Request),
/// completed by `Transport::wait`. Move-only. Unlike the in-process transport, a send is not eager:
/// the buffer of an isend must stay valid and unchanged until its wait returns. A default-constructed,
/// moved-from or completed request is empty and `wait` on it returns at once.
/// Destroying a pending request: a receive is cancelled (MPI_Cancel, then completed, so MPI never
/// writes into the buffer afterwards); a send is released (MPI_Request_free) and completes in the
/// background, so its buffer must outlive it.
class Request {
 public:
  Request() noexcept = default;
  Request(Request&& other) noexcept { take(other); }
  Request& operator=(Request&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() { release(); }

  /// True while the operation still has to be completed by wait().
  [[nodiscard]] bool pending() const noexcept { return request_ != MPI_REQUEST_NULL; }

 private:
  friend class Transport;
  enum class Kind : std::uint8_t { kSend, kRecv };

  void take(Request& other) noexcept {
    request_ = std::exchange(other.request_, MPI_REQUEST_NULL);
    unit_ = std::move(other.unit_);
    kind_ = other.kind_;
    comm_ = other.comm_;
    bytes_ = other.bytes_;
    peer_ = other.peer_;
    tag_ = other.tag_;
  }
  void release() noexcept {
    int finalized = 0;
    if (request_ == MPI_REQUEST_NULL || MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) {
      request_ = MPI_REQUEST_NULL;
      return;
    }
    if (kind_ == Kind::kRecv) {
      MPI_Cancel(&request_);
      MPI_Wait(&request_, MPI_STATUS_IGNORE);  // a cancelled receive completes locally
    } else {
      MPI_Request_free(&request_);
    }
    request_ = MPI_REQUEST_NULL;
    unit_.reset();
  }

  MPI_Request request_ = MPI_REQUEST_NULL;
  detail::UnitType unit_;  // the datatype the operation was posted with (kept for MPI_Get_elements_x)
  Kind kind_ = Kind::kSend;
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::size_t bytes_ = 0;
  int peer_ = -1;
  int tag_ = -1;
};

/// One rank's endpoint of an MPI communicator, satisfying `seqpar::Transport`: runs any strategy
/// across processes and nodes. The constructor duplicates the communicator (MPI_Comm_dup, so the
/// library's traffic never matches the application's) and sets MPI_ERRORS_RETURN on the duplicate;
/// the destructor frees it. Requires MPI to be initialized (see `Environment`).
///
/// Semantics (beyond the concept's):
///  - send/recv/isend/irecv are MPI_Isend/MPI_Irecv on the duplicate (tags in [0, MPI_TAG_UB]);
///    blocking calls complete their request with wait(). A send is not eager: for large messages it
///    completes only once the peer posts the receive. A receive whose message is larger or smaller
///    than its buffer throws `Errc::kProtocol`.
///  - Collectives are the non-blocking MPI collectives (MPI_Ialltoall, MPI_Ialltoallv,
///    MPI_Iallgather, MPI_Iallgatherv, MPI_Ibarrier). Send and receive buffers must not overlap.
///  - Waiting polls MPI_Test (spin, then yield, then sleep up to 1 ms) against a deadline of
///    `Options::timeout` per operation: a peer that died or never calls throws `Errc::kTimeout`
///    naming this rank, the operation and the peer instead of hanging. A timed-out receive is
///    cancelled; a timed-out send or collective cannot be, and leaves the communicator unusable:
///    end the job (`run_or_abort` does it with MPI_Abort).
///  - Every MPI return code is checked: a failure throws `seqpar::Error` with `mpi_category()` and
///    the message "rank R: <operation> with rank <peer>: <MPI_Error_string>".
///  - Sizes: MPI counts are int. A message or block above `Options::max_bytes_per_call` (INT_MAX) is
///    sent as a derived datatype (a struct of max-size blocks), so any size works. The variable
///    collectives express counts and displacements in a unit of the gcd of their counts; a call whose
///    total exceeds max_bytes_per_call times that unit throws std::invalid_argument (split the call).
///  - split(color, key): MPI_Comm_split (color >= 0), after an MPI_Ibarrier under the deadline, so a
///    dead peer times out rather than hanging in the split. The result owns its communicator.
///  - Counters: exactly as the in-process transport: bytes and messages to other ranks; each non-empty
///    block of a collective to another rank is one message; self-traffic, barrier and split are free.
///  - Not thread-safe: one thread per Transport object (MPI_THREAD_SERIALIZED is enough).
///
/// @code
/// seqpar::backend::mpi::Environment env(argc, argv);
/// seqpar::backend::mpi::run_or_abort(MPI_COMM_WORLD, [&](seqpar::backend::mpi::Transport& t) {
///   seqpar::DistributedAttention<ZigzagRing, attention::CpuFlash<float>> attn(t, shape, args);
///   attn.forward(batch, q, k, v, o, lse);
/// });
/// @endcode
class Transport {
 public:
  using Request = mpi::Request;

  struct Options {
    /// Longest one operation (a receive, a wait, a collective) may take before it throws Errc::kTimeout.
    /// Default 30 s, or the environment variable SEQPAR_TIMEOUT_S (seconds) when set (core/timeout.hpp).
    std::chrono::milliseconds timeout{seqpar::detail::default_timeout()};
    /// Largest count passed to one MPI call, in bytes, in [1, INT_MAX]. Lower it only to exercise
    /// the large-message paths with small buffers (tests).
    std::size_t max_bytes_per_call = static_cast<std::size_t>(INT_MAX);
  };

  /// Duplicates `comm` (collective over `comm`) with the default Options.
  explicit Transport(MPI_Comm comm) : Transport(comm, Options{}) {}
  /// Duplicates `comm` (collective over `comm`, under options.timeout: a rank that never constructs its
  /// transport makes the others throw Errc::kTimeout instead of hanging in MPI_Comm_dup).
  Transport(MPI_Comm comm, Options options) : options_(options) {
    constexpr std::string_view where = "mpi::Transport";
    options_.timeout = seqpar::detail::checked_timeout(where, "options.timeout", options.timeout);
    seqpar::detail::require(
        options.max_bytes_per_call >= 1 && options.max_bytes_per_call <= static_cast<std::size_t>(INT_MAX), where,
        "options.max_bytes_per_call", options.max_bytes_per_call, "must be in [1, INT_MAX]");
    seqpar::detail::require(comm != MPI_COMM_NULL, where, "comm", "MPI_COMM_NULL", "is not a communicator");
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized)
      throw Error(Errc::kTransport, "mpi::Transport: MPI is not initialized (construct an mpi::Environment first)");
    meet_before_dup(comm);
    MPI_Comm dup = MPI_COMM_NULL;
    if (const int rc = MPI_Comm_dup(comm, &dup); rc != MPI_SUCCESS)
      throw Error(std::error_code(rc, mpi_category()), "mpi::Transport: MPI_Comm_dup: " + detail::error_string(rc));
    adopt(dup);
  }

  Transport(Transport&& other) noexcept { take(other); }
  Transport& operator=(Transport&& other) noexcept {
    if (this != &other) {
      free_comm();
      take(other);
    }
    return *this;
  }
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  ~Transport() { free_comm(); }

  /// This rank in this communicator, in [0, size()).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Ranks in this communicator.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// This rank in MPI_COMM_WORLD (differs from rank() after split or on a sub-communicator).
  [[nodiscard]] int world_rank() const noexcept { return world_rank_; }
  /// The duplicated communicator this transport owns (for interoperation; do not free it).
  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

  /// Sends `data` to `peer` with `tag`; returns when MPI has completed the send (the buffer is reusable).
  void send(std::span<const std::byte> data, int peer, int tag) {
    Request req = isend(data, peer, tag);
    complete(req, "send");
  }

  /// Receives the next message from `peer` with `tag` into `data` (sizes must match).
  void recv(std::span<std::byte> data, int peer, int tag) {
    Request req = post_recv(data, peer, tag, "mpi::Transport::recv");
    complete(req, "recv");
  }

  /// Starts sending `data` (which must stay valid until wait) to `peer` with `tag`.
  [[nodiscard]] Request isend(std::span<const std::byte> data, int peer, int tag) {
    check_peer_tag("mpi::Transport::isend", peer, tag);
    Request req = make_request(Request::Kind::kSend, data.size(), peer, tag);
    const int count = message_count(req, data.size(), "isend");
    check(MPI_Isend(data.data(), count, req.unit_.type(), peer, tag, comm_, &req.request_), "isend", peer, tag);
    count_message(peer, data.size());
    return req;
  }

  /// Posts a receive from `peer` with `tag` into `data`; wait() completes it.
  [[nodiscard]] Request irecv(std::span<std::byte> data, int peer, int tag) {
    return post_recv(data, peer, tag, "mpi::Transport::irecv");
  }

  /// Completes `req` (a no-op on an empty request); `req` is empty afterwards.
  void wait(Request& req) {
    if (!req.pending()) return;
    seqpar::detail::require(req.comm_ == comm_, "mpi::Transport::wait", "req", "<request>",
                            "was started on another transport");
    Request done = std::move(req);
    complete(done, done.kind_ == Request::Kind::kRecv ? "wait(irecv)" : "wait(isend)");
  }

  /// Equal blocks: block i of `s` (s.size() / size() bytes) goes to rank i; block i of `r` comes
  /// from rank i. Requires s.size() == r.size(), a multiple of size(). MPI_Ialltoall.
  void all_to_all(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "mpi::Transport::all_to_all";
    const auto n = static_cast<std::size_t>(size_);
    seqpar::detail::require_equal_blocks(where, s.size(), r.size(), size_);
    require_disjoint(where, s, r);
    const std::size_t block = s.size() / n;
    const detail::UnitType unit = unit_type(block > options_.max_bytes_per_call ? block : 1, "all_to_all");
    const int count = block > options_.max_bytes_per_call ? 1 : static_cast<int>(block);
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ialltoall(s.data(), count, unit.type(), r.data(), count, unit.type(), comm_, &req), "all_to_all");
    complete_collective(req, "all_to_all");
    for (int dst = 0; dst < size_; ++dst) count_block(dst, block);
  }

  /// Variable blocks: send_counts[i] bytes (contiguous, in rank order in `s`) go to rank i;
  /// recv_counts[i] bytes (contiguous, in rank order in `r`) come from rank i. Rank j's
  /// send_counts[i] must equal rank i's recv_counts[j]. MPI_Ialltoallv with displacements.
  void all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> send_counts, std::span<std::byte> r,
                    std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "mpi::Transport::all_to_all_v";
    require_counts(where, "send_counts", send_counts, "s.size()", s.size());
    require_counts(where, "recv_counts", recv_counts, "r.size()", r.size());
    require_disjoint(where, s, r);
    const std::size_t send_unit = pick_unit(where, "send_counts", send_counts, s.size());
    const std::size_t recv_unit = pick_unit(where, "recv_counts", recv_counts, r.size());
    to_int_counts(send_counts, send_unit, send_counts_, send_displs_);
    to_int_counts(recv_counts, recv_unit, recv_counts_, recv_displs_);
    const detail::UnitType send_type = unit_type(send_unit, "all_to_all_v");
    const detail::UnitType recv_type = unit_type(recv_unit, "all_to_all_v");
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ialltoallv(s.data(), send_counts_.data(), send_displs_.data(), send_type.type(), r.data(),
                         recv_counts_.data(), recv_displs_.data(), recv_type.type(), comm_, &req),
          "all_to_all_v");
    complete_collective(req, "all_to_all_v");
    for (int dst = 0; dst < size_; ++dst) count_block(dst, send_counts[static_cast<std::size_t>(dst)]);
  }

  /// Every rank contributes s.size() bytes (equal on all ranks); `r` (size() * s.size() bytes)
  /// receives them in rank order. MPI_Iallgather.
  void all_gather(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "mpi::Transport::all_gather";
    const auto n = static_cast<std::size_t>(size_);
    seqpar::detail::require(r.size() == n * s.size(), where, "r.size()", r.size(),
                            "must equal size() * s.size() = " + std::to_string(n * s.size()));
    require_disjoint(where, s, r);
    const bool large = s.size() > options_.max_bytes_per_call;
    const detail::UnitType unit = unit_type(large ? s.size() : 1, "all_gather");
    const int count = large ? 1 : static_cast<int>(s.size());
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Iallgather(s.data(), count, unit.type(), r.data(), count, unit.type(), comm_, &req), "all_gather");
    complete_collective(req, "all_gather");
    for (int dst = 0; dst < size_; ++dst) count_block(dst, s.size());
  }

  /// Rank i contributes recv_counts[i] bytes; `r` receives them contiguously in rank order.
  /// Requires recv_counts[rank()] == s.size() and sum(recv_counts) == r.size(). MPI_Iallgatherv.
  void all_gather_v(std::span<const std::byte> s, std::span<std::byte> r, std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "mpi::Transport::all_gather_v";
    require_counts(where, "recv_counts", recv_counts, "r.size()", r.size());
    seqpar::detail::require(recv_counts[static_cast<std::size_t>(rank_)] == s.size(), where,
                            "recv_counts[" + std::to_string(rank_) + "]", recv_counts[static_cast<std::size_t>(rank_)],
                            "must equal this rank's s.size() = " + std::to_string(s.size()));
    require_disjoint(where, s, r);
    const bool large = s.size() > options_.max_bytes_per_call;
    const detail::UnitType send_type = unit_type(large ? s.size() : 1, "all_gather_v");
    const std::size_t recv_unit = pick_unit(where, "recv_counts", recv_counts, r.size());
    to_int_counts(recv_counts, recv_unit, recv_counts_, recv_displs_);
    const detail::UnitType recv_type = unit_type(recv_unit, "all_gather_v");
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Iallgatherv(s.data(), large ? 1 : static_cast<int>(s.size()), send_type.type(), r.data(),
                          recv_counts_.data(), recv_displs_.data(), recv_type.type(), comm_, &req),
          "all_gather_v");
    complete_collective(req, "all_gather_v");
    for (int dst = 0; dst < size_; ++dst) count_block(dst, s.size());
  }

  /// Returns once every rank of this communicator has entered barrier(). MPI_Ibarrier.
  void barrier() {
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(comm_, &req), "barrier");
    complete_collective(req, "barrier");
  }

  /// Collective: the ranks with the same `color` (>= 0) form a new communicator, ordered by `key`,
  /// then by rank() (MPI_Comm_split). Every rank of this communicator must call it.
  [[nodiscard]] Transport split(int color, int key) {
    seqpar::detail::require(color >= 0, "mpi::Transport::split", "color", color, "must be >= 0");
    barrier();  // MPI_Comm_split blocks without a deadline: meet under one first
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color, key, &sub), "split");
    Transport t(options_);
    t.adopt(sub);
    return t;
  }

  /// Bytes and messages this object sent to other ranks since construction or reset_counters().
  [[nodiscard]] const TrafficCounters& counters() const noexcept { return counters_; }
  void reset_counters() noexcept { counters_.reset(); }

 private:
  using clock = std::chrono::steady_clock;

  explicit Transport(Options options) noexcept : options_(options) {}

  // MPI_Comm_dup blocks without a deadline: a rank that never constructs its transport (never enters
  // run_or_abort) would hold every other rank there forever, where no timeout fires and run_or_abort
  // cannot end the job. The ranks meet under the deadline first (a non-blocking barrier, as split
  // does), so such a rank makes the others throw Errc::kTimeout, and run_or_abort abort the job.
  void meet_before_dup(MPI_Comm comm) const {
    int rank = -1;
    MPI_Comm_rank(comm, &rank);
    const std::string who = "mpi::Transport: rank " + std::to_string(rank);
    MPI_Request meet = MPI_REQUEST_NULL;
    if (const int rc = MPI_Ibarrier(comm, &meet); rc != MPI_SUCCESS)
      throw Error(std::error_code(rc, mpi_category()), who + ": MPI_Ibarrier: " + detail::error_string(rc));
    int rc = MPI_SUCCESS;
    const bool met = detail::poll_until(clock::now() + options_.timeout, [&] {
      int flag = 0;
      rc = MPI_Test(&meet, &flag, MPI_STATUS_IGNORE);
      return flag != 0 || rc != MPI_SUCCESS;
    });
    if (!met)  // the barrier cannot be cancelled: the communicator is unusable, end the job
      throw Error(Errc::kTimeout, who + ": construction timed out after " + std::to_string(options_.timeout.count()) +
                                      " ms waiting for every rank of the communicator to construct its transport "
                                      "(a rank that never calls?)");
    if (rc != MPI_SUCCESS)
      throw Error(std::error_code(rc, mpi_category()), who + ": MPI_Ibarrier: " + detail::error_string(rc));
  }

  // Takes ownership of `comm`: error handler, rank, size, tag bound, world rank.
  void adopt(MPI_Comm comm) {
    comm_ = comm;
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    void* attr = nullptr;
    int flag = 0;
    check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &attr, &flag), "MPI_Comm_get_attr(MPI_TAG_UB)");
    tag_ub_ = flag ? *static_cast<int*>(attr) : 32767;
    MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    check(MPI_Comm_group(comm_, &group), "MPI_Comm_group");
    check(MPI_Comm_group(MPI_COMM_WORLD, &world), "MPI_Comm_group(MPI_COMM_WORLD)");
    const int rc = MPI_Group_translate_ranks(group, 1, &rank_, world, &world_rank_);
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    check(rc, "MPI_Group_translate_ranks");
    counters_.bytes_to_peer.assign(static_cast<std::size_t>(size_), 0);
  }

  void take(Transport& other) noexcept {
    comm_ = std::exchange(other.comm_, MPI_COMM_NULL);
    rank_ = other.rank_;
    size_ = other.size_;
    world_rank_ = other.world_rank_;
    tag_ub_ = other.tag_ub_;
    options_ = other.options_;
    counters_ = std::move(other.counters_);
    send_counts_ = std::move(other.send_counts_);
    send_displs_ = std::move(other.send_displs_);
    recv_counts_ = std::move(other.recv_counts_);
    recv_displs_ = std::move(other.recv_displs_);
  }

  void free_comm() noexcept {
    int finalized = 0;
    if (comm_ != MPI_COMM_NULL && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

  // "rank 2", or "rank 1 (world rank 3)" on a sub-communicator.
  [[nodiscard]] std::string who() const {
    std::string s = "rank " + std::to_string(rank_);
    if (world_rank_ != rank_) s += " (world rank " + std::to_string(world_rank_) + ")";
    return s;
  }
  [[nodiscard]] static std::string with_peer(int peer, int tag) {
    if (peer < 0) return " with the ranks of the communicator";
    std::string s = " with rank " + std::to_string(peer);
    if (tag >= 0) s += " (tag " + std::to_string(tag) + ")";
    return s;
  }
  [[nodiscard]] std::string timed_out(std::string_view op, int peer, int tag) const {
    std::string s = who() + ": " + std::string(op) + with_peer(peer, tag) + " timed out after " +
                    std::to_string(options_.timeout.count()) + " ms";
    // MPI cannot say which rank is missing from a collective (the request only completes or not).
    if (peer < 0) s += " (a rank of the " + std::to_string(size_) + " did not enter it; MPI cannot tell which)";
    return s;
  }

  // Throws seqpar::Error(mpi_category) for a failed MPI call.
  void check(int rc, std::string_view op, int peer = -1, int tag = -1) const {
    if (rc == MPI_SUCCESS) return;
    throw Error(std::error_code(rc, mpi_category()),
                who() + ": " + std::string(op) + with_peer(peer, tag) + ": " + detail::error_string(rc));
  }

  void check_peer_tag(std::string_view where, int peer, int tag) const {
    seqpar::detail::require(peer >= 0 && peer < size_, where, "peer", peer,
                            "must be in [0, size()) = [0, " + std::to_string(size_) + ")");
    seqpar::detail::require(tag >= 0 && tag <= tag_ub_, where, "tag", tag,
                            "must be in [0, MPI_TAG_UB] = [0, " + std::to_string(tag_ub_) + "]");
  }

  void require_counts(std::string_view where, std::string_view name, std::span<const std::size_t> counts,
                      std::string_view buffer, std::size_t buffer_size) const {
    seqpar::detail::require_counts(where, name, counts, buffer, buffer_size, size_);
  }

  static void require_disjoint(std::string_view where, std::span<const std::byte> s, std::span<std::byte> r) {
    seqpar::detail::require_disjoint(where, s, r);
  }

  // The unit (bytes) in which a variable collective's counts and displacements fit an int: 1 when the
  // total does, else the gcd of the counts (a row of a tensor, typically). Chosen locally: a
  // message's type signature is its bytes, whatever unit either side posts it in.
  [[nodiscard]] std::size_t pick_unit(std::string_view where, std::string_view name,
                                      std::span<const std::size_t> counts, std::size_t total) const {
    const std::size_t limit = options_.max_bytes_per_call;
    if (total <= limit) return 1;
    std::size_t unit = 0;
    for (std::size_t c : counts) unit = std::gcd(unit, c);
    seqpar::detail::require(total / unit <= limit, where, "sum(" + std::string(name) + ")", total,
                            "exceeds " + std::to_string(limit) + " units of gcd(" + std::string(name) +
                                ") = " + std::to_string(unit) + " bytes (MPI counts are int): split the call");
    return unit;
  }

  static void to_int_counts(std::span<const std::size_t> counts, std::size_t unit, std::vector<int>& out,
                            std::vector<int>& displs) {
    out.resize(counts.size());
    displs.resize(counts.size());
    std::size_t offset = 0;
    for (std::size_t i = 0; i < counts.size(); ++i) {
      out[i] = static_cast<int>(counts[i] / unit);
      displs[i] = static_cast<int>(offset / unit);
      offset += counts[i];
    }
  }

  [[nodiscard]] detail::UnitType unit_type(std::size_t unit, std::string_view op) const {
    detail::UnitType t(unit, options_.max_bytes_per_call);
    check(t.status(), std::string(op) + ": building an MPI datatype of " + std::to_string(unit) + " bytes");
    return t;
  }

  [[nodiscard]] Request make_request(Request::Kind kind, std::size_t bytes, int peer, int tag) const {
    Request req;
    req.kind_ = kind;
    req.comm_ = comm_;
    req.bytes_ = bytes;
    req.peer_ = peer;
    req.tag_ = tag;
    return req;
  }

  // A message of `bytes` is posted as `bytes` MPI_BYTEs, or above the limit as one element of a
  // derived datatype of `bytes` bytes (kept in the request).
  [[nodiscard]] int message_count(Request& req, std::size_t bytes, std::string_view op) const {
    if (bytes <= options_.max_bytes_per_call) return static_cast<int>(bytes);
    req.unit_ = unit_type(bytes, op);
    return 1;
  }

  Request post_recv(std::span<std::byte> data, int peer, int tag, std::string_view where) {
    check_peer_tag(where, peer, tag);
    Request req = make_request(Request::Kind::kRecv, data.size(), peer, tag);
    const int count = message_count(req, data.size(), "irecv");
    check(MPI_Irecv(data.data(), count, req.unit_.type(), peer, tag, comm_, &req.request_), "irecv", peer, tag);
    return req;
  }

  // Completes a point-to-point request under the deadline; checks a receive's size.
  void complete(Request& req, std::string_view op) {
    MPI_Status status{};
    int rc = MPI_SUCCESS;
    const bool done = detail::poll_until(clock::now() + options_.timeout, [&] {
      int flag = 0;
      rc = MPI_Test(&req.request_, &flag, &status);
      return flag != 0 || rc != MPI_SUCCESS;
    });
    if (!done) {
      req.release();  // cancels a receive; a send completes (or not) in the background
      throw Error(Errc::kTimeout, timed_out(op, req.peer_, req.tag_));
    }
    req.request_ = MPI_REQUEST_NULL;
    if (rc != MPI_SUCCESS) {
      if (req.kind_ == Request::Kind::kRecv && detail::error_class(rc) == MPI_ERR_TRUNCATE)
        throw Error(Errc::kProtocol, who() + ": " + std::string(op) + " from rank " + std::to_string(req.peer_) +
                                         " (tag " + std::to_string(req.tag_) + "): message larger than the buffer of " +
                                         std::to_string(req.bytes_) + " bytes");
      check(rc, op, req.peer_, req.tag_);
    }
    if (req.kind_ != Request::Kind::kRecv) return;
    MPI_Count elements = 0;
    check(MPI_Get_elements_x(&status, req.unit_.type(), &elements), "MPI_Get_elements_x", req.peer_, req.tag_);
    if (elements == MPI_UNDEFINED || static_cast<std::size_t>(elements) != req.bytes_)
      throw Error(Errc::kProtocol, who() + ": " + std::string(op) + " from rank " + std::to_string(req.peer_) +
                                       " (tag " + std::to_string(req.tag_) + "): message of " +
                                       std::to_string(static_cast<long long>(elements)) + " bytes, buffer of " +
                                       std::to_string(req.bytes_) + " bytes");
  }

  // Completes a non-blocking collective under the deadline. A timed-out collective cannot be
  // cancelled (MPI forbids it): the communicator is unusable afterwards.
  void complete_collective(MPI_Request& req, std::string_view op) {
    int rc = MPI_SUCCESS;
    const bool done = detail::poll_until(clock::now() + options_.timeout, [&] {
      int flag = 0;
      rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
      return flag != 0 || rc != MPI_SUCCESS;
    });
    if (!done) throw Error(Errc::kTimeout, timed_out(op, -1, -1));
    if (rc != MPI_SUCCESS && detail::error_class(rc) == MPI_ERR_TRUNCATE)
      throw Error(Errc::kProtocol, who() + ": " + std::string(op) +
                                       ": a rank sent more bytes than this rank's receive count (MPI_ERR_TRUNCATE)");
    check(rc, op);
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

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  int world_rank_ = 0;
  int tag_ub_ = 32767;
  Options options_;
  TrafficCounters counters_;
  // int counts and displacements of the variable collectives (kept: no allocation per call).
  std::vector<int> send_counts_, send_displs_, recv_counts_, recv_displs_;
};

static_assert(seqpar::Transport<Transport>);

/// Initializes MPI for the lifetime of the object (MPI_Init_thread) and finalizes it after
/// (MPI_Finalize), unless MPI was already initialized, in which case it does neither.
/// `required`: the thread level the program needs; MPI_THREAD_SERIALIZED suffices for seqpar (one
/// thread per Transport; CPU kernels' worker threads never call MPI). Throws Errc::kTransport if MPI
/// provides less.
///
/// @code
/// int main(int argc, char** argv) {
///   seqpar::backend::mpi::Environment env(argc, argv);
///   return seqpar::backend::mpi::run_or_abort(MPI_COMM_WORLD, [](auto& t) { ...; return 0; });
/// }
/// @endcode
class Environment {
 public:
  Environment(int& argc, char**& argv, int required = MPI_THREAD_SERIALIZED) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) {
      MPI_Query_thread(&provided_);
      return;
    }
    if (const int rc = MPI_Init_thread(&argc, &argv, required, &provided_); rc != MPI_SUCCESS)
      throw Error(std::error_code(rc, mpi_category()), "mpi::Environment: MPI_Init_thread failed");
    owned_ = true;
    if (provided_ < required) {
      MPI_Finalize();
      owned_ = false;
      throw Error(Errc::kTransport, "mpi::Environment: MPI provides thread level " + std::to_string(provided_) +
                                        ", the program requires " + std::to_string(required));
    }
  }
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;
  ~Environment() {
    int finalized = 0;
    if (owned_ && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Finalize();
  }
  /// The thread level MPI provides (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
  [[nodiscard]] int thread_level() const noexcept { return provided_; }

 private:
  int provided_ = MPI_THREAD_SINGLE;
  bool owned_ = false;
};

namespace detail {
[[noreturn]] inline void abort_job(MPI_Comm comm, const char* what) noexcept {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "seqpar: rank %d failed: %s\n", rank, what);
  std::fflush(stderr);
  MPI_Abort(comm, 1);
  std::abort();  // MPI_Abort does not return; if it did, do not continue
}
}  // namespace detail

/// Runs `fn(transport)` on a Transport over `comm` (built with `options`) and returns what fn
/// returns. If fn (or building the transport) throws, prints "seqpar: rank R failed: <what>" (R the
/// MPI_COMM_WORLD rank) to stderr and calls MPI_Abort(comm, 1): the job ends with that message
/// instead of its other ranks hanging in their next receive (DESIGN.md invariant 3).
template <class F>
requires std::invocable<F&, Transport&>
decltype(auto) run_or_abort(MPI_Comm comm, F&& fn, Transport::Options options = {}) {
  try {
    Transport transport(comm, options);
    return std::invoke(fn, transport);
  } catch (const std::exception& e) {
    detail::abort_job(comm, e.what());
  } catch (...) {
    detail::abort_job(comm, "unknown exception");
  }
}

}  // namespace seqpar::backend::mpi
