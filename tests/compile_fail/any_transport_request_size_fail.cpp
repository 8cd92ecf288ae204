// SPDX-License-Identifier: Apache-2.0
// A user transport whose Request is too big for AnyTransport's inline request storage.
// expect: AnyTransport: this transport's Request does not fit AnyTransport's inline request storage;
//         raise AnyTransport::kRequestBytes
#include <seqpar/runtime/any_transport.hpp>

#include <cstddef>
#include <span>

struct BigRequestTransport {
  struct Request {
    std::byte state[512];
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
  BigRequestTransport split(int, int);
  const seqpar::TrafficCounters& counters() const;
};
static_assert(seqpar::Transport<BigRequestTransport>);  // a transport: only its Request is the problem

int main() {
  BigRequestTransport t;
  seqpar::runtime::AnyTransport any(t);
  return any.size();
}
