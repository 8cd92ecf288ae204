// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

#include "seqpar/core/transport.hpp"

namespace seqpar::runtime {

/// A type-erased Transport: lets `DistributedAttention<Strategy, Kernel>` run over the in-process
/// world, MPI or NCCL without the transport in its type. One virtual call per message or collective,
/// negligible next to the data it moves. Wraps a reference (the caller keeps the transport alive) or
/// owns a transport made by `split`. Requests live inside `AnyTransport::Request` (no allocation per
/// message: a ring step posts and waits without touching the heap).
class AnyTransport {
  /// Inline storage of a request: the in-process and MPI requests fit; a bigger one is a compile error.
  static constexpr std::size_t kRequestBytes = 96;

  struct RequestBase {
    virtual ~RequestBase() = default;
    /// Move-constructs this request into `storage` (kRequestBytes, max-aligned) and returns it there.
    virtual RequestBase* move_into(void* storage) noexcept = 0;
  };
  struct Interface {
    virtual ~Interface() = default;
    [[nodiscard]] virtual int rank() const = 0;
    [[nodiscard]] virtual int size() const = 0;
    virtual void send(std::span<const std::byte>, int, int) = 0;
    virtual void recv(std::span<std::byte>, int, int) = 0;
    virtual RequestBase* isend(void* storage, std::span<const std::byte>, int, int) = 0;
    virtual RequestBase* irecv(void* storage, std::span<std::byte>, int, int) = 0;
    virtual void wait(RequestBase&) = 0;
    virtual void all_to_all(std::span<const std::byte>, std::span<std::byte>) = 0;
    virtual void all_to_all_v(std::span<const std::byte>, std::span<const std::size_t>, std::span<std::byte>,
                              std::span<const std::size_t>) = 0;
    virtual void all_gather(std::span<const std::byte>, std::span<std::byte>) = 0;
    virtual void all_gather_v(std::span<const std::byte>, std::span<std::byte>, std::span<const std::size_t>) = 0;
    virtual void barrier() = 0;
    virtual void reserve_receives(std::size_t, std::size_t) = 0;
    virtual std::unique_ptr<Interface> split(int, int) = 0;
    [[nodiscard]] virtual const TrafficCounters& counters() const = 0;
    [[nodiscard]] virtual bool stream_ordered() const = 0;
    virtual void set_queue(void*) = 0;
  };

  template <Transport Tr, class Holder>
  struct Model final : Interface {
    struct Request final : RequestBase {
      explicit Request(typename Tr::Request r) : req(std::move(r)) {}
      RequestBase* move_into(void* storage) noexcept override { return ::new (storage) Request(std::move(req)); }
      typename Tr::Request req;
    };
    static_assert(sizeof(Request) <= kRequestBytes && alignof(Request) <= alignof(std::max_align_t),
                  "AnyTransport: this transport's Request does not fit AnyTransport's inline request storage; "
                  "raise AnyTransport::kRequestBytes");
    static_assert(std::is_nothrow_move_constructible_v<typename Tr::Request>,
                  "AnyTransport: a transport's Request must be nothrow move constructible");
    explicit Model(Holder h) : held(std::move(h)) {}
    Holder held;  // Tr* (reference) or Tr (owned)
    Tr& t() {
      if constexpr (std::is_pointer_v<Holder>)
        return *held;
      else
        return held;
    }
    const Tr& t() const {
      if constexpr (std::is_pointer_v<Holder>)
        return *held;
      else
        return held;
    }
    int rank() const override { return t().rank(); }
    int size() const override { return t().size(); }
    void send(std::span<const std::byte> s, int p, int tag) override { t().send(s, p, tag); }
    void recv(std::span<std::byte> r, int p, int tag) override { t().recv(r, p, tag); }
    RequestBase* isend(void* storage, std::span<const std::byte> s, int p, int tag) override {
      return ::new (storage) Request(t().isend(s, p, tag));
    }
    RequestBase* irecv(void* storage, std::span<std::byte> r, int p, int tag) override {
      return ::new (storage) Request(t().irecv(r, p, tag));
    }
    void wait(RequestBase& r) override { t().wait(static_cast<Request&>(r).req); }
    void all_to_all(std::span<const std::byte> s, std::span<std::byte> r) override { t().all_to_all(s, r); }
    void all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> sc, std::span<std::byte> r,
                      std::span<const std::size_t> rc) override {
      t().all_to_all_v(s, sc, r, rc);
    }
    void all_gather(std::span<const std::byte> s, std::span<std::byte> r) override { t().all_gather(s, r); }
    void all_gather_v(std::span<const std::byte> s, std::span<std::byte> r, std::span<const std::size_t> c) override {
      t().all_gather_v(s, r, c);
    }
    void barrier() override { t().barrier(); }
    void reserve_receives(std::size_t messages, std::size_t bytes) override {
      if constexpr (requires { t().reserve_receives(messages, bytes); }) t().reserve_receives(messages, bytes);
    }
    std::unique_ptr<Interface> split(int color, int key) override {
      return std::make_unique<Model<Tr, Tr>>(t().split(color, key));
    }
    const TrafficCounters& counters() const override { return t().counters(); }
    bool stream_ordered() const override { return StreamOrderedTransport<Tr>; }
    void set_queue(void* queue) override {
      if constexpr (StreamOrderedTransport<Tr>) t().set_queue(queue);
    }
  };

  explicit AnyTransport(std::unique_ptr<Interface> impl) : impl_(std::move(impl)) {}

 public:
  /// A pending operation of the wrapped transport, stored inline. Move-only; destroying a pending
  /// request has the wrapped transport's semantics.
  class Request {
   public:
    Request() noexcept = default;
    Request(Request&& other) noexcept { take(other); }
    Request& operator=(Request&& other) noexcept {
      if (this != &other) {
        reset();
        take(other);
      }
      return *this;
    }
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    ~Request() { reset(); }

   private:
    friend class AnyTransport;
    void take(Request& other) noexcept {
      if (other.impl_ == nullptr) return;
      impl_ = other.impl_->move_into(storage_);
      other.reset();
    }
    void reset() noexcept {
      if (impl_ != nullptr) impl_->~RequestBase();
      impl_ = nullptr;
    }
    alignas(std::max_align_t) std::byte storage_[kRequestBytes];
    RequestBase* impl_ = nullptr;
  };

  /// Refers to `transport`, which must outlive this object. (The exclusion is checked before the
  /// concept: nvcc's front end would otherwise check Transport<AnyTransport> inside itself.)
  template <class Tr>
  requires(!std::same_as<std::remove_cvref_t<Tr>, AnyTransport> && Transport<Tr>) explicit AnyTransport(Tr& transport)
      : impl_(std::make_unique<Model<Tr, Tr*>>(&transport)) {}

  [[nodiscard]] int rank() const { return impl_->rank(); }
  [[nodiscard]] int size() const { return impl_->size(); }
  void send(std::span<const std::byte> s, int peer, int tag = 0) { impl_->send(s, peer, tag); }
  void recv(std::span<std::byte> r, int peer, int tag = 0) { impl_->recv(r, peer, tag); }
  [[nodiscard]] Request isend(std::span<const std::byte> s, int peer, int tag = 0) {
    Request r;
    r.impl_ = impl_->isend(r.storage_, s, peer, tag);
    return r;
  }
  [[nodiscard]] Request irecv(std::span<std::byte> r, int peer, int tag = 0) {
    Request req;
    req.impl_ = impl_->irecv(req.storage_, r, peer, tag);
    return req;
  }
  void wait(Request& r) {
    if (r.impl_ == nullptr) return;
    impl_->wait(*r.impl_);
    r.reset();
  }
  void all_to_all(std::span<const std::byte> s, std::span<std::byte> r) { impl_->all_to_all(s, r); }
  void all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> sc, std::span<std::byte> r,
                    std::span<const std::size_t> rc) {
    impl_->all_to_all_v(s, sc, r, rc);
  }
  void all_gather(std::span<const std::byte> s, std::span<std::byte> r) { impl_->all_gather(s, r); }
  void all_gather_v(std::span<const std::byte> s, std::span<std::byte> r, std::span<const std::size_t> c) {
    impl_->all_gather_v(s, r, c);
  }
  void barrier() { impl_->barrier(); }
  /// Pre-sizes the wrapped transport's receive buffers for `messages` messages of up to `bytes` bytes
  /// in flight (transports that buffer eagerly, like the in-process one); a no-op for the others.
  void reserve_receives(std::size_t messages, std::size_t bytes) { impl_->reserve_receives(messages, bytes); }
  [[nodiscard]] AnyTransport split(int color, int key) { return AnyTransport(impl_->split(color, key)); }
  [[nodiscard]] const TrafficCounters& counters() const { return impl_->counters(); }
  /// Whether the wrapped transport is a StreamOrderedTransport (decided at run time: the executor
  /// orders its context's streams around it instead of synchronizing).
  [[nodiscard]] bool stream_ordered() const { return impl_->stream_ordered(); }
  /// Forwards to a stream-ordered transport's set_queue; a no-op for the others.
  void set_queue(void* queue) { impl_->set_queue(queue); }

 private:
  std::unique_ptr<Interface> impl_;
};

static_assert(Transport<AnyTransport>);

}  // namespace seqpar::runtime
