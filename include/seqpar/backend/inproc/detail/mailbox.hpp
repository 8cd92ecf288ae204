// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "seqpar/backend/inproc/detail/world_state.hpp"
#include "seqpar/backend/inproc/memory.hpp"

namespace seqpar::backend::inproc::detail {

/// A mailbox buffer in the world's memory (host memory unless the world says otherwise): the
/// `size()` bytes of one message in a buffer of `capacity()` bytes. Move-only.
class Payload {
 public:
  explicit Payload(const Memory& memory) noexcept : memory_(&memory) {}
  Payload(Payload&& other) noexcept
      : memory_(other.memory_),
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        capacity_(std::exchange(other.capacity_, 0)) {}
  Payload& operator=(Payload&& other) noexcept {
    if (this != &other) {
      free();
      memory_ = other.memory_;
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      capacity_ = std::exchange(other.capacity_, 0);
    }
    return *this;
  }
  Payload(const Payload&) = delete;
  Payload& operator=(const Payload&) = delete;
  ~Payload() { free(); }

  [[nodiscard]] const std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  /// Room for `bytes` bytes; the content is not kept when the buffer grows.
  void reserve(std::size_t bytes) {
    if (bytes <= capacity_) return;
    void* fresh = memory_->allocate(bytes);  // on failure this buffer stays as it was
    free();
    data_ = static_cast<std::byte*>(fresh);
    capacity_ = bytes;
  }

  /// Holds a copy of `bytes` bytes at `from` once it returns.
  void assign(const std::byte* from, std::size_t bytes) {
    reserve(bytes);
    size_ = 0;
    if (bytes != 0) {
      memory_->copy(data_, from, bytes);
      memory_->finish();
    }
    size_ = bytes;
  }

 private:
  void free() noexcept {
    if (data_ != nullptr) memory_->release(data_);
    data_ = nullptr;
    size_ = capacity_ = 0;
  }
  const Memory* memory_;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
};

/// The messages addressed to one rank of one communicator, one FIFO channel per (source, tag).
///
/// Receives are matched in the order they are posted, not the order they are waited on: every
/// receive takes a ticket from its channel at post time and completes with the message of that
/// index. So `irecv(a); recv(b); wait(a)` gives `a` the first message, as MPI does.
/// Senders copy the payload in (eager); only the owning rank posts and takes. Payloads live in the
/// world's memory and are copied with its copy function (inproc::Memory).
///
/// Steady state allocates nothing: channels are kept once created, and a taken message's map node
/// (with its payload buffer) goes to a free list that the next delivery reuses; payload buffers are
/// sized to the largest message seen, so a recycled node never has to grow again. How many messages
/// are in flight at once depends on thread timing; `reserve` sizes the pool for the most a program
/// can have (everything one run receives), otherwise it doubles when it runs dry.
class Inbox {
 public:
  /// `memory` (the world's) outlives the inbox.
  explicit Inbox(const Memory& memory) noexcept : memory_(memory) {}

  /// Appends a copy of `payload` to channel (src, tag) and wakes the owner.
  void deliver(int src, int tag, std::span<const std::byte> payload) {
    {
      std::lock_guard lock(mutex_);
      Channel& ch = channels_[{src, tag}];
      if (payload.size() > largest_) {
        // Every buffer is kept at the largest message's size, so a recycled node never grows later.
        largest_ = payload.size();
        for (auto& spare : free_) spare.mapped().reserve(largest_);
      }
      if (free_.empty()) {
        // More messages in flight than ever before: double the nodes, so that the steady state (the
        // most a program keeps in flight, which depends on thread timing) is reached within the first
        // calls and then has headroom, instead of growing one node at a time.
        const std::size_t grow = std::max<std::size_t>(nodes_, 4);
        free_.reserve(nodes_ + grow);
        nodes_ += grow;
        for (std::size_t i = 0; i < grow; ++i) {
          Messages fresh;  // a node of its own, to be moved into the channel
          auto spare = fresh.extract(fresh.emplace(0, Payload(memory_)).first);
          spare.mapped().reserve(largest_);
          free_.push_back(std::move(spare));
        }
      }
      Messages::node_type node = std::move(free_.back());
      free_.pop_back();
      try {
        node.mapped().assign(payload.data(), payload.size());
      } catch (...) {
        free_.push_back(std::move(node));  // a failed copy (a device error) keeps the node for later
        throw;
      }
      node.key() = ch.delivered;
      ++ch.delivered;
      ch.messages.insert(std::move(node));
    }
    cv_.notify_all();
  }

  /// Makes room for `messages` messages of up to `bytes` bytes in flight at once, so that delivering
  /// them allocates nothing (the executor reserves what one run of its program receives).
  void reserve(std::size_t messages, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    if (bytes > largest_) {
      largest_ = bytes;
      for (auto& spare : free_) spare.mapped().reserve(largest_);
    }
    if (messages <= nodes_) return;
    free_.reserve(free_.size() + (messages - nodes_));
    for (; nodes_ < messages; ++nodes_) {
      Messages fresh;
      auto spare = fresh.extract(fresh.emplace(0, Payload(memory_)).first);
      spare.mapped().reserve(largest_);
      free_.push_back(std::move(spare));
    }
  }

  /// Reserves the next message of channel (src, tag) for a receive posted now.
  [[nodiscard]] std::uint64_t post(int src, int tag) {
    std::lock_guard lock(mutex_);
    return channels_[{src, tag}].posted++;
  }

  /// Blocks until message `ticket` of channel (src, tag) has arrived, copies it into `out` when the
  /// sizes match, and returns the message's size (the caller reports a mismatch).
  template <class TimeoutError>
  [[nodiscard]] std::size_t take(int src, int tag, std::uint64_t ticket, std::span<std::byte> out,
                                 const WorldState& world, Clock::time_point deadline, TimeoutError&& timeout_error) {
    std::unique_lock lock(mutex_);
    const auto key = std::pair{src, tag};
    auto ch = channels_.find(key);
    if (ch == channels_.end()) ch = channels_.emplace(key, Channel{}).first;
    // Map nodes are stable and channels are never erased, so `ch` stays valid while waiting.
    wait_until_ready(
        lock, cv_, world, deadline, [&] { return ch->second.messages.contains(ticket); }, [] {}, timeout_error);
    auto node = ch->second.messages.extract(ticket);
    lock.unlock();
    const std::size_t size = node.mapped().size();
    if (size == out.size() && size != 0) {
      try {
        memory_.copy(out.data(), node.mapped().data(), size);
        memory_.finish();
      } catch (...) {
        lock.lock();
        free_.push_back(std::move(node));
        throw;
      }
    }
    lock.lock();
    if (node.mapped().capacity() < largest_) node.mapped().reserve(largest_);  // grown since it was made
    free_.push_back(std::move(node));
    return size;
  }

  void wake_all() noexcept {
    { std::lock_guard lock(mutex_); }
    cv_.notify_all();
  }

 private:
  using Messages = std::map<std::uint64_t, Payload>;
  struct Channel {
    std::uint64_t posted = 0;     // receives posted so far (next ticket)
    std::uint64_t delivered = 0;  // messages delivered so far (next message index)
    Messages messages;
  };
  const Memory& memory_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::pair<int, int>, Channel> channels_;
  std::size_t nodes_ = 0;                  // nodes made (in channels or free)
  std::vector<Messages::node_type> free_;  // taken messages' nodes, reused by deliver
  std::size_t largest_ = 0;
};

}  // namespace seqpar::backend::inproc::detail
