// SPDX-License-Identifier: Apache-2.0
// A stream-ordered transport (NCCL-like: it enqueues on the context's queue) under a host kernel.
// expect: DistributedAttention: a stream-ordered transport (NCCL) enqueues its transfers on the kernel's
//         streams, so it needs a kernel whose exec_type is a StreamOrderedExec (attention::CudaFlash on
//         gpu::CudaExec); with a host kernel use a host transport (in-process or MPI)
#include <seqpar/seqpar.hpp>  // DistributedAttention, as users include it

#include <cstddef>
#include <span>

struct QueueTransport {
  static constexpr bool kStreamOrdered = true;
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
  QueueTransport split(int, int);
  const seqpar::TrafficCounters& counters() const;
  void set_queue(void*);
};
static_assert(seqpar::StreamOrderedTransport<QueueTransport>);  // a stream-ordered transport: the kernel is the problem

int make(QueueTransport& t) {
  using S = seqpar::Strategy<seqpar::partition::Zigzag, seqpar::comm::Ring>;
  seqpar::DistributedAttention<S, seqpar::attention::CpuFlash<float>> attn(t, seqpar::AttentionShape{4, 2, 64});
  return attn.rank();
}

int main() {
  return 0;
}
