// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <memory>
#include <span>
#include <utility>

#include "seqpar/core/transport.hpp"

namespace seqpar {

/// A type-erased Transport: lets `DistributedAttention<Strategy, Kernel>` run over the in-process
/// world, MPI or NCCL without the transport in its type. One virtual call per message or collective,
/// negligible next to the data it moves. Wraps a reference (the caller keeps the transport alive) or
/// owns a transport made by `split`.
class AnyTransport {
  struct RequestBase {
    virtual ~RequestBase() = default;
  };
  struct Interface {
    virtual ~Interface() = default;
    [[nodiscard]] virtual int rank() const = 0;
    [[nodiscard]] virtual int size() const = 0;
    virtual void send(std::span<const std::byte>, int, int) = 0;
    virtual void recv(std::span<std::byte>, int, int) = 0;
    virtual std::unique_ptr<RequestBase> isend(std::span<const std::byte>, int, int) = 0;
    virtual std::unique_ptr<RequestBase> irecv(std::span<std::byte>, int, int) = 0;
    virtual void wait(RequestBase&) = 0;
    virtual void all_to_all(std::span<const std::byte>, std::span<std::byte>) = 0;
    virtual void all_to_all_v(std::span<const std::byte>, std::span<const std::size_t>, std::span<std::byte>,
                              std::span<const std::size_t>) = 0;
    virtual void all_gather(std::span<const std::byte>, std::span<std::byte>) = 0;
    virtual void all_gather_v(std::span<const std::byte>, std::span<std::byte>, std::span<const std::size_t>) = 0;
    virtual void barrier() = 0;
    virtual std::unique_ptr<Interface> split(int, int) = 0;
    [[nodiscard]] virtual TrafficCounters counters() const = 0;
  };

  template <Transport Tr, class Holder>
  struct Model final : Interface {
    struct Request final : RequestBase {
      explicit Request(typename Tr::Request r) : req(std::move(r)) {}
      typename Tr::Request req;
    };
    explicit Model(Holder h) : held(std::move(h)) {}
    Holder held;  // Tr* (reference) or Tr (owned)
    Tr& t() {
      if constexpr (std::is_pointer_v<Holder>) return *held; else return held;
    }
    const Tr& t() const {
      if constexpr (std::is_pointer_v<Holder>) return *held; else return held;
    }
    int rank() const override { return t().rank(); }
    int size() const override { return t().size(); }
    void send(std::span<const std::byte> s, int p, int tag) override { t().send(s, p, tag); }
    void recv(std::span<std::byte> r, int p, int tag) override { t().recv(r, p, tag); }
    std::unique_ptr<RequestBase> isend(std::span<const std::byte> s, int p, int tag) override {
      return std::make_unique<Request>(t().isend(s, p, tag));
    }
    std::unique_ptr<RequestBase> irecv(std::span<std::byte> r, int p, int tag) override {
      return std::make_unique<Request>(t().irecv(r, p, tag));
    }
    void wait(RequestBase& r) override { t().wait(static_cast<Request&>(r).req); }
    void all_to_all(std::span<const std::byte> s, std::span<std::byte> r) override { t().all_to_all(s, r); }
    void all_to_all_v(std::span<const std::byte> s, std::span<const std::size_t> sc, std::span<std::byte> r,
                      std::span<const std::size_t> rc) override {
      t().all_to_all_v(s, sc, r, rc);
    }
    void all_gather(std::span<const std::byte> s, std::span<std::byte> r) override { t().all_gather(s, r); }
    void all_gather_v(std::span<const std::byte> s, std::span<std::byte> r,
                      std::span<const std::size_t> c) override {
      t().all_gather_v(s, r, c);
    }
    void barrier() override { t().barrier(); }
    std::unique_ptr<Interface> split(int color, int key) override {
      return std::make_unique<Model<Tr, Tr>>(t().split(color, key));
    }
    TrafficCounters counters() const override { return t().counters(); }
  };

  explicit AnyTransport(std::unique_ptr<Interface> impl) : impl_(std::move(impl)) {}

 public:
  class Request {
   public:
    Request() = default;
   private:
    friend class AnyTransport;
    explicit Request(std::unique_ptr<RequestBase> r) : impl_(std::move(r)) {}
    std::unique_ptr<RequestBase> impl_;
  };

  /// Refers to `transport`, which must outlive this object.
  template <Transport Tr>
    requires(!std::same_as<std::remove_cvref_t<Tr>, AnyTransport>)
  explicit AnyTransport(Tr& transport) : impl_(std::make_unique<Model<Tr, Tr*>>(&transport)) {}

  [[nodiscard]] int rank() const { return impl_->rank(); }
  [[nodiscard]] int size() const { return impl_->size(); }
  void send(std::span<const std::byte> s, int peer, int tag = 0) { impl_->send(s, peer, tag); }
  void recv(std::span<std::byte> r, int peer, int tag = 0) { impl_->recv(r, peer, tag); }
  [[nodiscard]] Request isend(std::span<const std::byte> s, int peer, int tag = 0) {
    return Request(impl_->isend(s, peer, tag));
  }
  [[nodiscard]] Request irecv(std::span<std::byte> r, int peer, int tag = 0) {
    return Request(impl_->irecv(r, peer, tag));
  }
  void wait(Request& r) {
    if (r.impl_) impl_->wait(*r.impl_);
    r.impl_.reset();
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
  [[nodiscard]] AnyTransport split(int color, int key) { return AnyTransport(impl_->split(color, key)); }
  [[nodiscard]] TrafficCounters counters() const { return impl_->counters(); }

 private:
  std::unique_ptr<Interface> impl_;
};

static_assert(Transport<AnyTransport>);

}  // namespace seqpar
