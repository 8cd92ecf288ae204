// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The NCCL transport. Needs CUDA and NCCL: link seqpar::nccl (include "seqpar/backend/nccl.hpp").
// This header is its public API; the work is in detail/, one job a file: bootstrap.hpp (unique id,
// creation and split), point_to_point.hpp (the posted isend/irecv batch and its flush), all_to_all.hpp,
// all_gather.hpp and barrier.hpp (the collectives), over state.hpp, failure.hpp, progress.hpp (checks,
// ordering and deadlines) and buffers.hpp (argument checks and host staging).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "seqpar/backend/nccl/detail/all_gather.hpp"
#include "seqpar/backend/nccl/detail/all_to_all.hpp"
#include "seqpar/backend/nccl/detail/barrier.hpp"
#include "seqpar/backend/nccl/detail/bootstrap.hpp"
#include "seqpar/backend/nccl/detail/failure.hpp"
#include "seqpar/backend/nccl/detail/nccl_support.hpp"
#include "seqpar/backend/nccl/detail/point_to_point.hpp"
#include "seqpar/backend/nccl/detail/progress.hpp"
#include "seqpar/backend/nccl/detail/state.hpp"
#include "seqpar/backend/nccl/file_store.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/timeout.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::backend::nccl {

/// The 128 bytes that name one communicator to every rank that joins it (ncclUniqueId).
using UniqueId = ncclUniqueId;

/// A fresh unique id (ncclGetUniqueId: rank 0 makes it, a bootstrap carries it to the others).
[[nodiscard]] inline UniqueId unique_id() {
  return detail::make_unique_id();
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
/// // bf16: attention::DefaultCudaKernel (kernels/seqpar/gpu/default_kernel.hpp) is CudnnSdpa where built
/// seqpar::DistributedAttention<ZigzagRing, attention::DefaultCudaKernel<__nv_bfloat16>> attn(t, shape, args);
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
    s_ = detail::join(where, id, rank, size, seqpar::detail::checked_timeout(where, "options.timeout", options.timeout),
                      options.device);
  }

  /// A world of one rank: this process's device alone.
  [[nodiscard]] static Transport single(Options options = {}) { return Transport(unique_id(), 0, 1, options); }

  /// Joins a communicator of `size` ranks whose unique id travels through `store` (rank 0 publishes
  /// it; the others fetch it; rank 0 removes it once every rank has joined).
  template <IdStore Store>
  [[nodiscard]] static Transport bootstrap(Store& store, int rank, int size, Options options = {}) {
    validate("nccl::Transport::bootstrap", rank, size, options);
    Transport t(detail::share_unique_id(store, rank), rank, size, options);
    if constexpr (requires { store.remove(); })
      if (rank == 0) store.remove();  // every rank read it: NCCL's creation needs all of them
    return t;
  }

  /// Joins a communicator of the ranks of `host` (rank 0 makes the unique id, an all_gather of
  /// `host` carries it): `bootstrap(mpi_transport)` shares it through MPI. Collective over `host`.
  template <seqpar::Transport Host>
  requires(!StreamOrderedTransport<Host>) [[nodiscard]] static Transport bootstrap(Host& host, Options options = {}) {
    validate("nccl::Transport::bootstrap", host.rank(), host.size(), options);
    return Transport(detail::gather_unique_id(host), host.rank(), host.size(), options);
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
    live("set_timeout").timeout = seqpar::detail::checked_timeout("nccl::Transport::set_timeout", "timeout", timeout);
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
    if (!s.batch.empty()) detail::flush(s);
    s.queue = q;
    detail::follow_tail(s, q, "set_queue");  // what ran on the old queue comes first (requests waited there)
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
    check_peer_tag("nccl::Transport::isend", peer, tag);
    detail::State& s = usable("isend");
    return post(s, detail::posted_send(s, data, peer, tag), Request::Kind::kSend);
  }

  /// Posts receiving the next message from `peer` with `tag` into `data`; wait() completes it.
  [[nodiscard]] Request irecv(std::span<std::byte> data, int peer, int tag) {
    check_peer_tag("nccl::Transport::irecv", peer, tag);
    detail::State& s = usable("irecv");
    return post(s, detail::posted_recv(s, data, peer, tag), Request::Kind::kRecv);
  }

  /// Completes `req`: flushes its batch if it is not issued yet; then the queue runs after the
  /// transfer (device memory), or the data is in place (host memory). `req` is empty afterwards.
  void wait(Request& req) {
    if (!req.pending()) return;
    seqpar::detail::require(req.started_on(s_), "nccl::Transport::wait", "req", "<request>",
                            "was started on another transport");
    Request done = std::move(req);
    detail::State& s = usable(done.kind_ == Request::Kind::kRecv ? "wait(irecv)" : "wait(isend)");
    if (done.batch_ == s.batch_id) detail::flush(s);
  }

  /// Issues the posted isend/irecv now, as one group (the executor's post steps may call it to start
  /// transfers before their wait). A batch with a device buffer runs on the queue; one of host
  /// buffers only on the transport's own stream, and completes on the host.
  void flush() { detail::flush(live("flush")); }

  /// Equal blocks: block i of `s` (s.size() / size() bytes) goes to rank i; block i of `r` comes from
  /// rank i. Requires s.size() == r.size(), a multiple of size().
  void all_to_all(std::span<const std::byte> s, std::span<std::byte> r) {
    detail::all_to_all(live("all_to_all"), s, r);
  }

  /// Variable blocks: send_counts[i] bytes (contiguous, in rank order in `s`) go to rank i;
  /// recv_counts[i] bytes (contiguous, in rank order in `r`) come from rank i. Rank j's
  /// send_counts[i] must equal rank i's recv_counts[j]. One group of ncclSend/ncclRecv.
  void all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> send_counts, std::span<std::byte> r,
                    std::span<const std::size_t> recv_counts) {
    detail::all_to_all_v(live("all_to_all_v"), s, send_counts, r, recv_counts);
  }

  /// Every rank contributes s.size() bytes (equal on all ranks); `r` (size() * s.size() bytes)
  /// receives them in rank order. ncclAllGather.
  void all_gather(std::span<const std::byte> s, std::span<std::byte> r) {
    detail::all_gather(live("all_gather"), s, r);
  }

  /// Rank i contributes recv_counts[i] bytes; `r` receives them contiguously in rank order. Requires
  /// recv_counts[rank()] == s.size() and sum(recv_counts) == r.size(). One group of ncclBroadcast.
  void all_gather_v(std::span<const std::byte> s, std::span<std::byte> r, std::span<const std::size_t> recv_counts) {
    detail::all_gather_v(live("all_gather_v"), s, r, recv_counts);
  }

  /// Returns once every rank of this communicator has entered barrier(): a one-word ncclAllReduce on
  /// the transport's own stream (NCCL orders it after this communicator's earlier operations, on any
  /// stream), waited for on the host under the deadline.
  void barrier() { detail::barrier(live("barrier")); }

  /// Collective: the ranks with the same `color` (>= 0) form a new communicator, ordered by `key`,
  /// then by rank() (ncclCommSplit, after a barrier under the deadline). Named "<name()>/<color>".
  [[nodiscard]] Transport split(int color, int key) {
    seqpar::detail::require(color >= 0, "nccl::Transport::split", "color", color, "must be >= 0");
    detail::State& s = usable("split");
    barrier();  // a rank that never arrives times out here, not inside the split
    Transport child;
    child.s_ = detail::split(s, color, key);
    return child;
  }

  /// Flushes and waits on the host (under the deadline) for everything enqueued on the queue: the
  /// point where a stream-ordered step learns that its transfers finished, or that a peer failed.
  void synchronize() {
    detail::State& s = usable("synchronize");
    detail::flush(s);
    const auto what = [] { return std::string("synchronize"); };
    detail::host_wait(s, s.own.get(), what);
    if (s.queue != s.own.get()) detail::host_wait(s, s.queue, what);
  }

  /// Aborts the communicator (ncclCommAbort); every later operation throws. Local: the peers learn
  /// of it when their operations with this rank time out or fail.
  void abort() noexcept {
    if (s_) detail::abort_comm(*s_, "aborted by the caller");
  }

  /// Bytes and messages this object sent to other ranks since construction or reset_counters().
  [[nodiscard]] const TrafficCounters& counters() const noexcept {
    static const TrafficCounters none;
    return s_ ? s_->counters : none;
  }
  void reset_counters() noexcept {
    if (s_) s_->counters.reset();
  }

 private:
  Transport() = default;

  // ---- arguments and the checks every call makes ---------------------------------------------------

  static void validate(std::string_view where, int rank, int size, const Options& options) {
    (void)seqpar::detail::checked_timeout(where, "options.timeout", options.timeout);  // clamped where used
    seqpar::detail::require(options.device >= -1, where, "options.device", options.device,
                            "must be a device number, or -1 for the current device");
    seqpar::detail::require(size >= 1, where, "size", size, "must be >= 1");
    seqpar::detail::require(rank >= 0 && rank < size, where, "rank", rank,
                            "must be in [0, size) = [0, " + std::to_string(size) + ")");
  }

  void check_peer_tag(std::string_view where, int peer, int tag) const {
    const int n = live("isend/irecv").size;
    seqpar::detail::require(peer >= 0 && peer < n, where, "peer", peer,
                            "must be in [0, size()) = [0, " + std::to_string(n) + ")");
    seqpar::detail::require(tag >= 0, where, "tag", tag, "must be >= 0");
  }

  [[nodiscard]] detail::State& live(const char* op) const {
    if (!s_) throw std::logic_error(std::string("nccl::Transport::") + op + ": the transport was moved from");
    return *s_;
  }

  // Live, not aborted, no asynchronous error, no operation older than the timeout (detail::usable).
  detail::State& usable(const char* op) { return detail::usable(live(op), op); }

  // Adds `op` to the batch and returns its request.
  Request post(detail::State& s, const detail::PostedOp& op, Request::Kind kind) {
    detail::post(s, op);
    Request req;
    req.state_ = s_;
    req.pending_ = true;
    req.batch_ = s.batch_id;
    req.index_ = op.post;
    req.kind_ = kind;
    return req;
  }

  std::shared_ptr<detail::State> s_;  // shared with requests (weakly), so that moves keep them valid
};

static_assert(seqpar::Transport<Transport>);
static_assert(seqpar::StreamOrderedTransport<Transport>);

}  // namespace seqpar::backend::nccl
