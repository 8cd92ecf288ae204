// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The torch.distributed transport. Needs libtorch's c10d headers: built inside a torch extension
// (python/seqpar), never by the plain CMake build.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "seqpar/core/detail/transport_checks.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/timeout.hpp"
#include "seqpar/core/transport.hpp"

namespace seqpar::backend::c10d {

class Transport;

namespace detail {

// One point-to-point operation. Shared between the Request the caller holds and the transport's
// per-(peer, tag) queue of receives, so that a receive can be matched while its Request moves.
struct Operation {
  enum class Kind : std::uint8_t { kSend, kRecv, kSelfRecv };
  Kind kind = Kind::kSend;
  int peer = -1;
  int tag = -1;
  std::span<std::byte> buffer;     // a receive's destination
  std::int64_t header = 0;         // a send's size announcement; a receive's announced size
  at::Tensor header_tensor;        // the 8 bytes of `header` as a tensor (kept alive with the work)
  std::vector<std::byte> scratch;  // where a wrong-size message lands, so the stream stays in step
  c10::intrusive_ptr<::c10d::Work> header_work, payload_work;
  int group_peer = -1;        // `peer` as a rank of the process group
  int wire_tag = -1;          // the header's c10d tag; the payload's is wire_tag + 1
  bool matched = false;       // the matcher is done with it (payload posted, or error set)
  std::optional<Errc> error;  // why the header never came (set by the matcher)
  std::string error_text;
  const void* owner = nullptr;  // the transport that started it
};

// Posts the payload receives. A receive's payload can be posted only once its header has told the
// size, and a sender's payload completes only once that receive is posted: a thread that waits for
// the headers in the order they were posted and posts each payload at once lets every send progress
// whatever the receiving rank is waiting for (as an MPI library progresses receives), so no order of
// waits deadlocks. The thread never touches Python.
class Matcher {
 public:
  Matcher(c10::intrusive_ptr<::c10d::ProcessGroup> group, std::chrono::milliseconds timeout)
      : group_(std::move(group)), timeout_(timeout), thread_([this] { loop(); }) {}
  Matcher(const Matcher&) = delete;
  Matcher& operator=(const Matcher&) = delete;
  ~Matcher() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
      if (current_ && current_->header_work) current_->header_work->abort();  // wakes the wait
    }
    cv_.notify_all();
    thread_.join();
  }

  void post(std::shared_ptr<Operation> op) {
    {
      const std::lock_guard lock(mutex_);
      queue_.push_back(std::move(op));
    }
    cv_.notify_all();
  }

  // Waits until the matcher is done with `op`; false when `deadline` passed first.
  bool wait_matched(const Operation& op, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, deadline, [&] { return op.matched; });
  }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<Operation> op;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        op = queue_.front();
        queue_.pop_front();
        current_ = op;
      }
      std::optional<Errc> error;
      std::string text;
      try {
        if (!op->header_work->wait(timeout_)) {
          error = Errc::kTimeout;
          text = "no message arrived in " + std::to_string(timeout_.count()) + " ms";
        } else if (op->header < 0) {
          error = Errc::kProtocol;
          text = "announced size " + std::to_string(op->header) + " is negative";
        } else if (op->header > 0) {
          void* dest = op->buffer.data();
          if (static_cast<std::size_t>(op->header) != op->buffer.size()) {  // consume it, then report
            op->scratch.resize(static_cast<std::size_t>(op->header));
            dest = op->scratch.data();
          }
          std::vector<at::Tensor> p{at::from_blob(dest, {op->header}, at::TensorOptions().dtype(at::kByte))};
          op->payload_work = group_->recv(p, op->group_peer, op->wire_tag + 1);
        }
      } catch (const std::exception& e) {
        error = Errc::kTransport;
        text = e.what();
      }
      {
        const std::lock_guard lock(mutex_);
        if (error) op->error = error, op->error_text = std::move(text);
        op->matched = true;
        current_.reset();
      }
      cv_.notify_all();
    }
  }

  c10::intrusive_ptr<::c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Operation>> queue_;
  std::shared_ptr<Operation> current_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members it uses exist
};

// Lower-case copy, for classifying c10d/gloo error text.
inline std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// What c10d threw, as the transports' codes: the deadline, a peer gone, or anything else.
inline Errc errc_of(std::string_view what) {
  const std::string text = lower(what);
  const auto has = [&](std::string_view w) { return text.find(w) != std::string::npos; };
  if (has("timed out") || has("timeout")) return Errc::kTimeout;
  if (has("connection closed") || has("connection reset") || has("broken pipe") || has("connection refused"))
    return Errc::kPeerFailed;
  return Errc::kTransport;
}

// Process-wide registry of the process groups seqpar's transports run on, never freed: destroying a
// split gloo group from C++ deadlocks in ~ProcessGroupGloo (torch 2.15), so the groups that split()
// makes live until the process ends and are reused by later splits with the same members. It also
// numbers the transports on each group: a transport's slot puts its tags in a range of their own
// (every rank creates the transports of a group in the same order, so the slots agree).
struct GroupRegistry {
  std::mutex mutex;
  std::map<std::string, c10::intrusive_ptr<::c10d::ProcessGroup>> splits;  // by name
  std::map<const ::c10d::ProcessGroup*, int> next_slot;
};
inline GroupRegistry& registry() {
  static auto* r = new GroupRegistry;  // leaked on purpose: see above
  return *r;
}
inline int take_slot(const ::c10d::ProcessGroup* group) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  return r.next_slot[group]++ % 512;
}

// One rank's view of a split(color, key), from every rank's (color, key) pair: the members of its
// color in (key, rank) order, as ranks of the parent process group and sorted (what splitGroup takes),
// and the new group's name (the parent's and the members': every member computes the same).
struct SplitMembers {
  std::vector<int> members;       // ranks of the splitting transport, in (key, rank) order
  std::vector<int> parent_ranks;  // the members as ranks of the parent process group
  std::vector<int> sorted;        // parent_ranks sorted
  std::vector<int> group_rank;    // member i is rank group_rank[i] of the new group (parent order)
  int rank = 0;                   // this rank among the members
  std::string name;
};
inline SplitMembers split_members(std::span<const std::int32_t> color_key, int color, int rank,
                                  std::span<const int> group_rank, const std::string& parent_name) {
  SplitMembers m;
  const auto n = static_cast<int>(group_rank.size());
  for (int r = 0; r < n; ++r)
    if (color_key[2 * static_cast<std::size_t>(r)] == color) m.members.push_back(r);
  std::stable_sort(m.members.begin(), m.members.end(), [&](int a, int b) {
    return color_key[2 * static_cast<std::size_t>(a) + 1] < color_key[2 * static_cast<std::size_t>(b) + 1];
  });
  for (int r : m.members) m.parent_ranks.push_back(group_rank[static_cast<std::size_t>(r)]);
  m.sorted = m.parent_ranks;
  std::sort(m.sorted.begin(), m.sorted.end());
  for (int p : m.parent_ranks)
    m.group_rank.push_back(static_cast<int>(std::lower_bound(m.sorted.begin(), m.sorted.end(), p) - m.sorted.begin()));
  m.rank = static_cast<int>(std::find(m.members.begin(), m.members.end(), rank) - m.members.begin());
  m.name = "seqpar:" + parent_name + ":";
  for (int p : m.sorted) m.name += std::to_string(p) + ",";
  return m;
}

// The process group of `m`'s members: the one made by an earlier split with the same name, else
// parent.splitGroup's, kept for the life of the process (see GroupRegistry). Null when c10d made none.
inline c10::intrusive_ptr<::c10d::ProcessGroup> split_group(::c10d::ProcessGroup& parent, const SplitMembers& m,
                                                            std::chrono::milliseconds timeout) {
  auto& reg = registry();
  {
    const std::lock_guard lock(reg.mutex);
    if (auto it = reg.splits.find(m.name); it != reg.splits.end()) return it->second;
  }
  c10::intrusive_ptr<::c10d::ProcessGroup> sub = parent.splitGroup(m.sorted, timeout, std::nullopt, m.name, m.name);
  if (sub) {
    const std::lock_guard lock(reg.mutex);
    reg.splits.emplace(m.name, sub);
  }
  return sub;
}

}  // namespace detail

/// A point-to-point operation started by `Transport::isend` / `Transport::irecv`, completed by
/// `Transport::wait`. Move-only; a default-constructed, moved-from or completed request is empty.
/// The buffer of an isend must stay valid and unchanged until its wait returns (c10d sends the
/// caller's bytes in place, without a copy).
class Request {
 public:
  Request() noexcept = default;
  Request(Request&&) noexcept = default;
  Request& operator=(Request&&) noexcept = default;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() = default;

  /// True while the operation still has to be completed by wait().
  [[nodiscard]] bool pending() const noexcept { return op_ != nullptr; }

 private:
  friend class Transport;
  std::shared_ptr<detail::Operation> op_;
};

/// One rank's endpoint of a torch.distributed process group (`c10d::ProcessGroup`, gloo on the
/// CPU), satisfying `seqpar::Transport`, so any strategy runs inside a PyTorch job with no second
/// communication runtime.
///
/// Semantics (beyond the concept's):
///  - Point to point: c10d send/recv. c10d (gloo) requires a receive of exactly the sent size and
///    breaks the connection otherwise, so every message is announced by an 8-byte size header on a
///    tag of its own (2*tag; the payload travels on 2*tag+1): a receive whose buffer does not match
///    the announced size drains the payload into scratch and throws `Errc::kProtocol`, and the
///    group stays usable. Empty payloads are announced only. Messages to self never touch c10d
///    (an eager local queue per tag). Tags are in [0, 2^30).
///  - Receives are matched in the order they were posted, whatever order they are waited in: a
///    thread of the transport (detail::Matcher, started by the first receive) waits for each header
///    and posts its payload receive at once, so a send completes as soon as its receive is posted,
///    as with MPI. A receive whose Request is destroyed unwaited still lands in its buffer (c10d
///    cannot cancel it): keep the buffer alive, or wait.
///  - Collectives: all_to_all(_v) is c10d `alltoall_base` with split sizes on byte tensors that
///    alias the caller's buffers (no copies); all_gather is c10d `allgather` into views of `r`;
///    all_gather_v is `alltoall_base` with this rank's bytes sent to every rank (c10d's allgather
///    needs equal sizes); barrier is c10d `barrier`.
///  - Every wait has the deadline `Options::timeout`. Errors map to `seqpar::Error` with the codes
///    of the other transports: a deadline passed is `Errc::kTimeout`; a peer whose connection
///    closed (it died or aborted) is `Errc::kPeerFailed`; any other c10d failure is
///    `Errc::kTransport`. Messages name this rank, the operation and the peer. A timed-out
///    collective leaves the group unusable: destroy it (as with MPI or NCCL).
///  - Several transports may share a process group: each takes a slot of the group's tag space
///    (512 slots of 2^21 tags), so their messages never match one another's.
///  - split(color, key): the members are exchanged with an all_gather, then the parent's
///    `splitGroup` makes their process group, named after the parent and the members; it is kept
///    for the life of the process and reused by later splits with the same members (destroying a
///    split gloo group from C++ deadlocks in torch 2.15). c10d numbers a split group's ranks in parent order; when
///    `key` orders them differently, the sub-transport renumbers ranks itself (collectives then copy to reorder).
///  - Counters as every transport: bytes and messages to other ranks; self-traffic, headers,
///    barrier and split are free.
///  - Not thread-safe: one thread per Transport object.
///
/// @code
/// // Python: seqpar.torch.DistributedAttention("zigzag-ring", 8, 2, 64, group=dist.group.WORLD)
/// seqpar::backend::c10d::Transport t(process_group);
/// seqpar::DistributedAttention<ZigzagRing, attention::CpuFlash<float>> attn(t, shape, args);
/// @endcode
class Transport {
 public:
  using Request = c10d::Request;

  struct Options {
    /// Longest one operation may take before it throws Errc::kTimeout. Default 30 s, or the
    /// environment variable SEQPAR_TIMEOUT_S (seconds) when set (core/timeout.hpp).
    std::chrono::milliseconds timeout{seqpar::detail::default_timeout()};
  };

  static constexpr int kMaxTag = (1 << 20) - 1;  // wire tags: 2*tag(+1) in the transport's slot

  /// Wraps `group` (kept alive by this transport). Not collective.
  explicit Transport(c10::intrusive_ptr<::c10d::ProcessGroup> group) : Transport(std::move(group), Options{}) {}
  Transport(c10::intrusive_ptr<::c10d::ProcessGroup> group, Options options)
      : group_(std::move(group)), options_(options) {
    constexpr std::string_view where = "c10d::Transport";
    seqpar::detail::require(group_.defined(), where, "group", "None", "is not a process group");
    options_.timeout = seqpar::detail::checked_timeout(where, "options.timeout", options.timeout);
    size_ = group_->getSize();
    rank_ = group_->getRank();
    for (int r = 0; r < size_; ++r) group_rank_.push_back(r);
    name_ = group_->getGroupName();
    tag_base_ = detail::take_slot(group_.get()) << 21;
    counters_.bytes_to_peer.assign(static_cast<std::size_t>(size_), 0);
  }

  Transport(Transport&&) noexcept = default;
  Transport& operator=(Transport&&) noexcept = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  ~Transport() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  /// The process group this transport runs on.
  [[nodiscard]] const c10::intrusive_ptr<::c10d::ProcessGroup>& group() const noexcept { return group_; }

  void send(std::span<const std::byte> data, int peer, int tag) {
    Request req = isend(data, peer, tag);
    wait(req);
  }

  void recv(std::span<std::byte> data, int peer, int tag) {
    Request req = irecv(data, peer, tag);
    wait(req);
  }

  /// Starts sending `data` (which must stay valid until wait) to `peer` with `tag`.
  [[nodiscard]] Request isend(std::span<const std::byte> data, int peer, int tag) {
    check_peer_tag("c10d::Transport::isend", peer, tag);
    Request req;
    req.op_ = std::make_shared<detail::Operation>();
    auto& op = *req.op_;
    op.kind = detail::Operation::Kind::kSend;
    op.peer = peer;
    op.tag = tag;
    op.owner = this;
    if (peer == rank_) {  // eager: the bytes are copied now, the request completes at once
      self_queue_[tag].emplace_back(data.begin(), data.end());
      req.op_.reset();
      return req;
    }
    op.header = static_cast<std::int64_t>(data.size());
    op.header_tensor = bytes_tensor(&op.header, sizeof(op.header));
    guard("isend", peer, tag, [&] {
      std::vector<at::Tensor> h{op.header_tensor};
      op.header_work = group_->send(h, group_rank(peer), tag_base_ + 2 * tag);
      if (!data.empty()) {
        std::vector<at::Tensor> p{bytes_tensor(data.data(), data.size())};
        op.payload_work = group_->send(p, group_rank(peer), tag_base_ + 2 * tag + 1);
      }
    });
    count_message(peer, data.size());
    return req;
  }

  /// Posts a receive from `peer` with `tag` into `data`; wait() completes it.
  [[nodiscard]] Request irecv(std::span<std::byte> data, int peer, int tag) {
    check_peer_tag("c10d::Transport::irecv", peer, tag);
    Request req;
    req.op_ = std::make_shared<detail::Operation>();
    auto& op = *req.op_;
    op.kind = peer == rank_ ? detail::Operation::Kind::kSelfRecv : detail::Operation::Kind::kRecv;
    op.peer = peer;
    op.tag = tag;
    op.buffer = data;
    op.owner = this;
    if (peer == rank_) return req;
    op.group_peer = group_rank(peer);
    op.header_tensor = bytes_tensor(&op.header, sizeof(op.header));
    guard("irecv", peer, tag, [&] {
      std::vector<at::Tensor> h{op.header_tensor};
      op.wire_tag = tag_base_ + 2 * tag;
      op.header_work = group_->recv(h, op.group_peer, op.wire_tag);
    });
    if (!matcher_) matcher_ = std::make_shared<detail::Matcher>(group_, options_.timeout);
    matcher_->post(req.op_);
    return req;
  }

  /// Completes `req` (a no-op on an empty request); `req` is empty afterwards.
  void wait(Request& req) {
    if (!req.pending()) return;
    const std::shared_ptr<detail::Operation> op = std::move(req.op_);
    seqpar::detail::require(op->owner == this, "c10d::Transport::wait", "req", "<request>",
                            "was started on another transport");
    switch (op->kind) {
      case detail::Operation::Kind::kSend:
        finish(op->header_work, "wait(isend)", op->peer, op->tag);
        if (op->payload_work) finish(op->payload_work, "wait(isend)", op->peer, op->tag);
        return;
      case detail::Operation::Kind::kSelfRecv:
        return take_self(*op);
      case detail::Operation::Kind::kRecv:
        break;
    }
    if (!matcher_->wait_matched(*op, std::chrono::steady_clock::now() + options_.timeout))
      throw Error(Errc::kTimeout, who() + ": wait(irecv)" + with_peer(op->peer, op->tag) + " timed out after " +
                                      std::to_string(options_.timeout.count()) + " ms");
    if (op->error) {
      if (*op->error == Errc::kTransport) rethrow("wait(irecv)", op->peer, op->tag, op->error_text);
      throw Error(*op->error, who() + ": wait(irecv)" + with_peer(op->peer, op->tag) + ": " + op->error_text);
    }
    if (op->payload_work) finish(op->payload_work, "wait(irecv)", op->peer, op->tag);
    if (static_cast<std::size_t>(op->header) != op->buffer.size())
      throw Error(Errc::kProtocol, who() + ": wait(irecv) from rank " + std::to_string(op->peer) + " (tag " +
                                       std::to_string(op->tag) + "): message of " + std::to_string(op->header) +
                                       " bytes, buffer of " + std::to_string(op->buffer.size()) + " bytes");
  }

  /// Equal blocks: block i of `s` (s.size() / size() bytes) goes to rank i.
  void all_to_all(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "c10d::Transport::all_to_all";
    const auto n = static_cast<std::size_t>(size_);
    seqpar::detail::require_equal_blocks(where, s.size(), r.size(), size_);
    const std::vector<std::size_t> counts(n, s.size() / n);
    exchange(s, counts, r, counts, "all_to_all");
  }

  /// Variable blocks in rank order: send_counts[i] bytes of `s` go to rank i, recv_counts[i] bytes
  /// of `r` come from rank i.
  void all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> send_counts, std::span<std::byte> r,
                    std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "c10d::Transport::all_to_all_v";
    require_counts(where, "send_counts", send_counts, "s.size()", s.size());
    require_counts(where, "recv_counts", recv_counts, "r.size()", r.size());
    exchange(s, send_counts, r, recv_counts, "all_to_all_v");
  }

  /// Every rank contributes s.size() bytes (equal on all ranks); `r` receives them in rank order.
  void all_gather(std::span<const std::byte> s, std::span<std::byte> r) {
    constexpr std::string_view where = "c10d::Transport::all_gather";
    const auto n = static_cast<std::size_t>(size_);
    seqpar::detail::require(r.size() == n * s.size(), where, "r.size()", r.size(),
                            "must equal size() * s.size() = " + std::to_string(n * s.size()));
    if (s.empty()) return;  // every rank has nothing to send (sizes are equal): nothing to meet for
    if (identity_order()) {
      std::vector<std::vector<at::Tensor>> out(1);
      for (std::size_t i = 0; i < n; ++i) out[0].push_back(bytes_tensor(r.data() + i * s.size(), s.size()));
      std::vector<at::Tensor> in{bytes_tensor(s.data(), s.size())};
      run_collective("all_gather", [&] { return group_->allgather(out, in); });
      for (int dst = 0; dst < size_; ++dst) count_block(dst, s.size());
      return;
    }
    const std::vector<std::size_t> counts(n, s.size());
    all_gather_v(s, r, counts);
  }

  /// Rank i contributes recv_counts[i] bytes; `r` receives them contiguously in rank order.
  void all_gather_v(std::span<const std::byte> s, std::span<std::byte> r, std::span<const std::size_t> recv_counts) {
    constexpr std::string_view where = "c10d::Transport::all_gather_v";
    require_counts(where, "recv_counts", recv_counts, "r.size()", r.size());
    seqpar::detail::require(recv_counts[static_cast<std::size_t>(rank_)] == s.size(), where, "recv_counts[rank()]",
                            recv_counts[static_cast<std::size_t>(rank_)],
                            "must equal s.size() = " + std::to_string(s.size()));
    // c10d's allgather needs equal sizes: send this rank's bytes to every rank instead (one copy of s
    // per rank on the send side; all_gather_v carries metadata and small blocks in seqpar's programs).
    const auto n = static_cast<std::size_t>(size_);
    replicated_.resize(n * s.size());
    for (std::size_t i = 0; i < n; ++i)
      if (!s.empty()) std::memcpy(replicated_.data() + i * s.size(), s.data(), s.size());
    const std::vector<std::size_t> send_counts(n, s.size());
    exchange(std::span<const std::byte>(replicated_), send_counts, r, recv_counts, "all_gather_v");
  }

  /// Returns once every rank of this group has entered barrier().
  void barrier() {
    run_collective("barrier", [&] { return group_->barrier(); });
  }

  /// Collective: the ranks with the same `color` (>= 0) form a new transport, ordered by `key`, then
  /// by rank(). Every rank of this transport must call it.
  [[nodiscard]] Transport split(int color, int key) {
    seqpar::detail::require(color >= 0, "c10d::Transport::split", "color", color, "must be >= 0");
    const std::int32_t mine[2] = {color, key};
    std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size_));
    all_gather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)));
    const detail::SplitMembers m = detail::split_members(all, color, rank_, group_rank_, name_);
    c10::intrusive_ptr<::c10d::ProcessGroup> sub;
    guard("split", -1, -1, [&] { sub = detail::split_group(*group_, m, options_.timeout); });
    if (!sub)
      throw Error(Errc::kTransport,
                  who() + ": split: c10d splitGroup returned no group for color " + std::to_string(color));
    Transport t(sub, options_);
    // c10d numbers the sub-group in parent order; this transport's rank i is member i (key order).
    t.group_rank_ = m.group_rank;
    t.rank_ = m.rank;
    return t;
  }

  [[nodiscard]] const TrafficCounters& counters() const noexcept { return counters_; }
  void reset_counters() noexcept { counters_.reset(); }

 private:
  // A CPU byte tensor aliasing `bytes` bytes at `p` (c10d reads or writes them in place). An empty
  // span may have no address: it gets a valid one, since no byte of it is touched.
  static at::Tensor bytes_tensor(const void* p, std::size_t bytes) {
    static std::byte dummy{};
    void* data = bytes == 0 ? static_cast<void*>(&dummy) : const_cast<void*>(p);  // c10d never writes inputs
    return at::from_blob(data, {static_cast<std::int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  }

  [[nodiscard]] int group_rank(int peer) const { return group_rank_[static_cast<std::size_t>(peer)]; }
  [[nodiscard]] bool identity_order() const {
    for (int r = 0; r < size_; ++r)
      if (group_rank_[static_cast<std::size_t>(r)] != r) return false;
    return true;
  }

  [[nodiscard]] std::string who() const { return "rank " + std::to_string(rank_) + " (" + name_ + ")"; }
  [[nodiscard]] static std::string with_peer(int peer, int tag) {
    if (peer < 0) return " with the ranks of the group";
    std::string s = " with rank " + std::to_string(peer);
    if (tag >= 0) s += " (tag " + std::to_string(tag) + ")";
    return s;
  }

  // Maps what c10d threw to a seqpar::Error: the deadline, a peer gone, or anything else.
  [[noreturn]] void rethrow(std::string_view op, int peer, int tag, const std::string& what) const {
    throw Error(detail::errc_of(what), who() + ": " + std::string(op) + with_peer(peer, tag) + ": " + what);
  }

  template <class F>
  void guard(std::string_view op, int peer, int tag, F&& f) const {
    try {
      f();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      rethrow(op, peer, tag, e.what());
    }
  }

  // Waits for `work` under the deadline; a work that does not finish in time is aborted.
  void finish(const c10::intrusive_ptr<::c10d::Work>& work, std::string_view op, int peer, int tag) const {
    bool done = false;
    try {
      done = work->wait(options_.timeout);
    } catch (const std::exception& e) {
      rethrow(op, peer, tag, e.what());
    }
    if (!done)
      throw Error(Errc::kTimeout, who() + ": " + std::string(op) + with_peer(peer, tag) + " timed out after " +
                                      std::to_string(options_.timeout.count()) + " ms");
  }

  template <class F>
  void run_collective(std::string_view op, F&& start) const {
    c10::intrusive_ptr<::c10d::Work> work;
    guard(op, -1, -1, [&] { work = start(); });
    finish(work, op, -1, -1);
  }

  // all_to_all_v over c10d: byte tensors aliasing the buffers, split sizes in bytes. When this
  // transport's rank order differs from the group's (a split by key), blocks are reordered through
  // copies.
  void exchange(std::span<const std::byte> s, std::span<const std::size_t> send_counts, std::span<std::byte> r,
                std::span<const std::size_t> recv_counts, std::string_view op) {
    const auto n = static_cast<std::size_t>(size_);
    std::vector<std::int64_t> out_split(n), in_split(n);
    if (identity_order()) {
      for (std::size_t i = 0; i < n; ++i) {
        in_split[i] = static_cast<std::int64_t>(send_counts[i]);
        out_split[i] = static_cast<std::int64_t>(recv_counts[i]);
      }
      at::Tensor in = bytes_tensor(s.data(), s.size()), out = bytes_tensor(r.data(), r.size());
      run_collective(op, [&] { return group_->alltoall_base(out, in, out_split, in_split); });
    } else {
      // Lay the blocks out in group order, exchange, lay them back in this transport's order.
      const auto offsets = [&](std::span<const std::size_t> c) {
        std::vector<std::size_t> o(n + 1, 0);
        for (std::size_t i = 0; i < n; ++i) o[i + 1] = o[i] + c[i];
        return o;
      };
      const auto so = offsets(send_counts), ro = offsets(recv_counts);
      std::vector<std::size_t> by_group(n);  // by_group[g] = this transport's rank of group rank g
      for (std::size_t i = 0; i < n; ++i) by_group[static_cast<std::size_t>(group_rank_[i])] = i;
      std::vector<std::byte> sg(s.size()), rg(r.size());
      std::size_t at_s = 0, at_r = 0;
      for (std::size_t g = 0; g < n; ++g) {
        const std::size_t i = by_group[g];
        if (send_counts[i] != 0) std::memcpy(sg.data() + at_s, s.data() + so[i], send_counts[i]);
        at_s += send_counts[i];
        at_r += recv_counts[i];
        in_split[g] = static_cast<std::int64_t>(send_counts[i]);
        out_split[g] = static_cast<std::int64_t>(recv_counts[i]);
      }
      at::Tensor in = bytes_tensor(sg.data(), sg.size()), out = bytes_tensor(rg.data(), rg.size());
      run_collective(op, [&] { return group_->alltoall_base(out, in, out_split, in_split); });
      at_r = 0;
      for (std::size_t g = 0; g < n; ++g) {
        const std::size_t i = by_group[g];
        if (recv_counts[i] != 0) std::memcpy(r.data() + ro[i], rg.data() + at_r, recv_counts[i]);
        at_r += recv_counts[i];
      }
    }
    for (int dst = 0; dst < size_; ++dst) count_block(dst, send_counts[static_cast<std::size_t>(dst)]);
  }

  void take_self(detail::Operation& op) {
    auto& queue = self_queue_[op.tag];
    if (queue.empty())
      throw Error(Errc::kProtocol, who() + ": wait(irecv) from itself (tag " + std::to_string(op.tag) +
                                       "): no message was sent (a send to self must come before its receive's wait)");
    const std::vector<std::byte> message = std::move(queue.front());
    queue.pop_front();
    if (message.size() != op.buffer.size())
      throw Error(Errc::kProtocol, who() + ": wait(irecv) from itself (tag " + std::to_string(op.tag) +
                                       "): message of " + std::to_string(message.size()) + " bytes, buffer of " +
                                       std::to_string(op.buffer.size()) + " bytes");
    if (!message.empty()) std::memcpy(op.buffer.data(), message.data(), message.size());
  }

  void check_peer_tag(std::string_view where, int peer, int tag) const {
    seqpar::detail::require(peer >= 0 && peer < size_, where, "peer", peer,
                            "must be in [0, size()) = [0, " + std::to_string(size_) + ")");
    seqpar::detail::require(tag >= 0 && tag <= kMaxTag, where, "tag", tag,
                            "must be in [0, " + std::to_string(kMaxTag) + "]");
  }

  void require_counts(std::string_view where, std::string_view name, std::span<const std::size_t> counts,
                      std::string_view buffer, std::size_t buffer_size) const {
    seqpar::detail::require_counts(where, name, counts, buffer, buffer_size, size_);
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
  int rank_ = 0;
  int size_ = 0;
  std::vector<int> group_rank_;  // this transport's rank i is rank group_rank_[i] of group_
  std::string name_;             // the process group's name (names the groups split from it)
  int tag_base_ = 0;             // this transport's range of c10d tags on its group
  TrafficCounters counters_;
  std::shared_ptr<detail::Matcher> matcher_;  // started by the first receive from another rank
  std::map<int, std::deque<std::vector<std::byte>>> self_queue_;
  std::vector<std::byte> replicated_;
};

static_assert(seqpar::Transport<Transport>);

}  // namespace seqpar::backend::c10d
