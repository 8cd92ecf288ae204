// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The NCCL transport. Needs CUDA and NCCL: link seqpar::nccl (include "seqpar/backend/nccl.hpp").
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "seqpar/backend/nccl/detail/nccl_support.hpp"
#include "seqpar/backend/nccl/file_store.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::backend::nccl {

/// The 128 bytes that name one communicator to every rank that joins it (ncclUniqueId).
using UniqueId = ncclUniqueId;

/// A fresh unique id (ncclGetUniqueId: rank 0 makes it, a bootstrap carries it to the others).
[[nodiscard]] inline UniqueId unique_id() {
  UniqueId id{};
  if (const ncclResult_t rc = ncclGetUniqueId(&id); rc != ncclSuccess)
    throw Error(std::error_code(rc, nccl_category()), std::string("nccl::unique_id: ncclGetUniqueId: ") +
                                                          ncclGetErrorString(rc) + ": " + ncclGetLastError(nullptr));
  return id;
}

/// What carries the unique id from rank 0 to the other ranks: `publish` on rank 0, `fetch` on the
/// others, an optional `remove` once every rank has joined (FileStore, or the caller's own).
template <class S>
concept IdStore = requires(S& s, std::span<const std::byte> in, std::span<std::byte> out) {
  s.publish(in);
  s.fetch(out);
};

/// How a Transport is created and how long it waits (Transport::Options).
struct Options {
  /// Longest a communicator creation or split, a host wait, or an enqueued operation may take before
  /// the communicator is aborted and Errc::kTimeout thrown.
  std::chrono::milliseconds timeout{std::chrono::seconds{120}};
  /// CUDA device of this rank; -1: the calling thread's current device.
  int device = -1;
};

class Transport;

namespace detail {

/// Everything a Transport owns, on the heap so that moving a Transport keeps its requests valid.
struct State {
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    // Local, never waits for peers: see Transport's "Lifetime".
    if (comm != nullptr) (void)ncclCommAbort(comm);
    if (word != nullptr) (void)cudaFree(word);
  }

  ncclComm_t comm = nullptr;
  int rank = 0, size = 0, world_rank = 0, device = 0;
  std::chrono::milliseconds timeout{0};
  std::string name = "world";
  Stream own;                      // the queue until set_queue names another
  cudaStream_t queue = nullptr;    // where operations are enqueued now
  Event done;                      // host waits
  Event tail;                      // after the last operation enqueued, recorded on tail_on: the next
  cudaStream_t tail_on = nullptr;  // operation on another stream waits for it (one order per transport)
  Event watch;                     // the oldest operation not yet seen complete (progress check)
  bool watching = false;
  std::chrono::steady_clock::time_point watch_since{};
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

}  // namespace detail

/// A point-to-point operation started by `Transport::isend` / `Transport::irecv`, completed by
/// `Transport::wait`. Move-only. A default-constructed, moved-from or waited request is empty and
/// wait on it returns at once. Destroying a pending request does not cancel the transfer (NCCL
/// cannot): it is issued at the next flush, into the caller's device buffer (which must outlive it,
/// as a sent buffer must); a receive into host memory is dropped on arrival. A request may outlive
/// its transport (it holds the transport's state weakly).
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
  [[nodiscard]] bool pending() const noexcept { return pending_; }

 private:
  friend class Transport;
  enum class Kind : std::uint8_t { kSend, kRecv };

  void take(Request& other) noexcept {
    state_ = std::move(other.state_);
    other.state_.reset();
    pending_ = std::exchange(other.pending_, false);
    batch_ = other.batch_;
    index_ = other.index_;
    kind_ = other.kind_;
  }
  void release() noexcept {
    if (pending_ && kind_ == Kind::kRecv)
      if (const auto s = state_.lock(); s && batch_ == s->batch_id && index_ < s->batch.size())
        s->batch[index_].host_out = nullptr;  // not flushed yet: nowhere to copy a host receive to
    state_.reset();
    pending_ = false;
  }
  [[nodiscard]] bool started_on(const std::shared_ptr<detail::State>& s) const noexcept {
    return s && !state_.owner_before(s) && !s.owner_before(state_);
  }

  std::weak_ptr<detail::State> state_;  // weak: a request that outlives its transport stays harmless
  bool pending_ = false;
  Kind kind_ = Kind::kSend;
  std::uint32_t index_ = 0;  // position in its batch
  std::uint64_t batch_ = 0;
};

/// One rank's endpoint of an NCCL communicator, satisfying `seqpar::Transport` and
/// `seqpar::StreamOrderedTransport`: runs any strategy across GPUs and nodes, its transfers enqueued
/// on the execution context's comm stream (the executor calls `set_queue` and orders compute around
/// them with events; nothing waits on the host in a program's steady state).
///
/// Creation (one process, or one thread, per GPU; the device is `Options::device`, by default the
/// calling thread's current one):
///  - `Transport(id, rank, size)` with a unique id every rank got from rank 0; `bootstrap(host)`
///    carries it over a host transport (the MPI transport: `bootstrap(mpi_transport)`),
///    `bootstrap(store, rank, size)` through an `IdStore` (a `FileStore` on a shared path, for jobs
///    launched without MPI); `single()` is a world of one rank.
///  - Communicators are non-blocking (`ncclConfig_t::blocking = 0`): creation, split and every
///    enqueue return at once and are polled (`ncclCommGetAsyncError`) against the deadline
///    `Options::timeout`. A rank that never joins makes the others time out instead of hanging.
///  - `split(color, key)` is `ncclCommSplit` (after a barrier under the deadline), one communicator
///    per level of a strategy (BASP groups, Hierarchical's inner and outer levels); the child is named
///    "<parent>/<color>", the name errors give as the level.
///
/// Buffers: device memory of this transport's device is used in place and the call is stream-ordered:
/// it returns once enqueued on the queue (`set_queue`, else a stream of the transport's own), and
/// buffers must stay untouched until that queue has run it. Host memory (the engine's signature
/// agreement, the transport test bodies) is staged through pinned and device memory, and the call
/// completes on the host under the deadline before it returns, as the MPI transport's would; a call
/// whose buffers are all host memory runs on the transport's own stream, so that it never touches a
/// queue whose context is gone. Whatever stream a call uses, it first waits (an event) for this
/// transport's previous operation: one order per transport. Communicators of different transports
/// share no order beyond their streams' (the engine's levels share the context's comm stream).
///
/// Operations:
///  - isend/irecv are posted and issued together at the next flush as one group of ncclSend/ncclRecv
///    (ncclGroupStart/End), so that a ring step's send and receive cannot deadlock. A flush happens at
///    the first wait of a posted request, before any other operation, when the queue changes, and at
///    `flush()`. The executor posts a ring step before the attention it overlaps and waits after it:
///    the group is issued at that wait, while the compute stream still runs the attention (the host
///    runs ahead of the GPU), so the overlap holds. NCCL has no tags: a flush issues its operations
///    sorted by (tag, post order), so within one flush messages between two ranks match by tag then
///    order; across flushes, in flush order. Zero-byte messages are counted and not issued. send/recv
///    are isend/irecv + wait. NCCL cannot tell a receive of the wrong size (a protocol error is
///    undefined there, not Errc::kProtocol): sizes agree by construction of the programs and the
///    engine's signature agreement.
///  - all_to_all(_v): one group of ncclSend/ncclRecv per peer, the block to self a device copy.
///    all_gather: ncclAllGather. all_gather_v: one group of ncclBroadcast, one per rank with a block.
///    barrier: a one-word ncclAllReduce waited for on the host. Send and receive buffers must not overlap.
///  - Counters: as the MPI and in-process transports: bytes and messages to other ranks, each
///    non-empty block of a collective to another rank is one message; self-traffic, barrier and split
///    are free.
///
/// Failures (never a hang): every call first checks `ncclCommGetAsyncError` and whether the oldest
/// operation not yet seen complete was enqueued more than `timeout` ago; host waits (host buffers,
/// barrier, split, `synchronize()`) poll the queue and the communicator against the deadline. A
/// timeout, an asynchronous NCCL error or a failed peer aborts the communicator (`ncclCommAbort`, which
/// also stops its kernels, so the streams run on) and throws `seqpar::Error` naming this rank, the
/// communicator (the level), the operation and the peer: Errc::kTimeout for a deadline, the NCCL
/// result (`nccl_category()`) for an NCCL error. A stream-ordered program that only enqueues sees a
/// hang at its next transport call; end a step with `synchronize()` rather than a bare
/// cudaStreamSynchronize, which has no deadline.
///
/// State after an abort: the communicator is gone and this transport is unusable: every operation
/// throws Errc::kTransport "... was aborted earlier (<why>)"; rank(), size(), counters() still answer
/// and destruction is safe. Buffers written by aborted transfers hold undefined bytes, and work the
/// streams ran after them read those bytes. Its parent and its splits are separate communicators and
/// are not aborted; after a peer failed they cannot complete collectives either (abort them, or end
/// the process). Recovery is a new bootstrap (a new unique id), as NCCL requires.
///
/// Lifetime: the destructor aborts the communicator (ncclCommAbort is local, while ncclCommDestroy
/// synchronizes with peers: ranks destroying their transports in different orders, as the engine's
/// caches may, must not deadlock): `synchronize()` first if transfers may still run. Not thread-safe:
/// one thread per Transport.
///
/// @code
/// seqpar::backend::mpi::Environment env(argc, argv);                    // ids travel over MPI
/// seqpar::backend::mpi::Transport host(MPI_COMM_WORLD);
/// cudaSetDevice(local_rank);
/// auto t = seqpar::backend::nccl::Transport::bootstrap(host);
/// seqpar::DistributedAttention<ZigzagRing, attention::CudaFlash<__nv_bfloat16>> attn(t, shape, args);
/// attn.forward(batch, q, k, v, o, lse);                                 // device views
/// t.synchronize();                                                      // under the deadline
/// @endcode
class Transport {
 public:
  using Request = nccl::Request;
  static constexpr bool kStreamOrdered = true;

  using Options = nccl::Options;

  /// Joins the communicator named `id` as `rank` of `size` (collective over its ranks).
  Transport(const UniqueId& id, int rank, int size) : Transport(id, rank, size, Options{}) {}
  Transport(const UniqueId& id, int rank, int size, Options options) {
    constexpr std::string_view where = "nccl::Transport";
    validate(where, rank, size, options);
    s_ = make_state(where, options);
    s_->rank = rank, s_->size = size, s_->world_rank = rank;
    ncclConfig_t config = non_blocking();
    ncclComm_t comm = nullptr;
    const ncclResult_t rc = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    s_->comm = comm;
    settle_creation(comm, rc, "creating the communicator (ncclCommInitRankConfig)");
    s_->counters.bytes_to_peer.assign(static_cast<std::size_t>(size), 0);
  }

  /// A world of one rank: this process's device alone.
  [[nodiscard]] static Transport single(Options options = {}) { return Transport(unique_id(), 0, 1, options); }

  /// Joins a communicator of `size` ranks whose unique id travels through `store` (rank 0 publishes
  /// it; the others fetch it; rank 0 removes it once every rank has joined).
  template <IdStore Store>
  [[nodiscard]] static Transport bootstrap(Store& store, int rank, int size, Options options = {}) {
    validate("nccl::Transport::bootstrap", rank, size, options);
    UniqueId id{};
    const auto bytes = std::as_writable_bytes(std::span<UniqueId>(&id, 1));
    if (rank == 0) {
      id = unique_id();
      store.publish(bytes);
    } else {
      store.fetch(bytes);
    }
    Transport t(id, rank, size, options);
    if constexpr (requires { store.remove(); })
      if (rank == 0) store.remove();  // every rank read it: NCCL's creation needs all of them
    return t;
  }

  /// Joins a communicator of the ranks of `host` (rank 0 makes the unique id, an all_gather of
  /// `host` carries it): `bootstrap(mpi_transport)` shares it through MPI. Collective over `host`.
  template <seqpar::Transport Host>
  requires(!StreamOrderedTransport<Host>) [[nodiscard]] static Transport bootstrap(Host& host, Options options = {}) {
    validate("nccl::Transport::bootstrap", host.rank(), host.size(), options);
    UniqueId mine{};
    if (host.rank() == 0) mine = unique_id();
    std::vector<UniqueId> all(static_cast<std::size_t>(host.size()));
    host.all_gather(std::as_bytes(std::span<const UniqueId>(&mine, 1)), std::as_writable_bytes(std::span(all)));
    return Transport(all[0], host.rank(), host.size(), options);
  }

  Transport(Transport&&) noexcept = default;
  Transport& operator=(Transport&&) noexcept = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  ~Transport() = default;

  [[nodiscard]] int rank() const noexcept { return s_ ? s_->rank : 0; }
  [[nodiscard]] int size() const noexcept { return s_ ? s_->size : 0; }
  /// This rank in the communicator it was split from first (the bootstrap's rank).
  [[nodiscard]] int world_rank() const noexcept { return s_ ? s_->world_rank : 0; }
  /// "world", or "<parent>/<color>" for a split: the level errors name.
  [[nodiscard]] const std::string& name() const { return live("name").name; }
  [[nodiscard]] int device() const noexcept { return s_ ? s_->device : -1; }
  /// The NCCL communicator (for interoperation: do not destroy it); null once aborted.
  [[nodiscard]] ncclComm_t comm() const noexcept { return s_ ? s_->comm : nullptr; }
  /// The queue operations are enqueued on now.
  [[nodiscard]] cudaStream_t queue() const noexcept { return s_ ? s_->queue : nullptr; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return s_ ? s_->timeout : std::chrono::milliseconds{0};
  }
  /// Changes the deadline of later operations (a split inherits its parent's).
  void set_timeout(std::chrono::milliseconds timeout) {
    seqpar::detail::require(timeout.count() > 0, "nccl::Transport::set_timeout", "timeout",
                            std::to_string(timeout.count()) + " ms", "must be > 0");
    live("set_timeout").timeout = timeout;
  }
  /// Whether the communicator was aborted, and why.
  [[nodiscard]] bool aborted() const noexcept { return s_ && !s_->aborted.empty(); }
  [[nodiscard]] const std::string& abort_reason() const { return live("abort_reason").aborted; }

  /// Enqueue on `queue` (a cudaStream_t of this transport's device; null: the transport's own stream).
  /// Posted isend/irecv are flushed to the previous queue first.
  void set_queue(void* queue) {
    detail::State& s = live("set_queue");
    const auto q = queue != nullptr ? static_cast<cudaStream_t>(queue) : s.own.get();
    if (q == s.queue) return;
    if (!s.batch.empty()) flush();
    s.queue = q;
    follow_tail(s, q, "set_queue");  // what ran on the old queue comes first (requests waited there)
  }

  /// Sends `data` to `peer` with `tag`: isend + wait (device memory: returns once enqueued).
  void send(std::span<const std::byte> data, int peer, int tag) {
    Request req = isend(data, peer, tag);
    wait(req);
  }

  /// Receives the next message from `peer` with `tag` into `data`: irecv + wait.
  void recv(std::span<std::byte> data, int peer, int tag) {
    Request req = irecv(data, peer, tag);
    wait(req);
  }

  /// Posts sending `data` to `peer` with `tag`; issued at the next flush. A host buffer is copied
  /// now (it may be reused at once); a device buffer must stay unchanged until the queue ran it.
  [[nodiscard]] Request isend(std::span<const std::byte> data, int peer, int tag) {
    constexpr std::string_view where = "nccl::Transport::isend";
    check_peer_tag(where, peer, tag);
    detail::State& s = usable("isend");
    detail::PostedOp op{.send = true,
                        .peer = peer,
                        .tag = tag,
                        .post = static_cast<std::uint32_t>(s.batch.size()),
                        .data = const_cast<std::byte*>(data.data()),
                        .bytes = data.size()};
    if (!data.empty() && is_host(data.data(), where, "data")) {
      const auto block = s.staging.take(data.size(), where);
      std::memcpy(block.host, data.data(), data.size());  // to the device at the flush
      op.data = block.device;
      op.pinned = block.host;
      s.batch_host = true;
    } else if (!data.empty()) {
      s.batch_device = true;
    }
    return post(s, op, Request::Kind::kSend);
  }

  /// Posts receiving the next message from `peer` with `tag` into `data`; wait() completes it.
  [[nodiscard]] Request irecv(std::span<std::byte> data, int peer, int tag) {
    constexpr std::string_view where = "nccl::Transport::irecv";
    check_peer_tag(where, peer, tag);
    detail::State& s = usable("irecv");
    detail::PostedOp op{.send = false,
                        .peer = peer,
                        .tag = tag,
                        .post = static_cast<std::uint32_t>(s.batch.size()),
                        .data = data.data(),
                        .bytes = data.size()};
    if (!data.empty() && is_host(data.data(), where, "data")) {
      const auto block = s.staging.take(data.size(), where);
      op.data = block.device;
      op.pinned = block.host;
      op.host_out = data.data();
      s.batch_host = true;
    } else if (!data.empty()) {
      s.batch_device = true;
    }
    return post(s, op, Request::Kind::kRecv);
  }

  /// Completes `req`: flushes its batch if it is not issued yet; then the queue runs after the
  /// transfer (device memory), or the data is in place (host memory). `req` is empty afterwards.
  void wait(Request& req) {
    if (!req.pending()) return;
    seqpar::detail::require(req.started_on(s_), "nccl::Transport::wait", "req", "<request>",
                            "was started on another transport");
    Request done = std::move(req);
    detail::State& s = usable(done.kind_ == Request::Kind::kRecv ? "wait(irecv)" : "wait(isend)");
    if (done.batch_ == s.batch_id) flush();
  }

  /// Issues the posted isend/irecv now, as one group (the executor's post steps may call it to start
  /// transfers before their wait). A batch with a device buffer runs on the queue; one of host
  /// buffers only on the transport's own stream, and completes on the host.
  void flush() {
    detail::State& s = usable("flush");
    if (s.batch.empty()) return;
    const cudaStream_t stream = s.batch_device ? s.queue : s.own.get();
    follow_tail(s, stream, "flush");
    detail::order_for_issue(s.batch);
    const auto what = [&] { return "isend/irecv" + batch_peers(s); };
    bool any = false;
    for (const detail::PostedOp& op : s.batch) {
      any = any || op.bytes != 0;
      if (op.send && op.pinned != nullptr)
        cuda_check(cudaMemcpyAsync(op.data, op.pinned, op.bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync",
                   "isend");
    }
    if (any) {
      group_start(what);
      for (const detail::PostedOp& op : s.batch) {
        if (op.bytes == 0) continue;  // the peer skips it too: both know the size
        const ncclResult_t rc = op.send ? ncclSend(op.data, op.bytes, ncclUint8, op.peer, s.comm, stream)
                                        : ncclRecv(op.data, op.bytes, ncclUint8, op.peer, s.comm, stream);
        if (rc != ncclSuccess && rc != ncclInProgress) {
          (void)ncclGroupEnd();
          fail_nccl(rc, op.send ? "isend" : "irecv", op.peer, op.tag);
        }
      }
      settle(ncclGroupEnd(), what);
      record_tail(s, stream, "flush");
      arm(s, stream, "isend/irecv", single_peer(s));
    }
    if (s.batch_host) {
      for (const detail::PostedOp& op : s.batch)
        if (!op.send && op.pinned != nullptr)
          cuda_check(cudaMemcpyAsync(op.pinned, op.data, op.bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync",
                     "irecv");
      host_wait(s, stream, what);
      for (const detail::PostedOp& op : s.batch)
        if (op.host_out != nullptr) std::memcpy(op.host_out, op.pinned, op.bytes);
      s.staging.reset();
    }
    s.batch.clear();
    s.batch_host = s.batch_device = false;
    ++s.batch_id;
  }

  /// Equal blocks: block i of `s` (s.size() / size() bytes) goes to rank i; block i of `r` comes from
  /// rank i. Requires s.size() == r.size(), a multiple of size().
  void all_to_all(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "nccl::Transport::all_to_all";
    detail::State& st = live("all_to_all");
    const auto n = static_cast<std::size_t>(st.size);
    seqpar::detail::require(r.size() == s.size(), where, "r.size()", r.size(),
                            "must equal s.size() = " + std::to_string(s.size()));
    seqpar::detail::require(s.size() % n == 0, where, "s.size()", s.size(),
                            "must be a multiple of size() = " + std::to_string(n));
    st.counts.assign(n, s.size() / n);
    exchange(where, "all_to_all", s, st.counts, r, st.counts);
  }

  /// Variable blocks: send_counts[i] bytes (contiguous, in rank order in `s`) go to rank i;
  /// recv_counts[i] bytes (contiguous, in rank order in `r`) come from rank i. Rank j's
  /// send_counts[i] must equal rank i's recv_counts[j]. One group of ncclSend/ncclRecv.
  void all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> send_counts, std::span<std::byte> r,
                    std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "nccl::Transport::all_to_all_v";
    const detail::State& st = live("all_to_all_v");
    require_counts(where, "send_counts", send_counts, "s.size()", s.size(), st.size);
    require_counts(where, "recv_counts", recv_counts, "r.size()", r.size(), st.size);
    exchange(where, "all_to_all_v", s, send_counts, r, recv_counts);
  }

  /// Every rank contributes s.size() bytes (equal on all ranks); `r` (size() * s.size() bytes)
  /// receives them in rank order. ncclAllGather.
  void all_gather(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "nccl::Transport::all_gather";
    detail::State& st = live("all_gather");
    const auto n = static_cast<std::size_t>(st.size);
    seqpar::detail::require(r.size() == n * s.size(), where, "r.size()", r.size(),
                            "must equal size() * s.size() = " + std::to_string(n * s.size()));
    require_disjoint(where, s, r);
    usable("all_gather");
    flush();
    if (s.empty()) return;
    const Placement p = place(st, where, s, r);
    const auto what = [] { return std::string("all_gather with the ranks of the communicator"); };
    settle(ncclAllGather(p.in, p.out, s.size(), ncclUint8, st.comm, p.stream), what);
    record_tail(st, p.stream, "all_gather");
    arm(st, p.stream, "all_gather");
    finish(st, p, r, what);
    for (int dst = 0; dst < st.size; ++dst) count_block(st, dst, s.size());
  }

  /// Rank i contributes recv_counts[i] bytes; `r` receives them contiguously in rank order. Requires
  /// recv_counts[rank()] == s.size() and sum(recv_counts) == r.size(). One group of ncclBroadcast.
  void all_gather_v(std::span<const std::byte> s, std::span<std::byte> r, std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "nccl::Transport::all_gather_v";
    detail::State& st = live("all_gather_v");
    require_counts(where, "recv_counts", recv_counts, "r.size()", r.size(), st.size);
    seqpar::detail::require(
        recv_counts[static_cast<std::size_t>(st.rank)] == s.size(), where, "s.size()", s.size(),
        "must equal recv_counts[rank()] = " + std::to_string(recv_counts[static_cast<std::size_t>(st.rank)]));
    require_disjoint(where, s, r);
    usable("all_gather_v");
    flush();
    if (r.empty()) return;
    const Placement p = place(st, where, s, r);
    const auto what = [] { return std::string("all_gather_v with the ranks of the communicator"); };
    group_start(what);
    std::size_t offset = 0;
    for (int root = 0; root < st.size; ++root) {
      const std::size_t count = recv_counts[static_cast<std::size_t>(root)];
      if (count != 0) {
        const void* from = root == st.rank ? static_cast<const void*>(p.in) : p.out + offset;
        const ncclResult_t rc = ncclBroadcast(from, p.out + offset, count, ncclUint8, root, st.comm, p.stream);
        if (rc != ncclSuccess && rc != ncclInProgress) {
          (void)ncclGroupEnd();
          fail_nccl(rc, "all_gather_v", root, -1);
        }
      }
      offset += count;
    }
    settle(ncclGroupEnd(), what);
    record_tail(st, p.stream, "all_gather_v");
    arm(st, p.stream, "all_gather_v");
    finish(st, p, r, what);
    for (int dst = 0; dst < st.size; ++dst) count_block(st, dst, s.size());
  }

  /// Returns once every rank of this communicator has entered barrier(): a one-word ncclAllReduce on
  /// the transport's own stream (NCCL orders it after this communicator's earlier operations, on any
  /// stream), waited for on the host under the deadline.
  void barrier() {
    detail::State& s = usable("barrier");
    flush();
    const auto what = [] { return std::string("barrier with the ranks of the communicator"); };
    follow_tail(s, s.own.get(), "barrier");
    settle(ncclAllReduce(s.word, s.word, 1, ncclUint32, ncclMax, s.comm, s.own.get()), what);
    record_tail(s, s.own.get(), "barrier");
    host_wait(s, s.own.get(), what);
  }

  /// Collective: the ranks with the same `color` (>= 0) form a new communicator, ordered by `key`,
  /// then by rank() (ncclCommSplit, after a barrier under the deadline). Named "<name()>/<color>".
  [[nodiscard]] Transport split(int color, int key) {
    seqpar::detail::require(color >= 0, "nccl::Transport::split", "color", color, "must be >= 0");
    detail::State& s = usable("split");
    barrier();  // a rank that never arrives times out here, not inside the split
    Transport child;
    child.s_ = make_state("nccl::Transport::split", Options{.timeout = s.timeout, .device = s.device});
    child.s_->name = s.name + "/" + std::to_string(color);
    child.s_->world_rank = s.world_rank;
    ncclConfig_t config = non_blocking();
    ncclComm_t comm = nullptr;
    const ncclResult_t rc = ncclCommSplit(s.comm, color, key, &comm, &config);
    child.s_->comm = comm;
    child.s_->rank = s.rank;  // names this rank in the child's errors until NCCL says
    child.s_->size = s.size;
    child.settle_creation(comm, rc, "split (ncclCommSplit) of " + s.name);
    settle(ncclSuccess, [] { return std::string("split"); });  // the parent, too, is ready again
    int rank = 0, size = 0;
    child.check_call(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
    child.check_call(ncclCommCount(comm, &size), "ncclCommCount");
    child.s_->rank = rank, child.s_->size = size;
    child.s_->counters.bytes_to_peer.assign(static_cast<std::size_t>(size), 0);
    return child;
  }

  /// Flushes and waits on the host (under the deadline) for everything enqueued on the queue: the
  /// point where a stream-ordered step learns that its transfers finished, or that a peer failed.
  void synchronize() {
    detail::State& s = usable("synchronize");
    flush();
    const auto what = [] { return std::string("synchronize"); };
    host_wait(s, s.own.get(), what);
    if (s.queue != s.own.get()) host_wait(s, s.queue, what);
  }

  /// Aborts the communicator (ncclCommAbort); every later operation throws. Local: the peers learn
  /// of it when their operations with this rank time out or fail.
  void abort() noexcept {
    if (s_) abort_comm(*s_, "aborted by the caller");
  }

  /// Bytes and messages this object sent to other ranks since construction or reset_counters().
  [[nodiscard]] const TrafficCounters& counters() const noexcept {
    static const TrafficCounters none;
    return s_ ? s_->counters : none;
  }
  void reset_counters() noexcept {
    if (!s_) return;
    s_->counters.bytes_sent = 0;
    s_->counters.messages_sent = 0;
    std::fill(s_->counters.bytes_to_peer.begin(), s_->counters.bytes_to_peer.end(), std::uint64_t{0});
  }

 private:
  using clock = std::chrono::steady_clock;

  Transport() = default;

  // ---- creation -------------------------------------------------------------------------------------

  static void validate(std::string_view where, int rank, int size, const Options& options) {
    seqpar::detail::require(options.timeout.count() > 0, where, "options.timeout",
                            std::to_string(options.timeout.count()) + " ms", "must be > 0");
    seqpar::detail::require(options.device >= -1, where, "options.device", options.device,
                            "must be a device number, or -1 for the current device");
    seqpar::detail::require(size >= 1, where, "size", size, "must be >= 1");
    seqpar::detail::require(rank >= 0 && rank < size, where, "rank", rank,
                            "must be in [0, size) = [0, " + std::to_string(size) + ")");
  }

  static std::shared_ptr<detail::State> make_state(std::string_view where, const Options& options) {
    auto s = std::make_shared<detail::State>();
    s->timeout = options.timeout;
    int device = options.device;
    const auto check = [&](cudaError_t rc, const char* call) {
      if (rc != cudaSuccess) throw Error(Errc::kTransport, std::string(where) + ": " + detail::cuda_failure(rc, call));
    };
    if (device < 0) check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaSetDevice(device), "cudaSetDevice");
    s->device = device;
    s->own = detail::Stream(where);
    s->queue = s->own.get();
    s->done = detail::Event(where);
    s->tail = detail::Event(where);
    s->watch = detail::Event(where);
    void* word = nullptr;
    check(cudaMalloc(&word, sizeof(std::uint32_t)), "cudaMalloc");
    s->word = static_cast<std::uint32_t*>(word);
    check(cudaMemsetAsync(word, 0, sizeof(std::uint32_t), s->queue), "cudaMemsetAsync");
    check(cudaStreamSynchronize(s->queue), "cudaStreamSynchronize");  // a fresh stream: nothing can hang
    return s;
  }

  static ncclConfig_t non_blocking() noexcept {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns at once; readiness is polled against the deadline
    return config;
  }

  // Polls a communicator being created (or split) until it is ready; aborts it on timeout or error.
  void settle_creation(ncclComm_t comm, ncclResult_t rc, const std::string& op) {
    detail::State& s = *s_;
    if (rc != ncclSuccess && rc != ncclInProgress) {
      abort_comm(s, op + " failed");
      throw Error(std::error_code(rc, nccl_category()), who() + ": " + op + ": " + nccl_text(rc));
    }
    ncclResult_t state = rc;
    const bool ready = comm != nullptr && detail::poll_until(clock::now() + s.timeout, [&] {
                         if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
                         return state != ncclInProgress;
                       });
    if (!ready && comm != nullptr) {
      const std::string why = who() + ": " + op + " timed out after " + std::to_string(s.timeout.count()) +
                              " ms: a rank of the " + std::to_string(s.size) +
                              " did not join (is every rank running, with the same unique id?)";
      abort_comm(s, why);
      throw Error(Errc::kTimeout, why + "; the communicator was aborted");
    }
    if (state != ncclSuccess) {
      const std::string text = nccl_text(state);
      abort_comm(s, op + " failed");
      throw Error(std::error_code(state, nccl_category()), who() + ": " + op + ": " + text);
    }
  }

  // ---- the checks every call makes ------------------------------------------------------------------

  [[nodiscard]] detail::State& live(const char* op) const {
    if (!s_) throw std::logic_error(std::string("nccl::Transport::") + op + ": the transport was moved from");
    return *s_;
  }

  // The communicator is usable: not aborted, no asynchronous error, and the oldest operation not yet
  // seen complete was enqueued less than the timeout ago.
  detail::State& usable(const char* op) {
    detail::State& s = live(op);
    if (!s.aborted.empty())
      throw Error(Errc::kTransport, who() + ": " + op + ": the communicator was aborted earlier (" + s.aborted +
                                        "); bootstrap a new Transport");
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(s.comm, &async) != ncclSuccess) async = ncclInternalError;
    if (async != ncclSuccess && async != ncclInProgress) fail_async(s, async, op);
    if (s.watching) {
      const cudaError_t q = cudaEventQuery(s.watch.get());
      if (q == cudaSuccess) {
        s.watching = false;
      } else if (q != cudaErrorNotReady) {
        fail_cuda(s, q, "cudaEventQuery", op);
      } else if (clock::now() - s.watch_since >= s.timeout) {
        const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - s.watch_since).count();
        const std::string why = who() + ": " + op + ": an earlier " + s.watch_op + with_peer(s.watch_peer, -1) +
                                " enqueued " + std::to_string(ago) + " ms ago has not completed (timeout " +
                                std::to_string(s.timeout.count()) + " ms): a peer did not take part";
        abort_comm(s, why);
        throw Error(Errc::kTimeout, why + "; the communicator was aborted");
      }
    }
    return s;
  }

  // Starts watching the operation just enqueued unless an older one is still watched.
  static void arm(detail::State& s, cudaStream_t stream, const char* op, int peer = -1) {
    if (s.watching) return;
    if (cudaEventRecord(s.watch.get(), stream) != cudaSuccess) {
      (void)cudaGetLastError();
      return;  // progress is still checked by the next host wait
    }
    s.watching = true;
    s.watch_since = clock::now();
    s.watch_op = op;
    s.watch_peer = peer;
  }
  // One order per transport whatever stream each call uses: an operation on a stream other than the
  // last one's first waits for the last one (an event: no host wait; valid after that stream is gone).
  void follow_tail(detail::State& s, cudaStream_t stream, const char* op) const {
    if (s.tail_on == nullptr || s.tail_on == stream) return;
    cuda_check(cudaStreamWaitEvent(stream, s.tail.get(), 0), "cudaStreamWaitEvent", op);
    s.tail_on = nullptr;  // `stream` now carries the order until the next record_tail
  }
  void record_tail(detail::State& s, cudaStream_t stream, const char* op) const {
    cuda_check(cudaEventRecord(s.tail.get(), stream), "cudaEventRecord", op);
    s.tail_on = stream;
  }
  // The peer of every operation of the batch, or -1 when there are several.
  static int single_peer(const detail::State& s) noexcept {
    for (const detail::PostedOp& op : s.batch)
      if (op.peer != s.batch.front().peer) return -1;
    return s.batch.empty() ? -1 : s.batch.front().peer;
  }

  // Waits on the host for everything enqueued on `stream` so far, under the deadline.
  template <class What>
  void host_wait(detail::State& s, cudaStream_t stream, What&& what) {
    cuda_check(cudaEventRecord(s.done.get(), stream), "cudaEventRecord", "host wait");
    ncclResult_t async = ncclSuccess;
    cudaError_t q = cudaErrorNotReady;
    const bool finished = detail::poll_until(clock::now() + s.timeout, [&] {
      q = cudaEventQuery(s.done.get());
      if (q != cudaErrorNotReady) return true;
      if (ncclCommGetAsyncError(s.comm, &async) != ncclSuccess) async = ncclInternalError;
      return async != ncclSuccess && async != ncclInProgress;
    });
    if (q == cudaSuccess) {
      if (s.watching && cudaEventQuery(s.watch.get()) == cudaSuccess) s.watching = false;  // maybe on another stream
      return;
    }
    if (!finished) {
      std::string why = who() + ": " + what() + " timed out after " + std::to_string(s.timeout.count()) +
                        " ms (a peer did not take part, or the queue is stalled)";
      if (s.watching) {
        const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - s.watch_since).count();
        why += "; the oldest unfinished operation is " + std::string(s.watch_op) + with_peer(s.watch_peer, -1) +
               ", enqueued " + std::to_string(ago) + " ms ago";
      }
      abort_comm(s, why);
      throw Error(Errc::kTimeout, why + "; the communicator was aborted");
    }
    if (q != cudaErrorNotReady) fail_cuda(s, q, "cudaEventQuery", what().c_str());
    fail_async(s, async, what().c_str());
  }

  // Polls an enqueue that returned ncclInProgress (non-blocking communicator) until it is done.
  template <class What>
  void settle(ncclResult_t rc, What&& what) {
    detail::State& s = *s_;
    if (rc != ncclSuccess && rc != ncclInProgress) fail_nccl(rc, what(), -1, -1);
    ncclResult_t state = rc;
    if (state == ncclSuccess && ncclCommGetAsyncError(s.comm, &state) != ncclSuccess) state = ncclInternalError;
    if (state == ncclInProgress) {
      const bool done = detail::poll_until(clock::now() + s.timeout, [&] {
        if (ncclCommGetAsyncError(s.comm, &state) != ncclSuccess) state = ncclInternalError;
        return state != ncclInProgress;
      });
      if (!done) {
        const std::string why =
            who() + ": enqueueing " + what() + " timed out after " + std::to_string(s.timeout.count()) + " ms";
        abort_comm(s, why);
        throw Error(Errc::kTimeout, why + "; the communicator was aborted");
      }
    }
    if (state != ncclSuccess) fail_async(s, state, what().c_str());
  }

  template <class What>
  void group_start(What&& what) {
    if (const ncclResult_t rc = ncclGroupStart(); rc != ncclSuccess) fail_nccl(rc, what(), -1, -1);
  }

  // ---- failures -------------------------------------------------------------------------------------

  // "rank 1 of world/0 (world rank 3)": the rank, the communicator (the level) and the world rank.
  [[nodiscard]] std::string who() const {
    if (!s_) return "nccl::Transport";
    std::string w = "rank " + std::to_string(s_->rank) + " of " + s_->name;
    if (s_->world_rank != s_->rank) w += " (world rank " + std::to_string(s_->world_rank) + ")";
    return w;
  }
  [[nodiscard]] static std::string with_peer(int peer, int tag) {
    if (peer < 0) return "";
    std::string s = " with rank " + std::to_string(peer);
    if (tag >= 0) s += " (tag " + std::to_string(tag) + ")";
    return s;
  }
  // " with rank(s) 1, 3" for the operations of the batch.
  [[nodiscard]] static std::string batch_peers(const detail::State& s) {
    std::vector<int> peers;
    for (const detail::PostedOp& op : s.batch) peers.push_back(op.peer);
    std::sort(peers.begin(), peers.end());
    peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
    std::string out = peers.size() == 1 ? " with rank " : " with ranks ";
    for (std::size_t i = 0; i < peers.size(); ++i) out += (i ? ", " : "") + std::to_string(peers[i]);
    return out;
  }
  [[nodiscard]] std::string nccl_text(ncclResult_t rc) const {
    std::string t = ncclGetErrorString(rc);
    const char* last = ncclGetLastError(s_ ? s_->comm : nullptr);
    if (last != nullptr && *last != '\0') t += std::string(" (") + last + ")";
    return t;
  }

  // Aborts the communicator once; remembers why.
  static void abort_comm(detail::State& s, const std::string& why) noexcept {
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

  [[noreturn]] void fail_nccl(ncclResult_t rc, const std::string& op, int peer, int tag) {
    const std::string why = who() + ": " + op + with_peer(peer, tag) + ": " + nccl_text(rc);
    abort_comm(*s_, why);
    throw Error(std::error_code(rc, nccl_category()), why + "; the communicator was aborted");
  }
  // An asynchronous NCCL error (a failed peer, a network error): abort, then throw its result.
  [[noreturn]] void fail_async(detail::State& s, ncclResult_t async, const char* op) {
    const std::string why = who() + ": " + op + ": NCCL reported " + nccl_text(async) +
                            (async == ncclRemoteError ? " (a peer failed or left)" : "");
    abort_comm(s, why);
    throw Error(std::error_code(async, nccl_category()), why + "; the communicator was aborted");
  }
  [[noreturn]] void fail_cuda(detail::State& s, cudaError_t rc, const char* call, const char* op) {
    const std::string why = who() + ": " + op + ": " + detail::cuda_failure(rc, call);
    abort_comm(s, why);
    throw Error(Errc::kTransport, why + "; the communicator was aborted");
  }
  void cuda_check(cudaError_t rc, const char* call, const char* op) const {
    if (rc != cudaSuccess) throw Error(Errc::kTransport, who() + ": " + op + ": " + detail::cuda_failure(rc, call));
  }
  void check_call(ncclResult_t rc, const char* call) {
    if (rc != ncclSuccess) fail_nccl(rc, call, -1, -1);
  }

  // ---- arguments ------------------------------------------------------------------------------------

  void check_peer_tag(std::string_view where, int peer, int tag) const {
    const int n = live("isend/irecv").size;
    seqpar::detail::require(peer >= 0 && peer < n, where, "peer", peer,
                            "must be in [0, size()) = [0, " + std::to_string(n) + ")");
    seqpar::detail::require(tag >= 0, where, "tag", tag, "must be >= 0");
  }

  static void require_counts(std::string_view where, std::string_view name, std::span<const std::size_t> counts,
                             std::string_view buffer, std::size_t buffer_size, int n) {
    seqpar::detail::require(counts.size() == static_cast<std::size_t>(n), where, std::string(name) + ".size()",
                            counts.size(), "must equal size() = " + std::to_string(n));
    const std::size_t sum = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    seqpar::detail::require(sum == buffer_size, where, "sum(" + std::string(name) + ")", sum,
                            "must equal " + std::string(buffer) + " = " + std::to_string(buffer_size));
  }

  static void require_disjoint(std::string_view where, std::span<const std::byte> s, std::span<std::byte> r) {
    if (s.empty() || r.empty()) return;
    const std::less<const std::byte*> before;
    const bool overlap = before(s.data(), r.data() + r.size()) && before(r.data(), s.data() + s.size());
    seqpar::detail::require(!overlap, where, "r", "<buffer>", "overlaps s (in-place collectives are not supported)");
  }

  // Host memory (staged) or device memory of this transport's device (used in place).
  [[nodiscard]] bool is_host(const void* p, std::string_view where, std::string_view argument) const {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return true;  // memory CUDA does not know: host memory
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) return true;
    seqpar::detail::require(a.device == s_->device, where, argument, "<device buffer>",
                            "is memory of device " + std::to_string(a.device) + ", this transport's device is " +
                                std::to_string(s_->device));
    return false;
  }

  // ---- staging of host buffers ----------------------------------------------------------------------

  // Where a collective runs: the caller's device buffers in place on the queue; host buffers through
  // staging blocks. A call with host buffers only runs on the transport's own stream (the caller's
  // queue may be gone: the engine's agreement outlives the contexts that set it); any host buffer
  // makes the call complete on the host.
  struct Placement {
    const std::byte* in = nullptr;    // what NCCL reads
    std::byte* out = nullptr;         // what NCCL writes
    std::byte* pinned_out = nullptr;  // a staged output: where it lands before the caller's buffer
    cudaStream_t stream = nullptr;
    bool host = false;  // a buffer was staged: the call completes on the host
  };

  Placement place(detail::State& st, std::string_view where, std::span<const std::byte> s, std::span<std::byte> r) {
    const bool s_host = !s.empty() && is_host(s.data(), where, "s");
    const bool r_host = !r.empty() && is_host(r.data(), where, "r");
    const bool device = (!s.empty() && !s_host) || (!r.empty() && !r_host);
    Placement p{s.data(), r.data(), nullptr, device ? st.queue : st.own.get(), s_host || r_host};
    follow_tail(st, p.stream, where.data());
    if (s_host) {
      const auto block = st.staging.take(s.size(), where);
      std::memcpy(block.host, s.data(), s.size());
      cuda_check(cudaMemcpyAsync(block.device, block.host, s.size(), cudaMemcpyHostToDevice, p.stream),
                 "cudaMemcpyAsync", "staging s");
      p.in = block.device;
    }
    if (r_host) {
      const auto block = st.staging.take(r.size(), where);
      p.out = block.device;
      p.pinned_out = block.host;
    }
    return p;
  }
  // After the operation: a staged output is copied back; a staged call completes on the host.
  template <class What>
  void finish(detail::State& st, const Placement& p, std::span<std::byte> r, What&& what) {
    if (!p.host) return;
    if (p.pinned_out != nullptr)
      cuda_check(cudaMemcpyAsync(p.pinned_out, p.out, r.size(), cudaMemcpyDeviceToHost, p.stream), "cudaMemcpyAsync",
                 "staging r");
    host_wait(st, p.stream, what);
    if (p.pinned_out != nullptr) std::memcpy(r.data(), p.pinned_out, r.size());
    st.staging.reset();
  }

  // ---- operations -----------------------------------------------------------------------------------

  Request post(detail::State& s, const detail::PostedOp& op, Request::Kind kind) {
    s.batch.push_back(op);
    if (op.send) count_message(s, op.peer, op.bytes);
    Request req;
    req.state_ = s_;
    req.pending_ = true;
    req.batch_ = s.batch_id;
    req.index_ = op.post;
    req.kind_ = kind;
    return req;
  }

  // all_to_all and all_to_all_v: one group of ncclSend/ncclRecv, the block to self a device copy.
  void exchange(std::string_view where, const char* op, std::span<const std::byte> s,
                std::span<const std::size_t> send_counts, std::span<std::byte> r,
                std::span<const std::size_t> recv_counts) {
    detail::State& st = live(op);
    const auto me = static_cast<std::size_t>(st.rank);
    seqpar::detail::require(send_counts[me] == recv_counts[me], where, "send_counts[rank()]", send_counts[me],
                            "must equal recv_counts[rank()] = " + std::to_string(recv_counts[me]));
    require_disjoint(where, s, r);
    usable(op);
    flush();
    const Placement pl = place(st, where, s, r);
    const auto what = [op] { return std::string(op) + " with the ranks of the communicator"; };
    if (send_counts[me] != 0) {
      const std::size_t from = std::accumulate(send_counts.begin(), send_counts.begin() + st.rank, std::size_t{0});
      const std::size_t to = std::accumulate(recv_counts.begin(), recv_counts.begin() + st.rank, std::size_t{0});
      cuda_check(cudaMemcpyAsync(pl.out + to, pl.in + from, send_counts[me], cudaMemcpyDeviceToDevice, pl.stream),
                 "cudaMemcpyAsync", op);
    }
    std::size_t send_at = 0, recv_at = 0;
    bool grouped = false;
    for (std::size_t p = 0; p < send_counts.size(); ++p) {
      const std::size_t sc = send_counts[p], rc = recv_counts[p];
      if (p != me && (sc != 0 || rc != 0)) {
        if (!grouped) group_start(what), grouped = true;
        const int peer = static_cast<int>(p);
        ncclResult_t res = ncclSuccess;
        if (sc != 0) res = ncclSend(pl.in + send_at, sc, ncclUint8, peer, st.comm, pl.stream);
        if ((res == ncclSuccess || res == ncclInProgress) && rc != 0)
          res = ncclRecv(pl.out + recv_at, rc, ncclUint8, peer, st.comm, pl.stream);
        if (res != ncclSuccess && res != ncclInProgress) {
          (void)ncclGroupEnd();
          fail_nccl(res, op, peer, -1);
        }
      }
      send_at += sc, recv_at += rc;
    }
    if (grouped) {
      settle(ncclGroupEnd(), what);
      arm(st, pl.stream, op);
    }
    if (grouped || send_counts[me] != 0) record_tail(st, pl.stream, op);
    finish(st, pl, r, what);
    for (std::size_t dst = 0; dst < send_counts.size(); ++dst) count_block(st, static_cast<int>(dst), send_counts[dst]);
  }

  static void count_message(detail::State& s, int peer, std::size_t bytes) noexcept {
    if (peer == s.rank) return;
    s.counters.bytes_sent += bytes;
    s.counters.messages_sent += 1;
    s.counters.bytes_to_peer[static_cast<std::size_t>(peer)] += bytes;
  }
  static void count_block(detail::State& s, int peer, std::size_t bytes) noexcept {
    if (bytes != 0) count_message(s, peer, bytes);
  }

  std::shared_ptr<detail::State> s_;  // shared with requests (weakly), so that moves keep them valid
};

static_assert(seqpar::Transport<Transport>);
static_assert(seqpar::StreamOrderedTransport<Transport>);

}  // namespace seqpar::backend::nccl
