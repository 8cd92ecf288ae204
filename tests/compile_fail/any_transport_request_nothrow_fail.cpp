// SPDX-License-Identifier: Apache-2.0
// A user transport whose Request may throw when moved.
// expect: AnyTransport: a transport's Request must be nothrow move constructible
#include <seqpar/runtime/any_transport.hpp>

#include <cstddef>
#include <span>

struct ThrowingMoveTransport {
  struct Request {
    Request();
    Request(Request&&) noexcept(false);
    Request& operator=(Request&&);
    ~Request();
  };
  int rank() const;
  int size() const;
  void send(std::span<const std::byte>, int, int);
  void recv(std::span<std::byte>, int, int);
  Request isend(std::span<const std::byte>, int, int);
  Request irecv(std::span<std::byte>, int, int);
  void wait(Request&);
  void all_to_all(std::span<const std::byte>, std::span<std::byte>);
  void all_to_all_v(std::span<const std::byte>, std::span<const std::size_t>, std::span<std::byte>,
                    std::span<const std::size_t>);
  void all_gather(std::span<const std::byte>, std::span<std::byte>);
  void all_gather_v(std::span<const std::byte>, std::span<std::byte>, std::span<const std::size_t>);
  void barrier();
  ThrowingMoveTransport split(int, int);
  const seqpar::TrafficCounters& counters() const;
};
static_assert(seqpar::Transport<ThrowingMoveTransport>);  // a transport: only its Request is the problem

int main() {
  ThrowingMoveTransport t;
  seqpar::runtime::AnyTransport any(t);
  return any.size();
}
