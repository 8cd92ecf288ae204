// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The torch.distributed transport for CUDA memory, stream-ordered (ProcessGroupNCCL). Needs libtorch's
// c10d and CUDA headers: built inside seqpar's torch extension when it is built with CUDA
// (SEQPAR_TORCH_CUDA=1, python/setup.py), never by the plain CMake build. Compiled, never run yet: no
// GPU has executed it.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "seqpar/backend/c10d/transport.hpp"
#include "seqpar/core/detail/transport_checks.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/timeout.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::backend::c10d {

/// A point-to-point operation started by `DeviceTransport::isend` / `irecv`, completed by
/// `DeviceTransport::wait`. Move-only; a default-constructed, moved-from or waited request is empty.
class DeviceRequest {
 public:
  DeviceRequest() noexcept = default;
  DeviceRequest(DeviceRequest&& other) noexcept
      : owner_(std::exchange(other.owner_, nullptr)), batch_(other.batch_), recv_(other.recv_) {}
  DeviceRequest& operator=(DeviceRequest&& other) noexcept {
    owner_ = std::exchange(other.owner_, nullptr);
    batch_ = other.batch_;
    recv_ = other.recv_;
    return *this;
  }
  DeviceRequest(const DeviceRequest&) = delete;
  DeviceRequest& operator=(const DeviceRequest&) = delete;
  ~DeviceRequest() = default;

  /// True while the operation still has to be completed by wait().
  [[nodiscard]] bool pending() const noexcept { return owner_ != nullptr; }

 private:
  friend class DeviceTransport;
  const void* owner_ = nullptr;  // the transport that started it; null: empty
  std::uint64_t batch_ = 0;      // the flush that issues it
  bool recv_ = false;
};

/// One rank's endpoint of a torch.distributed process group whose CUDA backend is NCCL
/// (`c10d::ProcessGroupNCCL`, `init_process_group("nccl")` or `"cpu:gloo,cuda:nccl"`), satisfying
/// `seqpar::Transport` and `seqpar::StreamOrderedTransport` like `backend::nccl::Transport`: the
/// transfers of a program are ordered on the execution context's comm stream, and nothing waits on
/// the host in a program's steady state. The torch op (seqpar.torch) uses it for CUDA tensors with
/// `attention::CudaFlash`.
///
/// Stream order comes from c10d: a ProcessGroupNCCL operation issued while the current CUDA stream is
/// S runs on NCCL's stream after what S has issued, and `work->wait()` (no timeout) makes S wait for
/// it without blocking the host. So every operation runs with the current stream set to the queue
/// (`set_queue`, which the executor calls with its comm stream; before any, torch's current stream)
/// and ends with `wait()`: the queue is after the transfer when the call returns. Buffers must stay
/// untouched until the queue has run it, as with the NCCL transport.
///
///  - Device memory (of the transport's device) is used in place: byte tensors alias it (no copies).
///    Host memory (the engine's signature agreement, the transport test bodies) is staged through a
///    device tensor, and the call completes on the host under `Options::timeout` before it returns.
///  - isend/irecv are posted and issued together at the next flush (the first wait of a posted request,
///    any other operation, a change of queue, `flush()`) as one c10d coalesced group
///    (`startCoalescing` / `endCoalescing`: one ncclGroupStart/End), so that a ring step's send and
///    receive cannot deadlock. NCCL has no tags: a flush issues its operations sorted by (tag, post
///    order), and sizes must agree (NCCL cannot tell a receive of the wrong size; the programs and the
///    engine's signature agreement make them agree). Messages to self are device copies on the queue.
///  - all_to_all(_v): `all_to_all_single` with split sizes; all_gather: `all_gather_single`;
///    all_gather_v: this rank's bytes sent to every rank by `all_to_all_single` (NCCL's allgather
///    needs equal sizes); barrier: c10d `barrier` (which blocks the host), under the deadline.
///  - Deadlines: every c10d operation gets `Options::timeout` as its own (ProcessGroupNCCL's watchdog
///    aborts the communicator when it passes, and the next call throws); host waits poll under it.
///    Failures map to `seqpar::Error` as in `c10d::Transport` (Errc::kTimeout, kPeerFailed,
///    kTransport), naming this rank, the operation and the peer.
///  - split(color, key): as `c10d::Transport::split` (the same registry of split groups).
///  - Counters: bytes and messages to other ranks; self-traffic, barrier and split are free.
///  - Not thread-safe: one thread per DeviceTransport.
///
/// @code
/// // Python: the op on CUDA tensors with dist.init_process_group("nccl") (seqpar.torch)
/// seqpar::backend::c10d::DeviceTransport t(process_group, {.timeout = 600s, .device = 0});
/// // bf16: attention::DefaultCudaKernel (kernels/seqpar/gpu/default_kernel.hpp) is CudnnSdpa where built
/// seqpar::DistributedAttention<ZigzagRing, attention::DefaultCudaKernel<__nv_bfloat16>> attn(t, shape, args);
/// attn.forward(batch, q, k, v, o, lse);  // device views; enqueued on the kernel's streams
/// @endcode
class DeviceTransport {
 public:
  using Request = DeviceRequest;
  static constexpr bool kStreamOrdered = true;

  struct Options {
    /// Longest one operation may take (c10d's timeout of each operation, and host waits).
    std::chrono::milliseconds timeout{seqpar::detail::default_timeout()};
    /// CUDA device of this rank; -1: the current device.
    int device = -1;
  };

  explicit DeviceTransport(c10::intrusive_ptr<::c10d::ProcessGroup> group)
      : DeviceTransport(std::move(group), Options{}) {}
  DeviceTransport(c10::intrusive_ptr<::c10d::ProcessGroup> group, Options options)
      : group_(std::move(group)), options_(options) {
    constexpr std::string_view where = "c10d::DeviceTransport";
    seqpar::detail::require(group_.defined(), where, "group", "None", "is not a process group");
    options_.timeout = seqpar::detail::checked_timeout(where, "options.timeout", options.timeout);
    seqpar::detail::require(options.device >= -1, where, "options.device", options.device,
                            "must be a device number, or -1 for the current device");
    device_ = options.device >= 0 ? options.device : static_cast<int>(c10::cuda::current_device());
    size_ = group_->getSize();
    rank_ = group_->getRank();
    for (int r = 0; r < size_; ++r) group_rank_.push_back(r);
    name_ = group_->getGroupName();
    counters_.bytes_to_peer.assign(static_cast<std::size_t>(size_), 0);
  }

  DeviceTransport(DeviceTransport&&) noexcept = default;
  DeviceTransport& operator=(DeviceTransport&&) noexcept = default;
  DeviceTransport(const DeviceTransport&) = delete;
  DeviceTransport& operator=(const DeviceTransport&) = delete;
  ~DeviceTransport() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  [[nodiscard]] const c10::intrusive_ptr<::c10d::ProcessGroup>& group() const noexcept { return group_; }

  /// Enqueue on `queue` (a cudaStream_t of this transport's device; null: torch's current stream at
  /// each call). Posted isend/irecv are flushed to the previous queue first.
  void set_queue(void* queue) {
    const auto q = static_cast<cudaStream_t>(queue);
    if (q == queue_) return;
    flush();
    queue_ = q;
  }
  /// The stream operations are enqueued on now.
  [[nodiscard]] cudaStream_t queue() const { return current().stream(); }

  void send(std::span<const std::byte> data, int peer, int tag) {
    Request req = isend(data, peer, tag);
    wait(req);
  }
  void recv(std::span<std::byte> data, int peer, int tag) {
    Request req = irecv(data, peer, tag);
    wait(req);
  }

  /// Posts sending `data` to `peer` with `tag`; issued at the next flush. A host buffer is copied now.
  [[nodiscard]] Request isend(std::span<const std::byte> data, int peer, int tag) {
    check_peer_tag("c10d::DeviceTransport::isend", peer, tag);
    Posted p{false, peer, tag, posted_.size(), const_cast<std::byte*>(data.data()), data.size(), {}};
    if (!data.empty() && !on_device(data.data())) {  // staged now: the caller may reuse it at once
      p.staged = to_device(data);
      p.data = static_cast<std::byte*>(p.staged.data_ptr());
    }
    posted_.push_back(std::move(p));
    count_message(peer, data.size());
    return request(false);
  }

  /// Posts receiving the next message from `peer` with `tag` into `data`; wait() completes it.
  [[nodiscard]] Request irecv(std::span<std::byte> data, int peer, int tag) {
    check_peer_tag("c10d::DeviceTransport::irecv", peer, tag);
    Posted p{true, peer, tag, posted_.size(), data.data(), data.size(), {}};
    if (!data.empty() && !on_device(data.data())) p.staged = device_bytes(data.size());
    posted_.push_back(std::move(p));
    return request(true);
  }

  /// Completes `req`: flushes its batch if it is not issued yet; then the queue runs after the
  /// transfer (device memory), or the data is in place (host memory). `req` is empty afterwards.
  void wait(Request& req) {
    if (!req.pending()) return;
    seqpar::detail::require(req.owner_ == this, "c10d::DeviceTransport::wait", "req", "<request>",
                            "was started on another transport");
    const std::uint64_t batch = req.batch_;
    req.owner_ = nullptr;
    if (batch == batch_) flush();
  }

  /// Issues the posted isend/irecv now, as one coalesced group on the queue.
  void flush() {
    if (posted_.empty()) return;
    std::vector<Posted> ops = std::move(posted_);
    posted_.clear();
    ++batch_;
    std::stable_sort(ops.begin(), ops.end(), [](const Posted& a, const Posted& b) { return a.tag < b.tag; });
    const c10::cuda::CUDAStreamGuard on_queue(current());
    // Messages to self: a device copy per receive, from the send of the same tag posted first.
    std::map<int, std::deque<const Posted*>> self_sends;
    for (const Posted& p : ops)
      if (!p.recv && p.peer == rank_) self_sends[p.tag].push_back(&p);
    bool host = false, remote = false;
    for (const Posted& p : ops) {
      host = host || p.staged.defined();
      remote = remote || (p.peer != rank_ && p.bytes != 0);
      if (!p.recv || p.peer != rank_) continue;
      auto& q = self_sends[p.tag];
      if (q.empty())
        throw Error(Errc::kProtocol, who() + ": wait(irecv) from itself (tag " + std::to_string(p.tag) +
                                         "): no message was sent (a send to self must be posted before the flush)");
      const Posted* s = q.front();
      q.pop_front();
      if (s->bytes != p.bytes)
        throw Error(Errc::kProtocol, who() + ": wait(irecv) from itself (tag " + std::to_string(p.tag) +
                                         "): message of " + std::to_string(s->bytes) + " bytes, buffer of " +
                                         std::to_string(p.bytes) + " bytes");
      if (p.bytes != 0)
        check_cuda(cudaMemcpyAsync(p.device_data(), s->device_data(), p.bytes, cudaMemcpyDeviceToDevice, queue()),
                   "flush (a message to self)");
    }
    if (remote) {
      c10::intrusive_ptr<::c10d::Work> work;
      guard("flush (isend/irecv)", -1, -1, [&] {
        group_->startCoalescing(c10::DeviceType::CUDA);
        for (const Posted& p : ops) {
          if (p.peer == rank_ || p.bytes == 0) continue;
          std::vector<at::Tensor> t{bytes_tensor(p.device_data(), p.bytes)};
          if (p.recv)
            (void)group_->recv(t, group_rank(p.peer), p.tag);
          else
            (void)group_->send(t, group_rank(p.peer), p.tag);
        }
        work = group_->endCoalescing(c10::DeviceType::CUDA);
      });
      finish(work, "flush (isend/irecv)", -1, -1, host);
    }
    if (host) {
      for (const Posted& p : ops)
        if (p.recv && p.staged.defined()) from_device(p.staged, p.data, p.bytes);
      host_wait("flush (isend/irecv)");
    }
  }

  /// Equal blocks: block i of `s` (s.size() / size() bytes) goes to rank i.
  void all_to_all(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "c10d::DeviceTransport::all_to_all";
    const auto n = static_cast<std::size_t>(size_);
    seqpar::detail::require_equal_blocks(where, s.size(), r.size(), size_);
    const std::vector<std::size_t> counts(n, s.size() / n);
    exchange(s, counts, r, counts, "all_to_all");
  }

  /// Variable blocks in rank order: send_counts[i] bytes of `s` go to rank i, recv_counts[i] bytes of
  /// `r` come from rank i.
  void all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> send_counts, std::span<std::byte> r,
                    std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "c10d::DeviceTransport::all_to_all_v";
    seqpar::detail::require_counts(where, "send_counts", send_counts, "s.size()", s.size(), size_);
    seqpar::detail::require_counts(where, "recv_counts", recv_counts, "r.size()", r.size(), size_);
    exchange(s, send_counts, r, recv_counts, "all_to_all_v");
  }

  /// Every rank contributes s.size() bytes (equal on all ranks); `r` receives them in rank order.
  void all_gather(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "c10d::DeviceTransport::all_gather";
    const auto n = static_cast<std::size_t>(size_);
    seqpar::detail::require(r.size() == n * s.size(), where, "r.size()", r.size(),
                            "must equal size() * s.size() = " + std::to_string(n * s.size()));
    if (s.empty()) return;
    if (!identity_order()) {  // a split by key: blocks in this transport's order, through all_gather_v
      const std::vector<std::size_t> counts(n, s.size());
      all_gather_v(s, r, counts);
      return;
    }
    flush();
    const c10::cuda::CUDAStreamGuard on_queue(current());
    Staging st(*this, s, r);
    at::Tensor in = st.in(), out = st.out();
    ::c10d::AllgatherOptions opts;
    opts.timeout = options_.timeout;
    run_collective(
        "all_gather", [&] { return group_->all_gather_single(out, in, opts); }, st.host());
    st.finish("all_gather");
    for (int dst = 0; dst < size_; ++dst) count_block(dst, s.size());
  }

  /// Rank i contributes recv_counts[i] bytes; `r` receives them contiguously in rank order.
  void all_gather_v(std::span<const std::byte> s, std::span<std::byte> r, std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "c10d::DeviceTransport::all_gather_v";
    seqpar::detail::require_counts(where, "recv_counts", recv_counts, "r.size()", r.size(), size_);
    seqpar::detail::require(recv_counts[static_cast<std::size_t>(rank_)] == s.size(), where, "recv_counts[rank()]",
                            recv_counts[static_cast<std::size_t>(rank_)],
                            "must equal s.size() = " + std::to_string(s.size()));
    // This rank's bytes to every rank (NCCL's allgather needs equal sizes): a device tensor of size()
    // copies of s, made on the queue.
    const auto n = static_cast<std::size_t>(size_);
    flush();
    const c10::cuda::CUDAStreamGuard on_queue(current());
    Staging st(*this, s, {});
    replicated_ = s.empty() ? device_bytes(0) : st.in().repeat({static_cast<std::int64_t>(n)});
    const std::vector<std::size_t> send_counts(n, s.size());
    exchange({static_cast<const std::byte*>(replicated_.data_ptr()), n * s.size()}, send_counts, r, recv_counts,
             "all_gather_v");
  }

  /// Returns once every rank of this group has entered barrier() (c10d's barrier blocks the host).
  void barrier() {
    flush();
    const c10::cuda::CUDAStreamGuard on_queue(current());
    ::c10d::BarrierOptions opts;
    opts.timeout = options_.timeout;
    opts.device_ids = {static_cast<std::int64_t>(device_)};
    run_collective(
        "barrier", [&] { return group_->barrier(opts); }, /*host=*/true);
  }

  /// Collective: the ranks with the same `color` (>= 0) form a new transport, ordered by `key`, then
  /// by rank() (the process group split as c10d::Transport::split splits it).
  [[nodiscard]] DeviceTransport split(int color, int key) {
    seqpar::detail::require(color >= 0, "c10d::DeviceTransport::split", "color", color, "must be >= 0");
    const std::int32_t mine[2] = {color, key};
    std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size_));
    all_gather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)));
    const detail::SplitMembers m = detail::split_members(all, color, rank_, group_rank_, name_);
    c10::intrusive_ptr<::c10d::ProcessGroup> sub;
    guard("split", -1, -1, [&] { sub = detail::split_group(*group_, m, options_.timeout); });
    if (!sub)
      throw Error(Errc::kTransport,
                  who() + ": split: c10d splitGroup returned no group for color " + std::to_string(color));
    Options o = options_;
    o.device = device_;
    DeviceTransport t(sub, o);
    t.group_rank_ = m.group_rank;
    t.rank_ = m.rank;
    t.queue_ = queue_;
    return t;
  }

  /// Flushes and waits on the host (under the deadline) for everything enqueued on the queue.
  void synchronize() {
    flush();
    host_wait("synchronize");
  }

  [[nodiscard]] const TrafficCounters& counters() const noexcept { return counters_; }
  void reset_counters() noexcept { counters_.reset(); }

 private:
  struct Posted {
    bool recv = false;
    int peer = -1;
    int tag = -1;
    std::size_t post = 0;
    std::byte* data = nullptr;  // the caller's buffer
    std::size_t bytes = 0;
    at::Tensor staged;  // a host buffer's device copy
    [[nodiscard]] std::byte* device_data() const {
      return staged.defined() ? static_cast<std::byte*>(staged.data_ptr()) : data;
    }
  };

  // Host buffers of a collective, staged through device tensors on the queue; device ones aliased.
  class Staging {
   public:
    Staging(DeviceTransport& t, std::span<const std::byte> s, std::span<std::byte> r) : t_(t), r_(r) {
      host_ = (!s.empty() && !t.on_device(s.data())) || (!r.empty() && !t.on_device(r.data()));
      in_ = s.empty() || t.on_device(s.data()) ? t.bytes_tensor(const_cast<std::byte*>(s.data()), s.size())
                                               : t.to_device(s);
      out_ = r.empty() || t.on_device(r.data()) ? t.bytes_tensor(r.data(), r.size()) : t.device_bytes(r.size());
      out_is_staged_ = !r.empty() && !t.on_device(r.data());
    }
    [[nodiscard]] at::Tensor& in() { return in_; }
    [[nodiscard]] at::Tensor& out() { return out_; }
    [[nodiscard]] bool host() const { return host_; }
    // Host results in place: copied back and waited for under the deadline.
    void finish(std::string_view op) {
      if (out_is_staged_) t_.from_device(out_, r_.data(), r_.size());
      if (host_) t_.host_wait(op);
    }

   private:
    DeviceTransport& t_;
    std::span<std::byte> r_;
    at::Tensor in_, out_;
    bool host_ = false, out_is_staged_ = false;
  };

  [[nodiscard]] c10::cuda::CUDAStream current() const {
    if (queue_ == nullptr) return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
    return c10::cuda::getStreamFromExternal(queue_, static_cast<c10::DeviceIndex>(device_));
  }

  [[nodiscard]] Request request(bool recv) const {
    Request r;
    r.owner_ = this;
    r.batch_ = batch_;
    r.recv_ = recv;
    return r;
  }

  // Device memory of this transport's device (or managed memory), which c10d may use in place.
  [[nodiscard]] bool on_device(const void* p) const {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // an unregistered host pointer on older runtimes
      return false;
    }
    if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) {
      seqpar::detail::require(a.device == device_, "c10d::DeviceTransport", "buffer device", a.device,
                              "must be the transport's device " + std::to_string(device_));
      return true;
    }
    return false;
  }

  [[nodiscard]] at::TensorOptions byte_options() const {
    return at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
  }
  // A CUDA byte tensor aliasing `bytes` bytes at `p` (c10d reads or writes them in place); an empty
  // one when `bytes` is 0.
  [[nodiscard]] at::Tensor bytes_tensor(std::byte* p, std::size_t bytes) const {
    if (bytes == 0) return device_bytes(0);
    return at::from_blob(p, {static_cast<std::int64_t>(bytes)}, byte_options());
  }
  [[nodiscard]] at::Tensor device_bytes(std::size_t bytes) const {
    return at::empty({static_cast<std::int64_t>(bytes)}, byte_options());
  }
  // A device copy of host bytes, made on the queue (the host buffer may change once this returns).
  [[nodiscard]] at::Tensor to_device(std::span<const std::byte> s) const {
    const c10::cuda::CUDAStreamGuard on_queue(current());
    at::Tensor host = at::from_blob(const_cast<std::byte*>(s.data()), {static_cast<std::int64_t>(s.size())},
                                    at::TensorOptions().dtype(at::kByte));
    return host.to(byte_options(), /*non_blocking=*/false, /*copy=*/true);
  }
  // Device bytes to host memory, enqueued on the queue (host_wait completes it).
  void from_device(const at::Tensor& d, std::byte* host, std::size_t bytes) const {
    if (bytes != 0)
      check_cuda(cudaMemcpyAsync(host, d.data_ptr(), bytes, cudaMemcpyDeviceToHost, queue()), "copy to the host");
  }

  // Waits on the host for the queue, polling under the deadline.
  void host_wait(std::string_view op) const {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      const cudaError_t e = cudaStreamQuery(queue());
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) check_cuda(e, op);
      if (std::chrono::steady_clock::now() > deadline)
        throw Error(Errc::kTimeout, who() + ": " + std::string(op) + " timed out after " +
                                        std::to_string(options_.timeout.count()) + " ms");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void check_cuda(cudaError_t e, std::string_view op) const {
    if (e == cudaSuccess) return;
    (void)cudaGetLastError();
    throw Error(Errc::kTransport, who() + ": " + std::string(op) + ": " + cudaGetErrorString(e));
  }

  [[nodiscard]] int group_rank(int peer) const { return group_rank_[static_cast<std::size_t>(peer)]; }
  [[nodiscard]] bool identity_order() const {
    for (int r = 0; r < size_; ++r)
      if (group_rank_[static_cast<std::size_t>(r)] != r) return false;
    return true;
  }

  [[nodiscard]] std::string who() const {
    return "rank " + std::to_string(rank_) + " (" + name_ + ", cuda:" + std::to_string(device_) + ")";
  }
  [[nodiscard]] static std::string with_peer(int peer, int tag) {
    if (peer < 0) return " with the ranks of the group";
    std::string s = " with rank " + std::to_string(peer);
    if (tag >= 0) s += " (tag " + std::to_string(tag) + ")";
    return s;
  }

  template <class F>
  void guard(std::string_view op, int peer, int tag, F&& f) const {
    try {
      f();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(detail::errc_of(e.what()), who() + ": " + std::string(op) + with_peer(peer, tag) + ": " + e.what());
    }
  }

  // The queue after `work`: wait() orders the current stream (the queue) after NCCL's, no host wait;
  // with `host`, the host waits for it too, under the deadline.
  void finish(const c10::intrusive_ptr<::c10d::Work>& work, std::string_view op, int peer, int tag, bool host) const {
    if (!work) return;
    bool done = true;
    guard(op, peer, tag, [&] { done = host ? work->wait(options_.timeout) : work->wait(); });
    if (!done)
      throw Error(Errc::kTimeout, who() + ": " + std::string(op) + with_peer(peer, tag) + " timed out after " +
                                      std::to_string(options_.timeout.count()) + " ms");
  }

  template <class F>
  void run_collective(std::string_view op, F&& start, bool host) const {
    c10::intrusive_ptr<::c10d::Work> work;
    guard(op, -1, -1, [&] { work = start(); });
    finish(work, op, -1, -1, host);
  }

  // all_to_all_v over c10d: byte tensors aliasing (or staging) the buffers, split sizes in bytes. When
  // this transport's rank order differs from the group's (a split by key), blocks are reordered by
  // device copies into group order and back.
  void exchange(std::span<const std::byte> s, std::span<const std::size_t> send_counts, std::span<std::byte> r,
                std::span<const std::size_t> recv_counts, std::string_view op) {
    flush();
    const c10::cuda::CUDAStreamGuard on_queue(current());
    const auto n = static_cast<std::size_t>(size_);
    std::vector<std::int64_t> out_split(n), in_split(n);
    Staging st(*this, s, r);
    std::vector<std::size_t> by_group(n);  // by_group[g] = this transport's rank of group rank g
    for (std::size_t i = 0; i < n; ++i) by_group[static_cast<std::size_t>(group_rank_[i])] = i;
    for (std::size_t g = 0; g < n; ++g) {
      in_split[g] = static_cast<std::int64_t>(send_counts[by_group[g]]);
      out_split[g] = static_cast<std::int64_t>(recv_counts[by_group[g]]);
    }
    ::c10d::AllToAllOptions opts;
    opts.timeout = options_.timeout;
    if (identity_order()) {
      run_collective(
          op, [&] { return group_->all_to_all_single(st.out(), st.in(), out_split, in_split, opts); }, st.host());
    } else {
      const auto offsets = [&](std::span<const std::size_t> c) {
        std::vector<std::int64_t> o(n + 1, 0);
        for (std::size_t i = 0; i < n; ++i) o[i + 1] = o[i] + static_cast<std::int64_t>(c[i]);
        return o;
      };
      const auto so = offsets(send_counts), ro = offsets(recv_counts);
      std::vector<at::Tensor> send_blocks, recv_blocks;
      for (std::size_t g = 0; g < n; ++g) {
        const std::size_t i = by_group[g];
        send_blocks.push_back(st.in().narrow(0, so[i], in_split[g]));
      }
      at::Tensor in = at::cat(send_blocks), out = device_bytes(r.size());
      run_collective(
          op, [&] { return group_->all_to_all_single(out, in, out_split, in_split, opts); }, st.host());
      std::int64_t at_r = 0;
      for (std::size_t g = 0; g < n; ++g) {
        const std::size_t i = by_group[g];
        st.out().narrow(0, ro[i], out_split[g]).copy_(out.narrow(0, at_r, out_split[g]));
        at_r += out_split[g];
      }
    }
    st.finish(op);
    for (int dst = 0; dst < size_; ++dst) count_block(dst, send_counts[static_cast<std::size_t>(dst)]);
  }

  void check_peer_tag(std::string_view where, int peer, int tag) const {
    seqpar::detail::require(peer >= 0 && peer < size_, where, "peer", peer,
                            "must be in [0, size()) = [0, " + std::to_string(size_) + ")");
    seqpar::detail::require(tag >= 0, where, "tag", tag, "must be >= 0");
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

  c10::intrusive_ptr<::c10d::ProcessGroup> group_;
  Options options_;
  int device_ = 0;
  int rank_ = 0;
  int size_ = 0;
  std::vector<int> group_rank_;  // this transport's rank i is rank group_rank_[i] of group_
  std::string name_;
  cudaStream_t queue_ = nullptr;  // null: torch's current stream
  std::vector<Posted> posted_;    // isend/irecv not issued yet
  std::uint64_t batch_ = 0;       // the flushes so far (a request names the one that issues it)
  TrafficCounters counters_;
  at::Tensor replicated_;  // all_gather_v's send buffer (kept until the queue has run it: the next call)
};

static_assert(seqpar::Transport<DeviceTransport>);
static_assert(seqpar::StreamOrderedTransport<DeviceTransport>);

}  // namespace seqpar::backend::c10d
