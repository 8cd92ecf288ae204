// SPDX-License-Identifier: Apache-2.0
// Positive control of the compile_fail tests: the same constructs, used correctly, compile with the
// same command line. (If this fails, the *_fail tests prove nothing.)
#include <seqpar/attention/cpu_flash.hpp>
#include <seqpar/attention/reference.hpp>
#include <seqpar/comm/hierarchical.hpp>
#include <seqpar/comm/ring.hpp>
#include <seqpar/partition/batch_aware.hpp>
#include <seqpar/partition/uniform.hpp>
#include <seqpar/partition/zigzag.hpp>
#include <seqpar/plan/selected_attention.hpp>
#include <seqpar/runtime/any_transport.hpp>
#include <seqpar/seqpar.hpp>  // DistributedAttention, as users include it
#include <seqpar/strategy.hpp>

#include <cstddef>
#include <span>

// A transport with a small, nothrow-movable Request (what AnyTransport requires).
struct SmallRequestTransport {
  struct Request {
    std::byte state[16];
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
  SmallRequestTransport split(int, int);
  const seqpar::TrafficCounters& counters() const;
};

int wrap(SmallRequestTransport& t) {
  seqpar::runtime::AnyTransport any(t);
  return any.size();
}

// A host transport under a host kernel (stream_ordered_transport_host_kernel_fail.cpp, made right).
int host_engine(SmallRequestTransport& t) {
  using S = seqpar::Strategy<seqpar::partition::Zigzag, seqpar::comm::Ring>;
  seqpar::DistributedAttention<S, seqpar::attention::CpuFlash<float>> attn(t, seqpar::AttentionShape{4, 2, 64});
  return attn.rank();
}

int main() {
  seqpar::partition::BatchAware<seqpar::partition::Uniform> basp;
  seqpar::comm::Hierarchical<seqpar::comm::AllToAll, seqpar::comm::Ring> usp;
  seqpar::attention::CpuFlash<float> kernel;
  using S = seqpar::Strategy<seqpar::partition::Zigzag, seqpar::comm::Ring, seqpar::runtime::StaticOrder>;
  S::Arguments args;
  using One = seqpar::plan::SelectedAttention<seqpar::attention::Reference<double>, S>;
  (void)basp, (void)usp, (void)kernel, (void)args;
  return static_cast<int>(sizeof(One)) > 0 ? 0 : 1;
}
